//! `POST /v1/messages` (the accept path) and `GET /v1/messages/{id}`.
//!
//! The accept path does no per-request I/O except the group commit: the
//! caller, tenant and plan come from memory, limits are in-memory buckets
//! (or one Redis script call with `limits.backend = "redis"`), lane depth is
//! a cached sample, and the status row, queue entry and idempotency record
//! are written together by the accept writer.

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use utoipa::ToSchema;

use super::error::{ApiError, LimitReason, Problem, insert_rate_headers};
use super::{ApiPath, AppState, json_value};
use crate::accept::AcceptEntry;
use crate::auth::TenantAuth;
use crate::limits::tenant::Refusal;
use crate::message::{DeliveryPayload, MAX_PAYLOAD_BYTES, validate};
use crate::metrics as names;
use crate::model::{Channel, Lane, MessageStatus, Priority, TenantStatus, ms_to_rfc3339, now_ms};
use crate::queue::OutboundMessage;
use crate::store::idempotency::{self, StoredResponse};
use crate::store::messages::{self, MessageRecord};

/// The send route (not subject to the request timeout; see `api::app`).
pub fn send_router() -> Router<AppState> {
    Router::new().route("/v1/messages", post(send_message))
}

/// The status route.
pub fn status_router() -> Router<AppState> {
    Router::new().route("/v1/messages/{id}", get(get_message))
}

/// The answer to an accepted send.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct SendAccepted {
    pub id: String,
    /// Always `queued` on acceptance.
    pub status: MessageStatus,
    pub channel: Channel,
    pub lane: Lane,
    pub priority: Priority,
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
    pub reference: Option<String>,
    /// The caller's metadata object.
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Value>,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339.
    pub updated_at: String,
    /// RFC 3339; set once the provider accepted the message.
    pub sent_at: Option<String>,
    pub last_error: Option<String>,
    /// The provider's id (SES MessageId, SMS sid).
    pub provider_message_id: Option<String>,
}

impl From<MessageRecord> for MessageView {
    fn from(record: MessageRecord) -> Self {
        MessageView {
            id: record.id,
            channel: record.channel,
            status: record.status,
            priority: record.priority,
            lane: record.lane,
            attempts: record.attempts,
            reference: record.reference,
            metadata: record.metadata.and_then(|m| serde_json::from_str(&m).ok()),
            created_at: ms_to_rfc3339(record.created_at),
            updated_at: ms_to_rfc3339(record.updated_at),
            sent_at: record.sent_at.map(ms_to_rfc3339),
            last_error: record.last_error,
            provider_message_id: record.provider_message_id,
        }
    }
}

/// Longest accepted `Idempotency-Key`.
const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let key = value.to_str().ok().map(str::trim).unwrap_or("");
    if key.is_empty()
        || key.len() > MAX_IDEMPOTENCY_KEY_LEN
        || !key.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(ApiError::BadRequest(format!(
            "Idempotency-Key header must be 1-{MAX_IDEMPOTENCY_KEY_LEN} visible ASCII characters."
        )));
    }
    Ok(Some(key.to_owned()))
}

/// SHA-256 of the request with object keys sorted, so the same request
/// with other whitespace or key order counts as the same.
fn request_hash(value: &Value) -> String {
    fn feed(hasher: &mut Sha256, value: &Value) {
        match value {
            Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().collect();
                keys.sort();
                hasher.update(b"{");
                for key in keys {
                    hasher.update(serde_json::to_string(key).unwrap_or_default().as_bytes());
                    hasher.update(b":");
                    feed(hasher, &map[key]);
                    hasher.update(b",");
                }
                hasher.update(b"}");
            }
            Value::Array(items) => {
                hasher.update(b"[");
                for item in items {
                    feed(hasher, item);
                    hasher.update(b",");
                }
                hasher.update(b"]");
            }
            scalar => hasher.update(scalar.to_string().as_bytes()),
        }
    }
    let mut hasher = Sha256::new();
    feed(&mut hasher, value);
    hex::encode(hasher.finalize())
}

/// Marks an idempotency key as being answered; unmarks it when dropped.
struct InFlightKey {
    state: AppState,
    slot: (String, String),
}

impl InFlightKey {
    fn claim(state: &AppState, tenant_id: &str, key: &str) -> Result<Self, ApiError> {
        let slot = (tenant_id.to_owned(), key.to_owned());
        let fresh = state
            .idempotency_in_flight
            .lock()
            .expect("idempotency lock")
            .insert(slot.clone());
        if !fresh {
            return Err(ApiError::Conflict(
                "A request with this Idempotency-Key is still being processed; retry when it has been answered.".into(),
            ));
        }
        Ok(InFlightKey {
            state: state.clone(),
            slot,
        })
    }
}

impl Drop for InFlightKey {
    fn drop(&mut self) {
        self.state
            .idempotency_in_flight
            .lock()
            .expect("idempotency lock")
            .remove(&self.slot);
    }
}

fn accepted_response(status: StatusCode, id: &str, body: String) -> Response {
    let mut response = (status, body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Ok(location) = HeaderValue::from_str(&format!("/v1/messages/{id}")) {
        headers.insert(header::LOCATION, location);
    }
    response
}

/// Send an email or SMS.
///
/// Answers 202 once the message is durably queued. With an `Idempotency-Key`
/// header, a repeat of the same request within 24 hours gets the same answer
/// and id; the same key with another body gets 422; a repeat while the first
/// is still being answered gets 409.
#[utoipa::path(
    post,
    path = "/v1/messages",
    tag = "messages",
    request_body(content = crate::message::SendMessageRequest, content_type = "application/json"),
    params(("Idempotency-Key" = Option<String>, Header, description = "Makes retries safe: 1-255 visible ASCII characters, remembered 24 h per tenant.")),
    responses(
        (status = 202, description = "Queued; poll the Location.", body = SendAccepted,
            headers(("Location" = String, description = "/v1/messages/{id}"),
                    ("RateLimit-Limit" = u32), ("RateLimit-Remaining" = u32), ("RateLimit-Reset" = u64),
                    ("Idempotent-Replayed" = String, description = "`true` when this is the stored answer to an earlier request with the same Idempotency-Key (then without RateLimit headers)."))),
        (status = 400, description = "Malformed JSON or header.", body = super::error::Problem, content_type = "application/problem+json"),
        (status = 401, description = "No or bad API key.", body = super::error::Problem, content_type = "application/problem+json",
            headers(("WWW-Authenticate" = String, description = "`Bearer`"))),
        (status = 403, description = "Tenant disabled.", body = super::error::Problem, content_type = "application/problem+json"),
        (status = 409, description = "Same Idempotency-Key still in flight.", body = super::error::Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body too large.", body = super::error::Problem, content_type = "application/problem+json"),
        (status = 415, description = "Content-Type is not JSON.", body = super::error::Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid fields (named in `errors`) or Idempotency-Key reused with another body.", body = super::error::Problem, content_type = "application/problem+json"),
        (status = 429, description = "Tenant rate, daily quota or lane high-water mark; see Retry-After.", body = super::error::Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u64, description = "Seconds"))),
        (status = 503, description = "Could not be made durable; nothing was queued. See Retry-After.", body = super::error::Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u64, description = "Seconds"))),
    ),
    security(("tenant_key" = []))
)]
pub async fn send_message(
    State(state): State<AppState>,
    TenantAuth(caller): TenantAuth,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let tenant_id = caller.tenant.id.as_str();
    if caller.tenant.status == TenantStatus::Disabled {
        return Err(ApiError::Forbidden(format!(
            "Tenant {tenant_id:?} is disabled; sends are refused until an admin re-enables it."
        )));
    }
    let value = json_value(&headers, body)?;
    let message = validate(&value).map_err(ApiError::Validation)?;

    let mut remembered = None;
    let _in_flight = match idempotency_key(&headers)? {
        None => None,
        Some(key) => {
            let hash = request_hash(&value);
            let guard = InFlightKey::claim(&state, tenant_id, &key)?;
            if let Some(stored) = idempotency::lookup(&state.db, tenant_id, &key, now_ms()).await? {
                if stored.request_hash != hash {
                    return Err(ApiError::IdempotencyMismatch(
                        "This Idempotency-Key was used within the last 24 hours with a different request body.".into(),
                    ));
                }
                let status =
                    StatusCode::from_u16(stored.status_code).unwrap_or(StatusCode::ACCEPTED);
                let mut response =
                    accepted_response(status, &stored.message_id, stored.response_body);
                response
                    .headers_mut()
                    .insert("idempotent-replayed", HeaderValue::from_static("true"));
                return Ok(response);
            }
            remembered = Some((key, hash));
            Some(guard)
        }
    };

    let lane = caller.plan.lane;
    let id = uuid::Uuid::now_v7().to_string();
    let now = now_ms();
    let payload = DeliveryPayload {
        id: id.clone(),
        tenant_id: tenant_id.to_owned(),
        channel: message.channel,
        to: message.to,
        subject: message.subject,
        text: message.text,
        html: message.html,
        priority: message.priority,
        reference: message.reference.clone(),
    };
    let body = serde_json::to_string(&payload).map_err(anyhow::Error::from)?;
    if body.len() > MAX_PAYLOAD_BYTES {
        return Err(ApiError::PayloadTooLarge(format!(
            "The message would take {} bytes in the queue; the limit is {MAX_PAYLOAD_BYTES}.",
            body.len()
        )));
    }
    if let Err(full) = state.backpressure.check(lane) {
        metrics::counter!(names::REJECTED_TOTAL, "reason" => "lane").increment(1);
        return Err(ApiError::TooManyRequests {
            reason: LimitReason::Lane,
            detail: format!(
                "Lane {} holds about {} messages, at or above its high-water mark of {}.",
                full.lane, full.depth, full.high_water_mark
            ),
            retry_after: full.retry_after,
            rate: None,
        });
    }
    let grant = match state.limits.admit(tenant_id, &caller.plan).await? {
        Ok(grant) => grant,
        Err(Refusal::Rate { retry_after, info }) => {
            metrics::counter!(names::REJECTED_TOTAL, "reason" => "rate").increment(1);
            return Err(ApiError::TooManyRequests {
                reason: LimitReason::Rate,
                detail: format!(
                    "Plan {:?} allows {} messages per second with bursts of {}.",
                    caller.plan.name, caller.plan.rate_per_second, caller.plan.burst
                ),
                retry_after,
                rate: Some(info),
            });
        }
        Err(Refusal::Quota { retry_after, quota }) => {
            metrics::counter!(names::REJECTED_TOTAL, "reason" => "quota").increment(1);
            return Err(ApiError::TooManyRequests {
                reason: LimitReason::Quota,
                detail: format!(
                    "The daily quota of {quota} messages is used up; it renews at 00:00 UTC."
                ),
                retry_after,
                rate: None,
            });
        }
    };

    let answer = SendAccepted {
        id: id.clone(),
        status: MessageStatus::Queued,
        channel: message.channel,
        lane,
        priority: message.priority,
    };
    let answer_body = serde_json::to_string(&answer).map_err(anyhow::Error::from)?;
    let entry = AcceptEntry {
        lane,
        record: MessageRecord {
            id: id.clone(),
            tenant_id: tenant_id.to_owned(),
            channel: message.channel,
            status: MessageStatus::Queued,
            priority: message.priority,
            lane,
            attempts: 0,
            reference: message.reference,
            metadata: message.metadata.map(|m| Value::Object(m).to_string()),
            created_at: now,
            updated_at: now,
            sent_at: None,
            last_error: None,
            provider_message_id: None,
        },
        outbound: OutboundMessage {
            message_id: id.clone(),
            tenant_id: tenant_id.to_owned(),
            channel: message.channel,
            priority: message.priority,
            body,
            delay: std::time::Duration::ZERO,
        },
        idempotency: remembered.map(|(key, request_hash)| StoredResponse {
            tenant_id: tenant_id.to_owned(),
            key,
            request_hash,
            status_code: StatusCode::ACCEPTED.as_u16(),
            response_body: answer_body.clone(),
            message_id: id.clone(),
            created_at: now,
        }),
    };
    let to_send = state.outbox.as_ref().map(|_| entry.outbound.clone());
    if let Err(failed) = state.writer.accept(entry).await {
        state.limits.release(tenant_id, &grant).await;
        return Err(ApiError::Unavailable {
            detail: "The message could not be queued durably; nothing was accepted.".into(),
            retry_after: failed.retry_after,
        });
    }
    if let (Some(outbox), Some(outbound)) = (&state.outbox, to_send) {
        // A failed send is answered 503 unless a consumer already has the
        // message (it reached SQS late): then it is delivered, so 202.
        if let Err(failed) = outbox.send(lane, outbound).await
            && outbox.reject(tenant_id, &id, &failed.reason).await
                == crate::outbox::Rejection::Rejected
        {
            state.limits.release(tenant_id, &grant).await;
            metrics::counter!(names::REJECTED_TOTAL, "reason" => "queue").increment(1);
            return Err(ApiError::Unavailable {
                detail: format!(
                    "The queue did not take the message ({}); nothing was accepted.",
                    failed.reason
                ),
                retry_after: failed.retry_after,
            });
        }
    }
    state.backpressure.record_accepted(lane, 1);
    metrics::counter!(names::ACCEPTED_TOTAL, "lane" => lane.as_str(), "channel" => message.channel.as_str())
        .increment(1);
    let mut response = accepted_response(StatusCode::ACCEPTED, &id, answer_body);
    insert_rate_headers(response.headers_mut(), &grant.info);
    Ok(response)
}

/// A message's status. Another tenant's id answers 404.
#[utoipa::path(
    get,
    path = "/v1/messages/{id}",
    tag = "messages",
    params(("id" = String, Path, description = "Message id from the 202 answer")),
    responses(
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 200, description = "The message's delivery status.", body = MessageView),
        (status = 401, description = "No or bad API key.", body = super::error::Problem, content_type = "application/problem+json",
            headers(("WWW-Authenticate" = String, description = "`Bearer`"))),
        (status = 404, description = "No message with this id for this tenant.", body = super::error::Problem, content_type = "application/problem+json"),
    ),
    security(("tenant_key" = []))
)]
pub async fn get_message(
    State(state): State<AppState>,
    TenantAuth(caller): TenantAuth,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<MessageView>, ApiError> {
    let record = messages::get_for_tenant(&state.db, &caller.tenant.id, &id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("No message {id:?} for this tenant.")))?;
    Ok(axum::Json(record.into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn request_hash_ignores_key_order_but_not_values() {
        let a = json!({"channel": "sms", "to": "+15551234567", "text": "hi", "metadata": {"a": 1, "b": 2}});
        let b = json!({"metadata": {"b": 2, "a": 1}, "text": "hi", "to": "+15551234567", "channel": "sms"});
        let c = json!({"channel": "sms", "to": "+15551234567", "text": "hi!", "metadata": {"a": 1, "b": 2}});
        assert_eq!(request_hash(&a), request_hash(&b));
        assert_ne!(request_hash(&a), request_hash(&c));
    }
}
