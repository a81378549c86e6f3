//! The embedded queue: SQS semantics on a table of the SQLite file, so a
//! single box needs no other server and a 202 survives `kill -9`.
//!
//! Every change to the table is a piece of work for the store's one writer
//! ([`StoreWriter`]): inserts ride in the accept path's groups, and
//! receives, deletes, deferrals and DLQ moves share groups with them, so one
//! transaction carries the work of many messages.
//!
//! Leases live in memory. A receive writes nothing for a message received
//! for the first time: which messages are in flight, and until when, is kept
//! in [`Book::leases`], and visibility changes (heartbeats, giving messages
//! back) only touch that map. A lease lost in a crash only makes its message
//! visible again, which at-least-once delivery already allows. Receive
//! counts are what must survive: a message received again (its lease ran
//! out) has its count written in the receive's own transaction, so after a
//! crash a message is received at most once more than `max_receive_count`
//! before it moves to the DLQ (the one unwritten first receive).
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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Duration;

use anyhow::Context;
use async_trait::async_trait;
use rusqlite::{OptionalExtension, Transaction};
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use super::priority::{CLASSES, PriorityShare};
use super::{
    DeadLetter, EntryResult, LaneQueue, OutboundMessage, QueueStats, ReceivedMessage, RedriveFilter,
};
use crate::config::LanesSettings;
use crate::model::{Lane, Priority, now_ms};
use crate::store::SqliteDb;
use crate::store::writer::{StoreWriter, Work, WriteFailed};

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
        match self.last_key.get_mut(tenant_id) {
            Some(slot) => *slot = key,
            None => {
                self.last_key.insert(tenant_id.to_owned(), key);
            }
        }
        key
    }
}

/// A received message's lease, with its true receive count.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Lease {
    /// Receives so far, the latest included. The row may hold one less: a
    /// first receive is not written.
    count: u32,
    /// Not receivable again before this instant (ms).
    until: i64,
}

/// What one lane keeps in memory beside its rows, changed with the writes
/// that change the rows.
#[derive(Debug, Default)]
struct Book {
    /// Messages received and not yet deleted, deferred or moved, by `seq`.
    /// An entry outlives its lease (`until` passed) so the receive count
    /// stays known until the message is received again.
    leases: HashMap<i64, Lease>,
    /// Rows in the lane: visible, delayed and in flight.
    rows: u64,
    /// Rows in the lane's DLQ.
    dlq: u64,
    /// Rows of held tenants set aside.
    held: u64,
    /// Rows written with a due time still to come, by due time (ms).
    delayed: BTreeMap<i64, u64>,
}

impl Book {
    fn add_delayed(&mut self, at: i64, now: i64) {
        if at > now {
            *self.delayed.entry(at).or_default() += 1;
        }
    }

    /// Forgets due times that have passed; returns how many are to come.
    fn delayed_now(&mut self, now: i64) -> u64 {
        self.delayed = self.delayed.split_off(&(now + 1));
        self.delayed.values().sum()
    }

    fn in_flight(&self, now: i64) -> usize {
        self.leases
            .values()
            .filter(|lease| lease.until > now)
            .count()
    }

    /// The next instant after `now` (ms) at which a message may become
    /// receivable: a due time or a lease running out.
    fn next_due(&self, now: i64) -> Option<i64> {
        let delayed = self.delayed.range(now + 1..).next().map(|(at, _)| *at);
        let lease = self
            .leases
            .values()
            .map(|lease| lease.until)
            .filter(|until| *until > now)
            .min();
        match (delayed, lease) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// The table's queue names of one queue: its messages, its DLQ and the
/// messages of held tenants set aside.
#[derive(Debug)]
struct QueueNames {
    main: String,
    dlq: String,
    held: String,
}

impl QueueNames {
    /// A lane's queues: `fast`, `fast-dlq`, `fast-held`.
    fn lane(lane: Lane) -> Self {
        QueueNames {
            main: lane.as_str().to_owned(),
            dlq: format!("{lane}-dlq"),
            held: format!("{lane}-held"),
        }
    }

    /// A dedicated tenant's queues in `lane`: `fast:t:acme` and its `:dlq`
    /// and `:held`. Tenant ids have no `:`, so no two names collide.
    fn tenant(lane: Lane, tenant_id: &str) -> Self {
        Self::suffixed(format!("{lane}:t:{tenant_id}"))
    }

    /// A lane's attention queue, `fast:attention`: one entry per dedicated
    /// tenant whose queue needs a slice of work.
    fn attention(lane: Lane) -> Self {
        Self::suffixed(format!("{lane}:attention"))
    }

    fn suffixed(main: String) -> Self {
        QueueNames {
            dlq: format!("{main}:dlq"),
            held: format!("{main}:held"),
            main,
        }
    }
}

/// Per-queue state kept in memory beside the table: one for each lane,
/// each lane's attention queue and each dedicated tenant queue.
struct LaneState {
    lane: Lane,
    names: Arc<QueueNames>,
    /// Fair-queueing state of each priority class, by rank.
    fair: Mutex<[FairState; CLASSES]>,
    /// Which classes the next receive serves.
    share: PriorityShare,
    /// Woken after every commit that makes messages receivable.
    arrivals: Notify,
    deleted: AtomicU64,
    book: Mutex<Book>,
    /// Receives after which a message moves to the DLQ.
    max_receives: u32,
    visibility_ms: i64,
}

impl LaneState {
    fn new(lane: Lane, names: QueueNames, lanes: &LanesSettings) -> Arc<Self> {
        let settings = lanes.get(lane);
        Arc::new(LaneState {
            lane,
            names: Arc::new(names),
            fair: Mutex::default(),
            share: PriorityShare::new(settings.low_priority_share),
            arrivals: Notify::new(),
            deleted: AtomicU64::new(0),
            book: Mutex::default(),
            max_receives: settings.max_receive_count,
            visibility_ms: (settings.visibility_timeout_secs * 1000) as i64,
        })
    }

    fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn fair(&self) -> MutexGuard<'_, [FairState; CLASSES]> {
        self.fair.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Rebuilds the book's counters and the fair-queueing state from the
    /// rows stored under this queue's names.
    fn load(&self, conn: &rusqlite::Connection) -> rusqlite::Result<()> {
        let now = now_ms();
        let count = |name: &str| -> rusqlite::Result<u64> {
            conn.prepare_cached("SELECT COUNT(*) FROM queue_messages WHERE queue = ?1")?
                .query_row([name], |row| row.get::<_, i64>(0))
                .map(|n| n.max(0) as u64)
        };
        {
            let mut book = self.book();
            book.rows = count(&self.names.main)?;
            book.dlq = count(&self.names.dlq)?;
            book.held = count(&self.names.held)?;
            let mut delayed = conn.prepare_cached(
                "SELECT visible_at, COUNT(*) FROM queue_messages WHERE queue = ?1 AND visible_at > ?2 GROUP BY visible_at",
            )?;
            let rows = delayed.query_map(rusqlite::params![self.names.main, now], |row| {
                Ok((row.get::<_, i64>(0)?, row.get::<_, i64>(1)?))
            })?;
            for row in rows {
                let (at, n) = row?;
                *book.delayed.entry(at).or_default() += n as u64;
            }
        }
        for priority in Priority::ALL {
            let mut last = conn.prepare_cached(
                "SELECT tenant_id, MAX(fair_key) FROM queue_messages WHERE queue = ?1 AND priority = ?2 GROUP BY tenant_id",
            )?;
            let rows = last
                .query_map(
                    rusqlite::params![self.names.main, priority.as_str()],
                    |row| Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?)),
                )?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            let min_key: Option<i64> = conn
                .prepare_cached(
                    "SELECT MIN(fair_key) FROM queue_messages WHERE queue = ?1 AND priority = ?2",
                )?
                .query_row(
                    rusqlite::params![self.names.main, priority.as_str()],
                    |row| row.get(0),
                )?;
            let mut fair = self.fair();
            let class = &mut fair[priority.rank()];
            class.virtual_now = min_key.map(|k| k - 1).unwrap_or(0);
            class.last_key = rows.into_iter().collect();
        }
        Ok(())
    }
}

/// Tenants whose messages are set aside (paused or disabled).
type HeldTenants = Arc<RwLock<HashSet<String>>>;

/// What every view of the embedded queue shares: dedicated tenants and
/// their queues, and the lanes' attention queues.
struct Dedicated {
    lanes: LanesSettings,
    /// Tenants whose new messages go to their own queue.
    tenants: RwLock<HashSet<String>>,
    /// Each dedicated tenant queue's state, by lane and tenant, made on
    /// first use and kept (a tenant switched back to shared may still have
    /// a backlog there).
    queues: Mutex<HashMap<(Lane, String), Arc<LaneState>>>,
    /// Each lane's attention queue.
    attention: [Arc<LaneState>; 2],
}

impl Dedicated {
    fn is_dedicated(&self, tenant_id: &str) -> bool {
        self.tenants
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(tenant_id)
    }

    /// The state of `tenant_id`'s queue in `lane`, and whether it is new
    /// (its counters still to be loaded from the table).
    fn queue(&self, lane: Lane, tenant_id: &str) -> (Arc<LaneState>, bool) {
        let mut queues = self.queues.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(state) = queues.get(&(lane, tenant_id.to_owned())) {
            return (state.clone(), false);
        }
        let state = LaneState::new(lane, QueueNames::tenant(lane, tenant_id), &self.lanes);
        queues.insert((lane, tenant_id.to_owned()), state.clone());
        (state, true)
    }

    fn attention(&self, lane: Lane) -> &Arc<LaneState> {
        &self.attention[lane_index(lane)]
    }
}

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

/// One queue row, every column bound in order.
const INSERT_ROW: &str = "INSERT INTO queue_messages (queue, message_id, tenant_id, channel, priority, body, fair_key, visible_at, receive_count, enqueued_at) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, 0, ?9)";

/// An attention entry for a tenant, unless one is waiting already (in the
/// queue, or set aside while the tenant is held).
const INSERT_ATTENTION: &str = "INSERT INTO queue_messages (queue, message_id, tenant_id, channel, priority, body, fair_key, visible_at, receive_count, enqueued_at) \
     SELECT ?1, ?2, ?2, 'email', 'normal', '', ?3, ?4, 0, ?5 \
     WHERE NOT EXISTS (SELECT 1 FROM queue_messages WHERE queue IN (?1, ?6) AND tenant_id = ?2)";

fn parse_receipt(receipt: &str) -> Option<(i64, u32)> {
    let (seq, count) = receipt.split_once(':')?;
    Some((seq.parse().ok()?, count.parse().ok()?))
}

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
}

impl Inserted {
    fn note(&mut self, state: &Arc<LaneState>, visible_at: i64, now: i64) {
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
                });
                self.queues.len() - 1
            }
        };
        let booked = &mut self.queues[at];
        booked.count += 1;
        if visible_at > now {
            booked.delayed.push(visible_at);
        }
    }

    /// Books committed inserts and wakes each queue's long-polling receivers.
    fn book(&self) {
        let now = now_ms();
        for booked in &self.queues {
            {
                let mut book = booked.state.book();
                book.rows += booked.count;
                for at in &booked.delayed {
                    book.add_delayed(*at, now);
                }
            }
            booked.state.arrivals.notify_waiters();
        }
    }
}

fn lane_index(lane: Lane) -> usize {
    match lane {
        Lane::Fast => 0,
        Lane::Slow => 1,
    }
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
        let names: Vec<String> = sqlx::query_scalar(
            "SELECT DISTINCT queue FROM queue_messages WHERE queue LIKE '%:t:%'",
        )
        .fetch_all(&queue.db.write)
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

    /// Puts `messages` on `lane` within a writer transaction (the accept
    /// path's: status rows and queue entries commit together), noting in
    /// `inserted` what to book; call [`EmbeddedQueue::inserted`] with it
    /// once committed.
    pub fn insert_rows(
        &self,
        tx: &Transaction,
        lane: Lane,
        messages: &[&OutboundMessage],
        inserted: &mut Inserted,
    ) -> rusqlite::Result<()> {
        self.insert_messages(tx, self.state(lane), messages.iter().copied(), inserted)
    }

    /// Books committed inserts and wakes the queues' long-polling receivers.
    pub fn inserted(&self, inserted: &Inserted) {
        inserted.book();
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
                self.signal_attention(tx, state.lane, &message.tenant_id, 0, inserted)?;
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
    fn signal_attention(
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
        }
        Ok(added == 1)
    }

    /// One non-waiting receive through the writer.
    async fn receive_now(&self, lane: Lane, max: usize) -> anyhow::Result<Vec<ReceivedMessage>> {
        let (reply, answer) = oneshot::channel();
        self.writer
            .submit(Box::new(ReceiveWork {
                state: self.state(lane).clone(),
                held: self.held.clone(),
                max,
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

    /// Moves `tenant_id`'s set-aside messages of `state`'s queue back:
    /// per priority class, in their original order, with fair keys that
    /// start where the tenant would start now.
    async fn release_held(&self, state: Arc<LaneState>, tenant_id: &str) -> anyhow::Result<()> {
        self.through_writer(|reply| {
            Box::new(ReleaseWork {
                state,
                tenant_id: tenant_id.to_owned(),
                moved: 0,
                lasts: Vec::new(),
                reply: Some(reply),
            })
        })
        .await
    }

    /// Every queue state a tenant's held messages may sit beside: the
    /// lanes, their attention queues and its own queues.
    fn states_of(&self, tenant_id: &str) -> Vec<Arc<LaneState>> {
        let mut states = vec![self.fast.clone(), self.slow.clone()];
        states.extend(self.dedicated.attention.iter().cloned());
        for lane in Lane::ALL {
            if let Some(state) = self
                .dedicated
                .queues
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&(*lane, tenant_id.to_owned()))
            {
                states.push(state.clone());
            }
        }
        states
    }

    /// Releases every set-aside message whose tenant is no longer held (a
    /// tenant resumed by a process that stopped before moving them back).
    pub async fn release_unheld(&self) -> anyhow::Result<()> {
        let tenants: Vec<String> = sqlx::query_scalar(
            "SELECT DISTINCT tenant_id FROM queue_messages WHERE queue LIKE '%held'",
        )
        .fetch_all(&self.db.read)
        .await?;
        for tenant in tenants {
            if !self.held.read().expect("held lock").contains(&tenant) {
                for state in self.states_of(&tenant) {
                    self.release_held(state, &tenant).await?;
                }
            }
        }
        Ok(())
    }

    /// A view of one queue of this file as a [`LaneQueue`].
    fn view(&self, state: Arc<LaneState>) -> Arc<dyn LaneQueue> {
        Arc::new(EmbeddedQueue {
            pinned: Some(state),
            ..self.clone()
        })
    }
}

/// After a slice: when a dedicated queue still has rows, makes sure an
/// attention entry waits, visible when the first of them can be received.
struct SignalWork {
    queue: EmbeddedQueue,
    state: Arc<LaneState>,
    tenant_id: String,
    inserted: Inserted,
    backlog: bool,
    reply: Reply<bool>,
}

impl Work for SignalWork {
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        self.inserted = Inserted::default();
        let now = now_ms();
        let delay = {
            let mut book = self.state.book();
            let delayed = book.delayed_now(now);
            let in_flight = book.in_flight(now) as u64;
            self.backlog = book.rows > 0;
            if !self.backlog {
                None
            } else if book.rows > delayed + in_flight {
                Some(0)
            } else {
                // Everything waits for a delay or a lease: wake then.
                Some(book.next_due(now).map_or(1000, |at| at - now))
            }
        };
        if let Some(delay) = delay {
            self.queue.signal_attention(
                tx,
                self.state.lane,
                &self.tenant_id,
                delay,
                &mut self.inserted,
            )?;
        }
        Ok(())
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if let Err(failure) = outcome {
            return failed(&mut self.reply, failure);
        }
        self.inserted.book();
        let _ = answer(&mut self.reply, Ok(self.backlog));
    }
}

/// Removes the rows of a dedicated queue that are not in flight and marks
/// their messages `cancelled` where they were not sent yet.
struct PurgeWork {
    state: Arc<LaneState>,
    purged: Vec<(i64, String)>,
    reply: Reply<Vec<String>>,
}

impl Work for PurgeWork {
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        self.purged.clear();
        let now = now_ms();
        let rows: Vec<(i64, String)> = tx
            .prepare_cached("SELECT seq, message_id FROM queue_messages WHERE queue = ?1")?
            .query_map([self.state.names.main.as_str()], |row| {
                Ok((row.get(0)?, row.get(1)?))
            })?
            .collect::<rusqlite::Result<_>>()?;
        let book = self.state.book();
        let mut delete = tx.prepare_cached("DELETE FROM queue_messages WHERE seq = ?1")?;
        let mut cancel = tx.prepare_cached(
            "UPDATE messages SET status = 'cancelled', updated_at = ?1 \
             WHERE id = ?2 AND status IN ('queued', 'retrying', 'scheduled')",
        )?;
        for (seq, message_id) in rows {
            if book.leases.get(&seq).is_some_and(|lease| lease.until > now) {
                continue;
            }
            delete.execute([seq])?;
            cancel.execute(rusqlite::params![now, message_id])?;
            self.purged.push((seq, message_id));
        }
        Ok(())
    }

    fn rolled_back(&mut self) {
        self.purged.clear();
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if let Err(failure) = outcome {
            return failed(&mut self.reply, failure);
        }
        {
            let mut book = self.state.book();
            for (seq, _) in &self.purged {
                book.leases.remove(seq);
            }
            book.rows = book.rows.saturating_sub(self.purged.len() as u64);
        }
        let ids = self.purged.drain(..).map(|(_, id)| id).collect();
        let _ = answer(&mut self.reply, Ok(ids));
    }
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
        let mut heads_of = tx.prepare_cached(
            "SELECT seq, tenant_id, receive_count FROM queue_messages INDEXED BY queue_messages_class \
             WHERE queue = ?1 AND priority = ?2 AND visible_at <= ?3 ORDER BY fair_key, seq LIMIT ?4",
        )?;
        let mut row_of = tx.prepare_cached(
            "SELECT message_id, channel, body, enqueued_at, fair_key FROM queue_messages WHERE seq = ?1",
        )?;
        let mut status_of = tx.prepare_cached("SELECT status FROM messages WHERE id = ?1")?;
        let mut count_receive =
            tx.prepare_cached("UPDATE queue_messages SET receive_count = ?1 WHERE seq = ?2")?;
        let mut set_aside = tx.prepare_cached(
            "UPDATE queue_messages SET queue = ?1, receive_count = MAX(receive_count, ?2) WHERE seq = ?3",
        )?;
        let mut to_dlq = tx.prepare_cached(
            "UPDATE queue_messages SET queue = ?1, visible_at = ?2, receive_count = MAX(receive_count, ?3), \
             last_error = COALESCE(last_error, 'received max_receive_count times without being deleted') WHERE seq = ?4",
        )?;
        let mut mark_dead = tx.prepare_cached(
            "UPDATE messages SET status = 'dead_lettered', updated_at = ?1, \
             last_error = COALESCE((SELECT last_error FROM queue_messages WHERE seq = ?2), last_error) \
             WHERE id = (SELECT message_id FROM queue_messages WHERE seq = ?2) AND status <> 'sent'",
        )?;
        let mut book = self.state.book();
        let held = self.held.read().unwrap_or_else(PoisonError::into_inner);
        while self.out.len() < self.max {
            let want = self.max - self.out.len();
            // Rows in flight sit among the heads; read past them.
            let limit = want + book.in_flight(now);
            let mut heads: [Vec<Head>; CLASSES] = Default::default();
            let mut moved = 0;
            for priority in Priority::ALL {
                let rows = heads_of
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
                        to_dlq.execute(rusqlite::params![names.dlq.as_str(), now, prior, seq])?;
                        mark_dead.execute(rusqlite::params![now, seq])?;
                        self.moved.push(Moved::Dlq(seq));
                        moved += 1;
                    } else if held.contains(&tenant_id) {
                        set_aside.execute(rusqlite::params![names.held.as_str(), prior, seq])?;
                        self.moved.push(Moved::Held(seq));
                        moved += 1;
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
                        count_receive.execute(rusqlite::params![count, seq])?;
                    }
                    let (message_id, channel, body, enqueued_at, key): (
                        String,
                        String,
                        String,
                        i64,
                        i64,
                    ) = row_of.query_row([seq], |row| {
                        Ok((
                            row.get(0)?,
                            row.get(1)?,
                            row.get(2)?,
                            row.get(3)?,
                            row.get(4)?,
                        ))
                    })?;
                    let status: Option<String> = status_of
                        .query_row([&message_id], |row| row.get(0))
                        .optional()?;
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
            self.state.arrivals.notify_waiters();
        }
    }
}

/// Deletes received messages; one result per receipt.
struct DeleteWork {
    state: Arc<LaneState>,
    receipts: Vec<String>,
    results: Vec<EntryResult>,
    deleted: Vec<i64>,
    reply: Reply<Vec<EntryResult>>,
}

impl Work for DeleteWork {
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        let names = self.state.names.clone();
        let mut delete =
            tx.prepare_cached("DELETE FROM queue_messages WHERE seq = ?1 AND queue = ?2")?;
        let book = self.state.book();
        for receipt in &self.receipts {
            let Some((seq, count)) = parse_receipt(receipt) else {
                self.results
                    .push(Err(format!("receipt {receipt:?} is malformed")));
                continue;
            };
            let current = book.leases.get(&seq).is_some_and(|l| l.count == count);
            if current && delete.execute(rusqlite::params![seq, names.main.as_str()])? == 1 {
                self.deleted.push(seq);
                self.results.push(Ok(()));
            } else {
                self.results
                    .push(Err(format!("receipt {receipt:?} is no longer valid")));
            }
        }
        Ok(())
    }

    fn rolled_back(&mut self) {
        self.results.clear();
        self.deleted.clear();
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if let Err(failure) = outcome {
            return failed(&mut self.reply, failure);
        }
        {
            let mut book = self.state.book();
            for seq in &self.deleted {
                book.leases.remove(seq);
            }
            book.rows = book.rows.saturating_sub(self.deleted.len() as u64);
        }
        self.state
            .deleted
            .fetch_add(self.deleted.len() as u64, Ordering::Relaxed);
        let results = std::mem::take(&mut self.results);
        let _ = answer(&mut self.reply, Ok(results));
    }
}

/// What a received message is turned into by [`MoveWork`].
#[derive(Debug, Clone, Copy)]
enum Destination {
    /// Back into the lane after `delay`, with a fresh fair key, the receive
    /// not counted.
    Deferred { delay: Duration },
    /// Into the lane's DLQ.
    DeadLettered,
}

/// Moves one received message: a deferral or a move to the DLQ.
struct MoveWork {
    state: Arc<LaneState>,
    receipt: String,
    tenant_id: String,
    priority: Priority,
    to: Destination,
    /// When the deferred message is due (ms), once applied.
    due: Option<i64>,
    reply: Reply<()>,
}

impl Work for MoveWork {
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        let names = self.state.names.clone();
        let receipt = self.receipt.as_str();
        let (seq, count) =
            parse_receipt(receipt).with_context(|| format!("receipt {receipt:?} is malformed"))?;
        let current = self
            .state
            .book()
            .leases
            .get(&seq)
            .is_some_and(|l| l.count == count);
        let now = now_ms();
        let done = current
            && match self.to {
                Destination::Deferred { delay } => {
                    // A fresh fair key: the message queues behind its
                    // tenant's others. The receive is not counted.
                    let key = self.state.fair()[self.priority.rank()].next_key(&self.tenant_id);
                    let due = now + delay.as_millis() as i64;
                    self.due = Some(due);
                    tx.prepare_cached(
                        "UPDATE queue_messages SET visible_at = ?1, fair_key = ?2, receive_count = ?3 \
                         WHERE seq = ?4 AND queue = ?5",
                    )?
                    .execute(rusqlite::params![
                        due,
                        key,
                        count.saturating_sub(1),
                        seq,
                        names.main.as_str()
                    ])? == 1
                }
                Destination::DeadLettered => {
                    tx.prepare_cached(
                        "UPDATE queue_messages SET queue = ?1, visible_at = ?2, receive_count = ?3 \
                         WHERE seq = ?4 AND queue = ?5",
                    )?
                    .execute(rusqlite::params![
                        names.dlq.as_str(),
                        now,
                        count,
                        seq,
                        names.main.as_str()
                    ])? == 1
                }
            };
        if !done {
            // Not a failure of the group: only this receipt is stale.
            self.due = None;
            let _ = answer(
                &mut self.reply,
                Err(anyhow::anyhow!("receipt {receipt:?} is no longer valid")),
            );
        }
        Ok(())
    }

    fn rolled_back(&mut self) {
        self.due = None;
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if let Err(failure) = outcome {
            return failed(&mut self.reply, failure);
        }
        if self.reply.is_none() {
            return; // answered as stale in apply
        }
        let Some((seq, _)) = parse_receipt(&self.receipt) else {
            return;
        };
        let now = now_ms();
        let mut book = self.state.book();
        book.leases.remove(&seq);
        match self.to {
            Destination::Deferred { .. } => {
                if let Some(due) = self.due {
                    book.add_delayed(due, now);
                    if due <= now {
                        drop(book);
                        self.state.arrivals.notify_waiters();
                    }
                }
            }
            Destination::DeadLettered => {
                book.rows = book.rows.saturating_sub(1);
                book.dlq += 1;
            }
        }
        let _ = answer(&mut self.reply, Ok(()));
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

/// Moves a released tenant's set-aside messages back into the lane.
struct ReleaseWork {
    state: Arc<LaneState>,
    tenant_id: String,
    moved: u64,
    /// The tenant's last fair key per class after the move.
    lasts: Vec<(usize, i64)>,
    reply: Reply<()>,
}

impl Work for ReleaseWork {
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        let names = self.state.names.clone();
        self.lasts.clear();
        self.moved = 0;
        let counts: Vec<(String, i64)> = tx
            .prepare_cached(
                "SELECT priority, COUNT(*) FROM queue_messages WHERE queue = ?1 AND tenant_id = ?2 GROUP BY priority",
            )?
            .query_map(rusqlite::params![names.held.as_str(), self.tenant_id], |row| {
                Ok((row.get(0)?, row.get(1)?))
            })?
            .collect::<rusqlite::Result<_>>()?;
        if counts.is_empty() {
            return Ok(());
        }
        // Each class's keys run from the tenant's next key on; the fair
        // state is advanced past them only once the move has committed.
        let mut bases = [0i64; CLASSES];
        {
            let fair = self.state.fair();
            for (priority, count) in &counts {
                let rank = priority.parse::<Priority>().map_or(1, Priority::rank);
                let class = &fair[rank];
                let last = class
                    .last_key
                    .get(&self.tenant_id)
                    .copied()
                    .unwrap_or(i64::MIN);
                bases[rank] = last.max(class.virtual_now);
                self.lasts.push((rank, bases[rank] + count));
            }
        }
        self.moved = tx
            .prepare_cached(
                "UPDATE queue_messages SET queue = ?1, visible_at = MIN(visible_at, ?2), \
                   fair_key = CASE queue_messages.priority WHEN 'high' THEN ?3 WHEN 'normal' THEN ?4 ELSE ?5 END + ordered.place \
                 FROM (SELECT seq, ROW_NUMBER() OVER (PARTITION BY priority ORDER BY seq) AS place \
                       FROM queue_messages WHERE queue = ?6 AND tenant_id = ?7) AS ordered \
                 WHERE queue_messages.seq = ordered.seq",
            )?
            .execute(rusqlite::params![
                names.main.as_str(),
                now_ms(),
                bases[Priority::High.rank()],
                bases[Priority::Normal.rank()],
                bases[Priority::Low.rank()],
                names.held.as_str(),
                self.tenant_id,
            ])? as u64;
        Ok(())
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if let Err(failure) = outcome {
            return failed(&mut self.reply, failure);
        }
        if self.moved > 0 {
            {
                let mut book = self.state.book();
                book.held = book.held.saturating_sub(self.moved);
                book.rows += self.moved;
            }
            let mut fair = self.state.fair();
            for (rank, last) in &self.lasts {
                let key = fair[*rank]
                    .last_key
                    .entry(self.tenant_id.clone())
                    .or_insert(*last);
                *key = (*key).max(*last);
            }
            drop(fair);
            self.state.arrivals.notify_waiters();
        }
        let _ = answer(&mut self.reply, Ok(()));
    }
}

/// Moves matching dead letters back into the lane with fresh fair keys
/// and, in the same transaction, a fresh attempt budget.
struct RedriveWork {
    state: Arc<LaneState>,
    filter: RedriveFilter,
    ids: Vec<String>,
    reply: Reply<Vec<String>>,
}

impl Work for RedriveWork {
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        let names = self.state.names.clone();
        self.ids.clear();
        let wanted: Option<HashSet<&String>> = self
            .filter
            .message_ids
            .as_ref()
            .map(|ids| ids.iter().collect());
        let rows: Vec<(i64, String, String, String)> = tx
            .prepare_cached(
                "SELECT seq, message_id, tenant_id, priority FROM queue_messages \
                 WHERE queue = ?1 AND (?2 IS NULL OR tenant_id = ?2) ORDER BY seq",
            )?
            .query_map(
                rusqlite::params![names.dlq.as_str(), self.filter.tenant_id],
                |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?)),
            )?
            .collect::<rusqlite::Result<_>>()?;
        let now = now_ms();
        let mut move_back = tx.prepare_cached(
            "UPDATE queue_messages SET queue = ?1, visible_at = ?2, receive_count = 0, fair_key = ?3, \
             last_error = NULL WHERE seq = ?4",
        )?;
        let mut requeue = tx.prepare_cached(
            "UPDATE messages SET status = 'queued', attempts = 0, updated_at = ?1 \
             WHERE id = ?2 AND status NOT IN ('sent', 'rejected')",
        )?;
        for (seq, message_id, tenant_id, priority) in rows {
            if wanted
                .as_ref()
                .is_some_and(|ids| !ids.contains(&message_id))
            {
                continue;
            }
            let rank = priority.parse::<Priority>().map_or(1, Priority::rank);
            let key = self.state.fair()[rank].next_key(&tenant_id);
            move_back.execute(rusqlite::params![names.main.as_str(), now, key, seq])?;
            requeue.execute(rusqlite::params![now, message_id])?;
            self.ids.push(message_id);
        }
        Ok(())
    }

    fn rolled_back(&mut self) {
        self.ids.clear();
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if let Err(failure) = outcome {
            return failed(&mut self.reply, failure);
        }
        let moved = self.ids.len() as u64;
        if moved > 0 {
            {
                let mut book = self.state.book();
                book.dlq = book.dlq.saturating_sub(moved);
                book.rows += moved;
            }
            self.state.arrivals.notify_waiters();
        }
        let ids = std::mem::take(&mut self.ids);
        let _ = answer(&mut self.reply, Ok(ids));
    }
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

    async fn receive(
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
            let got = self.receive_now(lane, max.max(1)).await?;
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

    async fn delete_batch(
        &self,
        lane: Lane,
        receipts: &[String],
    ) -> anyhow::Result<Vec<EntryResult>> {
        let state = self.state(lane).clone();
        let receipts = receipts.to_vec();
        self.through_writer(|reply| {
            Box::new(DeleteWork {
                state,
                results: Vec::with_capacity(receipts.len()),
                receipts,
                deleted: Vec::new(),
                reply: Some(reply),
            })
        })
        .await
    }

    /// Leases live in memory, so a visibility change writes nothing.
    async fn change_visibility_batch(
        &self,
        lane: Lane,
        changes: &[(String, Duration)],
    ) -> anyhow::Result<Vec<EntryResult>> {
        let state = self.state(lane);
        let now = now_ms();
        let mut returned_any = false;
        let results = {
            let mut book = state.book();
            changes
                .iter()
                .map(|(receipt, visibility)| {
                    let Some((seq, count)) = parse_receipt(receipt) else {
                        return Err(format!("receipt {receipt:?} is malformed"));
                    };
                    match book.leases.get_mut(&seq) {
                        Some(lease) if lease.count == count => {
                            lease.until = now + visibility.as_millis() as i64;
                            returned_any |= visibility.is_zero();
                            Ok(())
                        }
                        _ => Err(format!("receipt {receipt:?} is no longer valid")),
                    }
                })
                .collect()
        };
        if returned_any {
            state.arrivals.notify_waiters();
        }
        Ok(results)
    }

    async fn defer(
        &self,
        lane: Lane,
        message: &ReceivedMessage,
        delay: Duration,
    ) -> anyhow::Result<()> {
        self.move_received(lane, message, Destination::Deferred { delay })
            .await
    }

    async fn dead_letter(&self, lane: Lane, message: &ReceivedMessage) -> anyhow::Result<()> {
        self.move_received(lane, message, Destination::DeadLettered)
            .await
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
        let oldest: Option<i64> = sqlx::query_scalar(
            "SELECT enqueued_at FROM queue_messages INDEXED BY queue_messages_queue \
             WHERE queue = ? ORDER BY seq LIMIT 1",
        )
        .bind(self.state(lane).names.main.as_str())
        .fetch_optional(&self.db.read)
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
        type Row = (String, String, String, String, i64, i64, String);
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT message_id, tenant_id, channel, priority, receive_count, enqueued_at, body \
             FROM queue_messages WHERE queue = ? ORDER BY seq LIMIT ?",
        )
        .bind(self.state(lane).names.dlq.as_str())
        .bind(limit as i64)
        .fetch_all(&self.db.read)
        .await?;
        rows.into_iter()
            .map(
                |(message_id, tenant_id, channel, priority, count, enqueued_at, body)| {
                    Ok(DeadLetter {
                        message_id,
                        tenant_id,
                        channel: channel.parse().map_err(anyhow::Error::msg)?,
                        priority: priority.parse().map_err(anyhow::Error::msg)?,
                        receive_count: count.max(0) as u32,
                        enqueued_at_ms: enqueued_at,
                        body,
                    })
                },
            )
            .collect()
    }

    async fn redrive(&self, lane: Lane, filter: &RedriveFilter) -> anyhow::Result<Vec<String>> {
        if filter.message_ids.as_ref().is_some_and(Vec::is_empty) {
            return Ok(Vec::new());
        }
        let state = self.state(lane).clone();
        let filter = filter.clone();
        self.through_writer(|reply| {
            Box::new(RedriveWork {
                state,
                filter,
                ids: Vec::new(),
                reply: Some(reply),
            })
        })
        .await
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
        if held {
            self.held
                .write()
                .expect("held lock")
                .insert(tenant_id.to_owned());
            return Ok(());
        }
        self.held.write().expect("held lock").remove(tenant_id);
        for state in self.states_of(tenant_id) {
            self.release_held(state, tenant_id).await?;
        }
        Ok(())
    }

    fn deleted_total(&self, lane: Lane) -> u64 {
        self.state(lane).deleted.load(Ordering::Relaxed)
    }

    fn has_dedicated_queues(&self) -> bool {
        true
    }

    fn set_tenant_dedicated(&self, tenant_id: &str, dedicated: bool) {
        let mut tenants = self
            .dedicated
            .tenants
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if dedicated {
            tenants.insert(tenant_id.to_owned());
        } else {
            tenants.remove(tenant_id);
        }
    }

    async fn dedicated_queue(
        &self,
        lane: Lane,
        tenant_id: &str,
    ) -> anyhow::Result<Option<Arc<dyn LaneQueue>>> {
        let state = self
            .dedicated
            .queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(lane, tenant_id.to_owned()))
            .cloned();
        Ok(state.map(|state| self.view(state)))
    }

    fn attention_queue(&self, lane: Lane) -> Option<Arc<dyn LaneQueue>> {
        Some(self.view(self.dedicated.attention(lane).clone()))
    }

    async fn settle_attention(&self, lane: Lane, tenant_id: &str) -> anyhow::Result<bool> {
        let Some(state) = self
            .dedicated
            .queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(lane, tenant_id.to_owned()))
            .cloned()
        else {
            return Ok(false);
        };
        let queue = self.clone();
        let tenant_id = tenant_id.to_owned();
        self.through_writer(|reply| {
            Box::new(SignalWork {
                queue,
                state,
                tenant_id,
                inserted: Inserted::default(),
                backlog: false,
                reply: Some(reply),
            })
        })
        .await
    }

    async fn reconcile_attention(&self) -> anyhow::Result<usize> {
        let queues: Vec<((Lane, String), Arc<LaneState>)> = self
            .dedicated
            .queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(_, state)| state.book().rows > 0)
            .map(|(key, state)| (key.clone(), state.clone()))
            .collect();
        let mut backlogged = 0;
        for ((lane, tenant_id), _) in queues {
            if self.settle_attention(lane, &tenant_id).await? {
                backlogged += 1;
            }
        }
        Ok(backlogged)
    }

    async fn purge_dedicated(&self, tenant_id: &str) -> anyhow::Result<Vec<String>> {
        let mut ids = Vec::new();
        for lane in self.dedicated_lanes(tenant_id).await? {
            let Some(state) = self
                .dedicated
                .queues
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&(lane, tenant_id.to_owned()))
                .cloned()
            else {
                continue;
            };
            ids.extend(
                self.through_writer(|reply| {
                    Box::new(PurgeWork {
                        state,
                        purged: Vec::new(),
                        reply: Some(reply),
                    })
                })
                .await?,
            );
        }
        Ok(ids)
    }

    async fn dedicated_lanes(&self, tenant_id: &str) -> anyhow::Result<Vec<Lane>> {
        let queues = self
            .dedicated
            .queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Ok(Lane::ALL
            .iter()
            .copied()
            .filter(|lane| queues.contains_key(&(*lane, tenant_id.to_owned())))
            .collect())
    }

    async fn ping(&self) -> bool {
        self.db.ping().await
    }
}

impl EmbeddedQueue {
    async fn move_received(
        &self,
        lane: Lane,
        message: &ReceivedMessage,
        to: Destination,
    ) -> anyhow::Result<()> {
        let state = self.state(lane).clone();
        let (receipt, tenant_id, priority) = (
            message.receipt.clone(),
            message.tenant_id.clone(),
            message.priority,
        );
        self.through_writer(|reply| {
            Box::new(MoveWork {
                state,
                receipt,
                tenant_id,
                priority,
                to,
                due: None,
                reply: Some(reply),
            })
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;
    use crate::model::{Channel, Priority};

    async fn open_queue(dir: &tempfile::TempDir, max_receive_count: u32) -> EmbeddedQueue {
        let db = SqliteDb::open(&dir.path().join("q.db"), false)
            .await
            .unwrap();
        let mut lanes = Settings::from_toml_overlay("").unwrap().lanes;
        lanes.fast.visibility_timeout_secs = 1;
        lanes.fast.max_receive_count = max_receive_count;
        let (writer, _stopped) = StoreWriter::spawn(&db, 512).unwrap();
        EmbeddedQueue::open(db, lanes, writer).await.unwrap()
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
        let receipts: Vec<String> = got.into_iter().map(|m| m.receipt).collect();
        queue.delete_batch(Lane::Fast, &receipts).await.unwrap();
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

    #[tokio::test]
    async fn a_receive_abandoned_while_the_writer_works_gives_its_messages_back_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let queue = open_queue(&dir, 5).await;
        queue
            .send_batch(Lane::Fast, vec![message("a", 1)])
            .await
            .unwrap();
        // Hold the write turn so the writer waits for it with the receive
        // in hand, then abandon the receive, as a consumer shutting down
        // mid-poll does.
        let busy = queue.db.write_turn().await;
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

    /// The lane's figures as a scan of the table sees them, to check the
    /// counters kept with the writes.
    async fn scanned(queue: &EmbeddedQueue) -> (u64, u64, u64) {
        let count = |name: &'static str| {
            let read = queue.db.read.clone();
            async move {
                sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM queue_messages WHERE queue = ?")
                    .bind(name)
                    .fetch_one(&read)
                    .await
                    .unwrap() as u64
            }
        };
        (
            count("fast").await,
            count("fast-dlq").await,
            count("fast-held").await,
        )
    }

    #[tokio::test]
    async fn a_first_receive_writes_nothing_and_a_crash_forgets_at_most_one_receive() {
        let dir = tempfile::tempdir().unwrap();
        let queue = open_queue(&dir, 2).await;
        queue
            .send_batch(Lane::Fast, vec![message("a", 1)])
            .await
            .unwrap();
        let stored = |queue: &EmbeddedQueue| {
            let read = queue.db.read.clone();
            async move {
                sqlx::query_as::<_, (i64, i64)>(
                    "SELECT receive_count, visible_at FROM queue_messages WHERE message_id = 'a-1'",
                )
                .fetch_one(&read)
                .await
                .unwrap()
            }
        };
        let before = stored(&queue).await;
        let first = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
        assert_eq!(first[0].receive_count, 1);
        assert_eq!(
            stored(&queue).await,
            before,
            "a first receive is not written"
        );

        // A crash (a new process on the file) loses the lease and the
        // unwritten first receive: the message is received as a first time.
        let queue = open_queue(&dir, 2).await;
        let again = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
        assert_eq!(again[0].receive_count, 1);
        queue
            .change_visibility_batch(Lane::Fast, &[(again[0].receipt.clone(), Duration::ZERO)])
            .await
            .unwrap();
        let second = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
        assert_eq!(second[0].receive_count, 2);
        assert_eq!(
            stored(&queue).await.0,
            2,
            "a receive after the first is written"
        );

        // After another crash the written count holds: the message is
        // exhausted and moves to the DLQ, one receive later than without
        // the crashes, never more.
        let queue = open_queue(&dir, 2).await;
        assert!(
            queue
                .receive(Lane::Fast, 1, Duration::ZERO)
                .await
                .unwrap()
                .is_empty()
        );
        let stats = queue.stats(Lane::Fast).await.unwrap();
        assert_eq!((stats.depth, stats.dlq_depth), (0, 1));
    }

    #[tokio::test]
    async fn the_counters_kept_with_the_writes_match_a_scan_of_the_table() {
        let dir = tempfile::tempdir().unwrap();
        let queue = open_queue(&dir, 2).await;
        queue.set_tenant_held("held", true).await.unwrap();
        let mut batch: Vec<_> = (0..30).map(|n| message("a", n)).collect();
        batch.extend((0..5).map(|n| message("held", n)));
        let mut later = message("a", 100);
        later.delay = Duration::from_secs(60);
        batch.push(later);
        queue.send_batch(Lane::Fast, batch).await.unwrap();

        let got = queue.receive(Lane::Fast, 20, Duration::ZERO).await.unwrap();
        assert_eq!(got.len(), 20);
        let stats = queue.stats(Lane::Fast).await.unwrap();
        assert_eq!(
            (stats.in_flight, stats.delayed, stats.held),
            (20, 1, 5),
            "{stats:?}"
        );
        let (deleted, rest) = got.split_at(10);
        let receipts: Vec<String> = deleted.iter().map(|m| m.receipt.clone()).collect();
        queue.delete_batch(Lane::Fast, &receipts).await.unwrap();
        queue.dead_letter(Lane::Fast, &rest[0]).await.unwrap();
        queue.dead_letter(Lane::Fast, &rest[1]).await.unwrap();
        queue
            .defer(Lane::Fast, &rest[2], Duration::from_secs(30))
            .await
            .unwrap();
        queue
            .defer(Lane::Fast, &rest[3], Duration::ZERO)
            .await
            .unwrap();
        queue
            .redrive(
                Lane::Fast,
                &RedriveFilter {
                    tenant_id: None,
                    message_ids: Some(vec![rest[0].message_id.clone()]),
                },
            )
            .await
            .unwrap();
        queue.set_tenant_held("held", false).await.unwrap();

        let stats = queue.stats(Lane::Fast).await.unwrap();
        let (rows, dlq, held) = scanned(&queue).await;
        assert_eq!(stats.depth + stats.in_flight, rows, "{stats:?}");
        assert_eq!((stats.dlq_depth, stats.held), (dlq, held));
        assert_eq!((dlq, held), (1, 0));
        assert_eq!(stats.in_flight, 6, "{stats:?}");
        assert_eq!(stats.delayed, 2, "the delayed send and the 30 s deferral");
        assert!(stats.oldest_age_secs.is_some());

        // A new process counts the same from the table.
        let reopened = open_queue(&dir, 2).await;
        let fresh = reopened.stats(Lane::Fast).await.unwrap();
        assert_eq!(fresh.depth, rows, "leases do not survive a restart");
        assert_eq!((fresh.dlq_depth, fresh.held, fresh.delayed), (1, 0, 2));
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
