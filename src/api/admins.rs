//! Named admins (`/v1/admin/admins`, owners only): each has a name, a
//! role (`viewer`, `operator`, `owner`) and a bearer token of its own,
//! shown once, stored as its hash. The audit log names the admin of every
//! change, and a support desk given a viewer can look without changing.

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{delete, post};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::audit::AuditBefore;
use super::auth::{ADMIN_TOKEN_PREFIX, OwnerOnly, Role};
use super::error::{
    AdminForbidden, AdminUnauthorized, ApiError, PayloadTooLarge, Problem, UnsupportedMediaType,
};
use super::{ApiPath, AppState, json_typed};
use crate::model::{ms_to_rfc3339, now_ms};
use crate::store::admins::{AdminRow, NewAdmin};
use crate::tenants::{hash_secret, random_hex};

/// The longest admin name.
const NAME_MAX: usize = 64;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/admin/admins", post(create_admin).get(list_admins))
        .route("/v1/admin/admins/{id}", delete(revoke_admin))
}

/// Body of `POST /v1/admin/admins`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewAdminInput {
    /// 1 to 64 of `A-Z a-z 0-9 . _ @ -`; unique among active admins;
    /// `root` is the root token's.
    #[schema(min_length = 1, max_length = 64, pattern = r"^[A-Za-z0-9._@-]+$")]
    pub name: String,
    pub role: Role,
}

/// A named admin.
#[derive(Debug, Serialize, ToSchema)]
pub struct Admin {
    pub id: String,
    pub name: String,
    pub role: String,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339; absent while the admin is active.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<String>,
}

impl From<AdminRow> for Admin {
    fn from(row: AdminRow) -> Self {
        Admin {
            id: row.id,
            name: row.name,
            role: row.role,
            created_at: ms_to_rfc3339(row.created_at),
            revoked_at: row.revoked_at.map(ms_to_rfc3339),
        }
    }
}

/// A new admin with its token, shown only in this answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct IssuedAdmin {
    #[serde(flatten)]
    pub admin: Admin,
    /// The admin's bearer token for `/v1/admin/*` and the console. Only
    /// its hash is stored: keep it now.
    pub token: String,
}

/// Every admin, revoked ones included.
#[derive(Debug, Serialize, ToSchema)]
pub struct AdminList {
    pub admins: Vec<Admin>,
}

/// Whether `name` is a valid admin name.
fn valid_name(name: &str) -> bool {
    (1..=NAME_MAX).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '@' | '-'))
}

/// Add a named admin.
///
/// Owners only. The answer holds the admin's token, shown only once.
#[utoipa::path(
    post, path = "/v1/admin/admins", tag = "admin",
    request_body = NewAdminInput,
    responses(
        (status = 201, description = "The admin, with its token.", body = IssuedAdmin),
        (status = 400, description = "The body is not valid JSON.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 409, description = "An active admin already has this name.", body = Problem, content_type = "application/problem+json"),
        (status = 413, response = PayloadTooLarge),
        (status = 415, response = UnsupportedMediaType),
        (status = 422, description = "Invalid fields (named in `errors`).", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn create_admin(
    State(state): State<AppState>,
    _owner: OwnerOnly,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<impl IntoResponse, ApiError> {
    let input: NewAdminInput = json_typed(&headers, body)?;
    if !valid_name(&input.name) {
        return Err(ApiError::field(
            "name",
            format!("must be 1 to {NAME_MAX} of A-Z a-z 0-9 . _ @ -"),
        ));
    }
    if input.name == "root" {
        return Err(ApiError::field("name", "root is the root token's name"));
    }
    let token = format!("{ADMIN_TOKEN_PREFIX}{}", random_hex(32));
    let admin = NewAdmin {
        id: format!("adm_{}", random_hex(8)),
        name: input.name,
        role: input.role.as_str().to_owned(),
        token_sha256: hex::encode(hash_secret(&token)),
        created_at: now_ms(),
    };
    state.db.insert_admin(&admin).await?;
    let issued = IssuedAdmin {
        admin: Admin::from(AdminRow {
            id: admin.id,
            name: admin.name,
            role: admin.role,
            created_at: admin.created_at,
            revoked_at: None,
        }),
        token,
    };
    Ok((StatusCode::CREATED, Json(issued)))
}

/// List the admins.
///
/// Owners only; revoked admins are listed with `revoked_at`.
#[utoipa::path(
    get, path = "/v1/admin/admins", tag = "admin",
    responses(
        (status = 200, description = "Every admin, oldest first.", body = AdminList),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
    ),
    security(("admin_token" = []))
)]
pub async fn list_admins(
    State(state): State<AppState>,
    _owner: OwnerOnly,
) -> Result<Json<AdminList>, ApiError> {
    let admins = state.db.admins().await?;
    Ok(Json(AdminList {
        admins: admins.into_iter().map(Admin::from).collect(),
    }))
}

/// Revoke a named admin.
///
/// Owners only. Its token stops working at once, on every instance.
#[utoipa::path(
    delete, path = "/v1/admin/admins/{id}", tag = "admin",
    params(("id" = String, Path, description = "Admin id.")),
    responses(
        (status = 204, description = "Revoked."),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 404, description = "No active admin with this id.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn revoke_admin(
    State(state): State<AppState>,
    _owner: OwnerOnly,
    ApiPath(id): ApiPath<String>,
) -> Result<impl IntoResponse, ApiError> {
    let mut revoked = state
        .db
        .revoke_admin(&id, now_ms())
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("No active admin {id:?}.")))?;
    revoked.revoked_at = None;
    Ok((
        AuditBefore::of(&Admin::from(revoked)),
        StatusCode::NO_CONTENT,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_names_are_short_plain_words() {
        assert!(valid_name("support-desk@acme.example"));
        assert!(!valid_name(""));
        assert!(!valid_name("a b"));
        assert!(!valid_name(&"a".repeat(NAME_MAX + 1)));
    }
}
