//! The message list a support desk searches: `GET /v1/messages` (a tenant's
//! own, the live ones with a live key and the test ones with a test key)
//! and `GET /v1/admin/tenants/{id}/messages`, newest first, filtered by
//! reference, status, channel and creation time, a page at a time.

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::extract::rejection::QueryRejection;
use axum::routing::get;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::{AdminForbidden, AdminUnauthorized, ApiError, Problem, TenantUnauthorized};
use super::{ApiPath, AppState, known_tenant};
use crate::accept::LimitReason;
use crate::api::auth::{AdminOnly, TenantAuth};
use crate::message::{MAX_REFERENCE_CHARS, MessageView};
use crate::model::{Channel, MessageStatus, Scope, World};
use crate::store::messages::ListFilter;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/messages", get(list_messages))
        .route("/v1/admin/tenants/{id}/messages", get(list_tenant_messages))
}

/// Messages in a page when `limit` is not given.
const DEFAULT_LIMIT: i64 = 100;
/// Most messages in a page.
pub const MAX_LIMIT: i64 = 1000;

/// What a message list shows.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Only messages with this `reference` (1-255 characters).
    #[param(min_length = 1, max_length = 255)]
    pub reference: Option<String>,
    /// Only messages to this recipient: an email address (any case) or an
    /// E.164 number. Retention erases it from settled messages, which no
    /// longer match. Without `reference`, a page reads at most
    /// `limits.list_scan_rows` messages, as with `status`.
    #[param(
        min_length = 3,
        max_length = 254,
        pattern = r"^(?:\+[1-9][0-9]{7,14}|[^@\s]+@[^@\s.]+(?:\.[^@\s.]+)+)$"
    )]
    pub recipient: Option<String>,
    /// Only messages in this status.
    #[param(value_type = Option<MessageStatus>)]
    pub status: Option<String>,
    /// Only `email` or only `sms`.
    #[param(value_type = Option<Channel>)]
    pub channel: Option<String>,
    /// RFC 3339: only messages created at or after this.
    #[param(format = DateTime)]
    pub since: Option<String>,
    /// RFC 3339: only messages created before this.
    #[param(format = DateTime)]
    pub until: Option<String>,
    /// The `next` of the previous page.
    #[param(max_length = 200, pattern = r"^[0-9]{1,18}\.[0-9A-Za-z-]{1,64}$")]
    pub cursor: Option<String>,
    /// Messages per page: 1-1,000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<i64>,
    /// Which world an admin's list reads (see [`WorldQuery`]). A tenant's
    /// list follows its key (a live key lists live messages, a test key
    /// test ones), so its document has no such parameter; a tenant that
    /// sends one anyway for the other world is refused, never shown it.
    #[param(ignore)]
    pub test: Option<bool>,
}

/// The admin list's `test` parameter, as its document shows it.
#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
#[allow(dead_code)]
pub struct WorldQuery {
    /// `true`: the messages of test keys; `false` (default): live messages.
    test: Option<bool>,
}

/// One page of messages, newest first.
#[derive(Debug, Serialize, ToSchema)]
pub struct MessageList {
    pub messages: Vec<MessageView>,
    /// Pass as `cursor` for the next page; absent on the last. A page
    /// filtered by `recipient`, `status` or `channel` (without `reference`) may hold
    /// fewer than `limit` messages, or none, and still have a `next`: it
    /// read `limits.list_scan_rows` messages, and the next page goes on
    /// below them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

fn time(field: &str, text: &str) -> Result<i64, ApiError> {
    chrono::DateTime::parse_from_rfc3339(text)
        .map(|at| at.timestamp_millis())
        .map_err(|_| {
            ApiError::field(
                field,
                "must be an RFC 3339 date-time with a time zone, like 2026-12-01T09:00:00Z",
            )
        })
}

/// The filter and page size `query` asks for, or a 422 naming the field.
fn filter_of(query: ListQuery) -> Result<(ListFilter, i64), ApiError> {
    let limit = query.limit.unwrap_or(DEFAULT_LIMIT);
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(ApiError::field("limit", "must be between 1 and 1000"));
    }
    if let Some(reference) = &query.reference
        && (reference.is_empty() || reference.chars().count() > MAX_REFERENCE_CHARS)
    {
        return Err(ApiError::field("reference", "must be 1-255 characters"));
    }
    let status = query
        .status
        .as_deref()
        .map(str::parse::<MessageStatus>)
        .transpose()
        .map_err(|message| ApiError::field("status", message))?;
    let channel = query
        .channel
        .as_deref()
        .map(str::parse::<Channel>)
        .transpose()
        .map_err(|message| ApiError::field("channel", message))?;
    let before = match query.cursor.as_deref() {
        None => None,
        Some(cursor) => Some(
            cursor_position(cursor)
                .ok_or_else(|| ApiError::field("cursor", "is not a `next` this list gave"))?,
        ),
    };
    Ok((
        ListFilter {
            reference: query.reference,
            recipient: query
                .recipient
                .as_deref()
                .map(|to| {
                    crate::store::suppressions::normalize(to)
                        .map(|(_, to)| to)
                        .ok_or_else(|| {
                            ApiError::field(
                                "recipient",
                                "must be an email address or an E.164 number like +15551234567",
                            )
                        })
                })
                .transpose()?,
            status,
            channel,
            since: query
                .since
                .as_deref()
                .map(|t| time("since", t))
                .transpose()?,
            until: query
                .until
                .as_deref()
                .map(|t| time("until", t))
                .transpose()?,
            before,
        },
        limit,
    ))
}

/// A `next` this list gave, as (created at, id): what the document's
/// pattern says, `^[0-9]{1,18}\.[0-9A-Za-z-]{1,64}$`.
fn cursor_position(cursor: &str) -> Option<(i64, String)> {
    let (at, id) = cursor.split_once('.')?;
    let digits = (1..=18).contains(&at.len()) && at.bytes().all(|b| b.is_ascii_digit());
    let id_ok =
        (1..=64).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    (digits && id_ok).then(|| Some((at.parse().ok()?, id.to_owned())))?
}

async fn page(
    state: &AppState,
    scope: &Scope,
    query: Result<axum::extract::Query<ListQuery>, QueryRejection>,
) -> Result<Json<MessageList>, ApiError> {
    let axum::extract::Query(query) = query
        .map_err(|err| ApiError::BadRequest(format!("Invalid query: {}.", err.body_text())))?;
    let (filter, limit) = filter_of(query)?;
    let _turn = state
        .reads
        .take(scope.tenant())
        .await
        .map_err(|mean_read| {
            metrics::counter!(crate::metrics::REJECTED_TOTAL, "reason" => "reads").increment(1);
            ApiError::TooManyRequests {
                reason: LimitReason::Reads,
                detail: format!(
                    "This tenant already has {} message list reads in progress; try again shortly.",
                    state.settings.limits.tenant_list_reads
                ),
                retry_after: mean_read,
                rate: None,
            }
        })?;
    let scan_rows = state.settings.limits.list_scan_rows;
    let page = state
        .db
        .list_messages(scope, &filter, limit, scan_rows)
        .await?;
    let full = page.rows.len() as i64 == limit;
    let next = match (full, page.rows.last(), page.scanned_to) {
        (true, Some(last), _) => Some(format!("{}.{}", last.created_at, last.id)),
        (_, _, Some((at, id))) => Some(format!("{at}.{id}")),
        _ => None,
    };
    Ok(Json(MessageList {
        messages: page.rows.into_iter().map(MessageView::from).collect(),
        next,
    }))
}

/// This tenant's messages, newest first.
///
/// A live key lists the live messages, a test key the test ones. Filters
/// combine; `next` leads to the following page.
#[utoipa::path(
    get, path = "/v1/messages", tag = "messages",
    params(ListQuery),
    responses(
        (status = 200, description = "One page of messages, newest first.", body = MessageList),
        (status = 400, description = "A malformed query.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = TenantUnauthorized),
        (status = 422, description = "A bad filter, cursor or limit (named in `errors`).", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant's `limits.tenant_list_reads` list reads were all in progress for half the request timeout (`urn:fairlane:problem:too-many-reads`).", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u64, description = "Seconds"))),
    ),
    security(("tenant_key" = []))
)]
pub async fn list_messages(
    State(state): State<AppState>,
    TenantAuth(caller): TenantAuth,
    query: Result<axum::extract::Query<ListQuery>, QueryRejection>,
) -> Result<Json<MessageList>, ApiError> {
    if let Ok(axum::extract::Query(ListQuery {
        test: Some(asked), ..
    })) = &query
        && *asked != caller.test
    {
        return Err(ApiError::field(
            "test",
            "a live key lists live messages and a test key test messages",
        ));
    }
    page(&state, &caller.scope(), query).await
}

/// A tenant's messages, newest first (see `GET /v1/messages`).
#[utoipa::path(
    get, path = "/v1/admin/tenants/{id}/messages", tag = "admin",
    params(("id" = String, Path, description = "Tenant id."), ListQuery, WorldQuery),
    responses(
        (status = 200, description = "One page of messages, newest first.", body = MessageList),
        (status = 400, description = "A malformed query, or a path segment that is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No tenant with this id.", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "A bad filter, cursor or limit (named in `errors`).", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant's `limits.tenant_list_reads` list reads were all in progress for half the request timeout (`urn:fairlane:problem:too-many-reads`).", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u64, description = "Seconds"))),
    ),
    security(("admin_token" = []))
)]
pub async fn list_tenant_messages(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
    query: Result<axum::extract::Query<ListQuery>, QueryRejection>,
) -> Result<Json<MessageList>, ApiError> {
    known_tenant(&state, &id)?;
    let test = match &query {
        Ok(axum::extract::Query(query)) => query.test.unwrap_or(false),
        Err(_) => false,
    };
    page(&state, &Scope::new(id, World::of_test(test)), query).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_is_taken_exactly_as_the_documents_pattern_says() {
        let id = "0192f1c2-7d4e-7aa0-8c11-2f3d4e5f6a7b";
        assert_eq!(
            cursor_position(&format!("1764300000000.{id}")),
            Some((1_764_300_000_000, id.to_owned()))
        );
        for bad in [
            "",
            "1764300000000",
            ".abc",
            "1764300000000.",
            "+17.abc",
            "-17.abc",
            "1234567890123456789.abc",
            "17.a b",
            "17.a.b",
            "17.é",
        ] {
            assert_eq!(cursor_position(bad), None, "{bad:?}");
        }
        assert!(cursor_position(&format!("17.{}", "a".repeat(64))).is_some());
        assert!(cursor_position(&format!("17.{}", "a".repeat(65))).is_none());
    }
}
