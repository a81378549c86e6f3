//! Admission limits on the accept path: per-tenant rate and daily quota
//! ([`admission`], [`tenant`]) and per-lane backpressure ([`backpressure`]); and the
//! provider gates that pace delivery ([`gate`]). Each refusal carries a
//! Retry-After derived from real state, never a constant.
//!
//! Tenant limits and provider gates count in this process by default, or in
//! Redis for every instance together ([`redis`], `limits.backend = "redis"`).

pub mod admission;
pub mod backpressure;
pub mod breaker;
pub mod gate;
pub mod redis;
pub mod tenant;
mod tenant_redis;

#[cfg(test)]
mod redis_tests;

use std::time::Duration;

/// Whole seconds for a `Retry-After` header: rounded up, at least 1.
pub fn retry_after_secs(wait: Duration) -> u64 {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    secs.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_and_is_never_zero() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::from_secs(3)), 3);
    }
}
