//! Durable state: tenants, plans, API keys, message status and events,
//! idempotency keys, suppressions, webhooks' rows and the SQS outbox. Every
//! statement of the service's own tables lives under this folder; nothing
//! above it writes SQL or asks which database it talks to.
//!
//! Two backends keep it, chosen by `storage.url`: one SQLite file
//! ([`sqlite`], the default, one instance) or a PostgreSQL database
//! ([`postgres`], shared by several instances; the lanes are then SQS
//! queues). [`Db`] is the handle the rest of the service holds; the modules
//! beside it are the operations, in the domain's words. Rare reads and
//! writes are written once, in SQL both engines take (`$1` parameters,
//! `ON CONFLICT`, `RETURNING`), and run on whichever pool the store has
//! ([`on_pool!`], [`in_transaction!`]); what differs per engine lives in
//! the backend's folder. The hot writes go through one [`Writer`], which
//! hands them to the backend's group-committing writer.
//!
//! The embedded queue keeps its own tables in the SQLite file and runs its
//! work on the SQLite writer ([`sqlite::writer`]).

mod delivery;
mod error;
pub mod events;
mod hot;
pub mod idempotency;
pub(crate) mod lifecycle;
pub mod messages;
pub mod outbox;
pub mod postgres;
pub mod receipts;
pub mod registry;
pub mod retention;
pub mod sqlite;
mod staging;
mod streak;
pub mod suppressions;
pub mod usage;
pub mod webhooks;

pub use delivery::{
    BeforeSend, Called, CallsRecord, PassRooms, SendCheck, StreamRead, TakenCalls, TenantRoom,
};
pub use error::StoreError;
pub use hot::Writer;
pub use sqlite::SqliteDb;
pub(crate) use staging::group_span;
pub use staging::{AcceptEntry, AfterCommit, NotDurable, QueueRows, Staging};
pub use streak::{FailureStreak, WriteFailed};

use std::path::Path;

pub use crate::config::{is_postgres_url, sqlite_path};

/// The store, on one backend or the other.
#[derive(Clone, Debug)]
pub enum Db {
    Sqlite(SqliteDb),
    Postgres(postgres::PgDb),
}

/// Runs the same sqlx expression on whichever pool the store has: `$pool`
/// is the SQLite `read` or `write` pool (as `$side` says) or the PostgreSQL
/// pool. The SQL must suit both engines (`$1` parameters).
macro_rules! on_pool {
    ($db:expr, $side:ident, |$pool:ident| $body:expr) => {
        match $db {
            $crate::store::Db::Sqlite(sqlite) => {
                let $pool = &sqlite.$side;
                $body
            }
            $crate::store::Db::Postgres(pg) => {
                let $pool = &pg.pool;
                $body
            }
        }
    };
}
pub(crate) use on_pool;

/// Runs `$body` in a write transaction `$tx` on whichever store `$db` is,
/// and commits it; an early return (`?`) rolls it back. On SQLite it takes
/// the write turn first and begins `IMMEDIATE`, so it neither waits on
/// `SQLITE_BUSY` nor fails to upgrade a read. As with [`on_pool!`], the SQL
/// must suit both engines; `&mut *$tx` is the executor.
macro_rules! in_transaction {
    ($db:expr, |$tx:ident| $body:expr) => {
        match $db {
            $crate::store::Db::Sqlite(sqlite) => {
                let _turn = sqlite.write_turn().await;
                let mut $tx = sqlite.write.begin_with("BEGIN IMMEDIATE").await?;
                let value = $body;
                $tx.commit().await?;
                value
            }
            $crate::store::Db::Postgres(pg) => {
                let mut $tx = pg.pool.begin().await?;
                let value = $body;
                $tx.commit().await?;
                value
            }
        }
    };
}
pub(crate) use in_transaction;

impl Db {
    /// Opens the store `url` names (`sqlite://PATH`, `postgres://…`),
    /// creating and migrating it as needed.
    pub async fn connect(url: &str, fsync: bool) -> anyhow::Result<Db> {
        if is_postgres_url(url) {
            Ok(Db::Postgres(postgres::PgDb::connect(url).await?))
        } else {
            Self::open(&sqlite_path(url), fsync).await
        }
    }

    /// Opens (creating if needed) and migrates the SQLite file at `path`.
    pub async fn open(path: &Path, fsync: bool) -> anyhow::Result<Db> {
        Ok(Db::Sqlite(SqliteDb::open(path, fsync).await?))
    }

    /// The SQLite handles, when the store is a SQLite file.
    pub fn sqlite(&self) -> Option<&SqliteDb> {
        match self {
            Db::Sqlite(db) => Some(db),
            Db::Postgres(_) => None,
        }
    }

    /// The PostgreSQL handle, when the store is a PostgreSQL database.
    pub fn postgres(&self) -> Option<&postgres::PgDb> {
        match self {
            Db::Sqlite(_) => None,
            Db::Postgres(db) => Some(db),
        }
    }

    /// Whether several instances may share this store (PostgreSQL); a
    /// SQLite file belongs to one.
    pub fn is_shared(&self) -> bool {
        matches!(self, Db::Postgres(_))
    }

    /// `sqlite` or `postgres`, for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Db::Sqlite(_) => "sqlite",
            Db::Postgres(_) => "postgres",
        }
    }

    /// True when the store answers a trivial query.
    pub async fn ping(&self) -> bool {
        match self {
            Db::Sqlite(db) => db.ping().await,
            Db::Postgres(db) => db.ping().await,
        }
    }

    /// Reads a value from the `settings` table.
    pub async fn setting(&self, key: &str) -> anyhow::Result<Option<String>> {
        Ok(on_pool!(self, write, |pool| {
            sqlx::query_scalar::<_, String>("SELECT value FROM settings WHERE key = $1")
                .bind(key)
                .fetch_optional(pool)
                .await?
        }))
    }

    /// Writes a value to the `settings` table.
    pub async fn set_setting(&self, key: &str, value: &str) -> anyhow::Result<()> {
        on_pool!(self, write, |pool| {
            sqlx::query(
                "INSERT INTO settings(key, value) VALUES ($1, $2) \
                 ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            )
            .bind(key)
            .bind(value)
            .execute(pool)
            .await?
            .rows_affected()
        });
        Ok(())
    }

    /// The value of `key` in the `settings` table, storing `value` first
    /// when there is none; instances starting together agree on one.
    pub async fn setting_or_insert(&self, key: &str, value: &str) -> anyhow::Result<String> {
        on_pool!(self, write, |pool| {
            sqlx::query(
                "INSERT INTO settings(key, value) VALUES ($1, $2) ON CONFLICT(key) DO NOTHING",
            )
            .bind(key)
            .bind(value)
            .execute(pool)
            .await?
            .rows_affected()
        });
        self.setting(key)
            .await?
            .ok_or_else(|| anyhow::anyhow!("setting {key} vanished after it was written"))
    }

    pub async fn close(&self) {
        match self {
            Db::Sqlite(db) => db.close().await,
            Db::Postgres(db) => db.close().await,
        }
    }
}
