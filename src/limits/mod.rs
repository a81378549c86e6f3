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
pub mod health;
pub mod last_hour;
pub mod reads;
pub mod redis;
pub mod tenant;
mod tenant_redis;
pub mod uploads;
pub mod writes;

#[cfg(test)]
mod redis_tests;

use std::time::Duration;

/// The longest emission interval a rate is turned into: a rate below one
/// per day (a plan or provider figure from before the bounds were checked,
/// say) is paced at one per day rather than overflowing a `Duration`.
pub const MAX_PERIOD: Duration = Duration::from_secs(86_400);

/// The time between two sends at `rate_per_second`: at least a
/// nanosecond, at most [`MAX_PERIOD`], and never a panic, whatever the
/// figure (zero, negative, NaN or tiny rates give [`MAX_PERIOD`]).
pub fn period_of(rate_per_second: f64) -> Duration {
    Duration::try_from_secs_f64(1.0 / rate_per_second)
        .unwrap_or(MAX_PERIOD)
        .clamp(Duration::from_nanos(1), MAX_PERIOD)
}

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

    #[test]
    fn a_period_comes_from_any_rate_without_a_panic() {
        assert_eq!(period_of(4.0), Duration::from_millis(250));
        assert_eq!(period_of(1e12), Duration::from_nanos(1));
        for rate in [1e-20, 0.0, -1.0, f64::NAN] {
            assert_eq!(period_of(rate), MAX_PERIOD, "{rate}");
        }
        assert_eq!(period_of(f64::INFINITY), Duration::from_nanos(1));
    }
}
