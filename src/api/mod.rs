//! The HTTP API: one module per resource, each with its own `router()`,
//! merged here into [`app`]. Shared state is [`AppState`]; the OpenAPI
//! document is [`ApiDoc`].

pub mod admin;
pub mod admins;
pub mod attachments;
pub mod audit;
pub mod auth;
pub mod console;
pub mod dlq;
pub mod error;
pub mod health;
pub mod message_list;
pub mod messages;
pub mod providers;
pub mod receipts;
pub mod senders;
pub mod spec;
pub mod suppressions;
pub mod templates;
pub mod tenant_queue;
pub mod unsubscribe;
pub mod usage;
pub mod webhooks;

use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::DefaultBodyLimit;
use axum::extract::FromRequestParts;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::http::{HeaderMap, StatusCode, header};
use serde::de::DeserializeOwned;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;
use tracing::Instrument;
use utoipa::OpenApi;
use utoipa_swagger_ui::SwaggerUi;

use crate::api::auth::AdminAuth;
use crate::config::Settings;
use crate::limits::backpressure::LaneBackpressure;
use crate::queue::{LaneQueue, TenantQueues};
use crate::store::Db;
use crate::tenants::Registry;
use error::ApiError;
pub use spec::ApiDoc;

/// Everything a handler may need, shared by reference.
#[derive(Clone)]
pub struct AppState(Arc<AppInner>);

pub struct AppInner {
    pub settings: Arc<Settings>,
    pub db: Db,
    pub registry: Arc<Registry>,
    pub queue: Arc<dyn LaneQueue>,
    /// The same backend's dedicated tenant queues.
    pub tenant_queues: Arc<dyn TenantQueues>,
    pub writer: crate::store::Writer,
    /// The accept path of the single and the batch send.
    pub accept: crate::accept::Acceptor,
    /// `limits.backend = "redis"`: the connection, for `/readyz`.
    pub redis: Option<Arc<crate::limits::redis::RedisLimits>>,
    pub backpressure: Arc<LaneBackpressure>,
    /// SQS mode: how the outbox relay is doing, for `/readyz`.
    pub relay: Option<Arc<crate::accept::outbox::RelayHealth>>,
    /// Tenants' changes other than sends, per tenant.
    pub writes: crate::limits::writes::TenantWrites,
    /// Tenants' uploads, per tenant and world (their plans' figures).
    pub uploads: crate::limits::uploads::TenantUploads,
    /// The tenants' turns of message list reads (`limits.tenant_list_reads`).
    pub reads: crate::limits::reads::TenantReads,
    pub admin: AdminAuth,
    /// Signs the console's sessions and CSRF tokens.
    pub console_key: console::SessionKey,
    /// The console's sign-in tries, per client and token prefix.
    pub sign_ins: console::session::SignInThrottle,
    /// Renders `/metrics`.
    pub metrics: metrics_exporter_prometheus::PrometheusHandle,
    /// Checks one-click unsubscribe links (none without a public URL).
    pub unsubscribe: Option<Arc<crate::unsubscribe::Links>>,
    /// Each channel's providers with their gate, as the consumers use them
    /// (empty with `consumers.enabled = false`): the admin view reads
    /// them, SMS callbacks count in their health.
    pub providers: Vec<(crate::model::Channel, crate::consumer::GatedProvider)>,
}

impl AppState {
    pub fn new(inner: AppInner) -> Self {
        AppState(Arc::new(inner))
    }
}

impl Deref for AppState {
    type Target = AppInner;
    fn deref(&self) -> &AppInner {
        &self.0
    }
}

/// The whole API as a router, ready to serve or to call in tests.
pub fn app(state: AppState) -> Router {
    let max_body = state.settings.server.max_body_bytes;
    let timeout = Duration::from_secs(state.settings.server.request_timeout_secs);
    // Every route but the send is cut off at the request timeout. The send
    // is not: once its message is with the accept writer, answering 503
    // while the commit still lands would be a lie. Its own bounds are the
    // store's acquire and busy timeouts, which fail honestly.
    let timed = Router::new()
        .merge(messages::status_router())
        .merge(admin::router())
        .merge(admins::router())
        .merge(audit::router())
        .merge(console::router())
        .merge(receipts::router())
        .merge(webhooks::router())
        .merge(suppressions::router())
        .merge(senders::router())
        .merge(templates::router())
        .merge(attachments::router())
        .merge(message_list::router())
        .merge(usage::router())
        .merge(providers::router())
        .merge(unsubscribe::router())
        .merge(dlq::router())
        .merge(tenant_queue::router())
        .merge(health::router())
        .merge(SwaggerUi::new("/docs").url("/openapi.json", ApiDoc::openapi()))
        // Inside the routes, so it sees the matched route; it records only
        // admin changes (`audit`).
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            audit::record_changes,
        ))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            timeout,
        ));
    // A batch carries up to 1,000 messages: its own, larger body limit.
    let batch = messages::batch_router().layer(DefaultBodyLimit::max(
        state.settings.server.max_batch_body_bytes,
    ));
    let router = Router::new()
        .merge(messages::send_router())
        .merge(batch)
        .merge(attachments::upload_router())
        .merge(timed)
        .fallback(|| async { ApiError::NotFound("No such route.".into()) })
        .layer(DefaultBodyLimit::max(max_body))
        .layer(axum::middleware::from_fn_with_state(timeout, body_deadline))
        .layer(axum::middleware::map_response_with_state(
            timeout,
            problem_for_bare_errors,
        ));
    let router = match crate::telemetry::enabled() {
        true => router.layer(axum::middleware::from_fn_with_state(
            state.clone(),
            trace_request,
        )),
        false => router,
    };
    answering_panics(router)
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}

/// Wraps `router` as [`app`] wraps the API: a handler that panics is
/// answered 500 problem+json (and logged) instead of the connection being
/// dropped without an answer.
pub fn answering_panics<S: Clone + Send + Sync + 'static>(router: Router<S>) -> Router<S> {
    router.layer(CatchPanicLayer::custom(answer_panic))
}

/// The answer to a request whose handler panicked: a 500 that shows no
/// internals; the panic's text goes to the log.
fn answer_panic(panic: Box<dyn std::any::Any + Send + 'static>) -> axum::response::Response {
    use axum::response::IntoResponse;
    let text = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("a panic without a message");
    metrics::counter!(crate::metrics::HANDLER_PANICS_TOTAL).increment(1);
    ApiError::Internal(anyhow::anyhow!("a request handler panicked: {text}")).into_response()
}

/// Gives every request body a deadline `request_timeout_secs` after its
/// head arrived, sends included (they have no request timeout, see
/// [`app`]): a client that drips its body cannot hold a connection, and its
/// request is answered 503 once the deadline passes (see
/// [`BodyDeadlinePassed`]).
/// With traces on: the server span of a request (method and route, never
/// the query, which may hold an unsubscribe token), continuing the caller's
/// `traceparent` when it sends one.
/// What a span says for a method it does not know.
const OTHER_METHOD: &str = "_OTHER";

/// `method` as a span's `http.request.method`: one of HTTP's standard
/// methods, or [`OTHER_METHOD`].
fn method_for_span(method: &axum::http::Method) -> &'static str {
    match method.as_str() {
        "GET" => "GET",
        "HEAD" => "HEAD",
        "POST" => "POST",
        "PUT" => "PUT",
        "DELETE" => "DELETE",
        "CONNECT" => "CONNECT",
        "OPTIONS" => "OPTIONS",
        "TRACE" => "TRACE",
        "PATCH" => "PATCH",
        _ => OTHER_METHOD,
    }
}

/// Whether a request's own `traceparent` may parent its span (and so
/// decide its sampling), as `telemetry.traceparent` says.
fn trusts_traceparent(state: &AppState, headers: &axum::http::HeaderMap) -> bool {
    use crate::config::TraceparentTrust;
    match state.settings.telemetry.traceparent {
        TraceparentTrust::Always => true,
        TraceparentTrust::Never => false,
        TraceparentTrust::Authenticated => auth::bearer_of(headers).is_some_and(|token| {
            state.registry.authenticate(token).is_some() || state.admin.matches(token)
        }),
    }
}

async fn trace_request(
    axum::extract::State(state): axum::extract::State<AppState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or("unmatched", |path| path.as_str())
        .to_owned();
    let method = method_for_span(request.method());
    // OpenTelemetry's HTTP conventions: a method outside the standard set
    // is `_OTHER`, and its span is named `HTTP {route}`; the client's own
    // spelling stays out of the span, whatever its length.
    let name = if method == OTHER_METHOD {
        "HTTP"
    } else {
        method
    };
    let span = crate::telemetry::span!(
        "request",
        otel.name = %format!("{name} {route}"),
        otel.kind = "server",
        http.request.method = method,
        http.route = %route,
    );
    let parent = request
        .headers()
        .get("traceparent")
        .and_then(|value| value.to_str().ok());
    // The caller's key is looked at only when it sent a context: a send
    // without one costs no second hash of its key here.
    if let Some(parent) = parent {
        if trusts_traceparent(&state, request.headers()) {
            crate::telemetry::parent_from(&span, Some(parent));
        } else {
            // A trace of its own, sampled here; the caller's context is
            // kept as a link, which decides nothing.
            crate::telemetry::link_all(&span, crate::telemetry::remote_context(parent));
        }
    }
    let response = next.run(request).instrument(span.clone()).await;
    let status = response.status();
    crate::telemetry::attribute(
        &span,
        "http.response.status_code",
        i64::from(status.as_u16()),
    );
    if status.is_server_error() {
        crate::telemetry::failed(&span, status.as_str());
    }
    response
}

async fn body_deadline(
    axum::extract::State(timeout): axum::extract::State<Duration>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let (parts, body) = request.into_parts();
    let body = axum::body::Body::new(DeadlineBody {
        inner: body,
        deadline: Box::pin(tokio::time::sleep(timeout)),
    });
    next.run(axum::extract::Request::from_parts(parts, body))
        .await
}

/// The request body did not arrive before its deadline.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within server.request_timeout_secs")]
pub struct BodyDeadlinePassed;

/// A body that fails with [`BodyDeadlinePassed`] once `deadline` is over,
/// however steadily its bytes trickle in (tower-http's body timeout restarts
/// with each frame).
struct DeadlineBody {
    inner: axum::body::Body,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl http_body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        if self.deadline.as_mut().poll(cx).is_ready() {
            return std::task::Poll::Ready(Some(Err(Box::new(BodyDeadlinePassed))));
        }
        std::pin::Pin::new(&mut self.inner)
            .poll_frame(cx)
            .map_err(Into::into)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Gives error answers made below the handlers (405 from the router, 503
/// from the timeout layer) the same problem+json shape as ours.
async fn problem_for_bare_errors(
    axum::extract::State(timeout): axum::extract::State<Duration>,
    response: axum::response::Response,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error())
        || response.headers().contains_key(header::CONTENT_TYPE)
    {
        return response;
    }
    let error = match status {
        StatusCode::METHOD_NOT_ALLOWED => {
            ApiError::MethodNotAllowed("This route does not support that method.".into())
        }
        StatusCode::SERVICE_UNAVAILABLE | StatusCode::REQUEST_TIMEOUT => ApiError::Unavailable {
            detail: "The request took longer than server.request_timeout_secs.".into(),
            // The request just needed more than the timeout; asking for
            // the same again sooner would most likely meet the same fate.
            retry_after: timeout,
        },
        StatusCode::PAYLOAD_TOO_LARGE => {
            ApiError::PayloadTooLarge(
                "Request body is larger than server.max_body_bytes (server.max_batch_body_bytes for a batch)."
                    .into(),
            )
        }
        _ => return response,
    };
    let mut converted = error.into_response();
    if let Some(allow) = response.headers().get(header::ALLOW) {
        converted.headers_mut().insert(header::ALLOW, allow.clone());
    }
    converted
}

/// 404 unless a tenant with this id exists (admin routes that name one).
pub(crate) fn known_tenant(state: &AppState, id: &str) -> Result<(), ApiError> {
    state
        .registry
        .tenant(id)
        .map(|_| ())
        .ok_or_else(|| ApiError::NotFound(format!("No tenant {id:?}.")))
}

/// Checks the content type and parses a JSON body; malformed input is a
/// problem+json 400, a wrong type 415, an oversized body 413.
pub fn json_value(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<serde_json::Value, ApiError> {
    let bytes = read_json_bytes(headers, body)?;
    serde_json::from_slice(&bytes)
        .map_err(|err| ApiError::BadRequest(format!("Request body is not valid JSON: {err}.")))
}

/// Like [`json_value`], then deserializes into `T` (whose `deny_unknown_fields`
/// turns a misspelt key into a 422 naming it).
pub fn json_typed<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let bytes = read_json_bytes(headers, body)?;
    // serde would also build a struct from a JSON list of its fields.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(|err| {
            ApiError::BadRequest(format!("Request body is not valid JSON: {err}."))
        })?;
        if !value.is_object() {
            return Err(ApiError::field("body", "must be a JSON object"));
        }
    }
    typed_from_slice(&bytes)
}

/// Deserializes JSON `bytes` into `T`, a failure naming the field: the
/// API's bodies, and the console's forms turned into JSON.
pub(crate) fn typed_from_slice<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let deserializer = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(deserializer).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            return ApiError::BadRequest(format!("Request body is not valid JSON: {inner}."));
        }
        let message = inner.to_string();
        // serde names an unknown or missing field only in its message.
        let named = message.split('`').nth(1).filter(|_| {
            message.starts_with("unknown field") || message.starts_with("missing field")
        });
        // For an unknown field the path already ends at it; for a missing
        // one it stops at the parent object.
        let field = match (named, path.as_str()) {
            (Some(name), ".") => name.to_owned(),
            (Some(name), parent) if message.starts_with("missing field") => {
                format!("{parent}.{name}")
            }
            (_, ".") => "body".to_owned(),
            (_, path) => path.to_owned(),
        };
        let message = message
            .split(" at line ")
            .next()
            .unwrap_or(&message)
            .to_owned();
        ApiError::field(&field, message)
    })
}

/// The 503 of a body that failed because its deadline passed (see
/// [`BodyDeadlinePassed`]), saying `what` of it; none for another failure.
pub(crate) fn body_too_late(
    err: &(dyn std::error::Error + 'static),
    what: &str,
) -> Option<ApiError> {
    let mut cause = Some(err);
    while let Some(error) = cause {
        if error.is::<BodyDeadlinePassed>() {
            return Some(ApiError::Unavailable {
                retry_after: Duration::from_secs(1),
                detail: format!(
                    "The request body did not arrive within server.request_timeout_secs; {what}."
                ),
            });
        }
        cause = error.source();
    }
    None
}

pub(crate) fn read_json_bytes(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Bytes, ApiError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let essence = crate::model::media_type(content_type);
    if essence != "application/json"
        && !(essence.starts_with("application/") && essence.ends_with("+json"))
    {
        return Err(ApiError::UnsupportedMediaType(format!(
            "Content-Type must be application/json (got {:?}).",
            content_type
        )));
    }
    body.map_err(|rejection| {
        if let Some(late) = body_too_late(&rejection, "nothing was accepted") {
            return late;
        }
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge(
                "Request body is larger than server.max_body_bytes (server.max_batch_body_bytes for a batch)."
                    .into(),
            )
        } else {
            ApiError::BadRequest(format!("Request body could not be read: {rejection}."))
        }
    })
}

/// `axum::extract::Path` whose refusals (a segment that is not valid UTF-8,
/// for instance) answer problem+json like every other error, not axum's
/// plain-text 400.
#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ApiError))]
pub struct ApiPath<T>(pub T);

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        ApiError::BadRequest(format!(
            "The URL path is not valid: {}.",
            rejection.body_text()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A span names a standard method as it is and any other as
    /// `_OTHER`: a client cannot write a 20,000-character method into an
    /// exported span.
    #[test]
    fn a_span_takes_a_standard_method_or_other() {
        use axum::http::Method;
        assert_eq!(method_for_span(&Method::POST), "POST");
        assert_eq!(method_for_span(&Method::PATCH), "PATCH");
        let long = Method::from_bytes("X".repeat(20_000).as_bytes()).unwrap();
        assert_eq!(method_for_span(&long), OTHER_METHOD);
        let lower = Method::from_bytes(b"get").unwrap();
        assert_eq!(
            method_for_span(&lower),
            OTHER_METHOD,
            "methods are case-sensitive"
        );
    }
}
