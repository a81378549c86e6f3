//! Tenant webhooks: each tenant may register one endpoint and the event
//! types it wants; fairlane POSTs every such event to it, signed to the
//! Standard Webhooks specification ([`sign`]).
//!
//! Delivery is durable: the calls to make are the tenant's events
//! themselves, which the store's lifecycle writes with each status change;
//! each endpoint keeps a position in them, and only a call that failed gets
//! a `webhook_deliveries` row (see `crate::store::webhooks`). [`dispatch`]
//! makes the calls: at least once, with the same
//! `webhook-id` on every attempt, in event order for each message, with
//! backoff, and with a bound on the calls to each tenant's endpoint so a
//! slow or dead endpoint delays only its own tenant. An endpoint that
//! fails for `webhooks.disable_after_secs` is disabled; its events are kept
//! as failed, listed by [`failing`], and sent again by [`redrive`].

mod body;
pub mod client;
pub mod dispatch;
pub mod endpoint;
pub mod sign;

use reqwest::Url;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use self::endpoint::EndpointPolicy;

use crate::model::{MessageStatus, ms_to_rfc3339, now_ms};
use crate::store::Db;
use crate::store::webhooks::Endpoint;
pub use crate::store::webhooks::Webhook;

/// A rotated-out secret keeps signing (beside the new one) this long.
pub const PREVIOUS_SECRET_GRACE_MS: i64 = 24 * 60 * 60 * 1000;

/// The event types a webhook can subscribe to: `message.{status}` for
/// every status a message can move to, except the moment of `sending`
/// and `scheduled`, which only an accept sets; and `message.unsubscribed`,
/// when a recipient unsubscribes with the message's one-click link.
pub fn event_types() -> Vec<String> {
    MessageStatus::ALL
        .iter()
        .filter(|status| !matches!(status, MessageStatus::Sending | MessageStatus::Scheduled))
        .map(|status| format!("message.{}", status.as_str()))
        .chain(std::iter::once("message.unsubscribed".to_owned()))
        .collect()
}

/// An event type a webhook may ask for (one of [`event_types`]), in the
/// OpenAPI document.
pub struct EventType;

impl utoipa::PartialSchema for EventType {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .enum_values(Some(event_types()))
            .into()
    }
}

impl ToSchema for EventType {}

/// Body of `PUT …/webhook`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WebhookInput {
    /// Where events are POSTed: an `https` URL (`http` only where the
    /// operator allows it), at most 2,048 characters, with no user name,
    /// password or control characters, whose host is, or resolves only to,
    /// public addresses. Stored as parsed (normalised).
    #[schema(format = "uri", min_length = 1, max_length = 2048)]
    pub url: String,
    /// Event types to send, e.g. `["message.delivered", "message.bounced"]`;
    /// at least one, each `message.{status}` for a status other than
    /// `scheduled` and `sending`.
    #[schema(value_type = Vec<EventType>, min_items = 1, max_items = 16)]
    pub events: Vec<String>,
    /// Events one call may carry, 1 to 100; 1 when absent. With 1 every
    /// call's body is one event (`{"type", "timestamp", "data"}`); with
    /// more, every call's body is a batch, `{"events": [{"id", "type",
    /// "timestamp", "data"}, …]}`, of the events due at once, in order,
    /// never two of one message. Receivers of batches deduplicate by each
    /// event's `id` (a retried event may come in another batch).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 100, default = 1)]
    pub max_events_per_call: Option<i64>,
}

/// The most events one webhook call may carry.
pub const MAX_EVENTS_PER_CALL: i64 = 100;

/// A webhook endpoint's settings and health.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct WebhookView {
    pub tenant_id: String,
    /// As parsed when it was set (normalised).
    #[schema(format = "uri")]
    pub url: String,
    pub events: Vec<String>,
    /// Events one call carries at most: 1, one event per call; more, a
    /// batch per call.
    pub max_events_per_call: i64,
    /// `active`, `failing` (its last call failed; retrying) or `disabled`
    /// (failed for `webhooks.disable_after_secs`; an admin redrive resumes it).
    pub state: String,
    /// RFC 3339: first failure of the current run of failures.
    pub failing_since: Option<String>,
    /// Why the last call failed, in general terms: `connection failed`,
    /// `timeout`, `HTTP <status>`, `address not allowed` (the host resolved
    /// to an internal address) or `URL not allowed`.
    pub last_error: Option<String>,
    /// RFC 3339.
    pub disabled_at: Option<String>,
    /// Events waiting to be delivered: the endpoint's backlog.
    pub pending: i64,
    /// Of the pending events, those whose (next) call is due now and not
    /// yet made: a retry scheduled for later and a call in flight are not
    /// counted.
    pub due: i64,
    /// RFC 3339: when the oldest pending event happened; how far behind
    /// the endpoint's calls are. Absent when nothing is pending.
    pub oldest_pending_at: Option<String>,
    /// Events given up on (kept for a redrive).
    pub failed: i64,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339.
    pub updated_at: String,
}

/// The answer that shows a signing secret: on creation and on rotation.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct WebhookWithSecret {
    #[serde(flatten)]
    pub webhook: WebhookView,
    /// `whsec_…`: verifies `webhook-signature` (Standard Webhooks). Shown
    /// only in this answer.
    pub secret: String,
}

/// A `PUT` body as checked: the URL as parsed, the event types as stored,
/// and the events per call.
pub struct Checked {
    pub url: Url,
    pub events: String,
    pub max_events_per_call: i64,
}

/// Checks a `PUT` body's form; Err names the field and what is wrong.
/// Where the URL leads is checked next, by
/// [`endpoint::EndpointPolicy::check_reachable`].
pub fn validate(
    input: &WebhookInput,
    policy: &EndpointPolicy,
) -> Result<Checked, (&'static str, String)> {
    let url = policy.parse(&input.url).map_err(|why| ("url", why))?;
    let per_call = input.max_events_per_call.unwrap_or(1);
    if !(1..=MAX_EVENTS_PER_CALL).contains(&per_call) {
        return Err((
            "max_events_per_call",
            format!("must be between 1 and {MAX_EVENTS_PER_CALL}; got {per_call}"),
        ));
    }
    if input.events.is_empty() {
        return Err(("events", "must name at least one event type".into()));
    }
    let known = event_types();
    let mut events: Vec<&str> = Vec::new();
    for event in &input.events {
        if !known.contains(event) {
            return Err((
                "events",
                format!(
                    "{event:?} is not an event type; known: {}",
                    known.join(", ")
                ),
            ));
        }
        if !events.contains(&event.as_str()) {
            events.push(event);
        }
    }
    Ok(Checked {
        url,
        events: format!(" {} ", events.join(" ")),
        max_events_per_call: per_call,
    })
}

/// The endpoint with its counts of pending and failed events.
pub async fn view(db: &Db, webhook: Webhook) -> anyhow::Result<WebhookView> {
    let counts = db
        .webhook_delivery_counts(&webhook.tenant_id, now_ms())
        .await?;
    let of = |state: &str| counts.iter().find(|count| count.state == state);
    let pending = of("pending");
    let state = if webhook.disabled_at.is_some() {
        "disabled"
    } else if webhook.failing_since.is_some() {
        "failing"
    } else {
        "active"
    };
    Ok(WebhookView {
        pending: pending.map_or(0, |count| count.count),
        due: pending.map_or(0, |count| count.due),
        oldest_pending_at: pending.and_then(|count| count.oldest).map(ms_to_rfc3339),
        failed: of("failed").map_or(0, |count| count.count),
        tenant_id: webhook.tenant_id,
        url: webhook.url,
        events: webhook
            .events
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
        max_events_per_call: webhook.max_events_per_call,
        state: state.into(),
        failing_since: webhook.failing_since.map(ms_to_rfc3339),
        last_error: webhook.last_error,
        disabled_at: webhook.disabled_at.map(ms_to_rfc3339),
        created_at: ms_to_rfc3339(webhook.created_at),
        updated_at: ms_to_rfc3339(webhook.updated_at),
    })
}

/// Sets the tenant's endpoint. A new endpoint gets a new secret (returned);
/// a changed one keeps its secret (None) and is enabled again, its failed
/// events pending once more.
pub async fn put(
    db: &Db,
    tenant_id: &str,
    checked: &Checked,
) -> anyhow::Result<(Webhook, Option<String>)> {
    let endpoint = Endpoint {
        url: checked.url.as_str(),
        events: &checked.events,
        max_events_per_call: checked.max_events_per_call,
    };
    Ok(db
        .put_webhook(tenant_id, &endpoint, sign::new_secret())
        .await?)
}

/// Gives the tenant's endpoint a new secret; the old one keeps signing
/// beside it for [`PREVIOUS_SECRET_GRACE_MS`]. None when there is no
/// endpoint.
pub async fn rotate(db: &Db, tenant_id: &str) -> anyhow::Result<Option<(Webhook, String)>> {
    Ok(db
        .rotate_webhook_secret(tenant_id, sign::new_secret(), PREVIOUS_SECRET_GRACE_MS)
        .await?)
}
