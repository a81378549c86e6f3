//! How healthy one provider of a pool looks from its recent calls, and the
//! share of its weight that routing gives it (see [`super::gate`]).
//!
//! Outcomes are counted in one-second slots over the last `window_secs`.
//! Once the window holds at least `min_calls` outcomes and more than
//! `max_failure_rate` of them failed, or the calls that worked took longer
//! than `max_latency_ms` on average, the provider is marked down: its share
//! is 0 for `down_secs`, then grows in a straight line from a tenth of its
//! weight to all of it over `recover_secs`. Marking down empties the
//! window, so the outcomes that marked it down are not counted again while
//! it recovers; enough failures among its recovering calls mark it down
//! once more and start the wait over. That gap between losing a share at
//! once and winning it back slowly is the hysteresis that keeps routing
//! from flapping between two providers.
//!
//! Time is the gate's timeline (nanoseconds since the gate was built), so
//! the gate's simulated-clock tests drive health too.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::config::ProviderHealthSettings;

/// The share a recovering provider starts from.
const FIRST_SHARE: f64 = 0.1;

/// A provider's health as the admin view and metrics report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Healthy,
    /// Marked down: no share until its wait ends.
    Down,
    /// Winning its share back.
    Recovering,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Healthy => "healthy",
            State::Down => "down",
            State::Recovering => "recovering",
        }
    }
}

/// What the window holds right now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Snapshot {
    pub state: State,
    /// The part of its weight routing gives it now, 0 to 1.
    pub factor: f64,
    /// Outcomes in the window, those that failed, and the mean time of
    /// the calls that worked.
    pub calls: u64,
    pub failures: u64,
    pub mean_latency_ms: Option<f64>,
    /// Times marked down since the process started.
    pub downs: u64,
}

#[derive(Debug)]
pub struct Health {
    rule: ProviderHealthSettings,
    state: Mutex<Window>,
}

#[derive(Debug, Default)]
struct Window {
    /// One slot per second of the window: (second, calls, failures,
    /// latency of the calls that worked in ms, calls that worked).
    slots: Vec<Slot>,
    /// When it was last marked down.
    down_at: Option<Duration>,
    /// When its last pause (a 429's `Retry-After`, an open breaker) ends:
    /// from then it wins its weight back on the same line as after a
    /// spell marked down.
    pause_ends: Option<Duration>,
    downs: u64,
}

impl Window {
    /// The slot of `second` in a window of `slots` seconds, emptied when
    /// it last held an older second.
    fn slot(&mut self, second: u64, slots: usize) -> &mut Slot {
        if self.slots.len() != slots {
            self.slots = vec![Slot::default(); slots];
        }
        let slot = &mut self.slots[(second % slots as u64) as usize];
        if slot.second != second {
            *slot = Slot {
                second,
                ..Slot::default()
            };
        }
        slot
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Slot {
    second: u64,
    calls: u64,
    failures: u64,
    latency_ms: f64,
    worked: u64,
    /// Delivery receipts (SMS status callbacks) and those reporting a
    /// failure.
    receipts: u64,
    receipt_failures: u64,
    /// Receipts that said how long after the send they came, and the sum
    /// of those delays in ms.
    receipts_timed: u64,
    receipt_delay_ms: f64,
}

impl Health {
    pub fn new(rule: ProviderHealthSettings) -> Self {
        Health {
            rule,
            state: Mutex::new(Window::default()),
        }
    }

    fn window(&self) -> std::sync::MutexGuard<'_, Window> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts one outcome at `now`: a call that worked (with its time) or
    /// one that failed. Returns true when this outcome marked the provider
    /// down.
    pub fn record(&self, now: Duration, failed: bool, latency: Duration) -> bool {
        let mut window = self.window();
        let second = now.as_secs();
        let slots = self.rule.window_secs.max(1) as usize;
        let slot = window.slot(second, slots);
        slot.calls += 1;
        if failed {
            slot.failures += 1;
        } else {
            slot.worked += 1;
            slot.latency_ms += latency.as_secs_f64() * 1000.0;
        }
        let (calls, failures, mean) = totals(&window.slots, second, slots as u64);
        if calls < u64::from(self.rule.min_calls)
            || state_at(&window, &self.rule, now) == State::Down
        {
            return false;
        }
        let failing = failures as f64 > self.rule.max_failure_rate * calls as f64;
        let slow = mean.is_some_and(|mean| mean > self.rule.max_latency_ms as f64);
        if failing || slow {
            mark_down(&mut window, now);
            return true;
        }
        false
    }

    /// Counts one delivery receipt at `now`, `failed` when it reports the
    /// message failed, with how long after the send it came when known.
    /// Receipts are judged apart from calls: at least `min_calls` of them
    /// in the window and more than `max_failure_rate` failed (a provider
    /// that takes every message and delivers none), or coming more than
    /// `max_receipt_delay_ms` after their sends on average, mark the
    /// provider down. Returns true then.
    pub fn record_receipt(&self, now: Duration, failed: bool, delay: Option<Duration>) -> bool {
        let mut window = self.window();
        let second = now.as_secs();
        let slots = self.rule.window_secs.max(1) as usize;
        let slot = window.slot(second, slots);
        slot.receipts += 1;
        slot.receipt_failures += u64::from(failed);
        if let Some(delay) = delay {
            slot.receipts_timed += 1;
            slot.receipt_delay_ms += delay.as_secs_f64() * 1000.0;
        }
        if state_at(&window, &self.rule, now) == State::Down {
            return false;
        }
        let live = window
            .slots
            .iter()
            .filter(|slot| slot.second + slots as u64 > second && slot.second <= second);
        let (mut receipts, mut failures, mut timed, mut delay_ms) = (0, 0, 0, 0.0);
        for slot in live {
            receipts += slot.receipts;
            failures += slot.receipt_failures;
            timed += slot.receipts_timed;
            delay_ms += slot.receipt_delay_ms;
        }
        let enough = receipts >= u64::from(self.rule.min_calls);
        let failing = failures as f64 > self.rule.max_failure_rate * receipts as f64;
        let slow = timed >= u64::from(self.rule.min_calls)
            && delay_ms / timed as f64 > self.rule.max_receipt_delay_ms as f64;
        if (enough && failing) || slow {
            mark_down(&mut window, now);
            return true;
        }
        false
    }

    /// The provider is paused until `end` (a 429, an open breaker): it
    /// has no share until then and wins its weight back from a tenth over
    /// `recover_secs` after, so a provider back from a pause never takes
    /// more than a small part of the traffic at once.
    pub fn paused_until(&self, end: Duration) {
        let mut window = self.window();
        window.pause_ends = Some(window.pause_ends.map_or(end, |known| known.max(end)));
    }

    /// The part of its weight routing gives the provider at `now`.
    pub fn factor(&self, now: Duration) -> f64 {
        factor_at(&self.window(), &self.rule, now)
    }

    pub fn snapshot(&self, now: Duration) -> Snapshot {
        let window = self.window();
        let factor = factor_at(&window, &self.rule, now);
        let slots = self.rule.window_secs.max(1);
        let (calls, failures, mean_latency_ms) = if window.slots.is_empty() {
            (0, 0, None)
        } else {
            totals(&window.slots, now.as_secs(), slots)
        };
        Snapshot {
            state: match state_at(&window, &self.rule, now) {
                State::Healthy
                    if window.pause_ends.is_some_and(|end| now >= end) && factor < 1.0 =>
                {
                    State::Recovering
                }
                state => state,
            },
            factor,
            calls,
            failures,
            mean_latency_ms,
            downs: window.downs,
        }
    }
}

/// Marks the provider down at `now` and forgets its window.
fn mark_down(window: &mut Window, now: Duration) {
    window.down_at = Some(now);
    window.downs += 1;
    window
        .slots
        .iter_mut()
        .for_each(|slot| *slot = Slot::default());
}

/// Calls, failures and the mean latency of the calls that worked, over
/// the slots still inside the window that ends at `second`.
fn totals(slots: &[Slot], second: u64, width: u64) -> (u64, u64, Option<f64>) {
    let live = slots
        .iter()
        .filter(|slot| slot.second + width > second && slot.second <= second);
    let (mut calls, mut failures, mut worked, mut latency) = (0, 0, 0, 0.0);
    for slot in live {
        calls += slot.calls;
        failures += slot.failures;
        worked += slot.worked;
        latency += slot.latency_ms;
    }
    let mean = (worked > 0).then(|| latency / worked as f64);
    (calls, failures, mean)
}

fn state_at(window: &Window, rule: &ProviderHealthSettings, now: Duration) -> State {
    let Some(down_at) = window.down_at else {
        return State::Healthy;
    };
    let since = now.saturating_sub(down_at);
    let down = Duration::from_secs(rule.down_secs);
    if since < down {
        State::Down
    } else if since < down + Duration::from_secs(rule.recover_secs) {
        State::Recovering
    } else {
        State::Healthy
    }
}

fn factor_at(window: &Window, rule: &ProviderHealthSettings, now: Duration) -> f64 {
    let health = match window.down_at {
        Some(down_at) => ramp(rule, now, down_at + Duration::from_secs(rule.down_secs)),
        None => 1.0,
    };
    match window.pause_ends {
        Some(end) => health.min(ramp(rule, now, end)),
        None => health,
    }
}

/// The share of a provider that is out until `back`: none before, then
/// a straight line from a tenth at `back` to all of it `recover_secs`
/// later.
fn ramp(rule: &ProviderHealthSettings, now: Duration, back: Duration) -> f64 {
    if now < back {
        return 0.0;
    }
    let into = (now - back).as_secs_f64();
    let whole = rule.recover_secs.max(1) as f64;
    (FIRST_SHARE + (1.0 - FIRST_SHARE) * (into / whole)).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule() -> ProviderHealthSettings {
        ProviderHealthSettings {
            window_secs: 10,
            min_calls: 10,
            max_failure_rate: 0.5,
            max_latency_ms: 1000,
            max_receipt_delay_ms: 60_000,
            down_secs: 5,
            recover_secs: 20,
        }
    }

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn failures_past_the_rate_mark_down_then_the_share_comes_back_in_a_line() {
        let health = Health::new(rule());
        let t0 = Duration::from_secs(100);
        for i in 0..9 {
            assert!(
                !health.record(t0 + i * MS, true, MS),
                "fewer than min_calls"
            );
        }
        assert_eq!(health.factor(t0), 1.0);
        assert!(health.record(t0 + 9 * MS, true, MS));
        let at = |secs: f64| t0 + 9 * MS + Duration::from_secs_f64(secs);
        assert_eq!(health.snapshot(at(0.0)).state, State::Down);
        assert_eq!(health.factor(at(4.9)), 0.0);
        assert!((health.factor(at(5.0)) - 0.1).abs() < 1e-9);
        assert!((health.factor(at(15.0)) - 0.55).abs() < 1e-9);
        assert_eq!(health.snapshot(at(15.0)).state, State::Recovering);
        assert_eq!(health.factor(at(25.0)), 1.0);
        assert_eq!(health.snapshot(at(25.0)).state, State::Healthy);
        assert_eq!(health.snapshot(at(25.0)).downs, 1);
    }

    #[test]
    fn a_failure_rate_at_the_limit_or_old_failures_do_not_mark_down() {
        let health = Health::new(rule());
        let t0 = Duration::from_secs(50);
        for i in 0..20 {
            assert!(!health.record(t0 + i * MS, i % 2 == 1, MS));
        }
        // Ten seconds later the window has forgotten them.
        let later = t0 + Duration::from_secs(11);
        for i in 0..5 {
            assert!(!health.record(later + i * MS, true, MS));
        }
        for i in 5..15 {
            assert!(!health.record(later + i * MS, false, MS));
        }
        assert_eq!(health.factor(later), 1.0);
    }

    #[test]
    fn failed_receipts_mark_down_apart_from_calls_that_worked() {
        let health = Health::new(rule());
        let t0 = Duration::from_secs(30);
        for i in 0..20 {
            assert!(!health.record(t0 + i * MS, false, MS));
        }
        let marked = (0..10).any(|i| health.record_receipt(t0 + (20 + i) * MS, true, None));
        assert!(marked, "a provider that delivers nothing is marked down");
        assert_eq!(health.factor(t0 + Duration::from_secs(1)), 0.0);
    }

    #[test]
    fn receipts_that_come_long_after_their_sends_mark_down() {
        let health = Health::new(rule());
        let t0 = Duration::from_secs(40);
        let prompt = Some(Duration::from_secs(2));
        assert!(!(0..20).any(|i| health.record_receipt(t0 + i * MS, false, prompt)));
        let late = Some(Duration::from_secs(300));
        let marked = (0..40).any(|i| health.record_receipt(t0 + (20 + i) * MS, false, late));
        assert!(marked, "delivered, but minutes late on average");
        let later = t0 + Duration::from_secs(1);
        assert_eq!(health.snapshot(later).state, State::Down);
    }

    #[test]
    fn slow_calls_mark_down_and_failing_again_while_recovering_starts_over() {
        let health = Health::new(rule());
        let t0 = Duration::from_secs(10);
        let slow = Duration::from_millis(1500);
        let marked = (0..10).any(|i| health.record(t0 + i * MS, false, slow));
        assert!(marked);
        let recovering = t0 + Duration::from_secs(6);
        assert_eq!(health.snapshot(recovering).state, State::Recovering);
        let again = (0..10).any(|i| health.record(recovering + i * MS, true, MS));
        assert!(again, "failing while recovering marks it down again");
        assert_eq!(health.factor(recovering + Duration::from_secs(4)), 0.0);
        assert_eq!(health.snapshot(recovering).downs, 2);
    }
}
