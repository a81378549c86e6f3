//! The one write path of the SQLite store: every hot mutation is a piece of
//! [`Work`] handed to one writer thread, which applies everything waiting in
//! one transaction and commits once (group commit).
//!
//! SQLite has one writer at a time, so what bounds throughput is how many
//! commits it makes and how long each holds the lock, not how many threads
//! ask. Accept inserts, embedded-queue receives (with the leases they take in
//! memory), deferrals, deletes, DLQ moves and status changes all arrive here
//! from many tasks; under load each transaction carries the work of hundreds
//! of messages, and when idle a lone piece commits at once. The thread owns a
//! rusqlite connection with cached prepared statements, so no SQL is parsed
//! per transaction.
//!
//! Every piece learns its outcome only after its group committed (or
//! failed): a 202 is answered, a delivery recorded, a lease handed out only
//! once durable. If one piece fails to apply (a constraint, a bad row), the
//! group is rolled back and each piece is applied again in a transaction of
//! its own, so one bad piece fails alone and never leaves half a record. A
//! failed commit (disk full, I/O error) fails the whole group.
//!
//! Rare writes (admin changes, tenant and plan edits) stay on sqlx's write
//! connection; they and this thread take turns through [`SqliteDb::write_turn`].
//!
//! Checkpoints (copying the write-ahead log back into the database file,
//! with its fsyncs) run on a thread of their own every
//! [`CHECKPOINT_INTERVAL`] instead of inside whichever commit crosses
//! SQLite's automatic threshold, so no group waits for one: a passive
//! checkpoint never blocks the writer. Only when the log has grown to
//! [`RESTART_FRAMES`] does the thread take the write turn for a restarting
//! checkpoint (see [`checkpoint_until`]).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rusqlite::{Connection, Transaction, TransactionBehavior};
use tokio::sync::{mpsc, oneshot};
use tracing::error;

use super::SqliteDb;
use super::usage;
pub use crate::store::streak::{FailureStreak, WriteFailed};

/// How long the writer waits for another connection's write transaction
/// (a rare admin write on sqlx's connection) before a group fails.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Size of the row a write probe adds: more than the largest send needs
/// (a batch aside), so that a probe that commits means sends commit too.
const PROBE_BYTES: i64 = 256 * 1024;

/// How often the checkpoint thread copies the log into the database file.
const CHECKPOINT_INTERVAL: Duration = Duration::from_millis(100);

/// Frames in the write-ahead log past which a checkpoint restarts it
/// (128 MiB of 4 KiB pages). A restart holds the write turn while it
/// copies what the last passive checkpoint left and syncs, so it is kept
/// rare: under a burst at the pipeline's full rate, about once a second.
const RESTART_FRAMES: i64 = 32768;

/// The log file is cut back to this size when it restarts after growing
/// past it (while a long read kept a restart from happening).
const LOG_SIZE_LIMIT: i64 = 256 * 1024 * 1024;

/// How long a restarting checkpoint waits for the writer and the readers
/// before it gives up until the next interval: it holds the write lock
/// while it waits for readers.
const RESTART_WAIT: Duration = Duration::from_millis(50);

/// One piece of work for the writer.
pub trait Work: Send + 'static {
    /// Applies the piece in the group's transaction. Called again, in a
    /// transaction of its own, if another piece of the group failed; so any
    /// state kept outside the database is changed tentatively here and
    /// undone in [`Work::rolled_back`], or changed only in [`Work::finish`].
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()>;

    /// Undoes what [`Work::apply`] changed outside the database when its
    /// transaction is rolled back.
    fn rolled_back(&mut self) {}

    /// Whether the piece would rather run before the group's writes: a
    /// read that then may be answered at once (see [`Work::settle_early`]).
    fn reads_first(&self) -> bool {
        false
    }

    /// Called right after [`Work::apply`] when nothing in the transaction
    /// has been written yet, this piece included: what it read was
    /// committed data, so it may answer now instead of after the commit.
    /// A piece that settles must then ignore the rest (a later apply, a
    /// rollback, its finish).
    fn settle_early(&mut self) {}

    /// Called once, after the piece's transaction committed (`Ok`) or
    /// failed for good.
    fn finish(self: Box<Self>, outcome: Result<(), WriteFailed>);

    /// Accepted messages this piece makes durable, for the group's span.
    fn accepted(&self) -> &[crate::store::AcceptEntry] {
        &[]
    }
}

/// Whether `err` says the store itself cannot write (full, read-only, an
/// I/O error, a broken file) rather than that one piece's data broke a
/// rule: such failures make the store unready and its writers back off.
fn is_store_fault(err: &anyhow::Error) -> bool {
    use rusqlite::ErrorCode::*;
    err.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<rusqlite::Error>(),
            Some(rusqlite::Error::SqliteFailure(failure, _))
                if matches!(
                    failure.code,
                    DiskFull
                        | SystemIoFailure
                        | ReadOnly
                        | CannotOpen
                        | DatabaseCorrupt
                        | NotADatabase
                        | OutOfMemory
                        | FileLockingProtocolFailed
                )
        )
    })
}

enum Command {
    Work(Box<dyn Work>),
    /// Commit what is queued, then stop taking work.
    Stop,
}

/// Handle to the writer thread; cheap to clone.
#[derive(Clone)]
pub struct StoreWriter {
    commands: mpsc::Sender<Command>,
    failures: FailureStreak,
}

impl StoreWriter {
    /// Opens a connection of its own to `db`'s file (already created and
    /// migrated by [`SqliteDb::open`]) and starts the writer thread; the returned
    /// receiver completes once the writer has stopped (see
    /// [`StoreWriter::stop`]) with everything it was given committed.
    pub fn spawn(db: &SqliteDb, max_group: usize) -> anyhow::Result<(Self, oneshot::Receiver<()>)> {
        Self::spawn_capped(db, max_group, 0)
    }

    /// [`StoreWriter::spawn`] with the file capped at `max_size_mb` MiB
    /// (`storage.max_size_mb`; 0: no cap). Writes that would grow it past
    /// the cap fail as on a full disk; deletes make room again.
    pub fn spawn_capped(
        db: &SqliteDb,
        max_group: usize,
        max_size_mb: u64,
    ) -> anyhow::Result<(Self, oneshot::Receiver<()>)> {
        let conn = open_connection(&db.path, db.fsync)
            .with_context(|| format!("opening {} for the store writer", db.path.display()))?;
        conn.pragma_update(None, "wal_autocheckpoint", 0)?;
        conn.pragma_update(None, "journal_size_limit", LOG_SIZE_LIMIT)?;
        if max_size_mb > 0 {
            let page_size: i64 = conn.pragma_query_value(None, "page_size", |row| row.get(0))?;
            let page_size = u64::try_from(page_size).unwrap_or(4096);
            let pages = (max_size_mb * 1024 * 1024 / page_size.max(1)).max(1);
            // SQLite keeps the cap at no less than the pages in use.
            let cap: i64 =
                conn.query_row(&format!("PRAGMA max_page_count = {pages}"), [], |row| {
                    row.get(0)
                })?;
            tracing::info!(
                max_size_mb,
                max_pages = cap,
                page_size,
                "The store file is capped; writes past the cap answer 503."
            );
        }
        let checkpoints = open_connection(&db.path, db.fsync)
            .with_context(|| format!("opening {} for checkpoints", db.path.display()))?;
        checkpoints.busy_timeout(RESTART_WAIT)?;
        let (commands, receiver) = mpsc::channel(max_group.max(1) * 8);
        let failures = FailureStreak::default();
        let streak = failures.clone();
        let turn = db.turn.clone();
        let (finished, done) = oneshot::channel();
        let (stop_checkpoints, stopped) = std::sync::mpsc::channel::<()>();
        let checkpoint_turn = turn.clone();
        let checkpointer = std::thread::Builder::new()
            .name("fairlane-checkpoint".into())
            .spawn(move || {
                checkpoint_until(checkpoints, stopped, RESTART_FRAMES, checkpoint_turn)
            })?;
        std::thread::Builder::new()
            .name("fairlane-store-writer".into())
            .spawn(move || {
                run(conn, turn, receiver, max_group.max(1), streak);
                drop(stop_checkpoints);
                let _ = checkpointer.join();
                let _ = finished.send(());
            })?;
        Ok((StoreWriter { commands, failures }, done))
    }

    /// Hands `work` to the writer without waiting; its
    /// [`Work::finish`] says how it went. A stopped writer finishes it at
    /// once with a failure.
    pub async fn submit(&self, work: Box<dyn Work>) {
        if let Err(mpsc::error::SendError(Command::Work(work))) =
            self.commands.send(Command::Work(work)).await
        {
            work.finish(Err(WriteFailed("the store writer has stopped".into())));
        }
    }

    /// Runs `apply` in the writer's next group and returns its value once
    /// the group has committed.
    pub async fn run<T, F>(&self, apply: F) -> anyhow::Result<T>
    where
        T: Send + 'static,
        F: FnMut(&Transaction) -> anyhow::Result<T> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        self.submit(Box::new(Closure {
            apply,
            value: None,
            reply,
        }))
        .await;
        answer
            .await
            .context("the store writer dropped a piece of work")?
    }

    /// Runs `read` on the writer's connection, ahead of the next group's
    /// writes, and answers as soon as it has run: it reads committed data
    /// only, so it need not wait for the commit. For reads on the delivery
    /// path, where the writer's cached statements cost a few microseconds
    /// and the pools' round trips many times that. `read` must not write.
    pub async fn read<T, F>(&self, read: F) -> anyhow::Result<T>
    where
        T: Send + 'static,
        F: FnMut(&Transaction) -> anyhow::Result<T> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        self.submit(Box::new(Read {
            read,
            reply: Some(reply),
            value: None,
        }))
        .await;
        answer
            .await
            .context("the store writer dropped a piece of work")?
    }

    /// The Retry-After to give when a write could not be made durable.
    pub fn retry_after(&self) -> Duration {
        self.failures.retry_after()
    }

    /// The writer's failure streak.
    pub fn failures(&self) -> &FailureStreak {
        &self.failures
    }

    /// Writes a row larger than any send and removes it in one
    /// transaction: whether a send would find room now.
    pub async fn probe(&self) -> anyhow::Result<()> {
        self.run(|tx| {
            tx.execute(
                "INSERT INTO write_probe(filler) VALUES (zeroblob(?1))",
                [PROBE_BYTES],
            )?;
            tx.execute("DELETE FROM write_probe", [])?;
            Ok(())
        })
        .await
    }

    /// Asks the writer to commit what it holds and stop; later work fails.
    pub async fn stop(&self) {
        let _ = self.commands.send(Command::Stop).await;
    }
}

/// A closure as a piece of work, answering its value after the commit.
struct Closure<T, F> {
    apply: F,
    value: Option<T>,
    reply: oneshot::Sender<anyhow::Result<T>>,
}

impl<T, F> Work for Closure<T, F>
where
    T: Send + 'static,
    F: FnMut(&Transaction) -> anyhow::Result<T> + Send + 'static,
{
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        self.value = Some((self.apply)(tx)?);
        Ok(())
    }

    fn rolled_back(&mut self) {
        self.value = None;
    }

    fn finish(self: Box<Self>, outcome: Result<(), WriteFailed>) {
        let answer = match (outcome, self.value) {
            (Ok(()), Some(value)) => Ok(value),
            (Ok(()), None) => Err(anyhow::anyhow!("work committed without a value")),
            (Err(failed), _) => Err(anyhow::Error::new(failed)),
        };
        let _ = self.reply.send(answer);
    }
}

/// A read answered before its group commits (see [`StoreWriter::read`]).
struct Read<T, F> {
    read: F,
    reply: Option<oneshot::Sender<anyhow::Result<T>>>,
    value: Option<anyhow::Result<T>>,
}

impl<T, F> Work for Read<T, F>
where
    T: Send + 'static,
    F: FnMut(&Transaction) -> anyhow::Result<T> + Send + 'static,
{
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        // A failed read is its own answer, not a reason to roll the group back.
        self.value = Some((self.read)(tx));
        Ok(())
    }

    fn reads_first(&self) -> bool {
        true
    }

    fn settle_early(&mut self) {
        if let (Some(reply), Some(value)) = (self.reply.take(), self.value.take()) {
            let _ = reply.send(value);
        }
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if let Some(reply) = self.reply.take() {
            let answer = match (outcome, self.value.take()) {
                (Ok(()), Some(value)) => value,
                (Ok(()), None) => Err(anyhow::anyhow!("read finished without a value")),
                (Err(failed), _) => Err(anyhow::Error::new(failed)),
            };
            let _ = reply.send(answer);
        }
    }
}

/// A connection with the durability settings of the pools.
pub(crate) fn open_connection(path: &Path, fsync: bool) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    conn.pragma_update(None, "journal_mode", "wal")?;
    conn.pragma_update(None, "synchronous", if fsync { "full" } else { "normal" })?;
    conn.pragma_update(None, "foreign_keys", "on")?;
    conn.pragma_update(None, "secure_delete", "on")?;
    conn.set_prepared_statement_cache_capacity(64);
    Ok(conn)
}

/// Passive checkpoints every [`CHECKPOINT_INTERVAL`] until `stop` closes;
/// then one more, so a clean shutdown leaves a short log. A passive
/// checkpoint never waits, so under steady writes it never catches the
/// log's end and the log would only grow (1.5–1.7 GB in a 100,000-message
/// run, every frame written past the file's end); once the log holds
/// [`RESTART_FRAMES`], a restarting checkpoint lets the writer's next
/// transaction write the log from its start again.
fn checkpoint_until(
    conn: Connection,
    stop: std::sync::mpsc::Receiver<()>,
    restart_frames: i64,
    turn: Arc<tokio::sync::Mutex<()>>,
) {
    let checkpoint = |mode: &str| -> Option<i64> {
        match conn.query_row(&format!("PRAGMA wal_checkpoint({mode})"), [], |row| {
            row.get::<_, i64>(1)
        }) {
            Ok(frames) => Some(frames),
            Err(err) => {
                tracing::warn!(error = %err, "Checkpoint failed; the next one tries again.");
                None
            }
        }
    };
    while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
        stop.recv_timeout(CHECKPOINT_INTERVAL)
    {
        if checkpoint("PASSIVE").is_some_and(|frames| frames >= restart_frames) {
            // In the write turn: the writer waits for it on the turn and
            // goes on the moment it ends, instead of polling SQLite's lock
            // with growing sleeps.
            let _turn = turn.blocking_lock();
            checkpoint("RESTART");
        }
    }
    checkpoint("PASSIVE");
}

fn run(
    mut conn: Connection,
    turn: Arc<tokio::sync::Mutex<()>>,
    mut receiver: mpsc::Receiver<Command>,
    max_group: usize,
    streak: FailureStreak,
) {
    let mut group: Vec<Box<dyn Work>> = Vec::with_capacity(max_group);
    let mut stopping = false;
    loop {
        if group.is_empty() {
            match receiver.blocking_recv() {
                Some(Command::Work(work)) => group.push(work),
                Some(Command::Stop) => stopping = true,
                None => break,
            }
        }
        // The turn first: what queues up while another writer holds it, or
        // during the previous commit, joins this group.
        let my_turn = turn.blocking_lock();
        while group.len() < max_group {
            match receiver.try_recv() {
                Ok(Command::Work(work)) => group.push(work),
                Ok(Command::Stop) => stopping = true,
                Err(_) => break,
            }
        }
        if stopping {
            receiver.close();
        }
        if !group.is_empty() {
            let span = crate::store::group_span(group.iter().flat_map(|work| work.accepted()));
            let committed = span.in_scope(|| commit_group(&mut conn, &mut group));
            drop(my_turn);
            let fault = match committed {
                Ok(fault) => {
                    for work in group.drain(..) {
                        work.finish(Ok(()));
                    }
                    fault
                }
                Err(failure) => {
                    for work in group.drain(..) {
                        work.finish(Err(failure.clone()));
                    }
                    Some(failure)
                }
            };
            match fault {
                None => {
                    let ended = streak.succeeded();
                    if ended > 0 {
                        tracing::warn!(failures = ended, "Store writes succeed again.");
                    }
                }
                Some(failure) => {
                    let failures = streak.failed_because(&failure);
                    // A full disk fails every group until it clears: say so
                    // when it starts and now and then, not thousands of times.
                    if failures == 1 || failures.is_multiple_of(1000) {
                        error!(error = %failure, failures, "The store cannot write; sends answer 503 until it can.");
                    }
                }
            }
        }
        if stopping && receiver.is_empty() {
            // Finish what raced with the stop, then end.
            while let Ok(command) = receiver.try_recv() {
                if let Command::Work(work) = command {
                    work.finish(Err(WriteFailed("the store writer has stopped".into())));
                }
            }
            break;
        }
    }
}

/// One transaction for the whole group. If a piece fails to apply, the
/// group is rolled back and every piece applied alone (its failure kept to
/// itself); the pieces that fail alone are finished here and removed, so
/// what remains in `group` has committed. `Ok` carries the first store
/// fault (see [`is_store_fault`]) a piece met alone, if any.
fn commit_group(
    conn: &mut Connection,
    group: &mut Vec<Box<dyn Work>>,
) -> Result<Option<WriteFailed>, WriteFailed> {
    // Reads go first, so that those which write nothing read only
    // committed data and can be answered before the commit.
    group.sort_by_key(|work| !work.reads_first());
    let applied = (|| -> anyhow::Result<Option<usize>> {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let unwritten = tx.total_changes();
        for (index, work) in group.iter_mut().enumerate() {
            if let Err(err) = work.apply(&tx) {
                tracing::debug!(error = %err, "A write failed; applying the group piece by piece.");
                return Ok(Some(index));
            }
            if tx.total_changes() == unwritten {
                work.settle_early();
            }
        }
        usage::Pending::write(&tx)?;
        let written = tx.total_changes() - unwritten;
        tx.commit()?;
        count_commit(written);
        Ok(None)
    })();
    if !matches!(applied, Ok(None)) {
        usage::Pending::forget();
    }
    match applied {
        Ok(None) => Ok(None),
        Ok(Some(failed_at)) => {
            for work in group.iter_mut().take(failed_at + 1) {
                work.rolled_back();
            }
            Ok(one_by_one(conn, group))
        }
        Err(err) => {
            for work in group.iter_mut() {
                work.rolled_back();
            }
            Err(WriteFailed::from_error(&err))
        }
    }
}

/// Counts a committed transaction and the rows it wrote (see
/// [`crate::metrics::STORE_ROWS_WRITTEN_TOTAL`]).
pub(crate) fn count_commit(rows: u64) {
    metrics::counter!(crate::metrics::STORE_COMMITS_TOTAL).increment(1);
    metrics::counter!(crate::metrics::STORE_ROWS_WRITTEN_TOTAL).increment(rows);
}

/// Applies each piece in a transaction of its own; finishes and removes the
/// ones that fail; returns the first store fault among their failures.
fn one_by_one(conn: &mut Connection, group: &mut Vec<Box<dyn Work>>) -> Option<WriteFailed> {
    let mut kept = Vec::with_capacity(group.len());
    let mut fault = None;
    for mut work in group.drain(..) {
        let outcome = (|| -> anyhow::Result<()> {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let unwritten = tx.total_changes();
            work.apply(&tx)?;
            usage::Pending::write(&tx)?;
            let written = tx.total_changes() - unwritten;
            tx.commit()?;
            count_commit(written);
            Ok(())
        })();
        if outcome.is_err() {
            usage::Pending::forget();
        }
        match outcome {
            Ok(()) => kept.push(work),
            Err(err) => {
                work.rolled_back();
                let failed = WriteFailed::from_error(&err);
                if is_store_fault(&err) {
                    fault.get_or_insert_with(|| failed.clone());
                } else {
                    error!(error = %failed, "A write could not be committed.");
                }
                work.finish(Err(failed));
            }
        }
    }
    *group = kept;
    fault
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn open(
        dir: &tempfile::TempDir,
    ) -> (crate::store::Db, StoreWriter, oneshot::Receiver<()>) {
        let db = crate::store::Db::open(&dir.path().join("w.db"), false)
            .await
            .unwrap();
        let (writer, done) = StoreWriter::spawn(db.sqlite().unwrap(), 64).unwrap();
        (db, writer, done)
    }

    #[test]
    fn steady_writes_do_not_grow_the_log_without_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.db");
        let writer = open_connection(&path, false).unwrap();
        writer.pragma_update(None, "wal_autocheckpoint", 0).unwrap();
        writer.execute_batch("CREATE TABLE t (b BLOB)").unwrap();
        let checkpoints = open_connection(&path, false).unwrap();
        checkpoints.busy_timeout(RESTART_WAIT).unwrap();
        let (stop, stopped) = std::sync::mpsc::channel();
        let turn = Arc::default();
        let thread = std::thread::spawn(move || checkpoint_until(checkpoints, stopped, 256, turn));
        let log = dir.path().join("log.db-wal");
        let (mut largest, mut written) = (0, 0);
        let until = std::time::Instant::now() + Duration::from_millis(1500);
        // A write about every 100 µs, never a pause long enough for a
        // passive checkpoint to catch the log's end.
        while std::time::Instant::now() < until {
            writer
                .execute("INSERT INTO t VALUES (zeroblob(3000))", [])
                .unwrap();
            written += 3000;
            largest = largest.max(std::fs::metadata(&log).map_or(0, |m| m.len()));
            std::thread::sleep(Duration::from_micros(100));
        }
        drop(stop);
        thread.join().unwrap();
        // Without restarts the log holds every page each commit wrote:
        // about four times `written` (88 MB for 21 MB when tried); with
        // them, about what a few checkpoint intervals write (7 MB).
        assert!(
            largest < written,
            "the log reached {largest} bytes for {written} bytes written"
        );
    }

    #[tokio::test]
    async fn a_failing_piece_fails_alone_and_the_rest_of_its_group_commits() {
        let dir = tempfile::tempdir().unwrap();
        let (db, writer, done) = open(&dir).await;
        let insert = |key: &'static str| {
            let writer = writer.clone();
            async move {
                writer
                    .run(move |tx| {
                        tx.execute("INSERT INTO settings(key, value) VALUES (?1, 'v')", [key])?;
                        Ok(())
                    })
                    .await
            }
        };
        // Submitted together, so they share a group; "b" twice breaks the
        // primary key.
        let (a, b1, b2, c) = tokio::join!(insert("a"), insert("b"), insert("b"), insert("c"));
        assert!(a.is_ok() && c.is_ok());
        assert!(
            b1.is_ok() != b2.is_ok(),
            "exactly one of the two b's commits"
        );
        for key in ["a", "b", "c"] {
            assert_eq!(db.setting(key).await.unwrap().as_deref(), Some("v"));
        }
        writer.stop().await;
        done.await.unwrap();
        assert!(insert("d").await.is_err(), "a stopped writer refuses work");
    }

    /// A read that settles early: answers from `settle_early`.
    struct EarlyRead(Option<oneshot::Sender<()>>);

    impl Work for EarlyRead {
        fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
            tx.query_row("SELECT COUNT(*) FROM settings", [], |_| Ok(()))?;
            Ok(())
        }
        fn reads_first(&self) -> bool {
            true
        }
        fn settle_early(&mut self) {
            if let Some(reply) = self.0.take() {
                let _ = reply.send(());
            }
        }
        fn finish(self: Box<Self>, _outcome: Result<(), WriteFailed>) {}
    }

    #[tokio::test]
    async fn a_read_that_writes_nothing_is_answered_before_the_writes_of_its_group() {
        let dir = tempfile::tempdir().unwrap();
        let (_db, writer, _done) = open(&dir).await;
        // Hold the writer's turn so that both pieces land in one group.
        let turn = _db.sqlite().unwrap().write_turn().await;
        let (release, released) = std::sync::mpsc::channel::<()>();
        let slow = {
            let writer = writer.clone();
            tokio::spawn(async move {
                writer
                    .run(move |tx| {
                        tx.execute("INSERT INTO settings(key, value) VALUES ('slow', 'v')", [])?;
                        // Goes on only once the read has been answered.
                        released.recv_timeout(Duration::from_secs(10))?;
                        Ok(())
                    })
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (reply, answered) = oneshot::channel();
        writer.submit(Box::new(EarlyRead(Some(reply)))).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(turn);
        // Submitted after the write, yet answered while the write's group
        // is still being applied: the read went first.
        tokio::time::timeout(Duration::from_secs(5), answered)
            .await
            .expect("the read was not answered before the group's writes")
            .unwrap();
        release.send(()).unwrap();
        slow.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_value_is_answered_only_after_its_commit() {
        let dir = tempfile::tempdir().unwrap();
        let (db, writer, _done) = open(&dir).await;
        let n = writer
            .run(|tx| {
                tx.execute("INSERT INTO settings(key, value) VALUES ('k', '7')", [])?;
                Ok(7)
            })
            .await
            .unwrap();
        assert_eq!(n, 7);
        // A reader on another connection sees it at once.
        assert_eq!(db.setting("k").await.unwrap().as_deref(), Some("7"));
    }
}
