//! Per-tenant admission: a token bucket per tenant (governor's GCRA, one
//! keyed limiter per plan so every tenant of a plan shares its figures) and
//! a daily quota counted per UTC day.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::middleware::StateInformationMiddleware;
use governor::state::keyed::DefaultKeyedStateStore;
use governor::{Quota, RateLimiter};

use super::retry_after_secs;
use crate::store::Db;
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
    day: i64,
}

/// Sends counted today for one tenant.
#[derive(Debug, Clone, Copy)]
struct DayCount {
    day: i64,
    count: u64,
}

const DAY_MS: i64 = 86_400_000;

pub struct TenantLimits {
    db: Db,
    buckets: RwLock<HashMap<String, PlanBucket>>,
    days: Mutex<HashMap<String, DayCount>>,
}

fn quota_for(plan: &Plan) -> Quota {
    let period = Duration::from_secs_f64(1.0 / plan.rate_per_second).max(Duration::from_nanos(1));
    let burst = NonZeroU32::new(plan.burst.max(1)).expect("burst is at least 1");
    Quota::with_period(period)
        .expect("period is positive")
        .allow_burst(burst)
}

impl TenantLimits {
    pub fn new(db: Db) -> Self {
        TenantLimits {
            db,
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

    /// Takes one send from `tenant_id`'s bucket and quota, or says why not.
    /// The quota is looked at first, so a tenant whose day is used up does
    /// not also drain its bucket; a refusal takes nothing from either.
    pub async fn admit(
        &self,
        tenant_id: &str,
        plan: &Plan,
    ) -> anyhow::Result<Result<Grant, Refusal>> {
        let now = crate::model::now_ms();
        let today = now.div_euclid(DAY_MS);
        let known = self.days.lock().expect("days lock").get(tenant_id).copied();
        if known.is_none_or(|c| c.day != today) {
            let counted =
                crate::store::messages::count_since(&self.db.read, tenant_id, today * DAY_MS)
                    .await?;
            let mut days = self.days.lock().expect("days lock");
            let entry = days.entry(tenant_id.to_owned()).or_insert(DayCount {
                day: today,
                count: counted,
            });
            if entry.day != today {
                *entry = DayCount {
                    day: today,
                    count: counted,
                };
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
            Ok(snapshot) => {
                let remaining = snapshot.remaining_burst_capacity();
                let missing = plan.burst.saturating_sub(remaining) as f64;
                RateInfo {
                    limit: plan.burst,
                    remaining,
                    reset_secs: (missing / plan.rate_per_second).ceil() as u64,
                }
            }
            Err(not_until) => {
                let wait = not_until.wait_time_from(limiter.clock().now());
                let info = RateInfo {
                    limit: plan.burst,
                    remaining: 0,
                    reset_secs: retry_after_secs(wait),
                };
                return Ok(Err(Refusal::Rate {
                    retry_after: wait,
                    info,
                }));
            }
        };

        let mut days = self.days.lock().expect("days lock");
        let entry = days.entry(tenant_id.to_owned()).or_insert(DayCount {
            day: today,
            count: 0,
        });
        if entry.day == today && entry.count >= plan.daily_quota {
            // Another request took the last of the quota meanwhile.
            return Ok(Err(quota_refusal()));
        }
        entry.count += 1;
        Ok(Ok(Grant { info, day: today }))
    }

    /// Gives back the quota of a grant whose send was not accepted.
    pub fn release(&self, tenant_id: &str, grant: &Grant) {
        if let Some(entry) = self.days.lock().expect("days lock").get_mut(tenant_id)
            && entry.day == grant.day
        {
            entry.count = entry.count.saturating_sub(1);
        }
    }
}
