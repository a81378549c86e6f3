//! One-click unsubscribe (RFC 8058).
//!
//! An email sent with `unsubscribe: true` (or by a tenant whose default
//! says so) carries `List-Unsubscribe: <{server.public_url}/v1/unsubscribe/{token}>`
//! (and the tenant's `mailto:` if it has one) and
//! `List-Unsubscribe-Post: List-Unsubscribe=One-Click`. The token names the
//! message's tenant, address and message id, and is signed with a secret
//! the store keeps (made at the first start and shared by every instance on
//! the same store), so nobody can make one for an address they did not
//! receive mail at. A `POST` to the URL adds the address to the tenant's
//! suppression list; a `GET` only shows a page with the button, since mail
//! scanners follow links.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::store::Db;

/// The `settings` key of the signing secret (hex).
const SECRET_SETTING: &str = "unsubscribe_secret";
/// Bytes of the signature kept in a token: 128 bits cannot be guessed.
const TAG_BYTES: usize = 16;
/// Longest token read; anything longer is not one of ours.
const MAX_TOKEN_CHARS: usize = 1024;
/// The path the links point at, below `server.public_url`.
pub const PATH: &str = "/v1/unsubscribe";

/// What a token says: whose list, which address, from which message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub tenant_id: String,
    pub address: String,
    pub message_id: String,
}

/// Makes and checks unsubscribe links.
#[derive(Clone)]
pub struct Links {
    /// `server.public_url` without a trailing `/`.
    base: String,
    key: Vec<u8>,
}

impl std::fmt::Debug for Links {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Links").field("base", &self.base).finish()
    }
}

impl Links {
    /// The links of a service reachable at `public_url`, signed with the
    /// store's secret (made now if the store has none). `None` without a
    /// public URL: no link can be given then.
    pub async fn load(db: &Db, public_url: Option<&str>) -> anyhow::Result<Option<Links>> {
        let Some(base) = public_url else {
            return Ok(None);
        };
        let fresh = crate::tenants::random_hex(32);
        let secret = db.setting_or_insert(SECRET_SETTING, &fresh).await?;
        let key = hex::decode(secret.trim())
            .map_err(|err| anyhow::anyhow!("the stored unsubscribe secret is not hex: {err}"))?;
        Ok(Some(Links::new(base, key)))
    }

    pub fn new(base: &str, key: Vec<u8>) -> Links {
        Links {
            base: base.trim_end_matches('/').to_owned(),
            key,
        }
    }

    fn tag(&self, payload: &[u8]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC takes any key");
        mac.update(payload);
        mac
    }

    /// The token of `claim`: its fields, then a signature, base64url.
    pub fn token(&self, claim: &Claim) -> String {
        let payload = format!(
            "{}\n{}\n{}",
            claim.tenant_id, claim.address, claim.message_id
        );
        let signature = self.tag(payload.as_bytes()).finalize().into_bytes();
        format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(payload),
            URL_SAFE_NO_PAD.encode(&signature[..TAG_BYTES])
        )
    }

    /// The https URL a `List-Unsubscribe` header carries for `claim`.
    pub fn url(&self, claim: &Claim) -> String {
        format!("{}{PATH}/{}", self.base, self.token(claim))
    }

    /// What `token` says, if it is one of ours and unaltered.
    pub fn verify(&self, token: &str) -> Option<Claim> {
        if token.len() > MAX_TOKEN_CHARS {
            return None;
        }
        let (payload, signature) = token.split_once('.')?;
        let payload = URL_SAFE_NO_PAD.decode(payload).ok()?;
        let signature = URL_SAFE_NO_PAD.decode(signature).ok()?;
        if signature.len() != TAG_BYTES {
            return None;
        }
        // Compared in constant time.
        self.tag(&payload).verify_truncated_left(&signature).ok()?;
        let text = String::from_utf8(payload).ok()?;
        let mut fields = text.splitn(3, '\n');
        Some(Claim {
            tenant_id: fields.next()?.to_owned(),
            address: fields.next()?.to_owned(),
            message_id: fields.next()?.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim() -> Claim {
        Claim {
            tenant_id: "acme".into(),
            address: "ada@example.com".into(),
            message_id: "0193a5f0-0000-7000-8000-000000000001".into(),
        }
    }

    #[test]
    fn a_token_reads_back_and_any_change_to_it_is_refused() {
        let links = Links::new("https://notify.example.com/", vec![7; 32]);
        let url = links.url(&claim());
        assert!(
            url.starts_with("https://notify.example.com/v1/unsubscribe/"),
            "{url}"
        );
        let token = url.rsplit('/').next().unwrap();
        assert_eq!(links.verify(token), Some(claim()));

        // Another address with the first signature, a flipped character, a
        // cut signature, another secret: all refused.
        let (_, signature) = token.split_once('.').unwrap();
        let other = Claim {
            address: "eve@example.com".into(),
            ..claim()
        };
        let forged_payload = links.token(&other);
        let (payload, _) = forged_payload.split_once('.').unwrap();
        assert_eq!(links.verify(&format!("{payload}.{signature}")), None);
        let mut flipped = token.to_owned().into_bytes();
        flipped[3] = if flipped[3] == b'A' { b'B' } else { b'A' };
        assert_eq!(links.verify(&String::from_utf8(flipped).unwrap()), None);
        assert_eq!(links.verify(&token[..token.len() - 2]), None);
        assert_eq!(
            Links::new("https://notify.example.com", vec![8; 32]).verify(token),
            None
        );
        assert_eq!(links.verify("not-a-token"), None);
    }
}
