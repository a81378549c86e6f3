//! The outbox: the accept path in SQS mode.
//!
//! With SQS, the status row (SQLite) and the queue message (SQS) live in two
//! systems that cannot share a transaction. The accept writer commits the
//! status row together with an outbox row holding the queue message; then
//! the request hands the message to a per-lane batcher, which coalesces
//! concurrent requests into SendMessageBatch calls (up to ten entries, at
//! most `queue.sqs.batch_window_ms` of waiting) and answers each request
//! with its own entry's outcome.
//!
//! | what happened | request | status row | outbox row |
//! |---|---|---|---|
//! | SQS took the entry | 202 | `queued` | removed (batched) |
//! | entry failed or timed out | 503 + Retry-After | `rejected` | removed, with the idempotency record |
//! | timed out, but a consumer already took it | 202 | unchanged (being delivered) | removed |
//! | process died in between | (no answer) | `queued` | left; the sweeper sends it |
//!
//! The sweeper re-sends every row at start-up (a row that survived a restart
//! belongs to a process that is gone) and afterwards rows older than
//! `queue.sqs.outbox_sweep_secs`, which is longer than any request waits for
//! its send. A message that reached SQS twice (the process died after the
//! send but before its outbox row was removed) is sent to the provider once:
//! the consumer skips a message whose status is already `sent`. A message
//! that reached SQS although its request was answered 503 (a send that timed
//! out on our side but arrived) is `rejected` and the consumer drops it.
//! Every wait is bounded: the request's by `send_timeout_ms` (getting into
//! the batcher included), each SQS call by the client's attempt timeout.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use crate::config::SqsSettings;
use crate::model::{Channel, Lane, Priority, now_ms};
use crate::queue::{EntryResult, LaneQueue, OutboundMessage};
use crate::store::outbox::{self, OutboxRow};
use crate::store::{Db, FailureStreak};

/// Entries per SendMessageBatch (the SQS limit).
const BATCH_ENTRIES: usize = 10;

/// SendMessageBatch calls in flight at once per lane.
const SENDS_IN_FLIGHT: usize = 16;

/// Outbox rows removed per DELETE.
const FORGET_BATCH: usize = 256;

/// Rows read per sweep query.
const SWEEP_PAGE: i64 = 100;

/// Attempts to mark a failed send before giving up (and logging).
const REJECT_ATTEMPTS: usize = 3;

struct Pending {
    message: OutboundMessage,
    reply: oneshot::Sender<EntryResult>,
}

/// The send could not be confirmed; the request answers 503.
#[derive(Debug)]
pub struct SendFailed {
    pub reason: String,
    pub retry_after: Duration,
}

/// What [`Outbox::reject`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rejection {
    /// Marked `rejected`: answer 503.
    Rejected,
    /// A consumer already took the message, so SQS had it after all:
    /// answer 202.
    InFlight,
}

/// Handle used by the accept path; see the module documentation.
pub struct Outbox {
    db: Db,
    queue: Arc<dyn LaneQueue>,
    fast: mpsc::Sender<Pending>,
    slow: mpsc::Sender<Pending>,
    forget: mpsc::Sender<String>,
    send_timeout: Duration,
    failures: FailureStreak,
}

/// Background tasks of the outbox; await them at shutdown.
pub struct OutboxTasks {
    /// Ends once every [`Outbox`] handle is gone and the last removals are
    /// committed.
    pub forgetter: JoinHandle<()>,
}

impl Outbox {
    /// Starts the batchers and the row remover. The first sweep (every row
    /// left by an earlier process) runs before this returns; later sweeps
    /// are the scheduler's (`crate::scheduler`).
    pub async fn start(
        db: Db,
        queue: Arc<dyn LaneQueue>,
        settings: &SqsSettings,
    ) -> anyhow::Result<(Arc<Outbox>, OutboxTasks)> {
        let window = Duration::from_millis(settings.batch_window_ms);
        let mut senders = Vec::new();
        for lane in Lane::ALL {
            let (tx, rx) = mpsc::channel(BATCH_ENTRIES * SENDS_IN_FLIGHT * 4);
            tokio::spawn(run_batcher(queue.clone(), *lane, rx, window));
            senders.push(tx);
        }
        let (forget, forget_rx) = mpsc::channel(FORGET_BATCH * 16);
        let forgetter = tokio::spawn(run_forgetter(db.clone(), forget_rx, window));
        let slow = senders.pop().expect("two lanes");
        let fast = senders.pop().expect("two lanes");
        let outbox = Arc::new(Outbox {
            db,
            queue,
            fast,
            slow,
            forget,
            send_timeout: Duration::from_millis(settings.send_timeout_ms),
            failures: FailureStreak::default(),
        });
        // On SQLite the file belongs to this one instance, so a row left at
        // start-up belongs to a process that is gone. On PostgreSQL it may
        // belong to another instance that is sending it right now: only
        // rows past the sweep age are taken.
        let first_cutoff = outbox
            .db
            .is_shared()
            .then(|| now_ms() - Duration::from_secs(settings.outbox_sweep_secs).as_millis() as i64);
        match outbox.sweep(first_cutoff).await {
            Ok(0) => {}
            Ok(resent) => info!(resent, "Re-sent outbox messages left by an earlier run."),
            Err(err) => {
                warn!(error = %format!("{err:#}"), "Could not re-send the outbox at start-up; the sweeper tries again.")
            }
        }
        Ok((outbox, OutboxTasks { forgetter }))
    }

    /// Puts `message` on `lane` through the batcher. `Ok` once SQS has
    /// confirmed this message's entry; `Err` when it failed or took longer
    /// than `send_timeout_ms` in all (waiting for the batcher included).
    pub async fn send(&self, lane: Lane, message: OutboundMessage) -> Result<(), SendFailed> {
        let id = message.message_id.clone();
        let (reply, answer) = oneshot::channel();
        let batcher = match lane {
            Lane::Fast => &self.fast,
            Lane::Slow => &self.slow,
        };
        let sent = tokio::time::timeout(self.send_timeout, async {
            if batcher.send(Pending { message, reply }).await.is_err() {
                return Err("the SQS batcher has stopped".to_owned());
            }
            answer
                .await
                .unwrap_or_else(|_| Err("the SQS batcher dropped the message".to_owned()))
        })
        .await;
        let outcome = sent.unwrap_or_else(|_| {
            Err(format!(
                "SQS did not confirm the send within {} ms",
                self.send_timeout.as_millis()
            ))
        });
        match outcome {
            Ok(()) => {
                self.failures.succeeded();
                // When full, the row stays and the sweeper sends it once more
                // (a duplicate the consumer absorbs) rather than the request
                // waiting here.
                let _ = self.forget.try_send(id);
                Ok(())
            }
            Err(reason) => {
                self.failures.failed();
                Err(SendFailed {
                    reason,
                    retry_after: self.failures.retry_after(),
                })
            }
        }
    }

    /// Records that the message's send failed: removes the outbox row and,
    /// unless a consumer already has the message (it reached SQS after all,
    /// and its status moved on from `queued`), marks it `rejected` and
    /// removes its idempotency record (a retry with the same key is a new
    /// attempt). Returns [`Rejection::InFlight`] in that case: the request
    /// should answer 202 after all.
    pub async fn reject(&self, tenant_id: &str, message_id: &str, reason: &str) -> Rejection {
        // The reason is the SDK's text (it may name queue ARNs and the
        // account): logged, not stored where the tenant reads it.
        warn!(%message_id, %reason, "The queue did not take a message.");
        let detail = "not queued: the queue did not take it".to_owned();
        for attempt in 1..=REJECT_ATTEMPTS {
            match self.try_reject(tenant_id, message_id, &detail).await {
                Ok(outcome) => return outcome,
                Err(err) if attempt == REJECT_ATTEMPTS => {
                    error!(%message_id, error = %err, "Could not mark a message whose send failed; the sweeper may still deliver it.");
                }
                Err(err) => {
                    warn!(%message_id, error = %err, attempt, "Could not mark a message whose send failed; trying again.");
                    tokio::time::sleep(Duration::from_millis(50 * attempt as u64)).await;
                }
            }
        }
        Rejection::Rejected
    }

    async fn try_reject(
        &self,
        tenant_id: &str,
        message_id: &str,
        detail: &str,
    ) -> anyhow::Result<Rejection> {
        Ok(
            match outbox::reject(&self.db, tenant_id, message_id, detail).await? {
                true => Rejection::Rejected,
                false => Rejection::InFlight,
            },
        )
    }

    /// Sends the outbox rows created at or before `cutoff_ms` (all rows when
    /// `None`) and the scheduled rows that are due, and removes those SQS
    /// took (a scheduled message is `queued` from then on). Returns how many
    /// were sent.
    pub async fn sweep(&self, cutoff_ms: Option<i64>) -> anyhow::Result<usize> {
        let cutoff = cutoff_ms.unwrap_or(i64::MAX);
        outbox::drain_due(&self.db, cutoff, SWEEP_PAGE, |rows| self.resend(rows)).await
    }

    /// Sends outbox rows to their lanes; returns the ids SQS took.
    async fn resend(&self, rows: Vec<OutboxRow>) -> anyhow::Result<Vec<String>> {
        let mut by_lane: [Vec<OutboundMessage>; 2] = [Vec::new(), Vec::new()];
        for (message_id, lane, tenant_id, channel, priority, body) in rows {
            let (Ok(lane), Ok(channel), Ok(priority)) = (
                lane.parse::<Lane>(),
                channel.parse::<Channel>(),
                priority.parse::<Priority>(),
            ) else {
                warn!(%message_id, "Outbox row with an unknown lane, channel or priority; left alone.");
                continue;
            };
            let slot = usize::from(lane == Lane::Slow);
            by_lane[slot].push(OutboundMessage {
                message_id,
                tenant_id,
                channel,
                priority,
                body,
                delay: Duration::ZERO,
            });
        }
        let mut sent = Vec::new();
        for (lane, messages) in Lane::ALL.iter().zip(by_lane) {
            if messages.is_empty() {
                continue;
            }
            let ids: Vec<String> = messages.iter().map(|m| m.message_id.clone()).collect();
            let results = self.queue.send_batch(*lane, messages).await?;
            for (id, result) in ids.into_iter().zip(results) {
                match result {
                    Ok(()) => sent.push(id),
                    Err(reason) => {
                        warn!(message_id = %id, %reason, "Outbox re-send failed; the next sweep tries again.");
                    }
                }
            }
        }
        Ok(sent)
    }
}

/// Collects up to ten messages (waiting at most `window` after the first)
/// and sends them in one call, several calls in flight at once.
async fn run_batcher(
    queue: Arc<dyn LaneQueue>,
    lane: Lane,
    mut pending: mpsc::Receiver<Pending>,
    window: Duration,
) {
    let in_flight = Arc::new(Semaphore::new(SENDS_IN_FLIGHT));
    let mut batch = Vec::with_capacity(BATCH_ENTRIES);
    while let Some(first) = pending.recv().await {
        batch.push(first);
        let deadline = tokio::time::sleep(window);
        tokio::pin!(deadline);
        while batch.len() < BATCH_ENTRIES {
            tokio::select! {
                next = pending.recv() => match next {
                    Some(next) => batch.push(next),
                    None => break,
                },
                _ = &mut deadline => break,
            }
        }
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            return;
        };
        let queue = queue.clone();
        // A request that gave up (timed out) has been answered 503 and its
        // message marked `rejected`: sending it now would only waste a call.
        let entries: Vec<Pending> = std::mem::take(&mut batch)
            .into_iter()
            .filter(|entry| !entry.reply.is_closed())
            .collect();
        if entries.is_empty() {
            continue;
        }
        tokio::spawn(async move {
            let (messages, replies): (Vec<_>, Vec<_>) = entries
                .into_iter()
                .map(|entry| (entry.message, entry.reply))
                .unzip();
            match queue.send_batch(lane, messages).await {
                Ok(results) => {
                    for (reply, result) in replies.into_iter().zip(results) {
                        let _ = reply.send(result);
                    }
                }
                Err(err) => {
                    let reason = format!("SendMessageBatch failed: {err:#}");
                    for reply in replies {
                        let _ = reply.send(Err(reason.clone()));
                    }
                }
            }
            drop(permit);
        });
    }
}

/// Removes the outbox rows of sent messages in batches.
async fn run_forgetter(db: Db, mut ids: mpsc::Receiver<String>, window: Duration) {
    let mut batch = Vec::with_capacity(FORGET_BATCH);
    loop {
        if ids.recv_many(&mut batch, FORGET_BATCH).await == 0 {
            return;
        }
        // Let a burst gather so one DELETE covers many rows.
        tokio::time::sleep(window).await;
        let room = FORGET_BATCH.saturating_sub(batch.len());
        if room > 0 {
            while let Ok(id) = ids.try_recv() {
                batch.push(id);
                if batch.len() >= FORGET_BATCH {
                    break;
                }
            }
        }
        if let Err(err) = outbox::forget(&db, &batch).await {
            warn!(error = %err, count = batch.len(), "Could not remove sent messages from the outbox; the sweeper will send them again.");
        }
        batch.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::postgres::tests::TestDatabase;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_sweepers_never_send_the_same_outbox_row() {
        let database = TestDatabase::create().await;
        let db = database.open().await;
        let mut sqs = crate::config::Settings::from_toml_overlay("")
            .unwrap()
            .queue
            .sqs;
        sqs.outbox_sweep_secs = 3600;
        // Two instances' outboxes, each sending to a queue of its own (the
        // embedded queue in a SQLite file), so every row sent is counted
        // where it went.
        let dir = tempfile::tempdir().unwrap();
        let mut outboxes = Vec::new();
        let mut files = Vec::new();
        for name in ["a", "b"] {
            let sqlite =
                crate::store::SqliteDb::open(&dir.path().join(format!("{name}.db")), false)
                    .await
                    .unwrap();
            let lanes = crate::config::Settings::from_toml_overlay("")
                .unwrap()
                .lanes;
            let (writer, _done) =
                crate::store::sqlite::writer::StoreWriter::spawn(&sqlite, 64).unwrap();
            let queue: Arc<dyn crate::queue::LaneQueue> = Arc::new(
                crate::queue::embedded::EmbeddedQueue::open(sqlite.clone(), lanes, writer)
                    .await
                    .unwrap(),
            );
            let (outbox, _tasks) = Outbox::start(db.clone(), queue, &sqs).await.unwrap();
            outboxes.push(outbox);
            files.push(sqlite);
        }
        // 250 rows an instance that died left behind, 10 minutes ago.
        let old = now_ms() - 600_000;
        sqlx::query(
            "INSERT INTO outbox SELECT 'm' || n, 'fast', 't', 'sms', 'normal', '{}', $1 FROM generate_series(1, 250) AS n",
        )
        .bind(old)
        .execute(&db.postgres().unwrap().pool)
        .await
        .unwrap();
        let cutoff = Some(now_ms() - 1000);
        let (a, b) = tokio::join!(outboxes[0].sweep(cutoff), outboxes[1].sweep(cutoff));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a + b, 250, "every row re-sent once ({a} + {b})");
        let mut ids = std::collections::HashSet::new();
        for sqlite in &files {
            let sent: Vec<String> = sqlx::query_scalar("SELECT message_id FROM queue_messages")
                .fetch_all(&sqlite.read)
                .await
                .unwrap();
            for id in sent {
                assert!(ids.insert(id.clone()), "{id} was sent by both sweepers");
            }
        }
        assert_eq!(ids.len(), 250);
        assert_eq!(
            crate::store::postgres::tests::count(&db, "SELECT COUNT(*) FROM outbox").await,
            0
        );
    }
}
