//! Queue operations for admins: lane statistics (`/v1/admin/queues`), the
//! dead letters (`/v1/admin/dlq`) and redrive (`/v1/admin/dlq/redrive`),
//! plus Prometheus metrics at `/metrics`.

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::{
    AdminForbidden, AdminUnauthorized, ApiError, PayloadTooLarge, Problem, UnsupportedMediaType,
};
use super::{AppState, json_typed};
use crate::api::auth::AdminOnly;
use crate::model::{Channel, Lane, Priority, ms_to_rfc3339};
use crate::queue::{QueueStats, RedriveFilter};

/// Most dead letters one listing returns.
const MAX_DLQ_LIMIT: usize = 1000;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/admin/queues", get(queues))
        .route("/v1/admin/dlq", get(list_dlq))
        .route("/v1/admin/dlq/redrive", post(redrive))
        .route("/metrics", get(metrics_text))
}

/// One lane's figures.
#[derive(Debug, Serialize, ToSchema)]
pub struct LaneView {
    pub lane: Lane,
    #[serde(flatten)]
    pub stats: QueueStats,
    /// Not yet delivered: `depth` (waiting, delayed and scheduled) plus
    /// `in_flight` (held by a consumer). Sends answer 429 while a lane's
    /// backlog is at or above its `high_water_mark`.
    pub backlog: u64,
    /// The lane's mark (not set for a tenant's dedicated queue).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub high_water_mark: Option<u64>,
}

impl LaneView {
    pub fn new(lane: Lane, stats: QueueStats, high_water_mark: Option<u64>) -> Self {
        LaneView {
            lane,
            backlog: stats.backlog(),
            high_water_mark,
            stats,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct QueuesView {
    pub lanes: Vec<LaneView>,
}

/// Query of `GET /v1/admin/dlq`.
///
/// `parameter_in` is spelt out: utoipa infers it only from a bare
/// `Query<…>` argument, and the handler takes a `Result` to answer a bad
/// query with a problem document.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct DlqQuery {
    /// Only this lane; both when absent.
    pub lane: Option<Lane>,
    /// At most this many per lane (default 100, at most 1000).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<usize>,
}

/// A dead letter.
#[derive(Debug, Serialize, ToSchema)]
pub struct DeadLetterView {
    pub id: String,
    pub tenant: String,
    pub lane: Lane,
    pub channel: Channel,
    pub priority: Priority,
    pub last_error: Option<String>,
    /// Provider calls made.
    pub attempts: u32,
    /// Times the queue handed it out.
    pub receive_count: u32,
    /// RFC 3339.
    pub enqueued_at: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DeadLetterList {
    pub dead_letters: Vec<DeadLetterView>,
}

/// Body of `POST /v1/admin/dlq/redrive`; every field narrows the selection.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RedriveRequest {
    /// Only this lane; both when absent.
    #[serde(default)]
    pub lane: Option<Lane>,
    /// Only this tenant's messages.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Only these message ids.
    #[serde(default)]
    pub ids: Option<Vec<String>>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct RedriveResult {
    /// Messages moved back to their lane, with status `queued` and a fresh
    /// attempt budget.
    pub redriven: usize,
}

fn lanes_of(lane: Option<Lane>) -> Vec<Lane> {
    lane.map_or_else(|| Lane::ALL.to_vec(), |lane| vec![lane])
}

/// Depth, in-flight, delayed, held, backlog (against the high-water
/// mark), oldest age and DLQ depth per lane.
#[utoipa::path(
    get, path = "/v1/admin/queues", tag = "admin",
    responses(
        (status = 200, description = "Figures for each lane.", body = QueuesView),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
    ),
    security(("admin_token" = []))
)]
pub async fn queues(
    State(state): State<AppState>,
    _admin: AdminOnly,
) -> Result<Json<QueuesView>, ApiError> {
    let mut lanes = Vec::new();
    for lane in Lane::ALL {
        let stats = state.queue.stats(*lane).await?;
        let mark = state.settings.lanes.get(*lane).high_water_mark;
        lanes.push(LaneView::new(*lane, stats, Some(mark)));
    }
    Ok(Json(QueuesView { lanes }))
}

/// List dead letters, oldest first.
#[utoipa::path(
    get, path = "/v1/admin/dlq", tag = "admin",
    params(DlqQuery),
    responses(
        (status = 200, description = "Dead letters, lane by lane.", body = DeadLetterList),
        (status = 400, description = "An unknown query parameter, an unknown lane or a `limit` that is not a number.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 422, description = "`limit` is not between 1 and 1000 (named in `errors`).", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn list_dlq(
    State(state): State<AppState>,
    _admin: AdminOnly,
    query: Result<Query<DlqQuery>, QueryRejection>,
) -> Result<Json<DeadLetterList>, ApiError> {
    let Query(query) = query
        .map_err(|err| ApiError::BadRequest(format!("Invalid query: {}.", err.body_text())))?;
    let limit = query.limit.unwrap_or(100);
    if limit == 0 || limit > MAX_DLQ_LIMIT {
        return Err(ApiError::field(
            "limit",
            format!("must be between 1 and {MAX_DLQ_LIMIT}"),
        ));
    }
    let mut dead_letters = Vec::new();
    for lane in lanes_of(query.lane) {
        let letters = state.queue.list_dead_letters(lane, limit).await?;
        dead_letters.extend(dead_letter_views(&state, lane, letters).await?);
    }
    Ok(Json(DeadLetterList { dead_letters }))
}

/// Dead letters of `lane` with what the status store knows of each.
pub(crate) async fn dead_letter_views(
    state: &AppState,
    lane: Lane,
    letters: Vec<crate::queue::DeadLetter>,
) -> anyhow::Result<Vec<DeadLetterView>> {
    let ids: Vec<String> = letters.iter().map(|l| l.message_id.clone()).collect();
    let records = state.db.messages_by_id(&ids).await?;
    Ok(letters
        .into_iter()
        .map(|letter| {
            let record = records.get(&letter.message_id);
            DeadLetterView {
                id: letter.message_id.clone(),
                tenant: letter.tenant_id,
                lane,
                channel: letter.channel,
                priority: letter.priority,
                last_error: record.and_then(|r| r.last_error.clone()),
                attempts: record.map_or(0, |r| r.attempts),
                receive_count: letter.receive_count,
                enqueued_at: ms_to_rfc3339(letter.enqueued_at_ms),
            }
        })
        .collect())
}

/// Move dead letters back to their lane.
///
/// The body names what to redrive: `lane`, `tenant` and `ids` narrow it,
/// and `{}` redrives every dead letter of both lanes. An empty body is
/// refused, so a request that lost its body never redrives everything by
/// accident. Redriven messages get status `queued` and a fresh attempt
/// budget.
#[utoipa::path(
    post, path = "/v1/admin/dlq/redrive", tag = "admin",
    request_body(
        content = RedriveRequest, content_type = "application/json",
        description = "What to redrive; `{}` redrives every dead letter of both lanes. Required: an empty body is refused.",
    ),
    responses(
        (status = 200, description = "How many dead letters went back to their lane.", body = RedriveResult),
        (status = 400, description = "The body is empty or not valid JSON.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, description = "Invalid fields (named in `errors`): unknown or mistyped fields, or more than 10000 ids.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn redrive(
    State(state): State<AppState>,
    _admin: AdminOnly,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<RedriveResult>, ApiError> {
    if body.as_ref().is_ok_and(|b| b.is_empty()) {
        return Err(ApiError::BadRequest(
            "the body must name what to redrive: {\"lane\", \"tenant\", \"ids\"}, or {} for every dead letter"
                .into(),
        ));
    }
    let request: RedriveRequest = json_typed(&headers, body)?;
    if let Some(ids) = &request.ids
        && ids.len() > 10_000
    {
        return Err(ApiError::field("ids", "must list at most 10000 ids"));
    }
    let filter = RedriveFilter {
        tenant_id: request.tenant.clone(),
        message_ids: request.ids.clone(),
    };
    let redriven = redrive_lanes(&state, lanes_of(request.lane), filter).await?;
    Ok(Json(RedriveResult { redriven }))
}

/// Moves the dead letters of `lanes` that `filter` matches back to their
/// lane and marks them `queued`; how many. The API's redrive and the
/// console's.
pub(crate) async fn redrive_lanes(
    state: &AppState,
    lanes: Vec<Lane>,
    filter: RedriveFilter,
) -> Result<usize, ApiError> {
    let state = state.clone();
    // In a task of its own: if the request times out during a long walk of
    // an SQS DLQ, the messages already moved are still marked `queued`.
    let work = tokio::spawn(async move {
        let mut redriven = 0;
        for lane in lanes {
            let started = crate::model::now_ms();
            let ids = state.queue.redrive(lane, &filter).await?;
            // The backends mark what they move before moving it; this catches
            // messages that reached the DLQ by SQS's own redrive policy.
            state.db.mark_requeued(&ids, started).await?;
            redriven += ids.len();
            log_redriven(&state, lane, &ids).await;
        }
        anyhow::Ok(redriven)
    });
    Ok(work.await.map_err(anyhow::Error::from)??)
}

/// One INFO line per redriven message, as for the other state changes an
/// operator follows (sent, dead-lettered). The status rows are read only
/// when the line is written.
async fn log_redriven(state: &AppState, lane: Lane, ids: &[String]) {
    if ids.is_empty() || !tracing::enabled!(tracing::Level::INFO) {
        return;
    }
    let records = match state.db.messages_by_id(ids).await {
        Ok(records) => records,
        Err(err) => {
            tracing::warn!(lane = lane.as_str(), redriven = ids.len(), error = %format!("{err:#}"), "Messages redriven; could not read them back for the log.");
            return;
        }
    };
    for id in ids {
        let record = records.get(id);
        tracing::info!(
            message_id = %id,
            tenant = record.map(|r| r.tenant_id.as_str()),
            channel = record.map(|r| r.channel.as_str()),
            lane = lane.as_str(),
            priority = record.map(|r| r.priority.as_str()),
            attempts = record.map(|r| r.attempts),
            "Message redriven."
        );
    }
}

/// Prometheus text exposition of fairlane's metrics.
#[utoipa::path(
    get, path = "/metrics", tag = "ops",
    responses((status = 200, description = "Prometheus text format", body = String, content_type = "text/plain"))
)]
pub async fn metrics_text(State(state): State<AppState>) -> Response {
    let body = state.metrics.render();
    let mut response = body.into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}
