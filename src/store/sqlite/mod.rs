//! The SQLite backend: one file, one instance. Its handles ([`SqliteDb`]:
//! a pool with the one write connection, a pool of readers, the write
//! turn), the group-committing writer thread ([`writer::StoreWriter`]) and
//! the hot statements it runs ([`hot`]).
//!
//! SQLite allows one writer at a time. Every hot write (accepts, the
//! embedded queue's receives, deletes, deferrals and DLQ moves, status
//! changes) goes through the one store writer, a thread with a connection
//! of its own that commits them in groups. Rare writes (admin changes, the
//! outbox's bookkeeping) use sqlx's pool of exactly one write connection;
//! the store writer takes [`SqliteDb::write_turn`], a FIFO lock, for each
//! group, and so do the rare writers that would otherwise wait on
//! `SQLITE_BUSY`. Take the turn before the pool connection, never while
//! holding it. Reads use a separate pool and, in WAL mode, never wait for a
//! writer.

pub(crate) mod hot;
pub(crate) mod lifecycle;
mod readers;
pub(crate) mod webhooks;
pub mod writer;

use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{QueryBuilder, Sqlite, SqlitePool};

/// Handles to the SQLite file.
#[derive(Clone, Debug)]
pub struct SqliteDb {
    /// The single writer connection; hold it only for one transaction.
    pub write: SqlitePool,
    /// Readers; never block behind the writer in WAL mode.
    pub read: SqlitePool,
    /// The same through rusqlite, for the reads the API answers most.
    pub(crate) readers: readers::Readers,
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
            // Deleted and overwritten content is zeroed in the file, so
            // what retention erases is not left in free space.
            .pragma("secure_delete", "on")
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
        let readers = readers::Readers::open(path, 4)?;
        Ok(SqliteDb {
            write,
            read,
            readers,
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
    /// Runs `work` in one `IMMEDIATE` transaction on a connection of its
    /// own, through the store writer's driver (rusqlite), in the write turn,
    /// and commits it with the usage it counted: the rare writes of a
    /// message's status (redrives, scheduled messages reaching their lane,
    /// a restart's released sends), which go through
    /// [`lifecycle`] like the writer's own.
    pub(crate) async fn transact<T, F>(&self, work: F) -> anyhow::Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&rusqlite::Transaction) -> anyhow::Result<T> + Send + 'static,
    {
        let _turn = self.write_turn().await;
        let (path, fsync) = (self.path.clone(), self.fsync);
        tokio::task::spawn_blocking(move || {
            let mut conn = writer::open_connection(&path, fsync)?;
            let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            match work(&tx) {
                Ok(value) => {
                    crate::store::usage::Pending::write(&tx)?;
                    let written = tx.total_changes();
                    tx.commit()?;
                    writer::count_commit(written);
                    Ok(value)
                }
                Err(err) => {
                    crate::store::usage::Pending::forget();
                    Err(err)
                }
            }
        })
        .await?
    }

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
