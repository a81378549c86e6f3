//! The registry's rows: plans, tenants and API keys (stored as hashes),
//! which `crate::tenants::Registry` serves from memory; and on PostgreSQL
//! the announcement that makes every instance reload them after a change.

use sqlx::postgres::PgListener;

use crate::store::StoreResult;
use async_trait::async_trait;

use crate::model::{Isolation, Plan, TenantStatus};

/// A plan row as stored.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct PlanRow {
    pub name: String,
    pub lane: String,
    pub rate_per_second: f64,
    pub burst: i64,
    pub daily_quota: i64,
    pub max_in_flight: i64,
    pub uploads_per_minute: i64,
    pub upload_bytes_held: i64,
}

pub(super) const PLAN_COLUMNS: &str = "name, lane, rate_per_second, burst, daily_quota, \
     max_in_flight, uploads_per_minute, upload_bytes_held";
/// A tenant row as stored.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct StoredTenant {
    pub id: String,
    pub name: String,
    pub plan: String,
    pub status: String,
    pub isolation: String,
    pub max_concurrent_consumers: i64,
    pub unsubscribe_default: bool,
    pub unsubscribe_mailto: Option<String>,
    /// Days its messages' personal data is kept; `None`: the configured default.
    pub retention_days: Option<i64>,
    pub created_at: i64,
    pub updated_at: i64,
}

pub(super) const TENANT_COLUMNS: &str = "id, name, plan, status, isolation, max_concurrent_consumers, \
     unsubscribe_default, unsubscribe_mailto, retention_days, created_at, updated_at";
/// An active key: id, tenant id, hex SHA-256 of its secret, kind (`live`
/// or `test`).
pub type KeyTuple = (String, String, String, String);

/// A sender identity as stored.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct SenderRow {
    pub id: String,
    pub tenant_id: String,
    pub channel: String,
    pub sender: Option<String>,
    pub display_name: Option<String>,
    /// JSON array of addresses, or NULL.
    pub reply_to: Option<String>,
    pub configuration_set: Option<String>,
    pub messaging_service_sid: Option<String>,
    pub is_default: bool,
    pub created_at: i64,
}

pub(super) const SENDER_COLUMNS: &str = "id, tenant_id, channel, sender, display_name, reply_to, \
     configuration_set, messaging_service_sid, is_default, created_at";

/// Plans, tenants, active keys and sender identities as stored.
pub struct RegistryRows {
    pub plans: Vec<PlanRow>,
    pub tenants: Vec<StoredTenant>,
    pub keys: Vec<KeyTuple>,
    pub senders: Vec<SenderRow>,
}

/// Who wrote a plan: the configuration seeds its plans at start-up until
/// an admin changes one; from then on the admin's figures stand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanSource {
    Config,
    Admin,
}

impl PlanSource {
    /// The word the `source` column holds.
    pub fn as_str(self) -> &'static str {
        match self {
            PlanSource::Config => "config",
            PlanSource::Admin => "admin",
        }
    }
}

/// A new tenant.
pub struct TenantInsert<'a> {
    pub id: &'a str,
    pub name: &'a str,
    pub plan: &'a str,
    pub status: TenantStatus,
    pub isolation: Isolation,
    pub max_concurrent_consumers: u32,
    pub retention_days: Option<u16>,
    pub created_at: i64,
}

/// What a tenant update changes; `None` fields stay as they are.
pub struct TenantUpdate<'a> {
    pub plan: Option<&'a str>,
    pub status: Option<TenantStatus>,
    pub isolation: Option<Isolation>,
    pub max_concurrent_consumers: Option<u32>,
    pub unsubscribe_default: Option<bool>,
    /// `Some("")` removes it.
    pub unsubscribe_mailto: Option<&'a str>,
    /// `Some(None)` returns it to the configured default.
    pub retention_days: Option<Option<u16>>,
}

/// What [`delete_tenant`] did.
pub enum TenantDeletion {
    Deleted,
    NotFound,
    /// Refused: this many of its messages are not delivered yet.
    Undelivered(i64),
}

/// The registry's rows, on either backend.
#[async_trait]
pub trait RegistryStore: Send + Sync {
    /// Plans, tenants and active keys as stored now, from one snapshot, so
    /// a change committed between the reads is not half seen.
    async fn read_registry(&self) -> StoreResult<RegistryRows>;

    /// Creates or replaces a plan. A configured plan (`PlanSource::Config`)
    /// does not replace one an admin has changed; an admin's always replaces.
    async fn write_plan(&self, plan: &Plan, source: PlanSource, now: i64) -> StoreResult<()>;

    /// Inserts a tenant; false when one with its id exists (the primary key
    /// decides races between two creates of the same id).
    async fn insert_tenant(&self, tenant: &TenantInsert<'_>) -> StoreResult<bool>;

    /// Changes only the fields given (another instance may have changed the
    /// others a moment ago); returns the tenant's row after it, `None` when
    /// there is no such tenant.
    async fn update_tenant(
        &self,
        id: &str,
        change: &TenantUpdate<'_>,
        now: i64,
    ) -> StoreResult<Option<StoredTenant>>;

    /// Deletes a tenant with its keys, message history, events, webhook,
    /// suppressions, sender identities, usage and idempotency keys, in one
    /// transaction; refused while any of its messages is undelivered
    /// (`scheduled`, `queued`, `sending`, `retrying`): a scheduled one would
    /// otherwise be sent for a tenant that no longer exists.
    async fn delete_tenant(&self, id: &str) -> StoreResult<TenantDeletion>;

    /// Stores a key's id, the hex SHA-256 of its secret and its kind (`live`
    /// or `test`).
    async fn insert_key(&self, key: &KeyInsert<'_>) -> StoreResult<()>;

    /// Revokes an active key of `tenant_id`; returns how many (0 or 1).
    async fn revoke_key(&self, tenant_id: &str, key_id: &str, now: i64) -> StoreResult<u64>;

    /// A tenant's keys, revoked ones too: id, created, revoked, kind,
    /// last used (ms).
    async fn keys_of(&self, tenant_id: &str) -> StoreResult<Vec<KeyListed>>;

    /// Notes when keys were last used, `(key id, ms)`; a time earlier than
    /// the one stored leaves it as it is.
    async fn note_key_uses(&self, uses: &[(String, i64)]) -> StoreResult<()>;

    /// Stores a sender identity; when it is a default, the tenant's previous
    /// default for its channel stops being one in the same transaction.
    async fn insert_sender(&self, row: &SenderRow) -> StoreResult<()>;

    /// Makes identity `id` of `tenant_id` its channel's default (`default`)
    /// or no default; false when the tenant has no such identity.
    async fn set_default_sender(
        &self,
        tenant_id: &str,
        id: &str,
        default: bool,
    ) -> StoreResult<bool>;

    /// Removes identity `id` of `tenant_id`; false when there was none.
    async fn delete_sender(&self, tenant_id: &str, id: &str) -> StoreResult<bool>;

    /// A tenant's sender identities, oldest first.
    async fn senders_of(&self, tenant_id: &str) -> StoreResult<Vec<SenderRow>>;

    /// Tells the other instances that the registry changed (`what`, for
    /// logs). Nothing to tell on SQLite, where there are none.
    async fn announce_registry(&self, what: &str) -> StoreResult<()>;

    /// Whether other instances may change plans, tenants and keys behind
    /// this one's cache (a PostgreSQL store they share); a SQLite file is
    /// changed by its one instance only, so its cache is never stale.
    fn changed_elsewhere(&self) -> bool;

    /// Listens for the announcements of [`announce_registry`]; fails on
    /// a store no other instance changes ([`changed_elsewhere`] false).
    ///
    /// [`changed_elsewhere`]: RegistryStore::changed_elsewhere
    ///
    /// [`announce_registry`]: RegistryStore::announce_registry
    async fn listen_registry(&self) -> StoreResult<RegistryListener>;
}

/// A new API key: its id, whose it is, the hex SHA-256 of its secret, its
/// kind (`live` or `test`) and when it was made.
pub struct KeyInsert<'a> {
    pub id: &'a str,
    pub tenant_id: &'a str,
    pub secret_hash_hex: &'a str,
    pub kind: &'a str,
    pub created_at: i64,
}

/// A key as listed: id, created, revoked (ms), kind, last used (ms).
pub type KeyListed = (String, i64, Option<i64>, String, Option<i64>);

/// Hears the registry's announcements, on a connection of its own.
pub struct RegistryListener(pub(super) PgListener);

impl RegistryListener {
    /// Waits for the next announcement: true when one came, false when the
    /// connection dropped (listen again, then reload).
    pub async fn next(&mut self) -> bool {
        matches!(self.0.try_recv().await, Ok(Some(_)))
    }
}
