//! Prometheus metrics: every name in one place, the recorder installed once
//! per process, and the text rendered at `/metrics`.
//!
//! Names and labels are documented in the book
//! (docs/src/operations/metrics.md); a test keeps the two in step.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Retention runs, by `outcome`: `done`, `skipped` (another instance was
/// running one), `failed`.
pub const RETENTION_RUNS_TOTAL: &str = "fairlane_retention_runs_total";
/// Admin changes made whose audit entry could not be written.
pub const AUDIT_WRITE_FAILURES_TOTAL: &str = "fairlane_audit_write_failures_total";
/// Messages whose personal data retention erased.
pub const RETENTION_ERASED_TOTAL: &str = "fairlane_retention_erased_total";
/// Queue copies (dead letters, set-aside and delayed rows) retention removed.
pub const RETENTION_QUEUE_ERASED_TOTAL: &str = "fairlane_retention_queue_erased_total";

/// Transactions the SQLite store's writer committed (its groups, a group's
/// pieces applied alone, and the rare writers' own).
pub const STORE_COMMITS_TOTAL: &str = "fairlane_store_commits_total";
/// Rows those transactions inserted, updated or deleted (SQLite's count of
/// changes, usage rows included).
pub const STORE_ROWS_WRITTEN_TOTAL: &str = "fairlane_store_rows_written_total";

/// Messages accepted (202), by `lane`, `channel`.
pub const ACCEPTED_TOTAL: &str = "fairlane_messages_accepted_total";
/// Messages the provider accepted, by `lane`, `channel`.
pub const DELIVERED_TOTAL: &str = "fairlane_messages_delivered_total";
/// Transient failures scheduled for another attempt, by `lane`, `channel`.
pub const RETRIED_TOTAL: &str = "fairlane_messages_retried_total";
/// Messages moved to a dead-letter queue, by `lane`, `channel`.
pub const DEAD_LETTERED_TOTAL: &str = "fairlane_messages_dead_lettered_total";
/// Messages returned to the queue without an attempt, by `lane`, `reason`
/// (`paused`, `disabled`, `duplicate`: another copy is being sent,
/// `throttled`). A tenant at its cap parks messages instead (see
/// [`MESSAGES_WAITING`]).
pub const DEFERRED_TOTAL: &str = "fairlane_messages_deferred_total";
/// Requests refused, by `reason`: `rate`, `quota`, `lane`, `batches` (a
/// tenant's batches in progress), `writes` (a tenant's changes other than
/// sends), `reads` (a tenant's message list reads in progress) (429).
pub const REJECTED_TOTAL: &str = "fairlane_requests_rejected_total";
/// SQS API calls started, by `operation` (SQS mode only; what SQS bills).
pub const SQS_CALLS_TOTAL: &str = "fairlane_sqs_calls_total";
/// Messages waiting in a lane (visible or delayed), by `lane`.
pub const LANE_DEPTH: &str = "fairlane_lane_depth";
/// Messages received and not yet deleted, by `lane`.
pub const LANE_IN_FLIGHT: &str = "fairlane_lane_in_flight";
/// Age of the oldest message in a lane in seconds, by `lane`.
pub const LANE_OLDEST_AGE_SECONDS: &str = "fairlane_lane_oldest_message_age_seconds";
/// Messages in a lane's dead-letter queue, by `lane`.
pub const LANE_DLQ_DEPTH: &str = "fairlane_lane_dlq_depth";
/// SQS mode: messages accepted (committed with an outbox row) and not yet
/// in SQS, by `lane`; part of the lane's backlog. Read once per stats
/// interval.
pub const OUTBOX_PENDING: &str = "fairlane_outbox_pending";
/// SQS mode: SendMessageBatch calls of the outbox relay or sweeper that
/// failed (the entries stay in the outbox and are retried), by `lane`.
pub const OUTBOX_RELAY_FAILURES_TOTAL: &str = "fairlane_outbox_relay_failures_total";
/// Provider call latency in seconds, by `provider`, `outcome`
/// (`sent`, `permanent`, `transient`, `throttled`).
pub const PROVIDER_CALL_SECONDS: &str = "fairlane_provider_call_seconds";
/// Time waited at a provider gate in seconds, by `channel`, `priority`.
pub const GATE_WAIT_SECONDS: &str = "fairlane_provider_gate_wait_seconds";
/// Messages a consumer holds that wait, by `lane`, `priority`, `stage`:
/// `token` (in a provider gate's line) or `parked` (their tenant is at its
/// `max_in_flight`).
pub const MESSAGES_WAITING: &str = "fairlane_messages_waiting";

/// 1 while tenant limits and provider gates are counted where configured
/// (always with `limits.backend = "local"`; with `redis`, while Redis
/// answers), 0 while an instance runs on its local share because Redis is
/// unreachable.
pub const LIMITS_BACKEND_UP: &str = "fairlane_limits_backend_up";
/// Redis calls of the limits that failed or timed out, by `operation`
/// (`admit`, `seed`, `release`, `reconcile`, `gate`, `writes`, `heartbeat`).
pub const REDIS_ERRORS_TOTAL: &str = "fairlane_redis_errors_total";
/// Finished spans dropped because the exporter's queue held
/// `telemetry.max_queued_bytes` already (the SDK counts those dropped at
/// `max_queued_spans` on its own).
pub const TRACE_SPANS_DROPPED_TOTAL: &str = "fairlane_trace_spans_dropped_total";
/// Instances with a fresh heartbeat in Redis, as this instance last saw it
/// (`limits.backend = "redis"` only); the divisor of the local shares.
pub const LIMITS_LIVE_INSTANCES: &str = "fairlane_limits_live_instances";

/// Attention signals of dedicated tenant queues, by `lane` and `event`:
/// `published` (a queue got work; on the embedded queue only when no signal
/// was waiting), `consumed` (a worker took it and worked a slice), `dropped`
/// (tenant deleted, paused or disabled, its consumer limit reached, or a
/// slice started since the signal was written).
pub const ATTENTION_SIGNALS_TOTAL: &str = "fairlane_attention_signals_total";
/// Slices of dedicated tenant queues, by `lane` and why each `ended`:
/// `empty`, `messages` (slice_max_messages), `time` (slice_max_secs),
/// `shutdown`.
pub const ATTENTION_SLICES_TOTAL: &str = "fairlane_attention_slices_total";
/// Pauses of a provider's gate after it answered 429 with `Retry-After`,
/// by `provider`.
pub const PROVIDER_PAUSES_TOTAL: &str = "fairlane_provider_pauses_total";
/// Series of one provider (its configured name), at zero until it counts.
pub fn register_provider(provider: &'static str) {
    metrics::counter!(PROVIDER_PAUSES_TOTAL, "provider" => provider).increment(0);
    metrics::counter!(BREAKER_OPENS_TOTAL, "provider" => provider).increment(0);
    metrics::counter!(PROVIDER_DOWNS_TOTAL, "provider" => provider).increment(0);
    for outcome in RECEIPT_OUTCOMES {
        metrics::counter!(RECEIPTS_TOTAL, "provider" => provider, "outcome" => *outcome)
            .increment(0);
    }
}

/// Openings of a provider's circuit breaker after a run of failed calls, by
/// `provider`.
pub const BREAKER_OPENS_TOTAL: &str = "fairlane_provider_breaker_opens_total";
/// Times a provider of a pool was marked down by its recent calls
/// (`providers.health`), by `provider`.
pub const PROVIDER_DOWNS_TOTAL: &str = "fairlane_provider_downs_total";
/// Stalls of a channel's provider gate that its watchdog found and repaired
/// (callers waiting, and the head of its line not acting when due), by
/// `channel`. Each one is a bug in the gate's hand-over: report it.
pub const GATE_STALLS_TOTAL: &str = "fairlane_provider_gate_stalls_total";
/// Fleet-wide provider tokens given up because their call started too long
/// after the grant (a stalled store or no free worker): the call took a
/// fresh token first, so held-up calls are not released together.
pub const GATE_STALE_GRANTS_TOTAL: &str = "fairlane_provider_gate_stale_grants_total";
/// The share of its channel's new messages a provider gets now (0 to 1:
/// weight × health, and 0 while paused), by `channel` and `provider`.
pub const PROVIDER_SHARE: &str = "fairlane_provider_share";
/// Connections shed at `server.max_connections`, by `action`: `evicted` (the
/// oldest connection waiting for a request head, closed to make room) or
/// `refused` (every connection busy: answered 503 and closed).
pub const CONNECTIONS_SHED_TOTAL: &str = "fairlane_connections_shed_total";
/// Requests whose handler panicked, answered 500 (every one is a bug).
pub const HANDLER_PANICS_TOTAL: &str = "fairlane_handler_panics_total";
/// Dedicated tenant queues of a `lane` this process knows to hold backlog:
/// signalled, or held while their tenant is paused, and not yet found empty
/// after a slice.
pub const DEDICATED_QUEUES_BACKLOGGED: &str = "fairlane_dedicated_queues_backlogged";

/// Provider receipts, by `provider` (`ses`, `http`) and `outcome`: the
/// status they set (`delivered`, `bounced`, `complained`, `failed`),
/// `event` (an update that sets no status), `duplicate`, `pending` (kept
/// for a later match; counted again when matched), `unmatched` (dropped
/// after `receipts.match_for_secs`), `ignored` or `unreadable`.
pub const RECEIPTS_TOTAL: &str = "fairlane_receipts_total";
/// Messages not sent because the address is on the tenant's suppression
/// list, by `channel`.
pub const SUPPRESSED_TOTAL: &str = "fairlane_messages_suppressed_total";
/// Webhook calls, by `result`: `delivered` (2xx), `rejected` (another
/// status), `unreachable` (connection failed or timed out), `not_allowed`
/// (not made: the URL or the address it resolved to is not allowed),
/// `gave_up` (the event failed for `webhooks.disable_after_secs`).
pub const WEBHOOK_ATTEMPTS_TOTAL: &str = "fairlane_webhook_attempts_total";
/// Webhook calls made (HTTP requests, whatever their answer): with
/// batching endpoints one call carries several events' attempts.
pub const WEBHOOK_CALLS_TOTAL: &str = "fairlane_webhook_calls_total";
/// Seconds from an event to its webhook's successful delivery.
pub const WEBHOOK_LAG_SECONDS: &str = "fairlane_webhook_lag_seconds";
/// Webhook calls due and not yet made, all tenants together (the same
/// fleet-wide figure on every instance), sampled every few seconds.
pub const WEBHOOK_CALLS_DUE: &str = "fairlane_webhook_calls_due";
/// Age of the oldest event whose webhook call is due and not yet made.
pub const WEBHOOK_OLDEST_DUE_AGE_SECONDS: &str = "fairlane_webhook_oldest_due_age_seconds";
/// Pauses of a tenant's webhook calls after failed calls in a row.
pub const WEBHOOK_ENDPOINT_PAUSES_TOTAL: &str = "fairlane_webhook_endpoint_pauses_total";
/// Webhook endpoints disabled after failing for
/// `webhooks.disable_after_secs`.
pub const WEBHOOKS_DISABLED_TOTAL: &str = "fairlane_webhooks_disabled_total";

/// Receipt outcomes, as labelled in [`RECEIPTS_TOTAL`].
pub const RECEIPT_OUTCOMES: &[&str] = &[
    "delivered",
    "bounced",
    "complained",
    "failed",
    "event",
    "duplicate",
    "pending",
    "unmatched",
    "ignored",
    "unreadable",
];

/// Webhook call results, as labelled in [`WEBHOOK_ATTEMPTS_TOTAL`].
pub const WEBHOOK_RESULTS: &[&str] = &[
    "delivered",
    "rejected",
    "unreachable",
    "not_allowed",
    "gave_up",
];

/// Raises a gauge by one for as long as it lives.
pub struct GaugeHold(metrics::Gauge);

impl GaugeHold {
    pub fn new(gauge: metrics::Gauge) -> Self {
        gauge.increment(1.0);
        GaugeHold(gauge)
    }
}

impl Drop for GaugeHold {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the global recorder (first call) and returns its handle. Every
/// metric carries the label `instance` (the first caller's), so the series
/// of several instances scraped into one Prometheus stay apart.
pub fn install(instance: &str) -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let buckets = [
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ];
            let builder = PrometheusBuilder::new()
                .set_buckets(&buckets)
                .expect("bucket list is not empty")
                .add_global_label("instance", instance);
            let handle = match builder.install_recorder() {
                Ok(handle) => handle,
                // Another recorder is already global (a host program's): keep
                // ours local so /metrics still renders what we record.
                Err(_) => PrometheusBuilder::new().build_recorder().handle(),
            };
            describe_and_register();
            handle
        })
        .clone()
}

/// Describes every metric (`# HELP`, with its unit) and registers every
/// counter and gauge at zero for the labels known up front (lanes,
/// channels, priorities, reasons, operations), so `/metrics` lists every
/// documented name from the first scrape, not only after a first event.
fn describe_and_register() {
    describe_pipeline();
    describe_around_the_pipeline();
    register_known_labels();
}

/// `# HELP` and units of the messages' own path: accepts, deliveries,
/// deferrals, the queues and the providers.
fn describe_pipeline() {
    use metrics::{Unit, describe_counter, describe_gauge};
    describe_counter!(
        ACCEPTED_TOTAL,
        Unit::Count,
        "Messages accepted (202), by lane and channel."
    );
    describe_counter!(
        DELIVERED_TOTAL,
        Unit::Count,
        "Messages the provider accepted, by lane and channel."
    );
    describe_counter!(
        RETRIED_TOTAL,
        Unit::Count,
        "Transient failures scheduled for another attempt, by lane and channel."
    );
    describe_counter!(
        DEAD_LETTERED_TOTAL,
        Unit::Count,
        "Messages moved to a dead-letter queue, by lane and channel."
    );
    describe_counter!(
        DEFERRED_TOTAL,
        Unit::Count,
        "Messages put back without an attempt, by lane and reason (paused, disabled, duplicate, throttled, store)."
    );
    describe_counter!(
        REJECTED_TOTAL,
        Unit::Count,
        "Sends refused: 429 by reason rate, quota or lane; 503 by reason queue (SQS did not take the message)."
    );
    describe_counter!(
        SQS_CALLS_TOTAL,
        Unit::Count,
        "SQS API calls started, by operation (SQS mode only; what SQS bills)."
    );
    describe_counter!(
        ATTENTION_SIGNALS_TOTAL,
        Unit::Count,
        "Attention signals of dedicated tenant queues, by lane and event (published, consumed, dropped)."
    );
    describe_counter!(
        ATTENTION_SLICES_TOTAL,
        Unit::Count,
        "Slices worked on dedicated tenant queues, by lane and why each ended (empty, messages, time, shutdown)."
    );
    describe_counter!(
        PROVIDER_PAUSES_TOTAL,
        Unit::Count,
        "Provider gate pauses after a 429 with Retry-After, by provider (every send of that provider waits)."
    );
    describe_counter!(
        BREAKER_OPENS_TOTAL,
        Unit::Count,
        "Provider circuit breaker openings after a run of failed calls, by provider (no call to it while open)."
    );
    describe_counter!(
        PROVIDER_DOWNS_TOTAL,
        Unit::Count,
        "Times a provider was marked down by its recent failures or latency (providers.health), by provider."
    );
    describe_gauge!(
        PROVIDER_SHARE,
        Unit::Count,
        "Share of its channel's new messages a provider gets now (weight x health, 0 while paused), by channel and provider."
    );
    describe_counter!(
        CONNECTIONS_SHED_TOTAL,
        Unit::Count,
        "Connections shed at server.max_connections: evicted (oldest waiting for a request head) or refused (503, all busy)."
    );
    describe_counter!(
        HANDLER_PANICS_TOTAL,
        Unit::Count,
        "Requests whose handler panicked, answered 500 (each one is a bug; the log has the panic)."
    );
    describe_gauge!(
        DEDICATED_QUEUES_BACKLOGGED,
        Unit::Count,
        "Dedicated tenant queues this process knows to hold backlog, by lane."
    );
}

/// `# HELP` and units of the gates' own fault counters.
fn describe_gate_faults() {
    use metrics::{Unit, describe_counter};
    describe_counter!(
        GATE_STALLS_TOTAL,
        Unit::Count,
        "Stalls of a provider gate found and repaired by its watchdog (callers waiting, the head of the line not acting when due), by channel."
    );
    describe_counter!(
        GATE_STALE_GRANTS_TOTAL,
        Unit::Count,
        "Fleet-wide provider tokens given up because their call started more than 100 ms after the grant; the call took a fresh one."
    );
}

/// `# HELP` and units of what runs beside the path: receipts, webhooks,
/// retention, the lanes' figures, the gates and the limits' backend.
fn describe_around_the_pipeline() {
    describe_receipts_and_webhooks();
    describe_store_and_retention();
    describe_lanes_gates_and_limits();
}

/// `# HELP` and units of receipts, suppressions and webhook calls.
fn describe_receipts_and_webhooks() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        RECEIPTS_TOTAL,
        Unit::Count,
        "Provider receipts, by provider and outcome (the status set, event, duplicate, pending, unmatched, ignored, unreadable)."
    );
    describe_counter!(
        SUPPRESSED_TOTAL,
        Unit::Count,
        "Messages not sent because the address is on the tenant's suppression list, by channel."
    );
    describe_counter!(
        WEBHOOK_ATTEMPTS_TOTAL,
        Unit::Count,
        "Webhook calls, by result (delivered, rejected, unreachable, gave_up)."
    );
    describe_counter!(
        WEBHOOK_CALLS_TOTAL,
        Unit::Count,
        "Webhook calls made (HTTP requests); a batch carries several events."
    );
    describe_histogram!(
        WEBHOOK_LAG_SECONDS,
        Unit::Seconds,
        "Time from an event to its webhook's successful delivery."
    );
    describe_gauge!(
        WEBHOOK_CALLS_DUE,
        Unit::Count,
        "Webhook calls due and not yet made, all tenants (fleet-wide), sampled every 5 s."
    );
    describe_gauge!(
        WEBHOOK_OLDEST_DUE_AGE_SECONDS,
        Unit::Seconds,
        "Age of the oldest event whose webhook call is due and not yet made (0 when none), sampled every 5 s."
    );
    describe_counter!(
        WEBHOOK_ENDPOINT_PAUSES_TOTAL,
        Unit::Count,
        "Pauses of a tenant's webhook calls after 5 failed calls in a row (or a failed probe after a pause)."
    );
}

/// `# HELP` and units of the store's writer, the audit log and retention.
fn describe_store_and_retention() {
    use metrics::{Unit, describe_counter};
    describe_counter!(
        STORE_COMMITS_TOTAL,
        Unit::Count,
        "Transactions the SQLite store's writer committed."
    );
    describe_counter!(
        STORE_ROWS_WRITTEN_TOTAL,
        Unit::Count,
        "Rows the SQLite store's committed transactions inserted, updated or deleted."
    );
    describe_counter!(
        AUDIT_WRITE_FAILURES_TOTAL,
        Unit::Count,
        "Admin changes that were made but whose audit log entry could not be written."
    );
    describe_counter!(
        RETENTION_RUNS_TOTAL,
        Unit::Count,
        "Retention runs by outcome: done, skipped (another instance was running one), failed."
    );
    describe_counter!(
        RETENTION_ERASED_TOTAL,
        Unit::Count,
        "Messages whose personal data retention erased."
    );
    describe_counter!(
        RETENTION_QUEUE_ERASED_TOTAL,
        Unit::Count,
        "Queue copies (dead letters, set-aside and delayed rows) retention removed."
    );
    describe_counter!(
        WEBHOOKS_DISABLED_TOTAL,
        Unit::Count,
        "Webhook endpoints disabled after failing for webhooks.disable_after_secs."
    );
}

/// `# HELP` and units of the lanes' figures, the outbox, provider calls,
/// the gates, the limits' backend and the trace exporter.
fn describe_lanes_gates_and_limits() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_gauge!(
        LANE_DEPTH,
        Unit::Count,
        "Messages waiting in a lane (visible or delayed), by lane."
    );
    describe_gauge!(
        LANE_IN_FLIGHT,
        Unit::Count,
        "Messages received and not yet deleted, by lane."
    );
    describe_gauge!(
        LANE_OLDEST_AGE_SECONDS,
        Unit::Seconds,
        "Age of the oldest message in a lane, by lane."
    );
    describe_gauge!(
        LANE_DLQ_DEPTH,
        Unit::Count,
        "Messages in a lane's dead-letter queue, by lane."
    );
    describe_gauge!(
        OUTBOX_PENDING,
        Unit::Count,
        "SQS mode: messages accepted and not yet in SQS (outbox rows), by lane."
    );
    describe_counter!(
        OUTBOX_RELAY_FAILURES_TOTAL,
        Unit::Count,
        "SQS mode: SendMessageBatch calls of the outbox relay that failed (their messages stay in the outbox and are retried), by lane."
    );
    describe_histogram!(
        PROVIDER_CALL_SECONDS,
        Unit::Seconds,
        "Provider call latency, by provider and outcome (sent, permanent, transient, throttled)."
    );
    describe_histogram!(
        GATE_WAIT_SECONDS,
        Unit::Seconds,
        "Time waited for a provider token, by channel and the message's priority."
    );
    describe_gate_faults();
    describe_gauge!(
        MESSAGES_WAITING,
        Unit::Count,
        "Messages a consumer holds that wait, by lane, priority and stage (token: in a provider gate's line; parked: their tenant is at its max_in_flight)."
    );
    describe_gauge!(
        LIMITS_BACKEND_UP,
        "1 while limits are counted where configured, 0 while this instance runs on its local share because Redis is unreachable."
    );
    describe_counter!(
        REDIS_ERRORS_TOTAL,
        Unit::Count,
        "Redis calls of the limits that failed or timed out, by operation."
    );
    describe_counter!(
        TRACE_SPANS_DROPPED_TOTAL,
        Unit::Count,
        "Finished spans dropped because the trace exporter's queue held telemetry.max_queued_bytes already."
    );
    describe_gauge!(
        LIMITS_LIVE_INSTANCES,
        Unit::Count,
        "Instances with a fresh heartbeat in Redis, as this instance last saw it (limits.backend = redis only)."
    );
}

/// The lanes, channels and priorities every labelled series is made for.
const LANES: [&str; 2] = ["fast", "slow"];
const CHANNELS: [&str; 2] = ["email", "sms"];
const PRIORITIES: [&str; 3] = ["high", "normal", "low"];

/// Every counter and gauge of a lane at zero, by channel, reason,
/// priority and stage.
fn register_lane_labels() {
    for lane in LANES {
        for channel in CHANNELS {
            for name in [
                ACCEPTED_TOTAL,
                DELIVERED_TOTAL,
                RETRIED_TOTAL,
                DEAD_LETTERED_TOTAL,
            ] {
                metrics::counter!(name, "lane" => lane, "channel" => channel).increment(0);
            }
        }
        for reason in ["paused", "disabled", "duplicate", "throttled", "store"] {
            metrics::counter!(DEFERRED_TOTAL, "lane" => lane, "reason" => reason).increment(0);
        }
        for name in [
            LANE_DEPTH,
            LANE_IN_FLIGHT,
            LANE_OLDEST_AGE_SECONDS,
            LANE_DLQ_DEPTH,
            OUTBOX_PENDING,
        ] {
            metrics::gauge!(name, "lane" => lane).increment(0.0);
        }
        metrics::counter!(OUTBOX_RELAY_FAILURES_TOTAL, "lane" => lane).increment(0);
        for priority in PRIORITIES {
            for stage in ["token", "parked"] {
                metrics::gauge!(MESSAGES_WAITING, "lane" => lane, "priority" => priority, "stage" => stage)
                    .increment(0.0);
            }
        }
    }
}

/// Every counter and gauge at zero for the labels known up front (lanes,
/// channels, priorities, reasons, operations).
fn register_known_labels() {
    register_lane_labels();
    for reason in ["rate", "quota", "lane", "batches", "writes", "reads"] {
        metrics::counter!(REJECTED_TOTAL, "reason" => reason).increment(0);
    }
    for operation in [
        "SendMessageBatch",
        "ReceiveMessage",
        "DeleteMessageBatch",
        "ChangeMessageVisibilityBatch",
        "GetQueueAttributes",
    ] {
        metrics::counter!(SQS_CALLS_TOTAL, "operation" => operation).increment(0);
    }
    for operation in [
        "admit",
        "seed",
        "release",
        "reconcile",
        "gate",
        "writes",
        "heartbeat",
    ] {
        metrics::counter!(REDIS_ERRORS_TOTAL, "operation" => operation).increment(0);
    }
    metrics::gauge!(LIMITS_LIVE_INSTANCES).increment(0.0);
    metrics::counter!(TRACE_SPANS_DROPPED_TOTAL).increment(0);
    for action in ["evicted", "refused"] {
        metrics::counter!(CONNECTIONS_SHED_TOTAL, "action" => action).increment(0);
    }
    metrics::counter!(HANDLER_PANICS_TOTAL).increment(0);
    for lane in LANES {
        for event in ["published", "consumed", "dropped"] {
            metrics::counter!(ATTENTION_SIGNALS_TOTAL, "lane" => lane, "event" => event)
                .increment(0);
        }
        for ended in ["empty", "messages", "time", "shutdown"] {
            metrics::counter!(ATTENTION_SLICES_TOTAL, "lane" => lane, "ended" => ended)
                .increment(0);
        }
        metrics::gauge!(DEDICATED_QUEUES_BACKLOGGED, "lane" => lane).increment(0.0);
    }
    for channel in CHANNELS {
        metrics::counter!(SUPPRESSED_TOTAL, "channel" => channel).increment(0);
        metrics::counter!(GATE_STALLS_TOTAL, "channel" => channel).increment(0);
    }
    for result in WEBHOOK_RESULTS {
        metrics::counter!(WEBHOOK_ATTEMPTS_TOTAL, "result" => *result).increment(0);
    }
    metrics::counter!(WEBHOOKS_DISABLED_TOTAL).increment(0);
    metrics::counter!(GATE_STALE_GRANTS_TOTAL).increment(0);
    for outcome in ["done", "skipped", "failed"] {
        metrics::counter!(RETENTION_RUNS_TOTAL, "outcome" => outcome).increment(0);
    }
    metrics::counter!(RETENTION_ERASED_TOTAL).increment(0);
    metrics::counter!(AUDIT_WRITE_FAILURES_TOTAL).increment(0);
    metrics::counter!(STORE_COMMITS_TOTAL).increment(0);
    metrics::counter!(STORE_ROWS_WRITTEN_TOTAL).increment(0);
    metrics::counter!(RETENTION_QUEUE_ERASED_TOTAL).increment(0);
    metrics::counter!(WEBHOOK_ENDPOINT_PAUSES_TOTAL).increment(0);
    metrics::counter!(WEBHOOK_CALLS_TOTAL).increment(0);
    let _ = metrics::histogram!(WEBHOOK_LAG_SECONDS);
    metrics::gauge!(WEBHOOK_CALLS_DUE).set(0.0);
    metrics::gauge!(WEBHOOK_OLDEST_DUE_AGE_SECONDS).set(0.0);
    for provider in ["ses", "http", "log"] {
        for outcome in ["sent", "permanent", "transient", "throttled"] {
            let _ = metrics::histogram!(PROVIDER_CALL_SECONDS, "provider" => provider, "outcome" => outcome);
        }
    }
    for channel in CHANNELS {
        for priority in PRIORITIES {
            let _ = metrics::histogram!(GATE_WAIT_SECONDS, "channel" => channel, "priority" => priority);
        }
    }
}
