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
//! Time comes from tokio's clock, in production and in the tests alike:
//! the tests run the gate under tokio's paused clock (`start_paused`), where
//! time stands still while any task can run and then jumps to the next
//! timer, so they check windows and rates exactly and need no real
//! sleeping. tokio's timers have a resolution of one millisecond (a sleep
//! ends on the first whole millisecond at or after its deadline), so the
//! tests use rates whose token interval is a whole number of milliseconds
//! where they check exact instants, and bounds the rounding cannot break
//! elsewhere.

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

mod line;
#[cfg(test)]
mod tests;
mod timeline;

use line::Line;
use timeline::Timeline;

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
    pub(crate) fn new(rate_per_second: f64, burst: u32) -> Self {
        Self::with_share(rate_per_second, burst, 0.0)
    }

    /// A gate of one provider at `rate_per_second` with `burst`, with
    /// strict priority softened: while lower priorities have callers
    /// waiting, they get at least `low_priority_share` of the tokens (the
    /// lanes' share rule, see [`crate::queue::priority`]).
    pub fn with_share(rate_per_second: f64, burst: u32, low_priority_share: f64) -> Self {
        let only = MemberSpec {
            name: String::new(),
            weight: 1,
            rate_per_second,
            burst,
        };
        Self::pool(
            &[only],
            low_priority_share,
            &ProviderHealthSettings::default(),
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
        let timeline = Timeline::tokio();
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
    pub(crate) fn pause_for(&self, pause: Duration) {
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
    pub(crate) async fn pace_call(&self) -> Duration {
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
    pub(crate) async fn acquire(&self, priority: Priority) -> Duration {
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
