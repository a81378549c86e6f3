//! Each tenant's suppression list: addresses it must not send to. A hard
//! bounce or a complaint adds one ([`crate::receipts`]); the tenant or an
//! admin adds and removes them through the API; the consumer checks it
//! before every provider call. Addresses are kept normalised, so
//! `Alice@Example.com` and `alice@example.com` are one entry.

use crate::store::StoreResult;
use async_trait::async_trait;
use serde::Serialize;
use utoipa::ToSchema;

use crate::message::{MAX_EMAIL_LEN, is_e164, is_email_address};
use crate::model::{Channel, ms_to_rfc3339};

/// The address as stored and compared: an email address in lower case, or
/// an E.164 number; None when it is neither.
pub fn normalize(address: &str) -> Option<(Channel, String)> {
    let address = address.trim();
    if is_e164(address) {
        return Some((Channel::Sms, address.to_owned()));
    }
    let lower = address.to_lowercase();
    (lower.len() <= MAX_EMAIL_LEN && is_email_address(&lower)).then_some((Channel::Email, lower))
}

/// Why an address is on the list.
pub const REASONS: &[&str] = &["bounce", "complaint", "manual", "unsubscribe"];

/// One entry of a tenant's list.
#[derive(Debug, Clone, Serialize, ToSchema, sqlx::FromRow)]
pub struct Suppression {
    /// Normalised: lower-case email address or E.164 number.
    pub address: String,
    /// `email` or `sms`.
    pub channel: String,
    /// `bounce`, `complaint`, `manual` or `unsubscribe` (one-click).
    pub reason: String,
    /// The provider's words (bounce type, error code) or the caller's note.
    pub detail: Option<String>,
    /// The message whose receipt added it, for bounces and complaints.
    pub message_id: Option<String>,
    /// RFC 3339.
    #[sqlx(skip)]
    pub created_at: String,
    #[serde(skip)]
    #[sqlx(rename = "created_at")]
    pub created_ms: i64,
}

impl Suppression {
    /// With `created_at` written out from `created_ms`.
    pub(super) fn dated(mut self) -> Self {
        self.created_at = ms_to_rfc3339(self.created_ms);
        self
    }
}

/// The suppression lists, on either backend.
#[async_trait]
pub trait SuppressionStore: Send + Sync {
    /// Adds `address` to `tenant_id`'s list with reason `unsubscribe` (a
    /// one-click unsubscribe from message `message_id`) and, when it was not
    /// listed before, records the `unsubscribed` event on that message (with
    /// its `message.unsubscribed` webhook call); one transaction. The message
    /// may be gone (its tenant's data erased): the address is listed all the
    /// same. True when it was added.
    async fn unsubscribe(
        &self,
        tenant_id: &str,
        channel: Channel,
        address: &str,
        message_id: &str,
        now: i64,
    ) -> StoreResult<bool>;

    /// Adds an entry by hand (reason `manual`); true when it was not listed
    /// before. The first reason of an address stays.
    async fn add_suppression(
        &self,
        tenant_id: &str,
        channel: Channel,
        address: &str,
        detail: Option<&str>,
    ) -> StoreResult<bool>;

    /// One entry, if listed.
    async fn suppression(&self, tenant_id: &str, address: &str)
    -> StoreResult<Option<Suppression>>;

    /// True when `address` (normalised) is on the tenant's list.
    async fn is_suppressed(&self, tenant_id: &str, address: &str) -> StoreResult<bool>;

    /// Up to `limit` entries after `after` (an address; None from the
    /// start), in address order.
    async fn suppressions_of(
        &self,
        tenant_id: &str,
        after: Option<&str>,
        limit: i64,
    ) -> StoreResult<Vec<Suppression>>;

    /// Removes an entry; true when it was listed.
    async fn remove_suppression(&self, tenant_id: &str, address: &str) -> StoreResult<bool>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_normalised_so_case_does_not_make_a_second_entry() {
        assert_eq!(
            normalize(" Alice@Example.COM "),
            Some((Channel::Email, "alice@example.com".into()))
        );
        assert_eq!(
            normalize("+15551234567"),
            Some((Channel::Sms, "+15551234567".into()))
        );
        assert_eq!(normalize("not an address"), None);
        assert_eq!(normalize("5551234567"), None);
    }
}
