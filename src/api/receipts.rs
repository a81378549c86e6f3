//! What happened to a message after it was accepted: its history
//! (`GET /v1/messages/{id}/events`), and the endpoint SMS providers report
//! to (`POST /v1/callbacks/sms`, see [`crate::receipts::twilio`]).

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::DefaultBodyLimit;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::routing::{get, post};
use secrecy::ExposeSecret;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::{ApiError, Problem, TenantUnauthorized};
use super::{ApiPath, AppState};
use crate::api::auth::TenantAuth;
use crate::config::{HttpSmsSettings, ProviderKind};
use crate::model::{MessageStatus, ms_to_rfc3339};
use crate::receipts::{self, twilio};
use crate::store::events;

/// Largest SMS status callback read: a provider's form is about 1 KiB, and
/// the whole body must be read before its signature can be checked.
pub const MAX_CALLBACK_BYTES: usize = 16 * 1024;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/messages/{id}/events", get(list_events))
        .route(
            twilio::CALLBACK_PATH,
            post(sms_callback).layer(DefaultBodyLimit::max(MAX_CALLBACK_BYTES)),
        )
        .route(
            &format!("{}/{{provider}}", twilio::CALLBACK_PATH),
            post(sms_callback_of).layer(DefaultBodyLimit::max(MAX_CALLBACK_BYTES)),
        )
}

/// One step of a message's history.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct MessageEvent {
    /// RFC 3339.
    pub at: String,
    /// The status the message moved to (`queued`, `sent`, `delivered`, …),
    /// or a provider update that changed no status: `sms_{status}` (an SMS
    /// provider's intermediate status), `transient_bounce`,
    /// `delivery_delayed`, or `provider_{status}` (a report the message had
    /// already passed). `sending` is not recorded.
    pub event: String,
    /// The message's status after the event.
    pub status: MessageStatus,
    /// Provider calls made by then.
    pub attempts: u32,
    /// The provider's or fairlane's words: an error, a bounce type, an
    /// SMTP answer.
    pub detail: Option<String>,
    pub provider_message_id: Option<String>,
}

impl MessageEvent {
    fn from_record(event: events::EventRecord) -> anyhow::Result<Self> {
        Ok(MessageEvent {
            at: ms_to_rfc3339(event.at),
            event: event.event,
            status: event.status.parse().map_err(anyhow::Error::msg)?,
            attempts: event.attempts.max(0) as u32,
            detail: event.detail,
            provider_message_id: event.provider_message_id,
        })
    }
}

/// A message's history, oldest first.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct MessageEvents {
    pub message_id: String,
    pub events: Vec<MessageEvent>,
}

/// A message's history: every status it went through, with provider
/// receipts. Another tenant's id answers 404.
///
/// The first event is the accept (`queued`, or `scheduled` for a later
/// `send_at`). At most 1,000 events are listed.
#[utoipa::path(
    get,
    path = "/v1/messages/{id}/events",
    tag = "messages",
    params(("id" = String, Path, description = "Message id from the 202 answer")),
    responses(
        (status = 200, description = "The message's events, oldest first.", body = MessageEvents),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = TenantUnauthorized),
        (status = 404, description = "No message with this id for this tenant.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("tenant_key" = []))
)]
pub async fn list_events(
    State(state): State<AppState>,
    TenantAuth(caller): TenantAuth,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<MessageEvents>, ApiError> {
    let record = state
        .db
        .message_in(&caller.scope(), &id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("No message {id:?} for this tenant.")))?;
    let accepted = if record.send_at.is_some() {
        MessageStatus::Scheduled
    } else {
        MessageStatus::Queued
    };
    let mut list = vec![MessageEvent {
        at: ms_to_rfc3339(record.created_at),
        event: accepted.as_str().to_owned(),
        status: accepted,
        attempts: 0,
        detail: None,
        provider_message_id: None,
    }];
    let stored = state.db.message_events(&id).await?;
    // `sent` is stored as an event only for tenants with a webhook; the
    // message row keeps its time and provider id for everybody else.
    let sent = record
        .sent_at
        .filter(|_| !stored.iter().any(|event| event.event == "sent"));
    let mut sent = sent.map(|at| events::EventRecord {
        id: 0,
        at,
        event: "sent".into(),
        status: "sent".into(),
        attempts: i64::from(record.attempts),
        detail: None,
        provider_message_id: record.provider_message_id.clone(),
    });
    for event in stored {
        // Placed before the first event that came after it.
        if sent.as_ref().is_some_and(|sent| sent.at <= event.at)
            && let Some(sent) = sent.take()
        {
            list.push(MessageEvent::from_record(sent)?);
        }
        list.push(MessageEvent::from_record(event)?);
    }
    if let Some(sent) = sent {
        list.push(MessageEvent::from_record(sent)?);
    }
    Ok(Json(MessageEvents {
        message_id: id,
        events: list,
    }))
}

/// The form a Twilio-compatible API posts to a `StatusCallback`; it may
/// carry more fields, which are signed and otherwise ignored.
#[derive(Debug, Deserialize, ToSchema)]
#[allow(non_snake_case, dead_code)]
pub struct SmsStatusForm {
    /// The provider's message id, as it answered the send.
    MessageSid: String,
    /// `queued`, `sent`, `delivered`, `undelivered`, `failed`, …
    MessageStatus: String,
    /// The provider's error code for `undelivered` and `failed`.
    ErrorCode: Option<String>,
    /// The recipient.
    To: Option<String>,
}

/// Status callback of a Twilio-compatible SMS API.
///
/// Called by the provider, not by tenants: set `server.public_url`, and
/// every SMS request carries `StatusCallback = {public_url}/v1/callbacks/sms`.
/// The request must carry a valid `X-Twilio-Signature` (HMAC-SHA1 with the
/// provider's auth token over the full URL and the sorted form); otherwise
/// the answer is 403 and nothing changes. The body may have at most 16 KiB
/// (413 beyond). A report that moves nothing and was recorded before (a
/// replay) is answered 204 and adds nothing. `delivered` makes the message
/// `delivered`; `undelivered` and `failed` make it `failed` with the
/// `ErrorCode` in `last_error`; other statuses are recorded as events.
#[utoipa::path(
    post,
    path = "/v1/callbacks/sms",
    tag = "receipts",
    params(("X-Twilio-Signature" = String, Header, description = "Base64 HMAC-SHA1 of the URL and the sorted form, keyed with the provider's auth token")),
    request_body(content = SmsStatusForm, content_type = "application/x-www-form-urlencoded"),
    responses(
        (status = 204, description = "Recorded (or kept until the message's provider id is known)."),
        (status = 400, description = "The body is not a readable form.", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The signature is missing or wrong.", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "The body is larger than 16 KiB.", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "SMS receipts are not set up: no server.public_url, or the SMS provider is not `http`.", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "The body is not application/x-www-form-urlencoded.", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "A signed form without `MessageSid` or `MessageStatus` (named in `errors`).", body = Problem, content_type = "application/problem+json"),
    ),
    security(())
)]
pub async fn sms_callback(
    State(state): State<AppState>,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ApiError> {
    take_callback(&state, None, &uri, &headers, body).await
}

/// Status callback of a named provider of the SMS pool.
///
/// For the providers of `providers.sms_pool` (the first SMS provider's
/// callbacks come to `/v1/callbacks/sms`). The same as `POST /v1/callbacks/sms`, with the signature checked with
/// that provider's auth token over this URL.
#[utoipa::path(
    post,
    path = "/v1/callbacks/sms/{provider}",
    tag = "receipts",
    params(
        ("provider" = String, Path, description = "The SMS provider's name in `providers.sms_pool`"),
        ("X-Twilio-Signature" = String, Header, description = "Base64 HMAC-SHA1 of the URL and the sorted form, keyed with that provider's auth token"),
    ),
    request_body(content = SmsStatusForm, content_type = "application/x-www-form-urlencoded"),
    responses(
        (status = 204, description = "Recorded (or kept until the message's provider id is known)."),
        (status = 400, description = "The body is not a readable form.", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The signature is missing or wrong.", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "The body is larger than 16 KiB.", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No `http` provider of that name in `providers.sms_pool`, or no server.public_url.", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "The body is not application/x-www-form-urlencoded.", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "A signed form without `MessageSid` or `MessageStatus` (named in `errors`).", body = Problem, content_type = "application/problem+json"),
    ),
    security(())
)]
pub async fn sms_callback_of(
    State(state): State<AppState>,
    axum::extract::Path(provider): axum::extract::Path<String>,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ApiError> {
    take_callback(&state, Some(&provider), &uri, &headers, body).await
}

/// Checks and records one status callback of the SMS provider `named`
/// (`None`: the pool's first).
async fn take_callback(
    state: &AppState,
    named: Option<&str>,
    uri: &Uri,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ApiError> {
    // Unsigned requests are refused before anything else is looked at.
    let Some(given) = headers
        .get("x-twilio-signature")
        .and_then(|value| value.to_str().ok())
    else {
        return Err(ApiError::Forbidden(
            "X-Twilio-Signature is missing: only the SMS provider may call this endpoint.".into(),
        ));
    };
    let settings = &state.settings;
    let pool = settings.providers.pool(crate::model::Channel::Sms);
    let (path, sms) = match named {
        None => (twilio::CALLBACK_PATH.to_owned(), pool[0].settings),
        Some(name) => match pool.iter().skip(1).find(|entry| entry.name == name) {
            Some(entry) => (
                format!("{}/{}", twilio::CALLBACK_PATH, entry.name),
                entry.settings,
            ),
            None => {
                return Err(ApiError::NotFound(format!(
                    "No SMS provider named {name:?} in providers.sms_pool."
                )));
            }
        },
    };
    let (Some(public_url), ProviderKind::Http(HttpSmsSettings { auth_token, .. })) =
        (&settings.server.public_url, &sms.kind)
    else {
        return Err(ApiError::NotFound(
            "SMS receipts are not set up: set server.public_url and an http SMS provider.".into(),
        ));
    };
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .unwrap_or("");
    if !content_type
        .to_ascii_lowercase()
        .starts_with("application/x-www-form-urlencoded")
    {
        return Err(ApiError::UnsupportedMediaType(format!(
            "Content-Type must be application/x-www-form-urlencoded (got {content_type:?})."
        )));
    }
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge(format!(
                "A status callback may have at most {MAX_CALLBACK_BYTES} bytes."
            ))
        } else {
            ApiError::BadRequest(format!("Request body could not be read: {rejection}."))
        }
    })?;
    let params: Vec<(String, String)> = form_urlencoded::parse(&body).into_owned().collect();
    let url = match uri.query() {
        Some(query) => format!("{}{path}?{query}", public_url.trim_end_matches('/')),
        None => format!("{}{path}", public_url.trim_end_matches('/')),
    };
    if !twilio::verify(auth_token.expose_secret(), &url, &params, given) {
        return Err(ApiError::Forbidden(
            "X-Twilio-Signature does not match this request.".into(),
        ));
    }
    let mut receipt =
        twilio::receipt(&params).map_err(|(field, why)| ApiError::field(field, why))?;
    receipt.provider = provider_name(state, named);
    // fairlane's own id, in the callback URL the provider was given (and
    // so under the signature checked above).
    receipt.message_id = uri.query().and_then(|query| {
        form_urlencoded::parse(query.as_bytes())
            .find(|(name, _)| name == crate::providers::sms_http::CALLBACK_MESSAGE_ID)
            .map(|(_, id)| id.into_owned())
    });
    let applied = receipts::ingest(&state.db, &state.writer, &receipt).await?;
    note_receipt(state, &receipt, &applied);
    Ok(StatusCode::NO_CONTENT)
}

/// The name of the SMS provider `named` (`None`: the pool's first),
/// which labels its receipts.
fn provider_name(state: &AppState, named: Option<&str>) -> String {
    match named {
        Some(name) => name.to_owned(),
        None => state.settings.providers.pool(crate::model::Channel::Sms)[0]
            .name
            .to_owned(),
    }
}

/// Counts a recorded receipt in its provider's health: a `failed` report
/// against it, and how long after the send a `delivered` or `failed` one
/// came (see [`crate::limits::health::Health::record_receipt`]).
fn note_receipt(
    state: &AppState,
    receipt: &crate::store::receipts::Receipt,
    applied: &receipts::Applied,
) {
    let failed = receipt.outcome == Some(MessageStatus::Failed);
    let delivered = receipt.outcome == Some(MessageStatus::Delivered);
    if !(failed || delivered) {
        return;
    }
    let Some(pool) = state
        .providers
        .iter()
        .find(|(channel, _)| *channel == crate::model::Channel::Sms)
        .map(|(_, pool)| pool)
    else {
        return;
    };
    let Some(member) = pool.position(&receipt.provider) else {
        return;
    };
    let delay = match applied {
        receipts::Applied::Matched {
            sent_at: Some(sent_at),
            ..
        } => Some(std::time::Duration::from_millis(
            u64::try_from(crate::model::now_ms() - sent_at).unwrap_or(0),
        )),
        _ => None,
    };
    if pool.gate.record_receipt(member, failed, delay) {
        tracing::warn!(
            provider = %receipt.provider,
            "SMS provider's recent receipts report failures or come late past providers.health; it takes no new messages for a while while its pool has others."
        );
    }
}
