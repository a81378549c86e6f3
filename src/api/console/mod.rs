//! The operator console at `/console`: pages rendered on the server
//! (maud), on the same store and queue calls the admin API makes, with no
//! script. An admin signs in with its token ([`session`]); a viewer sees
//! every page and no button that changes anything, and a change it forges
//! is refused as the API refuses it. Every change made here is recorded in
//! the audit log with the admin's name, as the API's are
//! ([`crate::api::audit`]).
//!
//! Pages, by file: `pages.rs` the overview, message search, one
//! message's timeline, dead letters and the audit log; `tenants.rs`
//! tenants, plans, keys, sender identities and suppressions with their
//! changes; `actions.rs` the other changes (sign-in and out, redrive);
//! `delivery.rs` the providers and the failing webhooks with their
//! replay; `forms.rs` a form read as the API's JSON body; this file the routes,
//! the frame every page shares and refusals as pages.

mod actions;
mod delivery;
mod forms;
mod pages;
pub mod session;
mod tenants;

use axum::Router;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use maud::{DOCTYPE, Markup, html};

use crate::api::AppState;
use crate::api::error::ApiError;
use session::Session;

pub use session::SessionKey;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/console", get(pages::overview))
        .route(
            "/console/login",
            get(actions::login_page).post(actions::login),
        )
        .route("/console/logout", post(actions::logout))
        .route("/console/tenants", get(tenants::list).post(tenants::create))
        .route(
            "/console/tenants/{id}",
            get(tenants::detail).post(tenants::change),
        )
        .route("/console/tenants/{id}/keys", post(tenants::issue_key))
        .route(
            "/console/tenants/{id}/keys/{key_id}/revoke",
            post(tenants::revoke_key),
        )
        .route("/console/tenants/{id}/senders", post(tenants::add_sender))
        .route(
            "/console/tenants/{id}/senders/{sender_id}/remove",
            post(tenants::remove_sender),
        )
        .route(
            "/console/tenants/{id}/suppressions",
            post(tenants::suppress),
        )
        .route(
            "/console/tenants/{id}/suppressions/remove",
            post(tenants::unsuppress),
        )
        .route(
            "/console/plans",
            get(tenants::plans).post(tenants::put_plan),
        )
        .route("/console/messages", get(pages::messages))
        .route("/console/messages/{id}", get(pages::message))
        .route("/console/dlq", get(pages::dead_letters))
        .route("/console/dlq/redrive", post(actions::redrive))
        .route("/console/providers", get(delivery::providers))
        .route("/console/webhooks", get(delivery::webhooks))
        .route("/console/webhooks/{tenant}/replay", post(delivery::replay))
        .route("/console/audit", get(pages::audit))
        .route("/console/style.css", get(style))
        .layer(axum::middleware::map_response(guarded))
}

/// What every console answer carries: no framing by another page
/// (clickjacking), a Content-Security-Policy that allows no script at all
/// and style only from the console's own sheet, no type sniffing, no
/// referrer beyond the console, and no caching (pages show personal data,
/// and the key-issued page a secret).
async fn guarded(mut response: Response) -> Response {
    const CSP: &str = "default-src 'none'; style-src 'self'; img-src 'self'; \
        form-action 'self'; frame-ancestors 'none'; base-uri 'none'";
    let headers = response.headers_mut();
    for (name, value) in [
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "same-origin"),
        (header::CACHE_CONTROL, "no-store"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

/// The console's one style sheet: readable at 375 px wide (a table's
/// cells wrap, long ids anywhere, so a table fits its box; the box still
/// scrolls, by keyboard too, should one not), visible focus for keyboard
/// users.
const STYLE: &str = "\
body{font:16px/1.45 system-ui,sans-serif;margin:0;color:#1b1b1b;background:#fafafa}\
a{color:#0b4fa8}a:focus,button:focus,input:focus,select:focus{outline:3px solid #f4b400;outline-offset:1px}\
.skip{position:absolute;left:-999px}.skip:focus{left:8px;top:8px;background:#fff;padding:4px}\
header{background:#1d2b3a;color:#fff;padding:8px 12px;display:flex;flex-wrap:wrap;gap:12px;align-items:center}\
header a{color:#fff}header nav ul{list-style:none;display:flex;flex-wrap:wrap;gap:12px;margin:0;padding:0}\
main{padding:12px;max-width:1200px;margin:auto}.box{overflow-x:auto}\
table{border-collapse:collapse;width:100%;background:#fff}th,td{border:1px solid #ddd;padding:4px 6px;text-align:left;overflow-wrap:anywhere}\
th{background:#eef1f4}.num{text-align:right}.warn{color:#a40000;font-weight:600}\
form.inline{display:inline}label{display:block;margin:6px 0 2px}\
svg.bar{vertical-align:middle}svg.bar rect.track{fill:#ddd}svg.bar rect.fill{fill:#0b7a3e}svg.bar rect.high{fill:#a40000}\
.note{color:#555}\
@media (max-width:700px){table.cards thead{position:absolute;left:-9999px}\
table.cards,table.cards tbody,table.cards tr,table.cards th,table.cards td{display:block}\
table.cards tr{border:1px solid #ddd;margin:0 0 8px}table.cards th,table.cards td{border:0;text-align:left}\
table.cards td::before{content:attr(data-label) \": \";font-weight:600}}\
svg.spark rect{fill:#0b7a3e}svg.spark rect.high{fill:#a40000}svg.spark line{stroke:#1b1b1b;stroke-dasharray:2 2}";

async fn style() -> impl axum::response::IntoResponse {
    ([(axum::http::header::CONTENT_TYPE, "text/css")], STYLE)
}

/// A whole page: the frame (skip link, navigation, the admin and the
/// sign-out button) around `body`.
fn page(title: &str, session: Option<&Session>, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · fairlane console" }
                link rel="stylesheet" href="/console/style.css";
            }
            body {
                a.skip href="#main" { "Skip to content" }
                header {
                    strong { "fairlane" }
                    @if let Some(session) = session {
                        nav aria-label="Console" {
                            ul {
                                li { a href="/console" { "Overview" } }
                                li { a href="/console/tenants" { "Tenants" } }
                                li { a href="/console/plans" { "Plans" } }
                                li { a href="/console/messages" { "Messages" } }
                                li { a href="/console/dlq" { "Dead letters" } }
                                li { a href="/console/webhooks" { "Webhooks" } }
                                li { a href="/console/providers" { "Providers" } }
                                li { a href="/console/audit" { "Audit log" } }
                            }
                        }
                        span { (session.actor.name) " (" (session.actor.role.as_str()) ")" }
                        form.inline method="post" action="/console/logout" {
                            input type="hidden" name="csrf" value=(session.csrf);
                            button type="submit" { "Sign out" }
                        }
                    }
                }
                main id="main" {
                    h1 { (title) }
                    (body)
                }
            }
        }
    }
}

/// A bar of `used` against `limit`, with the figures as text beside it
/// for screen readers and for a reader who prefers numbers.
fn bar(used: u64, limit: u64) -> Markup {
    let share = if limit == 0 {
        0.0
    } else {
        (used as f64 / limit as f64).min(1.0)
    };
    // An SVG's own width, not a style attribute: the pages' CSP allows no
    // inline style.
    let width = format!("{:.0}", share * 120.0);
    html! {
        svg.bar width="120" height="10" role="img" aria-label=(format!("{used} of {limit}")) {
            rect.track width="120" height="10" {}
            rect class=(if share >= 0.8 { "high" } else { "fill" }) width=(width) height="10" {}
        }
        " " (used) " / " (limit)
    }
}

/// A console request refused: the API's problem (status, headers such as
/// Retry-After, the fields at fault) as a page a person reads.
pub struct Refused(pub ApiError);

impl<E: Into<ApiError>> From<E> for Refused {
    fn from(err: E) -> Self {
        Refused(err.into())
    }
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        let problem = self.0.problem();
        let body = html! {
            p.warn role="alert" { (problem.detail) }
            @if let Some(errors) = &problem.errors {
                ul { @for (field, message) in errors { li { strong { (field) } ": " (message) } } }
            }
            p { "Go back, correct it and try again, or return to the " a href="/console" { "overview" } "." }
        };
        let page = page(&problem.title, None, body).into_string();
        // The API's answer keeps its status and headers (and logs an
        // internal error); only its body becomes the page.
        let mut response = self.0.into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/html; charset=utf-8"),
        );
        response.headers_mut().remove(header::CONTENT_LENGTH);
        *response.body_mut() = axum::body::Body::from(page);
        response
    }
}

/// The hidden field that carries a session's CSRF token in every form.
fn csrf_field(session: &Session) -> Markup {
    html! { input type="hidden" name="csrf" value=(session.csrf); }
}

/// A one-button form posting `fields` (and the CSRF token) to `action`:
/// a change in a table's row. `label` is the button's text, `name` what a
/// screen reader hears with it.
fn row_button(
    session: &Session,
    action: &str,
    fields: &[(&str, &str)],
    label: &str,
    name: &str,
) -> Markup {
    html! {
        form.inline method="post" action=(action) {
            (csrf_field(session))
            @for (field, value) in fields { input type="hidden" name=(field) value=(value); }
            button type="submit" aria-label=(name) { (label) }
        }
    }
}
