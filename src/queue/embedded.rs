//! The embedded queue: SQS semantics on a table of the SQLite file, so a
//! single box needs no other server and a 202 survives `kill -9`.
//!
//! Fair dequeue: each entry gets a `fair_key`, a virtual finish time in the
//! style of start-time fair queueing. A tenant's next key is one past the
//! larger of its own last key and the key of the last message received from
//! the queue, and receives take the smallest keys first. A tenant that
//! enqueues 10,000 messages at once therefore occupies keys far ahead, while
//! another tenant's first message lands next to the current receive point and
//! is served within one round, whatever the first tenant's backlog.
//!
//! Priority first: each priority class keeps its own fair keys, and a
//! receive reads the head of each class through the `(queue, priority,
//! fair_key)` index (at most one batch of rows per class, whatever the
//! depth), then fills its batch high before normal before low under the
//! share rule of [`super::priority`]. A deferred message (retry backoff,
//! tenant at its cap, tenant paused) takes a fresh key when it is put back,
//! so it queues behind its tenant's other messages instead of keeping the
//! front place it had.
//!
//! Held tenants cost nothing: a receive that meets a message of a paused or
//! disabled tenant moves it to the lane's hold queue (`fast-held`,
//! `slow-held`) in the same transaction, so each held message is looked at
//! once, not received and put back every few seconds; releasing the tenant
//! moves its held messages back with fresh fair keys, in their order.
//!
//! Receipts are `seq:receive_count`: receiving a message again invalidates
//! the receipt a slower consumer may still hold, as in SQS.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use async_trait::async_trait;
use rusqlite::OptionalExtension;
use sqlx::{Connection, QueryBuilder, Sqlite};
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::warn;

use super::priority::{CLASSES, PriorityShare};
use super::{
    DeadLetter, EntryResult, LaneQueue, OutboundMessage, QueueStats, ReceivedMessage, RedriveFilter,
};
use crate::config::LanesSettings;
use crate::model::{Lane, Priority, now_ms};
use crate::store::Db;

/// Most messages per receive and per delete batch.
const EMBEDDED_BATCH: usize = 50;

/// Longest single sleep of a long poll between checks, so a clock jump or a
/// missed wake-up costs at most this much latency.
const MAX_POLL_NAP: Duration = Duration::from_millis(500);

/// Fair-queueing bookkeeping of one queue.
#[derive(Debug, Default)]
struct FairState {
    /// Last key handed to each tenant.
    last_key: HashMap<String, i64>,
    /// Key of the last received message: new arrivals start from here.
    virtual_now: i64,
}

impl FairState {
    fn next_key(&mut self, tenant_id: &str) -> i64 {
        let last = self.last_key.get(tenant_id).copied().unwrap_or(i64::MIN);
        let key = last.max(self.virtual_now) + 1;
        self.last_key.insert(tenant_id.to_owned(), key);
        key
    }
}

/// Per-lane state kept in memory beside the table.
#[derive(Debug)]
struct LaneState {
    /// Fair-queueing state of each priority class, by rank.
    fair: Mutex<[FairState; CLASSES]>,
    /// Which classes the next receive serves.
    share: PriorityShare,
    /// Woken after every commit that makes messages receivable.
    arrivals: Notify,
    deleted: AtomicU64,
}

pub struct EmbeddedQueue {
    db: Db,
    lanes: LanesSettings,
    /// Tenants whose messages are set aside (paused or disabled).
    held: Arc<std::sync::RwLock<std::collections::HashSet<String>>>,
    fast: Arc<LaneState>,
    slow: Arc<LaneState>,
    /// The connection of the hot path (receives and deletes): rusqlite with
    /// cached statements, used on a blocking thread while holding the write
    /// turn, so no SQL is parsed per receive and the turn is held only for
    /// the writes themselves.
    hot: Arc<std::sync::Mutex<rusqlite::Connection>>,
}

/// The columns every queue insert writes, in binding order.
const INSERT_INTO: &str = "INSERT INTO queue_messages (queue, message_id, tenant_id, channel, priority, body, fair_key, visible_at, receive_count, enqueued_at) ";

fn queue_name(lane: Lane) -> &'static str {
    lane.as_str()
}

fn held_name(lane: Lane) -> &'static str {
    match lane {
        Lane::Fast => "fast-held",
        Lane::Slow => "slow-held",
    }
}

fn dlq_name(lane: Lane) -> &'static str {
    match lane {
        Lane::Fast => "fast-dlq",
        Lane::Slow => "slow-dlq",
    }
}

fn parse_receipt(receipt: &str) -> Option<(i64, i64)> {
    let (seq, count) = receipt.split_once(':')?;
    Some((seq.parse().ok()?, count.parse().ok()?))
}

type QueueRow = (i64, String, String, String, String, String, i64, i64, i64);

impl EmbeddedQueue {
    /// Opens the queue tables of `db` and rebuilds the fair-queueing state
    /// from what is stored.
    pub async fn open(db: Db, lanes: LanesSettings) -> anyhow::Result<Self> {
        let lane_state = |lane: Lane| LaneState {
            fair: Mutex::default(),
            share: PriorityShare::new(lanes.get(lane).low_priority_share),
            arrivals: Notify::new(),
            deleted: AtomicU64::new(0),
        };
        let queue = EmbeddedQueue {
            fast: Arc::new(lane_state(Lane::Fast)),
            slow: Arc::new(lane_state(Lane::Slow)),
            hot: Arc::new(std::sync::Mutex::new(
                crate::accept::open_connection(&db.path, db.fsync)
                    .with_context(|| format!("opening {} for the queue", db.path.display()))?,
            )),
            db,
            lanes,
            held: Default::default(),
        };
        for lane in Lane::ALL {
            for priority in Priority::ALL {
                let rows: Vec<(String, i64)> = sqlx::query_as(
                    "SELECT tenant_id, MAX(fair_key) FROM queue_messages WHERE queue = ? AND priority = ? GROUP BY tenant_id",
                )
                .bind(queue_name(*lane))
                .bind(priority.as_str())
                .fetch_all(&queue.db.write)
                .await
                .context("loading embedded queue state")?;
                let min_key: Option<i64> = sqlx::query_scalar(
                    "SELECT MIN(fair_key) FROM queue_messages WHERE queue = ? AND priority = ?",
                )
                .bind(queue_name(*lane))
                .bind(priority.as_str())
                .fetch_one(&queue.db.write)
                .await?;
                let mut fair = queue.state(*lane).fair.lock().expect("fair state lock");
                let class = &mut fair[priority.rank()];
                class.virtual_now = min_key.map(|k| k - 1).unwrap_or(0);
                class.last_key = rows.into_iter().collect();
            }
        }
        Ok(queue)
    }

    fn state(&self, lane: Lane) -> &Arc<LaneState> {
        match lane {
            Lane::Fast => &self.fast,
            Lane::Slow => &self.slow,
        }
    }

    /// Fair keys for `messages`, in order, as they join `lane`.
    fn fair_keys(&self, lane: Lane, messages: &[&OutboundMessage]) -> Vec<i64> {
        let mut fair = self.state(lane).fair.lock().expect("fair state lock");
        messages
            .iter()
            .map(|m| fair[m.priority.rank()].next_key(&m.tenant_id))
            .collect()
    }

    /// Puts `messages` on `lane` within the accept writer's transaction
    /// (status rows and queue entries commit together); call
    /// [`EmbeddedQueue::notify_arrivals`] after the commit.
    pub fn insert_rows(
        &self,
        tx: &rusqlite::Transaction,
        lane: Lane,
        messages: &[&OutboundMessage],
    ) -> rusqlite::Result<()> {
        if messages.is_empty() {
            return Ok(());
        }
        let now = now_ms();
        let keys = self.fair_keys(lane, messages);
        let mut insert = tx.prepare_cached(&format!(
            "{INSERT_INTO} VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, 0, ?9)"
        ))?;
        for (message, key) in messages.iter().zip(keys) {
            insert.execute(rusqlite::params![
                queue_name(lane),
                message.message_id,
                message.tenant_id,
                message.channel.as_str(),
                message.priority.as_str(),
                message.body,
                key,
                now + message.delay.as_millis() as i64,
                now,
            ])?;
        }
        Ok(())
    }

    /// Appends `INSERT` statements (each ending in `;`) putting `messages`
    /// on `lane` to a multi-statement query; call
    /// [`EmbeddedQueue::notify_arrivals`] after it committed.
    pub fn push_insert(
        &self,
        builder: &mut QueryBuilder<Sqlite>,
        lane: Lane,
        messages: &[&OutboundMessage],
    ) {
        if messages.is_empty() {
            return;
        }
        let now = now_ms();
        let keys = self.fair_keys(lane, messages);
        for (chunk, keys) in messages.chunks(3000).zip(keys.chunks(3000)) {
            builder.push(INSERT_INTO);
            builder.push_values(chunk.iter().zip(keys), |mut row, (message, key)| {
                row.push_bind(queue_name(lane))
                    .push_bind(message.message_id.clone())
                    .push_bind(message.tenant_id.clone())
                    .push_bind(message.channel.as_str())
                    .push_bind(message.priority.as_str())
                    .push_bind(message.body.clone())
                    .push_bind(*key)
                    .push_bind(now + message.delay.as_millis() as i64)
                    .push_bind(0i64)
                    .push_bind(now);
            });
            builder.push(";\n");
        }
    }

    /// Wakes long-polling receivers of `lane`.
    pub fn notify_arrivals(&self, lane: Lane) {
        self.state(lane).arrivals.notify_waiters();
    }

    /// One non-waiting receive: takes up to `max` visible messages, high
    /// priority first under the share rule and by fair key within a class,
    /// moving any that were received `max_receive_count` times to the DLQ
    /// and setting aside those of held tenants. Runs on a blocking thread
    /// with the hot connection while holding the write turn.
    async fn receive_now(&self, lane: Lane, max: usize) -> anyhow::Result<Vec<ReceivedMessage>> {
        let settings = self.lanes.get(lane);
        let limits = (
            settings.max_receive_count as i64,
            (settings.visibility_timeout_secs * 1000) as i64,
        );
        let turn = self.db.write_turn().await;
        let (hot, state, held) = (
            self.hot.clone(),
            self.state(lane).clone(),
            self.held.clone(),
        );
        // If this future is dropped while the thread works (a consumer
        // shutting down mid-poll), the thread gives what it leased back at
        // once instead of leaving it invisible for a visibility timeout.
        let (answer, answered) = tokio::sync::oneshot::channel();
        tokio::task::spawn_blocking(move || {
            let _turn = turn;
            let mut conn = hot.lock().unwrap_or_else(|e| e.into_inner());
            let got = {
                let held = held.read().expect("held lock");
                receive_rows(&mut conn, lane, max, &state, &held, limits)
            };
            if let Err(Ok(unwanted)) = answer.send(got) {
                match unlease_rows(&mut conn, &unwanted) {
                    Ok(()) => state.arrivals.notify_waiters(),
                    Err(err) => {
                        warn!(lane = %lane, error = %err, "Could not give back an abandoned receive; its messages return after their visibility timeout.")
                    }
                }
            }
        });
        answered.await.context("the receive thread failed")?
    }

    /// Moves `tenant_id`'s set-aside messages of `lane` back into the lane:
    /// per priority class, in their original order, with fair keys that
    /// start where the tenant would start now.
    async fn release_held(&self, lane: Lane, tenant_id: &str) -> anyhow::Result<()> {
        let _turn = self.db.write_turn().await;
        let mut conn = self.db.write.acquire().await?;
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        let counts: Vec<(String, i64)> = sqlx::query_as(
            "SELECT priority, COUNT(*) FROM queue_messages WHERE queue = ? AND tenant_id = ? GROUP BY priority",
        )
        .bind(held_name(lane))
        .bind(tenant_id)
        .fetch_all(&mut *tx)
        .await?;
        if counts.is_empty() {
            return Ok(());
        }
        // Each class's keys run from the tenant's next key on; the fair
        // state is advanced past them only once the move has committed.
        let mut bases = [0i64; CLASSES];
        let mut lasts = Vec::new();
        {
            let fair = self.state(lane).fair.lock().expect("fair state lock");
            for (priority, count) in &counts {
                let rank = priority.parse::<Priority>().map_or(1, Priority::rank);
                let class = &fair[rank];
                let last = class.last_key.get(tenant_id).copied().unwrap_or(i64::MIN);
                bases[rank] = last.max(class.virtual_now);
                lasts.push((rank, bases[rank] + count));
            }
        }
        sqlx::query(
            "UPDATE queue_messages SET queue = ?1, visible_at = MIN(visible_at, ?2), \
               fair_key = CASE queue_messages.priority WHEN 'high' THEN ?3 WHEN 'normal' THEN ?4 ELSE ?5 END + ordered.place \
             FROM (SELECT seq, ROW_NUMBER() OVER (PARTITION BY priority ORDER BY seq) AS place \
                   FROM queue_messages WHERE queue = ?6 AND tenant_id = ?7) AS ordered \
             WHERE queue_messages.seq = ordered.seq",
        )
        .bind(queue_name(lane))
        .bind(now_ms())
        .bind(bases[Priority::High.rank()])
        .bind(bases[Priority::Normal.rank()])
        .bind(bases[Priority::Low.rank()])
        .bind(held_name(lane))
        .bind(tenant_id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        let mut fair = self.state(lane).fair.lock().expect("fair state lock");
        for (rank, last) in lasts {
            let key = fair[rank]
                .last_key
                .entry(tenant_id.to_owned())
                .or_insert(last);
            *key = (*key).max(last);
        }
        drop(fair);
        self.notify_arrivals(lane);
        Ok(())
    }

    /// Releases every set-aside message whose tenant is no longer held (a
    /// tenant resumed by a process that stopped before moving them back).
    pub async fn release_unheld(&self) -> anyhow::Result<()> {
        for lane in Lane::ALL {
            let tenants: Vec<String> =
                sqlx::query_scalar("SELECT DISTINCT tenant_id FROM queue_messages WHERE queue = ?")
                    .bind(held_name(*lane))
                    .fetch_all(&self.db.read)
                    .await?;
            for tenant in tenants {
                if !self.held.read().expect("held lock").contains(&tenant) {
                    self.release_held(*lane, &tenant).await?;
                }
            }
        }
        Ok(())
    }

    /// Earliest future instant (ms) at which a message of `lane` becomes visible.
    async fn next_visible_at(&self, lane: Lane) -> anyhow::Result<Option<i64>> {
        Ok(sqlx::query_scalar(
            "SELECT MIN(visible_at) FROM queue_messages WHERE queue = ? AND visible_at > ?",
        )
        .bind(queue_name(lane))
        .bind(now_ms())
        .fetch_one(&self.db.read)
        .await?)
    }
}

/// The receive itself, in one transaction on `conn` (see
/// [`EmbeddedQueue::receive_now`]). `limits` is `(max_receive_count,
/// visibility in ms)`.
fn receive_rows(
    conn: &mut rusqlite::Connection,
    lane: Lane,
    max: usize,
    state: &LaneState,
    held: &std::collections::HashSet<String>,
    (max_receives, visibility_ms): (i64, i64),
) -> anyhow::Result<Vec<ReceivedMessage>> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let now = now_ms();
    let mut out = Vec::new();
    let mut highest_key: [Option<i64>; CLASSES] = [None; CLASSES];
    {
        let mut heads_of = tx.prepare_cached(
            "SELECT seq, message_id, tenant_id, channel, priority, body, receive_count, enqueued_at, fair_key \
             FROM queue_messages INDEXED BY queue_messages_class \
             WHERE queue = ?1 AND priority = ?2 AND visible_at <= ?3 ORDER BY fair_key, seq LIMIT ?4",
        )?;
        let mut status_of = tx.prepare_cached("SELECT status FROM messages WHERE id = ?1")?;
        let mut lease = tx.prepare_cached(
            "UPDATE queue_messages SET receive_count = receive_count + 1, visible_at = ?1 WHERE seq = ?2",
        )?;
        let mut set_aside =
            tx.prepare_cached("UPDATE queue_messages SET queue = ?1 WHERE seq = ?2")?;
        let mut to_dlq = tx.prepare_cached(
            "UPDATE queue_messages SET queue = ?1, visible_at = ?2, last_error = COALESCE(last_error, \
             'received max_receive_count times without being deleted') WHERE seq = ?3",
        )?;
        let mut mark_dead = tx.prepare_cached(
            "UPDATE messages SET status = 'dead_lettered', updated_at = ?1, \
             last_error = COALESCE((SELECT last_error FROM queue_messages WHERE seq = ?2), last_error) \
             WHERE id = (SELECT message_id FROM queue_messages WHERE seq = ?2) AND status <> 'sent'",
        )?;
        while out.len() < max {
            let want = max - out.len();
            let mut heads: [Vec<QueueRow>; CLASSES] = Default::default();
            let mut moved = 0;
            for priority in Priority::ALL {
                let rows = heads_of
                    .query_map(
                        rusqlite::params![queue_name(lane), priority.as_str(), now, want as i64],
                        |row| {
                            Ok((
                                row.get(0)?,
                                row.get(1)?,
                                row.get(2)?,
                                row.get(3)?,
                                row.get(4)?,
                                row.get(5)?,
                                row.get(6)?,
                                row.get(7)?,
                                row.get(8)?,
                            ))
                        },
                    )?
                    .collect::<rusqlite::Result<Vec<QueueRow>>>()?;
                for row in rows {
                    if row.6 >= max_receives {
                        to_dlq.execute(rusqlite::params![dlq_name(lane), now, row.0])?;
                        mark_dead.execute(rusqlite::params![now, row.0])?;
                        moved += 1;
                    } else if held.contains(&row.2) {
                        set_aside.execute(rusqlite::params![held_name(lane), row.0])?;
                        moved += 1;
                    } else {
                        heads[priority.rank()].push(row);
                    }
                }
            }
            let split = state
                .share
                .split(std::array::from_fn(|rank| heads[rank].len()), want);
            for (seq, message_id, tenant_id, channel, priority, body, count, enqueued_at, key) in
                heads
                    .into_iter()
                    .zip(split)
                    .flat_map(|(rows, count)| rows.into_iter().take(count))
            {
                lease.execute(rusqlite::params![now + visibility_ms, seq])?;
                let status: Option<String> = status_of
                    .query_row([&message_id], |row| row.get(0))
                    .optional()?;
                let priority: Priority = priority.parse().map_err(anyhow::Error::msg)?;
                let highest = &mut highest_key[priority.rank()];
                *highest = (*highest).max(Some(key));
                out.push(ReceivedMessage {
                    receipt: format!("{seq}:{}", count + 1),
                    message_id,
                    tenant_id,
                    channel: channel.parse().map_err(anyhow::Error::msg)?,
                    priority,
                    body,
                    receive_count: (count + 1) as u32,
                    enqueued_at_ms: enqueued_at,
                    status_at_receive: status.and_then(|word| word.parse().ok()),
                });
            }
            // Rows moved to the DLQ or set aside left room: look again.
            // Otherwise the classes had no more than what was taken.
            if moved == 0 {
                break;
            }
        }
    }
    tx.commit()?;
    let mut fair = state.fair.lock().expect("fair state lock");
    for (class, key) in fair.iter_mut().zip(highest_key) {
        if let Some(key) = key {
            class.virtual_now = class.virtual_now.max(key);
        }
    }
    Ok(out)
}

/// Makes received messages visible again at once, as if they had not been
/// received (their receive count goes back down).
fn unlease_rows(
    conn: &mut rusqlite::Connection,
    messages: &[ReceivedMessage],
) -> rusqlite::Result<()> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    {
        let mut unlease = tx.prepare_cached(
            "UPDATE queue_messages SET visible_at = ?1, receive_count = receive_count - 1 \
             WHERE seq = ?2 AND receive_count = ?3",
        )?;
        let now = now_ms();
        for message in messages {
            if let Some((seq, count)) = parse_receipt(&message.receipt) {
                unlease.execute(rusqlite::params![now, seq, count])?;
            }
        }
    }
    tx.commit()
}

/// Deletes received messages in one transaction on `conn`; one result per
/// receipt, and how many were deleted.
fn delete_rows(
    conn: &mut rusqlite::Connection,
    lane: Lane,
    receipts: &[String],
) -> rusqlite::Result<(Vec<EntryResult>, u64)> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let mut results = Vec::with_capacity(receipts.len());
    let mut deleted = 0;
    {
        let mut delete = tx.prepare_cached(
            "DELETE FROM queue_messages WHERE seq = ?1 AND queue = ?2 AND receive_count = ?3",
        )?;
        for receipt in receipts {
            let Some((seq, count)) = parse_receipt(receipt) else {
                results.push(Err(format!("receipt {receipt:?} is malformed")));
                continue;
            };
            if delete.execute(rusqlite::params![seq, queue_name(lane), count])? == 1 {
                deleted += 1;
                results.push(Ok(()));
            } else {
                results.push(Err(format!("receipt {receipt:?} is no longer valid")));
            }
        }
    }
    tx.commit()?;
    Ok((results, deleted))
}

#[async_trait]
impl LaneQueue for EmbeddedQueue {
    async fn send_batch(
        &self,
        lane: Lane,
        messages: Vec<OutboundMessage>,
    ) -> anyhow::Result<Vec<EntryResult>> {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let refs: Vec<&OutboundMessage> = messages.iter().collect();
        let mut builder = QueryBuilder::new("");
        self.push_insert(&mut builder, lane, &refs);
        let _turn = self.db.write_turn().await;
        let mut conn = self.db.write.acquire().await?;
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        builder.build().persistent(false).execute(&mut *tx).await?;
        tx.commit().await?;
        self.notify_arrivals(lane);
        Ok(vec![Ok(()); messages.len()])
    }

    async fn receive(
        &self,
        lane: Lane,
        max: usize,
        wait: Duration,
    ) -> anyhow::Result<Vec<ReceivedMessage>> {
        let deadline = Instant::now() + wait;
        let arrivals = &self.state(lane).arrivals;
        loop {
            let notified = arrivals.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let got = self.receive_now(lane, max.max(1)).await?;
            let now = Instant::now();
            if !got.is_empty() || now >= deadline {
                return Ok(got);
            }
            let mut wake = deadline.min(now + MAX_POLL_NAP);
            if let Some(at) = self.next_visible_at(lane).await? {
                let in_ms = (at - now_ms()).max(0) as u64;
                wake = wake.min(now + Duration::from_millis(in_ms));
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    async fn delete_batch(
        &self,
        lane: Lane,
        receipts: &[String],
    ) -> anyhow::Result<Vec<EntryResult>> {
        let turn = self.db.write_turn().await;
        let hot = self.hot.clone();
        let receipts = receipts.to_vec();
        let (results, deleted) = tokio::task::spawn_blocking(move || {
            let _turn = turn;
            let mut conn = hot.lock().unwrap_or_else(|e| e.into_inner());
            delete_rows(&mut conn, lane, &receipts)
        })
        .await
        .context("the delete thread failed")??;
        self.state(lane)
            .deleted
            .fetch_add(deleted, Ordering::Relaxed);
        Ok(results)
    }

    async fn change_visibility_batch(
        &self,
        lane: Lane,
        changes: &[(String, Duration)],
    ) -> anyhow::Result<Vec<EntryResult>> {
        let _turn = self.db.write_turn().await;
        let mut conn = self.db.write.acquire().await?;
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        let now = now_ms();
        let mut results = Vec::with_capacity(changes.len());
        let mut returned_any = false;
        for (receipt, visibility) in changes {
            let Some((seq, count)) = parse_receipt(receipt) else {
                results.push(Err(format!("receipt {receipt:?} is malformed")));
                continue;
            };
            let done = sqlx::query(
                "UPDATE queue_messages SET visible_at = ? WHERE seq = ? AND queue = ? AND receive_count = ?",
            )
            .bind(now + visibility.as_millis() as i64)
            .bind(seq)
            .bind(queue_name(lane))
            .bind(count)
            .execute(&mut *tx)
            .await?;
            if done.rows_affected() == 1 {
                returned_any |= visibility.is_zero();
                results.push(Ok(()));
            } else {
                results.push(Err(format!("receipt {receipt:?} is no longer valid")));
            }
        }
        tx.commit().await?;
        if returned_any {
            self.notify_arrivals(lane);
        }
        Ok(results)
    }

    async fn defer(
        &self,
        lane: Lane,
        message: &ReceivedMessage,
        delay: Duration,
    ) -> anyhow::Result<()> {
        let (seq, count) = parse_receipt(&message.receipt)
            .with_context(|| format!("receipt {:?} is malformed", message.receipt))?;
        let _turn = self.db.write_turn().await;
        // A fresh fair key: the message queues behind its tenant's others.
        let key = self.state(lane).fair.lock().expect("fair state lock")[message.priority.rank()]
            .next_key(&message.tenant_id);
        let done = sqlx::query(
            "UPDATE queue_messages SET visible_at = ?, fair_key = ?, receive_count = MAX(receive_count - 1, 0) \
             WHERE seq = ? AND queue = ? AND receive_count = ?",
        )
        .bind(now_ms() + delay.as_millis() as i64)
        .bind(key)
        .bind(seq)
        .bind(queue_name(lane))
        .bind(count)
        .execute(&self.db.write)
        .await?;
        anyhow::ensure!(
            done.rows_affected() == 1,
            "receipt {:?} is no longer valid",
            message.receipt
        );
        if delay.is_zero() {
            self.notify_arrivals(lane);
        }
        Ok(())
    }

    async fn dead_letter(&self, lane: Lane, message: &ReceivedMessage) -> anyhow::Result<()> {
        let receipt = message.receipt.as_str();
        let (seq, count) =
            parse_receipt(receipt).with_context(|| format!("receipt {receipt:?} is malformed"))?;
        let _turn = self.db.write_turn().await;
        let done = sqlx::query(
            "UPDATE queue_messages SET queue = ?, visible_at = ? WHERE seq = ? AND queue = ? AND receive_count = ?",
        )
        .bind(dlq_name(lane))
        .bind(now_ms())
        .bind(seq)
        .bind(queue_name(lane))
        .bind(count)
        .execute(&self.db.write)
        .await?;
        anyhow::ensure!(
            done.rows_affected() == 1,
            "receipt {receipt:?} is no longer valid"
        );
        Ok(())
    }

    async fn stats(&self, lane: Lane) -> anyhow::Result<QueueStats> {
        let now = now_ms();
        let (visible, delayed, in_flight, oldest): (i64, i64, i64, Option<i64>) = sqlx::query_as(
            "SELECT \
               COALESCE(SUM(visible_at <= ?1), 0), \
               COALESCE(SUM(visible_at > ?1 AND receive_count = 0), 0), \
               COALESCE(SUM(visible_at > ?1 AND receive_count > 0), 0), \
               MIN(enqueued_at) \
             FROM queue_messages WHERE queue = ?2",
        )
        .bind(now)
        .bind(queue_name(lane))
        .fetch_one(&self.db.read)
        .await?;
        let (dlq_depth, held): (i64, i64) = sqlx::query_as(
            "SELECT COALESCE(SUM(queue = ?1), 0), COALESCE(SUM(queue = ?2), 0) \
             FROM queue_messages WHERE queue IN (?1, ?2)",
        )
        .bind(dlq_name(lane))
        .bind(held_name(lane))
        .fetch_one(&self.db.read)
        .await?;
        Ok(QueueStats {
            depth: (visible + delayed) as u64,
            in_flight: in_flight as u64,
            delayed: delayed as u64,
            oldest_age_secs: oldest.map(|at| (now - at).max(0) as f64 / 1000.0),
            dlq_depth: dlq_depth as u64,
            held: held as u64,
        })
    }

    async fn list_dead_letters(&self, lane: Lane, limit: usize) -> anyhow::Result<Vec<DeadLetter>> {
        let rows: Vec<QueueRow> = sqlx::query_as(
            "SELECT seq, message_id, tenant_id, channel, priority, body, receive_count, enqueued_at, fair_key \
             FROM queue_messages WHERE queue = ? ORDER BY seq LIMIT ?",
        )
        .bind(dlq_name(lane))
        .bind(limit as i64)
        .fetch_all(&self.db.read)
        .await?;
        rows.into_iter()
            .map(
                |(_, message_id, tenant_id, channel, priority, body, count, enqueued_at, _)| {
                    Ok(DeadLetter {
                        message_id,
                        tenant_id,
                        channel: channel.parse().map_err(anyhow::Error::msg)?,
                        priority: priority.parse().map_err(anyhow::Error::msg)?,
                        receive_count: count as u32,
                        enqueued_at_ms: enqueued_at,
                        body,
                    })
                },
            )
            .collect()
    }

    async fn redrive(&self, lane: Lane, filter: &RedriveFilter) -> anyhow::Result<Vec<String>> {
        let _turn = self.db.write_turn().await;
        let mut conn = self.db.write.acquire().await?;
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        let mut select: QueryBuilder<Sqlite> = QueryBuilder::new(
            "SELECT seq, message_id, tenant_id, priority FROM queue_messages WHERE queue = ",
        );
        select.push_bind(dlq_name(lane));
        if let Some(tenant) = &filter.tenant_id {
            select.push(" AND tenant_id = ").push_bind(tenant.clone());
        }
        if let Some(ids) = &filter.message_ids {
            if ids.is_empty() {
                return Ok(Vec::new());
            }
            select.push(" AND message_id IN (");
            let mut list = select.separated(", ");
            for id in ids {
                list.push_bind(id.clone());
            }
            select.push(")");
        }
        select.push(" ORDER BY seq");
        let rows: Vec<(i64, String, String, String)> = select
            .build_query_as()
            .persistent(false)
            .fetch_all(&mut *tx)
            .await?;
        let now = now_ms();
        for (seq, _, tenant_id, priority) in &rows {
            let rank = priority.parse::<Priority>().map_or(1, Priority::rank);
            let key =
                self.state(lane).fair.lock().expect("fair state lock")[rank].next_key(tenant_id);
            sqlx::query(
                "UPDATE queue_messages SET queue = ?, visible_at = ?, receive_count = 0, fair_key = ?, last_error = NULL WHERE seq = ?",
            )
            .bind(queue_name(lane))
            .bind(now)
            .bind(key)
            .bind(seq)
            .execute(&mut *tx)
            .await?;
        }
        let ids: Vec<String> = rows.into_iter().map(|(_, id, _, _)| id).collect();
        // Fresh attempt budget in the same transaction as the move.
        crate::store::messages::mark_requeued(&mut tx, &ids, i64::MAX).await?;
        tx.commit().await?;
        self.notify_arrivals(lane);
        Ok(ids)
    }

    /// Receives and deletes are transactions on the one SQLite file, so
    /// fewer, larger ones leave more room for the accept writer's.
    fn max_batch(&self) -> usize {
        EMBEDDED_BATCH
    }

    /// Holding only marks the tenant: its messages are set aside as
    /// receives meet them. Releasing moves the tenant's set-aside messages
    /// back to their lanes at once, with fresh fair keys in their order.
    async fn set_tenant_held(&self, tenant_id: &str, held: bool) -> anyhow::Result<()> {
        if held {
            self.held
                .write()
                .expect("held lock")
                .insert(tenant_id.to_owned());
            return Ok(());
        }
        self.held.write().expect("held lock").remove(tenant_id);
        for lane in Lane::ALL {
            self.release_held(*lane, tenant_id).await?;
        }
        Ok(())
    }

    fn deleted_total(&self, lane: Lane) -> u64 {
        self.state(lane).deleted.load(Ordering::Relaxed)
    }

    async fn ping(&self) -> bool {
        self.db.ping().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;
    use crate::model::{Channel, Priority};

    async fn open_queue(dir: &tempfile::TempDir, max_receive_count: u32) -> EmbeddedQueue {
        let db = Db::open(&dir.path().join("q.db"), false).await.unwrap();
        let mut lanes = Settings::from_toml_overlay("").unwrap().lanes;
        lanes.fast.visibility_timeout_secs = 1;
        lanes.fast.max_receive_count = max_receive_count;
        EmbeddedQueue::open(db, lanes).await.unwrap()
    }

    fn message(tenant: &str, n: usize) -> OutboundMessage {
        OutboundMessage {
            message_id: format!("{tenant}-{n}"),
            tenant_id: tenant.to_owned(),
            channel: Channel::Sms,
            priority: Priority::Normal,
            body: format!("{{\"n\":{n}}}"),
            delay: Duration::ZERO,
        }
    }

    #[tokio::test]
    async fn a_received_message_is_invisible_until_its_visibility_timeout_ends() {
        let dir = tempfile::tempdir().unwrap();
        let queue = open_queue(&dir, 5).await;
        queue
            .send_batch(Lane::Fast, vec![message("a", 1)])
            .await
            .unwrap();

        let first = queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].receive_count, 1);
        assert!(
            queue
                .receive(Lane::Fast, 10, Duration::ZERO)
                .await
                .unwrap()
                .is_empty()
        );
        let stats = queue.stats(Lane::Fast).await.unwrap();
        assert_eq!((stats.depth, stats.in_flight), (0, 1));

        // A long poll wakes when the timeout ends, with the count raised.
        let again = queue
            .receive(Lane::Fast, 10, Duration::from_secs(3))
            .await
            .unwrap();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].receive_count, 2);
        assert_eq!(again[0].message_id, "a-1");

        // The first receipt is stale now; the fresh one deletes.
        let stale = queue
            .delete_batch(Lane::Fast, &[first[0].receipt.clone()])
            .await
            .unwrap();
        assert!(stale[0].is_err());
        let fresh = queue
            .delete_batch(Lane::Fast, &[again[0].receipt.clone()])
            .await
            .unwrap();
        assert!(fresh[0].is_ok());
        assert_eq!(
            queue.stats(Lane::Fast).await.unwrap(),
            QueueStats::default()
        );
        assert_eq!(queue.deleted_total(Lane::Fast), 1);
    }

    #[tokio::test]
    async fn visibility_zero_returns_a_message_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let queue = open_queue(&dir, 5).await;
        queue
            .send_batch(Lane::Fast, vec![message("a", 1)])
            .await
            .unwrap();
        let got = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
        let changed = queue
            .change_visibility_batch(Lane::Fast, &[(got[0].receipt.clone(), Duration::ZERO)])
            .await
            .unwrap();
        assert!(changed[0].is_ok());
        let again = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].receive_count, 2);
    }

    #[tokio::test]
    async fn a_message_received_max_receive_count_times_moves_to_the_dlq() {
        let dir = tempfile::tempdir().unwrap();
        let queue = open_queue(&dir, 2).await;
        queue
            .send_batch(Lane::Fast, vec![message("a", 1)])
            .await
            .unwrap();
        for expected in 1..=2 {
            let got = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
            assert_eq!(got[0].receive_count, expected);
            queue
                .change_visibility_batch(Lane::Fast, &[(got[0].receipt.clone(), Duration::ZERO)])
                .await
                .unwrap();
        }
        // The third receive finds it exhausted and moves it instead.
        assert!(
            queue
                .receive(Lane::Fast, 1, Duration::ZERO)
                .await
                .unwrap()
                .is_empty()
        );
        let stats = queue.stats(Lane::Fast).await.unwrap();
        assert_eq!((stats.depth, stats.in_flight, stats.dlq_depth), (0, 0, 1));
        let dead = queue.list_dead_letters(Lane::Fast, 10).await.unwrap();
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].message_id, "a-1");
        assert_eq!(dead[0].receive_count, 2);

        // Redrive brings it back with a fresh receive count.
        let redriven = queue
            .redrive(Lane::Fast, &RedriveFilter::default())
            .await
            .unwrap();
        assert_eq!(redriven, vec!["a-1".to_owned()]);
        let back = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
        assert_eq!(back[0].receive_count, 1);
        assert_eq!(queue.stats(Lane::Fast).await.unwrap().dlq_depth, 0);
    }

    #[tokio::test]
    async fn a_deferred_message_does_not_count_toward_the_dlq() {
        let dir = tempfile::tempdir().unwrap();
        let queue = open_queue(&dir, 2).await;
        queue
            .send_batch(Lane::Fast, vec![message("a", 1)])
            .await
            .unwrap();
        for _ in 0..5 {
            let got = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
            assert_eq!(
                got.len(),
                1,
                "a deferred message must come back, not go to the DLQ"
            );
            assert_eq!(got[0].receive_count, 1);
            queue
                .defer(Lane::Fast, &got[0], Duration::ZERO)
                .await
                .unwrap();
        }
        assert_eq!(queue.stats(Lane::Fast).await.unwrap().dlq_depth, 0);
    }

    #[tokio::test]
    async fn redrive_can_select_by_tenant_and_by_id() {
        let dir = tempfile::tempdir().unwrap();
        let queue = open_queue(&dir, 5).await;
        queue
            .send_batch(
                Lane::Fast,
                vec![message("a", 1), message("a", 2), message("b", 1)],
            )
            .await
            .unwrap();
        for got in queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap() {
            queue.dead_letter(Lane::Fast, &got).await.unwrap();
        }
        assert_eq!(queue.stats(Lane::Fast).await.unwrap().dlq_depth, 3);
        let by_id = RedriveFilter {
            tenant_id: None,
            message_ids: Some(vec!["a-2".into()]),
        };
        assert_eq!(
            queue.redrive(Lane::Fast, &by_id).await.unwrap(),
            vec!["a-2".to_owned()]
        );
        let by_tenant = RedriveFilter {
            tenant_id: Some("b".into()),
            message_ids: None,
        };
        assert_eq!(
            queue.redrive(Lane::Fast, &by_tenant).await.unwrap(),
            vec!["b-1".to_owned()]
        );
        assert_eq!(queue.stats(Lane::Fast).await.unwrap().dlq_depth, 1);
    }

    #[tokio::test]
    async fn a_delayed_message_is_not_received_before_its_delay() {
        let dir = tempfile::tempdir().unwrap();
        let queue = open_queue(&dir, 5).await;
        let mut delayed = message("a", 1);
        delayed.delay = Duration::from_millis(700);
        queue.send_batch(Lane::Fast, vec![delayed]).await.unwrap();
        assert!(
            queue
                .receive(Lane::Fast, 1, Duration::ZERO)
                .await
                .unwrap()
                .is_empty()
        );
        let stats = queue.stats(Lane::Fast).await.unwrap();
        assert_eq!((stats.depth, stats.delayed), (1, 1));
        let started = std::time::Instant::now();
        let got = queue
            .receive(Lane::Fast, 1, Duration::from_secs(3))
            .await
            .unwrap();
        assert_eq!(got.len(), 1);
        assert!(started.elapsed() >= Duration::from_millis(500));
    }

    #[tokio::test]
    async fn one_tenants_backlog_does_not_sit_in_front_of_another_tenants_first_message() {
        let dir = tempfile::tempdir().unwrap();
        let queue = open_queue(&dir, 5).await;
        let backlog: Vec<_> = (0..500).map(|n| message("big", n)).collect();
        queue.send_batch(Lane::Fast, backlog).await.unwrap();
        // The consumer has started on the backlog.
        let first = queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
        assert!(first.iter().all(|m| m.tenant_id == "big"));
        queue
            .send_batch(Lane::Fast, vec![message("small", 0)])
            .await
            .unwrap();
        let next = queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
        let position = next.iter().position(|m| m.tenant_id == "small");
        assert!(
            position.is_some_and(|p| p <= 1),
            "small tenant's message should be among the next two, got {:?}",
            next.iter().map(|m| &m.message_id).collect::<Vec<_>>()
        );
    }

    #[tokio::test]
    async fn two_backlogged_tenants_are_served_alternately() {
        let dir = tempfile::tempdir().unwrap();
        let queue = open_queue(&dir, 5).await;
        queue
            .send_batch(Lane::Fast, (0..100).map(|n| message("a", n)).collect())
            .await
            .unwrap();
        queue
            .send_batch(Lane::Fast, (0..100).map(|n| message("b", n)).collect())
            .await
            .unwrap();
        let got = queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
        let from_a = got.iter().filter(|m| m.tenant_id == "a").count();
        assert_eq!(
            from_a,
            5,
            "{:?}",
            got.iter().map(|m| &m.message_id).collect::<Vec<_>>()
        );
    }

    fn with_priority(mut message: OutboundMessage, priority: Priority) -> OutboundMessage {
        message.priority = priority;
        message
    }

    #[tokio::test]
    async fn a_high_message_queued_behind_a_low_backlog_is_received_first() {
        let dir = tempfile::tempdir().unwrap();
        let queue = open_queue(&dir, 5).await;
        let lows = (0..300).map(|n| with_priority(message("a", n), Priority::Low));
        queue.send_batch(Lane::Fast, lows.collect()).await.unwrap();
        queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
        queue
            .send_batch(
                Lane::Fast,
                vec![
                    with_priority(message("a", 1000), Priority::Normal),
                    with_priority(message("a", 1001), Priority::High),
                ],
            )
            .await
            .unwrap();
        let next = queue.receive(Lane::Fast, 3, Duration::ZERO).await.unwrap();
        let ids: Vec<_> = next.iter().map(|m| m.message_id.as_str()).collect();
        assert_eq!(ids[..2], ["a-1001", "a-1000"], "{ids:?}");
        assert_eq!(next[2].priority, Priority::Low);
    }

    #[tokio::test]
    async fn low_messages_keep_their_share_under_a_flood_of_high_ones() {
        let dir = tempfile::tempdir().unwrap();
        let queue = open_queue(&dir, 5).await;
        let mut flood: Vec<_> = (0..200)
            .map(|n| with_priority(message("a", n), Priority::High))
            .collect();
        flood.extend((200..300).map(|n| with_priority(message("b", n), Priority::Low)));
        queue.send_batch(Lane::Fast, flood).await.unwrap();
        let mut lows = 0;
        for _ in 0..10 {
            let got = queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
            assert_eq!(got.len(), 10);
            lows += got.iter().filter(|m| m.priority == Priority::Low).count();
        }
        // The default share is 0.1: 100 received while high floods, at least
        // one in eleven of them low.
        assert!((9..=10).contains(&lows), "{lows} lows of 100");
    }

    #[tokio::test]
    async fn a_deferred_message_goes_behind_its_tenants_other_messages() {
        let dir = tempfile::tempdir().unwrap();
        let queue = open_queue(&dir, 5).await;
        queue
            .send_batch(Lane::Fast, (0..4).map(|n| message("a", n)).collect())
            .await
            .unwrap();
        let first = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
        assert_eq!(first[0].message_id, "a-0");
        queue
            .defer(Lane::Fast, &first[0], Duration::ZERO)
            .await
            .unwrap();
        let rest = queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
        let ids: Vec<_> = rest.iter().map(|m| m.message_id.as_str()).collect();
        assert_eq!(ids, ["a-1", "a-2", "a-3", "a-0"]);
    }

    #[tokio::test]
    async fn a_held_tenants_messages_are_set_aside_once_and_come_back_in_order_when_released() {
        let dir = tempfile::tempdir().unwrap();
        let queue = open_queue(&dir, 5).await;
        queue.set_tenant_held("held", true).await.unwrap();
        let mut batch: Vec<_> = (0..20).map(|n| message("held", n)).collect();
        batch.push(with_priority(message("held", 99), Priority::High));
        batch.extend((0..3).map(|n| message("free", n)));
        queue.send_batch(Lane::Fast, batch).await.unwrap();
        let got = queue.receive(Lane::Fast, 50, Duration::ZERO).await.unwrap();
        assert!(got.iter().all(|m| m.tenant_id == "free"), "{got:?}");
        assert_eq!(got.len(), 3);
        let stats = queue.stats(Lane::Fast).await.unwrap();
        assert_eq!((stats.held, stats.depth), (21, 0));
        // Nothing more to hand out, and nothing churns.
        assert!(
            queue
                .receive(Lane::Fast, 50, Duration::ZERO)
                .await
                .unwrap()
                .is_empty()
        );

        // Still held after a restart; released by the next process.
        queue.db.close().await;
        let queue = open_queue(&dir, 5).await;
        assert_eq!(queue.stats(Lane::Fast).await.unwrap().held, 21);
        queue.release_unheld().await.unwrap();
        let stats = queue.stats(Lane::Fast).await.unwrap();
        assert_eq!((stats.held, stats.depth), (0, 21));
        let back = queue.receive(Lane::Fast, 50, Duration::ZERO).await.unwrap();
        let ids: Vec<_> = back.iter().map(|m| m.message_id.as_str()).collect();
        let mut expected = vec!["held-99".to_owned()];
        expected.extend((0..20).map(|n| format!("held-{n}")));
        assert_eq!(ids, expected);
        assert!(back.iter().all(|m| m.receive_count == 1));
    }

    #[tokio::test]
    async fn a_released_tenant_takes_turns_with_others_instead_of_jumping_ahead() {
        let dir = tempfile::tempdir().unwrap();
        let queue = open_queue(&dir, 5).await;
        queue.set_tenant_held("a", true).await.unwrap();
        queue
            .send_batch(Lane::Fast, (0..30).map(|n| message("a", n)).collect())
            .await
            .unwrap();
        queue
            .send_batch(Lane::Fast, (0..30).map(|n| message("b", n)).collect())
            .await
            .unwrap();
        let first = queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
        assert!(first.iter().all(|m| m.tenant_id == "b"));
        queue.set_tenant_held("a", false).await.unwrap();
        let next = queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
        let from_a = next.iter().filter(|m| m.tenant_id == "a").count();
        assert!((4..=6).contains(&from_a), "{next:?}");
    }

    // Holding the connection's lock across the abandoned receive is the point.
    #[allow(clippy::await_holding_lock)]
    #[tokio::test]
    async fn a_receive_abandoned_while_its_thread_works_gives_its_messages_back_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let queue = open_queue(&dir, 5).await;
        queue
            .send_batch(Lane::Fast, vec![message("a", 1)])
            .await
            .unwrap();
        // Hold the hot connection so the receive's thread waits for it, then
        // abandon the receive, as a consumer shutting down mid-poll does.
        let busy = queue.hot.lock().unwrap();
        let abandoned =
            tokio::time::timeout(Duration::from_millis(50), queue.receive_now(Lane::Fast, 10))
                .await;
        assert!(abandoned.is_err());
        drop(busy);
        let again = queue
            .receive(Lane::Fast, 10, Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!(again.len(), 1, "the abandoned lease was not given back");
        assert_eq!(again[0].receive_count, 1);
    }

    #[tokio::test]
    async fn messages_and_fairness_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        {
            let queue = open_queue(&dir, 5).await;
            queue
                .send_batch(Lane::Fast, (0..50).map(|n| message("a", n)).collect())
                .await
                .unwrap();
            queue.db.close().await;
        }
        let queue = open_queue(&dir, 5).await;
        assert_eq!(queue.stats(Lane::Fast).await.unwrap().depth, 50);
        queue
            .send_batch(Lane::Fast, vec![message("b", 0)])
            .await
            .unwrap();
        let got = queue.receive(Lane::Fast, 2, Duration::ZERO).await.unwrap();
        assert!(got.iter().any(|m| m.tenant_id == "b"));
    }
}
