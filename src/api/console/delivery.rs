//! Where messages go after the queue, in the console: the providers (pool
//! members, health, weights, gates) and the webhooks that are failing,
//! with their failed calls and a replay.

use axum::Form;
use axum::extract::State;
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};

use super::forms::field;
use super::session::Session;
use super::{Refused, bar, csrf_field, page};
use crate::api::audit::{AuditAfter, AuditTarget};
use crate::api::error::ApiError;
use crate::api::{ApiPath, AppState};
use crate::model::ms_to_rfc3339;
use crate::store::webhooks::{CallsOf, FailedCall};

/// Failed calls listed per failing endpoint.
const FAILED_CALL_ROWS: i64 = 20;

/// The providers of both channels, as this instance routes to them.
pub async fn providers(State(state): State<AppState>, session: Session) -> Markup {
    let views = crate::api::providers::provider_views(&state).await;
    let body = html! {
        @if !views.consumers { p.warn { "Consumers are off on this instance: it sends nothing." } }
        p.note { "This instance's view: each instance judges the providers by its own calls. Traffic moves away from a provider that is down (its recent calls or receipts failed, or were slow) or paused (a 429's Retry-After, an open breaker), and back as it recovers." }
        // Thirteen columns: below 700 px each provider is a card of
        // labelled cells (the style sheet's `table.cards`).
        div.box tabindex="0" { table.cards {
            thead { tr { th scope="col" { "Provider" } th scope="col" { "Channel" } th scope="col" { "Kind" }
                th scope="col" { "State" } th scope="col" { "Weight" } th scope="col" { "Share now" }
                th scope="col" { "Rate / s" } th scope="col" { "Tokens / burst" } th scope="col" { "Breaker" }
                th scope="col" { "Recent calls" } th scope="col" { "Failed" } th scope="col" { "Mean latency (ms)" }
                th scope="col" { "Times down" } } }
            tbody { @for provider in &views.providers { tr {
                th scope="row" { (provider.name) } td data-label="Channel" { (provider.channel.as_str()) } td data-label="Kind" { (provider.kind) }
                td data-label="State" class=(if provider.state == "healthy" { "" } else { "warn" }) {
                    (provider.state)
                    @if let Some(ms) = provider.paused_for_ms { " (" (ms) " ms left)" }
                }
                td.num data-label="Weight" { (provider.weight) } td.num data-label="Share now" { (format!("{:.0} %", provider.share * 100.0)) }
                td.num data-label="Rate / s" { (provider.rate_per_second) }
                td data-label="Tokens / burst" { @match provider.tokens {
                    // A full bucket is an idle gate; an empty one a saturated gate.
                    Some(tokens) => (bar(u64::from(provider.burst - tokens.min(provider.burst)), u64::from(provider.burst))),
                    None => "–",
                } }
                td data-label="Breaker" { @if provider.breaker_open { span.warn { "open" } } @else { "closed" } " (" (provider.breaker_failures) " failures)" }
                td.num data-label="Recent calls" { (provider.window_calls) } td.num data-label="Failed" { (provider.window_failures) }
                td.num data-label="Mean latency (ms)" { (provider.window_mean_latency_ms.map_or("–".to_owned(), |ms| format!("{ms:.0}"))) }
                td.num data-label="Times down" { (provider.downs) }
            } } }
        } }
        p.note { "Tokens / burst: the bar shows how much of the bucket is used; a full bar is a gate at its rate limit." }
    };
    page("Providers", Some(&session), body)
}

/// The failing and disabled webhook endpoints, each with its failed calls
/// and, for an operator, a replay.
pub async fn webhooks(State(state): State<AppState>, session: Session) -> Result<Markup, Refused> {
    let mut failing = Vec::new();
    for webhook in state.db.failing_webhooks().await? {
        let tenant = webhook.tenant_id.clone();
        let view = crate::webhooks::view(&state.db, webhook).await?;
        let calls = state
            .db
            .failed_webhook_calls(CallsOf::Tenant(&tenant), FAILED_CALL_ROWS)
            .await?;
        failing.push((view, calls));
    }
    let body = html! {
        @if failing.is_empty() { p role="status" { "No webhook endpoint is failing." } }
        @for (view, calls) in &failing {
            h2 { "Tenant " a href=(format!("/console/tenants/{}", view.tenant_id)) { (view.tenant_id) } }
            dl {
                dt { "Endpoint" } dd { (view.url) }
                dt { "State" } dd.warn { (view.state) }
                dt { "Failing since" } dd { (view.failing_since.as_deref().unwrap_or("–")) }
                @if let Some(at) = &view.disabled_at { dt { "Disabled at" } dd { (at) } }
                dt { "Last error" } dd { (view.last_error.as_deref().unwrap_or("–")) }
                dt { "Pending, given up" } dd { (view.pending) ", " (view.failed) }
            }
            @if session.may_change() {
                form method="post" action=(format!("/console/webhooks/{}/replay", view.tenant_id)) {
                    (csrf_field(&session))
                    button type="submit" aria-label=(format!("Replay {}'s webhook", view.tenant_id)) {
                        "Enable the endpoint and replay its failed calls"
                    }
                }
            }
            (failed_calls(calls))
        }
    };
    Ok(page("Failing webhooks", Some(&session), body))
}

/// A table of failed webhook calls: the attempt log.
pub fn failed_calls(calls: &[FailedCall]) -> Markup {
    html! {
        @if !calls.is_empty() { div.box tabindex="0" { table.cards {
            caption.skip { "Calls that failed at least once" }
            thead { tr { th scope="col" { "Event" } th scope="col" { "Message" } th scope="col" { "Type" }
                th scope="col" { "Event at" } th scope="col" { "Attempts" } th scope="col" { "State" }
                th scope="col" { "Next attempt" } th scope="col" { "Last error" } } }
            tbody { @for (event, message, kind, at, next, attempts, state, error) in calls { tr {
                td data-label="Event" { "evt_" (event) } td data-label="Message" { a href=(format!("/console/messages/{message}")) { (message) } }
                td data-label="Type" { (kind) } td data-label="Event at" { (ms_to_rfc3339(*at)) } td.num data-label="Attempts" { (attempts) }
                td data-label="State" { (if state == "failed" { "given up" } else { "retrying" }) }
                td data-label="Next attempt" { @if state == "pending" { (ms_to_rfc3339(*next)) } }
                td data-label="Last error" { (error.as_deref().unwrap_or("")) }
            } } }
        } } }
    }
}

/// Enables a tenant's endpoint again and replays its failed calls, as
/// `POST /v1/admin/tenants/{id}/webhook/redrive` does.
pub async fn replay(
    State(state): State<AppState>,
    session: Session,
    ApiPath(tenant): ApiPath<String>,
    Form(fields): Form<Vec<(String, String)>>,
) -> Result<Response, Refused> {
    super::actions::admit(&session, field(&fields, "csrf"))?;
    crate::api::known_tenant(&state, &tenant)?;
    let replayed = state
        .db
        .redrive_webhook(&tenant)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("Tenant {tenant:?} has no webhook.")))?;
    tracing::info!(%tenant, replayed, "Webhook replayed from the console.");
    let after = serde_json::json!({"tenant": tenant, "replayed": replayed});
    let target = AuditTarget(format!("/v1/admin/tenants/{tenant}/webhook/redrive"));
    Ok((
        target,
        AuditAfter::of(&after),
        Redirect::to("/console/webhooks"),
    )
        .into_response())
}
