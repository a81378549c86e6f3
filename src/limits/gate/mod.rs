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
//! built empty at the start of each outage so the switch adds no burst.
//! When Redis answers again, the first take of an instance that paced calls
//! on its share empties the bucket in Redis before it takes: that bucket
//! saw none of those calls, and would otherwise add its whole burst on top
//! of them (issue 67 measured a fleet-wide burst right after a cut of every
//! instance). A caller cancelled while its Redis call is under way may waste that token:
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

mod buckets;
mod global;
#[cfg(test)]
mod hand_over_tests;
mod line;
mod members;
#[cfg(test)]
mod tests;
mod timeline;

use buckets::{calls_quota, empty_bucket, quota};
use global::GlobalBucket;
use line::{Line, STALL_GRACE};
pub use members::{Choice, MemberSpec, MemberView};
use members::{Member, Weighed};
use timeline::Timeline;

/// How long a gate's line may stay stuck, its head woken by the watchdog
/// at every round and still not acting, before `/readyz` takes the
/// instance out: a stuck gate holds every message that needs its channel.
pub const STUCK_UNREADY: Duration = Duration::from_secs(5);

/// Number of priorities, indexed by [`Priority::rank`].
const PRIORITIES: usize = 3;

/// GCRA bucket reading the gate's timeline; instants are nanoseconds since
/// the gate was built.
type Bucket = RateLimiter<NotKeyed, InMemoryState, Timeline, StateInformationMiddleware>;

/// Paces calls to the providers of one channel: a token bucket per
/// provider, with one line of waiters over all of them, served high
/// priority first, then by tenant turns and arrival.
///
/// Build it once per channel and share it as `Arc<ProviderGate>`; the
/// constructors return the gate itself so the caller chooses how to share it.
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
            line: Mutex::new(Line::new(
                low_priority_share,
                members.len(),
                timeline.clone(),
            )),
            members,
            timeline,
        }
    }

    /// Callers waiting right now, by priority rank: `[high, normal, low]`.
    /// Cheap enough for every metrics scrape: one short lock.
    pub fn waiting(&self) -> [usize; PRIORITIES] {
        let line = self.line();
        std::array::from_fn(|rank| line.waiting(rank))
    }

    /// The watchdog's round, once a second from the service: with callers
    /// waiting and the head of the line more than [`STALL_GRACE`] past the
    /// instant it said it would act by (see [`Line::expect_head_by`]), the
    /// line is stuck, which the hand-over rule should make impossible. The
    /// round then repairs it by waking the head (a spare wake-up costs the
    /// head one look at the line) and returns true, for the caller to log
    /// and count. The head acting again ends the stall.
    pub fn watch(&self) -> bool {
        let now = self.timeline.now();
        let mut line = self.line();
        if (0..PRIORITIES).all(|rank| line.waiting(rank) == 0) {
            line.progress.stuck_since = None;
            return false;
        }
        let late = Duration::from(now.saturating_sub(line.progress.due));
        if late < STALL_GRACE {
            return false;
        }
        line.progress.stuck_since.get_or_insert(now);
        line.progress.stalls += 1;
        line.progress.due = now;
        if let Some(head) = line.head() {
            head.wake.notify_one();
        }
        true
    }

    /// How long the line has been stuck with the watchdog's wake-ups not
    /// helping: `None` while the head acts when it should. `/readyz` reports
    /// a gate stuck for [`STUCK_UNREADY`] or more.
    pub fn stuck_for(&self) -> Option<Duration> {
        let since = self.line().progress.stuck_since?;
        Some(self.timeline.elapsed_since(since))
    }

    /// Stalls the watchdog found and repaired so far.
    pub fn stalls(&self) -> u64 {
        self.line().progress.stalls
    }

    /// Callers waiting right now by tenant, all priorities together: how
    /// much of the gate's line each tenant holds (the console's gate
    /// saturation). One short lock.
    pub fn waiting_by_tenant(&self) -> HashMap<Arc<str>, usize> {
        let line = self.line();
        let mut by_tenant: HashMap<Arc<str>, usize> = HashMap::new();
        for turn in line.tiers.iter().flatten() {
            *by_tenant.entry(turn.tenant.clone()).or_default() += turn.waiters.len();
        }
        by_tenant
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
                        Err(due) => {
                            line.expect_head_by(due);
                            Some(due)
                        }
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

    /// Takes a token for the head from the first provider, in routing
    /// order, that has one and is not paused; otherwise says when the
    /// first of them will have one.
    fn take_local(&self, line: &mut Line, choice: Choice) -> Result<usize, Nanos> {
        let (order, weights) = self.candidates(line, choice);
        // A paused provider is out of the round: it earns no credit while
        // it cannot serve, and keeps none it had (a credit saved up over a
        // pause would give it every grant once it is back).
        let serving: Vec<Weighed> = weights
            .iter()
            .copied()
            .filter(|w| self.paused(&self.members[w.member]).is_none())
            .collect();
        let mut due: Option<Nanos> = None;
        for i in order {
            let member = &self.members[i];
            if let Some(until) = self.paused(member) {
                line.current[i] = line.current[i].min(0.0);
                due = Some(due.map_or(until, |d| d.min(until)));
                continue;
            }
            match self.take_grant(member, &member.bucket) {
                Ok(()) => {
                    line.granted(i, &serving);
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
