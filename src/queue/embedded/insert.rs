//! Inserts: messages put on a queue with fair keys, in the accept path's
//! transaction ([`EmbeddedQueue::insert_rows`]) or in a piece of work of
//! their own (a send outside the accept path). A lane's message of a
//! dedicated tenant goes to the tenant's own queue, with an attention entry
//! for it in the same transaction. [`Inserted`] notes what went on which
//! queue, for the books once the transaction has committed.

use std::sync::Arc;

use rusqlite::{OptionalExtension, Transaction};

use super::state::LaneState;
use super::{EmbeddedQueue, Reply, answer, failed};
use crate::model::{Lane, Priority, now_ms};
use crate::queue::{EntryResult, OutboundMessage};
use crate::store::sqlite::writer::{Work, WriteFailed};

/// One queue row, every column bound in order.
const INSERT_ROW: &str = "INSERT INTO queue_messages (queue, message_id, tenant_id, channel, priority, body, fair_key, visible_at, receive_count, enqueued_at) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, 0, ?9)";

/// An attention entry for a tenant, unless one is waiting already (in the
/// queue, or set aside while the tenant is held).
const INSERT_ATTENTION: &str = "INSERT INTO queue_messages (queue, message_id, tenant_id, channel, priority, body, fair_key, visible_at, receive_count, enqueued_at) \
     SELECT ?1, ?2, ?2, 'email', 'normal', '', ?3, ?4, 0, ?5 \
     WHERE NOT EXISTS (SELECT 1 FROM queue_messages WHERE queue IN (?1, ?6) AND tenant_id = ?2)";

/// The due time of a tenant's waiting attention entry (not one set aside
/// for a held tenant).
const ATTENTION_DUE: &str =
    "SELECT seq, visible_at FROM queue_messages WHERE queue = ?1 AND tenant_id = ?2";

/// Brings an attention entry forward to `?2`.
const BRING_FORWARD: &str = "UPDATE queue_messages SET visible_at = ?2 WHERE seq = ?1";

/// What an insert put on which queue, for their books once committed.
#[derive(Default)]
pub struct Inserted {
    queues: Vec<Booked>,
}

struct Booked {
    state: Arc<LaneState>,
    count: u64,
    /// Due times (ms) of delayed messages.
    delayed: Vec<i64>,
    /// Due times (ms) of rows brought forward, as they were.
    undelayed: Vec<i64>,
}

impl Inserted {
    fn note(&mut self, state: &Arc<LaneState>, visible_at: i64, now: i64) {
        let booked = self.booked(state);
        booked.count += 1;
        if visible_at > now {
            booked.delayed.push(visible_at);
        }
    }

    /// A row of `state`'s queue that was due at `was` is due at
    /// `visible_at` now.
    fn note_moved(&mut self, state: &Arc<LaneState>, was: i64, visible_at: i64, now: i64) {
        let booked = self.booked(state);
        booked.undelayed.push(was);
        if visible_at > now {
            booked.delayed.push(visible_at);
        }
    }

    fn booked(&mut self, state: &Arc<LaneState>) -> &mut Booked {
        let at = match self
            .queues
            .iter()
            .position(|booked| Arc::ptr_eq(&booked.state, state))
        {
            Some(at) => at,
            None => {
                self.queues.push(Booked {
                    state: state.clone(),
                    count: 0,
                    delayed: Vec::new(),
                    undelayed: Vec::new(),
                });
                self.queues.len() - 1
            }
        };
        &mut self.queues[at]
    }

    /// Books committed inserts and wakes each queue's long-polling receivers.
    pub(super) fn book(&self) {
        let now = now_ms();
        for booked in &self.queues {
            {
                let mut book = booked.state.book();
                book.rows += booked.count;
                for at in &booked.undelayed {
                    book.remove_delayed(*at);
                }
                for at in &booked.delayed {
                    book.add_delayed(*at, now);
                }
            }
            booked.state.arrived();
        }
    }
}

impl EmbeddedQueue {
    /// Puts `messages` on `lane` within a writer transaction (the accept
    /// path's: status rows and queue entries commit together), noting in
    /// `inserted` what to book; call [`EmbeddedQueue::inserted`] with it
    /// once committed.
    fn insert_rows(
        &self,
        tx: &Transaction,
        lane: Lane,
        messages: &[&OutboundMessage],
        inserted: &mut Inserted,
    ) -> rusqlite::Result<()> {
        self.insert_messages(tx, self.state(lane), messages.iter().copied(), inserted)
    }

    /// Inserts `messages` into `state`'s queue with fair keys; a lane's
    /// message of a dedicated tenant goes to the tenant's own queue instead,
    /// with an attention entry for it in the same transaction.
    fn insert_messages<'a>(
        &self,
        tx: &Transaction,
        state: &Arc<LaneState>,
        messages: impl IntoIterator<Item = &'a OutboundMessage>,
        inserted: &mut Inserted,
    ) -> rusqlite::Result<()> {
        let routed = self.pinned.is_none();
        let now = now_ms();
        let mut insert = tx.prepare_cached(INSERT_ROW)?;
        for message in messages {
            let target = if routed && self.dedicated.is_dedicated(&message.tenant_id) {
                let (target, new) = self.dedicated.queue(state.lane, &message.tenant_id);
                if new {
                    target.load(tx)?;
                }
                let delay_ms = i64::try_from(message.delay.as_millis()).unwrap_or(i64::MAX);
                self.signal_attention(tx, state.lane, &message.tenant_id, delay_ms, inserted)?;
                target
            } else {
                state.clone()
            };
            let key = target.fair()[message.priority.rank()].next_key(&message.tenant_id);
            let visible_at = now + message.delay.as_millis() as i64;
            insert.execute(rusqlite::params![
                target.names.main,
                message.message_id,
                message.tenant_id,
                message.channel.as_str(),
                message.priority.as_str(),
                message.body,
                key,
                visible_at,
                now,
            ])?;
            inserted.note(&target, visible_at, now);
        }
        Ok(())
    }

    /// Adds an attention entry for `tenant_id` in `lane`, visible after
    /// `delay_ms`, unless one is already waiting.
    pub(super) fn signal_attention(
        &self,
        tx: &Transaction,
        lane: Lane,
        tenant_id: &str,
        delay_ms: i64,
        inserted: &mut Inserted,
    ) -> rusqlite::Result<bool> {
        let attention = self.dedicated.attention(lane);
        let key = attention.fair()[Priority::Normal.rank()].next_key(tenant_id);
        let now = now_ms();
        let visible_at = now + delay_ms.max(0);
        let added = tx
            .prepare_cached(INSERT_ATTENTION)?
            .execute(rusqlite::params![
                attention.names.main,
                tenant_id,
                key,
                visible_at,
                now,
                attention.names.held,
            ])?;
        if added == 1 {
            inserted.note(attention, visible_at, now);
            metrics::counter!(crate::metrics::ATTENTION_SIGNALS_TOTAL, "lane" => lane.as_str(), "event" => "published")
                .increment(1);
            return Ok(true);
        }
        // One is waiting: due later than this message (the tenant's
        // scheduled send), it comes forward, so a send due now never waits
        // for a scheduled one (issue 68). A leased entry's due time has
        // passed, so one a worker holds is left alone.
        let waiting: Option<(i64, i64)> = tx
            .prepare_cached(ATTENTION_DUE)?
            .query_row(rusqlite::params![attention.names.main, tenant_id], |row| {
                Ok((row.get(0)?, row.get(1)?))
            })
            .optional()?;
        if let Some((seq, was)) = waiting.filter(|(_, was)| *was > visible_at) {
            tx.prepare_cached(BRING_FORWARD)?
                .execute(rusqlite::params![seq, visible_at])?;
            inserted.note_moved(attention, was, visible_at, now);
        }
        Ok(false)
    }

    /// Puts `messages` on `lane` outside the accept path, in a piece of
    /// work of their own; one result per message.
    pub(super) async fn insert_batch(
        &self,
        lane: Lane,
        messages: Vec<OutboundMessage>,
    ) -> anyhow::Result<Vec<EntryResult>> {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let queue_state = self.state(lane).clone();
        let sent = self
            .through_writer(|reply| {
                Box::new(InsertWork {
                    queue: self.clone(),
                    queue_state,
                    messages,
                    inserted: Inserted::default(),
                    reply: Some(reply),
                })
            })
            .await?;
        Ok(vec![Ok(()); sent])
    }
}

/// Puts messages on a lane outside the accept path.
struct InsertWork {
    queue: EmbeddedQueue,
    queue_state: Arc<LaneState>,
    messages: Vec<OutboundMessage>,
    inserted: Inserted,
    reply: Reply<usize>,
}

impl Work for InsertWork {
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        self.inserted = Inserted::default();
        self.queue
            .insert_messages(tx, &self.queue_state, &self.messages, &mut self.inserted)?;
        Ok(())
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if let Err(failure) = outcome {
            return failed(&mut self.reply, failure);
        }
        self.inserted.book();
        let _ = answer(&mut self.reply, Ok(self.messages.len()));
    }
}

/// The accept path's queue entries, written in its transaction.
impl crate::store::QueueRows for EmbeddedQueue {
    fn insert(
        &self,
        tx: &Transaction,
        rows: &[(Lane, &OutboundMessage)],
    ) -> anyhow::Result<crate::store::AfterCommit> {
        let mut inserted = Inserted::default();
        for (lane, message) in rows {
            self.insert_rows(tx, *lane, &[message], &mut inserted)?;
        }
        Ok(Box::new(move || inserted.book()))
    }
}
