//! The webhook dispatcher: finds due calls in `webhook_deliveries`, makes
//! them, and records the outcome.
//!
//! A pass looks for due calls when a delivery outcome has committed (at
//! most one such pass per 20 ms), when a call ends (its tenant may have
//! room again), and every `webhooks.poll_interval_ms` (retries that came
//! due, events written elsewhere: receipts, another instance).
//!
//! Each pass looks at the tenants with due calls and takes, for each, at
//! most the tenant's current limit less the calls it has in
//! flight, so a tenant whose endpoint is slow or dead holds only its own
//! slots and every other tenant's calls go out on the next pass. The limit
//! starts at `webhooks.concurrency_per_tenant` and grows by one with each
//! call answered 2xx within [`SLOW_CALL`] while the tenant has more due, up
//! to `webhooks.max_concurrency_per_tenant`; a failed or slow call halves
//! it (never below where it started), so a healthy endpoint keeps up with
//! its tenant's volume and a struggling one is not pressed harder. The
//! connections to each endpoint are kept alive between calls (hyper's
//! pool, see [`WebhookClient`]; each answer is read to its end, so its
//! connection can carry the next call), and an endpoint that offers HTTP/2
//! in its TLS handshake (ALPN) gets its calls as streams of one
//! connection. Delivered calls are removed in batches by one recorder
//! task, so a busy endpoint costs one write per batch rather than one per
//! call. On SQLite a whole pass (the
//! tenants with pending calls, and for each its due calls, their leases,
//! their data and its endpoint) is one piece of the store writer's group,
//! and the removals another, rather than taking the write lock from the
//! delivery path. A call is due only when no earlier
//! event of its message is still waiting, so each message's events arrive
//! in order. Taking a call moves its
//! `next_attempt_at` past the call's timeout (a lease): another instance
//! does not take it meanwhile, and if this one dies, the call is made
//! again once the lease ends, with the same `webhook-id`. An endpoint
//! whose calls fail [`PAUSE_AFTER_FAILURES`] times in a row is paused and
//! then tried one call at a time (see `Pause`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::StatusCode;
use hyper::header::HeaderValue;
use rand::Rng;
use tokio::sync::{Notify, Semaphore, mpsc, watch};
use tracing::{Instrument, debug, info, warn};

use super::client::{CallError, WebhookClient};
use super::endpoint::{EndpointPolicy, Refusal, refusal_in};
use super::sign::sign;
use crate::config::WebhookSettings;
use crate::message::MessageView;
use crate::metrics as names;
use crate::model::{ms_to_rfc3339, now_ms};
use crate::store::webhooks::{self, DueCall, Webhook};
use crate::store::{Db, PassRooms, TakenCalls, TenantRoom, Writer};

/// A 2xx answer slower than this counts against its endpoint: the tenant's
/// limit halves instead of growing.
pub const SLOW_CALL: Duration = Duration::from_secs(1);

/// Passes that a delivery outcome wakes are at least this far apart.
const MIN_PASS_GAP: Duration = Duration::from_millis(20);

/// Delivered calls removed per transaction, at most.
const RECORD_BATCH: usize = 256;

/// Failed calls in a row after which a tenant's endpoint is paused.
pub const PAUSE_AFTER_FAILURES: u32 = 5;

/// How often the gauges of due calls are sampled.
const SAMPLE_EVERY: Duration = Duration::from_secs(5);

/// Makes the webhook calls of every tenant; one per instance.
pub struct Dispatcher {
    db: Db,
    /// The store's hot-path writer: leases and removals ride in its groups.
    writer: Writer,
    settings: WebhookSettings,
    /// Checks each call's URL before it is made.
    policy: EndpointPolicy,
    /// Resolves names through [`EndpointPolicy`], follows no redirects and
    /// uses no proxy, so a call only reaches an address checked for it.
    client: WebhookClient,
    /// Event ids being called, by tenant.
    in_flight: Mutex<HashMap<String, HashSet<i64>>>,
    /// `webhooks.concurrency`: calls at once for all tenants.
    slots: Arc<Semaphore>,
    /// Woken when a call ends, so its tenant's next one need not wait for
    /// the poll interval.
    wake: Notify,
    /// Each tenant's current limit of calls at once (see the module
    /// documentation); absent: `concurrency_per_tenant`.
    limits: Mutex<HashMap<String, usize>>,
    /// Endpoints paused after failing calls in a row, by tenant (see
    /// [`Pause`]).
    pauses: Mutex<HashMap<String, Pause>>,
    /// Delivered calls (event id, tenant) for the recorder.
    delivered: mpsc::UnboundedSender<(i64, String)>,
    recorder: Mutex<Option<mpsc::UnboundedReceiver<(i64, String)>>>,
}

impl Dispatcher {
    pub fn new(db: Db, writer: Writer, settings: WebhookSettings) -> anyhow::Result<Arc<Self>> {
        let policy = EndpointPolicy::new(&settings);
        let client = WebhookClient::new(&settings, &policy)?;
        let (delivered, recorder) = mpsc::unbounded_channel();
        Ok(Arc::new(Dispatcher {
            limits: Mutex::default(),
            pauses: Mutex::default(),
            delivered,
            recorder: Mutex::new(Some(recorder)),
            slots: Arc::new(Semaphore::new(settings.concurrency)),
            db,
            writer,
            settings,
            policy,
            client,
            in_flight: Mutex::default(),
            wake: Notify::new(),
        }))
    }

    /// Passes every `poll_interval_ms` until shutdown, with the recorder
    /// of delivered calls beside it.
    pub async fn run(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let interval = Duration::from_millis(self.settings.poll_interval_ms);
        let recorder = self.recorder.lock().expect("recorder lock").take();
        if let Some(recorder) = recorder {
            tokio::spawn(record(self.writer.clone(), recorder, shutdown.clone()));
        }
        tokio::spawn(sample_due(self.db.clone(), shutdown.clone()));
        loop {
            let started = tokio::time::Instant::now();
            let outcome = tokio::select! {
                biased;
                _ = shutdown.wait_for(|stop| *stop) => return,
                _ = self.wake.notified() => false,
                _ = self.writer.changed().notified() => true,
                _ = tokio::time::sleep(interval) => false,
            };
            if outcome {
                // A delivery outcome may have written an event: a pass
                // soon, but no more than one per MIN_PASS_GAP on that
                // account, so a busy pipeline does not keep the dispatcher
                // reading. A call that ends meanwhile starts it at once.
                tokio::select! {
                    _ = tokio::time::sleep_until(started + MIN_PASS_GAP) => {}
                    _ = self.wake.notified() => {}
                }
            }
            if let Err(err) = self.pass().await {
                warn!(error = %format!("{err:#}"), "Could not look for due webhook calls; trying again shortly.");
            }
        }
    }

    /// One pass: takes and starts the due calls each tenant has room for.
    /// Each call that ends wakes the next pass at once, so a busy endpoint
    /// is kept at its limit of calls rather than that many per interval.
    pub async fn pass(self: &Arc<Self>) -> anyhow::Result<()> {
        let now = now_ms();
        let lease_until = now + self.settings.timeout_ms as i64 + 30_000;
        let taken = self
            .writer
            .take_pass(self.rooms(), now, lease_until)
            .await?;
        for calls in taken {
            self.start(calls).await?;
        }
        Ok(())
    }

    /// Each tenant's room as of now (see [`PassRooms`]): its limit (one
    /// while its endpoint is probed after a pause, none while paused) less
    /// its calls in flight.
    fn rooms(&self) -> PassRooms {
        let mut tenants: HashSet<String> = self.busy_tenants();
        tenants.extend(self.limits.lock().expect("limits lock").keys().cloned());
        tenants.extend(self.pauses.lock().expect("pauses lock").keys().cloned());
        let tenants = tenants
            .into_iter()
            .map(|tenant| {
                let busy = self.busy(&tenant);
                let limit = self.limit_now(&tenant);
                let room = limit.saturating_sub(busy.len());
                (tenant, TenantRoom { busy, room })
            })
            .collect();
        PassRooms {
            tenants,
            default_room: self.settings.concurrency_per_tenant,
        }
    }

    /// `tenant`'s limit of calls at once now: 0 while its endpoint is
    /// paused, 1 while it is probed (one call tells whether it is back).
    fn limit_now(&self, tenant: &str) -> usize {
        match self.pause_state(tenant) {
            PauseState::Open => self.limit(tenant),
            PauseState::Probing => 1,
            PauseState::Paused => 0,
        }
    }

    /// Starts the calls a pass took for one tenant.
    async fn start(self: &Arc<Self>, taken: TakenCalls) -> anyhow::Result<()> {
        let TakenCalls {
            tenant,
            room,
            wanted,
            calls,
            mut data,
            webhook,
        } = taken;
        let limit = self.limit_now(&tenant);
        // As many due as room: the endpoint has a backlog to grow into.
        let backlog = wanted >= room;
        let webhook = webhook.map(Arc::new);
        for due in calls {
            let admitted = {
                let mut in_flight = self.in_flight.lock().expect("in-flight lock");
                let ids = in_flight.entry(due.tenant_id.clone()).or_default();
                // Another pass may have got here first and taken its room.
                ids.len() < limit && ids.insert(due.event_id)
            };
            if !admitted {
                self.release(&due).await?;
                continue;
            }
            let dispatcher = self.clone();
            let webhook = webhook.clone();
            let data = data.remove(&due.event_id).map(MessageView::from);
            tokio::spawn(async move {
                let (tenant, event_id) = (due.tenant_id.clone(), due.event_id);
                let call = Call {
                    due: &due,
                    webhook: webhook.as_deref(),
                    data,
                    backlog,
                };
                if let Err(err) = dispatcher.call(call).await {
                    warn!(%tenant, event_id, error = %format!("{err:#}"), "Could not record a webhook call; it is made again after its lease.");
                }
                dispatcher.done(&tenant, event_id);
                // Room again: the next pass starts now, not at its interval.
                dispatcher.wake.notify_one();
            });
        }
        Ok(())
    }

    /// Gives back a lease taken but not used: the call is due again now.
    async fn release(&self, due: &DueCall) -> anyhow::Result<()> {
        webhooks::release_lease(&self.db, due.event_id).await?;
        Ok(())
    }

    /// `tenant`'s current limit of calls at once.
    fn limit(&self, tenant: &str) -> usize {
        let limits = self.limits.lock().expect("limits lock");
        limits
            .get(tenant)
            .copied()
            .unwrap_or(self.settings.concurrency_per_tenant)
    }

    /// Moves `tenant`'s limit after a call: one up for a quick 2xx while
    /// it has a backlog, halved for a failed or slow one, within
    /// `concurrency_per_tenant ..= max_concurrency_per_tenant`.
    fn adapt(&self, tenant: &str, healthy: bool, backlog: bool) {
        let floor = self.settings.concurrency_per_tenant;
        let ceiling = self.settings.max_concurrency_per_tenant.max(floor);
        let mut limits = self.limits.lock().expect("limits lock");
        let limit = limits.get(tenant).copied().unwrap_or(floor);
        let next = match (healthy, backlog) {
            (true, true) => (limit + 1).min(ceiling),
            (true, false) => limit,
            (false, _) => (limit / 2).max(floor),
        };
        if next == floor {
            limits.remove(tenant);
        } else {
            limits.insert(tenant.to_owned(), next);
        }
    }

    fn pause_state(&self, tenant: &str) -> PauseState {
        match self.pauses.lock().expect("pauses lock").get(tenant) {
            None => PauseState::Open,
            Some(pause) => match pause.until {
                Some(until) if tokio::time::Instant::now() < until => PauseState::Paused,
                Some(_) => PauseState::Probing,
                None => PauseState::Open,
            },
        }
    }

    /// Counts a call's outcome toward its endpoint's pause: a 2xx ends
    /// it; [`PAUSE_AFTER_FAILURES`] failures in a row, or one failed
    /// probe, pause the endpoint for `retry_base_ms`, doubling with each
    /// pause in a row, at most `retry_max_secs`.
    fn count_toward_pause(&self, tenant: &str, answered: bool) {
        let mut pauses = self.pauses.lock().expect("pauses lock");
        if answered {
            if let Some(pause) = pauses.remove(tenant)
                && pause.pauses > 0
            {
                info!(%tenant, pauses = pause.pauses, "Webhook endpoint answers again; its calls resume.");
            }
            return;
        }
        let pause = pauses.entry(tenant.to_owned()).or_default();
        let now = tokio::time::Instant::now();
        if pause.until.is_some_and(|until| now < until) {
            // A call that was in flight when the pause began.
            return;
        }
        pause.failures += 1;
        let probing = pause.until.is_some();
        if pause.failures < PAUSE_AFTER_FAILURES && !probing {
            return;
        }
        let length = Duration::from_millis(
            self.settings
                .retry_base_ms
                .saturating_mul(1 << pause.pauses.min(30))
                .min(self.settings.retry_max_secs.saturating_mul(1000)),
        );
        pause.pauses += 1;
        pause.failures = 0;
        pause.until = Some(now + length);
        metrics::counter!(names::WEBHOOK_ENDPOINT_PAUSES_TOTAL).increment(1);
        info!(%tenant, pause_ms = length.as_millis() as u64, pauses = pause.pauses, "Webhook endpoint failing: its calls pause, then one call tries it.");
    }

    /// The tenants with calls in flight.
    fn busy_tenants(&self) -> HashSet<String> {
        self.in_flight
            .lock()
            .expect("in-flight lock")
            .keys()
            .cloned()
            .collect()
    }

    fn busy(&self, tenant: &str) -> HashSet<i64> {
        self.in_flight
            .lock()
            .expect("in-flight lock")
            .get(tenant)
            .cloned()
            .unwrap_or_default()
    }

    fn done(&self, tenant: &str, event_id: i64) {
        let mut in_flight = self.in_flight.lock().expect("in-flight lock");
        if let Some(ids) = in_flight.get_mut(tenant) {
            ids.remove(&event_id);
            if ids.is_empty() {
                in_flight.remove(tenant);
            }
        }
    }

    /// Makes one call and records how it went.
    async fn call(&self, call: Call<'_>) -> anyhow::Result<()> {
        let Call {
            due,
            webhook,
            data,
            backlog,
        } = call;
        let _slot = self.slots.acquire().await?;
        let (Some(webhook), Some(data)) = (webhook, data) else {
            return self.forget(due).await;
        };
        let body = serde_json::to_vec(&Envelope {
            kind: &due.kind,
            timestamp: ms_to_rfc3339(due.created_at),
            data: &data,
        })?;
        let id = format!("evt_{}", due.event_id);
        let now = now_ms();
        let timestamp = now / 1000;
        let signatures = webhook
            .signing_secrets(now)
            .into_iter()
            .map(|secret| sign(secret, &id, timestamp, &body))
            .collect::<anyhow::Result<Vec<_>>>()?
            .join(" ");
        let failure = match self.policy.check_call(&webhook.url) {
            Err((reason, detail)) => Some(Failure {
                result: "not_allowed",
                reason: reason.into(),
                detail,
            }),
            Ok(url) => {
                // Found from the message's trace by `messaging.message.id`.
                let span = crate::telemetry::span!(
                    "webhook call",
                    otel.name = %format!("webhook {}", due.kind),
                    otel.kind = "client",
                    messaging.message.id = due.message_id.as_str(),
                    fairlane.tenant_id = due.tenant_id.as_str(),
                    fairlane.webhook.event_id = due.event_id,
                    fairlane.webhook.attempt = due.attempts + 1,
                );
                let started = std::time::Instant::now();
                let headers = [
                    ("webhook-id", HeaderValue::try_from(id)?),
                    ("webhook-timestamp", HeaderValue::from(timestamp)),
                    ("webhook-signature", HeaderValue::try_from(signatures)?),
                ];
                let answer = self
                    .client
                    .post(&url, headers, body)
                    .instrument(span.clone())
                    .await;
                let failure = Failure::of(answer, self.settings.timeout_ms);
                if let Some(failure) = &failure {
                    crate::telemetry::failed(&span, failure.result);
                }
                let healthy = failure.is_none() && started.elapsed() <= SLOW_CALL;
                self.adapt(&due.tenant_id, healthy, backlog);
                failure
            }
        };
        self.count_toward_pause(&due.tenant_id, failure.is_none());
        match failure {
            None => self.delivered(due).await,
            Some(failure) => self.failed(due, &failure).await,
        }
    }

    /// The endpoint or the message is gone: the call is dropped.
    async fn forget(&self, due: &DueCall) -> anyhow::Result<()> {
        webhooks::forget_call(&self.db, due.event_id).await
    }

    /// Hands the call to the recorder, which removes it with others.
    async fn delivered(&self, due: &DueCall) -> anyhow::Result<()> {
        self.delivered
            .send((due.event_id, due.tenant_id.clone()))
            .map_err(|_| anyhow::anyhow!("the webhook recorder has stopped"))?;
        let lag = (now_ms() - due.created_at).max(0) as f64 / 1000.0;
        metrics::counter!(names::WEBHOOK_ATTEMPTS_TOTAL, "result" => "delivered").increment(1);
        metrics::histogram!(names::WEBHOOK_LAG_SECONDS).record(lag);
        debug!(tenant = %due.tenant_id, message_id = %due.message_id, kind = %due.kind, event_id = due.event_id, "Webhook delivered.");
        Ok(())
    }

    /// Schedules the next try, or gives the event up once it has failed
    /// for `disable_after_secs`; disables the endpoint once it has failed
    /// that long. The tenant's view gets only the failure's general
    /// reason; the log has its detail.
    async fn failed(&self, due: &DueCall, failure: &Failure) -> anyhow::Result<()> {
        let now = now_ms();
        let limit = (self.settings.disable_after_secs * 1000) as i64;
        let gave_up = now - due.created_at >= limit;
        let next = now + self.backoff(due.attempts as u32 + 1).as_millis() as i64;
        let disabled =
            webhooks::call_failed(&self.db, due, &failure.reason, next, gave_up, now, limit)
                .await?;
        metrics::counter!(names::WEBHOOK_ATTEMPTS_TOTAL, "result" => failure.result).increment(1);
        if gave_up {
            metrics::counter!(names::WEBHOOK_ATTEMPTS_TOTAL, "result" => "gave_up").increment(1);
        }
        let (reason, detail) = (&failure.reason, &failure.detail);
        if disabled {
            metrics::counter!(names::WEBHOOKS_DISABLED_TOTAL).increment(1);
            warn!(tenant = %due.tenant_id, %reason, %detail, "Webhook endpoint disabled after failing for webhooks.disable_after_secs; its events are kept for a redrive.");
        } else {
            info!(tenant = %due.tenant_id, event_id = due.event_id, attempts = due.attempts + 1, %reason, %detail, retry_in_ms = next - now, "Webhook call failed; retrying later.");
        }
        Ok(())
    }

    /// Wait before try `attempt` (1-based): between half and all of
    /// `retry_base_ms × 2^(attempt-1)`, at most `retry_max_secs`.
    fn backoff(&self, attempt: u32) -> Duration {
        let base = self.settings.retry_base_ms;
        let ceiling = base
            .saturating_mul(1u64 << attempt.saturating_sub(1).min(30))
            .min(self.settings.retry_max_secs.saturating_mul(1000))
            .max(1);
        Duration::from_millis(rand::rng().random_range(ceiling / 2..=ceiling))
    }
}

/// Removes delivered calls in batches: whatever has arrived while the
/// last batch was written goes in the next, up to [`RECORD_BATCH`]. Ends at
/// shutdown after writing what it holds. A batch that cannot be written is
/// logged; its calls are made again once their leases end (at least once).
async fn record(
    writer: Writer,
    mut delivered: mpsc::UnboundedReceiver<(i64, String)>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut batch: Vec<(i64, String)> = Vec::with_capacity(RECORD_BATCH);
    loop {
        let stopping = tokio::select! {
            got = delivered.recv() => match got {
                Some(call) => { batch.push(call); false }
                None => true,
            },
            _ = shutdown.wait_for(|stop| *stop) => true,
        };
        while batch.len() < RECORD_BATCH {
            match delivered.try_recv() {
                Ok(call) => batch.push(call),
                Err(_) => break,
            }
        }
        if !batch.is_empty() {
            let ids: Vec<i64> = batch.iter().map(|(id, _)| *id).collect();
            let mut tenants: Vec<String> = batch.drain(..).map(|(_, tenant)| tenant).collect();
            tenants.sort();
            tenants.dedup();
            let count = ids.len();
            if let Err(err) = writer.calls_delivered(ids, tenants).await {
                warn!(calls = count, error = %format!("{err:#}"), "Could not record delivered webhook calls; they are made again after their lease.");
            }
        }
        if stopping {
            return;
        }
    }
}

/// Sets the gauges of due calls every [`SAMPLE_EVERY`] until shutdown.
async fn sample_due(db: Db, mut shutdown: watch::Receiver<bool>) {
    loop {
        let now = now_ms();
        match webhooks::due_overall(&db, now).await {
            Ok((due, oldest)) => {
                metrics::gauge!(names::WEBHOOK_CALLS_DUE).set(due as f64);
                let age = oldest.map_or(0, |at| (now - at).max(0)) as f64 / 1000.0;
                metrics::gauge!(names::WEBHOOK_OLDEST_DUE_AGE_SECONDS).set(age);
            }
            Err(err) => {
                debug!(error = %format!("{err:#}"), "Could not count due webhook calls.");
            }
        }
        tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => return,
            _ = tokio::time::sleep(SAMPLE_EVERY) => {}
        }
    }
}

/// An endpoint's run of failed calls. After [`PAUSE_AFTER_FAILURES`] in a
/// row its tenant's calls pause (events stay pending; each keeps its own
/// retry time); when the pause ends, one call at a time tries the
/// endpoint: a 2xx ends the pause, a failure starts a longer one. So an
/// endpoint that fails at once is not called hundreds of times a second.
/// Kept by each instance for itself.
#[derive(Debug, Default)]
struct Pause {
    /// Failed calls since the last 2xx or pause.
    failures: u32,
    /// Pauses in a row.
    pauses: u32,
    /// End of the current pause; None before the first.
    until: Option<tokio::time::Instant>,
}

/// Whether a tenant's calls may go out.
enum PauseState {
    Open,
    /// Its pause ended: one call at a time.
    Probing,
    Paused,
}

/// A call's body: one event, as the Standard Webhooks spec has it.
/// Serialized straight from the message's view, with no JSON tree between.
#[derive(serde::Serialize)]
struct Envelope<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    timestamp: String,
    data: &'a MessageView,
}

/// One call to make.
struct Call<'a> {
    due: &'a DueCall,
    /// The tenant's endpoint; `None` when it has none any more.
    webhook: Option<&'a Webhook>,
    /// The message as it was at the event; `None` when it is gone.
    data: Option<MessageView>,
    /// Whether the tenant had more due than room when it was taken.
    backlog: bool,
}

/// Why a call failed.
#[derive(Debug)]
struct Failure {
    /// The `result` label of [`names::WEBHOOK_ATTEMPTS_TOTAL`].
    result: &'static str,
    /// What the tenant sees in `last_error`: `connection failed`,
    /// `timeout`, `HTTP <status>`, `address not allowed` or `URL not
    /// allowed`. No addresses, ports or error text: the endpoint is the
    /// tenant's choice, and the detail would tell it what answers inside
    /// the operator's network.
    reason: String,
    /// What the log gets.
    detail: String,
}

impl Failure {
    /// None for a 2xx answer.
    fn of(answer: Result<StatusCode, CallError>, timeout_ms: u64) -> Option<Failure> {
        let err = match answer {
            Ok(status) if status.is_success() => return None,
            Ok(status) => {
                let status = status.as_u16();
                return Some(Failure {
                    result: "rejected",
                    reason: format!("HTTP {status}"),
                    detail: format!("the endpoint answered HTTP {status}"),
                });
            }
            Err(err) => err,
        };
        let detail = crate::providers::causes(&err);
        Some(match refusal_in(&err) {
            Some(Refusal::NotAllowed { .. }) => Failure {
                result: "not_allowed",
                reason: "address not allowed".into(),
                detail,
            },
            _ if timed_out(&err) => Failure {
                result: "unreachable",
                reason: "timeout".into(),
                detail: format!("no answer within {timeout_ms} ms: {detail}"),
            },
            _ => Failure {
                result: "unreachable",
                reason: "connection failed".into(),
                detail,
            },
        })
    }
}

/// Whether a call failed for want of an answer in time: the whole call,
/// or its connection.
fn timed_out(err: &CallError) -> bool {
    matches!(err, CallError::Timeout(_))
        || std::iter::successors(Some(err as &(dyn std::error::Error + 'static)), |err| {
            err.source()
        })
        .filter_map(|err| err.downcast_ref::<std::io::Error>())
        .any(|err| err.kind() == std::io::ErrorKind::TimedOut)
}
