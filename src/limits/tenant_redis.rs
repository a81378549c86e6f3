//! Tenant limits counted in Redis (`limits.backend = "redis"`): every
//! instance sharing the key prefix draws on one bucket and one daily counter
//! per tenant, so a tenant's plan holds for the fleet, not per instance.
//!
//! An admission is one script run (see [`super::redis`]): the day's quota,
//! then the plan's GCRA, both charged or neither, for all of a send's
//! recipients at once; a release gives both back in one run. The first admission of a
//! tenant on a day finds no counter and creates it from the store's count of
//! the day's messages (`SET NX`, so the first instance wins), which keeps a
//! tenant's day when the backend is switched from `local` to `redis`.
//!
//! While Redis is unreachable, admission runs in this process on the plan
//! divided by the live instances (rate and burst; burst at least 1), so the
//! fleet keeps the plan's rate. The quota is not divided: each instance
//! counts on from the day's count Redis last reported for the tenant (or
//! from the store, if it never did) and refuses once that reaches the quota.
//! Sends it admitted meanwhile are added to the Redis counter as soon as
//! Redis answers again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::watch;

use super::redis::{AdmitReply, RedisLimits, period_micros};
use super::tenant::{DAY_MS, Grant, LocalLimits, RateInfo, Refusal, SentCounts, Via};
use crate::tenants::Plan;

pub(crate) struct RedisTenantLimits {
    counts: Arc<dyn SentCounts>,
    redis: Arc<RedisLimits>,
    /// This instance's share while Redis is unreachable.
    fallback: LocalLimits,
    /// The day's count Redis last reported for each tenant, `(day, used)`:
    /// where the local count starts if Redis goes away.
    reported: Mutex<HashMap<String, (i64, u64)>>,
}

impl RedisTenantLimits {
    /// Builds the limits and a task that hands sends counted locally during
    /// an outage over to Redis when it comes back.
    pub(crate) fn start(counts: Arc<dyn SentCounts>, redis: Arc<RedisLimits>) -> Arc<Self> {
        let recoveries = redis.recoveries();
        let limits = Arc::new(RedisTenantLimits {
            fallback: LocalLimits::new(counts.clone()),
            counts,
            redis,
            reported: Mutex::new(HashMap::new()),
        });
        tokio::spawn(hand_over_after_outages(Arc::downgrade(&limits), recoveries));
        limits
    }

    pub(crate) async fn admit(
        &self,
        tenant_id: &str,
        plan: &Plan,
        units: u32,
    ) -> anyhow::Result<Result<Grant, Refusal>> {
        let units = units.max(1);
        if self.redis.is_up()
            && let Some(decision) = self.admit_in_redis(tenant_id, plan, units).await?
        {
            return Ok(decision);
        }
        let share = local_share(plan, self.redis.live_instances());
        let reported = self
            .reported
            .lock()
            .expect("reported lock")
            .get(tenant_id)
            .copied();
        self.fallback
            .admit(tenant_id, &share, units, |today| {
                reported
                    .filter(|&(day, _)| day == today)
                    .map(|(_, used)| used)
            })
            .await
    }

    /// The admission in Redis; `None` when Redis did not answer.
    async fn admit_in_redis(
        &self,
        tenant_id: &str,
        plan: &Plan,
        units: u32,
    ) -> anyhow::Result<Option<Result<Grant, Refusal>>> {
        let period = period_micros(plan.rate_per_second);
        let asked = super::redis::Admission {
            period_us: period,
            burst: plan.burst,
            daily_quota: plan.daily_quota,
            units,
        };
        let mut day = crate::model::now_ms().div_euclid(DAY_MS);
        // At most: seed the counter, learn the server's day, seed that one.
        for _ in 0..4 {
            let Ok(reply) = self.redis.admit(tenant_id, &asked, day).await else {
                return Ok(None);
            };
            let decision = match reply {
                AdmitReply::Granted { remaining, used } => {
                    self.remember(tenant_id, day, used);
                    Ok(Grant {
                        info: RateInfo::granted(plan, remaining),
                        day,
                        via: Via::Redis,
                        units,
                        period: std::time::Duration::from_micros(period),
                    })
                }
                AdmitReply::OverRate { wait, used } => {
                    self.remember(tenant_id, day, used);
                    Err(Refusal::Rate {
                        retry_after: wait,
                        info: RateInfo::refused(plan, wait),
                    })
                }
                AdmitReply::OverQuota {
                    until_midnight,
                    used,
                } => {
                    self.remember(tenant_id, day, used);
                    Err(Refusal::Quota {
                        retry_after: until_midnight,
                        quota: plan.daily_quota,
                    })
                }
                AdmitReply::Unseeded => {
                    let counted = self.counts.sent_since(tenant_id, day * DAY_MS).await?;
                    if self
                        .redis
                        .seed_quota(tenant_id, day, counted)
                        .await
                        .is_err()
                    {
                        return Ok(None);
                    }
                    continue;
                }
                AdmitReply::OtherDay { day: server_day } => {
                    day = server_day;
                    continue;
                }
            };
            return Ok(Some(decision));
        }
        anyhow::bail!("Redis kept dropping the daily counter of tenant {tenant_id:?}")
    }

    fn remember(&self, tenant_id: &str, day: i64, used: u64) {
        let mut reported = self.reported.lock().expect("reported lock");
        match reported.get_mut(tenant_id) {
            Some(entry) => *entry = (day, used),
            None => {
                reported.insert(tenant_id.to_owned(), (day, used));
            }
        }
    }

    /// Gives the send back to the bucket and counter that charged it. A
    /// Redis grant released while Redis is unreachable stays charged (the
    /// send's units of the day's quota and of the bucket, never more per
    /// request).
    pub(crate) async fn release(&self, tenant_id: &str, grant: &Grant) {
        match grant.via {
            Via::Local => self.fallback.release(tenant_id, grant),
            Via::Redis => {
                if self.redis.is_up() {
                    let _ = self.redis.release(tenant_id, grant).await;
                }
            }
        }
    }

    /// Adds what this instance admitted on its own to the Redis counters.
    /// Stops at the first failure; the rest waits for the next recovery.
    async fn hand_over(&self) {
        for (tenant, day, sends) in self.fallback.admitted_beyond_seed() {
            if self.redis.add_to_quota(&tenant, day, sends).await.is_err() {
                return;
            }
            self.fallback.handed_over(&tenant, day, sends);
        }
        self.fallback.forget_settled();
    }
}

async fn hand_over_after_outages(
    limits: Weak<RedisTenantLimits>,
    mut recoveries: watch::Receiver<u64>,
) {
    while recoveries.changed().await.is_ok() {
        let Some(limits) = limits.upgrade() else {
            return;
        };
        limits.hand_over().await;
    }
}

/// `plan` as one of `instances` equal shares: rate and burst divided, the
/// burst at least 1. The daily quota is not divided (see the module
/// documentation).
fn local_share(plan: &Plan, instances: u32) -> Plan {
    let instances = instances.max(1);
    let mut share = plan.clone();
    share.rate_per_second = plan.rate_per_second / f64::from(instances);
    share.burst = (plan.burst / instances).max(1);
    share
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Lane;

    #[test]
    fn the_local_share_divides_rate_and_burst_and_keeps_a_burst_of_one() {
        let plan = Plan {
            name: "p".into(),
            lane: Lane::Fast,
            rate_per_second: 10.0,
            burst: 5,
            daily_quota: 100,
            max_in_flight: 1,
            uploads_per_minute: 60,
            upload_bytes_held: 0,
        };
        let half = local_share(&plan, 2);
        assert_eq!((half.rate_per_second, half.burst), (5.0, 2));
        assert_eq!(half.daily_quota, 100);
        let tiny = local_share(&plan, 8);
        assert_eq!((tiny.rate_per_second, tiny.burst), (1.25, 1));
        assert_eq!(local_share(&plan, 1), plan);
    }
}
