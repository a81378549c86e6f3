//! The webhook dispatcher: reads each endpoint's events from the event log
//! (its *stream*, see `crate::store::webhooks`) and the failed calls due
//! again (`webhook_deliveries`), makes the calls, and records the outcome.
//!
//! A stream's calls are handed out in event order and end in any order;
//! the endpoint's position moves past the unbroken run of those that ended
//! (delivered, or failed and so given a row), written by the recorder in
//! batches. A delivered event thus costs no write of its own.
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
//! connection. Positions and delivered retries are written in batches by
//! one recorder task, so a busy endpoint costs one write per batch rather
//! than one per call. On SQLite a whole pass (the tenants with calls to
//! make, and for each its due retries, its stream's next events, their
//! leases, their data and its endpoint) is one piece of the store writer's
//! group, and the record another, rather than taking the write lock from
//! the delivery path. A message's later event waits while its earlier one
//! is in flight or has a failed call's row, so each message's events
//! arrive in order. A stream is read by one instance at a time, under a
//! lease on its endpoint's row, and a retry taken moves its
//! `next_attempt_at` past the call's timeout (a lease): another instance
//! does not take either meanwhile, and if this one dies, the calls are
//! made again once the lease ends, with the same `webhook-id`. An endpoint
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

use super::body;
use super::client::{CallError, WebhookClient};
use super::endpoint::{EndpointPolicy, Refusal, refusal_in};
use super::sign::sign;
use crate::config::WebhookSettings;
use crate::message::MessageView;
use crate::metrics as names;
use crate::model::now_ms;
use crate::store::webhooks::{Cursor, DueCall, Webhook};
use crate::store::{CallsRecord, Db, PassRooms, StreamRead, TakenCalls, TenantRoom, Writer};

/// A 2xx answer slower than this counts against its endpoint: the tenant's
/// limit halves instead of growing.
pub const SLOW_CALL: Duration = Duration::from_secs(1);

/// Passes that a delivery outcome wakes are at least this far apart.
const MIN_PASS_GAP: Duration = Duration::from_millis(20);

/// Call outcomes recorded per transaction, at most.
const RECORD_BATCH: usize = 256;

/// Failed calls in a row after which a tenant's endpoint is paused.
pub const PAUSE_AFTER_FAILURES: u32 = 5;

/// The shortest lease on a stream (see `Dispatcher::stream_lease_ms`).
const STREAM_LEASE_MIN: Duration = Duration::from_secs(5);

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
    /// Names this instance's dispatcher as the reader of the streams it
    /// holds.
    owner: String,
    /// Each tenant's calls in flight and the events they carry.
    in_flight: Mutex<HashMap<String, Busy>>,
    /// Each tenant's `max_events_per_call` as its last pass found it, when
    /// above 1: its room in a pass is that many events per call.
    per_call: Mutex<HashMap<String, usize>>,
    /// The calls handed out from each stream this instance reads.
    streams: Mutex<HashMap<String, StreamTrack>>,
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
    /// Outcomes for the recorder.
    delivered: mpsc::UnboundedSender<Outcome>,
    recorder: Mutex<Option<mpsc::UnboundedReceiver<Outcome>>>,
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
            owner: uuid::Uuid::new_v4().to_string(),
            in_flight: Mutex::default(),
            per_call: Mutex::default(),
            streams: Mutex::default(),
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
        let mut rooms = self.rooms();
        rooms.stream_until = now + self.stream_lease_ms();
        let taken = self.writer.take_pass(rooms, now, lease_until).await?;
        for calls in taken {
            self.start(calls).await?;
        }
        Ok(())
    }

    /// How long a stream read stays this instance's without a pass: ten
    /// poll intervals, at least [`STREAM_LEASE_MIN`]. Each pass renews it
    /// while calls are in flight; if this instance dies, another reads the
    /// stream again from its position once it has run out.
    fn stream_lease_ms(&self) -> i64 {
        let ms = self.settings.poll_interval_ms.saturating_mul(10);
        ms.max(STREAM_LEASE_MIN.as_millis() as u64)
            .min(i64::MAX as u64) as i64
    }

    /// Each tenant's room as of now (see [`PassRooms`]): its limit (one
    /// while its endpoint is probed after a pause, none while paused) less
    /// its calls in flight, times the events its endpoint takes per call.
    fn rooms(&self) -> PassRooms {
        let mut tenants: HashSet<String> = self.busy_tenants();
        tenants.extend(self.limits.lock().expect("limits lock").keys().cloned());
        tenants.extend(self.pauses.lock().expect("pauses lock").keys().cloned());
        tenants.extend(self.per_call.lock().expect("per-call lock").keys().cloned());
        let tenants = tenants
            .into_iter()
            .map(|tenant| {
                let Busy { events, calls } = self.busy(&tenant);
                let limit = self.limit_now(&tenant);
                let room = limit.saturating_sub(calls) * self.per_call_of(&tenant);
                let (busy, busy_messages) = events.into_iter().unzip();
                (
                    tenant,
                    TenantRoom {
                        busy,
                        busy_messages,
                        room,
                    },
                )
            })
            .collect();
        PassRooms {
            tenants,
            default_room: self.settings.concurrency_per_tenant,
            owner: self.owner.clone(),
            stream_until: 0,
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

    /// Starts the calls a pass took for one tenant: each event alone, or
    /// as many in one call as its endpoint takes, in order.
    async fn start(self: &Arc<Self>, taken: TakenCalls) -> anyhow::Result<()> {
        let TakenCalls {
            tenant,
            room,
            wanted,
            calls,
            mut data,
            webhook,
            stream,
        } = taken;
        if let Some(read) = stream {
            self.track(&tenant, read, &calls);
        }
        let limit = self.limit_now(&tenant);
        // As many due as room: the endpoint has a backlog to grow into.
        let backlog = wanted >= room;
        let per_call = webhook.as_ref().map_or(1, per_call_of);
        self.note_per_call(&tenant, per_call);
        let batched = per_call > 1;
        let webhook = webhook.map(Arc::new);
        let mut calls = calls.into_iter().peekable();
        while calls.peek().is_some() {
            let (admitted, refused) = self.admit(&tenant, calls.by_ref().take(per_call), limit);
            for due in &refused {
                self.release(due).await?;
            }
            if admitted.is_empty() {
                continue;
            }
            let dispatcher = self.clone();
            let data = admitted
                .iter()
                .map(|due| data.remove(&due.event_id).map(MessageView::from))
                .collect();
            let call = Call {
                dues: admitted,
                webhook: webhook.clone(),
                data,
                batched,
                backlog,
            };
            tokio::spawn(async move {
                let ended: Vec<(i64, Option<Cursor>)> = call
                    .dues
                    .iter()
                    .map(|due| (due.event_id, due.cursor))
                    .collect();
                let tenant = call.dues[0].tenant_id.clone();
                if let Err(err) = dispatcher.call(&call).await {
                    warn!(%tenant, event_id = ended[0].0, events = ended.len(), error = %format!("{err:#}"), "Could not record a webhook call; it is made again after its lease.");
                }
                dispatcher.done(&tenant, &ended);
                // Room again: the next pass starts now, not at its interval.
                dispatcher.wake.notify_one();
            });
        }
        Ok(())
    }

    /// Takes one call's events into `tenant`'s calls in flight: all of
    /// them while it has room for a call, or when one comes from its
    /// stream (the read has passed it); never an event already in flight.
    /// Returns those admitted, and those refused (to give back).
    fn admit(
        &self,
        tenant: &str,
        events: impl Iterator<Item = DueCall>,
        limit: usize,
    ) -> (Vec<DueCall>, Vec<DueCall>) {
        let events: Vec<DueCall> = events.collect();
        let mut in_flight = self.in_flight.lock().expect("in-flight lock");
        let busy = in_flight.entry(tenant.to_owned()).or_default();
        // Another pass may have got here first and taken its room; a
        // stream's call is made anyway.
        let room = busy.calls < limit || events.iter().any(|due| due.cursor.is_some());
        let (admitted, refused): (Vec<DueCall>, Vec<DueCall>) = if room {
            events.into_iter().partition(|due| {
                busy.events
                    .insert(due.event_id, due.message_id.clone())
                    .is_none()
            })
        } else {
            (Vec::new(), events)
        };
        if !admitted.is_empty() {
            busy.calls += 1;
        } else if busy.events.is_empty() {
            in_flight.remove(tenant);
        }
        (admitted, refused)
    }

    /// Keeps `tenant`'s events per call for its next passes' room.
    fn note_per_call(&self, tenant: &str, per_call: usize) {
        let mut known = self.per_call.lock().expect("per-call lock");
        if per_call > 1 {
            known.insert(tenant.to_owned(), per_call);
        } else {
            known.remove(tenant);
        }
    }

    /// `tenant`'s events per call as last seen (1 until a pass finds more).
    fn per_call_of(&self, tenant: &str) -> usize {
        let known = self.per_call.lock().expect("per-call lock");
        known.get(tenant).copied().unwrap_or(1)
    }

    /// Gives back a lease taken but not used: the call is due again now.
    async fn release(&self, due: &DueCall) -> anyhow::Result<()> {
        if due.cursor.is_none() {
            self.db.release_webhook_lease(due.event_id).await?;
        }
        Ok(())
    }

    /// Notes what a pass read of `tenant`'s stream: the calls it handed
    /// out, in order, and how far it read. A lease taken anew starts the
    /// count again from the position.
    fn track(&self, tenant: &str, read: StreamRead, calls: &[DueCall]) {
        let advanced = {
            let mut streams = self.streams.lock().expect("streams lock");
            let track = streams.entry(tenant.to_owned()).or_default();
            if read.fresh {
                *track = StreamTrack::default();
            }
            track.handed.extend(
                calls
                    .iter()
                    .filter_map(|due| due.cursor)
                    .map(|at| (at, false)),
            );
            track.read = read.read;
            track.settled()
        };
        self.advance(tenant, advanced);
    }

    /// Hands a stream's new position to the recorder.
    fn advance(&self, tenant: &str, to: Option<Cursor>) {
        if let Some(to) = to {
            let _ = self
                .delivered
                .send(Outcome::Advanced(tenant.to_owned(), to));
        }
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

    /// The tenants with calls in flight, and those whose stream this
    /// instance reads (its lease is renewed by each pass).
    fn busy_tenants(&self) -> HashSet<String> {
        let mut tenants: HashSet<String> = self
            .in_flight
            .lock()
            .expect("in-flight lock")
            .keys()
            .cloned()
            .collect();
        tenants.extend(
            self.streams
                .lock()
                .expect("streams lock")
                .iter()
                .filter(|(_, track)| !track.handed.is_empty())
                .map(|(tenant, _)| tenant.clone()),
        );
        tenants
    }

    /// `tenant`'s calls in flight.
    fn busy(&self, tenant: &str) -> Busy {
        self.in_flight
            .lock()
            .expect("in-flight lock")
            .get(tenant)
            .cloned()
            .unwrap_or_default()
    }

    /// A call has ended and the outcomes of its events are recorded (a
    /// failure's row committed): its stream's position may move past them.
    fn done(&self, tenant: &str, ended: &[(i64, Option<Cursor>)]) {
        {
            let mut in_flight = self.in_flight.lock().expect("in-flight lock");
            if let Some(busy) = in_flight.get_mut(tenant) {
                for (event_id, _) in ended {
                    busy.events.remove(event_id);
                }
                busy.calls = busy.calls.saturating_sub(1);
                if busy.events.is_empty() {
                    in_flight.remove(tenant);
                }
            }
        }
        let advanced = {
            let mut streams = self.streams.lock().expect("streams lock");
            streams.get_mut(tenant).and_then(|track| {
                ended
                    .iter()
                    .filter_map(|&(_, cursor)| track.ended(cursor?))
                    .last()
            })
        };
        self.advance(tenant, advanced);
    }

    /// Makes one call (one event, or a batch) and records how it went for
    /// each of its events.
    async fn call(&self, call: &Call) -> anyhow::Result<()> {
        let _slot = self.slots.acquire().await?;
        let Some(webhook) = call.webhook.as_deref() else {
            for due in &call.dues {
                self.forget(due).await?;
            }
            return Ok(());
        };
        let mut events = Vec::with_capacity(call.dues.len());
        for (due, data) in call.dues.iter().zip(&call.data) {
            match data {
                Some(data) => events.push((due, data)),
                None => self.forget(due).await?,
            }
        }
        let Some(&(first, _)) = events.first() else {
            return Ok(());
        };
        let (id, body) = body::of(&events, call.batched)?;
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
                // Found from the message's trace by `messaging.message.id`
                // (a batch's: its first message).
                let span = crate::telemetry::span!(
                    "webhook call",
                    otel.name = %format!("webhook {}", first.kind),
                    otel.kind = "client",
                    messaging.message.id = first.message_id.as_str(),
                    fairlane.tenant_id = first.tenant_id.as_str(),
                    fairlane.webhook.event_id = first.event_id,
                    fairlane.webhook.events = events.len(),
                    fairlane.webhook.attempt = first.attempts + 1,
                );
                let started = std::time::Instant::now();
                metrics::counter!(names::WEBHOOK_CALLS_TOTAL).increment(1);
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
                self.adapt(&first.tenant_id, healthy, call.backlog);
                failure
            }
        };
        self.count_toward_pause(&first.tenant_id, failure.is_none());
        match failure {
            None => self.delivered(&first.tenant_id, events.iter().map(|(due, _)| *due)),
            Some(failure) => {
                for (due, _) in events {
                    self.failed(due, &failure).await?;
                }
                Ok(())
            }
        }
    }

    /// The endpoint or the message is gone: the call is dropped (a
    /// stream's is passed by its position).
    async fn forget(&self, due: &DueCall) -> anyhow::Result<()> {
        if due.cursor.is_some() {
            return Ok(());
        }
        Ok(self.db.forget_webhook_call(due.event_id).await?)
    }

    /// Hands a delivered call's events to the recorder: the rows of
    /// retries among them are removed with others, and the endpoint is no
    /// longer failing.
    fn delivered<'a>(
        &self,
        tenant: &str,
        events: impl Iterator<Item = &'a DueCall>,
    ) -> anyhow::Result<()> {
        let now = now_ms();
        let lag = metrics::histogram!(names::WEBHOOK_LAG_SECONDS);
        let mut rows = Vec::new();
        let mut count = 0;
        for due in events {
            rows.extend(due.cursor.is_none().then_some(due.event_id));
            lag.record((now - due.created_at).max(0) as f64 / 1000.0);
            count += 1;
            debug!(tenant = %due.tenant_id, message_id = %due.message_id, kind = %due.kind, event_id = due.event_id, "Webhook delivered.");
        }
        metrics::counter!(names::WEBHOOK_ATTEMPTS_TOTAL, "result" => "delivered").increment(count);
        self.delivered
            .send(Outcome::Delivered(tenant.to_owned(), rows))
            .map_err(|_| anyhow::anyhow!("the webhook recorder has stopped"))
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
        let disabled = self
            .db
            .webhook_call_failed(due, &failure.reason, next, gave_up, now, limit)
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

/// What the recorder writes: a call delivered (tenant, and the rows of the
/// retries it carried), or a stream's new position.
enum Outcome {
    Delivered(String, Vec<i64>),
    Advanced(String, Cursor),
}

/// Writes call outcomes in batches: whatever has arrived while the last
/// batch was written goes in the next, up to [`RECORD_BATCH`]. Ends at
/// shutdown after writing what it holds. A batch that cannot be written is
/// logged; its calls are made again once their leases end (at least once).
async fn record(
    writer: Writer,
    mut outcomes: mpsc::UnboundedReceiver<Outcome>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut batch: Vec<Outcome> = Vec::with_capacity(RECORD_BATCH);
    loop {
        let stopping = tokio::select! {
            got = outcomes.recv() => match got {
                Some(outcome) => { batch.push(outcome); false }
                None => true,
            },
            _ = shutdown.wait_for(|stop| *stop) => true,
        };
        while batch.len() < RECORD_BATCH {
            match outcomes.try_recv() {
                Ok(outcome) => batch.push(outcome),
                Err(_) => break,
            }
        }
        if !batch.is_empty() {
            let count = batch.len();
            let record = record_of(batch.drain(..));
            if let Err(err) = writer.record_calls(record).await {
                warn!(outcomes = count, error = %format!("{err:#}"), "Could not record webhook calls; they are made again after their lease.");
            }
        }
        if stopping {
            return;
        }
    }
}

/// One write's worth of outcomes: rows, healthy tenants, and each
/// stream's furthest position.
fn record_of(outcomes: impl Iterator<Item = Outcome>) -> CallsRecord {
    {
        let mut record = CallsRecord::default();
        let mut positions: HashMap<String, Cursor> = HashMap::new();
        for outcome in outcomes {
            match outcome {
                Outcome::Delivered(tenant, rows) => {
                    record.delivered_rows.extend(rows);
                    record.healthy.push(tenant);
                }
                Outcome::Advanced(tenant, to) => {
                    let at = positions.entry(tenant).or_insert(to);
                    *at = (*at).max(to);
                }
            }
        }
        record.healthy.sort();
        record.healthy.dedup();
        record.positions = positions.into_iter().collect();
        record
    }
}

/// The calls one stream has handed out, in event order, and how far it is
/// read: what its position may move to.
#[derive(Debug, Default)]
struct StreamTrack {
    /// Each call handed out and not yet passed by the position, with
    /// whether it has ended.
    handed: std::collections::VecDeque<(Cursor, bool)>,
    /// Every event up to here was handed out or needs no call.
    read: Cursor,
    /// The last position handed to the recorder.
    sent: Option<Cursor>,
}

impl StreamTrack {
    /// The call at `cursor` has ended; the new position, if it moved.
    fn ended(&mut self, cursor: Cursor) -> Option<Cursor> {
        // Handed out in stream order, so sorted: a batch's hundred events
        // each find their place without walking thousands of others.
        let at = match self.handed.binary_search_by_key(&cursor, |(at, _)| *at) {
            Ok(at) => Some(at),
            Err(_) => self.handed.iter().position(|(at, _)| *at == cursor),
        };
        if let Some(at) = at {
            self.handed[at].1 = true;
        }
        self.settled()
    }

    /// Drops the ended calls at the front; the position past them (the
    /// read, once none is in flight), if it moved.
    fn settled(&mut self) -> Option<Cursor> {
        let mut last = None;
        while let Some(&(at, true)) = self.handed.front() {
            last = Some(at);
            self.handed.pop_front();
        }
        let to = if self.handed.is_empty() {
            Some(self.read)
        } else {
            last
        };
        match to {
            Some(to) if self.sent.is_none_or(|sent| to > sent) => {
                self.sent = Some(to);
                Some(to)
            }
            _ => None,
        }
    }
}

/// Sets the gauges of due calls every [`SAMPLE_EVERY`] until shutdown.
async fn sample_due(db: Db, mut shutdown: watch::Receiver<bool>) {
    loop {
        let now = now_ms();
        match db.webhook_calls_due(now).await {
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

/// One call to make.
struct Call {
    /// Its events, in order: one, or up to the endpoint's
    /// `max_events_per_call`.
    dues: Vec<DueCall>,
    /// The tenant's endpoint; `None` when it has none any more.
    webhook: Option<Arc<Webhook>>,
    /// Each event's message as it was at the event; `None` when it is gone.
    data: Vec<Option<MessageView>>,
    /// Whether the body is a batch (the endpoint takes more than one).
    batched: bool,
    /// Whether the tenant had more due than room when it was taken.
    backlog: bool,
}

/// A tenant's calls in flight.
#[derive(Debug, Default, Clone)]
struct Busy {
    /// The events they carry, with their message.
    events: HashMap<i64, String>,
    /// How many calls.
    calls: usize,
}

/// The events an endpoint takes per call, within 1 ..= the most allowed.
fn per_call_of(webhook: &Webhook) -> usize {
    webhook
        .max_events_per_call
        .clamp(1, super::MAX_EVENTS_PER_CALL) as usize
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream's position moves only past the unbroken run of ended
    /// calls, whatever order they end in, and to the read once none is in
    /// flight; never back.
    #[test]
    fn a_position_passes_only_calls_that_have_ended() {
        let mut track = StreamTrack::default();
        track
            .handed
            .extend([((0, 1), false), ((0, 4), false), ((0, 7), false)]);
        track.read = (0, 9);
        assert_eq!(
            track.ended((0, 4)),
            None,
            "the first call is still in flight"
        );
        assert_eq!(track.ended((0, 1)), Some((0, 4)));
        assert_eq!(track.ended((0, 1)), None, "a call ends once");
        assert_eq!(
            track.ended((0, 7)),
            Some((0, 9)),
            "none in flight: the read, past the events the endpoint does not want"
        );
        assert!(track.handed.is_empty());
        track.read = (0, 9);
        assert_eq!(track.settled(), None, "no move, no write");
    }

    /// The recorder's batch: each stream's furthest position, each
    /// delivered retry's row, each answering tenant once.
    #[test]
    fn a_record_keeps_each_streams_furthest_position() {
        let record = record_of(
            [
                Outcome::Advanced("a".into(), (0, 5)),
                Outcome::Delivered("a".into(), vec![]),
                Outcome::Advanced("a".into(), (0, 9)),
                Outcome::Advanced("a".into(), (0, 7)),
                Outcome::Delivered("b".into(), vec![42]),
                Outcome::Delivered("a".into(), vec![]),
            ]
            .into_iter(),
        );
        assert_eq!(record.positions, [("a".to_owned(), (0, 9))]);
        assert_eq!(record.delivered_rows, [42]);
        assert_eq!(record.healthy, ["a", "b"]);
    }
}
