//! Per-tenant admission: a token bucket per tenant (GCRA, one bucket per
//! tenant with its plan's figures) and a daily quota counted per UTC day.
//!
//! Two backends behind one [`TenantLimits`]: `local` keeps the buckets in
//! this process (governor, one keyed limiter per plan so every tenant of a
//! plan shares its figures); `redis` keeps them in Redis for every instance
//! together ([`super::tenant_redis`]), and falls back to this process's
//! share while Redis is unreachable. Both answer with the same [`Grant`] and
//! [`Refusal`] figures.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::middleware::StateInformationMiddleware;
use governor::state::keyed::DefaultKeyedStateStore;
use governor::{Quota, RateLimiter};

use super::retry_after_secs;
use crate::tenants::Plan;

type PlanLimiter =
    RateLimiter<String, DefaultKeyedStateStore<String>, DefaultClock, StateInformationMiddleware>;

/// A plan's limiter and the figures it was built from, so a plan change is
/// noticed on the next request and the limiter rebuilt.
struct PlanBucket {
    rate_per_second: f64,
    burst: u32,
    limiter: Arc<PlanLimiter>,
}

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

/// A granted send. Call [`TenantLimits::release`] if the send is not
/// accepted after all, so the quota is not charged for it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grant {
    pub info: RateInfo,
    pub(crate) day: i64,
    /// Which counter charged it, so a release goes back to the same one.
    pub(crate) via: Via,
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

/// Buckets and day counts kept in this process.
pub(crate) struct LocalLimits {
    counts: Arc<dyn SentCounts>,
    buckets: RwLock<HashMap<String, PlanBucket>>,
    days: Mutex<HashMap<String, DayCount>>,
}

fn quota_for(plan: &Plan) -> Quota {
    let period = super::period_of(plan.rate_per_second);
    let burst = NonZeroU32::new(plan.burst.max(1)).expect("burst is at least 1");
    Quota::with_period(period)
        .expect("period is positive")
        .allow_burst(burst)
}

impl LocalLimits {
    pub(crate) fn new(counts: Arc<dyn SentCounts>) -> Self {
        LocalLimits {
            counts,
            buckets: RwLock::new(HashMap::new()),
            days: Mutex::new(HashMap::new()),
        }
    }

    fn limiter(&self, plan: &Plan) -> Arc<PlanLimiter> {
        if let Some(bucket) = self.buckets.read().expect("buckets lock").get(&plan.name)
            && bucket.rate_per_second == plan.rate_per_second
            && bucket.burst == plan.burst
        {
            return bucket.limiter.clone();
        }
        let limiter = Arc::new(
            RateLimiter::dashmap(quota_for(plan)).with_middleware::<StateInformationMiddleware>(),
        );
        self.buckets.write().expect("buckets lock").insert(
            plan.name.clone(),
            PlanBucket {
                rate_per_second: plan.rate_per_second,
                burst: plan.burst,
                limiter: limiter.clone(),
            },
        );
        limiter
    }

    /// See [`TenantLimits::admit`]. A tenant's first count of the day
    /// starts from `seed(today)` when it has one, else from the store.
    pub(crate) async fn admit(
        &self,
        tenant_id: &str,
        plan: &Plan,
        seed: impl FnOnce(i64) -> Option<u64>,
    ) -> anyhow::Result<Result<Grant, Refusal>> {
        let now = crate::model::now_ms();
        let today = now.div_euclid(DAY_MS);
        let known = self.days.lock().expect("days lock").get(tenant_id).copied();
        if known.is_none_or(|c| c.day != today) {
            let counted = match seed(today) {
                Some(count) => count,
                None => self.counts.sent_since(tenant_id, today * DAY_MS).await?,
            };
            let mut days = self.days.lock().expect("days lock");
            let fresh = DayCount {
                day: today,
                count: counted,
                seeded: counted,
            };
            let entry = days.entry(tenant_id.to_owned()).or_insert(fresh);
            if entry.day != today {
                *entry = fresh;
            }
        }
        let quota_refusal = || Refusal::Quota {
            retry_after: Duration::from_millis(((today + 1) * DAY_MS - now).max(1) as u64),
            quota: plan.daily_quota,
        };
        let used = self
            .days
            .lock()
            .expect("days lock")
            .get(tenant_id)
            .map_or(0, |c| c.count);
        if used >= plan.daily_quota {
            return Ok(Err(quota_refusal()));
        }

        let limiter = self.limiter(plan);
        let key = tenant_id.to_owned();
        let info = match limiter.check_key(&key) {
            Ok(snapshot) => RateInfo::granted(plan, snapshot.remaining_burst_capacity()),
            Err(not_until) => {
                let wait = not_until.wait_time_from(limiter.clock().now());
                return Ok(Err(Refusal::Rate {
                    retry_after: wait,
                    info: RateInfo::refused(plan, wait),
                }));
            }
        };

        let mut days = self.days.lock().expect("days lock");
        let entry = days.entry(tenant_id.to_owned()).or_insert(DayCount {
            day: today,
            count: 0,
            seeded: 0,
        });
        if entry.day == today && entry.count >= plan.daily_quota {
            // Another request took the last of the quota meanwhile.
            return Ok(Err(quota_refusal()));
        }
        entry.count += 1;
        Ok(Ok(Grant {
            info,
            day: today,
            via: Via::Local,
        }))
    }

    /// Gives back the quota of a grant whose send was not accepted.
    pub(crate) fn release(&self, tenant_id: &str, grant: &Grant) {
        if let Some(entry) = self.days.lock().expect("days lock").get_mut(tenant_id)
            && entry.day == grant.day
        {
            entry.count = entry.count.saturating_sub(1);
        }
    }

    /// Sends admitted here beyond each tenant's seed: `(tenant, day, sends)`.
    pub(crate) fn admitted_beyond_seed(&self) -> Vec<(String, i64, u64)> {
        self.days
            .lock()
            .expect("days lock")
            .iter()
            .filter(|(_, c)| c.count > c.seeded)
            .map(|(tenant, c)| (tenant.clone(), c.day, c.count - c.seeded))
            .collect()
    }

    /// Forgets the counts with nothing to hand over (a tenant only refused,
    /// or whose sends were all handed over), so the next outage starts from
    /// the count Redis reports by then, not from this one's.
    pub(crate) fn forget_settled(&self) {
        self.days
            .lock()
            .expect("days lock")
            .retain(|_, c| c.count > c.seeded);
    }

    /// Records that `sends` of `tenant`'s day were handed over elsewhere;
    /// a count with nothing left to hand over is forgotten, so the next
    /// outage starts from fresher figures.
    pub(crate) fn handed_over(&self, tenant: &str, day: i64, sends: u64) {
        let mut days = self.days.lock().expect("days lock");
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
                    .admit("sender", &plan(2), |_| Some(5))
                    .await
                    .unwrap()
                    .is_ok()
            );
        }
        assert!(
            limits
                .admit("sender", &plan(2), |_| Some(5))
                .await
                .unwrap()
                .is_err()
        );
        let refusal = limits
            .admit("refused", &plan(2), |_| Some(100))
            .await
            .unwrap();
        assert!(matches!(refusal, Err(Refusal::Quota { .. })), "{refusal:?}");
        assert_eq!(limits.days.lock().unwrap().len(), 2);

        let owed = limits.admitted_beyond_seed();
        assert_eq!(owed.len(), 1);
        let (tenant, day, sends) = owed[0].clone();
        assert_eq!((tenant.as_str(), sends), ("sender", 2));
        limits.handed_over(&tenant, day, sends);
        limits.forget_settled();
        assert!(limits.admitted_beyond_seed().is_empty());
        assert!(
            limits.days.lock().unwrap().is_empty(),
            "nothing left to remember"
        );
    }
}
