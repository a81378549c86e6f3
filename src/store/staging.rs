//! What an accept makes durable ([`AcceptEntry`]) and where its queue
//! entry goes ([`Staging`]): the embedded queue's own rows, written by the
//! queue through [`QueueRows`] in the accept's transaction, the lanes'
//! table of a PostgreSQL store, or the outbox.

use std::sync::Arc;
use std::time::Duration;

use super::idempotency::StoredResponse;
use super::messages::MessageRecord;
use crate::message::OutboundMessage;
use crate::model::Lane;

/// One message to make durable.
#[derive(Debug, Clone)]
pub struct AcceptEntry {
    pub lane: Lane,
    pub record: MessageRecord,
    pub outbound: OutboundMessage,
    /// Answers to remember with it: its own `Idempotency-Key`'s, and a
    /// batch's (on one of the batch's entries).
    pub idempotency: Vec<StoredResponse>,
    /// With traces on: the span of the request waiting for this write,
    /// which the group commit's span links to.
    pub trace: Option<opentelemetry::trace::SpanContext>,
}

/// The span of a group commit holding accepted messages, linked to the
/// spans of the requests waiting for it (`entries`' traces); none while
/// traces are off or when the group accepts nothing traced.
pub(crate) fn group_span<'a>(entries: impl Iterator<Item = &'a AcceptEntry>) -> tracing::Span {
    if !crate::telemetry::enabled() {
        return tracing::Span::none();
    }
    let links: Vec<_> = entries.filter_map(|entry| entry.trace.clone()).collect();
    if links.is_empty() {
        return tracing::Span::none();
    }
    let span =
        crate::telemetry::span!("group commit", fairlane.store.messages = links.len() as u64);
    crate::telemetry::link_all(&span, links);
    span
}

/// The write could not be made durable; retry after the given time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NotDurable {
    pub retry_after: Duration,
}

/// What to do once the rows a [`QueueRows`] wrote have committed.
pub type AfterCommit = Box<dyn FnOnce() + Send>;

/// A queue that keeps its entries in the SQLite file (the embedded queue)
/// and writes them in the accept's transaction.
pub trait QueueRows: Send + Sync {
    /// Writes `rows` (lane, message) in `tx`; returns what to do once the
    /// transaction has committed (book the rows, wake receivers). May be
    /// called again for the same rows if the group is applied once more.
    fn insert(
        &self,
        tx: &rusqlite::Transaction,
        rows: &[(Lane, &OutboundMessage)],
    ) -> anyhow::Result<AfterCommit>;
}

/// Where the queue entries of an accept go.
pub enum Staging {
    /// Into the embedded queue, in the accept's transaction.
    Queue(Arc<dyn QueueRows>),
    /// Into the outbox table, in the accept's transaction; the request then
    /// sends to SQS through the accept path's outbox.
    Outbox,
    /// Into the PostgreSQL store's lane table, in the accept's transaction
    /// (`queue.backend = "postgres"`).
    Lanes,
}
