//! Console sessions: a signed cookie, no session table.
//!
//! Signing in with an admin token sets `fairlane_console` to
//! `{token hash}.{expiry}.{signature}`: the SHA-256 of the token (never
//! the token), the session's end in Unix ms, and an HMAC-SHA256 of both
//! with the console key, which every instance reads from the store (so a
//! session made on one instance holds on the others). Each request checks
//! the signature and the expiry, then resolves the admin from the hash as
//! the API does: a revoked admin's session ends at its next request.
//!
//! The cookie is `HttpOnly`, `SameSite=Strict`, `Path=/console`, and
//! `Secure` when `server.public_url` is https. Every change is a form
//! `POST` carrying a CSRF token: an HMAC of the cookie's value, which a
//! page of another site can neither read nor compute.

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

    /// A session cookie's value for the token hash `hash`, ending `ends` (ms).
    pub fn session(&self, hash: &[u8; 32], ends: i64) -> String {
        let signed = format!("{}.{ends}", hex::encode(hash));
        let signature = self.sign(&signed);
        format!("{signed}.{signature}")
    }

    /// The token hash of a session cookie's value that is genuine and has
    /// not ended at `now`.
    fn open(&self, value: &str, now: i64) -> Option<[u8; 32]> {
        let (signed, signature) = value.rsplit_once('.')?;
        let (hash, ends) = signed.split_once('.')?;
        if !self.verify(signed, signature) || ends.parse::<i64>().ok()? <= now {
            return None;
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(hash, &mut out).ok()?;
        Some(out)
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
        let hash = state
            .console_key
            .open(value, now_ms())
            .ok_or(NoSession::SignIn)?;
        let actor = state
            .admin
            .actor_by_hash(&state.db, &hash)
            .await
            .map_err(NoSession::Failed)?
            .ok_or(NoSession::SignIn)?;
        ActorSlot::fill(parts, &actor);
        Ok(Session {
            csrf: state.console_key.csrf(value),
            actor,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> SessionKey {
        SessionKey(b"0123456789abcdef".to_vec().into())
    }

    #[test]
    fn a_session_opens_only_unaltered_and_before_it_ends() {
        let hash = [7u8; 32];
        let value = key().session(&hash, 2_000);
        assert_eq!(key().open(&value, 1_999), Some(hash));
        assert_eq!(key().open(&value, 2_000), None, "ended");
        let later = value.replacen(".2000.", ".9000.", 1);
        assert_eq!(key().open(&later, 1_000), None, "a changed expiry");
        let other = SessionKey(b"another key".to_vec().into());
        assert_eq!(other.open(&value, 1_000), None, "another key");
        assert_eq!(key().open("garbage", 0), None);
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
