//! Plans, tenants and API keys: stored in the store, served from memory.
//!
//! The accept path authenticates and looks up a tenant and its plan on every
//! request, so the registry keeps all three tables in memory and changes them
//! only through its own methods, which write the database first and the cache
//! second. On SQLite nothing else writes these tables, so the cache cannot go
//! stale. On PostgreSQL other instances write them too: every change is
//! announced with `NOTIFY`, and [`Registry::follow`] reloads the cache on
//! each announcement (and after any reconnection of its listener, when
//! announcements may have been missed), so a change made through any
//! instance, a revoked key included, takes effect on all within moments.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use rand::Rng;
use serde::Serialize;
use sha2::{Digest, Sha256};
use utoipa::ToSchema;

use crate::config::PlanSettings;
pub use crate::config::validate_plan_figures;
use crate::model::{Isolation, Scope, TenantStatus, World, now_ms};
use crate::store::Db;
use crate::store::registry::{
    self, PlanSource, RegistryRows, SenderRow, StoredTenant, TenantDeletion,
};

pub use crate::model::Plan;

pub mod senders;
pub use senders::{NewSender, SenderIdentity};

/// A tenant of the gateway.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Tenant {
    pub id: String,
    pub name: String,
    pub plan: String,
    pub status: TenantStatus,
    /// `shared` (default): the lane's queue. `dedicated`: a queue of the
    /// tenant's own, consumed by attention workers in bounded slices.
    pub isolation: Isolation,
    /// Attention workers that may consume the tenant's own queue at once
    /// (1: strictly one message at a time). Default 2.
    pub max_concurrent_consumers: u32,
    /// Its email asks for one-click unsubscribe unless a send says
    /// `unsubscribe: false`.
    pub unsubscribe_default: bool,
    /// The `mailto:` address its `List-Unsubscribe` header offers beside
    /// the https link.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unsubscribe_mailto: Option<String>,
    /// Days a message's body, recipient, reference, metadata and error
    /// details are kept once it is settled; then they are erased. The
    /// configured `retention.default_days` unless set for the tenant.
    #[schema(minimum = 1, maximum = 90)]
    pub retention_days: u16,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339.
    pub updated_at: String,
}

/// An API key as the cache holds it (the secret only as a hash).
#[derive(Debug, Clone)]
struct KeyEntry {
    tenant_id: String,
    secret_hash: [u8; 32],
    /// A test key: its messages go to the simulated provider.
    test: bool,
}

/// What a key sends with: real providers (`live`), or the simulated one
/// (`test`), whose messages reach nobody and use no quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, serde::Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum KeyKind {
    #[default]
    Live,
    Test,
}

impl KeyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            KeyKind::Live => "live",
            KeyKind::Test => "test",
        }
    }
}

/// What an API key listing shows.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct KeyInfo {
    pub id: String,
    pub kind: KeyKind,
    pub created_at: String,
    pub revoked_at: Option<String>,
    /// When the key last authenticated a request, to about a minute
    /// (instances write their uses to the store once a minute); `null` if
    /// never.
    pub last_used_at: Option<String>,
}

/// Why a registry change was refused.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("{0} not found")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

/// A store failure: its own words for what was not there or clashed,
/// otherwise kept whole (the API maps it once: a store that is away is a
/// 503, not a 500).
impl From<crate::store::StoreError> for RegistryError {
    fn from(err: crate::store::StoreError) -> Self {
        use crate::store::StoreError;
        match err {
            StoreError::NotFound(what) => RegistryError::NotFound(what),
            StoreError::Conflict(detail) => RegistryError::Conflict(detail),
            other => RegistryError::Internal(other.into()),
        }
    }
}

fn undelivered(id: &str, pending: i64) -> RegistryError {
    RegistryError::Conflict(format!(
        "tenant {id:?} still has {pending} undelivered messages; wait until they are sent or dead-lettered"
    ))
}

fn invalid(field: &str, message: impl Into<String>) -> RegistryError {
    RegistryError::Invalid {
        field: field.to_owned(),
        message: message.into(),
    }
}

/// True for identifiers of tenants and plans: 1–64 of `a-z 0-9 _ -`,
/// starting with a letter or digit.
pub fn is_valid_identifier(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        && id.as_bytes()[0].is_ascii_alphanumeric()
}

const IDENTIFIER_RULE: &str =
    "must be 1-64 characters of a-z, 0-9, '_' or '-', starting with a letter or digit";

/// SHA-256 of a secret. Keys are 256-bit random values, so a fast hash is
/// enough: there is nothing to brute-force that a slow hash would protect.
pub fn hash_secret(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

/// A fresh random value as hex.
pub fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    rand::rng().fill(&mut buf[..]);
    hex::encode(buf)
}

/// Prefix of tenant API keys: `fl_<key id>_<secret>`.
pub const KEY_PREFIX: &str = "fl_";
/// Prefix of test keys: `fl_test_<key id>_<secret>`.
pub const TEST_KEY_PREFIX: &str = "fl_test_";

/// How often a following instance reloads the registry even without an
/// announcement (one missed while its listener reconnected, say).
const FOLLOW_RELOAD_INTERVAL: Duration = Duration::from_secs(30);

type PlanMap = HashMap<String, Arc<Plan>>;
type TenantMap = HashMap<String, Arc<TenantRow>>;
type KeyMap = HashMap<String, KeyEntry>;
/// Each tenant's sender identities, oldest first.
type SenderMap = HashMap<String, Arc<Vec<SenderIdentity>>>;

type Tables = (PlanMap, TenantMap, KeyMap, SenderMap);

fn sender_from_row(row: SenderRow) -> anyhow::Result<SenderIdentity> {
    let reply_to = match row.reply_to.as_deref() {
        None => Vec::new(),
        Some(json) => serde_json::from_str(json).with_context(|| {
            format!("reply_to of sender identity {} is not a JSON list", row.id)
        })?,
    };
    Ok(SenderIdentity {
        channel: row.channel.parse().map_err(anyhow::Error::msg)?,
        id: row.id,
        tenant_id: row.tenant_id,
        from: row.sender,
        display_name: row.display_name,
        reply_to,
        configuration_set: row.configuration_set,
        messaging_service_sid: row.messaging_service_sid,
        default: row.is_default,
        created_at: crate::model::ms_to_rfc3339(row.created_at),
    })
}

fn senders_by_tenant(rows: Vec<SenderRow>) -> anyhow::Result<SenderMap> {
    let mut grouped: HashMap<String, Vec<SenderIdentity>> = HashMap::new();
    for row in rows {
        let sender = sender_from_row(row)?;
        grouped
            .entry(sender.tenant_id.clone())
            .or_default()
            .push(sender);
    }
    Ok(grouped
        .into_iter()
        .map(|(tenant, list)| (tenant, Arc::new(list)))
        .collect())
}

/// Plans, tenants and active keys as stored now: on PostgreSQL from one
/// snapshot (`REPEATABLE READ`), so a change committed between the three
/// reads is not half seen.
async fn read_all(db: &Db) -> anyhow::Result<Tables> {
    let RegistryRows {
        plans: plan_rows,
        tenants: tenant_rows,
        keys: key_rows,
        senders: sender_rows,
    } = db.read_registry().await?;
    let mut plans = HashMap::new();
    for row in plan_rows {
        let name = row.name.clone();
        let plan = Plan {
            lane: row.lane.parse().map_err(anyhow::Error::msg)?,
            name: row.name,
            rate_per_second: row.rate_per_second,
            burst: row.burst as u32,
            daily_quota: row.daily_quota as u64,
            max_in_flight: row.max_in_flight as u32,
            uploads_per_minute: u32::try_from(row.uploads_per_minute).unwrap_or(u32::MAX),
            upload_bytes_held: u64::try_from(row.upload_bytes_held).unwrap_or(0),
        };
        plans.insert(name, Arc::new(plan));
    }
    let mut tenants = HashMap::new();
    for stored in tenant_rows {
        let row = TenantRow::from_stored(stored)?;
        tenants.insert(row.id.clone(), Arc::new(row));
    }
    let mut keys = HashMap::new();
    for (id, tenant_id, hash, kind) in key_rows {
        let mut secret_hash = [0u8; 32];
        hex::decode_to_slice(&hash, &mut secret_hash)
            .with_context(|| format!("stored hash of key {id} is not valid hex"))?;
        keys.insert(
            id,
            KeyEntry {
                tenant_id,
                secret_hash,
                test: kind == KeyKind::Test.as_str(),
            },
        );
    }
    Ok((plans, tenants, keys, senders_by_tenant(sender_rows)?))
}

pub struct Registry {
    db: Db,
    plans: RwLock<PlanMap>,
    tenants: RwLock<TenantMap>,
    keys: RwLock<KeyMap>,
    senders: RwLock<SenderMap>,
    /// Held by each change (from its write to its cache update) and by each
    /// reload (from its read to its swap), so a reload that read the tables
    /// before a change committed never replaces the cache after the change
    /// updated it.
    changing: tokio::sync::Mutex<()>,
    /// Keys used since the last [`Registry::flush_key_uses`]: id → when
    /// (ms). Only this instance's; the store holds everyone's.
    key_uses: std::sync::Mutex<HashMap<String, i64>>,
    /// The queue told each tenant's isolation after every reload, so sends
    /// on this instance follow a change made on another one.
    isolation_sink: std::sync::OnceLock<Arc<dyn crate::queue::TenantQueues>>,
    /// The retention of tenants that set none (`retention.default_days`).
    retention_default: std::sync::atomic::AtomicU16,
}

/// The cached form of a tenant row.
#[derive(Debug, Clone)]
pub struct TenantRow {
    pub id: String,
    pub name: String,
    pub plan: String,
    pub status: TenantStatus,
    pub isolation: Isolation,
    pub max_concurrent_consumers: u32,
    pub unsubscribe_default: bool,
    pub unsubscribe_mailto: Option<String>,
    /// Its own retention; `None`: the configured default.
    pub retention_days: Option<u16>,
    pub created_at: i64,
    pub updated_at: i64,
}

impl TenantRow {
    fn from_stored(stored: StoredTenant) -> anyhow::Result<TenantRow> {
        Ok(TenantRow {
            status: stored.status.parse().map_err(anyhow::Error::msg)?,
            isolation: stored.isolation.parse().map_err(anyhow::Error::msg)?,
            max_concurrent_consumers: stored
                .max_concurrent_consumers
                .clamp(1, i64::from(u32::MAX)) as u32,
            id: stored.id,
            name: stored.name,
            plan: stored.plan,
            unsubscribe_default: stored.unsubscribe_default,
            unsubscribe_mailto: stored.unsubscribe_mailto,
            retention_days: stored.retention_days.map(|days| {
                days.clamp(MIN_RETENTION_DAYS.into(), MAX_RETENTION_DAYS.into()) as u16
            }),
            created_at: stored.created_at,
            updated_at: stored.updated_at,
        })
    }

    /// The tenant as the API shows it; `retention_default` stands in for
    /// a retention it has not set.
    pub fn view(&self, retention_default: u16) -> Tenant {
        Tenant {
            id: self.id.clone(),
            name: self.name.clone(),
            plan: self.plan.clone(),
            status: self.status,
            isolation: self.isolation,
            max_concurrent_consumers: self.max_concurrent_consumers,
            unsubscribe_default: self.unsubscribe_default,
            unsubscribe_mailto: self.unsubscribe_mailto.clone(),
            retention_days: self.retention_days.unwrap_or(retention_default),
            created_at: crate::model::ms_to_rfc3339(self.created_at),
            updated_at: crate::model::ms_to_rfc3339(self.updated_at),
        }
    }
}

/// How a new tenant's messages are queued; [`TenantOptions::default`] is
/// the lane's shared queue.
#[derive(Debug, Clone, Copy)]
pub struct TenantOptions {
    pub isolation: Isolation,
    pub max_concurrent_consumers: u32,
    /// `None`: the configured default.
    pub retention_days: Option<u16>,
}

impl Default for TenantOptions {
    fn default() -> Self {
        TenantOptions {
            isolation: Isolation::Shared,
            max_concurrent_consumers: DEFAULT_CONSUMERS,
            retention_days: None,
        }
    }
}

pub use crate::model::{DEFAULT_RETENTION_DAYS, MAX_RETENTION_DAYS, MIN_RETENTION_DAYS};

fn check_retention(days: u16) -> Result<u16, RegistryError> {
    if (MIN_RETENTION_DAYS..=MAX_RETENTION_DAYS).contains(&days) {
        Ok(days)
    } else {
        Err(invalid(
            "retention_days",
            format!("must be {MIN_RETENTION_DAYS}-{MAX_RETENTION_DAYS} days"),
        ))
    }
}

/// Attention workers a dedicated tenant's queue allows at once by default.
pub const DEFAULT_CONSUMERS: u32 = 2;
/// Most attention workers one tenant's queue may have at once.
pub const MAX_CONSUMERS: u32 = 64;

/// What a tenant update changes; `None` fields stay as they are.
#[derive(Debug, Clone, Default)]
pub struct TenantChange {
    pub plan: Option<String>,
    pub status: Option<TenantStatus>,
    pub isolation: Option<Isolation>,
    pub max_concurrent_consumers: Option<u32>,
    pub unsubscribe_default: Option<bool>,
    /// An email address; `""` removes it.
    pub unsubscribe_mailto: Option<String>,
    /// `Some(None)` returns it to the configured default.
    pub retention_days: Option<Option<u16>>,
}

fn check_consumers(consumers: u32) -> Result<u32, RegistryError> {
    if (1..=MAX_CONSUMERS).contains(&consumers) {
        Ok(consumers)
    } else {
        Err(invalid(
            "max_concurrent_consumers",
            format!("must be 1-{MAX_CONSUMERS}"),
        ))
    }
}

/// An authenticated caller: its tenant and the plan in force.
#[derive(Debug, Clone)]
pub struct Caller {
    pub tenant: Arc<TenantRow>,
    pub plan: Arc<Plan>,
    /// The tenant's sender identities (none: an empty list).
    pub senders: Arc<Vec<SenderIdentity>>,
    /// Authenticated with a test key.
    pub test: bool,
}

impl Caller {
    /// The tenant and world this caller's key reaches: what every
    /// tenant-facing store call takes.
    pub fn scope(&self) -> Scope {
        Scope::new(self.tenant.id.as_str(), World::of_test(self.test))
    }
}

impl Registry {
    /// Seeds the configured plans (unless an admin changed them) and loads
    /// everything into memory.
    pub async fn load(db: Db, configured: &BTreeMap<String, PlanSettings>) -> anyhow::Result<Self> {
        let now = now_ms();
        for (name, plan) in configured {
            db.write_plan(&plan.named(name), PlanSource::Config, now)
                .await
                .with_context(|| format!("seeding plan {name}"))?;
        }
        let (plans, tenants, keys, senders) = read_all(&db).await?;
        Ok(Registry {
            db,
            plans: RwLock::new(plans),
            tenants: RwLock::new(tenants),
            keys: RwLock::new(keys),
            senders: RwLock::new(senders),
            changing: tokio::sync::Mutex::new(()),
            key_uses: std::sync::Mutex::new(HashMap::new()),
            isolation_sink: std::sync::OnceLock::new(),
            retention_default: std::sync::atomic::AtomicU16::new(DEFAULT_RETENTION_DAYS),
        })
    }

    /// Reads all three tables again and replaces the cache with them.
    pub async fn reload(&self) -> anyhow::Result<()> {
        let _changing = self.changing.lock().await;
        let (plans, tenants, keys, senders) = read_all(&self.db).await?;
        *self.plans.write().expect("plans lock") = plans;
        *self.tenants.write().expect("tenants lock") = tenants;
        *self.keys.write().expect("keys lock") = keys;
        *self.senders.write().expect("senders lock") = senders;
        self.apply_isolation();
        Ok(())
    }

    /// Tells `queue` each tenant's isolation now and after every reload.
    pub fn route_isolation_to(&self, queue: Arc<dyn crate::queue::TenantQueues>) {
        let _ = self.isolation_sink.set(queue);
        self.apply_isolation();
    }

    fn apply_isolation(&self) {
        let Some(queue) = self.isolation_sink.get() else {
            return;
        };
        for tenant in self.tenants.read().expect("tenants lock").values() {
            queue.set_tenant_dedicated(&tenant.id, tenant.isolation == Isolation::Dedicated);
        }
    }

    /// Tells the other instances that the tables changed (PostgreSQL; on
    /// SQLite there are none). Best effort: a lost announcement is made up
    /// for by the followers' periodic reload.
    async fn announce(&self, what: &str) {
        if let Err(err) = self.db.announce_registry(what).await {
            tracing::warn!(error = %err, "Could not announce a registry change; other instances pick it up at their next periodic reload.");
        }
    }

    /// Where other instances change the registry (a shared PostgreSQL
    /// store), keeps this instance's cache in step with them until
    /// `shutdown`: reloads on every announcement, after each (re)connection
    /// of the listener, and every [`FOLLOW_RELOAD_INTERVAL`] in any case.
    /// Returns at once on a store only this instance changes.
    pub async fn follow(self: Arc<Self>, mut shutdown: tokio::sync::watch::Receiver<bool>) {
        if !self.db.changed_elsewhere() {
            return;
        }
        let mut backoff = Duration::from_millis(100);
        loop {
            let listening = tokio::select! {
                listening = self.db.listen_registry() => listening,
                _ = shutdown.changed() => return,
            };
            let mut listener = match listening {
                Ok(listener) => listener,
                Err(err) => {
                    tracing::warn!(error = %format!("{err:#}"), "Registry listener could not connect; retrying.");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = shutdown.changed() => return,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            backoff = Duration::from_millis(100);
            // Whatever changed while nobody listened.
            self.reload_logged().await;
            loop {
                tokio::select! {
                    announced = listener.next() => match announced {
                        true => self.reload_logged().await,
                        // The connection dropped: listen again, then reload.
                        false => break,
                    },
                    _ = tokio::time::sleep(FOLLOW_RELOAD_INTERVAL) => self.reload_logged().await,
                    _ = shutdown.changed() => return,
                }
            }
        }
    }

    /// The tenant `id`; where other instances change the registry, if this
    /// instance has not heard of it, after reading the store again (another instance may have made it
    /// a moment ago). For admin changes and the rare miss of a consumer,
    /// not for authentication (an unknown key must not cost a reload).
    pub async fn tenant_fresh(&self, id: &str) -> Option<Arc<TenantRow>> {
        if self.tenant(id).is_none() && self.db.changed_elsewhere() {
            self.reload_logged().await;
        }
        self.tenant(id)
    }

    /// The plan `name`, read again like [`Registry::tenant_fresh`].
    async fn plan_fresh(&self, name: &str) -> Option<Arc<Plan>> {
        if self.plan(name).is_none() && self.db.changed_elsewhere() {
            self.reload_logged().await;
        }
        self.plan(name)
    }

    async fn reload_logged(&self) {
        if let Err(err) = self.reload().await {
            tracing::warn!(error = %format!("{err:#}"), "Could not reload plans, tenants and keys; keeping the cached ones.");
        }
    }

    // ----- plans -----

    pub fn plan(&self, name: &str) -> Option<Arc<Plan>> {
        self.plans.read().expect("plans lock").get(name).cloned()
    }

    pub fn plans(&self) -> Vec<Plan> {
        let mut plans: Vec<Plan> = self
            .plans
            .read()
            .expect("plans lock")
            .values()
            .map(|p| (**p).clone())
            .collect();
        plans.sort_by(|a, b| a.name.cmp(&b.name));
        plans
    }

    /// Creates or replaces a plan; returns true when it was created.
    pub async fn put_plan(&self, plan: Plan) -> Result<bool, RegistryError> {
        if !is_valid_identifier(&plan.name) {
            return Err(invalid("name", IDENTIFIER_RULE));
        }
        validate_plan_figures(&plan).map_err(|e| {
            let text = e.to_string();
            let field = text.split_whitespace().next().unwrap_or("plan").to_owned();
            RegistryError::Invalid {
                field,
                message: text,
            }
        })?;
        let _changing = self.changing.lock().await;
        self.db
            .write_plan(&plan, PlanSource::Admin, now_ms())
            .await?;
        let created = self
            .plans
            .write()
            .expect("plans lock")
            .insert(plan.name.clone(), Arc::new(plan))
            .is_none();
        self.announce("plan").await;
        Ok(created)
    }

    // ----- tenants -----

    /// Sets the retention of tenants that set none (`retention.default_days`).
    pub fn set_retention_default(&self, days: u16) {
        self.retention_default.store(
            days.clamp(MIN_RETENTION_DAYS, MAX_RETENTION_DAYS),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// The retention of tenants that set none.
    pub fn retention_default(&self) -> u16 {
        self.retention_default
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Every tenant's id with the retention in force for it, in days.
    pub fn retention_by_tenant(&self) -> Vec<(String, u16)> {
        let default = self.retention_default();
        let mut list: Vec<(String, u16)> = self
            .tenants
            .read()
            .expect("tenants lock")
            .values()
            .map(|t| (t.id.clone(), t.retention_days.unwrap_or(default)))
            .collect();
        list.sort();
        list
    }

    pub fn tenant(&self, id: &str) -> Option<Arc<TenantRow>> {
        self.tenants.read().expect("tenants lock").get(id).cloned()
    }

    pub fn tenants(&self) -> Vec<Tenant> {
        let mut list: Vec<Tenant> = self
            .tenants
            .read()
            .expect("tenants lock")
            .values()
            .map(|t| t.view(self.retention_default()))
            .collect();
        list.sort_by(|a, b| a.id.cmp(&b.id));
        list
    }

    pub async fn create_tenant(
        &self,
        id: &str,
        name: &str,
        plan: &str,
        options: TenantOptions,
    ) -> Result<Tenant, RegistryError> {
        if !is_valid_identifier(id) {
            return Err(invalid("id", IDENTIFIER_RULE));
        }
        if name.trim().is_empty() || name.chars().count() > 200 {
            return Err(invalid("name", "must be 1-200 characters"));
        }
        if self.plan_fresh(plan).await.is_none() {
            return Err(invalid("plan", format!("no plan named {plan:?}")));
        }
        let now = now_ms();
        let row = TenantRow {
            id: id.to_owned(),
            name: name.to_owned(),
            plan: plan.to_owned(),
            status: TenantStatus::Active,
            isolation: options.isolation,
            max_concurrent_consumers: check_consumers(options.max_concurrent_consumers)?,
            unsubscribe_default: false,
            unsubscribe_mailto: None,
            retention_days: options.retention_days.map(check_retention).transpose()?,
            created_at: now,
            updated_at: now,
        };
        // The primary key decides races between two creates of the same id.
        let _changing = self.changing.lock().await;
        let inserted = self
            .db
            .insert_tenant(&registry::TenantInsert {
                id: &row.id,
                name: &row.name,
                plan: &row.plan,
                status: row.status,
                isolation: row.isolation,
                max_concurrent_consumers: row.max_concurrent_consumers,
                retention_days: row.retention_days,
                created_at: row.created_at,
            })
            .await?;
        if !inserted {
            return Err(RegistryError::Conflict(format!(
                "tenant {id:?} already exists"
            )));
        }
        let view = row.view(self.retention_default());
        self.tenants
            .write()
            .expect("tenants lock")
            .insert(row.id.clone(), Arc::new(row));
        self.announce("tenant").await;
        Ok(view)
    }

    pub async fn update_tenant(
        &self,
        id: &str,
        change: &TenantChange,
    ) -> Result<Tenant, RegistryError> {
        let plan = change.plan.as_deref();
        let status = change.status;
        let consumers = change
            .max_concurrent_consumers
            .map(check_consumers)
            .transpose()?;
        if let Some(Some(days)) = change.retention_days {
            check_retention(days)?;
        }
        if let Some(mailto) = change.unsubscribe_mailto.as_deref()
            && !mailto.is_empty()
            && !crate::message::is_email_address(mailto)
        {
            return Err(invalid(
                "unsubscribe_mailto",
                "must be an email address like unsubscribe@example.com (\"\" removes it)",
            ));
        }
        self.tenant_fresh(id)
            .await
            .ok_or_else(|| RegistryError::NotFound(format!("tenant {id:?}")))?;
        if let Some(plan) = plan
            && self.plan_fresh(plan).await.is_none()
        {
            return Err(invalid("plan", format!("no plan named {plan:?}")));
        }
        // Only the fields given change: another instance may have changed
        // the other one a moment ago.
        let _changing = self.changing.lock().await;
        let stored = self
            .db
            .update_tenant(
                id,
                &registry::TenantUpdate {
                    plan,
                    status,
                    isolation: change.isolation,
                    max_concurrent_consumers: consumers,
                    unsubscribe_default: change.unsubscribe_default,
                    unsubscribe_mailto: change.unsubscribe_mailto.as_deref(),
                    retention_days: change.retention_days,
                },
                now_ms(),
            )
            .await?;
        let Some(stored) = stored else {
            return Err(RegistryError::NotFound(format!("tenant {id:?}")));
        };
        let row = TenantRow::from_stored(stored)?;
        let view = row.view(self.retention_default());
        self.tenants
            .write()
            .expect("tenants lock")
            .insert(id.to_owned(), Arc::new(row));
        self.announce("tenant").await;
        Ok(view)
    }

    /// Deletes a tenant with its keys, message history and idempotency
    /// keys. Refused (409) while any of its messages is still undelivered
    /// (`queued`, `sending`, `retrying`): otherwise a tenant re-created under
    /// the same id could inherit them. Pause or disable it and let its lane
    /// drain, or redrive/inspect dead letters first. Its dead letters and
    /// other waiting copies are erased from the queue first, so no body of
    /// a deleted tenant's message is left behind.
    pub async fn delete_tenant(&self, id: &str) -> Result<(), RegistryError> {
        if self.tenant_fresh(id).await.is_none() {
            return Err(RegistryError::NotFound(format!("tenant {id:?}")));
        }
        let _changing = self.changing.lock().await;
        let pending = self.db.undelivered(id).await?;
        if pending > 0 {
            return Err(undelivered(id, pending));
        }
        if let Some(queues) = self.isolation_sink.get() {
            queues.erase_waiting(id, None).await?;
        }
        match self.db.delete_tenant(id).await? {
            TenantDeletion::Deleted => {}
            TenantDeletion::NotFound => {
                return Err(RegistryError::NotFound(format!("tenant {id:?}")));
            }
            TenantDeletion::Undelivered(pending) => return Err(undelivered(id, pending)),
        }
        self.keys
            .write()
            .expect("keys lock")
            .retain(|_, key| key.tenant_id != id);
        self.tenants.write().expect("tenants lock").remove(id);
        self.senders.write().expect("senders lock").remove(id);
        self.announce("tenant").await;
        // No old copy of the deleted rows is left in the SQLite file or
        // its log.
        match self.db.scrub_file(true).await {
            Ok(scrubbed) if scrubbed.log_truncated => {}
            Ok(_) => tracing::warn!(
                tenant = id,
                "The store's log could not be truncated after deleting a tenant (a reader held it); the next retention run that erases something truncates it."
            ),
            Err(err) => {
                tracing::warn!(tenant = id, error = %err, "The store's log could not be truncated after deleting a tenant.")
            }
        }
        Ok(())
    }

    // ----- sender identities -----

    fn senders_cached(&self, tenant_id: &str) -> Arc<Vec<SenderIdentity>> {
        self.senders
            .read()
            .expect("senders lock")
            .get(tenant_id)
            .cloned()
            .unwrap_or_default()
    }

    /// A tenant's sender identities, oldest first.
    pub async fn senders_of(&self, tenant_id: &str) -> Result<Vec<SenderIdentity>, RegistryError> {
        if self.tenant_fresh(tenant_id).await.is_none() {
            return Err(RegistryError::NotFound(format!("tenant {tenant_id:?}")));
        }
        Ok(self.senders_cached(tenant_id).as_ref().clone())
    }

    /// Reads the tenant's identities again into the cache, after a change.
    async fn refresh_senders(&self, tenant_id: &str) -> anyhow::Result<Vec<SenderIdentity>> {
        let list = self
            .db
            .senders_of(tenant_id)
            .await?
            .into_iter()
            .map(sender_from_row)
            .collect::<anyhow::Result<Vec<_>>>()?;
        self.senders
            .write()
            .expect("senders lock")
            .insert(tenant_id.to_owned(), Arc::new(list.clone()));
        Ok(list)
    }

    /// Gives `tenant_id` a sender identity.
    pub async fn add_sender(
        &self,
        tenant_id: &str,
        input: &NewSender,
    ) -> Result<SenderIdentity, RegistryError> {
        if self.tenant_fresh(tenant_id).await.is_none() {
            return Err(RegistryError::NotFound(format!("tenant {tenant_id:?}")));
        }
        senders::validate(input)?;
        let _changing = self.changing.lock().await;
        if self.senders_cached(tenant_id).len() >= senders::MAX_SENDERS_PER_TENANT {
            return Err(RegistryError::Conflict(format!(
                "tenant {tenant_id:?} has {} sender identities, the most it may have; remove one first",
                senders::MAX_SENDERS_PER_TENANT
            )));
        }
        let row = SenderRow {
            // Time-ordered (UUIDv7), so a listing by id is oldest first.
            id: format!("snd_{}", uuid::Uuid::now_v7().simple()),
            tenant_id: tenant_id.to_owned(),
            channel: input.channel.as_str().to_owned(),
            sender: input.from.clone(),
            display_name: input.display_name.clone(),
            reply_to: (!input.reply_to.is_empty())
                .then(|| serde_json::to_string(&input.reply_to))
                .transpose()
                .map_err(anyhow::Error::from)?,
            configuration_set: input.configuration_set.clone(),
            messaging_service_sid: input.messaging_service_sid.clone(),
            is_default: input.default,
            created_at: now_ms(),
        };
        self.db.insert_sender(&row).await?;
        let list = self.refresh_senders(tenant_id).await?;
        self.announce("sender").await;
        list.into_iter()
            .find(|sender| sender.id == row.id)
            .ok_or_else(|| {
                RegistryError::Internal(anyhow::anyhow!("the new identity was not read back"))
            })
    }

    /// Makes identity `id` the default for its channel, or no default.
    pub async fn set_default_sender(
        &self,
        tenant_id: &str,
        id: &str,
        default: bool,
    ) -> Result<SenderIdentity, RegistryError> {
        let _changing = self.changing.lock().await;
        if !self.db.set_default_sender(tenant_id, id, default).await? {
            return Err(RegistryError::NotFound(format!(
                "sender identity {id:?} of tenant {tenant_id:?}"
            )));
        }
        let list = self.refresh_senders(tenant_id).await?;
        self.announce("sender").await;
        list.into_iter()
            .find(|sender| sender.id == id)
            .ok_or_else(|| RegistryError::NotFound(format!("sender identity {id:?}")))
    }

    /// Removes identity `id`; messages accepted with it still send with it.
    pub async fn remove_sender(&self, tenant_id: &str, id: &str) -> Result<(), RegistryError> {
        let _changing = self.changing.lock().await;
        if !self.db.delete_sender(tenant_id, id).await? {
            return Err(RegistryError::NotFound(format!(
                "sender identity {id:?} of tenant {tenant_id:?}"
            )));
        }
        self.refresh_senders(tenant_id).await?;
        self.announce("sender").await;
        Ok(())
    }

    // ----- keys -----

    /// Issues a key of `kind` for `tenant_id`; returns `(key id, full
    /// key)`. The full key exists only in this return value.
    pub async fn issue_key(
        &self,
        tenant_id: &str,
        kind: KeyKind,
    ) -> Result<(String, String), RegistryError> {
        if self.tenant_fresh(tenant_id).await.is_none() {
            return Err(RegistryError::NotFound(format!("tenant {tenant_id:?}")));
        }
        let key_id = random_hex(8);
        let secret = random_hex(32);
        let secret_hash = hash_secret(&secret);
        let _changing = self.changing.lock().await;
        self.db
            .insert_key(&registry::KeyInsert {
                id: &key_id,
                tenant_id,
                secret_hash_hex: &hex::encode(secret_hash),
                kind: kind.as_str(),
                created_at: now_ms(),
            })
            .await?;
        self.keys.write().expect("keys lock").insert(
            key_id.clone(),
            KeyEntry {
                tenant_id: tenant_id.to_owned(),
                secret_hash,
                test: kind == KeyKind::Test,
            },
        );
        self.announce("key").await;
        let prefix = match kind {
            KeyKind::Live => KEY_PREFIX,
            KeyKind::Test => TEST_KEY_PREFIX,
        };
        let full = format!("{prefix}{key_id}_{secret}");
        Ok((key_id, full))
    }

    pub async fn revoke_key(&self, tenant_id: &str, key_id: &str) -> Result<(), RegistryError> {
        let _changing = self.changing.lock().await;
        let revoked = self.db.revoke_key(tenant_id, key_id, now_ms()).await?;
        if revoked == 0 {
            return Err(RegistryError::NotFound(format!(
                "active key {key_id:?} of tenant {tenant_id:?}"
            )));
        }
        self.keys.write().expect("keys lock").remove(key_id);
        self.announce("key").await;
        Ok(())
    }

    /// A tenant's keys, revoked ones too, each with its last use as the
    /// store has it or, if later, as this instance noted it since.
    pub async fn keys_of(&self, tenant_id: &str) -> anyhow::Result<Vec<KeyInfo>> {
        let rows = self.db.keys_of(tenant_id).await?;
        let noted = self.key_uses.lock().expect("key uses lock");
        Ok(rows
            .into_iter()
            .map(|(id, created, revoked, kind, used)| {
                let used = used.max(noted.get(&id).copied());
                KeyInfo {
                    kind: if kind == KeyKind::Test.as_str() {
                        KeyKind::Test
                    } else {
                        KeyKind::Live
                    },
                    created_at: crate::model::ms_to_rfc3339(created),
                    revoked_at: revoked.map(crate::model::ms_to_rfc3339),
                    last_used_at: used.map(crate::model::ms_to_rfc3339),
                    id,
                }
            })
            .collect())
    }

    /// Notes that key `key_id` authenticated a request now.
    fn note_key_use(&self, key_id: &str) {
        let now = now_ms();
        let mut uses = self.key_uses.lock().expect("key uses lock");
        match uses.get_mut(key_id) {
            Some(at) => *at = now,
            None => {
                uses.insert(key_id.to_owned(), now);
            }
        }
    }

    /// Writes the key uses noted since the last call to the store. A
    /// failed write puts them back for the next call.
    pub async fn flush_key_uses(&self) -> anyhow::Result<()> {
        let uses: Vec<(String, i64)> =
            std::mem::take(&mut *self.key_uses.lock().expect("key uses lock"))
                .into_iter()
                .collect();
        if uses.is_empty() {
            return Ok(());
        }
        if let Err(err) = self.db.note_key_uses(&uses).await {
            let mut pending = self.key_uses.lock().expect("key uses lock");
            for (id, at) in uses {
                let slot = pending.entry(id).or_insert(at);
                *slot = (*slot).max(at);
            }
            return Err(err.into());
        }
        Ok(())
    }

    /// Writes key uses to the store every `every` until `shutdown`, and
    /// once more then.
    pub async fn keep_key_uses(
        self: Arc<Self>,
        every: Duration,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) {
        loop {
            let stopping = tokio::select! {
                _ = tokio::time::sleep(every) => false,
                _ = shutdown.changed() => true,
            };
            if let Err(err) = self.flush_key_uses().await {
                tracing::warn!(error = %format!("{err:#}"), "Could not write the API keys' last uses; they are kept for the next try.");
            }
            if stopping {
                return;
            }
        }
    }

    /// The tenant and plan behind a bearer key, if the key is valid and not
    /// revoked. Memory only; no I/O.
    pub fn authenticate(&self, key: &str) -> Option<Caller> {
        // Key ids are hex, so `test_` cannot begin a live key's id.
        let (rest, test) = match key.strip_prefix(TEST_KEY_PREFIX) {
            Some(rest) => (rest, true),
            None => (key.strip_prefix(KEY_PREFIX)?, false),
        };
        let (key_id, secret) = rest.split_once('_')?;
        let tenant_id = {
            let keys = self.keys.read().expect("keys lock");
            let entry = keys.get(key_id)?;
            if entry.secret_hash != hash_secret(secret) || entry.test != test {
                return None;
            }
            entry.tenant_id.clone()
        };
        self.note_key_use(key_id);
        let tenant = self.tenant(&tenant_id)?;
        let plan = self.plan(&tenant.plan)?;
        let senders = self.senders_cached(&tenant_id);
        Some(Caller {
            tenant,
            plan,
            senders,
            test,
        })
    }
}
