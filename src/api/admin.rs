//! Admin API (`/v1/admin/*`, admin bearer token): plans, tenants and their
//! API keys. Every change goes through the [`Registry`](crate::tenants::Registry),
//! which writes the database and then its in-memory cache, so the accept
//! path sees it on the next request.

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use serde::{Deserialize, Serialize};
use tracing::warn;
use utoipa::ToSchema;

use super::error::{
    AdminForbidden, AdminUnauthorized, ApiError, PayloadTooLarge, Problem, UnsupportedMediaType,
};
use super::{ApiPath, AppState, json_typed};
use crate::api::audit::AuditBefore;
use crate::api::auth::AdminOnly;
use crate::model::{Isolation, Lane, TenantStatus};
use crate::tenants::{KeyInfo, KeyKind, Plan, Tenant, TenantChange, TenantOptions};

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/admin/plans", get(list_plans))
        .route("/v1/admin/plans/{name}", put(put_plan).get(get_plan))
        .route("/v1/admin/tenants", post(create_tenant).get(list_tenants))
        .route(
            "/v1/admin/tenants/{id}",
            get(get_tenant).patch(patch_tenant).delete(delete_tenant),
        )
        .route("/v1/admin/tenants/{id}/keys", post(issue_key))
        .route(
            "/v1/admin/tenants/{id}/keys/{key_id}",
            axum::routing::delete(revoke_key),
        )
}

/// Body of `PUT /v1/admin/plans/{name}`. Whole numbers may be written
/// `10` or `10.0` (JSON Schema counts both as integers).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PlanInput {
    pub lane: Lane,
    /// Sustained sends per second: 0.001 (one in 1,000 s) to 1,000,000.
    #[schema(minimum = 0.001, maximum = 1000000.0)]
    pub rate_per_second: f64,
    /// Sends allowed at once after idle: 1 to 4,294,967,295.
    #[serde(deserialize_with = "whole::u32_at_least_1")]
    #[schema(value_type = i64, minimum = 1, maximum = 4294967295_i64)]
    pub burst: u32,
    /// Sends allowed per UTC day: 0 to 2^63 − 1.
    #[serde(deserialize_with = "whole::u64_up_to_i64")]
    #[schema(value_type = i64, minimum = 0)]
    pub daily_quota: u64,
    /// Messages of one tenant a lane consumer works on at once: 1 to
    /// 4,294,967,295.
    #[serde(deserialize_with = "whole::u32_at_least_1")]
    #[schema(value_type = i64, minimum = 1, maximum = 4294967295_i64)]
    pub max_in_flight: u32,
    /// Files a tenant may upload per minute in each of its worlds (live
    /// and test apart): 1 to 1,000,000; 60 when left out.
    #[serde(
        default = "crate::model::default_uploads_per_minute",
        deserialize_with = "whole::uploads_per_minute"
    )]
    #[schema(value_type = i64, minimum = 1, maximum = 1000000, default = 60)]
    pub uploads_per_minute: u32,
    /// Bytes of files a tenant may hold in each of its worlds, used by
    /// messages or not, until their bytes are erased: 0 to 2^63 − 1;
    /// 1 GiB (1073741824) when left out.
    #[serde(
        default = "crate::model::default_upload_bytes_held",
        deserialize_with = "whole::u64_up_to_i64"
    )]
    #[schema(value_type = i64, minimum = 0, default = 1073741824)]
    pub upload_bytes_held: u64,
}

impl PlanInput {
    /// The plan of this name with these figures.
    pub fn named(&self, name: &str) -> Plan {
        Plan {
            name: name.to_owned(),
            lane: self.lane,
            rate_per_second: self.rate_per_second,
            burst: self.burst,
            daily_quota: self.daily_quota,
            max_in_flight: self.max_in_flight,
            uploads_per_minute: self.uploads_per_minute,
            upload_bytes_held: self.upload_bytes_held,
        }
    }
}

/// Whole numbers from JSON that may be written with a fraction of zero
/// (`10.0`), held to a range; anything else is refused naming the range.
mod whole {
    use serde::de::{Deserializer, Error};

    fn integral<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
        let value: serde_json::Number = serde::Deserialize::deserialize(deserializer)?;
        if let Some(n) = value.as_u64() {
            return Ok(n as f64);
        }
        match value.as_f64() {
            Some(n) if n.fract() == 0.0 => Ok(n),
            _ => Err(D::Error::custom(format!("{value} is not a whole number"))),
        }
    }

    pub fn u32_at_least_1<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
        let n = integral(deserializer)?;
        if (1.0..=u32::MAX as f64).contains(&n) {
            Ok(n as u32)
        } else {
            Err(D::Error::custom(format!(
                "must be a whole number from 1 to {}",
                u32::MAX
            )))
        }
    }

    pub fn uploads_per_minute<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
        let most = crate::model::MAX_UPLOADS_PER_MINUTE;
        match integral(deserializer)? {
            n if (1.0..=f64::from(most)).contains(&n) => Ok(n as u32),
            _ => Err(D::Error::custom(format!(
                "must be a whole number from 1 to {most}"
            ))),
        }
    }

    pub fn u64_up_to_i64<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
        let value: serde_json::Number = serde::Deserialize::deserialize(deserializer)?;
        let n = match value.as_u64() {
            Some(n) => Some(n),
            None => value
                .as_f64()
                .filter(|n| n.fract() == 0.0 && *n >= 0.0 && *n < i64::MAX as f64)
                .map(|n| n as u64),
        };
        match n {
            Some(n) if n <= i64::MAX as u64 => Ok(n),
            _ => Err(D::Error::custom(format!(
                "must be a whole number from 0 to {}",
                i64::MAX
            ))),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PlanList {
    pub plans: Vec<Plan>,
}

/// Body of `POST /v1/admin/tenants`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTenant {
    /// 1-64 of `a-z 0-9 _ -`, starting with a letter or digit.
    #[schema(pattern = r"^[a-z0-9][a-z0-9_-]{0,63}$")]
    pub id: String,
    /// 1-200 characters, not blank.
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = r"[^\t\n\u000B\f\r \u0085\u00A0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000]"
    )]
    pub name: String,
    /// An existing plan's name.
    #[schema(pattern = r"^[a-z0-9][a-z0-9_-]{0,63}$")]
    pub plan: String,
    /// `shared` (default) or `dedicated`: a queue of the tenant's own,
    /// consumed by attention workers in bounded slices.
    #[serde(default)]
    pub isolation: Option<Isolation>,
    /// Attention workers that may consume the tenant's own queue at once
    /// (1: strictly serial). Default 2.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 64)]
    pub max_concurrent_consumers: Option<u32>,
    /// Days a settled message's body, recipient, reference, metadata and
    /// error details are kept before they are erased, 1-90. Default: the
    /// configured `retention.default_days` (7 unless set).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 90)]
    pub retention_days: Option<u16>,
}

/// Body of `PATCH /v1/admin/tenants/{id}`; absent fields stay as they are.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PatchTenant {
    /// An existing plan's name.
    #[serde(default)]
    #[schema(pattern = r"^[a-z0-9][a-z0-9_-]{0,63}$")]
    pub plan: Option<String>,
    #[serde(default)]
    pub status: Option<TenantStatus>,
    /// `shared` or `dedicated`. Switching keeps every queued message: those
    /// already queued are delivered from where they wait, new ones go to
    /// the queue of the new setting.
    #[serde(default)]
    pub isolation: Option<Isolation>,
    #[serde(default)]
    #[schema(minimum = 1, maximum = 64)]
    pub max_concurrent_consumers: Option<u32>,
    /// `true`: the tenant's email asks for one-click unsubscribe unless a
    /// send says `unsubscribe: false` (needs `server.public_url`).
    #[serde(default)]
    pub unsubscribe_default: Option<bool>,
    /// The `mailto:` address offered in `List-Unsubscribe` beside the
    /// https link; `""` removes it.
    #[serde(default)]
    #[schema(max_length = 254)]
    pub unsubscribe_mailto: Option<String>,
    /// Days a settled message's personal data is kept, 1-90; `null`
    /// returns the tenant to the configured default. A shorter retention
    /// applies to messages already kept at the next retention run.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<u16>, nullable, minimum = 1, maximum = 90)]
    pub retention_days: Option<Option<u16>>,
}

/// Tells a field given as `null` (`Some(None)`) from one left out (`None`).
fn present<'de, D, T>(deserializer: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(deserializer).map(Some)
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TenantList {
    pub tenants: Vec<Tenant>,
}

/// A tenant with its keys (ids only).
#[derive(Debug, Serialize, ToSchema)]
pub struct TenantDetail {
    #[serde(flatten)]
    pub tenant: Tenant,
    pub keys: Vec<KeyInfo>,
}

/// A newly issued API key. `key` is shown only in this answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct IssuedKey {
    pub id: String,
    /// `fl_<id>_<secret>` (live) or `fl_test_<id>_<secret>` (test).
    pub key: String,
    pub kind: KeyKind,
}

/// Body of `POST /v1/admin/tenants/{id}/keys` (optional: no body issues a
/// live key).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct IssueKey {
    /// `live` (default): sends go to the real providers. `test`: sends go
    /// through everything but the provider; a simulated one answers, as
    /// the recipient says (see the README), and the daily quota is not
    /// used.
    #[serde(default)]
    pub kind: KeyKind,
}

/// 201 with `body` and a `Location` header.
pub(super) fn created(location: String, body: impl Serialize) -> Response {
    let mut response = (StatusCode::CREATED, Json(body)).into_response();
    if let Ok(value) = HeaderValue::from_str(&location) {
        response.headers_mut().insert(header::LOCATION, value);
    }
    response
}

/// Create or replace a plan.
///
/// A plan written here wins over the configuration file from then on.
#[utoipa::path(
    put, path = "/v1/admin/plans/{name}", tag = "admin",
    params(("name" = String, Path, description = "Plan name: 1-64 of `a-z 0-9 _ -`, starting with a letter or digit.", pattern = r"^[a-z0-9][a-z0-9_-]{0,63}$")),
    request_body = PlanInput,
    responses(
        (status = 200, description = "The plan existed and was replaced.", body = Plan),
        (status = 201, description = "The plan was created.", body = Plan,
            headers(("Location" = String, description = "/v1/admin/plans/{name}"))),
        (status = 400, description = "The body is not valid JSON.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, description = "Invalid plan name or fields (named in `errors`): unknown, missing or mistyped fields, figures out of range.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn put_plan(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(name): ApiPath<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let input: PlanInput = json_typed(&headers, body)?;
    let plan = input.named(&name);
    let before = state.registry.plan(&name).map(|old| AuditBefore::of(&*old));
    let was_created = state.registry.put_plan(plan.clone()).await?;
    let answer = if was_created {
        created(format!("/v1/admin/plans/{name}"), plan)
    } else {
        Json(plan).into_response()
    };
    Ok((before, answer).into_response())
}

/// List plans.
#[utoipa::path(
    get, path = "/v1/admin/plans", tag = "admin",
    responses(
        (status = 200, description = "Every plan, by name.", body = PlanList),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
    ),
    security(("admin_token" = []))
)]
pub async fn list_plans(State(state): State<AppState>, _admin: AdminOnly) -> Json<PlanList> {
    Json(PlanList {
        plans: state.registry.plans(),
    })
}

/// Get a plan.
#[utoipa::path(
    get, path = "/v1/admin/plans/{name}", tag = "admin",
    params(("name" = String, Path, description = "Plan name.", pattern = r"^[a-z0-9][a-z0-9_-]{0,63}$")),
    responses(
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 200, description = "The plan.", body = Plan),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No plan of that name.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn get_plan(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<Plan>, ApiError> {
    state
        .registry
        .plan(&name)
        .map(|plan| Json((*plan).clone()))
        .ok_or_else(|| ApiError::NotFound(format!("No plan {name:?}.")))
}

/// Create a tenant (status `active`).
#[utoipa::path(
    post, path = "/v1/admin/tenants", tag = "admin",
    request_body = CreateTenant,
    responses(
        (status = 201, description = "The tenant was created.", body = Tenant,
            headers(("Location" = String, description = "/v1/admin/tenants/{id}"))),
        (status = 400, description = "The body is not valid JSON.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 409, description = "A tenant with this id exists.", body = Problem, content_type = "application/problem+json"),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, description = "Invalid fields (named in `errors`): unknown, missing or mistyped fields, a bad id or name, or no such plan.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn create_tenant(
    State(state): State<AppState>,
    _admin: AdminOnly,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let input: CreateTenant = json_typed(&headers, body)?;
    let tenant = create_tenant_with(&state, input).await?;
    Ok(created(format!("/v1/admin/tenants/{}", tenant.id), tenant))
}

/// Creates the tenant `input` describes and routes its sends: the API's
/// and the console's.
pub(crate) async fn create_tenant_with(
    state: &AppState,
    input: CreateTenant,
) -> Result<Tenant, ApiError> {
    check_isolation(state, input.isolation)?;
    let defaults = TenantOptions::default();
    let options = TenantOptions {
        isolation: input.isolation.unwrap_or(defaults.isolation),
        max_concurrent_consumers: input
            .max_concurrent_consumers
            .unwrap_or(defaults.max_concurrent_consumers),
        retention_days: input.retention_days,
    };
    let tenant = state
        .registry
        .create_tenant(&input.id, &input.name, &input.plan, options)
        .await?;
    state
        .tenant_queues
        .set_tenant_dedicated(&tenant.id, tenant.isolation == Isolation::Dedicated);
    Ok(tenant)
}

/// Dedicated queues need their attention queues, which SQS may have
/// refused at start-up.
fn check_isolation(state: &AppState, isolation: Option<Isolation>) -> Result<(), ApiError> {
    if isolation == Some(Isolation::Dedicated) && !state.tenant_queues.has_dedicated_queues() {
        return Err(ApiError::field(
            "isolation",
            "dedicated queues are not available: the attention queues could not be opened at start-up (see the log); every tenant takes its turn in the shared lanes",
        ));
    }
    Ok(())
}

/// List tenants.
#[utoipa::path(
    get, path = "/v1/admin/tenants", tag = "admin",
    responses(
        (status = 200, description = "Every tenant, by id.", body = TenantList),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
    ),
    security(("admin_token" = []))
)]
pub async fn list_tenants(State(state): State<AppState>, _admin: AdminOnly) -> Json<TenantList> {
    Json(TenantList {
        tenants: state.registry.tenants(),
    })
}

/// Get a tenant and its key ids.
#[utoipa::path(
    get, path = "/v1/admin/tenants/{id}", tag = "admin",
    params(("id" = String, Path, description = "Tenant id.")),
    responses(
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 200, description = "The tenant and its key ids.", body = TenantDetail),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No tenant with this id.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn get_tenant(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<TenantDetail>, ApiError> {
    let tenant = state
        .registry
        .tenant(&id)
        .ok_or_else(|| ApiError::NotFound(format!("No tenant {id:?}.")))?;
    let keys = state.registry.keys_of(&id).await?;
    Ok(Json(TenantDetail {
        tenant: tenant.view(state.registry.retention_default()),
        keys,
    }))
}

/// Change a tenant's plan or status.
///
/// `paused`: sends are still accepted (202) and delivery is held until the
/// tenant is `active` again. `disabled`: sends answer 403 and queued
/// messages are held, not sent.
#[utoipa::path(
    patch, path = "/v1/admin/tenants/{id}", tag = "admin",
    params(("id" = String, Path, description = "Tenant id.")),
    request_body = PatchTenant,
    responses(
        (status = 200, description = "The tenant as changed.", body = Tenant),
        (status = 400, description = "The body is not valid JSON.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No tenant with this id.", body = Problem, content_type = "application/problem+json"),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, description = "Invalid fields (named in `errors`): unknown or mistyped fields, an unknown status, or no such plan.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn patch_tenant(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Option<AuditBefore>, Json<Tenant>), ApiError> {
    let input: PatchTenant = json_typed(&headers, body)?;
    let before = tenant_before(&state, &id);
    Ok((before, Json(patch_tenant_with(&state, &id, input).await?)))
}

/// Applies the change `input` describes to tenant `id`: the API's and
/// the console's.
pub(crate) async fn patch_tenant_with(
    state: &AppState,
    id: &str,
    input: PatchTenant,
) -> Result<Tenant, ApiError> {
    check_isolation(state, input.isolation)?;
    if input.unsubscribe_default == Some(true) && state.unsubscribe.is_none() {
        return Err(ApiError::field(
            "unsubscribe_default",
            "one-click unsubscribe links need server.public_url to be set",
        ));
    }
    let change = TenantChange {
        plan: input.plan,
        status: input.status,
        isolation: input.isolation,
        max_concurrent_consumers: input.max_concurrent_consumers,
        unsubscribe_default: input.unsubscribe_default,
        unsubscribe_mailto: input.unsubscribe_mailto,
        retention_days: input.retention_days,
    };
    change_tenant(state, id, &change).await
}

/// Applies `change` to tenant `id` and what follows from it: the queue of
/// its isolation, its queued messages held or released, its own queues
/// signalled. The API's `PATCH` and the console's pause and resume.
async fn change_tenant(
    state: &AppState,
    id: &str,
    change: &TenantChange,
) -> Result<Tenant, ApiError> {
    let tenant = state.registry.update_tenant(id, change).await?;
    // New messages go to the queue of the isolation now in force; those
    // already queued are delivered from where they wait.
    state
        .tenant_queues
        .set_tenant_dedicated(id, tenant.isolation == Isolation::Dedicated);
    // A paused or disabled tenant's queued messages are set aside until it
    // is active again (embedded queue); consumers hold any they still see.
    let held = tenant.status != TenantStatus::Active;
    if let Err(err) = state.queue.set_tenant_held(id, held).await {
        warn!(tenant = %id, held, error = %err, "Could not move the tenant's queued messages; consumers hold them until it is done at the next start.");
    }
    // Resumed: its own queues are signalled again (signals met while it
    // was held were dropped).
    if !held {
        match state.tenant_queues.dedicated_lanes(id).await {
            Ok(lanes) => {
                for lane in lanes {
                    if let Err(err) = state.tenant_queues.settle_attention(lane, id).await {
                        warn!(tenant = %id, error = %format!("{err:#}"), "Could not signal the tenant's own queue; the next start reconciles it.");
                    }
                }
            }
            Err(err) => {
                warn!(tenant = %id, error = %format!("{err:#}"), "Could not look up the tenant's own queues; the next start reconciles them.");
            }
        }
    }
    Ok(tenant)
}

/// A tenant as it is before a change, for the audit log.
pub(crate) fn tenant_before(state: &AppState, id: &str) -> Option<AuditBefore> {
    let retention = state.registry.retention_default();
    state
        .registry
        .tenant(id)
        .map(|tenant| AuditBefore::of(&tenant.view(retention)))
}

/// Delete a tenant with its keys and message history.
///
/// Refused with 409 while any of its messages is undelivered (scheduled,
/// queued, sending or retrying), so a tenant re-created under the same id
/// starts clean; cancel scheduled messages first.
#[utoipa::path(
    delete, path = "/v1/admin/tenants/{id}", tag = "admin",
    params(("id" = String, Path, description = "Tenant id.")),
    responses(
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 204, description = "The tenant, its keys and its message history are gone."),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No tenant with this id.", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Undelivered messages remain.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn delete_tenant(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
) -> Result<(Option<AuditBefore>, StatusCode), ApiError> {
    let before = tenant_before(&state, &id);
    state.registry.delete_tenant(&id).await?;
    Ok((before, StatusCode::NO_CONTENT))
}

/// Issue an API key for a tenant. The key is shown only in this answer.
///
/// Without a body, or with `{"kind": "live"}`, a live key; with
/// `{"kind": "test"}` a test key (`fl_test_…`), whose sends reach no
/// provider.
#[utoipa::path(
    post, path = "/v1/admin/tenants/{id}/keys", tag = "admin",
    params(("id" = String, Path, description = "Tenant id.")),
    request_body(content = IssueKey, description = "Optional; without it a live key."),
    responses(
        (status = 400, description = "The body is not valid JSON, or a path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 201, description = "The key; `key` is not shown again.", body = IssuedKey,
            headers(("Location" = String, description = "/v1/admin/tenants/{id}/keys/{key_id}"))),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No tenant with this id.", body = Problem, content_type = "application/problem+json"),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, description = "Invalid fields (named in `errors`): an unknown kind or field.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn issue_key(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath(id): ApiPath<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let input: IssueKey = match &body {
        Ok(bytes) if bytes.is_empty() => IssueKey::default(),
        _ => json_typed(&headers, body)?,
    };
    let (key_id, key) = state.registry.issue_key(&id, input.kind).await?;
    Ok(created(
        format!("/v1/admin/tenants/{id}/keys/{key_id}"),
        IssuedKey {
            id: key_id,
            key,
            kind: input.kind,
        },
    ))
}

/// Revoke an API key; it stops working at once.
#[utoipa::path(
    delete, path = "/v1/admin/tenants/{id}/keys/{key_id}", tag = "admin",
    params(
        ("id" = String, Path, description = "Tenant id."),
        ("key_id" = String, Path, description = "Key id, as issued."),
    ),
    responses(
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 204, description = "The key is revoked."),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No such tenant, or no such live key of it.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn revoke_key(
    State(state): State<AppState>,
    _admin: AdminOnly,
    ApiPath((id, key_id)): ApiPath<(String, String)>,
) -> Result<StatusCode, ApiError> {
    state.registry.revoke_key(&id, &key_id).await?;
    Ok(StatusCode::NO_CONTENT)
}
