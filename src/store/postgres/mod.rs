//! The PostgreSQL store: the state of several instances in one database.
//!
//! Tables and columns are those of the SQLite store (`migrations/postgres`
//! mirrors `migrations/sqlite`); every statement on this engine lives in
//! this folder, one file per topic of the store's interface
//! ([`super::Backend`]). What differs from SQLite:
//!
//! - **The hot writes** (accepts with their outbox row and idempotency
//!   record; the `sending`, `sent` and failure status changes) go through
//!   [`PgWriter`], a task that takes everything waiting and commits it in
//!   one transaction of a few multi-row statements (`UNNEST` of arrays), so
//!   a busy instance makes one commit per group, not per message. As on
//!   SQLite, each piece is answered only after its group committed; if the
//!   group fails, each piece is tried again alone, so one bad piece fails by
//!   itself.
//! - **Changes reach every instance**: a registry change sends
//!   `NOTIFY fairlane_registry`; every instance listens and reloads its
//!   cache (see [`crate::tenants::Registry::follow`]).
//! - **Work that must run once** takes a transaction-scoped advisory lock
//!   ([`try_lock`]) or claims rows with `FOR UPDATE SKIP LOCKED`.

use std::time::Duration;

use anyhow::Context;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Postgres, Transaction};

/// Longest wait for a pooled connection before a query fails.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// Connections per instance: the writer's, the listener's, and readers.
const MAX_CONNECTIONS: u32 = 16;

/// Handle to the database; cheap to clone.
#[derive(Clone, Debug)]
pub struct PgDb {
    pub pool: PgPool,
    /// The URL, for the listener's own connection.
    url: String,
}

impl PgDb {
    /// Connects to `url` and runs the migrations (under sqlx's advisory
    /// lock, so instances starting together migrate once).
    pub async fn connect(url: &str) -> anyhow::Result<PgDb> {
        let options: PgConnectOptions = url
            .parse()
            .with_context(|| format!("storage.url {:?} is not a PostgreSQL URL", redact(url)))?;
        let pool = PgPoolOptions::new()
            .max_connections(MAX_CONNECTIONS)
            .min_connections(2)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            // Every statement is planned for its own arguments. Left to
            // itself, PostgreSQL keeps a generic plan after five runs of a
            // prepared statement; one made while `messages` was small (a
            // new deployment, before autovacuum's first ANALYZE) joins a
            // batch of ids by scanning the whole table, and keeps doing so
            // as it grows: measured in bench/several.sh, 60,000 messages,
            // 280 – 700 buffers per 10-id look-up and 400 µs of database
            // CPU per message, against 40 buffers and 160 µs planned each
            // time (planning costs ~0.1 ms per statement, a few per group).
            .connect_with(
                options
                    .application_name("fairlane")
                    .options([("plan_cache_mode", "force_custom_plan")]),
            )
            .await
            .with_context(|| format!("connecting to PostgreSQL at {}", redact(url)))?;
        sqlx::migrate!("./migrations/postgres")
            .run(&pool)
            .await
            .context("migrating the PostgreSQL database")?;
        Ok(PgDb {
            pool,
            url: url.to_owned(),
        })
    }

    pub async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }

    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// A listener on its own connection, subscribed to `channel`.
    pub async fn listen(&self, channel: &str) -> anyhow::Result<sqlx::postgres::PgListener> {
        let mut listener = sqlx::postgres::PgListener::connect(&self.url)
            .await
            .context("connecting the PostgreSQL listener")?;
        listener.listen(channel).await?;
        Ok(listener)
    }
}

/// `url` with any password replaced, for messages.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    match rest.split_once('@') {
        Some((credentials, host)) if credentials.contains(':') => {
            let user = credentials.split(':').next().unwrap_or("");
            format!("{scheme}://{user}:***@{host}")
        }
        _ => url.to_owned(),
    }
}

/// A transaction holding the advisory lock `key`, unless another instance
/// holds it now (`None`): the caller does its once-only work in it and
/// commits. The lock ends with the transaction, so a crashed holder never
/// keeps it.
pub async fn try_lock(
    db: &PgDb,
    key: i64,
) -> anyhow::Result<Option<Transaction<'static, Postgres>>> {
    let mut tx = db.pool.begin().await?;
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
        .bind(key)
        .fetch_one(&mut *tx)
        .await?;
    Ok(locked.then_some(tx))
}

/// Advisory lock keys of the jobs that run on one instance at a time.
pub mod locks {
    /// The outbox sweeper.
    pub const OUTBOX_SWEEP: i64 = 0x6661_6972_0001;
    /// Expiry of idempotency keys.
    pub const IDEMPOTENCY_PURGE: i64 = 0x6661_6972_0002;
    /// A retention run.
    pub const RETENTION: i64 = 0x6661_6972_0003;
    /// Folding usage deltas into usage rows.
    pub const USAGE_ROLL_UP: i64 = 0x6661_6972_0004;
}

mod admins;
mod attachments;
mod hot;
mod idempotency;
pub(crate) mod lanes;
pub(crate) mod lifecycle;
mod messages;
mod outbox;
pub(crate) mod receipts;
mod registry;
mod retention;
mod settings;
mod suppressions;
mod templates;
mod usage;
pub(crate) mod webhooks;
mod writer;
pub use writer::PgWriter;

#[cfg(test)]
pub(crate) mod tests;
