//! The HTTP layer's one error type. Every refusal leaves as
//! `application/problem+json` (RFC 9457) with `type`, `title`, `status`,
//! `detail` and, for validation failures, `errors` naming each field. 429
//! and 503 carry `Retry-After`; a 500 never shows internals.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tracing::error;
use utoipa::{ToResponse, ToSchema};

use crate::limits::retry_after_secs;
use crate::limits::tenant::RateInfo;
use crate::store::StoreError;
use crate::tenants::RegistryError;

/// An RFC 9457 problem document.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Problem {
    /// A URI naming the kind of problem, e.g. `urn:fairlane:problem:validation`.
    #[serde(rename = "type")]
    pub kind: String,
    pub title: String,
    pub status: u16,
    pub detail: String,
    /// Field → message, for validation failures.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub errors: Option<BTreeMap<String, String>>,
}

// Reusable OpenAPI responses for refusals that read the same on every route
// that can give them; route-specific ones (400, 404, 409, 422) are described
// in each route's own annotation.

/// No admin token, a malformed `Authorization` header, or a wrong token.
#[derive(ToResponse)]
#[response(
    content_type = "application/problem+json",
    headers(("WWW-Authenticate" = String, description = "`Bearer`"))
)]
pub struct AdminUnauthorized(pub Problem);

/// No tenant API key, a malformed `Authorization` header, or a key that
/// is unknown or revoked.
#[derive(ToResponse)]
#[response(
    content_type = "application/problem+json",
    headers(("WWW-Authenticate" = String, description = "`Bearer`"))
)]
pub struct TenantUnauthorized(pub Problem);

/// The tenant is disabled: its sends are refused until an admin
/// re-enables it.
#[derive(ToResponse)]
#[response(content_type = "application/problem+json")]
pub struct TenantDisabled(pub Problem);

/// The tenant's changes other than sends are over
/// `limits.tenant_writes_per_second` (`urn:fairlane:problem:too-many-changes`).
#[derive(ToResponse)]
#[response(
    content_type = "application/problem+json",
    headers(("Retry-After" = u64, description = "Seconds until the change may be made"))
)]
pub struct TooManyChanges(pub Problem);

/// The tenant's uploads are over its plan's `uploads_per_minute`
/// (`urn:fairlane:problem:too-many-uploads`, with `Retry-After`), or its
/// files would hold more than its plan's `upload_bytes_held`
/// (`urn:fairlane:problem:upload-bytes-held`, without `Retry-After`: room
/// comes back as files are deleted or expire unused, not at a set time).
#[derive(ToResponse)]
#[response(
    content_type = "application/problem+json",
    headers(("Retry-After" = u64, description = "Seconds until the next upload may be made (too-many-uploads only)"))
)]
pub struct TooManyUploads(pub Problem);

/// The tenant is disabled: its changes are refused until an admin
/// re-enables it.
#[derive(ToResponse)]
#[response(content_type = "application/problem+json")]
pub struct TenantDisabledChange(pub Problem);

/// The tenant is disabled, or the key is a test key: the tenant's webhook
/// and suppression list, which both its worlds share, change only with a
/// live key.
#[derive(ToResponse)]
#[response(content_type = "application/problem+json")]
pub struct LiveKeyChange(pub Problem);

/// A request with the same `Idempotency-Key` is still being answered.
#[derive(ToResponse)]
#[response(content_type = "application/problem+json")]
pub struct IdempotencyInFlight(pub Problem);

/// The body is not valid JSON, or a header is malformed.
#[derive(ToResponse)]
#[response(content_type = "application/problem+json")]
pub struct Malformed(pub Problem);

/// A tenant API key was sent (admin routes take only an admin token), or
/// the admin's role does not allow this: a `viewer` only reads, and only
/// an `owner` manages admins.
#[derive(ToResponse)]
#[response(content_type = "application/problem+json")]
pub struct AdminForbidden(pub Problem);

/// The body is larger than `server.max_body_bytes`.
#[derive(ToResponse)]
#[response(content_type = "application/problem+json")]
pub struct PayloadTooLarge(pub Problem);

/// A body was sent without a JSON `Content-Type` (`application/json` or
/// `application/*+json`).
#[derive(ToResponse)]
#[response(content_type = "application/problem+json")]
pub struct UnsupportedMediaType(pub Problem);

pub use crate::accept::LimitReason;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("request body has invalid fields")]
    Validation(BTreeMap<String, String>),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Unauthorized(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    /// 409 with `Retry-After`: a request under the same `Idempotency-Key`
    /// is still being answered.
    #[error("{detail}")]
    KeyInFlight {
        detail: String,
        retry_after: Duration,
    },
    #[error("{0}")]
    MethodNotAllowed(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("{0}")]
    IdempotencyMismatch(String),
    #[error("{detail}")]
    TooManyRequests {
        reason: LimitReason,
        detail: String,
        retry_after: Duration,
        rate: Option<RateInfo>,
    },
    /// 429 without `Retry-After`: the tenant's files would hold more than
    /// its plan's `upload_bytes_held`.
    #[error("{0}")]
    UploadBytesHeld(String),
    #[error("{detail}")]
    Unavailable {
        detail: String,
        retry_after: Duration,
    },
    #[error(transparent)]
    Internal(anyhow::Error),
}

/// The one place a failure from below the API becomes an answer: a store
/// that is away or full is a 503 with Retry-After, not a 500.
impl From<anyhow::Error> for ApiError {
    fn from(err: anyhow::Error) -> Self {
        ApiError::from(StoreError::classify(err))
    }
}

impl From<StoreError> for ApiError {
    fn from(err: StoreError) -> Self {
        match err {
            StoreError::Other(err) => ApiError::Internal(err),
            classified => ApiError::of_store(&classified),
        }
    }
}

impl ApiError {
    /// The one mapping of a store failure: not found, a conflict, or a
    /// store away or full (503 with Retry-After, its internals not shown).
    fn of_store(err: &StoreError) -> ApiError {
        let retry_after = err.retry_after().unwrap_or(Duration::from_secs(1));
        match err {
            StoreError::NotFound(detail) => ApiError::NotFound(detail.clone()),
            StoreError::Conflict(detail) => ApiError::Conflict(detail.clone()),
            StoreError::Unavailable(_) => ApiError::Unavailable {
                detail: "The store did not answer; nothing was changed. Try again after Retry-After.".into(),
                retry_after,
            },
            StoreError::Full(_) => ApiError::Unavailable {
                detail: "The store has no room for this change; nothing was changed. Try again after Retry-After.".into(),
                retry_after,
            },
            StoreError::Other(err) => ApiError::Internal(anyhow::anyhow!("{err:#}")),
        }
    }
}

impl ApiError {
    /// A validation failure of one field.
    pub fn field(field: &str, message: impl Into<String>) -> Self {
        ApiError::Validation(BTreeMap::from([(field.to_owned(), message.into())]))
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Validation(_) | ApiError::IdempotencyMismatch(_) => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(_) | ApiError::KeyInFlight { .. } => StatusCode::CONFLICT,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::TooManyRequests { .. } | ApiError::UploadBytesHeld(_) => {
                StatusCode::TOO_MANY_REQUESTS
            }
            ApiError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn slug_and_title(&self) -> (&'static str, &'static str) {
        match self {
            ApiError::Validation(_) => ("validation", "Invalid request"),
            ApiError::BadRequest(_) => ("bad-request", "Malformed request"),
            ApiError::Unauthorized(_) => ("unauthorized", "Not authenticated"),
            ApiError::Forbidden(_) => ("forbidden", "Not allowed"),
            ApiError::NotFound(_) => ("not-found", "Not found"),
            ApiError::Conflict(_) | ApiError::KeyInFlight { .. } => ("conflict", "Conflict"),
            ApiError::MethodNotAllowed(_) => ("method-not-allowed", "Method not allowed"),
            ApiError::PayloadTooLarge(_) => ("too-large", "Request too large"),
            ApiError::UnsupportedMediaType(_) => {
                ("unsupported-media-type", "Unsupported media type")
            }
            ApiError::IdempotencyMismatch(_) => (
                "idempotency-key-reused",
                "Idempotency-Key reused with a different request",
            ),
            ApiError::TooManyRequests { reason, .. } => match reason {
                LimitReason::Rate => ("rate-limited", "Tenant rate limit exceeded"),
                LimitReason::Quota => ("quota-exhausted", "Daily quota exhausted"),
                LimitReason::Lane => ("lane-full", "Lane is at its high-water mark"),
                LimitReason::Batches => ("too-many-batches", "Too many batches in progress"),
                LimitReason::Writes => ("too-many-changes", "Too many changes"),
                LimitReason::Reads => ("too-many-reads", "Too many list reads in progress"),
                LimitReason::Uploads => ("too-many-uploads", "Too many uploads"),
            },
            ApiError::UploadBytesHeld(_) => ("upload-bytes-held", "Upload store full"),
            ApiError::Unavailable { .. } => ("unavailable", "Service unavailable"),
            ApiError::Internal(_) => ("internal", "Internal error"),
        }
    }

    /// The Retry-After of a 429 or 503.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ApiError::TooManyRequests { retry_after, .. }
            | ApiError::Unavailable { retry_after, .. }
            | ApiError::KeyInFlight { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }

    /// The problem document for this error.
    pub fn problem(&self) -> Problem {
        let (slug, title) = self.slug_and_title();
        let detail = match self {
            ApiError::Internal(_) => "An unexpected error occurred; it has been logged.".to_owned(),
            ApiError::Validation(errors) => {
                let fields: Vec<&str> = errors.keys().map(String::as_str).collect();
                format!("Invalid fields: {}.", fields.join(", "))
            }
            other => other.to_string(),
        };
        Problem {
            kind: format!("urn:fairlane:problem:{slug}"),
            title: title.to_owned(),
            status: self.status().as_u16(),
            detail,
            errors: match self {
                ApiError::Validation(errors) => Some(errors.clone()),
                _ => None,
            },
        }
    }
}

/// Adds `RateLimit-Limit/Remaining/Reset` headers.
pub fn insert_rate_headers(headers: &mut HeaderMap, info: &RateInfo) {
    headers.insert("ratelimit-limit", HeaderValue::from(info.limit));
    headers.insert("ratelimit-remaining", HeaderValue::from(info.remaining));
    headers.insert("ratelimit-reset", HeaderValue::from(info.reset_secs));
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let ApiError::Internal(err) = &self {
            error!(
                error = format!("{err:#}"),
                "Request failed with an internal error."
            );
        }
        let status = self.status();
        let body = serde_json::to_vec(&self.problem()).unwrap_or_default();
        let mut response = (status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        match &self {
            ApiError::TooManyRequests {
                retry_after, rate, ..
            } => {
                headers.insert(
                    header::RETRY_AFTER,
                    HeaderValue::from(retry_after_secs(*retry_after)),
                );
                if let Some(info) = rate {
                    insert_rate_headers(headers, info);
                }
            }
            ApiError::Unavailable { retry_after, .. }
            | ApiError::KeyInFlight { retry_after, .. } => {
                headers.insert(
                    header::RETRY_AFTER,
                    HeaderValue::from(retry_after_secs(*retry_after)),
                );
            }
            ApiError::Unauthorized(_) => {
                headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            _ => {}
        }
        response
    }
}

impl From<RegistryError> for ApiError {
    fn from(err: RegistryError) -> Self {
        match err {
            RegistryError::NotFound(what) => ApiError::NotFound(format!("{what} not found")),
            RegistryError::Conflict(detail) => ApiError::Conflict(detail),
            RegistryError::Invalid { field, message } => ApiError::field(&field, message),
            RegistryError::Internal(err) => ApiError::from(err),
        }
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(err: sqlx::Error) -> Self {
        ApiError::from(anyhow::Error::from(err))
    }
}

impl From<crate::accept::Refused> for ApiError {
    fn from(refused: crate::accept::Refused) -> Self {
        ApiError::from(&refused)
    }
}

impl From<&crate::accept::Refused> for ApiError {
    fn from(refused: &crate::accept::Refused) -> Self {
        use crate::accept::Refused;
        match refused {
            Refused::Invalid(errors) => ApiError::Validation(errors.clone()),
            Refused::BadKey(detail) | Refused::Malformed(detail) => {
                ApiError::BadRequest(detail.clone())
            }
            Refused::Disabled(detail) => ApiError::Forbidden(detail.clone()),
            Refused::KeyInFlight {
                detail,
                retry_after,
            } => ApiError::KeyInFlight {
                detail: detail.clone(),
                retry_after: *retry_after,
            },
            Refused::KeyReused(detail) => ApiError::IdempotencyMismatch(detail.clone()),
            Refused::TooLarge(detail) => ApiError::PayloadTooLarge(detail.clone()),
            Refused::Limited {
                reason,
                detail,
                retry_after,
                rate,
            } => ApiError::TooManyRequests {
                reason: *reason,
                detail: detail.clone(),
                retry_after: *retry_after,
                rate: *rate,
            },
            Refused::Unavailable {
                detail,
                retry_after,
            } => ApiError::Unavailable {
                detail: detail.clone(),
                retry_after: *retry_after,
            },
            Refused::Store(err) => ApiError::of_store(err),
            Refused::Internal(err) => ApiError::Internal(anyhow::anyhow!("{err:#}")),
        }
    }
}
