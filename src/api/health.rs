//! `/healthz` (the process is up) and `/readyz` (the store and the queue
//! answer; on SQS, whether the outbox relay keeps up), for load balancers
//! and orchestrators.

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
    /// does not make it unready). On SQS also `queue_relay` → `ok` |
    /// `behind` (the outbox relay's calls to SQS fail: accepted messages
    /// wait in the outbox until SQS answers), and an SQS that does not
    /// answer is `queue` → `degraded`: neither makes the instance unready,
    /// since sends are still accepted (into the outbox). With consumers
    /// on, `provider_gates` → `ok` | `stuck`: a channel's gate has had
    /// messages waiting and no one taking its tokens for 5 s although its
    /// watchdog woke the line every second; this makes the instance
    /// unready, since it holds every message of that channel.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checks: Option<std::collections::BTreeMap<String, String>>,
    /// Per check that is not `ok`: why, as a code (`store_unreachable`,
    /// `store_full`, `store_writes_fail`, `queue_unreachable`,
    /// `queue_relay_failing`, `gate_stuck`). The
    /// error's own text goes to the log, not here: this route needs no
    /// authentication.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty", default)]
    pub reasons: std::collections::BTreeMap<String, String>,
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
        reasons: Default::default(),
    })
}

/// The store answers and can write, and the queue answers (and, with
/// Redis-held limits, whether Redis is).
#[utoipa::path(
    get, path = "/readyz", tag = "ops",
    responses(
        (status = 200, description = "Ready: every check is `ok`.", body = Health),
        (status = 503, description = "Not ready: `checks` names what is unavailable and `reasons` says why.", body = Health),
    )
)]
pub async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<Health>) {
    let word = |ok: bool| if ok { "ok" } else { "unavailable" }.to_owned();
    let (store, queue) = tokio::join!(store_check(&state), state.queue.ping());
    let mut reasons = std::collections::BTreeMap::new();
    if let Err(why) = &store {
        reasons.insert("store".to_owned(), why.clone());
    }
    if !queue {
        tracing::warn!("Readiness: the queue does not answer.");
        reasons.insert("queue".to_owned(), "queue_unreachable".to_owned());
    }
    // On SQS, accepts go into the outbox whether or not SQS answers.
    let outbox = state.relay.is_some();
    let ready = store.is_ok() && (queue || outbox);
    let queue_word = match (queue, outbox) {
        (true, _) => "ok",
        (false, true) => "degraded",
        (false, false) => "unavailable",
    };
    let mut checks: std::collections::BTreeMap<String, String> = [
        ("store".to_owned(), word(store.is_ok())),
        ("queue".to_owned(), queue_word.to_owned()),
    ]
    .into_iter()
    .collect();
    if let Some(relay) = &state.relay {
        let behind = relay.is_behind();
        if behind {
            reasons.insert("queue_relay".to_owned(), "queue_relay_failing".to_owned());
        }
        let word = if behind { "behind" } else { "ok" };
        checks.insert("queue_relay".to_owned(), word.to_owned());
    }
    if let Some(redis) = &state.redis {
        let limits = if redis.is_up() { "ok" } else { "degraded" };
        checks.insert("limits".to_owned(), limits.to_owned());
    }
    let stuck: Vec<&str> = state
        .providers
        .iter()
        .filter(|(_, pool)| {
            pool.gate
                .stuck_for()
                .is_some_and(|stuck| stuck >= crate::limits::gate::STUCK_UNREADY)
        })
        .map(|(channel, _)| channel.as_str())
        .collect();
    if !state.providers.is_empty() {
        let word = if stuck.is_empty() { "ok" } else { "stuck" };
        checks.insert("provider_gates".to_owned(), word.to_owned());
    }
    if !stuck.is_empty() {
        tracing::warn!(channels = ?stuck, "Readiness: a provider gate's line is stuck.");
        reasons.insert("provider_gates".to_owned(), "gate_stuck".to_owned());
    }
    let ready = ready && stuck.is_empty();
    (
        if ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        },
        Json(Health {
            status: word(ready),
            checks: Some(checks),
            reasons,
        }),
    )
}

/// How long after a failed store write `/readyz` still proves with a probe
/// write that writes commit, rather than trusting the last group's success
/// (on a nearly full file small writes commit between sends that fail).
const PROBE_AFTER_FAILURE: std::time::Duration = std::time::Duration::from_secs(60);

/// The store answers a query; and when a write failed lately (a full disk,
/// an I/O error, a lost server), a probe write larger than any send commits.
/// Fails with a reason code; the detail is logged.
async fn store_check(state: &AppState) -> Result<(), String> {
    if !state.db.ping().await {
        tracing::warn!("Readiness: the store does not answer a query.");
        return Err("store_unreachable".to_owned());
    }
    if !state.writer.failures().failed_within(PROBE_AFTER_FAILURE) {
        return Ok(());
    }
    state.writer.probe().await.map_err(|err| {
        let detail = format!("{err:#}");
        tracing::warn!(error = %detail, "Readiness: a probe write to the store failed.");
        if detail.to_ascii_lowercase().contains("full") {
            "store_full".to_owned()
        } else {
            "store_writes_fail".to_owned()
        }
    })
}
