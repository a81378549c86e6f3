//! Lane consumers: one per lane, in-process, started by `fairlane serve`.
//!
//! ```text
//! poller ──► TieredBuffer ──► dispatcher ──► process (one task per message)
//! long-poll,   bounded: a slot   tenant place    tenant check, then the
//! batches ≤10  is freed when     (or parked at   provider token (gate line:
//!              processing ends   its cap)        priority, tenant turns),
//!                                                then a worker for the call
//! ```
//!
//! Token first: every buffered message is started at once and waits in its
//! provider gate's line, where high goes before normal before low and the
//! tenants of one priority take turns. A worker slot (lane `concurrency`) is
//! taken only once the token is there, for the provider call itself, so a
//! message that is only waiting for the provider holds no worker, and a
//! high-priority message that arrives while a hundred lows wait takes the
//! very next token.
//!
//! The poller only receives as many messages as the buffer has free slots;
//! a slot comes back when the message that took it is finished, so memory
//! stays bounded. A tenant at its plan's `max_in_flight` gives way: its
//! further messages are parked outside the buffer (see [`TenantSlots`]) and
//! take the tenant's next free place, so its backlog never fills the buffer
//! that another tenant's first message needs.

mod attention;
pub mod buffer;
mod process;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tracing::{info, warn};

use crate::config::{ConsumerSettings, LaneSettings, RetrySettings};
use crate::limits::gate::ProviderGate;
use crate::metrics::{self as names, GaugeHold};
use crate::model::{Channel, Lane, World};
use crate::providers::Provider;
use crate::queue::{LaneQueue, ReceivedMessage, TenantQueues};
use crate::store::Db;
use crate::tenants::Registry;
use buffer::TieredBuffer;

/// How long the suppression list as read at receive is trusted for a
/// message that was parked behind its tenant's cap.
const LOOKED_UP_FRESH_FOR: Duration = Duration::from_secs(1);

/// Least time between two looks past the capped tenants' rows that an
/// arrival starts, after one that found nothing (see
/// `LaneConsumer::reserve_room`): at most 1,000 such looks a second.
const SKIP_SPACING: Duration = Duration::from_millis(1);

/// Longest pause after failed receives.
const MAX_ERROR_BACKOFF: Duration = Duration::from_secs(10);

/// A channel's providers with the gate that paces them: one line of
/// waiting messages, a bucket per provider (see [`crate::limits::gate`]).
#[derive(Clone)]
pub struct GatedProvider {
    pub gate: Arc<ProviderGate>,
    /// In the gate's order: the gate's member `i` is `members[i]`.
    pub members: Arc<[PoolMember]>,
}

/// One provider of a channel's pool.
pub struct PoolMember {
    /// Its configured name: metrics label, logs, the message's `provider`.
    pub name: &'static str,
    pub provider: Arc<dyn Provider>,
    /// Pauses the provider's bucket after a run of failed calls.
    pub breaker: Arc<crate::limits::breaker::CircuitBreaker>,
}

impl GatedProvider {
    /// A pool of one provider.
    pub fn single(
        name: &'static str,
        provider: Arc<dyn Provider>,
        gate: ProviderGate,
        breaker: crate::limits::breaker::CircuitBreaker,
    ) -> Self {
        GatedProvider {
            gate: Arc::new(gate),
            members: Arc::new([PoolMember {
                name,
                provider,
                breaker: Arc::new(breaker),
            }]),
        }
    }

    /// The position of the provider called `name` in the pool.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.members.iter().position(|member| member.name == name)
    }
}

/// What every lane's consumer shares.
#[derive(Clone)]
pub struct Delivery {
    pub db: Db,
    pub registry: Arc<Registry>,
    pub queue: Arc<dyn LaneQueue>,
    /// The same backend's dedicated tenant queues, served by attention
    /// workers. A slice's delivery keeps it while its `queue` is the
    /// tenant's own.
    pub tenant_queues: Arc<dyn TenantQueues>,
    /// Each channel's gated provider pool in each world.
    pub providers: ChannelProviders,
    pub retry: RetrySettings,
    pub consumers: ConsumerSettings,
    /// Batches `sending`/`sent` status changes into shared transactions.
    pub status: crate::store::Writer,
    /// Ids of the messages being delivered by this process.
    pub delivering: Arc<Delivering>,
    /// `logging.log_addresses`: recipients' addresses in the INFO lines of
    /// sent and dead-lettered messages.
    pub log_addresses: bool,
    /// Store writes of this process's deliveries that failed in a row (a
    /// claim, a `sent`): while any did, the pollers wait before receiving
    /// more, so a broken store is not met by a spin through the queue.
    pub store_trouble: crate::store::FailureStreak,
    /// The template versions sends by template are rendered from.
    pub templates: Arc<crate::templates::Templates>,
}

/// The ids of messages this process is delivering right now. A queue may
/// hold two copies of one message (at-least-once: an outbox re-send after a
/// crash, a delete that failed after a deferral's copy was sent). The status
/// check before sending keeps a later copy from going out again; this set
/// keeps a copy received while the other is still being sent from going out
/// at the same time.
#[derive(Debug, Default)]
pub struct Delivering(Mutex<std::collections::HashSet<String>>);

impl Delivering {
    /// Claims `id`; `None` while another copy holds it.
    fn claim(self: &Arc<Self>, id: &str) -> Option<DeliveringGuard> {
        let fresh = self
            .0
            .lock()
            .expect("delivering lock")
            .insert(id.to_owned());
        fresh.then(|| DeliveringGuard {
            set: self.clone(),
            id: id.to_owned(),
        })
    }
}

/// Releases its id when dropped.
struct DeliveringGuard {
    set: Arc<Delivering>,
    id: String,
}

impl Drop for DeliveringGuard {
    fn drop(&mut self) {
        self.set.0.lock().expect("delivering lock").remove(&self.id);
    }
}

impl Delivery {
    /// A provider's error text as the log and `last_error` may show it:
    /// with its addresses and phone numbers replaced unless
    /// `logging.log_addresses` is on.
    pub(crate) fn loggable<'a>(&self, text: &'a str) -> std::borrow::Cow<'a, str> {
        if self.log_addresses {
            std::borrow::Cow::Borrowed(text)
        } else {
            crate::providers::without_addresses(text)
        }
    }

    /// While this process's delivery writes fail: how long a poller waits
    /// before receiving again (100 ms after the first failure, doubling to
    /// [`MAX_ERROR_BACKOFF`]); the next write that commits ends the pause.
    fn store_trouble_pause(&self) -> Option<Duration> {
        let failures = self.store_trouble.count();
        if failures == 0 {
            return None;
        }
        let pause = Duration::from_millis(100).saturating_mul(1 << (failures - 1).min(10));
        let pause = pause.min(MAX_ERROR_BACKOFF);
        warn!(failures, pause_ms = pause.as_millis() as u64, reason = %self.store_trouble.failing().unwrap_or_default(), "Delivery writes fail; pausing before receiving more.");
        Some(pause)
    }

    /// The provider `message` goes to: its channel's in its world.
    pub fn provider_for(&self, message: &crate::message::DeliveryPayload) -> &GatedProvider {
        self.providers
            .get(message.channel, World::of_test(message.test))
    }
}

/// Each channel's gated provider pool in each world: the live world's are
/// the configured providers, the test world's the simulated ones (each with
/// a gate of its own, see [`crate::providers::simulated`]). One pool per
/// channel and world, checked when it is built.
#[derive(Clone)]
pub struct ChannelProviders {
    pools: Vec<(Channel, World, GatedProvider)>,
}

impl ChannelProviders {
    /// `pools` must hold one pool for each channel in each world.
    pub fn new(pools: Vec<(Channel, World, GatedProvider)>) -> anyhow::Result<Self> {
        for channel in Channel::ALL.iter().copied() {
            for world in [World::Live, World::Test] {
                let count = pools
                    .iter()
                    .filter(|(c, w, _)| *c == channel && *w == world)
                    .count();
                anyhow::ensure!(
                    count == 1,
                    "{count} provider pools for {channel} in the {world:?} world (one needed)"
                );
            }
        }
        Ok(ChannelProviders { pools })
    }

    /// `channel`'s pool in `world`.
    pub fn get(&self, channel: Channel, world: World) -> &GatedProvider {
        self.pools
            .iter()
            .find(|(c, w, _)| *c == channel && *w == world)
            .map(|(_, _, pool)| pool)
            .expect("ChannelProviders::new checked every channel and world")
    }

    /// Each channel's live pool, with its channel.
    pub fn live(&self) -> Vec<(Channel, GatedProvider)> {
        self.pools
            .iter()
            .filter(|(_, world, _)| *world == World::Live)
            .map(|(channel, _, pool)| (*channel, pool.clone()))
            .collect()
    }
}

/// Per tenant of one lane: messages in flight (waiting for a provider token
/// or being sent) and messages parked until one of those finishes.
///
/// A tenant at its plan's `max_in_flight` gives way without crowding others
/// out: its further messages are parked here, outside the shared buffer,
/// whose slot they give back at once, so the poller fetches other tenants'
/// messages meanwhile. When one of the tenant's messages finishes, its place
/// passes straight to the tenant's best parked message (highest priority,
/// then oldest). Parking is bounded: while `max_parked` messages are
/// parked, the poller receives nothing more (a place frees at the rate the
/// parked tenants' messages finish), so nothing is put back and received
/// again in a loop.
struct TenantSlots {
    state: Mutex<SlotState>,
    /// Parked messages whose tenant got a place back, for the dispatcher.
    resume: mpsc::UnboundedSender<Resumed>,
    /// Parked messages at which the poller stops receiving.
    max_parked: usize,
    /// Rung when a parked message leaves, for a poller waiting for room.
    room: Notify,
    /// For the `parked` gauge's label.
    lane: Lane,
}

/// Whose places a message takes: its tenant's, in its world. A tenant's
/// test messages have places of their own, so test sends stuck at the
/// simulated provider never hold its live sends back.
type SlotKey = (String, World);

#[derive(Default)]
struct SlotState {
    in_flight: HashMap<SlotKey, u32>,
    /// Each tenant world's cap as of its last admission.
    caps: HashMap<SlotKey, u32>,
    parked: HashMap<SlotKey, TieredQueue>,
    parked_total: usize,
}

/// A tenant's parked messages: one FIFO per priority rank, each message with
/// its count in the `parked` gauge and when it was parked.
#[derive(Default)]
struct TieredQueue([std::collections::VecDeque<Parked>; 3]);

struct Parked {
    message: ReceivedMessage,
    _gauge: GaugeHold,
    since: Instant,
    /// When its lease was last set (received, or renewed while parked).
    leased_at: Instant,
}

impl TieredQueue {
    fn is_empty(&self) -> bool {
        self.0.iter().all(std::collections::VecDeque::is_empty)
    }

    fn pop(&mut self) -> Option<Parked> {
        self.0
            .iter_mut()
            .find_map(std::collections::VecDeque::pop_front)
    }
}

/// A tenant's place among the in-flight messages; released on drop.
struct TenantSlot {
    slots: Arc<TenantSlots>,
    key: SlotKey,
}

/// What the dispatcher does with a message it took from the buffer.
enum Admission {
    /// The tenant had room: process it now.
    Run(ReceivedMessage, TenantSlot),
    /// The tenant is at its cap; the message waits for one of its places.
    Parked,
}

/// A parked message handed back with its tenant's place, and how long it
/// was parked.
type Resumed = (ReceivedMessage, TenantSlot, Duration);

impl TenantSlots {
    fn new(lane: Lane, max_parked: usize) -> (Arc<Self>, mpsc::UnboundedReceiver<Resumed>) {
        let (resume, resumed) = mpsc::unbounded_channel();
        let slots = Arc::new(TenantSlots {
            state: Mutex::default(),
            resume,
            max_parked,
            room: Notify::new(),
            lane,
        });
        (slots, resumed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes a place for the message's tenant unless it already has `cap`
    /// in flight; then parks the message.
    fn admit(self: &Arc<Self>, message: ReceivedMessage, cap: u32) -> Admission {
        let mut state = self.lock();
        let key: SlotKey = (message.tenant_id.clone(), World::of_test(message.test));
        if state.caps.get(&key) != Some(&cap) {
            state.caps.insert(key.clone(), cap);
        }
        let count = state.in_flight.entry(key.clone()).or_insert(0);
        if *count < cap {
            *count += 1;
            return Admission::Run(
                message,
                TenantSlot {
                    slots: self.clone(),
                    key,
                },
            );
        }
        state.parked_total += 1;
        let rank = message.priority.rank();
        let gauge = GaugeHold::new(
            metrics::gauge!(names::MESSAGES_WAITING, "lane" => self.lane.as_str(), "priority" => message.priority.as_str(), "stage" => "parked"),
        );
        let now = Instant::now();
        state.parked.entry(key).or_default().0[rank].push_back(Parked {
            message,
            _gauge: gauge,
            since: now,
            leased_at: now,
        });
        Admission::Parked
    }

    /// Receipts of the parked messages whose lease was set `every` ago or
    /// longer, their lease counted as set now (the caller renews them).
    fn leases_to_renew(&self, every: Duration) -> Vec<String> {
        let mut state = self.lock();
        let now = Instant::now();
        let mut due = Vec::new();
        for parked in state
            .parked
            .values_mut()
            .flat_map(|queue| queue.0.iter_mut().flatten())
        {
            if now.duration_since(parked.leased_at) >= every {
                parked.leased_at = now;
                due.push(parked.message.receipt.clone());
            }
        }
        due
    }

    /// Drops the parked messages of `receipts`: their leases are lost (the
    /// queue handed them to another consumer), so they are not this
    /// consumer's to send any more.
    fn forget_parked(&self, receipts: &HashSet<String>) -> usize {
        let mut state = self.lock();
        let mut forgotten = 0;
        state.parked.retain(|_, queue| {
            for tier in &mut queue.0 {
                let before = tier.len();
                tier.retain(|parked| !receipts.contains(&parked.message.receipt));
                forgotten += before - tier.len();
            }
            !queue.is_empty()
        });
        state.parked_total -= forgotten;
        drop(state);
        if forgotten > 0 {
            self.room.notify_waiters();
        }
        forgotten
    }

    /// Waits while `max_parked` or more messages are parked; then returns
    /// how many more may be parked. The poller receives no more than that,
    /// so under one tenant's backlog it takes one message per place freed
    /// and another tenant's message is never more than one receive away.
    async fn wait_for_room(&self) -> usize {
        loop {
            let freed = self.room.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            let parked = self.lock().parked_total;
            if parked < self.max_parked {
                return self.max_parked - parked;
            }
            freed.await;
        }
    }

    /// How many more messages may be parked now (0 at the bound).
    fn room_now(&self) -> usize {
        self.max_parked.saturating_sub(self.lock().parked_total)
    }

    /// The tenants with a world at its cap: a message of theirs received
    /// now might be parked. A queue tells tenants apart, not worlds, so a
    /// tenant is left in the queue while either of its worlds is full: the
    /// parking stays bounded, at the cost of its other world's messages
    /// waiting for a place rather than being looked past to.
    fn capped(&self) -> HashSet<String> {
        let state = self.lock();
        state
            .in_flight
            .iter()
            .filter(|(key, count)| state.caps.get(*key).is_some_and(|cap| *count >= cap))
            .map(|((tenant, _), _)| tenant.clone())
            .collect()
    }

    /// Removes every parked message (shutdown returns them to the queue).
    fn drain_parked(&self) -> Vec<ReceivedMessage> {
        let mut state = self.lock();
        state.parked_total = 0;
        let parked: Vec<ReceivedMessage> = state
            .parked
            .drain()
            .flat_map(|(_, queue)| queue.0.into_iter().flatten())
            .map(|parked| parked.message)
            .collect();
        self.room.notify_waiters();
        parked
    }
}

impl Drop for TenantSlot {
    fn drop(&mut self) {
        let mut state = self.slots.lock();
        // The place passes to the tenant's best parked message, if any.
        let next = match state.parked.get_mut(&self.key) {
            Some(queue) => {
                let next = queue.pop();
                if queue.is_empty() {
                    state.parked.remove(&self.key);
                }
                next
            }
            None => None,
        };
        if let Some(parked) = next {
            state.parked_total -= 1;
            drop(state);
            self.slots.room.notify_waiters();
            let slot = TenantSlot {
                slots: self.slots.clone(),
                key: self.key.clone(),
            };
            // If the dispatcher is gone (shutdown), the message is dropped
            // with its slot and comes back after its visibility timeout.
            let _ = self
                .slots
                .resume
                .send((parked.message, slot, parked.since.elapsed()));
            return;
        }
        if let Some(count) = state.in_flight.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                state.in_flight.remove(&self.key);
                state.caps.remove(&self.key);
            }
        }
    }
}

/// One lane's consumer.
pub struct LaneConsumer {
    lane: Lane,
    settings: LaneSettings,
    delivery: Delivery,
    buffer: TieredBuffer<ReceivedMessage>,
    /// Provider calls in progress at once; taken after the provider token.
    workers: Arc<Semaphore>,
    tenants: Arc<TenantSlots>,
    /// Parked messages handed back with a tenant place; read by the dispatcher.
    resumed: Mutex<Option<mpsc::UnboundedReceiver<Resumed>>>,
    /// Dedicated tenants' consumer permits, taken by attention workers.
    attention_permits: attention::ConsumerPermits,
}

impl LaneConsumer {
    pub fn new(lane: Lane, settings: LaneSettings, delivery: Delivery) -> Arc<Self> {
        // Room for every worker plus two receive batches waiting behind them,
        // so the next batch is fetched while the previous one is still there.
        let capacity = settings.concurrency + 2 * delivery.queue.max_batch();
        let (tenants, resumed) = TenantSlots::new(lane, capacity);
        Arc::new(LaneConsumer {
            lane,
            workers: Arc::new(Semaphore::new(settings.concurrency)),
            buffer: TieredBuffer::new(capacity),
            tenants,
            resumed: Mutex::new(Some(resumed)),
            attention_permits: attention::ConsumerPermits::default(),
            settings,
            delivery,
        })
    }

    /// Runs poller and dispatcher until `shutdown` turns true, then returns
    /// buffered and parked messages to the queue at once and waits (up to
    /// the grace period) for messages in flight.
    pub async fn run(self: Arc<Self>, shutdown: watch::Receiver<bool>) {
        let lane = self.lane;
        let (deletes, delete_rx) = mpsc::channel(1024);
        let deleter = tokio::spawn(process::run_deleter(
            self.delivery.queue.clone(),
            lane,
            delete_rx,
        ));
        let poller = tokio::spawn(self.clone().poll(shutdown.clone()));
        let keeper = tokio::spawn(self.clone().keep_parked_leased(shutdown.clone()));
        let mut attention_workers = JoinSet::new();
        if let Some(attention) = self.delivery.tenant_queues.attention_queue(lane) {
            for _ in 0..self.delivery.consumers.attention_workers {
                attention_workers.spawn(attention::run_worker(
                    self.clone(),
                    attention.clone(),
                    shutdown.clone(),
                ));
            }
            attention_workers.spawn(attention::run_sweeper(self.clone(), shutdown.clone()));
        }
        let mut running = JoinSet::new();
        self.dispatch(shutdown, &deletes, &mut running).await;
        let _ = poller.await;
        let _ = keeper.await;
        self.delivery.queue.release_prefetched(lane).await;

        let mut held = self.buffer.drain();
        held.extend(self.tenants.drain_parked());
        if let Some(resumed) = self.resumed.lock().expect("resumed lock").as_mut() {
            while let Ok((message, _slot, _)) = resumed.try_recv() {
                held.push(message);
            }
        }
        if !held.is_empty() {
            process::return_now(self.delivery.queue.as_ref(), lane, &held).await;
            info!(lane = %lane, returned = held.len(), "Buffered messages returned to the queue.");
        }
        let grace = Duration::from_secs(self.delivery.consumers.shutdown_grace_secs);
        let drained = tokio::time::timeout(grace, async {
            while running.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            warn!(lane = %lane, unfinished = running.len(), "Grace period over; abandoning sends still in flight (they will be redelivered).");
            running.abort_all();
        }
        // Attention workers end their slices at shutdown: the message in
        // hand finishes (within the grace period), the rest goes back.
        let grace = Duration::from_secs(self.delivery.consumers.shutdown_grace_secs);
        if tokio::time::timeout(grace, async {
            while attention_workers.join_next().await.is_some() {}
        })
        .await
        .is_err()
        {
            attention_workers.abort_all();
        }
        drop(deletes);
        let _ = deleter.await;
        info!(lane = %lane, "Lane consumer stopped.");
    }

    async fn poll(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let queue = self.delivery.queue.clone();
        let wait = Duration::from_secs(self.delivery.consumers.receive_wait_secs);
        let mut error_backoff = Duration::from_millis(100);
        loop {
            if *shutdown.borrow() {
                return;
            }
            if let Some(pause) = self.delivery.store_trouble_pause() {
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = shutdown.changed() => return,
                }
            }
            let slots = tokio::select! {
                slots = self.reserve_room(queue.as_ref()) => slots,
                _ = shutdown.changed() => return,
            };
            // The embedded receive is cancel-safe at its waiting points;
            // a shutdown during the long poll ends it without losing messages.
            let received = tokio::select! {
                received = queue.receive(self.lane, slots.len(), wait) => received,
                _ = shutdown.changed() => return,
            };
            match received {
                Ok(mut messages) => {
                    error_backoff = Duration::from_millis(100);
                    if !messages.is_empty() {
                        process::look_up(&self.delivery, &mut messages).await;
                    }
                    for (message, slot) in messages.into_iter().zip(slots) {
                        let priority = message.priority;
                        self.buffer.push(message, priority, slot);
                    }
                }
                Err(err) => {
                    warn!(lane = %self.lane, error = %err, backoff_ms = error_backoff.as_millis() as u64, "Receive failed; backing off.");
                    drop(slots);
                    tokio::select! {
                        _ = tokio::time::sleep(error_backoff) => {}
                        _ = shutdown.changed() => return,
                    }
                    error_backoff = (error_backoff * 2).min(MAX_ERROR_BACKOFF);
                }
            }
        }
    }

    /// Keeps the leases of parked messages: every third of the visibility
    /// timeout, those whose lease is that old get a fresh one, in batches.
    /// A tenant at its cap for longer than the visibility timeout (its
    /// messages in flight held up by a provider outage, say) would
    /// otherwise lose its parked messages' leases to other instances, which
    /// park them in turn, and each such hand-over spent a receive: issue
    /// 67's long run dead-lettered healthy messages so. A parked message
    /// whose receipt the queue no longer knows is dropped here (another
    /// consumer has it); one whose renewal failed with the store is tried
    /// again at the next round.
    async fn keep_parked_leased(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let visibility = Duration::from_secs(self.settings.visibility_timeout_secs);
        let every = visibility / 3;
        let queue = self.delivery.queue.clone();
        loop {
            tokio::select! {
                () = tokio::time::sleep(every) => {}
                _ = shutdown.changed() => return,
            }
            let due = self.tenants.leases_to_renew(every);
            let mut lost = HashSet::new();
            for chunk in due.chunks(queue.max_batch()) {
                let changes: Vec<(String, Duration)> = chunk
                    .iter()
                    .map(|receipt| (receipt.clone(), visibility))
                    .collect();
                match queue.change_visibility_batch(self.lane, &changes).await {
                    Ok(results) => lost.extend(
                        chunk
                            .iter()
                            .zip(results)
                            .filter(|(_, result)| result.is_err())
                            .map(|(receipt, _)| receipt.clone()),
                    ),
                    Err(err) => {
                        warn!(lane = %self.lane, error = %format!("{err:#}"), count = chunk.len(), "Could not renew the leases of parked messages; trying again at the next round.");
                    }
                }
            }
            if !lost.is_empty() {
                let forgotten = self.tenants.forget_parked(&lost);
                info!(lane = %self.lane, forgotten, "Parked messages whose leases another consumer holds now were dropped here.");
            }
        }
    }

    /// Buffer slots for the next receive, once a message may be parked.
    /// At the parking bound (a tenant's backlog waits behind its cap) the
    /// lane does not wait for one of its places to free before taking
    /// another tenant's message: on a queue that can leave the capped
    /// tenants' messages where they are, such a message is received as it
    /// arrives and goes straight to the gate's line, where the tenant's
    /// turn puts it ahead of the backlog.
    async fn reserve_room(&self, queue: &dyn LaneQueue) -> Vec<buffer::Slot> {
        // The queue's arrival count when the last look past the capped
        // tenants found nothing, and when: the next look waits for
        // something new, and at least SKIP_SPACING after that one, so
        // neither freed places nor a busy queue's commits each cost the
        // store writer a look.
        let mut found_nothing: Option<(u64, Instant)> = None;
        loop {
            let room = self.tenants.room_now();
            if room > 0 {
                return self.buffer.reserve(room.min(queue.max_batch())).await;
            }
            let arrived = queue.arrivals_so_far(self.lane);
            let new_since = found_nothing.is_none_or(|(count, _)| count != arrived);
            if new_since && self.buffer.available() > 0 {
                match queue
                    .receive_skipping(self.lane, 1, self.tenants.capped())
                    .await
                {
                    Ok(mut messages) if !messages.is_empty() => {
                        process::look_up(&self.delivery, &mut messages).await;
                        let slots = self.buffer.reserve(messages.len()).await;
                        for (message, slot) in messages.into_iter().zip(slots) {
                            let priority = message.priority;
                            self.buffer.push(message, priority, slot);
                        }
                        continue;
                    }
                    Ok(_) => found_nothing = Some((arrived, Instant::now())),
                    Err(err) => {
                        warn!(lane = %self.lane, error = %err, "Receive of other tenants' messages failed; waiting for a place instead.");
                        self.tenants.wait_for_room().await;
                        continue;
                    }
                }
            }
            tokio::select! {
                _ = self.tenants.wait_for_room() => {}
                () = async {
                    // Something arrived during the look: look again, spaced.
                    if queue.arrivals_so_far(self.lane) == arrived {
                        queue.arrival(self.lane).await;
                    }
                    if let Some((_, at)) = found_nothing {
                        tokio::time::sleep_until((at + SKIP_SPACING).into()).await;
                    }
                } => {}
            }
        }
    }

    /// Starts every buffered message at once: it takes its tenant's place
    /// (or is parked), then waits for a provider token in the gate's line,
    /// where the highest priority and the tenant whose turn it is go first.
    /// A worker is taken only once the token is there, for the call itself.
    async fn dispatch(
        self: &Arc<Self>,
        mut shutdown: watch::Receiver<bool>,
        deletes: &mpsc::Sender<String>,
        running: &mut JoinSet<()>,
    ) {
        let mut resumed = self
            .resumed
            .lock()
            .expect("resumed lock")
            .take()
            .expect("dispatch runs once");
        loop {
            let (message, tenant_slot, buffer_slot, parked_for) = tokio::select! {
                biased;
                _ = shutdown.changed() => break,
                Some((mut message, slot, parked_for)) = resumed.recv() => {
                    // A long wait makes the suppression list read at
                    // receive too old to trust: it is read again.
                    if parked_for >= LOOKED_UP_FRESH_FOR {
                        message.suppressed_at_receive = None;
                    }
                    (message, Some(slot), None, parked_for)
                }
                (message, slot) = self.buffer.pop() => (message, None, Some(slot), Duration::ZERO),
            };
            while running.try_join_next().is_some() {}
            let context = process::Context {
                lane: self.lane,
                settings: self.settings.clone(),
                delivery: self.delivery.clone(),
                deletes: deletes.clone(),
                shutdown: shutdown.clone(),
                workers: self.workers.clone(),
            };
            let admission = match tenant_slot {
                Some(slot) => Admission::Run(message, slot),
                None => {
                    let cap = self
                        .delivery
                        .registry
                        .tenant(&message.tenant_id)
                        .and_then(|tenant| self.delivery.registry.plan(&tenant.plan))
                        .map_or(u32::MAX, |plan| plan.max_in_flight);
                    self.tenants.admit(message, cap)
                }
            };
            match admission {
                Admission::Run(message, tenant_slot) => {
                    running.spawn(async move {
                        process::renew_if_parked_long(&context, &message, parked_for).await;
                        process::deliver(&context, message).await;
                        drop(tenant_slot);
                        drop(buffer_slot);
                    });
                }
                // The buffer slot is given back now (dropped here).
                Admission::Parked => {}
            }
        }
        *self.resumed.lock().expect("resumed lock") = Some(resumed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn received(tenant: &str, id: &str, priority: crate::model::Priority) -> ReceivedMessage {
        ReceivedMessage {
            receipt: format!("{id}:1"),
            message_id: id.to_owned(),
            tenant_id: tenant.to_owned(),
            channel: Channel::Sms,
            priority,
            body: String::new(),
            receive_count: 1,
            enqueued_at_ms: 0,
            status_at_receive: None,
            suppressed_at_receive: None,
            test: false,
        }
    }

    #[test]
    fn a_tenant_at_its_cap_parks_messages_and_its_freed_place_goes_to_the_best_parked_one() {
        use crate::model::Priority;
        let (slots, mut resumed) = TenantSlots::new(Lane::Fast, 10);
        let Admission::Run(_, running) = slots.admit(received("a", "a1", Priority::Low), 1) else {
            panic!("the first message runs");
        };
        assert!(matches!(
            slots.admit(received("a", "a2", Priority::Low), 1),
            Admission::Parked
        ));
        assert!(matches!(
            slots.admit(received("a", "a3", Priority::High), 1),
            Admission::Parked
        ));
        // Another tenant is not held up by the first one's parked messages.
        assert!(matches!(
            slots.admit(received("b", "b1", Priority::Low), 1),
            Admission::Run(..)
        ));
        assert!(resumed.try_recv().is_err());
        drop(running);
        let (next, place, _) = resumed.try_recv().expect("a parked message resumes");
        assert_eq!(next.message_id, "a3", "high before low");
        // The place passed on: the tenant is still at its cap.
        assert!(matches!(
            slots.admit(received("a", "a4", Priority::Low), 1),
            Admission::Parked
        ));
        drop(place);
        assert_eq!(resumed.try_recv().unwrap().0.message_id, "a2");
    }

    #[tokio::test]
    async fn the_poller_waits_while_parking_is_full() {
        use crate::model::Priority;
        let (slots, _resumed) = TenantSlots::new(Lane::Fast, 3);
        let Admission::Run(_, running) = slots.admit(received("a", "first", Priority::Normal), 1)
        else {
            panic!("the first message runs");
        };
        for n in 0..3 {
            let parked = slots.admit(received("a", &format!("p{n}"), Priority::Normal), 1);
            assert!(matches!(parked, Admission::Parked));
        }
        let waiting = tokio::time::timeout(Duration::from_millis(50), slots.wait_for_room()).await;
        assert!(waiting.is_err(), "no room while three are parked");
        drop(running);
        let room = tokio::time::timeout(Duration::from_millis(50), slots.wait_for_room()).await;
        assert!(room.is_ok(), "a resumed message makes room");
        assert_eq!(slots.drain_parked().len(), 2);
    }

    #[test]
    fn parked_messages_come_up_for_lease_renewal_and_lost_ones_are_dropped() {
        use crate::model::Priority;
        let (slots, mut resumed) = TenantSlots::new(Lane::Fast, 10);
        let Admission::Run(_, running) = slots.admit(received("a", "a1", Priority::Normal), 1)
        else {
            panic!("the first message runs");
        };
        for id in ["a2", "a3"] {
            assert!(matches!(
                slots.admit(received("a", id, Priority::Normal), 1),
                Admission::Parked
            ));
        }
        assert!(
            slots.leases_to_renew(Duration::from_secs(60)).is_empty(),
            "leases set just now are not due"
        );
        let mut due = slots.leases_to_renew(Duration::ZERO);
        due.sort();
        assert_eq!(due, ["a2:1", "a3:1"]);
        assert_eq!(slots.room_now(), 8);
        // a2's lease went to another consumer: it is not this one's to send.
        let lost = HashSet::from(["a2:1".to_owned()]);
        assert_eq!(slots.forget_parked(&lost), 1);
        assert_eq!(slots.room_now(), 9);
        drop(running);
        let (next, _place, _) = resumed.try_recv().expect("a3 takes a1's place");
        assert_eq!(next.message_id, "a3");
        assert!(slots.drain_parked().is_empty());
    }

    #[test]
    fn a_tenant_cannot_take_more_than_its_cap_and_gets_slots_back() {
        use crate::model::Priority;
        let (slots, mut resumed) = TenantSlots::new(Lane::Fast, 10);
        let admit = |tenant: &str, id: &str| slots.admit(received(tenant, id, Priority::Normal), 2);
        let (Admission::Run(_, a1), Admission::Run(_, _a2)) = (admit("a", "a1"), admit("a", "a2"))
        else {
            panic!("room for two");
        };
        assert!(matches!(admit("a", "a3"), Admission::Parked));
        assert!(matches!(admit("b", "b1"), Admission::Run(..)));
        drop(a1);
        let (next, _place, _) = resumed.try_recv().expect("a3 takes a1's place");
        assert_eq!(next.message_id, "a3");
        assert!(slots.drain_parked().is_empty());
    }
}
