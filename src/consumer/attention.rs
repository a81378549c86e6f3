//! Attention workers: consume dedicated tenant queues on demand.
//!
//! A dedicated tenant's messages wait in a queue of its own, and each write
//! to it also leaves an entry for the tenant on its lane's attention queue
//! (at most one waits per tenant). A few workers per lane long-poll that
//! queue. For each entry a worker checks the tenant (deleted, paused or
//! disabled: the entry is dropped, and nothing polls the tenant's queue;
//! resuming signals it again), takes one of the tenant's consumer permits
//! (`max_concurrent_consumers`; none free: the entry is dropped, because
//! the worker holding one signals again when its slice ends), then works a
//! slice of the queue: at most `slice_max_messages` messages or
//! `slice_max_secs`, one message at a time, through the same delivery as
//! the lane consumer (provider gates, retries, DLQ). When the slice ends it
//! removes its entry and, if backlog remains, leaves a new one behind the
//! other tenants' entries, so a huge backlog gets turns like everybody
//! else instead of the workers.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tracing::{debug, warn};

use super::{LaneConsumer, MAX_ERROR_BACKOFF, process};
use crate::metrics as names;
use crate::model::{Lane, TenantStatus};
use crate::queue::{LaneQueue, ReceivedMessage};

/// What this process's attention workers of one lane keep per dedicated
/// tenant: its consumer permits (with the limit they were made for: a
/// changed limit gets a fresh semaphore), when its last slice started, and
/// whether its queue is known to hold backlog.
#[derive(Default)]
pub(super) struct ConsumerPermits {
    permits: Mutex<HashMap<String, (u32, Arc<Semaphore>)>>,
    /// Tenant → start of its last slice here (ms since epoch).
    slice_started: Mutex<HashMap<String, i64>>,
    /// Tenants signalled and not yet found empty: the
    /// `fairlane_dedicated_queues_backlogged` gauge.
    backlogged: Mutex<HashSet<String>>,
}

impl ConsumerPermits {
    fn try_take(&self, tenant_id: &str, limit: u32) -> Option<OwnedSemaphorePermit> {
        let semaphore = {
            let mut permits = self.permits.lock().unwrap_or_else(PoisonError::into_inner);
            let entry = permits
                .entry(tenant_id.to_owned())
                .or_insert_with(|| (limit, Arc::new(Semaphore::new(limit as usize))));
            if entry.0 != limit {
                *entry = (limit, Arc::new(Semaphore::new(limit as usize)));
            }
            entry.1.clone()
        };
        semaphore.try_acquire_owned().ok()
    }

    /// True when a slice of `tenant_id` started here after a signal
    /// written at `signalled_at_ms`: that slice, or the signal its end
    /// leaves, covers whatever the signal was for.
    fn outdated(&self, tenant_id: &str, signalled_at_ms: i64) -> bool {
        self.slice_started
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(tenant_id)
            .is_some_and(|&started| started > signalled_at_ms)
    }

    fn slice_starts(&self, tenant_id: &str) {
        self.slice_started
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(tenant_id.to_owned(), crate::model::now_ms());
    }

    /// Records whether `tenant_id`'s queue holds backlog and sets the
    /// lane's gauge.
    fn set_backlogged(&self, lane: Lane, tenant_id: &str, backlog: bool) {
        let mut backlogged = self
            .backlogged
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if backlog {
            backlogged.insert(tenant_id.to_owned());
        } else {
            backlogged.remove(tenant_id);
        }
        metrics::gauge!(names::DEDICATED_QUEUES_BACKLOGGED, "lane" => lane.as_str())
            .set(backlogged.len() as f64);
    }
}

/// How often an attention worker with nothing to poll (no dedicated tenant
/// known) looks again.
const IDLE_RECHECK: Duration = Duration::from_secs(1);

/// Why a slice ended, as labelled in [`names::ATTENTION_SLICES_TOTAL`].
#[derive(Debug, Clone, Copy, PartialEq)]
enum SliceEnd {
    Empty,
    Messages,
    Time,
    Shutdown,
}

impl SliceEnd {
    fn as_str(self) -> &'static str {
        match self {
            SliceEnd::Empty => "empty",
            SliceEnd::Messages => "messages",
            SliceEnd::Time => "time",
            SliceEnd::Shutdown => "shutdown",
        }
    }
}

/// Runs one attention worker of `consumer`'s lane until shutdown.
pub(super) async fn run_worker(
    consumer: Arc<LaneConsumer>,
    attention: Arc<dyn LaneQueue>,
    mut shutdown: watch::Receiver<bool>,
) {
    let lane = consumer.lane;
    let wait = Duration::from_secs(consumer.delivery.consumers.receive_wait_secs);
    let mut error_backoff = Duration::from_millis(100);
    loop {
        if *shutdown.borrow() {
            return;
        }
        if !consumer.delivery.tenant_queues.attention_wanted() {
            // No dedicated tenant known yet: look again in a second.
            tokio::select! {
                _ = tokio::time::sleep(IDLE_RECHECK) => continue,
                _ = shutdown.changed() => return,
            }
        }
        let received = tokio::select! {
            received = attention.receive(lane, 1, wait) => received,
            _ = shutdown.changed() => return,
        };
        match received {
            Ok(signals) => {
                error_backoff = Duration::from_millis(100);
                for signal in signals {
                    handle(&consumer, attention.as_ref(), signal, &shutdown).await;
                }
            }
            Err(err) => {
                warn!(lane = %lane, error = %err, "Attention receive failed; backing off.");
                tokio::select! {
                    _ = tokio::time::sleep(error_backoff) => {}
                    _ = shutdown.changed() => return,
                }
                error_backoff = (error_backoff * 2).min(MAX_ERROR_BACKOFF);
            }
        }
    }
}

fn count_signal(lane: Lane, event: &'static str) {
    metrics::counter!(names::ATTENTION_SIGNALS_TOTAL, "lane" => lane.as_str(), "event" => event)
        .increment(1);
}

/// Acts on one attention entry: drop it, or work a slice and settle.
async fn handle(
    consumer: &Arc<LaneConsumer>,
    attention: &dyn LaneQueue,
    signal: ReceivedMessage,
    shutdown: &watch::Receiver<bool>,
) {
    let lane = consumer.lane;
    let tenant_id = signal.tenant_id.clone();
    let delivery = &consumer.delivery;
    let tenant = delivery.registry.tenant_fresh(&tenant_id).await;
    let drop_reason = match &tenant {
        None => Some("deleted"),
        Some(tenant) if tenant.status != TenantStatus::Active => Some("held"),
        Some(_) => None,
    };
    let book = &consumer.attention_permits;
    if drop_reason == Some("deleted") {
        book.set_backlogged(lane, &tenant_id, false);
    } else if drop_reason.is_some() {
        // Held: its queue keeps its backlog, and nothing polls it.
        book.set_backlogged(lane, &tenant_id, true);
    }
    let drop_reason = drop_reason.or_else(|| {
        book.outdated(&tenant_id, signal.enqueued_at_ms)
            .then_some("outdated")
    });
    if let Some(reason) = drop_reason {
        debug!(lane = %lane, tenant = %tenant_id, reason, "Attention signal dropped.");
        count_signal(lane, "dropped");
        let _ = attention.delete_batch(lane, &[signal.receipt]).await;
        return;
    }
    let limit = tenant.map_or(1, |tenant| tenant.max_concurrent_consumers.max(1));
    let Some(permit) = book.try_take(&tenant_id, limit) else {
        // Every permit is held; the holder signals again when it is done.
        count_signal(lane, "dropped");
        let _ = attention.delete_batch(lane, &[signal.receipt]).await;
        return;
    };
    count_signal(lane, "consumed");
    book.set_backlogged(lane, &tenant_id, true);
    let queue = match delivery
        .tenant_queues
        .dedicated_queue(lane, &tenant_id)
        .await
    {
        Ok(Some(queue)) => queue,
        Ok(None) => {
            book.set_backlogged(lane, &tenant_id, false);
            let _ = attention.delete_batch(lane, &[signal.receipt]).await;
            return;
        }
        Err(err) => {
            // The signal comes back after its visibility timeout.
            warn!(lane = %lane, tenant = %tenant_id, error = %format!("{err:#}"), "Could not open a dedicated queue; its signal is tried again later.");
            return;
        }
    };
    book.slice_starts(&tenant_id);
    let ended = work_slice(consumer, queue, shutdown).await;
    metrics::counter!(names::ATTENTION_SLICES_TOTAL, "lane" => lane.as_str(), "ended" => ended.as_str())
        .increment(1);
    // The entry goes first, then the backlog is looked at: a message
    // written meanwhile either saw the entry (and is found now) or did not
    // (and left a new one).
    if let Err(err) = attention.delete_batch(lane, &[signal.receipt]).await {
        warn!(lane = %lane, tenant = %tenant_id, error = %err, "Could not remove an attention signal; it comes back after its visibility timeout.");
    }
    // The permit goes before the new signal is left: a worker that takes
    // that signal at once finds the permit free, rather than dropping the
    // signal and leaving the backlog to the attention sweep.
    drop(permit);
    match delivery
        .tenant_queues
        .settle_attention(lane, &tenant_id)
        .await
    {
        Ok(backlog) => book.set_backlogged(lane, &tenant_id, backlog),
        Err(err) => {
            warn!(lane = %lane, tenant = %tenant_id, error = %format!("{err:#}"), "Could not signal a dedicated queue's remaining backlog; the attention sweep or the next start finds it.");
        }
    }
}

/// Works one slice of a dedicated queue: one message at a time until the
/// queue has nothing receivable, the slice's message count or time is
/// used up, or shutdown.
async fn work_slice(
    consumer: &Arc<LaneConsumer>,
    queue: Arc<dyn LaneQueue>,
    shutdown: &watch::Receiver<bool>,
) -> SliceEnd {
    let lane = consumer.lane;
    let settings = &consumer.delivery.consumers;
    let started = Instant::now();
    let budget = Duration::from_secs(settings.slice_max_secs);
    let max = settings.slice_max_messages.max(1);
    let (deletes, delete_rx) = mpsc::channel(64);
    let deleter = tokio::spawn(process::run_deleter(queue.clone(), lane, delete_rx));
    let mut delivery = consumer.delivery.clone();
    delivery.queue = queue.clone();
    let context = process::Context {
        lane,
        settings: consumer.settings.clone(),
        delivery,
        deletes,
        shutdown: shutdown.clone(),
        workers: consumer.workers.clone(),
    };
    let mut done = 0;
    let ended = loop {
        if *shutdown.borrow() {
            break SliceEnd::Shutdown;
        }
        if done >= max {
            break SliceEnd::Messages;
        }
        if started.elapsed() >= budget {
            break SliceEnd::Time;
        }
        if context.delivery.store_trouble.count() > 0 {
            // The store cannot record deliveries: end the slice; the sweep
            // or a later signal brings the queue back.
            break SliceEnd::Empty;
        }
        let want = (max - done).min(queue.max_batch());
        let messages = match queue.receive(lane, want, Duration::ZERO).await {
            Ok(messages) if messages.is_empty() => break SliceEnd::Empty,
            Ok(mut messages) => {
                process::look_up(&context.delivery, &mut messages).await;
                messages
            }
            Err(err) => {
                warn!(lane = %lane, error = %err, "Receive from a dedicated queue failed; ending the slice.");
                break SliceEnd::Empty;
            }
        };
        let mut left = messages.into_iter();
        for message in left.by_ref() {
            process::deliver(&context, message).await;
            done += 1;
            if *shutdown.borrow() || started.elapsed() >= budget {
                break;
            }
        }
        // What the slice received and did not start goes back at once.
        let rest: Vec<ReceivedMessage> = left.collect();
        if !rest.is_empty() {
            process::return_now(queue.as_ref(), lane, &rest).await;
        }
    };
    drop(context);
    let _ = deleter.await;
    // Whatever a receive fetched ahead for this queue goes back too.
    queue.release_prefetched(lane).await;
    ended
}

/// Runs `consumer`'s lane's attention sweep every
/// `consumers.attention_sweep_secs` until shutdown (see
/// [`crate::queue::TenantQueues::sweep_attention`]).
pub(super) async fn run_sweeper(consumer: Arc<LaneConsumer>, mut shutdown: watch::Receiver<bool>) {
    let lane = consumer.lane;
    let every = Duration::from_secs(consumer.delivery.consumers.attention_sweep_secs.max(1));
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shutdown.changed() => return,
        }
        if *shutdown.borrow() {
            return;
        }
        match consumer.delivery.tenant_queues.sweep_attention(lane).await {
            Ok(0) => {}
            Ok(signalled) => {
                debug!(lane = %lane, signalled, "Attention sweep signalled dedicated queues with backlog.")
            }
            Err(err) => {
                warn!(lane = %lane, error = %format!("{err:#}"), "Attention sweep failed; trying again at the next one.")
            }
        }
    }
}
