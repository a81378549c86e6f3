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
use crate::model::Lane;

/// Lane messages and dead letters are kept as long as SQS allows (14 days).
pub(super) const MAX_RETENTION_SECS: u32 = 1_209_600;

/// The SQS queues of one lane.
#[derive(Debug)]
pub(super) struct LaneQueues {
    pub(super) url: String,
    pub(super) arn: String,
    pub(super) dlq_url: String,
    /// Source of StartMessageMoveTask.
    pub(super) dlq_arn: String,
    /// Messages deleted through [`LaneQueue::delete_batch`], for the drain
    /// rate estimate.
    pub(super) deleted: AtomicU64,
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

/// Creates or looks up the queue and DLQ of `lane`.
pub(super) async fn open_lane(
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
