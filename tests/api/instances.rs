//! Several instances (issue 10): three fairlane processes, the real binary
//! each on its own port, share one PostgreSQL database, one Redis and moto's
//! SQS. A tenant or key made on one instance works on the others within a
//! second, a tenant's plan and a provider's rate hold for the three together,
//! killing one instance loses no accepted message, and Redis going away turns
//! into local shares, not errors.
//!
//! Needs PostgreSQL (each test creates a database of its own there and drops
//! it at the end, or keeps it when the test fails and `FAIRLANE_TEST_KEEP_DB`
//! is set), Redis (a random key prefix, deleted at the end) and moto (a
//! random queue prefix), found or started by `tests/servers`. The Redis
//! outage test starts a `redis-server` of its own on a free port and kills
//! only that.
//!
//! The SMS provider is a small Twilio-compatible server in the test that
//! records when each call arrived and what it carried; every message text
//! holds a marker, so arrivals map back to the messages that were accepted.
//!
//! Each instance logs (`RUST_LOG=info`, or `FAIRLANE_TEST_INSTANCE_LOG` when
//! set) to a file in a temporary directory.
//! When a test fails, the tail of every log is printed and the directory is
//! kept (its path is printed too).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Form, Path as UrlPath, State};
use axum::routing::post;
use axum::{Json, Router};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::task::JoinHandle;

use crate::crash::{ChildGuard, free_port};
use crate::support::TestDatabase;

/// The admin token of every instance in these tests.
pub(crate) const ADMIN: &str = "instances-test-admin-token-0123";

/// Names of the three instances (`server.instance`), also their index order.
pub(crate) const NAMES: [&str; 3] = ["a", "b", "c"];
pub(crate) const A: usize = 0;
pub(crate) const B: usize = 1;
pub(crate) const C: usize = 2;

/// The SMS provider's contract in every cluster: 20 calls a second, bursts
/// of 5, for the three instances together.
pub(crate) const SMS_RATE: f64 = 20.0;
pub(crate) const SMS_BURST: usize = 5;

/// `lanes.fast.concurrency` (the default): messages one instance's fast lane
/// works on at once, so the most a killed instance can have had in flight.
pub(crate) const FAST_CONCURRENCY: usize = 32;

/// How long changes made on one instance may take to reach the others.
const PROPAGATION: Duration = Duration::from_secs(1);

tokio::task_local! {
    /// Set: the clusters a test starts keep their lanes in PostgreSQL
    /// (`queue.backend = "postgres"`) instead of SQS.
    static LANES_IN_POSTGRES: bool;
}

// ---------------------------------------------------------------------------
// The services the cluster shares.
// ---------------------------------------------------------------------------

pub(crate) fn default_redis_url() -> String {
    crate::servers::redis_url()
}

/// A random key prefix on a Redis; its keys are deleted on drop.
pub(crate) struct RedisKeys {
    client: redis::Client,
    url: String,
    prefix: String,
}

impl RedisKeys {
    /// Fails the test when no Redis answers at `url`.
    pub(crate) fn new(url: &str, prefix: &str) -> RedisKeys {
        let client = redis::Client::open(url)
            .unwrap_or_else(|err| panic!("{url} is not a Redis URL: {err}"));
        let pong = client
            .get_connection_with_timeout(Duration::from_secs(5))
            .and_then(|mut conn| redis::cmd("PING").query::<String>(&mut conn));
        assert!(
            pong.is_ok(),
            "no Redis answers at {url} (FAIRLANE_TEST_REDIS_URL): the several-instances tests \
             need a real Redis; start one with `redis-server` or point the variable at one \
             ({pong:?})"
        );
        RedisKeys {
            client,
            url: url.to_owned(),
            prefix: prefix.to_owned(),
        }
    }
}

impl Drop for RedisKeys {
    fn drop(&mut self) {
        let Ok(mut conn) = self
            .client
            .get_connection_with_timeout(Duration::from_secs(1))
        else {
            return;
        };
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}:*", self.prefix))
            .query(&mut conn)
            .unwrap_or_default();
        if !keys.is_empty() {
            let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(keys).query(&mut conn);
        }
    }
}

/// A `redis-server` of the test's own, on a free port; killed (by its PID)
/// when the guard is dropped.
struct OwnRedis {
    url: String,
    child: Option<ChildGuard>,
}

impl OwnRedis {
    async fn start(dir: &Path) -> OwnRedis {
        let port = free_port();
        let log = std::fs::File::create(dir.join("redis.log")).expect("redis log file");
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .stdout(log.try_clone().expect("redis log file"))
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|err| panic!("cannot start redis-server (is it installed?): {err}"));
        let own = OwnRedis {
            url: format!("redis://127.0.0.1:{port}"),
            child: Some(ChildGuard(child)),
        };
        let client = redis::Client::open(own.url.as_str()).expect("Redis URL");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let pong = client
                .get_connection_with_timeout(Duration::from_millis(200))
                .and_then(|mut conn| redis::cmd("PING").query::<String>(&mut conn));
            if pong.is_ok() {
                return own;
            }
            assert!(
                Instant::now() < deadline,
                "the test's own redis-server on port {port} did not answer within 10 s: \
                 {pong:?}\n{}",
                tail(&dir.join("redis.log"), 20)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL, as a crashed or unreachable Redis.
    fn kill(&mut self) {
        if let Some(mut guard) = self.child.take() {
            guard.0.kill().expect("kill the test's redis-server");
            guard.0.wait().expect("reap the test's redis-server");
        }
    }
}

// ---------------------------------------------------------------------------
// The SMS provider.
// ---------------------------------------------------------------------------

/// One call the SMS provider received.
#[derive(Debug, Clone)]
struct Arrival {
    at: Instant,
    body: String,
    sid: String,
}

/// A Twilio-compatible SMS API that answers every send with 201 and a fresh
/// `sid` (`SM1`, `SM2`, …) and records each call.
struct SmsProvider {
    url: String,
    arrivals: Arc<Mutex<Vec<Arrival>>>,
    server: JoinHandle<()>,
}

impl SmsProvider {
    async fn start() -> SmsProvider {
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        let router = Router::new()
            .route(
                "/2010-04-01/Accounts/{account}/Messages.json",
                post(accept_sms),
            )
            .with_state(arrivals.clone());
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
        SmsProvider {
            url,
            arrivals,
            server,
        }
    }

    fn arrivals(&self) -> Vec<Arrival> {
        self.arrivals.lock().expect("arrivals").clone()
    }

    fn count(&self) -> usize {
        self.arrivals.lock().expect("arrivals").len()
    }

    /// How many calls carried each marker (the message text).
    fn per_text(&self) -> HashMap<String, usize> {
        let mut counts = HashMap::new();
        for arrival in self.arrivals() {
            *counts.entry(arrival.body).or_default() += 1;
        }
        counts
    }
}

impl Drop for SmsProvider {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn accept_sms(
    State(arrivals): State<Arc<Mutex<Vec<Arrival>>>>,
    UrlPath(_account): UrlPath<String>,
    Form(form): Form<HashMap<String, String>>,
) -> (axum::http::StatusCode, Json<Value>) {
    let at = Instant::now();
    let mut arrivals = arrivals.lock().expect("arrivals");
    let sid = format!("SM{}", arrivals.len() + 1);
    arrivals.push(Arrival {
        at,
        body: form.get("Body").cloned().unwrap_or_default(),
        sid: sid.clone(),
    });
    (
        axum::http::StatusCode::CREATED,
        Json(json!({"sid": sid, "status": "queued"})),
    )
}

// ---------------------------------------------------------------------------
// The cluster.
// ---------------------------------------------------------------------------

/// The answer to a send, as a client sees it.
#[derive(Debug, Clone)]
struct Answer {
    status: StatusCode,
    retry_after: Option<String>,
    body: Value,
}

impl Answer {
    fn id(&self) -> String {
        self.body["id"]
            .as_str()
            .unwrap_or_else(|| panic!("a 202 without an id: {}", self.body))
            .to_owned()
    }

    /// `Retry-After` as whole seconds; fails the test when it is missing or
    /// not a whole number.
    fn retry_after_secs(&self) -> u64 {
        let text = self
            .retry_after
            .as_deref()
            .unwrap_or_else(|| panic!("a {} without Retry-After: {}", self.status, self.body));
        text.parse()
            .unwrap_or_else(|_| panic!("Retry-After is not whole seconds: {text:?}"))
    }
}

/// HTTP access to the three instances; cheap to clone into sender tasks.
#[derive(Clone)]
pub(crate) struct Api {
    pub(crate) client: reqwest::Client,
    pub(crate) bases: Arc<Vec<String>>,
}

impl Api {
    pub(crate) fn url(&self, on: usize, path: &str) -> String {
        format!("{}{path}", self.bases[on])
    }

    /// `POST /v1/messages` of an SMS with `text` through instance `on`.
    async fn send(&self, on: usize, key: &str, text: &str) -> reqwest::Result<Answer> {
        let response = self
            .client
            .post(self.url(on, "/v1/messages"))
            .bearer_auth(key)
            .json(&json!({"channel": "sms", "to": "+15551234567", "text": text}))
            .send()
            .await?;
        let status = response.status();
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        let text = response.text().await?;
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok(Answer {
            status,
            retry_after,
            body,
        })
    }

    /// `GET /v1/messages/{id}` through instance `on`: the status and body.
    pub(crate) async fn message(&self, on: usize, key: &str, id: &str) -> (StatusCode, Value) {
        let response = self
            .client
            .get(self.url(on, &format!("/v1/messages/{id}")))
            .bearer_auth(key)
            .send()
            .await
            .unwrap_or_else(|err| panic!("GET message {id} on {}: {err}", NAMES[on]));
        let status = response.status();
        let text = response.text().await.unwrap_or_default();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    pub(crate) async fn admin(
        &self,
        on: usize,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut request = self
            .client
            .request(method.clone(), self.url(on, path))
            .bearer_auth(ADMIN);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request
            .send()
            .await
            .unwrap_or_else(|err| panic!("{method} {path} on {}: {err}", NAMES[on]));
        let status = response.status();
        let text = response.text().await.unwrap_or_default();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    /// `PUT /v1/admin/plans/{name}` on the fast lane.
    pub(crate) async fn put_plan(
        &self,
        on: usize,
        name: &str,
        rate: f64,
        burst: u32,
        max_in_flight: u32,
    ) {
        let plan = json!({
            "lane": "fast", "rate_per_second": rate, "burst": burst,
            "daily_quota": 1_000_000u64, "max_in_flight": max_in_flight,
        });
        let (status, body) = self
            .admin(
                on,
                reqwest::Method::PUT,
                &format!("/v1/admin/plans/{name}"),
                Some(plan),
            )
            .await;
        assert!(status.is_success(), "PUT plan {name}: {status} {body}");
    }

    pub(crate) async fn create_tenant(&self, on: usize, id: &str, plan: &str) {
        let (status, body) = self
            .admin(
                on,
                reqwest::Method::POST,
                "/v1/admin/tenants",
                Some(json!({"id": id, "name": format!("Tenant {id}"), "plan": plan})),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "create tenant {id}: {body}");
    }

    /// Issues a key for `tenant`; returns `(key id, key)`.
    pub(crate) async fn issue_key(&self, on: usize, tenant: &str) -> (String, String) {
        let (status, body) = self
            .admin(
                on,
                reqwest::Method::POST,
                &format!("/v1/admin/tenants/{tenant}/keys"),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "issue a key: {body}");
        (
            body["id"].as_str().expect("key id").to_owned(),
            body["key"].as_str().expect("key").to_owned(),
        )
    }

    async fn revoke_key(&self, on: usize, tenant: &str, key_id: &str) {
        let (status, body) = self
            .admin(
                on,
                reqwest::Method::DELETE,
                &format!("/v1/admin/tenants/{tenant}/keys/{key_id}"),
                None,
            )
            .await;
        assert!(status.is_success(), "revoke key {key_id}: {status} {body}");
    }

    /// Waits (up to 5 s) until every instance knows `key`, without sending
    /// anything (a send would spend the tenant's bucket): a status read of an
    /// unknown id answers 404 rather than 401 once the key is known.
    pub(crate) async fn wait_key_known_everywhere(&self, key: &str) {
        let deadline = Instant::now() + Duration::from_secs(5);
        for (on, name) in NAMES.iter().enumerate().take(self.bases.len()) {
            loop {
                let (status, body) = self.message(on, key, "no-such-message").await;
                if status != StatusCode::UNAUTHORIZED {
                    assert_eq!(
                        status,
                        StatusCode::NOT_FOUND,
                        "an unknown id on {name}: {body}"
                    );
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "instance {name} still refuses the key after 5 s"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    /// Waits until every one of `ids` reads `sent` through instance
    /// `readers[n % readers.len()]`, polling until `limit` has passed;
    /// fails the test naming those that did not.
    async fn wait_all_sent(&self, key: &str, ids: &[String], readers: &[usize], limit: Duration) {
        let deadline = Instant::now() + limit;
        let mut pending: Vec<String> = ids.to_vec();
        let mut round = 0usize;
        loop {
            let mut still = Vec::new();
            let mut last = BTreeMap::new();
            for (n, id) in pending.iter().enumerate() {
                let on = readers[(n + round) % readers.len()];
                let (status, view) = self.message(on, key, id).await;
                if status != StatusCode::OK || view["status"] != "sent" {
                    still.push(id.clone());
                    last.insert(id.clone(), (NAMES[on], status, view));
                }
            }
            pending = still;
            if pending.is_empty() {
                return;
            }
            if Instant::now() > deadline {
                let shown: Vec<String> = last
                    .iter()
                    .take(10)
                    .map(|(id, (on, status, view))| format!("{id} on {on}: {status} {view}"))
                    .collect();
                panic!(
                    "{} of {} messages are not sent after {limit:?}; for example:\n{}",
                    pending.len(),
                    ids.len(),
                    shown.join("\n")
                );
            }
            round += 1;
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The sum of the samples of `metric` on instance `on` whose labels
    /// contain every one of `labels` (e.g. `channel="sms"`).
    pub(crate) async fn metric_sum(&self, on: usize, metric: &str, labels: &[&str]) -> f64 {
        let text = self
            .client
            .get(self.url(on, "/metrics"))
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("metrics text");
        text.lines()
            .filter(|line| {
                line.strip_prefix(metric)
                    .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
            })
            .filter(|line| labels.iter().all(|label| line.contains(label)))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

/// One fairlane process of the cluster.
struct Instance {
    log: PathBuf,
    /// `None` once the test killed it.
    child: Option<ChildGuard>,
}

/// Three instances of the real binary on one database, one Redis prefix and
/// one SQS queue prefix, delivering SMS to [`SmsProvider`].
///
/// Fields drop in order: the processes first, then the provider, the
/// database and the Redis keys, so nothing writes to what is being removed.
struct Cluster {
    instances: Vec<Instance>,
    api: Api,
    sms: SmsProvider,
    _db: TestDatabase,
    _redis: RedisKeys,
    /// Configurations and logs; kept when the test fails.
    dir: Option<TempDir>,
}

impl Cluster {
    /// A cluster counting limits in the Redis at `FAIRLANE_TEST_REDIS_URL`.
    async fn start() -> Cluster {
        Self::start_with_redis(&default_redis_url()).await
    }

    async fn start_with_redis(redis_url: &str) -> Cluster {
        Self::start_on_sqs(redis_url, crate::backends::moto_url()).await
    }

    /// A cluster whose three instances share the SQS endpoint `moto`.
    async fn start_on_sqs(redis_url: &str, moto: String) -> Cluster {
        Self::start_full(redis_url, [moto.clone(), moto.clone(), moto]).await
    }

    /// A cluster whose instances reach SQS at `sqs` (one endpoint each, so
    /// a test can put a proxy in front of one of them).
    async fn start_full(redis_url: &str, sqs: [String; 3]) -> Cluster {
        Self::start_with_env(redis_url, sqs, |_| Vec::new()).await
    }

    /// [`Cluster::start_full`] with `env(on)` added to instance `on`'s
    /// environment.
    async fn start_with_env(
        redis_url: &str,
        sqs: [String; 3],
        env: impl Fn(usize) -> Vec<(&'static str, String)>,
    ) -> Cluster {
        let prefix = crate::backends::unique_prefix("inst");
        let redis = RedisKeys::new(redis_url, &prefix);
        let db = TestDatabase::create().await;
        let sms = SmsProvider::start().await;
        let dir = tempfile::tempdir().expect("temporary directory");

        let mut instances = Vec::new();
        let mut bases = Vec::new();
        let in_postgres = LANES_IN_POSTGRES.try_with(|set| *set).unwrap_or(false);
        for (on, (name, moto)) in NAMES.into_iter().zip(&sqs).enumerate() {
            let port = free_port();
            let config = dir.path().join(format!("{name}.toml"));
            let mut text =
                instance_config(name, port, &db.url, moto, &prefix, &redis.url, &sms.url);
            if in_postgres {
                text = lanes_in_postgres(&text);
            }
            std::fs::write(&config, text).expect("write an instance configuration");
            let log = dir.path().join(format!("{name}.log"));
            let child = start_binary(&config, &log, &env(on));
            instances.push(Instance {
                log,
                child: Some(child),
            });
            bases.push(format!("http://127.0.0.1:{port}"));
        }
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(15))
            .build()
            .expect("HTTP client");
        let mut cluster = Cluster {
            instances,
            api: Api {
                client,
                bases: Arc::new(bases),
            },
            sms,
            _db: db,
            _redis: redis,
            dir: Some(dir),
        };
        for on in 0..NAMES.len() {
            cluster.wait_ready(on).await;
        }
        cluster
    }

    /// Polls `GET /readyz` on instance `on` until 200 (30 s at most); fails
    /// at once if the process exits.
    async fn wait_ready(&mut self, on: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let url = self.api.url(on, "/readyz");
        loop {
            if let Ok(response) = self.api.client.get(&url).send().await
                && response.status() == StatusCode::OK
            {
                return;
            }
            let child = self.instances[on]
                .child
                .as_mut()
                .expect("a running instance");
            if let Ok(Some(exit)) = child.0.try_wait() {
                panic!("instance {} exited before it was ready: {exit}", NAMES[on]);
            }
            assert!(
                Instant::now() < deadline,
                "instance {} did not become ready within 30 s",
                NAMES[on]
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `kill -9` of instance `on` (SIGKILL to its PID), reaped.
    fn kill(&mut self, on: usize) {
        let mut guard = self.instances[on]
            .child
            .take()
            .expect("the instance is running");
        guard.0.kill().expect("kill the instance");
        guard.0.wait().expect("reap the instance");
    }

    /// Creates plan `plan` on instance A with `rate`/`burst`, a tenant on it
    /// and a key, and waits until every instance knows the key; returns it.
    async fn tenant_with_key(&self, tenant: &str, plan: &str, rate: f64, burst: u32) -> String {
        self.api.put_plan(A, plan, rate, burst, 32).await;
        self.api.create_tenant(A, tenant, plan).await;
        let (_, key) = self.api.issue_key(A, tenant).await;
        self.api.wait_key_known_everywhere(&key).await;
        key
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        for (on, instance) in self.instances.iter_mut().enumerate() {
            let state = match instance.child.as_mut().map(|child| child.0.try_wait()) {
                None => "killed by the test".to_owned(),
                Some(Ok(None)) => "running".to_owned(),
                Some(Ok(Some(exit))) => format!("exited: {exit}"),
                Some(Err(err)) => format!("state unknown: {err}"),
            };
            eprintln!(
                "----- instance {} ({state}), last lines of {} -----\n{}",
                NAMES[on],
                instance.log.display(),
                tail(&instance.log, 60)
            );
        }
        if let Some(dir) = self.dir.take() {
            eprintln!(
                "----- configurations and full logs kept in {} -----",
                dir.keep().display()
            );
        }
    }
}

/// The last `lines` lines of a log file.
pub(crate) fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read(path)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_else(|err| format!("(cannot read {}: {err})", path.display()));
    let text = strip_ansi(&text);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `text` without terminal colour sequences (`ESC [ … m`).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// One instance's configuration file: the same for the three but for
/// `listen` and `instance`.
pub(crate) fn instance_config(
    name: &str,
    port: u16,
    db_url: &str,
    moto: &str,
    prefix: &str,
    redis_url: &str,
    sms_url: &str,
) -> String {
    format!(
        r#"[server]
listen = "127.0.0.1:{port}"
admin_token = "{ADMIN}"
instance = "{name}"

[storage]
url = "{db_url}"

[queue]
backend = "sqs"

[queue.sqs]
endpoint_url = "{moto}"
region = "us-east-1"
queue_prefix = "{prefix}"
create_queues = true
access_key_id = "test"
secret_access_key = "test"
outbox_sweep_secs = 4

[lanes.fast]
concurrency = {FAST_CONCURRENCY}
visibility_timeout_secs = 5

[lanes.slow]
visibility_timeout_secs = 5

[consumers]
enabled = true
receive_wait_secs = 1

[limits]
backend = "redis"
redis_url = "{redis_url}"
key_prefix = "{prefix}"

[webhooks]
allow_http = true
allow_private = ["127.0.0.1/32"]
poll_interval_ms = 200

[providers.sms]
kind = "http"
base_url = "{sms_url}"
account_sid = "AC123"
auth_token = "secret"
from = "+15550000000"
rate_per_second = {SMS_RATE:.1}
burst = {SMS_BURST}
"#
    )
}

/// `config` with its lanes in PostgreSQL instead of SQS.
pub(crate) fn lanes_in_postgres(config: &str) -> String {
    let start = config.find("[queue]").expect("a [queue] table");
    let end = config.find("[lanes.fast]").expect("a [lanes.fast] table");
    format!(
        "{}[queue]\nbackend = \"postgres\"\n\n{}",
        &config[..start],
        &config[end..]
    )
}

/// Starts the binary with `config`, stdout and stderr going to `log`.
pub(crate) fn start_binary(config: &Path, log: &Path, env: &[(&str, String)]) -> ChildGuard {
    let file = std::fs::File::create(log).expect("log file");
    ChildGuard(
        Command::new(env!("CARGO_BIN_EXE_fairlane"))
            .envs(env.iter().map(|(name, value)| (name, value)))
            .arg("serve")
            .arg("--config")
            .arg(config)
            .env(
                "RUST_LOG",
                std::env::var("FAIRLANE_TEST_INSTANCE_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log file"))
            .stderr(file)
            .spawn()
            .expect("the fairlane binary starts"),
    )
}

/// Polls a send of `key` through instance `on` every 50 ms until it answers
/// `want`, for 5 s at most; returns how long after `since` that was (`None`
/// if never) and every other status seen meanwhile.
async fn time_until(
    api: &Api,
    on: usize,
    key: &str,
    want: StatusCode,
    since: Instant,
) -> (Option<Duration>, Vec<StatusCode>) {
    let mut others = Vec::new();
    let mut n = 0;
    while since.elapsed() < Duration::from_secs(5) {
        let answer = api
            .send(on, key, &format!("propagation {} {n}", NAMES[on]))
            .await
            .unwrap_or_else(|err| panic!("send through {}: {err}", NAMES[on]));
        if answer.status == want {
            return (Some(since.elapsed()), others);
        }
        others.push(answer.status);
        n += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (None, others)
}

/// Seconds from `origin` to `at`, negative when `at` came first.
fn seconds_from(origin: Instant, at: Instant) -> f64 {
    if at >= origin {
        at.duration_since(origin).as_secs_f64()
    } else {
        -origin.duration_since(at).as_secs_f64()
    }
}

/// Scheduling noise allowed on the receiver's arrival times. A call is
/// stamped when the test's provider reads it, not when the gate granted its
/// token, so two calls the gate spaced correctly can arrive closer by the
/// delay of three debug-build instances, moto, Redis, PostgreSQL and the
/// test sharing two cores: a CI run saw 173 calls in 8.288 s, 2.2 calls
/// (about 110 ms at 20/s) above burst + rate × t. A gate that were not
/// shared would exceed by tens of calls, which the test still catches.
pub(crate) const ARRIVAL_JITTER_SECS: f64 = 0.15;

/// Of every window of `times` (seconds, sorted) the one whose count most
/// exceeds what a bucket of `burst` refilled at `rate` allows:
/// `(excess, count, seconds)`.
pub(crate) fn worst_window(times: &[f64], rate: f64, burst: f64) -> (f64, usize, f64) {
    let mut worst = (f64::MIN, 0, 0.0);
    for i in 0..times.len() {
        for j in i..times.len() {
            let count = j - i + 1;
            let span = times[j] - times[i];
            // Measured at the receiver: see ARRIVAL_JITTER_SECS.
            let excess = count as f64 - (burst + rate * (span + ARRIVAL_JITTER_SECS));
            if excess > worst.0 {
                worst = (excess, count, span);
            }
        }
    }
    worst
}

// ---------------------------------------------------------------------------
// The tests.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_and_key_made_on_one_instance_work_on_the_others_within_a_second() {
    a_tenant_and_key_made_on_one_instance_work_on_the_others_within_a_second_on(false).await
}

/// The same with the lanes in PostgreSQL, no SQS (issue 49).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_and_key_made_on_one_instance_work_on_the_others_within_a_second_with_lanes_in_postgres()
 {
    a_tenant_and_key_made_on_one_instance_work_on_the_others_within_a_second_on(true).await
}

async fn a_tenant_and_key_made_on_one_instance_work_on_the_others_within_a_second_on(
    lanes_in_postgres: bool,
) {
    LANES_IN_POSTGRES
        .scope(lanes_in_postgres, async {
            let cluster = Cluster::start().await;
            let api = &cluster.api;
            api.put_plan(A, "open", 1000.0, 1000, 32).await;
            api.create_tenant(A, "acme", "open").await;
            let (key_id, key) = api.issue_key(A, "acme").await;
            let issued = Instant::now();

            let ((on_b, before_b), (on_c, before_c)) = tokio::join!(
                time_until(api, B, &key, StatusCode::ACCEPTED, issued),
                time_until(api, C, &key, StatusCode::ACCEPTED, issued),
            );
            eprintln!("a key issued on a was taken by b after {on_b:?}, by c after {on_c:?}");
            for (name, took, before) in [("b", on_b, before_b), ("c", on_c, before_c)] {
                let took = took.unwrap_or_else(|| {
                    panic!(
                        "instance {name} did not take the new key within 5 s (answers: {before:?})"
                    )
                });
                assert!(
                    took <= PROPAGATION,
                    "instance {name} took the key made on a only after {took:?}"
                );
                assert!(
                    before
                        .iter()
                        .all(|status| *status == StatusCode::UNAUTHORIZED),
                    "before it knew the key, {name} answered {before:?} (only 401 expected)"
                );
            }

            api.revoke_key(A, "acme", &key_id).await;
            let revoked = Instant::now();
            let ((on_b, before_b), (on_c, before_c)) = tokio::join!(
                time_until(api, B, &key, StatusCode::UNAUTHORIZED, revoked),
                time_until(api, C, &key, StatusCode::UNAUTHORIZED, revoked),
            );
            eprintln!("a key revoked on a was refused by b after {on_b:?}, by c after {on_c:?}");
            for (name, took, before) in [("b", on_b, before_b), ("c", on_c, before_c)] {
                let took = took.unwrap_or_else(|| {
            panic!("instance {name} still takes the revoked key after 5 s (answers: {before:?})")
        });
                assert!(
                    took <= PROPAGATION,
                    "instance {name} refused the key revoked on a only after {took:?}"
                );
                assert!(
                    before.iter().all(|status| *status == StatusCode::ACCEPTED),
                    "until it saw the revocation, {name} answered {before:?} (only 202 expected)"
                );
            }
            // Once refused, refused everywhere for good.
            for on in [A, B, C] {
                let answer = api.send(on, &key, "after revocation").await.unwrap();
                assert_eq!(
                    answer.status,
                    StatusCode::UNAUTHORIZED,
                    "instance {} after the revocation: {}",
                    NAMES[on],
                    answer.body
                );
            }
        })
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_limit_holds_across_three_instances() {
    a_tenant_limit_holds_across_three_instances_on(false).await
}

/// The same with the lanes in PostgreSQL, no SQS (issue 49).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_limit_holds_across_three_instances_with_lanes_in_postgres() {
    a_tenant_limit_holds_across_three_instances_on(true).await
}

async fn a_tenant_limit_holds_across_three_instances_on(lanes_in_postgres: bool) {
    LANES_IN_POSTGRES
        .scope(lanes_in_postgres, async {
    const RATE: f64 = 10.0;
    const BURST: u32 = 5;
    const SENDERS: usize = 6;
    let cluster = Cluster::start().await;
    let key = cluster.tenant_with_key("acme", "ten", RATE, BURST).await;

    let started = Instant::now();
    let stop_at = started + Duration::from_secs(3);
    let mut senders = Vec::new();
    for sender in 0..SENDERS {
        let (api, key) = (cluster.api.clone(), key.clone());
        senders.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            let mut n = 0;
            while Instant::now() < stop_at {
                let on = (sender + n) % NAMES.len();
                let answer = api
                    .send(on, &key, &format!("limit s{sender} n{n}"))
                    .await
                    .unwrap_or_else(|err| panic!("send through {}: {err}", NAMES[on]));
                answers.push((on, answer));
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            answers
        }));
    }
    let mut answers = Vec::new();
    for sender in senders {
        answers.extend(sender.await.expect("sender task"));
    }
    let elapsed = started.elapsed().as_secs_f64();

    let mut admitted = [0usize; 3];
    let mut refused = [0usize; 3];
    let mut retry_afters = BTreeMap::<u64, usize>::new();
    for (on, answer) in &answers {
        match answer.status {
            StatusCode::ACCEPTED => admitted[*on] += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                refused[*on] += 1;
                *retry_afters.entry(answer.retry_after_secs()).or_default() += 1;
            }
            other => panic!(
                "instance {} answered {other} to a send: {}",
                NAMES[*on], answer.body
            ),
        }
    }
    let total: usize = admitted.iter().sum();
    let allowed = BURST as f64 + RATE * elapsed + 1.0;
    eprintln!(
        "{} sends in {elapsed:.2} s: admitted {admitted:?} (total {total}, at most {allowed:.1}), \
         refused {refused:?}; Retry-After seconds → count: {retry_afters:?}",
        answers.len()
    );
    assert!(
        total as f64 <= allowed,
        "the three instances admitted {total} sends in {elapsed:.2} s; the plan allows {allowed:.1}"
    );
    // Not refusing everything either: the plan's rate is available.
    assert!(
        total as f64 >= BURST as f64 + RATE * elapsed * 0.6,
        "the three instances admitted only {total} sends in {elapsed:.2} s at {RATE}/s"
    );
    assert!(
        refused.iter().all(|&n| n > 0),
        "every instance should have refused some of the flood: {refused:?}"
    );
    assert!(
        retry_afters.keys().all(|&secs| (1..=2).contains(&secs)),
        "at {RATE}/s the next send passes within a second: Retry-After {retry_afters:?}"
    );

    // Honest: drain what refilled meanwhile, then wait what the refusal
    // says, and a send through another instance is admitted.
    let mut refusal = None;
    for n in 0..100 {
        let answer = cluster
            .api
            .send(A, &key, &format!("drain {n}"))
            .await
            .unwrap();
        if answer.status == StatusCode::TOO_MANY_REQUESTS {
            refusal = Some(answer);
            break;
        }
        assert_eq!(answer.status, StatusCode::ACCEPTED, "{}", answer.body);
    }
    let refusal = refusal.expect("a refusal once the bucket is drained");
    tokio::time::sleep(Duration::from_secs(refusal.retry_after_secs())).await;
    let after = cluster.api.send(B, &key, "after waiting").await.unwrap();
    assert_eq!(
        after.status,
        StatusCode::ACCEPTED,
        "a send after waiting Retry-After ({}) was refused: {:?} {}",
        refusal.retry_after_secs(),
        after.retry_after,
        after.body
    );
        })
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_sms_gate_is_shared_by_three_instances() {
    an_sms_gate_is_shared_by_three_instances_on(false).await
}

/// The same with the lanes in PostgreSQL, no SQS (issue 49).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_sms_gate_is_shared_by_three_instances_with_lanes_in_postgres() {
    an_sms_gate_is_shared_by_three_instances_on(true).await
}

async fn an_sms_gate_is_shared_by_three_instances_on(lanes_in_postgres: bool) {
    LANES_IN_POSTGRES
        .scope(lanes_in_postgres, async {
    let _timed = crate::support::TIMED.read().await;
    const MESSAGES: usize = 150;
    const SENDERS: usize = 15;
    // A moto of its own: on the shared one, other tests' queues slow every
    // receive, and the gate would wait for moto, not for the instances.
    let cluster = Cluster::start_on_sqs(&default_redis_url(), crate::servers::own_sqs_url()).await;
    let key = cluster.tenant_with_key("acme", "bulk", 1000.0, 1000).await;

    // Accept 150 messages through the three instances at once. (With 300,
    // moto, not the gate, set the pace at the start: its ReceiveMessage
    // costs about 1.7 ms per message in the queue, half a second a batch
    // at 300, and the instances saw 6 to 15 calls a second there.)
    let mut senders = Vec::new();
    for sender in 0..SENDERS {
        let (api, key) = (cluster.api.clone(), key.clone());
        senders.push(tokio::spawn(async move {
            let mut accepted = Vec::new();
            for n in (sender..MESSAGES).step_by(SENDERS) {
                let text = format!("gate m{n:03}");
                let on = n % NAMES.len();
                let mut attempts = 0;
                loop {
                    let answer = api
                        .send(on, &key, &text)
                        .await
                        .unwrap_or_else(|err| panic!("send through {}: {err}", NAMES[on]));
                    attempts += 1;
                    // A 503 (SQS slow to take the message) accepted
                    // nothing; a client tries again, as the test does.
                    if answer.status == StatusCode::SERVICE_UNAVAILABLE && attempts < 5 {
                        eprintln!("{} answered 503 to {text}: {}", NAMES[on], answer.body);
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                    assert_eq!(
                        answer.status,
                        StatusCode::ACCEPTED,
                        "{} refused {text}: {}",
                        NAMES[on],
                        answer.body
                    );
                    accepted.push((text, answer.id()));
                    break;
                }
            }
            accepted
        }));
    }
    let mut accepted = Vec::new();
    for sender in senders {
        accepted.extend(sender.await.expect("sender task"));
    }
    assert_eq!(accepted.len(), MESSAGES);

    // All delivered: the gate lets 20/s through, so about 7.5 s.
    let deadline = Instant::now() + Duration::from_secs(60);
    while cluster.sms.count() < MESSAGES && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Later copies of a message would arrive by now.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let arrivals = cluster.sms.arrivals();
    let per_text = cluster.sms.per_text();
    let missing: Vec<&String> = accepted
        .iter()
        .map(|(text, _)| text)
        .filter(|text| !per_text.contains_key(*text))
        .collect();
    let twice: Vec<(&String, &usize)> = per_text.iter().filter(|(_, n)| **n > 1).collect();

    // What the provider saw, against its contract.
    let mut times: Vec<Instant> = arrivals.iter().map(|arrival| arrival.at).collect();
    times.sort();
    let first = times[0];
    let seconds: Vec<f64> = times
        .iter()
        .map(|at| at.duration_since(first).as_secs_f64())
        .collect();
    let (excess, count, span) = worst_window(&seconds, SMS_RATE, SMS_BURST as f64);
    let span_all = seconds[seconds.len() - 1];
    let utilisation = (arrivals.len().saturating_sub(SMS_BURST)) as f64 / (span_all * SMS_RATE);
    let mut delivered = Vec::new();
    for on in [A, B, C] {
        delivered.push(
            cluster
                .api
                .metric_sum(
                    on,
                    "fairlane_messages_delivered_total",
                    &["channel=\"sms\""],
                )
                .await,
        );
    }
    eprintln!(
        "{} provider calls for {MESSAGES} messages ({} never sent, {} sent more than once) over \
         {span_all:.2} s (utilisation {utilisation:.3}); worst window: {count} calls in \
         {span:.3} s ({excess:+.2} over {SMS_BURST} + {SMS_RATE}/s); delivered per instance \
         (a, b, c): {delivered:?}",
        arrivals.len(),
        missing.len(),
        twice.len()
    );

    // Every message sent exactly once…
    assert!(
        missing.is_empty(),
        "{} of {MESSAGES} messages never reached the provider within 60 s, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    let id_of: HashMap<&str, &str> = accepted
        .iter()
        .map(|(text, id)| (text.as_str(), id.as_str()))
        .collect();
    assert!(
        twice.is_empty(),
        "{} messages were sent more than once, e.g. {:?}",
        twice.len(),
        twice
            .iter()
            .take(10)
            .map(|(text, n)| format!("{text} (id {}) ×{n}", id_of[text.as_str()]))
            .collect::<Vec<_>>()
    );
    assert_eq!(arrivals.len(), MESSAGES, "provider calls");

    // …and each reads `sent` on all three instances, with the sid the
    // provider gave its one call.
    let sid_of: HashMap<&str, &str> = arrivals
        .iter()
        .map(|arrival| (arrival.body.as_str(), arrival.sid.as_str()))
        .collect();
    let ids: Vec<String> = accepted.iter().map(|(_, id)| id.clone()).collect();
    for on in [A, B, C] {
        cluster
            .api
            .wait_all_sent(&key, &ids, &[on], Duration::from_secs(10))
            .await;
    }
    for (text, id) in &accepted {
        for on in [A, B, C] {
            let (status, view) = cluster.api.message(on, &key, id).await;
            assert_eq!(status, StatusCode::OK, "{id} on {}: {view}", NAMES[on]);
            assert_eq!(
                view["provider_message_id"],
                sid_of[text.as_str()],
                "{id} ({text}) on {}: {view}",
                NAMES[on]
            );
        }
    }

    // Never more than the provider's contract in any window…
    assert!(
        excess <= 1.0,
        "{count} provider calls arrived within {span:.3} s: more than {SMS_BURST} + \
         {SMS_RATE}/s × {span:.3} s + 1"
    );
    // …and close to all of it: the instances do not leave the gate idle.
    // Alone this test measures 0.975 – 0.998 (with 300 messages 0.70 –
    // 0.94, moto-bound, see above). On the one moto server the full suite
    // shares, 0.72 was seen; with a moto of its own, 0.871 inside the full
    // suite (the other tests still share the two cores), and since the
    // suite grew (2026-11-28) 0.745 and 0.748 in two fresh-clone runs. A
    // gate each instance keeps to itself fails the excess above; one the
    // instances take turns at (one at a time) would be near 1/3: the bound
    // sits between that and what a busy suite measures.
    assert!(
        utilisation >= 0.6,
        "{MESSAGES} calls took {span_all:.2} s: {:.0}% of what {SMS_RATE}/s allows",
        utilisation * 100.0
    );
    // The gate was really contested: every instance delivered some.
    assert!(
        delivered.iter().all(|&n| n >= 1.0),
        "messages delivered per instance (a, b, c): {delivered:?}"
    );
        })
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_one_instance_loses_no_accepted_message() {
    killing_one_instance_loses_no_accepted_message_on(false).await
}

/// The same with the lanes in PostgreSQL, no SQS (issue 49).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_one_instance_loses_no_accepted_message_with_lanes_in_postgres() {
    killing_one_instance_loses_no_accepted_message_on(true).await
}

async fn killing_one_instance_loses_no_accepted_message_on(lanes_in_postgres: bool) {
    LANES_IN_POSTGRES
        .scope(lanes_in_postgres, async {
    const SENDERS: usize = 6;
    const EACH: usize = 25;
    let mut cluster = Cluster::start().await;
    let key = cluster.tenant_with_key("acme", "bulk", 1000.0, 1000).await;

    // Senders spread over the three; once `c` is dead they use a and b.
    let c_dead = Arc::new(AtomicBool::new(false));
    let accepted_count = Arc::new(AtomicUsize::new(0));
    let mut senders = Vec::new();
    for sender in 0..SENDERS {
        let (api, key) = (cluster.api.clone(), key.clone());
        let (c_dead, accepted_count) = (c_dead.clone(), accepted_count.clone());
        senders.push(tokio::spawn(async move {
            let mut accepted = Vec::new();
            let mut lost = Vec::new();
            let mut other = Vec::new();
            for n in 0..EACH {
                let text = format!("kill s{sender} n{n:02}");
                let mut on = (sender + n) % NAMES.len();
                if on == C && c_dead.load(Ordering::SeqCst) {
                    on = (sender + n) % 2;
                }
                match api.send(on, &key, &text).await {
                    Ok(answer) if answer.status == StatusCode::ACCEPTED => {
                        accepted.push((on, text, answer.id()));
                        accepted_count.fetch_add(1, Ordering::SeqCst);
                    }
                    Ok(answer) => other.push((on, text, answer.status, answer.body)),
                    // The answer died with the instance.
                    Err(err) => lost.push((on, text, err.to_string())),
                }
                tokio::time::sleep(Duration::from_millis(80)).await;
            }
            (accepted, lost, other)
        }));
    }

    // Partway, while deliveries are under way and c holds messages it
    // received (waiting for a provider token or parked): SIGKILL to c.
    let deadline = Instant::now() + Duration::from_secs(20);
    let held_by_c = loop {
        let accepted = accepted_count.load(Ordering::SeqCst);
        if accepted >= 60 && cluster.sms.count() >= 10 {
            let held = cluster
                .api
                .metric_sum(C, "fairlane_messages_waiting", &[])
                .await;
            if held >= 1.0 {
                break held;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no moment to kill c: {accepted} accepted, {} delivered, c holding {} messages",
            cluster.sms.count(),
            cluster
                .api
                .metric_sum(C, "fairlane_messages_waiting", &[])
                .await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    c_dead.store(true, Ordering::SeqCst);
    cluster.kill(C);
    let accepted_at_kill = accepted_count.load(Ordering::SeqCst);
    let delivered_at_kill = cluster.sms.count();

    let mut accepted = Vec::new();
    let mut lost = Vec::new();
    let mut other = Vec::new();
    for sender in senders {
        let (a, l, o) = sender.await.expect("sender task");
        accepted.extend(a);
        lost.extend(l);
        other.extend(o);
    }
    let by_c = accepted.iter().filter(|(on, _, _)| *on == C).count();
    eprintln!(
        "killed c holding {held_by_c} messages, with {accepted_at_kill} accepted and \
         {delivered_at_kill} delivered; in all {} accepted ({by_c} by c), {} answers lost with \
         c, other answers: {:?}",
        accepted.len(),
        lost.len(),
        other
            .iter()
            .map(|(on, text, status, _)| format!("{} {text} {status}", NAMES[*on]))
            .collect::<Vec<_>>()
    );
    assert!(by_c > 0, "c accepted nothing before it was killed");
    assert!(
        delivered_at_kill < accepted_at_kill,
        "nothing was waiting for delivery when c was killed"
    );
    assert!(
        accepted.len() >= SENDERS * EACH * 2 / 3,
        "only {} of {} sends were accepted",
        accepted.len(),
        SENDERS * EACH
    );

    // Every 202, c's included, ends `sent`, read through the survivors.
    let ids: Vec<String> = accepted.iter().map(|(_, _, id)| id.clone()).collect();
    cluster
        .api
        .wait_all_sent(&key, &ids, &[A, B], Duration::from_secs(60))
        .await;
    // Later copies of a message would arrive by now.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let per_text = cluster.sms.per_text();
    let mut duplicates = 0;
    let mut twice = Vec::new();
    for (_, text, id) in &accepted {
        let calls = per_text.get(text).copied().unwrap_or(0);
        assert!(
            calls >= 1,
            "{id} ({text}) reads sent but never reached the provider"
        );
        duplicates += calls - 1;
        if calls > 1 {
            twice.push(format!("{text} (id {id}) ×{calls}"));
        }
    }
    let unanswered_delivered = lost
        .iter()
        .filter(|(_, text, _)| per_text.contains_key(text))
        .count();
    eprintln!(
        "{} provider calls for {} accepted messages: {duplicates} duplicates {twice:?}; \
         {unanswered_delivered} of the {} sends whose answer was lost were delivered too",
        cluster.sms.count(),
        accepted.len(),
        lost.len()
    );
    assert!(
        duplicates <= FAST_CONCURRENCY,
        "{duplicates} messages were sent twice: more than the {FAST_CONCURRENCY} the killed \
         instance can have had in flight"
    );
        })
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_an_instance_committed_but_never_relayed_are_sent_by_another_instances_sweeper() {
    use crate::sqs::{Sends, SqsProxy};
    const MESSAGES: usize = 12;
    let moto = crate::backends::moto_url();
    // Instance a reaches SQS through a proxy that will hold its sends.
    let proxy = SqsProxy::start(&moto).await;
    let mut cluster = Cluster::start_full(
        &default_redis_url(),
        [proxy.url.clone(), moto.clone(), moto],
    )
    .await;
    let key = cluster.tenant_with_key("acme", "bulk", 1000.0, 1000).await;

    // a commits and answers 202; its relay's SendMessageBatch calls hang.
    proxy.set(Sends::Hold);
    let mut accepted = Vec::new();
    for n in 0..MESSAGES {
        let text = format!("orphan n{n:02}");
        let answer = cluster.api.send(A, &key, &text).await.expect("a answers");
        assert_eq!(answer.status, StatusCode::ACCEPTED, "{}", answer.body);
        accepted.push((text, answer.id()));
    }
    assert_eq!(cluster.sms.count(), 0, "nothing reached SQS through a");
    cluster.kill(A);

    // b's and c's sweepers take a's rows once they are older than
    // outbox_sweep_secs (4 s); each message is sent once.
    let ids: Vec<String> = accepted.iter().map(|(_, id)| id.clone()).collect();
    cluster
        .api
        .wait_all_sent(&key, &ids, &[B, C], Duration::from_secs(60))
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let per_text = cluster.sms.per_text();
    for (text, id) in &accepted {
        assert_eq!(per_text.get(text), Some(&1), "{text} ({id}) provider calls");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_going_away_mid_run_gives_no_5xx() {
    const RATE: f64 = 10.0;
    const BURST: u32 = 5;
    const SENDERS: usize = 3;
    let redis_dir = tempfile::tempdir().expect("temporary directory");
    let mut redis = OwnRedis::start(redis_dir.path()).await;
    let cluster = Cluster::start_with_redis(&redis.url).await;
    let key = cluster.tenant_with_key("acme", "ten", RATE, BURST).await;

    // Steady sends, several times the plan's rate, through the three.
    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let mut senders = Vec::new();
    for sender in 0..SENDERS {
        let (api, key, stop) = (cluster.api.clone(), key.clone(), stop.clone());
        senders.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                let on = (sender + n) % NAMES.len();
                let at = Instant::now();
                let answer = api
                    .send(on, &key, &format!("outage s{sender} n{n:03}"))
                    .await;
                answers.push((at, on, answer));
                n += 1;
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            answers
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    redis.kill();
    let killed = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::SeqCst);
    let mut answers = Vec::new();
    for sender in senders {
        answers.extend(sender.await.expect("sender task"));
    }
    let outage = killed.elapsed().as_secs_f64();
    let before = killed.duration_since(started).as_secs_f64();

    let mut admitted_before = Vec::new();
    let mut admitted_during = Vec::new();
    let mut refused = [0usize; 2];
    let mut bad = Vec::new();
    for (at, on, answer) in &answers {
        let during = *at >= killed;
        match answer {
            Ok(answer) if answer.status == StatusCode::ACCEPTED => {
                if during {
                    admitted_during.push(answer.id());
                } else {
                    admitted_before.push(answer.id());
                }
            }
            Ok(answer) if answer.status == StatusCode::TOO_MANY_REQUESTS => {
                assert!(
                    answer.retry_after_secs() >= 1,
                    "a 429 from {} with Retry-After 0",
                    NAMES[*on]
                );
                refused[usize::from(during)] += 1;
            }
            Ok(answer) => bad.push(format!(
                "{} at {:+.3} s from the kill: {} {}",
                NAMES[*on],
                seconds_from(killed, *at),
                answer.status,
                answer.body
            )),
            Err(err) => bad.push(format!(
                "{} at {:+.3} s from the kill: no answer: {err}",
                NAMES[*on],
                seconds_from(killed, *at)
            )),
        }
    }
    let allowed_before = BURST as f64 + RATE * before + 1.0;
    let allowed_during = BURST as f64 + RATE * outage + 3.0;
    eprintln!(
        "{} sends; before the kill ({before:.2} s): {} admitted (at most {allowed_before:.1}), \
         {} refused; during the outage ({outage:.2} s): {} admitted (at most \
         {allowed_during:.1}), {} refused",
        answers.len(),
        admitted_before.len(),
        refused[0],
        admitted_during.len(),
        refused[1]
    );
    assert!(
        bad.is_empty(),
        "answers other than 202 and 429:\n{}",
        bad.join("\n")
    );
    assert!(
        admitted_before.len() as f64 <= allowed_before,
        "with Redis up the three admitted {} in {before:.2} s",
        admitted_before.len()
    );
    assert!(
        admitted_during.len() as f64 <= allowed_during,
        "without Redis the three admitted {} in {outage:.2} s: more than their shares of \
         {BURST} + {RATE}/s",
        admitted_during.len()
    );
    assert!(
        admitted_during.len() as f64 >= RATE * outage * 0.4,
        "without Redis the three admitted only {} in {outage:.2} s at {RATE}/s",
        admitted_during.len()
    );

    // Delivery goes on without Redis (the SMS gate on local shares).
    let ids: Vec<String> = admitted_before
        .iter()
        .chain(&admitted_during)
        .cloned()
        .collect();
    cluster
        .api
        .wait_all_sent(&key, &ids, &[A, B, C], Duration::from_secs(30))
        .await;
    let after_kill = cluster
        .sms
        .arrivals()
        .iter()
        .filter(|arrival| arrival.at > killed)
        .count();
    assert!(
        after_kill >= admitted_during.len(),
        "only {after_kill} provider calls since Redis went away, for {} messages admitted since",
        admitted_during.len()
    );
    let mut seen = HashSet::new();
    let twice: Vec<String> = cluster
        .sms
        .arrivals()
        .into_iter()
        .filter(|arrival| !seen.insert(arrival.body.clone()))
        .map(|arrival| arrival.body)
        .collect();
    assert!(twice.is_empty(), "sent more than once: {twice:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_made_dedicated_on_one_instance_sends_to_its_own_queue_through_the_others() {
    let cluster = Cluster::start().await;
    let api = &cluster.api;
    let key = cluster.tenant_with_key("acme", "open", 1000.0, 1000).await;
    // Paused as well, so what reaches its own queue stays there to count.
    let (status, body) = api
        .admin(
            A,
            reqwest::Method::PATCH,
            "/v1/admin/tenants/acme",
            Some(json!({"isolation": "dedicated", "status": "paused"})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    tokio::time::sleep(PROPAGATION + Duration::from_millis(500)).await;
    for on in [B, C] {
        for n in 0..5 {
            // The first send through an instance opens the tenant's queues
            // there (creating them on moto, slow on a busy machine): a 503
            // with Retry-After is a clean refusal, and the client retries.
            let mut tries = 0;
            loop {
                let answer = api
                    .send(on, &key, &format!("via {} {n}", NAMES[on]))
                    .await
                    .unwrap();
                tries += 1;
                if answer.status == StatusCode::SERVICE_UNAVAILABLE && tries < 4 {
                    assert!(answer.retry_after.is_some(), "{}", answer.body);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
                assert_eq!(answer.status, StatusCode::ACCEPTED, "{}", answer.body);
                break;
            }
        }
    }
    // The ten sends made through b and c wait in the tenant's own queue
    // (with any copy of a refused send that reached it after its 503: the
    // consumer drops those, and here the tenant is paused).
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (status, view) = api
            .admin(
                A,
                reqwest::Method::GET,
                "/v1/admin/tenants/acme/queue",
                None,
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{view}");
        let depth: u64 = view["lanes"]
            .as_array()
            .map(|lanes| lanes.iter().filter_map(|lane| lane["depth"].as_u64()).sum())
            .unwrap_or(0);
        if depth >= 10 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the tenant's own queue holds {depth} of the 10 sends made on b and c: {view}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Issue 31: a message accepted through a and sent by b (the only instance
/// whose consumers run), over SQS on moto, is one trace: a's request, its
/// producer span and the wait for the group commit (which the commit's span
/// links to), a's SendMessageBatch span linked to the producer span, and
/// b's consumer span continuing it with the token wait, the claim and the
/// provider call under it. b's "Message sent." line carries the trace id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_accepted_by_one_instance_and_sent_by_another_is_one_trace() {
    use crate::traces::{
        CLIENT, CONSUMER, OtlpReceiver, PRODUCER, SERVER, assert_no_secrets, child_of, span_of,
    };
    let otlp = OtlpReceiver::start().await;
    let moto = crate::backends::moto_url();
    let cluster = Cluster::start_with_env(
        &default_redis_url(),
        [moto.clone(), moto.clone(), moto],
        |on| {
            let mut env = vec![
                ("FAIRLANE__TELEMETRY__OTLP_ENDPOINT", otlp.url.clone()),
                ("FAIRLANE__TELEMETRY__EXPORT_INTERVAL_MS", "100".to_owned()),
                (
                    "OTEL_RESOURCE_ATTRIBUTES",
                    format!("service.instance.id={}", NAMES[on]),
                ),
                ("FAIRLANE_LOG_FORMAT", "json".to_owned()),
            ];
            if on != B {
                env.push(("FAIRLANE__CONSUMERS__ENABLED", "false".to_owned()));
            }
            env
        },
    )
    .await;
    let key = cluster.tenant_with_key("traced", "traced", 50.0, 50).await;
    let answer = cluster
        .api
        .send(A, &key, "trace marker 31")
        .await
        .expect("send through a");
    assert_eq!(answer.status, StatusCode::ACCEPTED, "{:?}", answer.body);
    let id = answer.id();
    cluster
        .api
        .wait_all_sent(
            &key,
            std::slice::from_ref(&id),
            &[A],
            Duration::from_secs(30),
        )
        .await;
    otlp.wait_until("b's provider call and a's SendMessageBatch", |spans| {
        spans.iter().any(|span| {
            span.instance == "b" && span.attribute("fairlane.message.id") == Some(id.as_str())
        }) && spans.iter().any(|span| {
            span.instance == "a" && span.name.starts_with("send ") && span.kind == PRODUCER
        })
    })
    .await;
    let spans = otlp.spans();

    let created = span_of(&spans, "create fast", &id);
    assert_eq!((created.instance.as_str(), created.kind), ("a", PRODUCER));
    let request = spans
        .iter()
        .find(|span| span.span_id == created.parent_span_id)
        .unwrap_or_else(|| panic!("the create span's parent was not exported: {created:#?}"));
    assert_eq!(
        (
            request.instance.as_str(),
            request.name.as_str(),
            request.kind
        ),
        ("a", "POST /v1/messages", SERVER)
    );
    let wait = child_of(&spans, "wait for the durable write", request);
    assert!(
        spans
            .iter()
            .any(|span| span.instance == "a" && span.name == "group commit" && span.links_to(wait)),
        "no group commit span of a links to {wait:#?}"
    );
    let send = spans
        .iter()
        .find(|span| span.name.starts_with("send ") && span.links_to(created))
        .unwrap_or_else(|| panic!("no SendMessageBatch span links to {created:#?}"));
    assert_eq!((send.instance.as_str(), send.kind), ("a", PRODUCER));
    assert_eq!(send.attribute("messaging.system"), Some("aws_sqs"));

    // On SQS the consumer span names the system and the class queue the
    // message came from (OpenTelemetry messaging conventions).
    let queue = send
        .attribute("messaging.destination.name")
        .expect("the SendMessageBatch span names its queue");
    assert!(queue.ends_with("-fast"), "a normal send's queue: {queue}");
    let process = span_of(&spans, &format!("process {queue}"), &id);
    assert_eq!((process.instance.as_str(), process.kind), ("b", CONSUMER));
    assert_eq!(process.attribute("messaging.system"), Some("aws_sqs"));
    assert_eq!(process.attribute("messaging.destination.name"), Some(queue));
    assert!(
        process.is_child_of(created),
        "{process:#?} under {created:#?}"
    );
    let token = child_of(&spans, "wait for a provider token", process);
    let claim = child_of(&spans, "claim", process);
    let call = child_of(&spans, "send sms", process);
    assert_eq!(call.kind, CLIENT);
    assert_eq!(call.attribute("fairlane.outcome"), Some("sent"));
    for span in [token, claim, call] {
        assert_eq!(span.instance, "b", "{span:#?}");
    }
    assert_no_secrets(&spans, &["+15551234567", "trace marker"]);

    let log = std::fs::read_to_string(&cluster.instances[B].log).expect("b's log");
    let sent: Value = log
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .find(|line| {
            line["fields"]["message"] == "Message sent."
                && line["fields"]["message_id"] == id.as_str()
        })
        .unwrap_or_else(|| panic!("no \"Message sent.\" line for {id} in b's log:\n{log}"));
    assert_eq!(sent["trace_id"], created.trace_id.as_str(), "{sent}");
}

/// A test key's `temporary` recipient fails its first attempt and is sent
/// on its second even when another instance makes it: the simulated outcome
/// is read from the store (the status before the attempt), not from the
/// memory of the instance that failed it (issue 45, item 2). The instance
/// that made the first attempt is killed as soon as its retry counter moves;
/// the retry's backoff (full jitter up to 6 s) leaves the others to make the
/// second. With the outcome kept in process memory, the second attempt
/// would fail again and the message be sent on its third.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_temporary_test_recipient_is_sent_on_its_second_attempt_by_another_instance() {
    let moto = crate::backends::moto_url();
    let mut cluster = Cluster::start_with_env(
        &default_redis_url(),
        [moto.clone(), moto.clone(), moto],
        |_| vec![("FAIRLANE__RETRY__BASE_DELAY_MS", "6000".to_owned())],
    )
    .await;
    cluster.api.put_plan(A, "tests", 100.0, 100, 32).await;
    cluster.api.create_tenant(A, "acme", "tests").await;
    let (status, body) = cluster
        .api
        .admin(
            A,
            reqwest::Method::POST,
            "/v1/admin/tenants/acme/keys",
            Some(json!({"kind": "test"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "issue a test key: {body}");
    let key = body["key"].as_str().expect("key").to_owned();
    cluster.api.wait_key_known_everywhere(&key).await;

    let response = cluster
        .api
        .client
        .post(cluster.api.url(A, "/v1/messages"))
        .bearer_auth(&key)
        .json(&json!({"channel": "sms", "to": "+15005550004", "text": "temporary"}))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), StatusCode::ACCEPTED);
    let id = response.json::<Value>().await.expect("JSON")["id"]
        .as_str()
        .expect("id")
        .to_owned();

    let deadline = Instant::now() + Duration::from_secs(30);
    let first = 'found: loop {
        for on in 0..NAMES.len() {
            let retried = cluster
                .api
                .metric_sum(on, "fairlane_messages_retried_total", &[])
                .await;
            if retried >= 1.0 {
                break 'found on;
            }
        }
        assert!(Instant::now() < deadline, "no instance retried {id}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    cluster.kill(first);
    let other = (first + 1) % NAMES.len();
    let deadline = Instant::now() + Duration::from_secs(60);
    let view = loop {
        let (status, view) = cluster.api.message(other, &key, &id).await;
        assert_eq!(status, StatusCode::OK, "{view}");
        // The simulator reports a delivery as soon as it has sent.
        if view["status"] == "sent" || view["status"] == "delivered" {
            break view;
        }
        assert!(Instant::now() < deadline, "{id} not sent: {view}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(view["attempts"], 2, "one failure, then sent: {view}");
    assert!(view["sent_at"].is_string(), "{view}");
    assert_eq!(view["test"], true, "{view}");
}

/// A webhook endpoint that notes when each call arrived (and which
/// message it carries) and answers 200 after [`HookEndpoint::DELAY`].
#[derive(Clone, Default)]
struct HookEndpoint(Arc<Mutex<Vec<(Instant, String)>>>);

impl HookEndpoint {
    const DELAY: Duration = Duration::from_millis(1000);

    /// The messages whose call was answered before `at` or arrived after
    /// it: a call in flight at `at` (killed with its instance) is not one.
    fn answered_around(&self, at: Instant) -> HashSet<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(arrived, _)| *arrived + Self::DELAY <= at || *arrived > at)
            .map(|(_, id)| id.clone())
            .collect()
    }
}

impl wiremock::Respond for HookEndpoint {
    fn respond(&self, call: &wiremock::Request) -> wiremock::ResponseTemplate {
        let body: Value = serde_json::from_slice(&call.body).unwrap_or_default();
        let id = body["data"]["id"].as_str().unwrap_or_default().to_owned();
        self.0.lock().unwrap().push((Instant::now(), id));
        wiremock::ResponseTemplate::new(200).set_delay(Self::DELAY)
    }
}

/// Three instances on PostgreSQL and a tenant with a webhook on
/// `message.sent`: one instance at a time reads the tenant's events. Killed
/// (kill -9) while its calls are in flight, it loses none: once its lease
/// has run out another instance reads again from the stream's position, so
/// every message's event reaches the endpoint (at least once), those whose
/// call was cut short by the kill included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_instance_that_reads_a_webhook_stream_loses_no_event() {
    use wiremock::matchers::method;
    use wiremock::{Mock, MockServer};
    const MESSAGES: usize = 60;
    let mut cluster = Cluster::start().await;
    let key = cluster.tenant_with_key("acme", "hooks", 100.0, 100).await;
    let endpoint = MockServer::start().await;
    let calls = HookEndpoint::default();
    Mock::given(method("POST"))
        .respond_with(calls.clone())
        .mount(&endpoint)
        .await;
    let answer = cluster
        .api
        .client
        .put(cluster.api.url(A, "/v1/webhook"))
        .bearer_auth(&key)
        .json(&json!({"url": endpoint.uri(), "events": ["message.sent"]}))
        .send()
        .await
        .expect("PUT /v1/webhook");
    assert_eq!(answer.status(), StatusCode::CREATED, "set the webhook");
    let mut ids = Vec::new();
    for n in 0..MESSAGES {
        let answer = cluster
            .api
            .send(n % NAMES.len(), &key, &format!("hook {n}"))
            .await;
        ids.push(answer.expect("send").id());
    }
    // The instance whose dispatcher has delivered calls reads the stream.
    let deadline = Instant::now() + Duration::from_secs(30);
    let reader = 'found: loop {
        for on in 0..NAMES.len() {
            let delivered = cluster
                .api
                .metric_sum(on, "fairlane_webhook_attempts_total", &["delivered"])
                .await;
            if delivered >= 5.0 {
                break 'found on;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no instance delivered a webhook call"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    cluster.kill(reader);
    let killed = Instant::now();
    let readers: Vec<usize> = (0..NAMES.len()).filter(|on| *on != reader).collect();
    cluster
        .api
        .wait_all_sent(&key, &ids, &readers, Duration::from_secs(60))
        .await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let missing = loop {
        let got = calls.answered_around(killed);
        let missing: Vec<&String> = ids.iter().filter(|id| !got.contains(*id)).collect();
        if missing.is_empty() || Instant::now() > deadline {
            break missing.len();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        missing, 0,
        "{missing} of {MESSAGES} messages' `message.sent` never reached the endpoint after \
         instance {} was killed",
        NAMES[reader]
    );
}
