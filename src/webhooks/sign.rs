//! Signatures as the Standard Webhooks specification defines them
//! (<https://www.standardwebhooks.com>), so any of its libraries verifies
//! fairlane's calls:
//!
//! - the secret is `whsec_` followed by the Base64 of random key bytes;
//! - the signed content is `{webhook-id}.{webhook-timestamp}.{body}`;
//! - `webhook-signature` is `v1,` followed by the Base64 HMAC-SHA256 of it,
//!   several such signatures separated by spaces (during a rotation, one
//!   with the new secret and one with the old).

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

/// Prefix of a signing secret.
pub const SECRET_PREFIX: &str = "whsec_";

/// Key bytes of a new secret (the spec asks for 24 to 64).
const SECRET_BYTES: usize = 32;

/// A fresh random secret, `whsec_…`.
pub fn new_secret() -> String {
    let mut key = [0u8; SECRET_BYTES];
    rand::rng().fill_bytes(&mut key);
    format!("{SECRET_PREFIX}{}", BASE64.encode(key))
}

/// `v1,<signature>` of one attempt, with `secret` (`whsec_…`).
pub fn sign(secret: &str, id: &str, timestamp: i64, body: &[u8]) -> anyhow::Result<String> {
    let key = BASE64
        .decode(secret.strip_prefix(SECRET_PREFIX).unwrap_or(secret))
        .map_err(|err| anyhow::anyhow!("the webhook secret is not Base64: {err}"))?;
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).expect("HMAC takes a key of any length");
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    Ok(format!("v1,{}", BASE64.encode(mac.finalize().into_bytes())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_matches_the_specifications_example() {
        // The example of the Standard Webhooks specification and its
        // reference libraries.
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let id = "msg_p5jXN8AQM9LWM0D4loKWxJek";
        let body = br#"{"test": 2432232314}"#;
        assert_eq!(
            sign(secret, id, 1614265330, body).unwrap(),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn new_secrets_are_prefixed_random_and_usable() {
        let (a, b) = (new_secret(), new_secret());
        assert!(a.starts_with(SECRET_PREFIX) && a != b);
        assert!(sign(&a, "evt_1", 1, b"{}").unwrap().starts_with("v1,"));
        assert!(sign("whsec_!!!", "evt_1", 1, b"{}").is_err());
    }
}
