//! The SQS queues of a lane: created (with their attributes) or looked up
//! at start-up.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;

use anyhow::Context;
use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::QueueAttributeName;
use tracing::warn;

use super::batch::sdk_error;
use crate::config::{LanesSettings, SqsSettings};
use crate::model::{Lane, Priority};
use crate::queue::priority::CLASSES;

/// Lane messages and dead letters are kept as long as SQS allows (14 days).
pub(super) const MAX_RETENTION_SECS: u32 = 1_209_600;

/// The SQS queue of one priority class of a lane.
#[derive(Debug)]
pub(super) struct ClassQueue {
    pub(super) name: String,
    pub(super) url: String,
}

/// The SQS queues of one lane: one per priority class and the DLQ they
/// share.
#[derive(Debug)]
pub(super) struct LaneQueues {
    /// Indexed by [`Priority::rank`]: high, normal, low.
    pub(super) classes: [ClassQueue; CLASSES],
    pub(super) dlq_url: String,
    /// Messages deleted through [`crate::queue::LaneQueue::delete_batch`],
    /// for the drain rate estimate.
    pub(super) deleted: AtomicU64,
}

impl LaneQueues {
    /// The queue of `priority`'s class.
    pub(super) fn class(&self, priority: Priority) -> &ClassQueue {
        &self.classes[priority.rank()]
    }
}

/// The name of the queue that holds `lane`'s messages of `priority`. Normal
/// keeps the lane's original name (`{prefix}-{lane}`), so a deployment from
/// before priority classes keeps its normal traffic where it was.
pub(super) fn class_queue_name(prefix: &str, lane: Lane, priority: Priority) -> String {
    match priority {
        Priority::Normal => format!("{prefix}-{lane}"),
        other => format!("{prefix}-{lane}-{other}"),
    }
}

/// The name of `lane`'s dead-letter queue, shared by its class queues.
pub(super) fn dlq_name(prefix: &str, lane: Lane) -> String {
    format!("{prefix}-{lane}-dlq")
}

/// CreateQueue (idempotent without attributes), then SetQueueAttributes, so
/// an existing queue gets the configured attributes too.
pub(super) async fn create_queue(
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

pub(super) async fn queue_url(client: &Client, name: &str) -> anyhow::Result<String> {
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

pub(super) async fn queue_attributes(
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

pub(super) fn count(
    attributes: &HashMap<QueueAttributeName, String>,
    name: QueueAttributeName,
) -> u64 {
    attributes
        .get(&name)
        .and_then(|value| value.parse().ok())
        .unwrap_or(0)
}

/// Receives more than `max_receive_count` that SQS allows a message before
/// its redrive policy moves it to the DLQ on its own. The consumer
/// dead-letters a message received more than `max_receive_count` times
/// itself, its status written `dead_lettered` first (SQS's own move writes
/// no status, and a dead letter that says `queued` looks alive forever,
/// issue 67); the redrive policy stays as the backstop for a message the
/// consumer could not record, for these few receives more (a store outage
/// of about this many visibility timeouts).
pub const REDRIVE_MARGIN: u32 = 3;

/// The `maxReceiveCount` of a class queue's redrive policy for a lane of
/// `max_receive_count` (see [`REDRIVE_MARGIN`]).
pub fn redrive_receive_count(max_receive_count: u32) -> u32 {
    max_receive_count.saturating_add(REDRIVE_MARGIN)
}

/// Warns of each existing class queue whose redrive policy does not lead
/// to its lane's DLQ, or moves a message there before fairlane does (at
/// `max_receive_count` receives).
async fn check_redrive_policies(
    client: &Client,
    names: &[String; CLASSES],
    urls: &[String; CLASSES],
    dlq_name: &str,
    dlq_arn: &str,
    max_receive_count: u32,
) -> anyhow::Result<()> {
    for (name, url) in names.iter().zip(urls) {
        let policy = queue_attributes(client, url, &[QueueAttributeName::RedrivePolicy])
            .await?
            .remove(&QueueAttributeName::RedrivePolicy)
            .unwrap_or_default();
        if !policy.contains(dlq_arn) {
            warn!(queue = %name, dlq = %dlq_name, "The class queue does not dead-letter to its lane's DLQ; messages that keep failing will be redelivered until they expire.");
        }
        let redrive_at = serde_json::from_str::<serde_json::Value>(&policy)
            .ok()
            .and_then(|policy| {
                let count = &policy["maxReceiveCount"];
                count.as_u64().or_else(|| count.as_str()?.parse().ok())
            });
        if redrive_at.is_some_and(|at| at <= u64::from(max_receive_count)) {
            warn!(queue = %name, max_receive_count, redrive_at, expected = redrive_receive_count(max_receive_count), "The class queue's redrive policy moves messages to the DLQ before fairlane can: they keep the status `queued`. Set its maxReceiveCount to max_receive_count + 3 (fairlane check-aws).");
        }
    }
    Ok(())
}

/// Creates or looks up `lane`'s DLQ and its three class queues.
pub(super) async fn open_lane(
    client: &Client,
    settings: &SqsSettings,
    lanes: &LanesSettings,
    lane: Lane,
) -> anyhow::Result<LaneQueues> {
    let lane_settings = lanes.get(lane);
    let prefix = &settings.queue_prefix;
    let names: [String; CLASSES] =
        std::array::from_fn(|rank| class_queue_name(prefix, lane, Priority::ALL[rank]));
    let dlq_name = dlq_name(prefix, lane);
    let arn_only = [QueueAttributeName::QueueArn];
    let (urls, dlq_url) = if settings.create_queues {
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
            "maxReceiveCount": redrive_receive_count(lane_settings.max_receive_count),
        });
        let attributes = HashMap::from([
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
        ]);
        let (high, normal, low) = tokio::try_join!(
            create_queue(client, &names[0], attributes.clone()),
            create_queue(client, &names[1], attributes.clone()),
            create_queue(client, &names[2], attributes.clone()),
        )?;
        ([high, normal, low], dlq_url)
    } else {
        // One at a time, so the error names the first missing queue in a
        // fixed order (a deployment from before priority classes lacks
        // the high and low queues).
        let mut urls = Vec::with_capacity(CLASSES);
        for name in &names {
            urls.push(queue_url(client, name).await?);
        }
        let dlq_url = queue_url(client, &dlq_name).await?;
        let urls: [String; CLASSES] = urls.try_into().expect("one URL per class");
        let dlq_arn = queue_attributes(client, &dlq_url, &arn_only)
            .await?
            .remove(&QueueAttributeName::QueueArn)
            .with_context(|| format!("SQS queue {dlq_name} has no ARN"))?;
        check_redrive_policies(
            client,
            &names,
            &urls,
            &dlq_name,
            &dlq_arn,
            lane_settings.max_receive_count,
        )
        .await?;
        (urls, dlq_url)
    };
    let [high, normal, low] = urls;
    let [high_name, normal_name, low_name] = names;
    Ok(LaneQueues {
        classes: [
            ClassQueue {
                name: high_name,
                url: high,
            },
            ClassQueue {
                name: normal_name,
                url: normal,
            },
            ClassQueue {
                name: low_name,
                url: low,
            },
        ],
        dlq_url,
        deleted: AtomicU64::new(0),
    })
}
