//! A tenant's changes other than sends (webhook and suppression changes,
//! cancels) share one token bucket per tenant:
//! `limits.tenant_writes_per_second` with bursts of
//! `limits.tenant_writes_burst`. They take the store's write turn that
//! every accept waits for, so a tenant cannot make them without bound.
//!
//! The bucket is counted in this process by default. With
//! `limits.backend = "redis"` it is one bucket for every instance
//! (`{prefix}:tenant:{id}:writes`, the same GCRA as the other Redis
//! limits), so N instances do not give a tenant N buckets. While Redis is
//! unreachable, each instance takes from its share: rate and burst divided
//! by the live instances last counted (the burst at least one), in a bucket
//! made fresh for each outage.

use std::num::NonZeroU32;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::state::keyed::DefaultKeyedStateStore;
use governor::{Quota, RateLimiter};

use super::redis::{RedisLimits, period_micros};

type Keyed = RateLimiter<String, DefaultKeyedStateStore<String>, DefaultClock>;

/// The per-tenant bucket of changes.
pub struct TenantWrites {
    rate_per_second: f64,
    burst: u32,
    /// This process's buckets: all of it without Redis, the share of the
    /// current outage with it.
    local: Mutex<Local>,
    redis: Option<Arc<RedisLimits>>,
    clock: DefaultClock,
}

struct Local {
    /// The Redis outage this share was made for (0 without Redis).
    outage: u64,
    limiter: Arc<Keyed>,
}

impl TenantWrites {
    /// Buckets counted in this process only.
    pub fn new(rate_per_second: f64, burst: u32) -> Self {
        TenantWrites {
            rate_per_second,
            burst,
            local: Mutex::new(Local {
                outage: 0,
                limiter: Arc::new(keyed(rate_per_second, burst)),
            }),
            redis: None,
            clock: DefaultClock::default(),
        }
    }

    /// Buckets counted in Redis for every instance together.
    pub fn shared(rate_per_second: f64, burst: u32, redis: Arc<RedisLimits>) -> Self {
        let mut writes = Self::new(rate_per_second, burst);
        writes
            .local
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .outage = u64::MAX;
        writes.redis = Some(redis);
        writes
    }

    /// Takes one change of `tenant_id`, or how long to wait for one.
    pub async fn take(&self, tenant_id: &str) -> Result<(), Duration> {
        if let Some(redis) = self.redis.as_ref().filter(|redis| redis.is_up()) {
            let period = period_micros(self.rate_per_second);
            match redis.take_tenant_write(tenant_id, period, self.burst).await {
                Ok(None) => return Ok(()),
                Ok(Some(wait)) => return Err(wait),
                // Redis is marked down now: this change takes from the share.
                Err(_) => {}
            }
        }
        self.limiter()
            .check_key(&tenant_id.to_owned())
            .map_err(|not_until| not_until.wait_time_from(self.clock.now()))
    }

    /// The bucket to take from in this process: the whole one without
    /// Redis, or this instance's share for the current outage.
    fn limiter(&self) -> Arc<Keyed> {
        let mut local = self.local.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(redis) = &self.redis {
            let outage = redis.outages();
            if local.outage != outage {
                let instances = redis.live_instances().max(1);
                *local = Local {
                    outage,
                    limiter: Arc::new(keyed(
                        self.rate_per_second / f64::from(instances),
                        (self.burst / instances).max(1),
                    )),
                };
            }
        }
        Arc::clone(&local.limiter)
    }
}

fn keyed(rate_per_second: f64, burst: u32) -> Keyed {
    let quota = Quota::with_period(super::period_of(rate_per_second))
        .expect("a period is at least a nanosecond")
        .allow_burst(NonZeroU32::new(burst.max(1)).expect("at least 1"));
    RateLimiter::keyed(quota)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_tenant_has_its_burst_then_waits_and_others_are_not_charged() {
        let writes = TenantWrites::new(1.0, 3);
        for _ in 0..3 {
            writes.take("a").await.unwrap();
        }
        let wait = writes.take("a").await.unwrap_err();
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_secs(1),
            "{wait:?}"
        );
        writes.take("b").await.unwrap();
    }
}
