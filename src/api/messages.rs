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
use utoipa::ToSchema;

use super::error::{ApiError, Problem, insert_rate_headers};
use super::{ApiPath, AppState, json_value, read_json_bytes};
use crate::accept::{Acceptor, BatchItem, BatchSent, Sent};
use crate::api::auth::{TenantAuth, TenantWrite};

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

pub use crate::accept::{MAX_BATCH, SendAccepted};
pub use crate::message::MessageView;

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
    Acceptor::refuse_disabled(&caller)?;
    let value = json_value(&headers, body)?;
    match state
        .accept
        .send(&caller, &value, key_header(&headers))
        .await?
    {
        Sent::Accepted { id, body, rate } => {
            let mut response = accepted_response(StatusCode::ACCEPTED, &id, body);
            insert_rate_headers(response.headers_mut(), &rate);
            Ok(response)
        }
        Sent::Replayed { id, status, body } => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::ACCEPTED);
            let mut response = accepted_response(status, &id, body);
            response
                .headers_mut()
                .insert("idempotent-replayed", HeaderValue::from_static("true"));
            Ok(response)
        }
    }
}

/// The `Idempotency-Key` header's text, if sent (empty when it is not
/// text, which the accept path refuses).
fn key_header(headers: &HeaderMap) -> Option<&str> {
    headers
        .get("idempotency-key")
        .map(|value| value.to_str().unwrap_or(""))
}

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
    pub problem: Option<super::error::Problem>,
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
        (status = 429, description = "The tenant already has `server.max_batches_per_tenant` batches in progress (`urn:fairlane:problem:too-many-batches`).", body = super::error::Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u64, description = "Seconds"))),
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
    Acceptor::refuse_disabled(&caller)?;
    let body = read_json_bytes(&headers, body)?;
    let sent = state
        .accept
        .send_batch(&caller, &body, key_header(&headers), |items| {
            Ok(serde_json::to_string(&batch_answer(items))?)
        })
        .await?;
    Ok(match sent {
        BatchSent::Answered(body) => json_response(StatusCode::OK, body),
        BatchSent::Replayed(body) => {
            let mut response = json_response(StatusCode::OK, body);
            response
                .headers_mut()
                .insert("idempotent-replayed", HeaderValue::from_static("true"));
            response
        }
    })
}

/// The batch's answer: each item as a single send would have answered it.
fn batch_answer(items: &[BatchItem]) -> BatchAccepted {
    let results: Vec<BatchItemResult> = items
        .iter()
        .enumerate()
        .map(|(index, item)| match item {
            BatchItem::Accepted { answer, replayed } => BatchItemResult {
                index,
                status: StatusCode::ACCEPTED.as_u16(),
                message: Some(answer.clone()),
                problem: None,
                retry_after: None,
                replayed: *replayed,
            },
            BatchItem::Refused(refused) => {
                let refused = ApiError::from(refused);
                BatchItemResult {
                    index,
                    status: refused.status().as_u16(),
                    message: None,
                    problem: Some(refused.problem()),
                    retry_after: refused.retry_after().map(crate::limits::retry_after_secs),
                    replayed: false,
                }
            }
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
    let (record, recipients) = state
        .db
        .message_with_recipients(&caller.scope(), &id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("No message {id:?} for this tenant.")))?;
    let mut view = MessageView::from(record);
    view.recipients = recipients.into_iter().map(Into::into).collect();
    Ok(axum::Json(view))
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
        (status = 403, response = super::error::TenantDisabledChange),
        (status = 429, response = super::error::TooManyChanges),
    ),
    security(("tenant_key" = []))
)]
pub async fn cancel_message(
    State(state): State<AppState>,
    TenantWrite(caller): TenantWrite,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<MessageView>, ApiError> {
    let scope = caller.scope();
    let not_found = || ApiError::NotFound(format!("No message {id:?} for this tenant."));
    state
        .db
        .message_in(&scope, &id)
        .await?
        .ok_or_else(not_found)?;
    let cancelled = state.writer.cancel(&scope, vec![id.clone()]).await?;
    let record = state
        .db
        .message_in(&scope, &id)
        .await?
        .ok_or_else(not_found)?;
    // Only this call's cancel counts: a message cancelled before is ended.
    if cancelled.is_empty() {
        return Err(ApiError::Conflict(format!(
            "Message {id:?} is {}; only scheduled, queued or retrying messages can be cancelled.",
            record.status.as_str()
        )));
    }
    tracing::info!(tenant = %scope.tenant(), message_id = %id, "Message cancelled.");
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
        (status = 403, response = super::error::TenantDisabledChange),
        (status = 429, response = super::error::TooManyChanges),
    ),
    security(("tenant_key" = []))
)]
pub async fn cancel_by_reference(
    State(state): State<AppState>,
    TenantWrite(caller): TenantWrite,
    query: Result<axum::extract::Query<CancelQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<axum::Json<CancelResult>, ApiError> {
    let axum::extract::Query(query) = query
        .map_err(|err| ApiError::BadRequest(format!("Invalid query: {}.", err.body_text())))?;
    let reference = query.reference;
    if reference.is_empty() || reference.chars().count() > crate::message::MAX_REFERENCE_CHARS {
        return Err(ApiError::field("reference", "must be 1-255 characters"));
    }
    let scope = caller.scope();
    let (pending, total) = state
        .db
        .pending_by_reference(&scope, &reference, MAX_CANCEL_BY_REFERENCE)
        .await?;
    let cancelled = state.writer.cancel(&scope, pending).await?.len();
    tracing::info!(tenant = %scope.tenant(), cancelled, "Messages cancelled by reference.");
    Ok(axum::Json(CancelResult {
        cancelled,
        not_cancelled: total.saturating_sub(cancelled),
    }))
}
