//! Idempotency on the accept path: the key's rules, the hash that tells
//! the same request from another, the hold that makes a repeat wait its
//! turn (409), and the answer remembered for 24 hours.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::Refused;
use crate::model::{Scope, now_ms};
use crate::store::Db;
use crate::store::idempotency::{KeyClaim, StoredResponse};

/// Longest accepted idempotency key.
pub const MAX_KEY_LEN: usize = 255;

/// True for a well-formed key: 1-255 visible ASCII characters.
pub fn is_valid_key(key: &str) -> bool {
    !key.is_empty() && key.len() <= MAX_KEY_LEN && key.bytes().all(|b| b.is_ascii_graphic())
}

/// The `Idempotency-Key` header's value (trimmed), if it was sent; `raw`
/// is its text, empty when it was not text.
pub fn header_key(raw: Option<&str>) -> Result<Option<String>, Refused> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    let key = raw.trim();
    if !is_valid_key(key) {
        return Err(Refused::BadKey(format!(
            "Idempotency-Key header must be 1-{MAX_KEY_LEN} visible ASCII characters."
        )));
    }
    Ok(Some(key.to_owned()))
}

/// SHA-256 of the request with object keys sorted, so the same request
/// with other whitespace or key order counts as the same.
pub fn request_hash(value: &Value) -> String {
    let mut hasher = Sha256::new();
    feed_hash(&mut hasher, value);
    hex::encode(hasher.finalize())
}

/// Feeds `value` to `hasher` as [`request_hash`] reads it.
pub(crate) fn feed_hash(hasher: &mut Sha256, value: &Value) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            hasher.update(b"{");
            for key in keys {
                hasher.update(serde_json::to_string(key).unwrap_or_default().as_bytes());
                hasher.update(b":");
                feed_hash(hasher, &map[key]);
                hasher.update(b",");
            }
            hasher.update(b"}");
        }
        Value::Array(items) => {
            hasher.update(b"[");
            for item in items {
                feed_hash(hasher, item);
                hasher.update(b",");
            }
            hasher.update(b"]");
        }
        scalar => hasher.update(scalar.to_string().as_bytes()),
    }
}

/// `(scope, key)` pairs whose first request is still being answered: a
/// key is its tenant's in one world, so a test key's and a live key's
/// requests under the same key are apart.
pub(crate) type InFlightKeys = Arc<Mutex<HashSet<(Scope, String)>>>;

/// How long a repeat of a request still being answered is told to wait
/// (409 with `Retry-After`): an accept commits within milliseconds, or
/// within the accept deadline when the store is slow.
pub(crate) const IN_FLIGHT_RETRY: Duration = Duration::from_secs(2);

fn in_flight() -> Refused {
    Refused::KeyInFlight {
        detail: "A request with this Idempotency-Key is still being processed; retry after Retry-After, when it has been answered.".into(),
        retry_after: IN_FLIGHT_RETRY,
    }
}

/// Marks an idempotency key as being answered in this process; unmarks it
/// when dropped.
pub(crate) struct InFlightKey {
    keys: InFlightKeys,
    slot: (Scope, String),
}

impl InFlightKey {
    /// Holds `key` of `scope`, or 409 while another request holds it.
    pub(crate) fn claim(keys: &InFlightKeys, scope: &Scope, key: &str) -> Result<Self, Refused> {
        let slot = (scope.clone(), key.to_owned());
        let fresh = keys.lock().expect("idempotency lock").insert(slot.clone());
        if !fresh {
            return Err(in_flight());
        }
        Ok(InFlightKey {
            keys: keys.clone(),
            slot,
        })
    }
}

impl Drop for InFlightKey {
    fn drop(&mut self) {
        self.keys
            .lock()
            .expect("idempotency lock")
            .remove(&self.slot);
    }
}

/// A key held for one request until it is answered: in this process (a
/// repeat here is 409 at once) and, on a shared store, by a durable claim
/// that every instance sees ([`IdempotencyStore::claim_key`]). Dropped
/// unanswered, it gives the claim up, so a retry may go ahead.
pub(crate) struct HeldKey {
    _local: InFlightKey,
    durable: Option<DurableClaim>,
}

/// A durable claim, given up when dropped unless it was answered.
struct DurableClaim {
    db: Db,
    scope: Scope,
    key: String,
    token: String,
    answered: bool,
}

impl HeldKey {
    /// The token the accept's commit must find the claim under, if the
    /// claim is durable.
    pub(crate) fn token(&self) -> Option<String> {
        self.durable.as_ref().map(|claim| claim.token.clone())
    }

    /// The accept committed (the answer replaced the claim), or its outcome
    /// is not known yet and the claim must stay until it is (a commit still
    /// under way answers it; a claim never answered goes stale).
    pub(crate) fn keep(mut self) {
        if let Some(claim) = self.durable.as_mut() {
            claim.answered = true;
        }
    }
}

impl Drop for DurableClaim {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let (db, scope, key, token) = (
            self.db.clone(),
            self.scope.clone(),
            std::mem::take(&mut self.key),
            std::mem::take(&mut self.token),
        );
        // Outside a runtime (never in the service) the claim goes stale.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(err) = db.release_key(&scope, &key, &token).await {
                    tracing::warn!(error = %err, "Could not give up an Idempotency-Key's claim; it goes stale in 30 s.");
                }
            });
        }
    }
}

/// What holding a key came to.
pub(crate) enum Hold {
    /// This request answers the key.
    Fresh(HeldKey),
    /// The key was answered within 24 hours, for the same request.
    Replay(StoredResponse),
}

/// Holds `key` of `scope` for a request whose hash is `hash`: 409 (with
/// `Retry-After`) while another request holds it here or on any instance,
/// 422 when it was answered for another request, the answer when it was
/// answered for this one.
pub(crate) async fn hold(
    keys: &InFlightKeys,
    db: &Db,
    scope: &Scope,
    key: &str,
    hash: &str,
) -> Result<Hold, Refused> {
    let local = InFlightKey::claim(keys, scope, key)?;
    let token = uuid::Uuid::new_v4().to_string();
    match db.claim_key(scope, key, hash, &token, now_ms()).await? {
        KeyClaim::Answered(stored) if stored.request_hash != hash => Err(Refused::KeyReused(
            "This Idempotency-Key was used within the last 24 hours with a different request body."
                .into(),
        )),
        KeyClaim::Answered(stored) => Ok(Hold::Replay(stored)),
        KeyClaim::Pending { .. } => Err(in_flight()),
        KeyClaim::Claimed { durable } => Ok(Hold::Fresh(HeldKey {
            _local: local,
            durable: durable.then(|| DurableClaim {
                db: db.clone(),
                scope: scope.clone(),
                key: key.to_owned(),
                token,
                answered: false,
            }),
        })),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn request_hash_ignores_key_order_but_not_values() {
        let a = json!({"channel": "sms", "to": "+15551234567", "text": "hi", "metadata": {"a": 1, "b": 2}});
        let b = json!({"metadata": {"b": 2, "a": 1}, "text": "hi", "to": "+15551234567", "channel": "sms"});
        let c = json!({"channel": "sms", "to": "+15551234567", "text": "hi!", "metadata": {"a": 1, "b": 2}});
        assert_eq!(request_hash(&a), request_hash(&b));
        assert_ne!(request_hash(&a), request_hash(&c));
    }
}
