//! A tenant's templates over the API: `/v1/templates` with a tenant's key
//! (reading and previewing with any key, changing with a live one: both
//! worlds send with the same templates), and
//! `/v1/admin/tenants/{id}/templates` for admins. See [`crate::templates`]
//! for what a template holds and how it renders.

use std::collections::BTreeMap;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::auth::{AdminOnly, LiveWrite, TenantAuth};
use super::error::{
    AdminForbidden, AdminUnauthorized, ApiError, LiveKeyChange, PayloadTooLarge, Problem,
    TenantUnauthorized, TooManyChanges, UnsupportedMediaType,
};
use super::{ApiPath, AppState, json_typed, known_tenant};
use crate::model::{Channel, ms_to_rfc3339, now_ms};
use crate::store::templates::{TemplateRow, TemplateVersionRow};
use crate::templates::TemplateContent;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/templates", get(list_own).post(create_own))
        .route(
            "/v1/templates/{template_id}",
            get(get_own).put(replace_own).delete(delete_own),
        )
        .route("/v1/templates/{template_id}/preview", post(preview))
        .route(
            "/v1/admin/tenants/{id}/templates",
            get(list_tenant_templates).post(create_tenant_template),
        )
        .route(
            "/v1/admin/tenants/{id}/templates/{template_id}",
            get(get_tenant_template)
                .put(replace_tenant_template)
                .delete(delete_tenant_template),
        )
}

/// A template: its newest version (or the one asked for), with the
/// placeholders a send may fill.
#[derive(Debug, Serialize, ToSchema)]
pub struct TemplateView {
    /// `tpl_` and 32 hex digits; what a send names in `template_id`.
    pub id: String,
    /// This version's number (the first is 1; each change adds one).
    pub version: u32,
    /// The newest version's number.
    pub latest_version: u32,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339: when this version was made.
    pub version_created_at: String,
    /// The placeholders of every variant: the names `personalisation`
    /// may give.
    pub placeholders: Vec<String>,
    #[serde(flatten)]
    pub content: TemplateContent,
}

/// A template in a list: its newest version's name and number.
#[derive(Debug, Serialize, ToSchema)]
pub struct TemplateSummary {
    pub id: String,
    pub name: String,
    pub channel: Channel,
    pub version: u32,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339: when its newest version was made.
    pub updated_at: String,
}

/// A tenant's templates, by id (oldest first).
#[derive(Debug, Serialize, ToSchema)]
pub struct TemplateList {
    pub templates: Vec<TemplateSummary>,
}

/// `?version=`: one version rather than the newest.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct VersionQuery {
    /// A version number (from 1).
    #[param(minimum = 1)]
    pub version: Option<u32>,
}

/// Body of `POST /v1/templates/{template_id}/preview`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PreviewRequest {
    /// The placeholders' values, as a send gives them.
    #[schema(value_type = Option<std::collections::HashMap<String, String>>)]
    pub personalisation: Option<serde_json::Value>,
    /// The locale whose variant to render (`fr-CA` falls back to `fr`,
    /// then to the default).
    #[schema(max_length = 35, pattern = r"^[A-Za-z]{2,3}(?:-[A-Za-z0-9]{2,8})*$")]
    pub locale: Option<String>,
    /// A version (default: the newest).
    #[schema(minimum = 1)]
    pub version: Option<u32>,
}

/// What a send with this personalisation would deliver.
#[derive(Debug, Serialize, ToSchema)]
pub struct Preview {
    pub version: u32,
    /// The locale variant used; absent: the default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub locale: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    pub text: String,
    /// The HTML part, personalisation escaped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub html: Option<String>,
    /// SMS: the fragments the text is sent in.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fragments: Option<u32>,
    /// SMS: `gsm7` or `ucs2`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encoding: Option<&'static str>,
}

/// `?version=`, or a 400 problem for a query that is not one.
fn version_of(query: Result<Query<VersionQuery>, QueryRejection>) -> Result<Option<u32>, ApiError> {
    let Query(query) = query
        .map_err(|err| ApiError::BadRequest(format!("Invalid query: {}.", err.body_text())))?;
    Ok(query.version)
}

fn no_template(id: &str) -> ApiError {
    ApiError::NotFound(format!("No template {id:?}."))
}

/// A tenant's template and a version of it, or 404.
async fn template_view(
    state: &AppState,
    tenant: &str,
    id: &str,
    version: Option<u32>,
) -> Result<TemplateView, ApiError> {
    let (row, stored) =
        state
            .db
            .template(tenant, id, version)
            .await?
            .ok_or_else(|| match version {
                Some(n) => ApiError::NotFound(format!("Template {id:?} has no version {n}.")),
                None => no_template(id),
            })?;
    view(row, stored)
}

fn view(row: TemplateRow, stored: TemplateVersionRow) -> Result<TemplateView, ApiError> {
    let content = crate::templates::parse(&stored.body)?;
    Ok(TemplateView {
        id: row.id,
        version: stored.version,
        latest_version: row.version,
        created_at: ms_to_rfc3339(row.created_at),
        version_created_at: ms_to_rfc3339(stored.created_at),
        placeholders: content.placeholders().into_iter().collect(),
        content,
    })
}

/// The body read as a template and checked, every bad field named.
fn content_of(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<TemplateContent, ApiError> {
    let content: TemplateContent = json_typed(headers, body)?;
    content.check().map_err(ApiError::Validation)?;
    Ok(content)
}

async fn list_for(state: &AppState, tenant: &str) -> Result<Json<TemplateList>, ApiError> {
    let rows = state.db.templates_of(tenant).await?;
    Ok(Json(TemplateList {
        templates: rows
            .into_iter()
            .map(|row| TemplateSummary {
                channel: row.channel.parse().unwrap_or(Channel::Email),
                id: row.id,
                name: row.name,
                version: row.version,
                created_at: ms_to_rfc3339(row.created_at),
                updated_at: ms_to_rfc3339(row.updated_at),
            })
            .collect(),
    }))
}

async fn create_for(
    state: &AppState,
    tenant: &str,
    location: &str,
    content: TemplateContent,
) -> Result<Response, ApiError> {
    let now = now_ms();
    let row = TemplateRow {
        id: format!("tpl_{}", uuid::Uuid::now_v7().simple()),
        tenant_id: tenant.to_owned(),
        channel: content.channel.as_str().to_owned(),
        name: content.name.clone(),
        version: 1,
        created_at: now,
        updated_at: now,
    };
    let body = serde_json::to_string(&content).map_err(anyhow::Error::from)?;
    state.db.insert_template(&row, &body).await?;
    tracing::info!(%tenant, template = %row.id, "Template created.");
    let location = format!("{location}/{}", row.id);
    let stored = TemplateVersionRow {
        template_id: row.id.clone(),
        version: 1,
        body,
        created_at: now,
    };
    let answer = view(row, stored)?;
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(answer),
    )
        .into_response())
}

async fn replace_for(
    state: &AppState,
    tenant: &str,
    id: &str,
    content: TemplateContent,
) -> Result<Json<TemplateView>, ApiError> {
    let Some((row, _)) = state.db.template(tenant, id, None).await? else {
        return Err(no_template(id));
    };
    if row.channel != content.channel.as_str() {
        return Err(ApiError::field(
            "channel",
            format!(
                "must stay {}: a template's sends are of one channel",
                row.channel
            ),
        ));
    }
    let body = serde_json::to_string(&content).map_err(anyhow::Error::from)?;
    let version = state
        .db
        .add_template_version(tenant, id, &content.name, &body, now_ms())
        .await?;
    state.accept.templates().forget(tenant, id);
    tracing::info!(%tenant, template = %id, version, "Template changed.");
    Ok(Json(template_view(state, tenant, id, Some(version)).await?))
}

async fn delete_for(state: &AppState, tenant: &str, id: &str) -> Result<StatusCode, ApiError> {
    if !state.db.delete_template(tenant, id, now_ms()).await? {
        return Err(no_template(id));
    }
    state.accept.templates().forget(tenant, id);
    tracing::info!(%tenant, template = %id, "Template deleted.");
    Ok(StatusCode::NO_CONTENT)
}

/// This tenant's templates.
#[utoipa::path(
    get, path = "/v1/templates", tag = "templates",
    responses(
        (status = 200, description = "The templates, by id.", body = TemplateList),
        (status = 401, response = TenantUnauthorized),
    ),
    security(("tenant_key" = []))
)]
pub async fn list_own(
    State(state): State<AppState>,
    TenantAuth(caller): TenantAuth,
) -> Result<Json<TemplateList>, ApiError> {
    list_for(&state, &caller.tenant.id).await
}

/// Create a template.
///
/// Email: a subject and a text, an optional HTML part; SMS: a text.
/// `((name))` is a placeholder a send fills from its `personalisation`.
/// `locales` holds variants a send's `locale` picks. A `priority` or
/// `lane` here is what every send of the template gets. A live key is
/// needed: test and live sends share the tenant's templates.
#[utoipa::path(
    post, path = "/v1/templates", tag = "templates",
    request_body = TemplateContent,
    responses(
        (status = 201, description = "Created as version 1.", body = TemplateView,
            headers(("Location" = String, description = "/v1/templates/{template_id}"))),
        (status = 400, description = "The body is not valid JSON.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = TenantUnauthorized),
        (status = 403, response = LiveKeyChange),
        (status = 409, description = "Another template has this name, or the tenant has 1,000 templates.", body = Problem, content_type = "application/problem+json"),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, description = "Invalid fields (named in `errors`, `locales.fr.text` for a variant's).", body = Problem, content_type = "application/problem+json"),
        (status = 429, response = TooManyChanges),
    ),
    security(("tenant_key" = []))
)]
pub async fn create_own(
    State(state): State<AppState>,
    LiveWrite(caller): LiveWrite,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let content = content_of(&headers, body)?;
    create_for(&state, &caller.tenant.id, "/v1/templates", content).await
}

/// One of this tenant's templates: its newest version, or `?version=`.
#[utoipa::path(
    get, path = "/v1/templates/{template_id}", tag = "templates",
    params(("template_id" = String, Path, description = "Template id."), VersionQuery),
    responses(
        (status = 200, description = "The template.", body = TemplateView),
        (status = 400, description = "A path segment is not valid UTF-8, or `version` is not a number.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = TenantUnauthorized),
        (status = 404, description = "No such template, or no such version.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("tenant_key" = []))
)]
pub async fn get_own(
    State(state): State<AppState>,
    TenantAuth(caller): TenantAuth,
    ApiPath(id): ApiPath<String>,
    query: Result<Query<VersionQuery>, QueryRejection>,
) -> Result<Json<TemplateView>, ApiError> {
    Ok(Json(
        template_view(&state, &caller.tenant.id, &id, version_of(query)?).await?,
    ))
}

/// Change a template: the body is its whole new content, kept as the
/// next version. Messages accepted before keep the version they named.
#[utoipa::path(
    put, path = "/v1/templates/{template_id}", tag = "templates",
    params(("template_id" = String, Path, description = "Template id.")),
    request_body = TemplateContent,
    responses(
        (status = 200, description = "The new version.", body = TemplateView),
        (status = 400, description = "The body is not valid JSON, or a path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = TenantUnauthorized),
        (status = 403, response = LiveKeyChange),
        (status = 404, description = "No such template.", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Another template has this name.", body = Problem, content_type = "application/problem+json"),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, description = "Invalid fields (named in `errors`); `channel` cannot change.", body = Problem, content_type = "application/problem+json"),
        (status = 429, response = TooManyChanges),
    ),
    security(("tenant_key" = []))
)]
pub async fn replace_own(
    State(state): State<AppState>,
    LiveWrite(caller): LiveWrite,
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<TemplateView>, ApiError> {
    let content = content_of(&headers, body)?;
    replace_for(&state, &caller.tenant.id, &id, content).await
}

/// Delete a template: sends can no longer name it; messages already
/// accepted are still rendered from their version.
#[utoipa::path(
    delete, path = "/v1/templates/{template_id}", tag = "templates",
    params(("template_id" = String, Path, description = "Template id.")),
    responses(
        (status = 204, description = "Deleted."),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = TenantUnauthorized),
        (status = 403, response = LiveKeyChange),
        (status = 404, description = "No such template.", body = Problem, content_type = "application/problem+json"),
        (status = 429, response = TooManyChanges),
    ),
    security(("tenant_key" = []))
)]
pub async fn delete_own(
    State(state): State<AppState>,
    LiveWrite(caller): LiveWrite,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    delete_for(&state, &caller.tenant.id, &id).await
}

/// Render a template without sending it.
///
/// The answer is what a send with the same personalisation and locale
/// would deliver, with an SMS's fragments and encoding; a missing or
/// unknown placeholder is a 422 naming it, as for a send.
#[utoipa::path(
    post, path = "/v1/templates/{template_id}/preview", tag = "templates",
    params(("template_id" = String, Path, description = "Template id.")),
    request_body = PreviewRequest,
    responses(
        (status = 200, description = "The rendered message.", body = Preview),
        (status = 400, description = "The body is not valid JSON, or a path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = TenantUnauthorized),
        (status = 404, description = "No such template, or no such version.", body = Problem, content_type = "application/problem+json"),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, description = "Invalid fields (named in `errors`: `personalisation.code`, `locale`, …).", body = Problem, content_type = "application/problem+json"),
    ),
    security(("tenant_key" = []))
)]
pub async fn preview(
    State(state): State<AppState>,
    TenantAuth(caller): TenantAuth,
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Preview>, ApiError> {
    let request: PreviewRequest = json_typed(&headers, body)?;
    let mut errors = BTreeMap::new();
    let values = crate::message::personalisation_of(request.personalisation.as_ref(), &mut errors);
    if let Some(locale) = &request.locale
        && !crate::message::is_locale(locale)
    {
        errors.insert("locale".into(), "must be a locale like fr or fr-CA".into());
    }
    if !errors.is_empty() {
        return Err(ApiError::Validation(errors));
    }
    let template = template_view(&state, &caller.tenant.id, &id, request.version).await?;
    let rendered = template
        .content
        .render(request.locale.as_deref(), &values)
        .map_err(ApiError::Validation)?;
    let sms =
        (template.content.channel == Channel::Sms).then(|| crate::sms::fragments(&rendered.text));
    Ok(Json(Preview {
        version: template.version,
        locale: rendered.locale,
        subject: rendered.subject,
        text: rendered.text,
        html: rendered.html,
        fragments: sms.map(|(_, n)| n),
        encoding: sms.map(|(encoding, _)| encoding.as_str()),
    }))
}

/// A tenant's templates.
#[utoipa::path(
    get, path = "/v1/admin/tenants/{id}/templates", tag = "admin",
    params(("id" = String, Path, description = "Tenant id.")),
    responses(
        (status = 200, description = "The templates, by id.", body = TemplateList),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No tenant with this id.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn list_tenant_templates(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<TemplateList>, ApiError> {
    known_tenant(&state, &id)?;
    list_for(&state, &id).await
}

/// Create a template for a tenant (as `POST /v1/templates` does).
#[utoipa::path(
    post, path = "/v1/admin/tenants/{id}/templates", tag = "admin",
    params(("id" = String, Path, description = "Tenant id.")),
    request_body = TemplateContent,
    responses(
        (status = 201, description = "Created as version 1.", body = TemplateView,
            headers(("Location" = String, description = "/v1/admin/tenants/{id}/templates/{template_id}"))),
        (status = 400, description = "The body is not valid JSON, or a path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No tenant with this id.", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Another template has this name, or the tenant has 1,000 templates.", body = Problem, content_type = "application/problem+json"),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, description = "Invalid fields (named in `errors`).", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn create_tenant_template(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let content = content_of(&headers, body)?;
    known_tenant(&state, &id)?;
    let location = format!("/v1/admin/tenants/{id}/templates");
    create_for(&state, &id, &location, content).await
}

/// One of a tenant's templates: its newest version, or `?version=`.
#[utoipa::path(
    get, path = "/v1/admin/tenants/{id}/templates/{template_id}", tag = "admin",
    params(
        ("id" = String, Path, description = "Tenant id."),
        ("template_id" = String, Path, description = "Template id."),
        VersionQuery,
    ),
    responses(
        (status = 200, description = "The template.", body = TemplateView),
        (status = 400, description = "A path segment is not valid UTF-8, or `version` is not a number.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No such tenant, template or version.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn get_tenant_template(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath((tenant, id)): ApiPath<(String, String)>,
    query: Result<Query<VersionQuery>, QueryRejection>,
) -> Result<Json<TemplateView>, ApiError> {
    known_tenant(&state, &tenant)?;
    Ok(Json(
        template_view(&state, &tenant, &id, version_of(query)?).await?,
    ))
}

/// Change a tenant's template (as `PUT /v1/templates/{template_id}` does).
#[utoipa::path(
    put, path = "/v1/admin/tenants/{id}/templates/{template_id}", tag = "admin",
    params(
        ("id" = String, Path, description = "Tenant id."),
        ("template_id" = String, Path, description = "Template id."),
    ),
    request_body = TemplateContent,
    responses(
        (status = 200, description = "The new version.", body = TemplateView),
        (status = 400, description = "The body is not valid JSON, or a path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No such tenant or template.", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Another template has this name.", body = Problem, content_type = "application/problem+json"),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, description = "Invalid fields (named in `errors`).", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn replace_tenant_template(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath((tenant, id)): ApiPath<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<TemplateView>, ApiError> {
    let content = content_of(&headers, body)?;
    known_tenant(&state, &tenant)?;
    replace_for(&state, &tenant, &id, content).await
}

/// Delete a tenant's template.
#[utoipa::path(
    delete, path = "/v1/admin/tenants/{id}/templates/{template_id}", tag = "admin",
    params(
        ("id" = String, Path, description = "Tenant id."),
        ("template_id" = String, Path, description = "Template id."),
    ),
    responses(
        (status = 204, description = "Deleted."),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No such tenant or template.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn delete_tenant_template(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath((tenant, id)): ApiPath<(String, String)>,
) -> Result<StatusCode, ApiError> {
    known_tenant(&state, &tenant)?;
    delete_for(&state, &tenant, &id).await
}
