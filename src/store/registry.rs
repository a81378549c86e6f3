//! The registry's rows: plans, tenants and API keys (stored as hashes),
//! which `crate::tenants::Registry` serves from memory; and on PostgreSQL
//! the announcement that makes every instance reload them after a change.

use sqlx::postgres::PgListener;

use rusqlite::OptionalExtension;

use super::{Db, sqlite};
use crate::model::{Isolation, Plan, TenantStatus};

/// The channel registry changes are announced on.
const REGISTRY_CHANNEL: &str = "fairlane_registry";

/// A plan row: name, lane, rate per second, burst, daily quota, in-flight cap.
pub type PlanTuple = (String, String, f64, i64, i64, i64);
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

const TENANT_COLUMNS: &str = "id, name, plan, status, isolation, max_concurrent_consumers, \
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

const SENDER_COLUMNS: &str = "id, tenant_id, channel, sender, display_name, reply_to, \
     configuration_set, messaging_service_sid, is_default, created_at";

/// Plans, tenants, active keys and sender identities as stored.
pub struct RegistryRows {
    pub plans: Vec<PlanTuple>,
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

/// Plans, tenants and active keys as stored now: on PostgreSQL from one
/// snapshot (`REPEATABLE READ`), so a change committed between the three
/// reads is not half seen.
pub async fn read_all(db: &Db) -> anyhow::Result<RegistryRows> {
    const PLANS: &str =
        "SELECT name, lane, rate_per_second, burst, daily_quota, max_in_flight FROM plans";
    const KEYS: &str =
        "SELECT id, tenant_id, secret_hash, kind FROM api_keys WHERE revoked_at IS NULL";
    let tenants = format!("SELECT {TENANT_COLUMNS} FROM tenants");
    let senders = format!("SELECT {SENDER_COLUMNS} FROM sender_identities ORDER BY tenant_id, id");
    Ok(match db {
        Db::Sqlite(sqlite) => {
            sqlite
                .read(move |conn| {
                    let snapshot = conn.unchecked_transaction()?;
                    let all = |sql: &str| sqlite::prepare(&snapshot, sql);
                    let rows = RegistryRows {
                        plans: all(PLANS)?
                            .query_map([], sqlite::tuple)?
                            .collect::<Result<_, _>>()?,
                        tenants: all(&tenants)?
                            .query_map([], tenant_row)?
                            .collect::<Result<_, _>>()?,
                        keys: all(KEYS)?
                            .query_map([], sqlite::tuple)?
                            .collect::<Result<_, _>>()?,
                        senders: all(&senders)?
                            .query_map([], sender_row)?
                            .collect::<Result<_, _>>()?,
                    };
                    snapshot.finish()?;
                    Ok(rows)
                })
                .await?
        }
        Db::Postgres(pg) => {
            let mut tx = pg.pool.begin().await?;
            sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                .execute(&mut *tx)
                .await?;
            let rows = RegistryRows {
                plans: sqlx::query_as(PLANS).fetch_all(&mut *tx).await?,
                tenants: sqlx::query_as(sqlx::AssertSqlSafe(tenants))
                    .fetch_all(&mut *tx)
                    .await?,
                keys: sqlx::query_as(KEYS).fetch_all(&mut *tx).await?,
                senders: sqlx::query_as(sqlx::AssertSqlSafe(senders))
                    .fetch_all(&mut *tx)
                    .await?,
            };
            tx.commit().await?;
            rows
        }
    })
}

/// A [`StoredTenant`] from a rusqlite row of [`TENANT_COLUMNS`].
fn tenant_row(row: &rusqlite::Row) -> rusqlite::Result<StoredTenant> {
    Ok(StoredTenant {
        id: row.get(0)?,
        name: row.get(1)?,
        plan: row.get(2)?,
        status: row.get(3)?,
        isolation: row.get(4)?,
        max_concurrent_consumers: row.get(5)?,
        unsubscribe_default: row.get(6)?,
        unsubscribe_mailto: row.get(7)?,
        retention_days: row.get(8)?,
        created_at: row.get(9)?,
        updated_at: row.get(10)?,
    })
}

/// A [`SenderRow`] from a rusqlite row of [`SENDER_COLUMNS`].
fn sender_row(row: &rusqlite::Row) -> rusqlite::Result<SenderRow> {
    Ok(SenderRow {
        id: row.get(0)?,
        tenant_id: row.get(1)?,
        channel: row.get(2)?,
        sender: row.get(3)?,
        display_name: row.get(4)?,
        reply_to: row.get(5)?,
        configuration_set: row.get(6)?,
        messaging_service_sid: row.get(7)?,
        is_default: row.get(8)?,
        created_at: row.get(9)?,
    })
}

/// Creates or replaces a plan. A configured plan (`PlanSource::Config`)
/// does not replace one an admin has changed; an admin's always replaces.
pub async fn write_plan(db: &Db, plan: &Plan, source: PlanSource, now: i64) -> anyhow::Result<()> {
    let sql = match source {
        PlanSource::Config => {
            "INSERT INTO plans (name, lane, rate_per_second, burst, daily_quota, max_in_flight, source, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, 'config', $7) \
             ON CONFLICT(name) DO UPDATE SET lane = excluded.lane, rate_per_second = excluded.rate_per_second, \
             burst = excluded.burst, daily_quota = excluded.daily_quota, max_in_flight = excluded.max_in_flight, \
             updated_at = excluded.updated_at WHERE plans.source = 'config'"
        }
        PlanSource::Admin => {
            "INSERT INTO plans (name, lane, rate_per_second, burst, daily_quota, max_in_flight, source, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, 'admin', $7) \
             ON CONFLICT(name) DO UPDATE SET lane = excluded.lane, rate_per_second = excluded.rate_per_second, \
             burst = excluded.burst, daily_quota = excluded.daily_quota, max_in_flight = excluded.max_in_flight, \
             source = 'admin', updated_at = excluded.updated_at"
        }
    };
    match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![
                plan.name.clone(),
                plan.lane.as_str().to_owned(),
                plan.rate_per_second,
                plan.burst as i64,
                plan.daily_quota as i64,
                plan.max_in_flight as i64,
                now
            ];
            db.execute(sql, args).await?;
        }
        Db::Postgres(db) => {
            sqlx::query(sql)
                .bind(&plan.name)
                .bind(plan.lane.as_str())
                .bind(plan.rate_per_second)
                .bind(plan.burst as i64)
                .bind(plan.daily_quota as i64)
                .bind(plan.max_in_flight as i64)
                .bind(now)
                .execute(&db.pool)
                .await?;
        }
    }
    Ok(())
}

/// Inserts a tenant; false when one with its id exists (the primary key
/// decides races between two creates of the same id).
pub async fn insert_tenant(db: &Db, tenant: &TenantInsert<'_>) -> anyhow::Result<bool> {
    const INSERT: &str = "INSERT INTO tenants (id, name, plan, status, isolation, \
         max_concurrent_consumers, created_at, updated_at, retention_days) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $7, $8) ON CONFLICT (id) DO NOTHING";
    let inserted = match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![
                tenant.id.to_owned(),
                tenant.name.to_owned(),
                tenant.plan.to_owned(),
                tenant.status.as_str().to_owned(),
                tenant.isolation.as_str().to_owned(),
                i64::from(tenant.max_concurrent_consumers),
                tenant.created_at,
                tenant.retention_days.map(i64::from)
            ];
            db.execute(INSERT, args).await? as u64
        }
        Db::Postgres(db) => sqlx::query(INSERT)
            .bind(tenant.id)
            .bind(tenant.name)
            .bind(tenant.plan)
            .bind(tenant.status.as_str())
            .bind(tenant.isolation.as_str())
            .bind(i64::from(tenant.max_concurrent_consumers))
            .bind(tenant.created_at)
            .bind(tenant.retention_days.map(i64::from))
            .execute(&db.pool)
            .await?
            .rows_affected(),
    };
    Ok(inserted == 1)
}

/// Changes only the fields given (another instance may have changed the
/// others a moment ago); returns the tenant's row after it, `None` when
/// there is no such tenant.
pub async fn update_tenant(
    db: &Db,
    id: &str,
    change: &TenantUpdate<'_>,
    now: i64,
) -> anyhow::Result<Option<StoredTenant>> {
    // Numbered parameters, in the order they are bound (SQLite's `?N`).
    let sql = format!(
        "UPDATE tenants SET plan = COALESCE(?1, plan), status = COALESCE(?2, status), \
         isolation = COALESCE(?5, isolation), \
         max_concurrent_consumers = COALESCE(?6, max_concurrent_consumers), \
         unsubscribe_default = COALESCE(?7, unsubscribe_default), \
         unsubscribe_mailto = CASE WHEN CAST(?8 AS TEXT) IS NULL THEN unsubscribe_mailto \
         WHEN CAST(?8 AS TEXT) = '' THEN NULL ELSE CAST(?8 AS TEXT) END, \
         retention_days = CASE WHEN CAST(?9 AS BOOLEAN) THEN CAST(?10 AS BIGINT) ELSE retention_days END, \
         updated_at = ?3 WHERE id = ?4 RETURNING {TENANT_COLUMNS}"
    );
    Ok(match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![
                change.plan.map(str::to_owned),
                change.status.map(|s| s.as_str().to_owned()),
                now,
                id.to_owned(),
                change.isolation.map(|i| i.as_str().to_owned()),
                change.max_concurrent_consumers.map(i64::from),
                change.unsubscribe_default,
                change.unsubscribe_mailto.map(str::to_owned),
                change.retention_days.is_some(),
                change.retention_days.flatten().map(i64::from)
            ];
            db.transact(move |tx| {
                Ok(sqlite::prepare(tx, &sql)?
                    .query_row(rusqlite::params_from_iter(args), tenant_row)
                    .optional()?)
            })
            .await?
        }
        Db::Postgres(db) => {
            sqlx::query_as(sqlx::AssertSqlSafe(sql.replace('?', "$")))
                .bind(change.plan)
                .bind(change.status.map(|s| s.as_str()))
                .bind(now)
                .bind(id)
                .bind(change.isolation.map(|i| i.as_str()))
                .bind(change.max_concurrent_consumers.map(i64::from))
                .bind(change.unsubscribe_default)
                .bind(change.unsubscribe_mailto)
                .bind(change.retention_days.is_some())
                .bind(change.retention_days.flatten().map(i64::from))
                .fetch_optional(&db.pool)
                .await?
        }
    })
}

/// Deletes a tenant with its keys, message history, events, webhook,
/// suppressions, sender identities, usage and idempotency keys, in one
/// transaction; refused while
/// any of its messages is undelivered (`scheduled`, `queued`, `sending`,
/// `retrying`): a scheduled one would otherwise be sent for a tenant that
/// no longer exists.
pub async fn delete_tenant(db: &Db, id: &str) -> anyhow::Result<TenantDeletion> {
    const PENDING: &str = "SELECT COUNT(*) FROM messages WHERE tenant_id = $1 \
         AND status IN ('scheduled', 'queued', 'sending', 'retrying')";
    const ERASE: [&str; 11] = [
        "DELETE FROM api_keys WHERE tenant_id = $1",
        "DELETE FROM idempotency_keys WHERE tenant_id = $1",
        "DELETE FROM messages WHERE tenant_id = $1",
        // The newest event of all stays, as a blank line: SQLite
        // gives a new row the highest id plus one, and an id used
        // again would sit behind webhook positions already past it.
        "DELETE FROM message_events WHERE tenant_id = $1 \
         AND id < (SELECT MAX(id) FROM message_events)",
        "UPDATE message_events SET tenant_id = '', message_id = '', detail = NULL, \
         provider_message_id = NULL WHERE tenant_id = $1",
        "DELETE FROM webhook_deliveries WHERE tenant_id = $1",
        "DELETE FROM webhooks WHERE tenant_id = $1",
        "DELETE FROM suppressions WHERE tenant_id = $1",
        "DELETE FROM sender_identities WHERE tenant_id = $1",
        "DELETE FROM usage WHERE tenant_id = $1",
        // Every message is settled, so each one reached its lane:
        // an outbox row still here only waits to be forgotten, and
        // it holds the message's text.
        "DELETE FROM outbox WHERE tenant_id = $1",
    ];
    const TENANT: &str = "DELETE FROM tenants WHERE id = $1";
    let deleted = |pending: i64, removed: u64| match (pending, removed) {
        (1.., _) => TenantDeletion::Undelivered(pending),
        (_, 0) => TenantDeletion::NotFound,
        _ => TenantDeletion::Deleted,
    };
    Ok(match db {
        Db::Sqlite(db) => {
            let id = id.to_owned();
            let (pending, removed) = db
                .transact(move |tx| {
                    let pending: i64 = tx.query_row(PENDING, [&id], |row| row.get(0))?;
                    if pending > 0 {
                        return Ok((pending, 0));
                    }
                    for statement in ERASE {
                        tx.execute(statement, [&id])?;
                    }
                    Ok((0, tx.execute(TENANT, [&id])? as u64))
                })
                .await?;
            deleted(pending, removed)
        }
        Db::Postgres(db) => {
            let mut tx = db.pool.begin().await?;
            let pending: i64 = sqlx::query_scalar(PENDING)
                .bind(id)
                .fetch_one(&mut *tx)
                .await?;
            if pending > 0 {
                return Ok(TenantDeletion::Undelivered(pending));
            }
            for statement in ERASE
                .into_iter()
                .chain(["DELETE FROM usage_deltas WHERE tenant_id = $1"])
            {
                sqlx::query(statement).bind(id).execute(&mut *tx).await?;
            }
            let removed = sqlx::query(TENANT).bind(id).execute(&mut *tx).await?;
            tx.commit().await?;
            deleted(0, removed.rows_affected())
        }
    })
}

/// Stores a key's id, the hex SHA-256 of its secret and its kind (`live`
/// or `test`).
pub async fn insert_key(
    db: &Db,
    key_id: &str,
    tenant_id: &str,
    secret_hash_hex: &str,
    kind: &str,
    now: i64,
) -> anyhow::Result<()> {
    const INSERT: &str = "INSERT INTO api_keys (id, tenant_id, secret_hash, created_at, kind) \
         VALUES ($1, $2, $3, $4, $5)";
    match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![
                key_id.to_owned(),
                tenant_id.to_owned(),
                secret_hash_hex.to_owned(),
                now,
                kind.to_owned()
            ];
            db.execute(INSERT, args).await?;
        }
        Db::Postgres(db) => {
            sqlx::query(INSERT)
                .bind(key_id)
                .bind(tenant_id)
                .bind(secret_hash_hex)
                .bind(now)
                .bind(kind)
                .execute(&db.pool)
                .await?;
        }
    }
    Ok(())
}

/// Revokes an active key of `tenant_id`; returns how many (0 or 1).
pub async fn revoke_key(db: &Db, tenant_id: &str, key_id: &str, now: i64) -> anyhow::Result<u64> {
    const REVOKE: &str = "UPDATE api_keys SET revoked_at = $1 \
         WHERE id = $2 AND tenant_id = $3 AND revoked_at IS NULL";
    Ok(match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![now, key_id.to_owned(), tenant_id.to_owned()];
            db.execute(REVOKE, args).await? as u64
        }
        Db::Postgres(db) => sqlx::query(REVOKE)
            .bind(now)
            .bind(key_id)
            .bind(tenant_id)
            .execute(&db.pool)
            .await?
            .rows_affected(),
    })
}

/// A tenant's keys, revoked ones too: id, created, revoked (ms), kind.
pub async fn keys_of(
    db: &Db,
    tenant_id: &str,
) -> anyhow::Result<Vec<(String, i64, Option<i64>, String)>> {
    const KEYS: &str = "SELECT id, created_at, revoked_at, kind FROM api_keys \
         WHERE tenant_id = $1 ORDER BY created_at, id";
    Ok(match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![tenant_id.to_owned()];
            db.rows(KEYS, args, sqlite::tuple).await?
        }
        Db::Postgres(db) => {
            sqlx::query_as(KEYS)
                .bind(tenant_id)
                .fetch_all(&db.pool)
                .await?
        }
    })
}

/// Stores a sender identity; when it is a default, the tenant's previous
/// default for its channel stops being one in the same transaction.
pub async fn insert_sender(db: &Db, row: &SenderRow) -> anyhow::Result<()> {
    const UNSET: &str = "UPDATE sender_identities SET is_default = FALSE \
         WHERE tenant_id = $1 AND channel = $2 AND is_default";
    const INSERT: &str = "INSERT INTO sender_identities (id, tenant_id, channel, sender, \
         display_name, reply_to, configuration_set, messaging_service_sid, is_default, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)";
    match db {
        Db::Sqlite(db) => {
            let row = row.clone();
            db.transact(move |tx| {
                if row.is_default {
                    tx.execute(UNSET, rusqlite::params![row.tenant_id, row.channel])?;
                }
                tx.execute(
                    INSERT,
                    rusqlite::params![
                        row.id,
                        row.tenant_id,
                        row.channel,
                        row.sender,
                        row.display_name,
                        row.reply_to,
                        row.configuration_set,
                        row.messaging_service_sid,
                        row.is_default,
                        row.created_at
                    ],
                )?;
                Ok(())
            })
            .await?;
        }
        Db::Postgres(db) => {
            let mut tx = db.pool.begin().await?;
            if row.is_default {
                sqlx::query(UNSET)
                    .bind(&row.tenant_id)
                    .bind(&row.channel)
                    .execute(&mut *tx)
                    .await?;
            }
            sqlx::query(INSERT)
                .bind(&row.id)
                .bind(&row.tenant_id)
                .bind(&row.channel)
                .bind(&row.sender)
                .bind(&row.display_name)
                .bind(&row.reply_to)
                .bind(&row.configuration_set)
                .bind(&row.messaging_service_sid)
                .bind(row.is_default)
                .bind(row.created_at)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
        }
    }
    Ok(())
}

/// Makes identity `id` of `tenant_id` its channel's default (`default`) or
/// no default; false when the tenant has no such identity.
pub async fn set_default_sender(
    db: &Db,
    tenant_id: &str,
    id: &str,
    default: bool,
) -> anyhow::Result<bool> {
    const CHANNEL: &str = "SELECT channel FROM sender_identities WHERE tenant_id = $1 AND id = $2";
    const UNSET_OTHERS: &str = "UPDATE sender_identities SET is_default = FALSE \
         WHERE tenant_id = $1 AND channel = $2 AND is_default AND id <> $3";
    const SET: &str = "UPDATE sender_identities SET is_default = $1 WHERE id = $2";
    match db {
        Db::Sqlite(db) => {
            let (tenant_id, id) = (tenant_id.to_owned(), id.to_owned());
            db.transact(move |tx| {
                let channel: Option<String> = tx
                    .query_row(CHANNEL, [&tenant_id, &id], |row| row.get(0))
                    .optional()?;
                let Some(channel) = channel else {
                    return Ok(false);
                };
                if default {
                    tx.execute(UNSET_OTHERS, [&tenant_id, &channel, &id])?;
                }
                tx.execute(SET, rusqlite::params![default, id])?;
                Ok(true)
            })
            .await
        }
        Db::Postgres(db) => {
            let mut tx = db.pool.begin().await?;
            let channel: Option<String> = sqlx::query_scalar(CHANNEL)
                .bind(tenant_id)
                .bind(id)
                .fetch_optional(&mut *tx)
                .await?;
            let Some(channel) = channel else {
                return Ok(false);
            };
            if default {
                sqlx::query(UNSET_OTHERS)
                    .bind(tenant_id)
                    .bind(&channel)
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
            }
            sqlx::query(SET)
                .bind(default)
                .bind(id)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(true)
        }
    }
}

/// Removes identity `id` of `tenant_id`; false when there was none.
pub async fn delete_sender(db: &Db, tenant_id: &str, id: &str) -> anyhow::Result<bool> {
    const REMOVE: &str = "DELETE FROM sender_identities WHERE tenant_id = $1 AND id = $2";
    let removed = match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![tenant_id.to_owned(), id.to_owned()];
            db.execute(REMOVE, args).await? as u64
        }
        Db::Postgres(db) => sqlx::query(REMOVE)
            .bind(tenant_id)
            .bind(id)
            .execute(&db.pool)
            .await?
            .rows_affected(),
    };
    Ok(removed > 0)
}

/// A tenant's sender identities, oldest first.
pub async fn senders_of(db: &Db, tenant_id: &str) -> anyhow::Result<Vec<SenderRow>> {
    let sql =
        format!("SELECT {SENDER_COLUMNS} FROM sender_identities WHERE tenant_id = $1 ORDER BY id");
    Ok(match db {
        Db::Sqlite(db) => {
            db.rows(sql, sqlite::args![tenant_id.to_owned()], sender_row)
                .await?
        }
        Db::Postgres(db) => {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(tenant_id)
                .fetch_all(&db.pool)
                .await?
        }
    })
}

/// Tells the other instances that the registry changed (`what`, for
/// logs). Nothing to tell on SQLite, where there are none.
pub async fn announce(db: &Db, what: &str) -> anyhow::Result<()> {
    if let Db::Postgres(pg) = db {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(REGISTRY_CHANNEL)
            .bind(what)
            .execute(&pg.pool)
            .await?;
    }
    Ok(())
}

/// Hears the announcements of [`announce`], on a connection of its own.
pub struct RegistryListener(PgListener);

impl RegistryListener {
    /// Waits for the next announcement: true when one came, false when the
    /// connection dropped (listen again, then reload).
    pub async fn next(&mut self) -> bool {
        matches!(self.0.try_recv().await, Ok(Some(_)))
    }
}

/// Listens for registry announcements; fails on SQLite, which has none
/// (see [`Db::is_shared`]).
pub async fn listen(db: &Db) -> anyhow::Result<RegistryListener> {
    match db {
        Db::Postgres(pg) => Ok(RegistryListener(pg.listen(REGISTRY_CHANNEL).await?)),
        Db::Sqlite(_) => anyhow::bail!("a SQLite store has no other instances to hear from"),
    }
}
