//! The exporter's queue bounded in bytes (`telemetry.max_queued_bytes`),
//! beside the SDK's bound in spans (`max_queued_spans`).
//!
//! A span's size is estimated when it ends (its name, attribute keys and
//! values, events and links, plus a fixed part for ids and times) and
//! added to what waits; a span that would take the total past the budget
//! is dropped at once and counted (`fairlane_trace_spans_dropped_total`),
//! never waited for. The exporter gives the sizes of a batch back as it
//! takes it, whatever the collector then answers.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use opentelemetry::{Context, Value};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};

/// Bytes counted for each span besides its text: ids, times, kind, status.
const FIXED_BYTES: usize = 96;

/// Bytes of the spans that ended and have not been taken for export.
#[derive(Debug)]
pub(super) struct Budget {
    limit: usize,
    waiting: AtomicUsize,
}

impl Budget {
    pub(super) fn new(limit: usize) -> Arc<Self> {
        Arc::new(Budget {
            limit,
            waiting: AtomicUsize::new(0),
        })
    }

    /// Counts `bytes` in, unless the total would pass the limit.
    fn admit(&self, bytes: usize) -> bool {
        self.waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |waiting| {
                let total = waiting.checked_add(bytes)?;
                (total <= self.limit).then_some(total)
            })
            .is_ok()
    }

    fn release(&self, bytes: usize) {
        let _ = self
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |waiting| {
                Some(waiting.saturating_sub(bytes))
            });
    }
}

/// The estimated size of `span` in memory and on the wire.
pub(super) fn size_of(span: &SpanData) -> usize {
    let value = |value: &Value| match value {
        Value::String(text) => text.as_str().len(),
        Value::Array(array) => format!("{array:?}").len(),
        _ => 8,
    };
    let attributes = |attributes: &[opentelemetry::KeyValue]| -> usize {
        attributes
            .iter()
            .map(|kv| kv.key.as_str().len() + value(&kv.value) + 8)
            .sum()
    };
    let events: usize = span
        .events
        .events
        .iter()
        .map(|event| event.name.len() + attributes(&event.attributes) + 24)
        .sum();
    let links: usize = span
        .links
        .links
        .iter()
        .map(|link| attributes(&link.attributes) + 40)
        .sum();
    FIXED_BYTES + span.name.len() + attributes(&span.attributes) + events + links
}

/// Lets a span through to `inner` (the SDK's batch processor) only while
/// the budget holds it.
#[derive(Debug)]
pub(super) struct Bounded<P> {
    pub(super) inner: P,
    pub(super) budget: Arc<Budget>,
}

impl<P: SpanProcessor> SpanProcessor for Bounded<P> {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.budget.admit(size_of(&span)) {
            self.inner.on_end(span);
        } else {
            metrics::counter!(crate::metrics::TRACE_SPANS_DROPPED_TOTAL).increment(1);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// Gives each batch's bytes back to the budget as the batch processor
/// hands it over, then exports it with `inner`.
#[derive(Debug)]
pub(super) struct Releasing<E> {
    pub(super) inner: E,
    pub(super) budget: Arc<Budget>,
}

impl<E: SpanExporter> SpanExporter for Releasing<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        self.budget.release(batch.iter().map(size_of).sum());
        self.inner.export(batch).await
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_admits_up_to_its_limit_and_frees_what_is_released() {
        let budget = Budget::new(1000);
        assert!(budget.admit(600));
        assert!(!budget.admit(500), "past the limit");
        assert!(budget.admit(400));
        budget.release(600);
        assert!(budget.admit(500));
        budget.release(usize::MAX);
        assert_eq!(budget.waiting.load(Ordering::Acquire), 0);
    }
}
