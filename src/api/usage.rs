//! Usage: per tenant, UTC day, channel and key kind, the messages accepted
//! and their outcomes, and the SMS fragments sent. `GET /v1/usage` (a
//! tenant's own), `GET /v1/admin/tenants/{id}/usage` and
//! `GET /v1/admin/usage` (every tenant). The counts live in rows of their
//! own (`crate::store::usage`), so retention never changes them.

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::extract::rejection::QueryRejection;
use axum::routing::get;
use chrono::{Days, NaiveDate};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::{AdminForbidden, AdminUnauthorized, ApiError, Problem, TenantUnauthorized};
use super::{ApiPath, AppState, known_tenant};
use crate::api::auth::{AdminOnly, TenantAuth};
use crate::model::{Channel, now_ms};
use crate::store::usage::{UsageRow, Whose};

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/usage", get(tenant_usage))
        .route("/v1/admin/tenants/{id}/usage", get(admin_tenant_usage))
        .route("/v1/admin/usage", get(admin_usage))
}

/// Days a usage answer covers when `from` is not given (today included).
const DEFAULT_DAYS: u64 = 31;
/// Most days one usage answer covers.
pub const MAX_DAYS: i64 = 366;

/// Which days to show.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct UsageQuery {
    /// First UTC day (`YYYY-MM-DD`, 1970 or later), included. Default: 30
    /// days before `to`.
    #[param(format = Date, pattern = r"^(?:19[7-9][0-9]|[2-9][0-9]{3})-[0-9]{2}-[0-9]{2}$")]
    pub from: Option<String>,
    /// Last UTC day (`YYYY-MM-DD`), included: at most 366 days after
    /// `from`, counting both. Default: today; with `from` alone, today or
    /// the 366th day from `from`, whichever comes first (and `from`
    /// itself when it is after today). 1970 or later.
    #[param(format = Date, pattern = r"^(?:19[7-9][0-9]|[2-9][0-9]{3})-[0-9]{2}-[0-9]{2}$")]
    pub to: Option<String>,
}

/// The counts of one day (or of a whole answer, in `totals`).
#[derive(Debug, Default, Clone, PartialEq, Serialize, ToSchema)]
pub struct UsageCounts {
    /// Messages accepted (answered 202 and stored; in SQS mode a message
    /// the queue refused afterwards is also counted in `rejected`).
    pub accepted: i64,
    /// Handed to the provider, which took it.
    pub sent: i64,
    /// Reported delivered by the provider.
    pub delivered: i64,
    pub bounced: i64,
    pub complained: i64,
    /// Reported failed by the provider after it took the message.
    pub failed: i64,
    /// Given up after a permanent failure or the last attempt: each move
    /// into the dead-letter queue (a redrive that could not move a message
    /// puts it back, and counts it again).
    pub dead_lettered: i64,
    /// Moved back from the dead-letter queue by a redrive: `dead_lettered`
    /// less `redriven` is what a period left there.
    pub redriven: i64,
    /// Not sent: the address was on the suppression list.
    pub suppressed: i64,
    pub cancelled: i64,
    pub rejected: i64,
    /// SMS fragments of the messages counted in `sent` (what SMS providers
    /// bill): GSM-7 160 characters in one, 153 per part; UCS-2 70 and 67.
    pub fragments: i64,
    /// Bytes of the files attached to the emails counted in `accepted`.
    pub attachment_bytes: i64,
}

impl UsageCounts {
    fn add(&mut self, row: &UsageRow) {
        self.accepted += row.accepted;
        self.sent += row.sent;
        self.delivered += row.delivered;
        self.bounced += row.bounced;
        self.complained += row.complained;
        self.failed += row.failed;
        self.dead_lettered += row.dead_lettered;
        self.redriven += row.redriven;
        self.suppressed += row.suppressed;
        self.cancelled += row.cancelled;
        self.rejected += row.rejected;
        self.fragments += row.fragments;
        self.attachment_bytes += row.attachment_bytes;
    }
}

/// One tenant's usage of one channel on one UTC day, live or test.
#[derive(Debug, Serialize, ToSchema)]
pub struct UsageDay {
    pub tenant_id: String,
    /// The UTC day, `YYYY-MM-DD`. Each count is of the messages that
    /// reached that state on this day (`accepted`: were created).
    #[schema(format = Date)]
    pub date: String,
    pub channel: Channel,
    /// `true`: messages of test keys, which reach no provider.
    pub test: bool,
    #[serde(flatten)]
    pub counts: UsageCounts,
}

/// The sums of an answer's days for one channel, live or test.
#[derive(Debug, Serialize, ToSchema)]
pub struct UsageTotal {
    pub channel: Channel,
    pub test: bool,
    #[serde(flatten)]
    pub counts: UsageCounts,
}

/// Usage over a span of UTC days.
#[derive(Debug, Serialize, ToSchema)]
pub struct Usage {
    #[schema(format = Date)]
    pub from: String,
    #[schema(format = Date)]
    pub to: String,
    /// Days with any count, by tenant, day, channel and kind; days without
    /// any are left out.
    pub days: Vec<UsageDay>,
    /// The days' sums per channel and kind (over every tenant listed).
    pub totals: Vec<UsageTotal>,
}

/// Days since 1970-01-01 of `date`.
fn day_number(date: NaiveDate) -> i64 {
    date.signed_duration_since(NaiveDate::default()).num_days()
}

fn date_of(day: i64) -> String {
    NaiveDate::default()
        .checked_add_days(Days::new(day.max(0) as u64))
        .map_or_else(String::new, |d| d.format("%Y-%m-%d").to_string())
}

fn date(field: &str, text: &str) -> Result<NaiveDate, ApiError> {
    NaiveDate::parse_from_str(text, "%Y-%m-%d")
        .ok()
        .filter(|d| *d >= NaiveDate::default())
        .ok_or_else(|| ApiError::field(field, "must be a date like 2026-12-01 (UTC)"))
}

/// The span `query` asks for, as day numbers, or a 422 naming the field.
fn span(query: &UsageQuery) -> Result<(i64, i64), ApiError> {
    let today = chrono::DateTime::from_timestamp_millis(now_ms())
        .map(|now| now.date_naive())
        .unwrap_or_default();
    let (from, to) = match (&query.from, &query.to) {
        (from, Some(to)) => {
            let to = date("to", to)?;
            let from = match from {
                Some(text) => date("from", text)?,
                None => to
                    .checked_sub_days(Days::new(DEFAULT_DAYS - 1))
                    .unwrap_or_default(),
            };
            (from, to)
        }
        // `from` alone: up to today, or the longest span after `from`
        // when today is further; a `from` after today shows that day.
        (Some(from), None) => {
            let from = date("from", from)?;
            let longest = from
                .checked_add_days(Days::new(MAX_DAYS as u64 - 1))
                .unwrap_or(from);
            (from, today.min(longest).max(from))
        }
        (None, None) => (
            today
                .checked_sub_days(Days::new(DEFAULT_DAYS - 1))
                .unwrap_or_default(),
            today,
        ),
    };
    let (from, to) = (day_number(from), day_number(to));
    if from > to {
        return Err(ApiError::field("from", "must not be after `to`"));
    }
    if to - from >= MAX_DAYS {
        return Err(ApiError::field(
            "to",
            format!("must be at most {MAX_DAYS} days after `from`, counting both"),
        ));
    }
    Ok((from, to))
}

async fn answer(
    state: &AppState,
    whose: Whose<'_>,
    query: Result<axum::extract::Query<UsageQuery>, QueryRejection>,
) -> Result<Json<Usage>, ApiError> {
    let axum::extract::Query(query) = query
        .map_err(|err| ApiError::BadRequest(format!("Invalid query: {}.", err.body_text())))?;
    let (from, to) = span(&query)?;
    let rows = state.db.usage(whose, from, to).await?;
    let mut totals: Vec<UsageTotal> = Vec::new();
    let mut days = Vec::with_capacity(rows.len());
    for row in rows {
        let channel: Channel = row.channel.parse().map_err(anyhow::Error::msg)?;
        match totals
            .iter_mut()
            .find(|t| t.channel == channel && t.test == row.test)
        {
            Some(total) => total.counts.add(&row),
            None => {
                let mut counts = UsageCounts::default();
                counts.add(&row);
                totals.push(UsageTotal {
                    channel,
                    test: row.test,
                    counts,
                });
            }
        }
        let mut counts = UsageCounts::default();
        counts.add(&row);
        days.push(UsageDay {
            date: date_of(row.day),
            tenant_id: row.tenant_id,
            channel,
            test: row.test,
            counts,
        });
    }
    totals.sort_by_key(|t| (t.channel.as_str(), t.test));
    Ok(Json(Usage {
        from: date_of(from),
        to: date_of(to),
        days,
        totals,
    }))
}

/// This tenant's usage per UTC day and channel, in the key's world.
///
/// A live key sees its live messages' counts, a test key its test
/// messages' (`test`); an admin sees both. Retention does not change these
/// counts.
#[utoipa::path(
    get, path = "/v1/usage", tag = "messages",
    params(UsageQuery),
    responses(
        (status = 200, description = "The tenant's usage over the days asked for.", body = Usage),
        (status = 400, description = "A malformed query.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = TenantUnauthorized),
        (status = 422, description = "A bad date or span (named in `errors`).", body = Problem, content_type = "application/problem+json"),
    ),
    security(("tenant_key" = []))
)]
pub async fn tenant_usage(
    State(state): State<AppState>,
    TenantAuth(caller): TenantAuth,
    query: Result<axum::extract::Query<UsageQuery>, QueryRejection>,
) -> Result<Json<Usage>, ApiError> {
    answer(&state, Whose::Scope(&caller.scope()), query).await
}

/// A tenant's usage (see `GET /v1/usage`).
#[utoipa::path(
    get, path = "/v1/admin/tenants/{id}/usage", tag = "admin",
    params(("id" = String, Path, description = "Tenant id."), UsageQuery),
    responses(
        (status = 200, description = "The tenant's usage over the days asked for.", body = Usage),
        (status = 400, description = "A malformed query, or a path segment that is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No tenant with this id.", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "A bad date or span (named in `errors`).", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn admin_tenant_usage(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
    query: Result<axum::extract::Query<UsageQuery>, QueryRejection>,
) -> Result<Json<Usage>, ApiError> {
    known_tenant(&state, &id)?;
    answer(&state, Whose::Tenant(&id), query).await
}

/// Every tenant's usage (see `GET /v1/usage`); `totals` sum all tenants.
#[utoipa::path(
    get, path = "/v1/admin/usage", tag = "admin",
    params(UsageQuery),
    responses(
        (status = 200, description = "Every tenant's usage over the days asked for.", body = Usage),
        (status = 400, description = "A malformed query.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 422, description = "A bad date or span (named in `errors`).", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn admin_usage(
    State(state): State<AppState>,
    _admin: AdminOnly,
    query: Result<axum::extract::Query<UsageQuery>, QueryRejection>,
) -> Result<Json<Usage>, ApiError> {
    answer(&state, Whose::Everyone, query).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_count_from_the_epoch() {
        let date = NaiveDate::from_ymd_opt(2026, 11, 25).unwrap();
        let day = day_number(date);
        assert_eq!(day, 20_782);
        assert_eq!(date_of(day), "2026-11-25");
        // The stores count days as created_at / 86_400_000.
        let midnight = date
            .and_hms_opt(0, 0, 0)
            .unwrap()
            .and_utc()
            .timestamp_millis();
        assert_eq!(midnight / 86_400_000, day);
        assert_eq!((midnight - 1) / 86_400_000, day - 1);
    }

    #[test]
    fn spans_are_checked_and_named() {
        let query = |from: Option<&str>, to: Option<&str>| UsageQuery {
            from: from.map(str::to_owned),
            to: to.map(str::to_owned),
        };
        assert_eq!(
            span(&query(Some("2026-01-01"), Some("2026-01-31"))).unwrap(),
            (20_454, 20_484)
        );
        let named = |result: Result<(i64, i64), ApiError>| match result {
            Err(ApiError::Validation(fields)) => fields.keys().next().cloned(),
            _ => None,
        };
        assert_eq!(
            named(span(&query(Some("2026-02-01"), Some("2026-01-01")))).as_deref(),
            Some("from")
        );
        assert_eq!(
            named(span(&query(Some("2026-1-1x"), None))).as_deref(),
            Some("from")
        );
        assert_eq!(
            named(span(&query(None, Some("tomorrow")))).as_deref(),
            Some("to")
        );
        assert_eq!(
            named(span(&query(Some("2024-01-01"), Some("2026-01-01")))).as_deref(),
            Some("to")
        );
        let (from, to) = span(&query(None, Some("2026-01-31"))).unwrap();
        assert_eq!(to - from + 1, DEFAULT_DAYS as i64);
        // `from` alone, years back: the longest span after it, not a 422.
        assert_eq!(
            span(&query(Some("2020-01-01"), None)).unwrap(),
            (18_262, 18_262 + MAX_DAYS - 1)
        );
        // `from` alone, after today: that one day.
        assert_eq!(
            span(&query(Some("2999-01-01"), None)).unwrap(),
            (375_835, 375_835)
        );
    }
}
