//! One-click unsubscribe (RFC 8058).
//!
//! An email sent with `unsubscribe: true` (or by a tenant whose default
//! says so) carries `List-Unsubscribe: <{server.public_url}/v1/unsubscribe/{token}>`
//! (and the tenant's `mailto:` if it has one) and
//! `List-Unsubscribe-Post: List-Unsubscribe=One-Click`. The token holds the
//! message's tenant (and which incarnation of it: the tenant's creation
//! time), address, message id and issue time, sealed with AES-256-GCM
//! under a key derived from a secret the store keeps (made at the first
//! start and shared by every instance on the same store): nobody can read
//! the address out of a link (in a URL, a log, a proxy's access log) or
//! make one for an address they did not receive mail at. A link is
//! honoured for `server.unsubscribe_link_days` after its email, and only by
//! the tenant that sent it: a tenant deleted and created again with the
//! same id does not honour the old one's links. A `POST` whose body says
//! `List-Unsubscribe=One-Click` adds the address to the tenant's
//! suppression list; a `GET` only shows a page with the button, since mail
//! scanners follow links.
//!
//! Links made before this form (`{payload}.{signature}`, signed but
//! readable) are still honoured, for the same lifetime counted from their
//! message's creation, and only while that message is in the store under
//! the tenant the link names.

use aws_lc_rs::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::store::Db;

/// The `settings` key of the signing secret (hex).
const SECRET_SETTING: &str = "unsubscribe_secret";
/// Bytes of the signature kept in a token of the first form.
const TAG_BYTES: usize = 16;
/// Longest token read; anything longer is not one of ours.
const MAX_TOKEN_CHARS: usize = 1024;
/// The path the links point at, below `server.public_url`.
pub const PATH: &str = "/v1/unsubscribe";
/// What begins a sealed token (a token of the first form cannot begin so:
/// its base64 payload is at least two characters before its `.`).
const SEALED: &str = "2.";
/// Bound into every sealed token, so a token sealed for another purpose
/// under the same key would not open as one of these.
const AAD: &[u8] = b"fairlane unsubscribe link";

/// What a token says: whose list (and which incarnation of the tenant),
/// which address, from which message, since when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub tenant_id: String,
    /// The tenant's creation time (ms); `None` in a token of the first
    /// form, whose message is looked up instead.
    pub incarnation: Option<i64>,
    pub address: String,
    pub message_id: String,
    /// When the link was made (ms); `None` in a token of the first form.
    pub issued_at: Option<i64>,
}

impl Claim {
    /// Whether the link is honoured at `now` by its tenant as it stands
    /// (created at `tenant_created`): made for this incarnation of the
    /// tenant, at most `lifetime_ms` ago. A link of the first form names
    /// neither, so its message must be in the store under that tenant
    /// (`message_created`: when it was made), made by this incarnation and
    /// within the lifetime.
    pub fn honoured(
        &self,
        tenant_created: i64,
        message_created: Option<i64>,
        now: i64,
        lifetime_ms: i64,
    ) -> bool {
        let issued_at = match (self.incarnation, self.issued_at) {
            (Some(incarnation), Some(issued_at)) if incarnation == tenant_created => issued_at,
            (Some(_), Some(_)) => return false,
            _ => match message_created {
                Some(created) if created >= tenant_created => created,
                _ => return false,
            },
        };
        now - issued_at <= lifetime_ms
    }
}

/// Makes and checks unsubscribe links.
#[derive(Clone)]
pub struct Links {
    /// `server.public_url` without a trailing `/`.
    base: String,
    /// Signs (and checks) tokens of the first form.
    key: Vec<u8>,
    /// Seals tokens: HMAC-SHA-256 of a fixed label under `key`.
    seal_key: [u8; 32],
}

impl std::fmt::Debug for Links {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Links").field("base", &self.base).finish()
    }
}

impl Links {
    /// The links of a service reachable at `public_url`, sealed with the
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
        let mut derive = Hmac::<Sha256>::new_from_slice(&key).expect("HMAC takes any key");
        derive.update(b"fairlane unsubscribe seal v2");
        Links {
            base: base.trim_end_matches('/').to_owned(),
            seal_key: derive.finalize().into_bytes().into(),
            key,
        }
    }

    fn sealer(&self) -> LessSafeKey {
        LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &self.seal_key).expect("a 32-byte key"))
    }

    /// The token of `claim`: its fields sealed under a fresh random nonce,
    /// base64url after [`SEALED`].
    pub fn token(&self, claim: &Claim) -> String {
        let mut data = format!(
            "{}\n{}\n{}\n{}\n{}",
            claim.tenant_id,
            claim.incarnation.unwrap_or_default(),
            claim.issued_at.unwrap_or_default(),
            claim.message_id,
            claim.address,
        )
        .into_bytes();
        let nonce: [u8; NONCE_LEN] = rand::random();
        self.sealer()
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(AAD),
                &mut data,
            )
            .expect("AES-GCM seals any short text");
        let mut sealed = nonce.to_vec();
        sealed.extend_from_slice(&data);
        format!("{SEALED}{}", URL_SAFE_NO_PAD.encode(sealed))
    }

    /// The https URL a `List-Unsubscribe` header carries for `claim`.
    pub fn url(&self, claim: &Claim) -> String {
        format!("{}{PATH}/{}", self.base, self.token(claim))
    }

    /// What `token` says, if it is one of ours and unaltered (of either
    /// form). Whether it is still honoured (its lifetime, its tenant's
    /// incarnation) is the caller's to check.
    pub fn verify(&self, token: &str) -> Option<Claim> {
        if token.len() > MAX_TOKEN_CHARS {
            return None;
        }
        match token.strip_prefix(SEALED) {
            Some(sealed) => self.open(sealed),
            None => self.verify_signed(token),
        }
    }

    fn open(&self, sealed: &str) -> Option<Claim> {
        let mut data = URL_SAFE_NO_PAD.decode(sealed).ok()?;
        if data.len() < NONCE_LEN {
            return None;
        }
        let text = data.split_off(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(&data).ok()?;
        let mut text = text;
        let plain = self
            .sealer()
            .open_in_place(nonce, Aad::from(AAD), &mut text)
            .ok()?;
        let plain = std::str::from_utf8(plain).ok()?;
        let mut fields = plain.splitn(5, '\n');
        Some(Claim {
            tenant_id: fields.next()?.to_owned(),
            incarnation: Some(fields.next()?.parse().ok()?),
            issued_at: Some(fields.next()?.parse().ok()?),
            message_id: fields.next()?.to_owned(),
            address: fields.next()?.to_owned(),
        })
    }

    /// A token of the first form: its fields in clear, then a truncated
    /// HMAC-SHA-256, each base64url.
    fn verify_signed(&self, token: &str) -> Option<Claim> {
        let (payload, signature) = token.split_once('.')?;
        let payload = URL_SAFE_NO_PAD.decode(payload).ok()?;
        let signature = URL_SAFE_NO_PAD.decode(signature).ok()?;
        if signature.len() != TAG_BYTES {
            return None;
        }
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC takes any key");
        mac.update(&payload);
        // Compared in constant time.
        mac.verify_truncated_left(&signature).ok()?;
        let text = String::from_utf8(payload).ok()?;
        let mut fields = text.splitn(3, '\n');
        Some(Claim {
            tenant_id: fields.next()?.to_owned(),
            incarnation: None,
            address: fields.next()?.to_owned(),
            message_id: fields.next()?.to_owned(),
            issued_at: None,
        })
    }

    /// A token of the first form for `claim`, as links made before sealed
    /// ones were; for the tests of their honouring.
    #[cfg(test)]
    pub(crate) fn signed_token(&self, claim: &Claim) -> String {
        let payload = format!(
            "{}\n{}\n{}",
            claim.tenant_id, claim.address, claim.message_id
        );
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC takes any key");
        mac.update(payload.as_bytes());
        let signature = mac.finalize().into_bytes();
        format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(payload),
            URL_SAFE_NO_PAD.encode(&signature[..TAG_BYTES])
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim() -> Claim {
        Claim {
            tenant_id: "acme".into(),
            incarnation: Some(1_700_000_000_000),
            address: "ada@example.com".into(),
            message_id: "0193a5f0-0000-7000-8000-000000000001".into(),
            issued_at: Some(1_800_000_000_000),
        }
    }

    #[test]
    fn a_token_reads_back_reveals_nothing_and_any_change_to_it_is_refused() {
        let links = Links::new("https://notify.example.com/", vec![7; 32]);
        let url = links.url(&claim());
        assert!(
            url.starts_with("https://notify.example.com/v1/unsubscribe/2."),
            "{url}"
        );
        let token = url.rsplit('/').next().unwrap();
        assert_eq!(links.verify(token), Some(claim()));
        // Sealed: decoded, it holds neither the address nor the tenant.
        let raw = URL_SAFE_NO_PAD.decode(&token[2..]).unwrap();
        let raw = String::from_utf8_lossy(&raw);
        assert!(
            !raw.contains("ada@example.com") && !raw.contains("acme"),
            "{raw}"
        );
        // Two links of one claim differ (a fresh nonce each).
        assert_ne!(links.token(&claim()), links.token(&claim()));

        let mut flipped = token.to_owned().into_bytes();
        flipped[9] = if flipped[9] == b'A' { b'B' } else { b'A' };
        assert_eq!(links.verify(&String::from_utf8(flipped).unwrap()), None);
        assert_eq!(links.verify(&token[..token.len() - 2]), None);
        assert_eq!(
            Links::new("https://notify.example.com", vec![8; 32]).verify(token),
            None
        );
        assert_eq!(links.verify("not-a-token"), None);
        assert_eq!(links.verify("2."), None);
    }

    /// A link is honoured only by the tenant incarnation it was made for
    /// and within its lifetime; one of the first form only while its
    /// message is there, made by this incarnation, within the lifetime.
    #[test]
    fn a_link_is_honoured_by_its_tenant_within_its_lifetime() {
        const DAY: i64 = 86_400_000;
        let sealed = claim();
        let created = sealed.incarnation.unwrap();
        let issued = sealed.issued_at.unwrap();
        assert!(sealed.honoured(created, None, issued + 90 * DAY, 90 * DAY));
        assert!(
            !sealed.honoured(created, None, issued + 90 * DAY + 1, 90 * DAY),
            "expired"
        );
        assert!(
            !sealed.honoured(created + 5, None, issued, 90 * DAY),
            "another incarnation"
        );
        let first = Claim {
            incarnation: None,
            issued_at: None,
            ..claim()
        };
        assert!(first.honoured(created, Some(issued), issued + DAY, 90 * DAY));
        assert!(
            !first.honoured(created, None, issued + DAY, 90 * DAY),
            "its message is gone"
        );
        assert!(
            !first.honoured(created, Some(created - 1), created + DAY, 90 * DAY),
            "its message is older than the tenant"
        );
        assert!(
            !first.honoured(created, Some(issued), issued + 91 * DAY, 90 * DAY),
            "expired"
        );
    }

    /// Links of the first form (signed, readable) still verify, and a
    /// forged one does not.
    #[test]
    fn a_signed_token_of_the_first_form_still_verifies() {
        let links = Links::new("https://notify.example.com/", vec![7; 32]);
        let old = links.signed_token(&claim());
        let read = links.verify(&old).expect("verifies");
        assert_eq!(
            (
                read.tenant_id.as_str(),
                read.address.as_str(),
                read.incarnation,
                read.issued_at
            ),
            ("acme", "ada@example.com", None, None)
        );
        let (_, signature) = old.split_once('.').unwrap();
        let other = Claim {
            address: "eve@example.com".into(),
            ..claim()
        };
        let forged = links.signed_token(&other);
        let (payload, _) = forged.split_once('.').unwrap();
        assert_eq!(links.verify(&format!("{payload}.{signature}")), None);
    }
}
