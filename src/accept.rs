//! The accept writer: group commit for the hot path.
//!
//! A transaction per request would cap the accept rate at the number of
//! commits SQLite can make per second. Instead every accepted message is sent
//! over a channel to one writer task, which takes everything waiting (up to
//! `storage.max_group`), writes all status rows, queue entries and
//! idempotency records in one transaction, commits once, and only then
//! answers each request. Under load, groups grow by themselves while a
//! commit is running; when idle, a lone request commits at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use sqlx::Acquire;
use tokio::sync::{mpsc, oneshot};
use tracing::{error, warn};

use crate::model::Lane;
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

/// Handle to the writer task.
pub struct AcceptWriter {
    jobs: mpsc::Sender<Job>,
    /// Groups that failed in a row; sets the Retry-After of the next 503.
    consecutive_failures: Arc<AtomicU32>,
}

impl AcceptWriter {
    /// Starts the writer task over `db` and the embedded `queue`.
    pub fn spawn(
        db: Db,
        queue: Arc<EmbeddedQueue>,
        max_group: usize,
    ) -> (Self, tokio::task::JoinHandle<()>) {
        let (jobs, receiver) = mpsc::channel(max_group * 4);
        let consecutive_failures = Arc::new(AtomicU32::new(0));
        let task = tokio::spawn(run_writer(
            db,
            queue,
            receiver,
            max_group,
            consecutive_failures.clone(),
        ));
        (
            AcceptWriter {
                jobs,
                consecutive_failures,
            },
            task,
        )
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
        let failures = self
            .consecutive_failures
            .load(Ordering::Relaxed)
            .clamp(1, 6);
        NotDurable {
            retry_after: Duration::from_secs((1u64 << (failures - 1)).min(30)),
        }
    }
}

async fn run_writer(
    db: Db,
    queue: Arc<EmbeddedQueue>,
    mut receiver: mpsc::Receiver<Job>,
    max_group: usize,
    consecutive_failures: Arc<AtomicU32>,
) {
    let mut group = Vec::with_capacity(max_group);
    while receiver.recv_many(&mut group, max_group).await > 0 {
        let outcome = commit_group(&db, &queue, &group).await;
        match &outcome {
            Ok(()) => {
                consecutive_failures.store(0, Ordering::Relaxed);
                for lane in Lane::ALL {
                    if group.iter().any(|job| job.entry.lane == *lane) {
                        queue.notify_arrivals(*lane);
                    }
                }
            }
            Err(err) => {
                let failures = consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
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

async fn commit_group(db: &Db, queue: &EmbeddedQueue, group: &[Job]) -> anyhow::Result<()> {
    let mut conn = db.write.acquire().await?;
    let mut tx = conn.begin().await?;
    let records: Vec<&MessageRecord> = group.iter().map(|job| &job.entry.record).collect();
    messages::insert_many(&mut tx, &records).await?;
    for lane in Lane::ALL {
        let outbound: Vec<&OutboundMessage> = group
            .iter()
            .filter(|job| job.entry.lane == *lane)
            .map(|job| &job.entry.outbound)
            .collect();
        queue.insert_in(&mut tx, *lane, &outbound).await?;
    }
    let remembered: Vec<&StoredResponse> = group
        .iter()
        .filter_map(|job| job.entry.idempotency.as_ref())
        .collect();
    if !remembered.is_empty() {
        idempotency::insert_many(&mut tx, &remembered).await?;
    }
    tx.commit().await?;
    Ok(())
}
