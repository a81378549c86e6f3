//! Traces (issue 31): an OTLP/HTTP receiver of the tests' own collects what
//! the real binary exports, decoded with the OpenTelemetry protobuf types.
//!
//! Here the embedded default: with `telemetry.otlp_endpoint` set, one trace
//! holds a message's request, its producer span, the wait for the group
//! commit (linked from the commit's span), the consumer's attempt with its
//! token wait, claim and provider call, and the attempt after a redrive;
//! the JSON log lines of that message carry the trace's ids; no span holds
//! an address or a text. Without the setting nothing is exported, even with
//! the SDK's own `OTEL_EXPORTER_OTLP_ENDPOINT` pointing at the receiver.
//! The cross-instance trace (accepted by one instance, sent by another, over
//! SQS) is in `instances.rs`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message;
use tokio::task::JoinHandle;

use crate::logging::{EMAIL_TO, SMS_TO, run_with};

/// `SpanKind` values of the OTLP protocol.
pub const SERVER: i32 = 2;
pub const CLIENT: i32 = 3;
pub const PRODUCER: i32 = 4;
pub const CONSUMER: i32 = 5;

/// One exported span, flattened: ids in lowercase hex.
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    /// The resource's `service.instance.id` ("" when not set).
    pub instance: String,
    pub name: String,
    pub kind: i32,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    /// (trace id, span id) of each link.
    pub links: Vec<(String, String)>,
    pub attributes: HashMap<String, String>,
}

impl ReceivedSpan {
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }

    pub fn links_to(&self, other: &ReceivedSpan) -> bool {
        self.links
            .iter()
            .any(|(trace, span)| *trace == other.trace_id && *span == other.span_id)
    }

    pub fn is_child_of(&self, parent: &ReceivedSpan) -> bool {
        self.trace_id == parent.trace_id && self.parent_span_id == parent.span_id
    }
}

/// An OTLP/HTTP endpoint (`POST /v1/traces`, protobuf) keeping every span.
pub struct OtlpReceiver {
    /// The base address, as `telemetry.otlp_endpoint` takes it.
    pub url: String,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    requests: Arc<Mutex<usize>>,
    server: JoinHandle<()>,
}

type Received = (Arc<Mutex<Vec<ReceivedSpan>>>, Arc<Mutex<usize>>);

impl OtlpReceiver {
    pub async fn start() -> OtlpReceiver {
        let spans = Arc::new(Mutex::new(Vec::new()));
        let requests = Arc::new(Mutex::new(0));
        let router = Router::new()
            .route("/v1/traces", post(take_export))
            .with_state((spans.clone(), requests.clone()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the OTLP receiver");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let server = tokio::spawn(async move {
            axum::serve(listener, router)
                .await
                .expect("the OTLP receiver serves")
        });
        OtlpReceiver {
            url,
            spans,
            requests,
            server,
        }
    }

    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().expect("spans").clone()
    }

    /// Export requests received so far.
    pub fn requests(&self) -> usize {
        *self.requests.lock().expect("requests")
    }

    /// Waits (30 s at most) until `done` holds for the spans received.
    pub async fn wait_until(&self, what: &str, done: impl Fn(&[ReceivedSpan]) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if done(&self.spans()) {
                return;
            }
            if Instant::now() > deadline {
                let names: Vec<String> = self
                    .spans()
                    .iter()
                    .map(|span| format!("{} {} ({})", span.instance, span.name, span.trace_id))
                    .collect();
                panic!("within 30 s the receiver did not get {what}; it got: {names:#?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn take_export(
    State((spans, requests)): State<Received>,
    body: Bytes,
) -> axum::http::StatusCode {
    *requests.lock().expect("requests") += 1;
    let Ok(export) = ExportTraceServiceRequest::decode(body) else {
        return axum::http::StatusCode::BAD_REQUEST;
    };
    let mut kept = spans.lock().expect("spans");
    for resource_spans in export.resource_spans {
        let instance = resource_spans
            .resource
            .as_ref()
            .and_then(|resource| text_of(&resource.attributes, "service.instance.id"))
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                kept.push(ReceivedSpan {
                    instance: instance.clone(),
                    name: span.name,
                    kind: span.kind,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    links: span
                        .links
                        .iter()
                        .map(|link| (hex(&link.trace_id), hex(&link.span_id)))
                        .collect(),
                    attributes: span
                        .attributes
                        .iter()
                        .map(|kv| (kv.key.clone(), value_text(kv)))
                        .collect(),
                });
            }
        }
    }
    axum::http::StatusCode::OK
}

fn text_of(attributes: &[KeyValue], key: &str) -> Option<String> {
    attributes.iter().find(|kv| kv.key == key).map(value_text)
}

fn value_text(kv: &KeyValue) -> String {
    match kv.value.as_ref().and_then(|value| value.value.as_ref()) {
        Some(AnyValue::StringValue(text)) => text.clone(),
        Some(AnyValue::IntValue(n)) => n.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::DoubleValue(x)) => x.to_string(),
        other => format!("{other:?}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// The one span named `name` with `messaging.message.id` (or
/// `fairlane.message.id`) `id`, or the test fails.
pub fn span_of<'a>(spans: &'a [ReceivedSpan], name: &str, id: &str) -> &'a ReceivedSpan {
    let found: Vec<&ReceivedSpan> = spans
        .iter()
        .filter(|span| {
            span.name == name
                && (span.attribute("messaging.message.id") == Some(id)
                    || span.attribute("fairlane.message.id") == Some(id))
        })
        .collect();
    match found.as_slice() {
        [one] => one,
        _ => panic!(
            "want one {name:?} span of {id}, found {}: {found:#?}",
            found.len()
        ),
    }
}

/// The one span named `name` whose parent is `parent`.
pub fn child_of<'a>(
    spans: &'a [ReceivedSpan],
    name: &str,
    parent: &ReceivedSpan,
) -> &'a ReceivedSpan {
    spans
        .iter()
        .find(|span| span.name == name && span.is_child_of(parent))
        .unwrap_or_else(|| {
            panic!(
                "no {name:?} span under {:?} ({}); spans: {spans:#?}",
                parent.name, parent.span_id
            )
        })
}

/// Fails when any span carries one of `secrets` (an address, a text).
pub fn assert_no_secrets(spans: &[ReceivedSpan], secrets: &[&str]) {
    for span in spans {
        let text = format!("{span:?}");
        for secret in secrets {
            assert!(
                !text.contains(secret),
                "a span carries {secret:?}: {span:#?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_follows_a_message_through_the_embedded_queue_and_a_redrive() {
    let otlp = OtlpReceiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    let run = run_with(
        dir.path(),
        &[
            ("FAIRLANE__TELEMETRY__OTLP_ENDPOINT", &otlp.url),
            ("FAIRLANE__TELEMETRY__EXPORT_INTERVAL_MS", "100"),
        ],
    )
    .await;
    // The process has stopped: what it had finished is exported.
    let spans = otlp.spans();

    let email = &run.email_id;
    let created = span_of(&spans, "create fast", email);
    assert_eq!(created.kind, PRODUCER, "{created:#?}");
    let request = spans
        .iter()
        .find(|span| span.span_id == created.parent_span_id)
        .unwrap_or_else(|| panic!("the create span's parent was not exported: {created:#?}"));
    assert_eq!(request.name, "POST /v1/messages", "{request:#?}");
    assert_eq!(request.kind, SERVER);
    assert_eq!(request.attribute("http.response.status_code"), Some("202"));
    let wait = child_of(&spans, "wait for the durable write", request);
    let group = spans
        .iter()
        .find(|span| span.name == "group commit" && span.links_to(wait))
        .unwrap_or_else(|| panic!("no group commit span links to {wait:#?}"));
    assert_ne!(
        group.trace_id, request.trace_id,
        "a group is a trace of its own"
    );

    let process = span_of(&spans, "process fast", email);
    assert_eq!(process.kind, CONSUMER);
    assert_eq!(
        process.attribute("messaging.operation.name"),
        Some("process")
    );
    assert_eq!(process.attribute("messaging.system"), Some("fairlane"));
    assert_eq!(
        process.attribute("messaging.destination.name"),
        Some("fast")
    );
    assert_eq!(
        created.attribute("messaging.operation.name"),
        Some("create")
    );
    assert!(
        process.is_child_of(created),
        "{process:#?} under {created:#?}"
    );
    child_of(&spans, "wait for a provider token", process);
    child_of(&spans, "claim", process);
    let call = child_of(&spans, "send email", process);
    assert_eq!(call.kind, CLIENT);
    assert_eq!(call.attribute("fairlane.outcome"), Some("sent"));

    // The SMS was refused for good, dead-lettered and redriven: the attempt
    // after the redrive is in the trace the message was accepted in.
    let sms = &run.sms_id;
    let sms_created = span_of(&spans, "create fast", sms);
    let attempts: Vec<&ReceivedSpan> = spans
        .iter()
        .filter(|span| {
            span.name == "process fast" && span.attribute("messaging.message.id") == Some(sms)
        })
        .collect();
    assert!(
        attempts.len() >= 2,
        "the first attempt and the one after the redrive: {attempts:#?}"
    );
    for attempt in &attempts {
        assert!(attempt.is_child_of(sms_created), "{attempt:#?}");
        let call = child_of(&spans, "send sms", attempt);
        assert_eq!(call.attribute("fairlane.outcome"), Some("permanent"));
    }

    // The log lines of the email's delivery carry its trace.
    let sent = run.line("Message sent.", email);
    assert_eq!(sent["trace_id"], created.trace_id.as_str(), "{sent}");
    assert_eq!(sent["span_id"], process.span_id.as_str(), "{sent}");
    assert_no_secrets(&spans, &[EMAIL_TO, SMS_TO, "Your receipt", "Your code is"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_endpoint_nothing_is_exported_and_no_line_has_trace_ids() {
    let otlp = OtlpReceiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    // The SDK's own variable points at the receiver: fairlane must not
    // build an exporter that would read it.
    let run = run_with(
        dir.path(),
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp.url),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", &otlp.url),
        ],
    )
    .await;
    assert_eq!(
        otlp.requests(),
        0,
        "spans were exported: {:#?}",
        otlp.spans()
    );
    run.line("Message sent.", &run.email_id);
    for line in &run.lines {
        assert!(
            line.get("trace_id").is_none() && line.get("span_id").is_none(),
            "{line}"
        );
    }
}

/// A client's odd method does not reach an exported span: a request with
/// a 20,000-character method and a sampled `traceparent` is exported as
/// `_OTHER`, its span named `HTTP …`, and no span holds the method.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_method_is_other_in_the_exported_span() {
    let otlp = OtlpReceiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    let started = crate::logging::start(
        dir.path(),
        &[
            ("FAIRLANE__TELEMETRY__OTLP_ENDPOINT", &otlp.url),
            ("FAIRLANE__TELEMETRY__EXPORT_INTERVAL_MS", "100"),
            // The odd request has no credentials: continue its trace all
            // the same, so its span is exported to be looked at.
            ("FAIRLANE__TELEMETRY__TRACEPARENT", "always"),
        ],
    )
    .await;
    let method = "X".repeat(20_000);
    let answer = started
        .client
        .request(
            reqwest::Method::from_bytes(method.as_bytes()).unwrap(),
            format!("{}/v1/messages", started.base),
        )
        .header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .send()
        .await
        .expect("the request is answered");
    assert!(answer.status().is_client_error(), "{}", answer.status());
    otlp.wait_until("the odd request's span", |spans| {
        spans
            .iter()
            .any(|span| span.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736")
    })
    .await;
    crate::logging::stop(started.child).await;
    let spans = otlp.spans();
    let request = spans
        .iter()
        .find(|span| span.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736" && span.kind == SERVER)
        .expect("the request's span");
    assert_eq!(
        request.attribute("http.request.method"),
        Some("_OTHER"),
        "{request:#?}"
    );
    assert!(request.name.starts_with("HTTP "), "{}", request.name);
    assert_no_secrets(&spans, &[&method[..64]]);
}

/// Issue 46: with `sample_ratio = 0.0`, a request without credentials and
/// a sampled `traceparent` exports nothing (its span is a root of its own,
/// not sampled); the same request with the admin token continues the
/// caller's trace and is exported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anonymous_sampled_traceparent_is_not_exported_by_default() {
    const ANONYMOUS: &str = "5bf92f3577b34da6a3ce929d0e0e4736";
    const ADMIN: &str = "c0f92f3577b34da6a3ce929d0e0e4736";
    let otlp = OtlpReceiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    let started = crate::logging::start(
        dir.path(),
        &[
            ("FAIRLANE__TELEMETRY__OTLP_ENDPOINT", &otlp.url),
            ("FAIRLANE__TELEMETRY__EXPORT_INTERVAL_MS", "100"),
            ("FAIRLANE__TELEMETRY__SAMPLE_RATIO", "0.0"),
        ],
    )
    .await;
    let get = |trace: &str| {
        started
            .client
            .get(format!("{}/v1/admin/tenants", started.base))
            .header("traceparent", format!("00-{trace}-00f067aa0ba902b7-01"))
    };
    for _ in 0..20 {
        let answer = get(ANONYMOUS).send().await.unwrap();
        assert_eq!(answer.status(), reqwest::StatusCode::UNAUTHORIZED);
    }
    let answer = get(ADMIN)
        .bearer_auth(crate::logging::ADMIN)
        .send()
        .await
        .unwrap();
    assert!(answer.status().is_success(), "{}", answer.status());
    otlp.wait_until("the admin request's span", |spans| {
        spans.iter().any(|span| span.trace_id == ADMIN)
    })
    .await;
    crate::logging::stop(started.child).await;
    let spans = otlp.spans();
    assert!(
        spans.iter().all(|span| span.trace_id != ANONYMOUS),
        "an anonymous caller's traceparent forced an export: {spans:#?}"
    );
}

/// Issue 46: the exporter's queue is bounded in bytes. With no export
/// while the test runs (the first is an hour away) and a budget of
/// 4,096 bytes, a few hundred traced requests fill it and every span past
/// it is dropped and counted; the process goes on answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_past_the_exporters_byte_budget_are_dropped_and_counted() {
    let otlp = OtlpReceiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    let started = crate::logging::start(
        dir.path(),
        &[
            ("FAIRLANE__TELEMETRY__OTLP_ENDPOINT", &otlp.url),
            ("FAIRLANE__TELEMETRY__EXPORT_INTERVAL_MS", "3600000"),
            ("FAIRLANE__TELEMETRY__MAX_QUEUED_BYTES", "4096"),
        ],
    )
    .await;
    let dropped = |text: &str| -> f64 {
        text.lines()
            .find(|line| line.starts_with("fairlane_trace_spans_dropped_total"))
            .and_then(|line| line.rsplit(' ').next())
            .and_then(|value| value.parse().ok())
            .unwrap_or_else(|| panic!("no fairlane_trace_spans_dropped_total in:\n{text}"))
    };
    let metrics = || async {
        started
            .client
            .get(format!("{}/metrics", started.base))
            .send()
            .await
            .expect("/metrics answers")
            .text()
            .await
            .unwrap()
    };
    assert_eq!(dropped(&metrics().await), 0.0, "nothing dropped at first");
    for _ in 0..200 {
        let answer = started
            .client
            .get(format!("{}/v1/admin/tenants", started.base))
            .bearer_auth(crate::logging::ADMIN)
            .send()
            .await
            .expect("a traced request is answered");
        assert!(answer.status().is_success(), "{}", answer.status());
    }
    let count = dropped(&metrics().await);
    // 4,096 bytes hold a few dozen request spans at most.
    assert!(count >= 100.0, "spans dropped past the budget: {count}");
    crate::logging::stop(started.child).await;
}
