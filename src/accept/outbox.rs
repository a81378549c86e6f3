//! The outbox and its relay: the accept path in SQS mode.
//!
//! With SQS, the status row (in the store) and the queue message (in SQS)
//! live in two systems that cannot share a transaction. The accept writer
//! commits the status row together with an outbox row holding the queue
//! message, and that commit is the accept: the request is answered 202 at
//! once and hands the message to this instance's relay ([`Outbox::hand`],
//! a bounded channel, no wait on SQS). The relay sends what it is handed in
//! SendMessageBatch calls of up to ten entries of one priority class (one
//! call per class queue), waiting at most `queue.sqs.batch_window_ms` for a
//! batch to fill, and removes each row once SQS has its entry.
//!
//! | what happened | request | status row | outbox row |
//! |---|---|---|---|
//! | committed | 202 | `queued` | written |
//! | SQS took the entry | (answered) | `queued` | removed (batched) |
//! | SQS failed, refused or was slow | (answered) | `queued` | kept; the relay retries with backoff |
//! | the relay's channel was full | (answered) | `queued` | kept; the sweeper sends it |
//! | process died before the relay sent it | (answered, or no answer) | `queued` | kept; the sweeper sends it |
//!
//! SQS trouble is a backlog, not an error: while SQS fails, accepts go on
//! into the outbox, the relay retries the entries it holds with a bounded,
//! jittered backoff (one WARN per streak of failures, not one per message),
//! and delivery resumes when SQS answers. The outbox's rows count toward
//! their lane's backlog (`crate::limits::backpressure`), so the lane's
//! high-water mark (429 with Retry-After) bounds the outbox too; `/readyz`
//! says `queue_relay: behind` while the relay is failing.
//!
//! The sweeper (`crate::scheduler`) sends every row at start-up on SQLite
//! (the file belongs to this one process, so a row left there is a dead
//! process's) and afterwards rows older than `queue.sqs.outbox_sweep_secs`
//! that this instance's relay does not hold, on PostgreSQL rows another
//! instance left behind (claimed with `FOR UPDATE SKIP LOCKED`). A message
//! that reached SQS twice (a process died after the send but before its
//! row was removed, or a relay and a sweeper both sent a row) is sent to
//! the provider once: the consumer's claim skips a message whose status has
//! moved on from `queued`.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rand::Rng;
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::config::SqsSettings;
use crate::message::OutboundMessage;
use crate::metrics as names;
use crate::model::{Channel, Lane, Priority, now_ms};
use crate::queue::LaneQueue;
use crate::store::Db;
use crate::store::outbox::OutboxRow;

/// Entries per SendMessageBatch (the SQS limit).
const BATCH_ENTRIES: usize = 10;

/// SendMessageBatch calls in flight at once per lane.
const SENDS_IN_FLIGHT: usize = 16;

/// Messages a lane's relay holds in its channel; beyond that a committed
/// message waits in the outbox for the sweeper.
const RELAY_CAPACITY: usize = 4096;

/// Outbox rows removed per DELETE.
const FORGET_BATCH: usize = 256;

/// Rows read per sweep query.
const SWEEP_PAGE: i64 = 100;

/// The relay's first wait after a failed call; doubles with each failure
/// in a row up to [`MAX_BACKOFF`], and each wait is drawn between half and
/// all of it (jitter), so instances that lost SQS together do not come
/// back in step.
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// How the relay is doing: failed calls in a row (the backoff and
/// `/readyz` read it) and whether this streak was logged yet.
#[derive(Debug, Default)]
pub struct RelayHealth {
    failures: AtomicU32,
    warned: AtomicBool,
}

impl RelayHealth {
    /// Whether the relay's last call failed: SQS is behind the outbox.
    pub fn is_behind(&self) -> bool {
        self.failures.load(Ordering::Relaxed) > 0
    }

    /// Counts a failed call for `lane`; logs the first of a streak.
    fn failed(&self, lane: Lane, reason: &str) {
        metrics::counter!(names::OUTBOX_RELAY_FAILURES_TOTAL, "lane" => lane.as_str()).increment(1);
        self.failures.fetch_add(1, Ordering::Relaxed);
        if !self.warned.swap(true, Ordering::Relaxed) {
            // The reason is the SDK's text; logged, never shown to tenants.
            warn!(%lane, %reason, "SQS does not take messages; accepted messages wait in the outbox and the relay keeps trying.");
        }
    }

    fn succeeded(&self) {
        let ended = self.failures.swap(0, Ordering::Relaxed);
        if ended > 0 && self.warned.swap(false, Ordering::Relaxed) {
            info!(
                failed_calls = ended,
                "SQS takes messages again; the outbox drains."
            );
        }
    }

    /// How long to wait before the next call: nothing while calls succeed.
    fn backoff(&self) -> Option<Duration> {
        let failures = self.failures.load(Ordering::Relaxed);
        if failures == 0 {
            return None;
        }
        let full = FIRST_BACKOFF
            .saturating_mul(1 << (failures - 1).min(8))
            .min(MAX_BACKOFF);
        Some(full.mul_f64(rand::rng().random_range(0.5..=1.0)))
    }
}

/// What the relay tasks of both lanes share.
struct Relay {
    queue: Arc<dyn LaneQueue>,
    /// Ids of the messages the relay holds (in its channel, in a call or
    /// waiting to be retried): the sweeper leaves their rows alone.
    held: Mutex<HashSet<String>>,
    health: Arc<RelayHealth>,
    /// Ids of sent messages, whose rows the forgetter removes.
    forget: mpsc::Sender<String>,
}

impl Relay {
    fn release(&self, ids: impl IntoIterator<Item = String>) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        for id in ids {
            held.remove(&id);
        }
    }

    fn holds(&self, id: &str) -> bool {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(id)
    }
}

/// Handle used by the accept path and the sweeper; see the module
/// documentation.
pub struct Outbox {
    db: Db,
    relay: Arc<Relay>,
    fast: mpsc::Sender<OutboundMessage>,
    slow: mpsc::Sender<OutboundMessage>,
}

/// Background tasks of the outbox; await them at shutdown.
pub struct OutboxTasks {
    /// Ends once every [`Outbox`] handle is gone, the relay has sent what
    /// it held (or given up on it while SQS fails) and the last removals
    /// are committed.
    pub forgetter: JoinHandle<()>,
}

impl Outbox {
    /// Starts the relays and the row remover. The first sweep (every row
    /// left by an earlier process) runs before this returns; later sweeps
    /// are the scheduler's (`crate::scheduler`).
    pub async fn start(
        db: Db,
        queue: Arc<dyn LaneQueue>,
        settings: &SqsSettings,
    ) -> anyhow::Result<(Arc<Outbox>, OutboxTasks)> {
        let window = Duration::from_millis(settings.batch_window_ms);
        let (forget, forget_rx) = mpsc::channel(FORGET_BATCH * 16);
        let forgetter = tokio::spawn(run_forgetter(db.clone(), forget_rx, window));
        let relay = Arc::new(Relay {
            queue,
            held: Mutex::default(),
            health: Arc::default(),
            forget,
        });
        let mut senders = Vec::new();
        for lane in Lane::ALL {
            let (tx, rx) = mpsc::channel(RELAY_CAPACITY);
            tokio::spawn(run_relay(relay.clone(), *lane, rx, window));
            senders.push(tx);
        }
        let slow = senders.pop().expect("two lanes");
        let fast = senders.pop().expect("two lanes");
        let outbox = Arc::new(Outbox {
            db,
            relay,
            fast,
            slow,
        });
        // A row left at start-up: the store says whether it may belong to
        // another instance sending it right now.
        let sweep_age = Duration::from_secs(settings.outbox_sweep_secs).as_millis() as i64;
        let first_cutoff = outbox.db.start_up_cutoff(now_ms(), sweep_age);
        match outbox.sweep(first_cutoff).await {
            Ok(0) => {}
            Ok(resent) => info!(resent, "Re-sent outbox messages left by an earlier run."),
            Err(err) => {
                warn!(error = %format!("{err:#}"), "Could not re-send the outbox at start-up; the sweeper tries again.")
            }
        }
        Ok((outbox, OutboxTasks { forgetter }))
    }

    /// Hands a committed message to its lane's relay, without waiting: a
    /// full relay leaves it in the outbox for the sweeper.
    pub fn hand(&self, lane: Lane, message: OutboundMessage) {
        let id = message.message_id.clone();
        self.relay
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id.clone());
        let relay = match lane {
            Lane::Fast => &self.fast,
            Lane::Slow => &self.slow,
        };
        if relay.try_send(message).is_err() {
            self.relay.release([id]);
        }
    }

    /// How the relay is doing, for `/readyz`.
    pub fn health(&self) -> Arc<RelayHealth> {
        self.relay.health.clone()
    }

    /// Sends the outbox rows created at or before `cutoff_ms` (all rows when
    /// `None`) that the relay does not hold, and the scheduled rows that are
    /// due, and removes those SQS took (a scheduled message is `queued`
    /// from then on). Returns how many were sent.
    pub async fn sweep(&self, cutoff_ms: Option<i64>) -> anyhow::Result<usize> {
        let cutoff = cutoff_ms.unwrap_or(i64::MAX);
        Ok(self
            .db
            .drain_outbox(cutoff, SWEEP_PAGE, &mut |rows| Box::pin(self.resend(rows)))
            .await?)
    }

    /// Sends outbox rows to their lanes; returns the ids SQS took.
    async fn resend(&self, rows: Vec<OutboxRow>) -> anyhow::Result<Vec<String>> {
        let mut by_lane: [Vec<OutboundMessage>; 2] = [Vec::new(), Vec::new()];
        for (message_id, lane, tenant_id, channel, priority, body) in rows {
            if self.relay.holds(&message_id) {
                continue;
            }
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
            let results = match self.relay.queue.send_batch(*lane, messages).await {
                Ok(results) => results,
                Err(err) => {
                    self.relay.health.failed(*lane, &format!("{err:#}"));
                    return Err(err);
                }
            };
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

/// Where a message goes in a lane: one SQS queue per priority class, so
/// one batch per class.
fn class(priority: Priority) -> usize {
    match priority {
        Priority::High => 0,
        Priority::Normal => 1,
        Priority::Low => 2,
    }
}

/// One lane's relay: gathers what it is handed into batches of up to ten
/// per priority class (waiting at most `window` after the first), sends
/// them with several calls in flight, and retries what failed after a
/// backoff. Ends once its channel is closed and what it holds is sent (or,
/// while SQS fails, left to the next start's sweep).
async fn run_relay(
    relay: Arc<Relay>,
    lane: Lane,
    mut handed: mpsc::Receiver<OutboundMessage>,
    window: Duration,
) {
    let in_flight = Arc::new(Semaphore::new(SENDS_IN_FLIGHT));
    // Failed entries come back here; at most what the calls in flight hold.
    let (retry_tx, mut retry_rx) = mpsc::unbounded_channel::<Vec<OutboundMessage>>();
    let mut classes: [Vec<OutboundMessage>; 3] = Default::default();
    let mut closed = false;
    loop {
        while let Ok(failed) = retry_rx.try_recv() {
            for message in failed {
                classes[class(message.priority)].push(message);
            }
        }
        if let Some(wait) = relay.health.backoff() {
            if closed {
                // Shutting down while SQS fails: the rows stay in the outbox.
                return;
            }
            tokio::time::sleep(wait).await;
        }
        if classes.iter().all(Vec::is_empty) {
            if closed {
                // Wait for the calls in flight; whatever fails comes back.
                let _ = in_flight.acquire_many(SENDS_IN_FLIGHT as u32).await;
                match retry_rx.try_recv() {
                    Ok(failed) => {
                        for message in failed {
                            classes[class(message.priority)].push(message);
                        }
                        continue;
                    }
                    Err(_) => return,
                }
            }
            tokio::select! {
                next = handed.recv() => match next {
                    Some(message) => classes[class(message.priority)].push(message),
                    None => {
                        closed = true;
                        continue;
                    }
                },
                Some(failed) = retry_rx.recv() => {
                    for message in failed {
                        classes[class(message.priority)].push(message);
                    }
                }
            }
        }
        // Fill up: until a class has a full batch or the window passes.
        if !closed && classes.iter().all(|c| c.len() < BATCH_ENTRIES) {
            let deadline = tokio::time::sleep(window);
            tokio::pin!(deadline);
            while classes.iter().all(|c| c.len() < BATCH_ENTRIES) {
                tokio::select! {
                    next = handed.recv() => match next {
                        Some(message) => classes[class(message.priority)].push(message),
                        None => {
                            closed = true;
                            break;
                        }
                    },
                    _ = &mut deadline => break,
                }
            }
        }
        // While SQS fails, one batch probes it per backoff; the rest waits.
        let probing = relay.health.is_behind();
        'send: for messages in &mut classes {
            while !messages.is_empty() {
                let take = messages.len().min(BATCH_ENTRIES);
                let batch: Vec<OutboundMessage> = messages.drain(..take).collect();
                let Ok(permit) = in_flight.clone().acquire_owned().await else {
                    return;
                };
                let (relay, retry) = (relay.clone(), retry_tx.clone());
                tokio::spawn(async move {
                    send_batch(&relay, lane, batch, &retry).await;
                    drop(permit);
                });
                if probing {
                    break 'send;
                }
            }
        }
    }
}

/// One SendMessageBatch: the rows of entries SQS took are removed, the
/// entries that failed go back to the relay through `retry`.
async fn send_batch(
    relay: &Relay,
    lane: Lane,
    batch: Vec<OutboundMessage>,
    retry: &mpsc::UnboundedSender<Vec<OutboundMessage>>,
) {
    let ids: Vec<String> = batch.iter().map(|m| m.message_id.clone()).collect();
    let results = match relay.queue.send_batch(lane, batch.clone()).await {
        Ok(results) => results,
        Err(err) => vec![Err(format!("SendMessageBatch failed: {err:#}")); ids.len()],
    };
    let mut failed = Vec::new();
    let mut reason = None;
    let mut sent = Vec::new();
    for ((id, message), result) in ids.into_iter().zip(batch).zip(results) {
        match result {
            Ok(()) => sent.push(id),
            Err(why) => {
                reason.get_or_insert(why);
                failed.push(message);
            }
        }
    }
    for id in &sent {
        // When full, the row stays and the sweeper sends it once more (a
        // duplicate the consumer absorbs).
        let _ = relay.forget.try_send(id.clone());
    }
    relay.release(sent);
    match reason {
        None => relay.health.succeeded(),
        Some(reason) => {
            relay.health.failed(lane, &reason);
            if let Err(unsent) = retry.send(failed) {
                // The relay has stopped: the rows stay for the next sweep.
                relay.release(unsent.0.into_iter().map(|m| m.message_id));
            }
        }
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
        if let Err(err) = db.forget_outbox_rows(&batch).await {
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
        .execute(&db.lanes_engine().unwrap().pool)
        .await
        .unwrap();
        let cutoff = Some(now_ms() - 1000);
        let (a, b) = tokio::join!(outboxes[0].sweep(cutoff), outboxes[1].sweep(cutoff));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a + b, 250, "every row re-sent once ({a} + {b})");
        let mut ids = std::collections::HashSet::new();
        for sqlite in &files {
            let sent: Vec<String> = sqlite
                .rows("SELECT message_id FROM queue_messages", vec![], |row| {
                    row.get(0)
                })
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
