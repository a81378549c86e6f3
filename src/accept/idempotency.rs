//! Idempotency on the accept path: the key's rules, the hash that tells
//! the same request from another, the hold that makes a repeat wait its
//! turn (409), and the answer remembered for 24 hours.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::Refused;
use crate::model::{Scope, now_ms};
use crate::store::Db;
use crate::store::idempotency::StoredResponse;

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

/// Marks an idempotency key as being answered; unmarks it when dropped.
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
            return Err(Refused::KeyInFlight(
                "A request with this Idempotency-Key is still being processed; retry when it has been answered.".into(),
            ));
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

/// The answer remembered for `key` if its request had the same `hash`;
/// 422 if it had another.
pub(crate) async fn remembered(
    db: &Db,
    scope: &Scope,
    key: &str,
    hash: &str,
) -> Result<Option<StoredResponse>, Refused> {
    match db.remembered_answer(scope, key, now_ms()).await? {
        Some(stored) if stored.request_hash != hash => Err(Refused::KeyReused(
            "This Idempotency-Key was used within the last 24 hours with a different request body."
                .into(),
        )),
        stored => Ok(stored),
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
