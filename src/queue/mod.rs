//! Lane queues with SQS semantics: named queues (one per lane plus a DLQ
//! each), batch send, long-poll receive, batch delete, visibility changes,
//! receive counts, redrive to the DLQ after `max_receive_count`, delivery
//! delays and depth statistics.
//!
//! Three backends implement [`LaneQueue`]: [`embedded::EmbeddedQueue`] (a
//! durable queue in the SQLite file, the default), [`postgres::PgLanes`]
//! (the lanes in the PostgreSQL store) and the SQS backend. Code
//! above this module does not care which one runs. Each also implements
//! [`TenantQueues`] on the same object: dedicated tenant queues and the
//! attention queues through which they are served, whose views are
//! [`LaneQueue`]s of their own.

pub mod embedded;
pub mod postgres;
pub mod priority;
pub mod sqs;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;
use utoipa::ToSchema;

use crate::model::{Channel, Lane, MessageStatus, Priority};

pub use crate::message::OutboundMessage;

/// The `last_error` of a message its queue dead-lettered because it was
/// received `max_receive_count` times and never deleted (its consumers
/// kept dying or overran the visibility timeout).
pub const RECEIVED_TOO_OFTEN: &str = "received max_receive_count times without being deleted";

/// A receipt the queue no longer knows: the message was received again
/// since (its lease ran out), or settled. What was asked of it cannot be
/// done, and trying again will not change that.
#[derive(Debug)]
pub struct StaleReceipt(pub String);

impl std::fmt::Display for StaleReceipt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "receipt {:?} is no longer valid", self.0)
    }
}

impl std::error::Error for StaleReceipt {}

/// A message handed to a consumer. It stays invisible to other receivers
/// until its visibility timeout ends or it is deleted.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedMessage {
    /// Opaque handle for delete and visibility changes; valid until the
    /// message is received again.
    pub receipt: String,
    pub message_id: String,
    pub tenant_id: String,
    pub channel: Channel,
    pub priority: Priority,
    pub body: String,
    /// How many times the message has been received, this time included.
    pub receive_count: u32,
    /// When the message was first enqueued (ms since epoch).
    pub enqueued_at_ms: i64,
    /// The message's status row as read in the receive's own transaction,
    /// where the backend shares the status store's file (embedded queue);
    /// elsewhere (SQS) as the consumer's poller read it for the whole
    /// receive at once (`None` until then, or when that read failed: the
    /// consumer then reads it itself).
    pub status_at_receive: Option<MessageStatus>,
    /// Whether the recipient was on the tenant's suppression list when the
    /// consumer's poller looked the receive up; `None`: not looked up (the
    /// consumer then reads it itself).
    pub suppressed_at_receive: Option<bool>,
    /// Sent with a test key, as the consumer's poller read it from the body
    /// when it looked the receive up (false until then): the world whose
    /// in-flight places the message takes.
    pub test: bool,
}

/// Point-in-time figures for one lane.
#[derive(Debug, Clone, Default, PartialEq, Serialize, ToSchema)]
pub struct QueueStats {
    /// Messages waiting (visible now or delayed), not counting in-flight ones.
    pub depth: u64,
    /// Received and not yet deleted or returned.
    pub in_flight: u64,
    /// Waiting for a delivery delay to pass (included in `depth`).
    pub delayed: u64,
    /// Age in seconds of the oldest message in the lane, if any.
    pub oldest_age_secs: Option<f64>,
    /// Messages in the lane's dead-letter queue.
    pub dlq_depth: u64,
    /// Messages of paused or disabled tenants set aside until the tenant
    /// resumes (embedded queue); not counted in `depth`.
    #[serde(default)]
    pub held: u64,
}

impl QueueStats {
    /// What the lane holds that is not yet delivered and competes for its
    /// drain: waiting (visible or delayed, scheduled included) and held by
    /// a consumer. This is what a lane's high-water mark bounds. Messages
    /// of paused tenants, set aside, are not counted: a paused tenant
    /// would otherwise close the lane to every other tenant.
    pub fn backlog(&self) -> u64 {
        self.depth.saturating_add(self.in_flight)
    }
}

/// A message in a dead-letter queue.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetter {
    pub message_id: String,
    pub tenant_id: String,
    pub channel: Channel,
    pub priority: Priority,
    pub receive_count: u32,
    pub enqueued_at_ms: i64,
    pub body: String,
}

/// Which dead letters to move back; `None` fields match everything.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RedriveFilter {
    pub tenant_id: Option<String>,
    pub message_ids: Option<Vec<String>>,
}

/// The outcome of one entry of a batch call: `Err` carries the reason.
pub type EntryResult = Result<(), String>;

#[async_trait]
pub trait LaneQueue: Send + Sync {
    /// Puts messages on `lane`; one result per message, in order.
    async fn send_batch(
        &self,
        lane: Lane,
        messages: Vec<OutboundMessage>,
    ) -> anyhow::Result<Vec<EntryResult>>;

    /// Receives up to `max` messages, waiting up to `wait` for the first one.
    async fn receive(
        &self,
        lane: Lane,
        max: usize,
        wait: Duration,
    ) -> anyhow::Result<Vec<ReceivedMessage>>;

    /// Receives at once (no wait) up to `max` messages of tenants not in
    /// `skip`, leaving theirs where they are. A backend that cannot choose
    /// (SQS hands out what it hands out) receives nothing.
    async fn receive_skipping(
        &self,
        _lane: Lane,
        _max: usize,
        _skip: HashSet<String>,
    ) -> anyhow::Result<Vec<ReceivedMessage>> {
        Ok(Vec::new())
    }

    /// Returns when something may have been put on `lane` (a send, a
    /// redrive, a message coming back); never on a backend that cannot
    /// tell. With [`LaneQueue::receive_skipping`], for a consumer whose
    /// parked messages are at their bound.
    async fn arrival(&self, _lane: Lane) {
        std::future::pending::<()>().await;
    }

    /// How many times [`LaneQueue::arrival`] has returned for `lane` so
    /// far (a count that changes when something may have arrived); 0 on a
    /// backend that cannot tell.
    fn arrivals_so_far(&self, _lane: Lane) -> u64 {
        0
    }

    /// Deletes received messages; one result per receipt, in order.
    async fn delete_batch(
        &self,
        lane: Lane,
        receipts: &[String],
    ) -> anyhow::Result<Vec<EntryResult>>;

    /// Sets the remaining invisibility of received messages (0 returns them
    /// to the queue at once).
    async fn change_visibility_batch(
        &self,
        lane: Lane,
        changes: &[(String, Duration)],
    ) -> anyhow::Result<Vec<EntryResult>>;

    /// Returns a received message to the lane, receivable again after
    /// `delay`, without the receive counting toward `max_receive_count`:
    /// for deferrals (tenant paused or at its in-flight cap, provider
    /// throttling, retry backoff) that must not dead-letter a healthy message.
    /// The consumer retries a deferral the queue could not take (see
    /// `consumer::process`); where a receipt gone stale in the meantime
    /// still lets the queue give back that receive (PostgreSQL lanes), a
    /// store outage that outlasted the lease does not count toward
    /// dead-lettering either. SQS and the embedded queue count it.
    async fn defer(
        &self,
        lane: Lane,
        message: &ReceivedMessage,
        delay: Duration,
    ) -> anyhow::Result<()>;

    /// Moves a received message to the lane's DLQ at once (SQS can only
    /// move a message by re-sending its content, hence the whole message).
    /// It writes no status: its one caller, the consumer's dead-lettering,
    /// calls it only once the store has recorded the message
    /// `dead_lettered`. A queue's own move by receive count writes the
    /// status itself, in the move's transaction.
    async fn dead_letter(&self, lane: Lane, message: &ReceivedMessage) -> anyhow::Result<()>;

    async fn stats(&self, lane: Lane) -> anyhow::Result<QueueStats>;

    /// Dead letters of `lane`, oldest first.
    async fn list_dead_letters(&self, lane: Lane, limit: usize) -> anyhow::Result<Vec<DeadLetter>>;

    /// Moves matching dead letters back to `lane`; returns their ids.
    async fn redrive(&self, lane: Lane, filter: &RedriveFilter) -> anyhow::Result<Vec<String>>;

    /// Messages this process has deleted from `lane` since it started; the
    /// backpressure estimator derives the drain rate from it.
    fn deleted_total(&self, lane: Lane) -> u64;

    /// True when the queue backend answers.
    async fn ping(&self) -> bool;

    /// How often [`LaneQueue::stats`] is worth calling: more often only
    /// returns cached figures.
    fn stats_interval(&self) -> Duration {
        Duration::from_secs(1)
    }

    /// API calls made to a remote queue service since start-up (what it
    /// bills), or `None` for the embedded queue.
    fn api_calls(&self) -> Option<u64> {
        None
    }

    /// How traces name where `lane`'s messages of `priority` wait
    /// (OpenTelemetry messaging conventions): `messaging.system` and
    /// `messaging.destination.name`. The embedded queue is fairlane's own
    /// system with the lane as destination.
    fn trace_destination(&self, lane: Lane, _priority: Priority) -> (&'static str, String) {
        ("fairlane", lane.as_str().to_owned())
    }

    /// Tells the queue whether a tenant's messages are held (tenant paused
    /// or disabled). A queue that can set them aside stops handing them out
    /// until the tenant is released, and then puts them back in line; the
    /// default does nothing, and consumers put such messages back for
    /// `hold_delay_secs` instead.
    async fn set_tenant_held(&self, _tenant_id: &str, _held: bool) -> anyhow::Result<()> {
        Ok(())
    }

    /// Per tenant, both lanes together: messages delayed (scheduled for
    /// later, or waiting for a retry) and messages set aside because the
    /// tenant is paused or disabled, as `(tenant, delayed, held)`; `None`
    /// where the backend cannot tell (SQS: its delays are SQS's, and
    /// consumers put a held tenant's messages back instead).
    async fn waiting_by_tenant(&self) -> anyhow::Result<Option<Vec<(String, i64, i64)>>> {
        Ok(None)
    }

    /// Gives back at once any messages of `lane` the backend received ahead
    /// of demand and has not handed out yet; the consumer calls it at
    /// shutdown once it has stopped receiving.
    async fn release_prefetched(&self, _lane: Lane) {}

    /// Most messages one receive, delete or visibility call takes: SQS's
    /// limit of ten by default. The embedded queue takes more, so each of
    /// its transactions carries more messages.
    fn max_batch(&self) -> usize {
        10
    }

    /// How long a caller batching deletes or sends waits for more entries.
    fn batch_window(&self) -> Duration {
        Duration::from_millis(5)
    }
}

/// A backend's dedicated tenant queues: a tenant's own queue in each lane,
/// served by attention workers through the lane's attention queue (one
/// entry per tenant queue that needs a slice of work), as against the
/// shared lanes of [`LaneQueue`]. Every backend implements it on the same
/// object as their lanes; the views it hands out (one tenant's queue, one
/// lane's attention queue) are [`LaneQueue`]s only.
#[async_trait]
pub trait TenantQueues: Send + Sync {
    /// True when this backend keeps dedicated tenant queues (a queue of a
    /// tenant's own, consumed by attention workers): always, but on SQS
    /// when the attention queues could not be opened.
    fn has_dedicated_queues(&self) -> bool;

    /// Routes `tenant_id`'s new messages to its own queue (`true`) or to
    /// its lane's shared queue. Messages already queued stay where they are
    /// and are delivered from there.
    fn set_tenant_dedicated(&self, tenant_id: &str, dedicated: bool);

    /// `tenant_id`'s own queue in `lane` as a queue of its own (its `lane`
    /// arguments then name only the lane's settings); `None` while the
    /// tenant has never had one in `lane`.
    async fn dedicated_queue(
        &self,
        lane: Lane,
        tenant_id: &str,
    ) -> anyhow::Result<Option<Arc<dyn LaneQueue>>>;

    /// `lane`'s attention queue: one entry per dedicated tenant queue that
    /// needs a slice of work, the tenant in `tenant_id`.
    fn attention_queue(&self, lane: Lane) -> Option<Arc<dyn LaneQueue>>;

    /// After a slice of `tenant_id`'s queue in `lane`: when rows remain, an
    /// attention entry waits for them, visible when the first of them can
    /// be received. Returns whether backlog remains.
    async fn settle_attention(&self, lane: Lane, tenant_id: &str) -> anyhow::Result<bool>;

    /// Signals attention for every dedicated tenant queue that has rows and
    /// no attention entry (after a restart, or a tenant resumed).
    async fn reconcile_attention(&self) -> anyhow::Result<usize>;

    /// Removes the messages waiting (not in flight) in `tenant_id`'s own
    /// queues, marks those not yet sent `cancelled`, and returns their ids.
    async fn purge_dedicated(&self, tenant_id: &str) -> anyhow::Result<Vec<String>>;

    /// Whether [`TenantQueues::purge_dedicated`] marks what it removed
    /// `cancelled` itself (with the status store in the same transaction);
    /// otherwise the caller does.
    fn purge_marks_cancelled(&self) -> bool {
        true
    }

    /// Removes for good the copies of `tenant_id`'s messages that wait
    /// where no consumer takes them soon: its dead letters, its set-aside
    /// messages and delayed rows of cancelled scheduled ones, in the lanes
    /// and its own queues; of `message_ids` only when given, else all of
    /// them (tenant deletion). Copies a consumer holds now are left to it.
    /// Retention and tenant deletion call it; returns the ids removed.
    async fn erase_waiting(
        &self,
        tenant_id: &str,
        message_ids: Option<&[String]>,
    ) -> anyhow::Result<Vec<String>>;

    /// The lanes in which `tenant_id` has a queue of its own.
    async fn dedicated_lanes(&self, tenant_id: &str) -> anyhow::Result<Vec<Lane>>;

    /// Whether attention workers should poll now. SQS: only once this
    /// instance knows a dedicated tenant or tenant queue, so a deployment
    /// without any pays for no attention long polls.
    fn attention_wanted(&self) -> bool {
        true
    }

    /// Called every `consumers.attention_sweep_secs` per lane: signals
    /// attention again for dedicated queues that were written or worked
    /// since the last sweep and still hold backlog, where attention entries
    /// are not exactly one per queue (SQS). Returns how many it signalled.
    async fn sweep_attention(&self, _lane: Lane) -> anyhow::Result<usize> {
        Ok(0)
    }
}
