//! A validated message made ready for the store: its id, status row,
//! queue message (the delivery payload) and the answer it will get, built
//! once and shared by the single and the batch send.

use std::collections::BTreeMap;

use serde_json::Value;

use super::{Refused, SendAccepted};
use crate::message::{
    AttachmentOnMessage, DeliveryPayload, EmailHeader, MAX_PAYLOAD_BYTES, NewMessage,
    OutboundMessage, TemplateOnMessage, TemplateSend,
};
use crate::model::{Channel, Lane, MessageStatus, ms_to_rfc3339, now_ms};
use crate::store::AcceptEntry;
use crate::store::idempotency::StoredResponse;
use crate::store::messages::MessageRecord;
use crate::tenants::Caller;
use crate::unsubscribe::{Claim, Links};

/// One validated message on its way in: its entry for the store and the
/// answer it gets once durable.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub(crate) id: String,
    pub(crate) lane: Lane,
    pub(crate) channel: Channel,
    /// Due later: the SQS backend's scheduler (not the request) sends it.
    pub(crate) scheduled: bool,
    /// Its addresses, `to` and each copy: what it is charged.
    pub(crate) recipients: usize,
    /// The ids of the uploaded files it carries, to claim for it.
    pub(crate) attachments: Vec<String>,
    pub(crate) answer: SendAccepted,
    pub(crate) answer_body: String,
    pub(crate) entry: AcceptEntry,
}

/// What is left of a [`Prepared`] message once its entry went to the store:
/// enough to hand it to its lane and answer.
#[derive(Debug)]
pub(crate) struct Handed {
    pub(crate) id: String,
    pub(crate) tenant_id: String,
    pub(crate) lane: Lane,
    pub(crate) channel: Channel,
    pub(crate) answer_body: String,
    /// SQS mode, not scheduled: the message for the relay to send now.
    pub(crate) to_send: Option<OutboundMessage>,
    /// It claimed uploaded files (to free if its accept does not commit).
    pub(crate) files: bool,
}

impl Prepared {
    /// Makes the message's own idempotency record answer the claim `token`
    /// (see [`crate::store::idempotency::KeyClaim`]).
    pub(crate) fn claimed_as(&mut self, token: Option<String>) {
        for stored in &mut self.entry.idempotency {
            stored.claimed_as = token.clone();
        }
    }

    /// Splits off the store entry; the queue message is copied only where
    /// the relay sends it at once (SQS mode, not scheduled).
    pub(crate) fn into_parts(self, sqs: bool) -> (AcceptEntry, Handed) {
        let to_send = (sqs && !self.scheduled).then(|| self.entry.outbound.clone());
        let handed = Handed {
            id: self.id,
            tenant_id: self.entry.record.tenant_id.clone(),
            lane: self.lane,
            channel: self.channel,
            answer_body: self.answer_body,
            to_send,
            files: !self.attachments.is_empty(),
        };
        (self.entry, handed)
    }
}

/// `List-Unsubscribe` (the signed link for this message's tenant and
/// address, and the tenant's `mailto:`) and `List-Unsubscribe-Post`, or a
/// 422 when the service has no public URL to link to.
fn unsubscribe_headers(
    caller: &Caller,
    to: &str,
    message_id: &str,
    links: Option<&Links>,
) -> Result<[EmailHeader; 2], Refused> {
    let Some(links) = links else {
        return Err(Refused::Invalid(BTreeMap::from([(
            "unsubscribe".to_owned(),
            "one-click unsubscribe needs server.public_url, which this service does not set"
                .to_owned(),
        )])));
    };
    let url = links.url(&Claim {
        tenant_id: caller.tenant.id.clone(),
        incarnation: Some(caller.tenant.created_at),
        address: to.to_lowercase(),
        message_id: message_id.to_owned(),
        issued_at: Some(crate::model::now_ms()),
    });
    let mut value = format!("<{url}>");
    if let Some(mailto) = &caller.tenant.unsubscribe_mailto {
        value.push_str(&format!(", <mailto:{mailto}?subject=unsubscribe>"));
    }
    Ok([
        EmailHeader {
            name: "List-Unsubscribe".into(),
            value,
        },
        EmailHeader {
            name: "List-Unsubscribe-Post".into(),
            value: "List-Unsubscribe=One-Click".into(),
        },
    ])
}

/// What a message queues of its content: a send by template its template
/// and personalisation, not what they render to (checked by rendering
/// them once before this; delivery renders them again from the same
/// version), any other its text.
fn queued_content(
    template: Option<TemplateSend>,
    text: String,
) -> (Option<TemplateOnMessage>, String) {
    match template {
        Some(asked) => {
            let queued = TemplateOnMessage {
                id: asked.id,
                version: asked.version.unwrap_or(1),
                locale: asked.locale,
                personalisation: asked.personalisation,
            };
            (Some(queued), String::new())
        }
        None => (None, text),
    }
}

/// The message's producer span: its context travels in the payload, and
/// the consumer's span (on whichever instance) continues it.
fn created_span(
    id: &str,
    tenant_id: &str,
    lane: Lane,
    channel: Channel,
    priority: crate::model::Priority,
) -> tracing::Span {
    crate::telemetry::span!(
        "create",
        otel.name = %format!("create {}", lane.as_str()),
        otel.kind = "producer",
        messaging.system = "fairlane",
        messaging.operation.type = "create",
        messaging.operation.name = "create",
        messaging.destination.name = lane.as_str(),
        messaging.message.id = id,
        fairlane.tenant_id = tenant_id,
        fairlane.channel = channel.as_str(),
        fairlane.priority = priority.as_str(),
    )
}

/// The ids of the files a message carries, to claim, and their bytes in
/// all, to count (none without files).
fn files_of(files: &[AttachmentOnMessage]) -> (Vec<String>, Option<i64>) {
    let ids = files.iter().map(|file| file.id.clone()).collect();
    let bytes = (!files.is_empty()).then(|| files.iter().map(|file| file.size).sum());
    (ids, bytes)
}

/// A message's first row: `queued`, or `scheduled` when it is due later,
/// with what its payload says of it.
fn first_record(
    payload: &DeliveryPayload,
    lane: Lane,
    now: i64,
    send_at: Option<i64>,
    metadata: Option<serde_json::Map<String, Value>>,
    fragments: Option<u32>,
) -> MessageRecord {
    let (template_id, template_version) = payload
        .template
        .as_ref()
        .map(|t| (t.id.clone(), t.version))
        .unzip();
    let (_, attachment_bytes) = files_of(&payload.attachments);
    MessageRecord {
        id: payload.id.clone(),
        tenant_id: payload.tenant_id.clone(),
        channel: payload.channel,
        status: match send_at {
            Some(_) => MessageStatus::Scheduled,
            None => MessageStatus::Queued,
        },
        priority: payload.priority,
        lane,
        attempts: 0,
        reference: payload.reference.clone(),
        metadata: metadata.map(|m| Value::Object(m).to_string()),
        created_at: now,
        updated_at: now,
        sent_at: None,
        last_error: None,
        provider_message_id: None,
        send_at,
        test: payload.test,
        fragments,
        erased_at: None,
        provider: None,
        recipient: crate::store::suppressions::normalize(&payload.to).map(|(_, to)| to),
        gate_wait_ms: None,
        template_id,
        template_version,
        attachment_bytes,
    }
}

/// The answer a message's `Idempotency-Key` gives again, when it has one
/// (`remembered` is the key and the request's hash).
fn remembered_answer(
    caller: &Caller,
    remembered: Option<(String, String)>,
    id: &str,
    answer_body: &str,
    now: i64,
) -> Vec<StoredResponse> {
    Vec::from_iter(remembered.map(|(key, request_hash)| StoredResponse {
        tenant_id: caller.tenant.id.clone(),
        test: caller.test,
        key,
        request_hash,
        status_code: 202,
        response_body: answer_body.to_owned(),
        message_id: id.to_owned(),
        created_at: now,
        claimed_as: None,
    }))
}

/// The payload as the queue holds it, within [`MAX_PAYLOAD_BYTES`].
fn queue_body(payload: &DeliveryPayload) -> Result<String, Refused> {
    let body = serde_json::to_string(payload).map_err(anyhow::Error::from)?;
    if body.len() > MAX_PAYLOAD_BYTES {
        return Err(Refused::TooLarge(format!(
            "The message would take {} bytes in the queue; the limit is {MAX_PAYLOAD_BYTES}.",
            body.len()
        )));
    }
    Ok(body)
}

/// Builds the store entry and the answer of a validated message;
/// `remembered` is its `(Idempotency-Key, request hash)`.
pub(crate) fn prepare(
    caller: &Caller,
    message: NewMessage,
    remembered: Option<(String, String)>,
    links: Option<&Links>,
) -> Result<Prepared, Refused> {
    let tenant_id = caller.tenant.id.as_str();
    let lane = message.lane.unwrap_or(caller.plan.lane);
    let sender = crate::tenants::senders::choose(
        &caller.senders,
        message.sender_id.as_deref(),
        message.channel,
    )
    .map_err(|reason| Refused::Invalid(BTreeMap::from([("sender_id".to_owned(), reason)])))?;
    let id = uuid::Uuid::now_v7().to_string();
    let now = now_ms();
    let mut headers = message.headers;
    if message.channel == Channel::Email
        && message
            .unsubscribe
            .unwrap_or(caller.tenant.unsubscribe_default)
    {
        headers.extend(unsubscribe_headers(caller, &message.to, &id, links)?);
    }
    let fragments =
        (message.channel == Channel::Sms).then(|| crate::sms::fragments(&message.text).1);
    let created = created_span(&id, tenant_id, lane, message.channel, message.priority);
    let (template, text) = queued_content(message.template, message.text);
    let recipients = 1 + message.cc.len() + message.bcc.len();
    let payload = DeliveryPayload {
        id: id.clone(),
        tenant_id: tenant_id.to_owned(),
        channel: message.channel,
        to: message.to,
        subject: message.subject,
        text,
        html: message.html,
        cc: message.cc,
        bcc: message.bcc,
        priority: message.priority,
        reference: message.reference,
        sender: sender.map(crate::tenants::SenderIdentity::on_message),
        headers,
        test: caller.test,
        retrying: false,
        template,
        attachments: message.attachments,
        traceparent: crate::telemetry::traceparent_of(&created),
    };
    drop(created);
    let (attachment_ids, _) = files_of(&payload.attachments);
    let body = queue_body(&payload)?;
    let record = first_record(
        &payload,
        lane,
        now,
        message.send_at,
        message.metadata,
        fragments,
    );
    let status = record.status;
    let answer = SendAccepted {
        id: id.clone(),
        status,
        channel: message.channel,
        lane,
        priority: message.priority,
        send_at: message.send_at.map(ms_to_rfc3339),
        fragments,
        suppressed: message.suppressed,
    };
    let answer_body = serde_json::to_string(&answer).map_err(anyhow::Error::from)?;
    let delay = message.send_at.map_or(0, |at| (at - now).max(0) as u64);
    let entry = AcceptEntry {
        lane,
        record,
        outbound: OutboundMessage {
            message_id: id.clone(),
            tenant_id: tenant_id.to_owned(),
            channel: message.channel,
            priority: message.priority,
            body,
            // The embedded queue holds a scheduled message as a delayed one.
            delay: std::time::Duration::from_millis(delay),
        },
        idempotency: remembered_answer(caller, remembered, &id, &answer_body, now),
        trace: None,
    };
    Ok(Prepared {
        id,
        lane,
        channel: message.channel,
        scheduled: message.send_at.is_some(),
        recipients,
        attachments: attachment_ids,
        answer,
        answer_body,
        entry,
    })
}
