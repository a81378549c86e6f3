//! The embedded queue: SQS semantics on a table of the SQLite file, so a
//! single box needs no other server and a 202 survives `kill -9`. It is the
//! default [`LaneQueue`] backend, and the one the accept path writes into
//! directly: [`EmbeddedQueue::insert_rows`] puts a request's messages on
//! their lane in the same transaction as their status rows.
//!
//! Every change to the table is a piece of work for the store's one writer
//! ([`StoreWriter`]): inserts ride in the accept path's groups, and
//! receives, deletes, deferrals and DLQ moves share groups with them, so one
//! transaction carries the work of many messages. Each kind of work is a
//! [`Work`] type that lives beside the operation that submits it, and
//! answers its caller once its group has committed or rolled back.
//!
//! Leases live in memory. A receive writes nothing for a message received
//! for the first time: which messages are in flight, and until when, is kept
//! in [`Book::leases`](state::Book::leases), and visibility changes
//! (heartbeats, giving messages back) only touch that map. A lease lost in a
//! crash only makes its message visible again, which at-least-once delivery
//! already allows. Receive counts are what must survive: a message received
//! again (its lease ran out) has its count written in the receive's own
//! transaction, so after a crash a message is received at most once more
//! than `max_receive_count` before it moves to the DLQ (the one unwritten
//! first receive).
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
//! fair_key)` index, then fills its batch high before normal before low
//! under the share rule of [`super::priority`]. A deferred message (retry
//! backoff, tenant at its cap, tenant paused) takes a fresh key when it is
//! put back, so it queues behind its tenant's other messages instead of
//! keeping the front place it had.
//!
//! Held tenants cost nothing: a receive that meets a message of a paused or
//! disabled tenant moves it to the lane's hold queue (`fast-held`,
//! `slow-held`) in the same transaction, so each held message is looked at
//! once, not received and put back every few seconds; releasing the tenant
//! moves its held messages back with fresh fair keys, in their order.
//!
//! Statistics come from counters kept with the writes (rows per lane, DLQ
//! and hold queues, delayed messages by due time, leases), plus one index
//! probe for the oldest message: nothing scans the lane.
//!
//! Receipts are `seq:receive_count`: receiving a message again invalidates
//! the receipt a slower consumer may still hold, as in SQS.
//!
//! The folder, by concern. This file holds the queue itself, its opening
//! (the one scan of the table, which rebuilds the state), the way to the
//! writer, and the [`LaneQueue`] and [`TenantQueues`] impls, which hand
//! each call to the file of its concern:
//! - `state.rs`: what each queue keeps in memory beside its rows, and the
//!   registry of dedicated tenant queues; it uses none of the files beside
//!   it;
//! - `insert.rs`: inserts, in the accept path's transaction or alone;
//! - `receive.rs`: receives and the long poll;
//! - `settle.rs`: deletes, visibility changes, deferrals and moves to the
//!   DLQ, and the dead letters' listing and redrive;
//! - `held.rs`: holding and releasing tenants;
//! - `dedicated.rs`: dedicated tenant queues and their attention signals.

mod dedicated;
mod erase;
mod held;
mod insert;
mod receive;
mod settle;
mod state;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use anyhow::Context;
use async_trait::async_trait;
use rusqlite::Transaction;
use tokio::sync::oneshot;

use super::{
    DeadLetter, EntryResult, LaneQueue, OutboundMessage, QueueStats, ReceivedMessage,
    RedriveFilter, TenantQueues,
};
use crate::config::LanesSettings;
use crate::model::{Lane, now_ms};
use crate::store::SqliteDb;
use crate::store::sqlite::writer::{StoreWriter, Work, WriteFailed};

pub use insert::Inserted;
use state::{Dedicated, HeldTenants, LaneState, QueueNames};

/// Most messages per receive and per delete batch.
const EMBEDDED_BATCH: usize = 50;

#[derive(Clone)]
pub struct EmbeddedQueue {
    db: SqliteDb,
    /// Every change to the queue table goes through it.
    writer: StoreWriter,
    held: HeldTenants,
    fast: Arc<LaneState>,
    slow: Arc<LaneState>,
    dedicated: Arc<Dedicated>,
    /// Set in a view of one queue (a dedicated tenant's or an attention
    /// queue): every `lane` argument then names only the lane's settings.
    pinned: Option<Arc<LaneState>>,
}

impl EmbeddedQueue {
    /// Opens the queue tables of `db`, whose changes go through `writer`,
    /// and rebuilds the fair-queueing state and the counters from what is
    /// stored (the one time the table is scanned).
    pub async fn open(
        db: SqliteDb,
        lanes: LanesSettings,
        writer: StoreWriter,
    ) -> anyhow::Result<Self> {
        let queue = EmbeddedQueue {
            fast: LaneState::new(Lane::Fast, QueueNames::lane(Lane::Fast), &lanes),
            slow: LaneState::new(Lane::Slow, QueueNames::lane(Lane::Slow), &lanes),
            dedicated: Arc::new(Dedicated {
                attention: [
                    LaneState::new(Lane::Fast, QueueNames::attention(Lane::Fast), &lanes),
                    LaneState::new(Lane::Slow, QueueNames::attention(Lane::Slow), &lanes),
                ],
                tenants: RwLock::default(),
                queues: Mutex::default(),
                lanes,
            }),
            db,
            writer,
            held: HeldTenants::default(),
            pinned: None,
        };
        // Every dedicated tenant queue that has rows gets its state now, so
        // its counters are right from the start.
        let names: Vec<String> = queue
            .db
            .rows(
                "SELECT DISTINCT queue FROM queue_messages WHERE queue LIKE '%:t:%'",
                vec![],
                |row| row.get(0),
            )
            .await
            .context("listing dedicated tenant queues")?;
        for name in names {
            let mut parts = name.splitn(3, ':');
            if let (Some(lane), Some("t"), Some(rest)) = (parts.next(), parts.next(), parts.next())
                && let Ok(lane) = lane.parse::<Lane>()
            {
                let tenant = rest.split(':').next().unwrap_or(rest);
                queue.dedicated.queue(lane, tenant);
            }
        }
        let mut states = vec![queue.fast.clone(), queue.slow.clone()];
        states.extend(queue.dedicated.attention.iter().cloned());
        states.extend(
            queue
                .dedicated
                .queues
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .values()
                .cloned(),
        );
        queue
            .through_writer(|reply| {
                Box::new(LoadWork {
                    states,
                    reply: Some(reply),
                })
            })
            .await
            .context("loading embedded queue state")?;
        Ok(queue)
    }

    fn state(&self, lane: Lane) -> &Arc<LaneState> {
        if let Some(pinned) = &self.pinned {
            return pinned;
        }
        match lane {
            Lane::Fast => &self.fast,
            Lane::Slow => &self.slow,
        }
    }

    /// Runs `work` in the writer and waits for its answer.
    async fn through_writer<T: Send + 'static>(
        &self,
        work: impl FnOnce(oneshot::Sender<anyhow::Result<T>>) -> Box<dyn Work>,
    ) -> anyhow::Result<T> {
        let (reply, answer) = oneshot::channel();
        self.writer.submit(work(reply)).await;
        answer
            .await
            .context("the store writer dropped a piece of work")?
    }
}

/// Answers a waiting caller; `Err` only when the caller has gone away.
type Reply<T> = Option<oneshot::Sender<anyhow::Result<T>>>;

fn answer<T>(reply: &mut Reply<T>, value: anyhow::Result<T>) -> Result<(), anyhow::Result<T>> {
    match reply.take() {
        Some(reply) => reply.send(value),
        None => Ok(()),
    }
}

fn failed<T>(reply: &mut Reply<T>, failure: WriteFailed) {
    let _ = answer(reply, Err(anyhow::Error::new(failure)));
}

/// Rebuilds queue states from the table, in the writer's connection.
struct LoadWork {
    states: Vec<Arc<LaneState>>,
    reply: Reply<()>,
}

impl Work for LoadWork {
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        for state in &self.states {
            state.load(tx)?;
        }
        Ok(())
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        match outcome {
            Ok(()) => {
                let _ = answer(&mut self.reply, Ok(()));
            }
            Err(failure) => failed(&mut self.reply, failure),
        }
    }
}

#[async_trait]
impl LaneQueue for EmbeddedQueue {
    async fn send_batch(
        &self,
        lane: Lane,
        messages: Vec<OutboundMessage>,
    ) -> anyhow::Result<Vec<EntryResult>> {
        self.insert_batch(lane, messages).await
    }

    async fn receive(
        &self,
        lane: Lane,
        max: usize,
        wait: Duration,
    ) -> anyhow::Result<Vec<ReceivedMessage>> {
        self.long_poll(lane, max, wait).await
    }

    async fn receive_skipping(
        &self,
        lane: Lane,
        max: usize,
        skip: std::collections::HashSet<String>,
    ) -> anyhow::Result<Vec<ReceivedMessage>> {
        self.receive_now(lane, max.max(1), Some(skip)).await
    }

    async fn arrival(&self, lane: Lane) {
        self.state(lane).arrivals.notified().await;
    }

    fn arrivals_so_far(&self, lane: Lane) -> u64 {
        self.state(lane)
            .arrived_total
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    async fn delete_batch(
        &self,
        lane: Lane,
        receipts: &[String],
    ) -> anyhow::Result<Vec<EntryResult>> {
        self.delete_received(lane, receipts).await
    }

    /// Leases live in memory, so a visibility change writes nothing.
    async fn change_visibility_batch(
        &self,
        lane: Lane,
        changes: &[(String, Duration)],
    ) -> anyhow::Result<Vec<EntryResult>> {
        Ok(self.change_leases(lane, changes))
    }

    async fn defer(
        &self,
        lane: Lane,
        message: &ReceivedMessage,
        delay: Duration,
    ) -> anyhow::Result<()> {
        self.defer_received(lane, message, delay).await
    }

    async fn dead_letter(&self, lane: Lane, message: &ReceivedMessage) -> anyhow::Result<()> {
        self.dead_letter_received(lane, message).await
    }

    async fn stats(&self, lane: Lane) -> anyhow::Result<QueueStats> {
        let now = now_ms();
        let (rows, in_flight, delayed, dlq_depth, held) = {
            let mut book = self.state(lane).book();
            let delayed = book.delayed_now(now);
            (
                book.rows,
                book.in_flight(now) as u64,
                delayed,
                book.dlq,
                book.held,
            )
        };
        // Rows come in `seq` order, so the lane's first row by the
        // `(queue)` index is its oldest: one index probe.
        let oldest: Option<i64> = self
            .db
            .row(
                "SELECT enqueued_at FROM queue_messages INDEXED BY queue_messages_queue \
                 WHERE queue = ? ORDER BY seq LIMIT 1",
                crate::store::sqlite::args![self.state(lane).names.main.as_str().to_owned()],
                |row| row.get(0),
            )
            .await?;
        Ok(QueueStats {
            depth: rows.saturating_sub(in_flight),
            in_flight,
            delayed,
            oldest_age_secs: oldest.map(|at| (now - at).max(0) as f64 / 1000.0),
            dlq_depth,
            held,
        })
    }

    async fn list_dead_letters(&self, lane: Lane, limit: usize) -> anyhow::Result<Vec<DeadLetter>> {
        self.dead_letters(lane, limit).await
    }

    async fn redrive(&self, lane: Lane, filter: &RedriveFilter) -> anyhow::Result<Vec<String>> {
        self.redrive_dead_letters(lane, filter).await
    }

    /// Receives and deletes share the writer's groups with the accept
    /// path, so larger batches mean fewer pieces of work per message.
    fn max_batch(&self) -> usize {
        EMBEDDED_BATCH
    }

    /// Holding only marks the tenant: its messages are set aside as
    /// receives meet them. Releasing moves the tenant's set-aside messages
    /// back to their lanes at once, with fresh fair keys in their order.
    async fn set_tenant_held(&self, tenant_id: &str, held: bool) -> anyhow::Result<()> {
        self.set_held(tenant_id, held).await
    }

    async fn waiting_by_tenant(&self) -> anyhow::Result<Option<Vec<(String, i64, i64)>>> {
        let now = now_ms();
        let mut delayed = Vec::new();
        let mut held = Vec::new();
        for lane in Lane::ALL {
            let state = self.state(*lane);
            let (later, set_aside) = {
                let mut book = state.book();
                (book.delayed_now(now), book.held)
            };
            // The book knows whether a lane has any: most often it has
            // none, and the rows are not read at all.
            if later > 0 {
                delayed.push(state.names.main.clone());
            }
            if set_aside > 0 {
                held.push(state.names.held.clone());
            }
        }
        let mut waiting: BTreeMap<String, (i64, i64)> = BTreeMap::new();
        for (queues, is_held) in [(delayed, false), (held, true)] {
            if queues.is_empty() {
                continue;
            }
            // Each by an index of its own rows alone: the delayed rows'
            // partial index, the `(queue)` index of the held queues.
            let sql = format!(
                "SELECT tenant_id, COUNT(*) FROM queue_messages INDEXED BY {} \
                 WHERE queue IN ({}){} GROUP BY tenant_id",
                if is_held {
                    "queue_messages_queue"
                } else {
                    "queue_messages_delayed"
                },
                vec!["?"; queues.len()].join(", "),
                if is_held {
                    ""
                } else {
                    " AND visible_at > enqueued_at AND visible_at > ?"
                },
            );
            let mut args: Vec<rusqlite::types::Value> = queues
                .into_iter()
                .map(rusqlite::types::Value::from)
                .collect();
            if !is_held {
                args.push(now.into());
            }
            let counts: Vec<(String, i64)> =
                self.db.rows(sql, args, crate::store::sqlite::tuple).await?;
            for (tenant, count) in counts {
                let entry = waiting.entry(tenant).or_default();
                if is_held {
                    entry.1 += count;
                } else {
                    entry.0 += count;
                }
            }
        }
        Ok(Some(
            waiting
                .into_iter()
                .map(|(tenant, (later, set_aside))| (tenant, later, set_aside))
                .collect(),
        ))
    }

    fn deleted_total(&self, lane: Lane) -> u64 {
        self.state(lane).deleted.load(Ordering::Relaxed)
    }

    async fn ping(&self) -> bool {
        self.db.ping().await
    }
}

#[async_trait]
impl TenantQueues for EmbeddedQueue {
    fn has_dedicated_queues(&self) -> bool {
        true
    }

    async fn erase_waiting(
        &self,
        tenant_id: &str,
        message_ids: Option<&[String]>,
    ) -> anyhow::Result<Vec<String>> {
        self.erase_rows(tenant_id, message_ids).await
    }

    fn set_tenant_dedicated(&self, tenant_id: &str, dedicated: bool) {
        self.set_dedicated(tenant_id, dedicated)
    }

    async fn dedicated_queue(
        &self,
        lane: Lane,
        tenant_id: &str,
    ) -> anyhow::Result<Option<Arc<dyn LaneQueue>>> {
        Ok(self.tenant_queue(lane, tenant_id))
    }

    fn attention_queue(&self, lane: Lane) -> Option<Arc<dyn LaneQueue>> {
        Some(self.view(self.dedicated.attention(lane).clone()))
    }

    async fn settle_attention(&self, lane: Lane, tenant_id: &str) -> anyhow::Result<bool> {
        self.signal_backlog(lane, tenant_id).await
    }

    async fn reconcile_attention(&self) -> anyhow::Result<usize> {
        self.signal_backlogs().await
    }

    async fn purge_dedicated(&self, tenant_id: &str) -> anyhow::Result<Vec<String>> {
        self.purge_tenant_queues(tenant_id).await
    }

    async fn dedicated_lanes(&self, tenant_id: &str) -> anyhow::Result<Vec<Lane>> {
        Ok(self.tenant_lanes(tenant_id))
    }
}
