//! A tenant's changes other than sends (webhook and suppression changes,
//! cancels) share one token bucket per tenant, in this process:
//! `limits.tenant_writes_per_second` with bursts of
//! `limits.tenant_writes_burst`. They take the store's write turn that
//! every accept waits for, so a tenant cannot make them without bound.

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::state::keyed::DefaultKeyedStateStore;
use governor::{Quota, RateLimiter};

type Keyed = RateLimiter<String, DefaultKeyedStateStore<String>, DefaultClock>;

/// The per-tenant bucket of changes.
pub struct TenantWrites {
    limiter: Keyed,
    clock: DefaultClock,
}

impl TenantWrites {
    pub fn new(rate_per_second: f64, burst: u32) -> Self {
        let quota = Quota::with_period(super::period_of(rate_per_second))
            .expect("a period is at least a nanosecond")
            .allow_burst(NonZeroU32::new(burst.max(1)).expect("at least 1"));
        TenantWrites {
            limiter: RateLimiter::keyed(quota),
            clock: DefaultClock::default(),
        }
    }

    /// Takes one change of `tenant_id`, or how long to wait for one.
    pub fn take(&self, tenant_id: &str) -> Result<(), Duration> {
        self.limiter
            .check_key(&tenant_id.to_owned())
            .map_err(|not_until| not_until.wait_time_from(self.clock.now()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_has_its_burst_then_waits_and_others_are_not_charged() {
        let writes = TenantWrites::new(1.0, 3);
        for _ in 0..3 {
            writes.take("a").unwrap();
        }
        let wait = writes.take("a").unwrap_err();
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_secs(1),
            "{wait:?}"
        );
        writes.take("b").unwrap();
    }
}
