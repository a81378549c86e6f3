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
use crate::api::auth::TenantAuth;
use crate::limits::tenant::Refusal;
use crate::message::{DeliveryPayload, MAX_PAYLOAD_BYTES, NewMessage, validate};
use crate::metrics as names;
use crate::model::{Channel, Lane, MessageStatus, Priority, TenantStatus, ms_to_rfc3339, now_ms};
use crate::queue::OutboundMessage;
use crate::store::idempotency::{self, StoredResponse};
use crate::store::messages::{self, MessageRecord};
use crate::tenants::Caller;

/// The send route (not subject to the request timeout; see `api::app`).
pub fn send_router() -> Router<AppState> {
    Router::new().route("/v1/messages", post(send_message))
}

/// The status and cancel routes.
pub fn status_router() -> Router<AppState> {
    Router::new()
        .route("/v1/messages/{id}", get(get_message).delete(cancel_message))
        .route("/v1/messages", axum::routing::delete(cancel_by_reference))
}

/// The answer to an accepted send.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SendAccepted {
    pub id: String,
    /// `queued`, or `scheduled` with a `send_at` in the future.
    pub status: MessageStatus,
    pub channel: Channel,
    pub lane: Lane,
    pub priority: Priority,
    /// RFC 3339: when a scheduled message is due.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub send_at: Option<String>,
}

pub use crate::message::MessageView;

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
/// Answers 202 once the message is durably queued (or, with `send_at`,
/// durably scheduled). With an `Idempotency-Key` header, a repeat of the
/// same request within 24 hours gets the same answer and id; the same key
/// with another body gets 422; a repeat while the first is still being
/// answered gets 409.
#[utoipa::path(
    post,
    path = "/v1/messages",
    tag = "messages",
    request_body(content = crate::message::SendMessageRequest, content_type = "application/json"),
    params(("Idempotency-Key" = Option<String>, Header, description = "Makes retries safe: 1-255 visible ASCII characters, remembered 24 h per tenant.", min_length = 1, max_length = 255, pattern = r"^[!-~]+$")),
    responses(
        (status = 202, description = "Queued (or scheduled); poll the Location.", body = SendAccepted,
            headers(("Location" = String, description = "/v1/messages/{id}"),
                    ("RateLimit-Limit" = u32), ("RateLimit-Remaining" = u32), ("RateLimit-Reset" = u64),
                    ("Idempotent-Replayed" = String, description = "`true` when this is the stored answer to an earlier request with the same Idempotency-Key (then without RateLimit headers)."))),
        (status = 400, response = super::error::Malformed),
        (status = 401, response = super::error::TenantUnauthorized),
        (status = 403, response = super::error::TenantDisabled),
        (status = 409, response = super::error::IdempotencyInFlight),
        (status = 413, response = super::error::PayloadTooLarge),
        (status = 415, response = super::error::UnsupportedMediaType),
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
    refuse_disabled(&caller)?;
    let value = json_value(&headers, body)?;
    let message = validate(&value).map_err(ApiError::Validation)?;
    let tenant_id = caller.tenant.id.as_str();

    let mut remembered = None;
    let _in_flight = match idempotency_key(&headers)? {
        None => None,
        Some(key) => {
            let hash = request_hash(&value);
            let guard = InFlightKey::claim(&state, tenant_id, &key)?;
            if let Some(stored) = remembered_answer(&state, tenant_id, &key, &hash).await? {
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

    let prepared = prepare(&caller, message, remembered)?;
    let grant = admit(&state, &caller, prepared.lane).await?;
    let (entry, prepared) = prepared.into_parts(state.outbox.is_some());
    if let Err(failed) = state.writer.accept(entry).await {
        state.limits.release(tenant_id, &grant).await;
        return Err(ApiError::Unavailable {
            detail: "The message could not be queued durably; nothing was accepted.".into(),
            retry_after: failed.retry_after,
        });
    }
    if let Err(refused) = hand_to_lane(&state, &prepared).await {
        state.limits.release(tenant_id, &grant).await;
        return Err(refused);
    }
    counted_accepted(&state, &prepared);
    let mut response = accepted_response(StatusCode::ACCEPTED, &prepared.id, prepared.answer_body);
    insert_rate_headers(response.headers_mut(), &grant.info);
    Ok(response)
}

/// 403 for a disabled tenant: its sends are refused until re-enabled.
fn refuse_disabled(caller: &Caller) -> Result<(), ApiError> {
    if caller.tenant.status == TenantStatus::Disabled {
        return Err(ApiError::Forbidden(format!(
            "Tenant {:?} is disabled; sends are refused until an admin re-enables it.",
            caller.tenant.id
        )));
    }
    Ok(())
}

/// The answer remembered for `key` if its request had the same `hash`;
/// 422 if it had another.
async fn remembered_answer(
    state: &AppState,
    tenant_id: &str,
    key: &str,
    hash: &str,
) -> Result<Option<StoredResponse>, ApiError> {
    match idempotency::lookup(&state.db, tenant_id, key, now_ms()).await? {
        Some(stored) if stored.request_hash != hash => Err(ApiError::IdempotencyMismatch(
            "This Idempotency-Key was used within the last 24 hours with a different request body."
                .into(),
        )),
        stored => Ok(stored),
    }
}

/// One validated message on its way in: its entry for the store and the
/// answer it gets once durable.
#[derive(Debug)]
struct Prepared {
    id: String,
    lane: Lane,
    channel: Channel,
    /// Due later: the SQS backend's scheduler (not the request) sends it.
    scheduled: bool,
    answer: SendAccepted,
    answer_body: String,
    entry: AcceptEntry,
}

/// What is left of a [`Prepared`] message once its entry went to the store:
/// enough to hand it to its lane and answer.
#[derive(Debug)]
struct Handed {
    id: String,
    tenant_id: String,
    lane: Lane,
    channel: Channel,
    answer_body: String,
    /// SQS mode, not scheduled: the message for the request to send now.
    to_send: Option<OutboundMessage>,
}

impl Prepared {
    /// Splits off the store entry; the queue message is copied only where
    /// the request itself sends it (SQS mode, not scheduled).
    fn into_parts(self, sqs: bool) -> (AcceptEntry, Handed) {
        let to_send = (sqs && !self.scheduled).then(|| self.entry.outbound.clone());
        let handed = Handed {
            id: self.id,
            tenant_id: self.entry.record.tenant_id.clone(),
            lane: self.lane,
            channel: self.channel,
            answer_body: self.answer_body,
            to_send,
        };
        (self.entry, handed)
    }
}

/// Builds the store entry and the answer of a validated message;
/// `remembered` is its `(Idempotency-Key, request hash)`.
fn prepare(
    caller: &Caller,
    message: NewMessage,
    remembered: Option<(String, String)>,
) -> Result<Prepared, ApiError> {
    let tenant_id = caller.tenant.id.as_str();
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
    let status = match message.send_at {
        Some(_) => MessageStatus::Scheduled,
        None => MessageStatus::Queued,
    };
    let answer = SendAccepted {
        id: id.clone(),
        status,
        channel: message.channel,
        lane,
        priority: message.priority,
        send_at: message.send_at.map(ms_to_rfc3339),
    };
    let answer_body = serde_json::to_string(&answer).map_err(anyhow::Error::from)?;
    let delay = message.send_at.map_or(0, |at| (at - now).max(0) as u64);
    let entry = AcceptEntry {
        lane,
        record: MessageRecord {
            id: id.clone(),
            tenant_id: tenant_id.to_owned(),
            channel: message.channel,
            status,
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
            send_at: message.send_at,
        },
        outbound: OutboundMessage {
            message_id: id.clone(),
            tenant_id: tenant_id.to_owned(),
            channel: message.channel,
            priority: message.priority,
            body,
            // The embedded queue holds a scheduled message as a delayed one.
            delay: std::time::Duration::from_millis(delay),
        },
        idempotency: Vec::from_iter(remembered.map(|(key, request_hash)| StoredResponse {
            tenant_id: tenant_id.to_owned(),
            key,
            request_hash,
            status_code: StatusCode::ACCEPTED.as_u16(),
            response_body: answer_body.clone(),
            message_id: id.clone(),
            created_at: now,
        })),
    };
    Ok(Prepared {
        id,
        lane,
        channel: message.channel,
        scheduled: message.send_at.is_some(),
        answer,
        answer_body,
        entry,
    })
}

/// The lane's high-water mark and the tenant's rate and daily quota, in
/// that order: a refusal charges nothing.
async fn admit(
    state: &AppState,
    caller: &Caller,
    lane: Lane,
) -> Result<crate::limits::tenant::Grant, ApiError> {
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
    match state.limits.admit(&caller.tenant.id, &caller.plan).await? {
        Ok(grant) => Ok(grant),
        Err(Refusal::Rate { retry_after, info }) => {
            metrics::counter!(names::REJECTED_TOTAL, "reason" => "rate").increment(1);
            Err(ApiError::TooManyRequests {
                reason: LimitReason::Rate,
                detail: format!(
                    "Plan {:?} allows {} messages per second with bursts of {}.",
                    caller.plan.name, caller.plan.rate_per_second, caller.plan.burst
                ),
                retry_after,
                rate: Some(info),
            })
        }
        Err(Refusal::Quota { retry_after, quota }) => {
            metrics::counter!(names::REJECTED_TOTAL, "reason" => "quota").increment(1);
            Err(ApiError::TooManyRequests {
                reason: LimitReason::Quota,
                detail: format!(
                    "The daily quota of {quota} messages is used up; it renews at 00:00 UTC."
                ),
                retry_after,
                rate: None,
            })
        }
    }
}

/// SQS mode: sends a committed message to its lane (a scheduled one waits
/// for the scheduler instead). A failed send is a 503 unless a consumer
/// already has the message (it reached SQS late): then it is delivered.
async fn hand_to_lane(state: &AppState, handed: &Handed) -> Result<(), ApiError> {
    let (Some(outbox), Some(message)) = (&state.outbox, &handed.to_send) else {
        return Ok(());
    };
    if let Err(failed) = outbox.send(handed.lane, message.clone()).await
        && outbox
            .reject(&handed.tenant_id, &handed.id, &failed.reason)
            .await
            == crate::accept::outbox::Rejection::Rejected
    {
        metrics::counter!(names::REJECTED_TOTAL, "reason" => "queue").increment(1);
        return Err(ApiError::Unavailable {
            detail: format!(
                "The queue did not take the message ({}); nothing was accepted.",
                failed.reason
            ),
            retry_after: failed.retry_after,
        });
    }
    Ok(())
}

fn counted_accepted(state: &AppState, handed: &Handed) {
    tracing::debug!(message_id = %handed.id, tenant = %handed.tenant_id, channel = handed.channel.as_str(), lane = handed.lane.as_str(), "Message accepted.");
    state.backpressure.record_accepted(handed.lane, 1);
    metrics::counter!(names::ACCEPTED_TOTAL, "lane" => handed.lane.as_str(), "channel" => handed.channel.as_str())
        .increment(1);
}

/// Most messages in one batch.
pub const MAX_BATCH: usize = 1000;

/// A batch of sends.
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub struct SendBatchRequest {
    /// 1-1000 send requests, each as for `POST /v1/messages`, each with an
    /// optional `idempotency_key` of its own (1-255 visible ASCII
    /// characters, remembered 24 h like the header).
    #[schema(min_items = 1, max_items = 1000)]
    messages: Vec<crate::message::SendMessageRequest>,
}

/// The outcome of one message of a batch, in the batch's order.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct BatchItemResult {
    /// Position in the request's `messages`.
    pub index: usize,
    /// What a single send would have answered: 202, or the refusal's status.
    pub status: u16,
    /// Set when accepted (202).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<SendAccepted>,
    /// Set when refused: the problem a single send would have answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<super::error::Problem>)]
    pub problem: Option<Value>,
    /// For a 429 or 503: seconds to wait before sending this one again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
    /// True when this is the stored answer to an earlier send with the same
    /// item `idempotency_key`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replayed: bool,
}

/// The answer to a batch.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct BatchAccepted {
    /// Messages accepted (202).
    pub accepted: usize,
    /// Messages refused.
    pub refused: usize,
    pub results: Vec<BatchItemResult>,
}

/// The batch route.
pub fn batch_router() -> Router<AppState> {
    Router::new().route("/v1/messages/batch", post(send_batch))
}

/// Send up to 1,000 messages at once.
///
/// Each message is validated, rate-limited and charged to the daily quota
/// on its own, and the batch is admitted **partially**: the results list,
/// in order, a 202-like entry for each accepted message and the problem a
/// single send would have answered for each refused one (422 invalid, 429
/// over the rate, quota or lane mark, with its own `retry_after`). All the
/// accepted messages are made durable in one transaction. The batch's
/// `Idempotency-Key` replays the whole answer; an item's `idempotency_key`
/// replays that item.
#[utoipa::path(
    post,
    path = "/v1/messages/batch",
    tag = "messages",
    request_body(content = SendBatchRequest, content_type = "application/json"),
    params(("Idempotency-Key" = Option<String>, Header, description = "Makes a retry of the whole batch safe: 1-255 visible ASCII characters, remembered 24 h per tenant.", min_length = 1, max_length = 255, pattern = r"^[!-~]+$")),
    responses(
        (status = 200, description = "Per-message results, in order; see each `status`.", body = BatchAccepted,
            headers(("Idempotent-Replayed" = String, description = "`true` when this is the stored answer to an earlier batch with the same Idempotency-Key."))),
        (status = 400, response = super::error::Malformed),
        (status = 401, response = super::error::TenantUnauthorized),
        (status = 403, response = super::error::TenantDisabled),
        (status = 409, response = super::error::IdempotencyInFlight),
        (status = 413, response = super::error::PayloadTooLarge),
        (status = 415, response = super::error::UnsupportedMediaType),
        (status = 422, description = "Not a batch: `messages` missing, empty, longer than 1000 or not a list; or Idempotency-Key reused with another body.", body = super::error::Problem, content_type = "application/problem+json"),
        (status = 503, description = "The accepted messages could not be made durable; nothing was accepted. See Retry-After.", body = super::error::Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u64, description = "Seconds"))),
    ),
    security(("tenant_key" = []))
)]
pub async fn send_batch(
    State(state): State<AppState>,
    TenantAuth(caller): TenantAuth,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    refuse_disabled(&caller)?;
    let value = json_value(&headers, body)?;
    let items = batch_items(&value)?;
    let tenant_id = caller.tenant.id.as_str();

    let mut batch_key = None;
    let _batch_in_flight = match idempotency_key(&headers)? {
        None => None,
        Some(key) => {
            let hash = request_hash(&value);
            let guard = InFlightKey::claim(&state, tenant_id, &key)?;
            if let Some(stored) = remembered_answer(&state, tenant_id, &key, &hash).await? {
                let mut response = json_response(StatusCode::OK, stored.response_body);
                response
                    .headers_mut()
                    .insert("idempotent-replayed", HeaderValue::from_static("true"));
                return Ok(response);
            }
            batch_key = Some((key, hash));
            Some(guard)
        }
    };

    // Each item: validated, replayed, or admitted and prepared.
    let mut results: Vec<Option<BatchItemResult>> = Vec::with_capacity(items.len());
    let mut admitted = Vec::new();
    let mut item_guards = Vec::new();
    for (index, item) in items.iter().enumerate() {
        match admit_item(&state, &caller, item).await {
            Ok(ItemOutcome::Replayed(result)) => {
                results.push(Some(BatchItemResult { index, ..result }))
            }
            Ok(ItemOutcome::Admitted(prepared, grant, guard)) => {
                results.push(None);
                item_guards.extend(guard);
                admitted.push((index, *prepared, grant));
            }
            Err(refused) => results.push(Some(refused_item(index, &refused))),
        }
    }

    // The answer as it will read if every admitted message is accepted;
    // remembered under the batch's key in the same transaction.
    for (index, prepared, _) in &admitted {
        results[*index] = Some(accepted_item(*index, &prepared.answer));
    }
    let answer = batch_answer(&results);
    let answer_body = serde_json::to_string(&answer).map_err(anyhow::Error::from)?;
    let sqs = state.outbox.is_some();
    let (mut entries, admitted): (Vec<AcceptEntry>, Vec<_>) = admitted
        .into_iter()
        .map(|(index, prepared, grant)| {
            let (entry, handed) = prepared.into_parts(sqs);
            (entry, (index, handed, grant))
        })
        .unzip();
    if let (Some((key, request_hash)), Some(first)) = (batch_key.clone(), entries.first_mut()) {
        first.idempotency.push(StoredResponse {
            tenant_id: tenant_id.to_owned(),
            key,
            request_hash,
            status_code: StatusCode::OK.as_u16(),
            response_body: answer_body.clone(),
            message_id: first.record.id.clone(),
            created_at: now_ms(),
        });
    }
    if let Err(failed) = state.writer.accept_all(entries).await {
        for (_, _, grant) in &admitted {
            state.limits.release(tenant_id, grant).await;
        }
        return Err(ApiError::Unavailable {
            detail: "The batch could not be queued durably; nothing was accepted.".into(),
            retry_after: failed.retry_after,
        });
    }

    // SQS mode: each message to its lane; one SQS did not take is refused
    // on its own (503), and the remembered answer is corrected.
    // Polled together, so the outbox batcher coalesces them into batch calls.
    let handed = futures_util::future::join_all(
        admitted
            .iter()
            .map(|(_, handed, _)| hand_to_lane(&state, handed)),
    )
    .await;
    let mut corrected = false;
    for ((index, message, grant), outcome) in admitted.iter().zip(handed) {
        match outcome {
            Ok(()) => counted_accepted(&state, message),
            Err(refused) => {
                state.limits.release(tenant_id, grant).await;
                results[*index] = Some(refused_item(*index, &refused));
                corrected = true;
            }
        }
    }
    let answer = batch_answer(&results);
    let body = serde_json::to_string(&answer).map_err(anyhow::Error::from)?;
    if corrected && let Some((key, _)) = &batch_key {
        idempotency::replace_answer(&state.db, tenant_id, key, &body).await?;
    }
    drop(item_guards);
    Ok(json_response(StatusCode::OK, body))
}

/// The `messages` of a batch body, or 422 naming what is wrong.
fn batch_items(value: &Value) -> Result<&Vec<Value>, ApiError> {
    let Value::Object(object) = value else {
        return Err(ApiError::field(
            "body",
            "must be a JSON object with a `messages` list",
        ));
    };
    if let Some(other) = object.keys().find(|key| key.as_str() != "messages") {
        return Err(ApiError::field(
            other,
            "unknown field; a batch has only `messages`",
        ));
    }
    match object.get("messages") {
        Some(Value::Array(items)) if items.is_empty() => Err(ApiError::field(
            "messages",
            "must hold at least one message",
        )),
        Some(Value::Array(items)) if items.len() > MAX_BATCH => Err(ApiError::field(
            "messages",
            format!("must hold at most {MAX_BATCH} messages"),
        )),
        Some(Value::Array(items)) => Ok(items),
        Some(_) => Err(ApiError::field(
            "messages",
            "must be a list of send requests",
        )),
        None => Err(ApiError::field("messages", "is required")),
    }
}

enum ItemOutcome {
    /// The stored answer to an earlier send with the item's key.
    Replayed(BatchItemResult),
    /// Admitted: to be made durable, with its limit grant and the hold on
    /// its idempotency key.
    Admitted(
        Box<Prepared>,
        crate::limits::tenant::Grant,
        Option<InFlightKey>,
    ),
}

/// One item of a batch through the single send's checks, in its order.
async fn admit_item(
    state: &AppState,
    caller: &Caller,
    item: &Value,
) -> Result<ItemOutcome, ApiError> {
    let tenant_id = caller.tenant.id.as_str();
    let mut item = item.clone();
    let key = match &mut item {
        Value::Object(object) => match object.remove("idempotency_key") {
            None | Some(Value::Null) => None,
            Some(Value::String(key))
                if !key.is_empty()
                    && key.len() <= MAX_IDEMPOTENCY_KEY_LEN
                    && key.bytes().all(|b| b.is_ascii_graphic()) =>
            {
                Some(key)
            }
            Some(_) => {
                return Err(ApiError::field(
                    "idempotency_key",
                    format!("must be 1-{MAX_IDEMPOTENCY_KEY_LEN} visible ASCII characters"),
                ));
            }
        },
        _ => None,
    };
    let message = validate(&item).map_err(ApiError::Validation)?;
    let (remembered, guard) = match key {
        None => (None, None),
        Some(key) => {
            let hash = request_hash(&item);
            let guard = InFlightKey::claim(state, tenant_id, &key)?;
            if let Some(stored) = remembered_answer(state, tenant_id, &key, &hash).await? {
                let message: SendAccepted =
                    serde_json::from_str(&stored.response_body).map_err(anyhow::Error::from)?;
                return Ok(ItemOutcome::Replayed(BatchItemResult {
                    replayed: true,
                    ..accepted_item(0, &message)
                }));
            }
            (Some((key, hash)), Some(guard))
        }
    };
    let prepared = prepare(caller, message, remembered)?;
    let grant = admit(state, caller, prepared.lane).await?;
    Ok(ItemOutcome::Admitted(Box::new(prepared), grant, guard))
}

fn accepted_item(index: usize, answer: &SendAccepted) -> BatchItemResult {
    BatchItemResult {
        index,
        status: StatusCode::ACCEPTED.as_u16(),
        message: Some(answer.clone()),
        problem: None,
        retry_after: None,
        replayed: false,
    }
}

fn refused_item(index: usize, refused: &ApiError) -> BatchItemResult {
    if let ApiError::Internal(err) = refused {
        tracing::error!(error = %format!("{err:#}"), "A batch item failed with an internal error.");
    }
    BatchItemResult {
        index,
        status: refused.status().as_u16(),
        message: None,
        problem: serde_json::to_value(refused.problem()).ok(),
        retry_after: refused.retry_after().map(crate::limits::retry_after_secs),
        replayed: false,
    }
}

fn batch_answer(results: &[Option<BatchItemResult>]) -> BatchAccepted {
    let results: Vec<BatchItemResult> = results
        .iter()
        .flatten()
        .map(|result| BatchItemResult {
            message: result.message.clone(),
            problem: result.problem.clone(),
            ..*result
        })
        .collect();
    let accepted = results.iter().filter(|r| r.status == 202).count();
    BatchAccepted {
        accepted,
        refused: results.len() - accepted,
        results,
    }
}

fn json_response(status: StatusCode, body: String) -> Response {
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
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
        (status = 401, response = super::error::TenantUnauthorized),
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

/// Cancel a message that has not been sent yet.
///
/// A `scheduled`, `queued` or `retrying` message becomes `cancelled` and is
/// never sent, even if a consumer already holds a copy. Once it is being
/// sent or has ended, the answer is 409 naming its status.
#[utoipa::path(
    delete,
    path = "/v1/messages/{id}",
    tag = "messages",
    params(("id" = String, Path, description = "Message id from the 202 answer")),
    responses(
        (status = 200, description = "Cancelled: the message's status, now `cancelled`.", body = MessageView),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = super::error::TenantUnauthorized),
        (status = 404, description = "No message with this id for this tenant.", body = super::error::Problem, content_type = "application/problem+json"),
        (status = 409, description = "Too late: the message is being sent or has ended; `detail` names its status.", body = super::error::Problem, content_type = "application/problem+json"),
    ),
    security(("tenant_key" = []))
)]
pub async fn cancel_message(
    State(state): State<AppState>,
    TenantAuth(caller): TenantAuth,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<MessageView>, ApiError> {
    let tenant_id = caller.tenant.id.as_str();
    let not_found = || ApiError::NotFound(format!("No message {id:?} for this tenant."));
    messages::get_for_tenant(&state.db, tenant_id, &id)
        .await?
        .ok_or_else(not_found)?;
    let cancelled = state.writer.cancel(tenant_id, vec![id.clone()]).await?;
    let record = messages::get_for_tenant(&state.db, tenant_id, &id)
        .await?
        .ok_or_else(not_found)?;
    // Only this call's cancel counts: a message cancelled before is ended.
    if cancelled.is_empty() {
        return Err(ApiError::Conflict(format!(
            "Message {id:?} is {}; only scheduled, queued or retrying messages can be cancelled.",
            record.status.as_str()
        )));
    }
    tracing::info!(tenant = %tenant_id, message_id = %id, "Message cancelled.");
    Ok(axum::Json(record.into()))
}

/// Which messages to cancel by reference.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct CancelQuery {
    /// Cancels every message of this tenant with this `reference` that has
    /// not been sent yet (1-255 characters).
    #[param(min_length = 1, max_length = 255)]
    pub reference: String,
}

/// How many messages a cancel by reference cancelled.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct CancelResult {
    pub cancelled: usize,
    /// Messages with the reference that were already being sent or had
    /// ended, and so were left as they are.
    pub not_cancelled: usize,
}

/// Most messages one cancel by reference looks at.
const MAX_CANCEL_BY_REFERENCE: i64 = 10_000;

/// Cancel every unsent message with a reference.
///
/// For a batch sent with one `reference`: each of the tenant's messages
/// with it that is `scheduled`, `queued` or `retrying` becomes `cancelled`
/// (at most 10,000 per call; call again while `cancelled` is 10,000).
#[utoipa::path(
    delete,
    path = "/v1/messages",
    tag = "messages",
    params(CancelQuery),
    responses(
        (status = 200, description = "How many were cancelled.", body = CancelResult),
        (status = 400, description = "`reference` missing or malformed.", body = super::error::Problem, content_type = "application/problem+json"),
        (status = 401, response = super::error::TenantUnauthorized),
        (status = 422, description = "`reference` is empty or longer than 255 characters.", body = super::error::Problem, content_type = "application/problem+json"),
    ),
    security(("tenant_key" = []))
)]
pub async fn cancel_by_reference(
    State(state): State<AppState>,
    TenantAuth(caller): TenantAuth,
    query: Result<axum::extract::Query<CancelQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<axum::Json<CancelResult>, ApiError> {
    let axum::extract::Query(query) = query
        .map_err(|err| ApiError::BadRequest(format!("Invalid query: {}.", err.body_text())))?;
    let reference = query.reference;
    if reference.is_empty() || reference.chars().count() > crate::message::MAX_REFERENCE_CHARS {
        return Err(ApiError::field("reference", "must be 1-255 characters"));
    }
    let tenant_id = caller.tenant.id.as_str();
    let (pending, total) =
        messages::ids_by_reference(&state.db, tenant_id, &reference, MAX_CANCEL_BY_REFERENCE)
            .await?;
    let cancelled = state.writer.cancel(tenant_id, pending).await?.len();
    tracing::info!(tenant = %tenant_id, cancelled, "Messages cancelled by reference.");
    Ok(axum::Json(CancelResult {
        cancelled,
        not_cancelled: total.saturating_sub(cancelled),
    }))
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
