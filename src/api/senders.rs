//! Sender identities: an admin gives a tenant its identities at
//! `/v1/admin/tenants/{id}/senders`; a tenant lists its own at
//! `/v1/senders` to learn the ids a send names in `sender_id`. See
//! [`crate::tenants::senders`].

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::{get, patch};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::{
    AdminForbidden, AdminUnauthorized, ApiError, PayloadTooLarge, Problem, TenantUnauthorized,
    UnsupportedMediaType,
};
use super::{ApiPath, AppState, json_typed};
use crate::api::auth::{AdminOnly, TenantAuth};
use crate::tenants::{NewSender, SenderIdentity};

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/senders", get(list_own_senders))
        .route(
            "/v1/admin/tenants/{id}/senders",
            get(list_senders).post(add_sender),
        )
        .route(
            "/v1/admin/tenants/{id}/senders/{sender_id}",
            patch(patch_sender).delete(remove_sender),
        )
}

/// A tenant's sender identities, oldest first.
#[derive(Debug, Serialize, ToSchema)]
pub struct SenderList {
    pub senders: Vec<SenderIdentity>,
}

/// Body of `PATCH /v1/admin/tenants/{id}/senders/{sender_id}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PatchSender {
    /// `true`: the tenant's default for the identity's channel (the
    /// previous default stops being one); `false`: not a default.
    pub default: bool,
}

/// This tenant's sender identities.
///
/// A send names one with `sender_id`; without it the tenant's default for
/// the channel is used, then the gateway's configured sender.
#[utoipa::path(
    get, path = "/v1/senders", tag = "messages",
    responses(
        (status = 200, description = "The tenant's identities, oldest first.", body = SenderList),
        (status = 401, response = TenantUnauthorized),
    ),
    security(("tenant_key" = []))
)]
pub async fn list_own_senders(TenantAuth(caller): TenantAuth) -> Json<SenderList> {
    Json(SenderList {
        senders: caller.senders.as_ref().clone(),
    })
}

/// A tenant's sender identities.
#[utoipa::path(
    get, path = "/v1/admin/tenants/{id}/senders", tag = "admin",
    params(("id" = String, Path, description = "Tenant id.")),
    responses(
        (status = 200, description = "The tenant's identities, oldest first.", body = SenderList),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No tenant with this id.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn list_senders(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<SenderList>, ApiError> {
    Ok(Json(SenderList {
        senders: state.registry.senders_of(&id).await?,
    }))
}

/// Give a tenant a sender identity.
///
/// Email: a from address (an identity verified in SES), with an optional
/// display name, reply-to addresses and SES configuration set. SMS: a
/// sender number or alphanumeric id, or a messaging service. With
/// `default: true` it becomes the tenant's default for its channel.
#[utoipa::path(
    post, path = "/v1/admin/tenants/{id}/senders", tag = "admin",
    params(("id" = String, Path, description = "Tenant id.")),
    request_body = NewSender,
    responses(
        (status = 201, description = "The identity.", body = SenderIdentity,
            headers(("Location" = String, description = "/v1/admin/tenants/{id}/senders/{sender_id}"))),
        (status = 400, description = "The body is not valid JSON, or a path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No tenant with this id.", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "The tenant has the most identities it may have (100).", body = Problem, content_type = "application/problem+json"),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, description = "Invalid fields (named in `errors`).", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn add_sender(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let input: NewSender = json_typed(&headers, body)?;
    let sender = state.registry.add_sender(&id, &input).await?;
    tracing::info!(tenant = %id, sender = %sender.id, channel = %sender.channel, "Sender identity added.");
    let location = format!("/v1/admin/tenants/{id}/senders/{}", sender.id);
    Ok(super::admin::created(location, sender))
}

/// Make a sender identity the tenant's default for its channel, or not.
#[utoipa::path(
    patch, path = "/v1/admin/tenants/{id}/senders/{sender_id}", tag = "admin",
    params(
        ("id" = String, Path, description = "Tenant id."),
        ("sender_id" = String, Path, description = "Identity id (`snd_…`)."),
    ),
    request_body = PatchSender,
    responses(
        (status = 200, description = "The identity as changed.", body = SenderIdentity),
        (status = 400, description = "The body is not valid JSON, or a path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No such identity of this tenant.", body = Problem, content_type = "application/problem+json"),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, description = "Invalid fields (named in `errors`).", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn patch_sender(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath((id, sender_id)): ApiPath<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<SenderIdentity>, ApiError> {
    let input: PatchSender = json_typed(&headers, body)?;
    Ok(Json(
        state
            .registry
            .set_default_sender(&id, &sender_id, input.default)
            .await?,
    ))
}

/// Remove a sender identity.
///
/// Messages already accepted with it still go out with it; later sends
/// naming it are refused.
#[utoipa::path(
    delete, path = "/v1/admin/tenants/{id}/senders/{sender_id}", tag = "admin",
    params(
        ("id" = String, Path, description = "Tenant id."),
        ("sender_id" = String, Path, description = "Identity id (`snd_…`)."),
    ),
    responses(
        (status = 204, description = "The identity is gone."),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No such identity of this tenant.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn remove_sender(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath((id, sender_id)): ApiPath<(String, String)>,
) -> Result<StatusCode, ApiError> {
    state.registry.remove_sender(&id, &sender_id).await?;
    tracing::info!(tenant = %id, sender = %sender_id, "Sender identity removed.");
    Ok(StatusCode::NO_CONTENT)
}
