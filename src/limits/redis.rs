//! The Redis side of the limits (`limits.backend = "redis"`): one connection
//! shared by the tenant limits and the provider gates, the Lua scripts that
//! make each check atomic, and the health and head-count that decide what
//! happens while Redis cannot be reached.
//!
//! Every check is one script run on the Redis server, reading the server's
//! clock (`TIME`), so instances whose clocks disagree still share one
//! timeline. Keys, all under `{prefix}:`:
//!
//! | key | type | holds | expires |
//! |---|---|---|---|
//! | `{prefix}:instances` | sorted set | instance id → last heartbeat (server ms) | 60 s after the last heartbeat |
//! | `{prefix}:tenant:{id}:rate` | string | the tenant's GCRA theoretical arrival time (server µs) | when the bucket is full again |
//! | `{prefix}:tenant:{id}:quota:{day}` | string | sends counted on that UTC day (days since 1970) | at the end of the next day |
//! | `{prefix}:tenant:{id}:writes` | string | the GCRA theoretical arrival time of the tenant's changes other than sends (server µs) | when the bucket is full again |
//! | `{prefix}:gate:{provider}` | string | the provider's GCRA theoretical arrival time (server µs) | when the bucket is full again |
//!
//! Health: a call that fails or takes longer than `limits.timeout_ms` marks
//! Redis down (one WARN line); from then on no request waits for Redis. The
//! heartbeat keeps trying once a second and marks it up again (one INFO line)
//! as soon as a heartbeat goes through; the connection manager reconnects by
//! itself. The heartbeat also counts the live instances, which sets each
//! instance's share while Redis is down.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{FromRedisValue, Script, ScriptInvocation};
use secrecy::ExposeSecret;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::tenant::Grant;
use crate::config::LimitsSettings;
use crate::metrics as names;

/// How often each instance writes its heartbeat.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);

/// Heartbeats older than this do not count an instance as live.
const HEARTBEAT_STALE_MS: u64 = 5_000;

/// Heartbeat: records this instance, forgets stale ones, counts the rest.
/// KEYS[1] instances; ARGV[1] instance id, ARGV[2] staleness in ms.
///
/// Staleness counts back from the fleet's newest heartbeat before this
/// one, not from now: after an outage that kept every instance from
/// beating, all their last beats are old by the outage's length, and
/// counting from now would forget every other instance until it had
/// beaten again (the first instance back would count itself alone). From
/// the newest, the fleet is counted as it was before the outage at the
/// first beat after it; an instance that died meanwhile is forgotten as
/// soon as the others' beats move the newest on.
const HEARTBEAT_LUA: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local newest = redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local from = now
if newest[2] then
  from = math.min(now, tonumber(newest[2]))
end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (from - tonumber(ARGV[2])))
redis.call('PEXPIRE', KEYS[1], 60000)
return redis.call('ZCARD', KEYS[1])
";

/// One tenant admission of n units (a send's recipients): the daily quota,
/// then the plan's GCRA, both or neither charged, all n units or none. The
/// arithmetic is governor's (what the local backend runs), in microseconds
/// of server time: emission interval T, tolerance tau = T × (burst − 1);
/// n units at `now` pass when `now ≥ tat − tau + (n − 1) × T`, and move
/// `tat` to `max(tat, now) + n × T`. The caller passes a burst of at least n.
///
/// KEYS[1] rate key, KEYS[2] quota key of day ARGV[4].
/// ARGV[1] T (µs), ARGV[2] burst, ARGV[3] daily quota, ARGV[4] the day the
/// caller thinks it is (days since 1970, UTC), ARGV[5] n.
///
/// Returns `{code, value, used}`: code 1 granted (value = remaining burst),
/// 0 over the rate (value = µs until the n units may pass), 2 over the
/// quota (value = µs until the server's next UTC midnight), 3 the day's
/// counter does not exist yet (seed it, then ask again), 4 the server is on
/// another day (value = the server's day; ask again with it). `used` is the
/// day's count after the call.
const ADMIT_LUA: &str = r"
local t = redis.call('TIME')
local secs = tonumber(t[1])
local now = secs * 1000000 + tonumber(t[2])
local day = math.floor(secs / 86400)
if day ~= tonumber(ARGV[4]) then
  return {4, day, 0}
end
local used = redis.call('GET', KEYS[2])
if not used then
  return {3, 0, 0}
end
used = tonumber(used)
local units = tonumber(ARGV[5])
if used + units > tonumber(ARGV[3]) then
  return {2, (day + 1) * 86400000000 - now, used}
end
local period = tonumber(ARGV[1])
local tau = period * (tonumber(ARGV[2]) - 1)
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
local earliest = tat - tau + (units - 1) * period
if now < earliest then
  return {0, earliest - now, used}
end
local next_tat = math.max(tat, now) + units * period
redis.call('SET', KEYS[1], string.format('%.0f', next_tat), 'PX', math.floor((next_tat - now) / 1000) + 1)
used = redis.call('INCRBY', KEYS[2], units)
local remaining = math.floor(math.min(now + tau + period - next_tat, tau + period) / period)
return {1, remaining, used}
";

/// Gives back what an admission took: n units of the day's quota (never
/// below zero, never creating the counter) and n × T of the bucket (never
/// fuller than full). KEYS[1] quota key, KEYS[2] rate key; ARGV[1] n,
/// ARGV[2] n × T (µs). Returns the day's count after.
const RELEASE_LUA: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tat = redis.call('GET', KEYS[2])
if tat then
  tat = tonumber(tat) - tonumber(ARGV[2])
  if tat > now then
    redis.call('SET', KEYS[2], string.format('%.0f', tat), 'PX', math.floor((tat - now) / 1000) + 1)
  else
    redis.call('DEL', KEYS[2])
  end
end
local used = redis.call('GET', KEYS[1])
if used and tonumber(used) > 0 then
  return redis.call('DECRBY', KEYS[1], math.min(tonumber(used), tonumber(ARGV[1])))
end
return 0
";

/// Adds sends counted locally during an outage to a day's counter, if the
/// counter exists (a missing one is seeded from the store, which has them
/// already). KEYS[1] quota key, ARGV[1] sends. Returns the count after, or
/// -1 when there was no counter.
const ADD_LUA: &str = r"
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('INCRBY', KEYS[1], ARGV[1])
end
return -1
";

/// Takes one token from a fleet-wide bucket (a provider's gate, a tenant's
/// changes), with the same GCRA as [`ADMIT_LUA`]. KEYS[1] the bucket's
/// key; ARGV[1] T (µs), ARGV[2] burst, ARGV[3] `1` to empty the bucket
/// first (an instance charging the calls it paced on its own share during
/// an outage, see [`RedisLimits::take_gate_token`]).
/// Returns 0 when the token was taken, or the µs until one is due.
const GATE_LUA: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local period = tonumber(ARGV[1])
local tau = period * (tonumber(ARGV[2]) - 1)
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if ARGV[3] == '1' and tat < now + tau + period then
  tat = now + tau + period
  redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.floor((tat - now) / 1000) + 1)
end
local earliest = tat - tau
if now < earliest then
  return earliest - now
end
local next_tat = math.max(tat, now) + period
redis.call('SET', KEYS[1], string.format('%.0f', next_tat), 'PX', math.floor((next_tat - now) / 1000) + 1)
return 0
";

/// Tokens a provider's fleet-wide bucket holds now (0 to burst), read
/// from its theoretical arrival time without taking one.
const GATE_TOKENS_LUA: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local period = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
local held = math.floor((now + period * (burst - 1) - tat) / period) + 1
return math.max(0, math.min(burst, held))
";

/// What an admission asks of the script: the plan's figures and the
/// send's units (its recipients).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Admission {
    pub period_us: u64,
    pub burst: u32,
    pub daily_quota: u64,
    pub units: u32,
}

/// What one admission script run answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AdmitReply {
    Granted {
        remaining: u32,
        used: u64,
    },
    OverRate {
        wait: Duration,
        used: u64,
    },
    OverQuota {
        until_midnight: Duration,
        used: u64,
    },
    /// The day's counter does not exist yet.
    Unseeded,
    /// Redis's clock is on another UTC day than the caller's.
    OtherDay {
        day: i64,
    },
}

/// A call failed or timed out; Redis is marked down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Unreachable;

/// The shared Redis connection of the limits, its scripts and its health.
pub struct RedisLimits {
    /// Reconnects by itself; cloning it is cheap and shares the connection.
    conn: ConnectionManager,
    /// `limits.key_prefix`.
    prefix: String,
    /// This process in the instances set.
    instance: String,
    /// Longest wait for one call (`limits.timeout_ms`).
    timeout: Duration,
    /// Whether the last call went through. While false, requests use the
    /// local shares and only the heartbeat talks to Redis.
    up: AtomicBool,
    /// Live instances at the last heartbeat that went through (at least 1);
    /// kept through an outage, when no new count can be had.
    live: AtomicU32,
    /// Switches to down so far: a fallback built for one outage is not
    /// reused for the next.
    outages: AtomicU64,
    /// Bumped at every recovery, so the tenant limits can hand over what
    /// they counted locally meanwhile.
    recoveries: watch::Sender<u64>,
    heartbeat: Script,
    admit: Script,
    release: Script,
    add: Script,
    gate: Script,
    gate_tokens: Script,
}

impl std::fmt::Debug for RedisLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLimits")
            .field("prefix", &self.prefix)
            .field("instance", &self.instance)
            .field("up", &self.is_up())
            .field("live_instances", &self.live_instances())
            .finish()
    }
}

impl RedisLimits {
    /// Sets up the connection from `[limits]` and sends a first heartbeat.
    /// Fails only on a malformed URL: an unreachable Redis means starting on
    /// local shares (one WARN line) and switching to Redis once it answers.
    ///
    /// Until a heartbeat counts the fleet, this instance assumes it has
    /// `known_fleet` instances (the size last counted, as the store keeps
    /// it) or `limits.expected_instances`, whichever is larger: an
    /// instance that starts while Redis is down paces at that share.
    pub async fn connect(settings: &LimitsSettings, known_fleet: u32) -> anyhow::Result<Arc<Self>> {
        let url = settings
            .redis_url
            .as_ref()
            .context("limits.redis_url is required when limits.backend = \"redis\"")?;
        Self::connect_to_fleet(
            url.expose_secret(),
            &settings.key_prefix,
            Duration::from_millis(settings.timeout_ms),
            known_fleet.max(settings.expected_instances),
        )
        .await
    }

    /// Like [`RedisLimits::connect`], from parts (tests use their own
    /// prefix), assuming a fleet of one until a heartbeat counts it.
    pub async fn connect_to(
        url: &str,
        prefix: &str,
        timeout: Duration,
    ) -> anyhow::Result<Arc<Self>> {
        Self::connect_to_fleet(url, prefix, timeout, 1).await
    }

    /// Like [`RedisLimits::connect_to`], assuming `assumed` instances until
    /// a heartbeat counts them.
    pub async fn connect_to_fleet(
        url: &str,
        prefix: &str,
        timeout: Duration,
        assumed: u32,
    ) -> anyhow::Result<Arc<Self>> {
        let client = redis::Client::open(url).context("limits.redis_url is not a Redis URL")?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            // Give up on a reconnection quickly: the next call (the
            // heartbeat's, once a second) starts another one.
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(200));
        let conn = ConnectionManager::new_lazy_with_config(client, config)
            .context("setting up the Redis connection")?;
        let redis = Arc::new(RedisLimits {
            conn,
            prefix: prefix.to_owned(),
            instance: uuid::Uuid::new_v4().to_string(),
            timeout,
            up: AtomicBool::new(false),
            live: AtomicU32::new(assumed.max(1)),
            outages: AtomicU64::new(0),
            recoveries: watch::Sender::new(0),
            heartbeat: Script::new(HEARTBEAT_LUA),
            admit: Script::new(ADMIT_LUA),
            release: Script::new(RELEASE_LUA),
            add: Script::new(ADD_LUA),
            gate: Script::new(GATE_LUA),
            gate_tokens: Script::new(GATE_TOKENS_LUA),
        });
        metrics::gauge!(names::LIMITS_BACKEND_UP).set(0.0);
        match redis.beat().await {
            Ok(live) => {
                redis.up.store(true, Ordering::SeqCst);
                metrics::gauge!(names::LIMITS_BACKEND_UP).set(1.0);
                info!(
                    prefix,
                    live, "Limits are counted in Redis for all instances."
                );
            }
            Err(Unreachable) => {
                redis.outages.fetch_add(1, Ordering::SeqCst);
                metrics::gauge!(names::LIMITS_LIVE_INSTANCES).set(f64::from(assumed.max(1)));
                warn!(
                    prefix,
                    assumed_instances = assumed.max(1),
                    "Redis is unreachable at start-up; limits use this instance's share of the fleet it assumes until it answers."
                );
            }
        }
        Ok(redis)
    }

    /// Sends a heartbeat every second until `shutdown`, then takes this
    /// instance out of the live set. Recovers from an outage as soon as a
    /// heartbeat goes through.
    pub fn spawn_heartbeat(
        self: &Arc<Self>,
        mut shutdown: watch::Receiver<bool>,
    ) -> JoinHandle<()> {
        let redis = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(HEARTBEAT_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = shutdown.wait_for(|stop| *stop) => break,
                }
                let Some(redis) = redis.upgrade() else { return };
                if let Ok(live) = redis.beat().await {
                    redis.mark_up(live);
                }
            }
            if let Some(redis) = redis.upgrade() {
                redis.leave().await;
            }
        })
    }

    /// Whether limits are global right now.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::SeqCst)
    }

    /// Live instances as last counted (at least 1).
    pub fn live_instances(&self) -> u32 {
        self.live.load(Ordering::SeqCst).max(1)
    }

    /// The longest one call waits for Redis (`limits.timeout_ms`).
    pub(crate) fn call_timeout(&self) -> Duration {
        self.timeout
    }

    /// Outages so far (switches from up to down).
    pub(crate) fn outages(&self) -> u64 {
        self.outages.load(Ordering::SeqCst)
    }

    /// Changes at every recovery.
    pub(crate) fn recoveries(&self) -> watch::Receiver<u64> {
        self.recoveries.subscribe()
    }

    /// The key prefix, for tests that clean up after themselves.
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }

    fn tenant_key(&self, tenant: &str, what: &str) -> String {
        format!("{}:tenant:{tenant}:{what}", self.prefix)
    }

    fn quota_key(&self, tenant: &str, day: i64) -> String {
        self.tenant_key(tenant, &format!("quota:{day}"))
    }

    async fn beat(&self) -> Result<u32, Unreachable> {
        let mut invocation = self.heartbeat.prepare_invoke();
        invocation
            .key(format!("{}:instances", self.prefix))
            .arg(&self.instance)
            .arg(HEARTBEAT_STALE_MS);
        let live: u32 = self.invoke("heartbeat", &invocation).await?;
        self.live.store(live.max(1), Ordering::SeqCst);
        metrics::gauge!(names::LIMITS_LIVE_INSTANCES).set(f64::from(live.max(1)));
        Ok(live)
    }

    /// Takes this instance out of the live set (shutdown), so the others'
    /// shares grow without waiting for its heartbeat to go stale.
    async fn leave(&self) {
        let mut cmd = redis::cmd("ZREM");
        cmd.arg(format!("{}:instances", self.prefix))
            .arg(&self.instance);
        let _ = self.query::<i64>("heartbeat", &cmd).await;
    }

    /// One admission: quota and rate of `tenant` in one script run.
    pub(crate) async fn admit(
        &self,
        tenant: &str,
        asked: &Admission,
        day: i64,
    ) -> Result<AdmitReply, Unreachable> {
        let mut invocation = self.admit.prepare_invoke();
        invocation
            .key(self.tenant_key(tenant, "rate"))
            .key(self.quota_key(tenant, day))
            .arg(asked.period_us)
            .arg(asked.burst.max(asked.units))
            .arg(asked.daily_quota)
            .arg(day)
            .arg(asked.units);
        let (code, value, used): (i64, i64, i64) = self.invoke("admit", &invocation).await?;
        let used = used.max(0) as u64;
        let micros = |value: i64| Duration::from_micros(value.max(0) as u64);
        Ok(match code {
            1 => AdmitReply::Granted {
                remaining: u32::try_from(value.max(0)).unwrap_or(u32::MAX),
                used,
            },
            0 => AdmitReply::OverRate {
                wait: micros(value),
                used,
            },
            2 => AdmitReply::OverQuota {
                until_midnight: micros(value),
                used,
            },
            3 => AdmitReply::Unseeded,
            4 => AdmitReply::OtherDay { day: value },
            other => {
                self.mark_down("admit", &format!("unexpected admission reply {other}"));
                return Err(Unreachable);
            }
        })
    }

    /// Creates `tenant`'s counter for `day` holding `count`, unless another
    /// instance created it first. It expires at the end of the next day.
    pub(crate) async fn seed_quota(
        &self,
        tenant: &str,
        day: i64,
        count: u64,
    ) -> Result<(), Unreachable> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.quota_key(tenant, day))
            .arg(count)
            .arg("NX")
            .arg("EXAT")
            .arg((day + 2) * 86_400);
        self.query::<Option<String>>("seed", &cmd).await.map(drop)
    }

    /// Gives back what `grant` took of `tenant`'s bucket and quota.
    pub(crate) async fn release(&self, tenant: &str, grant: &Grant) -> Result<(), Unreachable> {
        let period_us = u64::try_from(grant.period.as_micros()).unwrap_or(u64::MAX);
        let mut invocation = self.release.prepare_invoke();
        invocation
            .key(self.quota_key(tenant, grant.day))
            .key(self.tenant_key(tenant, "rate"))
            .arg(grant.units)
            .arg(period_us.saturating_mul(u64::from(grant.units)));
        self.invoke::<i64>("release", &invocation).await.map(drop)
    }

    /// Adds `sends` counted elsewhere to `tenant`'s counter of `day`, if it
    /// exists.
    pub(crate) async fn add_to_quota(
        &self,
        tenant: &str,
        day: i64,
        sends: u64,
    ) -> Result<(), Unreachable> {
        let mut invocation = self.add.prepare_invoke();
        invocation.key(self.quota_key(tenant, day)).arg(sends);
        self.invoke::<i64>("reconcile", &invocation).await.map(drop)
    }

    /// Takes one token of `provider`'s fleet-wide bucket: `None` when taken,
    /// or how long until one is due. With `empty_first`, the bucket is
    /// emptied before the take: the bucket in Redis did not see the calls
    /// this instance paced on its share during an outage, and a bucket left
    /// full by the outage (or lost with a restarted Redis) would add its
    /// whole burst on top of them.
    pub(crate) async fn take_gate_token(
        &self,
        provider: &str,
        period_us: u64,
        burst: u32,
        empty_first: bool,
    ) -> Result<Option<Duration>, Unreachable> {
        let key = format!("{}:gate:{provider}", self.prefix);
        self.take_token("gate", key, period_us, burst, empty_first)
            .await
    }

    /// Takes one of `tenant`'s changes other than sends from its fleet-wide
    /// bucket: `None` when taken, or how long until one is due.
    pub(crate) async fn take_tenant_write(
        &self,
        tenant: &str,
        period_us: u64,
        burst: u32,
    ) -> Result<Option<Duration>, Unreachable> {
        let key = self.tenant_key(tenant, "writes");
        self.take_token("writes", key, period_us, burst, false)
            .await
    }

    /// Takes one upload of `tenant` in `world` (`live` or `test`) from its
    /// fleet-wide bucket: `None` when taken, or how long until one is due.
    pub(crate) async fn take_tenant_upload(
        &self,
        tenant: &str,
        world: &str,
        period_us: u64,
        burst: u32,
    ) -> Result<Option<Duration>, Unreachable> {
        let key = self.tenant_key(tenant, &format!("uploads:{world}"));
        self.take_token("uploads", key, period_us, burst, false)
            .await
    }

    async fn take_token(
        &self,
        operation: &'static str,
        key: String,
        period_us: u64,
        burst: u32,
        empty_first: bool,
    ) -> Result<Option<Duration>, Unreachable> {
        let mut invocation = self.gate.prepare_invoke();
        invocation
            .key(key)
            .arg(period_us)
            .arg(burst)
            .arg(u8::from(empty_first));
        let wait: i64 = self.invoke(operation, &invocation).await?;
        Ok((wait > 0).then(|| Duration::from_micros(wait as u64)))
    }

    /// The tokens `provider`'s fleet-wide bucket holds now, none taken.
    pub(crate) async fn gate_tokens(
        &self,
        provider: &str,
        period_us: u64,
        burst: u32,
    ) -> Result<u32, Unreachable> {
        let mut invocation = self.gate_tokens.prepare_invoke();
        invocation
            .key(format!("{}:gate:{provider}", self.prefix))
            .arg(period_us)
            .arg(burst);
        let held: i64 = self.invoke("gate_tokens", &invocation).await?;
        Ok(u32::try_from(held.max(0)).unwrap_or(u32::MAX))
    }

    async fn invoke<T: FromRedisValue>(
        &self,
        operation: &'static str,
        invocation: &ScriptInvocation<'_>,
    ) -> Result<T, Unreachable> {
        let mut conn = self.conn.clone();
        let outcome = tokio::time::timeout(self.timeout, invocation.invoke_async(&mut conn)).await;
        self.settle(operation, outcome)
    }

    async fn query<T: FromRedisValue>(
        &self,
        operation: &'static str,
        cmd: &redis::Cmd,
    ) -> Result<T, Unreachable> {
        let mut conn = self.conn.clone();
        let outcome = tokio::time::timeout(self.timeout, cmd.query_async(&mut conn)).await;
        self.settle(operation, outcome)
    }

    fn settle<T>(
        &self,
        operation: &'static str,
        outcome: Result<redis::RedisResult<T>, tokio::time::error::Elapsed>,
    ) -> Result<T, Unreachable> {
        match outcome {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(err)) => {
                self.mark_down(operation, &err.to_string());
                Err(Unreachable)
            }
            Err(_) => {
                self.mark_down(
                    operation,
                    &format!("no answer within {} ms", self.timeout.as_millis()),
                );
                Err(Unreachable)
            }
        }
    }

    fn mark_down(&self, operation: &'static str, error: &str) {
        metrics::counter!(names::REDIS_ERRORS_TOTAL, "operation" => operation).increment(1);
        if self.up.swap(false, Ordering::SeqCst) {
            self.outages.fetch_add(1, Ordering::SeqCst);
            metrics::gauge!(names::LIMITS_BACKEND_UP).set(0.0);
            warn!(
                operation,
                error,
                live_instances = self.live_instances(),
                "Redis is unreachable; tenant limits and provider gates use this instance's share until it answers again."
            );
        }
    }

    fn mark_up(&self, live: u32) {
        if !self.up.swap(true, Ordering::SeqCst) {
            metrics::gauge!(names::LIMITS_BACKEND_UP).set(1.0);
            info!(
                live_instances = live,
                "Redis answers again; limits are global again."
            );
            self.recoveries.send_modify(|n| *n += 1);
        }
    }
}

/// A rate as a whole number of microseconds per send, rounded up so the
/// rate kept is never above the one configured.
pub(crate) fn period_micros(rate_per_second: f64) -> u64 {
    let period = super::period_of(rate_per_second);
    u64::try_from(period.as_nanos().div_ceil(1_000))
        .unwrap_or(u64::MAX)
        .max(1)
}
