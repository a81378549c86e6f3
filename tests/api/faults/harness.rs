//! The scenario driver of `tests/api/faults.rs`: a cluster of three real
//! instances, each reaching PostgreSQL, Redis (and on SQS lanes, moto)
//! through proxies of its own; a load of several tenants whose client
//! retries the same Idempotency-Key elsewhere on a timeout or a 503; faults
//! on a timeline; and the audit of every accepted message at the end.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Form, Path as UrlPath, State};
use axum::http::StatusCode as HttpStatus;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::crash::{ChildGuard, free_port};
use crate::instances::{
    A, Api, FAST_CONCURRENCY, NAMES, RedisKeys, SMS_BURST, SMS_RATE, default_redis_url,
    instance_config, lanes_in_postgres, start_binary, tail, worst_window,
};
use crate::support::{FaultProxy, TestDatabase, connect_pg};

/// How long the client waits for an answer before it tries elsewhere.
pub(crate) const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// Most attempts the client makes for one send (one Idempotency-Key).
const MAX_ATTEMPTS: usize = 10;
/// The client gives a send up this long after its first attempt.
const GIVE_UP_AFTER: Duration = Duration::from_secs(60);
/// Most sends in progress at once, all tenants together.
const MAX_SENDS_IN_PROGRESS: usize = 256;
/// A provider call made by an instance killed at most this long after it
/// may be repeated by another instance: the first instance may have died
/// before it recorded the call (the lease is `visibility_timeout_secs`,
/// 5 s in these configurations, and a call takes up to its timeout).
const KILL_EXCUSES_CALLS_FOR: Duration = Duration::from_secs(30);
/// Statuses a message leaves only by itself (a consumer is still at it).
const PENDING: [&str; 4] = ["scheduled", "queued", "sending", "retrying"];

// ---------------------------------------------------------------------------
// The SMS provider, able to go down and to throttle.
// ---------------------------------------------------------------------------

/// One call the SMS provider received.
#[derive(Debug, Clone)]
pub(crate) struct Call {
    pub(crate) at: Instant,
    /// The instance that made it (its base URL carries its name).
    pub(crate) instance: usize,
    /// The message text: `fault {Idempotency-Key}`.
    pub(crate) body: String,
    /// What the provider answered: 201, 503 (down) or 429 (throttling).
    pub(crate) status: u16,
}

#[derive(Default)]
struct SmsState {
    /// Outages in force (they may overlap): every call answers 503.
    down: AtomicUsize,
    /// Throttling in force: every call answers 429 with `Retry-After: 1`.
    throttled: AtomicUsize,
    calls: Mutex<Vec<Call>>,
}

/// A Twilio-compatible SMS API under the test's control: it answers 201
/// with a fresh `sid`, or 503 while it is down, or 429 with `Retry-After`
/// while it throttles, and records every call. Each instance reaches it at
/// `{url}/{name}` so a call is known by who made it.
pub(crate) struct FaultySms {
    url: String,
    state: Arc<SmsState>,
    server: JoinHandle<()>,
}

impl FaultySms {
    async fn start() -> FaultySms {
        let state = Arc::new(SmsState::default());
        let router = Router::new()
            .route(
                "/{instance}/2010-04-01/Accounts/{account}/Messages.json",
                post(sms_call),
            )
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the SMS provider");
        let url = format!(
            "http://{}",
            listener.local_addr().expect("provider address")
        );
        let server = tokio::spawn(async move {
            axum::serve(listener, router)
                .await
                .expect("the SMS provider serves")
        });
        FaultySms { url, state, server }
    }

    /// The `base_url` instance `on` is configured with.
    fn base_url(&self, on: usize) -> String {
        format!("{}/{}", self.url, NAMES[on])
    }

    pub(crate) fn calls(&self) -> Vec<Call> {
        self.state.calls.lock().expect("calls").clone()
    }

    /// Answers every call with `status` (503: down, 429: throttling) for
    /// `lasting`; how many calls it refused so.
    async fn refuse_for(&self, status: u16, lasting: Duration) -> usize {
        let flag = match status {
            503 => &self.state.down,
            429 => &self.state.throttled,
            other => panic!("the provider cannot answer {other} on its own"),
        };
        let since = Instant::now();
        flag.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(lasting).await;
        flag.fetch_sub(1, Ordering::SeqCst);
        self.answered_since(status, since)
    }

    /// Calls answered `status` since `since`.
    fn answered_since(&self, status: u16, since: Instant) -> usize {
        self.state
            .calls
            .lock()
            .expect("calls")
            .iter()
            .filter(|call| call.status == status && call.at >= since)
            .count()
    }
}

impl Drop for FaultySms {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn sms_call(
    State(state): State<Arc<SmsState>>,
    UrlPath((instance, _account)): UrlPath<(String, String)>,
    Form(form): Form<HashMap<String, String>>,
) -> Response {
    let at = Instant::now();
    let instance = NAMES
        .iter()
        .position(|name| *name == instance)
        .unwrap_or(usize::MAX);
    let body = form.get("Body").cloned().unwrap_or_default();
    let mut calls = state.calls.lock().expect("calls");
    let (status, answer) = if state.down.load(Ordering::SeqCst) > 0 {
        (
            HttpStatus::SERVICE_UNAVAILABLE,
            json!({"code": 20503, "message": "Service unavailable (injected)", "status": 503}),
        )
    } else if state.throttled.load(Ordering::SeqCst) > 0 {
        (
            HttpStatus::TOO_MANY_REQUESTS,
            json!({"code": 20429, "message": "Too Many Requests (injected)", "status": 429}),
        )
    } else {
        // Every call is counted, so the sid is fresh.
        let sid = format!("SM{}", calls.len() + 1);
        (HttpStatus::CREATED, json!({"sid": sid, "status": "queued"}))
    };
    calls.push(Call {
        at,
        instance,
        body,
        status: status.as_u16(),
    });
    drop(calls);
    let mut response = (status, Json(answer)).into_response();
    if status == HttpStatus::TOO_MANY_REQUESTS {
        response
            .headers_mut()
            .insert("retry-after", axum::http::HeaderValue::from_static("1"));
    }
    response
}

// ---------------------------------------------------------------------------
// The cluster.
// ---------------------------------------------------------------------------

/// Where the lanes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lanes {
    /// `queue.backend = "postgres"`.
    Postgres,
    /// `queue.backend = "sqs"`, on a moto of the test's own.
    Sqs,
    /// The embedded default: one instance, its SQLite store and queue in
    /// one file, limits in the process (no PostgreSQL, Redis or SQS to cut).
    Embedded,
}

impl Lanes {
    fn describe(self) -> &'static str {
        match self {
            Lanes::Postgres => "lanes in PostgreSQL",
            Lanes::Sqs => "SQS lanes on moto",
            Lanes::Embedded => "the embedded default, one instance",
        }
    }

    /// How many instances the cluster runs.
    fn instances(self) -> usize {
        match self {
            Lanes::Embedded => 1,
            Lanes::Postgres | Lanes::Sqs => NAMES.len(),
        }
    }
}

/// One instance's process, its configuration and its logs (one per start).
struct Proc {
    config: PathBuf,
    logs: Vec<PathBuf>,
    child: Option<ChildGuard>,
}

/// Three instances of the real binary on one PostgreSQL database, one Redis
/// prefix (and one SQS queue prefix), each through proxies of its own; or
/// one on the embedded default, with no proxy.
///
/// Fields drop in order: the processes first, then the proxies, the
/// provider, the database and the Redis keys.
pub(crate) struct FaultCluster {
    procs: Mutex<Vec<Proc>>,
    pub(crate) api: Api,
    /// Instance `on`'s way to PostgreSQL.
    pub(crate) pg: Vec<FaultProxy>,
    /// Instance `on`'s way to Redis.
    pub(crate) redis: Vec<FaultProxy>,
    /// Instance `on`'s way to moto (SQS lanes only).
    pub(crate) sqs: Vec<FaultProxy>,
    pub(crate) sms: FaultySms,
    pub(crate) db: TestDatabase,
    /// The store's SQLite file, on the embedded default.
    sqlite: Option<PathBuf>,
    _redis: RedisKeys,
    /// Set when the audit fails: the logs are shown and kept.
    failed: AtomicBool,
    dir: Mutex<Option<TempDir>>,
}

/// `host:port` of a URL (`scheme://[user@]host:port/…`).
pub(crate) fn authority(url: &str) -> &str {
    let start = url.find("://").map_or(0, |at| at + 3);
    let rest = &url[start..];
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let authority = &rest[..end];
    authority.rsplit('@').next().unwrap_or(authority)
}

/// `url` with its `host:port` replaced by `by` (user and path kept).
pub(crate) fn with_authority(url: &str, by: &str) -> String {
    let old = authority(url);
    let start = url.find(old).expect("the authority is in the URL");
    format!("{}{by}{}", &url[..start], &url[start + old.len()..])
}

/// An instance configuration of [`instance_config`] moved onto the embedded
/// default: its store and queue in the SQLite file `file`, its limits in
/// the process.
fn on_the_embedded_default(config: &str, file: &std::path::Path) -> String {
    let storage = config.find("[storage]").expect("a [storage] table");
    let lanes = config.find("[lanes.fast]").expect("a [lanes.fast] table");
    let limits = config.find("[limits]").expect("a [limits] table");
    let webhooks = config.find("[webhooks]").expect("a [webhooks] table");
    format!(
        "{}[storage]\nurl = \"sqlite://{}\"\n\n[queue]\nbackend = \"embedded\"\n\n{}{}",
        &config[..storage],
        file.display(),
        &config[lanes..limits],
        &config[webhooks..]
    )
}

/// Whether this build knows `limits.expected_instances` (issue 67): when it
/// does, the instances are told there are three of them.
fn knows_expected_instances() -> bool {
    fairlane::config::Settings::from_toml_overlay("[limits]\nexpected_instances = 3\n").is_ok()
}

impl FaultCluster {
    /// Starts the three instances with an SMS provider of `sms_rate` a
    /// second and bursts of `sms_burst` (all instances together) and waits
    /// until each is ready.
    pub(crate) async fn start(lanes: Lanes, sms_rate: f64, sms_burst: usize) -> FaultCluster {
        let prefix = crate::backends::unique_prefix("fault");
        let redis_url = default_redis_url();
        let redis_keys = RedisKeys::new(&redis_url, &prefix);
        let db = TestDatabase::create().await;
        let sms = FaultySms::start().await;
        let moto = match lanes {
            Lanes::Sqs => Some(crate::servers::own_sqs_url()),
            Lanes::Postgres | Lanes::Embedded => None,
        };
        let dir = tempfile::tempdir().expect("temporary directory");
        let sqlite = (lanes == Lanes::Embedded).then(|| dir.path().join("fairlane.db"));
        let expected_instances = knows_expected_instances();
        let (mut pg, mut redis, mut sqs) = (Vec::new(), Vec::new(), Vec::new());
        let (mut procs, mut bases) = (Vec::new(), Vec::new());
        for (on, name) in NAMES.iter().enumerate().take(lanes.instances()) {
            let pg_proxy = FaultProxy::start(authority(&db.url)).await;
            let redis_proxy = FaultProxy::start(authority(&redis_url)).await;
            let sqs_url = match &moto {
                Some(moto) => {
                    let proxy = FaultProxy::start(authority(moto)).await;
                    let url = with_authority(moto, &proxy.authority());
                    sqs.push(proxy);
                    url
                }
                // Not used: the lanes are in PostgreSQL.
                None => "http://127.0.0.1:9".to_owned(),
            };
            let port = free_port();
            let mut text = instance_config(
                name,
                port,
                &with_authority(&db.url, &pg_proxy.authority()),
                &sqs_url,
                &prefix,
                &with_authority(&redis_url, &redis_proxy.authority()),
                &sms.base_url(on),
            );
            let rate = format!("rate_per_second = {SMS_RATE:.1}\nburst = {SMS_BURST}\n");
            assert!(text.contains(&rate), "the SMS provider's rate in:\n{text}");
            text = text.replace(
                &rate,
                &format!("rate_per_second = {sms_rate:.1}\nburst = {sms_burst}\n"),
            );
            if let Some(file) = &sqlite {
                text = on_the_embedded_default(&text, file);
            } else if expected_instances {
                let line = format!("key_prefix = \"{prefix}\"\n");
                assert!(text.contains(&line), "the [limits] key prefix in:\n{text}");
                text = text.replacen(&line, &format!("{line}expected_instances = 3\n"), 1);
            }
            if lanes == Lanes::Postgres {
                text = lanes_in_postgres(&text);
            }
            let config = dir.path().join(format!("{name}.toml"));
            std::fs::write(&config, text).expect("write an instance configuration");
            let log = dir.path().join(format!("{name}.log"));
            let child = start_binary(&config, &log, &[]);
            procs.push(Proc {
                config,
                logs: vec![log],
                child: Some(child),
            });
            if sqlite.is_none() {
                pg.push(pg_proxy);
                redis.push(redis_proxy);
            }
            bases.push(format!("http://127.0.0.1:{port}"));
        }
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(15))
            .build()
            .expect("HTTP client");
        let cluster = FaultCluster {
            procs: Mutex::new(procs),
            api: Api {
                client,
                bases: Arc::new(bases),
            },
            pg,
            redis,
            sqs,
            sms,
            db,
            sqlite,
            _redis: redis_keys,
            failed: AtomicBool::new(false),
            dir: Mutex::new(Some(dir)),
        };
        for on in 0..cluster.size() {
            if let Err(err) = cluster.wait_ready(on, Duration::from_secs(30)).await {
                cluster.failed.store(true, Ordering::SeqCst);
                panic!("{err}");
            }
        }
        cluster
    }

    /// How many instances it runs.
    pub(crate) fn size(&self) -> usize {
        self.api.bases.len()
    }

    /// Whether `GET /readyz` on instance `on` answers 200 within a second.
    async fn is_ready(&self, on: usize) -> bool {
        let request = self
            .api
            .client
            .get(self.api.url(on, "/readyz"))
            .timeout(Duration::from_secs(1));
        matches!(request.send().await, Ok(response) if response.status() == StatusCode::OK)
    }

    /// Polls `/readyz` of instance `on` until 200, for `limit` at most;
    /// how long that took, or why not.
    async fn wait_ready(&self, on: usize, limit: Duration) -> Result<Duration, String> {
        let started = Instant::now();
        loop {
            if self.is_ready(on).await {
                return Ok(started.elapsed());
            }
            let state = self.state(on);
            if state.starts_with("exited") {
                return Err(format!(
                    "instance {} {state} before it was ready",
                    NAMES[on]
                ));
            }
            if started.elapsed() > limit {
                return Err(format!(
                    "instance {} ({state}) not ready within {limit:?}",
                    NAMES[on]
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `running`, `killed by the test` or `exited: …`.
    fn state(&self, on: usize) -> String {
        let mut procs = self.procs.lock().expect("processes");
        match procs[on].child.as_mut().map(|child| child.0.try_wait()) {
            None => "killed by the test".to_owned(),
            Some(Ok(None)) => "running".to_owned(),
            Some(Ok(Some(exit))) => format!("exited: {exit}"),
            Some(Err(err)) => format!("state unknown: {err}"),
        }
    }

    /// `kill -9` of instance `on` (SIGKILL to the PID of the child the test
    /// started), reaped; its PID, or `None` when it was not running.
    fn kill(&self, on: usize) -> Option<u32> {
        let mut procs = self.procs.lock().expect("processes");
        let mut guard = procs[on].child.take()?;
        let pid = guard.0.id();
        let running = matches!(guard.0.try_wait(), Ok(None));
        guard.0.kill().expect("kill the instance");
        guard.0.wait().expect("reap the instance");
        running.then_some(pid)
    }

    /// Starts instance `on` again on its configuration (same port), logging
    /// to a file of its own.
    fn restart(&self, on: usize) {
        let mut procs = self.procs.lock().expect("processes");
        let proc = &mut procs[on];
        assert!(proc.child.is_none(), "instance {} is running", NAMES[on]);
        let log = proc
            .config
            .with_file_name(format!("{}.{}.log", NAMES[on], proc.logs.len()));
        proc.child = Some(start_binary(&proc.config, &log, &[]));
        proc.logs.push(log);
    }

    /// Creates plan `plan` (fast lane) and a tenant on it through instance
    /// A, issues a key and waits until every instance knows it.
    pub(crate) async fn tenant_with_key(
        &self,
        tenant: &str,
        plan: &str,
        rate: f64,
        burst: u32,
    ) -> String {
        self.api.put_plan(A, plan, rate, burst, 32).await;
        self.api.create_tenant(A, tenant, plan).await;
        let (_, key) = self.api.issue_key(A, tenant).await;
        self.api.wait_key_known_everywhere(&key).await;
        key
    }

    /// Every message row: `(id, reference, status)`, read directly (not
    /// through any proxy).
    pub(crate) async fn rows(&self) -> Vec<(String, Option<String>, String)> {
        if let Some(file) = &self.sqlite {
            let conn = crate::support::sqlite_file(file);
            let mut statement = conn
                .prepare("SELECT id, reference, status FROM messages")
                .expect("read the messages");
            return statement
                .query_map([], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))
                .expect("read the messages")
                .collect::<Result<_, _>>()
                .expect("read the messages");
        }
        let mut conn = connect_pg(&self.db.url).await;
        sqlx::query_as("SELECT id, reference, status FROM messages")
            .fetch_all(&mut conn)
            .await
            .expect("read the messages")
    }

    /// Marks the test failed: the logs are shown and kept when the
    /// cluster is dropped.
    pub(crate) fn fail(&self) {
        self.failed.store(true, Ordering::SeqCst);
    }
}

impl Drop for FaultCluster {
    fn drop(&mut self) {
        if !std::thread::panicking() && !self.failed.load(Ordering::SeqCst) {
            return;
        }
        let procs = self.procs.get_mut().expect("processes");
        for (on, proc) in procs.iter_mut().enumerate() {
            let state = match proc.child.as_mut().map(|child| child.0.try_wait()) {
                None => "killed by the test".to_owned(),
                Some(Ok(None)) => "running".to_owned(),
                Some(Ok(Some(exit))) => format!("exited: {exit}"),
                Some(Err(err)) => format!("state unknown: {err}"),
            };
            for log in &proc.logs {
                // Slow-statement warnings carry whole queries: cut short.
                let lines: Vec<String> = tail(log, 25)
                    .lines()
                    .map(|line| line.chars().take(300).collect())
                    .collect();
                eprintln!(
                    "----- instance {} ({state}), last lines of {} -----\n{}",
                    NAMES[on],
                    log.display(),
                    lines.join("\n")
                );
            }
        }
        if let Some(dir) = self.dir.get_mut().expect("directory").take() {
            eprintln!(
                "----- configurations and full logs kept in {} -----",
                dir.keep().display()
            );
        }
    }
}

// ---------------------------------------------------------------------------
// The client.
// ---------------------------------------------------------------------------

/// How one attempt of a send ended, as the client saw it.
#[derive(Debug, Clone)]
pub(crate) enum Outcome {
    Answer {
        status: u16,
        retry_after: Option<String>,
        /// A 202's message id.
        id: Option<String>,
    },
    /// No answer within the client's timeout.
    Timeout,
    /// The connection failed or broke (an instance killed, say).
    Error(String),
}

/// One attempt of a send.
#[derive(Debug, Clone)]
pub(crate) struct Attempt {
    pub(crate) on: usize,
    /// Seconds from the start of the load.
    pub(crate) at: f64,
    pub(crate) took: f64,
    pub(crate) outcome: Outcome,
}

impl Attempt {
    fn status(&self) -> Option<u16> {
        match &self.outcome {
            Outcome::Answer { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// Every attempt of one send (one Idempotency-Key, one body).
#[derive(Debug)]
pub(crate) struct SendRecord {
    pub(crate) tenant: usize,
    pub(crate) key: String,
    pub(crate) attempts: Vec<Attempt>,
}

impl SendRecord {
    /// The ids of its 202s.
    fn ids(&self) -> HashSet<&str> {
        self.attempts
            .iter()
            .filter_map(|attempt| match &attempt.outcome {
                Outcome::Answer { id: Some(id), .. } => Some(id.as_str()),
                _ => None,
            })
            .collect()
    }
}

/// Which instances answered `/readyz` 200 last time they were asked.
#[derive(Clone)]
struct Readiness(Arc<Vec<AtomicBool>>);

impl Readiness {
    /// All of `instances` taken as ready.
    fn all(instances: usize) -> Self {
        Readiness(Arc::new(
            (0..instances).map(|_| AtomicBool::new(true)).collect(),
        ))
    }

    /// Instance `from` (modulo their number), or the next one after it
    /// that is ready (`from` when none is).
    fn pick(&self, from: usize) -> usize {
        let instances = self.0.len();
        (0..instances)
            .map(|step| (from + step) % instances)
            .find(|on| self.0[*on].load(Ordering::SeqCst))
            .unwrap_or(from % instances)
    }
}

/// The outside client: picks a ready instance, and on a timeout, a broken
/// connection or a 503 tries the same key and body on another; on a 409
/// waits the Retry-After and tries again; a 429 it takes as the answer.
#[derive(Clone)]
struct Client {
    http: reqwest::Client,
    bases: Arc<Vec<String>>,
    ready: Readiness,
    origin: Instant,
}

/// The body of send `key`: its text and reference carry the key, so a
/// provider call and a message row map back to it.
pub(crate) fn body_of(key: &str, n: usize) -> Value {
    json!({
        "channel": "sms",
        "to": format!("+1555{:07}", n % 10_000_000),
        "text": format!("fault {key}"),
        "reference": key,
    })
}

/// One `POST /v1/messages` of `body` with Idempotency-Key `key` to `base`,
/// given up after `timeout`.
pub(crate) async fn attempt(
    http: &reqwest::Client,
    base: &str,
    api_key: &str,
    key: &str,
    body: &Value,
    timeout: Duration,
) -> Outcome {
    let request = http
        .post(format!("{base}/v1/messages"))
        .bearer_auth(api_key)
        .header("idempotency-key", key)
        .json(body);
    let answer = tokio::time::timeout(timeout, async {
        let response = request.send().await?;
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        let text = response.text().await?;
        Ok::<_, reqwest::Error>((status, retry_after, text))
    })
    .await;
    match answer {
        Err(_) => Outcome::Timeout,
        Ok(Err(err)) => Outcome::Error(err.without_url().to_string()),
        Ok(Ok((status, retry_after, text))) => {
            let id = (status == 202).then(|| {
                serde_json::from_str::<Value>(&text)
                    .ok()
                    .and_then(|body| body["id"].as_str().map(str::to_owned))
                    .unwrap_or_else(|| format!("(a 202 without an id: {text})"))
            });
            Outcome::Answer {
                status,
                retry_after,
                id,
            }
        }
    }
}

impl Client {
    async fn attempt(&self, on: usize, api_key: &str, key: &str, body: &Value) -> Attempt {
        let started = Instant::now();
        let outcome = attempt(
            &self.http,
            &self.bases[on],
            api_key,
            key,
            body,
            CLIENT_TIMEOUT,
        )
        .await;
        Attempt {
            on,
            at: started.duration_since(self.origin).as_secs_f64(),
            took: started.elapsed().as_secs_f64(),
            outcome,
        }
    }

    /// Sends `key` until it is answered 202 or 429 (or something the
    /// client does not retry), [`MAX_ATTEMPTS`] at most, within
    /// [`GIVE_UP_AFTER`].
    async fn send(&self, tenant: usize, api_key: &str, key: String, n: usize) -> SendRecord {
        let body = body_of(&key, n);
        let started = Instant::now();
        let mut on = self.ready.pick(tenant + n);
        let mut attempts = Vec::new();
        while attempts.len() < MAX_ATTEMPTS && started.elapsed() < GIVE_UP_AFTER {
            let attempt = self.attempt(on, api_key, &key, &body).await;
            let (pause, other) = match &attempt.outcome {
                Outcome::Answer { status: 202, .. } | Outcome::Answer { status: 429, .. } => {
                    attempts.push(attempt);
                    break;
                }
                Outcome::Answer {
                    status: 409,
                    retry_after,
                    ..
                } => (seconds(retry_after.as_deref(), 1, 5), false),
                Outcome::Answer {
                    status: 503,
                    retry_after,
                    ..
                } => (seconds(retry_after.as_deref(), 1, 2), true),
                Outcome::Answer { .. } => {
                    attempts.push(attempt);
                    break;
                }
                Outcome::Timeout | Outcome::Error(_) => (Duration::from_millis(200), true),
            };
            attempts.push(attempt);
            tokio::time::sleep(pause).await;
            if other {
                on = self.ready.pick(on + 1);
            }
        }
        SendRecord {
            tenant,
            key,
            attempts,
        }
    }
}

/// `Retry-After` as a pause between `least` and `most` seconds.
fn seconds(retry_after: Option<&str>, least: u64, most: u64) -> Duration {
    let secs = retry_after
        .and_then(|text| text.parse::<u64>().ok())
        .unwrap_or(least);
    Duration::from_secs(secs.clamp(least, most))
}

// ---------------------------------------------------------------------------
// The timeline.
// ---------------------------------------------------------------------------

/// A fault the timeline injects.
#[derive(Debug, Clone)]
pub(crate) enum Fault {
    /// `kill -9` of the instance, started again `after` later.
    KillAndRestart { instance: usize, after: Duration },
    /// The instance's connections to PostgreSQL closed, new ones refused.
    CutPostgres { instance: usize, lasting: Duration },
    /// Every chunk between the instance and PostgreSQL held `per_packet`.
    StallPostgres {
        instance: usize,
        per_packet: Duration,
        lasting: Duration,
    },
    /// Redis cut for every instance.
    CutRedis { lasting: Duration },
    /// The instance's connections to SQS (moto) cut.
    CutSqs { instance: usize, lasting: Duration },
    /// The SMS provider answers 503.
    ProviderDown { lasting: Duration },
    /// The SMS provider answers 429 with `Retry-After: 1`.
    Provider429 { lasting: Duration },
}

/// A fault and when it starts, in seconds from the start of the load.
#[derive(Debug, Clone)]
pub(crate) struct Step {
    at: Duration,
    fault: Fault,
}

/// The timeline's step: `fault` at `seconds` from the start of the load.
pub(crate) fn at(seconds: f64, fault: Fault) -> Step {
    Step {
        at: Duration::from_secs_f64(seconds),
        fault,
    }
}

/// Shorthand for whole seconds.
pub(crate) fn secs(seconds: u64) -> Duration {
    Duration::from_secs(seconds)
}

/// What a step did.
#[derive(Debug, Clone)]
struct FaultRecord {
    what: String,
    started: f64,
    ended: f64,
    /// What shows it took effect (connections closed, chunks held, calls
    /// refused, a process killed).
    evidence: String,
    effective: bool,
    /// A kill: the instance and when.
    killed: Option<(usize, Instant)>,
}

impl Step {
    async fn run(self, cluster: Arc<FaultCluster>, origin: Instant) -> FaultRecord {
        tokio::time::sleep_until((origin + self.at).into()).await;
        let started = origin.elapsed().as_secs_f64();
        let mut killed = None;
        let (what, evidence, effective) = match self.fault {
            Fault::KillAndRestart { instance, after } => {
                let pid = cluster.kill(instance);
                killed = Some((instance, Instant::now()));
                tokio::time::sleep(after).await;
                cluster.restart(instance);
                let ready = cluster.wait_ready(instance, Duration::from_secs(30)).await;
                let evidence = match (&pid, &ready) {
                    (Some(pid), Ok(took)) => {
                        format!(
                            "pid {pid} killed; ready again {:.1} s after the restart",
                            took.as_secs_f64()
                        )
                    }
                    (Some(pid), Err(err)) => format!("pid {pid} killed; {err}"),
                    (None, _) => "it was not running".to_owned(),
                };
                (
                    format!(
                        "kill -9 {}, restarted {} s later",
                        NAMES[instance],
                        after.as_secs_f64()
                    ),
                    evidence,
                    pid.is_some() && ready.is_ok(),
                )
            }
            Fault::CutPostgres { instance, lasting } => {
                let proxy = &cluster.pg[instance];
                let before = proxy.closed();
                proxy.cut();
                tokio::time::sleep(lasting).await;
                proxy.restore();
                let closed = proxy.closed() - before;
                (
                    format!(
                        "PostgreSQL of {} cut for {} s",
                        NAMES[instance],
                        lasting.as_secs_f64()
                    ),
                    format!("{closed} connections closed or refused"),
                    closed > 0,
                )
            }
            Fault::StallPostgres {
                instance,
                per_packet,
                lasting,
            } => {
                let proxy = &cluster.pg[instance];
                let before = proxy.delayed();
                proxy.stall(per_packet);
                tokio::time::sleep(lasting).await;
                proxy.restore();
                let delayed = proxy.delayed() - before;
                (
                    format!(
                        "PostgreSQL of {} stalled {} ms a packet for {} s",
                        NAMES[instance],
                        per_packet.as_millis(),
                        lasting.as_secs_f64()
                    ),
                    format!("{delayed} chunks held"),
                    delayed > 0,
                )
            }
            Fault::CutRedis { lasting } => {
                let before: usize = cluster.redis.iter().map(FaultProxy::closed).sum();
                for proxy in &cluster.redis {
                    proxy.cut();
                }
                tokio::time::sleep(lasting).await;
                for proxy in &cluster.redis {
                    proxy.restore();
                }
                let closed = cluster.redis.iter().map(FaultProxy::closed).sum::<usize>() - before;
                (
                    format!("Redis cut for all for {} s", lasting.as_secs_f64()),
                    format!("{closed} connections closed or refused"),
                    closed > 0,
                )
            }
            Fault::CutSqs { instance, lasting } => {
                let proxy = cluster
                    .sqs
                    .get(instance)
                    .expect("an SQS proxy: the scenario runs on SQS lanes");
                let before = proxy.closed();
                proxy.cut();
                tokio::time::sleep(lasting).await;
                proxy.restore();
                let closed = proxy.closed() - before;
                (
                    format!(
                        "SQS of {} cut for {} s",
                        NAMES[instance],
                        lasting.as_secs_f64()
                    ),
                    format!("{closed} connections closed or refused"),
                    closed > 0,
                )
            }
            Fault::ProviderDown { lasting } => {
                let refused = cluster.sms.refuse_for(503, lasting).await;
                (
                    format!("SMS provider down (503) for {} s", lasting.as_secs_f64()),
                    format!("{refused} calls answered 503"),
                    refused > 0,
                )
            }
            Fault::Provider429 { lasting } => {
                let refused = cluster.sms.refuse_for(429, lasting).await;
                (
                    format!("SMS provider 429 storm for {} s", lasting.as_secs_f64()),
                    format!("{refused} calls answered 429"),
                    refused > 0,
                )
            }
        };
        FaultRecord {
            what,
            started,
            ended: origin.elapsed().as_secs_f64(),
            evidence,
            effective,
            killed,
        }
    }
}

// ---------------------------------------------------------------------------
// The scenario.
// ---------------------------------------------------------------------------

/// One tenant of the load: its plan and how fast it sends.
#[derive(Debug, Clone)]
pub(crate) struct TenantLoad {
    pub(crate) name: &'static str,
    pub(crate) rate: f64,
    pub(crate) burst: u32,
    pub(crate) sends_per_second: f64,
}

/// The usual four tenants: three under their plans' rates and one (`tiny`)
/// above its own, so some sends are refused 429; `scale` multiplies how
/// fast each sends (about 18 a second at 1.0, 16 of them accepted).
pub(crate) fn four_tenants(scale: f64) -> Vec<TenantLoad> {
    [
        ("gold", 20.0, 20, 7.0),
        ("silver", 10.0, 10, 5.0),
        ("bronze", 5.0, 5, 3.0),
        ("tiny", 1.0, 2, 3.0),
    ]
    .into_iter()
    .map(|(name, rate, burst, sends)| TenantLoad {
        name,
        rate,
        burst,
        sends_per_second: sends * scale,
    })
    .collect()
}

/// A load, a timeline of faults and the provider's contract.
pub(crate) struct Scenario {
    pub(crate) name: &'static str,
    pub(crate) lanes: Lanes,
    pub(crate) tenants: Vec<TenantLoad>,
    pub(crate) load_for: Duration,
    pub(crate) timeline: Vec<Step>,
    /// How long after the load and the last fault every accepted message
    /// has to be sent.
    pub(crate) drain_limit: Duration,
    pub(crate) sms_rate: f64,
    pub(crate) sms_burst: usize,
}

/// Runs `scenario`: starts the cluster, the load and the timeline, waits
/// for both, audits, prints the summary and fails listing every broken
/// promise.
pub(crate) async fn run(scenario: Scenario) {
    let cluster =
        Arc::new(FaultCluster::start(scenario.lanes, scenario.sms_rate, scenario.sms_burst).await);
    let mut api_keys = Vec::new();
    for tenant in &scenario.tenants {
        let key = cluster
            .tenant_with_key(tenant.name, tenant.name, tenant.rate, tenant.burst)
            .await;
        api_keys.push(key);
    }

    let ready = Readiness::all(cluster.size());
    let stop = Arc::new(AtomicBool::new(false));
    let poller = {
        let (cluster, ready, stop) = (cluster.clone(), ready.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                for on in 0..cluster.size() {
                    let is_ready = cluster.is_ready(on).await;
                    ready.0[on].store(is_ready, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    };

    let origin = Instant::now();
    let client = Client {
        http: reqwest::Client::builder()
            .timeout(CLIENT_TIMEOUT + Duration::from_secs(5))
            .build()
            .expect("HTTP client"),
        bases: cluster.api.bases.clone(),
        ready,
        origin,
    };
    let faults: Vec<JoinHandle<FaultRecord>> = scenario
        .timeline
        .iter()
        .cloned()
        .map(|step| tokio::spawn(step.run(cluster.clone(), origin)))
        .collect();
    let permits = Arc::new(Semaphore::new(MAX_SENDS_IN_PROGRESS));
    let loads: Vec<JoinHandle<Vec<SendRecord>>> = scenario
        .tenants
        .iter()
        .zip(&api_keys)
        .enumerate()
        .map(|(tenant, (load, api_key))| {
            tokio::spawn(tenant_load(
                client.clone(),
                tenant,
                load.clone(),
                api_key.clone(),
                scenario.load_for,
                permits.clone(),
            ))
        })
        .collect();
    let mut sends = Vec::new();
    for load in loads {
        sends.extend(load.await.expect("a load task"));
    }
    let load_ended = origin.elapsed().as_secs_f64();
    let mut records = Vec::new();
    for fault in faults {
        records.push(fault.await.expect("a fault task"));
    }
    stop.store(true, Ordering::SeqCst);
    poller.await.expect("the readiness poller");
    audit(&cluster, &scenario, sends, records, origin, load_ended).await;
}

/// One tenant's sends, paced at its rate for `load_for`, each in a task of
/// its own (at most [`MAX_SENDS_IN_PROGRESS`] at once, all tenants
/// together), so a slow answer does not slow the pace.
async fn tenant_load(
    client: Client,
    tenant: usize,
    load: TenantLoad,
    api_key: String,
    load_for: Duration,
    permits: Arc<Semaphore>,
) -> Vec<SendRecord> {
    let count = (load.sends_per_second * load_for.as_secs_f64()).floor() as usize;
    let mut tasks = Vec::with_capacity(count);
    for n in 0..count {
        let due = client.origin + Duration::from_secs_f64(n as f64 / load.sends_per_second);
        tokio::time::sleep_until(due.into()).await;
        let permit = permits.clone().acquire_owned().await.expect("permits");
        let (client, api_key) = (client.clone(), api_key.clone());
        let key = format!("{}-{n:05}", load.name);
        tasks.push(tokio::spawn(async move {
            let record = client.send(tenant, &api_key, key, n).await;
            drop(permit);
            record
        }));
    }
    let mut records = Vec::with_capacity(count);
    for task in tasks {
        records.push(task.await.expect("a send task"));
    }
    records
}

// ---------------------------------------------------------------------------
// The audit.
// ---------------------------------------------------------------------------

/// At most `n` of `items`, for a failure message.
fn some<T: std::fmt::Debug>(items: &[T], n: usize) -> String {
    let shown: Vec<String> = items
        .iter()
        .take(n)
        .map(|item| format!("{item:?}"))
        .collect();
    if items.len() > n {
        format!("{} … ({} in all)", shown.join(", "), items.len())
    } else {
        shown.join(", ")
    }
}

/// Where the window of `count` calls over `span` seconds (as
/// `worst_window` found it) lies, who made its calls and how the provider
/// answered them, with the calls of the second before it.
fn describe_window(calls: &[Call], count: usize, span: f64, origin: Instant) -> String {
    let mut calls: Vec<&Call> = calls.iter().collect();
    calls.sort_by_key(|call| call.at);
    let Some(first) = (0..calls.len().saturating_sub(count - 1)).find(|&i| {
        let width = calls[i + count - 1]
            .at
            .duration_since(calls[i].at)
            .as_secs_f64();
        (width - span).abs() < 1e-9
    }) else {
        return "(window not found again)".to_owned();
    };
    let start = calls[first].at;
    let mut by = BTreeMap::<String, usize>::new();
    for call in &calls[first..first + count] {
        let who = NAMES.get(call.instance).copied().unwrap_or("?");
        *by.entry(format!("{who} {}", call.status)).or_default() += 1;
    }
    let before = calls[..first]
        .iter()
        .filter(|call| start.duration_since(call.at) <= Duration::from_secs(1))
        .count();
    format!(
        "it starts at +{:.3} s; its calls by instance and answer: {}; {before} calls in the \
         second before it",
        start.duration_since(origin).as_secs_f64(),
        histogram(&by)
    )
}

/// A histogram's text: `key ×count, …`.
fn histogram<K: std::fmt::Display>(counts: &BTreeMap<K, usize>) -> String {
    if counts.is_empty() {
        return "none".to_owned();
    }
    counts
        .iter()
        .map(|(key, count)| format!("{key} ×{count}"))
        .collect::<Vec<_>>()
        .join(", ")
}

async fn audit(
    cluster: &FaultCluster,
    scenario: &Scenario,
    sends: Vec<SendRecord>,
    faults: Vec<FaultRecord>,
    origin: Instant,
    load_ended: f64,
) {
    let mut failures: Vec<String> = Vec::new();
    let faults_ended = faults.iter().map(|fault| fault.ended).fold(0.0, f64::max);

    // What the client was told.
    let mut ids_of_key: HashMap<&str, HashSet<&str>> = HashMap::new();
    let mut key_of_id: HashMap<&str, &str> = HashMap::new();
    for send in &sends {
        let ids = send.ids();
        for id in &ids {
            key_of_id.insert(id, &send.key);
        }
        if !ids.is_empty() {
            ids_of_key.insert(&send.key, ids);
        }
    }
    let accepted: HashSet<&str> = key_of_id.keys().copied().collect();

    // Wait until every accepted message, and every row, has left the
    // pending statuses, or the drain limit has passed.
    let until = faults_ended.max(load_ended) + scenario.drain_limit.as_secs_f64();
    let drained_at = loop {
        let rows = cluster.rows().await;
        let statuses: HashMap<&str, &str> = rows
            .iter()
            .map(|(id, _, status)| (id.as_str(), status.as_str()))
            .collect();
        let waiting = accepted
            .iter()
            .filter(|id| {
                statuses
                    .get(*id)
                    .is_none_or(|status| PENDING.contains(status))
            })
            .count()
            + rows
                .iter()
                .filter(|(id, _, status)| {
                    !accepted.contains(id.as_str()) && PENDING.contains(&status.as_str())
                })
                .count();
        let now = origin.elapsed().as_secs_f64();
        if waiting == 0 {
            break Some(now);
        }
        if now > until {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    // Later copies of a message would arrive by now.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rows = cluster.rows().await;
    let calls = cluster.sms.calls();

    // 1. Every 202's id has a row, and it is sent; nothing is stranded.
    let row_of: HashMap<&str, (&Option<String>, &str)> = rows
        .iter()
        .map(|(id, reference, status)| (id.as_str(), (reference, status.as_str())))
        .collect();
    let mut missing = Vec::new();
    let mut not_sent = Vec::new();
    let mut accepted_statuses = BTreeMap::<&str, usize>::new();
    for id in &accepted {
        match row_of.get(id) {
            None => missing.push(format!("{id} ({})", key_of_id[id])),
            Some((_, status)) => {
                *accepted_statuses.entry(status).or_default() += 1;
                if *status != "sent" {
                    not_sent.push(format!("{id} ({}) {status}", key_of_id[id]));
                }
            }
        }
    }
    if !missing.is_empty() {
        failures.push(format!(
            "{} of {} accepted ids have no row: {}",
            missing.len(),
            accepted.len(),
            some(&missing, 5)
        ));
    }
    if !not_sent.is_empty() {
        failures.push(format!(
            "{} of {} accepted messages are not sent {} s after the last fault and the load \
             (statuses {}): {}",
            not_sent.len(),
            accepted.len(),
            scenario.drain_limit.as_secs(),
            histogram(&accepted_statuses),
            some(&not_sent, 5)
        ));
    }
    let unanswered: Vec<&(String, Option<String>, String)> = rows
        .iter()
        .filter(|(id, _, _)| !accepted.contains(id.as_str()))
        .collect();
    let mut unanswered_statuses = BTreeMap::<&str, usize>::new();
    for (_, _, status) in &unanswered {
        *unanswered_statuses.entry(status.as_str()).or_default() += 1;
    }
    let stranded: Vec<String> = unanswered
        .iter()
        .filter(|(_, _, status)| PENDING.contains(&status.as_str()))
        .map(|(id, reference, status)| format!("{id} ({reference:?}) {status}"))
        .collect();
    if !stranded.is_empty() {
        failures.push(format!(
            "{} messages no 202 named are still pending: {}",
            stranded.len(),
            some(&stranded, 5)
        ));
    }

    // 2. One key, one message: all 202s of a key name one id, and the
    //    store holds one message per key.
    let mut two_ids: Vec<String> = ids_of_key
        .iter()
        .filter(|(_, ids)| ids.len() > 1)
        .map(|(key, ids)| format!("{key}: 202s named {ids:?}"))
        .collect();
    let mut rows_of_key = HashMap::<&str, Vec<(&str, &str)>>::new();
    for (id, reference, status) in &rows {
        if let Some(reference) = reference {
            rows_of_key
                .entry(reference.as_str())
                .or_default()
                .push((id.as_str(), status.as_str()));
        }
    }
    two_ids.extend(
        rows_of_key
            .iter()
            .filter(|(_, rows)| rows.len() > 1)
            .map(|(key, rows)| format!("{key}: {} messages in the store {rows:?}", rows.len())),
    );
    two_ids.sort();
    if !two_ids.is_empty() {
        failures.push(format!(
            "{} Idempotency-Keys gave more than one message: {}",
            two_ids.len(),
            some(&two_ids, 5)
        ));
    }

    // 3. Each message at the provider once, but for what a kill cut short.
    let kills: Vec<(usize, Instant)> = faults.iter().filter_map(|fault| fault.killed).collect();
    let mut taken = HashMap::<&str, Vec<&Call>>::new();
    let mut call_statuses = BTreeMap::<u16, usize>::new();
    for call in &calls {
        *call_statuses.entry(call.status).or_default() += 1;
        if call.status == 201 {
            let key = call.body.strip_prefix("fault ").unwrap_or(&call.body);
            taken.entry(key).or_default().push(call);
        }
    }
    let (mut duplicates, mut excused) = (0usize, 0usize);
    let mut unexcused = Vec::new();
    for (key, calls) in &mut taken {
        calls.sort_by_key(|call| call.at);
        for (n, call) in calls.iter().enumerate().take(calls.len() - 1) {
            duplicates += 1;
            let cut_short = kills.iter().any(|(on, killed)| {
                *on == call.instance
                    && *killed >= call.at
                    && killed.duration_since(call.at) <= KILL_EXCUSES_CALLS_FOR
            });
            if cut_short {
                excused += 1;
            } else {
                unexcused.push(format!(
                    "{key} call {} of {} by {} at +{:.2} s",
                    n + 1,
                    calls.len(),
                    NAMES.get(call.instance).copied().unwrap_or("?"),
                    call.at.duration_since(origin).as_secs_f64()
                ));
            }
        }
    }
    unexcused.sort();
    if !unexcused.is_empty() {
        failures.push(format!(
            "{} provider calls were repeated by another call of the same message and no kill \
             of their instance explains them: {}",
            unexcused.len(),
            some(&unexcused, 5)
        ));
    }
    if excused > kills.len() * FAST_CONCURRENCY {
        failures.push(format!(
            "{excused} repeated provider calls after {} kills: more than the {FAST_CONCURRENCY} \
             a killed instance can have had in flight, each time",
            kills.len()
        ));
    }
    let mut sent_uncalled: Vec<String> = rows
        .iter()
        .filter(|(_, reference, status)| {
            status == "sent"
                && reference
                    .as_deref()
                    .is_some_and(|key| !taken.contains_key(key))
        })
        .map(|(id, reference, _)| format!("{id} ({reference:?})"))
        .collect();
    sent_uncalled.sort();
    if !sent_uncalled.is_empty() {
        failures.push(format!(
            "{} messages read `sent` but no provider call of theirs was taken: {}",
            sent_uncalled.len(),
            some(&sent_uncalled, 5)
        ));
    }

    // 4. Every refusal is 409, 429 or 503, with Retry-After.
    let mut answers = BTreeMap::<u16, usize>::new();
    let mut bad_answers = Vec::new();
    let mut transport = [[0usize; 2]; 3];
    let mut errors = BTreeMap::<String, usize>::new();
    for send in &sends {
        for attempt in &send.attempts {
            match &attempt.outcome {
                Outcome::Answer {
                    status,
                    retry_after,
                    ..
                } => {
                    *answers.entry(*status).or_default() += 1;
                    let refusal = [409, 429, 503].contains(status);
                    if *status != 202 && (!refusal || retry_after.is_none()) {
                        bad_answers.push(format!(
                            "{} by {} at +{:.2} s: {status}, Retry-After {retry_after:?}",
                            send.key, NAMES[attempt.on], attempt.at
                        ));
                    }
                }
                Outcome::Timeout => transport[attempt.on][0] += 1,
                Outcome::Error(err) => {
                    transport[attempt.on][1] += 1;
                    *errors.entry(err.clone()).or_default() += 1;
                }
            }
        }
    }
    bad_answers.sort();
    if !bad_answers.is_empty() {
        failures.push(format!(
            "{} answers were not 202, nor 409, 429 or 503 with Retry-After: {}",
            bad_answers.len(),
            some(&bad_answers, 5)
        ));
    }

    // 5. The provider's contract, all instances together.
    let mut times: Vec<Instant> = calls.iter().map(|call| call.at).collect();
    times.sort();
    let seconds: Vec<f64> = times
        .iter()
        .map(|at| at.duration_since(times[0]).as_secs_f64())
        .collect();
    let (excess, count, span) =
        worst_window(&seconds, scenario.sms_rate, scenario.sms_burst as f64);
    if excess > 1.0 {
        failures.push(format!(
            "{count} provider calls arrived within {span:.3} s: {excess:+.2} over {} + {}/s × \
             {span:.3} s; {}",
            scenario.sms_burst,
            scenario.sms_rate,
            describe_window(&calls, count, span, origin)
        ));
    }

    // 6. The faults took effect, and every instance runs at the end.
    for fault in &faults {
        if !fault.effective {
            failures.push(format!(
                "the fault \"{}\" at +{:.1} s had no effect: {}",
                fault.what, fault.started, fault.evidence
            ));
        }
    }
    for (on, name) in NAMES.iter().enumerate().take(cluster.size()) {
        let state = cluster.state(on);
        if state != "running" {
            failures.push(format!("instance {name} is {state} at the end"));
        }
    }

    // 7. The load really ran.
    let offered = sends.len();
    if (accepted.len() as f64) < offered as f64 * 0.5 {
        failures.push(format!(
            "only {} of {offered} sends were accepted",
            accepted.len()
        ));
    }

    // The summary.
    let mut out = String::new();
    let _ = writeln!(
        out,
        "===== fault scenario `{}` ({}), load {} s, SMS provider {}/s burst {} =====",
        scenario.name,
        scenario.lanes.describe(),
        scenario.load_for.as_secs(),
        scenario.sms_rate,
        scenario.sms_burst
    );
    let _ = writeln!(out, "faults (seconds from the start of the load):");
    for fault in &faults {
        let _ = writeln!(
            out,
            "  {:+7.1} → {:+7.1}  {}: {}{}",
            fault.started,
            fault.ended,
            fault.what,
            fault.evidence,
            if fault.effective { "" } else { "  [NO EFFECT]" }
        );
    }
    let _ = writeln!(
        out,
        "{:<8} {:>12} {:>8} {:>9} {:>6} {:>8} {:>9}",
        "tenant", "plan", "offered", "accepted", "429", "gave up", "attempts"
    );
    for (t, tenant) in scenario.tenants.iter().enumerate() {
        let mine: Vec<&SendRecord> = sends.iter().filter(|send| send.tenant == t).collect();
        let accepted = mine.iter().filter(|send| !send.ids().is_empty()).count();
        let refused = mine
            .iter()
            .filter(|send| send.attempts.last().and_then(Attempt::status) == Some(429))
            .count();
        let attempts: usize = mine.iter().map(|send| send.attempts.len()).sum();
        let _ = writeln!(
            out,
            "{:<8} {:>12} {:>8} {:>9} {:>6} {:>8} {:>9}",
            tenant.name,
            format!("{}/s b{}", tenant.rate, tenant.burst),
            mine.len(),
            accepted,
            refused,
            mine.len() - accepted - refused,
            attempts
        );
    }
    let mut slowest = [0.0f64; 3];
    for attempt in sends.iter().flat_map(|send| &send.attempts) {
        if let Outcome::Answer { .. } = attempt.outcome {
            slowest[attempt.on] = slowest[attempt.on].max(attempt.took);
        }
    }
    let _ = writeln!(
        out,
        "slowest answer: a {:.2} s, b {:.2} s, c {:.2} s",
        slowest[0], slowest[1], slowest[2]
    );
    let _ = writeln!(
        out,
        "answers: {}; timeouts/connection errors: a {}/{}, b {}/{}, c {}/{}",
        histogram(&answers),
        transport[0][0],
        transport[0][1],
        transport[1][0],
        transport[1][1],
        transport[2][0],
        transport[2][1]
    );
    if !errors.is_empty() {
        let _ = writeln!(out, "connection errors: {}", histogram(&errors));
    }
    let rows_table = [
        ("accepted (distinct ids)", accepted.len().to_string()),
        (
            "rows in the store",
            format!(
                "{} ({} no 202 named: {})",
                rows.len(),
                unanswered.len(),
                histogram(&unanswered_statuses)
            ),
        ),
        (
            "accepted, by status",
            format!(
                "{} ({} without a row)",
                histogram(&accepted_statuses),
                missing.len()
            ),
        ),
        (
            "provider calls",
            format!("{} ({})", calls.len(), histogram(&call_statuses)),
        ),
        (
            "duplicates",
            format!(
                "{duplicates} ({excused} cut short by a kill, {} not)",
                unexcused.len()
            ),
        ),
        ("keys with two ids", two_ids.len().to_string()),
        (
            "worst window",
            format!(
                "{count} calls in {span:.3} s ({excess:+.2} over {} + {}/s × t)",
                scenario.sms_burst, scenario.sms_rate
            ),
        ),
        (
            "time to drain",
            match drained_at {
                Some(at) => format!(
                    "{:.1} s after the last fault ended (+{faults_ended:.1} s), {:.1} s after \
                     the load ended (+{load_ended:.1} s)",
                    at - faults_ended,
                    at - load_ended
                ),
                None => format!(
                    "not drained {} s after the load and the faults",
                    scenario.drain_limit.as_secs()
                ),
            },
        ),
    ];
    for (what, figure) in rows_table {
        let _ = writeln!(out, "  {what:<24} {figure}");
    }
    eprintln!("{out}");

    if !failures.is_empty() {
        cluster.fail();
        panic!(
            "fault scenario `{}`: {} promises broken:\n- {}",
            scenario.name,
            failures.len(),
            failures.join("\n- ")
        );
    }
}
