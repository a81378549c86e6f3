//! `/healthz` (the process is up) and `/readyz` (the store and the queue
//! answer), for load balancers and orchestrators.

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use serde::Serialize;
use utoipa::ToSchema;

use super::AppState;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// `ok` or `unavailable`.
    pub status: String,
    /// Per dependency: `store`, `queue` → `ok` | `unavailable`; with
    /// `limits.backend = "redis"` also `limits` → `ok` | `degraded` (Redis
    /// unreachable: this instance counts limits on its local share, which
    /// does not make it unready).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checks: Option<std::collections::BTreeMap<String, String>>,
}

/// The process is up.
#[utoipa::path(
    get, path = "/healthz", tag = "ops",
    responses((status = 200, description = "Always `ok` while the process answers.", body = Health))
)]
pub async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        checks: None,
    })
}

/// The store and the queue are reachable (and, with Redis-held limits,
/// whether Redis is).
#[utoipa::path(
    get, path = "/readyz", tag = "ops",
    responses(
        (status = 200, description = "Ready: every check is `ok`.", body = Health),
        (status = 503, description = "Not ready: `checks` names what is unavailable.", body = Health),
    )
)]
pub async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<Health>) {
    let word = |ok: bool| if ok { "ok" } else { "unavailable" }.to_owned();
    let (store, queue) = tokio::join!(state.db.ping(), state.queue.ping());
    let ready = store && queue;
    let mut checks: std::collections::BTreeMap<String, String> = [
        ("store".to_owned(), word(store)),
        ("queue".to_owned(), word(queue)),
    ]
    .into_iter()
    .collect();
    if let Some(redis) = &state.redis {
        let limits = if redis.is_up() { "ok" } else { "degraded" };
        checks.insert("limits".to_owned(), limits.to_owned());
    }
    (
        if ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        },
        Json(Health {
            status: word(ready),
            checks: Some(checks),
        }),
    )
}
