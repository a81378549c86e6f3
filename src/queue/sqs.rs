//! The SQS backend: each lane is an SQS standard queue `{prefix}-{lane}` with
//! a dead-letter queue `{prefix}-{lane}-dlq`, bound by a `RedrivePolicy` of
//! the lane's `max_receive_count`, so code above [`LaneQueue`] sees the same
//! semantics as with the embedded queue.
//!
//! Every message carries `MessageGroupId = tenant id` (SQS fair queues on
//! standard queues keep one tenant's backlog from delaying the others) and the
//! message attributes `tenant`, `channel`, `priority` and `message_id`. Copies
//! made by [`LaneQueue::defer`], [`LaneQueue::dead_letter`] and the redrive
//! fallback also carry `enqueued_at_ms` (the first enqueue time, which SQS
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

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow};
use async_trait::async_trait;
use aws_sdk_sqs::Client;
use aws_sdk_sqs::config::interceptors::BeforeSerializationInterceptorContextRef;
use aws_sdk_sqs::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_sqs::error::{BoxError, DisplayErrorContext, SdkError};
use aws_sdk_sqs::types::{
    BatchResultErrorEntry, ChangeMessageVisibilityBatchRequestEntry,
    DeleteMessageBatchRequestEntry, Message, MessageAttributeValue, MessageSystemAttributeName,
    QueueAttributeName, SendMessageBatchRequestEntry,
};
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use super::{
    DeadLetter, EntryResult, LaneQueue, OutboundMessage, QueueStats, ReceivedMessage, RedriveFilter,
};
use crate::config::{LanesSettings, SqsSettings};
use crate::model::{Channel, Lane, Priority};
use crate::store::Db;

/// Most entries SQS takes in one batch call.
const MAX_BATCH_ENTRIES: usize = 10;
/// Most bytes (bodies and attributes) of one SendMessageBatch. SQS has taken
/// up to 1 MiB since 2025; 256 KiB keeps older SQS-compatible servers working
/// and costs extra calls only for unusually large messages.
const MAX_BATCH_BYTES: usize = 256 * 1024;
/// SQS limits, in seconds.
const MAX_DELAY_SECS: u64 = 900;
const MAX_WAIT_SECS: u64 = 20;
const MAX_VISIBILITY_SECS: u64 = 43_200;
/// Lane messages and dead letters are kept as long as SQS allows (14 days).
const MAX_RETENTION_SECS: u32 = 1_209_600;
/// How long DLQ messages stay hidden while a listing or redrive walks the
/// DLQ. Long enough to outlast the walk (so no message is seen twice); they
/// are made visible again as soon as the walk ends, so only a crash mid-walk
/// leaves them hidden this long.
const DLQ_SCAN_VISIBILITY_SECS: i32 = 30;
/// Long-poll wait of DLQ walks. A short poll samples only some SQS servers
/// and may answer empty while a small queue holds messages; a long poll asks
/// all of them and still returns as soon as something is found.
const DLQ_SCAN_WAIT_SECS: i32 = 1;
/// Ids listed before a StartMessageMoveTask redrive, so the caller can mark
/// them requeued; a deeper DLQ is moved completely, but only this many ids
/// are returned.
const MOVE_TASK_ID_LIMIT: usize = 1000;

/// Message attribute names.
const ATTR_TENANT: &str = "tenant";
const ATTR_CHANNEL: &str = "channel";
const ATTR_PRIORITY: &str = "priority";
const ATTR_MESSAGE_ID: &str = "message_id";
const ATTR_ENQUEUED_AT: &str = "enqueued_at_ms";
const ATTR_RECEIVE_COUNT: &str = "receive_count";

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

/// The SQS queues of one lane.
#[derive(Debug)]
struct LaneQueues {
    url: String,
    arn: String,
    dlq_url: String,
    /// Source of StartMessageMoveTask.
    dlq_arn: String,
    /// Messages deleted through [`LaneQueue::delete_batch`], for the drain
    /// rate estimate.
    deleted: AtomicU64,
}

/// The lanes as SQS queues, through one SDK client.
pub struct SqsQueue {
    client: Client,
    lanes: LanesSettings,
    fast: LaneQueues,
    slow: LaneQueues,
    /// SQS operations started by `client`, for cost measurements.
    api_calls: Arc<AtomicU64>,
    /// See [`LaneQueue::stats_interval`].
    stats_interval: Duration,
    batch_window: Duration,
    /// The last statistics of each lane (fast, slow) and when they were read.
    stats_cache: Mutex<[Option<(Instant, QueueStats)>; 2]>,
    /// Supplies `oldest_age_secs`, which SQS does not report.
    status_store: Option<Db>,
}

/// What is sent for one message: the message itself or a copy of one.
#[derive(Debug)]
struct Envelope<'a> {
    message_id: &'a str,
    tenant_id: &'a str,
    channel: Channel,
    priority: Priority,
    body: &'a str,
    delay: Duration,
    /// Set on copies, so the first enqueue time survives.
    enqueued_at_ms: Option<i64>,
    /// Set on dead-letter copies: receives in the lane.
    receive_count: Option<u32>,
}

impl<'a> Envelope<'a> {
    fn of(message: &'a OutboundMessage) -> Self {
        Envelope {
            message_id: &message.message_id,
            tenant_id: &message.tenant_id,
            channel: message.channel,
            priority: message.priority,
            body: &message.body,
            delay: message.delay,
            enqueued_at_ms: None,
            receive_count: None,
        }
    }

    fn copy_of(message: &'a ReceivedMessage, delay: Duration) -> Self {
        Envelope {
            message_id: &message.message_id,
            tenant_id: &message.tenant_id,
            channel: message.channel,
            priority: message.priority,
            body: &message.body,
            delay,
            enqueued_at_ms: Some(message.enqueued_at_ms),
            receive_count: None,
        }
    }

    fn attributes(&self) -> Vec<(&'static str, &'static str, String)> {
        let mut attributes = vec![
            (ATTR_TENANT, "String", self.tenant_id.to_owned()),
            (ATTR_CHANNEL, "String", self.channel.as_str().to_owned()),
            (ATTR_PRIORITY, "String", self.priority.as_str().to_owned()),
            (ATTR_MESSAGE_ID, "String", self.message_id.to_owned()),
        ];
        if let Some(at) = self.enqueued_at_ms {
            attributes.push((ATTR_ENQUEUED_AT, "Number", at.to_string()));
        }
        if let Some(count) = self.receive_count {
            attributes.push((ATTR_RECEIVE_COUNT, "Number", count.to_string()));
        }
        attributes
    }

    /// Bytes SQS counts toward the batch size limit.
    fn size(&self) -> usize {
        self.body.len()
            + self
                .attributes()
                .iter()
                .map(|(name, kind, value)| name.len() + kind.len() + value.len())
                .sum::<usize>()
    }

    fn entry(&self, id: usize) -> anyhow::Result<SendMessageBatchRequestEntry> {
        let mut entry = SendMessageBatchRequestEntry::builder()
            .id(id.to_string())
            .message_body(self.body)
            .message_group_id(self.tenant_id)
            .delay_seconds(ceil_secs(self.delay, MAX_DELAY_SECS));
        for (name, kind, value) in self.attributes() {
            entry = entry.message_attributes(
                name,
                MessageAttributeValue::builder()
                    .data_type(kind)
                    .string_value(value)
                    .build()?,
            );
        }
        Ok(entry.build()?)
    }
}

/// A queue message read back: our attributes and the SQS system attributes.
#[derive(Debug)]
struct Parsed {
    message_id: String,
    tenant_id: String,
    channel: Channel,
    priority: Priority,
    body: String,
    receipt: String,
    /// SQS's ApproximateReceiveCount.
    receive_count: u32,
    enqueued_at_ms: i64,
    /// The `receive_count` attribute of dead-letter copies.
    lane_receive_count: Option<u32>,
}

impl Parsed {
    fn from_sqs(message: &Message) -> Result<Self, String> {
        let attribute = |name: &str| {
            message
                .message_attributes()
                .and_then(|attributes| attributes.get(name))
                .and_then(|value| value.string_value())
                .ok_or_else(|| format!("message attribute {name:?} is missing"))
        };
        let system = |name: MessageSystemAttributeName| {
            message
                .attributes()
                .and_then(|attributes| attributes.get(&name))
                .map(String::as_str)
        };
        let sent_at: Option<i64> =
            system(MessageSystemAttributeName::SentTimestamp).and_then(|v| v.parse().ok());
        let enqueued_at_ms = match attribute(ATTR_ENQUEUED_AT) {
            Ok(at) => at.parse().ok(),
            Err(_) => sent_at,
        };
        Ok(Parsed {
            message_id: attribute(ATTR_MESSAGE_ID)?.to_owned(),
            tenant_id: attribute(ATTR_TENANT)?.to_owned(),
            channel: attribute(ATTR_CHANNEL)?.parse()?,
            priority: attribute(ATTR_PRIORITY)?.parse()?,
            body: message.body().unwrap_or_default().to_owned(),
            receipt: message
                .receipt_handle()
                .ok_or("receipt handle is missing")?
                .to_owned(),
            receive_count: system(MessageSystemAttributeName::ApproximateReceiveCount)
                .and_then(|v| v.parse().ok())
                .unwrap_or(1),
            enqueued_at_ms: enqueued_at_ms.unwrap_or_default(),
            lane_receive_count: attribute(ATTR_RECEIVE_COUNT)
                .ok()
                .and_then(|v| v.parse().ok()),
        })
    }

    fn into_received(self) -> ReceivedMessage {
        ReceivedMessage {
            receipt: self.receipt,
            message_id: self.message_id,
            tenant_id: self.tenant_id,
            channel: self.channel,
            priority: self.priority,
            body: self.body,
            receive_count: self.receive_count,
            enqueued_at_ms: self.enqueued_at_ms,
        }
    }
}

/// Whole seconds of `duration`, rounded up (a delay is never shortened) and
/// capped at `max`.
fn ceil_secs(duration: Duration, max: u64) -> i32 {
    let secs = duration.as_secs() + u64::from(duration.subsec_nanos() > 0);
    secs.min(max) as i32
}

/// An SDK error with its whole chain (code and message of service errors).
fn sdk_error<E, R>(err: SdkError<E, R>) -> anyhow::Error
where
    E: std::error::Error + 'static,
    R: std::fmt::Debug,
{
    anyhow!("{}", DisplayErrorContext(&err))
}

fn batch_error_text(failed: &BatchResultErrorEntry) -> String {
    format!(
        "{}: {}",
        failed.code(),
        failed.message().unwrap_or("no message")
    )
}

/// Splits `0..len` into index ranges of at most [`MAX_BATCH_ENTRIES`].
fn chunks(len: usize) -> impl Iterator<Item = Range<usize>> {
    (0..len)
        .step_by(MAX_BATCH_ENTRIES)
        .map(move |start| start..(start + MAX_BATCH_ENTRIES).min(len))
}

/// Per-entry results of one batch call whose entry ids are `0..len`.
fn entry_results<'a>(
    len: usize,
    successful: impl IntoIterator<Item = &'a str>,
    failed: &[BatchResultErrorEntry],
) -> Vec<EntryResult> {
    let mut results = vec![Err("SQS did not report on this entry".to_owned()); len];
    for id in successful {
        if let Some(slot) = id.parse::<usize>().ok().and_then(|i| results.get_mut(i)) {
            *slot = Ok(());
        }
    }
    for failure in failed {
        if let Some(slot) = failure
            .id()
            .parse::<usize>()
            .ok()
            .and_then(|i| results.get_mut(i))
        {
            *slot = Err(batch_error_text(failure));
        }
    }
    results
}

/// Runs one batch operation as several SQS calls. A call that fails as a
/// whole ends the operation with `Err` if it was the first (nothing was
/// done); later, it marks its own entries `Err` and the others go on.
async fn run_batches<F, Fut>(
    ranges: Vec<Range<usize>>,
    mut call: F,
) -> anyhow::Result<Vec<EntryResult>>
where
    F: FnMut(Range<usize>) -> Fut,
    Fut: Future<Output = anyhow::Result<Vec<EntryResult>>>,
{
    let mut results = Vec::new();
    for (n, range) in ranges.into_iter().enumerate() {
        let len = range.len();
        match call(range).await {
            Ok(part) => results.extend(part),
            Err(err) if n == 0 => return Err(err),
            Err(err) => {
                let reason = format!("{err:#}");
                results.extend(std::iter::repeat_n(Err(reason), len));
            }
        }
    }
    Ok(results)
}

/// SendMessageBatch of `envelopes` to `url`, in calls of at most ten
/// entries and [`MAX_BATCH_BYTES`].
async fn send_envelopes(
    client: &Client,
    url: &str,
    envelopes: &[Envelope<'_>],
) -> anyhow::Result<Vec<EntryResult>> {
    let mut ranges = Vec::new();
    let mut start = 0;
    let mut bytes = 0;
    for (i, envelope) in envelopes.iter().enumerate() {
        let size = envelope.size();
        if i > start && (i - start == MAX_BATCH_ENTRIES || bytes + size > MAX_BATCH_BYTES) {
            ranges.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += size;
    }
    if start < envelopes.len() {
        ranges.push(start..envelopes.len());
    }
    run_batches(ranges, |range| async move {
        let chunk = &envelopes[range];
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(i, envelope)| envelope.entry(i))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let output = client
            .send_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(sdk_error)
            .context("SendMessageBatch failed")?;
        Ok(entry_results(
            chunk.len(),
            output.successful().iter().map(|entry| entry.id()),
            output.failed(),
        ))
    })
    .await
}

/// ChangeMessageVisibilityBatch of `(receipt, seconds)` pairs.
async fn change_visibility(
    client: &Client,
    url: &str,
    changes: &[(&str, i32)],
) -> anyhow::Result<Vec<EntryResult>> {
    run_batches(chunks(changes.len()).collect(), |range| async move {
        let chunk = &changes[range];
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(i, (receipt, secs))| {
                ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(*receipt)
                    .visibility_timeout(*secs)
                    .build()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let output = client
            .change_message_visibility_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(sdk_error)
            .context("ChangeMessageVisibilityBatch failed")?;
        Ok(entry_results(
            chunk.len(),
            output.successful().iter().map(|entry| entry.id()),
            output.failed(),
        ))
    })
    .await
}

/// DeleteMessageBatch of `receipts`.
async fn delete_receipts(
    client: &Client,
    url: &str,
    receipts: &[&str],
) -> anyhow::Result<Vec<EntryResult>> {
    run_batches(chunks(receipts.len()).collect(), |range| async move {
        let chunk = &receipts[range];
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(i, receipt)| {
                DeleteMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(*receipt)
                    .build()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let output = client
            .delete_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(sdk_error)
            .context("DeleteMessageBatch failed")?;
        Ok(entry_results(
            chunk.len(),
            output.successful().iter().map(|entry| entry.id()),
            output.failed(),
        ))
    })
    .await
}

/// Makes received messages visible again at once, logging what could not be.
async fn release(client: &Client, url: &str, receipts: &[&str]) {
    let changes: Vec<(&str, i32)> = receipts.iter().map(|receipt| (*receipt, 0)).collect();
    match change_visibility(client, url, &changes).await {
        Ok(results) => {
            let failed = results.iter().filter(|r| r.is_err()).count();
            if failed > 0 {
                warn!(
                    queue = url,
                    failed,
                    "Could not return some messages; they return after their visibility timeout."
                );
            }
        }
        Err(err) => {
            warn!(queue = url, error = %format!("{err:#}"), "Could not return messages; they return after their visibility timeout.");
        }
    }
}

/// CreateQueue (idempotent without attributes), then SetQueueAttributes, so
/// an existing queue gets the configured attributes too.
async fn create_queue(
    client: &Client,
    name: &str,
    attributes: HashMap<QueueAttributeName, String>,
) -> anyhow::Result<String> {
    let created = client
        .create_queue()
        .queue_name(name)
        .send()
        .await
        .map_err(sdk_error)
        .with_context(|| format!("could not create SQS queue {name}"))?;
    let url = created
        .queue_url()
        .with_context(|| format!("CreateQueue of {name} returned no queue URL"))?
        .to_owned();
    client
        .set_queue_attributes()
        .queue_url(&url)
        .set_attributes(Some(attributes))
        .send()
        .await
        .map_err(sdk_error)
        .with_context(|| format!("could not set the attributes of SQS queue {name}"))?;
    Ok(url)
}

async fn queue_url(client: &Client, name: &str) -> anyhow::Result<String> {
    match client.get_queue_url().queue_name(name).send().await {
        Ok(output) => Ok(output
            .queue_url()
            .with_context(|| format!("GetQueueUrl of {name} returned no queue URL"))?
            .to_owned()),
        Err(err) => {
            let missing = err
                .as_service_error()
                .is_some_and(|e| e.is_queue_does_not_exist());
            if missing {
                anyhow::bail!(
                    "SQS queue {name} does not exist; create it or set queue.sqs.create_queues = true"
                );
            }
            Err(sdk_error(err)).with_context(|| format!("could not look up SQS queue {name}"))
        }
    }
}

async fn queue_attributes(
    client: &Client,
    url: &str,
    names: &[QueueAttributeName],
) -> anyhow::Result<HashMap<QueueAttributeName, String>> {
    let output = client
        .get_queue_attributes()
        .queue_url(url)
        .set_attribute_names(Some(names.to_vec()))
        .send()
        .await
        .map_err(sdk_error)
        .with_context(|| format!("GetQueueAttributes of {url} failed"))?;
    Ok(output.attributes().cloned().unwrap_or_default())
}

fn count(attributes: &HashMap<QueueAttributeName, String>, name: QueueAttributeName) -> u64 {
    attributes
        .get(&name)
        .and_then(|value| value.parse().ok())
        .unwrap_or(0)
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
        let fast = open_lane(&client, settings, &lanes, Lane::Fast).await?;
        let slow = open_lane(&client, settings, &lanes, Lane::Slow).await?;
        info!(prefix = %settings.queue_prefix, fast = %fast.url, slow = %slow.url, "SQS lane queues ready.");
        Ok(SqsQueue {
            client,
            lanes,
            fast,
            slow,
            api_calls,
            stats_interval: Duration::from_secs(settings.stats_interval_secs.max(1)),
            batch_window: Duration::from_millis(settings.batch_window_ms),
            stats_cache: Mutex::new([None, None]),
            status_store: None,
        })
    }

    /// Takes the age of a lane's oldest message from the status store (SQS
    /// has no such attribute), with a partial index on the pending messages
    /// created for it if missing.
    pub async fn with_status_store(mut self, db: Db) -> anyhow::Result<SqsQueue> {
        // The WHERE clause must match the query in `oldest_age_secs` word
        // for word for SQLite to use this partial index.
        sqlx::query(
            "CREATE INDEX IF NOT EXISTS messages_pending ON messages(lane, created_at) WHERE status IN ('queued', 'sending', 'retrying')",
        )
        .execute(&db.write)
        .await
        .context("creating the index of pending messages")?;
        self.status_store = Some(db);
        Ok(self)
    }

    async fn oldest_age_secs(&self, lane: Lane) -> anyhow::Result<Option<f64>> {
        let Some(db) = &self.status_store else {
            return Ok(None);
        };
        let oldest: Option<i64> = sqlx::query_scalar(
            "SELECT MIN(created_at) FROM messages WHERE lane = ? AND status IN ('queued', 'sending', 'retrying')",
        )
        .bind(lane.as_str())
        .fetch_one(&db.read)
        .await?;
        Ok(oldest.map(|created| (crate::model::now_ms() - created).max(0) as f64 / 1000.0))
    }

    /// Two GetQueueAttributes calls (lane and DLQ) and the oldest age.
    async fn fetch_stats(&self, lane: Lane) -> anyhow::Result<QueueStats> {
        let queues = self.queues(lane);
        let names = [
            QueueAttributeName::ApproximateNumberOfMessages,
            QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
            QueueAttributeName::ApproximateNumberOfMessagesDelayed,
        ];
        let (main, dead, oldest_age_secs) = tokio::try_join!(
            queue_attributes(&self.client, &queues.url, &names),
            queue_attributes(&self.client, &queues.dlq_url, &names),
            self.oldest_age_secs(lane),
        )?;
        let delayed = count(
            &main,
            QueueAttributeName::ApproximateNumberOfMessagesDelayed,
        );
        Ok(QueueStats {
            depth: count(&main, QueueAttributeName::ApproximateNumberOfMessages) + delayed,
            in_flight: count(
                &main,
                QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
            ),
            delayed,
            oldest_age_secs,
            dlq_depth: names.iter().map(|name| count(&dead, name.clone())).sum(),
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
        if let (Some(db), false) = (&self.status_store, ids.is_empty()) {
            let _turn = db.write_turn().await;
            let mut conn = db.write.acquire().await?;
            crate::store::messages::mark_requeued(&mut conn, ids, i64::MAX).await?;
        }
        Ok(())
    }

    /// Undoes [`SqsQueue::mark_requeued`] for messages that stayed in the DLQ.
    async fn restore_dead_lettered(&self, ids: &[String]) {
        if let (Some(db), false) = (&self.status_store, ids.is_empty()) {
            let _turn = db.write_turn().await;
            let restored = match db.write.acquire().await {
                Ok(mut conn) => crate::store::messages::restore_dead_lettered(&mut conn, ids).await,
                Err(err) => Err(err.into()),
            };
            if let Err(err) = restored {
                warn!(error = %format!("{err:#}"), count = ids.len(), "Messages left in the DLQ could not be marked dead_lettered again; they show as queued.");
            }
        }
    }

    /// Walks the DLQ, re-sending messages that match `filter` to the lane
    /// and deleting them from the DLQ, and returning the others at the end.
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
                    let matches = first_time && parsed.as_ref().is_ok_and(|p| {
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
                let sent = match send_envelopes(&self.client, &queues.url, &copies).await {
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

    /// Redrive of the whole DLQ by StartMessageMoveTask, after listing the
    /// ids it will move (up to [`MOVE_TASK_ID_LIMIT`]).
    async fn redrive_by_move_task(&self, lane: Lane) -> anyhow::Result<Vec<String>> {
        let queues = self.queues(lane);
        let listed = self.list_dead_letters(lane, MOVE_TASK_ID_LIMIT).await?;
        if listed.is_empty() {
            return Ok(Vec::new());
        }
        self.client
            .start_message_move_task()
            .source_arn(&queues.dlq_arn)
            .destination_arn(&queues.arn)
            .send()
            .await
            .map_err(sdk_error)
            .context("StartMessageMoveTask failed")?;
        info!(lane = %lane, listed = listed.len(), "DLQ move task started.");
        Ok(listed.into_iter().map(|letter| letter.message_id).collect())
    }
}

/// Creates or looks up the queue and DLQ of `lane`.
async fn open_lane(
    client: &Client,
    settings: &SqsSettings,
    lanes: &LanesSettings,
    lane: Lane,
) -> anyhow::Result<LaneQueues> {
    let lane_settings = lanes.get(lane);
    let name = format!("{}-{}", settings.queue_prefix, lane.as_str());
    let dlq_name = format!("{name}-dlq");
    let arn_only = [QueueAttributeName::QueueArn];
    let (url, dlq_url, dlq_arn) = if settings.create_queues {
        let dlq_url = create_queue(
            client,
            &dlq_name,
            HashMap::from([(
                QueueAttributeName::MessageRetentionPeriod,
                MAX_RETENTION_SECS.to_string(),
            )]),
        )
        .await?;
        let dlq_arn = queue_attributes(client, &dlq_url, &arn_only)
            .await?
            .remove(&QueueAttributeName::QueueArn)
            .with_context(|| format!("SQS queue {dlq_name} has no ARN"))?;
        let redrive_policy = serde_json::json!({
            "deadLetterTargetArn": dlq_arn,
            "maxReceiveCount": lane_settings.max_receive_count,
        });
        let url = create_queue(
            client,
            &name,
            HashMap::from([
                (
                    QueueAttributeName::RedrivePolicy,
                    redrive_policy.to_string(),
                ),
                (
                    QueueAttributeName::VisibilityTimeout,
                    lane_settings.visibility_timeout_secs.to_string(),
                ),
                // The SQS maximum rather than its 4-day default: a lane held
                // for a paused tenant must not lose messages to expiry.
                (
                    QueueAttributeName::MessageRetentionPeriod,
                    MAX_RETENTION_SECS.to_string(),
                ),
            ]),
        )
        .await?;
        (url, dlq_url, dlq_arn)
    } else {
        let url = queue_url(client, &name).await?;
        let dlq_url = queue_url(client, &dlq_name).await?;
        let dlq_arn = queue_attributes(client, &dlq_url, &arn_only)
            .await?
            .remove(&QueueAttributeName::QueueArn)
            .with_context(|| format!("SQS queue {dlq_name} has no ARN"))?;
        (url, dlq_url, dlq_arn)
    };
    let mut attributes = queue_attributes(
        client,
        &url,
        &[
            QueueAttributeName::QueueArn,
            QueueAttributeName::RedrivePolicy,
        ],
    )
    .await?;
    let arn = attributes
        .remove(&QueueAttributeName::QueueArn)
        .with_context(|| format!("SQS queue {name} has no ARN"))?;
    let policy = attributes
        .remove(&QueueAttributeName::RedrivePolicy)
        .unwrap_or_default();
    if !policy.contains(&dlq_arn) {
        warn!(queue = %name, dlq = %dlq_name, "The lane queue does not dead-letter to its DLQ; messages that keep failing will be redelivered until they expire.");
    }
    Ok(LaneQueues {
        url,
        arn,
        dlq_url,
        dlq_arn,
        deleted: AtomicU64::new(0),
    })
}

#[async_trait]
impl LaneQueue for SqsQueue {
    /// Sends in SendMessageBatch calls of at most ten messages and 256 KiB.
    /// `Err` as a whole only when the first call fails as a whole (nothing
    /// was sent); otherwise one result per message.
    async fn send_batch(
        &self,
        lane: Lane,
        messages: Vec<OutboundMessage>,
    ) -> anyhow::Result<Vec<EntryResult>> {
        let envelopes: Vec<Envelope> = messages.iter().map(Envelope::of).collect();
        send_envelopes(&self.client, &self.queues(lane).url, &envelopes).await
    }

    /// One ReceiveMessage long poll (at most 10 messages, at most 20 s).
    ///
    /// The call runs in its own task. If this future is dropped mid-poll
    /// (shutdown), the task finishes the poll and makes whatever it received
    /// visible again at once, so no message waits out a visibility timeout
    /// for a consumer that is gone; their ApproximateReceiveCount has still
    /// gone up by one. If the runtime stops before that, they return after
    /// their visibility timeout.
    ///
    /// Messages without fairlane's attributes are logged and left alone: the
    /// redrive policy moves them to the DLQ after `max_receive_count`.
    async fn receive(
        &self,
        lane: Lane,
        max: usize,
        wait: Duration,
    ) -> anyhow::Result<Vec<ReceivedMessage>> {
        let url = self.queues(lane).url.clone();
        let request = self
            .client
            .receive_message()
            .queue_url(&url)
            .max_number_of_messages(max.clamp(1, MAX_BATCH_ENTRIES) as i32)
            .wait_time_seconds(wait.as_secs().min(MAX_WAIT_SECS) as i32)
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .message_system_attribute_names(MessageSystemAttributeName::SentTimestamp)
            .message_attribute_names("All");
        let (tx, rx) = oneshot::channel();
        let client = self.client.clone();
        tokio::spawn(async move {
            let result = request.send().await;
            if let Err(Ok(output)) = tx.send(result) {
                let receipts: Vec<&str> = output
                    .messages()
                    .iter()
                    .filter_map(Message::receipt_handle)
                    .collect();
                if !receipts.is_empty() {
                    debug!(queue = %url, count = receipts.len(), "Receive was abandoned; returning its messages.");
                    release(&client, &url, &receipts).await;
                }
            }
        });
        let output = rx
            .await
            .context("the receive task ended without an answer")?
            .map_err(sdk_error)
            .context("ReceiveMessage failed")?;
        let mut received = Vec::new();
        for message in output.messages() {
            match Parsed::from_sqs(message) {
                Ok(parsed) => received.push(parsed.into_received()),
                Err(reason) => {
                    warn!(lane = %lane, sqs_message_id = message.message_id().unwrap_or_default(), %reason, "Ignoring a queue message fairlane did not write; the redrive policy moves it to the DLQ.");
                }
            }
        }
        Ok(received)
    }

    async fn delete_batch(
        &self,
        lane: Lane,
        receipts: &[String],
    ) -> anyhow::Result<Vec<EntryResult>> {
        let queues = self.queues(lane);
        let refs: Vec<&str> = receipts.iter().map(String::as_str).collect();
        let results = delete_receipts(&self.client, &queues.url, &refs).await?;
        let deleted = results.iter().filter(|result| result.is_ok()).count() as u64;
        queues.deleted.fetch_add(deleted, Ordering::Relaxed);
        Ok(results)
    }

    async fn change_visibility_batch(
        &self,
        lane: Lane,
        changes: &[(String, Duration)],
    ) -> anyhow::Result<Vec<EntryResult>> {
        let secs: Vec<(&str, i32)> = changes
            .iter()
            .map(|(receipt, visibility)| {
                (
                    receipt.as_str(),
                    ceil_secs(*visibility, MAX_VISIBILITY_SECS),
                )
            })
            .collect();
        change_visibility(&self.client, &self.queues(lane).url, &secs).await
    }

    /// Sends a copy (same body, attributes, group id and first enqueue time)
    /// with `delay` (at most 900 s) and, once that succeeded, deletes the
    /// received message, so the copy starts with a receive count of zero.
    /// If the delete fails, the message is delivered twice and the status
    /// store deduplicates.
    async fn defer(
        &self,
        lane: Lane,
        message: &ReceivedMessage,
        delay: Duration,
    ) -> anyhow::Result<()> {
        let queues = self.queues(lane);
        self.send_copy(&queues.url, &Envelope::copy_of(message, delay))
            .await
            .context("could not send the deferred copy")?;
        self.delete_received(&queues.url, &message.receipt)
            .await
            .context("the deferred copy was sent but the received message could not be deleted")
    }

    /// Sends a copy to the lane's DLQ (with its lane receive count and
    /// first enqueue time), then deletes the received message. If the delete
    /// fails the message exists in both queues; the lane copy is delivered
    /// again and deduplicated by the status store.
    async fn dead_letter(&self, lane: Lane, message: &ReceivedMessage) -> anyhow::Result<()> {
        let queues = self.queues(lane);
        let mut envelope = Envelope::copy_of(message, Duration::ZERO);
        envelope.receive_count = Some(message.receive_count);
        self.send_copy(&queues.dlq_url, &envelope)
            .await
            .context("could not send the message to the DLQ")?;
        self.delete_received(&queues.url, &message.receipt)
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
        if let Some((at, stats)) = &self.stats_cache.lock().expect("stats cache")[slot] {
            if at.elapsed() < fresh_for {
                return Ok(stats.clone());
            }
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
    /// `dead_letter`, or `max_receive_count` for messages the redrive policy
    /// moved (that is when SQS moves them).
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
                                .unwrap_or(self.lanes.get(lane).max_receive_count),
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

    /// With an empty filter, lists the ids (up to 1000) and starts a
    /// StartMessageMoveTask from the DLQ to the lane; SQS moves the messages
    /// in the background, so they may arrive in the lane a little later, and
    /// of a DLQ deeper than 1000 only 1000 ids are returned although all
    /// messages move. If the task cannot be started (e.g. moto, missing
    /// permission, a task already running), and with any filter, the DLQ is
    /// walked instead: matching messages are re-sent to the lane (fresh
    /// receive count) and deleted from the DLQ, the others made visible
    /// again. A walk covers the DLQ's approximate visible count at its
    /// start; messages dead-lettered meanwhile wait for the next redrive.
    /// Returns the ids redriven.
    async fn redrive(&self, lane: Lane, filter: &RedriveFilter) -> anyhow::Result<Vec<String>> {
        if filter.message_ids.as_ref().is_some_and(Vec::is_empty) {
            return Ok(Vec::new());
        }
        if filter.tenant_id.is_none() && filter.message_ids.is_none() {
            match self.redrive_by_move_task(lane).await {
                Ok(ids) => return Ok(ids),
                Err(err) => {
                    info!(lane = %lane, error = %format!("{err:#}"), "DLQ move task unavailable; redriving message by message.");
                }
            }
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

    async fn ping(&self) -> bool {
        queue_attributes(
            &self.client,
            &self.fast.url,
            &[QueueAttributeName::ApproximateNumberOfMessages],
        )
        .await
        .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;
    use aws_sdk_sqs::config::Credentials;
    use aws_sdk_sqs::config::retry::RetryConfig;

    /// The local SQS-compatible server (moto) the tests run against.
    fn server_url() -> Option<String> {
        match std::env::var("FAIRLANE_TEST_SQS_URL") {
            Ok(url) if !url.is_empty() => Some(url),
            _ => {
                eprintln!("skipping: FAIRLANE_TEST_SQS_URL is not set");
                None
            }
        }
    }

    /// A client for a local server: static credentials, one attempt per
    /// call so that unimplemented operations fail fast.
    fn test_client(url: &str) -> Client {
        let config = aws_sdk_sqs::Config::builder()
            .behavior_version(aws_sdk_sqs::config::BehaviorVersion::latest())
            .region(aws_sdk_sqs::config::Region::new("us-east-1"))
            .credentials_provider(Credentials::new("test", "test", None, None, "test"))
            .endpoint_url(url)
            .retry_config(RetryConfig::standard().with_max_attempts(1))
            .build();
        Client::from_conf(config)
    }

    fn settings(url: &str, prefix: &str, create: bool, max_receive_count: u32) -> Settings {
        Settings::from_toml_overlay(&format!(
            "[queue.sqs]\nendpoint_url = \"{url}\"\nregion = \"us-east-1\"\n\
             queue_prefix = \"{prefix}\"\ncreate_queues = {create}\n\
             [lanes.fast]\nvisibility_timeout_secs = 30\nmax_receive_count = {max_receive_count}\n"
        ))
        .unwrap()
    }

    fn unique_prefix() -> String {
        format!("ft-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
    }

    struct Fixture {
        queue: SqsQueue,
        /// A plain client for looking at the queues from outside.
        client: Client,
        prefix: String,
    }

    impl Fixture {
        async fn url(&self, name: &str) -> String {
            queue_url(&self.client, &format!("{}-{name}", self.prefix))
                .await
                .unwrap()
        }
    }

    /// A queue with fresh lane queues, or `None` without a server.
    async fn fixture(max_receive_count: u32) -> Option<Fixture> {
        let url = server_url()?;
        let prefix = unique_prefix();
        let settings = settings(&url, &prefix, true, max_receive_count);
        let mut queue = SqsQueue::connect_with_client(
            test_client(&url),
            &settings.queue.sqs,
            settings.lanes.clone(),
        )
        .await
        .unwrap();
        // Fresh statistics on every call (caching has a test of its own).
        queue.stats_interval = Duration::ZERO;
        Some(Fixture {
            queue,
            client: test_client(&url),
            prefix,
        })
    }

    fn message(tenant: &str, n: usize) -> OutboundMessage {
        OutboundMessage {
            message_id: format!("{tenant}-{n}"),
            tenant_id: tenant.to_owned(),
            channel: Channel::Sms,
            priority: Priority::High,
            body: format!("{{\"n\":{n}}}"),
            delay: Duration::ZERO,
        }
    }

    async fn send(queue: &SqsQueue, messages: Vec<OutboundMessage>) {
        let results = queue.send_batch(Lane::Fast, messages).await.unwrap();
        assert!(results.iter().all(Result::is_ok), "{results:?}");
    }

    /// Receives from the fast lane until `n` messages arrived (or a few
    /// empty polls).
    async fn receive_n(queue: &SqsQueue, n: usize) -> Vec<ReceivedMessage> {
        let mut got = Vec::new();
        for _ in 0..5 {
            if got.len() >= n {
                break;
            }
            got.extend(
                queue
                    .receive(Lane::Fast, n - got.len(), Duration::ZERO)
                    .await
                    .unwrap(),
            );
        }
        got
    }

    fn ids<'a>(messages: impl IntoIterator<Item = &'a ReceivedMessage>) -> Vec<String> {
        let mut ids: Vec<String> = messages.into_iter().map(|m| m.message_id.clone()).collect();
        ids.sort();
        ids
    }

    #[tokio::test]
    async fn created_queues_get_the_redrive_policy_and_visibility_timeout_also_when_they_existed() {
        let Some(url) = server_url() else { return };
        let prefix = unique_prefix();
        let first = settings(&url, &prefix, true, 4);
        SqsQueue::connect_with_client(test_client(&url), &first.queue.sqs, first.lanes.clone())
            .await
            .unwrap();
        // Connecting again with other lane settings updates the queues.
        let mut second = settings(&url, &prefix, true, 7);
        second.lanes.fast.visibility_timeout_secs = 45;
        SqsQueue::connect_with_client(test_client(&url), &second.queue.sqs, second.lanes.clone())
            .await
            .unwrap();

        let client = test_client(&url);
        let dlq_url = queue_url(&client, &format!("{prefix}-fast-dlq"))
            .await
            .unwrap();
        let dlq = queue_attributes(&client, &dlq_url, &[QueueAttributeName::All])
            .await
            .unwrap();
        let fast_url = queue_url(&client, &format!("{prefix}-fast")).await.unwrap();
        let fast = queue_attributes(&client, &fast_url, &[QueueAttributeName::All])
            .await
            .unwrap();
        assert_eq!(fast[&QueueAttributeName::VisibilityTimeout], "45");
        let policy: serde_json::Value =
            serde_json::from_str(&fast[&QueueAttributeName::RedrivePolicy]).unwrap();
        assert_eq!(
            policy["deadLetterTargetArn"],
            dlq[&QueueAttributeName::QueueArn].as_str()
        );
        assert_eq!(policy["maxReceiveCount"].to_string().trim_matches('"'), "7");
        assert_eq!(
            dlq[&QueueAttributeName::MessageRetentionPeriod],
            MAX_RETENTION_SECS.to_string()
        );
        assert_eq!(
            fast[&QueueAttributeName::MessageRetentionPeriod],
            MAX_RETENTION_SECS.to_string()
        );
        // The slow lane has its own pair.
        queue_url(&client, &format!("{prefix}-slow")).await.unwrap();
        queue_url(&client, &format!("{prefix}-slow-dlq"))
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn missing_queues_are_an_error_naming_the_queue_when_creation_is_off() {
        let Some(url) = server_url() else { return };
        let prefix = unique_prefix();
        let settings = settings(&url, &prefix, false, 5);
        let err = SqsQueue::connect_with_client(
            test_client(&url),
            &settings.queue.sqs,
            settings.lanes.clone(),
        )
        .await
        .err()
        .expect("connect must fail without queues");
        let text = format!("{err:#}");
        assert!(
            text.contains(&format!("SQS queue {prefix}-fast does not exist"))
                && text.contains("queue.sqs.create_queues = true"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn existing_queues_are_found_when_creation_is_off() {
        let Some(f) = fixture(5).await else { return };
        let url = server_url().unwrap();
        let settings = settings(&url, &f.prefix, false, 5);
        let queue = SqsQueue::connect_with_client(
            test_client(&url),
            &settings.queue.sqs,
            settings.lanes.clone(),
        )
        .await
        .unwrap();
        assert!(queue.ping().await);
    }

    #[tokio::test]
    async fn connect_uses_the_standard_credential_chain_and_the_endpoint_override() {
        let Some(url) = server_url() else { return };
        if std::env::var_os("AWS_ACCESS_KEY_ID").is_none() {
            eprintln!("skipping: AWS_ACCESS_KEY_ID is not set (any value works with moto)");
            return;
        }
        let settings = settings(&url, &unique_prefix(), true, 5);
        let queue = SqsQueue::connect(&settings.queue.sqs, settings.lanes.clone())
            .await
            .unwrap();
        assert!(queue.ping().await);
    }

    #[tokio::test]
    async fn a_batch_of_fifteen_arrives_with_its_attributes_and_the_tenant_as_group_id() {
        let Some(f) = fixture(5).await else { return };
        let messages: Vec<OutboundMessage> = (0..15)
            .map(|n| message(if n % 2 == 0 { "acme" } else { "globex" }, n))
            .collect();
        let before = f.queue.api_calls();
        let results = f
            .queue
            .send_batch(Lane::Fast, messages.clone())
            .await
            .unwrap();
        assert_eq!(results, vec![Ok(()); 15]);
        assert_eq!(
            f.queue.api_calls() - before,
            2,
            "15 messages take two calls"
        );

        let url = f.url("fast").await;
        let mut seen = HashMap::new();
        for _ in 0..5 {
            let output = f
                .client
                .receive_message()
                .queue_url(&url)
                .max_number_of_messages(10)
                .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
                .message_attribute_names("All")
                .send()
                .await
                .unwrap();
            for raw in output.messages() {
                let attribute = |name: &str| {
                    let value = &raw.message_attributes().unwrap()[name];
                    assert_eq!(value.data_type(), "String");
                    value.string_value().unwrap().to_owned()
                };
                let group =
                    raw.attributes().unwrap()[&MessageSystemAttributeName::MessageGroupId].clone();
                let id = attribute("message_id");
                assert_eq!(group, attribute("tenant"), "{id}");
                assert_eq!(attribute("channel"), "sms");
                assert_eq!(attribute("priority"), "high");
                seen.insert(id, (group, raw.body().unwrap().to_owned()));
            }
        }
        assert_eq!(seen.len(), 15);
        for sent in &messages {
            assert_eq!(
                seen[&sent.message_id],
                (sent.tenant_id.clone(), sent.body.clone())
            );
        }
    }

    #[tokio::test]
    async fn a_received_message_stays_invisible_until_its_visibility_is_set_to_zero() {
        let Some(f) = fixture(5).await else { return };
        let sent_at = crate::model::now_ms();
        send(&f.queue, vec![message("acme", 1)]).await;

        let first = f
            .queue
            .receive(Lane::Fast, 10, Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(first.len(), 1);
        let got = &first[0];
        assert_eq!(
            (
                got.message_id.as_str(),
                got.tenant_id.as_str(),
                got.channel,
                got.priority,
                got.body.as_str(),
                got.receive_count
            ),
            (
                "acme-1",
                "acme",
                Channel::Sms,
                Priority::High,
                "{\"n\":1}",
                1
            )
        );
        assert!((got.enqueued_at_ms - sent_at).abs() < 5_000, "{got:?}");
        assert!(
            f.queue
                .receive(Lane::Fast, 10, Duration::ZERO)
                .await
                .unwrap()
                .is_empty()
        );

        let changed = f
            .queue
            .change_visibility_batch(Lane::Fast, &[(got.receipt.clone(), Duration::ZERO)])
            .await
            .unwrap();
        assert_eq!(changed, vec![Ok(())]);
        let again = f
            .queue
            .receive(Lane::Fast, 10, Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].receive_count, 2);
        assert_eq!(again[0].enqueued_at_ms, got.enqueued_at_ms);
    }

    #[tokio::test]
    async fn a_bogus_receipt_fails_alone_in_a_delete_batch() {
        let Some(f) = fixture(5).await else { return };
        send(&f.queue, (0..3).map(|n| message("acme", n)).collect()).await;
        let got = receive_n(&f.queue, 3).await;
        assert_eq!(got.len(), 3);
        let receipts = vec![
            got[0].receipt.clone(),
            "not-a-receipt".to_owned(),
            got[1].receipt.clone(),
            got[2].receipt.clone(),
        ];
        let results = f.queue.delete_batch(Lane::Fast, &receipts).await.unwrap();
        assert!(results[0].is_ok() && results[2].is_ok() && results[3].is_ok());
        assert!(results[1].is_err(), "{results:?}");
        assert_eq!(f.queue.deleted_total(Lane::Fast), 3);
        assert_eq!(f.queue.deleted_total(Lane::Slow), 0);
        let stats = f.queue.stats(Lane::Fast).await.unwrap();
        assert_eq!((stats.depth, stats.in_flight), (0, 0));
    }

    #[tokio::test]
    async fn a_message_received_max_receive_count_times_moves_to_the_dlq() {
        let Some(f) = fixture(2).await else { return };
        send(&f.queue, vec![message("acme", 1)]).await;
        for expected in 1..=2 {
            let got = f
                .queue
                .receive(Lane::Fast, 1, Duration::ZERO)
                .await
                .unwrap();
            assert_eq!(got[0].receive_count, expected);
            f.queue
                .change_visibility_batch(Lane::Fast, &[(got[0].receipt.clone(), Duration::ZERO)])
                .await
                .unwrap();
        }
        assert!(
            f.queue
                .receive(Lane::Fast, 1, Duration::ZERO)
                .await
                .unwrap()
                .is_empty()
        );
        let stats = f.queue.stats(Lane::Fast).await.unwrap();
        assert_eq!((stats.depth, stats.in_flight, stats.dlq_depth), (0, 0, 1));
        let dead = f.queue.list_dead_letters(Lane::Fast, 10).await.unwrap();
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].message_id, "acme-1");
        assert_eq!(dead[0].receive_count, 2);
    }

    #[tokio::test]
    async fn a_message_deferred_three_times_max_receive_count_never_reaches_the_dlq() {
        let Some(f) = fixture(2).await else { return };
        send(&f.queue, vec![message("acme", 1)]).await;
        let mut enqueued_at = None;
        for _ in 0..6 {
            let got = f
                .queue
                .receive(Lane::Fast, 1, Duration::ZERO)
                .await
                .unwrap();
            assert_eq!(got.len(), 1, "a deferred message must come back");
            assert_eq!(got[0].receive_count, 1);
            assert_eq!(got[0].message_id, "acme-1");
            assert_eq!(
                *enqueued_at.get_or_insert(got[0].enqueued_at_ms),
                got[0].enqueued_at_ms
            );
            f.queue
                .defer(Lane::Fast, &got[0], Duration::ZERO)
                .await
                .unwrap();
        }
        let stats = f.queue.stats(Lane::Fast).await.unwrap();
        assert_eq!((stats.depth, stats.in_flight, stats.dlq_depth), (1, 0, 0));
        assert_eq!(f.queue.deleted_total(Lane::Fast), 0);
    }

    #[tokio::test]
    async fn a_deferred_message_is_delayed() {
        let Some(f) = fixture(5).await else { return };
        send(&f.queue, vec![message("acme", 1)]).await;
        let got = f
            .queue
            .receive(Lane::Fast, 1, Duration::ZERO)
            .await
            .unwrap();
        f.queue
            .defer(Lane::Fast, &got[0], Duration::from_millis(1500))
            .await
            .unwrap();
        let stats = f.queue.stats(Lane::Fast).await.unwrap();
        assert_eq!((stats.depth, stats.delayed, stats.in_flight), (1, 1, 0));
        assert!(
            f.queue
                .receive(Lane::Fast, 1, Duration::ZERO)
                .await
                .unwrap()
                .is_empty()
        );
        let back = f
            .queue
            .receive(Lane::Fast, 1, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(back.len(), 1);
    }

    #[tokio::test]
    async fn dead_letter_moves_a_received_message_to_the_dlq() {
        let Some(f) = fixture(5).await else { return };
        send(&f.queue, vec![message("acme", 1)]).await;
        let got = f
            .queue
            .receive(Lane::Fast, 1, Duration::ZERO)
            .await
            .unwrap();
        f.queue.dead_letter(Lane::Fast, &got[0]).await.unwrap();
        let stats = f.queue.stats(Lane::Fast).await.unwrap();
        assert_eq!((stats.depth, stats.in_flight, stats.dlq_depth), (0, 0, 1));
        let dead = f.queue.list_dead_letters(Lane::Fast, 10).await.unwrap();
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].receive_count, 1);
        assert_eq!(dead[0].enqueued_at_ms, got[0].enqueued_at_ms);
    }

    #[tokio::test]
    async fn listing_dead_letters_leaves_them_in_the_dlq() {
        let Some(f) = fixture(5).await else { return };
        send(&f.queue, vec![message("acme", 1), message("globex", 2)]).await;
        for got in receive_n(&f.queue, 2).await {
            f.queue.dead_letter(Lane::Fast, &got).await.unwrap();
        }
        let first = f.queue.list_dead_letters(Lane::Fast, 10).await.unwrap();
        let listed: Vec<(&str, &str, Channel, Priority, &str)> = first
            .iter()
            .map(|d| {
                (
                    d.message_id.as_str(),
                    d.tenant_id.as_str(),
                    d.channel,
                    d.priority,
                    d.body.as_str(),
                )
            })
            .collect();
        let mut sorted = listed.clone();
        sorted.sort_by_key(|entry| entry.0);
        assert_eq!(
            sorted,
            vec![
                ("acme-1", "acme", Channel::Sms, Priority::High, "{\"n\":1}"),
                (
                    "globex-2",
                    "globex",
                    Channel::Sms,
                    Priority::High,
                    "{\"n\":2}"
                ),
            ]
        );
        // Visible again at once: a second listing sees them all.
        let second = f.queue.list_dead_letters(Lane::Fast, 10).await.unwrap();
        assert_eq!(second.len(), 2);
        assert_eq!(
            f.queue
                .list_dead_letters(Lane::Fast, 1)
                .await
                .unwrap()
                .len(),
            1
        );
        let stats = f.queue.stats(Lane::Fast).await.unwrap();
        assert_eq!(stats.dlq_depth, 2);
        assert!(
            f.queue
                .list_dead_letters(Lane::Slow, 10)
                .await
                .unwrap()
                .is_empty()
        );
    }

    #[tokio::test]
    async fn redrive_by_tenant_and_by_id_moves_only_matching_messages() {
        let Some(f) = fixture(5).await else { return };
        send(
            &f.queue,
            vec![message("a", 1), message("a", 2), message("b", 1)],
        )
        .await;
        for got in receive_n(&f.queue, 3).await {
            f.queue.dead_letter(Lane::Fast, &got).await.unwrap();
        }
        assert_eq!(f.queue.stats(Lane::Fast).await.unwrap().dlq_depth, 3);

        let none = RedriveFilter {
            tenant_id: None,
            message_ids: Some(vec![]),
        };
        assert!(f.queue.redrive(Lane::Fast, &none).await.unwrap().is_empty());
        let by_id = RedriveFilter {
            tenant_id: None,
            message_ids: Some(vec!["a-2".into()]),
        };
        assert_eq!(
            f.queue.redrive(Lane::Fast, &by_id).await.unwrap(),
            vec!["a-2".to_owned()]
        );
        let by_tenant = RedriveFilter {
            tenant_id: Some("b".into()),
            message_ids: None,
        };
        assert_eq!(
            f.queue.redrive(Lane::Fast, &by_tenant).await.unwrap(),
            vec!["b-1".to_owned()]
        );

        let stats = f.queue.stats(Lane::Fast).await.unwrap();
        assert_eq!((stats.depth, stats.dlq_depth), (2, 1));
        let back = receive_n(&f.queue, 2).await;
        assert_eq!(ids(&back), vec!["a-2", "b-1"]);
        assert!(back.iter().all(|m| m.receive_count == 1));
        let left = f.queue.list_dead_letters(Lane::Fast, 10).await.unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].message_id, "a-1");
    }

    #[tokio::test]
    async fn stats_are_read_from_sqs_once_per_interval() {
        let Some(mut f) = fixture(5).await else {
            return;
        };
        f.queue.stats_interval = Duration::from_secs(60);
        let before = f.queue.api_calls();
        let first = f.queue.stats(Lane::Fast).await.unwrap();
        assert_eq!(f.queue.api_calls() - before, 2, "lane and DLQ attributes");
        send(&f.queue, vec![message("acme", 1)]).await;
        let calls = f.queue.api_calls();
        assert_eq!(f.queue.stats(Lane::Fast).await.unwrap(), first);
        assert_eq!(f.queue.api_calls(), calls, "served from the cache");
        // Each lane has its own entry.
        f.queue.stats(Lane::Slow).await.unwrap();
        assert_eq!(f.queue.api_calls() - calls, 2);
    }

    #[tokio::test]
    async fn redriving_everything_falls_back_when_the_move_task_fails() {
        let Some(f) = fixture(5).await else { return };
        send(&f.queue, (0..3).map(|n| message("acme", n)).collect()).await;
        let received = receive_n(&f.queue, 3).await;
        for got in &received {
            f.queue.dead_letter(Lane::Fast, got).await.unwrap();
        }
        // moto does not implement StartMessageMoveTask.
        let mut redriven = f
            .queue
            .redrive(Lane::Fast, &RedriveFilter::default())
            .await
            .unwrap();
        redriven.sort();
        assert_eq!(redriven, vec!["acme-0", "acme-1", "acme-2"]);
        let stats = f.queue.stats(Lane::Fast).await.unwrap();
        assert_eq!((stats.depth, stats.dlq_depth), (3, 0));
        let back = receive_n(&f.queue, 3).await;
        assert_eq!(ids(&back), ids(&received));
        // The first enqueue time survives the round trip.
        for message in &back {
            let original = received
                .iter()
                .find(|r| r.message_id == message.message_id)
                .unwrap();
            assert_eq!(message.enqueued_at_ms, original.enqueued_at_ms);
        }
        assert!(
            f.queue
                .redrive(Lane::Fast, &RedriveFilter::default())
                .await
                .unwrap()
                .is_empty()
        );
    }

    #[tokio::test]
    async fn stats_count_waiting_in_flight_delayed_and_dead_messages() {
        let Some(f) = fixture(5).await else { return };
        let mut delayed = message("acme", 4);
        delayed.delay = Duration::from_secs(60);
        send(
            &f.queue,
            vec![
                message("acme", 1),
                message("acme", 2),
                message("acme", 3),
                delayed,
            ],
        )
        .await;
        f.queue
            .receive(Lane::Fast, 1, Duration::ZERO)
            .await
            .unwrap();
        let doomed = f
            .queue
            .receive(Lane::Fast, 1, Duration::ZERO)
            .await
            .unwrap();
        f.queue.dead_letter(Lane::Fast, &doomed[0]).await.unwrap();
        assert_eq!(
            f.queue.stats(Lane::Fast).await.unwrap(),
            QueueStats {
                depth: 2,
                in_flight: 1,
                delayed: 1,
                oldest_age_secs: None,
                dlq_depth: 1,
            }
        );
        assert_eq!(
            f.queue.stats(Lane::Slow).await.unwrap(),
            QueueStats::default()
        );
    }

    #[tokio::test]
    async fn api_calls_counts_each_sqs_call() {
        let Some(f) = fixture(5).await else { return };
        assert!(f.queue.api_calls() > 0, "connect makes calls");
        let start = f.queue.api_calls();
        send(&f.queue, (0..10).map(|n| message("acme", n)).collect()).await;
        assert_eq!(f.queue.api_calls() - start, 1);
        let got = f
            .queue
            .receive(Lane::Fast, 10, Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(got.len(), 10);
        assert_eq!(f.queue.api_calls() - start, 2);
        let receipts: Vec<String> = got.iter().map(|m| m.receipt.clone()).collect();
        f.queue.delete_batch(Lane::Fast, &receipts).await.unwrap();
        assert_eq!(f.queue.api_calls() - start, 3);
        f.queue.stats(Lane::Fast).await.unwrap();
        assert_eq!(f.queue.api_calls() - start, 5);
    }

    #[tokio::test]
    async fn an_abandoned_receive_returns_what_it_received() {
        let Some(f) = fixture(5).await else { return };
        // The receive is dropped mid-poll, as on shutdown...
        let abandoned = tokio::time::timeout(
            Duration::from_millis(300),
            f.queue.receive(Lane::Fast, 10, Duration::from_secs(3)),
        )
        .await;
        assert!(abandoned.is_err());
        // ...and the poll still running on the server takes this message.
        send(&f.queue, vec![message("acme", 1)]).await;
        // Without the release it would stay hidden for 30 s.
        let got = f
            .queue
            .receive(Lane::Fast, 10, Duration::from_secs(8))
            .await
            .unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].message_id, "acme-1");
    }

    #[test]
    fn delays_round_up_to_whole_seconds_within_the_sqs_limit() {
        assert_eq!(ceil_secs(Duration::ZERO, MAX_DELAY_SECS), 0);
        assert_eq!(ceil_secs(Duration::from_millis(1), MAX_DELAY_SECS), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1500), MAX_DELAY_SECS), 2);
        assert_eq!(ceil_secs(Duration::from_secs(3600), MAX_DELAY_SECS), 900);
    }

    #[test]
    fn batch_results_map_failed_entries_back_to_their_inputs() {
        let failed = BatchResultErrorEntry::builder()
            .id("1")
            .sender_fault(true)
            .code("ReceiptHandleIsInvalid")
            .message("bad receipt")
            .build()
            .unwrap();
        assert_eq!(
            entry_results(3, ["0"], &[failed]),
            vec![
                Ok(()),
                Err("ReceiptHandleIsInvalid: bad receipt".to_owned()),
                Err("SQS did not report on this entry".to_owned()),
            ]
        );
        let ranges: Vec<_> = chunks(25).collect();
        assert_eq!(ranges, vec![0..10, 10..20, 20..25]);
    }
}
