//! A circuit breaker per provider: after a run of failed calls (5xx,
//! timeouts, refused connections) the provider's gate hands out no token for
//! a short interval, so a dead provider is not called by every worker in
//! turn. Each time the run goes on past a reopening, the interval doubles,
//! up to a ceiling; one call that reaches the provider and gets an answer it
//! meant (sent, or a permanent refusal of that message) closes the breaker
//! and starts over.
//!
//! The breaker only decides; the caller applies the interval through
//! [`super::gate::ProviderGate::pause_for`], the same pause a 429's
//! Retry-After makes. When the interval ends, one call goes (the trial) and
//! the gate goes on at its rate, without a burst; one more failure opens it
//! again at once (the run is still past the threshold), for twice as long.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::config::MAX_PROVIDER_PAUSE;

/// How a breaker opens; see `providers.*.breaker_*` in the configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerSettings {
    /// Failed calls in a row that open the breaker; 0 turns it off.
    pub failures: u32,
    /// How long it stays open the first time.
    pub open_for: Duration,
    /// The longest it stays open.
    pub max_open_for: Duration,
}

#[derive(Debug)]
pub struct CircuitBreaker {
    settings: BreakerSettings,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Failed calls since the last call that worked.
    failures: u32,
    /// Times opened since the last call that worked.
    opened: u32,
    /// While open: when it closes. Failures of calls made before it opened
    /// land meanwhile and do not open it again.
    open_until: Option<Instant>,
}

/// What a recorded outcome did to the breaker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Change {
    None,
    /// Opened (again) for this long, after this many failures in a row.
    Opened {
        open_for: Duration,
        failures: u32,
    },
    /// A call worked after the breaker had opened this many times.
    Closed {
        opened: u32,
    },
}

impl BreakerSettings {
    /// The breaker a provider's settings ask for. Configuration checking
    /// refuses intervals above [`MAX_PROVIDER_PAUSE`]; they are cut to it
    /// here as well, so no setting can push the end of an interval past what
    /// the clock holds.
    pub fn of(settings: &crate::config::ProviderSettings) -> Self {
        let open_for =
            Duration::from_millis(settings.breaker_open_ms.max(1)).min(MAX_PROVIDER_PAUSE);
        let max_open_for =
            Duration::from_secs(settings.breaker_max_open_secs).clamp(open_for, MAX_PROVIDER_PAUSE);
        BreakerSettings {
            failures: settings.breaker_failures,
            open_for,
            max_open_for,
        }
    }
}

impl CircuitBreaker {
    pub fn new(settings: BreakerSettings) -> Self {
        CircuitBreaker {
            settings,
            state: Mutex::new(State::default()),
        }
    }

    /// Failed calls in a row now, and whether the breaker is open.
    pub fn status(&self) -> (u32, bool) {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let open = state.open_until.is_some_and(|until| until > Instant::now());
        (state.failures, open)
    }

    /// A call failed in a way that says the provider is unwell.
    pub fn failed(&self) -> Change {
        self.failed_at(Instant::now())
    }

    fn failed_at(&self, now: Instant) -> Change {
        if self.settings.failures == 0 {
            return Change::None;
        }
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        state.failures = state.failures.saturating_add(1);
        if state.failures < self.settings.failures
            || state.open_until.is_some_and(|until| until > now)
        {
            return Change::None;
        }
        let doublings = state.opened.min(20);
        state.opened = state.opened.saturating_add(1);
        let open_for = self
            .settings
            .open_for
            .saturating_mul(1 << doublings)
            .min(self.settings.max_open_for);
        state.open_until = Some(now + open_for);
        Change::Opened {
            open_for,
            failures: state.failures,
        }
    }

    /// A call got an answer the provider meant.
    pub fn succeeded(&self) -> Change {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let opened = state.opened;
        *state = State::default();
        if opened > 0 {
            Change::Closed { opened }
        } else {
            Change::None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker() -> CircuitBreaker {
        CircuitBreaker::new(BreakerSettings {
            failures: 3,
            open_for: Duration::from_secs(1),
            max_open_for: Duration::from_secs(5),
        })
    }

    #[test]
    fn opens_after_the_run_and_doubles_each_time_the_run_goes_on_up_to_the_ceiling() {
        let breaker = breaker();
        let start = Instant::now();
        let at = |secs: f64| start + Duration::from_secs_f64(secs);
        assert_eq!(breaker.failed_at(at(0.0)), Change::None);
        assert_eq!(breaker.failed_at(at(0.0)), Change::None);
        let opened = |secs, failures| Change::Opened {
            open_for: Duration::from_secs(secs),
            failures,
        };
        assert_eq!(breaker.failed_at(at(0.1)), opened(1, 3));
        // Calls made before it opened fail meanwhile: no change.
        assert_eq!(breaker.failed_at(at(0.5)), Change::None);
        assert_eq!(breaker.failed_at(at(1.0)), Change::None);
        // The trial after the interval fails: open again at once, longer.
        assert_eq!(breaker.failed_at(at(1.2)), opened(2, 6));
        assert_eq!(breaker.failed_at(at(3.3)), opened(4, 7));
        assert_eq!(breaker.failed_at(at(7.4)), opened(5, 8));
        assert_eq!(breaker.failed_at(at(12.5)), opened(5, 9));
    }

    #[test]
    fn a_call_that_works_closes_it_and_starts_the_count_over() {
        let breaker = breaker();
        for _ in 0..3 {
            breaker.failed();
        }
        assert!(breaker.state.lock().unwrap().open_until.is_some());
        assert_eq!(breaker.succeeded(), Change::Closed { opened: 1 });
        assert_eq!(breaker.succeeded(), Change::None);
        assert_eq!(breaker.failed(), Change::None);
        assert_eq!(breaker.failed(), Change::None);
        assert!(matches!(
            breaker.failed(),
            Change::Opened { open_for, .. } if open_for == Duration::from_secs(1)
        ));
    }

    #[test]
    fn failures_short_of_the_run_never_open_it() {
        let breaker = breaker();
        for _ in 0..100 {
            assert_eq!(breaker.failed(), Change::None);
            assert_eq!(breaker.failed(), Change::None);
            assert_eq!(breaker.succeeded(), Change::None);
        }
    }

    #[test]
    fn zero_failures_turns_it_off() {
        let breaker = CircuitBreaker::new(BreakerSettings {
            failures: 0,
            open_for: Duration::from_secs(1),
            max_open_for: Duration::from_secs(5),
        });
        for _ in 0..50 {
            assert_eq!(breaker.failed(), Change::None);
        }
    }
}
