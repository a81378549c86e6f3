//! Dedicated tenant queues and attention queues on SQS.
//!
//! A dedicated tenant's messages of a lane go to queues of its own, named
//! like a lane's with the prefix `{prefix}-t-{tenant}` (so
//! `{prefix}-t-{tenant}-fast`, `…-fast-high`, `…-fast-low` and the DLQ
//! `…-fast-dlq`; a tenant id too long for SQS's 80 characters is replaced
//! by `th-` and a hash of it). They are created on the tenant's first send,
//! with the lane's attributes, and worked only when signalled: each lane
//! has an attention queue (`{prefix}-attention-{lane}`, with its class
//! queues and DLQ like a lane) where a send leaves one signal per tenant
//! and batch call.
//!
//! SQS cannot write the work and its signal in one transaction. The signal
//! is sent beside the work, and the send counts as done only when both
//! were: a failed signal fails the entry, so the outbox keeps its row and
//! sends both again (the consumer skips a second copy of the work). Signals
//! are not deduplicated by SQS; the attention workers drop a signal older
//! than a slice of the same tenant that started since (that slice ends by
//! signalling again if backlog remains). What could still be missed (a
//! signal that failed after its slice, an approximate count that read zero)
//! the sweep finds: every `consumers.attention_sweep_secs` each lane looks
//! again at the queues written or worked since its last sweep, and at
//! start-up every tenant queue that exists is looked at (ListQueues by
//! prefix, then the depth of those found). Idle tenants cost no call.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use anyhow::Context;
use aws_sdk_sqs::types::QueueAttributeName;
use sha2::{Digest, Sha256};
use tracing::{info, warn};

use super::SqsQueue;
use super::batch::{MAX_BATCH_ENTRIES, delete_receipts, sdk_error, send_envelopes};
use super::envelope::{Envelope, Parsed};
use super::lanes::{count, open_lane, queue_attributes, queue_url};
use crate::config::SqsSettings;
use crate::metrics as names;
use crate::model::{Channel, Lane, Priority};

/// SQS queue names are at most 80 characters.
const MAX_QUEUE_NAME: usize = 80;
/// The longest suffix a lane adds to its prefix (`-fast-high`).
const LONGEST_SUFFIX: usize = "-fast-high".len();
/// When a dedicated queue holds messages that are not receivable yet
/// (delayed, or in flight elsewhere), its next signal waits this long.
const RECHECK_DELAY: Duration = Duration::from_secs(10);
/// Wait of the receives of a purge: a short poll may miss messages.
const PURGE_WAIT_SECS: i32 = 1;

/// The dedicated tenant queues and attention queues of an [`SqsQueue`].
pub(super) struct Dedicated {
    /// Tenants whose new messages go to their own queues.
    tenants: RwLock<HashSet<String>>,
    /// Tenant queues opened by this process, by lane and tenant.
    views: tokio::sync::Mutex<HashMap<(Lane, String), Arc<SqsQueue>>>,
    /// Each lane's attention queue (fast, slow).
    attention: [Arc<SqsQueue>; 2],
    /// Tenant queues written to or worked since their lane's last sweep.
    touched: Mutex<HashSet<(Lane, String)>>,
    /// Set once a tenant was made dedicated or a tenant queue was found:
    /// from then on the attention queues are polled.
    in_use: AtomicBool,
}

impl Dedicated {
    /// Opens (or creates, with `create_queues`) both lanes' attention
    /// queues. `None`, with a warning, when they cannot be: dedicated
    /// isolation is then refused by the admin API.
    pub(super) async fn open(queue: &SqsQueue) -> Option<Dedicated> {
        let mut attention = Vec::with_capacity(2);
        for lane in Lane::ALL.iter().copied() {
            let settings = SqsSettings {
                queue_prefix: format!("{}-attention", queue.settings.queue_prefix),
                ..queue.settings.clone()
            };
            match open_lane(&queue.client, &settings, &queue.lanes, lane).await {
                Ok(queues) => attention.push(Arc::new(queue.view(lane, queues, None))),
                Err(err) => {
                    warn!(error = %format!("{err:#}"), "The attention queues could not be opened; dedicated tenant queues are not available.");
                    return None;
                }
            }
        }
        let [fast, slow]: [Arc<SqsQueue>; 2] = attention.try_into().ok()?;
        Some(Dedicated {
            tenants: RwLock::new(HashSet::new()),
            views: tokio::sync::Mutex::new(HashMap::new()),
            attention: [fast, slow],
            touched: Mutex::new(HashSet::new()),
            in_use: AtomicBool::new(false),
        })
    }

    pub(super) fn set(&self, tenant_id: &str, dedicated: bool) {
        let mut tenants = self.tenants.write().unwrap_or_else(PoisonError::into_inner);
        if dedicated {
            tenants.insert(tenant_id.to_owned());
            self.in_use.store(true, Ordering::Relaxed);
        } else {
            tenants.remove(tenant_id);
        }
    }

    pub(super) fn is_dedicated(&self, tenant_id: &str) -> bool {
        self.tenants
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(tenant_id)
    }

    pub(super) fn in_use(&self) -> bool {
        self.in_use.load(Ordering::Relaxed)
    }

    pub(super) fn attention(&self, lane: Lane) -> &Arc<SqsQueue> {
        &self.attention[usize::from(lane == Lane::Slow)]
    }

    fn touch(&self, lane: Lane, tenant_id: &str) {
        self.touched
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((lane, tenant_id.to_owned()));
    }

    fn take_touched(&self, lane: Lane) -> Vec<String> {
        let mut touched = self.touched.lock().unwrap_or_else(PoisonError::into_inner);
        let mine: Vec<String> = touched
            .iter()
            .filter(|(l, _)| *l == lane)
            .map(|(_, tenant)| tenant.clone())
            .collect();
        touched.retain(|(l, _)| *l != lane);
        mine
    }
}

/// The prefix of `tenant_id`'s queues: `{prefix}-t-{tenant}`, or
/// `{prefix}-th-{hash}` where that would make a name too long.
pub(super) fn tenant_prefix(prefix: &str, tenant_id: &str) -> String {
    let plain = format!("{prefix}-t-{tenant_id}");
    if plain.len() + LONGEST_SUFFIX <= MAX_QUEUE_NAME {
        return plain;
    }
    let digest = Sha256::digest(tenant_id.as_bytes());
    format!("{prefix}-th-{}", hex::encode(&digest[..8]))
}

/// The tenant of a lane's normal-class queue name under `{prefix}-t-`
/// (`{prefix}-t-{tenant}-{lane}`), and that lane.
fn tenant_of_queue(prefix: &str, name: &str) -> Option<(String, Lane)> {
    let rest = name.strip_prefix(&format!("{prefix}-t-"))?;
    Lane::ALL.iter().copied().find_map(|lane| {
        rest.strip_suffix(&format!("-{lane}"))
            .filter(|tenant| !tenant.is_empty())
            .map(|tenant| (tenant.to_owned(), lane))
    })
}

/// Visible messages, and the others (delayed or in flight), in a queue's
/// three class queues.
async fn backlog(view: &SqsQueue) -> anyhow::Result<(u64, u64)> {
    let names = [
        QueueAttributeName::ApproximateNumberOfMessages,
        QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
        QueueAttributeName::ApproximateNumberOfMessagesDelayed,
    ];
    let classes = &view.fast.classes;
    let (high, normal, low) = tokio::try_join!(
        queue_attributes(&view.client, &classes[0].url, &names),
        queue_attributes(&view.client, &classes[1].url, &names),
        queue_attributes(&view.client, &classes[2].url, &names),
    )?;
    let mut visible = 0;
    let mut other = 0;
    for attributes in [high, normal, low] {
        visible += count(&attributes, QueueAttributeName::ApproximateNumberOfMessages);
        other += count(
            &attributes,
            QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
        ) + count(
            &attributes,
            QueueAttributeName::ApproximateNumberOfMessagesDelayed,
        );
    }
    Ok((visible, other))
}

impl SqsQueue {
    /// `tenant_id`'s queues in `lane`: opened before by this process, or
    /// looked up, or (with `create`) created. `None` when they do not exist
    /// and `create` is false.
    pub(super) async fn tenant_view(
        &self,
        dedicated: &Dedicated,
        lane: Lane,
        tenant_id: &str,
        create: bool,
    ) -> anyhow::Result<Option<Arc<SqsQueue>>> {
        let key = (lane, tenant_id.to_owned());
        let mut views = dedicated.views.lock().await;
        if let Some(view) = views.get(&key) {
            return Ok(Some(view.clone()));
        }
        let settings = SqsSettings {
            queue_prefix: tenant_prefix(&self.settings.queue_prefix, tenant_id),
            create_queues: create || self.settings.create_queues,
            ..self.settings.clone()
        };
        if !create {
            // Cheap existence check before the full lookup.
            let normal = format!("{}-{lane}", settings.queue_prefix);
            if let Err(err) = queue_url(&self.client, &normal).await {
                if format!("{err:#}").contains("does not exist") {
                    return Ok(None);
                }
                return Err(err);
            }
            let settings = SqsSettings {
                create_queues: false,
                ..settings
            };
            let queues = open_lane(&self.client, &settings, &self.lanes, lane).await?;
            let view = Arc::new(self.view(lane, queues, Some(tenant_id.to_owned())));
            views.insert(key, view.clone());
            // A tenant queue exists: its signals must be polled.
            dedicated.in_use.store(true, Ordering::Relaxed);
            return Ok(Some(view));
        }
        let queues = open_lane(&self.client, &settings, &self.lanes, lane)
            .await
            .with_context(|| {
                format!("could not open the dedicated queues of tenant {tenant_id}")
            })?;
        info!(tenant = %tenant_id, lane = %lane, queue = %queues.class(Priority::Normal).name, "Dedicated tenant queues ready.");
        let view = Arc::new(self.view(lane, queues, Some(tenant_id.to_owned())));
        views.insert(key, view.clone());
        dedicated.in_use.store(true, Ordering::Relaxed);
        Ok(Some(view))
    }

    /// Sends one attention signal for `tenant_id` to `lane`'s attention
    /// queue, receivable after `delay`.
    pub(super) async fn signal(
        &self,
        dedicated: &Dedicated,
        lane: Lane,
        tenant_id: &str,
        delay: Duration,
    ) -> anyhow::Result<()> {
        let attention = dedicated.attention(lane);
        let envelope = Envelope {
            message_id: "attention",
            tenant_id,
            channel: Channel::Email,
            priority: Priority::Normal,
            body: tenant_id,
            delay,
            enqueued_at_ms: Some(crate::model::now_ms()),
            receive_count: None,
        };
        let url = &attention.fast.class(Priority::Normal).url;
        let result = send_envelopes(&self.client, url, std::slice::from_ref(&envelope))
            .await?
            .into_iter()
            .next()
            .unwrap_or(Err("no result".to_owned()));
        result.map_err(anyhow::Error::msg)?;
        metrics::counter!(names::ATTENTION_SIGNALS_TOTAL, "lane" => lane.as_str(), "event" => "published")
            .increment(1);
        Ok(())
    }

    /// The dedicated tenants' part of a send: each tenant's messages to its
    /// own queues, then one signal per tenant. `results[i]` is set for the
    /// indexes given.
    pub(super) async fn send_dedicated(
        &self,
        dedicated: &Dedicated,
        lane: Lane,
        envelopes: &[Envelope<'_>],
        groups: HashMap<&str, Vec<usize>>,
        results: &mut [Option<Result<(), String>>],
    ) {
        for (tenant_id, indexes) in groups {
            let chosen: Vec<Envelope> = indexes.iter().map(|&i| envelopes[i].clone()).collect();
            let work = async {
                match self.tenant_view(dedicated, lane, tenant_id, true).await {
                    Ok(Some(view)) => view.send_by_class(lane, &chosen).await,
                    Ok(None) => Err(anyhow::anyhow!("no dedicated queue for {tenant_id}")),
                    Err(err) => Err(err),
                }
            };
            // The signal goes at the same time as the work (one round trip
            // of latency, not two). A worker that meets it before the work
            // finds the queue empty and looks again when it settles; the
            // sweep covers a count that lags.
            let (sent, signalled) = tokio::join!(
                work,
                self.signal(dedicated, lane, tenant_id, Duration::ZERO)
            );
            let mut sent: Vec<Result<(), String>> = match sent {
                Ok(sent) => sent,
                Err(err) => vec![Err(format!("{err:#}")); indexes.len()],
            };
            if sent.iter().any(Result::is_ok) {
                dedicated.touch(lane, tenant_id);
                if let Err(err) = signalled {
                    // The work is there without its signal: fail the
                    // entries, so their outbox rows send both again.
                    let reason = format!("the attention signal could not be sent: {err:#}");
                    for result in sent.iter_mut().filter(|r| r.is_ok()) {
                        *result = Err(reason.clone());
                    }
                }
            }
            for (index, result) in indexes.into_iter().zip(sent) {
                results[index] = Some(result);
            }
        }
    }

    /// See [`crate::queue::TenantQueues::settle_attention`]: signals at once
    /// when messages are receivable, after [`RECHECK_DELAY`] when some are
    /// delayed or in flight.
    pub(super) async fn settle(
        &self,
        dedicated: &Dedicated,
        lane: Lane,
        tenant_id: &str,
    ) -> anyhow::Result<bool> {
        let Some(view) = self.tenant_view(dedicated, lane, tenant_id, false).await? else {
            return Ok(false);
        };
        dedicated.touch(lane, tenant_id);
        let (visible, other) = backlog(&view).await?;
        if visible > 0 {
            self.signal(dedicated, lane, tenant_id, Duration::ZERO)
                .await?;
        } else if other > 0 {
            self.signal(dedicated, lane, tenant_id, RECHECK_DELAY)
                .await?;
        }
        Ok(visible + other > 0)
    }

    /// Looks at the queues of `lane` written or worked since the last
    /// sweep; signals those with backlog. A queue that fails to be looked
    /// at is looked at again next time.
    pub(super) async fn sweep(&self, dedicated: &Dedicated, lane: Lane) -> anyhow::Result<usize> {
        let mut signalled = 0;
        for tenant_id in dedicated.take_touched(lane) {
            let outcome = async {
                let Some(view) = self.tenant_view(dedicated, lane, &tenant_id, false).await? else {
                    return Ok(false);
                };
                let (visible, other) = backlog(&view).await?;
                if visible + other > 0 {
                    let delay = if visible > 0 {
                        Duration::ZERO
                    } else {
                        RECHECK_DELAY
                    };
                    self.signal(dedicated, lane, &tenant_id, delay).await?;
                    return Ok(true);
                }
                anyhow::Ok(false)
            }
            .await;
            match outcome {
                Ok(true) => signalled += 1,
                Ok(false) => {}
                Err(err) => {
                    dedicated.touch(lane, &tenant_id);
                    warn!(lane = %lane, tenant = %tenant_id, error = %format!("{err:#}"), "Attention sweep could not look at a dedicated queue.");
                }
            }
        }
        Ok(signalled)
    }

    /// At start-up: every tenant queue that exists (ListQueues by prefix)
    /// and holds backlog gets a signal.
    pub(super) async fn reconcile(&self, dedicated: &Dedicated) -> anyhow::Result<usize> {
        let prefix = &self.settings.queue_prefix;
        let mut found: Vec<(String, Lane)> = Vec::new();
        let mut next: Option<String> = None;
        loop {
            let page = self
                .client
                .list_queues()
                .queue_name_prefix(format!("{prefix}-t"))
                .max_results(1000)
                .set_next_token(next.take())
                .send()
                .await
                .map_err(sdk_error)
                .context("ListQueues of the dedicated tenant queues failed")?;
            for url in page.queue_urls() {
                let name = url.rsplit('/').next().unwrap_or_default();
                if let Some(found_one) = tenant_of_queue(prefix, name) {
                    found.push(found_one);
                } else if name.starts_with(&format!("{prefix}-th-"))
                    && Lane::ALL
                        .iter()
                        .any(|lane| name.ends_with(&format!("-{lane}")))
                {
                    warn!(queue = %name, "A dedicated queue under a hashed name is not reconciled at start-up; it is signalled on its tenant's next send.");
                }
            }
            match page.next_token() {
                Some(token) => next = Some(token.to_owned()),
                None => break,
            }
        }
        let mut signalled = 0;
        for (tenant_id, lane) in found {
            if self.settle(dedicated, lane, &tenant_id).await? {
                signalled += 1;
            }
        }
        Ok(signalled)
    }

    /// Receives and deletes every receivable message of `tenant_id`'s own
    /// queues; returns their message ids. Messages in flight or delayed
    /// (a retry's backoff) are not receivable and stay.
    pub(super) async fn purge(
        &self,
        dedicated: &Dedicated,
        tenant_id: &str,
    ) -> anyhow::Result<Vec<String>> {
        let mut ids = Vec::new();
        for lane in Lane::ALL.iter().copied() {
            let Some(view) = self.tenant_view(dedicated, lane, tenant_id, false).await? else {
                continue;
            };
            view.receiver(lane).release_all().await;
            for class in &view.fast.classes {
                loop {
                    let output = self
                        .client
                        .receive_message()
                        .queue_url(&class.url)
                        .max_number_of_messages(MAX_BATCH_ENTRIES as i32)
                        .wait_time_seconds(PURGE_WAIT_SECS)
                        .message_attribute_names("All")
                        .send()
                        .await
                        .map_err(sdk_error)
                        .context("ReceiveMessage of a purge failed")?;
                    let messages = output.messages.unwrap_or_default();
                    if messages.is_empty() {
                        break;
                    }
                    let receipts: Vec<&str> =
                        messages.iter().filter_map(|m| m.receipt_handle()).collect();
                    let deleted = delete_receipts(&self.client, &class.url, &receipts).await?;
                    for (message, result) in messages.iter().zip(deleted) {
                        if result.is_ok()
                            && let Ok(parsed) = Parsed::from_sqs(message)
                        {
                            ids.push(parsed.message_id);
                        }
                    }
                }
            }
        }
        Ok(ids)
    }

    /// The lanes in which `tenant_id` has queues of its own.
    pub(super) async fn lanes_of(
        &self,
        dedicated: &Dedicated,
        tenant_id: &str,
    ) -> anyhow::Result<Vec<Lane>> {
        let mut lanes = Vec::new();
        for lane in Lane::ALL.iter().copied() {
            if self
                .tenant_view(dedicated, lane, tenant_id, false)
                .await?
                .is_some()
            {
                lanes.push(lane);
            }
        }
        Ok(lanes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_queue_names_fit_sqs_and_map_back_to_their_tenant() {
        assert_eq!(tenant_prefix("fairlane", "acme"), "fairlane-t-acme");
        let long = "a".repeat(64);
        let hashed = tenant_prefix("fairlane", &long);
        assert!(hashed.starts_with("fairlane-th-"), "{hashed}");
        assert!(hashed.len() + LONGEST_SUFFIX <= MAX_QUEUE_NAME, "{hashed}");
        assert_ne!(hashed, tenant_prefix("fairlane", &"b".repeat(64)));
        for tenant in ["acme", "x-fast", "a-fast-high", "b_2"] {
            for lane in Lane::ALL.iter().copied() {
                let name = format!("{}-{lane}", tenant_prefix("fl", tenant));
                assert_eq!(
                    tenant_of_queue("fl", &name),
                    Some((tenant.to_owned(), lane))
                );
                for other in ["-high", "-low", "-dlq"] {
                    assert_eq!(tenant_of_queue("fl", &format!("{name}{other}")), None);
                }
            }
        }
        assert_eq!(tenant_of_queue("fl", "fl-fast"), None);
        assert_eq!(tenant_of_queue("fl", "fl-attention-fast"), None);
    }
}
