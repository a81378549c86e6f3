//! Logging and traces.
//!
//! Logging: `tracing` to stderr, filtered by `RUST_LOG` (default `info`),
//! as text or, with `FAIRLANE_LOG_FORMAT=json`, as JSON lines. Levels and
//! the lines an operator follows are described in the book
//! (docs/src/operations/logging.md).
//!
//! Traces (docs/src/operations/traces.md): with `telemetry.otlp_endpoint` set, the spans
//! made with [`span!`] (target [`TARGET`]) go to an OpenTelemetry exporter
//! (OTLP over HTTP, batched on the SDK's own thread) and never to the log;
//! JSON log lines written inside one carry its `trace_id` and `span_id`.
//! Without an endpoint no exporter is built and those spans are disabled
//! at their call sites, so they cost a load and a branch each.
//!
//! A queued message carries its trace as a W3C `traceparent` inside its
//! delivery payload ([`traceparent_of`], [`parent_from`]), so it survives
//! either queue, the outbox, redrives and dead-letter copies with no change
//! to any table or queue attribute.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{SpanContext, TraceContextExt, TracerProvider as _};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider,
};
use tracing::{Level, Span, Subscriber};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::fmt::format::{FormatEvent, FormatFields, Writer};
use tracing_subscriber::fmt::{FmtContext, format};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

use crate::config::TelemetrySettings;

mod budget;

/// The target of the spans that are exported and never logged.
pub const TARGET: &str = "fairlane_otel";

/// A span for the trace exporter (disabled while traces are off), at INFO
/// under [`TARGET`]; the arguments are those of `tracing::info_span!`.
/// `otel.kind` (`server`, `client`, `producer`, `consumer`) and `otel.name`
/// follow tracing-opentelemetry's conventions.
macro_rules! span {
    ($($arg:tt)+) => {
        ::tracing::info_span!(target: "fairlane_otel", $($arg)+)
    };
}
pub(crate) use span;

/// Whether traces are on in this process.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// True when traces are exported: callers skip building what only a span
/// would use.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Flushes and stops the exporter when dropped (at the end of `serve`).
#[must_use = "dropping it stops the trace exporter"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(err) = provider.shutdown_with_timeout(Duration::from_secs(5))
        {
            eprintln!("fairlane: the last spans could not be exported: {err}");
        }
    }
}

/// Installs the global subscriber: the log and, with an endpoint, the trace
/// exporter. A second call installs nothing (and exports nothing).
pub fn init(settings: &TelemetrySettings) -> anyhow::Result<Telemetry> {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info"))
        .add_directive(format!("{TARGET}=off").parse()?);
    let json = std::env::var("FAIRLANE_LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    if settings.otlp_endpoint.is_empty() {
        // The log alone, its filter global: every span of TARGET is off at
        // its call site.
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(std::io::stderr().is_terminal())
            .with_writer(std::io::stderr);
        let _ = if json {
            builder.json().try_init()
        } else {
            builder.try_init()
        };
        return Ok(Telemetry { provider: None });
    }
    // Colours only on a terminal: in `docker logs`, a file or a log shipper
    // the escape codes would sit inside field names and values (the
    // generated admin token among them).
    let log = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let log: Box<dyn Layer<Registry> + Send + Sync> = if json {
        log.json()
            .event_format(WithTraceIds(format().json()))
            .with_filter(filter)
            .boxed()
    } else {
        log.with_filter(filter).boxed()
    };
    let provider = provider(settings)?;
    let traces = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("fairlane"))
        .with_location(false)
        .with_threads(false)
        .with_level(false)
        .with_filter(Targets::new().with_target(TARGET, Level::TRACE))
        .boxed();
    if tracing_subscriber::registry()
        .with(vec![log, traces])
        .try_init()
        .is_err()
    {
        return Ok(Telemetry { provider: None });
    }
    ENABLED.store(true, Ordering::Relaxed);
    Ok(Telemetry {
        provider: Some(provider),
    })
}

fn provider(settings: &TelemetrySettings) -> anyhow::Result<SdkTracerProvider> {
    let endpoint = format!("{}/v1/traces", settings.otlp_endpoint.trim_end_matches('/'));
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_endpoint(endpoint)
        .with_timeout(Duration::from_secs(10))
        .build()?;
    let bytes = budget::Budget::new(settings.max_queued_bytes);
    let exporter = budget::Releasing {
        inner: exporter,
        budget: bytes.clone(),
    };
    let batches = BatchConfigBuilder::default()
        .with_scheduled_delay(Duration::from_millis(settings.export_interval_ms))
        .with_max_queue_size(settings.max_queued_spans)
        .with_max_export_batch_size(settings.max_queued_spans.min(512))
        .build();
    let processor = budget::Bounded {
        inner: BatchSpanProcessor::builder(exporter)
            .with_batch_config(batches)
            .build(),
        budget: bytes,
    };
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(settings.service_name.clone())
        .build();
    Ok(SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            settings.sample_ratio,
        ))))
        .with_resource(resource)
        .build())
}

/// The span's context, if it is recorded (traces on, span sampled or not).
pub fn span_context(span: &Span) -> Option<SpanContext> {
    if span.is_disabled() {
        return None;
    }
    let context = span.context();
    let span_context = context.span().span_context().clone();
    span_context.is_valid().then_some(span_context)
}

/// The span's context as a W3C `traceparent` value.
pub fn traceparent_of(span: &Span) -> Option<String> {
    if span.is_disabled() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
    carrier.remove("traceparent")
}

/// Makes `span` a child of the remote span `traceparent` names; an
/// unreadable value leaves `span` where it is.
pub fn parent_from(span: &Span, traceparent: Option<&str>) {
    let Some(traceparent) = traceparent else {
        return;
    };
    if span.is_disabled() {
        return;
    }
    let context = extract(traceparent);
    if context.span().span_context().is_valid() {
        let _ = span.set_parent(context);
    }
}

/// The context `traceparent` names, for a link.
pub fn remote_context(traceparent: &str) -> Option<SpanContext> {
    let span_context = extract(traceparent).span().span_context().clone();
    span_context.is_valid().then_some(span_context)
}

/// The remote context of a W3C `traceparent` value (invalid if unreadable).
fn extract(traceparent: &str) -> opentelemetry::Context {
    let carrier = HashMap::from([("traceparent".to_owned(), traceparent.to_owned())]);
    TraceContextPropagator::new().extract(&carrier)
}

/// The `traceparent` inside a queued message's JSON payload, found without
/// parsing it: the payload is fairlane's own serialization, where the key
/// can only appear as the field (inside a string its quotes are escaped).
pub fn traceparent_in(payload: &str) -> Option<&str> {
    const KEY: &str = "\"traceparent\":\"";
    let start = payload.rfind(KEY)? + KEY.len();
    let value = &payload[start..];
    Some(&value[..value.find('"')?])
}

/// Links `span` to each of `contexts` (once each); nothing while disabled.
pub fn link_all(span: &Span, contexts: impl IntoIterator<Item = SpanContext>) {
    if span.is_disabled() {
        return;
    }
    let mut seen = Vec::new();
    for context in contexts {
        if !seen.contains(&context.span_id()) {
            seen.push(context.span_id());
            span.add_link(context);
        }
    }
}

/// Sets an attribute on `span` after it was made (a value known later).
pub fn attribute(span: &Span, key: &'static str, value: impl Into<opentelemetry::Value>) {
    if !span.is_disabled() {
        span.set_attribute(key, value);
    }
}

/// Marks `span` failed with `description` (the OpenTelemetry status).
pub fn failed(span: &Span, description: impl Into<String>) {
    if !span.is_disabled() {
        span.set_status(opentelemetry::trace::Status::error(description.into()));
    }
}

/// The JSON log format with the current span's `trace_id` and `span_id`
/// added to each line written inside an exported span.
struct WithTraceIds<F>(F);

impl<S, N, F> FormatEvent<S, N> for WithTraceIds<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let Some(ids) = span_context(&Span::current()) else {
            return self.0.format_event(ctx, writer, event);
        };
        let mut line = String::new();
        self.0.format_event(ctx, Writer::new(&mut line), event)?;
        match line.rfind('}') {
            Some(end) => write!(
                writer,
                "{},\"trace_id\":\"{}\",\"span_id\":\"{}\"}}{}",
                &line[..end],
                ids.trace_id(),
                ids.span_id(),
                &line[end + 1..]
            ),
            None => writer.write_str(&line),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_traceparent_is_found_as_the_field_and_not_inside_a_text() {
        let tricky = serde_json::json!({
            "text": "\"traceparent\":\"00-forged\"",
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        })
        .to_string();
        assert_eq!(
            traceparent_in(&tricky),
            Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        );
        let only_text = serde_json::json!({"text": "\"traceparent\":\"00-forged\""}).to_string();
        assert_eq!(traceparent_in(&only_text), None);
    }

    #[test]
    fn a_remote_context_reads_a_valid_traceparent_and_refuses_garbage() {
        let context = remote_context("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
            .expect("a valid traceparent");
        assert_eq!(
            context.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert!(context.is_remote());
        assert!(remote_context("not a traceparent").is_none());
    }

    #[test]
    fn without_traces_spans_are_disabled_and_carry_nothing() {
        let span = span!("nothing");
        assert!(span.is_disabled());
        assert!(traceparent_of(&span).is_none());
        assert!(span_context(&span).is_none());
    }
}
