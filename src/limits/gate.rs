//! Provider gate: one per channel, with a token bucket per provider of the
//! channel's pool, shared by every lane's consumer, so that fairlane as a
//! whole never calls a provider faster than its contract allows. A consumer
//! awaits [`ProviderGate::acquire_from`] before each provider call; it
//! returns once the call may go, with the time spent waiting (for the wait
//! histogram) and the provider whose token it took.
//!
//! Pools: the line below is one line over all the channel's buckets. The
//! head of the line tries the providers in smooth weighted round robin
//! order (weight × health factor, see [`super::health`]) and takes the
//! first token there is; a paused provider (429, open breaker) is skipped,
//! so the others serve meanwhile, and the head sleeps until the earliest
//! token of any provider it may use. A message may be limited to providers
//! ([`Choice`]): failover avoids the one whose call was refused, a timed-out
//! message may only go back to the same one. Each provider keeps its own
//! bucket and `burst + rate × t`; a gate of one provider behaves exactly as
//! the single gate did before pools.
//!
//! governor's GCRA does the arithmetic: in any window of length t at most
//! `burst + rate × t` calls pass, and an idle bucket refills to `burst` and no
//! further. A new gate starts with its bucket empty and earns its first
//! token `1 / rate` after it was built: the provider cannot tell a restart
//! from a pause, and still counts the calls the previous process made just
//! before it stopped (or was killed), so a process that started with a full
//! bucket would add a whole burst on top of them. Starting empty, the calls
//! of both processes together stay within `burst + rate × t`, and from the
//! first token on the line below orders the waiters by priority, so the first
//! seconds after a start serve high priority first like any others. A pause
//! (a provider's `Retry-After`, an open circuit breaker) ends the same way:
//! one call when it ends, then the rate, not the burst saved up meanwhile.
//!
//! On top of the bucket sits a line of waiters: per priority, the tenants
//! with callers waiting take turns, and each tenant's callers keep their
//! arrival order. Only the head of the line (the next caller of the tenant
//! whose turn it is, in the highest priority that has any) asks the bucket
//! for a token. When the bucket answers "not until
//! T", the head alone sleeps until T; every other waiter sleeps on its own
//! [`Notify`] until it becomes the head. A waiter that gets its token leaves
//! the line and wakes the next head, so under a backlog each grant costs one
//! wake-up and nothing polls. A new caller takes a token at once only when no
//! one of its priority or higher is waiting, so a newly arrived high-priority
//! caller goes ahead of queued normal and low waiters and gets the very next
//! token, while callers of equal priority and tenant keep their order, and a
//! tenant's first waiter is at most one turn per waiting tenant away from a
//! token however many callers another tenant has queued. A tenant that
//! starts waiting joins the rotation ahead of the tenants served since it
//! was last served (start-time fair queuing), so a quiet tenant beside a
//! busy one takes the very next token rather than the one after the busy
//! tenant's turn.
//!
//! Cancellation is safe: a token is taken only in the poll that returns it, so
//! dropping an `acquire` future never loses one. The dropped waiter leaves the
//! line and, if it was the head, wakes the next one.
//!
//! Fleet-wide (`limits.backend = "redis"`, [`ProviderGate::with_global_bucket`]):
//! the line stays local and orders this instance's waiters exactly as above,
//! but the head must take its token from the provider's bucket in Redis,
//! which every instance draws on, so the fleet together keeps within
//! `burst + rate × t`. It asks for one token when it would use it (never
//! ahead), and when Redis answers "not until T" it sleeps until T. The local
//! bucket is not consulted then: an instance's calls are a subset of the
//! fleet's, so the global bucket bounds them already, and a second bucket on
//! the instance's own clock would refuse tokens the global one granted
//! whenever network delay bunches two grants together. While Redis is
//! unreachable, the head takes from a local bucket of this instance's share
//! instead (rate and burst divided by the live instances, burst at least 1),
//! built empty at the start of each outage so the switch adds no burst. A
//! caller cancelled while its Redis call is under way may waste that token:
//! the fleet then sends less, never more.
//!
//! Time comes from tokio's clock, so the gate also runs exactly under
//! `tokio::time::pause`. The tests do not use that, because this crate does
//! not enable tokio's `test-util` feature. Instead they drive a simulated clock
//! with a small executor of their own, which runs every ready task before
//! moving time on, so the checks of windows and rates are exact to the
//! nanosecond and need no real sleeping.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use governor::clock::Clock;
use governor::middleware::StateInformationMiddleware;
use governor::nanos::Nanos;
use governor::state::{InMemoryState, NotKeyed};
use governor::{NotUntil, Quota, RateLimiter};
use tokio::sync::Notify;

use super::health::{self, Health};
use super::redis::{RedisLimits, period_micros};
use crate::config::ProviderHealthSettings;
use crate::model::Priority;
use crate::queue::priority::ShareCredit;

/// Number of priorities, indexed by [`Priority::rank`].
const PRIORITIES: usize = 3;

/// GCRA bucket reading the gate's timeline; instants are nanoseconds since
/// the gate was built.
type Bucket = RateLimiter<NotKeyed, InMemoryState, Timeline, StateInformationMiddleware>;

/// Paces calls to the providers of one channel: a token bucket per
/// provider, with one line of waiters over all of them, served high
/// priority first, then by tenant turns and arrival.
///
/// Build it once per channel and share it as `Arc<ProviderGate>`; `new`
/// returns the gate itself so the caller chooses how to share it.
pub struct ProviderGate {
    /// Where "now" comes from and how to sleep until a token is due.
    timeline: Timeline,
    /// Callers waiting for a token. A std mutex is enough: it is held only
    /// for a few queue operations and bucket checks, never across an await.
    line: Mutex<Line>,
    /// The channel's providers, in configuration order; a gate of one
    /// provider behaves exactly as before pools existed.
    members: Vec<Member>,
}

/// One provider of the gate: its bucket, pause and health.
struct Member {
    /// The provider's name (Redis key, metrics label, admin view).
    name: String,
    /// Its configured share beside the others.
    weight: u32,
    /// GCRA state: decides whether a call may go now and, if not, from when.
    bucket: Bucket,
    /// The configured rate, reported as given for metrics and logs (the
    /// bucket holds it as a whole number of nanoseconds per call).
    rate_per_second: f64,
    /// The configured bucket size, reported as given.
    burst: u32,
    /// With `limits.backend = "redis"`: the fleet-wide bucket the head of
    /// the line takes this provider's tokens from instead of `bucket`.
    global: Option<GlobalBucket>,
    /// Until when no token is handed out (nanoseconds on the timeline),
    /// after the provider answered 429 with a `Retry-After`; 0: never.
    paused_until: AtomicU64,
    /// Set by a pause: the first grant after it empties the bucket of what
    /// it saved up during the pause (see [`ProviderGate::pause_for`]).
    drain_grants: AtomicBool,
    /// The same for `calls`, by the first call paced after the pause.
    drain_calls: AtomicBool,
    /// A second bucket of the same rate and one call more of burst, taken
    /// from right before each call (see [`ProviderGate::pace_call`]).
    calls: Bucket,
    /// Tokens this instance's grants left in the bucket at its last grant,
    /// and when: with the rate, what it holds now (governor's bucket
    /// answers that only when a token is taken).
    left: Mutex<(u32, Nanos)>,
    /// Its recent outcomes and the share of its weight they leave it.
    health: Health,
}

/// One provider of a pool, as [`ProviderGate::pool`] builds it.
#[derive(Debug, Clone)]
pub struct MemberSpec {
    pub name: String,
    pub weight: u32,
    pub rate_per_second: f64,
    pub burst: u32,
}

/// Which providers of the gate a caller may take a token from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// Any, by weight and health.
    Any,
    /// Any but this one (failover after a refused or failed call), unless
    /// it is the gate's only provider.
    Avoid(usize),
    /// Only this one: a call to it timed out, so the message may have
    /// arrived, and only the same provider may try it again.
    Only(usize),
}

impl Choice {
    fn allows(self, member: usize, members: usize) -> bool {
        match self {
            Choice::Any => true,
            Choice::Avoid(avoid) => member != avoid || members == 1,
            Choice::Only(only) => member == only || only >= members,
        }
    }
}

/// A provider routing may choose now, with its weight × health factor.
#[derive(Debug, Clone, Copy)]
struct Weighed {
    member: usize,
    weight: f64,
    factor: f64,
}

/// What the admin view and metrics read of one provider of a gate.
#[derive(Debug, Clone)]
pub struct MemberView {
    pub name: String,
    pub weight: u32,
    pub rate_per_second: f64,
    pub burst: u32,
    /// The share of the channel's new messages it gets now, 0 to 1.
    pub share: f64,
    /// Until when its gate is paused (a 429, an open breaker), from now.
    pub paused_for: Option<Duration>,
    pub health: health::Snapshot,
}

/// A provider's bucket in Redis, shared by every instance, and this
/// instance's share of it for when Redis cannot be reached.
struct GlobalBucket {
    redis: Arc<RedisLimits>,
    /// The provider's name in the key, `{prefix}:gate:{provider}`.
    provider: String,
    /// The gate's rate as whole microseconds per call, rounded up.
    period_us: u64,
    /// The local share, built afresh for each outage.
    share: Mutex<Option<ShareBucket>>,
}

/// This instance's share of a provider's rate during one outage.
struct ShareBucket {
    /// Which outage it was built for ([`RedisLimits`] counts them).
    outage: u64,
    bucket: Arc<Bucket>,
}

impl ProviderGate {
    /// A gate that allows `rate_per_second` calls per second on average and
    /// bursts of at most `burst` calls after a quiet spell. It starts empty:
    /// the first token is due `1 / rate_per_second` after this call, and
    /// tokens then accrue at the rate up to `burst` (see the module
    /// documentation for why).
    ///
    /// # Panics
    ///
    /// If `rate_per_second` is not a positive finite number or `burst` is 0.
    /// Configuration checking refuses both before a gate is built.
    #[cfg(test)]
    pub fn new(rate_per_second: f64, burst: u32) -> Self {
        Self::with_timeline(rate_per_second, burst, 0.0, Timeline::tokio())
    }

    /// A gate of one provider at `rate_per_second` with `burst`, with
    /// strict priority softened: while lower priorities have callers
    /// waiting, they get at least `low_priority_share` of the tokens (the
    /// lanes' share rule, see [`crate::queue::priority`]).
    pub fn with_share(rate_per_second: f64, burst: u32, low_priority_share: f64) -> Self {
        Self::with_timeline(
            rate_per_second,
            burst,
            low_priority_share,
            Timeline::tokio(),
        )
    }

    /// A gate over several providers of one channel (see the module
    /// documentation): one line, a bucket per provider.
    ///
    /// # Panics
    ///
    /// If a member's rate is not a positive finite number or its burst is
    /// 0, or with no member.
    pub fn pool(
        members: &[MemberSpec],
        low_priority_share: f64,
        health: &ProviderHealthSettings,
    ) -> Self {
        Self::pool_with_timeline(members, low_priority_share, health, Timeline::tokio())
    }

    fn with_timeline(
        rate_per_second: f64,
        burst: u32,
        low_priority_share: f64,
        timeline: Timeline,
    ) -> Self {
        let only = MemberSpec {
            name: String::new(),
            weight: 1,
            rate_per_second,
            burst,
        };
        Self::pool_with_timeline(
            &[only],
            low_priority_share,
            &ProviderHealthSettings::default(),
            timeline,
        )
    }

    fn pool_with_timeline(
        members: &[MemberSpec],
        low_priority_share: f64,
        health: &ProviderHealthSettings,
        timeline: Timeline,
    ) -> Self {
        assert!(!members.is_empty(), "a gate needs a provider");
        let members = members
            .iter()
            .map(|spec| {
                let rate_per_second = spec.rate_per_second;
                assert!(
                    rate_per_second.is_finite() && rate_per_second > 0.0,
                    "provider rate must be a positive number, not {rate_per_second}"
                );
                let max_burst =
                    NonZeroU32::new(spec.burst).expect("provider burst must be at least 1");
                let quota = quota(rate_per_second, max_burst);
                Member {
                    name: spec.name.clone(),
                    weight: spec.weight.max(1),
                    bucket: empty_bucket(quota, &timeline),
                    calls: empty_bucket(calls_quota(rate_per_second, max_burst), &timeline),
                    rate_per_second,
                    burst: spec.burst,
                    global: None,
                    paused_until: AtomicU64::new(0),
                    drain_grants: AtomicBool::new(false),
                    drain_calls: AtomicBool::new(false),
                    left: Mutex::new((0, timeline.now())),
                    health: Health::new(health.clone()),
                }
            })
            .collect::<Vec<_>>();
        ProviderGate {
            line: Mutex::new(Line::new(low_priority_share, members.len())),
            members,
            timeline,
        }
    }

    /// Hands out no token of any provider for `pause` from now (see
    /// [`ProviderGate::pause_member`]).
    #[cfg(test)]
    pub fn pause_for(&self, pause: Duration) {
        for member in 0..self.members.len() {
            self.pause_member(member, pause);
        }
    }

    /// Hands out no token of provider `member` for `pause` from now (or
    /// until a later pause ends): the provider said to wait, and every
    /// caller waits for it, not only the one that was told; in a pool the
    /// other providers go on meanwhile. When the pause ends, one call goes
    /// (the provider's "retry after", the breaker's trial) and then the
    /// provider goes on at its rate: the first grant empties what the
    /// bucket saved up during the pause, so the gate does not resume with a
    /// burst into a provider that just pushed back, and a burst of calls
    /// opening new connections at once cannot arrive bunched on top of the
    /// rate.
    ///
    /// `pause` may come from a provider's header: however long it is, the
    /// end saturates rather than overflows (the providers clamp it first, see
    /// [`crate::config::MAX_PROVIDER_PAUSE`]).
    pub fn pause_member(&self, member: usize, pause: Duration) {
        let Some(member) = self.members.get(member) else {
            return;
        };
        let until = Duration::from(self.timeline.now()).saturating_add(pause);
        let until = u64::try_from(until.as_nanos()).unwrap_or(u64::MAX);
        member.paused_until.fetch_max(until, Ordering::Relaxed);
        member.drain_grants.store(true, Ordering::Relaxed);
        member.drain_calls.store(true, Ordering::Relaxed);
        // A waiter asleep until another provider's token is due may now
        // have to look elsewhere sooner; the head re-checks when it wakes.
    }

    /// Counts one call's outcome in provider `member`'s health; true when
    /// it marked the provider down.
    pub fn record_outcome(&self, member: usize, failed: bool, took: Duration) -> bool {
        let now = Duration::from(self.timeline.now());
        self.members
            .get(member)
            .is_some_and(|m| m.health.record(now, failed, took))
    }

    /// Counts one delivery receipt of provider `member` in its health;
    /// true when it marked the provider down.
    pub fn record_receipt(&self, member: usize, failed: bool, delay: Option<Duration>) -> bool {
        let now = Duration::from(self.timeline.now());
        self.members
            .get(member)
            .is_some_and(|m| m.health.record_receipt(now, failed, delay))
    }

    /// Takes one token of `bucket` (the member's, or its share during a
    /// Redis outage); the first taken after a pause also empties it.
    fn take_grant(&self, member: &Member, bucket: &Bucket) -> Result<(), NotUntil<Nanos>> {
        let mut left = bucket.check()?.remaining_burst_capacity();
        if member.drain_grants.swap(false, Ordering::Relaxed) {
            drain(bucket, member.burst);
            left = 0;
        }
        *member.left.lock().unwrap_or_else(PoisonError::into_inner) = (left, self.timeline.now());
        Ok(())
    }

    /// The tokens provider `member`'s bucket holds now as this instance
    /// sees it: what its last grant left, plus what accrued since, at most
    /// the burst. A fleet-wide bucket's come from Redis (`None` while it
    /// cannot be reached).
    pub async fn tokens(&self) -> Vec<Option<u32>> {
        let now = Duration::from(self.timeline.now());
        let mut tokens = Vec::with_capacity(self.members.len());
        for member in &self.members {
            tokens.push(match &member.global {
                Some(global) => global
                    .redis
                    .gate_tokens(&global.provider, global.period_us, member.burst)
                    .await
                    .ok(),
                None => {
                    let (left, at) = *member.left.lock().unwrap_or_else(PoisonError::into_inner);
                    let accrued = now.saturating_sub(Duration::from(at)).as_secs_f64()
                        * member.rate_per_second;
                    let held = f64::from(left) + accrued.floor();
                    Some(held.min(f64::from(member.burst)) as u32)
                }
            });
        }
        tokens
    }

    /// Waits until a call to provider `member` may start without it seeing
    /// more than `burst + rate × t` calls in any window t; returns the
    /// wait. A token from [`ProviderGate::acquire_for`] spaces the grants,
    /// but what comes between grant and call (the claim's store write,
    /// waiting for a worker) can bunch calls after a stall: a writer held
    /// up for two seconds releases two seconds' worth of granted messages
    /// at once. This second bucket, of the same rate and one call more of
    /// burst (see `calls_quota`), spaces them again at the moment of the
    /// call. Normally it has a token ready and costs one check. Fleet-wide gates (Redis) pace grants only: a local
    /// bucket there would refuse what the fleet's bucket granted.
    pub async fn pace_call_of(&self, member: usize) -> Duration {
        let Some(member) = self.members.get(member) else {
            return Duration::ZERO;
        };
        if member.global.is_some() {
            return Duration::ZERO;
        }
        let started = self.timeline.now();
        loop {
            match member.calls.check() {
                Ok(_) => {
                    // A call granted before a pause may be paced during it;
                    // only the first after the pause drains.
                    if self.paused(member).is_none()
                        && member.drain_calls.swap(false, Ordering::Relaxed)
                    {
                        drain(&member.calls, member.burst.saturating_add(1));
                    }
                    return self.timeline.elapsed_since(started);
                }
                Err(not_until) => {
                    self.timeline
                        .sleep_until(not_until.earliest_possible())
                        .await
                }
            }
        }
    }

    /// [`ProviderGate::pace_call_of`] the first provider.
    #[cfg(test)]
    pub async fn pace_call(&self) -> Duration {
        self.pace_call_of(0).await
    }

    /// The end of `member`'s pause still running, if any.
    fn paused(&self, member: &Member) -> Option<Nanos> {
        let until = member.paused_until.load(Ordering::Relaxed);
        let now = u64::try_from(Duration::from(self.timeline.now()).as_nanos()).unwrap_or(u64::MAX);
        (until > now).then(|| Nanos::from(Duration::from_nanos(until)))
    }

    /// Makes the gate fleet-wide: the head of the line takes each
    /// provider's tokens from the bucket `{prefix}:gate:{name}` in Redis
    /// (`provider` for a gate of one provider), which every instance with
    /// this prefix shares, so together they keep each provider's rate and
    /// burst. While Redis is unreachable, this instance paces its calls at
    /// its share of both (see the module documentation).
    pub fn with_global_bucket(mut self, redis: Arc<RedisLimits>, provider: &str) -> Self {
        let single = self.members.len() == 1;
        for member in &mut self.members {
            let key = if single || member.name.is_empty() {
                provider.to_owned()
            } else {
                member.name.clone()
            };
            member.global = Some(GlobalBucket {
                redis: Arc::clone(&redis),
                provider: key,
                period_us: period_micros(member.rate_per_second),
                share: Mutex::new(None),
            });
        }
        self
    }

    /// The first provider's configured rate in calls per second.
    pub fn rate_per_second(&self) -> f64 {
        self.members[0].rate_per_second
    }

    /// The first provider's configured burst.
    pub fn burst(&self) -> u32 {
        self.members[0].burst
    }

    /// The providers, in configuration order.
    pub fn members(&self) -> usize {
        self.members.len()
    }

    /// Each provider's weight, share, pause and health, now.
    pub fn view(&self) -> Vec<MemberView> {
        let now = Duration::from(self.timeline.now());
        let weights = self.effective_weights(Choice::Any, now);
        let total: f64 = weights.iter().map(|w| w.weight).sum();
        self.members
            .iter()
            .enumerate()
            .map(|(i, member)| {
                let weight = weights
                    .iter()
                    .find(|w| w.member == i)
                    .map_or(0.0, |w| w.weight);
                MemberView {
                    name: member.name.clone(),
                    weight: member.weight,
                    rate_per_second: member.rate_per_second,
                    burst: member.burst,
                    share: if total > 0.0 { weight / total } else { 0.0 },
                    paused_for: self
                        .paused(member)
                        .map(|until| Duration::from(until).saturating_sub(now)),
                    health: member.health.snapshot(now),
                }
            })
            .collect()
    }

    /// Callers waiting right now, by priority rank: `[high, normal, low]`.
    /// Cheap enough for every metrics scrape: one short lock.
    pub fn waiting(&self) -> [usize; PRIORITIES] {
        let line = self.line();
        std::array::from_fn(|rank| line.waiting(rank))
    }

    /// Waits until the caller may make one provider call and returns how long
    /// it waited.
    ///
    /// Waiting callers are served high before normal before low, and in
    /// arrival order within a priority (all such callers count as one
    /// tenant). Cancel-safe: dropping the future while
    /// it waits gives up its place in line without losing a token or holding
    /// up anyone behind it.
    #[cfg(test)]
    pub async fn acquire(&self, priority: Priority) -> Duration {
        self.acquire_for(priority, "").await
    }

    /// Like [`ProviderGate::acquire`], on behalf of `tenant`: within a
    /// priority, tenants with callers waiting take the tokens in turn, so
    /// one tenant's hundred waiting messages do not stand in front of
    /// another tenant's first.
    pub async fn acquire_for(&self, priority: Priority, tenant: &str) -> Duration {
        self.acquire_from(priority, tenant, Choice::Any).await.0
    }

    /// Like [`ProviderGate::acquire_for`], from the providers `choice`
    /// allows; returns the wait and the provider whose token it is.
    pub async fn acquire_from(
        &self,
        priority: Priority,
        tenant: &str,
        choice: Choice,
    ) -> (Duration, usize) {
        let rank = priority.rank();
        if self.members.iter().any(|member| member.global.is_some()) {
            return self.acquire_global(rank, tenant, choice).await;
        }
        let started = self.timeline.now();

        // Nobody this urgent or more is waiting, so this caller would be the
        // head of the line: it may take a token straight away if one is free.
        let place = {
            let mut line = self.line();
            if line.would_lead(rank)
                && let Ok(member) = self.take_local(&mut line, choice)
            {
                line.record_grant(rank, tenant);
                return (Duration::ZERO, member);
            }
            line.join(self, rank, tenant)
        };

        loop {
            let due = {
                let mut line = self.line();
                if line.head_id() != Some(place.id) {
                    None
                } else {
                    match self.take_local(&mut line, choice) {
                        Ok(member) => {
                            // Leave the line in the same poll that takes the
                            // token, so a cancellation cannot come between.
                            line.leave(rank, place.id, true);
                            place.served();
                            return (self.timeline.elapsed_since(started), member);
                        }
                        Err(due) => Some(due),
                    }
                }
            };
            match due {
                // Tokens never come sooner than the buckets say, so the head
                // needs no other wake-up. If a more urgent caller arrives
                // meanwhile, it becomes the head and sleeps until the same
                // instant; this one then finds it is no longer the head.
                Some(due) => self.timeline.sleep_until(due).await,
                // Woken when this waiter becomes the head.
                None => place.wake.notified().await,
            }
        }
    }

    /// The providers `choice` allows with the weight routing gives each
    /// now (its configured weight × its health factor). When health
    /// leaves none of them a share, all of them at their configured
    /// weight: a channel whose every provider looks down still tries
    /// them rather than hold every message.
    fn effective_weights(&self, choice: Choice, now: Duration) -> Vec<Weighed> {
        let count = self.members.len();
        let allowed: Vec<Weighed> = self
            .members
            .iter()
            .enumerate()
            .filter(|(i, _)| choice.allows(*i, count))
            .map(|(i, member)| {
                let factor = if count == 1 {
                    1.0
                } else {
                    member.health.factor(now)
                };
                Weighed {
                    member: i,
                    weight: f64::from(member.weight) * factor,
                    factor,
                }
            })
            .collect();
        if allowed.iter().any(|w| w.weight > 0.0) {
            allowed.into_iter().filter(|w| w.weight > 0.0).collect()
        } else {
            allowed
                .into_iter()
                .map(|w| Weighed {
                    weight: f64::from(self.members[w.member].weight),
                    factor: 1.0,
                    ..w
                })
                .collect()
        }
    }

    /// The providers the head may take from, in the order it tries them
    /// (smooth weighted round robin, see [`Line::order`]), with each one's
    /// weight now.
    fn candidates(&self, line: &Line, choice: Choice) -> (Vec<usize>, Vec<Weighed>) {
        let now = Duration::from(self.timeline.now());
        let weights = self.effective_weights(choice, now);
        (line.order(&weights), weights)
    }

    /// Takes a token for the head from the first provider, in routing
    /// order, that has one and is not paused; otherwise says when the
    /// first of them will have one.
    fn take_local(&self, line: &mut Line, choice: Choice) -> Result<usize, Nanos> {
        let (order, weights) = self.candidates(line, choice);
        let mut due: Option<Nanos> = None;
        for i in order {
            let member = &self.members[i];
            if let Some(until) = self.paused(member) {
                due = Some(due.map_or(until, |d| d.min(until)));
                continue;
            }
            match self.take_grant(member, &member.bucket) {
                Ok(()) => {
                    line.granted(i, &weights);
                    return Ok(i);
                }
                Err(not_until) => {
                    let at = not_until.earliest_possible();
                    due = Some(due.map_or(at, |d| d.min(at)));
                }
            }
        }
        Err(due.expect("a gate has at least one provider and choice allows one"))
    }

    /// [`ProviderGate::acquire_from`] with fleet-wide buckets: the same
    /// line, but the head takes its token from Redis, or from this
    /// instance's share while Redis is down. Every caller queues first (no
    /// fast path), because the Redis call cannot be made under the line's
    /// lock; a caller that finds the line empty is its head at once, so it
    /// costs nothing but the queue operations.
    async fn acquire_global(&self, rank: usize, tenant: &str, choice: Choice) -> (Duration, usize) {
        let started = self.timeline.now();
        let place = self.line().join(self, rank, tenant);
        'wait: loop {
            let candidates = {
                let line = self.line();
                (line.head_id() == Some(place.id)).then(|| self.candidates(&line, choice))
            };
            let Some((order, weights)) = candidates else {
                place.wake.notified().await;
                continue;
            };
            let mut due: Option<Nanos> = None;
            let mut earliest = |at: Nanos| due = Some(due.map_or(at, |d: Nanos| d.min(at)));
            for i in order {
                let member = &self.members[i];
                let global = member.global.as_ref().expect("every member is global");
                if let Some(until) = self.paused(member) {
                    earliest(until);
                    continue;
                }
                if global.redis.is_up() {
                    match global
                        .redis
                        .take_gate_token(&global.provider, global.period_us, member.burst)
                        .await
                    {
                        Ok(None) => {
                            {
                                let mut line = self.line();
                                line.granted(i, &weights);
                                line.leave(rank, place.id, true);
                            }
                            place.served();
                            return (self.timeline.elapsed_since(started), i);
                        }
                        Ok(Some(wait)) => {
                            earliest(Nanos::from(Duration::from(self.timeline.now()) + wait));
                        }
                        // Redis is marked down now: the next round takes from
                        // this instance's share.
                        Err(_) => continue 'wait,
                    }
                    continue;
                }
                let share = global.share(self, member);
                let taken = {
                    let mut line = self.line();
                    if line.head_id() != Some(place.id) {
                        None
                    } else {
                        let taken = self.take_grant(member, &share);
                        if taken.is_ok() {
                            line.granted(i, &weights);
                            line.leave(rank, place.id, true);
                        }
                        Some(taken)
                    }
                };
                match taken {
                    None => continue 'wait,
                    Some(Ok(())) => {
                        place.served();
                        return (self.timeline.elapsed_since(started), i);
                    }
                    Some(Err(not_until)) => earliest(not_until.earliest_possible()),
                }
            }
            let due = due.expect("a gate has at least one provider and choice allows one");
            self.timeline.sleep_until(due).await;
        }
    }

    fn line(&self) -> MutexGuard<'_, Line> {
        // Nothing panics while the lock is held, so a poisoned lock still
        // guards consistent queues.
        self.line.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl fmt::Debug for ProviderGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProviderGate")
            .field("rate_per_second", &self.rate_per_second())
            .field("burst", &self.burst())
            .field("members", &self.members.len())
            .field("waiting", &self.waiting())
            .finish()
    }
}

impl GlobalBucket {
    /// This instance's share of `member`'s bucket for the current outage:
    /// rate and burst divided by the live instances last counted (the burst
    /// at least one). It starts empty, so that the fleet's switch to shares
    /// adds no burst on top of the tokens just taken from Redis.
    fn share(&self, gate: &ProviderGate, member: &Member) -> Arc<Bucket> {
        let outage = self.redis.outages();
        let mut share = self.share.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(current) = share.as_ref().filter(|s| s.outage == outage) {
            return Arc::clone(&current.bucket);
        }
        let instances = self.redis.live_instances().max(1);
        let rate = member.rate_per_second / f64::from(instances);
        let burst = NonZeroU32::new((member.burst / instances).max(1)).expect("at least 1");
        let bucket = Arc::new(empty_bucket(quota(rate, burst), &gate.timeline));
        *share = Some(ShareBucket {
            outage,
            bucket: Arc::clone(&bucket),
        });
        bucket
    }
}

/// A quota of `rate_per_second` calls a second on average, `burst` at once
/// (the period never panics, see [`super::period_of`]).
fn quota(rate_per_second: f64, burst: NonZeroU32) -> Quota {
    Quota::with_period(super::period_of(rate_per_second))
        .expect("period is at least one nanosecond")
        .allow_burst(burst)
}

/// The call-pacing bucket's quota: the gate's rate with one call more of
/// burst. Grants come exactly at the rate under a backlog, so a bucket of
/// the same burst at the call could never win back a call held up between
/// grant and call (a claim's commit): every later call would wait as long
/// as the longest such hold-up so far, whoever's it was. One cell more lets
/// a call that is up to one interval late be followed by the next on time,
/// at the price of at most one call over `burst + rate × t` at the
/// provider in the window around it.
fn calls_quota(rate_per_second: f64, burst: NonZeroU32) -> Quota {
    quota(rate_per_second, burst.saturating_add(1))
}

/// A bucket with no token in it: the first is due one period after now,
/// and it fills up to its burst only by waiting, never by being built.
fn empty_bucket(quota: Quota, timeline: &Timeline) -> Bucket {
    let bucket = RateLimiter::direct_with_clock(quota, timeline.clone())
        .with_middleware::<StateInformationMiddleware>();
    // Taking the whole burst at once always fits the bucket's capacity.
    let _ = bucket.check_n(quota.burst_size());
    bucket
}

/// Takes every whole token `bucket` holds now, in at most 33 all-or-nothing
/// checks: the largest powers of two first, which takes exactly the binary
/// digits of what is there.
fn drain(bucket: &Bucket, burst: u32) {
    let mut size = burst.checked_next_power_of_two().unwrap_or(1 << 31);
    while let Some(cells) = NonZeroU32::new(size) {
        // Too many for the bucket's capacity, or not there: either way
        // nothing is taken.
        let _ = bucket.check_n(cells);
        size /= 2;
    }
}

/// The waiters: per priority rank, one FIFO per tenant, and the tenants
/// taking turns.
struct Line {
    /// Waiting callers by priority rank, grouped by tenant; the tenants of a
    /// rank are served in rotation, each tenant's callers in arrival order.
    tiers: [VecDeque<TenantWaiters>; PRIORITIES],
    /// Which priority the next token goes to: the highest waiting, except
    /// that lower priorities keep their share while they have waiters.
    share: ShareCredit,
    /// Source of waiter ids, so a waiter can find itself in its queue.
    next_id: u64,
    /// Smooth weighted round robin over the providers: each one's running
    /// credit (see [`Line::order`]).
    current: Vec<f64>,
    /// A recovering provider's allowance: it grows by the provider's
    /// health factor with every grant the pool makes, and the provider
    /// may take a token only with a whole one.
    allowance: Vec<f64>,
    /// Grants made so far, and the grant count at each tenant's last
    /// grant: a tenant that starts waiting goes ahead of the tenants
    /// served since it was last served (see [`Line::join`]).
    grants: u64,
    last_served: HashMap<Arc<str>, u64>,
}

/// How many tenants' last grants the line remembers; one forgotten counts
/// as served long ago, which it was.
const REMEMBERED_TENANTS: usize = 4096;

/// One tenant's waiters of one priority, oldest first.
struct TenantWaiters {
    tenant: Arc<str>,
    waiters: VecDeque<Waiter>,
}

struct Waiter {
    id: u64,
    /// Rung when this waiter becomes the head of the line.
    wake: Arc<Notify>,
}

impl Line {
    fn new(low_priority_share: f64, members: usize) -> Self {
        Line {
            tiers: Default::default(),
            share: ShareCredit::new(low_priority_share),
            next_id: 0,
            current: vec![0.0; members],
            allowance: vec![0.0; members],
            grants: 0,
            last_served: HashMap::new(),
        }
    }

    /// Notes a grant to `tenant`.
    fn served(&mut self, tenant: &str) {
        self.grants += 1;
        if self.last_served.len() >= REMEMBERED_TENANTS && !self.last_served.contains_key(tenant) {
            let horizon = self.grants.saturating_sub(REMEMBERED_TENANTS as u64);
            self.last_served.retain(|_, at| *at > horizon);
        }
        match self.last_served.get_mut(tenant) {
            Some(at) => *at = self.grants,
            None => {
                self.last_served.insert(Arc::from(tenant), self.grants);
            }
        }
    }

    fn last_served(&self, tenant: &str) -> u64 {
        self.last_served.get(tenant).copied().unwrap_or(0)
    }

    /// The order in which the head tries the providers of `weights` (each
    /// with its weight and health factor now): highest running credit
    /// plus weight first, as smooth weighted round robin would pick; ties
    /// by configuration order. A recovering provider (factor below 1)
    /// without a whole allowance is left out while another can serve, so
    /// under a backlog it gets about its factor's part of the grants
    /// instead of its whole rate.
    fn order(&self, weights: &[Weighed]) -> Vec<usize> {
        let mut order: Vec<(usize, f64)> = weights
            .iter()
            .filter(|w| weights.len() == 1 || w.factor >= 1.0 || self.allowance[w.member] >= 1.0)
            .map(|w| (w.member, self.current[w.member] + w.weight))
            .collect();
        if order.is_empty() {
            order = weights.iter().map(|w| (w.member, w.weight)).collect();
        }
        order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        order.into_iter().map(|(member, _)| member).collect()
    }

    /// Books a grant of provider `member`: smooth weighted round robin
    /// (every candidate's credit grows by its weight, the chosen one's
    /// falls by their sum) and the recovering providers' allowances.
    fn granted(&mut self, member: usize, weights: &[Weighed]) {
        if weights.len() < 2 {
            return;
        }
        let total: f64 = weights.iter().map(|w| w.weight).sum();
        for w in weights {
            self.current[w.member] += w.weight;
            if w.factor < 1.0 {
                self.allowance[w.member] = (self.allowance[w.member] + w.factor).min(2.0);
            }
        }
        self.current[member] -= total;
        if let Some(w) = weights
            .iter()
            .find(|w| w.member == member && w.factor < 1.0)
        {
            self.allowance[w.member] = (self.allowance[w.member] - 1.0).max(0.0);
        }
    }

    fn waiting_ranks(&self) -> [bool; PRIORITIES] {
        std::array::from_fn(|rank| !self.tiers[rank].is_empty())
    }

    /// True when a new caller of `rank` would be the head of the line: no
    /// one of its priority waits and the share rule would serve its
    /// priority next. It may then take a free token at once.
    fn would_lead(&self, rank: usize) -> bool {
        let mut waiting = self.waiting_ranks();
        if waiting[rank] {
            return false;
        }
        waiting[rank] = true;
        self.share.pick(waiting) == Some(rank)
    }

    /// Books a token given to a caller of `rank` who was not waiting.
    /// Credit may move the head to another priority: that waiter is woken.
    fn record_grant(&mut self, rank: usize, tenant: &str) {
        self.served(tenant);
        let before = self.head_id();
        let mut waiting = self.waiting_ranks();
        waiting[rank] = true;
        self.share.record(rank, waiting);
        if let Some(head) = self.head().filter(|head| Some(head.id) != before) {
            head.wake.notify_one();
        }
    }

    fn head(&self) -> Option<&Waiter> {
        let rank = self.share.pick(self.waiting_ranks())?;
        self.tiers[rank]
            .front()
            .and_then(|turn| turn.waiters.front())
    }

    fn head_id(&self) -> Option<u64> {
        self.head().map(|waiter| waiter.id)
    }

    fn waiting(&self, rank: usize) -> usize {
        self.tiers[rank].iter().map(|turn| turn.waiters.len()).sum()
    }

    /// Queues a waiter at the back of its tenant's queue in its priority. A
    /// tenant with no one waiting there joins the rotation ahead of every
    /// tenant served since it was last served (start-time fair queuing):
    /// a quiet tenant beside a busy one takes the very next token instead
    /// of waiting for the busy one's turn first, while a tenant that was
    /// just served and comes back at once goes to the back.
    fn join<'g>(&mut self, gate: &'g ProviderGate, rank: usize, tenant: &str) -> Place<'g> {
        let id = self.next_id;
        self.next_id += 1;
        let wake = Arc::new(Notify::new());
        let waiter = Waiter {
            id,
            wake: Arc::clone(&wake),
        };
        let known = self.tiers[rank]
            .iter()
            .position(|turn| &*turn.tenant == tenant);
        match known {
            Some(at) => self.tiers[rank][at].waiters.push_back(waiter),
            None => {
                let last = self.last_served(tenant);
                let at = self.tiers[rank]
                    .iter()
                    .position(|turn| self.last_served(&turn.tenant) > last)
                    .unwrap_or(self.tiers[rank].len());
                self.tiers[rank].insert(
                    at,
                    TenantWaiters {
                        tenant: Arc::from(tenant),
                        waiters: VecDeque::from([waiter]),
                    },
                );
            }
        }
        Place {
            gate,
            rank,
            id,
            wake,
            served: false,
        }
    }

    /// Removes a waiter; if it was the head, wakes the new head so the next
    /// token is not left waiting for someone who has gone. A tenant whose
    /// waiter was `served` goes to the back of the rotation.
    fn leave(&mut self, rank: usize, id: u64, served: bool) {
        let was_head = self.head_id() == Some(id);
        if served {
            self.share.record(rank, self.waiting_ranks());
        }
        let at = self.tiers[rank]
            .iter()
            .position(|turn| turn.waiters.iter().any(|w| w.id == id));
        if let (true, Some(at)) = (served, at) {
            let tenant = Arc::clone(&self.tiers[rank][at].tenant);
            self.served(&tenant);
        }
        let tier = &mut self.tiers[rank];
        if let Some(at) = at {
            let turn = &mut tier[at];
            turn.waiters.retain(|w| w.id != id);
            if turn.waiters.is_empty() {
                tier.remove(at);
            } else if served && at == 0 {
                tier.rotate_left(1);
            }
        }
        if let Some(head) = self.head().filter(|_| was_head) {
            head.wake.notify_one();
        }
    }
}

/// A caller's place in line. Dropping it unserved (the `acquire` future was
/// cancelled) takes the caller out of the line.
struct Place<'g> {
    /// The gate whose line to leave on cancellation.
    gate: &'g ProviderGate,
    /// Which queue the caller is in, and its id there.
    rank: usize,
    id: u64,
    /// This caller's end of its [`Waiter::wake`].
    wake: Arc<Notify>,
    /// Set once the caller got its token and already left the line.
    served: bool,
}

impl Place<'_> {
    /// Drops the place without touching the line (the caller already left
    /// it, under the lock the caller still holds).
    fn served(mut self) {
        self.served = true;
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        if !self.served {
            self.gate.line().leave(self.rank, self.id, false);
        }
    }
}

/// The gate's source of time: instants are nanoseconds since the gate was
/// built, which is what governor's arithmetic wants.
#[derive(Clone)]
enum Timeline {
    /// tokio's clock: real time, or paused time under `tokio::time::pause`.
    Tokio { origin: tokio::time::Instant },
    /// The tests' simulated clock.
    #[cfg(test)]
    Simulated(Arc<sim::SimClock>),
}

impl Timeline {
    fn tokio() -> Self {
        Timeline::Tokio {
            origin: tokio::time::Instant::now(),
        }
    }

    fn elapsed_since(&self, earlier: Nanos) -> Duration {
        Duration::from(self.now().saturating_sub(earlier))
    }

    async fn sleep_until(&self, at: Nanos) {
        match self {
            Timeline::Tokio { origin } => {
                tokio::time::sleep_until(*origin + Duration::from(at)).await;
            }
            #[cfg(test)]
            Timeline::Simulated(clock) => clock.sleep_until(at).await,
        }
    }
}

impl Clock for Timeline {
    type Instant = Nanos;

    fn now(&self) -> Nanos {
        match self {
            Timeline::Tokio { origin } => Nanos::from(origin.elapsed()),
            #[cfg(test)]
            Timeline::Simulated(clock) => clock.now(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::rc::Rc;

    use super::sim::{Sim, timeout};
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const SECOND: Duration = Duration::from_secs(1);

    /// `callers` tasks, priorities mixed, each taking tokens back to back for
    /// `run_for` of simulated time. Returns the grant instants in order and
    /// the number of task polls the executor made.
    fn backlog(
        sim: &Sim,
        gate: &Arc<ProviderGate>,
        callers: usize,
        run_for: Duration,
    ) -> (Vec<Duration>, u64) {
        let grants = Rc::new(RefCell::new(Vec::new()));
        let start = sim.now();
        let polls_before = sim.polls();
        let tasks: Vec<_> = (0..callers)
            .map(|i| {
                let (sim2, gate, grants) = (sim.clone(), Arc::clone(gate), Rc::clone(&grants));
                let priority = Priority::ALL[i % Priority::ALL.len()];
                sim.spawn(async move {
                    loop {
                        gate.acquire(priority).await;
                        grants.borrow_mut().push(sim2.now());
                    }
                })
            })
            .collect();
        sim.run_until(start + run_for);
        for task in tasks {
            sim.abort(task);
        }
        let grants = grants.borrow().clone();
        (grants, sim.polls() - polls_before)
    }

    fn spec(name: &str, weight: u32, rate_per_second: f64, burst: u32) -> MemberSpec {
        MemberSpec {
            name: name.into(),
            weight,
            rate_per_second,
            burst,
        }
    }

    /// `callers` tasks taking tokens of `gate` back to back under `choice`
    /// for `run_for`; returns each grant's instant and provider.
    fn pool_backlog(
        sim: &Sim,
        gate: &Arc<ProviderGate>,
        callers: usize,
        choice: Choice,
        run_for: Duration,
    ) -> Vec<(Duration, usize)> {
        let grants = Rc::new(RefCell::new(Vec::new()));
        let start = sim.now();
        let tasks: Vec<_> = (0..callers)
            .map(|i| {
                let (sim2, gate, grants) = (sim.clone(), Arc::clone(gate), Rc::clone(&grants));
                sim.spawn(async move {
                    loop {
                        let (_, member) = gate
                            .acquire_from(Priority::ALL[i % 3], &format!("t{}", i % 4), choice)
                            .await;
                        grants.borrow_mut().push((sim2.now(), member));
                    }
                })
            })
            .collect();
        sim.run_until(start + run_for);
        for task in tasks {
            sim.abort(task);
        }
        grants.borrow().clone()
    }

    fn of_member(grants: &[(Duration, usize)], member: usize) -> Vec<Duration> {
        grants
            .iter()
            .filter(|(_, m)| *m == member)
            .map(|(at, _)| *at)
            .collect()
    }

    #[test]
    fn a_quiet_tenant_beside_a_busy_one_takes_the_very_next_token() {
        let sim = Sim::new(Duration::from_micros(10));
        let gate = sim.gate(100.0, 1);
        let grants = Rc::new(RefCell::new(Vec::new()));
        for _ in 0..8 {
            let (g, log, sim2) = (Arc::clone(&gate), Rc::clone(&grants), sim.clone());
            sim.spawn(async move {
                loop {
                    g.acquire_for(Priority::Normal, "busy").await;
                    log.borrow_mut().push(("busy", sim2.now()));
                }
            });
        }
        // Quiet callers one at a time, off the token grid, each once the
        // previous one got its token.
        let (g, log, sim2) = (Arc::clone(&gate), Rc::clone(&grants), sim.clone());
        sim.spawn(async move {
            for n in 0..20u32 {
                let at = Nanos::from(SECOND + Duration::from_micros(53_700 * u64::from(n) + 1_300));
                sim2.clock().sleep_until(at).await;
                let asked = sim2.now();
                let waited = g.acquire_for(Priority::Normal, "quiet").await;
                log.borrow_mut().push(("quiet", sim2.now()));
                assert!(
                    waited <= 10 * MS,
                    "quiet caller {n} asked at {asked:?} and waited {waited:?}: more than one token interval"
                );
            }
        });
        sim.run_until(3 * SECOND);
        let grants = grants.borrow();
        let quiet = grants.iter().filter(|(who, _)| *who == "quiet").count();
        assert_eq!(quiet, 20);
        // The busy tenant still gets every other token: the gate is exact.
        let times: Vec<Duration> = grants.iter().map(|(_, at)| *at).collect();
        assert!(worst_window_excess(&times, 100.0, 1) <= 1e-9);
        assert!(
            grants.len() >= 299,
            "{} grants in 3 s at 100/s",
            grants.len()
        );
    }

    #[test]
    fn a_call_held_up_after_its_grant_does_not_hold_up_every_later_call() {
        let sim = Sim::new(Duration::from_micros(10));
        let gate = sim.gate(100.0, 1);
        let calls = Rc::new(RefCell::new(Vec::new()));
        let (g, log, sim2) = (Arc::clone(&gate), Rc::clone(&calls), sim.clone());
        sim.spawn(async move {
            for n in 0..100u32 {
                g.acquire(Priority::Normal).await;
                // Every tenth call is held up 8 ms between grant and call
                // (a slow claim); the others go at once.
                if n % 10 == 3 {
                    let at = Nanos::from(sim2.now() + 8 * MS);
                    sim2.clock().sleep_until(at).await;
                }
                let paced = g.pace_call().await;
                log.borrow_mut().push((sim2.now(), paced));
            }
        });
        sim.run_until(2 * SECOND);
        let calls = calls.borrow();
        assert_eq!(calls.len(), 100);
        let late: Vec<_> = calls
            .iter()
            .filter(|(_, paced)| *paced > Duration::ZERO)
            .collect();
        assert!(late.is_empty(), "calls paced after a held-up one: {late:?}");
        let times: Vec<Duration> = calls.iter().map(|(at, _)| *at).collect();
        let excess = worst_window_excess(&times, 100.0, 1);
        assert!(
            excess <= 1.0,
            "at most one call over burst + rate x t: {excess}"
        );
    }

    #[test]
    fn a_pool_uses_every_providers_rate_and_none_exceeds_its_own() {
        let sim = Sim::new(Duration::from_micros(10));
        let health = ProviderHealthSettings::default();
        let gate = sim.pool(&[spec("a", 1, 100.0, 5), spec("b", 1, 50.0, 3)], &health);
        let grants = pool_backlog(&sim, &gate, 40, Choice::Any, 10 * SECOND);
        let (a, b) = (of_member(&grants, 0), of_member(&grants, 1));
        // Both start empty: 10 s earn 1,000 and 500 tokens.
        assert!(a.len() >= 999 && a.len() <= 1000, "a: {}", a.len());
        assert!(b.len() >= 499 && b.len() <= 500, "b: {}", b.len());
        let utilisation = grants.len() as f64 / 1500.0;
        assert!(utilisation >= 0.99, "utilisation {utilisation}");
        assert!(worst_window_excess(&a, 100.0, 5) <= 1e-9);
        assert!(worst_window_excess(&b, 50.0, 3) <= 1e-9);
    }

    #[test]
    fn the_view_of_tokens_starts_empty_fills_at_the_rate_up_to_the_burst_and_follows_grants() {
        let sim = Sim::new(Duration::from_millis(1));
        let gate = sim.pool(&[spec("a", 1, 10.0, 5)], &ProviderHealthSettings::default());
        let tokens = |gate: &Arc<ProviderGate>| {
            let got = Rc::new(RefCell::new(None));
            let (g, out) = (Arc::clone(gate), Rc::clone(&got));
            sim.spawn(async move {
                *out.borrow_mut() = g.tokens().await[0];
            });
            sim.settle();
            got.borrow_mut().take().expect("the view answered")
        };
        assert_eq!(tokens(&gate), 0, "a gate starts empty");
        sim.run_until(Duration::from_millis(350));
        assert_eq!(tokens(&gate), 3, "10/s for 350 ms");
        sim.run_until(2 * SECOND);
        assert_eq!(tokens(&gate), 5, "never more than the burst");
        let g = Arc::clone(&gate);
        sim.spawn(async move {
            for _ in 0..2 {
                g.acquire(Priority::Normal).await;
            }
        });
        sim.settle();
        assert_eq!(tokens(&gate), 3, "two grants took two");
    }

    #[test]
    fn spare_tokens_are_shared_by_weight() {
        let sim = Sim::new(Duration::from_micros(10));
        let health = ProviderHealthSettings::default();
        // Both could take every call: 3:1 weights decide.
        let gate = sim.pool(
            &[spec("a", 3, 1000.0, 100), spec("b", 1, 1000.0, 100)],
            &health,
        );
        sim.run_until(SECOND);
        let grants = Rc::new(RefCell::new(Vec::new()));
        let (g, log) = (Arc::clone(&gate), Rc::clone(&grants));
        let sim2 = sim.clone();
        sim.spawn(async move {
            for _ in 0..400 {
                let (_, member) = g.acquire_from(Priority::Normal, "", Choice::Any).await;
                log.borrow_mut().push(member);
                let at = Nanos::from(sim2.now() + Duration::from_millis(5));
                sim2.clock().sleep_until(at).await;
            }
        });
        sim.run_until(10 * SECOND);
        let grants = grants.borrow();
        let a = grants.iter().filter(|m| **m == 0).count();
        assert_eq!(grants.len(), 400);
        assert_eq!(a, 300, "weights 3:1 give a three quarters");
    }

    #[test]
    fn a_paused_provider_leaves_its_calls_to_the_others_and_choices_are_kept() {
        let sim = Sim::new(Duration::from_micros(10));
        let health = ProviderHealthSettings::default();
        let gate = sim.pool(&[spec("a", 1, 100.0, 5), spec("b", 1, 100.0, 5)], &health);
        gate.pause_member(0, 5 * SECOND);
        let grants = pool_backlog(&sim, &gate, 20, Choice::Any, 2 * SECOND);
        assert!(
            grants.iter().all(|(_, m)| *m == 1),
            "paused a served nothing"
        );
        assert!(grants.len() >= 199, "b alone served {}", grants.len());
        // Only(0) waits for a's pause to end; Avoid(1) is the same here.
        let only = pool_backlog(&sim, &gate, 4, Choice::Only(0), 4 * SECOND);
        assert!(
            only.iter().all(|(at, m)| *m == 0 && *at >= 5 * SECOND),
            "{only:?}"
        );
        assert!(!only.is_empty());
        let avoid = pool_backlog(&sim, &gate, 4, Choice::Avoid(0), SECOND);
        assert!(avoid.iter().all(|(_, m)| *m == 1));
    }

    #[test]
    fn a_provider_marked_down_gets_nothing_then_its_share_back_gradually() {
        let sim = Sim::new(Duration::from_micros(10));
        let health = ProviderHealthSettings {
            window_secs: 2,
            min_calls: 5,
            max_failure_rate: 0.5,
            max_latency_ms: 1000,
            max_receipt_delay_ms: 60_000,
            down_secs: 2,
            recover_secs: 4,
        };
        let gate = sim.pool(&[spec("a", 1, 100.0, 5), spec("b", 1, 100.0, 5)], &health);
        sim.run_until(SECOND);
        let marked = (0..5).any(|_| gate.record_outcome(0, true, MS));
        assert!(marked);
        let view = gate.view();
        assert_eq!(view[0].share, 0.0);
        assert_eq!(view[1].share, 1.0);
        assert_eq!(view[0].health.state, health::State::Down);
        // Under a backlog: nothing for a while it is down, a small part
        // while it recovers, its whole rate after.
        let grants = pool_backlog(&sim, &gate, 40, Choice::Any, 8 * SECOND);
        let a_in = |from: u32, to: u32| {
            grants
                .iter()
                .filter(|(at, m)| *m == 0 && *at >= SECOND * from && *at < SECOND * to)
                .count()
        };
        assert_eq!(a_in(1, 3), 0, "down for 2 s");
        let early = a_in(3, 4);
        let late = a_in(8, 9);
        assert!(
            early > 0 && early < 40,
            "recovering at first: {early} of 100"
        );
        assert!(late >= 99, "recovered: {late}");
    }

    /// Largest excess over `burst + rate × t` in any window between two grants.
    fn worst_window_excess(grants: &[Duration], rate: f64, burst: u32) -> f64 {
        let mut worst = f64::NEG_INFINITY;
        for i in 0..grants.len() {
            for j in i..grants.len() {
                let window = (grants[j] - grants[i]).as_secs_f64();
                let allowed = f64::from(burst) + rate * window;
                worst = worst.max((j - i + 1) as f64 - allowed);
            }
        }
        worst
    }

    #[test]
    fn no_window_ever_holds_more_than_burst_plus_rate_times_its_length() {
        for (rate, burst, tick) in [
            (20.0, 5, MS),
            (26.67, 10, MS),
            (26.67, 1, MS),
            (20.0, 5, 7 * MS),
        ] {
            let sim = Sim::new(tick);
            let gate = sim.gate(rate, burst);
            let (grants, _) = backlog(&sim, &gate, 50, 30 * SECOND);
            assert!(
                grants.len() > 500,
                "the run made only {} grants",
                grants.len()
            );
            let excess = worst_window_excess(&grants, rate, burst);
            assert!(
                excess <= 1e-6,
                "{rate}/s burst {burst}: a window held {excess} grants too many"
            );
        }
    }

    #[test]
    fn a_backlog_uses_at_least_99_percent_of_the_configured_rate() {
        // A timer tick of 7 ms models a late wake-up on a busy machine; a
        // burst of two or more absorbs lateness shorter than a token interval.
        // The gate starts empty, so every grant is one the rate earned.
        for (rate, burst, tick) in [(20.0, 5, MS), (26.67, 10, MS), (26.67, 10, 7 * MS)] {
            let sim = Sim::new(tick);
            let gate = sim.gate(rate, burst);
            let (grants, _) = backlog(&sim, &gate, 50, 30 * SECOND);
            let granted = grants.len() as f64;
            assert!(
                granted >= 0.99 * rate * 30.0,
                "{rate}/s burst {burst} tick {tick:?}: only {granted} grants in 30 s"
            );
        }
    }

    #[test]
    fn a_new_gate_starts_empty_and_grants_no_more_than_its_rate_has_earned_since() {
        // Built at 0 with 50 callers waiting: the bucket has no token at
        // first, so by any instant t at most rate × t calls have gone,
        // whatever the burst; the first token is due one interval in.
        for (rate, burst) in [(20.0, 5), (26.67, 10), (10.0, 1)] {
            let sim = Sim::new(MS);
            let gate = sim.gate(rate, burst);
            let (grants, _) = backlog(&sim, &gate, 50, 3 * SECOND);
            let first_due = Duration::from_secs_f64(1.0 / rate);
            assert!(
                grants[0] >= first_due && grants[0] <= first_due + MS,
                "{rate}/s burst {burst}: first grant at {:?}",
                grants[0]
            );
            for (n, at) in grants.iter().enumerate() {
                let earned = rate * at.as_secs_f64();
                assert!(
                    (n + 1) as f64 <= earned + 1e-9,
                    "{rate}/s burst {burst}: {} grants by {at:?}, earned {earned:.2}",
                    n + 1
                );
            }
            assert!(grants.len() as f64 >= rate * 3.0 - 1.0);
        }
    }

    /// Callers that each take a token, pace the call and record its instant,
    /// over and over; returns the call log and the tasks, to abort (a kill).
    fn callers(
        sim: &Sim,
        gate: &Arc<ProviderGate>,
        count: usize,
        calls: &Rc<RefCell<Vec<Duration>>>,
    ) -> Vec<usize> {
        (0..count)
            .map(|i| {
                let (sim2, gate, calls) = (sim.clone(), Arc::clone(gate), Rc::clone(calls));
                sim.spawn(async move {
                    loop {
                        gate.acquire(Priority::ALL[i % 3]).await;
                        gate.pace_call().await;
                        calls.borrow_mut().push(sim2.now());
                    }
                })
            })
            .collect()
    }

    #[test]
    fn a_process_started_right_after_another_stopped_keeps_the_provider_within_burst_plus_rate() {
        // The first process idles (its bucket fills), takes its whole burst
        // in a rush at 4.9 s, goes on at the rate and is killed at 5 s, or 5
        // ms later. A second process starts that instant with a backlog. The
        // provider sees both: together they must keep burst + rate × t, which
        // a second process starting with a full bucket would break (its
        // burst on top of the first one's).
        for gap in [Duration::ZERO, 5 * MS] {
            let sim = Sim::new(MS);
            let calls: Rc<RefCell<Vec<Duration>>> = Rc::default();
            let first = sim.gate(20.0, 5);
            sim.run_until(4900 * MS);
            let running = callers(&sim, &first, 50, &calls);
            sim.run_until(5 * SECOND);
            for task in running {
                sim.abort(task);
            }
            let before_restart = calls.borrow().len();
            assert!(
                before_restart >= 5,
                "{before_restart} calls before the kill"
            );
            sim.run_until(5 * SECOND + gap);
            let second = sim.gate(20.0, 5);
            callers(&sim, &second, 50, &calls);
            sim.run_until(8 * SECOND);
            let calls = calls.borrow();
            assert!(calls.len() > before_restart + 50);
            let excess = worst_window_excess(&calls, 20.0, 5);
            assert!(
                excess <= 1e-6,
                "gap {gap:?}: a window held {excess} calls above burst + rate × t: {calls:?}"
            );
        }
    }

    #[test]
    fn in_the_first_second_after_start_high_priority_callers_are_served_first() {
        // Low callers arrive at the start, two high ones 10 ms later. A gate
        // starting full would have handed the lows its burst before the
        // highs came; an empty one serves the highs with its first tokens.
        let sim = Sim::new(MS);
        let gate = sim.gate(10.0, 5);
        let log = Log::default();
        for i in 1..=4 {
            queue(&sim, &gate, &log, &format!("low{i}"), Priority::Low);
        }
        sim.run_until(10 * MS);
        queue(&sim, &gate, &log, "high1", Priority::High);
        queue(&sim, &gate, &log, "high2", Priority::High);
        sim.run_until(SECOND);
        assert_eq!(
            names(&log),
            ["high1", "high2", "low1", "low2", "low3", "low4"]
        );
        assert_eq!(log.borrow()[0].1, 100 * MS);
    }

    #[test]
    fn a_pause_of_any_length_holds_the_gate_without_overflowing() {
        let sim = Sim::new(MS);
        let gate = empty_gate(&sim);
        gate.pause_for(Duration::MAX);
        let log = Log::default();
        queue(&sim, &gate, &log, "held", Priority::High);
        sim.run_until(10 * SECOND);
        assert!(log.borrow().is_empty(), "{:?}", log.borrow());
        assert_eq!(gate.waiting(), [1, 0, 0]);
    }

    #[test]
    fn after_an_idle_spell_only_burst_callers_pass_at_once_then_the_rate_resumes() {
        let sim = Sim::new(MS);
        let gate = sim.gate(20.0, 5);
        // Empty the bucket first, so a refill beyond `burst` would show.
        let (drained, _) = backlog(&sim, &gate, 10, 5 * SECOND);
        assert!(drained.len() >= 100);
        sim.run_until(sim.now() + 10 * SECOND);

        let rush = sim.now();
        let grants = Rc::new(RefCell::new(Vec::new()));
        for _ in 0..100 {
            let (sim2, gate, grants) = (sim.clone(), Arc::clone(&gate), Rc::clone(&grants));
            sim.spawn(async move {
                gate.acquire(Priority::Normal).await;
                grants.borrow_mut().push(sim2.now());
            });
        }
        sim.run_until(rush + SECOND);
        let grants = grants.borrow();
        let at_once = grants.iter().filter(|&&at| at == rush).count();
        assert_eq!(at_once, 5, "grants in the first instant after idling");
        // Then one every 50 ms: 20 more within the second.
        assert_eq!(grants.len(), 5 + 20);
        assert_eq!(grants[5], rush + 50 * MS);
        assert_eq!(gate.waiting(), [0, 75, 0]);
    }

    #[test]
    fn a_pause_holds_every_caller_and_the_rate_resumes_after_it() {
        let sim = Sim::new(MS);
        let gate = empty_gate(&sim);
        let log = Log::default();
        // A 429 with Retry-After: 2 at 50 ms: nobody passes before 2,050 ms,
        // neither the callers waiting then nor those arriving meanwhile.
        queue(&sim, &gate, &log, "waiting", Priority::Normal);
        sim.run_until(50 * MS);
        gate.pause_for(2 * SECOND);
        sim.run_until(SECOND);
        queue(&sim, &gate, &log, "high", Priority::High);
        queue(&sim, &gate, &log, "later", Priority::Normal);
        sim.run_until(2 * SECOND);
        assert!(
            log.borrow().is_empty(),
            "granted during the pause: {:?}",
            log.borrow()
        );
        sim.run_until(3 * SECOND);
        let log = log.borrow();
        assert_eq!(
            log.iter()
                .map(|(name, at, _)| (name.as_str(), *at))
                .collect::<Vec<_>>(),
            [
                ("high", 2050 * MS),
                ("waiting", 2150 * MS),
                ("later", 2250 * MS),
            ],
            "after the pause: high first, then one every 100 ms (the rate)"
        );
    }

    #[test]
    fn calls_bunched_after_a_stall_are_spaced_again_at_the_call() {
        // 10/s, burst 2. Twenty callers take their tokens over about two
        // seconds, but the calls are held up (a stalled store write) until
        // 2.5 s; then they all pace at once.
        let sim = Sim::new(MS);
        let gate = sim.gate(10.0, 2);
        let calls: Rc<RefCell<Vec<Duration>>> = Rc::default();
        let clock = sim.clock();
        for _ in 0..20 {
            let (gate, calls, clock) = (Arc::clone(&gate), calls.clone(), clock.clone());
            sim.spawn(async move {
                gate.acquire(Priority::Normal).await;
                clock.sleep_until(Nanos::from(2500 * MS)).await;
                gate.pace_call().await;
                calls.borrow_mut().push(Duration::from(clock.now()));
            });
        }
        sim.run_until(10 * SECOND);
        let calls = calls.borrow();
        assert_eq!(calls.len(), 20);
        // Every window [calls[i], calls[j]] holds j - i + 1 calls: at most
        // burst + rate x its length, and the one call more the call bucket
        // allows (see `calls_quota`).
        for i in 0..calls.len() {
            for j in i..calls.len() {
                let window = (calls[j] - calls[i]).as_secs_f64();
                let allowed = 2.0 + 1.0 + 10.0 * window + 1e-9;
                assert!(
                    (j - i + 1) as f64 <= allowed,
                    "{} calls in {window:.3} s: {calls:?}",
                    j - i + 1
                );
            }
        }
        // The bucket for calls filled up while no call came (until 2.5 s):
        // burst + 1 at once, then one every 100 ms.
        assert_eq!(calls[0], 2500 * MS);
        assert_eq!(calls[2], 2500 * MS);
        assert_eq!(calls[3], 2600 * MS);
        assert_eq!(calls[19], 4200 * MS);
    }

    #[test]
    fn after_a_pause_one_call_goes_then_the_rate_resumes_without_a_burst() {
        // 20/s burst 5, under a backlog; a 2 s pause at 3 s lets the bucket
        // refill, which must not come out as a burst when the pause ends.
        let sim = Sim::new(MS);
        let gate = sim.gate(20.0, 5);
        let calls: Rc<RefCell<Vec<Duration>>> = Rc::default();
        callers(&sim, &gate, 30, &calls);
        sim.run_until(3 * SECOND);
        gate.pause_for(2 * SECOND);
        let paused_at = calls.borrow().len();
        sim.run_until(7 * SECOND);
        let calls = calls.borrow();
        let after: Vec<Duration> = calls[paused_at..].to_vec();
        assert!(after[0] >= 5 * SECOND, "a call during the pause: {after:?}");
        assert_eq!(after[0], 5 * SECOND, "the call at the end of the pause");
        assert_eq!(after[1], 5050 * MS, "then one every 50 ms: {after:?}");
        assert_eq!(after[2], 5100 * MS, "{after:?}");
        assert_eq!(after.len(), 41, "{after:?}");
        assert!(worst_window_excess(&calls, 20.0, 5) <= 1e-6);
    }

    #[test]
    fn a_shorter_pause_does_not_cut_a_longer_one() {
        let sim = Sim::new(MS);
        let gate = empty_gate(&sim);
        let log = Log::default();
        gate.pause_for(SECOND);
        gate.pause_for(200 * MS);
        queue(&sim, &gate, &log, "one", Priority::Normal);
        sim.run_until(2 * SECOND);
        assert_eq!(log.borrow()[0].1, SECOND);
    }

    /// A 10/s, burst-1 gate built at time 0: it starts empty, so the first
    /// token is due at 100 ms and one every 100 ms after.
    fn empty_gate(sim: &Sim) -> Arc<ProviderGate> {
        sim.gate(10.0, 1)
    }

    type Log = Rc<RefCell<Vec<(String, Duration, Duration)>>>;

    /// Queues a caller named `name` that logs (name, grant time, wait).
    fn queue(
        sim: &Sim,
        gate: &Arc<ProviderGate>,
        log: &Log,
        name: &str,
        priority: Priority,
    ) -> usize {
        let (sim2, gate, log, name) = (
            sim.clone(),
            Arc::clone(gate),
            Rc::clone(log),
            name.to_string(),
        );
        let task = sim.spawn(async move {
            let waited = gate.acquire(priority).await;
            log.borrow_mut().push((name, sim2.now(), waited));
        });
        sim.settle();
        task
    }

    fn names(log: &Log) -> Vec<String> {
        log.borrow()
            .iter()
            .map(|(name, _, _)| name.clone())
            .collect()
    }

    #[test]
    fn a_high_caller_arriving_behind_queued_low_waiters_gets_the_very_next_token() {
        let sim = Sim::new(MS);
        let gate = empty_gate(&sim);
        let log = Log::default();
        for i in 1..=5 {
            queue(&sim, &gate, &log, &format!("low{i}"), Priority::Low);
        }
        sim.run_until(30 * MS);
        queue(&sim, &gate, &log, "high", Priority::High);
        assert_eq!(gate.waiting(), [1, 0, 5]);

        sim.run_until(100 * MS);
        assert_eq!(log.borrow()[..], [("high".to_string(), 100 * MS, 70 * MS)]);
        sim.run_until(SECOND);
        assert_eq!(
            names(&log),
            ["high", "low1", "low2", "low3", "low4", "low5"]
        );
        assert_eq!(log.borrow()[5].1, 600 * MS);
    }

    #[test]
    fn normal_waiters_go_before_low_ones_and_each_priority_keeps_arrival_order() {
        let sim = Sim::new(MS);
        let gate = empty_gate(&sim);
        let log = Log::default();
        queue(&sim, &gate, &log, "low1", Priority::Low);
        queue(&sim, &gate, &log, "normal1", Priority::Normal);
        queue(&sim, &gate, &log, "low2", Priority::Low);
        queue(&sim, &gate, &log, "normal2", Priority::Normal);
        queue(&sim, &gate, &log, "high1", Priority::High);
        assert_eq!(gate.waiting(), [1, 2, 2]);
        sim.run_until(SECOND);
        assert_eq!(names(&log), ["high1", "normal1", "normal2", "low1", "low2"]);
        let times: Vec<_> = log.borrow().iter().map(|(_, at, _)| *at).collect();
        assert_eq!(times, [100 * MS, 200 * MS, 300 * MS, 400 * MS, 500 * MS]);
    }

    /// Queues a caller of `tenant` named `name`, logging like [`queue`].
    fn queue_for(sim: &Sim, gate: &Arc<ProviderGate>, log: &Log, name: &str, tenant: &str) {
        let (sim2, gate, log, name, tenant) = (
            sim.clone(),
            Arc::clone(gate),
            Rc::clone(log),
            name.to_string(),
            tenant.to_string(),
        );
        sim.spawn(async move {
            let waited = gate.acquire_for(Priority::Normal, &tenant).await;
            log.borrow_mut().push((name, sim2.now(), waited));
        });
        sim.settle();
    }

    #[test]
    fn tenants_of_one_priority_take_turns_so_a_first_message_is_not_behind_a_backlog() {
        let sim = Sim::new(MS);
        let gate = empty_gate(&sim);
        let log = Log::default();
        for i in 1..=4 {
            queue_for(&sim, &gate, &log, &format!("big{i}"), "big");
        }
        queue_for(&sim, &gate, &log, "small1", "small");
        queue_for(&sim, &gate, &log, "other1", "other");
        queue_for(&sim, &gate, &log, "small2", "small");
        sim.run_until(SECOND);
        assert_eq!(
            names(&log),
            ["big1", "small1", "other1", "big2", "small2", "big3", "big4"]
        );
    }

    #[test]
    fn under_a_flood_of_high_callers_low_ones_still_get_their_share_of_tokens() {
        let sim = Sim::new(MS);
        let gate = sim.gate_with_share(100.0, 1, 0.1);
        let counts = Rc::new(RefCell::new([0usize; 3]));
        for i in 0..12 {
            let priority = if i < 10 {
                Priority::High
            } else {
                Priority::Low
            };
            let (gate, counts) = (Arc::clone(&gate), Rc::clone(&counts));
            sim.spawn(async move {
                loop {
                    gate.acquire(priority).await;
                    counts.borrow_mut()[priority.rank()] += 1;
                }
            });
        }
        sim.run_until(20 * SECOND);
        let [high, _, low] = *counts.borrow();
        let share = low as f64 / (high + low) as f64;
        assert!(
            (0.085..=0.1).contains(&share),
            "low got {low} of {} tokens",
            high + low
        );
        // Strict priority (share 0) would give low nothing at all.
        let strict = Sim::new(MS);
        let gate = strict.gate(100.0, 1);
        let low_grants = Rc::new(RefCell::new(0usize));
        for i in 0..12 {
            let priority = if i < 10 {
                Priority::High
            } else {
                Priority::Low
            };
            let (gate, low_grants) = (Arc::clone(&gate), Rc::clone(&low_grants));
            strict.spawn(async move {
                loop {
                    gate.acquire(priority).await;
                    if priority == Priority::Low {
                        *low_grants.borrow_mut() += 1;
                    }
                }
            });
        }
        strict.run_until(5 * SECOND);
        assert!(*low_grants.borrow() <= 2, "low got {}", low_grants.borrow());
    }

    #[test]
    fn the_share_rule_keeps_the_gate_within_burst_plus_rate() {
        let sim = Sim::new(MS);
        let gate = sim.gate_with_share(50.0, 5, 0.2);
        let (grants, _) = backlog(&sim, &gate, 30, 10 * SECOND);
        assert!(worst_window_excess(&grants, 50.0, 5) <= 1e-9);
        assert!(grants.len() as f64 >= 0.99 * 50.0 * 10.0);
    }

    #[test]
    fn a_caller_coming_back_for_another_token_queues_behind_those_already_waiting() {
        // Timers firing only every 250 ms let two tokens pile up while the
        // head sleeps, so at the wake-up one is still free when the served
        // caller asks again.
        let sim = Sim::new(250 * MS);
        let gate = sim.gate(10.0, 5);
        let log = Log::default();
        for name in ["a", "b", "c"] {
            let (sim2, gate, log) = (sim.clone(), Arc::clone(&gate), Rc::clone(&log));
            sim.spawn(async move {
                loop {
                    let waited = gate.acquire(Priority::Normal).await;
                    log.borrow_mut()
                        .push((name.to_string(), sim2.now(), waited));
                }
            });
        }
        sim.run_until(SECOND);
        let served: Vec<_> = names(&log).into_iter().take(9).collect();
        assert_eq!(served, ["a", "b", "c", "a", "b", "c", "a", "b", "c"]);
    }

    #[test]
    fn a_cancelled_head_of_line_does_not_swallow_the_next_token() {
        let sim = Sim::new(MS);
        let gate = empty_gate(&sim);
        let log = Log::default();
        queue(&sim, &gate, &log, "low", Priority::Low);
        let high = queue(&sim, &gate, &log, "high", Priority::High);
        sim.run_until(50 * MS);
        sim.abort(high);
        assert_eq!(gate.waiting(), [0, 0, 1]);
        sim.run_until(SECOND);
        assert_eq!(log.borrow()[..], [("low".to_string(), 100 * MS, 100 * MS)]);
    }

    #[test]
    fn a_waiter_that_times_out_leaves_the_next_token_to_the_one_behind_it() {
        let sim = Sim::new(MS);
        let gate = empty_gate(&sim);
        let log = Log::default();
        let timed_out = Rc::new(RefCell::new(None));
        {
            let (clock, gate, timed_out) = (sim.clock(), Arc::clone(&gate), Rc::clone(&timed_out));
            sim.spawn(async move {
                let outcome = timeout(&clock, 50 * MS, gate.acquire(Priority::High)).await;
                *timed_out.borrow_mut() = Some((outcome, clock.now()));
            });
        }
        queue(&sim, &gate, &log, "normal", Priority::Normal);
        queue(&sim, &gate, &log, "low", Priority::Low);
        sim.run_until(SECOND);
        assert_eq!(*timed_out.borrow(), Some((None, Nanos::from(50 * MS))));
        assert_eq!(names(&log), ["normal", "low"]);
        assert_eq!(log.borrow()[0].1, 100 * MS);
        assert_eq!(log.borrow()[1].1, 200 * MS);
    }

    #[test]
    fn a_waiter_cancelled_just_after_being_woken_as_head_passes_the_turn_on() {
        let sim = Sim::new(MS);
        let gate = empty_gate(&sim);
        let log = Log::default();
        let normal = Rc::new(RefCell::new(None));
        {
            // The high caller, once served, cancels the normal caller that
            // its grant just woke, before that caller has run.
            let (sim2, gate, log, normal) = (
                sim.clone(),
                Arc::clone(&gate),
                Rc::clone(&log),
                Rc::clone(&normal),
            );
            sim.spawn(async move {
                let waited = gate.acquire(Priority::High).await;
                log.borrow_mut()
                    .push(("high".to_string(), sim2.now(), waited));
                sim2.abort(normal.borrow_mut().take().expect("normal caller queued"));
            });
        }
        *normal.borrow_mut() = Some(queue(&sim, &gate, &log, "normal", Priority::Normal));
        queue(&sim, &gate, &log, "low", Priority::Low);
        sim.run_until(SECOND);
        assert_eq!(names(&log), ["high", "low"]);
        assert_eq!(log.borrow()[1].1, 200 * MS);
        assert_eq!(gate.waiting(), [0, 0, 0]);
    }

    #[test]
    fn waiting_callers_are_woken_about_once_per_grant_not_once_per_waiter() {
        let sim = Sim::new(MS);
        let gate = sim.gate(20.0, 5);
        let (grants, polls) = backlog(&sim, &gate, 50, 30 * SECOND);
        // Each grant: the served caller returns and queues again, the next
        // head wakes and goes to sleep on the clock, the clock wakes it.
        let per_grant = polls as f64 / grants.len() as f64;
        assert!(per_grant <= 4.0, "{per_grant} polls per grant");
    }

    #[tokio::test]
    async fn on_tokio_time_a_caller_waits_until_its_token_is_due() {
        let start = tokio::time::Instant::now();
        let gate = ProviderGate::new(4.0, 1);
        let first = gate.acquire(Priority::Normal).await;
        let waited = gate.acquire(Priority::Normal).await;
        // Lower bounds only: a busy machine may wake the caller late, never
        // early. The gate starts empty: the first token is due 250 ms after
        // it was built, the second 250 ms after that.
        assert!(
            start.elapsed() >= 500 * MS,
            "granted after {:?}",
            start.elapsed()
        );
        assert!(first > Duration::ZERO, "the first caller did not wait");
        assert!(waited > Duration::ZERO, "the second caller did not wait");
        assert_eq!(gate.waiting(), [0, 0, 0]);
    }

    #[test]
    fn acquire_can_run_on_a_multi_threaded_runtime() {
        fn assert_send<T: Send>(_: &T) {}
        let gate = ProviderGate::new(1.0, 1);
        assert_send(&gate.acquire(Priority::High));
        fn assert_shareable<T: Send + Sync>() {}
        assert_shareable::<ProviderGate>();
    }

    #[test]
    fn reports_the_rate_achieved_by_a_20_per_second_gate_over_30_seconds() {
        let sim = Sim::new(MS);
        let gate = sim.gate(20.0, 5);
        let (grants, _) = backlog(&sim, &gate, 50, 30 * SECOND);
        let at_start = grants.iter().filter(|&&at| at == Duration::ZERO).count();
        let achieved = grants.len() as f64 / 30.0;
        println!(
            "provider gate at {}/s burst {}: {} grants in 30 s of simulated time \
             ({at_start} at t=0: it starts empty), {achieved:.3}/s",
            gate.rate_per_second(),
            gate.burst(),
            grants.len(),
        );
        assert_eq!(at_start, 0);
        assert!(achieved >= 0.99 * 20.0);
    }

    /// Real time, 30 s: `cargo test --lib limits::gate -- --ignored --nocapture`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "takes 30 s of real time"]
    async fn reports_the_rate_achieved_on_tokio_time() {
        let gate = Arc::new(ProviderGate::new(20.0, 5));
        let grants = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let start = tokio::time::Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..50 {
            let (gate, grants) = (Arc::clone(&gate), Arc::clone(&grants));
            tasks.spawn(async move {
                loop {
                    gate.acquire(Priority::ALL[i % 3]).await;
                    grants.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
        tokio::time::sleep_until(start + 30 * SECOND).await;
        let total = grants.load(std::sync::atomic::Ordering::Relaxed);
        tasks.abort_all();
        println!(
            "provider gate at 20/s burst 5, real time: {total} grants in 30 s, {:.3}/s (it starts empty)",
            total as f64 / 30.0
        );
        assert!(total as f64 >= 0.99 * 600.0);
    }
}

/// A simulated clock and a single-threaded executor for the tests: every
/// ready task runs before time moves on to the next timer, the way tokio's
/// paused clock does, and every timer fires on a tick boundary, the way
/// tokio's millisecond timer wheel does.
#[cfg(test)]
mod sim {
    use std::cell::{Cell, RefCell};
    use std::collections::{BTreeMap, HashMap, VecDeque};
    use std::future::Future;
    use std::pin::Pin;
    use std::rc::Rc;
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll, Wake, Waker};
    use std::time::Duration;

    use governor::nanos::Nanos;

    use super::{ProviderGate, Timeline};

    /// Simulated time in nanoseconds and the timers waiting on it.
    pub struct SimClock {
        /// Timers fire on multiples of this many nanoseconds.
        tick: u64,
        state: Mutex<ClockState>,
    }

    #[derive(Default)]
    struct ClockState {
        now: u64,
        next_key: u64,
        /// Pending timers by (fire time, key).
        timers: BTreeMap<(u64, u64), Waker>,
    }

    impl SimClock {
        pub fn now(&self) -> Nanos {
            Nanos::from(self.state.lock().unwrap().now)
        }

        pub fn sleep_until(self: &Arc<Self>, at: Nanos) -> SimSleep {
            let fire_at = at.as_u64().div_ceil(self.tick).saturating_mul(self.tick);
            SimSleep {
                clock: Arc::clone(self),
                fire_at,
                key: None,
            }
        }

        fn next_timer(&self) -> Option<u64> {
            let state = self.state.lock().unwrap();
            state.timers.keys().next().map(|&(at, _)| at)
        }

        /// Moves time to `to` and wakes the timers due by then.
        fn advance_to(&self, to: u64) {
            let mut state = self.state.lock().unwrap();
            state.now = state.now.max(to);
            let first_later = (state.now + 1, 0);
            let later = state.timers.split_off(&first_later);
            let due = std::mem::replace(&mut state.timers, later);
            drop(state);
            due.into_values().for_each(Waker::wake);
        }
    }

    pub struct SimSleep {
        clock: Arc<SimClock>,
        fire_at: u64,
        key: Option<(u64, u64)>,
    }

    impl Future for SimSleep {
        type Output = ();

        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            let this = self.get_mut();
            let mut state = this.clock.state.lock().unwrap();
            if state.now >= this.fire_at {
                if let Some(key) = this.key.take() {
                    state.timers.remove(&key);
                }
                return Poll::Ready(());
            }
            let key = *this.key.get_or_insert_with(|| {
                state.next_key += 1;
                (this.fire_at, state.next_key)
            });
            state.timers.insert(key, cx.waker().clone());
            Poll::Pending
        }
    }

    impl Drop for SimSleep {
        fn drop(&mut self) {
            if let Some(key) = self.key {
                self.clock.state.lock().unwrap().timers.remove(&key);
            }
        }
    }

    /// Resolves to `None` if `future` is not done `after` from now.
    pub async fn timeout<F: Future>(
        clock: &Arc<SimClock>,
        after: Duration,
        future: F,
    ) -> Option<F::Output> {
        let mut future = std::pin::pin!(future);
        let mut sleep = clock.sleep_until(Nanos::from(Duration::from(clock.now()) + after));
        std::future::poll_fn(|cx| {
            if let Poll::Ready(output) = future.as_mut().poll(cx) {
                return Poll::Ready(Some(output));
            }
            Pin::new(&mut sleep).poll(cx).map(|()| None)
        })
        .await
    }

    type Task = Pin<Box<dyn Future<Output = ()>>>;

    /// Polls tasks in the order they were woken; cloning shares it, so a
    /// task can abort another.
    #[derive(Clone)]
    pub struct Sim(Rc<Executor>);

    struct Executor {
        clock: Arc<SimClock>,
        tasks: RefCell<HashMap<usize, Task>>,
        ready: Arc<Mutex<VecDeque<usize>>>,
        next_id: Cell<usize>,
        polls: Cell<u64>,
    }

    struct TaskWaker {
        id: usize,
        ready: Arc<Mutex<VecDeque<usize>>>,
    }

    impl Wake for TaskWaker {
        fn wake(self: Arc<Self>) {
            self.ready.lock().unwrap().push_back(self.id);
        }
    }

    impl Sim {
        /// Starts at time zero; timers fire on multiples of `tick`.
        pub fn new(tick: Duration) -> Self {
            let clock = SimClock {
                tick: Nanos::from(tick).as_u64().max(1),
                state: Mutex::default(),
            };
            Sim(Rc::new(Executor {
                clock: Arc::new(clock),
                tasks: RefCell::default(),
                ready: Arc::default(),
                next_id: Cell::new(0),
                polls: Cell::new(0),
            }))
        }

        pub fn gate(&self, rate_per_second: f64, burst: u32) -> Arc<ProviderGate> {
            self.gate_with_share(rate_per_second, burst, 0.0)
        }

        pub fn gate_with_share(
            &self,
            rate_per_second: f64,
            burst: u32,
            share: f64,
        ) -> Arc<ProviderGate> {
            let timeline = Timeline::Simulated(self.clock());
            Arc::new(ProviderGate::with_timeline(
                rate_per_second,
                burst,
                share,
                timeline,
            ))
        }

        pub fn pool(
            &self,
            members: &[super::MemberSpec],
            health: &crate::config::ProviderHealthSettings,
        ) -> Arc<ProviderGate> {
            let timeline = Timeline::Simulated(self.clock());
            Arc::new(ProviderGate::pool_with_timeline(
                members, 0.0, health, timeline,
            ))
        }

        pub fn clock(&self) -> Arc<SimClock> {
            Arc::clone(&self.0.clock)
        }

        pub fn now(&self) -> Duration {
            Duration::from(self.0.clock.now())
        }

        /// Task polls so far.
        pub fn polls(&self) -> u64 {
            self.0.polls.get()
        }

        pub fn spawn(&self, task: impl Future<Output = ()> + 'static) -> usize {
            let id = self.0.next_id.get();
            self.0.next_id.set(id + 1);
            self.0.tasks.borrow_mut().insert(id, Box::pin(task));
            self.0.ready.lock().unwrap().push_back(id);
            id
        }

        /// Drops a task's future wherever it is waiting. A task cannot abort
        /// itself.
        pub fn abort(&self, id: usize) {
            let task = self.0.tasks.borrow_mut().remove(&id);
            drop(task);
        }

        /// Runs tasks until none is ready, without moving time.
        pub fn settle(&self) {
            let mut polls_here = 0u64;
            loop {
                let next = self.0.ready.lock().unwrap().pop_front();
                let Some(id) = next else { return };
                let task = self.0.tasks.borrow_mut().remove(&id);
                let Some(mut task) = task else { continue };
                let waker = Waker::from(Arc::new(TaskWaker {
                    id,
                    ready: Arc::clone(&self.0.ready),
                }));
                self.0.polls.set(self.0.polls.get() + 1);
                polls_here += 1;
                assert!(
                    polls_here < 1_000_000,
                    "tasks keep waking each other without time passing"
                );
                if task
                    .as_mut()
                    .poll(&mut Context::from_waker(&waker))
                    .is_pending()
                {
                    self.0.tasks.borrow_mut().insert(id, task);
                }
            }
        }

        /// Runs tasks and moves time from timer to timer up to `until`.
        pub fn run_until(&self, until: Duration) {
            let until = Nanos::from(until).as_u64();
            loop {
                self.settle();
                match self.0.clock.next_timer() {
                    Some(at) if at <= until => self.0.clock.advance_to(at),
                    _ => break,
                }
            }
            self.0.clock.advance_to(until);
            self.settle();
        }
    }
}
