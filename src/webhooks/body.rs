//! What a webhook call posts: one event, or a batch of them for an
//! endpoint whose `max_events_per_call` is above 1.
//!
//! One event is the Standard Webhooks body, `{"type", "timestamp",
//! "data"}`, and its `webhook-id` is the event's id (`evt_…`), the same on
//! every attempt. A batch is `{"events": [{"id", "type", "timestamp",
//! "data"}, …]}`, in event order, and its `webhook-id` names its first and
//! last events (`evts_…_…`); a failed batch's events are tried again one
//! by one as they come due, so a later attempt may group them otherwise:
//! a receiver deduplicates by each event's `id`.

use crate::message::MessageView;
use crate::model::ms_to_rfc3339;
use crate::store::webhooks::DueCall;

/// One event, as the Standard Webhooks spec has it. Serialized straight
/// from the message's view, with no JSON tree between.
#[derive(serde::Serialize)]
struct Envelope<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    timestamp: String,
    data: &'a MessageView,
}

/// One event of a batch: the envelope with its id.
#[derive(serde::Serialize)]
struct BatchEvent<'a> {
    id: String,
    #[serde(flatten)]
    event: Envelope<'a>,
}

#[derive(serde::Serialize)]
struct Batch<'a> {
    events: Vec<BatchEvent<'a>>,
}

/// The id of one event in calls: `evt_{event id}`.
pub fn event_id(due: &DueCall) -> String {
    format!("evt_{}", due.event_id)
}

fn envelope<'a>(due: &'a DueCall, data: &'a MessageView) -> Envelope<'a> {
    Envelope {
        kind: &due.kind,
        timestamp: ms_to_rfc3339(due.created_at),
        data,
    }
}

/// The `webhook-id` and the body of a call carrying `events` (at least
/// one, in order): a batch when `batched`, else the first event alone.
pub fn of(events: &[(&DueCall, &MessageView)], batched: bool) -> anyhow::Result<(String, Vec<u8>)> {
    let Some(&(first, first_data)) = events.first() else {
        anyhow::bail!("a webhook call needs at least one event");
    };
    if !batched {
        let body = serde_json::to_vec(&envelope(first, first_data))?;
        return Ok((event_id(first), body));
    }
    let last = events.last().map_or(first, |(due, _)| due);
    let id = format!("evts_{}_{}", first.event_id, last.event_id);
    let batch = Batch {
        events: events
            .iter()
            .map(|&(due, data)| BatchEvent {
                id: event_id(due),
                event: envelope(due, data),
            })
            .collect(),
    };
    Ok((id, serde_json::to_vec(&batch)?))
}
