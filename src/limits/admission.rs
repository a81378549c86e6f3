//! Admission of a tenant's sends: its plan's rate bucket and daily quota,
//! counted in this process ([`LocalLimits`]) or, with several instances,
//! in Redis ([`RedisTenantLimits`], with this instance's share as
//! fallback while Redis is away).

use std::borrow::Cow;
use std::sync::Arc;

use super::redis::RedisLimits;
use super::tenant::{Grant, LocalLimits, Refusal, SentCounts};
use super::tenant_redis::RedisTenantLimits;
use crate::model::{Scope, World};
use crate::tenants::Plan;

/// Admission limits of every tenant, in the configured backend.
pub struct TenantLimits {
    backend: Backend,
    /// Each tenant's admitted sends in the last hour, by minute.
    last_hour: super::last_hour::LastHour,
}

enum Backend {
    Local(LocalLimits),
    Redis(Arc<RedisTenantLimits>),
}

impl TenantLimits {
    /// Limits counted in this process.
    pub fn new(counts: Arc<dyn SentCounts>) -> Self {
        TenantLimits {
            backend: Backend::Local(LocalLimits::new(counts)),
            last_hour: Default::default(),
        }
    }

    /// Limits counted in Redis for every instance that shares its key
    /// prefix, with this instance's share as fallback.
    pub fn with_redis(counts: Arc<dyn SentCounts>, redis: Arc<RedisLimits>) -> Self {
        TenantLimits {
            backend: Backend::Redis(RedisTenantLimits::start(counts, redis)),
            last_hour: Default::default(),
        }
    }

    /// Takes `units` sends (one per recipient) from the bucket and quota
    /// of `scope`'s tenant in its world, all of them or none, or says why
    /// not. The quota is looked at first, so a tenant whose day is used up
    /// does not also drain its bucket; a refusal takes nothing from
    /// either. The test world has a bucket of its own at the plan's rate
    /// and burst, and no daily quota.
    pub async fn admit(
        &self,
        scope: &Scope,
        plan: &Plan,
        units: u32,
    ) -> anyhow::Result<Result<Grant, Refusal>> {
        let bucket = bucket(scope);
        let plan = world_plan(scope.world(), plan);
        let admitted = match &self.backend {
            Backend::Local(local) => local.admit(&bucket, &plan, units, |_| None).await,
            Backend::Redis(redis) => redis.admit(&bucket, &plan, units).await,
        };
        if matches!(admitted, Ok(Ok(_))) && scope.world() == World::Live {
            self.last_hour
                .record(scope.tenant(), crate::model::now_ms(), units);
        }
        admitted
    }

    /// Each tenant's admitted sends in the last hour, by minute.
    pub fn last_hour(&self) -> &super::last_hour::LastHour {
        &self.last_hour
    }

    /// Gives back what a grant took (its units in the bucket and the
    /// day's count) when its send was not accepted after all.
    pub async fn release(&self, scope: &Scope, grant: &Grant) {
        let bucket = bucket(scope);
        match &self.backend {
            Backend::Local(local) => local.release(&bucket, grant),
            Backend::Redis(redis) => redis.release(&bucket, grant).await,
        }
    }
}

/// The name a scope's bucket and day count go by, here and in Redis: the
/// tenant's id for its live world, `{tenant}#test` for its test world (a
/// tenant id cannot hold `#`).
fn bucket(scope: &Scope) -> Cow<'_, str> {
    match scope.world() {
        World::Live => Cow::Borrowed(scope.tenant()),
        World::Test => Cow::Owned(format!("{}#test", scope.tenant())),
    }
}

/// The plan a world's sends are limited by: the test world's has the
/// plan's rate and burst but no daily quota.
fn world_plan(world: World, plan: &Plan) -> Cow<'_, Plan> {
    match world {
        World::Live => Cow::Borrowed(plan),
        World::Test => Cow::Owned(Plan {
            daily_quota: i64::MAX as u64,
            ..plan.clone()
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::tenant::tests::NoneSent;
    use crate::model::Lane;

    #[tokio::test]
    async fn each_world_has_its_own_bucket_and_only_the_live_one_a_quota_and_a_last_hour() {
        let limits = TenantLimits::new(Arc::new(NoneSent));
        let plan = Plan {
            name: "p".into(),
            lane: Lane::Fast,
            rate_per_second: 0.001,
            burst: 5,
            daily_quota: 3,
            max_in_flight: 1,
            uploads_per_minute: 60,
            upload_bytes_held: 0,
        };
        let live = Scope::new("acme", World::Live);
        let test = Scope::new("acme", World::Test);
        let admit = |scope: &Scope, units| {
            let limits = &limits;
            let plan = &plan;
            let scope = scope.clone();
            async move { limits.admit(&scope, plan, units).await.unwrap() }
        };
        // The live world stops at its quota of 3 with burst left over.
        assert!(admit(&live, 3).await.is_ok());
        assert!(matches!(admit(&live, 1).await, Err(Refusal::Quota { .. })));
        // The test world has its whole burst still and no quota: 4 go,
        // and 2 more meet the bucket, not the day.
        let grant = admit(&test, 4).await.unwrap();
        assert!(matches!(admit(&test, 2).await, Err(Refusal::Rate { .. })));
        // What a test send gives back goes to the test world's bucket.
        limits.release(&test, &grant).await;
        assert!(admit(&test, 5).await.is_ok());
        let minutes = limits.last_hour().of("acme", crate::model::now_ms());
        assert_eq!(minutes.iter().sum::<u32>(), 3, "the live sends only");
    }
}
