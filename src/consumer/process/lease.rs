//! A received message's lease while it is worked on: deferrals that the
//! queue must take even through a store outage ([`put_back`]), and the
//! visibility kept while a call runs ([`kept_visible`]) or after a long
//! wait behind the tenant's cap ([`renew_if_parked_long`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use super::Context;
use crate::metrics as names;
use crate::queue::{ReceivedMessage, StaleReceipt};

pub(super) async fn defer(
    context: &Context,
    message: &ReceivedMessage,
    delay: Duration,
    reason: &'static str,
) {
    metrics::counter!(names::DEFERRED_TOTAL, "lane" => context.lane.as_str(), "reason" => reason)
        .increment(1);
    put_back(context, message, delay, reason).await;
}

/// First pause before a deferral the queue refused is tried again; it
/// doubles up to [`PUT_BACK_RETRY_MAX`].
const PUT_BACK_RETRY_FIRST: Duration = Duration::from_millis(250);
const PUT_BACK_RETRY_MAX: Duration = Duration::from_secs(4);
/// A refused deferral is given up this long after the first try.
const PUT_BACK_RETRY_FOR: Duration = Duration::from_secs(300);

/// Returns `message` to its lane after `delay` ([`LaneQueue::defer`]). A
/// queue that cannot be reached (a store outage, on PostgreSQL lanes)
/// gets the same deferral again in the background, until it takes it or
/// [`PUT_BACK_RETRY_FOR`] has passed: within the lease that keeps the
/// receive from counting toward `max_receive_count`, and after it, where
/// the queue can still give the receive back, too. Without this, every
/// store outage cost each message in hand one receive, and a few faults
/// in a row dead-lettered healthy messages (issue 67). Meanwhile the
/// message returns after its visibility timeout as before.
pub(super) async fn put_back(
    context: &Context,
    message: &ReceivedMessage,
    delay: Duration,
    reason: &str,
) {
    let queue = &context.delivery.queue;
    let Err(err) = queue.defer(context.lane, message, delay).await else {
        return;
    };
    if err.is::<StaleReceipt>() {
        warn!(message_id = %message.message_id, error = %err, reason, "Could not defer message: it was received again meanwhile.");
        return;
    }
    warn!(message_id = %message.message_id, error = %format!("{err:#}"), reason, "Could not defer message; trying again in the background (it returns after its visibility timeout meanwhile).");
    let (queue, lane, message) = (Arc::clone(queue), context.lane, message.clone());
    let mut shutdown = context.shutdown.clone();
    let since = Instant::now();
    tokio::spawn(async move {
        let mut pause = PUT_BACK_RETRY_FIRST;
        loop {
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                _ = shutdown.wait_for(|stopping| *stopping) => return,
            }
            let left = delay.saturating_sub(since.elapsed());
            match queue.defer(lane, &message, left).await {
                Ok(()) => {
                    info!(message_id = %message.message_id, after_ms = since.elapsed().as_millis() as u64, "Deferred the message once the queue answered again.");
                    return;
                }
                Err(err) if err.is::<StaleReceipt>() => {
                    info!(message_id = %message.message_id, "Gave up deferring the message: it was received again meanwhile.");
                    return;
                }
                Err(err) if since.elapsed() >= PUT_BACK_RETRY_FOR => {
                    warn!(message_id = %message.message_id, error = %err, "Gave up deferring the message; its receive counts toward max_receive_count.");
                    return;
                }
                Err(_) => pause = (pause * 2).min(PUT_BACK_RETRY_MAX),
            }
        }
    });
}

/// A message that was parked for a third of its visibility timeout or more
/// gets a fresh one before it goes on, so it is not received again by
/// another consumer while it waits for a provider token.
pub(in crate::consumer) async fn renew_if_parked_long(
    context: &Context,
    message: &ReceivedMessage,
    parked_for: Duration,
) {
    let visibility = Duration::from_secs(context.settings.visibility_timeout_secs);
    if parked_for < visibility / 3 {
        return;
    }
    let renewed = context
        .delivery
        .queue
        .change_visibility_batch(context.lane, &[(message.receipt.clone(), visibility)])
        .await;
    if !matches!(renewed, Ok(results) if results.iter().all(Result::is_ok)) {
        warn!(message_id = %message.message_id, "Could not renew the visibility of a parked message; it may be delivered again.");
    }
}

/// Runs `work` while extending the message's invisibility every half
/// timeout, in the same task: no task of its own per message to spawn and
/// abort. The extensions stop when `work` ends, or when the queue no longer
/// knows the receipt (received again elsewhere, or settled); a queue that
/// cannot be reached is asked again every [`PUT_BACK_RETRY_FIRST`] until
/// the lease would have run out, so a short store outage does not hand
/// the message to another consumer.
pub(super) async fn kept_visible<F: std::future::Future>(
    context: &Context,
    message: &ReceivedMessage,
    work: F,
) -> F::Output {
    let visibility = Duration::from_secs(context.settings.visibility_timeout_secs);
    let extend = async {
        let mut leased_until = Instant::now() + visibility;
        let mut next = visibility / 2;
        loop {
            tokio::time::sleep(next).await;
            let asked = Instant::now();
            let extended = context
                .delivery
                .queue
                .change_visibility_batch(context.lane, &[(message.receipt.clone(), visibility)])
                .await;
            match extended {
                Ok(results) if results.iter().all(Result::is_ok) => {
                    debug!(receipt = %message.receipt, "Visibility extended.");
                    leased_until = asked + visibility;
                    next = visibility / 2;
                }
                Err(err) if Instant::now() + PUT_BACK_RETRY_FIRST < leased_until => {
                    debug!(receipt = %message.receipt, error = %err, "Could not extend visibility yet; trying again.");
                    next = PUT_BACK_RETRY_FIRST;
                }
                _ => {
                    warn!(receipt = %message.receipt, "Could not extend visibility; the message may be delivered again.");
                    return;
                }
            }
        }
    };
    tokio::pin!(work);
    tokio::select! {
        biased;
        done = &mut work => return done,
        () = extend => {}
    }
    work.await
}
