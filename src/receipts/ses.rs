//! Email receipts from SES: a configuration set (`providers.email.
//! configuration_set`, sent with every email) publishes events to an SNS
//! topic, the topic delivers them to an SQS queue, and fairlane long-polls
//! that queue (`providers.email.events_queue_url`). No public endpoint is
//! needed.
//!
//! A queue message is an SNS envelope (`{"Type": "Notification",
//! "Message": "<the SES event as JSON text>"}`), or the SES event itself
//! when the subscription has raw message delivery. Events are matched by
//! `mail.messageId`, the id SES answered the send with:
//!
//! | SES event | result |
//! |---|---|
//! | Delivery | `delivered` |
//! | Bounce, `bounceType` Permanent | `bounced`; the bounced addresses are suppressed |
//! | Bounce, Transient or Undetermined | event `transient_bounce`, no status change |
//! | Complaint | `complained`; the complaining addresses are suppressed |
//! | Reject, Rendering Failure | `failed` |
//! | DeliveryDelay | event `delivery_delayed` |
//! | Send, Open, Click, Subscription | ignored (deleted) |
//!
//! A message is deleted once its receipt is recorded or kept for a later
//! match; if the store cannot take it, it stays in the queue and comes back
//! after its visibility timeout.

use std::time::Duration;

use anyhow::Context;
use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::DeleteMessageBatchRequestEntry;
use serde_json::Value;
use tokio::sync::watch;
use tracing::{info, warn};

use super::{Receipt, ReportedRecipient, ingest};
use crate::config::ProviderSettings;
use crate::metrics as names;
use crate::model::MessageStatus;
use crate::store::{Db, Writer};

/// Reads a queue message's body. Ok(None) for an event that carries
/// nothing fairlane records; Err for a body that is not an SES event.
pub fn parse(body: &str) -> Result<Option<Receipt>, String> {
    let outer: Value = serde_json::from_str(body).map_err(|err| format!("not JSON: {err}"))?;
    // Through SNS the event is a JSON text in `Message`.
    let event: Value = match (outer.get("Type"), outer.get("Message")) {
        (Some(_), Some(Value::String(inner))) => serde_json::from_str(inner)
            .map_err(|err| format!("the SNS Message is not JSON: {err}"))?,
        _ => outer,
    };
    // Configuration sets write `eventType`; identity notifications
    // `notificationType`.
    let kind = event
        .get("eventType")
        .or_else(|| event.get("notificationType"))
        .and_then(Value::as_str)
        .ok_or("no eventType or notificationType")?;
    let id = event
        .pointer("/mail/messageId")
        .and_then(Value::as_str)
        .ok_or("no mail.messageId")?;
    // The message tag every send carries (see `providers::ses`).
    let message_id = event
        .pointer("/mail/tags/message_id/0")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let text = |pointer: &str| event.pointer(pointer).and_then(Value::as_str);
    let receipt = |outcome: Option<MessageStatus>, event: &str, detail: Option<String>| Receipt {
        // The poller that read it names its SES provider.
        provider: "ses".into(),
        provider_message_id: id.to_owned(),
        message_id: message_id.clone(),
        outcome,
        event: event.to_owned(),
        detail,
        suppress: Vec::new(),
        suppress_reason: None,
        recipients: Vec::new(),
    };
    let mut receipt = match kind {
        "Delivery" => receipt(
            Some(MessageStatus::Delivered),
            "delivered",
            text("/delivery/smtpResponse").map(str::to_owned),
        ),
        "Bounce" => {
            let bounce_type = text("/bounce/bounceType").unwrap_or("Undetermined");
            let sub_type = text("/bounce/bounceSubType").unwrap_or("");
            let diagnostic = event
                .pointer("/bounce/bouncedRecipients/0/diagnosticCode")
                .and_then(Value::as_str);
            let detail = match diagnostic {
                Some(code) => format!("{bounce_type} bounce ({sub_type}): {code}"),
                None => format!("{bounce_type} bounce ({sub_type})"),
            };
            if bounce_type == "Permanent" {
                let mut bounced = receipt(Some(MessageStatus::Bounced), "bounced", Some(detail));
                bounced.suppress_reason = Some("bounce".into());
                bounced
            } else {
                receipt(None, "transient_bounce", Some(detail))
            }
        }
        "Complaint" => {
            let feedback = text("/complaint/complaintFeedbackType").unwrap_or("unspecified");
            let mut complained = receipt(
                Some(MessageStatus::Complained),
                "complained",
                Some(format!("complaint: {feedback}")),
            );
            complained.suppress_reason = Some("complaint".into());
            complained
        }
        "Reject" => receipt(
            Some(MessageStatus::Failed),
            "failed",
            Some(format!(
                "rejected by SES: {}",
                text("/reject/reason").unwrap_or("no reason given")
            )),
        ),
        "Rendering Failure" => receipt(
            Some(MessageStatus::Failed),
            "failed",
            Some(format!(
                "rendering failure: {}",
                text("/failure/errorMessage").unwrap_or("no reason given")
            )),
        ),
        "DeliveryDelay" => receipt(
            None,
            "delivery_delayed",
            text("/deliveryDelay/delayType").map(|kind| format!("delayed: {kind}")),
        ),
        _ => return Ok(None),
    };
    name_recipients(&event, kind, &mut receipt);
    Ok(Some(receipt))
}

/// Puts in `receipt` the addresses its SES event of type `kind` names
/// (Reject and Rendering Failure name none: the whole message failed), and
/// for a hard bounce or a complaint the addresses to suppress: all of them.
fn name_recipients(event: &Value, kind: &str, receipt: &mut Receipt) {
    let list = match kind {
        "Delivery" => "/delivery/recipients",
        "Bounce" => "/bounce/bouncedRecipients",
        "Complaint" => "/complaint/complainedRecipients",
        "DeliveryDelay" => "/deliveryDelay/delayedRecipients",
        _ => return,
    };
    receipt.recipients = reported(event, list, &receipt.detail);
    if receipt.suppress_reason.is_some() {
        receipt.suppress = receipt
            .recipients
            .iter()
            .map(|recipient| recipient.address.clone())
            .collect();
    }
}

/// The addresses an event's `list` names, each with its own diagnostic
/// where SES gives one (else the report's `detail`).
fn reported(event: &Value, list: &str, detail: &Option<String>) -> Vec<ReportedRecipient> {
    let Some(entries) = event.pointer(list).and_then(Value::as_array) else {
        return Vec::new();
    };
    entries
        .iter()
        .filter_map(|entry| {
            // `delivery.recipients` lists bare addresses; the others
            // objects.
            let address = entry
                .as_str()
                .or_else(|| entry.get("emailAddress").and_then(Value::as_str))?;
            let own = entry.get("diagnosticCode").and_then(Value::as_str);
            Some(ReportedRecipient {
                address: address.to_owned(),
                detail: own.map(str::to_owned).or_else(|| detail.clone()),
            })
        })
        .collect()
}

/// Receives in flight at once.
const POLLS: usize = 4;

/// How long a receive waits for messages (SQS's longest long poll).
const WAIT_SECS: i32 = 20;

/// Polls the SES events queue until shutdown.
pub struct EventsPoller {
    client: Client,
    /// The SES provider's configured name: its events' receipts match only
    /// the messages it sent, and label its receipt metrics.
    name: String,
    /// `logging.log_addresses`: without it, addresses in a bounce's
    /// diagnostic (`550 5.1.1 <ada@example.com>…`) become `[address]`
    /// before the text is stored in the message's events and error.
    keep_addresses: bool,
    queue_url: String,
    db: Db,
    /// Receipts are recorded in the store writer's groups.
    writer: Writer,
}

impl EventsPoller {
    /// An SQS client for `settings.events_queue_url`, with the email
    /// provider's region, endpoint and credentials (the queue lives beside
    /// SES).
    pub async fn from_settings(
        name: &str,
        keep_addresses: bool,
        settings: &ProviderSettings,
        db: Db,
        writer: Writer,
    ) -> anyhow::Result<Option<Self>> {
        let Some(ses) = settings.kind.ses() else {
            return Ok(None);
        };
        let Some(queue_url) = ses.events_queue_url.clone() else {
            return Ok(None);
        };
        let sdk_config = crate::aws::provider_config(ses, "the SES events queue").await?;
        Ok(Some(EventsPoller {
            client: Client::new(&sdk_config),
            name: name.to_owned(),
            keep_addresses,
            queue_url,
            db,
            writer,
        }))
    }

    /// Receives, records and deletes until `shutdown` turns true, with
    /// [`POLLS`] long polls in flight, so a deep queue drains at several
    /// batches at a time (an idle queue costs one empty receive per poll
    /// and 20 s).
    pub async fn run(self, shutdown: watch::Receiver<bool>) {
        info!(queue = %self.queue_url, "Reading SES events.");
        futures_util::future::join_all((0..POLLS).map(|_| self.poll_until(shutdown.clone()))).await;
    }

    async fn poll_until(&self, mut shutdown: watch::Receiver<bool>) {
        let mut failures = 0u32;
        loop {
            let polled = tokio::select! {
                polled = self.poll_once() => polled,
                _ = shutdown.wait_for(|stop| *stop) => return,
            };
            match polled {
                Ok(()) => failures = 0,
                Err(err) => {
                    failures += 1;
                    let pause = Duration::from_secs(1u64 << failures.min(5));
                    warn!(error = %format!("{err:#}"), retry_in_secs = pause.as_secs(), "Could not read the SES events queue.");
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        _ = shutdown.wait_for(|stop| *stop) => return,
                    }
                }
            }
        }
    }

    /// One long poll: records what it received, all of it at once (so the
    /// receipts share the store writer's group), and deletes what was
    /// recorded in one call.
    pub async fn poll_once(&self) -> anyhow::Result<()> {
        let received = self
            .client
            .receive_message()
            .queue_url(&self.queue_url)
            .max_number_of_messages(10)
            .wait_time_seconds(WAIT_SECS)
            .send()
            .await
            .context("receiving from the SES events queue")?;
        let recorded = futures_util::future::join_all(
            received
                .messages()
                .iter()
                .map(|message| async move { (message, self.record(message).await) }),
        )
        .await;
        let mut entries = Vec::new();
        for (n, (message, done)) in recorded.into_iter().enumerate() {
            if let (true, Some(handle)) = (done, message.receipt_handle()) {
                entries.push(
                    DeleteMessageBatchRequestEntry::builder()
                        .id(n.to_string())
                        .receipt_handle(handle)
                        .build()
                        .context("a delete entry")?,
                );
            }
        }
        if entries.is_empty() {
            return Ok(());
        }
        let deleted = self
            .client
            .delete_message_batch()
            .queue_url(&self.queue_url)
            .set_entries(Some(entries))
            .send()
            .await
            .context("deleting from the SES events queue")?;
        for failed in deleted.failed() {
            warn!(code = %failed.code(), "An SES event could not be deleted; it comes back and is recognised as a duplicate.");
        }
        Ok(())
    }

    /// Records one events-queue message; true when it may be deleted.
    async fn record(&self, message: &aws_sdk_sqs::types::Message) -> bool {
        let body = message.body().unwrap_or_default();
        match parse(body) {
            Ok(Some(mut receipt)) => {
                receipt.provider = self.name.clone();
                if !self.keep_addresses {
                    let hide =
                        |text: String| crate::providers::without_addresses(&text).into_owned();
                    receipt.detail = receipt.detail.map(hide);
                    for recipient in &mut receipt.recipients {
                        recipient.detail = recipient.detail.take().map(hide);
                    }
                }
                self.ingest(&receipt).await
            }
            Ok(None) => {
                metrics::counter!(names::RECEIPTS_TOTAL, "provider" => self.name.clone(), "outcome" => "ignored").increment(1);
                true
            }
            Err(why) => {
                metrics::counter!(names::RECEIPTS_TOTAL, "provider" => self.name.clone(), "outcome" => "unreadable").increment(1);
                warn!(reason = %why, "An SES events queue message is not an SES event; deleting it.");
                true
            }
        }
    }

    /// Records one SES event's receipt; true when it may be deleted.
    async fn ingest(&self, receipt: &Receipt) -> bool {
        match ingest(&self.db, &self.writer, receipt).await {
            Ok(_) => true,
            Err(err) => {
                warn!(error = %format!("{err:#}"), "Could not record an SES event; it comes back after its visibility timeout.");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn through_sns(event: Value) -> String {
        json!({"Type": "Notification", "MessageId": "n1", "TopicArn": "arn:aws:sns:us-east-1:1:ses", "Message": event.to_string()}).to_string()
    }

    #[test]
    fn a_permanent_bounce_through_sns_bounces_and_suppresses_the_recipients() {
        let body = through_sns(json!({
            "eventType": "Bounce",
            "mail": {"messageId": "ses-1", "destination": ["a@example.com"]},
            "bounce": {"bounceType": "Permanent", "bounceSubType": "General",
                "bouncedRecipients": [{"emailAddress": "A@example.com", "diagnosticCode": "smtp; 550 no such user"}]}
        }));
        let receipt = parse(&body).unwrap().unwrap();
        assert_eq!(receipt.provider_message_id, "ses-1");
        assert_eq!(receipt.outcome, Some(MessageStatus::Bounced));
        assert_eq!(receipt.suppress, vec!["A@example.com".to_owned()]);
        assert_eq!(
            receipt.detail.as_deref(),
            Some("Permanent bounce (General): smtp; 550 no such user")
        );
    }

    #[test]
    fn the_message_id_tag_names_fairlanes_message() {
        let tagged = json!({
            "eventType": "Delivery",
            "mail": {"messageId": "ses-3", "destination": ["a@example.com"],
                "tags": {"tenant": ["acme"], "message_id": ["01J0000000000000000000000A"]}},
            "delivery": {"recipients": ["a@example.com"]}
        });
        let receipt = parse(&through_sns(tagged)).unwrap().unwrap();
        assert_eq!(
            receipt.message_id.as_deref(),
            Some("01J0000000000000000000000A")
        );
        let untagged = json!({
            "eventType": "Delivery",
            "mail": {"messageId": "ses-4", "destination": ["a@example.com"]},
            "delivery": {"recipients": ["a@example.com"]}
        });
        assert_eq!(
            parse(&through_sns(untagged)).unwrap().unwrap().message_id,
            None
        );
    }

    #[test]
    fn each_report_names_its_recipients_with_their_own_words() {
        let named = |event: Value| {
            parse(&through_sns(event))
                .unwrap()
                .unwrap()
                .recipients
                .into_iter()
                .map(|r| (r.address, r.detail))
                .collect::<Vec<_>>()
        };
        let mail = json!({"messageId": "ses-2", "destination": ["a@example.com", "b@example.com"]});
        let delivered = named(json!({
            "eventType": "Delivery", "mail": mail,
            "delivery": {"recipients": ["a@example.com", "b@example.com"], "smtpResponse": "250 ok"}
        }));
        let ok = Some("250 ok".to_owned());
        assert_eq!(
            delivered,
            [
                ("a@example.com".into(), ok.clone()),
                ("b@example.com".into(), ok)
            ]
        );
        let bounced = named(json!({
            "eventType": "Bounce", "mail": mail,
            "bounce": {"bounceType": "Permanent", "bounceSubType": "General", "bouncedRecipients": [
                {"emailAddress": "a@example.com", "diagnosticCode": "550 no such user"},
                {"emailAddress": "b@example.com"}]}
        }));
        assert_eq!(
            bounced,
            [
                ("a@example.com".into(), Some("550 no such user".into())),
                // No diagnostic of its own: the report's words.
                (
                    "b@example.com".into(),
                    Some("Permanent bounce (General): 550 no such user".into())
                ),
            ]
        );
        let delayed = named(json!({
            "eventType": "DeliveryDelay", "mail": mail,
            "deliveryDelay": {"delayType": "MailboxFull", "delayedRecipients": [{"emailAddress": "b@example.com"}]}
        }));
        assert_eq!(
            delayed,
            [("b@example.com".into(), Some("delayed: MailboxFull".into()))]
        );
        let rejected = named(json!({
            "eventType": "Reject", "mail": mail, "reject": {"reason": "Bad content"}
        }));
        assert!(rejected.is_empty(), "a rejection names no recipient");
    }

    #[test]
    fn a_transient_bounce_is_an_event_only_and_raw_delivery_is_read_too() {
        let raw = json!({"eventType": "Bounce", "mail": {"messageId": "ses-2"},
            "bounce": {"bounceType": "Transient", "bounceSubType": "MailboxFull", "bouncedRecipients": []}})
        .to_string();
        let receipt = parse(&raw).unwrap().unwrap();
        assert_eq!(
            (receipt.outcome, receipt.event.as_str()),
            (None, "transient_bounce")
        );
        assert!(receipt.suppress.is_empty());
    }

    #[test]
    fn complaints_deliveries_and_ignored_or_broken_events() {
        let complaint = parse(&through_sns(json!({"notificationType": "Complaint", "mail": {"messageId": "ses-3"},
            "complaint": {"complainedRecipients": [{"emailAddress": "b@example.com"}], "complaintFeedbackType": "abuse"}})))
        .unwrap()
        .unwrap();
        assert_eq!(complaint.outcome, Some(MessageStatus::Complained));
        assert_eq!(complaint.suppress_reason.as_deref(), Some("complaint"));
        let delivery =
            parse(&json!({"eventType": "Delivery", "mail": {"messageId": "ses-4"}}).to_string())
                .unwrap()
                .unwrap();
        assert_eq!(delivery.outcome, Some(MessageStatus::Delivered));
        assert_eq!(
            parse(&json!({"eventType": "Open", "mail": {"messageId": "x"}}).to_string()),
            Ok(None)
        );
        assert!(parse("not json").is_err());
        assert!(parse(&json!({"eventType": "Delivery"}).to_string()).is_err());
    }
}
