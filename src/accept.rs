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
//! Two things keep a group's round trip short, which is what bounds the
//! accept rate (requests wait for the commit cycle, not for CPU): the whole
//! transaction (`BEGIN`, the multi-row inserts, `COMMIT`) goes to SQLite as
//! one multi-statement call, one hand-off to sqlx's connection thread instead
//! of one per statement; and the writer runs on its own thread with its own
//! small runtime, so its wake-ups do not queue behind hundreds of HTTP tasks
//! on the API's workers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use sqlx::{QueryBuilder, Sqlite};
use tokio::sync::{mpsc, oneshot};
use tracing::{error, warn};

use crate::model::{Lane, now_ms};
use crate::queue::OutboundMessage;
use crate::queue::embedded::EmbeddedQueue;
use crate::store::Db;
use crate::store::idempotency::{self, StoredResponse};
use crate::store::messages::{self, MessageRecord};

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
    /// Starts the writer over `db` on a thread of its own; the returned
    /// receiver completes when the writer has committed everything it was
    /// given and every [`AcceptWriter`] is dropped.
    pub fn spawn(
        db: Db,
        staging: Staging,
        max_group: usize,
    ) -> anyhow::Result<(Self, oneshot::Receiver<()>)> {
        let (jobs, receiver) = mpsc::channel(max_group * 4);
        let failures = FailureStreak::default();
        let streak = failures.clone();
        let (finished, done) = oneshot::channel();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        std::thread::Builder::new()
            .name("fairlane-accept-writer".into())
            .spawn(move || {
                runtime.block_on(run_writer(db, staging, receiver, max_group, streak));
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

async fn run_writer(
    db: Db,
    staging: Staging,
    mut receiver: mpsc::Receiver<Job>,
    max_group: usize,
    streak: FailureStreak,
) {
    let mut group = Vec::with_capacity(max_group);
    while receiver.recv_many(&mut group, max_group).await > 0 {
        let outcome = commit_group(&db, &staging, &group).await;
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

async fn commit_group(db: &Db, staging: &Staging, group: &[Job]) -> anyhow::Result<()> {
    let mut transaction: QueryBuilder<Sqlite> = QueryBuilder::new("BEGIN IMMEDIATE;\n");
    let records: Vec<&MessageRecord> = group.iter().map(|job| &job.entry.record).collect();
    messages::push_insert(&mut transaction, &records);
    match staging {
        Staging::Embedded(queue) => {
            for lane in Lane::ALL {
                let outbound: Vec<&OutboundMessage> = group
                    .iter()
                    .filter(|job| job.entry.lane == *lane)
                    .map(|job| &job.entry.outbound)
                    .collect();
                queue.push_insert(&mut transaction, *lane, &outbound);
            }
        }
        Staging::Outbox => {
            let rows: Vec<(Lane, &OutboundMessage)> = group
                .iter()
                .map(|job| (job.entry.lane, &job.entry.outbound))
                .collect();
            crate::outbox::push_insert(&mut transaction, &rows, now_ms());
        }
    }
    let remembered: Vec<&StoredResponse> = group
        .iter()
        .filter_map(|job| job.entry.idempotency.as_ref())
        .collect();
    idempotency::push_insert(&mut transaction, &remembered);
    transaction.push("COMMIT;");
    let mut conn = db.write.acquire().await?;
    // Not kept in the statement cache: group sizes vary, and every size
    // would otherwise stay prepared (a large statement each) for good.
    if let Err(err) = transaction
        .build()
        .persistent(false)
        .execute(&mut *conn)
        .await
    {
        // A statement failed after BEGIN: undo the group so the connection
        // is clean for the next one (an error before BEGIN makes this a no-op
        // that fails harmlessly).
        let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
        return Err(err.into());
    }
    Ok(())
}
