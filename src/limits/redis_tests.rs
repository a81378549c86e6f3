//! The Redis backend of the limits against a real Redis: two instances (two
//! `RedisLimits`, two `TenantLimits`, two `ProviderGate`s) sharing one key
//! prefix, and outages of a Redis server the test starts and kills itself.
//!
//! The shared Redis comes from `crate::test_servers` (`FAIRLANE_TEST_REDIS_URL`,
//! else 6379, else one it starts); outage tests start `redis-server` (or
//! `FAIRLANE_TEST_REDIS_SERVER`) on a free port and stop it by its PID.
//! Without either, the tests fail saying so. Each test uses a random key
//! prefix and deletes its keys at the end.
//!
//! These run on real time, so they assert only bounds that a slow machine
//! cannot break: never more than `burst + rate × elapsed + 1`, and at least
//! a generous fraction of it.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tempfile::TempDir;
use tokio::sync::watch;

use super::admission::TenantLimits;
use super::gate::ProviderGate;
use super::redis::RedisLimits;
use super::tenant::{Grant, Refusal};
use crate::limits::tenant::tests::NoneSent;
use crate::model::{Lane, Priority};
use crate::tenants::Plan;

const CALL_TIMEOUT: Duration = Duration::from_millis(250);

fn shared_redis_url() -> String {
    crate::test_servers::redis_url()
}

fn plan(rate_per_second: f64, burst: u32, daily_quota: u64) -> Plan {
    Plan {
        name: "test".into(),
        lane: Lane::Fast,
        rate_per_second,
        burst,
        daily_quota,
        max_in_flight: 1,
        uploads_per_minute: 60,
        upload_bytes_held: 0,
    }
}

/// A random key prefix whose keys are deleted when this is dropped, even
/// when the test fails.
struct Prefix {
    url: String,
    name: String,
}

impl Prefix {
    fn new(url: &str) -> Self {
        Prefix {
            url: url.to_owned(),
            name: format!("fairlane-test-{}", uuid::Uuid::new_v4().simple()),
        }
    }

    /// Keys under this prefix right now.
    fn keys(&self) -> Vec<String> {
        let Ok(mut conn) = redis::Client::open(self.url.as_str()).and_then(|c| c.get_connection())
        else {
            return Vec::new();
        };
        redis::cmd("KEYS")
            .arg(format!("{}:*", self.name))
            .query(&mut conn)
            .unwrap_or_default()
    }
}

impl Drop for Prefix {
    fn drop(&mut self) {
        let keys = self.keys();
        if keys.is_empty() {
            return;
        }
        if let Ok(mut conn) =
            redis::Client::open(self.url.as_str()).and_then(|c| c.get_connection())
        {
            let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(keys).query(&mut conn);
        }
    }
}

/// One fairlane instance's limits: its own store, its own Redis
/// connection and heartbeat, the shared prefix.
struct Instance {
    redis: Arc<RedisLimits>,
    tenants: TenantLimits,
    /// Held for the store's temporary file.
    _dir: TempDir,
    /// Stops the heartbeat when dropped.
    _stop: watch::Sender<bool>,
}

impl Instance {
    async fn start(url: &str, prefix: &Prefix) -> Instance {
        let redis = RedisLimits::connect_to(url, &prefix.name, CALL_TIMEOUT)
            .await
            .expect("a well-formed Redis URL");
        let dir = tempfile::tempdir().expect("temporary directory");
        let (stop, stopped) = watch::channel(false);
        redis.spawn_heartbeat(stopped);
        Instance {
            tenants: TenantLimits::with_redis(Arc::new(NoneSent), Arc::clone(&redis)),
            redis,
            _dir: dir,
            _stop: stop,
        }
    }

    /// An instance on the machine's shared Redis; fails the test when that
    /// Redis does not answer.
    async fn on_shared_redis(prefix: &Prefix) -> Instance {
        let instance = Self::start(&prefix.url, prefix).await;
        assert!(
            instance.redis.is_up(),
            "no Redis answers at {} (FAIRLANE_TEST_REDIS_URL): these tests need a real Redis; \
             start one with `redis-server` or point the variable at one",
            prefix.url
        );
        instance
    }

    fn gate(&self, rate_per_second: f64, burst: u32) -> Arc<ProviderGate> {
        Arc::new(
            ProviderGate::new(rate_per_second, burst)
                .with_global_bucket(Arc::clone(&self.redis), "email"),
        )
    }

    async fn admit(&self, tenant: &str, plan: &Plan) -> Result<Grant, Refusal> {
        self.admit_units(tenant, plan, 1).await
    }

    async fn admit_units(&self, tenant: &str, plan: &Plan, units: u32) -> Result<Grant, Refusal> {
        self.tenants
            .admit(&live(tenant), plan, units)
            .await
            .expect("admission answers without an error")
    }
}

/// `tenant`'s live world.
fn live(tenant: &str) -> crate::model::Scope {
    crate::model::Scope::new(tenant, crate::model::World::Live)
}

/// Waits until `check` holds, up to `within`; false if it never did.
async fn eventually(within: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    check()
}

/// Largest excess over `burst + rate × t` in any window between two of the
/// (sorted) grant instants.
fn worst_window_excess(grants: &[Instant], rate: f64, burst: u32) -> f64 {
    let mut worst = f64::NEG_INFINITY;
    for i in 0..grants.len() {
        for j in i..grants.len() {
            let window = (grants[j] - grants[i]).as_secs_f64();
            worst = worst.max((j - i + 1) as f64 - f64::from(burst) - rate * window);
        }
    }
    worst
}

/// Runs `callers` tasks per gate, each taking tokens back to back, for
/// `run_for`; returns every grant's instant, sorted.
async fn hammer_gates(
    gates: &[Arc<ProviderGate>],
    callers: usize,
    run_for: Duration,
) -> Vec<Instant> {
    let grants = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = tokio::task::JoinSet::new();
    for gate in gates {
        for i in 0..callers {
            let (gate, grants) = (Arc::clone(gate), Arc::clone(&grants));
            tasks.spawn(async move {
                loop {
                    gate.acquire_for(Priority::ALL[i % 3], "t").await;
                    grants.lock().unwrap().push(Instant::now());
                }
            });
        }
    }
    tokio::time::sleep(run_for).await;
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    let mut grants = grants.lock().unwrap().clone();
    grants.sort();
    grants
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_together_admit_no_more_than_burst_plus_rate_of_one_plan() {
    let prefix = Prefix::new(&shared_redis_url());
    let a = Instance::on_shared_redis(&prefix).await;
    let b = Instance::on_shared_redis(&prefix).await;
    // A full bucket first, on a plan slow enough that nothing refills while
    // the calls run: exactly the burst passes, counting down, shared by both.
    let slow = plan(1.0, 5, 1_000_000);
    for (i, expected) in [4, 3, 2, 1, 0].into_iter().enumerate() {
        let instance = if i % 2 == 0 { &a } else { &b };
        let grant = instance
            .admit("fresh", &slow)
            .await
            .expect("within the burst");
        assert_eq!(grant.info.remaining, expected, "{grant:?}");
    }
    match b.admit("fresh", &slow).await {
        Err(Refusal::Rate { retry_after, .. }) => assert!(
            retry_after > Duration::ZERO && retry_after <= Duration::from_secs(1),
            "{retry_after:?}"
        ),
        other => panic!("the sixth send of a burst of 5 passed: {other:?}"),
    }

    let plan = plan(10.0, 5, 1_000_000);
    let period = Duration::from_millis(100);

    let start = Instant::now();
    let (mut admitted, mut refused) = (0u32, 0u32);
    while start.elapsed() < Duration::from_secs(3) {
        for instance in [&a, &b] {
            match instance.admit("acme", &plan).await {
                Ok(grant) => {
                    admitted += 1;
                    assert_eq!(grant.info.limit, 5);
                    assert!(grant.info.remaining < 5, "{grant:?}");
                }
                Err(Refusal::Rate { retry_after, info }) => {
                    refused += 1;
                    // Hammered without pause, the bucket is never more than
                    // one emission interval from its next token.
                    assert!(
                        retry_after > Duration::ZERO && retry_after <= period,
                        "Retry-After of {retry_after:?} with one token per 100 ms"
                    );
                    assert_eq!((info.limit, info.remaining, info.reset_secs), (5, 0, 1));
                }
                Err(other) => panic!("unexpected refusal {other:?}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = start.elapsed().as_secs_f64();
    println!(
        "two instances, plan 10/s burst 5, {elapsed:.2} s: {admitted} admitted, {refused} refused"
    );
    assert!(
        f64::from(admitted) <= 5.0 + 10.0 * elapsed + 1.0,
        "{admitted} admitted in {elapsed:.2} s"
    );
    assert!(
        f64::from(admitted) >= 10.0 * elapsed * 0.5,
        "only {admitted} admitted in {elapsed:.2} s"
    );
    assert!(refused > 0);

    // A refusal's Retry-After is when the bucket has a token again: waiting
    // that long (with no one else asking) is enough.
    let wait = loop {
        match a.admit("acme", &plan).await {
            Ok(_) => continue,
            Err(Refusal::Rate { retry_after, .. }) => break retry_after,
            Err(other) => panic!("unexpected refusal {other:?}"),
        }
    };
    tokio::time::sleep(wait).await;
    assert!(
        b.admit("acme", &plan).await.is_ok(),
        "refused after Retry-After"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_one_daily_quota_and_a_release_gives_one_back() {
    let prefix = Prefix::new(&shared_redis_url());
    let a = Instance::on_shared_redis(&prefix).await;
    let b = Instance::on_shared_redis(&prefix).await;
    let plan = plan(1000.0, 1000, 7);

    let mut grants = Vec::new();
    for round in 0..10 {
        let instance = if round % 2 == 0 { &a } else { &b };
        match instance.admit("acme", &plan).await {
            Ok(grant) => grants.push(grant),
            Err(Refusal::Quota { retry_after, quota }) => {
                assert_eq!(quota, 7);
                assert!(
                    retry_after > Duration::ZERO && retry_after <= Duration::from_secs(86_400),
                    "{retry_after:?}"
                );
            }
            Err(other) => panic!("unexpected refusal {other:?}"),
        }
    }
    assert_eq!(grants.len(), 7, "the quota of 7 is shared by both");

    // A's send was not accepted after all: B may use its place.
    a.tenants.release(&live("acme"), &grants[0]).await;
    assert!(b.admit("acme", &plan).await.is_ok());
    assert!(matches!(
        a.admit("acme", &plan).await,
        Err(Refusal::Quota { .. })
    ));
    // Another tenant has a day of its own.
    assert!(a.admit("other", &plan).await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_of_several_units_is_charged_whole_and_a_release_gives_all_back() {
    let prefix = Prefix::new(&shared_redis_url());
    let a = Instance::on_shared_redis(&prefix).await;
    let b = Instance::on_shared_redis(&prefix).await;
    // A bucket of 3 refilling once in 100 s, 5 sends a day.
    let plan = plan(0.01, 3, 5);
    let three = a
        .admit_units("acme", &plan, 3)
        .await
        .expect("three fit a full bucket of 3");
    assert_eq!(three.info.remaining, 0);
    assert!(matches!(
        b.admit_units("acme", &plan, 1).await,
        Err(Refusal::Rate { .. })
    ));
    assert!(matches!(
        b.admit_units("acme", &plan, 2).await,
        Err(Refusal::Rate { .. })
    ));
    // The refusals took nothing; the release gives all three back, to
    // the bucket and to the day, for the other instance too.
    a.tenants.release(&live("acme"), &three).await;
    let again = b
        .admit_units("acme", &plan, 3)
        .await
        .expect("the bucket is full again");
    assert_eq!(again.info.remaining, 0);
    b.tenants.release(&live("acme"), &again).await;
    let two = a.admit_units("acme", &plan, 2).await.expect("two of three");
    assert_eq!(two.info.remaining, 1);
    // 2 of the day's 5 are used: 3 fit, 4 do not (the quota is looked at
    // before the bucket, which holds only 1).
    assert!(matches!(
        b.admit_units("acme", &plan, 4).await,
        Err(Refusal::Quota { .. })
    ));
    assert!(matches!(
        b.admit_units("acme", &plan, 3).await,
        Err(Refusal::Rate { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gates_sharing_a_redis_bucket_keep_the_fleet_within_burst_plus_rate() {
    let prefix = Prefix::new(&shared_redis_url());
    let a = Instance::on_shared_redis(&prefix).await;
    let b = Instance::on_shared_redis(&prefix).await;
    let gates = [a.gate(20.0, 5), b.gate(20.0, 5)];

    let run_for = Duration::from_secs(3);
    let grants = hammer_gates(&gates, 4, run_for).await;
    let excess = worst_window_excess(&grants, 20.0, 5);
    let span = (grants[grants.len() - 1] - grants[0]).as_secs_f64();
    let after_burst = (grants.len() as f64 - 5.0) / span;
    println!(
        "two gates sharing 20/s burst 5: {} grants in {span:.2} s, {after_burst:.2}/s after the burst, \
         worst window {excess:+.2} against burst + rate × t",
        grants.len()
    );
    assert!(
        excess <= 1.0,
        "a window held {excess:.2} grants more than 5 + 20 × t"
    );
    assert!(
        after_burst >= 0.85 * 20.0,
        "only {after_burst:.2} grants a second after the burst"
    );
    assert!(gates.iter().all(|gate| gate.waiting() == [0, 0, 0]));
}

/// The admin view's tokens of a fleet-wide bucket: a full bucket holds its
/// burst, tokens one instance takes are gone for the other, and reading
/// takes none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_wide_buckets_tokens_are_read_from_redis_without_taking_one() {
    let prefix = Prefix::new(&shared_redis_url());
    let a = Instance::on_shared_redis(&prefix).await;
    let b = Instance::on_shared_redis(&prefix).await;
    // 1 a second, so nothing accrues while the test looks.
    let (gate_a, gate_b) = (a.gate(1.0, 5), b.gate(1.0, 5));
    assert_eq!(
        gate_b.tokens().await,
        [Some(5)],
        "a bucket never used is full"
    );
    for _ in 0..3 {
        gate_a.acquire(Priority::Normal).await;
    }
    assert_eq!(gate_b.tokens().await, [Some(2)], "three taken through a");
    assert_eq!(gate_b.tokens().await, [Some(2)], "reading takes nothing");
    assert_eq!(gate_a.tokens().await, [Some(2)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_restarted_on_a_shared_redis_bucket_takes_no_second_burst() {
    // One process spends the fleet's burst and goes on at the rate, then
    // stops; the next starts at once with a connection and a gate of its
    // own. The bucket lives in Redis, so the second finds it as the first
    // left it and the two together keep burst + rate × t.
    let prefix = Prefix::new(&shared_redis_url());
    let run_for = Duration::from_millis(1500);
    let before = {
        let first = Instance::on_shared_redis(&prefix).await;
        hammer_gates(&[first.gate(20.0, 5)], 4, run_for).await
    };
    let second = Instance::on_shared_redis(&prefix).await;
    let after = hammer_gates(&[second.gate(20.0, 5)], 4, run_for).await;
    let grants: Vec<Instant> = before.iter().chain(&after).copied().collect();
    let excess = worst_window_excess(&grants, 20.0, 5);
    println!(
        "a gate restarted on a shared bucket of 20/s burst 5: {} grants before, {} after, \
         worst window {excess:+.2} against burst + rate × t",
        before.len(),
        after.len()
    );
    assert!(
        excess <= 1.0,
        "a window held {excess:.2} grants more than 5 + 20 × t across the restart"
    );
    assert!(
        after.len() >= 20,
        "only {} grants after the restart",
        after.len()
    );
}

/// A `redis-server` of the test's own on a free port, without persistence.
/// Stopped by its PID, never by name.
struct OwnRedis {
    port: u16,
    child: Option<Child>,
}

impl OwnRedis {
    fn start() -> OwnRedis {
        let port = {
            let listener = TcpListener::bind("127.0.0.1:0").expect("a free port");
            listener.local_addr().expect("bound").port()
        };
        let mut redis = OwnRedis { port, child: None };
        redis.restart();
        redis
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again) on the same port and waits until it answers.
    fn restart(&mut self) {
        let binary =
            std::env::var("FAIRLANE_TEST_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let child = Command::new(&binary)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|err| {
                panic!(
                    "cannot start {binary:?} ({err}): the outage tests need redis-server \
                     (apt-get install redis-server) or FAIRLANE_TEST_REDIS_SERVER"
                )
            });
        self.child = Some(child);
        let client = redis::Client::open(self.url()).expect("URL");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let pong = client
                .get_connection()
                .and_then(|mut conn| redis::cmd("PING").query::<String>(&mut conn));
            if pong.is_ok() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {} did not answer within 10 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills this server (SIGKILL to its own PID) and reaps it.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Runs one command on this server.
    fn command(&self, args: &[&str]) -> redis::Value {
        let client = redis::Client::open(self.url()).expect("URL");
        let mut conn = client.get_connection().expect("own Redis answers");
        let mut cmd = redis::cmd(args[0]);
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        cmd.query(&mut conn).expect("command runs")
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_redis_is_down_admission_and_gates_run_on_local_shares_and_recover_by_themselves() {
    let mut server = OwnRedis::start();
    let prefix = Prefix::new(&server.url());
    let a = Instance::start(&server.url(), &prefix).await;
    let b = Instance::start(&server.url(), &prefix).await;
    assert!(a.redis.is_up() && b.redis.is_up());
    assert!(
        eventually(Duration::from_secs(5), || a.redis.live_instances() == 2).await,
        "both heartbeats counted"
    );
    let plan = plan(10.0, 6, 1_000_000);
    assert!(a.admit("acme", &plan).await.is_ok());
    let gate = a.gate(20.0, 4);
    gate.acquire(Priority::Normal).await;

    server.kill();

    // Admission answers at once and from then on runs on A's half of the
    // plan: 5/s, burst 3 (no error, no waiting for Redis per request).
    let start = Instant::now();
    let (mut admitted, mut slowest) = (0u32, Duration::ZERO);
    while start.elapsed() < Duration::from_secs(2) {
        let asked = Instant::now();
        match a.admit("acme", &plan).await {
            Ok(grant) => {
                admitted += 1;
                assert_eq!(grant.info.limit, 3, "the local share's burst");
            }
            Err(Refusal::Rate { retry_after, info }) => {
                assert_eq!(info.limit, 3);
                assert!(retry_after <= Duration::from_millis(200), "{retry_after:?}");
            }
            Err(other) => panic!("unexpected refusal {other:?}"),
        }
        slowest = slowest.max(asked.elapsed());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = start.elapsed().as_secs_f64();
    assert!(!a.redis.is_up(), "the outage was noticed");
    println!(
        "Redis down: {admitted} admitted in {elapsed:.2} s on a share of 5/s burst 3; \
         slowest answer {slowest:?}"
    );
    assert!(
        f64::from(admitted) <= 3.0 + 5.0 * elapsed + 1.0,
        "{admitted} admitted"
    );
    assert!(
        f64::from(admitted) >= 5.0 * elapsed * 0.5,
        "{admitted} admitted"
    );
    assert!(
        slowest <= Duration::from_millis(1000),
        "an admission took {slowest:?}"
    );

    // The gate paces A's calls at its share: 10/s, burst 2, starting empty.
    let grants = hammer_gates(std::slice::from_ref(&gate), 3, Duration::from_secs(2)).await;
    let span = (grants[grants.len() - 1] - grants[0]).as_secs_f64();
    println!(
        "Redis down: the gate granted {} in {span:.2} s on a share of 10/s",
        grants.len()
    );
    assert!(
        worst_window_excess(&grants, 10.0, 2) <= 1.0,
        "the share of 10/s burst 2 was exceeded"
    );
    assert!(grants.len() >= 10, "only {} grants in 2 s", grants.len());

    // Back on the same port: the heartbeat finds it, and admissions go
    // through Redis again (the day's counter is created there anew).
    server.restart();
    assert!(
        eventually(Duration::from_secs(10), || a.redis.is_up()).await,
        "the backend did not come back within 10 s of Redis"
    );
    assert!(a.admit("acme", &plan).await.is_ok());
    let day = crate::model::now_ms().div_euclid(super::tenant::DAY_MS);
    let counter = format!("{}:tenant:acme:quota:{day}", prefix.name);
    assert_eq!(
        server.command(&["EXISTS", &counter]),
        redis::Value::Int(1),
        "the admission went through Redis"
    );
    let grants = hammer_gates(std::slice::from_ref(&gate), 3, Duration::from_millis(500)).await;
    assert!(grants.len() >= 4, "the gate's Redis bucket grants again");
    server.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_admitted_while_redis_stalled_are_added_to_its_day_count_when_it_answers() {
    let server = OwnRedis::start();
    let prefix = Prefix::new(&server.url());
    let a = Instance::start(&server.url(), &prefix).await;
    assert!(a.redis.is_up());
    let plan = plan(1000.0, 1000, 100);
    for _ in 0..3 {
        assert!(a.admit("acme", &plan).await.is_ok());
    }
    let day = crate::model::now_ms().div_euclid(super::tenant::DAY_MS);
    let counter = format!("{}:tenant:acme:quota:{day}", prefix.name);
    assert_eq!(
        server.command(&["GET", &counter]),
        redis::Value::BulkString(b"3".to_vec())
    );

    // A stalled Redis (every client paused) counts as down: each call gives
    // up after the timeout, and admission goes on locally from count 3.
    server.command(&["CLIENT", "PAUSE", "1500", "ALL"]);
    let asked = Instant::now();
    for _ in 0..4 {
        assert!(a.admit("acme", &plan).await.is_ok());
    }
    assert!(!a.redis.is_up());
    assert!(
        asked.elapsed() < Duration::from_millis(1000),
        "four admissions took {:?}",
        asked.elapsed()
    );

    // Once Redis answers, the 4 local sends join the day's count. The
    // script call that timed out may still have run when the pause ended
    // (it was sent): then that one send is counted twice, never missed.
    assert!(
        eventually(Duration::from_secs(10), || a.redis.is_up()).await,
        "back within 10 s"
    );
    let count = || match server.command(&["GET", &counter]) {
        redis::Value::BulkString(text) => {
            String::from_utf8_lossy(&text).parse::<u64>().unwrap_or(0)
        }
        _ => 0,
    };
    assert!(
        eventually(Duration::from_secs(5), || count() >= 7).await,
        "day count {}",
        count()
    );
    let reconciled = count();
    assert!(reconciled <= 8, "day count {reconciled}");
    assert!(a.admit("acme", &plan).await.is_ok());
    assert_eq!(count(), reconciled + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_is_down_at_start_up_means_local_shares_until_it_answers() {
    let mut server = OwnRedis::start();
    let url = server.url();
    server.kill();
    let prefix = Prefix::new(&url);
    let a = Instance::start(&url, &prefix).await;
    assert!(!a.redis.is_up());
    assert!(a.admit("acme", &plan(10.0, 5, 100)).await.is_ok());
    server.restart();
    assert!(
        eventually(Duration::from_secs(10), || a.redis.is_up()).await,
        "came up within 10 s"
    );
    server.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_started_while_redis_is_down_paces_at_its_share_of_the_fleet_it_knows() {
    let mut server = OwnRedis::start();
    let url = server.url();
    server.kill();
    let prefix = Prefix::new(&url);
    // The fleet last counted three instances (the store keeps that): the
    // instance starting blind takes a third of the provider's 30/s, burst 3.
    let redis = RedisLimits::connect_to_fleet(&url, &prefix.name, CALL_TIMEOUT, 3)
        .await
        .expect("a well-formed Redis URL");
    assert!(!redis.is_up());
    assert_eq!(redis.live_instances(), 3);
    let gate = Arc::new(ProviderGate::new(30.0, 3).with_global_bucket(Arc::clone(&redis), "sms"));
    let run_for = Duration::from_secs(2);
    let grants = hammer_gates(std::slice::from_ref(&gate), 3, run_for).await;
    let excess = worst_window_excess(&grants, 10.0, 1);
    println!(
        "started with Redis down, assuming 3 instances: {} grants in {run_for:?} against a share of 10/s burst 1 \
         (worst window {excess:+.2})",
        grants.len()
    );
    assert!(
        excess <= 1.0,
        "the share of 10/s burst 1 was exceeded by {excess:.2}: the instance took more than its third"
    );
    assert!(grants.len() >= 10, "only {} grants in 2 s", grants.len());
    // Once Redis answers, the heartbeat counts the fleet (this instance
    // alone now) and the gate is fleet-wide again.
    server.restart();
    let (stop, stopped) = watch::channel(false);
    redis.spawn_heartbeat(stopped);
    assert!(
        eventually(Duration::from_secs(10), || redis.is_up()
            && redis.live_instances() == 1)
        .await,
        "the heartbeat counted the fleet within 10 s of Redis answering"
    );
    stop.send_replace(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_outage_the_bucket_in_redis_adds_no_burst_on_top_of_the_shares() {
    let mut server = OwnRedis::start();
    let prefix = Prefix::new(&server.url());
    let a = Instance::start(&server.url(), &prefix).await;
    let b = Instance::start(&server.url(), &prefix).await;
    assert!(
        eventually(Duration::from_secs(5), || a.redis.live_instances() == 2
            && b.redis.live_instances() == 2)
        .await,
        "both heartbeats counted"
    );
    let (rate, burst) = (20.0, 10);
    let gates = [a.gate(rate, burst), b.gate(rate, burst)];
    server.kill();
    // One call each finds Redis gone and builds the instance's share
    // (10/s, burst 5, empty); a second idle saves up both shares' bursts.
    for gate in &gates {
        gate.acquire(Priority::Normal).await;
    }
    assert!(
        !a.redis.is_up() && !b.redis.is_up(),
        "the outage was noticed"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Both instances call back to back from here on: they spend their
    // shares' bursts, pace at their shares, and go on in Redis once the
    // heartbeat finds it again, whose bucket (a restarted Redis's) is full.
    let hammer = tokio::spawn({
        let gates = gates.clone();
        async move { hammer_gates(&gates, 3, Duration::from_secs(4)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    tokio::task::block_in_place(|| server.restart());
    assert!(
        eventually(Duration::from_secs(3), || a.redis.is_up()
            && b.redis.is_up())
        .await,
        "both instances found Redis again within 3 s"
    );
    let grants = hammer.await.expect("the hammer runs");
    let excess = worst_window_excess(&grants, rate, burst);
    println!(
        "an outage of both instances and a restarted Redis: {} grants in 4 s of {rate}/s burst {burst} \
         (worst window {excess:+.2})",
        grants.len()
    );
    assert!(
        excess <= 1.0,
        "the fleet went {excess:.2} over burst + rate × t around Redis's return: \
         the bucket in Redis added its burst on top of the shares'"
    );
    assert!(grants.len() >= 40, "only {} grants in 4 s", grants.len());
    server.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_outage_of_every_instance_the_first_heartbeat_counts_the_whole_fleet() {
    let prefix = Prefix::new(&shared_redis_url());
    let client = redis::Client::open(prefix.url.as_str()).expect("URL");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("the shared Redis answers");
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let server_ms = secs * 1000 + micros / 1000;
    // The set as an 8 s outage of every instance leaves it: two instances
    // last beat 8 s ago, a third died 20 s ago.
    let key = format!("{}:instances", prefix.name);
    let _: () = redis::cmd("ZADD")
        .arg(&key)
        .arg(server_ms - 8_000)
        .arg("b")
        .arg(server_ms - 8_000)
        .arg("c")
        .arg(server_ms - 20_000)
        .arg("dead")
        .query_async(&mut conn)
        .await
        .unwrap();
    // The first instance back counts itself and the two that beat until
    // the outage, not itself alone; the one dead before it is forgotten.
    let a = Instance::start(&prefix.url, &prefix).await;
    assert!(a.redis.is_up());
    assert_eq!(
        a.redis.live_instances(),
        3,
        "the first heartbeat after the outage counted the fleet from now, not from its last beat"
    );
    let members: Vec<String> = redis::cmd("ZRANGE")
        .arg(&key)
        .arg(0)
        .arg(-1)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!members.contains(&"dead".to_owned()), "{members:?}");
    // b and c do not come back: once a's beats have moved the newest on,
    // they are stale by the same rule as ever and a counts itself alone.
    assert!(
        eventually(Duration::from_secs(4), || a.redis.live_instances() == 1).await,
        "instances that never beat again are forgotten after the outage"
    );
}

/// What one admission costs, local against Redis (one script call on the
/// loopback): `cargo test --lib limits::redis_tests -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, not a check"]
async fn reports_the_time_one_admission_takes_local_and_redis() {
    let prefix = Prefix::new(&shared_redis_url());
    let redis = Instance::on_shared_redis(&prefix).await;
    let local = TenantLimits::new(Arc::new(NoneSent));
    let plan = plan(1_000_000.0, 1_000_000, 100_000_000);
    let gate = redis.gate(1_000_000.0, 1_000_000);
    for (name, run) in [("local", 0), ("redis", 1), ("gate", 2)] {
        let mut took = Vec::with_capacity(5_000);
        for i in 0..5_000 {
            let tenant = format!("t{}", i % 50);
            let asked = Instant::now();
            match run {
                0 => assert!(local.admit(&live(&tenant), &plan, 1).await.unwrap().is_ok()),
                1 => assert!(redis.admit(&tenant, &plan).await.is_ok()),
                _ => drop(gate.acquire(Priority::Normal).await),
            }
            took.push(asked.elapsed());
        }
        took.sort();
        let mean = took.iter().sum::<Duration>() / took.len() as u32;
        println!(
            "{name}: mean {mean:?}, p50 {:?}, p99 {:?}, max {:?} over {} calls",
            took[took.len() / 2],
            took[took.len() * 99 / 100],
            took[took.len() - 1],
            took.len()
        );
    }
}

/// Two instances take a tenant's uploads from one bucket per world in
/// Redis: together no more than the plan's `uploads_per_minute` at once,
/// the refusal saying when the next one is due, and the test world's
/// bucket untouched by the live world's; `{prefix}:tenant:acme:uploads:*`
/// holds the two.
#[tokio::test]
async fn two_instances_share_a_worlds_uploads_bucket() {
    use super::uploads::TenantUploads;
    use crate::model::{Scope, World};
    let prefix = Prefix::new(&shared_redis_url());
    let one = Instance::on_shared_redis(&prefix).await;
    let two = Instance::on_shared_redis(&prefix).await;
    let (a, b) = (
        TenantUploads::shared(Arc::clone(&one.redis)),
        TenantUploads::shared(Arc::clone(&two.redis)),
    );
    let live = Scope::new("acme", World::Live);
    let mut taken = 0;
    for round in 0..6 {
        let uploads = if round % 2 == 0 { &a } else { &b };
        if uploads.take(&live, 4).await.is_ok() {
            taken += 1;
        }
    }
    assert_eq!(taken, 4, "4 a minute, whichever instance takes them");
    let wait = b.take(&live, 4).await.unwrap_err();
    assert!(
        wait > Duration::from_secs(10) && wait <= Duration::from_secs(15),
        "one upload comes back every 15 s: {wait:?}"
    );
    a.take(&Scope::new("acme", World::Test), 4).await.unwrap();
    let mut keys: Vec<String> = prefix
        .keys()
        .into_iter()
        .filter(|key| key.contains(":uploads:"))
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            format!("{}:tenant:acme:uploads:live", prefix.name),
            format!("{}:tenant:acme:uploads:test", prefix.name)
        ]
    );
}
