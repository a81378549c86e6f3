//! A dedicated tenant's own queue, for admins: its figures, a purge, its
//! dead letters and their redrive (`/v1/admin/tenants/{id}/queue`,
//! `…/dlq`, `…/dlq/redrive`). Nothing here touches another tenant's
//! messages: each call works on the tenant's own queues only.

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use tracing::info;
use utoipa::ToSchema;

use super::dlq::{DeadLetterList, LaneView, RedriveResult, dead_letter_views};
use super::error::{
    AdminForbidden, AdminUnauthorized, ApiError, PayloadTooLarge, Problem, UnsupportedMediaType,
};
use super::{ApiPath, AppState, json_typed};
use crate::api::auth::AdminOnly;
use crate::model::Isolation;
use crate::queue::RedriveFilter;

/// Most dead letters one listing returns per lane.
const DLQ_LIMIT: usize = 1000;

pub fn router() -> Router<AppState> {
    Router::new()
        .route(
            "/v1/admin/tenants/{id}/queue",
            get(tenant_queue).delete(purge_tenant_queue),
        )
        .route("/v1/admin/tenants/{id}/dlq", get(tenant_dlq))
        .route(
            "/v1/admin/tenants/{id}/dlq/redrive",
            post(redrive_tenant_dlq),
        )
}

/// A tenant's own queues, one per lane it has used while dedicated.
#[derive(Debug, Serialize, ToSchema)]
pub struct TenantQueueView {
    pub tenant: String,
    pub isolation: Isolation,
    pub lanes: Vec<LaneView>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PurgeResult {
    /// Messages removed from the tenant's own queues; those not yet sent
    /// are now `cancelled`. Messages in flight are left to finish.
    pub purged: usize,
    pub ids: Vec<String>,
}

/// Body of `POST /v1/admin/tenants/{id}/dlq/redrive`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TenantRedriveRequest {
    /// Only these message ids; every dead letter of the tenant when absent.
    #[serde(default)]
    pub ids: Option<Vec<String>>,
}

async fn known_tenant(state: &AppState, id: &str) -> Result<Isolation, ApiError> {
    state
        .registry
        .tenant_fresh(id)
        .await
        .map(|tenant| tenant.isolation)
        .ok_or_else(|| ApiError::NotFound(format!("No tenant {id:?}.")))
}

/// Depth, in-flight, delayed, oldest age and DLQ depth of a tenant's own
/// queues (dedicated isolation).
#[utoipa::path(
    get, path = "/v1/admin/tenants/{id}/queue", tag = "admin",
    params(("id" = String, Path, description = "Tenant id.")),
    responses(
        (status = 200, description = "The tenant's own queues; none while it has never been dedicated.", body = TenantQueueView),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No tenant with this id.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn tenant_queue(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<TenantQueueView>, ApiError> {
    let isolation = known_tenant(&state, &id).await?;
    let mut lanes = Vec::new();
    for lane in state.tenant_queues.dedicated_lanes(&id).await? {
        if let Some(queue) = state.tenant_queues.dedicated_queue(lane, &id).await? {
            lanes.push(LaneView::new(lane, queue.stats(lane).await?, None));
        }
    }
    Ok(Json(TenantQueueView {
        tenant: id,
        isolation,
        lanes,
    }))
}

/// Most messages of the outbox one purge cancels (a backlog that waits
/// there longer is SQS being away; a second purge takes the rest).
const MAX_PURGED_FROM_OUTBOX: i64 = 100_000;

/// Purge a tenant's own queues: waiting messages are removed and marked
/// `cancelled`; messages in flight finish. Other tenants are not touched.
#[utoipa::path(
    delete, path = "/v1/admin/tenants/{id}/queue", tag = "admin",
    params(("id" = String, Path, description = "Tenant id.")),
    responses(
        (status = 200, description = "What was purged.", body = PurgeResult),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No tenant with this id.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn purge_tenant_queue(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<PurgeResult>, ApiError> {
    let isolation = known_tenant(&state, &id).await?;
    let mut ids = state.tenant_queues.purge_dedicated(&id).await?;
    // The embedded queue marks them in its own transaction; otherwise this
    // does. Messages that were sent meanwhile keep their status.
    if !state.tenant_queues.purge_marks_cancelled() {
        // On SQS a message is in its queue only once the relay moved it
        // there: those still in the outbox are waiting too, and a cancel
        // removes their outbox rows (one the relay is sending right now
        // arrives cancelled and is dropped at its receive). A shared
        // tenant's messages go to the shared lanes, which a purge leaves.
        if isolation == Isolation::Dedicated {
            ids.extend(
                state
                    .db
                    .outbox_waiting_of_tenant(&id, MAX_PURGED_FROM_OUTBOX)
                    .await?,
            );
        }
        ids.sort_unstable();
        ids.dedup();
        ids = state.writer.cancel_either_world(&id, ids).await?;
    }
    info!(tenant = %id, purged = ids.len(), "Dedicated tenant queue purged.");
    Ok(Json(PurgeResult {
        purged: ids.len(),
        ids,
    }))
}

/// Dead letters of a tenant's own queues, oldest first.
#[utoipa::path(
    get, path = "/v1/admin/tenants/{id}/dlq", tag = "admin",
    params(("id" = String, Path, description = "Tenant id.")),
    responses(
        (status = 200, description = "The tenant's own dead letters (at most 1000 per lane).", body = DeadLetterList),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No tenant with this id.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn tenant_dlq(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<DeadLetterList>, ApiError> {
    known_tenant(&state, &id).await?;
    let mut dead_letters = Vec::new();
    for lane in state.tenant_queues.dedicated_lanes(&id).await? {
        if let Some(queue) = state.tenant_queues.dedicated_queue(lane, &id).await? {
            let letters = queue.list_dead_letters(lane, DLQ_LIMIT).await?;
            dead_letters.extend(dead_letter_views(&state, lane, letters).await?);
        }
    }
    Ok(Json(DeadLetterList { dead_letters }))
}

/// Move a tenant's own dead letters back to its own queue (`{}`: all of
/// them). They get status `queued` and a fresh attempt budget.
#[utoipa::path(
    post, path = "/v1/admin/tenants/{id}/dlq/redrive", tag = "admin",
    params(("id" = String, Path, description = "Tenant id.")),
    request_body(content = TenantRedriveRequest, content_type = "application/json"),
    responses(
        (status = 200, description = "How many dead letters went back.", body = RedriveResult),
        (status = 400, description = "The body is empty or not valid JSON.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No tenant with this id.", body = Problem, content_type = "application/problem+json"),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, description = "Invalid fields (named in `errors`): unknown or mistyped fields, or more than 10000 ids.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn redrive_tenant_dlq(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<RedriveResult>, ApiError> {
    if body.as_ref().is_ok_and(|b| b.is_empty()) {
        return Err(ApiError::BadRequest(
            "the body must name what to redrive: {\"ids\": [...]}, or {} for every dead letter of the tenant"
                .into(),
        ));
    }
    let request: TenantRedriveRequest = json_typed(&headers, body)?;
    if request.ids.as_ref().is_some_and(|ids| ids.len() > 10_000) {
        return Err(ApiError::field("ids", "must list at most 10000 ids"));
    }
    known_tenant(&state, &id).await?;
    let filter = RedriveFilter {
        tenant_id: Some(id.clone()),
        message_ids: request.ids,
    };
    let mut redriven = 0;
    for lane in state.tenant_queues.dedicated_lanes(&id).await? {
        let Some(queue) = state.tenant_queues.dedicated_queue(lane, &id).await? else {
            continue;
        };
        let started = crate::model::now_ms();
        let ids = queue.redrive(lane, &filter).await?;
        state.db.mark_requeued(&ids, started).await?;
        redriven += ids.len();
        state.tenant_queues.settle_attention(lane, &id).await?;
    }
    Ok(Json(RedriveResult { redriven }))
}
