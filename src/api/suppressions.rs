//! Suppression lists: a tenant manages its own at `/v1/suppressions` (API
//! key), an admin any tenant's at `/v1/admin/tenants/{id}/suppressions`.
//! See [`crate::store::suppressions`].

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::{
    AdminForbidden, AdminUnauthorized, ApiError, PayloadTooLarge, Problem, TenantUnauthorized,
    UnsupportedMediaType,
};
use super::{ApiPath, AppState, json_typed, known_tenant};
use crate::api::auth::{AdminOnly, LiveWrite, TenantAuth};
use crate::store::suppressions::{self, Suppression};

pub fn router() -> Router<AppState> {
    Router::new()
        .route(
            "/v1/suppressions",
            get(list_suppressions).post(add_suppression),
        )
        .route(
            "/v1/suppressions/{address}",
            get(get_suppression).delete(remove_suppression),
        )
        .route(
            "/v1/admin/tenants/{id}/suppressions",
            get(list_tenant_suppressions).post(add_tenant_suppression),
        )
        .route(
            "/v1/admin/tenants/{id}/suppressions/{address}",
            get(get_tenant_suppression).delete(remove_tenant_suppression),
        )
}

/// An address as the suppression routes take it, in the OpenAPI document:
/// an email address (as a send's `to`: at most 254 characters) or an E.164
/// number (as an SMS's `to`).
pub struct SuppressionAddress;

impl utoipa::PartialSchema for SuppressionAddress {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{KnownFormat, SchemaFormat, Type};
        use utoipa::openapi::{ObjectBuilder, OneOfBuilder};
        let email = ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Email)))
            .min_length(Some(3))
            .max_length(Some(254));
        let number = ObjectBuilder::new()
            .schema_type(Type::String)
            .pattern(Some(r"^\+[1-9][0-9]{7,14}$"));
        OneOfBuilder::new()
            .item(email)
            .item(number)
            .description(Some(
                "An email address (any case; stored in lower case) or an E.164 number.",
            ))
            .into()
    }
}

impl utoipa::ToSchema for SuppressionAddress {}

/// Body of a `POST` to a suppression list.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SuppressionInput {
    /// An email address or an E.164 number; stored normalised (email in
    /// lower case).
    #[schema(value_type = SuppressionAddress)]
    pub address: String,
    /// A note kept with the entry (at most 500 characters).
    #[schema(max_length = 500)]
    pub detail: Option<String>,
}

/// Paging of a suppression list.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct SuppressionQuery {
    /// Start after this address (the `next` of the previous page).
    pub after: Option<String>,
    /// At most this many (default 100, at most 1,000).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<i64>,
}

/// One page of a suppression list, in address order.
#[derive(Debug, Serialize, ToSchema)]
pub struct SuppressionList {
    pub suppressions: Vec<Suppression>,
    /// Pass as `after` for the next page; absent on the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

/// The normalised form of a path's address, or a 422 naming it.
fn address_of(raw: &str) -> Result<String, ApiError> {
    suppressions::normalize(raw)
        .map(|(_, address)| address)
        .ok_or_else(|| {
            ApiError::field(
                "address",
                "must be an email address or an E.164 number like +15551234567",
            )
        })
}

async fn list_for(
    state: &AppState,
    tenant: &str,
    query: Result<axum::extract::Query<SuppressionQuery>, QueryRejection>,
) -> Result<Json<SuppressionList>, ApiError> {
    let axum::extract::Query(query) = query
        .map_err(|err| ApiError::BadRequest(format!("Invalid query: {}.", err.body_text())))?;
    let limit = query.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::field("limit", "must be between 1 and 1000"));
    }
    let page = state
        .db
        .suppressions_of(tenant, query.after.as_deref(), limit)
        .await?;
    let next = (page.len() as i64 == limit)
        .then(|| page.last().map(|entry| entry.address.clone()))
        .flatten();
    Ok(Json(SuppressionList {
        suppressions: page,
        next,
    }))
}

async fn add_for(
    state: &AppState,
    tenant: &str,
    by_admin: bool,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let input: SuppressionInput = json_typed(headers, body)?;
    // An admin names the tenant in the path: checked once the body is
    // known to be JSON, as the other admin writes do.
    if by_admin {
        known_tenant(state, tenant)?;
    }
    let (added, entry) = add_entry(state, tenant, &input).await?;
    if added {
        Ok((StatusCode::CREATED, Json(entry)).into_response())
    } else {
        Ok(Json(entry).into_response())
    }
}

/// Puts `input`'s address on `tenant`'s list: whether it was added (not
/// there before), and the entry. The API's and the console's.
pub(crate) async fn add_entry(
    state: &AppState,
    tenant: &str,
    input: &SuppressionInput,
) -> Result<(bool, Suppression), ApiError> {
    let Some((channel, address)) = suppressions::normalize(&input.address) else {
        return Err(ApiError::field(
            "address",
            "must be an email address or an E.164 number like +15551234567",
        ));
    };
    if input
        .detail
        .as_ref()
        .is_some_and(|d| d.chars().count() > 500)
    {
        return Err(ApiError::field("detail", "must be at most 500 characters"));
    }
    let added = state
        .db
        .add_suppression(tenant, channel, &address, input.detail.as_deref())
        .await?;
    let entry = state
        .db
        .suppression(tenant, &address)
        .await?
        .ok_or_else(|| anyhow::anyhow!("the suppression just written is gone"))?;
    if added {
        tracing::info!(%tenant, channel = channel.as_str(), "Address suppressed by hand.");
    }
    Ok((added, entry))
}

async fn get_for(state: &AppState, tenant: &str, raw: &str) -> Result<Json<Suppression>, ApiError> {
    let address = address_of(raw)?;
    state
        .db
        .suppression(tenant, &address)
        .await?
        .map(Json)
        .ok_or_else(|| ApiError::NotFound("This address is not on the list.".into()))
}

pub(crate) async fn remove_for(
    state: &AppState,
    tenant: &str,
    raw: &str,
) -> Result<StatusCode, ApiError> {
    let address = address_of(raw)?;
    if !state.db.remove_suppression(tenant, &address).await? {
        return Err(ApiError::NotFound(
            "This address is not on the list.".into(),
        ));
    }
    tracing::info!(%tenant, "Address removed from the suppression list.");
    Ok(StatusCode::NO_CONTENT)
}

/// This tenant's suppression list.
///
/// Sends to a listed address answer 202 and end `suppressed` without a
/// provider call. Hard bounces and complaints add addresses; so can the
/// tenant.
#[utoipa::path(
    get, path = "/v1/suppressions", tag = "suppressions",
    params(SuppressionQuery),
    responses(
        (status = 200, description = "One page of the list.", body = SuppressionList),
        (status = 400, description = "A malformed query.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = TenantUnauthorized),
        (status = 422, description = "`limit` out of range.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("tenant_key" = []))
)]
pub async fn list_suppressions(
    State(state): State<AppState>,
    TenantAuth(caller): TenantAuth,
    query: Result<axum::extract::Query<SuppressionQuery>, QueryRejection>,
) -> Result<Json<SuppressionList>, ApiError> {
    list_for(&state, &caller.tenant.id, query).await
}

/// Add an address to this tenant's suppression list.
#[utoipa::path(
    post, path = "/v1/suppressions", tag = "suppressions",
    request_body = SuppressionInput,
    responses(
        (status = 200, description = "Already listed; the entry as it was.", body = Suppression),
        (status = 201, description = "Added.", body = Suppression),
        (status = 400, description = "The body is not valid JSON.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = TenantUnauthorized),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, description = "Invalid fields (named in `errors`).", body = Problem, content_type = "application/problem+json"),
        (status = 403, response = super::error::LiveKeyChange),
        (status = 429, response = super::error::TooManyChanges),
    ),
    security(("tenant_key" = []))
)]
pub async fn add_suppression(
    State(state): State<AppState>,
    LiveWrite(caller): LiveWrite,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    add_for(&state, &caller.tenant.id, false, &headers, body).await
}

/// One entry of this tenant's suppression list.
#[utoipa::path(
    get, path = "/v1/suppressions/{address}", tag = "suppressions",
    params(("address" = SuppressionAddress, Path, description = "Email address or E.164 number (any case).")),
    responses(
        (status = 200, description = "The entry.", body = Suppression),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = TenantUnauthorized),
        (status = 404, description = "Not on the list.", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Not an email address or E.164 number.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("tenant_key" = []))
)]
pub async fn get_suppression(
    State(state): State<AppState>,
    TenantAuth(caller): TenantAuth,
    ApiPath(address): ApiPath<String>,
) -> Result<Json<Suppression>, ApiError> {
    get_for(&state, &caller.tenant.id, &address).await
}

/// Remove an address from this tenant's suppression list; sends to it go
/// out again.
#[utoipa::path(
    delete, path = "/v1/suppressions/{address}", tag = "suppressions",
    params(("address" = SuppressionAddress, Path, description = "Email address or E.164 number (any case).")),
    responses(
        (status = 204, description = "Removed."),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = TenantUnauthorized),
        (status = 404, description = "Not on the list.", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Not an email address or E.164 number.", body = Problem, content_type = "application/problem+json"),
        (status = 403, response = super::error::LiveKeyChange),
        (status = 429, response = super::error::TooManyChanges),
    ),
    security(("tenant_key" = []))
)]
pub async fn remove_suppression(
    State(state): State<AppState>,
    LiveWrite(caller): LiveWrite,
    ApiPath(address): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    remove_for(&state, &caller.tenant.id, &address).await
}

/// A tenant's suppression list (see `GET /v1/suppressions`).
#[utoipa::path(
    get, path = "/v1/admin/tenants/{id}/suppressions", tag = "admin",
    params(("id" = String, Path, description = "Tenant id."), SuppressionQuery),
    responses(
        (status = 200, description = "One page of the list.", body = SuppressionList),
        (status = 400, description = "A malformed query or path.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No tenant with this id.", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "`limit` out of range.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn list_tenant_suppressions(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
    query: Result<axum::extract::Query<SuppressionQuery>, QueryRejection>,
) -> Result<Json<SuppressionList>, ApiError> {
    known_tenant(&state, &id)?;
    list_for(&state, &id, query).await
}

/// Add an address to a tenant's suppression list.
#[utoipa::path(
    post, path = "/v1/admin/tenants/{id}/suppressions", tag = "admin",
    params(("id" = String, Path, description = "Tenant id.")),
    request_body = SuppressionInput,
    responses(
        (status = 200, description = "Already listed; the entry as it was.", body = Suppression),
        (status = 201, description = "Added.", body = Suppression),
        (status = 400, description = "The body is not valid JSON, or a path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No tenant with this id.", body = Problem, content_type = "application/problem+json"),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, description = "Invalid fields (named in `errors`).", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn add_tenant_suppression(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    add_for(&state, &id, true, &headers, body).await
}

/// One entry of a tenant's suppression list.
#[utoipa::path(
    get, path = "/v1/admin/tenants/{id}/suppressions/{address}", tag = "admin",
    params(
        ("id" = String, Path, description = "Tenant id."),
        ("address" = SuppressionAddress, Path, description = "Email address or E.164 number (any case)."),
    ),
    responses(
        (status = 200, description = "The entry.", body = Suppression),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No such tenant, or not on its list.", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Not an email address or E.164 number.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn get_tenant_suppression(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath((id, address)): ApiPath<(String, String)>,
) -> Result<Json<Suppression>, ApiError> {
    known_tenant(&state, &id)?;
    get_for(&state, &id, &address).await
}

/// Remove an address from a tenant's suppression list.
#[utoipa::path(
    delete, path = "/v1/admin/tenants/{id}/suppressions/{address}", tag = "admin",
    params(
        ("id" = String, Path, description = "Tenant id."),
        ("address" = SuppressionAddress, Path, description = "Email address or E.164 number (any case)."),
    ),
    responses(
        (status = 204, description = "Removed."),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No such tenant, or not on its list.", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Not an email address or E.164 number.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn remove_tenant_suppression(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath((id, address)): ApiPath<(String, String)>,
) -> Result<StatusCode, ApiError> {
    known_tenant(&state, &id)?;
    remove_for(&state, &id, &address).await
}
