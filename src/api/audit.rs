//! The audit log: every admin change that succeeded, with who made it,
//! what and on which target, the state before (where the handler knows
//! it) and after, secrets removed; and `GET /v1/admin/audit` to read it.
//!
//! One middleware writes it ([`record_changes`]), so no admin route can
//! forget to: it wraps every route, and for a change (any method but
//! `GET`/`HEAD`) on `/v1/admin/*` that answered 2xx it records the admin
//! the route's extractor authenticated ([`ActorSlot`]), the method and
//! route as the action, the path as the target, the answer's JSON body as
//! the state after, and the [`AuditBefore`] a handler put in its answer as
//! the state before. A change whose entry cannot be written is still
//! answered as done (it is); the failure is logged and counted in
//! `fairlane_audit_write_failures_total`.

use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::extract::{MatchedPath, Query, Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::{IntoResponseParts, Response, ResponseParts};
use axum::routing::get;
use serde::{Deserialize, Serialize};
use tracing::error;
use utoipa::{IntoParams, ToSchema};

use super::AppState;
use super::auth::{ActorSlot, AdminOnly};
use super::error::{AdminForbidden, AdminUnauthorized, ApiError, Problem};
use crate::metrics::AUDIT_WRITE_FAILURES_TOTAL;
use crate::model::{ms_to_rfc3339, now_ms};
use crate::store::admins::{AuditQuery, AuditRow};

/// The most of an answer's body kept as the state after; admin answers
/// are far smaller, and a longer one is recorded without it.
const AFTER_LIMIT: usize = 256 * 1024;

/// Field names whose values are secrets: kept out of the log, their
/// place marked.
const SECRET_FIELDS: [&str; 5] = ["key", "token", "secret", "password", "api_key"];

/// What stands in the log for a secret's value.
const REDACTED: &str = "[redacted]";

/// Entries per page: the default and the most a page may ask for.
const PAGE_DEFAULT: u32 = 100;
const PAGE_MAX: u32 = 500;

pub fn router() -> Router<AppState> {
    Router::new().route("/v1/admin/audit", get(list_audit))
}

/// A state a handler hands the log in its answer's extensions: `of` any
/// serializable value, and a response part.
macro_rules! audit_part {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug)]
        pub struct $name(serde_json::Value);

        impl $name {
            pub fn of<T: Serialize>(state: &T) -> $name {
                $name(serde_json::to_value(state).unwrap_or(serde_json::Value::Null))
            }
        }

        impl IntoResponseParts for $name {
            type Error = std::convert::Infallible;

            fn into_response_parts(
                self,
                mut res: ResponseParts,
            ) -> Result<ResponseParts, Self::Error> {
                res.extensions_mut().insert(self);
                Ok(res)
            }
        }
    };
}

audit_part!(
    /// The state of a changed thing before the change, as a handler knows
    /// it; put in its answer (`(AuditBefore::of(&old), Json(new))`) for the
    /// log.
    AuditBefore
);

audit_part!(
    /// The state after a change whose answer is not its JSON (a console
    /// page): put in the answer as [`AuditBefore`] is.
    AuditAfter
);

/// The resource a console change was made on, named as the admin API
/// names it (`/v1/admin/tenants/acme`), so that the log's `target` filter
/// finds a change whether it was made in the console or over the API. A
/// response part, as [`AuditAfter`] is; without it the target is the path.
#[derive(Clone, Debug)]
pub struct AuditTarget(pub String);

impl IntoResponseParts for AuditTarget {
    type Error = std::convert::Infallible;

    fn into_response_parts(self, mut res: ResponseParts) -> Result<ResponseParts, Self::Error> {
        res.extensions_mut().insert(self);
        Ok(res)
    }
}

/// Whether a request is an admin change the log records: one on the
/// admin API, or one made in the console (signing in and out change
/// nothing).
fn is_admin_change(method: &Method, path: &str) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
        && (path.starts_with("/v1/admin/")
            || (path.starts_with("/console/")
                && !matches!(path, "/console/login" | "/console/logout")))
}

/// The middleware that writes the log (see the module documentation).
pub async fn record_changes(
    State(state): State<AppState>,
    route: Option<MatchedPath>,
    mut request: Request,
    next: Next,
) -> Response {
    if !is_admin_change(request.method(), request.uri().path()) {
        return next.run(request).await;
    }
    let path = request.uri().path().to_owned();
    let action = format!(
        "{} {}",
        request.method(),
        route.as_ref().map_or(path.as_str(), MatchedPath::as_str)
    );
    let slot = ActorSlot::default();
    request.extensions_mut().insert(slot.clone());
    let response = next.run(request).await;
    let Some(actor) = slot.actor() else {
        return response;
    };
    // A console change answers by sending the browser on (303).
    if !(response.status().is_success() || response.status().is_redirection()) {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    // A state the handler gave is the one logged; only without one is the
    // answer's body read (and kept to be sent on).
    let (body, after) = match parts.extensions.remove::<AuditAfter>() {
        Some(given) => (body, Some(redacted(given.0))),
        None => match axum::body::to_bytes(body, AFTER_LIMIT).await {
            Ok(bytes) => {
                let after = serde_json::from_slice(&bytes).ok().map(redacted);
                (Body::from(bytes), after)
            }
            // Only a body longer than the limit or one that failed midway
            // gets here; admin answers are built whole in memory.
            Err(_) => (Body::empty(), None),
        },
    };
    let before = parts
        .extensions
        .remove::<AuditBefore>()
        .map(|before| redacted(before.0));
    let target = parts
        .extensions
        .remove::<AuditTarget>()
        .map_or(path, |target| target.0);
    let entry = AuditRow {
        id: 0,
        at: now_ms(),
        actor_id: actor.id.clone(),
        actor_name: actor.name.clone(),
        actor_role: actor.role.as_str().to_owned(),
        action,
        target,
        status: i64::from(parts.status.as_u16()),
        before: before.map(|value| value.to_string()),
        after: after.map(|value| value.to_string()),
    };
    if let Err(err) = state.db.record_audit(&entry).await {
        metrics::counter!(AUDIT_WRITE_FAILURES_TOTAL).increment(1);
        error!(
            error = %err, action = %entry.action, target = %entry.target, actor = %entry.actor_name,
            "An admin change was made but its audit entry could not be written."
        );
    }
    Response::from_parts(parts, body)
}

/// `value` with the value of every field named in [`SECRET_FIELDS`], at
/// any depth, replaced by [`REDACTED`].
fn redacted(mut value: serde_json::Value) -> serde_json::Value {
    fn walk(value: &mut serde_json::Value) {
        match value {
            serde_json::Value::Object(fields) => {
                for (name, field) in fields.iter_mut() {
                    if SECRET_FIELDS.contains(&name.as_str()) {
                        *field = serde_json::Value::String(REDACTED.into());
                    } else {
                        walk(field);
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut value);
    value
}

/// Filters of `GET /v1/admin/audit`.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct AuditParams {
    /// Only changes by the admin of this name (`root` for the root token).
    pub actor: Option<String>,
    /// Only actions starting with this, e.g. `POST` or `DELETE /v1/admin/tenants`.
    pub action: Option<String>,
    /// Only targets starting with this, e.g. `/v1/admin/tenants/acme`.
    pub target: Option<String>,
    /// Only changes at or after this instant (RFC 3339).
    #[param(format = DateTime)]
    pub since: Option<String>,
    /// Only changes before this instant (RFC 3339).
    #[param(format = DateTime)]
    pub until: Option<String>,
    /// Entries per page, 1 to 500; 100 when not given.
    #[param(minimum = 1, maximum = 500)]
    pub limit: Option<u32>,
    /// The `next` of the previous page (an entry's number).
    #[param(pattern = r"^[1-9][0-9]{0,17}$")]
    pub cursor: Option<String>,
}

/// The admin who made a change.
#[derive(Debug, Serialize, ToSchema)]
pub struct AuditActor {
    /// `root` for the root token, the admin's id otherwise.
    pub id: String,
    pub name: String,
    /// The admin's role when it made the change.
    pub role: String,
}

/// One admin change.
#[derive(Debug, Serialize, ToSchema)]
pub struct AuditEntry {
    pub id: i64,
    /// When the change was made (RFC 3339).
    pub at: String,
    pub actor: AuditActor,
    /// The method and route, e.g. `PATCH /v1/admin/tenants/{id}`.
    pub action: String,
    /// The path the change was made on.
    pub target: String,
    /// The HTTP status of the answer.
    pub status: i64,
    /// The state before the change, where the route records it (plans,
    /// tenants, keys, admins, webhooks); secrets are `"[redacted]"`.
    #[schema(value_type = Option<Object>)]
    pub before: Option<serde_json::Value>,
    /// The answer's body; secrets are `"[redacted]"`.
    #[schema(value_type = Option<Object>)]
    pub after: Option<serde_json::Value>,
}

/// A page of the audit log, newest first.
#[derive(Debug, Serialize, ToSchema)]
pub struct AuditPage {
    pub entries: Vec<AuditEntry>,
    /// Pass as `cursor` for the next page; absent on the last one.
    pub next: Option<String>,
}

impl From<AuditRow> for AuditEntry {
    fn from(row: AuditRow) -> Self {
        let json = |text: Option<String>| text.and_then(|text| serde_json::from_str(&text).ok());
        AuditEntry {
            id: row.id,
            at: ms_to_rfc3339(row.at),
            actor: AuditActor {
                id: row.actor_id,
                name: row.actor_name,
                role: row.actor_role,
            },
            action: row.action,
            target: row.target,
            status: row.status,
            before: json(row.before),
            after: json(row.after),
        }
    }
}

/// Unix milliseconds of an RFC 3339 instant, or a 422 naming `field`.
fn instant(field: &str, text: Option<&str>) -> Result<Option<i64>, ApiError> {
    let Some(text) = text else {
        return Ok(None);
    };
    let at = chrono::DateTime::parse_from_rfc3339(text).map_err(|_| {
        ApiError::field(
            field,
            "must be an RFC 3339 instant, e.g. 2026-11-28T09:00:00Z",
        )
    })?;
    Ok(Some(at.timestamp_millis()))
}

impl AuditParams {
    fn query(&self) -> Result<AuditQuery, ApiError> {
        let limit = self.limit.unwrap_or(PAGE_DEFAULT);
        if !(1..=PAGE_MAX).contains(&limit) {
            return Err(ApiError::field("limit", format!("must be 1 to {PAGE_MAX}")));
        }
        let before_id = match &self.cursor {
            Some(cursor) => Some(
                cursor
                    .parse::<i64>()
                    .ok()
                    .filter(|id| *id > 0)
                    .ok_or_else(|| ApiError::field("cursor", "is not a cursor this log gave"))?,
            ),
            None => None,
        };
        Ok(AuditQuery {
            actor: self.actor.clone(),
            action: self.action.clone(),
            target: self.target.clone(),
            since: instant("since", self.since.as_deref())?,
            until: instant("until", self.until.as_deref())?,
            before_id,
            limit,
        })
    }
}

/// The audit log: admin changes, newest first.
///
/// Every change made through the admin API (tenants, plans, keys, sender
/// identities, suppressions, webhooks, redrives, pauses, admins) that
/// succeeded, with the admin that made it. Any role may read it. Entries
/// older than `audit.retention_days` are removed.
#[utoipa::path(
    get, path = "/v1/admin/audit", tag = "admin",
    params(AuditParams),
    responses(
        (status = 200, description = "A page of the log, newest first.", body = AuditPage),
        (status = 400, description = "A query parameter is not understood.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
        (status = 422, description = "A filter is invalid (named in `errors`).", body = Problem, content_type = "application/problem+json"),
    ),
    security(("admin_token" = []))
)]
pub async fn list_audit(
    State(state): State<AppState>,
    _admin: AdminOnly,
    params: Result<Query<AuditParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<AuditPage>, ApiError> {
    let Query(params) =
        params.map_err(|err| ApiError::BadRequest(format!("{}.", err.body_text())))?;
    let query = params.query()?;
    let rows = state.db.audit_page(&query).await?;
    let next = (rows.len() == query.limit as usize)
        .then(|| rows.last().map(|row| row.id.to_string()))
        .flatten();
    Ok(Json(AuditPage {
        entries: rows.into_iter().map(AuditEntry::from).collect(),
        next,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_redacted_at_any_depth_and_nothing_else_is() {
        let value = serde_json::json!({
            "id": "k1", "key": "fl_live_x", "nested": {"secret": "whsec_y", "url": "https://a"},
            "list": [{"token": "fla_z", "name": "desk"}]
        });
        let out = redacted(value);
        assert_eq!(out["key"], REDACTED);
        assert_eq!(out["nested"]["secret"], REDACTED);
        assert_eq!(out["nested"]["url"], "https://a");
        assert_eq!(out["list"][0]["token"], REDACTED);
        assert_eq!(out["list"][0]["name"], "desk");
        assert_eq!(out["id"], "k1");
    }

    #[test]
    fn only_admin_changes_are_recorded() {
        assert!(is_admin_change(&Method::POST, "/v1/admin/tenants"));
        assert!(is_admin_change(
            &Method::DELETE,
            "/v1/admin/tenants/a/keys/k"
        ));
        assert!(!is_admin_change(&Method::GET, "/v1/admin/tenants"));
        assert!(!is_admin_change(&Method::POST, "/v1/messages"));
        assert!(is_admin_change(&Method::POST, "/console/dlq/redrive"));
        assert!(!is_admin_change(&Method::POST, "/console/login"));
    }
}
