//! The SQLite backend: one file, one instance, one driver (rusqlite; why
//! that one: bench/README.md "One SQLite driver: which"). Its handle
//! ([`SqliteDb`]: the reader threads, the write turn, the connection of
//! the rare writes), the group-committing writer thread
//! ([`writer::StoreWriter`]), the hot statements it runs ([`hot`]) and
//! every other statement of the store on this engine, by topic.
//!
//! SQLite allows one writer at a time. Every hot write (accepts, the
//! embedded queue's receives, deletes, deferrals and DLQ moves, status
//! changes) goes through the one store writer, a thread with a connection
//! of its own that commits them in groups. Rare writes (admin changes, the
//! outbox's bookkeeping) run in [`SqliteDb::transact`] on a connection of
//! their own; the store writer takes [`SqliteDb::write_turn`], a FIFO lock,
//! for each group, and so does every rare writer, so neither waits on
//! `SQLITE_BUSY`. Reads run on reader threads with read-only connections
//! ([`SqliteDb::read`]) and, in WAL mode, never wait for a writer.

mod admins;
pub(crate) mod attachments;
pub(crate) mod hot;
mod idempotency;
pub(crate) mod lifecycle;
mod messages;
mod migrate;
pub(crate) mod outbox;
mod readers;
pub(crate) mod receipts;
mod registry;
mod retention;
mod settings;
pub(crate) mod suppressions;
mod templates;
pub(crate) mod usage;
pub(crate) mod webhooks;
pub mod writer;

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::Context;
use rusqlite::{Connection, OptionalExtension, Row};

/// Handles to the SQLite file; cheap to clone.
#[derive(Clone)]
pub struct SqliteDb {
    /// Read-only connections on threads of their own.
    readers: readers::Readers,
    /// Whose turn it is to write; see the module documentation.
    pub turn: Arc<tokio::sync::Mutex<()>>,
    /// The rare writes' connection, opened at the first of them.
    rare: Arc<Mutex<Option<Connection>>>,
    /// The file, for writers on connections of their own.
    pub path: std::path::PathBuf,
    /// Whether commits are fsynced (`storage.fsync`).
    pub fsync: bool,
}

impl std::fmt::Debug for SqliteDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteDb")
            .field("path", &self.path)
            .finish()
    }
}

/// Readers per store: enough for the API's reads beside the dispatcher's.
const READERS: usize = 4;

/// Takes the query planner's statistics afresh, each index read through a
/// bounded sample (`analysis_limit`), so it takes milliseconds at any
/// size; then `PRAGMA optimize` for what else it judges worth doing. A
/// connection keeps the statistics it opened with, so the readers open
/// theirs again afterwards ([`SqliteDb::refresh_statistics`]).
/// Without statistics SQLite guesses, and on a big tenant it guessed the
/// message list's index over the reference's: seconds for one reference
/// instead of milliseconds (issue 46). (`PRAGMA optimize` alone left a
/// table that never had statistics without them.)
const OPTIMIZE: &str = "PRAGMA analysis_limit = 1000; ANALYZE; PRAGMA optimize;";

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
        let owned = path.to_owned();
        let conn = tokio::task::spawn_blocking(move || -> anyhow::Result<Connection> {
            let mut conn = writer::open_connection(&owned, fsync)
                .with_context(|| format!("opening SQLite database {}", owned.display()))?;
            migrate::run(&mut conn).context("migrating the SQLite database")?;
            conn.execute_batch(OPTIMIZE)
                .context("refreshing the query planner's statistics")?;
            Ok(conn)
        })
        .await??;
        let readers = readers::Readers::open(path, READERS)?;
        Ok(SqliteDb {
            readers,
            turn: Arc::default(),
            rare: Arc::new(Mutex::new(Some(conn))),
            path: path.to_owned(),
            fsync,
        })
    }

    /// True when a reader answers a trivial query.
    pub async fn ping(&self) -> bool {
        self.read(|conn| conn.query_row("SELECT 1", [], |_| Ok(())))
            .await
            .is_ok()
    }

    /// Waits for this side's turn to write (FIFO with the accept writer).
    pub async fn write_turn(&self) -> tokio::sync::OwnedMutexGuard<()> {
        self.turn.clone().lock_owned().await
    }

    /// Runs `read` on the next free reader connection and returns what it
    /// found; what one closure reads, it reads from one snapshot when it
    /// opens a transaction.
    pub(crate) async fn read<T, F>(&self, read: F) -> anyhow::Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        self.readers.read(read).await
    }

    /// Refreshes the planner's statistics ([`OPTIMIZE`]) in the write
    /// turn (`ANALYZE` writes them); run at start and on a schedule.
    pub(crate) async fn refresh_statistics(&self) -> anyhow::Result<()> {
        let _turn = self.write_turn().await;
        self.on_rare_connection(|conn| Ok(conn.execute_batch(OPTIMIZE)?))
            .await?;
        self.readers.reload_statistics();
        Ok(())
    }

    /// Closes the rare writes' connection; the readers end with the last
    /// handle.
    pub async fn close(&self) {
        self.rare
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
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
        self.on_rare_connection(move |conn| {
            let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            match work(&tx) {
                Ok(value) => {
                    usage::Pending::write(&tx)?;
                    let written = tx.total_changes();
                    tx.commit()?;
                    writer::count_commit(written);
                    Ok(value)
                }
                Err(err) => {
                    usage::Pending::forget();
                    Err(err)
                }
            }
        })
        .await
    }

    /// Runs `work` on the rare writes' connection, outside a transaction,
    /// for what cannot run in one (`VACUUM`, a checkpoint). The caller
    /// holds the write turn.
    pub(crate) async fn on_rare_connection<T, F>(&self, work: F) -> anyhow::Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> anyhow::Result<T> + Send + 'static,
    {
        let (path, fsync, rare) = (self.path.clone(), self.fsync, Arc::clone(&self.rare));
        tokio::task::spawn_blocking(move || {
            let mut held = rare.lock().unwrap_or_else(PoisonError::into_inner);
            if held.is_none() {
                *held = Some(writer::open_connection(&path, fsync)?);
            }
            work(held.as_mut().expect("opened above"))
        })
        .await?
    }

    /// Runs `head` followed by an `IN (…)` list of `ids`, a chunk of ids at
    /// a time, in one rare write: `head` is the statement up to its `IN (`
    /// and binds nothing; the ids are bound after it.
    pub(crate) async fn execute_for_ids(&self, ids: &[String], head: &str) -> anyhow::Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let (ids, head) = (ids.to_vec(), head.to_owned());
        self.transact(move |tx| {
            for chunk in ids.chunks(IDS_PER_STATEMENT) {
                let sql = format!("{head}{}", id_list(chunk.len()));
                tx.execute(&sql, rusqlite::params_from_iter(chunk))?;
            }
            Ok(())
        })
        .await
    }
}

/// The values bound to a statement's parameters `$1`, `$2`, … (or `?1`,
/// `?2`, …), in order.
pub(crate) type Args = Vec<rusqlite::types::Value>;

/// [`Args`] from values rusqlite can store.
macro_rules! args {
    ($($value:expr),* $(,)?) => {
        vec![$(rusqlite::types::Value::from($value)),*]
    };
}
pub(crate) use args;

/// Maps a row to a tuple of its columns, in order.
pub(crate) fn tuple<T>(row: &Row) -> rusqlite::Result<T>
where
    T: for<'a> TryFrom<&'a Row<'a>, Error = rusqlite::Error>,
{
    T::try_from(row)
}

/// `sql` with PostgreSQL's `$N` parameters written as SQLite's `?N`, which
/// SQLite binds by number as PostgreSQL does (it would take `$N` for a
/// name, numbered in order of appearance), so SQL both engines take can be
/// written once. The store's SQL has no `$` in a literal.
pub(crate) fn numbered(sql: &str) -> std::borrow::Cow<'_, str> {
    if !sql.contains('$') {
        return sql.into();
    }
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        let digit_follows = chars.peek().is_some_and(char::is_ascii_digit);
        out.push(if c == '$' && digit_follows { '?' } else { c });
    }
    out.into()
}

/// Prepares `sql` (after [`numbered`]) from `conn`'s cache.
pub(crate) fn prepare<'c>(
    conn: &'c Connection,
    sql: &str,
) -> rusqlite::Result<rusqlite::CachedStatement<'c>> {
    conn.prepare_cached(&numbered(sql))
}

impl SqliteDb {
    /// Every row `sql` returns, through `map`, read on a reader.
    pub(crate) async fn rows<T: Send + 'static>(
        &self,
        sql: impl Into<String>,
        args: Args,
        map: fn(&Row) -> rusqlite::Result<T>,
    ) -> anyhow::Result<Vec<T>> {
        let sql = sql.into();
        self.read(move |conn| {
            prepare(conn, &sql)?
                .query_map(rusqlite::params_from_iter(args), map)?
                .collect()
        })
        .await
    }

    /// The first row `sql` returns, if any, through `map`.
    pub(crate) async fn row<T: Send + 'static>(
        &self,
        sql: impl Into<String>,
        args: Args,
        map: fn(&Row) -> rusqlite::Result<T>,
    ) -> anyhow::Result<Option<T>> {
        let sql = sql.into();
        self.read(move |conn| {
            prepare(conn, &sql)?
                .query_row(rusqlite::params_from_iter(args), map)
                .optional()
        })
        .await
    }

    /// Runs one write statement as a rare write; returns the rows it
    /// changed.
    pub(crate) async fn execute(
        &self,
        sql: impl Into<String>,
        args: Args,
    ) -> anyhow::Result<usize> {
        let sql = sql.into();
        self.transact(move |tx| Ok(prepare(tx, &sql)?.execute(rusqlite::params_from_iter(args))?))
            .await
    }
}

/// Ids bound per `IN (…)` list, well under SQLite's parameter limit.
pub(crate) const IDS_PER_STATEMENT: usize = 500;

/// `?, ?, …)` for `count` ids: the end of an `IN (` list whose values
/// come after every other parameter of the statement.
pub(crate) fn id_list(count: usize) -> String {
    let mut list = vec!["?"; count].join(", ");
    list.push(')');
    list
}

#[cfg(test)]
mod tests {
    use crate::store::Db;

    /// A tenant's messages with a few references: the refresh takes the
    /// statistics of a table that has none worth the name (the file's
    /// were taken while it was empty), and with them the planner reads
    /// one reference through its index.
    #[tokio::test]
    async fn refreshed_statistics_lead_a_reference_to_its_index() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("s.db"), false).await.unwrap();
        db.test_execute(
            "WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c WHERE n < 20000) \
             INSERT INTO messages (id, tenant_id, channel, status, priority, lane, attempts, \
             reference, created_at, updated_at) \
             SELECT 'm' || n, 'big', 'sms', 'delivered', 'normal', 'fast', 1, \
             'ref-' || (n % 5000), n, n FROM c",
        )
        .await;
        let plan = || async {
            db.test_texts(
                "EXPLAIN QUERY PLAN SELECT id FROM messages \
                 WHERE tenant_id = 'big' AND test = 0 AND reference = 'ref-7' \
                 ORDER BY created_at DESC, id DESC LIMIT 100",
            )
            .await
            .into_iter()
            .map(|row| row.last().cloned().flatten().unwrap_or_default())
            .collect::<Vec<_>>()
            .join("; ")
        };
        // The statistics of the reference index, as rows counted: none
        // from the empty table the file opened with, the table's after.
        let counted = || async {
            db.test_count(
                "SELECT COALESCE(MAX(CAST(stat AS INTEGER)), 0) FROM sqlite_stat1 \
                 WHERE idx = 'messages_tenant_reference'",
            )
            .await
        };
        assert_eq!(counted().await, 0, "statistics before any rows");
        db.refresh_statistics().await.unwrap();
        let rows = counted().await;
        assert!(
            rows > 10_000,
            "statistics after the refresh count {rows} rows"
        );
        let after = plan().await;
        assert!(after.contains("messages_tenant_reference"), "{after}");
    }
}
