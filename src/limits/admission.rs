//! Admission of a tenant's sends: its plan's rate bucket and daily quota,
//! counted in this process ([`LocalLimits`]) or, with several instances,
//! in Redis ([`RedisTenantLimits`], with this instance's share as
//! fallback while Redis is away).

use std::sync::Arc;

use super::redis::RedisLimits;
use super::tenant::{Grant, LocalLimits, Refusal, SentCounts};
use super::tenant_redis::RedisTenantLimits;
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

    /// Takes `units` sends (one per recipient) from `tenant_id`'s bucket
    /// and quota, all of them or none, or says why not. The quota is
    /// looked at first, so a tenant whose day is used up does not also
    /// drain its bucket; a refusal takes nothing from either.
    pub async fn admit(
        &self,
        tenant_id: &str,
        plan: &Plan,
        units: u32,
    ) -> anyhow::Result<Result<Grant, Refusal>> {
        let admitted = match &self.backend {
            Backend::Local(local) => local.admit(tenant_id, plan, units, |_| None).await,
            Backend::Redis(redis) => redis.admit(tenant_id, plan, units).await,
        };
        // A test key's bucket is `{tenant}#test`: not the tenant's sends.
        if matches!(admitted, Ok(Ok(_))) && !tenant_id.ends_with("#test") {
            self.last_hour
                .record(tenant_id, crate::model::now_ms(), units);
        }
        admitted
    }

    /// Each tenant's admitted sends in the last hour, by minute.
    pub fn last_hour(&self) -> &super::last_hour::LastHour {
        &self.last_hour
    }

    /// Gives back what a grant took (its units in the bucket and the
    /// day's count) when its send was not accepted after all.
    pub async fn release(&self, tenant_id: &str, grant: &Grant) {
        match &self.backend {
            Backend::Local(local) => local.release(tenant_id, grant),
            Backend::Redis(redis) => redis.release(tenant_id, grant).await,
        }
    }
}
