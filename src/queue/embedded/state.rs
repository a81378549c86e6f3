//! What each queue keeps in memory beside its rows, changed with the writes
//! that change the rows: fair-queueing keys per priority class, the book of
//! leases and counters, and the table's names of the queue; and the
//! registry of dedicated tenant queues that every view of the embedded
//! queue shares. [`LaneState::load`] rebuilds a queue's state from the
//! table when the queue is opened. Nothing here submits work to the writer,
//! and nothing here uses the files beside it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

use tokio::sync::Notify;

use crate::config::LanesSettings;
use crate::model::{Lane, Priority, now_ms};
use crate::queue::priority::{CLASSES, PriorityShare};

/// Fair-queueing bookkeeping of one queue.
#[derive(Debug, Default)]
pub(super) struct FairState {
    /// Last key handed to each tenant.
    pub(super) last_key: HashMap<String, i64>,
    /// Key of the last received message: new arrivals start from here.
    pub(super) virtual_now: i64,
}

impl FairState {
    pub(super) fn next_key(&mut self, tenant_id: &str) -> i64 {
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
pub(super) struct Lease {
    /// Receives so far, the latest included. The row may hold one less: a
    /// first receive is not written.
    pub(super) count: u32,
    /// Not receivable again before this instant (ms).
    pub(super) until: i64,
}

/// What one lane keeps in memory beside its rows, changed with the writes
/// that change the rows.
#[derive(Debug, Default)]
pub(super) struct Book {
    /// Messages received and not yet deleted, deferred or moved, by `seq`.
    /// An entry outlives its lease (`until` passed) so the receive count
    /// stays known until the message is received again.
    pub(super) leases: HashMap<i64, Lease>,
    /// Rows in the lane: visible, delayed and in flight.
    pub(super) rows: u64,
    /// Rows in the lane's DLQ.
    pub(super) dlq: u64,
    /// Rows of held tenants set aside.
    pub(super) held: u64,
    /// Rows written with a due time still to come, by due time (ms).
    delayed: BTreeMap<i64, u64>,
}

impl Book {
    pub(super) fn add_delayed(&mut self, at: i64, now: i64) {
        if at > now {
            *self.delayed.entry(at).or_default() += 1;
        }
    }

    /// Forgets one row due at `at` (removed before it was due).
    pub(super) fn remove_delayed(&mut self, at: i64) {
        if let Some(count) = self.delayed.get_mut(&at) {
            *count -= 1;
            if *count == 0 {
                self.delayed.remove(&at);
            }
        }
    }

    /// Forgets due times that have passed; returns how many are to come.
    pub(super) fn delayed_now(&mut self, now: i64) -> u64 {
        self.delayed = self.delayed.split_off(&(now + 1));
        self.delayed.values().sum()
    }

    pub(super) fn in_flight(&self, now: i64) -> usize {
        self.leases
            .values()
            .filter(|lease| lease.until > now)
            .count()
    }

    /// The next instant after `now` (ms) at which a message may become
    /// receivable: a due time or a lease running out.
    pub(super) fn next_due(&self, now: i64) -> Option<i64> {
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
pub(super) struct QueueNames {
    pub(super) main: String,
    pub(super) dlq: String,
    pub(super) held: String,
}

impl QueueNames {
    /// A lane's queues: `fast`, `fast-dlq`, `fast-held`.
    pub(super) fn lane(lane: Lane) -> Self {
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
    pub(super) fn attention(lane: Lane) -> Self {
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
pub(super) struct LaneState {
    pub(super) lane: Lane,
    pub(super) names: Arc<QueueNames>,
    /// Fair-queueing state of each priority class, by rank.
    fair: Mutex<[FairState; CLASSES]>,
    /// Which classes the next receive serves.
    pub(super) share: PriorityShare,
    /// Woken after every commit that makes messages receivable (see
    /// [`LaneState::arrived`]).
    pub(super) arrivals: Notify,
    /// How many times `arrivals` was woken.
    pub(super) arrived_total: AtomicU64,
    pub(super) deleted: AtomicU64,
    book: Mutex<Book>,
    /// Receives after which a message moves to the DLQ.
    pub(super) max_receives: u32,
    pub(super) visibility_ms: i64,
}

impl LaneState {
    /// Counts a commit that made messages receivable and wakes the waiters.
    pub(super) fn arrived(&self) {
        self.arrived_total.fetch_add(1, Ordering::Relaxed);
        self.arrivals.notify_waiters();
    }

    pub(super) fn new(lane: Lane, names: QueueNames, lanes: &LanesSettings) -> Arc<Self> {
        let settings = lanes.get(lane);
        Arc::new(LaneState {
            lane,
            names: Arc::new(names),
            fair: Mutex::default(),
            share: PriorityShare::new(settings.low_priority_share),
            arrivals: Notify::new(),
            arrived_total: AtomicU64::new(0),
            deleted: AtomicU64::new(0),
            book: Mutex::default(),
            max_receives: settings.max_receive_count,
            visibility_ms: (settings.visibility_timeout_secs * 1000) as i64,
        })
    }

    pub(super) fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn fair(&self) -> MutexGuard<'_, [FairState; CLASSES]> {
        self.fair.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Rebuilds the book's counters and the fair-queueing state from the
    /// rows stored under this queue's names.
    pub(super) fn load(&self, conn: &rusqlite::Connection) -> rusqlite::Result<()> {
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
pub(super) type HeldTenants = Arc<RwLock<HashSet<String>>>;

/// What every view of the embedded queue shares: dedicated tenants and
/// their queues, and the lanes' attention queues.
pub(super) struct Dedicated {
    pub(super) lanes: LanesSettings,
    /// Tenants whose new messages go to their own queue.
    pub(super) tenants: RwLock<HashSet<String>>,
    /// Each dedicated tenant queue's state, by lane and tenant, made on
    /// first use and kept (a tenant switched back to shared may still have
    /// a backlog there).
    pub(super) queues: Mutex<HashMap<(Lane, String), Arc<LaneState>>>,
    /// Each lane's attention queue.
    pub(super) attention: [Arc<LaneState>; 2],
}

impl Dedicated {
    pub(super) fn is_dedicated(&self, tenant_id: &str) -> bool {
        self.tenants
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(tenant_id)
    }

    /// The state of `tenant_id`'s queue in `lane`, and whether it is new
    /// (its counters still to be loaded from the table).
    pub(super) fn queue(&self, lane: Lane, tenant_id: &str) -> (Arc<LaneState>, bool) {
        let mut queues = self.queues.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(state) = queues.get(&(lane, tenant_id.to_owned())) {
            return (state.clone(), false);
        }
        let state = LaneState::new(lane, QueueNames::tenant(lane, tenant_id), &self.lanes);
        queues.insert((lane, tenant_id.to_owned()), state.clone());
        (state, true)
    }

    pub(super) fn attention(&self, lane: Lane) -> &Arc<LaneState> {
        &self.attention[lane_index(lane)]
    }
}

fn lane_index(lane: Lane) -> usize {
    match lane {
        Lane::Fast => 0,
        Lane::Slow => 1,
    }
}
