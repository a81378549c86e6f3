//! Usage rows: per tenant, UTC day, channel and key kind, how many messages
//! were accepted and reached each outcome, and the SMS fragments sent.
//! They are counted in the same transaction as the change they count.
//! The lifecycle's moves count them ([`crate::store::lifecycle`]). On
//! PostgreSQL each move's statement appends its counts to `usage_deltas`,
//! and [`UsageStore::roll_up_usage`] folds them into `usage` on one instance at a time; reads
//! add both. On SQLite the counts are summed over a writer's group in
//! [`super::sqlite::usage::Pending`] and written once per key before the
//! group commits. The rows are apart from the messages, so retention never
//! changes them.

use crate::store::StoreResult;
use async_trait::async_trait;

use super::usage_counters::COUNTERS;
use crate::model::Scope;

/// One day's usage of one tenant's channel, live or test.
#[derive(Debug, Clone, Default, PartialEq, Eq, sqlx::FromRow)]
pub struct UsageRow {
    pub tenant_id: String,
    /// Days since 1970-01-01 (UTC).
    pub day: i64,
    pub channel: String,
    pub test: bool,
    pub accepted: i64,
    pub sent: i64,
    pub delivered: i64,
    pub bounced: i64,
    pub complained: i64,
    pub failed: i64,
    pub dead_lettered: i64,
    pub suppressed: i64,
    pub cancelled: i64,
    pub rejected: i64,
    pub fragments: i64,
    /// Bytes of the files attached to the messages accepted.
    pub attachment_bytes: i64,
    /// Moved back from the dead-letter queue by a redrive.
    pub redriven: i64,
}

/// Whose usage a read covers.
#[derive(Debug, Clone, Copy)]
pub enum Whose<'a> {
    /// Every tenant, both worlds (an operator's view).
    Everyone,
    /// One tenant, both worlds (an operator's view).
    Tenant(&'a str),
    /// One tenant in one world: what its own key may see.
    Scope(&'a Scope),
}

/// Usage rows, on either backend. The counting itself happens in the
/// lifecycle's moves, in their transactions.
#[async_trait]
pub trait UsageStore: Send + Sync {
    /// The usage rows of days `from_day..=to_day` of `whose`, ordered by
    /// tenant, day, channel and kind.
    async fn usage(
        &self,
        whose: Whose<'_>,
        from_day: i64,
        to_day: i64,
    ) -> StoreResult<Vec<UsageRow>>;

    /// Folds the counts appended since the last roll-up into `usage`, one
    /// batch per transaction, on one instance at a time (`None` from the
    /// others). Returns how many deltas it folded. PostgreSQL only; SQLite
    /// counts in place and answers `None`.
    async fn roll_up_usage(&self) -> StoreResult<Option<u64>>;
}

impl<'a> Whose<'a> {
    /// The tenant and kind (`test`) a read is bound to; `None`: any.
    pub(super) fn bounds(self) -> (Option<&'a str>, Option<bool>) {
        match self {
            Whose::Everyone => (None, None),
            Whose::Tenant(tenant) => (Some(tenant), None),
            Whose::Scope(scope) => (Some(scope.tenant()), Some(scope.is_test())),
        }
    }
}

/// Every counter summed over a group, as a `BIGINT` under its own name.
pub(super) fn summed_counters() -> String {
    COUNTERS
        .iter()
        .map(|c| format!("CAST(SUM({c}) AS BIGINT) AS {c}"))
        .collect::<Vec<_>>()
        .join(", ")
}
