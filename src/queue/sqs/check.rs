//! `fairlane check-aws`: reads (never changes) the account's queues that
//! the configuration names and reports each way they differ from it.
//!
//! For both lanes, and for both lanes' attention queues: each class queue
//! and the DLQ exist; each class queue's redrive policy targets its lane's
//! DLQ with the lane's `max_receive_count` + 3 (`REDRIVE_MARGIN`); its visibility timeout is the
//! lane's and outlasts the longest provider timeout; its retention (and the
//! DLQ's) outlasts the longest retry backoff. For each SES provider of the
//! email pool: the identity that verifies its `from` (the address or its
//! domain) and its configuration set exist, and so does its events queue.

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::QueueAttributeName;

use super::lanes::{
    REDRIVE_MARGIN, class_queue_name, dlq_name, queue_attributes, redrive_receive_count,
};
use crate::config::{ProviderKind, Settings};
use crate::model::{Channel, Lane, Priority};

/// Every mismatch between the queues in the account and `settings`, in a
/// fixed order; empty when there is none. An error only when SQS cannot be
/// asked at all.
pub async fn check(settings: &Settings) -> anyhow::Result<Vec<String>> {
    let sqs = &settings.queue.sqs;
    let sdk_config = crate::aws::loader(
        Some(&sqs.region),
        sqs.endpoint_url.as_deref(),
        sqs.access_key_id.as_deref(),
        sqs.secret_access_key.as_ref(),
    )
    .load()
    .await;
    let client = Client::new(&sdk_config);
    let longest_call_secs = settings
        .providers
        .all()
        .map(|(_, entry)| {
            entry
                .settings
                .timeout_ms
                .map_or(crate::providers::DEFAULT_TIMEOUT.as_secs(), |ms| {
                    ms.div_ceil(1000)
                })
        })
        .max()
        .unwrap_or(0);
    let mut problems = Vec::new();
    let prefixes = [
        sqs.queue_prefix.clone(),
        format!("{}-attention", sqs.queue_prefix),
    ];
    for prefix in &prefixes {
        for lane in Lane::ALL.iter().copied() {
            check_lane(
                &client,
                settings,
                prefix,
                lane,
                longest_call_secs,
                &mut problems,
            )
            .await?;
        }
    }
    for (channel, entry) in settings.providers.all() {
        let (Channel::Email, ProviderKind::Ses(ses)) = (channel, &entry.settings.kind) else {
            continue;
        };
        check_ses(entry.name, ses, &mut problems).await?;
        if let Some(url) = &ses.events_queue_url {
            let found = client
                .get_queue_attributes()
                .queue_url(url)
                .attribute_names(QueueAttributeName::QueueArn)
                .send()
                .await;
            if found.is_err() {
                problems.push(format!(
                    "the SES events queue {url} of provider {:?} cannot be read (missing, or no permission)",
                    entry.name
                ));
            }
        }
    }
    Ok(problems)
}

/// The URL of queue `name`, or `None` when it does not exist.
async fn url_of(client: &Client, name: &str) -> anyhow::Result<Option<String>> {
    match client.get_queue_url().queue_name(name).send().await {
        Ok(output) => Ok(output.queue_url().map(str::to_owned)),
        Err(err)
            if err
                .as_service_error()
                .is_some_and(|e| e.is_queue_does_not_exist()) =>
        {
            Ok(None)
        }
        Err(err) => Err(anyhow::Error::new(err).context(format!("GetQueueUrl of {name}"))),
    }
}

async fn check_lane(
    client: &Client,
    settings: &Settings,
    prefix: &str,
    lane: Lane,
    longest_call_secs: u64,
    problems: &mut Vec<String>,
) -> anyhow::Result<()> {
    let lane_settings = settings.lanes.get(lane);
    let longest_backoff = settings.retry.max_delay_secs;
    let dlq = dlq_name(prefix, lane);
    let dlq_arn = match url_of(client, &dlq).await? {
        None => {
            problems.push(format!("missing queue {dlq} (the DLQ of lane {lane})"));
            None
        }
        Some(url) => {
            let attributes = queue_attributes(
                client,
                &url,
                &[
                    QueueAttributeName::QueueArn,
                    QueueAttributeName::MessageRetentionPeriod,
                ],
            )
            .await?;
            check_retention(&dlq, &attributes, longest_backoff, problems);
            attributes.get(&QueueAttributeName::QueueArn).cloned()
        }
    };
    for priority in Priority::ALL.iter().copied() {
        let name = class_queue_name(prefix, lane, priority);
        let Some(url) = url_of(client, &name).await? else {
            problems.push(format!(
                "missing queue {name} (lane {lane}, {priority} priority)"
            ));
            continue;
        };
        let attributes = queue_attributes(
            client,
            &url,
            &[
                QueueAttributeName::RedrivePolicy,
                QueueAttributeName::VisibilityTimeout,
                QueueAttributeName::MessageRetentionPeriod,
            ],
        )
        .await?;
        match attributes
            .get(&QueueAttributeName::RedrivePolicy)
            .and_then(|policy| serde_json::from_str::<serde_json::Value>(policy).ok())
        {
            None => problems.push(format!(
                "queue {name} has no redrive policy: messages that keep failing never reach {dlq}"
            )),
            Some(policy) => {
                let target = policy["deadLetterTargetArn"].as_str().unwrap_or("");
                if let Some(arn) = &dlq_arn
                    && target != arn
                {
                    problems.push(format!(
                        "queue {name} dead-letters to {target}, not to {dlq} ({arn})"
                    ));
                }
                let count = policy["maxReceiveCount"]
                    .as_u64()
                    .or_else(|| policy["maxReceiveCount"].as_str()?.parse().ok());
                let want = redrive_receive_count(lane_settings.max_receive_count);
                if count != Some(u64::from(want)) {
                    problems.push(format!(
                        "queue {name} has maxReceiveCount {}, not {want} (lanes.{lane}.max_receive_count {} + {REDRIVE_MARGIN}: fairlane dead-letters a message itself after max_receive_count receives, with its status)",
                        count.map_or("unset".to_owned(), |c| c.to_string()),
                        lane_settings.max_receive_count
                    ));
                }
            }
        }
        let visibility: Option<u64> = attributes
            .get(&QueueAttributeName::VisibilityTimeout)
            .and_then(|v| v.parse().ok());
        match visibility {
            Some(secs) if secs <= longest_call_secs => problems.push(format!(
                "queue {name} has a visibility timeout of {secs} s, no longer than the longest provider timeout ({longest_call_secs} s): a message could be received again while its call is still running"
            )),
            Some(secs) if secs != lane_settings.visibility_timeout_secs => {
                problems.push(format!(
                    "queue {name} has a visibility timeout of {secs} s, lanes.{lane}.visibility_timeout_secs is {}",
                    lane_settings.visibility_timeout_secs
                ))
            }
            _ => {}
        }
        check_retention(&name, &attributes, longest_backoff, problems);
    }
    Ok(())
}

fn check_retention(
    name: &str,
    attributes: &std::collections::HashMap<QueueAttributeName, String>,
    longest_backoff: u64,
    problems: &mut Vec<String>,
) {
    let retention: Option<u64> = attributes
        .get(&QueueAttributeName::MessageRetentionPeriod)
        .and_then(|v| v.parse().ok());
    if let Some(secs) = retention
        && secs <= longest_backoff
    {
        problems.push(format!(
            "queue {name} keeps messages {secs} s, no longer than the longest retry backoff (retry.max_delay_secs = {longest_backoff} s)"
        ));
    }
}

/// The SES identity of provider `name`'s `from` (the address, or else its domain)
/// and its configuration set.
async fn check_ses(
    name: &str,
    ses: &crate::config::SesSettings,
    problems: &mut Vec<String>,
) -> anyhow::Result<()> {
    let sdk_config = crate::aws::provider_config(ses, "SES").await?;
    let client = aws_sdk_sesv2::Client::new(&sdk_config);
    let from = ses.from.as_str();
    let mut candidates = vec![from.to_owned()];
    if let Some((_, domain)) = from.rsplit_once('@') {
        candidates.push(domain.to_owned());
    }
    let mut found = false;
    for identity in &candidates {
        if client
            .get_email_identity()
            .email_identity(identity)
            .send()
            .await
            .is_ok()
        {
            found = true;
            break;
        }
    }
    if !found {
        problems.push(format!(
            "provider {name:?}: no SES identity for {from} (neither the address nor its domain), or no permission to read it"
        ));
    }
    if let Some(set) = ses.configuration_set.as_deref() {
        let read = client
            .get_configuration_set()
            .configuration_set_name(set)
            .send()
            .await;
        match read {
            Ok(_) => {}
            // Answered 2xx but the body could not be read (moto's, for
            // one): the set is there.
            Err(err)
                if err
                    .raw_response()
                    .is_some_and(|raw| raw.status().is_success()) => {}
            Err(err)
                if err
                    .as_service_error()
                    .is_some_and(|e| e.is_not_found_exception()) =>
            {
                problems.push(format!(
                    "provider {name:?}: SES configuration set {set} is missing"
                ));
            }
            Err(err) => problems.push(format!(
                "provider {name:?}: SES configuration set {set} could not be read: {}",
                aws_sdk_sesv2::error::DisplayErrorContext(&err)
            )),
        }
    }
    Ok(())
}
