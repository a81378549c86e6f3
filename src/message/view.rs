//! A message's status row ([`MessageRecord`]) and its status as clients
//! and webhooks see it ([`MessageView`]).

use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use crate::model::{Channel, Lane, MessageStatus, Priority, ms_to_rfc3339, now_ms};

/// A message's status row.
#[derive(Debug, Clone, PartialEq)]
pub struct MessageRecord {
    pub id: String,
    pub tenant_id: String,
    pub channel: Channel,
    pub status: MessageStatus,
    pub priority: Priority,
    pub lane: Lane,
    pub attempts: u32,
    pub reference: Option<String>,
    /// The caller's metadata object as JSON text.
    pub metadata: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
    pub sent_at: Option<i64>,
    pub last_error: Option<String>,
    pub provider_message_id: Option<String>,
    /// When a scheduled message is due (ms); `None`: at once.
    pub send_at: Option<i64>,
    /// Sent with a test key: a simulated provider answers it.
    pub test: bool,
    /// SMS: the billed segments of its text (see [`crate::sms`]).
    pub fragments: Option<u32>,
    /// When retention erased its personal data (ms).
    pub erased_at: Option<i64>,
    /// The name of the provider last called for it (the one that sent it,
    /// once sent).
    pub provider: Option<String>,
    /// Its recipient, normalised (a lower-case email address or an E.164
    /// number); `None` once retention erased it.
    pub recipient: Option<String>,
    /// Sent: how long its last attempt waited for the provider's token (ms).
    pub gate_wait_ms: Option<i64>,
    /// Sent by template: its id and the version rendered.
    pub template_id: Option<String>,
    pub template_version: Option<u32>,
    /// Email: the bytes of the files it carries, if any.
    pub attachment_bytes: Option<i64>,
}

/// What a provider last reported of one recipient of an email
/// (`recipient_statuses`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecipientRecord {
    /// Lower case, as suppression lists keep it.
    pub address: String,
    pub status: String,
    pub detail: Option<String>,
    pub updated_at: i64,
}

/// One recipient's status, as its provider reported it.
#[derive(Debug, Serialize, ToSchema)]
pub struct RecipientView {
    /// The address, in lower case.
    pub address: String,
    /// `delivered`, `bounced`, `complained`, or a report that settles
    /// nothing: `transient_bounce`, `delivery_delayed`. A recipient moves
    /// only forward (delivered, then bounced or failed, then complained).
    pub status: String,
    /// The provider's words for this address: the receiving server's
    /// answer, a bounce's diagnostic (addresses in it shown as `[address]`
    /// unless `logging.log_addresses` is on).
    pub detail: Option<String>,
    /// RFC 3339: when the report was recorded.
    pub updated_at: String,
}

impl From<RecipientRecord> for RecipientView {
    fn from(record: RecipientRecord) -> Self {
        RecipientView {
            address: record.address,
            status: record.status,
            detail: record.detail,
            updated_at: ms_to_rfc3339(record.updated_at),
        }
    }
}

/// A message's delivery status.
#[derive(Debug, Serialize, ToSchema)]
pub struct MessageView {
    pub id: String,
    pub channel: Channel,
    pub status: MessageStatus,
    pub priority: Priority,
    pub lane: Lane,
    /// Provider calls made, the successful one included.
    pub attempts: u32,
    /// `null` when none was given; absent once retention erased it.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>, nullable)]
    pub reference: Option<Option<String>>,
    /// The caller's metadata object; `null` when none was given, absent
    /// once retention erased it.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>, nullable)]
    pub metadata: Option<Option<Value>>,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339.
    pub updated_at: String,
    /// RFC 3339; set once the provider accepted the message.
    pub sent_at: Option<String>,
    /// The last failure's reason; `null` when there was none, absent once
    /// retention erased it.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>, nullable)]
    pub last_error: Option<Option<String>>,
    /// The provider's id (SES MessageId, SMS sid).
    pub provider_message_id: Option<String>,
    /// RFC 3339: when a scheduled message is (or was) due.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub send_at: Option<String>,
    /// `true`: sent with a test key; a simulated provider answered it and
    /// no real message went out. Absent for live messages.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub test: bool,
    /// SMS: the segments its text is billed as (GSM-7: 160 characters in
    /// one, 153 per part; UCS-2: 70 and 67).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fragments: Option<u32>,
    /// RFC 3339: when retention erased the message's body, recipient,
    /// reference, metadata and error details (its tenant's
    /// `retention_days` after it was created). Absent until then.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub erased_at: Option<String>,
    /// The name of the provider (in the operator's configuration) that
    /// sent the message, or was last tried for it. Absent before the first
    /// provider call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// Sent by template: the template's id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template_id: Option<String>,
    /// Sent by template: the version it was rendered from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template_version: Option<u32>,
    /// Email with attachments: the bytes of its files in all (what usage
    /// counts; `GET /v1/attachments/{attachment_id}` counts the messages
    /// each went with).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attachment_bytes: Option<i64>,
    /// Email: each recipient's status as its provider reported it (SES
    /// reports per address), in address order. The message's `status` is
    /// the furthest any of them reached: one bounced recipient among
    /// delivered ones makes the message `bounced`. Absent before a report
    /// names a recipient, once retention erased the message, and in lists
    /// (`GET /v1/messages/{id}` shows it).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub recipients: Vec<RecipientView>,
}

impl From<MessageRecord> for MessageView {
    fn from(record: MessageRecord) -> Self {
        // A scheduled message that fell due waits in its lane like any
        // other: `queued` (the embedded queue holds it as a delayed entry
        // and changes no row when it falls due).
        let status = match (record.status, record.send_at) {
            (MessageStatus::Scheduled, Some(at)) if at <= now_ms() => MessageStatus::Queued,
            (status, _) => status,
        };
        // Erased fields are left out; fields never set are `null`.
        let kept = record.erased_at.is_none();
        MessageView {
            id: record.id,
            channel: record.channel,
            status,
            priority: record.priority,
            lane: record.lane,
            attempts: record.attempts,
            reference: kept.then_some(record.reference),
            metadata: kept.then(|| record.metadata.and_then(|m| serde_json::from_str(&m).ok())),
            created_at: ms_to_rfc3339(record.created_at),
            updated_at: ms_to_rfc3339(record.updated_at),
            sent_at: record.sent_at.map(ms_to_rfc3339),
            last_error: kept.then_some(record.last_error),
            provider_message_id: record.provider_message_id,
            send_at: record.send_at.map(ms_to_rfc3339),
            test: record.test,
            fragments: record.fragments,
            erased_at: record.erased_at.map(ms_to_rfc3339),
            provider: record.provider,
            template_id: record.template_id,
            template_version: record.template_version,
            attachment_bytes: record.attachment_bytes,
            recipients: Vec::new(),
        }
    }
}
