//! What fairlane puts on and reads back from SQS: the message attributes
//! of a lane message or of a copy of one ([`Envelope`]), and a received
//! message parsed back from them ([`Parsed`]).

use std::time::Duration;

use aws_sdk_sqs::types::{
    Message, MessageAttributeValue, MessageSystemAttributeName, SendMessageBatchRequestEntry,
};

use super::MAX_DELAY_SECS;
use crate::model::{Channel, Priority};
use crate::queue::{OutboundMessage, ReceivedMessage};

/// Message attribute names.
pub(super) const ATTR_TENANT: &str = "tenant";
pub(super) const ATTR_CHANNEL: &str = "channel";
pub(super) const ATTR_PRIORITY: &str = "priority";
pub(super) const ATTR_MESSAGE_ID: &str = "message_id";
pub(super) const ATTR_ENQUEUED_AT: &str = "enqueued_at_ms";
pub(super) const ATTR_RECEIVE_COUNT: &str = "receive_count";

/// What is sent for one message: the message itself or a copy of one.
#[derive(Debug, Clone)]
pub(super) struct Envelope<'a> {
    pub(super) message_id: &'a str,
    pub(super) tenant_id: &'a str,
    pub(super) channel: Channel,
    pub(super) priority: Priority,
    pub(super) body: &'a str,
    pub(super) delay: Duration,
    /// Set on copies, so the first enqueue time survives.
    pub(super) enqueued_at_ms: Option<i64>,
    /// Set on dead-letter copies: receives in the lane.
    pub(super) receive_count: Option<u32>,
}

impl<'a> Envelope<'a> {
    pub(super) fn of(message: &'a OutboundMessage) -> Self {
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

    pub(super) fn copy_of(message: &'a ReceivedMessage, delay: Duration) -> Self {
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

    pub(super) fn attributes(&self) -> Vec<(&'static str, &'static str, String)> {
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
    pub(super) fn size(&self) -> usize {
        self.body.len()
            + self
                .attributes()
                .iter()
                .map(|(name, kind, value)| name.len() + kind.len() + value.len())
                .sum::<usize>()
    }

    pub(super) fn entry(&self, id: usize) -> anyhow::Result<SendMessageBatchRequestEntry> {
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
pub(super) struct Parsed {
    pub(super) message_id: String,
    pub(super) tenant_id: String,
    pub(super) channel: Channel,
    pub(super) priority: Priority,
    pub(super) body: String,
    pub(super) receipt: String,
    /// SQS's ApproximateReceiveCount.
    pub(super) receive_count: u32,
    pub(super) enqueued_at_ms: i64,
    /// The `receive_count` attribute of dead-letter copies.
    pub(super) lane_receive_count: Option<u32>,
}

impl Parsed {
    pub(super) fn from_sqs(message: &Message) -> Result<Self, String> {
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

    pub(super) fn into_received(self) -> ReceivedMessage {
        ReceivedMessage {
            receipt: self.receipt,
            message_id: self.message_id,
            tenant_id: self.tenant_id,
            channel: self.channel,
            priority: self.priority,
            body: self.body,
            receive_count: self.receive_count,
            enqueued_at_ms: self.enqueued_at_ms,
            status_at_receive: None,
            suppressed_at_receive: None,
            test: false,
        }
    }
}

/// Whole seconds of `duration`, rounded up (a delay is never shortened) and
/// capped at `max`.
pub(crate) fn ceil_secs(duration: Duration, max: u64) -> i32 {
    let secs = duration.as_secs() + u64::from(duration.subsec_nanos() > 0);
    secs.min(max) as i32
}
