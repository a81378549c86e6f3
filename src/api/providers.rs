//! `GET /v1/admin/providers`: each provider of each channel's pool, its
//! weight, the share of new messages routing gives it now, its pause and
//! breaker, and what its recent calls and receipts say (see
//! [`crate::limits::gate`] and [`crate::limits::health`]).

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::routing::get;
use serde::Serialize;
use utoipa::ToSchema;

use super::AppState;
use super::error::{AdminForbidden, AdminUnauthorized};
use crate::api::auth::AdminOnly;
use crate::model::Channel;

pub fn router() -> Router<AppState> {
    Router::new().route("/v1/admin/providers", get(list_providers))
}

/// Every provider this instance sends through.
#[derive(Debug, Serialize, ToSchema)]
pub struct Providers {
    /// `false` when this instance runs no consumers (`consumers.enabled =
    /// false`): it calls no provider, and `providers` is empty.
    pub consumers: bool,
    pub providers: Vec<ProviderView>,
}

/// One provider of a channel's pool, as this instance sees it.
#[derive(Debug, Serialize, ToSchema)]
pub struct ProviderView {
    pub channel: Channel,
    /// Its name in the configuration (`providers.sms` is named by its
    /// `name`, `sms` by default; `providers.sms_pool.NAME` by NAME).
    pub name: String,
    /// `ses`, `http`, `log` or `test`.
    pub kind: String,
    /// `healthy`; `down` (its recent calls or receipts failed, or its calls
    /// were slow, past `providers.health`: no new messages while another
    /// provider can take them); `recovering` (winning its weight back);
    /// `paused` (a 429's Retry-After or an open breaker: no call until
    /// `paused_for_ms` has passed).
    pub state: String,
    pub weight: u32,
    /// The share of the channel's new messages it gets now, 0 to 1.
    pub share: f64,
    pub rate_per_second: f64,
    pub burst: u32,
    /// Tokens in its bucket now, 0 to `burst`: as this instance's grants
    /// left it, or with `limits.backend = "redis"` the fleet-wide bucket's
    /// (absent while Redis cannot be reached).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u32>,
    /// How long its pause still runs.
    pub paused_for_ms: Option<u64>,
    /// Failed calls in a row, and whether its circuit breaker is open.
    pub breaker_failures: u32,
    pub breaker_open: bool,
    /// Its calls in the health window (`providers.health.window_secs`),
    /// those that failed, and the mean time of those that worked.
    pub window_calls: u64,
    pub window_failures: u64,
    pub window_failure_rate: Option<f64>,
    pub window_mean_latency_ms: Option<f64>,
    /// Times it was marked down since this instance started.
    pub downs: u64,
}

/// The providers of both channels, as this instance routes to them.
///
/// Health, shares and pauses are this instance's own view: with several
/// instances each judges the providers by its own calls (the rate limits
/// are fleet-wide with `limits.backend = "redis"`; health is not).
#[utoipa::path(
    get, path = "/v1/admin/providers", tag = "admin",
    responses(
        (status = 200, description = "Each provider's state, weight, share, pause, breaker and recent outcomes.", body = Providers),
        (status = 401, response = AdminUnauthorized),
        (status = 403, response = AdminForbidden),
    ),
    security(("admin_token" = []))
)]
pub async fn list_providers(State(state): State<AppState>, _admin: AdminOnly) -> Json<Providers> {
    Json(provider_views(&state).await)
}

/// Every provider as this instance routes to it: the API's answer and
/// the console's page.
pub(crate) async fn provider_views(state: &AppState) -> Providers {
    let mut providers = Vec::new();
    for (channel, pool) in state.providers.iter() {
        let views = pool.gate.view();
        let tokens = pool.gate.tokens().await;
        for ((member, view), tokens) in pool.members.iter().zip(views).zip(tokens) {
            let (breaker_failures, breaker_open) = member.breaker.status();
            let health = view.health;
            let state = if view.paused_for.is_some() {
                "paused"
            } else {
                health.state.as_str()
            };
            providers.push(ProviderView {
                channel: *channel,
                name: member.name.to_owned(),
                kind: member.provider.name().to_owned(),
                state: state.to_owned(),
                weight: view.weight,
                share: view.share,
                rate_per_second: view.rate_per_second,
                burst: view.burst,
                tokens,
                paused_for_ms: view
                    .paused_for
                    .map(|left| u64::try_from(left.as_millis()).unwrap_or(u64::MAX)),
                breaker_failures,
                breaker_open,
                window_calls: health.calls,
                window_failures: health.failures,
                window_failure_rate: (health.calls > 0)
                    .then(|| health.failures as f64 / health.calls as f64),
                window_mean_latency_ms: health.mean_latency_ms,
                downs: health.downs,
            });
        }
    }
    Providers {
        consumers: state.settings.consumers.enabled,
        providers,
    }
}
