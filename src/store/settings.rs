//! The `settings` table: a few named values the service keeps beside its
//! data (the admin token's hash), and the planner's statistics.

use crate::store::StoreResult;
use async_trait::async_trait;

/// Named values, on either backend.
#[async_trait]
pub trait SettingsStore: Send + Sync {
    /// The value of `key`, if one is stored.
    async fn setting(&self, key: &str) -> StoreResult<Option<String>>;

    /// Stores `value` under `key`, replacing what was there.
    async fn set_setting(&self, key: &str, value: &str) -> StoreResult<()>;

    /// The value of `key`, storing `value` first when there is none;
    /// instances starting together agree on one.
    async fn setting_or_insert(&self, key: &str, value: &str) -> StoreResult<String>;

    /// Keeps the query planner's statistics current: SQLite's `PRAGMA
    /// optimize` (an `ANALYZE` of the tables whose size changed enough,
    /// reading a bounded sample); nothing on PostgreSQL, whose autovacuum
    /// analyzes a table after enough of its rows changed.
    async fn refresh_statistics(&self) -> StoreResult<()>;
}
