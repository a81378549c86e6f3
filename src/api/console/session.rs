//! Console sessions: a signed cookie naming a session the store keeps.
//!
//! Signing in with an admin token starts a session in the store (a random
//! id, the SHA-256 of the token, never the token, and its end) and sets
//! `fairlane_console` to `{id}.{signature}`, an HMAC-SHA256 of the id with
//! the console key, which every instance reads from the store. Each
//! request checks the signature (a forged cookie costs no store read),
//! then that the session is still in the store and has not ended, then
//! resolves the admin from the hash as the API does. So signing out ends
//! the session on every instance at once, a revoked admin's session ends
//! at its next request, and rotating the root token ends the old token's
//! sessions.
//!
//! The cookie is `HttpOnly`, `SameSite=Strict`, `Path=/console`, and
//! `Secure` when `server.public_url` is https. Every change is a form
//! `POST` carrying a CSRF token: an HMAC of the cookie's value, which a
//! page of another site can neither read nor compute.
//!
//! Sign-in is throttled ([`SignInThrottle`]): per client address and per
//! token prefix, so neither one client nor many guessing at one token can
//! try more than a few tokens a minute.

use axum::extract::FromRequestParts;
use axum::http::header::{COOKIE, SET_COOKIE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::api::AppState;
use crate::api::auth::{Actor, ActorSlot, Role};
use crate::api::error::ApiError;
use crate::model::now_ms;
use crate::store::Db;
use crate::tenants::random_hex;

/// Sign-in tries a client (or a token prefix) may make at once, and how
/// often one more is allowed after (10 a minute).
pub const SIGN_IN_BURST: u32 = 10;
pub const SIGN_IN_EVERY: std::time::Duration = std::time::Duration::from_secs(6);

/// Characters of a tried token that name its prefix for the throttle.
const PREFIX_CHARS: usize = 8;

/// The session cookie's name.
pub const COOKIE_NAME: &str = "fairlane_console";

/// How long a session lasts after sign-in.
pub const SESSION_MS: i64 = 8 * 3600 * 1000;

/// The settings key of the console's signing key.
const KEY_SETTING: &str = "console_session_key";

/// The key sessions and CSRF tokens are signed with, shared by every
/// instance through the store.
#[derive(Clone)]
pub struct SessionKey(std::sync::Arc<[u8]>);

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKey(…)")
    }
}

impl SessionKey {
    /// The store's key, made by the first instance that asks.
    pub async fn load(db: &Db) -> anyhow::Result<SessionKey> {
        let key = db
            .setting_or_insert(KEY_SETTING, &random_hex(32))
            .await
            .map_err(|err| anyhow::anyhow!("loading the console's session key: {err}"))?;
        Ok(SessionKey(key.into_bytes().into()))
    }

    fn sign(&self, what: &str) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(what.as_bytes());
        hex::encode(mac.finalize().into_bytes())
    }

    /// Whether `signature` is `what`'s, compared in constant time.
    fn verify(&self, what: &str, signature: &str) -> bool {
        let Ok(signature) = hex::decode(signature) else {
            return false;
        };
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(what.as_bytes());
        mac.verify_slice(&signature).is_ok()
    }

    /// A session cookie's value for session `id`.
    pub fn session(&self, id: &str) -> String {
        format!("{id}.{}", self.sign(id))
    }

    /// The session id of a genuine cookie value.
    fn open<'a>(&self, value: &'a str) -> Option<&'a str> {
        let (id, signature) = value.rsplit_once('.')?;
        (!id.is_empty() && self.verify(id, signature)).then_some(id)
    }

    /// The CSRF token of the session whose cookie value is `session`.
    pub fn csrf(&self, session: &str) -> String {
        self.sign(&format!("csrf.{session}"))
    }
}

/// The `Set-Cookie` value of a session (or, with `value` empty, of its
/// end).
pub fn set_cookie(value: &str, secure: bool) -> HeaderValue {
    let age = if value.is_empty() {
        0
    } else {
        SESSION_MS / 1000
    };
    let secure = if secure { "; Secure" } else { "" };
    let cookie = format!(
        "{COOKIE_NAME}={value}; Path=/console; HttpOnly; SameSite=Strict; Max-Age={age}{secure}"
    );
    HeaderValue::from_str(&cookie).expect("the cookie is plain ASCII")
}

/// Headers that set (or end) the session cookie.
pub fn cookie_headers(value: &str, state: &AppState) -> HeaderMap {
    let secure = state
        .settings
        .server
        .public_url
        .as_deref()
        .is_some_and(|url| url.starts_with("https://"));
    let mut headers = HeaderMap::new();
    headers.insert(SET_COOKIE, set_cookie(value, secure));
    headers
}

/// The session cookie's value in `headers`, if there is one.
fn cookie_value(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .find_map(|pair| pair.trim().strip_prefix(COOKIE_NAME)?.strip_prefix('='))
}

/// A request made in a live session: the admin and the session's CSRF
/// token. Without one, the page answers by sending the browser to the
/// sign-in page.
pub struct Session {
    pub actor: Actor,
    pub csrf: String,
    /// The store's id of the session.
    pub id: String,
}

impl Session {
    /// Whether this admin may change things (an operator or an owner).
    pub fn may_change(&self) -> bool {
        self.actor.role >= Role::Operator
    }
}

/// Why a request has no session.
pub enum NoSession {
    /// Not signed in, or the session ended: to the sign-in page.
    SignIn,
    /// The store could not be asked.
    Failed(ApiError),
}

impl axum::response::IntoResponse for NoSession {
    fn into_response(self) -> axum::response::Response {
        match self {
            NoSession::SignIn => axum::response::Redirect::to("/console/login").into_response(),
            NoSession::Failed(err) => err.into_response(),
        }
    }
}

impl FromRequestParts<AppState> for Session {
    type Rejection = NoSession;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let value = cookie_value(&parts.headers).ok_or(NoSession::SignIn)?;
        let id = state.console_key.open(value).ok_or(NoSession::SignIn)?;
        let stored = state
            .db
            .console_session(id, now_ms())
            .await
            .map_err(|err| NoSession::Failed(err.into()))?
            .ok_or(NoSession::SignIn)?;
        let mut hash = [0u8; 32];
        hex::decode_to_slice(stored.trim(), &mut hash).map_err(|_| NoSession::SignIn)?;
        let actor = state
            .admin
            .actor_by_hash(&state.db, &hash)
            .await
            .map_err(NoSession::Failed)?
            .ok_or(NoSession::SignIn)?;
        ActorSlot::fill(parts, &actor);
        Ok(Session {
            csrf: state.console_key.csrf(value),
            id: id.to_owned(),
            actor,
        })
    }
}

/// Starts a session for the admin token hashed to `hash`; the cookie's
/// value.
pub async fn start(state: &AppState, hash: &[u8; 32]) -> Result<String, ApiError> {
    let id = random_hex(16);
    let now = now_ms();
    state
        .db
        .start_console_session(&id, &hex::encode(hash), now, now + SESSION_MS)
        .await?;
    Ok(state.console_key.session(&id))
}

type Keyed = governor::RateLimiter<
    String,
    governor::state::keyed::DefaultKeyedStateStore<String>,
    governor::clock::DefaultClock,
>;

/// Sign-in tries, counted per client address and per token prefix in this
/// instance: [`SIGN_IN_BURST`] at once, then one per [`SIGN_IN_EVERY`].
pub struct SignInThrottle {
    clients: Keyed,
    prefixes: Keyed,
}

impl Default for SignInThrottle {
    fn default() -> Self {
        let quota = governor::Quota::with_period(SIGN_IN_EVERY)
            .expect("a positive period")
            .allow_burst(std::num::NonZeroU32::new(SIGN_IN_BURST).expect("a positive burst"));
        SignInThrottle {
            clients: governor::RateLimiter::keyed(quota),
            prefixes: governor::RateLimiter::keyed(quota),
        }
    }
}

impl SignInThrottle {
    /// Takes one try of `client` with `token`, or says how long until the
    /// next may be made. Both counts are taken; the longer wait answers.
    pub fn take(&self, client: &str, token: &str) -> Result<(), std::time::Duration> {
        use governor::clock::Clock;
        // Keys that are back to a full bucket are forgotten now and then,
        // so many addresses or prefixes do not grow the maps for ever.
        for limiter in [&self.clients, &self.prefixes] {
            if limiter.len() > 10_000 {
                limiter.retain_recent();
            }
        }
        let prefix: String = token.chars().take(PREFIX_CHARS).collect();
        let now = governor::clock::DefaultClock::default().now();
        let waits = [
            self.clients.check_key(&client.to_owned()),
            self.prefixes.check_key(&prefix),
        ]
        .into_iter()
        .filter_map(|checked| checked.err().map(|not| not.wait_time_from(now)))
        .max();
        waits.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> SessionKey {
        SessionKey(b"0123456789abcdef".to_vec().into())
    }

    #[test]
    fn a_session_cookie_opens_only_unaltered() {
        let value = key().session("0a1b");
        assert_eq!(key().open(&value), Some("0a1b"));
        let other_id = value.replacen("0a1b", "0a1c", 1);
        assert_eq!(key().open(&other_id), None, "another id");
        let other = SessionKey(b"another key".to_vec().into());
        assert_eq!(other.open(&value), None, "another key");
        assert_eq!(key().open("garbage"), None);
        assert_eq!(key().open(".sig"), None);
    }

    #[test]
    fn sign_in_is_throttled_per_client_and_per_token_prefix() {
        let throttle = SignInThrottle::default();
        for i in 0..SIGN_IN_BURST {
            assert!(throttle.take("10.0.0.1", &format!("guess{i:04}")).is_ok());
        }
        let wait = throttle.take("10.0.0.1", "another").unwrap_err();
        assert!(
            wait > std::time::Duration::ZERO && wait <= SIGN_IN_EVERY,
            "{wait:?}"
        );
        // Another client is not held up by the first, but one guessing at
        // the same prefix from many addresses is.
        assert!(throttle.take("10.0.0.2", "fla_0000aaaa").is_ok());
        for i in 0..SIGN_IN_BURST - 1 {
            let _ = throttle.take(&format!("10.1.0.{i}"), "fla_0000bbbb");
        }
        assert!(throttle.take("10.2.0.1", "fla_0000cccc").is_err());
    }

    #[test]
    fn the_cookie_is_found_among_others() {
        let mut headers = HeaderMap::new();
        headers.insert(
            COOKIE,
            HeaderValue::from_static("a=1; fairlane_console=abc.1.sig; b=2"),
        );
        assert_eq!(cookie_value(&headers), Some("abc.1.sig"));
    }
}
