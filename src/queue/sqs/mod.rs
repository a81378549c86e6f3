//! The SQS backend. SQS has no priorities, so each lane is three SQS
//! standard queues, one per priority class (`{prefix}-{lane}-high`,
//! `{prefix}-{lane}` for normal, `{prefix}-{lane}-low`), sharing the
//! dead-letter queue `{prefix}-{lane}-dlq` through their `RedrivePolicy`.
//! Its `maxReceiveCount` is the lane's `max_receive_count` plus
//! [`lanes::REDRIVE_MARGIN`]: the consumer moves a message received more
//! than `max_receive_count` times itself, with its status, so code above
//! [`LaneQueue`] sees the same semantics as with the embedded queue, and
//! SQS's move (which writes no status) is the backstop. Messages and their copies go to the
//! queue of their priority; receives serve the classes by the priority share
//! rule ([`receiver`]).
//!
//! Every message carries `MessageGroupId = tenant id` (SQS fair queues on
//! standard queues keep one tenant's backlog from delaying the others) and the
//! message attributes `tenant`, `channel`, `priority` and `message_id`. Copies
//! made by [`LaneQueue::defer`], [`LaneQueue::dead_letter`] and the redrive
//! also carry `enqueued_at_ms` (the first enqueue time, which SQS
//! would otherwise reset), and dead-letter copies `receive_count` (the
//! receives the message had in its lane).
//!
//! Batch APIs are used wherever SQS has them, in calls of at most ten entries
//! and 256 KiB, and every `Failed` entry is mapped back to its input. A batch
//! operation returns `Err` as a whole only when its first SQS call fails as a
//! whole, that is when nothing was done; after that, a failing call marks its
//! own entries `Err` and the remaining calls are still made.
//!
//! SQS dead-letters a message by its `ApproximateReceiveCount`, which every
//! receive raises. A deferral (rate limits, in-flight caps, paused tenants,
//! retry backoff) must not spend that budget, so [`LaneQueue::defer`] sends a
//! fresh copy with a delivery delay and deletes the received one.

mod batch;
pub mod check;
mod dedicated;
mod envelope;
pub mod lanes;
mod receiver;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use async_trait::async_trait;
use aws_sdk_sqs::Client;
use aws_sdk_sqs::config::interceptors::BeforeSerializationInterceptorContextRef;
use aws_sdk_sqs::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_sqs::error::BoxError;
use aws_sdk_sqs::types::{Message, MessageSystemAttributeName, QueueAttributeName};
use tracing::{info, warn};

use super::{
    DeadLetter, EntryResult, LaneQueue, OutboundMessage, QueueStats, ReceivedMessage,
    RedriveFilter, TenantQueues,
};
use crate::config::{LanesSettings, SqsSettings};
use crate::model::{Lane, Priority};
use crate::store::Db;
use batch::{
    MAX_BATCH_ENTRIES, by_class, ceil_secs, change_visibility, delete_receipts, release, sdk_error,
    send_envelopes,
};
use envelope::{Envelope, Parsed};
use lanes::{LaneQueues, count, open_lane, queue_attributes};
use receiver::{Receiver, split_receipt};

/// SQS limits, in seconds.
const MAX_DELAY_SECS: u64 = 900;
const MAX_WAIT_SECS: u64 = 20;
const MAX_VISIBILITY_SECS: u64 = 43_200;
/// How long DLQ messages stay hidden while a listing or redrive walks the
/// DLQ. Long enough to outlast the walk (so no message is seen twice); they
/// are made visible again as soon as the walk ends, so only a crash mid-walk
/// leaves them hidden this long.
const DLQ_SCAN_VISIBILITY_SECS: i32 = 30;
/// Long-poll wait of DLQ walks. A short poll samples only some SQS servers
/// and may answer empty while a small queue holds messages; a long poll asks
/// all of them and still returns as soon as something is found.
const DLQ_SCAN_WAIT_SECS: i32 = 1;

/// Counts the SQS operations a client starts (one per operation; SDK
/// retries of the same operation are not counted again), in total and in
/// the `fairlane_sqs_calls_total` metric by operation name.
#[derive(Debug)]
struct ApiCallCounter(Arc<AtomicU64>);

impl Intercept for ApiCallCounter {
    fn name(&self) -> &'static str {
        "fairlane.sqs.api_call_counter"
    }

    // Not `read_before_execution`: a client interceptor sees that before the
    // operation's metadata (its name) is in the config bag.
    fn read_before_serialization(
        &self,
        _context: &BeforeSerializationInterceptorContextRef<'_>,
        _components: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        let operation = cfg
            .load::<aws_smithy_runtime_api::client::orchestrator::Metadata>()
            .map(|metadata| metadata.name().to_owned())
            .unwrap_or_else(|| "unknown".to_owned());
        metrics::counter!(crate::metrics::SQS_CALLS_TOTAL, "operation" => operation).increment(1);
        Ok(())
    }
}

/// The lanes as SQS queues, through one SDK client; or, as a view made by
/// the lanes' queue, one dedicated tenant queue or one lane's attention
/// queue (then `fast` and `slow` are the same queues).
pub struct SqsQueue {
    client: Client,
    settings: SqsSettings,
    lanes: LanesSettings,
    fast: Arc<LaneQueues>,
    slow: Arc<LaneQueues>,
    /// Stashes and polls of each lane (fast, slow).
    receivers: [Arc<Receiver>; 2],
    /// SQS operations started by `client`, for cost measurements.
    api_calls: Arc<AtomicU64>,
    /// See [`LaneQueue::stats_interval`].
    stats_interval: Duration,
    batch_window: Duration,
    /// The last statistics of each lane (fast, slow) and when they were read.
    stats_cache: Mutex<[Option<(Instant, QueueStats)>; 2]>,
    /// Supplies `oldest_age_secs`, which SQS does not report.
    status_store: Option<Db>,
    /// In a view of a dedicated tenant queue: its tenant.
    tenant: Option<String>,
    /// In the lanes' queue: the dedicated tenant queues and the attention
    /// queues (`None` in views, and where the attention queues could not be
    /// opened).
    dedicated: Option<Arc<dedicated::Dedicated>>,
}

impl SqsQueue {
    /// Connects with the standard AWS credential chain, the region of
    /// `settings` and its endpoint override, with the SDK's default retries;
    /// then creates or looks up the lane queues (see
    /// [`SqsQueue::connect_with_client`]).
    pub async fn connect(settings: &SqsSettings, lanes: LanesSettings) -> anyhow::Result<SqsQueue> {
        let loader = crate::aws::loader(
            Some(&settings.region),
            settings.endpoint_url.as_deref(),
            settings.access_key_id.as_deref(),
            settings.secret_access_key.as_ref(),
        );
        let sdk_config = loader.load().await;
        Self::connect_with_client(Client::new(&sdk_config), settings, lanes).await
    }

    /// Uses `client` (its credentials, region, endpoint and retries) for the
    /// lane queues. With `settings.create_queues`, creates each lane's queue
    /// and DLQ and sets their attributes (also on queues that existed);
    /// otherwise looks them up and fails naming the first missing one.
    pub async fn connect_with_client(
        client: Client,
        settings: &SqsSettings,
        lanes: LanesSettings,
    ) -> anyhow::Result<SqsQueue> {
        let api_calls = Arc::new(AtomicU64::new(0));
        let client = Client::from_conf(
            client
                .config()
                .to_builder()
                .interceptor(ApiCallCounter(api_calls.clone()))
                // Bounds every call (the SDK sets only a connect timeout): a
                // connection that goes silent must not hang a request, the
                // sweeper or shutdown. Long enough for a 20 s long poll.
                .timeout_config(
                    aws_sdk_sqs::config::timeout::TimeoutConfig::builder()
                        .operation_attempt_timeout(Duration::from_secs(MAX_WAIT_SECS + 10))
                        .build(),
                )
                .build(),
        );
        let fast = Arc::new(open_lane(&client, settings, &lanes, Lane::Fast).await?);
        let slow = Arc::new(open_lane(&client, settings, &lanes, Lane::Slow).await?);
        info!(
            prefix = %settings.queue_prefix,
            fast = %fast.class(Priority::Normal).name,
            slow = %slow.class(Priority::Normal).name,
            "SQS lane queues ready (a high, a normal and a low queue per lane, and its DLQ)."
        );
        let receiver = |lane: Lane, queues: &LaneQueues| {
            let lane_settings = lanes.get(lane);
            Receiver::new(
                lane,
                client.clone(),
                std::array::from_fn(|rank| queues.classes[rank].url.clone()),
                lane_settings.low_priority_share,
                Duration::from_secs(lane_settings.visibility_timeout_secs),
                settings.look_ahead_messages,
            )
        };
        let receivers = [receiver(Lane::Fast, &fast), receiver(Lane::Slow, &slow)];
        let mut queue = SqsQueue {
            client,
            settings: settings.clone(),
            lanes,
            fast,
            slow,
            receivers,
            api_calls,
            stats_interval: Duration::from_secs(settings.stats_interval_secs.max(1)),
            batch_window: Duration::from_millis(settings.batch_window_ms),
            stats_cache: Mutex::new([None, None]),
            status_store: None,
            tenant: None,
            dedicated: None,
        };
        queue.dedicated = dedicated::Dedicated::open(&queue).await.map(Arc::new);
        Ok(queue)
    }

    /// A queue over `queues` alone, in `lane` (both lane slots), sharing
    /// this queue's client, settings and status store.
    fn view(&self, lane: Lane, queues: LaneQueues, tenant: Option<String>) -> SqsQueue {
        let queues = Arc::new(queues);
        let settings = self.lanes.get(lane);
        let receiver = Receiver::new(
            lane,
            self.client.clone(),
            std::array::from_fn(|rank| queues.classes[rank].url.clone()),
            settings.low_priority_share,
            Duration::from_secs(settings.visibility_timeout_secs),
            self.settings.look_ahead_messages,
        );
        SqsQueue {
            client: self.client.clone(),
            settings: self.settings.clone(),
            lanes: self.lanes.clone(),
            fast: queues.clone(),
            slow: queues,
            receivers: [receiver.clone(), receiver],
            api_calls: self.api_calls.clone(),
            stats_interval: self.stats_interval,
            batch_window: self.batch_window,
            stats_cache: Mutex::new([None, None]),
            status_store: self.status_store.clone(),
            tenant,
            dedicated: None,
        }
    }

    /// Takes the age of a lane's oldest message from the status store (SQS
    /// has no such attribute), with a partial index on the pending messages
    /// created for it if missing.
    pub async fn with_status_store(mut self, db: Db) -> anyhow::Result<SqsQueue> {
        db.index_pending()
            .await
            .context("creating the index of pending messages")?;
        self.status_store = Some(db);
        Ok(self)
    }

    async fn oldest_age_secs(&self, lane: Lane) -> anyhow::Result<Option<f64>> {
        let Some(db) = &self.status_store else {
            return Ok(None);
        };
        // A dedicated queue: the tenant's pending messages in the lane
        // (after a switch, some may wait in the shared lane instead).
        let oldest = db.oldest_pending(lane, self.tenant.as_deref()).await?;
        Ok(oldest.map(|created| (crate::model::now_ms() - created).max(0) as f64 / 1000.0))
    }

    /// Four GetQueueAttributes calls at once (the class queues and the
    /// DLQ) and the oldest age.
    async fn fetch_stats(&self, lane: Lane) -> anyhow::Result<QueueStats> {
        let queues = self.queues(lane);
        let names = [
            QueueAttributeName::ApproximateNumberOfMessages,
            QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
            QueueAttributeName::ApproximateNumberOfMessagesDelayed,
        ];
        let (high, normal, low, dead, oldest_age_secs) = tokio::try_join!(
            queue_attributes(&self.client, &queues.classes[0].url, &names),
            queue_attributes(&self.client, &queues.classes[1].url, &names),
            queue_attributes(&self.client, &queues.classes[2].url, &names),
            queue_attributes(&self.client, &queues.dlq_url, &names),
            self.oldest_age_secs(lane),
        )?;
        let classes = [high, normal, low];
        let sum = |name: QueueAttributeName| -> u64 {
            classes
                .iter()
                .map(|attributes| count(attributes, name.clone()))
                .sum()
        };
        let delayed = sum(QueueAttributeName::ApproximateNumberOfMessagesDelayed);
        Ok(QueueStats {
            depth: sum(QueueAttributeName::ApproximateNumberOfMessages) + delayed,
            // Stashed messages are received, hence counted here.
            in_flight: sum(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
            delayed,
            oldest_age_secs,
            dlq_depth: names.iter().map(|name| count(&dead, name.clone())).sum(),
            // SQS has nowhere to set messages aside: held tenants' messages
            // stay in depth and are put back by the consumer.
            held: 0,
        })
    }

    /// SQS operations this queue's client has started since connect (the
    /// connect's own included); SDK retries are not counted again.
    pub fn api_calls(&self) -> u64 {
        self.api_calls.load(Ordering::Relaxed)
    }

    fn queues(&self, lane: Lane) -> &LaneQueues {
        match lane {
            Lane::Fast => &self.fast,
            Lane::Slow => &self.slow,
        }
    }

    fn receiver(&self, lane: Lane) -> &Arc<Receiver> {
        &self.receivers[usize::from(lane == Lane::Slow)]
    }

    /// The class queue a handed-out receipt belongs to, and its SQS handle.
    fn receipt_queue<'r>(&self, lane: Lane, receipt: &'r str) -> anyhow::Result<(&str, &'r str)> {
        let (priority, raw) = split_receipt(receipt)
            .with_context(|| format!("{receipt:?} is not a receipt this queue handed out"))?;
        Ok((&self.queues(lane).class(priority).url, raw))
    }

    /// SendMessageBatch of `envelopes`, each to the queue of its class.
    async fn send_by_class(
        &self,
        lane: Lane,
        envelopes: &[Envelope<'_>],
    ) -> anyhow::Result<Vec<EntryResult>> {
        let queues = self.queues(lane);
        let classes: Vec<Option<usize>> = envelopes
            .iter()
            .map(|envelope| Some(envelope.priority.rank()))
            .collect();
        by_class(&classes, |rank, indexes| {
            let chosen: Vec<Envelope> = indexes.iter().map(|&i| envelopes[i].clone()).collect();
            let url = &queues.classes[rank].url;
            async move { send_envelopes(&self.client, url, &chosen).await }
        })
        .await
    }

    async fn send_copy(&self, url: &str, envelope: &Envelope<'_>) -> anyhow::Result<()> {
        let results = send_envelopes(&self.client, url, std::slice::from_ref(envelope)).await?;
        results
            .into_iter()
            .next()
            .unwrap_or(Err("no result".to_owned()))
            .map_err(anyhow::Error::msg)
    }

    async fn delete_received(&self, url: &str, receipt: &str) -> anyhow::Result<()> {
        self.client
            .delete_message()
            .queue_url(url)
            .receipt_handle(receipt)
            .send()
            .await
            .map_err(sdk_error)
            .context("DeleteMessage failed")?;
        Ok(())
    }

    /// One receive from `lane`'s DLQ, hiding what it returns for
    /// [`DLQ_SCAN_VISIBILITY_SECS`].
    /// Walks `lane`'s DLQ and deletes `tenant_id`'s dead letters (those in
    /// `wanted` only, when given); the others are made visible again. A
    /// walk covers the DLQ's approximate visible count at its start.
    /// Returns the ids deleted.
    async fn erase_dead(
        &self,
        lane: Lane,
        tenant_id: &str,
        wanted: Option<&HashSet<&str>>,
    ) -> anyhow::Result<Vec<String>> {
        let queues = self.queues(lane);
        let visible = self.dead_visible(lane).await?;
        let mut seen = HashSet::new();
        let mut kept = Vec::new();
        let mut erased = Vec::new();
        let outcome: anyhow::Result<()> = async {
            while (seen.len() as u64) < visible {
                let batch = self.receive_dead(lane, MAX_BATCH_ENTRIES).await?;
                let mut fresh = false;
                let mut doomed: Vec<(String, String)> = Vec::new();
                for message in &batch {
                    let Some(receipt) = message.receipt_handle() else {
                        continue;
                    };
                    fresh |= seen.insert(message.message_id().unwrap_or_default().to_owned());
                    let ours = Parsed::from_sqs(message).ok().filter(|p| {
                        p.tenant_id == tenant_id
                            && wanted.is_none_or(|ids| ids.contains(p.message_id.as_str()))
                    });
                    match ours {
                        Some(parsed) => doomed.push((receipt.to_owned(), parsed.message_id)),
                        None => kept.push(receipt.to_owned()),
                    }
                }
                if !doomed.is_empty() {
                    let receipts: Vec<&str> = doomed.iter().map(|(r, _)| r.as_str()).collect();
                    let results = delete_receipts(&self.client, &queues.dlq_url, &receipts).await?;
                    for ((_, id), result) in doomed.into_iter().zip(results) {
                        if result.is_ok() {
                            erased.push(id);
                        }
                    }
                }
                if !fresh {
                    break;
                }
            }
            Ok(())
        }
        .await;
        let refs: Vec<&str> = kept.iter().map(String::as_str).collect();
        if !refs.is_empty() {
            release(&self.client, &queues.dlq_url, &refs).await;
        }
        outcome?;
        Ok(erased)
    }

    async fn receive_dead(&self, lane: Lane, max: usize) -> anyhow::Result<Vec<Message>> {
        let output = self
            .client
            .receive_message()
            .queue_url(&self.queues(lane).dlq_url)
            .max_number_of_messages(max.clamp(1, MAX_BATCH_ENTRIES) as i32)
            .wait_time_seconds(DLQ_SCAN_WAIT_SECS)
            .visibility_timeout(DLQ_SCAN_VISIBILITY_SECS)
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .message_system_attribute_names(MessageSystemAttributeName::SentTimestamp)
            .message_attribute_names("All")
            .send()
            .await
            .map_err(sdk_error)
            .context("ReceiveMessage from the DLQ failed")?;
        Ok(output.messages.unwrap_or_default())
    }

    /// Visible messages in `lane`'s DLQ now: where a DLQ walk may stop
    /// without waiting for an empty long poll.
    async fn dead_visible(&self, lane: Lane) -> anyhow::Result<u64> {
        let attributes = queue_attributes(
            &self.client,
            &self.queues(lane).dlq_url,
            &[QueueAttributeName::ApproximateNumberOfMessages],
        )
        .await?;
        Ok(count(
            &attributes,
            QueueAttributeName::ApproximateNumberOfMessages,
        ))
    }

    /// Gives messages about to be redriven a fresh attempt budget in the
    /// status store, if there is one.
    async fn mark_requeued(&self, ids: &[String]) -> anyhow::Result<()> {
        if let Some(db) = &self.status_store {
            db.mark_requeued(ids, i64::MAX).await?;
        }
        Ok(())
    }

    /// Undoes [`SqsQueue::mark_requeued`] for messages that stayed in the DLQ.
    async fn restore_dead_lettered(&self, ids: &[String]) {
        if let (Some(db), false) = (&self.status_store, ids.is_empty())
            && let Err(err) = db.restore_dead_lettered(ids).await
        {
            warn!(error = %format!("{err:#}"), count = ids.len(), "Messages left in the DLQ could not be marked dead_lettered again; they show as queued.");
        }
    }

    /// Sends a copy of each matching dead letter to its class queue (after
    /// marking it requeued), deletes those sent from the DLQ, releases the
    /// others and adds the ids redriven to `redriven`.
    async fn redrive_batch(
        &self,
        lane: Lane,
        matching: &[Parsed],
        redriven: &mut Vec<String>,
    ) -> anyhow::Result<()> {
        let queues = self.queues(lane);
        let copies: Vec<Envelope> = matching
            .iter()
            .map(|p| Envelope {
                message_id: &p.message_id,
                tenant_id: &p.tenant_id,
                channel: p.channel,
                priority: p.priority,
                body: &p.body,
                delay: Duration::ZERO,
                enqueued_at_ms: Some(p.enqueued_at_ms),
                receive_count: None,
            })
            .collect();
        // Fresh attempt budget before the copies can be received.
        let ids: Vec<String> = matching.iter().map(|p| p.message_id.clone()).collect();
        self.mark_requeued(&ids).await?;
        let sent = match self.send_by_class(lane, &copies).await {
            Ok(sent) => sent,
            Err(err) => {
                self.restore_dead_lettered(&ids).await;
                return Err(err);
            }
        };
        let mut to_delete = Vec::new();
        let mut to_release = Vec::new();
        let mut unsent = Vec::new();
        for (parsed, result) in matching.iter().zip(sent) {
            match result {
                Ok(()) => {
                    to_delete.push(parsed.receipt.as_str());
                    redriven.push(parsed.message_id.clone());
                }
                Err(reason) => {
                    warn!(message_id = %parsed.message_id, %reason, "Could not redrive message; it stays in the DLQ.");
                    to_release.push(parsed.receipt.as_str());
                    unsent.push(parsed.message_id.clone());
                }
            }
        }
        self.restore_dead_lettered(&unsent).await;
        if !to_release.is_empty() {
            release(&self.client, &queues.dlq_url, &to_release).await;
        }
        if !to_delete.is_empty() {
            let deleted = delete_receipts(&self.client, &queues.dlq_url, &to_delete).await;
            let failed = deleted.map_or(to_delete.len(), |results| {
                results.iter().filter(|r| r.is_err()).count()
            });
            if failed > 0 {
                warn!(lane = %lane, failed, "Redriven messages could not be deleted from the DLQ; they will be redriven again later (the status store deduplicates).");
            }
        }
        Ok(())
    }

    /// Walks the DLQ, re-sending messages that match `filter` to their class
    /// queue in the lane and deleting them from the DLQ, and returning the
    /// others at the end.
    async fn redrive_by_receiving(
        &self,
        lane: Lane,
        filter: &RedriveFilter,
    ) -> anyhow::Result<Vec<String>> {
        let queues = self.queues(lane);
        let wanted_ids: Option<HashSet<&str>> = filter
            .message_ids
            .as_ref()
            .map(|ids| ids.iter().map(String::as_str).collect());
        let visible = self.dead_visible(lane).await?;
        let mut seen: HashSet<String> = HashSet::new();
        // SQS message id → latest receipt of messages left in the DLQ.
        let mut kept: HashMap<String, String> = HashMap::new();
        let mut redriven = Vec::new();
        let outcome: anyhow::Result<()> = async {
            while (seen.len() as u64) < visible {
                if wanted_ids
                    .as_ref()
                    .is_some_and(|ids| redriven.len() >= ids.len())
                {
                    break;
                }
                let batch = self.receive_dead(lane, MAX_BATCH_ENTRIES).await?;
                let mut fresh = false;
                let mut matching = Vec::new();
                for message in &batch {
                    let sqs_id = message.message_id().unwrap_or_default().to_owned();
                    let first_time = seen.insert(sqs_id.clone());
                    fresh |= first_time;
                    let parsed = Parsed::from_sqs(message);
                    // A message seen before is never re-sent: it matched and
                    // its delete failed, or it did not match.
                    let matches = first_time
                        && parsed.as_ref().is_ok_and(|p| {
                            filter.tenant_id.as_ref().is_none_or(|t| *t == p.tenant_id)
                                && wanted_ids
                                    .as_ref()
                                    .is_none_or(|ids| ids.contains(p.message_id.as_str()))
                        });
                    match parsed {
                        Ok(parsed) if matches => {
                            kept.remove(&sqs_id);
                            matching.push(parsed);
                        }
                        _ => {
                            if let Some(receipt) = message.receipt_handle() {
                                kept.insert(sqs_id, receipt.to_owned());
                            }
                        }
                    }
                }
                self.redrive_batch(lane, &matching, &mut redriven).await?;
                if !fresh {
                    break;
                }
            }
            Ok(())
        }
        .await;
        let receipts: Vec<&str> = kept.values().map(String::as_str).collect();
        if !receipts.is_empty() {
            release(&self.client, &queues.dlq_url, &receipts).await;
        }
        if redriven.is_empty() {
            outcome?;
        } else if let Err(err) = outcome {
            // Some were moved already: report them so their status is fixed.
            warn!(lane = %lane, error = %format!("{err:#}"), redriven = redriven.len(), "Redrive stopped early.");
        }
        Ok(redriven)
    }
}

#[async_trait]
impl LaneQueue for SqsQueue {
    /// The SQS queue of the message's class.
    fn trace_destination(&self, lane: Lane, priority: Priority) -> (&'static str, String) {
        ("aws_sqs", self.queues(lane).class(priority).name.clone())
    }

    /// Sends each message to the queue of its priority class, in
    /// SendMessageBatch calls of at most ten messages and 256 KiB (the
    /// classes at once). `Err` as a whole only when nothing was sent;
    /// otherwise one result per message.
    async fn send_batch(
        &self,
        lane: Lane,
        messages: Vec<OutboundMessage>,
    ) -> anyhow::Result<Vec<EntryResult>> {
        let envelopes: Vec<Envelope> = messages.iter().map(Envelope::of).collect();
        let Some(dedicated) = &self.dedicated else {
            return self.send_by_class(lane, &envelopes).await;
        };
        let mut groups: HashMap<&str, Vec<usize>> = HashMap::new();
        let mut shared = Vec::new();
        for (index, message) in messages.iter().enumerate() {
            if dedicated.is_dedicated(&message.tenant_id) {
                groups.entry(&message.tenant_id).or_default().push(index);
            } else {
                shared.push(index);
            }
        }
        if groups.is_empty() {
            return self.send_by_class(lane, &envelopes).await;
        }
        let mut results: Vec<Option<EntryResult>> = vec![None; envelopes.len()];
        if !shared.is_empty() {
            let chosen: Vec<Envelope> = shared.iter().map(|&i| envelopes[i].clone()).collect();
            let sent = match self.send_by_class(lane, &chosen).await {
                Ok(sent) => sent,
                Err(err) => vec![Err(format!("{err:#}")); shared.len()],
            };
            for (index, result) in shared.into_iter().zip(sent) {
                results[index] = Some(result);
            }
        }
        self.send_dedicated(dedicated, lane, &envelopes, groups, &mut results)
            .await;
        let results: Vec<EntryResult> = results
            .into_iter()
            .map(|result| result.unwrap_or(Err("not sent".to_owned())))
            .collect();
        if results.iter().all(Result::is_err) {
            let reason = results[0].clone().err().unwrap_or_default();
            anyhow::bail!("no message of the batch was sent: {reason}");
        }
        Ok(results)
    }

    /// Hands out up to `max` messages from the lane's class stashes, high
    /// first with the priority share rule, polling the class queues when
    /// the stashes are empty (see [`receiver`]). Cancel-safe: messages a
    /// dropped receive was waiting for stay stashed for the next one.
    ///
    /// Messages without fairlane's attributes are logged and left alone: the
    /// redrive policy moves them to the DLQ after its `maxReceiveCount`.
    async fn receive(
        &self,
        lane: Lane,
        max: usize,
        wait: Duration,
    ) -> anyhow::Result<Vec<ReceivedMessage>> {
        self.receiver(lane).receive(max, wait).await
    }

    /// Stashed messages of tenants not in `skip`; with none, polls further
    /// past the skipped tenants' messages for the next look (see
    /// [`receiver`]).
    async fn receive_skipping(
        &self,
        lane: Lane,
        max: usize,
        skip: HashSet<String>,
    ) -> anyhow::Result<Vec<ReceivedMessage>> {
        Ok(self.receiver(lane).receive_skipping(max, &skip).await)
    }

    /// A poll of the lane brought messages.
    async fn arrival(&self, lane: Lane) {
        self.receiver(lane).arrival().await;
    }

    fn arrivals_so_far(&self, lane: Lane) -> u64 {
        self.receiver(lane).arrivals()
    }

    /// DeleteMessageBatch per class queue (by the class the receipt
    /// carries), the classes at once.
    async fn delete_batch(
        &self,
        lane: Lane,
        receipts: &[String],
    ) -> anyhow::Result<Vec<EntryResult>> {
        let queues = self.queues(lane);
        let split: Vec<Option<(Priority, &str)>> = receipts
            .iter()
            .map(|receipt| split_receipt(receipt))
            .collect();
        let classes: Vec<Option<usize>> = split
            .iter()
            .map(|entry| entry.map(|(priority, _)| priority.rank()))
            .collect();
        let results = by_class(&classes, |rank, indexes| {
            let raw: Vec<&str> = indexes
                .iter()
                .filter_map(|&i| split[i].map(|(_, raw)| raw))
                .collect();
            let url = &queues.classes[rank].url;
            async move { delete_receipts(&self.client, url, &raw).await }
        })
        .await?;
        let deleted = results.iter().filter(|result| result.is_ok()).count() as u64;
        queues.deleted.fetch_add(deleted, Ordering::Relaxed);
        Ok(results)
    }

    async fn change_visibility_batch(
        &self,
        lane: Lane,
        changes: &[(String, Duration)],
    ) -> anyhow::Result<Vec<EntryResult>> {
        let queues = self.queues(lane);
        let split: Vec<Option<(Priority, &str, i32)>> = changes
            .iter()
            .map(|(receipt, visibility)| {
                split_receipt(receipt).map(|(priority, raw)| {
                    (priority, raw, ceil_secs(*visibility, MAX_VISIBILITY_SECS))
                })
            })
            .collect();
        let classes: Vec<Option<usize>> = split
            .iter()
            .map(|entry| entry.map(|(priority, _, _)| priority.rank()))
            .collect();
        by_class(&classes, |rank, indexes| {
            let secs: Vec<(&str, i32)> = indexes
                .iter()
                .filter_map(|&i| split[i].map(|(_, raw, secs)| (raw, secs)))
                .collect();
            let url = &queues.classes[rank].url;
            async move { change_visibility(&self.client, url, &secs).await }
        })
        .await
    }

    /// Sends a copy (same body, attributes, group id and first enqueue time)
    /// with `delay` (at most 900 s) to the queue of the message's class and,
    /// once that succeeded, deletes the
    /// received message, so the copy starts with a receive count of zero.
    /// If the delete fails, the message is delivered twice and the status
    /// store deduplicates; the deferral counts as done then (`Ok`), so
    /// that a caller that retries an `Err` never sends a second copy: an
    /// `Err` means nothing was sent.
    async fn defer(
        &self,
        lane: Lane,
        message: &ReceivedMessage,
        delay: Duration,
    ) -> anyhow::Result<()> {
        let (from, receipt) = self.receipt_queue(lane, &message.receipt)?;
        let to = &self.queues(lane).class(message.priority).url;
        self.send_copy(to, &Envelope::copy_of(message, delay))
            .await
            .context("could not send the deferred copy")?;
        if let Err(err) = self.delete_received(from, receipt).await {
            warn!(message_id = %message.message_id, error = %format!("{err:#}"), "The deferred copy was sent but the received message could not be deleted; it comes back after its visibility timeout and the status store settles it.");
        }
        Ok(())
    }

    /// Sends a copy to the lane's DLQ (shared by its class queues, with its lane receive count and
    /// first enqueue time), then deletes the received message. If the delete
    /// fails the message exists in both queues; the lane copy is delivered
    /// again and deduplicated by the status store.
    async fn dead_letter(&self, lane: Lane, message: &ReceivedMessage) -> anyhow::Result<()> {
        let (from, receipt) = self.receipt_queue(lane, &message.receipt)?;
        let mut envelope = Envelope::copy_of(message, Duration::ZERO);
        envelope.receive_count = Some(message.receive_count);
        self.send_copy(&self.queues(lane).dlq_url, &envelope)
            .await
            .context("could not send the message to the DLQ")?;
        self.delete_received(from, receipt)
            .await
            .context("the message was copied to the DLQ but could not be deleted from its lane")
    }

    /// Cached for a little less than `stats_interval_secs`, so the sampler
    /// that calls this at that interval gets fresh figures each time and
    /// other callers (admin, metrics) cost no extra SQS calls. The age of the
    /// oldest message comes from the status store when one was given
    /// ([`SqsQueue::with_status_store`]).
    async fn stats(&self, lane: Lane) -> anyhow::Result<QueueStats> {
        let slot = usize::from(lane == Lane::Slow);
        let fresh_for = self.stats_interval.mul_f64(0.8);
        if let Some((at, stats)) = &self.stats_cache.lock().expect("stats cache")[slot]
            && at.elapsed() < fresh_for
        {
            return Ok(stats.clone());
        }
        let stats = self.fetch_stats(lane).await?;
        self.stats_cache.lock().expect("stats cache")[slot] = Some((Instant::now(), stats.clone()));
        Ok(stats)
    }

    /// Receives up to `limit` visible DLQ messages (hidden for a few seconds
    /// meanwhile), then makes them visible again at once. SQS standard
    /// queues have no order, so "oldest first" sorts what was read by first
    /// enqueue time; with a DLQ deeper than `limit` it is an arbitrary
    /// subset. `receive_count` is the lane receive count recorded by
    /// `dead_letter`, or the redrive policy's `maxReceiveCount` for
    /// messages SQS moved (that is when it moves them).
    async fn list_dead_letters(&self, lane: Lane, limit: usize) -> anyhow::Result<Vec<DeadLetter>> {
        let queues = self.queues(lane);
        let visible = self.dead_visible(lane).await?;
        let mut seen = HashSet::new();
        let mut letters = Vec::new();
        let mut receipts = Vec::new();
        let outcome: anyhow::Result<()> = async {
            while letters.len() < limit && (seen.len() as u64) < visible {
                let batch = self.receive_dead(lane, limit - letters.len()).await?;
                let mut fresh = false;
                for message in &batch {
                    if let Some(receipt) = message.receipt_handle() {
                        receipts.push(receipt.to_owned());
                    }
                    if !seen.insert(message.message_id().unwrap_or_default().to_owned()) {
                        continue;
                    }
                    fresh = true;
                    match Parsed::from_sqs(message) {
                        Ok(parsed) => letters.push(DeadLetter {
                            receive_count: parsed
                                .lane_receive_count
                                .unwrap_or(lanes::redrive_receive_count(
                                    self.lanes.get(lane).max_receive_count,
                                )),
                            message_id: parsed.message_id,
                            tenant_id: parsed.tenant_id,
                            channel: parsed.channel,
                            priority: parsed.priority,
                            enqueued_at_ms: parsed.enqueued_at_ms,
                            body: parsed.body,
                        }),
                        Err(reason) => {
                            warn!(lane = %lane, sqs_message_id = message.message_id().unwrap_or_default(), %reason, "Skipping a dead letter fairlane did not write.");
                        }
                    }
                }
                if !fresh {
                    break;
                }
            }
            Ok(())
        }
        .await;
        let refs: Vec<&str> = receipts.iter().map(String::as_str).collect();
        if !refs.is_empty() {
            release(&self.client, &queues.dlq_url, &refs).await;
        }
        outcome?;
        letters.sort_by(|a, b| {
            (a.enqueued_at_ms, &a.message_id).cmp(&(b.enqueued_at_ms, &b.message_id))
        });
        Ok(letters)
    }

    /// Walks the DLQ: matching messages are re-sent to the queue of their
    /// class (by their `priority` attribute; fresh receive count) and
    /// deleted from the DLQ, the others made visible again. A walk covers
    /// the DLQ's approximate visible count at its start; messages
    /// dead-lettered meanwhile wait for the next redrive. Returns the ids
    /// redriven.
    ///
    /// Not StartMessageMoveTask: the DLQ is shared by the lane's three
    /// class queues, and a move task sends everything to one destination
    /// (or back to the queue SQS moved it from, which messages dead-lettered
    /// by fairlane itself do not have).
    async fn redrive(&self, lane: Lane, filter: &RedriveFilter) -> anyhow::Result<Vec<String>> {
        if filter.message_ids.as_ref().is_some_and(Vec::is_empty) {
            return Ok(Vec::new());
        }
        self.redrive_by_receiving(lane, filter).await
    }

    fn deleted_total(&self, lane: Lane) -> u64 {
        self.queues(lane).deleted.load(Ordering::Relaxed)
    }

    fn stats_interval(&self) -> Duration {
        self.stats_interval
    }

    fn api_calls(&self) -> Option<u64> {
        Some(SqsQueue::api_calls(self))
    }

    fn batch_window(&self) -> Duration {
        self.batch_window
    }

    /// Releases the lane's stashes; polls still in flight release what they
    /// bring (until the next receive).
    async fn release_prefetched(&self, lane: Lane) {
        self.receiver(lane).release_all().await;
    }

    async fn ping(&self) -> bool {
        queue_attributes(
            &self.client,
            &self.fast.class(Priority::Normal).url,
            &[QueueAttributeName::ApproximateNumberOfMessages],
        )
        .await
        .is_ok()
    }
}

#[async_trait]
impl TenantQueues for SqsQueue {
    fn has_dedicated_queues(&self) -> bool {
        self.dedicated.is_some()
    }

    /// SQS holds no set-aside or delayed rows of settled messages (a
    /// scheduled message waits in the outbox): only dead letters, in each
    /// lane's DLQ and the DLQs of the tenant's own queues.
    async fn erase_waiting(
        &self,
        tenant_id: &str,
        message_ids: Option<&[String]>,
    ) -> anyhow::Result<Vec<String>> {
        if message_ids.is_some_and(<[String]>::is_empty) {
            return Ok(Vec::new());
        }
        let wanted: Option<HashSet<&str>> =
            message_ids.map(|ids| ids.iter().map(String::as_str).collect());
        let mut erased = Vec::new();
        for lane in Lane::ALL.iter().copied() {
            erased.extend(self.erase_dead(lane, tenant_id, wanted.as_ref()).await?);
            if let Some(dedicated) = &self.dedicated
                && let Some(view) = self.tenant_view(dedicated, lane, tenant_id, false).await?
            {
                erased.extend(view.erase_dead(lane, tenant_id, wanted.as_ref()).await?);
            }
        }
        Ok(erased)
    }

    fn set_tenant_dedicated(&self, tenant_id: &str, dedicated: bool) {
        if let Some(queues) = &self.dedicated {
            queues.set(tenant_id, dedicated);
        }
    }

    async fn dedicated_queue(
        &self,
        lane: Lane,
        tenant_id: &str,
    ) -> anyhow::Result<Option<Arc<dyn LaneQueue>>> {
        let Some(dedicated) = &self.dedicated else {
            return Ok(None);
        };
        let view = self.tenant_view(dedicated, lane, tenant_id, false).await?;
        Ok(view.map(|view| view as Arc<dyn LaneQueue>))
    }

    fn attention_wanted(&self) -> bool {
        self.dedicated
            .as_ref()
            .is_some_and(|dedicated| dedicated.in_use())
    }

    fn attention_queue(&self, lane: Lane) -> Option<Arc<dyn LaneQueue>> {
        let dedicated = self.dedicated.as_ref()?;
        Some(dedicated.attention(lane).clone() as Arc<dyn LaneQueue>)
    }

    async fn settle_attention(&self, lane: Lane, tenant_id: &str) -> anyhow::Result<bool> {
        match &self.dedicated {
            Some(dedicated) => self.settle(dedicated, lane, tenant_id).await,
            None => Ok(false),
        }
    }

    async fn reconcile_attention(&self) -> anyhow::Result<usize> {
        match &self.dedicated {
            Some(dedicated) => self.reconcile(dedicated).await,
            None => Ok(0),
        }
    }

    async fn sweep_attention(&self, lane: Lane) -> anyhow::Result<usize> {
        match &self.dedicated {
            Some(dedicated) => self.sweep(dedicated, lane).await,
            None => Ok(0),
        }
    }

    /// Receives and deletes the receivable messages of the tenant's own
    /// queues (the caller marks them `cancelled`); delayed retries and
    /// messages in flight stay.
    async fn purge_dedicated(&self, tenant_id: &str) -> anyhow::Result<Vec<String>> {
        match &self.dedicated {
            Some(dedicated) => self.purge(dedicated, tenant_id).await,
            None => Ok(Vec::new()),
        }
    }

    fn purge_marks_cancelled(&self) -> bool {
        false
    }

    async fn dedicated_lanes(&self, tenant_id: &str) -> anyhow::Result<Vec<Lane>> {
        match &self.dedicated {
            Some(dedicated) => self.lanes_of(dedicated, tenant_id).await,
            None => Ok(Vec::new()),
        }
    }
}

#[cfg(test)]
mod tests;
