//! SQS batch calls: SendMessageBatch, DeleteMessageBatch and
//! ChangeMessageVisibilityBatch in calls of at most ten entries, with every
//! `Failed` entry mapped back to its input.

use std::future::Future;
use std::ops::Range;

use anyhow::{Context, anyhow};
use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::{DisplayErrorContext, SdkError};
use aws_sdk_sqs::types::{
    BatchResultErrorEntry, ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry,
};
use futures_util::StreamExt;
use tracing::{Instrument, warn};

use super::envelope::Envelope;
pub(super) use super::envelope::ceil_secs;
use crate::queue::EntryResult;
use crate::queue::priority::CLASSES;

/// Most entries SQS takes in one batch call.
pub(super) const MAX_BATCH_ENTRIES: usize = 10;
/// Most bytes (bodies and attributes) of one SendMessageBatch. SQS has taken
/// up to 1 MiB since 2025; 256 KiB keeps older SQS-compatible servers working
/// and costs extra calls only for unusually large messages.
pub(super) const MAX_BATCH_BYTES: usize = 256 * 1024;

/// An SDK error with its whole chain (code and message of service errors).
pub(super) fn sdk_error<E, R>(err: SdkError<E, R>) -> anyhow::Error
where
    E: std::error::Error + 'static,
    R: std::fmt::Debug,
{
    anyhow!("{}", DisplayErrorContext(&err))
}

pub(super) fn batch_error_text(failed: &BatchResultErrorEntry) -> String {
    format!(
        "{}: {}",
        failed.code(),
        failed.message().unwrap_or("no message")
    )
}

/// Splits `0..len` into index ranges of at most [`MAX_BATCH_ENTRIES`].
pub(super) fn chunks(len: usize) -> impl Iterator<Item = Range<usize>> {
    (0..len)
        .step_by(MAX_BATCH_ENTRIES)
        .map(move |start| start..(start + MAX_BATCH_ENTRIES).min(len))
}

/// Per-entry results of one batch call whose entry ids are `0..len`.
pub(super) fn entry_results<'a>(
    len: usize,
    successful: impl IntoIterator<Item = &'a str>,
    failed: &[BatchResultErrorEntry],
) -> Vec<EntryResult> {
    let mut results = vec![Err("SQS did not report on this entry".to_owned()); len];
    for id in successful {
        if let Some(slot) = id.parse::<usize>().ok().and_then(|i| results.get_mut(i)) {
            *slot = Ok(());
        }
    }
    for failure in failed {
        if let Some(slot) = failure
            .id()
            .parse::<usize>()
            .ok()
            .and_then(|i| results.get_mut(i))
        {
            *slot = Err(batch_error_text(failure));
        }
    }
    results
}

/// Runs one batch operation as several SQS calls. A call that fails as a
/// whole ends the operation with `Err` if it was the first (nothing was
/// done); later, it marks its own entries `Err` and the others go on.
pub(super) async fn run_batches<F, Fut>(
    ranges: Vec<Range<usize>>,
    mut call: F,
) -> anyhow::Result<Vec<EntryResult>>
where
    F: FnMut(Range<usize>) -> Fut,
    Fut: Future<Output = anyhow::Result<Vec<EntryResult>>>,
{
    let mut results = Vec::new();
    for (n, range) in ranges.into_iter().enumerate() {
        let len = range.len();
        match call(range).await {
            Ok(part) => results.extend(part),
            Err(err) if n == 0 => return Err(err),
            Err(err) => {
                let reason = format!("{err:#}");
                results.extend(std::iter::repeat_n(Err(reason), len));
            }
        }
    }
    Ok(results)
}

/// SendMessageBatch of `envelopes` to `url`, in calls of at most ten
/// entries and [`MAX_BATCH_BYTES`].
pub(super) async fn send_envelopes(
    client: &Client,
    url: &str,
    envelopes: &[Envelope<'_>],
) -> anyhow::Result<Vec<EntryResult>> {
    let mut ranges = Vec::new();
    let mut start = 0;
    let mut bytes = 0;
    for (i, envelope) in envelopes.iter().enumerate() {
        let size = envelope.size();
        if i > start && (i - start == MAX_BATCH_ENTRIES || bytes + size > MAX_BATCH_BYTES) {
            ranges.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += size;
    }
    if start < envelopes.len() {
        ranges.push(start..envelopes.len());
    }
    run_batches(ranges, |range| async move {
        let chunk = &envelopes[range];
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(i, envelope)| envelope.entry(i))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let span = send_span(url, chunk);
        let output = client
            .send_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .instrument(span)
            .await
            .map_err(sdk_error)
            .context("SendMessageBatch failed")?;
        Ok(entry_results(
            chunk.len(),
            output.successful().iter().map(|entry| entry.id()),
            output.failed(),
        ))
    })
    .await
}

/// The producer span of one SendMessageBatch (OpenTelemetry messaging
/// conventions), linked to each message's own trace.
fn send_span(url: &str, chunk: &[Envelope<'_>]) -> tracing::Span {
    if !crate::telemetry::enabled() {
        return tracing::Span::none();
    }
    let queue = url.rsplit('/').next().unwrap_or(url);
    let span = crate::telemetry::span!(
        "send",
        otel.name = %format!("send {queue}"),
        otel.kind = "producer",
        messaging.system = "aws_sqs",
        messaging.operation.type = "send",
        messaging.operation.name = "SendMessageBatch",
        messaging.destination.name = queue,
        messaging.batch.message_count = chunk.len() as u64,
    );
    crate::telemetry::link_all(
        &span,
        chunk.iter().filter_map(|envelope| {
            crate::telemetry::traceparent_in(envelope.body)
                .and_then(crate::telemetry::remote_context)
        }),
    );
    span
}

/// ChangeMessageVisibilityBatch of `(receipt, seconds)` pairs.
pub(super) async fn change_visibility(
    client: &Client,
    url: &str,
    changes: &[(&str, i32)],
) -> anyhow::Result<Vec<EntryResult>> {
    run_batches(chunks(changes.len()).collect(), |range| async move {
        let chunk = &changes[range];
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(i, (receipt, secs))| {
                ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(*receipt)
                    .visibility_timeout(*secs)
                    .build()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let output = client
            .change_message_visibility_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(sdk_error)
            .context("ChangeMessageVisibilityBatch failed")?;
        Ok(entry_results(
            chunk.len(),
            output.successful().iter().map(|entry| entry.id()),
            output.failed(),
        ))
    })
    .await
}

/// DeleteMessageBatch of `receipts`.
pub(super) async fn delete_receipts(
    client: &Client,
    url: &str,
    receipts: &[&str],
) -> anyhow::Result<Vec<EntryResult>> {
    run_batches(chunks(receipts.len()).collect(), |range| async move {
        let chunk = &receipts[range];
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(i, receipt)| {
                DeleteMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(*receipt)
                    .build()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let output = client
            .delete_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(sdk_error)
            .context("DeleteMessageBatch failed")?;
        Ok(entry_results(
            chunk.len(),
            output.successful().iter().map(|entry| entry.id()),
            output.failed(),
        ))
    })
    .await
}

/// ChangeMessageVisibilityBatch calls [`change_visibility_at_once`] makes at
/// a time.
const VISIBILITY_CALLS_AT_ONCE: usize = 8;

/// ChangeMessageVisibilityBatch of `(receipt, seconds)` pairs for many
/// messages (a deep stash): up to [`VISIBILITY_CALLS_AT_ONCE`] calls at a
/// time, each call's failure as a whole marking its own entries `Err`.
/// Results in entry order.
pub(super) async fn change_visibility_at_once(
    client: &Client,
    url: &str,
    changes: &[(&str, i32)],
) -> Vec<EntryResult> {
    let calls = chunks(changes.len()).map(|range| async move {
        let len = range.len();
        change_visibility(client, url, &changes[range])
            .await
            .unwrap_or_else(|err| vec![Err(format!("{err:#}")); len])
    });
    futures_util::stream::iter(calls)
        .buffered(VISIBILITY_CALLS_AT_ONCE)
        .concat()
        .await
}

/// Makes received messages visible again at once, logging what could not be.
pub(super) async fn release(client: &Client, url: &str, receipts: &[&str]) {
    let changes: Vec<(&str, i32)> = receipts.iter().map(|receipt| (*receipt, 0)).collect();
    let results = change_visibility_at_once(client, url, &changes).await;
    if let Some(Err(error)) = results.iter().find(|r| r.is_err()) {
        let failed = results.iter().filter(|r| r.is_err()).count();
        warn!(queue = url, failed, %error, "Could not return some messages; they return after their visibility timeout.");
    }
}

/// Runs a batch operation whose entries go to different class queues: one
/// `call(rank, indexes)` per class that has entries (`classes[i]` is entry
/// `i`'s class rank, `None` for an entry that has none and fails alone), all
/// at once, with the results put back in entry order. `Err` as a whole only
/// when every call failed as a whole, that is when nothing was done.
pub(super) async fn by_class<F, Fut>(
    classes: &[Option<usize>],
    call: F,
) -> anyhow::Result<Vec<EntryResult>>
where
    F: Fn(usize, Vec<usize>) -> Fut,
    Fut: Future<Output = anyhow::Result<Vec<EntryResult>>>,
{
    let groups: [Vec<usize>; CLASSES] = std::array::from_fn(|rank| {
        (0..classes.len())
            .filter(|&i| classes[i] == Some(rank))
            .collect()
    });
    let run = |rank: usize| {
        let call = (!groups[rank].is_empty()).then(|| call(rank, groups[rank].clone()));
        async move {
            match call {
                Some(call) => Some(call.await),
                None => None,
            }
        }
    };
    let (high, normal, low) = tokio::join!(run(0), run(1), run(2));
    let mut results: Vec<EntryResult> =
        vec![Err("the receipt names no class queue of this lane".to_owned()); classes.len()];
    let mut done_any = false;
    let mut first_error = None;
    for (rank, outcome) in [high, normal, low].into_iter().enumerate() {
        match outcome {
            None => {}
            Some(Ok(part)) => {
                done_any = true;
                for (&i, result) in groups[rank].iter().zip(part) {
                    results[i] = result;
                }
            }
            Some(Err(err)) => {
                let reason = format!("{err:#}");
                for &i in &groups[rank] {
                    results[i] = Err(reason.clone());
                }
                first_error.get_or_insert(err);
            }
        }
    }
    match first_error {
        Some(err) if !done_any => Err(err),
        _ => Ok(results),
    }
}
