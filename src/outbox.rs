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

use tokio::sync::{Semaphore, mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use crate::accept::FailureStreak;
use crate::config::SqsSettings;
use crate::model::{Channel, Lane, MessageStatus, Priority, now_ms};
use crate::queue::{EntryResult, LaneQueue, OutboundMessage};
use crate::store::Db;

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
    /// Ends at shutdown.
    pub sweeper: JoinHandle<()>,
}

/// Inserts the outbox rows of a group in the accept writer's transaction.
/// Each row's `Option<i64>` is when a scheduled message is due (ms): the
/// scheduler sends it then; `None` rows are sent by the request at once.
pub fn insert_rows(
    tx: &rusqlite::Transaction,
    rows: &[(Lane, &OutboundMessage, Option<i64>)],
    now: i64,
) -> rusqlite::Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut insert = tx.prepare_cached(
        "INSERT OR REPLACE INTO outbox (message_id, lane, tenant_id, channel, priority, body, created_at, due_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )?;
    for (lane, message, due_at) in rows {
        insert.execute(rusqlite::params![
            message.message_id,
            lane.as_str(),
            message.tenant_id,
            message.channel.as_str(),
            message.priority.as_str(),
            message.body,
            now,
            due_at,
        ])?;
    }
    Ok(())
}

impl Outbox {
    /// Starts the batchers, the row remover and the sweeper. The first sweep
    /// (every row left by an earlier process) runs before this returns.
    pub async fn start(
        db: Db,
        queue: Arc<dyn LaneQueue>,
        settings: &SqsSettings,
        shutdown: watch::Receiver<bool>,
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
        let first_cutoff = match &outbox.db {
            Db::Sqlite(_) => None,
            Db::Postgres(_) => {
                Some(now_ms() - Duration::from_secs(settings.outbox_sweep_secs).as_millis() as i64)
            }
        };
        match outbox.sweep(first_cutoff).await {
            Ok(0) => {}
            Ok(resent) => info!(resent, "Re-sent outbox messages left by an earlier run."),
            Err(err) => {
                warn!(error = %format!("{err:#}"), "Could not re-send the outbox at start-up; the sweeper tries again.")
            }
        }
        let sweeper = tokio::spawn(run_sweeper(
            outbox.clone(),
            Duration::from_secs(settings.outbox_sweep_secs),
            shutdown,
        ));
        Ok((outbox, OutboxTasks { forgetter, sweeper }))
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
        let detail = format!("not queued: {reason}");
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
        // The same three statements on either store, in one transaction.
        macro_rules! reject_in {
            ($tx:expr) => {{
                let mut tx = $tx;
                sqlx::query("DELETE FROM outbox WHERE message_id = $1")
                    .bind(message_id)
                    .execute(&mut *tx)
                    .await?;
                let marked = sqlx::query(
                    "UPDATE messages SET status = $1, last_error = $2, updated_at = $3 WHERE id = $4 AND status = $5",
                )
                .bind(MessageStatus::Rejected.as_str())
                .bind(detail)
                .bind(now_ms())
                .bind(message_id)
                .bind(MessageStatus::Queued.as_str())
                .execute(&mut *tx)
                .await?;
                let outcome = if marked.rows_affected() == 1 {
                    sqlx::query("DELETE FROM idempotency_keys WHERE tenant_id = $1 AND message_id = $2")
                        .bind(tenant_id)
                        .bind(message_id)
                        .execute(&mut *tx)
                        .await?;
                    Rejection::Rejected
                } else {
                    Rejection::InFlight
                };
                tx.commit().await?;
                outcome
            }};
        }
        Ok(match &self.db {
            Db::Sqlite(sqlite) => {
                let _turn = sqlite.write_turn().await;
                reject_in!(sqlite.write.begin_with("BEGIN IMMEDIATE").await?)
            }
            Db::Postgres(pg) => reject_in!(pg.pool.begin().await?),
        })
    }

    /// Sends the outbox rows created at or before `cutoff_ms` (all rows when
    /// `None`) and the scheduled rows that are due, and removes those SQS
    /// took (a scheduled message is `queued` from then on). Returns how many
    /// were sent.
    pub async fn sweep(&self, cutoff_ms: Option<i64>) -> anyhow::Result<usize> {
        let cutoff = cutoff_ms.unwrap_or(i64::MAX);
        let sqlite = match &self.db {
            Db::Sqlite(sqlite) => sqlite,
            Db::Postgres(pg) => return self.sweep_claiming(pg, cutoff).await,
        };
        let mut resent = 0;
        let mut after = String::new();
        loop {
            let rows: Vec<OutboxRow> = sqlx::query_as(
                "SELECT message_id, lane, tenant_id, channel, priority, body FROM outbox \
                 WHERE ((due_at IS NULL AND created_at <= $1) OR due_at <= $2) AND message_id > $3 \
                 ORDER BY message_id LIMIT $4",
            )
            .bind(cutoff)
            .bind(now_ms())
            .bind(&after)
            .bind(SWEEP_PAGE)
            .fetch_all(&sqlite.read)
            .await?;
            let Some(last) = rows.last() else {
                return Ok(resent);
            };
            after = last.0.clone();
            let page_len = rows.len();
            let sent = self.resend(rows).await?;
            resent += sent.len();
            mark_due_queued(&self.db, &sent).await?;
            forget_rows(&self.db, &sent).await?;
            if (page_len as i64) < SWEEP_PAGE {
                return Ok(resent);
            }
        }
    }

    /// The sweep on PostgreSQL, where several instances sweep: each page of
    /// rows is claimed with `FOR UPDATE SKIP LOCKED` in a transaction that
    /// also removes those SQS took, so two sweepers never send the same row
    /// and a sweeper that dies mid-page leaves its rows to the next.
    async fn sweep_claiming(
        &self,
        pg: &crate::store::postgres::PgDb,
        cutoff: i64,
    ) -> anyhow::Result<usize> {
        let mut resent = 0;
        loop {
            let mut tx = pg.pool.begin().await?;
            let rows: Vec<OutboxRow> = sqlx::query_as(
                "SELECT message_id, lane, tenant_id, channel, priority, body FROM outbox \
                 WHERE (due_at IS NULL AND created_at <= $1) OR due_at <= $2 \
                 ORDER BY created_at LIMIT $3 FOR UPDATE SKIP LOCKED",
            )
            .bind(cutoff)
            .bind(now_ms())
            .bind(SWEEP_PAGE)
            .fetch_all(&mut *tx)
            .await?;
            let page_len = rows.len();
            let sent = self.resend(rows).await?;
            sqlx::query("DELETE FROM outbox WHERE message_id = ANY($1)")
                .bind(&sent)
                .execute(&mut *tx)
                .await?;
            sqlx::query(MARK_DUE_QUEUED)
                .bind(now_ms())
                .bind(&sent)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            resent += sent.len();
            if (page_len as i64) < SWEEP_PAGE || sent.is_empty() {
                return Ok(resent);
            }
        }
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

/// An outbox row: message id, lane, tenant, channel, priority, body.
type OutboxRow = (String, String, String, String, String, String);

/// A scheduled message that reached its lane is `queued` (unless it was
/// cancelled meanwhile: the consumer then drops it).
const MARK_DUE_QUEUED: &str = "UPDATE messages SET status = 'queued', updated_at = $1 \
     WHERE status = 'scheduled' AND id = ANY($2)";

async fn mark_due_queued(db: &Db, ids: &[String]) -> anyhow::Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    match db {
        Db::Sqlite(sqlite) => {
            let now = now_ms();
            sqlite
                .execute_for_ids(ids, |query| {
                    query
                        .push("UPDATE messages SET status = 'queued', updated_at = ")
                        .push_bind(now)
                        .push(" WHERE status = 'scheduled' AND id IN (");
                })
                .await?;
        }
        Db::Postgres(pg) => {
            sqlx::query(MARK_DUE_QUEUED)
                .bind(now_ms())
                .bind(ids)
                .execute(&pg.pool)
                .await?;
        }
    }
    Ok(())
}

/// How often scheduled messages are looked for: a message is in its lane
/// at most this long after it is due.
const SCHEDULER_TICK: Duration = Duration::from_secs(1);

/// Every [`SCHEDULER_TICK`], sends the scheduled messages that are due;
/// every half sweep age, also re-sends rows whose send outcome was never
/// recorded. With several instances each row is claimed by one of them.
async fn run_sweeper(outbox: Arc<Outbox>, age: Duration, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(SCHEDULER_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let mut last_sweep = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = tick.tick() => {
                // Between sweeps only due scheduled rows qualify.
                let cutoff = if last_sweep.elapsed() >= age / 2 {
                    last_sweep = tokio::time::Instant::now();
                    now_ms() - age.as_millis() as i64
                } else {
                    i64::MIN
                };
                match outbox.sweep(Some(cutoff)).await {
                    Ok(0) => {}
                    Ok(resent) => info!(resent, "Outbox sent scheduled messages that fell due or re-sent messages whose send outcome was unknown."),
                    Err(err) => warn!(error = %err, "Outbox sweep failed; the next one tries again."),
                }
            }
            _ = shutdown.changed() => return,
        }
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
        if let Err(err) = forget_rows(&db, &batch).await {
            warn!(error = %err, count = batch.len(), "Could not remove sent messages from the outbox; the sweeper will send them again.");
        }
        batch.clear();
    }
}

async fn forget_rows(db: &Db, ids: &[String]) -> anyhow::Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    match db {
        Db::Sqlite(sqlite) => {
            sqlite
                .execute_for_ids(ids, |query| {
                    query.push("DELETE FROM outbox WHERE message_id IN (");
                })
                .await?;
        }
        Db::Postgres(pg) => {
            sqlx::query("DELETE FROM outbox WHERE message_id = ANY($1)")
                .bind(ids)
                .execute(&pg.pool)
                .await?;
        }
    }
    Ok(())
}
