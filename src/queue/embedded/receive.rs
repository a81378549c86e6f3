//! Receives: [`ReceiveWork`] hands out up to a batch of visible messages,
//! high priority first under the share rule and by fair key within a
//! class, each with a lease taken in the book (a first receive writes
//! nothing). On its way it moves exhausted messages to the DLQ and sets
//! aside those of held tenants. The long poll around it waits for arrivals,
//! due times and leases running out. Receipts (`seq:receive_count`) are
//! made here and read back by [`parse_receipt`].

use std::collections::HashSet;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use anyhow::Context;
use rusqlite::{OptionalExtension, Transaction};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::state::{HeldTenants, LaneState, Lease};
use super::{EmbeddedQueue, Reply, answer, failed};
use crate::model::{Lane, Priority, now_ms};
use crate::queue::ReceivedMessage;
use crate::queue::priority::CLASSES;
use crate::store::lifecycle::{Failure, Move};
use crate::store::sqlite::lifecycle;
use crate::store::sqlite::writer::{Work, WriteFailed};

/// Longest single sleep of a long poll between checks, so a clock jump or a
/// missed wake-up costs at most this much latency.
const MAX_POLL_NAP: Duration = Duration::from_millis(500);

/// Rows of skipped tenants a skipping receive reads past in each class.
const SKIP_MARGIN: usize = 32;

/// The statements of a receive, prepared once per transaction.
struct ReceiveSql<'t> {
    heads_of: rusqlite::CachedStatement<'t>,
    row_of: rusqlite::CachedStatement<'t>,
    status_of: rusqlite::CachedStatement<'t>,
    count_receive: rusqlite::CachedStatement<'t>,
    set_aside: rusqlite::CachedStatement<'t>,
    to_dlq: rusqlite::CachedStatement<'t>,
    dead_of: rusqlite::CachedStatement<'t>,
}

/// A row handed out: message id, channel, body, enqueued at, fair key, and
/// the message's status then.
type RowOut = (String, String, String, i64, i64, Option<String>);

impl<'t> ReceiveSql<'t> {
    fn prepare(tx: &'t Transaction) -> rusqlite::Result<Self> {
        Ok(ReceiveSql {
            heads_of: tx.prepare_cached(
                "SELECT seq, tenant_id, receive_count FROM queue_messages INDEXED BY queue_messages_class \
                 WHERE queue = ?1 AND priority = ?2 AND visible_at <= ?3 ORDER BY fair_key, seq LIMIT ?4",
            )?,
            row_of: tx.prepare_cached(
                "SELECT message_id, channel, body, enqueued_at, fair_key FROM queue_messages WHERE seq = ?1",
            )?,
            status_of: tx.prepare_cached("SELECT status FROM messages WHERE id = ?1")?,
            count_receive: tx
                .prepare_cached("UPDATE queue_messages SET receive_count = ?1 WHERE seq = ?2")?,
            set_aside: tx.prepare_cached(
                "UPDATE queue_messages SET queue = ?1, receive_count = MAX(receive_count, ?2) WHERE seq = ?3",
            )?,
            to_dlq: tx.prepare_cached(
                "UPDATE queue_messages SET queue = ?1, visible_at = ?2, receive_count = MAX(receive_count, ?3), \
                 last_error = COALESCE(last_error, 'received max_receive_count times without being deleted') WHERE seq = ?4",
            )?,
            dead_of: tx
                .prepare_cached("SELECT message_id, last_error FROM queue_messages WHERE seq = ?1")?,
        })
    }

    /// Moves row `seq`, received `prior` times already, to the lane's DLQ
    /// `dlq`, and its message to `dead_lettered` in the same transaction.
    fn dead_letter(
        &mut self,
        tx: &Transaction,
        dlq: &str,
        seq: i64,
        prior: u32,
        now: i64,
    ) -> anyhow::Result<()> {
        self.to_dlq
            .execute(rusqlite::params![dlq, now, prior, seq])?;
        let (message_id, error): (String, Option<String>) = self
            .dead_of
            .query_row([seq], |row| Ok((row.get(0)?, row.get(1)?)))?;
        let failure = Failure {
            step: Move::DeadLetter,
            error: error.as_deref(),
            counted: false,
            provider: None,
            pinned: None,
        };
        lifecycle::fail(tx, &message_id, &failure, now)?;
        Ok(())
    }

    /// Row `seq` as it is handed out, with its message's status.
    fn row(&mut self, seq: i64) -> rusqlite::Result<RowOut> {
        let (message_id, channel, body, enqueued_at, key) =
            self.row_of.query_row([seq], |row| {
                Ok((
                    row.get(0)?,
                    row.get(1)?,
                    row.get(2)?,
                    row.get(3)?,
                    row.get(4)?,
                ))
            })?;
        let status = self
            .status_of
            .query_row([&message_id], |row| row.get(0))
            .optional()?;
        Ok((message_id, channel, body, enqueued_at, key, status))
    }
}

/// The `seq` and receive count a receipt names.
pub(super) fn parse_receipt(receipt: &str) -> Option<(i64, u32)> {
    let (seq, count) = receipt.split_once(':')?;
    Some((seq.parse().ok()?, count.parse().ok()?))
}

impl EmbeddedQueue {
    /// Receives up to `max` messages of `lane`, waiting up to `wait` for
    /// the first one.
    pub(super) async fn long_poll(
        &self,
        lane: Lane,
        max: usize,
        wait: Duration,
    ) -> anyhow::Result<Vec<ReceivedMessage>> {
        let deadline = Instant::now() + wait;
        let state = self.state(lane);
        loop {
            let notified = state.arrivals.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let got = self.receive_now(lane, max.max(1), None).await?;
            let now = Instant::now();
            if !got.is_empty() || now >= deadline {
                return Ok(got);
            }
            let mut wake = deadline.min(now + MAX_POLL_NAP);
            let wall = now_ms();
            if let Some(at) = state.book().next_due(wall) {
                wake = wake.min(now + Duration::from_millis((at - wall).max(0) as u64));
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    /// One non-waiting receive through the writer; `skip`: tenants whose
    /// messages stay where they are.
    pub(super) async fn receive_now(
        &self,
        lane: Lane,
        max: usize,
        skip: Option<HashSet<String>>,
    ) -> anyhow::Result<Vec<ReceivedMessage>> {
        let (reply, answer) = oneshot::channel();
        self.writer
            .submit(Box::new(ReceiveWork {
                state: self.state(lane).clone(),
                held: self.held.clone(),
                max,
                skip: skip.unwrap_or_default(),
                out: Vec::new(),
                taken: Vec::new(),
                moved: Vec::new(),
                highest: [None; CLASSES],
                settled: false,
                reply: Some(reply),
            }))
            .await;
        answer.await.context("the store writer dropped a receive")?
    }
}

/// A candidate row at the head of a class: `(seq, tenant, receives so far)`.
type Head = (i64, String, u32);

/// What a receive moved out of the lane, for the book.
enum Moved {
    Dlq(i64),
    Held(i64),
}

/// One receive: takes up to `max` visible messages, high priority first
/// under the share rule and by fair key within a class, moving any that
/// were received `max_receive_count` times to the DLQ and setting aside
/// those of held tenants. Leases are taken in the book as the rows are
/// chosen (so a receive later in the same group skips them) and given back
/// if the group rolls back.
struct ReceiveWork {
    state: Arc<LaneState>,
    held: HeldTenants,
    max: usize,
    /// Tenants whose messages this receive leaves alone.
    skip: HashSet<String>,
    out: Vec<ReceivedMessage>,
    /// Leases taken, with what the book held before.
    taken: Vec<(i64, Option<Lease>)>,
    moved: Vec<Moved>,
    /// Largest fair key handed out per class: the class's clock after it.
    highest: [Option<i64>; CLASSES],
    /// Answered before the commit (it wrote nothing); the rest is a no-op.
    settled: bool,
    reply: Reply<Vec<ReceivedMessage>>,
}

impl Work for ReceiveWork {
    fn reads_first(&self) -> bool {
        true
    }

    /// A receive that wrote nothing (only first receives, nothing moved)
    /// read committed rows and took its leases in memory: it is answered
    /// now, without waiting for the group's commit.
    fn settle_early(&mut self) {
        if self.moved.is_empty() {
            self.settled = true;
            self.hand_out();
        }
    }

    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        if self.settled {
            return Ok(());
        }
        let names = self.state.names.clone();
        let now = now_ms();
        let max_receives = self.state.max_receives;
        let mut sql = ReceiveSql::prepare(tx)?;
        let mut book = self.state.book();
        let held = self.held.read().unwrap_or_else(PoisonError::into_inner);
        while self.out.len() < self.max {
            let want = self.max - self.out.len();
            // Rows in flight sit among the heads; read past them, and past
            // some of the skipped tenants' (another tenant's new message
            // has a fair key near the class's clock, so near the head).
            let margin = if self.skip.is_empty() { 0 } else { SKIP_MARGIN };
            let limit = want + book.in_flight(now) + margin;
            let mut heads: [Vec<Head>; CLASSES] = Default::default();
            let mut moved = 0;
            for priority in Priority::ALL {
                let rows = sql
                    .heads_of
                    .query_map(
                        rusqlite::params![
                            names.main.as_str(),
                            priority.as_str(),
                            now,
                            limit as i64
                        ],
                        |row| Ok((row.get(0)?, row.get(1)?, row.get::<_, i64>(2)?)),
                    )?
                    .collect::<rusqlite::Result<Vec<(i64, String, i64)>>>()?;
                for (seq, tenant_id, stored) in rows {
                    let lease = book.leases.get(&seq).copied();
                    if lease.is_some_and(|lease| lease.until > now) {
                        continue;
                    }
                    let prior = lease.map_or(0, |l| l.count).max(stored.max(0) as u32);
                    if prior >= max_receives {
                        sql.dead_letter(tx, &names.dlq, seq, prior, now)?;
                        self.moved.push(Moved::Dlq(seq));
                        moved += 1;
                    } else if held.contains(&tenant_id) {
                        sql.set_aside.execute(rusqlite::params![
                            names.held.as_str(),
                            prior,
                            seq
                        ])?;
                        self.moved.push(Moved::Held(seq));
                        moved += 1;
                    } else if self.skip.contains(&tenant_id) {
                        continue;
                    } else if heads[priority.rank()].len() < want {
                        heads[priority.rank()].push((seq, tenant_id, prior));
                    }
                }
            }
            let split = self
                .state
                .share
                .split(std::array::from_fn(|rank| heads[rank].len()), want);
            for (rank, (rows, take)) in heads.into_iter().zip(split).enumerate() {
                for (seq, tenant_id, prior) in rows.into_iter().take(take) {
                    let count = prior + 1;
                    // A first receive is not written; any later one is, so
                    // a crash forgets at most one receive.
                    if count >= 2 {
                        sql.count_receive.execute(rusqlite::params![count, seq])?;
                    }
                    let (message_id, channel, body, enqueued_at, key, status) = sql.row(seq)?;
                    let lease = Lease {
                        count,
                        until: now + self.state.visibility_ms,
                    };
                    self.taken.push((seq, book.leases.insert(seq, lease)));
                    self.highest[rank] = self.highest[rank].max(Some(key));
                    self.out.push(ReceivedMessage {
                        receipt: format!("{seq}:{count}"),
                        message_id,
                        tenant_id,
                        channel: channel.parse().map_err(anyhow::Error::msg)?,
                        priority: Priority::ALL[rank],
                        body,
                        receive_count: count,
                        enqueued_at_ms: enqueued_at,
                        status_at_receive: status.and_then(|word| word.parse().ok()),
                        suppressed_at_receive: None,
                        test: false,
                    });
                }
            }
            // Rows moved to the DLQ or set aside left room: look again.
            // Otherwise the classes had no more than what was taken.
            if moved == 0 {
                break;
            }
        }
        Ok(())
    }

    fn rolled_back(&mut self) {
        if self.settled {
            return;
        }
        let mut book = self.state.book();
        for (seq, before) in self.taken.drain(..).rev() {
            match before {
                Some(lease) => book.leases.insert(seq, lease),
                None => book.leases.remove(&seq),
            };
        }
        self.out.clear();
        self.moved.clear();
        self.highest = [None; CLASSES];
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if self.settled {
            return;
        }
        if let Err(failure) = outcome {
            return failed(&mut self.reply, failure);
        }
        {
            let mut book = self.state.book();
            for moved in &self.moved {
                match moved {
                    Moved::Dlq(seq) => {
                        book.leases.remove(seq);
                        book.rows = book.rows.saturating_sub(1);
                        book.dlq += 1;
                    }
                    Moved::Held(seq) => {
                        book.leases.remove(seq);
                        book.rows = book.rows.saturating_sub(1);
                        book.held += 1;
                    }
                }
            }
        }
        self.hand_out();
    }
}

impl ReceiveWork {
    /// Moves the classes' clocks and answers the receive; gives the leases
    /// back at once if the receiver has gone away.
    fn hand_out(&mut self) {
        // Each class's clock moves to the largest key handed out.
        {
            let mut fair = self.state.fair();
            for (class, key) in fair.iter_mut().zip(self.highest) {
                if let Some(key) = key {
                    class.virtual_now = class.virtual_now.max(key);
                }
            }
        }
        let out = std::mem::take(&mut self.out);
        if let Err(Ok(unwanted)) = answer(&mut self.reply, Ok(out)) {
            // The receiver went away (a consumer shutting down mid-poll):
            // give the leases back at once instead of after a timeout.
            let mut book = self.state.book();
            for message in &unwanted {
                if let Some((seq, count)) = parse_receipt(&message.receipt)
                    && let Some(lease) = book.leases.get_mut(&seq)
                    && lease.count == count
                {
                    lease.count -= 1;
                    lease.until = 0;
                    if lease.count == 0 {
                        book.leases.remove(&seq);
                    }
                }
            }
            drop(book);
            self.state.arrived();
        }
    }
}
