//! The accept writer: group commit for the hot path.
//!
//! A transaction per request would cap the accept rate at the number of
//! commits SQLite can make per second. Instead every accepted message is sent
//! over a channel to one writer task, which takes everything waiting (up to
//! `storage.max_group`), writes all status rows, queue entries and
//! idempotency records in one transaction, commits once, and only then
//! answers each request. Under load, groups grow by themselves while a
//! commit is running; when idle, a lone request commits at once.
//!
//! A group's round trip bounds the accept rate (requests wait for the commit
//! cycle), so the writer is a plain thread with its own SQLite connection
//! (rusqlite) rather than a task handing statements to sqlx's connection
//! thread: no hand-off between threads per group, its wake-ups do not queue
//! behind the HTTP tasks on the API's workers, and each table's insert is one
//! cached single-row statement run once per row, so no SQL is parsed per
//! group. The other writers (status updates, admin changes, the embedded
//! queue's receives) use sqlx's write connection; SQLite serialises the two,
//! and the writer waits up to [`BUSY_TIMEOUT`] for the other's transaction.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::Context;
use rusqlite::{Connection, TransactionBehavior};
use tokio::sync::{mpsc, oneshot};
use tracing::{error, warn};

use crate::model::{Lane, now_ms};
use crate::queue::OutboundMessage;
use crate::queue::embedded::EmbeddedQueue;
use crate::store::idempotency::{self, StoredResponse};
use crate::store::messages::{self, MessageRecord};

/// How long the writer waits for another connection's write transaction
/// (the consumers' status and queue updates) before a group fails.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// One message to make durable.
#[derive(Debug)]
pub struct AcceptEntry {
    pub lane: Lane,
    pub record: MessageRecord,
    pub outbound: OutboundMessage,
    pub idempotency: Option<StoredResponse>,
}

struct Job {
    entry: AcceptEntry,
    reply: oneshot::Sender<bool>,
}

/// The write could not be made durable; retry after the given time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NotDurable {
    pub retry_after: Duration,
}

/// Where the queue entries of a group go.
pub enum Staging {
    /// Into the embedded queue, in the group's transaction.
    Embedded(Arc<EmbeddedQueue>),
    /// Into the outbox table, in the group's transaction; the request then
    /// sends to SQS through [`crate::outbox::Outbox`].
    Outbox,
}

/// Failures in a row, which set the Retry-After of the next 503: 1 s after
/// the first, doubling up to 30 s.
#[derive(Debug, Clone, Default)]
pub struct FailureStreak(Arc<AtomicU32>);

impl FailureStreak {
    pub fn succeeded(&self) {
        self.0.store(0, Ordering::Relaxed);
    }

    /// Counts a failure; returns the streak length.
    pub fn failed(&self) -> u32 {
        self.0.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub fn retry_after(&self) -> Duration {
        let failures = self.0.load(Ordering::Relaxed).clamp(1, 6);
        Duration::from_secs((1u64 << (failures - 1)).min(30))
    }
}

/// Handle to the writer task.
pub struct AcceptWriter {
    jobs: mpsc::Sender<Job>,
    failures: FailureStreak,
}

impl AcceptWriter {
    /// Opens a connection of its own to the SQLite file at `path` (already
    /// created and migrated by [`Db::open`](crate::store::Db::open)) and
    /// starts the writer on a thread of its own; the returned receiver
    /// completes when the writer has committed everything it was given and
    /// every [`AcceptWriter`] is dropped.
    pub fn spawn(
        path: &Path,
        fsync: bool,
        turn: Arc<tokio::sync::Mutex<()>>,
        staging: Staging,
        max_group: usize,
    ) -> anyhow::Result<(Self, oneshot::Receiver<()>)> {
        let conn = open_connection(path, fsync)
            .with_context(|| format!("opening {} for the accept writer", path.display()))?;
        let (jobs, receiver) = mpsc::channel(max_group * 4);
        let failures = FailureStreak::default();
        let streak = failures.clone();
        let (finished, done) = oneshot::channel();
        std::thread::Builder::new()
            .name("fairlane-accept-writer".into())
            .spawn(move || {
                run_writer(conn, turn, staging, receiver, max_group, streak);
                let _ = finished.send(());
            })?;
        Ok((AcceptWriter { jobs, failures }, done))
    }

    /// Makes `entry` durable; returns once its group has committed.
    pub async fn accept(&self, entry: AcceptEntry) -> Result<(), NotDurable> {
        let (reply, answer) = oneshot::channel();
        if self.jobs.send(Job { entry, reply }).await.is_err() {
            return Err(self.not_durable());
        }
        match answer.await {
            Ok(true) => Ok(()),
            _ => Err(self.not_durable()),
        }
    }

    fn not_durable(&self) -> NotDurable {
        NotDurable {
            retry_after: self.failures.retry_after(),
        }
    }
}

/// The writer's connection, with the durability settings of the pools.
pub(crate) fn open_connection(path: &Path, fsync: bool) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    conn.pragma_update(None, "journal_mode", "wal")?;
    conn.pragma_update(None, "synchronous", if fsync { "full" } else { "normal" })?;
    conn.set_prepared_statement_cache_capacity(16);
    Ok(conn)
}

fn run_writer(
    mut conn: Connection,
    turn: Arc<tokio::sync::Mutex<()>>,
    staging: Staging,
    mut receiver: mpsc::Receiver<Job>,
    max_group: usize,
    streak: FailureStreak,
) {
    let mut group = Vec::with_capacity(max_group);
    while let Some(first) = receiver.blocking_recv() {
        group.push(first);
        // Everything that queued up during the previous commit joins.
        while group.len() < max_group {
            match receiver.try_recv() {
                Ok(job) => group.push(job),
                Err(_) => break,
            }
        }
        let outcome = {
            let _turn = turn.blocking_lock();
            commit_group(&mut conn, &staging, &group)
        };
        match &outcome {
            Ok(()) => {
                streak.succeeded();
                if let Staging::Embedded(queue) = &staging {
                    for lane in Lane::ALL {
                        if group.iter().any(|job| job.entry.lane == *lane) {
                            queue.notify_arrivals(*lane);
                        }
                    }
                }
            }
            Err(err) => {
                let failures = streak.failed();
                error!(error = %err, group = group.len(), failures, "Accept group could not be committed; answering 503.");
            }
        }
        for job in group.drain(..) {
            if job.reply.send(outcome.is_ok()).is_err() {
                warn!(message_id = %job.entry.record.id, "Caller went away before its message was committed.");
            }
        }
    }
}

/// One transaction for the whole group: status rows, queue entries (or
/// outbox rows) and idempotency records. Dropping the transaction on an
/// error rolls it back, so the connection is clean for the next group.
fn commit_group(conn: &mut Connection, staging: &Staging, group: &[Job]) -> rusqlite::Result<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let records: Vec<&MessageRecord> = group.iter().map(|job| &job.entry.record).collect();
    messages::insert_rows(&tx, &records)?;
    match staging {
        Staging::Embedded(queue) => {
            for lane in Lane::ALL {
                let outbound: Vec<&OutboundMessage> = group
                    .iter()
                    .filter(|job| job.entry.lane == *lane)
                    .map(|job| &job.entry.outbound)
                    .collect();
                queue.insert_rows(&tx, *lane, &outbound)?;
            }
        }
        Staging::Outbox => {
            let rows: Vec<(Lane, &OutboundMessage)> = group
                .iter()
                .map(|job| (job.entry.lane, &job.entry.outbound))
                .collect();
            crate::outbox::insert_rows(&tx, &rows, now_ms())?;
        }
    }
    let remembered: Vec<&StoredResponse> = group
        .iter()
        .filter_map(|job| job.entry.idempotency.as_ref())
        .collect();
    idempotency::insert_rows(&tx, &remembered)?;
    tx.commit()
}
