//! Durable state: tenants, plans, API keys, message status, idempotency
//! keys, the SQS outbox and (on the embedded backend) the queues.
//!
//! Two backends keep it, chosen by `storage.url`: one SQLite file
//! ([`SqliteDb`], the default, one instance) or a PostgreSQL database
//! ([`postgres::PgDb`], shared by several instances; the lanes are then SQS
//! queues). [`Db`] is the handle the rest of the service holds. Rare reads
//! and writes are written once, in SQL both engines take (`$1` parameters,
//! `ON CONFLICT`, `RETURNING`), and run on whichever pool the store has
//! ([`on_pool!`]); the hot writes have one writer per backend that commits
//! them in groups.
//!
//! SQLite allows one writer at a time. Every hot write (accepts, the
//! embedded queue's receives, deletes, deferrals and DLQ moves, status
//! changes) goes through the one store writer ([`writer::StoreWriter`]),
//! a thread with a connection of its own that commits them in groups. Rare
//! writes (admin changes, the outbox's bookkeeping) use sqlx's pool of
//! exactly one write connection; the store writer takes [`Db::write_turn`],
//! a FIFO lock, for each group, and so do the rare writers that would
//! otherwise wait on `SQLITE_BUSY`. Take the turn before the pool
//! connection, never while holding it. Reads use a separate pool and, in
//! WAL mode, never wait for a writer.

pub mod events;
pub mod idempotency;
pub mod messages;
pub mod postgres;
pub mod status;
pub mod suppressions;
pub mod writer;

use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{QueryBuilder, Sqlite, SqlitePool};

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

    pub async fn close(&self) {
        match self {
            Db::Sqlite(db) => db.close().await,
            Db::Postgres(db) => db.close().await,
        }
    }
}

/// True for `postgres://` and `postgresql://` URLs.
pub fn is_postgres_url(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// The file path of a `sqlite://PATH` (or `sqlite:PATH`) URL.
pub fn sqlite_path(url: &str) -> std::path::PathBuf {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .unwrap_or(url);
    std::path::PathBuf::from(rest.split('?').next().unwrap_or(rest))
}

/// Handles to the SQLite file.
#[derive(Clone, Debug)]
pub struct SqliteDb {
    /// The single writer connection; hold it only for one transaction.
    pub write: SqlitePool,
    /// Readers; never block behind the writer in WAL mode.
    pub read: SqlitePool,
    /// Whose turn it is to write; see the module documentation.
    pub turn: Arc<tokio::sync::Mutex<()>>,
    /// The file, for writers on connections of their own (rusqlite).
    pub path: std::path::PathBuf,
    /// Whether commits are fsynced (`storage.fsync`).
    pub fsync: bool,
}

impl SqliteDb {
    /// Opens (creating if needed) and migrates the database at `path`.
    /// `fsync` chooses `synchronous = FULL` (fsync per commit) over `NORMAL`
    /// (the WAL reaches the OS on commit; durable across a process crash).
    pub async fn open(path: &Path, fsync: bool) -> anyhow::Result<Self> {
        if let Some(parent) = path.parent()
            && !parent.as_os_str().is_empty()
        {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating directory {}", parent.display()))?;
        }
        let base = SqliteConnectOptions::from_str("sqlite://")?
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(if fsync {
                SqliteSynchronous::Full
            } else {
                SqliteSynchronous::Normal
            })
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10))
            .statement_cache_capacity(256);
        let write = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(base.clone())
            .await
            .with_context(|| format!("opening SQLite database {}", path.display()))?;
        sqlx::migrate!("./migrations/sqlite")
            .run(&write)
            .await
            .context("migrating the SQLite database")?;
        let read = SqlitePoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(base.read_only(true))
            .await
            .with_context(|| format!("opening SQLite database {} for reading", path.display()))?;
        Ok(SqliteDb {
            write,
            read,
            turn: Arc::default(),
            path: path.to_owned(),
            fsync,
        })
    }

    /// True when both pools answer a trivial query.
    pub async fn ping(&self) -> bool {
        let read = sqlx::query("SELECT 1").execute(&self.read).await.is_ok();
        let write = sqlx::query("SELECT 1").execute(&self.write).await.is_ok();
        read && write
    }

    /// Waits for this side's turn to write (FIFO with the accept writer).
    pub async fn write_turn(&self) -> tokio::sync::OwnedMutexGuard<()> {
        self.turn.clone().lock_owned().await
    }

    pub async fn close(&self) {
        self.read.close().await;
        self.write.close().await;
    }
}

impl SqliteDb {
    /// Runs a statement over `ids` on the write connection, in its write
    /// turn, a chunk of ids at a time: `head` writes the statement up to
    /// its `IN (` (binding what it needs), and the ids close the list.
    pub(crate) async fn execute_for_ids(
        &self,
        ids: &[String],
        head: impl Fn(&mut QueryBuilder<Sqlite>),
    ) -> anyhow::Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let _turn = self.write_turn().await;
        let mut conn = self.write.acquire().await?;
        for chunk in ids.chunks(IDS_PER_STATEMENT) {
            let mut builder = QueryBuilder::new("");
            head(&mut builder);
            push_id_list(&mut builder, chunk);
            builder
                .build()
                .persistent(false)
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }
}

/// Ids bound per `IN (…)` list, well under SQLite's parameter limit.
pub(crate) const IDS_PER_STATEMENT: usize = 500;

/// Appends `?, ?, …)` binding `ids`: the end of an `IN (` list.
pub(crate) fn push_id_list(builder: &mut QueryBuilder<Sqlite>, ids: &[String]) {
    let mut list = builder.separated(", ");
    for id in ids {
        list.push_bind(id.clone());
    }
    builder.push(")");
}
