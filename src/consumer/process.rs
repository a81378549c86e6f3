//! Processing one message and acting on the outcome.
//!
//! | outcome | queue | status |
//! |---|---|---|
//! | sent | delete (batched) | `sent`, `sent_at`, provider id, attempts + 1 |
//! | already sent (redelivery) | delete, no second send | unchanged |
//! | `rejected` (SQS send answered 503, arrived anyway) | delete, no send | unchanged |
//! | tenant paused/disabled | defer `hold_delay_secs`, no attempt | unchanged |
//! | another copy being sent by this process | defer `tenant_cap_delay_secs`, no attempt | unchanged |
//! | the store could not be read or the claim written | defer (1 s, doubling while delivery writes fail) | unchanged |
//! | provider throttled | defer its Retry-After (or backoff), no attempt | `retrying` |
//! | transient | defer full-jitter backoff | `retrying`, attempts + 1 |
//! | permanent, or attempts exhausted | move to DLQ | `dead_lettered`, `last_error` |
//!
//! Every queue action that fails leaves the message where it is: it comes
//! back after its visibility timeout (at-least-once), and the status check
//! before sending keeps a redelivered, already-sent message from going out
//! twice.

use std::time::{Duration, Instant};

use rand::Rng;
use tokio::sync::{mpsc, watch};
use tracing::{Instrument, Span, debug, info, warn};

use super::{Delivery, GatedProvider};
use crate::config::LaneSettings;
use crate::limits::breaker::Change;
use crate::limits::gate::Choice;
use crate::message::DeliveryPayload;
use crate::metrics as names;
use crate::model::{Lane, MessageStatus, TenantStatus};
use crate::providers::{Delivered, ProviderError};
use crate::queue::{LaneQueue, RECEIVED_TOO_OFTEN, ReceivedMessage};
use crate::store::Called;
use crate::store::SendCheck;
use crate::store::suppressions;

mod content;
mod lease;
mod simulated;

use content::{read_files, render_template};
pub(super) use lease::renew_if_parked_long;
use lease::{defer, kept_visible, put_back};
use simulated::simulate_receipt;

/// What a message's processing task needs.
pub(super) struct Context {
    pub lane: Lane,
    pub settings: LaneSettings,
    pub delivery: Delivery,
    /// Receipts to delete, batched by [`run_deleter`].
    pub deletes: mpsc::Sender<String>,
    /// Turns true at shutdown: a message still waiting for a provider token
    /// goes back to the queue instead of holding shutdown up.
    pub shutdown: watch::Receiver<bool>,
    /// The lane's provider-call slots (`concurrency`), taken once the
    /// provider token is there.
    pub workers: std::sync::Arc<tokio::sync::Semaphore>,
}

/// Tells the provider's circuit breaker how a call went, and pauses its gate
/// when the breaker opens. A 429 leaves it as it is (its Retry-After
/// pauses the gate by itself); a permanent refusal is an answer the
/// provider meant, so it counts as the provider working.
///
/// The outcome also counts in the provider's health in its pool: a
/// transient failure as a failure, an answer it meant (sent, or a
/// permanent refusal) as a call that worked, with its time.
fn note_provider_health(
    gated: &GatedProvider,
    member: usize,
    outcome: &Result<Delivered, ProviderError>,
    took: Duration,
) {
    let pool = &gated.members[member];
    let provider = pool.name;
    let change = match outcome {
        Ok(_) | Err(ProviderError::Permanent(_)) => pool.breaker.succeeded(),
        Err(ProviderError::Transient(_)) => pool.breaker.failed(),
        Err(ProviderError::Throttled { .. }) => return,
    };
    let failed = matches!(outcome, Err(ProviderError::Transient(_)));
    if gated.gate.record_outcome(member, failed, took) {
        metrics::counter!(names::PROVIDER_DOWNS_TOTAL, "provider" => provider).increment(1);
        warn!(
            provider,
            "Provider's recent calls failed or were slow past providers.health; it takes no new messages for a while while its pool has others."
        );
    }
    match change {
        Change::None => {}
        Change::Opened { open_for, failures } => {
            gated.gate.pause_member(member, open_for);
            metrics::counter!(names::BREAKER_OPENS_TOTAL, "provider" => provider).increment(1);
            warn!(
                provider,
                failures,
                open_secs = open_for.as_secs_f64(),
                "Provider failed calls in a row; its circuit breaker opens and nothing calls it for a while."
            );
        }
        Change::Closed { opened } => {
            info!(
                provider,
                opened, "Provider answers again; its circuit breaker closes."
            );
        }
    }
}

/// Counts a delivery write's outcome in the streak that pauses the pollers
/// (see [`super::Delivery::store_trouble`]).
fn note_store_write(context: &Context, outcome: Result<(), &anyhow::Error>) {
    let trouble = &context.delivery.store_trouble;
    match outcome {
        Ok(()) => {
            if trouble.succeeded() > 0 {
                info!(lane = %context.lane, "Delivery writes succeed again; polling resumes.");
            }
        }
        Err(err) => {
            trouble.failed_because(&crate::store::WriteFailed(format!("{err:#}").into()));
        }
    }
}

/// Backoff before retry `attempt` (1-based): a uniformly random delay
/// between zero and `min(max, base × 2^(attempt-1))` ("full jitter").
pub fn backoff(base: Duration, max: Duration, attempt: u32) -> Duration {
    let exponent = attempt.saturating_sub(1).min(30);
    let ceiling = base.saturating_mul(1u32 << exponent).min(max);
    let millis = ceiling.as_millis() as u64;
    Duration::from_millis(if millis == 0 {
        0
    } else {
        rand::rng().random_range(0..=millis)
    })
}

/// What is known about a message being dead-lettered, for its log line:
/// its payload once it could be read, the provider once one was called, and
/// the provider's whole story of the last failure (the tenant sees only its
/// classified reason).
#[derive(Clone, Copy)]
struct Known<'a> {
    payload: Option<&'a DeliveryPayload>,
    provider: Option<&'static str>,
    detail: Option<&'a str>,
}

impl<'a> Known<'a> {
    /// A message whose payload was read, before any provider call.
    fn unsent(payload: &'a DeliveryPayload) -> Self {
        Known {
            payload: Some(payload),
            provider: None,
            detail: None,
        }
    }
}

async fn dead_letter(
    context: &Context,
    message: &ReceivedMessage,
    known: Known<'_>,
    error: &str,
    counted: bool,
) {
    let channel = message.channel.as_str();
    let attempts = match context
        .delivery
        .status
        .failure(
            &message.message_id,
            MessageStatus::DeadLettered,
            &context.delivery.loggable(error),
            counted,
        )
        .await
    {
        Ok(attempts) => attempts,
        Err(err) => {
            // Not moved without its status (a dead letter that says
            // `queued` looks alive forever, issue 67): it returns after its
            // visibility timeout, and a queue that dead-letters by receive
            // count writes the status with that move.
            warn!(message_id = %message.message_id, error = %err, "Could not record dead-lettering; the message stays on its lane and returns after its visibility timeout.");
            return;
        }
    };
    match context
        .delivery
        .queue
        .dead_letter(context.lane, message)
        .await
    {
        Ok(()) => {
            metrics::counter!(names::DEAD_LETTERED_TOTAL, "lane" => context.lane.as_str(), "channel" => channel).increment(1);
            let to = known
                .payload
                .filter(|_| context.delivery.log_addresses)
                .map(|payload| payload.to.as_str());
            info!(
                message_id = %message.message_id,
                tenant = %message.tenant_id,
                channel,
                lane = context.lane.as_str(),
                priority = message.priority.as_str(),
                provider = known.provider,
                attempts,
                receive_count = message.receive_count,
                reason = %context.delivery.loggable(error),
                detail = known.detail.map(|detail| context.delivery.loggable(detail).into_owned()),
                to,
                "Message dead-lettered."
            );
        }
        Err(err) => {
            warn!(message_id = %message.message_id, error = %err, "Could not move message to the DLQ; it returns after its visibility timeout.")
        }
    }
}

/// A copy this instance could not claim: deleted if the message was sent
/// (or refused at accept), otherwise put back until whoever is sending it
/// has finished.
async fn settle_unclaimed(context: &Context, message: &ReceivedMessage, id: &str) {
    match context.delivery.db.message(id).await {
        Ok(Some(record)) if record.status.is_settled() => {
            info!(message_id = %id, status = %record.status.as_str(), "Another copy of the message was settled elsewhere; deleting this one without sending.");
            let _ = context.deletes.send(message.receipt.clone()).await;
        }
        Ok(_) => {
            let delay = Duration::from_secs(context.delivery.consumers.tenant_cap_delay_secs);
            defer(context, message, delay, "duplicate").await;
        }
        Err(err) => {
            warn!(message_id = %id, error = %err, "Could not read message status; leaving it for redelivery.");
        }
    }
}

/// The recipient of a queue entry and its world, read without the rest
/// of its payload.
#[derive(serde::Deserialize)]
struct Recipient<'a> {
    #[serde(borrow)]
    to: std::borrow::Cow<'a, str>,
    #[serde(default)]
    test: bool,
}

/// Reads, in one store call for a whole receive, what [`deliver`] checks
/// before a message takes a provider token: its status (where the receive
/// did not read it) and whether its address is suppressed. Without this,
/// each message would read both by itself: two round trips per message on
/// PostgreSQL. If the read fails, the messages are left as they are and
/// each reads for itself. What it finds is a first answer: the claim
/// before the provider call is still what decides.
pub(super) async fn look_up(delivery: &Delivery, messages: &mut [ReceivedMessage]) {
    let checks: Vec<SendCheck> = messages
        .iter_mut()
        .map(|message| {
            let recipient = serde_json::from_str::<Recipient>(&message.body).ok();
            message.test = recipient.as_ref().is_some_and(|recipient| recipient.test);
            SendCheck {
                id: message.message_id.clone(),
                tenant_id: message.tenant_id.clone(),
                address: recipient
                    .and_then(|recipient| suppressions::normalize(&recipient.to))
                    .map(|(_, address)| address),
            }
        })
        .collect();
    match delivery.status.before_send(checks).await {
        Ok(found) => {
            for (message, found) in messages.iter_mut().zip(found) {
                if message.status_at_receive.is_none() {
                    message.status_at_receive = found.status;
                }
                message.suppressed_at_receive = Some(found.suppressed);
            }
        }
        Err(err) => {
            debug!(error = %format!("{err:#}"), count = messages.len(), "Could not look the received messages up at once; each reads for itself.");
        }
    }
}

pub(super) async fn deliver(context: &Context, message: ReceivedMessage) {
    let payload: DeliveryPayload = match serde_json::from_str(&message.body) {
        Ok(payload) => payload,
        Err(err) => {
            let reason = format!("queue entry is not a readable message: {err}");
            let known = Known {
                payload: None,
                provider: None,
                detail: None,
            };
            return dead_letter(context, &message, known, &reason, false).await;
        }
    };
    let span = process_span(context, &message, &payload);
    deliver_payload(context, message, payload)
        .instrument(span)
        .await
}

/// The consumer span of one delivery attempt (OpenTelemetry messaging
/// conventions), continuing the trace the message was queued in.
fn process_span(context: &Context, message: &ReceivedMessage, payload: &DeliveryPayload) -> Span {
    if !crate::telemetry::enabled() {
        return Span::none();
    }
    let (system, destination) = context
        .delivery
        .queue
        .trace_destination(context.lane, payload.priority);
    let span = crate::telemetry::span!(
        "process",
        otel.name = %format!("process {destination}"),
        otel.kind = "consumer",
        messaging.system = system,
        messaging.operation.type = "process",
        messaging.operation.name = "process",
        messaging.destination.name = destination.as_str(),
        messaging.message.id = payload.id.as_str(),
        fairlane.tenant_id = payload.tenant_id.as_str(),
        fairlane.channel = payload.channel.as_str(),
        fairlane.priority = payload.priority.as_str(),
        fairlane.receive_count = message.receive_count,
    );
    crate::telemetry::parent_from(&span, payload.traceparent.as_deref());
    span
}

async fn deliver_payload(
    context: &Context,
    message: ReceivedMessage,
    mut payload: DeliveryPayload,
) {
    let Some(cleared) = preflight(context, &message, &payload).await else {
        return;
    };
    payload.retrying = cleared.retrying;
    if payload.template.is_some() && !render_template(context, &message, &mut payload).await {
        return;
    }
    if !payload.attachments.is_empty() && !read_files(context, &message, &mut payload).await {
        return;
    }
    let called = kept_visible(context, &message, async {
        let turn = take_turn(context, &message, &payload, cleared.retrying).await?;
        let gated = turn.gated;
        let (outcome, done) = call_provider(&payload, turn).await;
        Ok::<_, NoTurn>((gated, outcome, done))
    })
    .await;
    match called {
        Ok((gated, outcome, done)) => {
            settle(context, message, &payload, gated, outcome, done).await
        }
        Err(no_turn) => no_turn.settle(context, &message, &payload.id).await,
    }
}

/// What [`preflight`] found: the message may take its turn at the provider.
struct Cleared {
    /// An earlier attempt failed (the status was `retrying`).
    retrying: bool,
    /// Keeps another copy received meanwhile from being sent at once.
    _delivering: super::DeliveringGuard,
}

/// What [`take_turn`] holds for the call: the provider's pool member whose
/// token it got and a worker slot.
struct Turn<'a> {
    gated: &'a GatedProvider,
    member: usize,
    worker: tokio::sync::OwnedSemaphorePermit,
    /// How long the call waited for its token.
    waited: Duration,
    /// When the token was granted: a fleet-wide grant goes stale.
    granted_at: tokio::time::Instant,
    priority: crate::model::Priority,
    tenant: String,
}

/// Which pool member answered a call, how long it took, and how long it
/// waited for its token before.
struct CallDone {
    provider: &'static str,
    member: usize,
    took: Duration,
    waited: Duration,
}

/// The look-up before a provider call: the tenant may send, no other
/// copy of the message is being sent here, its status still waits for a
/// send and its address is not suppressed. Anything else is acted on here
/// (held, deferred, deleted, dead-lettered or suppressed) and gives `None`.
async fn preflight(
    context: &Context,
    message: &ReceivedMessage,
    payload: &DeliveryPayload,
) -> Option<Cleared> {
    let unsent = Known {
        payload: Some(payload),
        provider: None,
        detail: None,
    };
    // A second copy of a message another task is sending right now comes
    // back later, when the status check below settles it.
    let Some(delivering) = context.delivery.delivering.claim(&payload.id) else {
        let delay = Duration::from_secs(context.delivery.consumers.tenant_cap_delay_secs);
        defer(context, message, delay, "duplicate").await;
        return None;
    };
    let retrying = settle_if_done(context, message, payload).await?;
    // Received more often than the lane allows: only SQS hands such a
    // message out (its redrive policy moves one a few receives later, see
    // `queue::sqs::lanes::REDRIVE_MARGIN`); the embedded queue and
    // PostgreSQL lanes dead-letter it in the receive. Its status is written
    // first, so a dead letter never says `queued` (issue 67).
    if message.receive_count > context.settings.max_receive_count {
        dead_letter(context, message, unsent, RECEIVED_TOO_OFTEN, false).await;
        return None;
    }

    hold_if_not_active(context, message, unsent).await?;
    suppress_if_listed(context, message, payload).await?;
    Some(Cleared {
        retrying,
        _delivering: delivering,
    })
}

/// [`preflight`]'s look at the message's status: `Some(retrying)` while
/// it waits for a send; a sent, rejected, cancelled or suppressed copy is
/// deleted, and one whose status cannot be read is deferred (`None`).
async fn settle_if_done(
    context: &Context,
    message: &ReceivedMessage,
    payload: &DeliveryPayload,
) -> Option<bool> {
    // Idempotent consumer: a redelivered copy of a sent message is deleted.
    // The status read at receive (in the receive's own transaction on the
    // embedded queue, by `look_up` on SQS) is enough while nobody had
    // started sending the message. Should another copy have been sent
    // since (SQS may hold two), this copy's claim below fails and it is
    // settled then. Any other status is read again now, after the claim
    // above.
    let status = match message.status_at_receive {
        Some(
            status @ (MessageStatus::Queued | MessageStatus::Retrying | MessageStatus::Scheduled),
        ) => Ok(Some(status)),
        _ => context
            .delivery
            .db
            .message(&payload.id)
            .await
            .map(|record| record.map(|record| record.status)),
    };
    match status {
        Ok(Some(status)) if status == MessageStatus::Sent || status.is_receipt() => {
            info!(message_id = %payload.id, "Redelivered message was already sent; deleting without sending again.");
            let _ = context.deletes.send(message.receipt.clone()).await;
            None
        }
        Ok(Some(MessageStatus::Rejected)) => {
            info!(message_id = %payload.id, "Message was answered 503 when sent (its queue send timed out but arrived); deleting without sending.");
            let _ = context.deletes.send(message.receipt.clone()).await;
            None
        }
        Ok(Some(status @ (MessageStatus::Cancelled | MessageStatus::Suppressed))) => {
            info!(message_id = %payload.id, status = status.as_str(), "Message ended without sending; deleting it.");
            let _ = context.deletes.send(message.receipt.clone()).await;
            None
        }
        Ok(status) => Some(status == Some(MessageStatus::Retrying)),
        Err(err) => {
            warn!(message_id = %payload.id, error = %format!("{err:#}"), "Could not read message status; trying again soon.");
            let pause = context.delivery.store_trouble.retry_after();
            defer(context, message, pause, "store").await;
            None
        }
    }
}

/// [`preflight`]'s look at the tenant: a message of a deleted tenant is
/// dead-lettered, one of a paused or disabled tenant held (`None`).
async fn hold_if_not_active(
    context: &Context,
    message: &ReceivedMessage,
    unsent: Known<'_>,
) -> Option<()> {
    // The status comes before the tenant's pause: a held copy of a message
    // that was cancelled (or sent, or erased by retention) is deleted on
    // sight rather than put back for another `hold_delay_secs` with its
    // content (issue 46: on SQS a held copy never aged out).
    let Some(tenant) = context
        .delivery
        .registry
        .tenant_fresh(&message.tenant_id)
        .await
    else {
        dead_letter(context, message, unsent, "tenant was deleted", false).await;
        return None;
    };
    match tenant.status {
        TenantStatus::Active => Some(()),
        TenantStatus::Paused | TenantStatus::Disabled => {
            let delay = Duration::from_secs(context.delivery.consumers.hold_delay_secs);
            let reason = if tenant.status == TenantStatus::Paused {
                "paused"
            } else {
                "disabled"
            };
            defer(context, message, delay, reason).await;
            None
        }
    }
}

/// [`preflight`]'s look at the suppression list: a listed address ends
/// the message, and a list that cannot be read defers it (`None`).
async fn suppress_if_listed(
    context: &Context,
    message: &ReceivedMessage,
    payload: &DeliveryPayload,
) -> Option<()> {
    // An address on the tenant's suppression list ends the message here,
    // before it takes a provider token.
    let suppressed = match message.suppressed_at_receive {
        Some(known) => Ok(known),
        None => match suppressions::normalize(&payload.to) {
            Some((_, address)) => context
                .delivery
                .db
                .is_suppressed(&message.tenant_id, &address)
                .await
                .map_err(anyhow::Error::from),
            None => Ok(false),
        },
    };
    match suppressed {
        Ok(false) => Some(()),
        Ok(true) => {
            suppress(context, message, payload).await;
            None
        }
        Err(err) => {
            warn!(message_id = %payload.id, error = %format!("{err:#}"), "Could not read the suppression list; trying again soon.");
            let pause = context.delivery.store_trouble.retry_after();
            defer(context, message, pause, "store").await;
            None
        }
    }
}

/// The message's turn at the provider: a token from the gate's line (by
/// priority and tenant turn, no worker held meanwhile), then a worker, then
/// the claim that makes this instance the one to call. [`NoTurn`] when the
/// turn ended without a call, for the caller to settle once the message's
/// visibility is no longer extended.
async fn take_turn<'a>(
    context: &'a Context,
    message: &ReceivedMessage,
    payload: &DeliveryPayload,
    retrying: bool,
) -> Result<Turn<'a>, NoTurn> {
    let lane = context.lane;
    let channel = payload.channel.as_str();
    let gated = context.delivery.provider_for(payload);
    let choice = match retrying {
        true if gated.members.len() > 1 => choose_after_failure(context, gated, &payload.id).await,
        _ => Choice::Any,
    };
    let mut shutdown = context.shutdown.clone();
    // The token first, in the gate's line by priority and tenant turn, with
    // no worker held meanwhile; then a worker for the call itself.
    let token_span = crate::telemetry::span!("wait for a provider token");
    let token_and_worker = async {
        let _waiting = names::GaugeHold::new(
            metrics::gauge!(names::MESSAGES_WAITING, "lane" => lane.as_str(), "priority" => payload.priority.as_str(), "stage" => "token"),
        );
        let (waited, member) = gated
            .gate
            .acquire_from(payload.priority, &message.tenant_id, choice)
            .await;
        let granted_at = tokio::time::Instant::now();
        let worker = context
            .workers
            .clone()
            .acquire_owned()
            .await
            .expect("worker semaphore is never closed");
        (waited, member, worker, granted_at)
    }
    .instrument(token_span);
    let (waited, member, worker, granted_at) = tokio::select! {
        got = token_and_worker => got,
        () = async { drop(shutdown.wait_for(|stop| *stop).await) } => return Err(NoTurn::ShuttingDown),
    };
    metrics::histogram!(names::GATE_WAIT_SECONDS, "channel" => channel, "priority" => payload.priority.as_str())
        .record(waited.as_secs_f64());
    // Of several instances holding a copy, only the one whose claim takes
    // the message calls the provider.
    let claimed = claim(context, &payload.id)
        .instrument(crate::telemetry::span!("claim"))
        .await;
    note_store_write(context, claimed.as_ref().map(|_| ()));
    match claimed {
        Ok(true) => {}
        Ok(false) => return Err(NoTurn::Unclaimed),
        Err(err) => {
            warn!(message_id = %payload.id, error = %format!("{err:#}"), "Could not claim the message for sending; putting it back.");
            return Err(NoTurn::ClaimFailed);
        }
    }
    Ok(Turn {
        gated,
        member,
        worker,
        waited,
        granted_at,
        priority: payload.priority,
        tenant: message.tenant_id.clone(),
    })
}

/// Why a message's turn ended without a provider call.
enum NoTurn {
    /// The consumer is stopping: the message goes back at once.
    ShuttingDown,
    /// Another copy's claim took the message.
    Unclaimed,
    /// The store could not write the claim.
    ClaimFailed,
}

impl NoTurn {
    async fn settle(self, context: &Context, message: &ReceivedMessage, id: &str) {
        match self {
            NoTurn::ShuttingDown => {
                let queue = context.delivery.queue.as_ref();
                return_now(queue, context.lane, std::slice::from_ref(message)).await;
            }
            NoTurn::Unclaimed => settle_unclaimed(context, message, id).await,
            // Back soon rather than after the visibility timeout where the
            // queue can still take the change (SQS while the store is away);
            // on the embedded queue this write fails too and the timeout
            // brings it back.
            NoTurn::ClaimFailed => {
                let pause = context.delivery.store_trouble.retry_after();
                defer(context, message, pause, "store").await;
            }
        }
    }
}

/// The provider call itself: spaced at the gate's pace, traced and timed,
/// its outcome counted in the provider's health and breaker. The worker is
/// given back as soon as the provider answers.
async fn call_provider(
    payload: &DeliveryPayload,
    turn: Turn<'_>,
) -> (Result<Delivered, ProviderError>, CallDone) {
    // Spaced again at the call itself: the claim's write may have held a
    // group of granted messages up (see ProviderGate::pace_call).
    turn.gated
        .gate
        .pace_call_of(turn.member, turn.granted_at, turn.priority, &turn.tenant)
        .await;
    let pool = &turn.gated.members[turn.member];
    let call_span = crate::telemetry::span!(
        "provider call",
        otel.name = %format!("send {}", pool.name),
        otel.kind = "client",
        fairlane.provider = pool.name,
        fairlane.message.id = payload.id.as_str(),
    );
    let started = Instant::now();
    let outcome = pool
        .provider
        .send(payload)
        .instrument(call_span.clone())
        .await;
    drop(turn.worker);
    let outcome_label = match &outcome {
        Ok(_) => "sent",
        Err(ProviderError::Permanent(_)) => "permanent",
        Err(ProviderError::Transient(_)) => "transient",
        Err(ProviderError::Throttled { .. }) => "throttled",
    };
    crate::telemetry::attribute(&call_span, "fairlane.outcome", outcome_label);
    if outcome.is_err() {
        // The label only: a provider's error text may quote the address.
        crate::telemetry::failed(&call_span, outcome_label);
    }
    drop(call_span);
    let call_time = started.elapsed();
    metrics::histogram!(names::PROVIDER_CALL_SECONDS, "provider" => pool.name, "outcome" => outcome_label)
        .record(call_time.as_secs_f64());
    note_provider_health(turn.gated, turn.member, &outcome, call_time);

    (
        outcome,
        CallDone {
            provider: pool.name,
            member: turn.member,
            took: call_time,
            waited: turn.waited,
        },
    )
}

/// Hands the call's outcome on: `sent` recorded and the copy deleted; a
/// throttle or a transient failure recorded and the message deferred; a
/// permanent failure, or the last attempt, dead-lettered.
async fn settle(
    context: &Context,
    message: ReceivedMessage,
    payload: &DeliveryPayload,
    gated: &GatedProvider,
    outcome: Result<Delivered, ProviderError>,
    done: CallDone,
) {
    let called = Known {
        payload: Some(payload),
        provider: Some(done.provider),
        detail: None,
    };
    match outcome {
        Ok(delivered) => settle_sent(context, &message, payload, &delivered, &done).await,
        Err(ProviderError::Throttled {
            retry_after,
            failure,
        }) => {
            let at = (gated, done.member);
            settle_throttled(context, &message, payload, at, retry_after, &failure).await;
        }
        Err(error @ ProviderError::Transient(_)) => {
            settle_transient(context, &message, (payload, done.provider), &error).await;
        }
        Err(ProviderError::Permanent(failure)) => {
            let known = Known {
                detail: Some(&failure.detail),
                ..called
            };
            dead_letter(context, &message, known, &failure.reason, true).await;
        }
    }
}

/// The provider took the message: `sent` is recorded, then the copy
/// deleted (a test message's simulated receipt follows).
async fn settle_sent(
    context: &Context,
    message: &ReceivedMessage,
    payload: &DeliveryPayload,
    delivered: &Delivered,
    done: &CallDone,
) {
    let (lane, channel) = (context.lane, payload.channel.as_str());
    let pool_name = done.provider;
    let call_time = done.took;
    let recorded = context
        .delivery
        .status
        .sent_after_wait(
            &payload.id,
            &delivered.provider_message_id,
            Some(pool_name),
            Some(i64::try_from(done.waited.as_millis()).unwrap_or(i64::MAX)),
        )
        .await;
    note_store_write(context, recorded.as_ref().map(|_| ()));
    if let Err(err) = recorded {
        // Leave the queue entry: its redelivery finds no `sent` and
        // sends again (at-least-once) rather than losing the message.
        warn!(message_id = %payload.id, error = %err, "Sent, but could not record it.");
        return;
    }
    let _ = context.deletes.send(message.receipt.clone()).await;
    if payload.test {
        simulate_receipt(context, payload, &delivered.provider_message_id);
    }
    metrics::counter!(names::DELIVERED_TOTAL, "lane" => lane.as_str(), "channel" => channel)
        .increment(1);
    let to = context
        .delivery
        .log_addresses
        .then_some(payload.to.as_str());
    info!(
        message_id = %payload.id,
        tenant = %payload.tenant_id,
        channel,
        lane = lane.as_str(),
        priority = payload.priority.as_str(),
        provider = pool_name,
        provider_message_id = %delivered.provider_message_id,
        receive_count = message.receive_count,
        queued_ms = (crate::model::now_ms() - message.enqueued_at_ms).max(0),
        call_ms = call_time.as_millis() as u64,
        to,
        "Message sent."
    );
}

/// A 429: the attempt is not counted, the provider's gate pauses for its
/// Retry-After, and the message waits that long (or a first backoff).
async fn settle_throttled(
    context: &Context,
    message: &ReceivedMessage,
    payload: &DeliveryPayload,
    (gated, member): (&GatedProvider, usize),
    retry_after: Option<Duration>,
    failure: &crate::providers::Failure,
) {
    let pool = &gated.members[member];
    let retry = &context.delivery.retry;
    // A 429 refused the message: another provider may take it.
    let _ = context
        .delivery
        .status
        .failure_of(
            &payload.id,
            MessageStatus::Retrying,
            &format!(
                "throttled by provider: {}",
                context.delivery.loggable(&failure.reason)
            ),
            false,
            Some(Called {
                provider: pool.name,
                pinned: false,
            }),
        )
        .await;
    if let Some(pause) = retry_after.filter(|pause| !pause.is_zero()) {
        // Every message of this provider waits, not only this one.
        // The provider bounded the pause (MAX_PROVIDER_PAUSE).
        gated.gate.pause_member(member, pause);
        metrics::counter!(names::PROVIDER_PAUSES_TOTAL, "provider" => pool.name).increment(1);
        warn!(
            provider = pool.name,
            pause_secs = pause.as_secs_f64(),
            detail = %context.delivery.loggable(&failure.detail),
            "Provider answered 429 with Retry-After; its gate pauses every send for that long."
        );
    }
    let delay = retry_after.unwrap_or_else(|| {
        backoff(
            Duration::from_millis(retry.base_delay_ms),
            Duration::from_secs(retry.max_delay_secs),
            1,
        )
    });
    defer(context, message, delay, "throttled").await;
}

/// A transient failure: counted as an attempt, then a full-jitter backoff,
/// or the dead-letter queue after the last attempt.
async fn settle_transient(
    context: &Context,
    message: &ReceivedMessage,
    (payload, provider): (&DeliveryPayload, &'static str),
    error: &ProviderError,
) {
    let (lane, channel) = (context.lane, payload.channel.as_str());
    let called = Known {
        payload: Some(payload),
        provider: Some(provider),
        detail: None,
    };
    let retry = &context.delivery.retry;
    // The next attempt goes to another provider of the pool, unless
    // this call may have reached the provider (a timeout): then
    // only the same one may try again.
    let pinned = error.may_have_arrived();
    let failure = error.failure().clone();
    let tried = Some(Called { provider, pinned });
    let recorded = context
        .delivery
        .status
        .failure_of(
            &payload.id,
            MessageStatus::Retrying,
            &context.delivery.loggable(&failure.reason),
            true,
            tried,
        )
        .await;
    let attempts = match recorded {
        Ok(attempts) => attempts,
        Err(err) => {
            // Neither retried nor dead-lettered on an attempt the store
            // did not count: back in the lane until the store writes
            // again, its receive given back (the claim before the next
            // call needs the store too).
            warn!(message_id = %payload.id, error = %format!("{err:#}"), "Could not record the failed call; trying again once the store writes.");
            let pause = context.delivery.store_trouble.retry_after();
            return put_back(context, message, pause, "store").await;
        }
    };
    if attempts >= retry.max_attempts {
        let reason = format!("gave up after {attempts} attempts: {}", failure.reason);
        let known = Known {
            detail: Some(&failure.detail),
            ..called
        };
        return dead_letter(context, message, known, &reason, false).await;
    }
    let delay = backoff(
        Duration::from_millis(retry.base_delay_ms),
        Duration::from_secs(retry.max_delay_secs),
        attempts,
    );
    metrics::counter!(names::RETRIED_TOTAL, "lane" => lane.as_str(), "channel" => channel)
        .increment(1);
    info!(
        message_id = %payload.id,
        tenant = %payload.tenant_id,
        channel,
        lane = lane.as_str(),
        provider,
        pinned,
        attempts,
        delay_ms = delay.as_millis() as u64,
        error = %context.delivery.loggable(&failure.reason),
        detail = %context.delivery.loggable(&failure.detail),
        "Transient failure; retrying later."
    );
    put_back(context, message, delay, "transient").await;
}

/// Which providers of the pool a retried message may go to: not the one
/// whose last call failed (failover), or only that one when the call may
/// have reached it (a timeout: a second provider could send it twice).
/// A provider no longer configured, or a row that cannot be read, leaves
/// the choice to routing.
async fn choose_after_failure(context: &Context, gated: &GatedProvider, id: &str) -> Choice {
    match context.delivery.db.last_provider(id).await {
        Ok(Some((name, pinned))) => match gated.position(&name) {
            Some(member) if pinned => Choice::Only(member),
            Some(member) => Choice::Avoid(member),
            None => Choice::Any,
        },
        Ok(None) => Choice::Any,
        Err(err) => {
            warn!(message_id = %id, error = %format!("{err:#}"), "Could not read which provider the message last went to; routing chooses.");
            Choice::Any
        }
    }
}

/// Takes the message for this instance (see [`Writer::claim`]). A
/// claim older than the visibility timeout belongs to an instance that
/// died mid-call.
///
/// [`Writer::claim`]: crate::store::Writer::claim
async fn claim(context: &Context, id: &str) -> anyhow::Result<bool> {
    let stale_before = crate::model::now_ms()
        - Duration::from_secs(context.settings.visibility_timeout_secs).as_millis() as i64;
    context.delivery.status.claim(id, stale_before).await
}

/// Ends a message whose address is suppressed: claimed like a send (so a
/// cancel or another instance's copy is ordered with it), marked
/// `suppressed`, and deleted from the queue without a provider call.
async fn suppress(context: &Context, message: &ReceivedMessage, payload: &DeliveryPayload) {
    match claim(context, &payload.id).await {
        Ok(true) => {}
        Ok(false) => return settle_unclaimed(context, message, &payload.id).await,
        Err(err) => {
            warn!(message_id = %payload.id, error = %format!("{err:#}"), "Could not claim a suppressed message; leaving it for redelivery.");
            return;
        }
    }
    if let Err(err) = context
        .delivery
        .status
        .failure(
            &payload.id,
            MessageStatus::Suppressed,
            "the address is on the tenant's suppression list",
            false,
        )
        .await
    {
        warn!(message_id = %payload.id, error = %format!("{err:#}"), "Could not record a suppressed message; leaving it for redelivery.");
        return;
    }
    let _ = context.deletes.send(message.receipt.clone()).await;
    metrics::counter!(names::SUPPRESSED_TOTAL, "channel" => payload.channel.as_str()).increment(1);
    info!(message_id = %payload.id, tenant = %payload.tenant_id, "Message suppressed: its address is on the tenant's suppression list.");
}

/// Returns messages to the queue at once (visibility 0), ten per call.
pub(super) async fn return_now(queue: &dyn LaneQueue, lane: Lane, messages: &[ReceivedMessage]) {
    for chunk in messages.chunks(queue.max_batch()) {
        let changes: Vec<(String, Duration)> = chunk
            .iter()
            .map(|m| (m.receipt.clone(), Duration::ZERO))
            .collect();
        if let Err(err) = queue.change_visibility_batch(lane, &changes).await {
            warn!(lane = %lane, error = %err, "Could not return buffered messages; they return after their visibility timeout.");
        }
    }
}

/// Deletes receipts in batches of up to ten, flushing after a few
/// milliseconds so a lone delete is not held back; ends when every sender
/// is gone and the last batch is flushed.
pub(super) async fn run_deleter(
    queue: std::sync::Arc<dyn LaneQueue>,
    lane: Lane,
    mut receipts: mpsc::Receiver<String>,
) {
    let flush_after = queue.batch_window();
    let max_batch = queue.max_batch();
    let mut batch = Vec::with_capacity(max_batch);
    loop {
        if batch.is_empty() {
            match receipts.recv().await {
                Some(receipt) => batch.push(receipt),
                None => return,
            }
        }
        let deadline = tokio::time::sleep(flush_after);
        tokio::pin!(deadline);
        let mut closed = false;
        while batch.len() < max_batch {
            tokio::select! {
                receipt = receipts.recv() => match receipt {
                    Some(receipt) => batch.push(receipt),
                    None => { closed = true; break; }
                },
                _ = &mut deadline => break,
            }
        }
        match queue.delete_batch(lane, &batch).await {
            Ok(results) => {
                for (receipt, result) in batch.iter().zip(results) {
                    if let Err(reason) = result {
                        warn!(lane = %lane, %receipt, %reason, "Delete failed; the message may be redelivered (and then skipped as sent).");
                    }
                }
            }
            Err(err) => {
                warn!(lane = %lane, error = %err, count = batch.len(), "Delete batch failed; the messages may be redelivered (and then skipped as sent).")
            }
        }
        batch.clear();
        if closed {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_stays_under_the_growing_ceiling_and_the_cap() {
        let base = Duration::from_millis(100);
        let max = Duration::from_secs(1);
        for attempt in 1..=10 {
            let ceiling = (base * 2u32.pow(attempt - 1)).min(max);
            for _ in 0..50 {
                assert!(backoff(base, max, attempt) <= ceiling);
            }
        }
        // Full jitter spreads retries: not every draw is the ceiling.
        let draws: Vec<_> = (0..50).map(|_| backoff(base, max, 4)).collect();
        assert!(draws.iter().any(|d| *d < Duration::from_millis(700)));
    }
}
