//! The receipts a test key's message gets from the simulated provider.

use tracing::warn;

use super::Context;
use crate::message::DeliveryPayload;

/// A test key's message was "sent": its simulated receipts follow, in
/// order, through the same path as a provider's (status, event,
/// suppression, webhook).
pub(super) fn simulate_receipt(
    context: &Context,
    payload: &DeliveryPayload,
    provider_message_id: &str,
) {
    let receipts = simulated_receipts(payload, provider_message_id);
    let (db, writer) = (context.delivery.db.clone(), context.delivery.status.clone());
    tokio::spawn(async move {
        for receipt in receipts {
            if let Err(err) = crate::receipts::ingest(&db, &writer, &receipt).await {
                warn!(provider_message_id = %receipt.provider_message_id, error = %format!("{err:#}"), "Could not record a test message's simulated receipt.");
            }
        }
    });
}

/// The receipts the simulated provider "sends" for a message it took. An
/// SMS: delivered, or failed (undelivered) with the number suppressed. An
/// email, as SES reports per address: a delivery naming the recipients
/// (to, cc and bcc) that are not `bounced@`, then a permanent bounce naming
/// those that are, suppressed; the message ends `bounced` if any bounced.
fn simulated_receipts(
    message: &DeliveryPayload,
    provider_message_id: &str,
) -> Vec<crate::receipts::Receipt> {
    use crate::model::{Channel, MessageStatus};
    use crate::providers::simulated::{NAME, Outcome};
    use crate::receipts::{Receipt, ReportedRecipient};
    let receipt = |outcome: MessageStatus, detail: Option<&str>, to: Vec<String>| {
        let bounced = outcome != MessageStatus::Delivered;
        Receipt {
            provider: NAME.into(),
            provider_message_id: provider_message_id.to_owned(),
            message_id: Some(message.id.clone()),
            outcome: Some(outcome),
            event: outcome.as_str().to_owned(),
            detail: detail.map(str::to_owned),
            suppress: if bounced { to.clone() } else { Vec::new() },
            suppress_reason: bounced.then(|| "bounce".to_owned()),
            recipients: match message.channel {
                Channel::Email => to
                    .into_iter()
                    .map(|address| ReportedRecipient {
                        address,
                        detail: detail.map(str::to_owned),
                    })
                    .collect(),
                Channel::Sms => Vec::new(),
            },
        }
    };
    let bounces = |to: &String| Outcome::of(message.channel, to) == Outcome::Bounced;
    if message.channel == Channel::Sms {
        return vec![if bounces(&message.to) {
            receipt(
                MessageStatus::Failed,
                Some("undelivered, error 30005 (simulated)"),
                vec![message.to.clone()],
            )
        } else {
            receipt(MessageStatus::Delivered, None, Vec::new())
        }];
    }
    let (bounced, delivered): (Vec<String>, Vec<String>) = std::iter::once(&message.to)
        .chain(&message.cc)
        .chain(&message.bcc)
        .cloned()
        .partition(bounces);
    let mut receipts = Vec::new();
    if !delivered.is_empty() {
        receipts.push(receipt(MessageStatus::Delivered, None, delivered));
    }
    if !bounced.is_empty() {
        receipts.push(receipt(
            MessageStatus::Bounced,
            Some("Permanent: General (simulated)"),
            bounced,
        ));
    }
    receipts
}
