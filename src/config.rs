//! Typed settings, layered: built-in `config/default.toml` ← `--config FILE`
//! ← environment variables `FAIRLANE__SECTION__KEY`.
//!
//! Every struct rejects unknown keys, so a typo in a file or a variable is an
//! error at start-up instead of a silently ignored setting. Secrets live in
//! [`SecretString`] so they never reach a log line through `Debug`.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use figment::Figment;
use figment::providers::{Format, Toml};
use ipnet::IpNet;
use schemars::JsonSchema;
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use crate::model::Lane;

mod providers;
pub use providers::{
    HttpSmsSettings, LogSettings, PoolEntry, ProviderHealthSettings, ProviderKind,
    ProviderSettings, ProvidersSettings, SesSettings,
};

/// The built-in defaults, compiled into the binary so `fairlane serve` runs
/// with no file at all.
pub const DEFAULT_TOML: &str = include_str!("../config/default.toml");

/// Prefix of environment variables that override settings.
pub const ENV_PREFIX: &str = "FAIRLANE__";

/// The longest a provider's bucket may take to fill up (`burst /
/// rate_per_second`): a year. Longer is a typo, and would overflow the
/// gate's nanosecond clock (584 years) in its arithmetic.
pub const MAX_PROVIDER_REFILL_SECS: f64 = 365.0 * 24.0 * 3600.0;
/// The longest a provider's gate pauses: a provider's `Retry-After` above
/// it is cut to it (a WARN line says so), and a circuit breaker may not be
/// configured to stay open longer (`breaker_open_ms`,
/// `breaker_max_open_secs`). A provider's header cannot stop delivery for
/// every tenant for longer than this, nor overflow a clock.
pub const MAX_PROVIDER_PAUSE: std::time::Duration = std::time::Duration::from_secs(3600);

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// The HTTP server: address, admin token, body sizes, timeouts and
    /// connection limits.
    pub server: ServerSettings,
    /// Where state lives: the SQLite file or a PostgreSQL database.
    pub storage: StorageSettings,
    /// Which queue carries the lanes: the embedded one or Amazon SQS.
    pub queue: QueueSettings,
    /// The two lanes, `fast` (paid plans) and `slow` (free plans).
    pub lanes: LanesSettings,
    /// Retries of failed provider calls.
    pub retry: RetrySettings,
    /// The lane consumers and the workers of dedicated tenant queues.
    pub consumers: ConsumerSettings,
    /// Email and SMS providers: kinds, credentials, rates, circuit
    /// breakers, pools and their health.
    pub providers: ProvidersSettings,
    /// Where tenant limits and provider rates are counted: in this process,
    /// or in Redis for every instance together.
    #[serde(default)]
    pub limits: LimitsSettings,
    /// Receipts: how long one whose message is not found yet is kept.
    #[serde(default)]
    pub receipts: ReceiptSettings,
    /// Tenant webhooks: timeouts, concurrency, retries.
    #[serde(default)]
    pub webhooks: WebhookSettings,
    /// How long messages' personal data is kept, and how often the
    /// retention job erases what has passed it.
    #[serde(default)]
    pub retention: RetentionSettings,
    /// What the log may contain (levels and format come from `RUST_LOG`
    /// and `FAIRLANE_LOG_FORMAT`, read before the settings).
    #[serde(default)]
    pub logging: LoggingSettings,
    /// Traces (OpenTelemetry, OTLP over HTTP): off unless an endpoint is
    /// set.
    #[serde(default)]
    pub telemetry: TelemetrySettings,
    /// Built-in plans. The admin API can add more; an admin `PUT` of a plan
    /// named here wins over this file from then on.
    #[serde(default)]
    pub plans: BTreeMap<String, PlanSettings>,
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServerSettings {
    /// Address the API binds; port 0 picks a free port.
    pub listen: SocketAddr,
    /// Admin bearer token (at least 16 characters). When absent, one is
    /// generated on first start, printed once in the log, and only its
    /// SHA-256 hash is stored.
    #[serde(default)]
    #[schemars(with = "Option<String>")]
    pub admin_token: Option<SecretString>,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// Largest body of a batch send (up to 1,000 messages; 413 beyond).
    pub max_batch_body_bytes: usize,
    /// Upper bound on the time a request may take (reading its body
    /// included); a longer one is answered 503.
    pub request_timeout_secs: u64,
    /// A connection must send a whole request head within this many seconds
    /// of opening or of going idle after a response, or it is closed
    /// (slow or idle clients). Default 10.
    #[serde(default = "default_header_read_timeout_secs")]
    pub header_read_timeout_secs: u64,
    /// Longest a send waits for its durable write (the commit of its status
    /// and queue rows) before it answers 503 with `Retry-After`: a stalled
    /// store then costs the client this long, not its own timeout. The
    /// write goes on and may still commit; a retry under the same
    /// `Idempotency-Key` is answered 409 until it has ended, then with the
    /// message if it committed (the book's "Errors and idempotency").
    /// Default 5,000 ms.
    #[serde(default = "default_accept_deadline_ms")]
    pub accept_deadline_ms: u64,
    /// Most connections open at once; 0 (default): what the open-file
    /// limit leaves after a reserve of 128. At the cap the oldest
    /// connection waiting for a request head makes room; when all are busy,
    /// a new one gets 503.
    #[serde(default)]
    pub max_connections: usize,
    /// Most requests in progress at once on one HTTP/2 connection, so
    /// `max_connections × http2_max_streams` bounds the requests in
    /// progress (hyper alone would allow 200 per connection). Default 16.
    #[serde(default = "default_http2_max_streams")]
    pub http2_max_streams: u32,
    /// Most batch sends one tenant may have in progress at once; one more
    /// is answered 429. Default 2.
    #[serde(default = "default_max_batches_per_tenant")]
    pub max_batches_per_tenant: usize,
    /// This instance's name among several: the `instance` label of every
    /// metric. Unset: the host name and process id.
    #[serde(default)]
    pub instance: Option<String>,
    /// The URL clients and providers reach this service at, e.g.
    /// `https://notify.example.com`. Set, SMS requests carry a
    /// `StatusCallback` to `{public_url}/v1/callbacks/sms` so the provider
    /// reports delivery; unset, SMS stay `sent`.
    #[serde(default)]
    pub public_url: Option<String>,
    /// Days an email's one-click unsubscribe link is honoured after it was
    /// sent. Default 90; 30 to 3650 (CAN-SPAM asks that an opt-out work
    /// for 30 days after the mail).
    #[serde(default = "default_unsubscribe_link_days")]
    pub unsubscribe_link_days: u32,
}

fn default_unsubscribe_link_days() -> u32 {
    90
}

fn default_accept_deadline_ms() -> u64 {
    5_000
}

fn default_header_read_timeout_secs() -> u64 {
    10
}

fn default_http2_max_streams() -> u32 {
    16
}

fn default_max_batches_per_tenant() -> usize {
    2
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StorageSettings {
    /// `sqlite://PATH` (relative paths are relative to the working
    /// directory; one instance; created and migrated on first start) or
    /// `postgres://user:password@host:port/database` (state shared by
    /// several instances, migrated at start-up; with
    /// `queue.backend = "postgres"` or `"sqs"`).
    pub url: String,
    /// fsync every commit group (power-loss durability) instead of relying on
    /// the OS to write the WAL out (crash durability); see the book's
    /// "Durability".
    pub fsync: bool,
    /// Most pieces of work (accepts, receives, status changes, deletes)
    /// committed in one transaction by the store writer.
    pub max_group: usize,
    /// SQLite: the largest the file may grow, in MiB (0: no cap, the disk
    /// is the limit). Past it, writes fail as on a full disk: sends answer
    /// 503 with Retry-After and `/readyz` says why, until deliveries make
    /// room.
    #[serde(default)]
    pub max_size_mb: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum QueueBackend {
    Embedded,
    Sqs,
    Postgres,
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct QueueSettings {
    /// `embedded` (a durable queue in the SQLite file), `postgres` (the
    /// lanes in the PostgreSQL store: several instances without AWS) or
    /// `sqs` (Amazon SQS, or an SQS-compatible server).
    pub backend: QueueBackend,
    /// Amazon SQS, used with `backend = "sqs"`.
    pub sqs: SqsSettings,
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SqsSettings {
    /// Endpoint override (a local SQS-compatible server); omit for AWS.
    #[serde(default)]
    pub endpoint_url: Option<String>,
    /// Region of the queues.
    pub region: String,
    /// Queue names are `{prefix}-{lane}-high`, `{prefix}-{lane}` (normal),
    /// `{prefix}-{lane}-low` and their shared `{prefix}-{lane}-dlq`.
    pub queue_prefix: String,
    /// Create missing queues at start-up instead of failing.
    pub create_queues: bool,
    /// Static access key id, for local SQS-compatible servers; leave unset
    /// on AWS so the standard credential chain (env, profile, role) is used.
    #[serde(default)]
    pub access_key_id: Option<String>,
    /// The secret belonging to `access_key_id`.
    #[serde(default)]
    #[schemars(with = "Option<String>")]
    pub secret_access_key: Option<SecretString>,
    /// How long the outbox relay and the consumers' deleter wait for more
    /// entries before a batch call (SendMessageBatch, DeleteMessageBatch)
    /// goes out with fewer than ten (at most 1000).
    pub batch_window_ms: u64,
    /// Outbox rows older than this that no relay of this instance holds (an
    /// instance died before its relay sent them, or its relay was full) are
    /// sent by the sweeper; at start-up every row is on SQLite.
    pub outbox_sweep_secs: u64,
    /// Queue depths (GetQueueAttributes, four calls per lane) are refreshed
    /// this often.
    pub stats_interval_secs: u64,
    /// How many received messages a lane's consumer may hold (invisible in
    /// SQS) while it looks past the messages of tenants at their
    /// `max_in_flight` for another tenant's; also bounded by 16 MiB of
    /// message bodies. 10 to 100000 (see the book's "Priority and
    /// fairness").
    #[serde(default = "default_look_ahead_messages")]
    pub look_ahead_messages: usize,
}

fn default_look_ahead_messages() -> usize {
    5_000
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LanesSettings {
    /// The fast lane, for paid plans.
    pub fast: LaneSettings,
    /// The slow lane, for free plans.
    pub slow: LaneSettings,
}

impl LanesSettings {
    pub fn get(&self, lane: Lane) -> &LaneSettings {
        match lane {
            Lane::Fast => &self.fast,
            Lane::Slow => &self.slow,
        }
    }
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LaneSettings {
    /// Messages processed at once by this lane's consumer.
    pub concurrency: usize,
    /// Backlog (waiting, delayed and held by a consumer) at which sends to
    /// this lane answer 429.
    pub high_water_mark: u64,
    /// Invisibility of a received message before it is delivered again.
    pub visibility_timeout_secs: u64,
    /// Receives before a message moves to the lane's DLQ.
    pub max_receive_count: u32,
    /// Least share of received messages that goes to lower priority classes
    /// while they have messages waiting, so a flood of high-priority
    /// messages slows normal and low ones but never stops them (0 = strict
    /// priority, 0.5 at most). Default 0.1.
    #[serde(default = "default_low_priority_share")]
    pub low_priority_share: f64,
}

fn default_low_priority_share() -> f64 {
    0.1
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetrySettings {
    /// Provider calls before a message is dead-lettered.
    pub max_attempts: u32,
    /// First wait before a retry; the full-jitter backoff doubles it with
    /// each attempt.
    pub base_delay_ms: u64,
    /// Longest wait between two attempts (at most 900, the SQS delay
    /// limit).
    pub max_delay_secs: u64,
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ConsumerSettings {
    /// Run the lane consumers in `fairlane serve` (false: accept only).
    pub enabled: bool,
    /// Longest long-poll of one receive.
    pub receive_wait_secs: u64,
    /// How long a message of a paused or disabled tenant is put back for
    /// before it is looked at again.
    pub hold_delay_secs: u64,
    /// How long a second copy of a message this process is still sending is
    /// put back for. (The name is kept from when messages of a tenant at its
    /// `max_in_flight` were put back too; they are parked now.)
    pub tenant_cap_delay_secs: u64,
    /// How long shutdown waits for sends in flight.
    pub shutdown_grace_secs: u64,
    /// Attention workers per lane: each takes one dedicated tenant queue's
    /// signal at a time and works a slice of that queue. Default 2.
    #[serde(default = "default_attention_workers")]
    pub attention_workers: usize,
    /// Most messages one slice of a dedicated queue takes before the
    /// worker moves on (and signals again if backlog remains). Default 100.
    #[serde(default = "default_slice_max_messages")]
    pub slice_max_messages: usize,
    /// Longest time one slice works a dedicated queue. Default 5.
    #[serde(default = "default_slice_max_secs")]
    pub slice_max_secs: u64,
    /// How often each lane looks again at the dedicated queues written or
    /// worked since its last look and signals those that still hold
    /// backlog (SQS, where a signal is not tied to its queue in one
    /// transaction). Idle tenants cost nothing. Default 30.
    #[serde(default = "default_attention_sweep_secs")]
    pub attention_sweep_secs: u64,
}

fn default_attention_sweep_secs() -> u64 {
    30
}

fn default_attention_workers() -> usize {
    2
}

fn default_slice_max_messages() -> usize {
    100
}

fn default_slice_max_secs() -> u64 {
    5
}

/// `[receipts]`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ReceiptSettings {
    /// A receipt for a provider id fairlane has not recorded yet (the
    /// provider can call back before the `sent` commit) is matched again
    /// for this long, then dropped with a warning. Default 600.
    pub match_for_secs: u64,
}

impl Default for ReceiptSettings {
    fn default() -> Self {
        ReceiptSettings {
            match_for_secs: 600,
        }
    }
}

/// `[webhooks]`: calls to tenants' webhook endpoints.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct WebhookSettings {
    /// Bound on one call, connection included. Default 10000.
    pub timeout_ms: u64,
    /// Calls to one tenant's endpoint at once to begin with, and again
    /// after a failed or slow call: a slow or dead endpoint holds only its
    /// own tenant's calls. Default 4.
    pub concurrency_per_tenant: usize,
    /// How far a healthy endpoint's calls at once grow while its tenant has
    /// calls waiting: one more per call answered 2xx within a second,
    /// halved by a failed or slower one. Default 32.
    pub max_concurrency_per_tenant: usize,
    /// Calls at once for all tenants together. Default 64.
    pub concurrency: usize,
    /// First retry after about this long, doubling (with jitter) up to
    /// `retry_max_secs`. Default 5000.
    pub retry_base_ms: u64,
    /// Longest wait between two tries. Default 3600.
    pub retry_max_secs: u64,
    /// An endpoint failing for this long (no success since its first
    /// failure) is disabled: its events are kept as failed until an admin
    /// redrives them. Default 86400 (24 h).
    pub disable_after_secs: u64,
    /// How often due calls are looked for besides the moments that make
    /// one due on this instance (a message sent or failed, a call ending):
    /// retries that came due, receipts' events, another instance's events.
    /// Default 500.
    pub poll_interval_ms: u64,
    /// Accept `http://` endpoints as well as `https://`. For development
    /// against a local receiver: over plain HTTP anyone on the path reads
    /// the events. Default false.
    pub allow_http: bool,
    /// Internal addresses endpoints may have anyway, as CIDR ranges
    /// (`"10.1.2.0/24"`, `"fd00:1::/64"`) or single addresses
    /// (`"127.0.0.1"`). Loopback, private, link-local (cloud metadata),
    /// carrier-grade NAT, multicast and reserved addresses are otherwise
    /// refused, when a URL is set and again when it is called, so a tenant
    /// cannot make fairlane call services inside its network. Default none.
    #[serde(deserialize_with = "ip_ranges")]
    #[schemars(with = "Vec<String>")]
    pub allow_private: Vec<IpNet>,
    /// A PEM file of certificate authorities that endpoints' certificates
    /// may also chain to, besides the system's: for endpoints inside your
    /// network (see `allow_private`) signed by an internal CA. Read at
    /// start; a file that cannot be read or holds no certificate stops the
    /// start. Default none.
    pub ca_file: Option<PathBuf>,
}

/// `webhooks.allow_private`: CIDR ranges, or single addresses as one-address
/// ranges.
fn ip_ranges<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Vec<IpNet>, D::Error> {
    let given = Vec::<String>::deserialize(deserializer)?;
    given
        .iter()
        .map(|text| {
            let text = text.trim();
            text.parse::<IpNet>()
                .or_else(|_| text.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| {
                    serde::de::Error::custom(format!(
                        "{text:?} is not a CIDR range or an IP address, like \"10.1.2.0/24\", \"fd00::/8\" or \"127.0.0.1\""
                    ))
                })
        })
        .collect()
}

impl Default for WebhookSettings {
    fn default() -> Self {
        WebhookSettings {
            timeout_ms: 10_000,
            concurrency_per_tenant: 4,
            max_concurrency_per_tenant: 32,
            concurrency: 64,
            retry_base_ms: 5_000,
            retry_max_secs: 3_600,
            disable_after_secs: 86_400,
            poll_interval_ms: 500,
            allow_http: false,
            allow_private: Vec::new(),
            ca_file: None,
        }
    }
}

/// `[logging]`: personal data in log lines.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct LoggingSettings {
    /// Put recipients' addresses (email addresses, phone numbers) into the
    /// INFO lines of sent and dead-lettered messages. Off by default: an
    /// address is personal data, and logs are usually kept longer and read
    /// by more people than the status store. Message bodies are never
    /// logged by fairlane itself (the `log` provider, meant for
    /// development, writes whole messages to its own output).
    pub log_addresses: bool,
}

/// `[telemetry]`: OpenTelemetry traces of a message's way through the
/// service (the book's "Traces"). Spans carry ids, tenants, lanes, providers
/// and outcomes; never a message body or a recipient's address.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetrySettings {
    /// The collector's OTLP/HTTP base address (`http://collector:4318`);
    /// spans go to `{otlp_endpoint}/v1/traces` as protobuf. Empty: no
    /// traces, no exporter, no `traceparent` in queued messages.
    pub otlp_endpoint: String,
    /// Fraction of new traces kept, 0.0-1.0. A trace begun by a caller's
    /// `traceparent` or by a queued message follows that decision.
    pub sample_ratio: f64,
    /// The `service.name` resource attribute. `OTEL_RESOURCE_ATTRIBUTES`
    /// adds others (e.g. `service.instance.id=api-1`).
    pub service_name: String,
    /// How often finished spans are sent, in milliseconds.
    pub export_interval_ms: u64,
    /// Most finished spans held for export; beyond it new ones are dropped
    /// (and counted by the SDK), never waited for.
    pub max_queued_spans: usize,
    /// Most bytes of finished spans held for export (estimated from their
    /// names, attributes, events and links); beyond it new ones are
    /// dropped and counted in `fairlane_trace_spans_dropped_total`.
    pub max_queued_bytes: usize,
    /// Whose `traceparent` header a request's span continues, taking the
    /// caller's sampling decision with it: `authenticated` (default: a
    /// request that presents a valid API key or the admin token), `always`
    /// or `never`. Any other request starts a trace of its own, kept by
    /// `sample_ratio`, with a link to the caller's context; so an anonymous
    /// client cannot force spans to be exported.
    pub traceparent: TraceparentTrust,
}

/// Whose incoming `traceparent` is continued (`telemetry.traceparent`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum TraceparentTrust {
    /// Callers with a valid API key or the admin token.
    #[default]
    Authenticated,
    /// Every caller.
    Always,
    /// No caller: every request starts its own trace.
    Never,
}

impl TelemetrySettings {
    fn validate(&self) -> anyhow::Result<()> {
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            bail!("telemetry.sample_ratio must be between 0.0 and 1.0");
        }
        let endpoint = self.otlp_endpoint.as_str();
        let http = endpoint.starts_with("http://") || endpoint.starts_with("https://");
        if !endpoint.is_empty() && !http {
            bail!("telemetry.otlp_endpoint must be an http:// or https:// address, or empty");
        }
        if self.export_interval_ms == 0 || self.max_queued_spans == 0 {
            bail!("telemetry.export_interval_ms and telemetry.max_queued_spans must be at least 1");
        }
        if self.max_queued_bytes < 4096 {
            bail!("telemetry.max_queued_bytes must be at least 4096");
        }
        Ok(())
    }
}

impl Default for TelemetrySettings {
    fn default() -> Self {
        TelemetrySettings {
            otlp_endpoint: String::new(),
            sample_ratio: 1.0,
            service_name: "fairlane".into(),
            export_interval_ms: 5000,
            max_queued_spans: 8192,
            max_queued_bytes: 16 * 1024 * 1024,
            traceparent: TraceparentTrust::Authenticated,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum LimitsBackend {
    /// Each instance counts on its own (one instance, or tests).
    #[default]
    Local,
    /// Counted in Redis, so several instances behind a load balancer share
    /// each tenant's rate and quota and each provider's rate.
    Redis,
}

/// `[retention]`: once a message is settled (sent, delivered, failed,
/// cancelled, …) and older than its tenant's retention, its body,
/// recipient, reference, metadata and error details are erased.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetentionSettings {
    /// Retention of tenants that set none, in days (1-90). Default 7.
    #[serde(default = "default_retention_days")]
    pub default_days: u16,
    /// Seconds between runs of the retention job (one instance runs it at
    /// a time; also once at start-up). 1 to 86400; default 3600.
    #[serde(default = "default_retention_interval_secs")]
    pub interval_secs: u64,
    /// Messages erased per transaction (1-500). Default 500.
    #[serde(default = "default_retention_batch")]
    pub batch: usize,
    /// SQLite: rewrite the file (`VACUUM`) after a run that erased
    /// something, then truncate its log. `secure_delete` zeroes what a
    /// write frees, but SQLite's page rebuilds leave old copies of rows in
    /// the unused middle of pages; only a rewrite removes them. Writes wait
    /// meanwhile (about 1.3 s per 400 MB here). Default true; false keeps
    /// those copies until their pages are rewritten by later writes.
    #[serde(default = "default_true")]
    pub vacuum: bool,
    /// Days the audit log keeps an admin change (1-3650). Default 365.
    #[serde(default = "default_audit_days")]
    pub audit_days: u16,
}

fn default_audit_days() -> u16 {
    365
}

fn default_retention_days() -> u16 {
    crate::model::DEFAULT_RETENTION_DAYS
}

fn default_retention_interval_secs() -> u64 {
    3600
}

fn default_true() -> bool {
    true
}

fn default_retention_batch() -> usize {
    500
}

impl Default for RetentionSettings {
    fn default() -> Self {
        RetentionSettings {
            default_days: default_retention_days(),
            interval_secs: default_retention_interval_secs(),
            batch: default_retention_batch(),
            vacuum: true,
            audit_days: default_audit_days(),
        }
    }
}

/// `[limits]`: where tenant rates, daily quotas and provider token buckets
/// are kept.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LimitsSettings {
    /// `local` (default) or `redis`.
    #[serde(default)]
    pub backend: LimitsBackend,
    /// `redis://[:password@]host:port[/db]`; required with `backend = "redis"`.
    /// Kept secret because the URL may carry a password.
    #[serde(default)]
    #[schemars(with = "Option<String>")]
    pub redis_url: Option<SecretString>,
    /// Every key fairlane writes starts with `{key_prefix}:`, so several
    /// deployments (or tests) can share one Redis.
    #[serde(default = "default_key_prefix")]
    pub key_prefix: String,
    /// Longest wait for one Redis call; a slower answer counts as Redis
    /// being down, so a dead connection never holds up a request for long.
    #[serde(default = "default_redis_timeout_ms")]
    pub timeout_ms: u64,
    /// A tenant's changes other than sends (webhook and suppression
    /// changes, cancels) per second, in this process, or for every instance
    /// together in Redis with `backend = "redis"`. Over it: 429
    /// (`urn:fairlane:problem:too-many-changes`) with `Retry-After`. A
    /// disabled tenant's changes are refused 403. Default 10.
    #[serde(default = "default_tenant_writes_per_second")]
    pub tenant_writes_per_second: f64,
    /// Changes a tenant may make at once after a quiet spell. Default 50.
    #[serde(default = "default_tenant_writes_burst")]
    pub tenant_writes_burst: u32,
    /// Message list reads one tenant may have in progress at once, in
    /// this process (see `crate::limits::reads`); more wait their turn, at
    /// most half of `server.request_timeout_secs`, then 429
    /// (`urn:fairlane:problem:too-many-reads`). A scan holds one of the
    /// store's readers while it runs: this keeps one tenant's scans from
    /// taking every reader. Default 2.
    #[serde(default = "default_tenant_list_reads")]
    pub tenant_list_reads: usize,
    /// Most messages one page of a list filtered by status or channel
    /// (without a reference) reads; a page that reads them all without
    /// filling up answers what it found and a `next` to go on from (the
    /// book's "Message status and the message list"). At least 1; default
    /// 20,000.
    #[serde(default = "default_list_scan_rows")]
    pub list_scan_rows: i64,
    /// With `backend = "redis"`: how many instances this one assumes the
    /// fleet has while it cannot count them, that is when it starts with
    /// Redis unreachable. Its local shares of the provider gates and the
    /// tenant limits are then the configured rates divided by the larger of
    /// this and the fleet size last counted (kept in the store as the
    /// setting `limits.fleet_size`), never the whole rate, and grow only
    /// once a heartbeat counts the fleet. Set it to the number of replicas
    /// you run. At least 1; default 1.
    #[serde(default = "default_expected_instances")]
    pub expected_instances: u32,
}

fn default_expected_instances() -> u32 {
    1
}

fn default_tenant_list_reads() -> usize {
    2
}

fn default_list_scan_rows() -> i64 {
    20_000
}

fn default_tenant_writes_per_second() -> f64 {
    10.0
}

fn default_tenant_writes_burst() -> u32 {
    50
}

impl Default for LimitsSettings {
    fn default() -> Self {
        LimitsSettings {
            backend: LimitsBackend::Local,
            redis_url: None,
            key_prefix: default_key_prefix(),
            timeout_ms: default_redis_timeout_ms(),
            tenant_writes_per_second: default_tenant_writes_per_second(),
            tenant_writes_burst: default_tenant_writes_burst(),
            tenant_list_reads: default_tenant_list_reads(),
            list_scan_rows: default_list_scan_rows(),
            expected_instances: default_expected_instances(),
        }
    }
}

fn default_key_prefix() -> String {
    "fairlane".to_owned()
}

fn default_redis_timeout_ms() -> u64 {
    250
}

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PlanSettings {
    /// `fast` or `slow`: the lane the plan's messages go to.
    #[schemars(with = "String")]
    pub lane: Lane,
    /// Sends per second a tenant on the plan may make (its token bucket's
    /// rate).
    pub rate_per_second: f64,
    /// Sends a tenant may make at once after a quiet spell.
    pub burst: u32,
    /// Sends a tenant may make per UTC day.
    pub daily_quota: u64,
    /// Messages of one tenant in progress at once (waiting for a provider
    /// token or being sent); further ones are parked.
    pub max_in_flight: u32,
    /// Files a tenant may upload per minute in each of its worlds (live
    /// and test apart): a bucket of this many that refills over a minute.
    /// 1 to 1,000,000.
    #[serde(default = "crate::model::default_uploads_per_minute")]
    pub uploads_per_minute: u32,
    /// Bytes of files a tenant may hold in the store in each of its worlds:
    /// every upload counts, used by messages or not, until its bytes are
    /// erased (it expired or was deleted and no message uses it any more,
    /// or retention erased the last message using it). Default 1 GiB.
    #[serde(default = "crate::model::default_upload_bytes_held")]
    pub upload_bytes_held: u64,
}

impl PlanSettings {
    /// The plan `name` with these figures.
    pub fn named(&self, name: &str) -> crate::model::Plan {
        crate::model::Plan {
            name: name.to_owned(),
            lane: self.lane,
            rate_per_second: self.rate_per_second,
            burst: self.burst,
            daily_quota: self.daily_quota,
            max_in_flight: self.max_in_flight,
            uploads_per_minute: self.uploads_per_minute,
            upload_bytes_held: self.upload_bytes_held,
        }
    }
}

/// Layers `FAIRLANE__SECTION__KEY=value` variables over `figment`. Values
/// are read as TOML-like scalars (numbers, booleans, text), except that a
/// value starting with `+` stays text: `FAIRLANE__PROVIDERS__SMS__FROM=+15550001111`
/// is a phone number, not the integer 15550001111.
fn merge_env(mut figment: Figment, vars: impl Iterator<Item = (String, String)>) -> Figment {
    for (name, raw) in vars {
        let Some(rest) = name.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        let path = rest.to_ascii_lowercase().replace("__", ".");
        let value: figment::value::Value = if raw.starts_with('+') {
            raw.into()
        } else {
            raw.parse()
                .expect("parsing an environment value is infallible")
        };
        figment = figment.merge(EnvVariable { name, path, value });
    }
    figment
}

/// One `FAIRLANE__…` variable as a figment provider, named after the
/// variable so an error in its value says where it came from.
struct EnvVariable {
    name: String,
    path: String,
    value: figment::value::Value,
}

impl figment::Provider for EnvVariable {
    fn metadata(&self) -> figment::Metadata {
        figment::Metadata::named(format!("environment variable {}", self.name))
    }

    fn data(
        &self,
    ) -> Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        figment::providers::Serialized::global(&self.path, &self.value).data()
    }
}

/// Words one figment error as an operator needs it: the key as written in
/// a file (`server.listen`, not figment's `default.server.listen`), what
/// is wrong, and where the value came from, a file by its absolute path.
fn describe_config_error(err: &figment::Error) -> String {
    use figment::error::Kind;
    let mut key: Vec<&str> = err.path.iter().map(String::as_str).collect();
    // figment puts the field named by these two in the message, not the path.
    let field = match &err.kind {
        Kind::UnknownField(field, _) => Some(field.as_str()),
        Kind::MissingField(field) => Some(field.as_ref()),
        _ => None,
    };
    if let Some(field) = field
        && key.last() != Some(&field)
    {
        key.push(field);
    }
    let origin = match err.metadata.as_ref() {
        Some(metadata) => match &metadata.source {
            Some(figment::Source::File(path)) => {
                let path = std::path::absolute(path).unwrap_or_else(|_| path.clone());
                format!(" (in {})", path.display())
            }
            _ if metadata.name.starts_with("environment variable") => {
                format!(" (from {})", metadata.name)
            }
            // The built-in defaults, or TOML text given in code (tests).
            _ => String::new(),
        },
        None => String::new(),
    };
    if key.is_empty() {
        format!("{}{origin}", err.kind)
    } else {
        format!("{}: {}{origin}", key.join("."), err.kind)
    }
}

impl Settings {
    /// Loads defaults, then `file` (if given), then the environment.
    pub fn load(file: Option<&Path>) -> anyhow::Result<Self> {
        Self::load_with_env(file, std::env::vars())
    }

    fn load_with_env(
        file: Option<&Path>,
        vars: impl Iterator<Item = (String, String)>,
    ) -> anyhow::Result<Self> {
        let mut figment = Figment::from(Toml::string(DEFAULT_TOML));
        if let Some(path) = file {
            // Absolute, so every message names the file wherever fairlane
            // was started from; `file_exact`, because `Toml::file` would
            // look for a relative path in every parent directory too.
            let path = path.canonicalize().map_err(|_| {
                let shown = std::path::absolute(path).unwrap_or_else(|_| path.to_owned());
                anyhow::anyhow!("configuration file {} does not exist", shown.display())
            })?;
            if !path.is_file() {
                bail!("configuration file {} is not a file", path.display());
            }
            figment = figment.merge(Toml::file_exact(&path));
        }
        Self::from_figment(merge_env(figment, vars))
    }

    /// Loads defaults with `overlay` (TOML text) on top; used by tests and
    /// benchmarks that build settings in code.
    pub fn from_toml_overlay(overlay: &str) -> anyhow::Result<Self> {
        Self::from_figment(Figment::from(Toml::string(DEFAULT_TOML)).merge(Toml::string(overlay)))
    }

    fn from_figment(figment: Figment) -> anyhow::Result<Self> {
        let settings: Settings = figment.extract().map_err(|err| {
            let messages: Vec<String> =
                err.into_iter().map(|e| describe_config_error(&e)).collect();
            anyhow::anyhow!("invalid configuration: {}", messages.join("; "))
        })?;
        settings.validate().context("invalid configuration")?;
        Ok(settings)
    }

    /// Checks that figures are in range and that each provider has what its
    /// kind needs.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.telemetry.validate()?;
        if self.server.max_body_bytes == 0 || self.server.max_body_bytes > 250 * 1024 {
            bail!(
                "server.max_body_bytes must be between 1 and 256000 (SQS messages are at most 256 KiB)"
            );
        }
        if self.server.http2_max_streams == 0 {
            bail!("server.http2_max_streams must be at least 1");
        }
        if !(30..=3650).contains(&self.server.unsubscribe_link_days) {
            bail!("server.unsubscribe_link_days must be 30-3650");
        }
        if self.server.max_batches_per_tenant == 0 {
            bail!("server.max_batches_per_tenant must be at least 1");
        }
        if self.server.max_batch_body_bytes < self.server.max_body_bytes
            || self.server.max_batch_body_bytes > 64 * 1024 * 1024
        {
            bail!("server.max_batch_body_bytes must be between server.max_body_bytes and 67108864");
        }
        self.validate_storage()?;
        if let Some(url) = &self.server.public_url {
            let parsed = reqwest::Url::parse(url)
                .map_err(|err| anyhow::anyhow!("server.public_url {url:?} is not a URL: {err}"))?;
            if !matches!(parsed.scheme(), "http" | "https") || parsed.query().is_some() {
                bail!(
                    "server.public_url must be an http(s) URL without a query, like https://notify.example.com"
                );
            }
        }
        self.validate_workers()?;
        self.providers.validate()?;
        self.validate_sqs()?;
        self.validate_limits()?;
        for (name, plan) in &self.plans {
            validate_plan_figures(&plan.named(name)).with_context(|| format!("plans.{name}"))?;
        }
        Ok(())
    }

    /// Checks retention's figures, the store's URL and that the queue
    /// backend can live in that store.
    fn validate_storage(&self) -> anyhow::Result<()> {
        let retention = &self.retention;
        if !(crate::model::MIN_RETENTION_DAYS..=crate::model::MAX_RETENTION_DAYS)
            .contains(&retention.default_days)
        {
            bail!("retention.default_days must be between 1 and 90");
        }
        if retention.interval_secs == 0 || retention.interval_secs > 86_400 {
            bail!("retention.interval_secs must be between 1 and 86400");
        }
        if retention.batch == 0 || retention.batch > 500 {
            bail!("retention.batch must be between 1 and 500");
        }
        if !(1..=3650).contains(&retention.audit_days) {
            bail!("retention.audit_days must be between 1 and 3650");
        }
        if self.storage.max_group == 0 {
            bail!("storage.max_group must be at least 1");
        }
        let postgres = is_postgres_url(&self.storage.url);
        if !self.storage.url.starts_with("sqlite:") && !postgres {
            bail!(
                "storage.url must start with sqlite:// or postgres:// (got {:?})",
                self.storage.url
            );
        }
        if postgres && self.queue.backend == QueueBackend::Embedded {
            bail!(
                "storage.url is a PostgreSQL database, which the embedded queue cannot use: \
                 set queue.backend = \"postgres\" (the lanes in the same database) or \
                 \"sqs\" (several instances share PostgreSQL and SQS), \
                 or keep storage.url = \"sqlite://…\" for the embedded queue"
            );
        }
        if !postgres && self.queue.backend == QueueBackend::Postgres {
            bail!(
                "queue.backend = \"postgres\" keeps the lanes in the PostgreSQL store: \
                 set storage.url = \"postgres://…\", or queue.backend = \"embedded\" \
                 for a SQLite file"
            );
        }
        Ok(())
    }

    /// Checks the webhook workers, the instance name, the lanes, the
    /// consumers and retries.
    fn validate_workers(&self) -> anyhow::Result<()> {
        let hooks = &self.webhooks;
        if hooks.concurrency == 0 || hooks.concurrency_per_tenant == 0 {
            bail!("webhooks.concurrency and webhooks.concurrency_per_tenant must be at least 1");
        }
        if hooks.max_concurrency_per_tenant < hooks.concurrency_per_tenant {
            bail!(
                "webhooks.max_concurrency_per_tenant ({}) must be at least webhooks.concurrency_per_tenant ({})",
                hooks.max_concurrency_per_tenant,
                hooks.concurrency_per_tenant
            );
        }
        if hooks.timeout_ms == 0 || hooks.poll_interval_ms == 0 || hooks.retry_base_ms == 0 {
            bail!(
                "webhooks.timeout_ms, webhooks.poll_interval_ms and webhooks.retry_base_ms must be at least 1"
            );
        }
        if let Some(instance) = &self.server.instance
            && (instance.is_empty()
                || instance.len() > 64
                || !instance
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)))
        {
            bail!("server.instance must be 1-64 characters of a-z, A-Z, 0-9, '-', '_' or '.'");
        }
        for (name, lane) in [("fast", &self.lanes.fast), ("slow", &self.lanes.slow)] {
            if lane.concurrency == 0 {
                bail!("lanes.{name}.concurrency must be at least 1");
            }
            if lane.max_receive_count == 0 {
                bail!("lanes.{name}.max_receive_count must be at least 1");
            }
            if lane.visibility_timeout_secs == 0 || lane.visibility_timeout_secs > 43_200 {
                bail!("lanes.{name}.visibility_timeout_secs must be between 1 and 43200");
            }
            if !(0.0..=0.5).contains(&lane.low_priority_share) {
                bail!("lanes.{name}.low_priority_share must be between 0 and 0.5");
            }
        }
        if self.consumers.receive_wait_secs > 20 {
            bail!("consumers.receive_wait_secs must be at most 20 (the SQS long-poll limit)");
        }
        if self.consumers.hold_delay_secs > 900 || self.consumers.tenant_cap_delay_secs > 900 {
            bail!("consumers delays must be at most 900 seconds (the SQS delay limit)");
        }
        if self.retry.max_delay_secs > 900 {
            bail!("retry.max_delay_secs must be at most 900 (the SQS delay limit)");
        }
        if self.retry.max_attempts == 0 {
            bail!("retry.max_attempts must be at least 1");
        }
        Ok(())
    }

    /// Checks the SQS backend's credentials and figures.
    fn validate_sqs(&self) -> anyhow::Result<()> {
        let sqs = &self.queue.sqs;
        if sqs.access_key_id.is_some() != sqs.secret_access_key.is_some() {
            bail!("queue.sqs.access_key_id and secret_access_key must be set together");
        }
        if sqs.batch_window_ms > 1000 {
            bail!("queue.sqs.batch_window_ms must be at most 1000");
        }
        if sqs.stats_interval_secs == 0 {
            bail!("queue.sqs.stats_interval_secs must be at least 1");
        }
        if sqs.outbox_sweep_secs == 0 {
            bail!("queue.sqs.outbox_sweep_secs must be at least 1");
        }
        if !(10..=100_000).contains(&sqs.look_ahead_messages) {
            bail!("queue.sqs.look_ahead_messages must be between 10 and 100000");
        }
        Ok(())
    }

    fn validate_limits(&self) -> anyhow::Result<()> {
        let limits = &self.limits;
        if !is_sensible_rate(limits.tenant_writes_per_second) {
            bail!(
                "limits.tenant_writes_per_second must be a number from {MIN_RATE_PER_SECOND} to {MAX_RATE_PER_SECOND}"
            );
        }
        if limits.tenant_writes_burst == 0 {
            bail!("limits.tenant_writes_burst must be at least 1");
        }
        if limits.expected_instances < 1 {
            bail!("limits.expected_instances must be at least 1");
        }
        if limits.list_scan_rows < 1 {
            bail!("limits.list_scan_rows must be at least 1");
        }
        if limits.key_prefix.is_empty() {
            bail!("limits.key_prefix must not be empty");
        }
        if limits.timeout_ms == 0 || limits.timeout_ms > 10_000 {
            bail!("limits.timeout_ms must be between 1 and 10000");
        }
        match (limits.backend, &limits.redis_url) {
            (LimitsBackend::Local, _) => {}
            (LimitsBackend::Redis, None) => bail!(
                "limits.redis_url is required when limits.backend = \"redis\" (e.g. redis://127.0.0.1:6379)"
            ),
            (LimitsBackend::Redis, Some(url)) => {
                // Parsing only: whether Redis answers is checked at start-up,
                // where an unreachable Redis means starting on local shares.
                redis::Client::open(url.expose_secret())
                    .map_err(|err| anyhow::anyhow!("limits.redis_url is not a Redis URL: {err}"))?;
            }
        }
        Ok(())
    }

    /// The SQLite file path from `storage.url`.
    pub fn sqlite_path(&self) -> PathBuf {
        sqlite_path(&self.storage.url)
    }

    /// This instance's name: `server.instance`, or `{host}-{pid}`.
    pub fn instance_name(&self) -> String {
        self.server.instance.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|name| name.trim().to_owned())
                .filter(|name| !name.is_empty())
                .unwrap_or_else(|| "fairlane".to_owned());
            format!("{host}-{}", std::process::id())
        })
    }
}

/// The slowest rate a plan or provider may have: one send in 1,000 s.
/// (Fewer sends a day are what a daily quota is for.)
pub const MIN_RATE_PER_SECOND: f64 = 0.001;
/// The fastest rate a plan or provider may have.
pub const MAX_RATE_PER_SECOND: f64 = 1_000_000.0;

/// A rate within [`MIN_RATE_PER_SECOND`] and [`MAX_RATE_PER_SECOND`].
pub fn is_sensible_rate(rate_per_second: f64) -> bool {
    (MIN_RATE_PER_SECOND..=MAX_RATE_PER_SECOND).contains(&rate_per_second)
}

/// Checks a plan's figures; the error names the figure first.
pub fn validate_plan_figures(plan: &crate::model::Plan) -> anyhow::Result<()> {
    use crate::model::MAX_UPLOADS_PER_MINUTE;
    anyhow::ensure!(
        is_sensible_rate(plan.rate_per_second),
        "rate_per_second must be a number from {MIN_RATE_PER_SECOND} to {MAX_RATE_PER_SECOND}"
    );
    anyhow::ensure!(plan.burst >= 1, "burst must be at least 1");
    anyhow::ensure!(plan.max_in_flight >= 1, "max_in_flight must be at least 1");
    anyhow::ensure!(
        (1..=MAX_UPLOADS_PER_MINUTE).contains(&plan.uploads_per_minute),
        "uploads_per_minute must be a whole number from 1 to {MAX_UPLOADS_PER_MINUTE}"
    );
    anyhow::ensure!(
        plan.upload_bytes_held <= i64::MAX as u64,
        "upload_bytes_held must be a whole number from 0 to {}",
        i64::MAX
    );
    Ok(())
}

/// True for `postgres://` and `postgresql://` URLs.
pub fn is_postgres_url(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// The file path of a `sqlite://PATH` (or `sqlite:PATH`) URL.
pub fn sqlite_path(url: &str) -> std::path::PathBuf {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .unwrap_or(url);
    std::path::PathBuf::from(rest.split('?').next().unwrap_or(rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_load_and_validate() {
        let settings = Settings::from_toml_overlay("").unwrap();
        assert_eq!(settings.queue.backend, QueueBackend::Embedded);
        assert_eq!(settings.plans["basic"].lane, Lane::Slow);
        assert_eq!(settings.plans["pro"].lane, Lane::Fast);
        assert_eq!(settings.sqlite_path(), PathBuf::from("fairlane.db"));
    }

    #[test]
    fn unknown_key_is_rejected_with_its_name() {
        let err = Settings::from_toml_overlay("[server]\nlisen = \"127.0.0.1:1\"\n").unwrap_err();
        let text = format!("{err:#}");
        assert!(text.contains("lisen"), "{text}");
    }

    #[test]
    fn the_production_example_loads_once_its_secret_is_supplied() {
        let example = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/config/production.example.toml"
        );
        let figment = Figment::from(Toml::string(DEFAULT_TOML))
            .merge(Toml::file(example))
            .merge(("providers.sms.auth_token", "from-the-environment"));
        let settings = Settings::from_figment(figment).unwrap();
        assert!(settings.storage.fsync);
        assert_eq!(settings.providers.sms.kind.name(), "http");
        assert!(settings.plans.contains_key("startup"));
    }

    #[test]
    fn the_sqs_example_loads() {
        let example = concat!(env!("CARGO_MANIFEST_DIR"), "/config/sqs.example.toml");
        let figment = Figment::from(Toml::string(DEFAULT_TOML)).merge(Toml::file(example));
        let settings = Settings::from_figment(figment).unwrap();
        assert_eq!(settings.queue.backend, QueueBackend::Sqs);
        assert_eq!(settings.providers.email.kind.name(), "ses");
        assert_eq!(settings.consumers.receive_wait_secs, 20);
    }

    #[test]
    fn the_several_instances_example_loads_with_postgres_sqs_and_redis() {
        let example = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/config/several-instances.example.toml"
        );
        let figment = Figment::from(Toml::string(DEFAULT_TOML)).merge(Toml::file(example));
        let settings = Settings::from_figment(figment).unwrap();
        assert!(is_postgres_url(&settings.storage.url));
        assert_eq!(settings.queue.backend, QueueBackend::Sqs);
        assert_eq!(settings.limits.backend, LimitsBackend::Redis);
        assert_eq!(settings.instance_name(), "a");
    }

    #[test]
    fn the_postgres_example_loads_with_its_lanes_in_postgres_and_redis() {
        let example = concat!(env!("CARGO_MANIFEST_DIR"), "/config/postgres.example.toml");
        let figment = Figment::from(Toml::string(DEFAULT_TOML)).merge(Toml::file(example));
        let settings = Settings::from_figment(figment).unwrap();
        assert!(is_postgres_url(&settings.storage.url));
        assert_eq!(settings.queue.backend, QueueBackend::Postgres);
        assert_eq!(settings.limits.backend, LimitsBackend::Redis);
    }

    #[test]
    fn a_postgres_store_with_the_embedded_queue_is_refused_naming_both_keys() {
        let err = Settings::from_toml_overlay(
            "[storage]\nurl = \"postgres://root@127.0.0.1/fairlane\"\n",
        )
        .unwrap_err();
        let text = format!("{err:#}");
        assert!(
            text.contains("storage.url") && text.contains("queue.backend"),
            "{text}"
        );
        let err = Settings::from_toml_overlay("[storage]\nurl = \"mysql://x\"\n").unwrap_err();
        assert!(format!("{err:#}").contains("sqlite:// or postgres://"));
    }

    #[test]
    fn lanes_in_postgres_need_a_postgres_store() {
        let err = Settings::from_toml_overlay("[queue]\nbackend = \"postgres\"\n").unwrap_err();
        let text = format!("{err:#}");
        assert!(
            text.contains("storage.url") && text.contains("queue.backend"),
            "{text}"
        );
        let settings = Settings::from_toml_overlay(
            "[storage]\nurl = \"postgres://root@127.0.0.1/fairlane\"\n\n[queue]\nbackend = \"postgres\"\n",
        )
        .expect("a PostgreSQL store with its lanes in it");
        assert_eq!(settings.queue.backend, QueueBackend::Postgres);
    }

    #[test]
    fn environment_variables_override_and_keep_phone_numbers_as_text() {
        let vars = [
            ("FAIRLANE__PROVIDERS__SMS__KIND", "http"),
            ("FAIRLANE__PROVIDERS__SMS__BASE_URL", "http://127.0.0.1:9"),
            ("FAIRLANE__PROVIDERS__SMS__ACCOUNT_SID", "AC1"),
            ("FAIRLANE__PROVIDERS__SMS__AUTH_TOKEN", "secret"),
            ("FAIRLANE__PROVIDERS__SMS__FROM", "+15550001111"),
            ("FAIRLANE__LANES__FAST__CONCURRENCY", "64"),
            ("OTHER__LANES__FAST__CONCURRENCY", "1"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        let figment = merge_env(Figment::from(Toml::string(DEFAULT_TOML)), vars.into_iter());
        let settings = Settings::from_figment(figment).unwrap();
        let http = settings.providers.sms.kind.http().unwrap();
        assert_eq!(http.from, "+15550001111");
        assert_eq!(settings.lanes.fast.concurrency, 64);
    }

    /// The `FAIRLANE__…` variables a compose file gives its instances (a
    /// line's trailing comment and commented-out lines left out).
    fn compose_environment(text: &str) -> Vec<(String, String)> {
        text.lines()
            .filter_map(|line| {
                let line = line.split(" #").next()?.trim();
                let (name, value) = line.split_once(": ")?;
                name.starts_with(ENV_PREFIX)
                    .then(|| (name.to_owned(), value.trim().to_owned()))
            })
            .collect()
    }

    /// The deployment examples run where no Docker engine does (this
    /// machine, CI): what each gives its instances must at least be a
    /// configuration fairlane starts with, on the backends it names.
    #[test]
    fn the_compose_files_give_their_instances_valid_configurations() {
        let files = [
            (
                "deploy/postgres.compose.yml",
                include_str!("../deploy/postgres.compose.yml"),
                QueueBackend::Postgres,
            ),
            (
                "deploy/several-instances.compose.yml",
                include_str!("../deploy/several-instances.compose.yml"),
                QueueBackend::Sqs,
            ),
        ];
        for (file, text, queue) in files {
            let vars = compose_environment(text);
            assert!(vars.len() >= 6, "{file}: {vars:?}");
            let figment = merge_env(Figment::from(Toml::string(DEFAULT_TOML)), vars.into_iter());
            let settings =
                Settings::from_figment(figment).unwrap_or_else(|err| panic!("{file}: {err:#}"));
            assert_eq!(settings.queue.backend, queue, "{file}");
            assert!(settings.storage.url.starts_with("postgres://"), "{file}");
            assert_eq!(settings.limits.backend, LimitsBackend::Redis, "{file}");
        }
    }

    #[test]
    fn an_unknown_environment_key_is_rejected_with_its_name() {
        let vars = [("FAIRLANE__SERVER__LISTN".to_owned(), "x".to_owned())];
        let figment = merge_env(Figment::from(Toml::string(DEFAULT_TOML)), vars.into_iter());
        let err = Settings::from_figment(figment).unwrap_err();
        let text = format!("{err:#}");
        assert!(text.contains("server.listn: unknown field"), "{text}");
        assert!(
            text.contains("(from environment variable FAIRLANE__SERVER__LISTN)"),
            "{text}"
        );
        assert!(!text.contains("default."), "{text}");
    }

    #[test]
    fn an_error_in_a_config_file_names_the_key_as_written_and_the_absolute_path() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("fairlane.toml");
        let absolute = dir.path().canonicalize().unwrap().join("fairlane.toml");
        let no_env = || std::iter::empty::<(String, String)>();

        std::fs::write(&file, "[server]\nlisen = \"127.0.0.1:1\"\n").unwrap();
        let text = format!(
            "{:#}",
            Settings::load_with_env(Some(&file), no_env()).unwrap_err()
        );
        assert!(text.contains("server.lisen: unknown field"), "{text}");
        assert!(
            text.contains(&format!("(in {})", absolute.display())),
            "{text}"
        );
        assert!(!text.contains("default."), "{text}");

        std::fs::write(&file, "[lanes.fast]\nconcurrency = \"lots\"\n").unwrap();
        let text = format!(
            "{:#}",
            Settings::load_with_env(Some(&file), no_env()).unwrap_err()
        );
        assert!(
            text.contains("lanes.fast.concurrency: invalid type"),
            "{text}"
        );
        assert!(
            text.contains(&format!("(in {})", absolute.display())),
            "{text}"
        );

        // A path through `..` is shown resolved.
        let relative = dir.path().join("sub/../fairlane.toml");
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let text = format!(
            "{:#}",
            Settings::load_with_env(Some(&relative), no_env()).unwrap_err()
        );
        assert!(
            text.contains(&format!("(in {})", absolute.display())),
            "{text}"
        );

        let missing = Path::new("no-such-dir/fairlane.toml");
        let text = format!(
            "{:#}",
            Settings::load_with_env(Some(missing), no_env()).unwrap_err()
        );
        let shown = std::env::current_dir().unwrap().join(missing);
        assert!(
            text.contains(&format!(
                "configuration file {} does not exist",
                shown.display()
            )),
            "{text}"
        );

        std::fs::write(&file, "[logging]\nlog_addresses = true\n").unwrap();
        let settings = Settings::load_with_env(Some(&file), no_env()).unwrap();
        assert!(settings.logging.log_addresses);
        assert!(
            !Settings::from_toml_overlay("")
                .unwrap()
                .logging
                .log_addresses
        );
    }

    #[test]
    fn a_low_priority_share_outside_0_to_0_5_is_rejected_with_its_name() {
        let err = Settings::from_toml_overlay("[lanes.slow]\nconcurrency = 8\nhigh_water_mark = 10\nvisibility_timeout_secs = 60\nmax_receive_count = 5\nlow_priority_share = 0.7\n")
            .unwrap_err();
        assert!(
            format!("{err:#}").contains("lanes.slow.low_priority_share"),
            "{err:#}"
        );
        let settings = Settings::from_toml_overlay("").unwrap();
        assert_eq!(settings.lanes.fast.low_priority_share, 0.1);
    }

    #[test]
    fn an_sqs_look_ahead_outside_10_to_100000_is_rejected_with_its_name() {
        for bad in [0, 9, 100_001] {
            let err =
                Settings::from_toml_overlay(&format!("[queue.sqs]\nlook_ahead_messages = {bad}\n"))
                    .unwrap_err();
            assert!(
                format!("{err:#}").contains("queue.sqs.look_ahead_messages"),
                "{err:#}"
            );
        }
        let settings = Settings::from_toml_overlay("").unwrap();
        assert_eq!(settings.queue.sqs.look_ahead_messages, 5_000);
    }

    #[test]
    fn the_limits_backend_is_local_by_default_and_redis_needs_a_url() {
        let settings = Settings::from_toml_overlay("").unwrap();
        assert_eq!(settings.limits.backend, LimitsBackend::Local);
        assert_eq!(settings.limits.key_prefix, "fairlane");
        assert_eq!(settings.limits.timeout_ms, 250);

        let err = Settings::from_toml_overlay("[limits]\nbackend = \"redis\"\n").unwrap_err();
        assert!(
            format!("{err:#}").contains("limits.redis_url is required"),
            "{err:#}"
        );

        let err = Settings::from_toml_overlay(
            "[limits]\nbackend = \"redis\"\nredis_url = \"http://127.0.0.1:6379\"\n",
        )
        .unwrap_err();
        assert!(format!("{err:#}").contains("limits.redis_url"), "{err:#}");

        let err = Settings::from_toml_overlay("[limits]\nbakend = \"redis\"\n").unwrap_err();
        assert!(format!("{err:#}").contains("bakend"), "{err:#}");

        let settings = Settings::from_toml_overlay(
            "[limits]\nbackend = \"redis\"\nredis_url = \"redis://127.0.0.1:6379\"\nkey_prefix = \"eu1\"\n",
        )
        .unwrap();
        assert_eq!(settings.limits.backend, LimitsBackend::Redis);
        assert_eq!(settings.limits.key_prefix, "eu1");
    }

    #[test]
    fn webhook_allow_private_takes_cidr_ranges_and_addresses_and_names_a_bad_one() {
        let settings = Settings::from_toml_overlay("").unwrap();
        assert!(!settings.webhooks.allow_http);
        assert!(settings.webhooks.allow_private.is_empty());

        let settings = Settings::from_toml_overlay(
            "[webhooks]\nallow_http = true\nallow_private = [\"10.1.2.0/24\", \"127.0.0.1\", \"fd00:1::/64\"]\n",
        )
        .unwrap();
        assert!(settings.webhooks.allow_http);
        let listed: Vec<String> = settings
            .webhooks
            .allow_private
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(listed, ["10.1.2.0/24", "127.0.0.1/32", "fd00:1::/64"]);

        // As the bench scripts set them.
        let vars = [
            ("FAIRLANE__WEBHOOKS__ALLOW_HTTP", "true"),
            ("FAIRLANE__WEBHOOKS__ALLOW_PRIVATE", "[\"127.0.0.1/32\"]"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        let figment = merge_env(Figment::from(Toml::string(DEFAULT_TOML)), vars.into_iter());
        let settings = Settings::from_figment(figment).unwrap();
        assert!(settings.webhooks.allow_http);
        assert_eq!(settings.webhooks.allow_private.len(), 1);

        for bad in ["10.1.2.0/33", "10.1.2", "localhost", "fd00::/129"] {
            let err =
                Settings::from_toml_overlay(&format!("[webhooks]\nallow_private = [\"{bad}\"]\n"))
                    .unwrap_err();
            let text = format!("{err:#}");
            assert!(
                text.contains("webhooks.allow_private") && text.contains(bad),
                "{text}"
            );
        }
    }

    #[test]
    fn http_sms_without_base_url_is_rejected() {
        let err = Settings::from_toml_overlay("[providers.sms]\nkind = \"http\"\n").unwrap_err();
        let text = format!("{err:#}");
        assert!(
            text.contains("providers.sms: base_url is required"),
            "{text}"
        );
    }

    /// Each kind holds its own settings only: another kind's setting is
    /// refused at start, named with the table it is in, never ignored.
    #[test]
    fn a_provider_with_another_kinds_setting_is_refused_naming_it() {
        let ses = "[providers.email]\nkind = \"ses\"\n";
        let http = "[providers.sms]\nkind = \"http\"\nbase_url = \"http://127.0.0.1:9\"\n\
                    account_sid = \"AC1\"\nauth_token = \"t\"\nfrom = \"+15550001111\"\n";
        let log = "[providers.sms_pool.spare]\nkind = \"log\"\nrate_per_second = 1.0\nburst = 1\n";
        for (table, foreign, at) in [
            (ses, "base_url = \"http://127.0.0.1:9\"", "providers.email"),
            (ses, "log_path = \"/tmp/x\"", "providers.email"),
            (http, "ses_tenants = false", "providers.sms"),
            (http, "region = \"eu-west-1\"", "providers.sms"),
            (log, "account_sid = \"AC1\"", "providers.sms_pool.spare"),
        ] {
            let field = foreign.split(' ').next().unwrap();
            let err = Settings::from_toml_overlay(&format!("{table}{foreign}\n")).unwrap_err();
            let text = format!("{err:#}");
            assert!(
                text.contains(&format!(
                    "{at}: {field} is not a setting of a provider of kind"
                )),
                "{text}"
            );
            Settings::from_toml_overlay(table).unwrap();
        }
        // The channel's own kinds only.
        let err =
            Settings::from_toml_overlay(http.replace("providers.sms", "providers.email").as_str())
                .unwrap_err();
        let text = format!("{err:#}");
        assert!(
            text.contains("providers.email: kind \"http\" cannot deliver email (a provider of email is \"log\" or \"ses\")"),
            "{text}"
        );
    }

    #[test]
    fn http_sms_with_an_empty_auth_token_is_rejected() {
        let sms = "[providers.sms]\nkind = \"http\"\nbase_url = \"http://127.0.0.1:9\"\n\
                   account_sid = \"AC1\"\nfrom = \"+15550001111\"\n";
        for token in ["", "  "] {
            let err = Settings::from_toml_overlay(&format!("{sms}auth_token = \"{token}\"\n"))
                .unwrap_err();
            assert!(format!("{err:#}").contains("auth_token"), "{err:#}");
        }
        Settings::from_toml_overlay(&format!("{sms}auth_token = \"t\"\n")).unwrap();
    }

    #[test]
    fn rates_outside_the_sensible_range_are_rejected() {
        for rate in ["1e-20", "0.0009", "0", "-1", "2000000"] {
            let err = Settings::from_toml_overlay(&format!(
                "[providers.email]\nrate_per_second = {rate}\n"
            ))
            .unwrap_err();
            assert!(
                format!("{err:#}").contains("rate_per_second"),
                "{rate}: {err:#}"
            );
            let err = Settings::from_toml_overlay(&format!(
                "[plans.tiny]\nlane = \"slow\"\nrate_per_second = {rate}\nburst = 1\n\
                 daily_quota = 10\nmax_in_flight = 1\n"
            ))
            .unwrap_err();
            assert!(
                format!("{err:#}").contains("rate_per_second"),
                "{rate}: {err:#}"
            );
        }
    }

    #[test]
    fn a_provider_bucket_that_takes_more_than_a_year_to_fill_is_rejected() {
        let err = Settings::from_toml_overlay(
            "[providers.email]\nrate_per_second = 0.001\nburst = 4000000000\n",
        )
        .unwrap_err();
        assert!(
            format!("{err:#}").contains("providers.email.burst"),
            "{err:#}"
        );
        Settings::from_toml_overlay("[providers.email]\nrate_per_second = 0.001\nburst = 31536\n")
            .unwrap();
    }

    #[test]
    fn breaker_intervals_longer_than_the_longest_pause_are_rejected() {
        for overlay in [
            "[providers.sms]\nbreaker_max_open_secs = 9223372036854775807\n",
            "[providers.sms]\nbreaker_max_open_secs = 3601\n",
            "[providers.email]\nbreaker_open_ms = 3600001\n",
        ] {
            let err = Settings::from_toml_overlay(overlay).unwrap_err();
            let text = format!("{err:#}");
            assert!(text.contains("breaker_open_ms"), "{overlay}: {text}");
        }
        Settings::from_toml_overlay(
            "[providers.sms]\nbreaker_open_ms = 3600000\nbreaker_max_open_secs = 3600\n",
        )
        .unwrap();
    }
}
