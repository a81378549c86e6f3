//! Webhook endpoints: a tenant sets its own at `/v1/webhook` (API key), an
//! admin any tenant's at `/v1/admin/tenants/{id}/webhook`, and lists the
//! failing ones at `/v1/admin/webhooks/failing`. See [`crate::webhooks`].

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::{
    AdminForbidden, AdminUnauthorized, ApiError, PayloadTooLarge, Problem, TenantUnauthorized,
    UnsupportedMediaType,
};
use super::{ApiPath, AppState, json_typed, known_tenant};
use crate::api::auth::{AdminOnly, LiveWrite, TenantAuth};
use crate::webhooks::endpoint::{self, EndpointPolicy};
use crate::webhooks::{self, WebhookInput, WebhookView, WebhookWithSecret};

pub fn router() -> Router<AppState> {
    Router::new()
        .route(
            "/v1/webhook",
            get(get_webhook).put(put_webhook).delete(delete_webhook),
        )
        .route("/v1/webhook/rotate", post(rotate_webhook))
        .route(
            "/v1/admin/tenants/{id}/webhook",
            get(get_tenant_webhook)
                .put(put_tenant_webhook)
                .delete(delete_tenant_webhook),
        )
        .route(
            "/v1/admin/tenants/{id}/webhook/rotate",
            post(rotate_tenant_webhook),
        )
        .route(
            "/v1/admin/tenants/{id}/webhook/redrive",
            post(redrive_tenant_webhook),
        )
        .route("/v1/admin/webhooks/failing", get(list_failing))
}

fn no_webhook(tenant: &str) -> ApiError {
    ApiError::NotFound(format!("Tenant {tenant:?} has no webhook."))
}

/// Who sets a webhook: the tenant itself with a live key (a [`LiveWrite`]:
/// refused while it is disabled, charged to its bucket of changes), or an
/// admin for a tenant named in the path.
enum Setter {
    Tenant,
    Admin,
}

async fn put_for(
    state: &AppState,
    tenant: &str,
    setter: Setter,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let input: WebhookInput = json_typed(headers, body)?;
    // An admin names the tenant in the path: checked once the body is
    // known to be JSON, as the other admin writes do.
    if let Setter::Admin = setter {
        known_tenant(state, tenant)?;
    }
    let policy = EndpointPolicy::new(&state.settings.webhooks);
    let checked =
        webhooks::validate(&input, &policy).map_err(|(field, why)| ApiError::field(field, why))?;
    let url = &checked.url;
    if let Err(refusal) = policy.check_reachable(url).await {
        // The tenant learns that the URL is refused, not what its host
        // resolves to: the log has that.
        tracing::info!(%tenant, %url, reason = %refusal, "Webhook URL refused: it does not lead to a public address.");
        return Err(ApiError::field("url", endpoint::refused_because(url)));
    }
    let (webhook, secret) = webhooks::put(&state.db, tenant, &checked).await?;
    let view = webhooks::view(&state.db, webhook).await?;
    tracing::info!(%tenant, url = %view.url, events = ?view.events, "Webhook set.");
    Ok(match secret {
        Some(secret) => (
            StatusCode::CREATED,
            Json(WebhookWithSecret {
                webhook: view,
                secret,
            }),
        )
            .into_response(),
        None => Json(view).into_response(),
    })
}

async fn get_for(state: &AppState, tenant: &str) -> Result<Json<WebhookView>, ApiError> {
    let webhook = state
        .db
        .webhook(tenant)
        .await?
        .ok_or_else(|| no_webhook(tenant))?;
    Ok(Json(webhooks::view(&state.db, webhook).await?))
}

async fn delete_for(state: &AppState, tenant: &str) -> Result<StatusCode, ApiError> {
    if !state.db.delete_webhook(tenant).await? {
        return Err(no_webhook(tenant));
    }
    tracing::info!(%tenant, "Webhook removed.");
    Ok(StatusCode::NO_CONTENT)
}

async fn rotate_for(state: &AppState, tenant: &str) -> Result<Json<WebhookWithSecret>, ApiError> {
    let (webhook, secret) = webhooks::rotate(&state.db, tenant)
        .await?
        .ok_or_else(|| no_webhook(tenant))?;
    tracing::info!(%tenant, "Webhook secret rotated.");
    Ok(Json(WebhookWithSecret {
        webhook: webhooks::view(&state.db, webhook).await?,
        secret,
    }))
}

/// Set this tenant's webhook endpoint.
///
/// The URL must be `https` and lead to a public address: a host that is,
/// or resolves to, a loopback, private, link-local or other internal
/// address is refused, here and again at every call.
///
/// The first `PUT` answers 201 with the signing secret (`whsec_…`), shown
/// only then; a later `PUT` changes the URL or the event types, keeps the
/// secret, and enables a disabled endpoint again with its failed events.
/// Each event is POSTed as `{"type", "timestamp", "data": <the message's
/// status>}` with `webhook-id`, `webhook-timestamp` and
/// `webhook-signature` as the Standard Webhooks specification defines.
#[utoipa::path(
    put, path = "/v1/webhook", tag = "webhooks",
    request_body = WebhookInput,
    responses(
        (status = 200, description = "Changed; the secret is unchanged.", body = WebhookView),
        (status = 201, description = "Created; `secret` is not shown again.", body = WebhookWithSecret),
        (status = 400, description = "The body is not valid JSON.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = TenantUnauthorized),
        (status = 403, response = super::error::LiveKeyChange),
        (status = 429, response = super::error::TooManyChanges),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, description = "Invalid fields (named in `errors`): `url` not an https URL (http only where `webhooks.allow_http` is set), with a user name, a password or control characters, or whose host is or resolves to an internal address (loopback, private, link-local, …) outside `webhooks.allow_private`; `events` empty or naming an unknown event type.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("tenant_key" = []))
)]
pub async fn put_webhook(
    State(state): State<AppState>,
    LiveWrite(caller): LiveWrite,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    put_for(&state, &caller.tenant.id, Setter::Tenant, &headers, body).await
}

/// This tenant's webhook endpoint and its health.
#[utoipa::path(
    get, path = "/v1/webhook", tag = "webhooks",
    responses(
        (status = 200, description = "The endpoint.", body = WebhookView),
        (status = 401, response = TenantUnauthorized),
        (status = 404, description = "No webhook is set.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("tenant_key" = []))
)]
pub async fn get_webhook(
    State(state): State<AppState>,
    TenantAuth(caller): TenantAuth,
) -> Result<Json<WebhookView>, ApiError> {
    get_for(&state, &caller.tenant.id).await
}

/// Remove this tenant's webhook endpoint and the events still waiting for it.
#[utoipa::path(
    delete, path = "/v1/webhook", tag = "webhooks",
    responses(
        (status = 204, description = "Removed."),
        (status = 401, response = TenantUnauthorized),
        (status = 403, response = super::error::LiveKeyChange),
        (status = 429, response = super::error::TooManyChanges),
        (status = 404, description = "No webhook is set.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("tenant_key" = []))
)]
pub async fn delete_webhook(
    State(state): State<AppState>,
    LiveWrite(caller): LiveWrite,
) -> Result<StatusCode, ApiError> {
    delete_for(&state, &caller.tenant.id).await
}

/// Give this tenant's webhook a new signing secret.
///
/// The answer shows the new secret once. For 24 hours calls carry two
/// signatures, one with each secret, so receivers can switch without
/// missing an event.
#[utoipa::path(
    post, path = "/v1/webhook/rotate", tag = "webhooks",
    responses(
        (status = 200, description = "The new secret; it is not shown again.", body = WebhookWithSecret),
        (status = 401, response = TenantUnauthorized),
        (status = 403, response = super::error::LiveKeyChange),
        (status = 429, response = super::error::TooManyChanges),
        (status = 404, description = "No webhook is set.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("tenant_key" = []))
)]
pub async fn rotate_webhook(
    State(state): State<AppState>,
    LiveWrite(caller): LiveWrite,
) -> Result<Json<WebhookWithSecret>, ApiError> {
    rotate_for(&state, &caller.tenant.id).await
}

/// Set a tenant's webhook endpoint (as `PUT /v1/webhook` does for itself).
#[utoipa::path(
    put, path = "/v1/admin/tenants/{id}/webhook", tag = "admin",
    params(("id" = String, Path, description = "Tenant id.")),
    request_body = WebhookInput,
    responses(
        (status = 200, description = "Changed; the secret is unchanged.", body = WebhookView),
        (status = 201, description = "Created; `secret` is not shown again.", body = WebhookWithSecret),
        (status = 400, description = "The body is not valid JSON, or a path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No tenant with this id.", body = Problem, content_type = "application/problem+json"),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, description = "Invalid fields (named in `errors`), as for `PUT /v1/webhook`.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn put_tenant_webhook(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    put_for(&state, &id, Setter::Admin, &headers, body).await
}

/// A tenant's webhook endpoint and its health.
#[utoipa::path(
    get, path = "/v1/admin/tenants/{id}/webhook", tag = "admin",
    params(("id" = String, Path, description = "Tenant id.")),
    responses(
        (status = 200, description = "The endpoint.", body = WebhookView),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No such tenant, or it has no webhook.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn get_tenant_webhook(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<WebhookView>, ApiError> {
    known_tenant(&state, &id)?;
    get_for(&state, &id).await
}

/// Remove a tenant's webhook endpoint and the events still waiting for it.
#[utoipa::path(
    delete, path = "/v1/admin/tenants/{id}/webhook", tag = "admin",
    params(("id" = String, Path, description = "Tenant id.")),
    responses(
        (status = 204, description = "Removed."),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No such tenant, or it has no webhook.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn delete_tenant_webhook(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    known_tenant(&state, &id)?;
    delete_for(&state, &id).await
}

/// Give a tenant's webhook a new signing secret (see `POST /v1/webhook/rotate`).
#[utoipa::path(
    post, path = "/v1/admin/tenants/{id}/webhook/rotate", tag = "admin",
    params(("id" = String, Path, description = "Tenant id.")),
    responses(
        (status = 200, description = "The new secret; it is not shown again.", body = WebhookWithSecret),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No such tenant, or it has no webhook.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn rotate_tenant_webhook(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<WebhookWithSecret>, ApiError> {
    known_tenant(&state, &id)?;
    rotate_for(&state, &id).await
}

/// How many events a redrive made pending again.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct WebhookRedriven {
    pub redriven: u64,
}

/// Enable a tenant's webhook again and resend its failed events.
///
/// Events given up on, and those recorded while the endpoint was disabled,
/// become pending, due now, in their original order per message, with
/// their original `webhook-id`.
#[utoipa::path(
    post, path = "/v1/admin/tenants/{id}/webhook/redrive", tag = "admin",
    params(("id" = String, Path, description = "Tenant id.")),
    responses(
        (status = 200, description = "The endpoint is enabled; this many events are pending again.", body = WebhookRedriven),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No such tenant, or it has no webhook.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn redrive_tenant_webhook(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<WebhookRedriven>, ApiError> {
    known_tenant(&state, &id)?;
    let redriven = state
        .db
        .redrive_webhook(&id)
        .await?
        .ok_or_else(|| no_webhook(&id))?;
    tracing::info!(tenant = %id, redriven, "Webhook redriven.");
    Ok(Json(WebhookRedriven { redriven }))
}

/// Webhook endpoints that are failing or disabled.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct FailingWebhooks {
    pub webhooks: Vec<WebhookView>,
}

/// Webhook endpoints whose calls are failing (retrying) or that were
/// disabled after failing for `webhooks.disable_after_secs`, oldest
/// failure first (at most 1,000).
#[utoipa::path(
    get, path = "/v1/admin/webhooks/failing", tag = "admin",
    responses(
        (status = 200, description = "The failing and disabled endpoints.", body = FailingWebhooks),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
    ),
    security(("admin_token" = []))
)]
pub async fn list_failing(
    State(state): State<AppState>,
    _admin: AdminOnly,
) -> Result<Json<FailingWebhooks>, ApiError> {
    let mut views = Vec::new();
    for webhook in state.db.failing_webhooks().await? {
        views.push(webhooks::view(&state.db, webhook).await?);
    }
    Ok(Json(FailingWebhooks { webhooks: views }))
}
