//! Per-tenant admission: a token bucket per tenant (GCRA, with its plan's
//! figures) and a daily quota counted per UTC day.
//!
//! Two backends behind one [`TenantLimits`]: `local` keeps the buckets in
//! this process; `redis` keeps them in Redis for every instance together
//! ([`super::tenant_redis`]), and falls back to this process's share while
//! Redis is unreachable. Both answer with the same [`Grant`] and
//! [`Refusal`] figures, and both charge a send of several recipients as one
//! admission of that many units: all of them or none.
//!
//! A grant can be given back ([`TenantLimits::release`]): a send refused
//! after its admission (its files taken meanwhile, the store unable to
//! write it) returns the units to the bucket and to the day's count, so a
//! refusal charges nothing. The local bucket is our own GCRA rather than
//! governor's, which has no way to return cells once taken (governor
//! issue 152); the arithmetic is the one governor and the Redis script run.
//!
//! [`TenantLimits`]: super::admission::TenantLimits
//! [`TenantLimits::release`]: super::admission::TenantLimits::release

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::retry_after_secs;
use crate::tenants::Plan;

/// Figures for the `RateLimit-*` headers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateInfo {
    /// The bucket size (`RateLimit-Limit`).
    pub limit: u32,
    /// Sends left right now (`RateLimit-Remaining`).
    pub remaining: u32,
    /// Seconds until the bucket is full again (`RateLimit-Reset`).
    pub reset_secs: u64,
}

impl RateInfo {
    /// The figures of a granted send that left `remaining` in a bucket of
    /// `plan.burst`.
    pub(crate) fn granted(plan: &Plan, remaining: u32) -> Self {
        let missing = plan.burst.saturating_sub(remaining) as f64;
        RateInfo {
            limit: plan.burst,
            remaining,
            reset_secs: (missing / plan.rate_per_second).ceil() as u64,
        }
    }

    /// The figures of a send refused for `wait`.
    pub(crate) fn refused(plan: &Plan, wait: Duration) -> Self {
        RateInfo {
            limit: plan.burst,
            remaining: 0,
            reset_secs: retry_after_secs(wait),
        }
    }
}

/// Why a send was refused.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// Over the plan's rate; the limiter allows the next send after `retry_after`.
    Rate {
        retry_after: Duration,
        info: RateInfo,
    },
    /// The day's quota is used up; it renews at the next UTC midnight.
    Quota { retry_after: Duration, quota: u64 },
}

/// A granted send of `units` recipients. Call [`TenantLimits::release`] if
/// the send is not accepted after all, so neither the bucket nor the quota
/// is charged for it.
///
/// [`TenantLimits::release`]: super::admission::TenantLimits::release
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grant {
    pub info: RateInfo,
    pub(crate) day: i64,
    /// Which counter charged it, so a release goes back to the same one.
    pub(crate) via: Via,
    /// Units taken from the bucket and the day's count.
    pub(crate) units: u32,
    /// The bucket's emission interval when they were taken: what one unit
    /// gives back.
    pub(crate) period: Duration,
}

/// Where a grant's quota was counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Via {
    /// This process's counter (`local` backend, or `redis` while down).
    Local,
    /// The day's counter in Redis.
    Redis,
}

/// Where a tenant's count of the day starts when this process (or Redis)
/// has not counted it yet: what the store holds since midnight. Passed in
/// by the caller, so the limits know nothing of the store.
#[async_trait::async_trait]
pub trait SentCounts: Send + Sync {
    /// Messages `tenant_id` sent since `since_ms` (ms since the epoch).
    async fn sent_since(&self, tenant_id: &str, since_ms: i64) -> anyhow::Result<u64>;
}

/// Sends counted today for one tenant.
#[derive(Debug, Clone, Copy)]
struct DayCount {
    day: i64,
    count: u64,
    /// What `count` started from (the store's count, or the count Redis
    /// last reported): `count - seeded` is what this process admitted.
    seeded: u64,
}

/// Milliseconds in a UTC day.
pub(crate) const DAY_MS: i64 = 86_400_000;

/// Buckets and day counts kept in this process, under one lock, so an
/// admission looks at both and charges both or neither.
pub(crate) struct LocalLimits {
    counts: Arc<dyn SentCounts>,
    /// The buckets' clock: nanoseconds since this instant.
    epoch: Instant,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Each tenant's GCRA theoretical arrival time (ns since `epoch`).
    tats: HashMap<String, u64>,
    days: HashMap<String, DayCount>,
}

/// `period` (a bucket's emission interval) in nanoseconds, at least 1.
fn period_nanos(period: Duration) -> u64 {
    u64::try_from(period.as_nanos()).unwrap_or(u64::MAX).max(1)
}

/// GCRA: takes `units` from a bucket of `burst` refilling one unit every
/// `period` ns, whose theoretical arrival time is `tat` (`None`: a full
/// bucket). Returns the new arrival time and the units left, or the ns
/// until the units could be taken. More units than the burst are taken
/// only from a full bucket (the accept refuses such sends up front; this
/// instance's share while Redis is away may be smaller than a send).
pub(crate) fn gcra_take(
    tat: Option<u64>,
    now: u64,
    period: u64,
    burst: u32,
    units: u32,
) -> Result<(u64, u32), u64> {
    let burst = u64::from(burst.max(units).max(1));
    let units = u64::from(units.max(1));
    let tau = period.saturating_mul(burst - 1);
    let tat = tat.unwrap_or(now);
    let earliest = tat
        .saturating_add(period.saturating_mul(units - 1))
        .saturating_sub(tau);
    if now < earliest {
        return Err(earliest - now);
    }
    let next = tat.max(now).saturating_add(period.saturating_mul(units));
    let left = (now.saturating_add(tau).saturating_add(period)).saturating_sub(next) / period;
    Ok((next, u32::try_from(left.min(burst)).unwrap_or(u32::MAX)))
}

/// GCRA: gives `units` back to a bucket whose arrival time is `tat`; a
/// bucket is never fuller than full (`now`).
pub(crate) fn gcra_give_back(tat: u64, now: u64, period: u64, units: u32) -> u64 {
    tat.saturating_sub(period.saturating_mul(u64::from(units)))
        .max(now)
}

impl LocalLimits {
    pub(crate) fn new(counts: Arc<dyn SentCounts>) -> Self {
        LocalLimits {
            counts,
            epoch: Instant::now(),
            state: Mutex::new(State::default()),
        }
    }

    fn clock(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// See [`TenantLimits::admit`]. A tenant's first count of the day
    /// starts from `seed(today)` when it has one, else from the store.
    ///
    /// [`TenantLimits::admit`]: super::admission::TenantLimits::admit
    pub(crate) async fn admit(
        &self,
        tenant_id: &str,
        plan: &Plan,
        units: u32,
        seed: impl FnOnce(i64) -> Option<u64>,
    ) -> anyhow::Result<Result<Grant, Refusal>> {
        let units = units.max(1);
        let now_ms = crate::model::now_ms();
        let today = now_ms.div_euclid(DAY_MS);
        let known = self.state().days.get(tenant_id).copied();
        if known.is_none_or(|c| c.day != today) {
            let counted = match seed(today) {
                Some(count) => count,
                None => self.counts.sent_since(tenant_id, today * DAY_MS).await?,
            };
            let fresh = DayCount {
                day: today,
                count: counted,
                seeded: counted,
            };
            let mut state = self.state();
            let entry = state.days.entry(tenant_id.to_owned()).or_insert(fresh);
            if entry.day != today {
                *entry = fresh;
            }
        }

        let mut state = self.state();
        let used = state
            .days
            .get(tenant_id)
            .filter(|c| c.day == today)
            .map_or(0, |c| c.count);
        if used.saturating_add(u64::from(units)) > plan.daily_quota {
            return Ok(Err(Refusal::Quota {
                retry_after: Duration::from_millis(((today + 1) * DAY_MS - now_ms).max(1) as u64),
                quota: plan.daily_quota,
            }));
        }
        let period = super::period_of(plan.rate_per_second);
        let now = self.clock();
        let tat = state.tats.get(tenant_id).copied();
        let remaining = match gcra_take(tat, now, period_nanos(period), plan.burst, units) {
            Ok((next, remaining)) => {
                state.tats.insert(tenant_id.to_owned(), next);
                remaining
            }
            Err(wait) => {
                let wait = Duration::from_nanos(wait);
                return Ok(Err(Refusal::Rate {
                    retry_after: wait,
                    info: RateInfo::refused(plan, wait),
                }));
            }
        };
        let entry = state.days.entry(tenant_id.to_owned()).or_insert(DayCount {
            day: today,
            count: 0,
            seeded: 0,
        });
        entry.count += u64::from(units);
        Ok(Ok(Grant {
            info: RateInfo::granted(plan, remaining),
            day: today,
            via: Via::Local,
            units,
            period,
        }))
    }

    /// Gives back the units and the quota of a grant whose send was not
    /// accepted.
    pub(crate) fn release(&self, tenant_id: &str, grant: &Grant) {
        let now = self.clock();
        let mut state = self.state();
        if let Some(tat) = state.tats.get_mut(tenant_id) {
            *tat = gcra_give_back(*tat, now, period_nanos(grant.period), grant.units);
        }
        if let Some(entry) = state.days.get_mut(tenant_id)
            && entry.day == grant.day
        {
            entry.count = entry.count.saturating_sub(u64::from(grant.units));
        }
    }

    /// Sends admitted here beyond each tenant's seed: `(tenant, day, sends)`.
    pub(crate) fn admitted_beyond_seed(&self) -> Vec<(String, i64, u64)> {
        self.state()
            .days
            .iter()
            .filter(|(_, c)| c.count > c.seeded)
            .map(|(tenant, c)| (tenant.clone(), c.day, c.count - c.seeded))
            .collect()
    }

    /// Forgets the counts with nothing to hand over (a tenant only refused,
    /// or whose sends were all handed over), so the next outage starts from
    /// the count Redis reports by then, not from this one's.
    pub(crate) fn forget_settled(&self) {
        self.state().days.retain(|_, c| c.count > c.seeded);
    }

    /// Records that `sends` of `tenant`'s day were handed over elsewhere;
    /// a count with nothing left to hand over is forgotten, so the next
    /// outage starts from fresher figures.
    pub(crate) fn handed_over(&self, tenant: &str, day: i64, sends: u64) {
        let mut state = self.state();
        let days = &mut state.days;
        if let Some(entry) = days.get_mut(tenant)
            && entry.day == day
        {
            entry.seeded = (entry.seeded + sends).min(entry.count);
            if entry.seeded == entry.count {
                days.remove(tenant);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::Lane;

    /// A store with nothing sent yet.
    pub(crate) struct NoneSent;

    #[async_trait::async_trait]
    impl SentCounts for NoneSent {
        async fn sent_since(&self, _tenant_id: &str, _since_ms: i64) -> anyhow::Result<u64> {
            Ok(0)
        }
    }

    fn plan(burst: u32) -> Plan {
        Plan {
            name: "p".into(),
            lane: Lane::Fast,
            rate_per_second: 0.01,
            burst,
            daily_quota: 100,
            max_in_flight: 1,
            uploads_per_minute: 60,
            upload_bytes_held: 0,
        }
    }

    #[tokio::test]
    async fn counts_beyond_a_seed_are_handed_over_once_and_settled_ones_forgotten() {
        let limits = LocalLimits::new(Arc::new(NoneSent));
        // "sender" is admitted twice on top of a reported count of 5;
        // "refused" was reported at its quota and only meets refusals.
        for _ in 0..2 {
            assert!(
                limits
                    .admit("sender", &plan(2), 1, |_| Some(5))
                    .await
                    .unwrap()
                    .is_ok()
            );
        }
        assert!(
            limits
                .admit("sender", &plan(2), 1, |_| Some(5))
                .await
                .unwrap()
                .is_err()
        );
        let refusal = limits
            .admit("refused", &plan(2), 1, |_| Some(100))
            .await
            .unwrap();
        assert!(matches!(refusal, Err(Refusal::Quota { .. })), "{refusal:?}");
        assert_eq!(limits.state().days.len(), 2);

        let owed = limits.admitted_beyond_seed();
        assert_eq!(owed.len(), 1);
        let (tenant, day, sends) = owed[0].clone();
        assert_eq!((tenant.as_str(), sends), ("sender", 2));
        limits.handed_over(&tenant, day, sends);
        limits.forget_settled();
        assert!(limits.admitted_beyond_seed().is_empty());
        assert!(limits.state().days.is_empty(), "nothing left to remember");
    }

    #[test]
    fn gcra_takes_several_units_whole_or_not_at_all_and_gives_them_back() {
        // A bucket of 3, one unit every 100 ns, full at t = 1000.
        let (tat, left) = gcra_take(None, 1000, 100, 3, 3).expect("3 fit a full bucket of 3");
        assert_eq!((tat, left), (1300, 0));
        // Empty: one unit is due in 100 ns, four are never due.
        assert_eq!(gcra_take(Some(tat), 1000, 100, 3, 1), Err(100));
        assert!(
            gcra_take(None, 1000, 100, 3, 4).is_ok(),
            "beyond the burst from full only"
        );
        assert!(gcra_take(Some(1100), 1000, 100, 3, 4).is_err());
        // Two of the three given back: two may go now, not three.
        let back = gcra_give_back(tat, 1000, 100, 2);
        assert_eq!(back, 1100);
        assert_eq!(
            gcra_take(Some(back), 1000, 100, 3, 2).map(|(_, left)| left),
            Ok(0)
        );
        assert_eq!(gcra_take(Some(back), 1000, 100, 3, 3), Err(100));
        // A bucket is never fuller than full.
        assert_eq!(gcra_give_back(1100, 5000, 100, 10), 5000);
    }

    #[tokio::test]
    async fn a_refused_send_charges_nothing_and_a_released_one_is_given_back() {
        let limits = LocalLimits::new(Arc::new(NoneSent));
        let burst3 = plan(3);
        // A send of three empties a bucket of 3; two more are refused.
        let grant = limits
            .admit("acme", &burst3, 3, |_| None)
            .await
            .unwrap()
            .expect("three fit a burst of 3");
        assert_eq!(grant.info.remaining, 0);
        let refused = limits.admit("acme", &burst3, 2, |_| None).await.unwrap();
        assert!(matches!(refused, Err(Refusal::Rate { .. })), "{refused:?}");
        // The refusal took nothing: the release of the three gives all
        // three back, and a send of three goes again.
        limits.release("acme", &grant);
        assert_eq!(limits.state().days["acme"].count, 0);
        let again = limits.admit("acme", &burst3, 3, |_| None).await.unwrap();
        assert!(again.is_ok(), "{again:?}");
        // The quota is all or nothing too: 98 more would pass 100.
        let over = limits
            .admit("acme", &plan(200), 98, |_| None)
            .await
            .unwrap();
        assert!(matches!(over, Err(Refusal::Quota { .. })), "{over:?}");
        assert_eq!(limits.state().days["acme"].count, 3);
    }
}
