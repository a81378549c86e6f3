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
        }
    }

    /// Limits counted in Redis for every instance that shares its key
    /// prefix, with this instance's share as fallback.
    pub fn with_redis(counts: Arc<dyn SentCounts>, redis: Arc<RedisLimits>) -> Self {
        TenantLimits {
            backend: Backend::Redis(RedisTenantLimits::start(counts, redis)),
        }
    }

    /// Takes one send from `tenant_id`'s bucket and quota, or says why not.
    /// The quota is looked at first, so a tenant whose day is used up does
    /// not also drain its bucket; a refusal takes nothing from either.
    pub async fn admit(
        &self,
        tenant_id: &str,
        plan: &Plan,
    ) -> anyhow::Result<Result<Grant, Refusal>> {
        match &self.backend {
            Backend::Local(local) => local.admit(tenant_id, plan, |_| None).await,
            Backend::Redis(redis) => redis.admit(tenant_id, plan).await,
        }
    }

    /// Gives back the quota of a grant whose send was not accepted.
    pub async fn release(&self, tenant_id: &str, grant: &Grant) {
        match &self.backend {
            Backend::Local(local) => local.release(tenant_id, grant),
            Backend::Redis(redis) => redis.release(tenant_id, grant).await,
        }
    }
}
