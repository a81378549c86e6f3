//! The gate's providers: each one's bucket, pause and health, how routing
//! weighs them (weight × health factor, within a caller's [`Choice`]), and
//! what the admin view and metrics read of them.

use super::*;

/// One provider of the gate: its bucket, pause and health.
pub(super) struct Member {
    /// The provider's name (Redis key, metrics label, admin view).
    pub(super) name: String,
    /// Its configured share beside the others.
    pub(super) weight: u32,
    /// GCRA state: decides whether a call may go now and, if not, from when.
    pub(super) bucket: Bucket,
    /// The configured rate, reported as given for metrics and logs (the
    /// bucket holds it as a whole number of nanoseconds per call).
    pub(super) rate_per_second: f64,
    /// The configured bucket size, reported as given.
    pub(super) burst: u32,
    /// With `limits.backend = "redis"`: the fleet-wide bucket the head of
    /// the line takes this provider's tokens from instead of `bucket`.
    pub(super) global: Option<GlobalBucket>,
    /// Until when no token is handed out (nanoseconds on the timeline),
    /// after the provider answered 429 with a `Retry-After`; 0: never.
    pub(super) paused_until: AtomicU64,
    /// Set by a pause: the first grant after it empties the bucket of what
    /// it saved up during the pause (see [`ProviderGate::pause_for`]).
    pub(super) drain_grants: AtomicBool,
    /// The same for `calls`, by the first call paced after the pause.
    pub(super) drain_calls: AtomicBool,
    /// A second bucket of the same rate and one call more of burst, taken
    /// from right before each call (see [`ProviderGate::pace_call`]).
    pub(super) calls: Bucket,
    /// Tokens this instance's grants left in the bucket at its last grant,
    /// and when: with the rate, what it holds now (governor's bucket
    /// answers that only when a token is taken).
    pub(super) left: Mutex<(u32, Nanos)>,
    /// Its recent outcomes and the share of its weight they leave it.
    pub(super) health: Health,
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
pub(super) struct Weighed {
    pub(super) member: usize,
    pub(super) weight: f64,
    pub(super) factor: f64,
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

impl ProviderGate {
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
    /// rate. In a pool it then wins its weight back on the health ramp
    /// (from a tenth over `recover_secs`), as after a spell marked down.
    ///
    /// `pause` may come from a provider's header: however long it is, the
    /// end saturates rather than overflows (the providers clamp it first, see
    /// [`crate::config::MAX_PROVIDER_PAUSE`]).
    pub fn pause_member(&self, member: usize, pause: Duration) {
        let Some(member) = self.members.get(member) else {
            return;
        };
        let end = Duration::from(self.timeline.now()).saturating_add(pause);
        member.health.paused_until(end);
        let until = u64::try_from(end.as_nanos()).unwrap_or(u64::MAX);
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

    /// The end of `member`'s pause still running, if any.
    pub(super) fn paused(&self, member: &Member) -> Option<Nanos> {
        let until = member.paused_until.load(Ordering::Relaxed);
        let now = u64::try_from(Duration::from(self.timeline.now()).as_nanos()).unwrap_or(u64::MAX);
        (until > now).then(|| Nanos::from(Duration::from_nanos(until)))
    }

    /// The first provider's configured rate in calls per second.
    pub fn rate_per_second(&self) -> f64 {
        self.members[0].rate_per_second
    }

    /// The first provider's configured burst.
    pub fn burst(&self) -> u32 {
        self.members[0].burst
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
    pub(super) fn candidates(&self, line: &Line, choice: Choice) -> (Vec<usize>, Vec<Weighed>) {
        let now = Duration::from(self.timeline.now());
        let weights = self.effective_weights(choice, now);
        (line.order(&weights), weights)
    }
}
