//! Lane consumers: one per lane, in-process, started by `fairlane serve`.
//!
//! ```text
//! poller ──► TieredBuffer ──► dispatcher ──► process (one task per message)
//! long-poll,   high > normal    semaphore of      tenant check, provider gate,
//! batches ≤10  > low, bounded   `concurrency`,    provider call, outcome
//!                               tenant in-flight cap
//! ```
//!
//! The poller runs independently of processing and only receives as many
//! messages as the buffer has free slots; a slot comes back when the message
//! that took it is finished. The dispatcher starts each message as soon as a
//! worker slot frees, so one slow provider call never holds up the others.
//! A tenant at its plan's `max_in_flight` has further messages deferred back
//! to the queue (not counted as attempts), so no tenant can hold every slot.

pub mod buffer;
mod process;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tracing::{info, warn};

use crate::config::{ConsumerSettings, LaneSettings, RetrySettings};
use crate::limits::gate::ProviderGate;
use crate::model::{Channel, Lane};
use crate::providers::Provider;
use crate::queue::{LaneQueue, ReceivedMessage};
use crate::store::Db;
use crate::store::status::StatusWriter;
use crate::tenants::Registry;
use buffer::TieredBuffer;

/// Most messages one receive asks for (SQS's batch limit).
pub const RECEIVE_BATCH: usize = 10;

/// Longest pause after failed receives.
const MAX_ERROR_BACKOFF: Duration = Duration::from_secs(10);

/// A provider with the gate that paces it.
#[derive(Clone)]
pub struct GatedProvider {
    pub provider: Arc<dyn Provider>,
    pub gate: Arc<ProviderGate>,
}

/// What every lane's consumer shares.
#[derive(Clone)]
pub struct Delivery {
    pub db: Db,
    pub registry: Arc<Registry>,
    pub queue: Arc<dyn LaneQueue>,
    pub email: GatedProvider,
    pub sms: GatedProvider,
    pub retry: RetrySettings,
    pub consumers: ConsumerSettings,
    /// Batches `sending`/`sent` status changes into shared transactions.
    pub status: StatusWriter,
    /// Ids of the messages being delivered by this process.
    pub delivering: Arc<Delivering>,
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
    pub fn provider(&self, channel: Channel) -> &GatedProvider {
        match channel {
            Channel::Email => &self.email,
            Channel::Sms => &self.sms,
        }
    }
}

/// Counts messages in flight per tenant for one lane.
#[derive(Debug, Default)]
struct TenantSlots {
    in_flight: Mutex<HashMap<String, u32>>,
}

/// A tenant's place among the in-flight messages; released on drop.
struct TenantSlot {
    slots: Arc<TenantSlots>,
    tenant_id: String,
}

impl TenantSlots {
    /// Takes a place for `tenant_id` unless it already has `cap` in flight.
    fn try_enter(self: &Arc<Self>, tenant_id: &str, cap: u32) -> Option<TenantSlot> {
        let mut in_flight = self.in_flight.lock().expect("tenant slots lock");
        let count = in_flight.entry(tenant_id.to_owned()).or_insert(0);
        if *count >= cap {
            return None;
        }
        *count += 1;
        Some(TenantSlot {
            slots: self.clone(),
            tenant_id: tenant_id.to_owned(),
        })
    }
}

impl Drop for TenantSlot {
    fn drop(&mut self) {
        let mut in_flight = self.slots.in_flight.lock().expect("tenant slots lock");
        if let Some(count) = in_flight.get_mut(&self.tenant_id) {
            *count -= 1;
            if *count == 0 {
                in_flight.remove(&self.tenant_id);
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
    workers: Arc<Semaphore>,
    tenants: Arc<TenantSlots>,
}

impl LaneConsumer {
    pub fn new(lane: Lane, settings: LaneSettings, delivery: Delivery) -> Arc<Self> {
        // Room for every worker plus two receive batches waiting behind them,
        // so the next batch is fetched while the previous one is still there.
        let capacity = settings.concurrency + 2 * RECEIVE_BATCH;
        Arc::new(LaneConsumer {
            lane,
            workers: Arc::new(Semaphore::new(settings.concurrency)),
            buffer: TieredBuffer::new(capacity),
            tenants: Arc::new(TenantSlots::default()),
            settings,
            delivery,
        })
    }

    /// Runs poller and dispatcher until `shutdown` turns true, then returns
    /// buffered messages to the queue at once and waits (up to the grace
    /// period) for messages in flight.
    pub async fn run(self: Arc<Self>, shutdown: watch::Receiver<bool>) {
        let lane = self.lane;
        let (deletes, delete_rx) = mpsc::channel(1024);
        let deleter = tokio::spawn(process::run_deleter(
            self.delivery.queue.clone(),
            lane,
            delete_rx,
        ));
        let poller = tokio::spawn(self.clone().poll(shutdown.clone()));
        let mut running = JoinSet::new();
        self.dispatch(shutdown, &deletes, &mut running).await;
        let _ = poller.await;

        let buffered = self.buffer.drain();
        if !buffered.is_empty() {
            process::return_now(self.delivery.queue.as_ref(), lane, &buffered).await;
            info!(lane = %lane, returned = buffered.len(), "Buffered messages returned to the queue.");
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
            let slots = tokio::select! {
                slots = self.buffer.reserve(RECEIVE_BATCH) => slots,
                _ = shutdown.changed() => return,
            };
            // The embedded receive is cancel-safe at its waiting points;
            // a shutdown during the long poll ends it without losing messages.
            let received = tokio::select! {
                received = queue.receive(self.lane, slots.len(), wait) => received,
                _ = shutdown.changed() => return,
            };
            match received {
                Ok(messages) => {
                    error_backoff = Duration::from_millis(100);
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

    async fn dispatch(
        self: &Arc<Self>,
        mut shutdown: watch::Receiver<bool>,
        deletes: &mpsc::Sender<String>,
        running: &mut JoinSet<()>,
    ) {
        loop {
            // Take a worker first, then the best message: a high-priority
            // message that arrives while all workers are busy is next.
            let worker = tokio::select! {
                worker = self.workers.clone().acquire_owned() => worker.expect("worker semaphore is never closed"),
                _ = shutdown.changed() => return,
            };
            let (message, slot) = tokio::select! {
                entry = self.buffer.pop() => entry,
                _ = shutdown.changed() => return,
            };
            while running.try_join_next().is_some() {}
            let cap = self
                .delivery
                .registry
                .tenant(&message.tenant_id)
                .and_then(|tenant| self.delivery.registry.plan(&tenant.plan))
                .map_or(u32::MAX, |plan| plan.max_in_flight);
            let tenant_slot = self.tenants.try_enter(&message.tenant_id, cap);
            let context = process::Context {
                lane: self.lane,
                settings: self.settings.clone(),
                delivery: self.delivery.clone(),
                deletes: deletes.clone(),
                shutdown: shutdown.clone(),
            };
            running.spawn(async move {
                match tenant_slot {
                    Some(tenant_slot) => {
                        // `deliver` gives the worker back as soon as the
                        // provider has answered; recording the outcome
                        // does not hold up the next send.
                        process::deliver(&context, message, worker).await;
                        drop(tenant_slot);
                    }
                    None => {
                        process::defer_for_tenant_cap(&context, message).await;
                        drop(worker);
                    }
                }
                drop(slot);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_cannot_take_more_than_its_cap_and_gets_slots_back() {
        let slots = Arc::new(TenantSlots::default());
        let a1 = slots.try_enter("a", 2).unwrap();
        let _a2 = slots.try_enter("a", 2).unwrap();
        assert!(slots.try_enter("a", 2).is_none());
        assert!(slots.try_enter("b", 2).is_some());
        drop(a1);
        assert!(slots.try_enter("a", 2).is_some());
    }
}
