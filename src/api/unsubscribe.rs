//! One-click unsubscribe links (`/v1/unsubscribe/{token}`): no API key,
//! the signed token is the proof. `POST` (what a mail provider sends for
//! RFC 8058's one click, or the button of the `GET` page) adds the address
//! to the tenant's suppression list; `GET` shows the page and changes
//! nothing, since mail scanners follow links. See [`crate::unsubscribe`].

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use super::error::{ApiError, Problem};
use super::{ApiPath, AppState};
use crate::model::now_ms;
use crate::store::suppressions;
use crate::unsubscribe::Claim;

pub fn router() -> Router<AppState> {
    Router::new().route(
        "/v1/unsubscribe/{token}",
        get(unsubscribe_page).post(unsubscribe),
    )
}

/// The claim of a valid token whose tenant still exists, or 404: a forged,
/// altered or foreign token tells nothing more.
fn checked(state: &AppState, token: &str) -> Result<(Claim, String), ApiError> {
    let not_found = || ApiError::NotFound("This unsubscribe link is not valid.".into());
    let claim = state
        .unsubscribe
        .as_ref()
        .and_then(|links| links.verify(token))
        .ok_or_else(not_found)?;
    let tenant = state
        .registry
        .tenant(&claim.tenant_id)
        .ok_or_else(not_found)?;
    Ok((claim, tenant.name.clone()))
}

/// Text for an HTML page.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn page(title: &str, body: &str) -> Response {
    let html = format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <meta name=\"robots\" content=\"noindex\"><title>{title}</title></head>\
         <body style=\"font-family: sans-serif; max-width: 32rem; margin: 3rem auto; padding: 0 1rem\">\
         {body}</body></html>\n"
    );
    let mut response = html.into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// The page behind an unsubscribe link: a button, nothing changed yet.
#[utoipa::path(
    get, path = "/v1/unsubscribe/{token}", tag = "unsubscribe",
    params(("token" = String, Path, description = "The signed token of the message's `List-Unsubscribe` link.")),
    responses(
        (status = 200, description = "A page asking to confirm; nothing is changed.", body = String, content_type = "text/html"),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "Not a valid link (forged, altered, or its tenant is gone).", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn unsubscribe_page(
    State(state): State<AppState>,
    ApiPath(token): ApiPath<String>,
) -> Result<Response, ApiError> {
    let (claim, sender) = checked(&state, &token)?;
    Ok(page(
        "Unsubscribe",
        &format!(
            "<h1>Unsubscribe</h1><p>Stop email from {} to {}?</p>\
             <form method=\"post\"><input type=\"hidden\" name=\"List-Unsubscribe\" value=\"One-Click\">\
             <button type=\"submit\">Unsubscribe</button></form>",
            escape(&sender),
            escape(&claim.address)
        ),
    ))
}

/// Unsubscribe: one click (RFC 8058).
///
/// Adds the link's address to its tenant's suppression list (reason
/// `unsubscribe`), records an `unsubscribed` event on the message and
/// sends the tenant's `message.unsubscribed` webhook. Doing it again
/// changes nothing more.
#[utoipa::path(
    post, path = "/v1/unsubscribe/{token}", tag = "unsubscribe",
    params(("token" = String, Path, description = "The signed token of the message's `List-Unsubscribe` link.")),
    responses(
        (status = 200, description = "Unsubscribed (or already): a page saying so.", body = String, content_type = "text/html"),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "Not a valid link (forged, altered, or its tenant is gone); nothing changed.", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn unsubscribe(
    State(state): State<AppState>,
    ApiPath(token): ApiPath<String>,
) -> Result<Response, ApiError> {
    let (claim, sender) = checked(&state, &token)?;
    let Some((channel, address)) = suppressions::normalize(&claim.address) else {
        return Err(ApiError::NotFound(
            "This unsubscribe link is not valid.".into(),
        ));
    };
    let added = suppressions::unsubscribe(
        &state.db,
        &claim.tenant_id,
        channel,
        &address,
        &claim.message_id,
        now_ms(),
    )
    .await?;
    if added {
        // The event's webhook call is due now.
        state.writer.changed().notify_one();
        tracing::info!(tenant = %claim.tenant_id, message_id = %claim.message_id, "Recipient unsubscribed with a one-click link.");
    }
    Ok(page(
        "Unsubscribed",
        &format!(
            "<h1>Unsubscribed</h1><p>{} will not send email to {} any more.</p>",
            escape(&sender),
            escape(&address)
        ),
    ))
}
