//! A tenant's uploads: a bucket per tenant and world of its plan's
//! `uploads_per_minute` files, refilling over a minute (one file every
//! `60 / uploads_per_minute` seconds), apart from the bucket of its other
//! changes ([`super::writes`]) so that a plan can give a tenant more or
//! fewer uploads than changes. Live and test keys take from buckets of
//! their own: a test key's uploads never use up the live world's.
//!
//! The bucket is a GCRA, counted in this process by default. With
//! `limits.backend = "redis"` it is one bucket for every instance
//! (`{prefix}:tenant:{id}:uploads:{world}`, the script the other Redis
//! limits run), so N instances do not give a tenant N buckets. While Redis
//! is unreachable, each instance takes from its share: the rate and the
//! burst divided by the live instances last counted (the burst at least
//! one), in buckets made fresh for each outage.
//!
//! A bucket's figures come from the tenant's plan at each take, so a plan
//! change applies from the next upload on; the bucket keeps what it was
//! owed, so a change of plan never hands out a fresh burst.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::redis::RedisLimits;
use super::tenant::gcra_take;
use crate::model::Scope;

/// Nanoseconds in a minute.
const MINUTE_NS: u64 = 60_000_000_000;

/// The per-tenant, per-world buckets of uploads.
pub struct TenantUploads {
    redis: Option<Arc<RedisLimits>>,
    /// The buckets' clock: nanoseconds since this instant.
    epoch: Instant,
    local: Mutex<Local>,
}

#[derive(Default)]
struct Local {
    /// The Redis outage these buckets were made for (0 without Redis).
    outage: u64,
    /// Each bucket's theoretical arrival time (ns since `epoch`), by
    /// `tenant:world`.
    tats: HashMap<String, u64>,
}

impl TenantUploads {
    /// Buckets counted in this process only.
    pub fn new() -> Self {
        TenantUploads {
            redis: None,
            epoch: Instant::now(),
            local: Mutex::new(Local::default()),
        }
    }

    /// Buckets counted in Redis for every instance together.
    pub fn shared(redis: Arc<RedisLimits>) -> Self {
        let uploads = TenantUploads {
            redis: Some(redis),
            ..Self::new()
        };
        uploads
            .local
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .outage = u64::MAX;
        uploads
    }

    /// Takes one upload of `scope` from a bucket of `per_minute`, or how
    /// long until one is due.
    pub async fn take(&self, scope: &Scope, per_minute: u32) -> Result<(), Duration> {
        let per_minute = per_minute.max(1);
        let world = if scope.is_test() { "test" } else { "live" };
        if let Some(redis) = self.redis.as_ref().filter(|redis| redis.is_up()) {
            let period_us = (MINUTE_NS / 1_000 / u64::from(per_minute)).max(1);
            match redis
                .take_tenant_upload(scope.tenant(), world, period_us, per_minute)
                .await
            {
                Ok(None) => return Ok(()),
                Ok(Some(wait)) => return Err(wait),
                // Redis is marked down now: this upload takes from the share.
                Err(_) => {}
            }
        }
        self.take_here(format!("{}:{world}", scope.tenant()), per_minute)
    }

    /// Takes from this process's bucket: the whole one without Redis, this
    /// instance's share of the current outage with it.
    fn take_here(&self, bucket: String, per_minute: u32) -> Result<(), Duration> {
        let now = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let mut local = self.local.lock().unwrap_or_else(PoisonError::into_inner);
        let mut instances = 1;
        if let Some(redis) = &self.redis {
            instances = redis.live_instances().max(1);
            let outage = redis.outages();
            if local.outage != outage {
                *local = Local {
                    outage,
                    tats: HashMap::new(),
                };
            }
        }
        // A share of 1/N: the period N times as long, the burst N times
        // smaller (at least one).
        let period = (MINUTE_NS / u64::from(per_minute)).saturating_mul(u64::from(instances));
        let burst = (per_minute / instances).max(1);
        match gcra_take(local.tats.get(&bucket).copied(), now, period, burst, 1) {
            Ok((tat, _left)) => {
                local.tats.insert(bucket, tat);
                Ok(())
            }
            Err(wait_ns) => Err(Duration::from_nanos(wait_ns)),
        }
    }
}

impl Default for TenantUploads {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::World;

    #[tokio::test]
    async fn a_world_has_its_plans_uploads_a_minute_apart_from_the_other_world() {
        let uploads = TenantUploads::new();
        let live = Scope::new("a", World::Live);
        for _ in 0..3 {
            uploads.take(&live, 3).await.unwrap();
        }
        let wait = uploads.take(&live, 3).await.unwrap_err();
        assert!(
            wait > Duration::from_secs(19) && wait <= Duration::from_secs(20),
            "one upload comes back every 20 s at 3 a minute: {wait:?}"
        );
        uploads
            .take(&Scope::new("a", World::Test), 3)
            .await
            .unwrap();
        uploads
            .take(&Scope::new("b", World::Live), 3)
            .await
            .unwrap();
    }
}
