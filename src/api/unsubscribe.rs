//! One-click unsubscribe links (`/v1/unsubscribe/{token}`): no API key,
//! the sealed token is the proof. A `POST` whose body says
//! `List-Unsubscribe=One-Click` (RFC 8058: what a mail provider sends on
//! the one click, urlencoded or `multipart/form-data`, or the button of the
//! `GET` page) adds the address to the tenant's suppression list; any other
//! `POST` is a 400 and changes nothing. `GET` shows the page and changes
//! nothing, since mail scanners follow links. See [`crate::unsubscribe`].

use axum::extract::{FromRequest, Multipart, Request, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Form, Router};

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

/// The claim of a valid token that is still honoured, with its tenant's
/// name, or 404: a forged, altered, foreign or expired token, or one of a
/// tenant that is gone or was created again under its id, tells nothing
/// more.
async fn checked(state: &AppState, token: &str) -> Result<(Claim, String), ApiError> {
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
    // A link of the first form names no incarnation and no time: its
    // message, in the store under that tenant, stands for both.
    let message_created = if claim.issued_at.is_none() {
        state
            .db
            .message(&claim.message_id)
            .await?
            .filter(|message| message.tenant_id == claim.tenant_id)
            .map(|message| message.created_at)
    } else {
        None
    };
    let lifetime = i64::from(state.settings.server.unsubscribe_link_days) * 86_400_000;
    if !claim.honoured(tenant.created_at, message_created, now_ms(), lifetime) {
        return Err(not_found());
    }
    Ok((claim, tenant.name.clone()))
}

/// Whether a `POST`'s body is RFC 8058's one click: a form field
/// `List-Unsubscribe` of `One-Click`, urlencoded or `multipart/form-data`.
async fn is_one_click(request: Request) -> bool {
    const NAME: &str = "List-Unsubscribe";
    const VALUE: &str = "One-Click";
    let kind = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_ascii_lowercase();
    if kind.starts_with("multipart/form-data") {
        let Ok(mut form) = Multipart::from_request(request, &()).await else {
            return false;
        };
        while let Ok(Some(field)) = form.next_field().await {
            if field.name() == Some(NAME) {
                return field.text().await.is_ok_and(|text| text == VALUE);
            }
        }
        return false;
    }
    match Form::<Vec<(String, String)>>::from_request(request, &()).await {
        Ok(Form(fields)) => fields
            .iter()
            .any(|(name, value)| name == NAME && value == VALUE),
        Err(_) => false,
    }
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
        (status = 404, description = "Not a valid link (forged, altered, expired, or its tenant is gone or was created again).", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn unsubscribe_page(
    State(state): State<AppState>,
    ApiPath(token): ApiPath<String>,
) -> Result<Response, ApiError> {
    let (claim, sender) = checked(&state, &token).await?;
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
/// With a body of `List-Unsubscribe=One-Click` (urlencoded or
/// `multipart/form-data`), adds the link's address to its tenant's
/// suppression list (reason `unsubscribe`), records an `unsubscribed`
/// event on the message and sends the tenant's `message.unsubscribed`
/// webhook. Doing it again changes nothing more, and writes nothing.
#[utoipa::path(
    post, path = "/v1/unsubscribe/{token}", tag = "unsubscribe",
    params(("token" = String, Path, description = "The signed token of the message's `List-Unsubscribe` link.")),
    responses(
        (status = 200, description = "Unsubscribed (or already): a page saying so.", body = String, content_type = "text/html"),
        (status = 400, description = "The body is not `List-Unsubscribe=One-Click` (RFC 8058), or a path segment is not valid UTF-8; nothing changed.", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "Not a valid link (forged, altered, expired, or its tenant is gone or was created again); nothing changed.", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn unsubscribe(
    State(state): State<AppState>,
    ApiPath(token): ApiPath<String>,
    request: Request,
) -> Result<Response, ApiError> {
    let (claim, sender) = checked(&state, &token).await?;
    if !is_one_click(request).await {
        return Err(ApiError::BadRequest(
            "A one-click unsubscribe is a POST whose body is List-Unsubscribe=One-Click \
             (RFC 8058), urlencoded or multipart/form-data."
                .into(),
        ));
    }
    let Some((channel, address)) = suppressions::normalize(&claim.address) else {
        return Err(ApiError::NotFound(
            "This unsubscribe link is not valid.".into(),
        ));
    };
    let done = |sender: &str, address: &str| {
        page(
            "Unsubscribed",
            &format!(
                "<h1>Unsubscribed</h1><p>{} will not send email to {} any more.</p>",
                escape(sender),
                escape(address)
            ),
        )
    };
    // Already listed (a second click, a provider that repeats itself):
    // answered from a read, without the store's write turn.
    if state.db.is_suppressed(&claim.tenant_id, &address).await? {
        return Ok(done(&sender, &address));
    }
    let added = state
        .db
        .unsubscribe(
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
    Ok(done(&sender, &address))
}
