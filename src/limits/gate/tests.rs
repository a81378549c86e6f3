//! The gate's tests, on the simulated clock of [`super::sim`].

use std::cell::RefCell;
use std::rc::Rc;

use super::sim::{Sim, timeout};
use super::*;

const MS: Duration = Duration::from_millis(1);
const SECOND: Duration = Duration::from_secs(1);

/// `callers` tasks, priorities mixed, each taking tokens back to back for
/// `run_for` of simulated time. Returns the grant instants in order and
/// the number of task polls the executor made.
fn backlog(
    sim: &Sim,
    gate: &Arc<ProviderGate>,
    callers: usize,
    run_for: Duration,
) -> (Vec<Duration>, u64) {
    let grants = Rc::new(RefCell::new(Vec::new()));
    let start = sim.now();
    let polls_before = sim.polls();
    let tasks: Vec<_> = (0..callers)
        .map(|i| {
            let (sim2, gate, grants) = (sim.clone(), Arc::clone(gate), Rc::clone(&grants));
            let priority = Priority::ALL[i % Priority::ALL.len()];
            sim.spawn(async move {
                loop {
                    gate.acquire(priority).await;
                    grants.borrow_mut().push(sim2.now());
                }
            })
        })
        .collect();
    sim.run_until(start + run_for);
    for task in tasks {
        sim.abort(task);
    }
    let grants = grants.borrow().clone();
    (grants, sim.polls() - polls_before)
}

fn spec(name: &str, weight: u32, rate_per_second: f64, burst: u32) -> MemberSpec {
    MemberSpec {
        name: name.into(),
        weight,
        rate_per_second,
        burst,
    }
}

/// `callers` tasks taking tokens of `gate` back to back under `choice`
/// for `run_for`; returns each grant's instant and provider.
fn pool_backlog(
    sim: &Sim,
    gate: &Arc<ProviderGate>,
    callers: usize,
    choice: Choice,
    run_for: Duration,
) -> Vec<(Duration, usize)> {
    let grants = Rc::new(RefCell::new(Vec::new()));
    let start = sim.now();
    let tasks: Vec<_> = (0..callers)
        .map(|i| {
            let (sim2, gate, grants) = (sim.clone(), Arc::clone(gate), Rc::clone(&grants));
            sim.spawn(async move {
                loop {
                    let (_, member) = gate
                        .acquire_from(Priority::ALL[i % 3], &format!("t{}", i % 4), choice)
                        .await;
                    grants.borrow_mut().push((sim2.now(), member));
                }
            })
        })
        .collect();
    sim.run_until(start + run_for);
    for task in tasks {
        sim.abort(task);
    }
    grants.borrow().clone()
}

fn of_member(grants: &[(Duration, usize)], member: usize) -> Vec<Duration> {
    grants
        .iter()
        .filter(|(_, m)| *m == member)
        .map(|(at, _)| *at)
        .collect()
}

#[test]
fn a_quiet_tenant_beside_a_busy_one_takes_the_very_next_token() {
    let sim = Sim::new(Duration::from_micros(10));
    let gate = sim.gate(100.0, 1);
    let grants = Rc::new(RefCell::new(Vec::new()));
    for _ in 0..8 {
        let (g, log, sim2) = (Arc::clone(&gate), Rc::clone(&grants), sim.clone());
        sim.spawn(async move {
            loop {
                g.acquire_for(Priority::Normal, "busy").await;
                log.borrow_mut().push(("busy", sim2.now()));
            }
        });
    }
    // Quiet callers one at a time, off the token grid, each once the
    // previous one got its token.
    let (g, log, sim2) = (Arc::clone(&gate), Rc::clone(&grants), sim.clone());
    sim.spawn(async move {
        for n in 0..20u32 {
            let at = Nanos::from(SECOND + Duration::from_micros(53_700 * u64::from(n) + 1_300));
            sim2.clock().sleep_until(at).await;
            let asked = sim2.now();
            let waited = g.acquire_for(Priority::Normal, "quiet").await;
            log.borrow_mut().push(("quiet", sim2.now()));
            assert!(
                waited <= 10 * MS,
                "quiet caller {n} asked at {asked:?} and waited {waited:?}: more than one token interval"
            );
        }
    });
    sim.run_until(3 * SECOND);
    let grants = grants.borrow();
    let quiet = grants.iter().filter(|(who, _)| *who == "quiet").count();
    assert_eq!(quiet, 20);
    // The busy tenant still gets every other token: the gate is exact.
    let times: Vec<Duration> = grants.iter().map(|(_, at)| *at).collect();
    assert!(worst_window_excess(&times, 100.0, 1) <= 1e-9);
    assert!(
        grants.len() >= 299,
        "{} grants in 3 s at 100/s",
        grants.len()
    );
}

#[test]
fn a_call_held_up_after_its_grant_does_not_hold_up_every_later_call() {
    let sim = Sim::new(Duration::from_micros(10));
    let gate = sim.gate(100.0, 1);
    let calls = Rc::new(RefCell::new(Vec::new()));
    let (g, log, sim2) = (Arc::clone(&gate), Rc::clone(&calls), sim.clone());
    sim.spawn(async move {
        for n in 0..100u32 {
            g.acquire(Priority::Normal).await;
            // Every tenth call is held up 8 ms between grant and call
            // (a slow claim); the others go at once.
            if n % 10 == 3 {
                let at = Nanos::from(sim2.now() + 8 * MS);
                sim2.clock().sleep_until(at).await;
            }
            let paced = g.pace_call().await;
            log.borrow_mut().push((sim2.now(), paced));
        }
    });
    sim.run_until(2 * SECOND);
    let calls = calls.borrow();
    assert_eq!(calls.len(), 100);
    let late: Vec<_> = calls
        .iter()
        .filter(|(_, paced)| *paced > Duration::ZERO)
        .collect();
    assert!(late.is_empty(), "calls paced after a held-up one: {late:?}");
    let times: Vec<Duration> = calls.iter().map(|(at, _)| *at).collect();
    let excess = worst_window_excess(&times, 100.0, 1);
    assert!(
        excess <= 1.0,
        "at most one call over burst + rate x t: {excess}"
    );
}

#[test]
fn a_pool_uses_every_providers_rate_and_none_exceeds_its_own() {
    let sim = Sim::new(Duration::from_micros(10));
    let health = ProviderHealthSettings::default();
    let gate = sim.pool(&[spec("a", 1, 100.0, 5), spec("b", 1, 50.0, 3)], &health);
    let grants = pool_backlog(&sim, &gate, 40, Choice::Any, 10 * SECOND);
    let (a, b) = (of_member(&grants, 0), of_member(&grants, 1));
    // Both start empty: 10 s earn 1,000 and 500 tokens.
    assert!(a.len() >= 999 && a.len() <= 1000, "a: {}", a.len());
    assert!(b.len() >= 499 && b.len() <= 500, "b: {}", b.len());
    let utilisation = grants.len() as f64 / 1500.0;
    assert!(utilisation >= 0.99, "utilisation {utilisation}");
    assert!(worst_window_excess(&a, 100.0, 5) <= 1e-9);
    assert!(worst_window_excess(&b, 50.0, 3) <= 1e-9);
}

#[test]
fn the_view_of_tokens_starts_empty_fills_at_the_rate_up_to_the_burst_and_follows_grants() {
    let sim = Sim::new(Duration::from_millis(1));
    let gate = sim.pool(&[spec("a", 1, 10.0, 5)], &ProviderHealthSettings::default());
    let tokens = |gate: &Arc<ProviderGate>| {
        let got = Rc::new(RefCell::new(None));
        let (g, out) = (Arc::clone(gate), Rc::clone(&got));
        sim.spawn(async move {
            *out.borrow_mut() = g.tokens().await[0];
        });
        sim.settle();
        got.borrow_mut().take().expect("the view answered")
    };
    assert_eq!(tokens(&gate), 0, "a gate starts empty");
    sim.run_until(Duration::from_millis(350));
    assert_eq!(tokens(&gate), 3, "10/s for 350 ms");
    sim.run_until(2 * SECOND);
    assert_eq!(tokens(&gate), 5, "never more than the burst");
    let g = Arc::clone(&gate);
    sim.spawn(async move {
        for _ in 0..2 {
            g.acquire(Priority::Normal).await;
        }
    });
    sim.settle();
    assert_eq!(tokens(&gate), 3, "two grants took two");
}

#[test]
fn spare_tokens_are_shared_by_weight() {
    let sim = Sim::new(Duration::from_micros(10));
    let health = ProviderHealthSettings::default();
    // Both could take every call: 3:1 weights decide.
    let gate = sim.pool(
        &[spec("a", 3, 1000.0, 100), spec("b", 1, 1000.0, 100)],
        &health,
    );
    sim.run_until(SECOND);
    let grants = Rc::new(RefCell::new(Vec::new()));
    let (g, log) = (Arc::clone(&gate), Rc::clone(&grants));
    let sim2 = sim.clone();
    sim.spawn(async move {
        for _ in 0..400 {
            let (_, member) = g.acquire_from(Priority::Normal, "", Choice::Any).await;
            log.borrow_mut().push(member);
            let at = Nanos::from(sim2.now() + Duration::from_millis(5));
            sim2.clock().sleep_until(at).await;
        }
    });
    sim.run_until(10 * SECOND);
    let grants = grants.borrow();
    let a = grants.iter().filter(|m| **m == 0).count();
    assert_eq!(grants.len(), 400);
    assert_eq!(a, 300, "weights 3:1 give a three quarters");
}

#[test]
fn a_paused_provider_leaves_its_calls_to_the_others_and_choices_are_kept() {
    let sim = Sim::new(Duration::from_micros(10));
    let health = ProviderHealthSettings::default();
    let gate = sim.pool(&[spec("a", 1, 100.0, 5), spec("b", 1, 100.0, 5)], &health);
    gate.pause_member(0, 5 * SECOND);
    let grants = pool_backlog(&sim, &gate, 20, Choice::Any, 2 * SECOND);
    assert!(
        grants.iter().all(|(_, m)| *m == 1),
        "paused a served nothing"
    );
    assert!(grants.len() >= 199, "b alone served {}", grants.len());
    // Only(0) waits for a's pause to end; Avoid(1) is the same here.
    let only = pool_backlog(&sim, &gate, 4, Choice::Only(0), 4 * SECOND);
    assert!(
        only.iter().all(|(at, m)| *m == 0 && *at >= 5 * SECOND),
        "{only:?}"
    );
    assert!(!only.is_empty());
    let avoid = pool_backlog(&sim, &gate, 4, Choice::Avoid(0), SECOND);
    assert!(avoid.iter().all(|(_, m)| *m == 1));
}

#[test]
fn a_provider_marked_down_gets_nothing_then_its_share_back_gradually() {
    let sim = Sim::new(Duration::from_micros(10));
    let health = ProviderHealthSettings {
        window_secs: 2,
        min_calls: 5,
        max_failure_rate: 0.5,
        max_latency_ms: 1000,
        max_receipt_delay_ms: 60_000,
        down_secs: 2,
        recover_secs: 4,
    };
    let gate = sim.pool(&[spec("a", 1, 100.0, 5), spec("b", 1, 100.0, 5)], &health);
    sim.run_until(SECOND);
    let marked = (0..5).any(|_| gate.record_outcome(0, true, MS));
    assert!(marked);
    let view = gate.view();
    assert_eq!(view[0].share, 0.0);
    assert_eq!(view[1].share, 1.0);
    assert_eq!(view[0].health.state, health::State::Down);
    // Under a backlog: nothing for a while it is down, a small part
    // while it recovers, its whole rate after.
    let grants = pool_backlog(&sim, &gate, 40, Choice::Any, 8 * SECOND);
    let a_in = |from: u32, to: u32| {
        grants
            .iter()
            .filter(|(at, m)| *m == 0 && *at >= SECOND * from && *at < SECOND * to)
            .count()
    };
    assert_eq!(a_in(1, 3), 0, "down for 2 s");
    let early = a_in(3, 4);
    let late = a_in(8, 9);
    assert!(
        early > 0 && early < 40,
        "recovering at first: {early} of 100"
    );
    assert!(late >= 99, "recovered: {late}");
}

/// Largest excess over `burst + rate × t` in any window between two grants.
fn worst_window_excess(grants: &[Duration], rate: f64, burst: u32) -> f64 {
    let mut worst = f64::NEG_INFINITY;
    for i in 0..grants.len() {
        for j in i..grants.len() {
            let window = (grants[j] - grants[i]).as_secs_f64();
            let allowed = f64::from(burst) + rate * window;
            worst = worst.max((j - i + 1) as f64 - allowed);
        }
    }
    worst
}

#[test]
fn no_window_ever_holds_more_than_burst_plus_rate_times_its_length() {
    for (rate, burst, tick) in [
        (20.0, 5, MS),
        (26.67, 10, MS),
        (26.67, 1, MS),
        (20.0, 5, 7 * MS),
    ] {
        let sim = Sim::new(tick);
        let gate = sim.gate(rate, burst);
        let (grants, _) = backlog(&sim, &gate, 50, 30 * SECOND);
        assert!(
            grants.len() > 500,
            "the run made only {} grants",
            grants.len()
        );
        let excess = worst_window_excess(&grants, rate, burst);
        assert!(
            excess <= 1e-6,
            "{rate}/s burst {burst}: a window held {excess} grants too many"
        );
    }
}

#[test]
fn a_backlog_uses_at_least_99_percent_of_the_configured_rate() {
    // A timer tick of 7 ms models a late wake-up on a busy machine; a
    // burst of two or more absorbs lateness shorter than a token interval.
    // The gate starts empty, so every grant is one the rate earned.
    for (rate, burst, tick) in [(20.0, 5, MS), (26.67, 10, MS), (26.67, 10, 7 * MS)] {
        let sim = Sim::new(tick);
        let gate = sim.gate(rate, burst);
        let (grants, _) = backlog(&sim, &gate, 50, 30 * SECOND);
        let granted = grants.len() as f64;
        assert!(
            granted >= 0.99 * rate * 30.0,
            "{rate}/s burst {burst} tick {tick:?}: only {granted} grants in 30 s"
        );
    }
}

#[test]
fn a_new_gate_starts_empty_and_grants_no_more_than_its_rate_has_earned_since() {
    // Built at 0 with 50 callers waiting: the bucket has no token at
    // first, so by any instant t at most rate × t calls have gone,
    // whatever the burst; the first token is due one interval in.
    for (rate, burst) in [(20.0, 5), (26.67, 10), (10.0, 1)] {
        let sim = Sim::new(MS);
        let gate = sim.gate(rate, burst);
        let (grants, _) = backlog(&sim, &gate, 50, 3 * SECOND);
        let first_due = Duration::from_secs_f64(1.0 / rate);
        assert!(
            grants[0] >= first_due && grants[0] <= first_due + MS,
            "{rate}/s burst {burst}: first grant at {:?}",
            grants[0]
        );
        for (n, at) in grants.iter().enumerate() {
            let earned = rate * at.as_secs_f64();
            assert!(
                (n + 1) as f64 <= earned + 1e-9,
                "{rate}/s burst {burst}: {} grants by {at:?}, earned {earned:.2}",
                n + 1
            );
        }
        assert!(grants.len() as f64 >= rate * 3.0 - 1.0);
    }
}

/// Callers that each take a token, pace the call and record its instant,
/// over and over; returns the call log and the tasks, to abort (a kill).
fn callers(
    sim: &Sim,
    gate: &Arc<ProviderGate>,
    count: usize,
    calls: &Rc<RefCell<Vec<Duration>>>,
) -> Vec<usize> {
    (0..count)
        .map(|i| {
            let (sim2, gate, calls) = (sim.clone(), Arc::clone(gate), Rc::clone(calls));
            sim.spawn(async move {
                loop {
                    gate.acquire(Priority::ALL[i % 3]).await;
                    gate.pace_call().await;
                    calls.borrow_mut().push(sim2.now());
                }
            })
        })
        .collect()
}

#[test]
fn a_process_started_right_after_another_stopped_keeps_the_provider_within_burst_plus_rate() {
    // The first process idles (its bucket fills), takes its whole burst
    // in a rush at 4.9 s, goes on at the rate and is killed at 5 s, or 5
    // ms later. A second process starts that instant with a backlog. The
    // provider sees both: together they must keep burst + rate × t, which
    // a second process starting with a full bucket would break (its
    // burst on top of the first one's).
    for gap in [Duration::ZERO, 5 * MS] {
        let sim = Sim::new(MS);
        let calls: Rc<RefCell<Vec<Duration>>> = Rc::default();
        let first = sim.gate(20.0, 5);
        sim.run_until(4900 * MS);
        let running = callers(&sim, &first, 50, &calls);
        sim.run_until(5 * SECOND);
        for task in running {
            sim.abort(task);
        }
        let before_restart = calls.borrow().len();
        assert!(
            before_restart >= 5,
            "{before_restart} calls before the kill"
        );
        sim.run_until(5 * SECOND + gap);
        let second = sim.gate(20.0, 5);
        callers(&sim, &second, 50, &calls);
        sim.run_until(8 * SECOND);
        let calls = calls.borrow();
        assert!(calls.len() > before_restart + 50);
        let excess = worst_window_excess(&calls, 20.0, 5);
        assert!(
            excess <= 1e-6,
            "gap {gap:?}: a window held {excess} calls above burst + rate × t: {calls:?}"
        );
    }
}

#[test]
fn in_the_first_second_after_start_high_priority_callers_are_served_first() {
    // Low callers arrive at the start, two high ones 10 ms later. A gate
    // starting full would have handed the lows its burst before the
    // highs came; an empty one serves the highs with its first tokens.
    let sim = Sim::new(MS);
    let gate = sim.gate(10.0, 5);
    let log = Log::default();
    for i in 1..=4 {
        queue(&sim, &gate, &log, &format!("low{i}"), Priority::Low);
    }
    sim.run_until(10 * MS);
    queue(&sim, &gate, &log, "high1", Priority::High);
    queue(&sim, &gate, &log, "high2", Priority::High);
    sim.run_until(SECOND);
    assert_eq!(
        names(&log),
        ["high1", "high2", "low1", "low2", "low3", "low4"]
    );
    assert_eq!(log.borrow()[0].1, 100 * MS);
}

#[test]
fn a_pause_of_any_length_holds_the_gate_without_overflowing() {
    let sim = Sim::new(MS);
    let gate = empty_gate(&sim);
    gate.pause_for(Duration::MAX);
    let log = Log::default();
    queue(&sim, &gate, &log, "held", Priority::High);
    sim.run_until(10 * SECOND);
    assert!(log.borrow().is_empty(), "{:?}", log.borrow());
    assert_eq!(gate.waiting(), [1, 0, 0]);
}

#[test]
fn after_an_idle_spell_only_burst_callers_pass_at_once_then_the_rate_resumes() {
    let sim = Sim::new(MS);
    let gate = sim.gate(20.0, 5);
    // Empty the bucket first, so a refill beyond `burst` would show.
    let (drained, _) = backlog(&sim, &gate, 10, 5 * SECOND);
    assert!(drained.len() >= 100);
    sim.run_until(sim.now() + 10 * SECOND);

    let rush = sim.now();
    let grants = Rc::new(RefCell::new(Vec::new()));
    for _ in 0..100 {
        let (sim2, gate, grants) = (sim.clone(), Arc::clone(&gate), Rc::clone(&grants));
        sim.spawn(async move {
            gate.acquire(Priority::Normal).await;
            grants.borrow_mut().push(sim2.now());
        });
    }
    sim.run_until(rush + SECOND);
    let grants = grants.borrow();
    let at_once = grants.iter().filter(|&&at| at == rush).count();
    assert_eq!(at_once, 5, "grants in the first instant after idling");
    // Then one every 50 ms: 20 more within the second.
    assert_eq!(grants.len(), 5 + 20);
    assert_eq!(grants[5], rush + 50 * MS);
    assert_eq!(gate.waiting(), [0, 75, 0]);
}

#[test]
fn a_pause_holds_every_caller_and_the_rate_resumes_after_it() {
    let sim = Sim::new(MS);
    let gate = empty_gate(&sim);
    let log = Log::default();
    // A 429 with Retry-After: 2 at 50 ms: nobody passes before 2,050 ms,
    // neither the callers waiting then nor those arriving meanwhile.
    queue(&sim, &gate, &log, "waiting", Priority::Normal);
    sim.run_until(50 * MS);
    gate.pause_for(2 * SECOND);
    sim.run_until(SECOND);
    queue(&sim, &gate, &log, "high", Priority::High);
    queue(&sim, &gate, &log, "later", Priority::Normal);
    sim.run_until(2 * SECOND);
    assert!(
        log.borrow().is_empty(),
        "granted during the pause: {:?}",
        log.borrow()
    );
    sim.run_until(3 * SECOND);
    let log = log.borrow();
    assert_eq!(
        log.iter()
            .map(|(name, at, _)| (name.as_str(), *at))
            .collect::<Vec<_>>(),
        [
            ("high", 2050 * MS),
            ("waiting", 2150 * MS),
            ("later", 2250 * MS),
        ],
        "after the pause: high first, then one every 100 ms (the rate)"
    );
}

#[test]
fn calls_bunched_after_a_stall_are_spaced_again_at_the_call() {
    // 10/s, burst 2. Twenty callers take their tokens over about two
    // seconds, but the calls are held up (a stalled store write) until
    // 2.5 s; then they all pace at once.
    let sim = Sim::new(MS);
    let gate = sim.gate(10.0, 2);
    let calls: Rc<RefCell<Vec<Duration>>> = Rc::default();
    let clock = sim.clock();
    for _ in 0..20 {
        let (gate, calls, clock) = (Arc::clone(&gate), calls.clone(), clock.clone());
        sim.spawn(async move {
            gate.acquire(Priority::Normal).await;
            clock.sleep_until(Nanos::from(2500 * MS)).await;
            gate.pace_call().await;
            calls.borrow_mut().push(Duration::from(clock.now()));
        });
    }
    sim.run_until(10 * SECOND);
    let calls = calls.borrow();
    assert_eq!(calls.len(), 20);
    // Every window [calls[i], calls[j]] holds j - i + 1 calls: at most
    // burst + rate x its length, and the one call more the call bucket
    // allows (see `calls_quota`).
    for i in 0..calls.len() {
        for j in i..calls.len() {
            let window = (calls[j] - calls[i]).as_secs_f64();
            let allowed = 2.0 + 1.0 + 10.0 * window + 1e-9;
            assert!(
                (j - i + 1) as f64 <= allowed,
                "{} calls in {window:.3} s: {calls:?}",
                j - i + 1
            );
        }
    }
    // The bucket for calls filled up while no call came (until 2.5 s):
    // burst + 1 at once, then one every 100 ms.
    assert_eq!(calls[0], 2500 * MS);
    assert_eq!(calls[2], 2500 * MS);
    assert_eq!(calls[3], 2600 * MS);
    assert_eq!(calls[19], 4200 * MS);
}

#[test]
fn after_a_pause_one_call_goes_then_the_rate_resumes_without_a_burst() {
    // 20/s burst 5, under a backlog; a 2 s pause at 3 s lets the bucket
    // refill, which must not come out as a burst when the pause ends.
    let sim = Sim::new(MS);
    let gate = sim.gate(20.0, 5);
    let calls: Rc<RefCell<Vec<Duration>>> = Rc::default();
    callers(&sim, &gate, 30, &calls);
    sim.run_until(3 * SECOND);
    gate.pause_for(2 * SECOND);
    let paused_at = calls.borrow().len();
    sim.run_until(7 * SECOND);
    let calls = calls.borrow();
    let after: Vec<Duration> = calls[paused_at..].to_vec();
    assert!(after[0] >= 5 * SECOND, "a call during the pause: {after:?}");
    assert_eq!(after[0], 5 * SECOND, "the call at the end of the pause");
    assert_eq!(after[1], 5050 * MS, "then one every 50 ms: {after:?}");
    assert_eq!(after[2], 5100 * MS, "{after:?}");
    assert_eq!(after.len(), 41, "{after:?}");
    assert!(worst_window_excess(&calls, 20.0, 5) <= 1e-6);
}

#[test]
fn a_shorter_pause_does_not_cut_a_longer_one() {
    let sim = Sim::new(MS);
    let gate = empty_gate(&sim);
    let log = Log::default();
    gate.pause_for(SECOND);
    gate.pause_for(200 * MS);
    queue(&sim, &gate, &log, "one", Priority::Normal);
    sim.run_until(2 * SECOND);
    assert_eq!(log.borrow()[0].1, SECOND);
}

/// A 10/s, burst-1 gate built at time 0: it starts empty, so the first
/// token is due at 100 ms and one every 100 ms after.
fn empty_gate(sim: &Sim) -> Arc<ProviderGate> {
    sim.gate(10.0, 1)
}

type Log = Rc<RefCell<Vec<(String, Duration, Duration)>>>;

/// Queues a caller named `name` that logs (name, grant time, wait).
fn queue(sim: &Sim, gate: &Arc<ProviderGate>, log: &Log, name: &str, priority: Priority) -> usize {
    let (sim2, gate, log, name) = (
        sim.clone(),
        Arc::clone(gate),
        Rc::clone(log),
        name.to_string(),
    );
    let task = sim.spawn(async move {
        let waited = gate.acquire(priority).await;
        log.borrow_mut().push((name, sim2.now(), waited));
    });
    sim.settle();
    task
}

fn names(log: &Log) -> Vec<String> {
    log.borrow()
        .iter()
        .map(|(name, _, _)| name.clone())
        .collect()
}

#[test]
fn a_high_caller_arriving_behind_queued_low_waiters_gets_the_very_next_token() {
    let sim = Sim::new(MS);
    let gate = empty_gate(&sim);
    let log = Log::default();
    for i in 1..=5 {
        queue(&sim, &gate, &log, &format!("low{i}"), Priority::Low);
    }
    sim.run_until(30 * MS);
    queue(&sim, &gate, &log, "high", Priority::High);
    assert_eq!(gate.waiting(), [1, 0, 5]);

    sim.run_until(100 * MS);
    assert_eq!(log.borrow()[..], [("high".to_string(), 100 * MS, 70 * MS)]);
    sim.run_until(SECOND);
    assert_eq!(
        names(&log),
        ["high", "low1", "low2", "low3", "low4", "low5"]
    );
    assert_eq!(log.borrow()[5].1, 600 * MS);
}

#[test]
fn normal_waiters_go_before_low_ones_and_each_priority_keeps_arrival_order() {
    let sim = Sim::new(MS);
    let gate = empty_gate(&sim);
    let log = Log::default();
    queue(&sim, &gate, &log, "low1", Priority::Low);
    queue(&sim, &gate, &log, "normal1", Priority::Normal);
    queue(&sim, &gate, &log, "low2", Priority::Low);
    queue(&sim, &gate, &log, "normal2", Priority::Normal);
    queue(&sim, &gate, &log, "high1", Priority::High);
    assert_eq!(gate.waiting(), [1, 2, 2]);
    sim.run_until(SECOND);
    assert_eq!(names(&log), ["high1", "normal1", "normal2", "low1", "low2"]);
    let times: Vec<_> = log.borrow().iter().map(|(_, at, _)| *at).collect();
    assert_eq!(times, [100 * MS, 200 * MS, 300 * MS, 400 * MS, 500 * MS]);
}

/// Queues a caller of `tenant` named `name`, logging like [`queue`].
fn queue_for(sim: &Sim, gate: &Arc<ProviderGate>, log: &Log, name: &str, tenant: &str) {
    let (sim2, gate, log, name, tenant) = (
        sim.clone(),
        Arc::clone(gate),
        Rc::clone(log),
        name.to_string(),
        tenant.to_string(),
    );
    sim.spawn(async move {
        let waited = gate.acquire_for(Priority::Normal, &tenant).await;
        log.borrow_mut().push((name, sim2.now(), waited));
    });
    sim.settle();
}

#[test]
fn tenants_of_one_priority_take_turns_so_a_first_message_is_not_behind_a_backlog() {
    let sim = Sim::new(MS);
    let gate = empty_gate(&sim);
    let log = Log::default();
    for i in 1..=4 {
        queue_for(&sim, &gate, &log, &format!("big{i}"), "big");
    }
    queue_for(&sim, &gate, &log, "small1", "small");
    queue_for(&sim, &gate, &log, "other1", "other");
    queue_for(&sim, &gate, &log, "small2", "small");
    sim.run_until(SECOND);
    assert_eq!(
        names(&log),
        ["big1", "small1", "other1", "big2", "small2", "big3", "big4"]
    );
}

#[test]
fn under_a_flood_of_high_callers_low_ones_still_get_their_share_of_tokens() {
    let sim = Sim::new(MS);
    let gate = sim.gate_with_share(100.0, 1, 0.1);
    let counts = Rc::new(RefCell::new([0usize; 3]));
    for i in 0..12 {
        let priority = if i < 10 {
            Priority::High
        } else {
            Priority::Low
        };
        let (gate, counts) = (Arc::clone(&gate), Rc::clone(&counts));
        sim.spawn(async move {
            loop {
                gate.acquire(priority).await;
                counts.borrow_mut()[priority.rank()] += 1;
            }
        });
    }
    sim.run_until(20 * SECOND);
    let [high, _, low] = *counts.borrow();
    let share = low as f64 / (high + low) as f64;
    assert!(
        (0.085..=0.1).contains(&share),
        "low got {low} of {} tokens",
        high + low
    );
    // Strict priority (share 0) would give low nothing at all.
    let strict = Sim::new(MS);
    let gate = strict.gate(100.0, 1);
    let low_grants = Rc::new(RefCell::new(0usize));
    for i in 0..12 {
        let priority = if i < 10 {
            Priority::High
        } else {
            Priority::Low
        };
        let (gate, low_grants) = (Arc::clone(&gate), Rc::clone(&low_grants));
        strict.spawn(async move {
            loop {
                gate.acquire(priority).await;
                if priority == Priority::Low {
                    *low_grants.borrow_mut() += 1;
                }
            }
        });
    }
    strict.run_until(5 * SECOND);
    assert!(*low_grants.borrow() <= 2, "low got {}", low_grants.borrow());
}

#[test]
fn the_share_rule_keeps_the_gate_within_burst_plus_rate() {
    let sim = Sim::new(MS);
    let gate = sim.gate_with_share(50.0, 5, 0.2);
    let (grants, _) = backlog(&sim, &gate, 30, 10 * SECOND);
    assert!(worst_window_excess(&grants, 50.0, 5) <= 1e-9);
    assert!(grants.len() as f64 >= 0.99 * 50.0 * 10.0);
}

#[test]
fn a_caller_coming_back_for_another_token_queues_behind_those_already_waiting() {
    // Timers firing only every 250 ms let two tokens pile up while the
    // head sleeps, so at the wake-up one is still free when the served
    // caller asks again.
    let sim = Sim::new(250 * MS);
    let gate = sim.gate(10.0, 5);
    let log = Log::default();
    for name in ["a", "b", "c"] {
        let (sim2, gate, log) = (sim.clone(), Arc::clone(&gate), Rc::clone(&log));
        sim.spawn(async move {
            loop {
                let waited = gate.acquire(Priority::Normal).await;
                log.borrow_mut()
                    .push((name.to_string(), sim2.now(), waited));
            }
        });
    }
    sim.run_until(SECOND);
    let served: Vec<_> = names(&log).into_iter().take(9).collect();
    assert_eq!(served, ["a", "b", "c", "a", "b", "c", "a", "b", "c"]);
}

#[test]
fn a_cancelled_head_of_line_does_not_swallow_the_next_token() {
    let sim = Sim::new(MS);
    let gate = empty_gate(&sim);
    let log = Log::default();
    queue(&sim, &gate, &log, "low", Priority::Low);
    let high = queue(&sim, &gate, &log, "high", Priority::High);
    sim.run_until(50 * MS);
    sim.abort(high);
    assert_eq!(gate.waiting(), [0, 0, 1]);
    sim.run_until(SECOND);
    assert_eq!(log.borrow()[..], [("low".to_string(), 100 * MS, 100 * MS)]);
}

#[test]
fn a_waiter_that_times_out_leaves_the_next_token_to_the_one_behind_it() {
    let sim = Sim::new(MS);
    let gate = empty_gate(&sim);
    let log = Log::default();
    let timed_out = Rc::new(RefCell::new(None));
    {
        let (clock, gate, timed_out) = (sim.clock(), Arc::clone(&gate), Rc::clone(&timed_out));
        sim.spawn(async move {
            let outcome = timeout(&clock, 50 * MS, gate.acquire(Priority::High)).await;
            *timed_out.borrow_mut() = Some((outcome, clock.now()));
        });
    }
    queue(&sim, &gate, &log, "normal", Priority::Normal);
    queue(&sim, &gate, &log, "low", Priority::Low);
    sim.run_until(SECOND);
    assert_eq!(*timed_out.borrow(), Some((None, Nanos::from(50 * MS))));
    assert_eq!(names(&log), ["normal", "low"]);
    assert_eq!(log.borrow()[0].1, 100 * MS);
    assert_eq!(log.borrow()[1].1, 200 * MS);
}

#[test]
fn a_waiter_cancelled_just_after_being_woken_as_head_passes_the_turn_on() {
    let sim = Sim::new(MS);
    let gate = empty_gate(&sim);
    let log = Log::default();
    let normal = Rc::new(RefCell::new(None));
    {
        // The high caller, once served, cancels the normal caller that
        // its grant just woke, before that caller has run.
        let (sim2, gate, log, normal) = (
            sim.clone(),
            Arc::clone(&gate),
            Rc::clone(&log),
            Rc::clone(&normal),
        );
        sim.spawn(async move {
            let waited = gate.acquire(Priority::High).await;
            log.borrow_mut()
                .push(("high".to_string(), sim2.now(), waited));
            sim2.abort(normal.borrow_mut().take().expect("normal caller queued"));
        });
    }
    *normal.borrow_mut() = Some(queue(&sim, &gate, &log, "normal", Priority::Normal));
    queue(&sim, &gate, &log, "low", Priority::Low);
    sim.run_until(SECOND);
    assert_eq!(names(&log), ["high", "low"]);
    assert_eq!(log.borrow()[1].1, 200 * MS);
    assert_eq!(gate.waiting(), [0, 0, 0]);
}

#[test]
fn waiting_callers_are_woken_about_once_per_grant_not_once_per_waiter() {
    let sim = Sim::new(MS);
    let gate = sim.gate(20.0, 5);
    let (grants, polls) = backlog(&sim, &gate, 50, 30 * SECOND);
    // Each grant: the served caller returns and queues again, the next
    // head wakes and goes to sleep on the clock, the clock wakes it.
    let per_grant = polls as f64 / grants.len() as f64;
    assert!(per_grant <= 4.0, "{per_grant} polls per grant");
}

#[tokio::test]
async fn on_tokio_time_a_caller_waits_until_its_token_is_due() {
    let start = tokio::time::Instant::now();
    let gate = ProviderGate::new(4.0, 1);
    let first = gate.acquire(Priority::Normal).await;
    let waited = gate.acquire(Priority::Normal).await;
    // Lower bounds only: a busy machine may wake the caller late, never
    // early. The gate starts empty: the first token is due 250 ms after
    // it was built, the second 250 ms after that.
    assert!(
        start.elapsed() >= 500 * MS,
        "granted after {:?}",
        start.elapsed()
    );
    assert!(first > Duration::ZERO, "the first caller did not wait");
    assert!(waited > Duration::ZERO, "the second caller did not wait");
    assert_eq!(gate.waiting(), [0, 0, 0]);
}

#[test]
fn acquire_can_run_on_a_multi_threaded_runtime() {
    fn assert_send<T: Send>(_: &T) {}
    let gate = ProviderGate::new(1.0, 1);
    assert_send(&gate.acquire(Priority::High));
    fn assert_shareable<T: Send + Sync>() {}
    assert_shareable::<ProviderGate>();
}

#[test]
fn reports_the_rate_achieved_by_a_20_per_second_gate_over_30_seconds() {
    let sim = Sim::new(MS);
    let gate = sim.gate(20.0, 5);
    let (grants, _) = backlog(&sim, &gate, 50, 30 * SECOND);
    let at_start = grants.iter().filter(|&&at| at == Duration::ZERO).count();
    let achieved = grants.len() as f64 / 30.0;
    println!(
        "provider gate at {}/s burst {}: {} grants in 30 s of simulated time \
         ({at_start} at t=0: it starts empty), {achieved:.3}/s",
        gate.rate_per_second(),
        gate.burst(),
        grants.len(),
    );
    assert_eq!(at_start, 0);
    assert!(achieved >= 0.99 * 20.0);
}

/// Real time, 30 s: `cargo test --lib limits::gate -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "takes 30 s of real time"]
async fn reports_the_rate_achieved_on_tokio_time() {
    let gate = Arc::new(ProviderGate::new(20.0, 5));
    let grants = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..50 {
        let (gate, grants) = (Arc::clone(&gate), Arc::clone(&grants));
        tasks.spawn(async move {
            loop {
                gate.acquire(Priority::ALL[i % 3]).await;
                grants.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        });
    }
    tokio::time::sleep_until(start + 30 * SECOND).await;
    let total = grants.load(std::sync::atomic::Ordering::Relaxed);
    tasks.abort_all();
    println!(
        "provider gate at 20/s burst 5, real time: {total} grants in 30 s, {:.3}/s (it starts empty)",
        total as f64 / 30.0
    );
    assert!(total as f64 >= 0.99 * 600.0);
}
