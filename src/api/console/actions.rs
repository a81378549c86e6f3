//! The console's changes other than the registry's (those are in
//! `tenants.rs`): signing in and out, a redrive. Each change is a form `POST` whose CSRF token must
//! be the session's; a viewer's is refused 403 as the API refuses it.

use axum::Form;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use maud::html;
use serde::Deserialize;

use super::session::{Session, cookie_headers};
use super::{Refused, page};
use crate::api::AppState;
use crate::api::audit::{AuditAfter, AuditTarget};
use crate::api::error::ApiError;
use crate::model::Lane;
use crate::queue::RedriveFilter;
use crate::tenants::hash_secret;

/// The sign-in page, with `problem` above the form after a failed try.
fn sign_in(problem: Option<&str>) -> maud::Markup {
    let body = html! {
        @if let Some(problem) = problem { p.warn role="alert" { (problem) } }
        form method="post" action="/console/login" {
            label for="token" { "Admin token" }
            input id="token" name="token" type="password" autocomplete="current-password" required;
            p { button type="submit" { "Sign in" } }
        }
        p.note { "The root token (server.admin_token) or a named admin's token (POST /v1/admin/admins)." }
    };
    page("Sign in", None, body)
}

pub async fn login_page() -> maud::Markup {
    sign_in(None)
}

#[derive(Deserialize)]
pub struct SignIn {
    token: String,
}

/// Signs in with an admin token: a session in the store, its cookie, and
/// on to the overview. Throttled per client address and token prefix
/// (429 with `Retry-After`, before the token is looked at).
pub async fn login(
    State(state): State<AppState>,
    extensions: axum::http::Extensions,
    Form(form): Form<SignIn>,
) -> Result<Response, ApiError> {
    let token = form.token.trim();
    let client = extensions
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map_or_else(|| "unknown".to_owned(), |peer| peer.0.ip().to_string());
    if let Err(wait) = state.sign_ins.take(&client, token) {
        let secs = crate::limits::retry_after_secs(wait);
        let page = sign_in(Some(&format!(
            "Too many sign-in tries; try again in {secs} s."
        )));
        let retry = [(axum::http::header::RETRY_AFTER, secs.to_string())];
        return Ok((StatusCode::TOO_MANY_REQUESTS, retry, page).into_response());
    }
    if state.admin.actor(&state.db, token).await?.is_none() {
        let page = sign_in(Some("That is not an admin token."));
        return Ok((StatusCode::UNAUTHORIZED, page).into_response());
    }
    let value = super::session::start(&state, &hash_secret(token)).await?;
    Ok((cookie_headers(&value, &state), Redirect::to("/console")).into_response())
}

#[derive(Deserialize)]
pub struct Csrf {
    csrf: String,
}

/// Refuses a change whose form does not carry the session's CSRF token,
/// or that a viewer makes.
pub(super) fn admit(session: &Session, csrf: &str) -> Result<(), ApiError> {
    if csrf != session.csrf {
        return Err(ApiError::Forbidden(
            "The form's CSRF token is not this session's; reload the page and try again.".into(),
        ));
    }
    if !session.may_change() {
        return Err(ApiError::Forbidden(format!(
            "Admin {:?} has the viewer role: it may read the console but not change anything.",
            session.actor.name
        )));
    }
    Ok(())
}

/// Signs out: the session ends in the store (on every instance) and the
/// cookie is removed.
pub async fn logout(
    State(state): State<AppState>,
    session: Session,
    Form(form): Form<Csrf>,
) -> Result<Response, ApiError> {
    if form.csrf != session.csrf {
        return Err(ApiError::Forbidden(
            "The form's CSRF token is not this session's.".into(),
        ));
    }
    state.db.end_console_session(&session.id).await?;
    Ok((cookie_headers("", &state), Redirect::to("/console/login")).into_response())
}

/// Redrives a lane's dead letters, as `POST /v1/admin/dlq/redrive` does:
/// the selected ones (`what` = `selected`, an `id` each), or all of the
/// lane's, of one tenant when the form names it.
pub async fn redrive(
    State(state): State<AppState>,
    session: Session,
    Form(fields): Form<Vec<(String, String)>>,
) -> Result<Response, Refused> {
    let field = |name: &str| super::forms::field(&fields, name);
    admit(&session, field("csrf"))?;
    let lane: Lane = field("lane")
        .parse()
        .map_err(|_| ApiError::field("lane", "must be fast or slow"))?;
    let tenant = Some(field("tenant").to_owned()).filter(|t| !t.is_empty());
    if let Some(tenant) = &tenant {
        crate::api::known_tenant(&state, tenant)?;
    }
    let ids: Vec<String> = fields
        .iter()
        .filter(|(name, _)| name == "id")
        .map(|(_, id)| id.clone())
        .collect();
    let selected = field("what") == "selected";
    if selected && ids.is_empty() {
        return Err(ApiError::field("id", "select at least one dead letter").into());
    }
    let filter = RedriveFilter {
        tenant_id: tenant.clone(),
        message_ids: selected.then(|| ids.clone()),
    };
    let redriven = crate::api::dlq::redrive_lanes(&state, vec![lane], filter).await?;
    let after = serde_json::json!({"lane": lane, "tenant": tenant, "ids": selected.then_some(ids), "redriven": redriven});
    let back = match &tenant {
        Some(tenant) => format!("/console/dlq?tenant={tenant}"),
        None => "/console/dlq".to_owned(),
    };
    let target = AuditTarget("/v1/admin/dlq/redrive".into());
    Ok((target, AuditAfter::of(&after), Redirect::to(&back)).into_response())
}
