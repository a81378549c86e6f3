//! The gate's tests, on tokio's paused clock (`start_paused`): time moves
//! only when every task waits, and then straight to the next timer, so the
//! grant instants are exact and nothing sleeps for real.
//!
//! tokio's timers have a resolution of one millisecond: a sleep ends at the
//! first whole millisecond at or after its deadline. The tests therefore use
//! rates whose token interval is a whole number of milliseconds wherever
//! they check exact instants; where the interval is not whole (26.67/s), the
//! checks are bounds that the rounding cannot break (say which), since the
//! gate only ever grants a token at or after the instant it is due.

use std::future::Future;
use std::sync::atomic::AtomicU64;

use tokio::task::AbortHandle;
use tokio::time::Instant;

use super::*;

const MS: Duration = Duration::from_millis(1);
const SECOND: Duration = Duration::from_secs(1);

/// One test's tasks on the paused clock, and the instant it started (the
/// instants the tests log are durations since then).
#[derive(Clone)]
struct Run {
    start: Instant,
    /// Polls of the tasks spawned through [`Run::spawn`] so far.
    polls: Arc<AtomicU64>,
}

/// How the paused clock moves on while a test runs its tasks.
#[derive(Debug, Clone, Copy)]
enum Timers {
    /// As tokio moves it by itself: to the next timer, which fires on time
    /// (to the millisecond).
    OnTime,
    /// In steps of this length: a timer fires only at the end of the step
    /// it falls in, which models late wake-ups on a busy machine.
    Every(Duration),
}

impl Run {
    fn new() -> Self {
        Run {
            start: Instant::now(),
            polls: Arc::default(),
        }
    }

    fn now(&self) -> Duration {
        self.start.elapsed()
    }

    fn polls(&self) -> u64 {
        self.polls.load(Ordering::Relaxed)
    }

    /// Spawns `task` on the test's runtime, counting its polls.
    fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) -> AbortHandle {
        let polls = Arc::clone(&self.polls);
        let mut task = Box::pin(task);
        tokio::spawn(std::future::poll_fn(move |cx| {
            polls.fetch_add(1, Ordering::Relaxed);
            task.as_mut().poll(cx)
        }))
        .abort_handle()
    }

    /// Cancels `tasks` and lets the runtime drop them, so that they have
    /// left the gate's line when this returns.
    async fn abort(&self, tasks: &[AbortHandle]) {
        tasks.iter().for_each(AbortHandle::abort);
        self.settle().await;
    }

    /// Runs the spawned tasks until none is ready, without moving time:
    /// each `yield_now` lets the runtime poll every ready task (and fire the
    /// timers due now) before it polls the test's body again, so two rounds
    /// in a row without a poll mean that every task waits.
    async fn settle(&self) {
        let mut idle_rounds = 0;
        while idle_rounds < 2 {
            let before = self.polls();
            tokio::task::yield_now().await;
            idle_rounds = if self.polls() == before {
                idle_rounds + 1
            } else {
                0
            };
        }
    }

    /// Sleeps until `at` after the start of the test.
    async fn sleep_until(&self, at: Duration) {
        tokio::time::sleep_until(self.start + at).await;
    }

    /// Runs the tasks and moves time from timer to timer up to `until`,
    /// including the tasks whose timers fire right then.
    async fn run_until(&self, until: Duration) {
        self.run(Timers::OnTime, until).await;
    }

    async fn run(&self, timers: Timers, until: Duration) {
        self.settle().await;
        match timers {
            Timers::OnTime => self.sleep_until(until).await,
            Timers::Every(tick) => {
                // The test's body never waits on a timer here, so tokio never
                // moves time by itself: only these steps move it.
                while self.now() < until {
                    tokio::time::advance(tick.min(until - self.now())).await;
                    self.settle().await;
                }
            }
        }
        self.settle().await;
    }
}

fn new_gate(rate_per_second: f64, burst: u32) -> Arc<ProviderGate> {
    Arc::new(ProviderGate::new(rate_per_second, burst))
}

fn pool(members: &[MemberSpec], health: &ProviderHealthSettings) -> Arc<ProviderGate> {
    Arc::new(ProviderGate::pool(members, 0.0, health))
}

type Shared<T> = Arc<Mutex<T>>;

fn lock<T>(shared: &Shared<T>) -> MutexGuard<'_, T> {
    shared.lock().unwrap()
}

/// `callers` tasks, priorities mixed, each taking tokens back to back for
/// `run_for`. Returns the grant instants in order, as durations since the
/// call, and the number of task polls the runtime made.
async fn backlog(
    run: &Run,
    gate: &Arc<ProviderGate>,
    callers: usize,
    timers: Timers,
    run_for: Duration,
) -> (Vec<Duration>, u64) {
    let grants: Shared<Vec<Duration>> = Shared::default();
    let start = run.now();
    let polls_before = run.polls();
    let tasks: Vec<_> = (0..callers)
        .map(|i| {
            let (run2, gate, grants) = (run.clone(), Arc::clone(gate), Arc::clone(&grants));
            let priority = Priority::ALL[i % Priority::ALL.len()];
            run.spawn(async move {
                loop {
                    gate.acquire(priority).await;
                    lock(&grants).push(run2.now() - start);
                }
            })
        })
        .collect();
    run.run(timers, start + run_for).await;
    let polls = run.polls() - polls_before;
    run.abort(&tasks).await;
    let grants = lock(&grants).clone();
    if let Timers::Every(tick) = timers {
        // Only the steps moved the clock: every grant came at the end of one.
        let off_step = grants
            .iter()
            .filter(|at| at.as_nanos() % tick.as_nanos() != 0 && **at != run_for)
            .count();
        assert_eq!(off_step, 0, "grants between the steps of {tick:?}");
    }
    (grants, polls)
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
async fn pool_backlog(
    run: &Run,
    gate: &Arc<ProviderGate>,
    callers: usize,
    choice: Choice,
    run_for: Duration,
) -> Vec<(Duration, usize)> {
    let grants: Shared<Vec<(Duration, usize)>> = Shared::default();
    let start = run.now();
    let tasks: Vec<_> = (0..callers)
        .map(|i| {
            let (run2, gate, grants) = (run.clone(), Arc::clone(gate), Arc::clone(&grants));
            run.spawn(async move {
                loop {
                    let (_, member) = gate
                        .acquire_from(Priority::ALL[i % 3], &format!("t{}", i % 4), choice)
                        .await;
                    lock(&grants).push((run2.now(), member));
                }
            })
        })
        .collect();
    run.run_until(start + run_for).await;
    run.abort(&tasks).await;
    lock(&grants).clone()
}

fn of_member(grants: &[(Duration, usize)], member: usize) -> Vec<Duration> {
    grants
        .iter()
        .filter(|(_, m)| *m == member)
        .map(|(at, _)| *at)
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_quiet_tenant_beside_a_busy_one_takes_the_very_next_token() {
    let run = Run::new();
    let gate = new_gate(100.0, 1);
    let grants: Shared<Vec<(&str, Duration)>> = Shared::default();
    let waits: Shared<Vec<(Duration, Duration)>> = Shared::default();
    for _ in 0..8 {
        let (g, log, run2) = (Arc::clone(&gate), Arc::clone(&grants), run.clone());
        run.spawn(async move {
            loop {
                g.acquire_for(Priority::Normal, "busy").await;
                lock(&log).push(("busy", run2.now()));
            }
        });
    }
    // Quiet callers one at a time, each once the previous one got its
    // token, at whole milliseconds (tokio's timers) that fall at every
    // distance from the 10 ms token grid: 3, 6, 9, 2, 5, ... ms past it.
    let (g, log, run2, waits2) = (
        Arc::clone(&gate),
        Arc::clone(&grants),
        run.clone(),
        Arc::clone(&waits),
    );
    run.spawn(async move {
        for n in 0..20u64 {
            run2.sleep_until(SECOND + Duration::from_millis(53 * n + 3))
                .await;
            let asked = run2.now();
            let waited = g.acquire_for(Priority::Normal, "quiet").await;
            lock(&log).push(("quiet", run2.now()));
            lock(&waits2).push((asked, waited));
        }
    });
    run.run_until(3 * SECOND).await;
    for (n, (asked, waited)) in lock(&waits).iter().enumerate() {
        assert!(
            *waited <= 10 * MS,
            "quiet caller {n} asked at {asked:?} and waited {waited:?}: more than one token interval"
        );
    }
    let grants = lock(&grants);
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

#[tokio::test(start_paused = true)]
async fn a_call_held_up_after_its_grant_does_not_hold_up_every_later_call() {
    let run = Run::new();
    let gate = new_gate(100.0, 1);
    let calls: Shared<Vec<(Duration, Duration)>> = Shared::default();
    let (g, log, run2) = (Arc::clone(&gate), Arc::clone(&calls), run.clone());
    run.spawn(async move {
        for n in 0..100u32 {
            g.acquire(Priority::Normal).await;
            // Every tenth call is held up 8 ms between grant and call
            // (a slow claim); the others go at once.
            if n % 10 == 3 {
                tokio::time::sleep(8 * MS).await;
            }
            let paced = g.pace_call().await;
            lock(&log).push((run2.now(), paced));
        }
    });
    run.run_until(2 * SECOND).await;
    let calls = lock(&calls);
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

#[tokio::test(start_paused = true)]
async fn a_pool_uses_every_providers_rate_and_none_exceeds_its_own() {
    let run = Run::new();
    let health = ProviderHealthSettings::default();
    let gate = pool(&[spec("a", 1, 100.0, 5), spec("b", 1, 50.0, 3)], &health);
    let grants = pool_backlog(&run, &gate, 40, Choice::Any, 10 * SECOND).await;
    let (a, b) = (of_member(&grants, 0), of_member(&grants, 1));
    // Both start empty: 10 s earn 1,000 and 500 tokens.
    assert!(a.len() >= 999 && a.len() <= 1000, "a: {}", a.len());
    assert!(b.len() >= 499 && b.len() <= 500, "b: {}", b.len());
    let utilisation = grants.len() as f64 / 1500.0;
    assert!(utilisation >= 0.99, "utilisation {utilisation}");
    assert!(worst_window_excess(&a, 100.0, 5) <= 1e-9);
    assert!(worst_window_excess(&b, 50.0, 3) <= 1e-9);
}

#[tokio::test(start_paused = true)]
async fn the_view_of_tokens_starts_empty_fills_at_the_rate_up_to_the_burst_and_follows_grants() {
    let run = Run::new();
    let gate = pool(&[spec("a", 1, 10.0, 5)], &ProviderHealthSettings::default());
    assert_eq!(gate.tokens().await[0], Some(0), "a gate starts empty");
    run.run_until(Duration::from_millis(350)).await;
    assert_eq!(gate.tokens().await[0], Some(3), "10/s for 350 ms");
    run.run_until(2 * SECOND).await;
    assert_eq!(gate.tokens().await[0], Some(5), "never more than the burst");
    let g = Arc::clone(&gate);
    run.spawn(async move {
        for _ in 0..2 {
            g.acquire(Priority::Normal).await;
        }
    });
    run.settle().await;
    assert_eq!(gate.tokens().await[0], Some(3), "two grants took two");
}

#[tokio::test(start_paused = true)]
async fn spare_tokens_are_shared_by_weight() {
    let run = Run::new();
    let health = ProviderHealthSettings::default();
    // Both could take every call: 3:1 weights decide.
    let gate = pool(
        &[spec("a", 3, 1000.0, 100), spec("b", 1, 1000.0, 100)],
        &health,
    );
    run.run_until(SECOND).await;
    let grants: Shared<Vec<usize>> = Shared::default();
    let (g, log) = (Arc::clone(&gate), Arc::clone(&grants));
    run.spawn(async move {
        for _ in 0..400 {
            let (_, member) = g.acquire_from(Priority::Normal, "", Choice::Any).await;
            lock(&log).push(member);
            tokio::time::sleep(5 * MS).await;
        }
    });
    run.run_until(10 * SECOND).await;
    let grants = lock(&grants);
    let a = grants.iter().filter(|m| **m == 0).count();
    assert_eq!(grants.len(), 400);
    assert_eq!(a, 300, "weights 3:1 give a three quarters");
}

#[tokio::test(start_paused = true)]
async fn a_paused_provider_leaves_its_calls_to_the_others_and_choices_are_kept() {
    let run = Run::new();
    let health = ProviderHealthSettings::default();
    let gate = pool(&[spec("a", 1, 100.0, 5), spec("b", 1, 100.0, 5)], &health);
    gate.pause_member(0, 5 * SECOND);
    let grants = pool_backlog(&run, &gate, 20, Choice::Any, 2 * SECOND).await;
    assert!(
        grants.iter().all(|(_, m)| *m == 1),
        "paused a served nothing"
    );
    assert!(grants.len() >= 199, "b alone served {}", grants.len());
    // Only(0) waits for a's pause to end; Avoid(1) is the same here.
    let only = pool_backlog(&run, &gate, 4, Choice::Only(0), 4 * SECOND).await;
    assert!(
        only.iter().all(|(at, m)| *m == 0 && *at >= 5 * SECOND),
        "{only:?}"
    );
    assert!(!only.is_empty());
    let avoid = pool_backlog(&run, &gate, 4, Choice::Avoid(0), SECOND).await;
    assert!(avoid.iter().all(|(_, m)| *m == 1));
}

/// Issue 46: two equal providers, 20 calls a second, far under either's
/// rate; the first is paused 6 s (a breaker, a 429). It earns no credit
/// while out (with credit saved over the pause it took every call for
/// about 3 s), and once back it wins its half back on the health ramp:
/// from a tenth of its weight to all of it over `recover_secs` (20 s).
#[tokio::test(start_paused = true)]
async fn a_provider_back_from_a_pause_ramps_up_and_never_takes_more_than_its_weight() {
    let run = Run::new();
    let health = ProviderHealthSettings::default();
    assert_eq!(health.recover_secs, 20);
    let gate = pool(&[spec("a", 1, 100.0, 5), spec("b", 1, 100.0, 5)], &health);
    gate.pause_member(0, 6 * SECOND);
    let grants: Shared<Vec<(Duration, usize)>> = Shared::default();
    let start = run.now();
    let tasks: Vec<_> = (0..2)
        .map(|i| {
            let (run2, gate, grants) = (run.clone(), Arc::clone(&gate), Arc::clone(&grants));
            run.spawn(async move {
                loop {
                    let (_, member) = gate
                        .acquire_from(Priority::Normal, &format!("t{i}"), Choice::Any)
                        .await;
                    lock(&grants).push((run2.now(), member));
                    tokio::time::sleep(100 * MS).await;
                }
            })
        })
        .collect();
    run.run_until(start + 32 * SECOND).await;
    run.abort(&tasks).await;
    let grants = lock(&grants).clone();
    assert!(
        grants.iter().all(|(at, m)| *m == 1 || *at >= 6 * SECOND),
        "a served while paused"
    );
    let mut shares = Vec::new();
    for bin in (6..32).step_by(2) {
        let in_bin: Vec<usize> = grants
            .iter()
            .filter(|(at, _)| *at >= SECOND * bin && *at < SECOND * (bin + 2))
            .map(|(_, m)| *m)
            .collect();
        let a = in_bin.iter().filter(|m| **m == 0).count();
        assert!(
            in_bin.len() >= 38,
            "{} calls in {bin}..{} s",
            in_bin.len(),
            bin + 2
        );
        assert!(
            a * 2 <= in_bin.len() + 2,
            "a took {a} of {} calls in {bin}..{} s",
            in_bin.len(),
            bin + 2
        );
        shares.push(a as f64 / in_bin.len() as f64);
    }
    // Weight × factor against b's 1: a tenth's share is 0.09 at first,
    // 0.33 halfway (factor 0.55), a half once back in full.
    assert!(shares[0] <= 0.2, "a's share just back: {shares:?}");
    assert!(
        (0.2..=0.45).contains(&shares[5]),
        "a's share halfway up the ramp: {shares:?}"
    );
    assert!(shares[12] >= 0.4, "a's share after the ramp: {shares:?}");
    assert!(
        shares[0] < shares[5] && shares[5] < shares[12],
        "a's share grows: {shares:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_provider_marked_down_gets_nothing_then_its_share_back_gradually() {
    let run = Run::new();
    let health = ProviderHealthSettings {
        window_secs: 2,
        min_calls: 5,
        max_failure_rate: 0.5,
        max_latency_ms: 1000,
        max_receipt_delay_ms: 60_000,
        down_secs: 2,
        recover_secs: 4,
    };
    let gate = pool(&[spec("a", 1, 100.0, 5), spec("b", 1, 100.0, 5)], &health);
    run.run_until(SECOND).await;
    let marked = (0..5).any(|_| gate.record_outcome(0, true, MS));
    assert!(marked);
    let view = gate.view();
    assert_eq!(view[0].share, 0.0);
    assert_eq!(view[1].share, 1.0);
    assert_eq!(view[0].health.state, health::State::Down);
    // Under a backlog: nothing for a while it is down, a small part
    // while it recovers, its whole rate after.
    let grants = pool_backlog(&run, &gate, 40, Choice::Any, 8 * SECOND).await;
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

#[tokio::test(start_paused = true)]
async fn no_window_ever_holds_more_than_burst_plus_rate_times_its_length() {
    // 26.67/s has a token interval of 37.49 ms, which tokio's timers round
    // up to 38 ms: a token is only ever granted at or after it is due, so
    // the rounding can only make windows hold fewer grants, and the bound
    // stays exact.
    let run = Run::new();
    for (rate, burst, timers) in [
        (20.0, 5, Timers::OnTime),
        (26.67, 10, Timers::OnTime),
        (26.67, 1, Timers::OnTime),
        (20.0, 5, Timers::Every(7 * MS)),
    ] {
        let gate = new_gate(rate, burst);
        let (grants, _) = backlog(&run, &gate, 50, timers, 30 * SECOND).await;
        assert!(
            grants.len() > 500,
            "the run made only {} grants",
            grants.len()
        );
        let excess = worst_window_excess(&grants, rate, burst);
        assert!(
            excess <= 1e-6,
            "{rate}/s burst {burst} {timers:?}: a window held {excess} grants too many"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_backlog_uses_at_least_99_percent_of_the_configured_rate() {
    // Timers every 7 ms model a late wake-up on a busy machine; a burst of
    // two or more absorbs lateness shorter than a token interval, and so
    // it does tokio's rounding of 37.49 ms (26.67/s) up to 38 ms. (With a
    // burst of 1 that rounding alone would cost 1.3 % of the rate.)
    // The gate starts empty, so every grant is one the rate earned.
    let run = Run::new();
    for (rate, burst, timers) in [
        (20.0, 5, Timers::OnTime),
        (26.67, 10, Timers::OnTime),
        (26.67, 10, Timers::Every(7 * MS)),
    ] {
        let gate = new_gate(rate, burst);
        let (grants, _) = backlog(&run, &gate, 50, timers, 30 * SECOND).await;
        let granted = grants.len() as f64;
        assert!(
            granted >= 0.99 * rate * 30.0,
            "{rate}/s burst {burst} {timers:?}: only {granted} grants in 30 s"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_new_gate_starts_empty_and_grants_no_more_than_its_rate_has_earned_since() {
    // Built with 50 callers waiting: the bucket has no token at first, so
    // by any instant t after it was built at most rate × t calls have
    // gone, whatever the burst; the first token is due one interval in
    // (at 37.49 ms for 26.67/s: tokio's timer wakes the head at 38 ms,
    // hence the one tick of slack).
    let run = Run::new();
    for (rate, burst) in [(20.0, 5), (26.67, 10), (10.0, 1)] {
        let gate = new_gate(rate, burst);
        let (grants, _) = backlog(&run, &gate, 50, Timers::OnTime, 3 * SECOND).await;
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
/// over and over; returns the tasks, to abort (a kill).
fn callers(
    run: &Run,
    gate: &Arc<ProviderGate>,
    count: usize,
    calls: &Shared<Vec<Duration>>,
) -> Vec<AbortHandle> {
    (0..count)
        .map(|i| {
            let (run2, gate, calls) = (run.clone(), Arc::clone(gate), Arc::clone(calls));
            run.spawn(async move {
                loop {
                    gate.acquire(Priority::ALL[i % 3]).await;
                    gate.pace_call().await;
                    lock(&calls).push(run2.now());
                }
            })
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_process_started_right_after_another_stopped_keeps_the_provider_within_burst_plus_rate() {
    // The first process idles (its bucket fills), takes its whole burst
    // in a rush at 4.9 s, goes on at the rate and is killed at 5 s, or 5
    // ms later. A second process starts that instant with a backlog. The
    // provider sees both: together they must keep burst + rate × t, which
    // a second process starting with a full bucket would break (its
    // burst on top of the first one's).
    for gap in [Duration::ZERO, 5 * MS] {
        let run = Run::new();
        let calls: Shared<Vec<Duration>> = Shared::default();
        let first = new_gate(20.0, 5);
        run.run_until(4900 * MS).await;
        let running = callers(&run, &first, 50, &calls);
        run.run_until(5 * SECOND).await;
        run.abort(&running).await;
        let before_restart = lock(&calls).len();
        assert!(
            before_restart >= 5,
            "{before_restart} calls before the kill"
        );
        run.run_until(5 * SECOND + gap).await;
        let second = new_gate(20.0, 5);
        let running = callers(&run, &second, 50, &calls);
        run.run_until(8 * SECOND).await;
        run.abort(&running).await;
        let calls = lock(&calls);
        assert!(calls.len() > before_restart + 50);
        let excess = worst_window_excess(&calls, 20.0, 5);
        assert!(
            excess <= 1e-6,
            "gap {gap:?}: a window held {excess} calls above burst + rate × t: {calls:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn in_the_first_second_after_start_high_priority_callers_are_served_first() {
    // Low callers arrive at the start, two high ones 10 ms later. A gate
    // starting full would have handed the lows its burst before the
    // highs came; an empty one serves the highs with its first tokens.
    let run = Run::new();
    let gate = new_gate(10.0, 5);
    let log = Log::default();
    for i in 1..=4 {
        queue(&run, &gate, &log, &format!("low{i}"), Priority::Low).await;
    }
    run.run_until(10 * MS).await;
    queue(&run, &gate, &log, "high1", Priority::High).await;
    queue(&run, &gate, &log, "high2", Priority::High).await;
    run.run_until(SECOND).await;
    assert_eq!(
        names(&log),
        ["high1", "high2", "low1", "low2", "low3", "low4"]
    );
    assert_eq!(lock(&log)[0].1, 100 * MS);
}

#[tokio::test(start_paused = true)]
async fn a_pause_of_any_length_holds_the_gate_without_overflowing() {
    let run = Run::new();
    let gate = empty_gate();
    gate.pause_for(Duration::MAX);
    let log = Log::default();
    queue(&run, &gate, &log, "held", Priority::High).await;
    run.run_until(10 * SECOND).await;
    assert!(lock(&log).is_empty(), "{:?}", lock(&log));
    assert_eq!(gate.waiting(), [1, 0, 0]);
}

#[tokio::test(start_paused = true)]
async fn the_line_tells_how_many_callers_each_tenant_has_waiting() {
    let run = Run::new();
    let gate = empty_gate();
    gate.pause_for(Duration::MAX);
    let log = Log::default();
    for (name, tenant) in [("a1", "a"), ("a2", "a"), ("b1", "b")] {
        queue_for(&run, &gate, &log, name, tenant).await;
    }
    queue(&run, &gate, &log, "high", Priority::High).await;
    run.run_until(SECOND).await;
    let waiting = gate.waiting_by_tenant();
    let count = |tenant: &str| waiting.get(tenant).copied().unwrap_or(0);
    assert_eq!(
        (count("a"), count("b"), count("")),
        (2, 1, 1),
        "{waiting:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn after_an_idle_spell_only_burst_callers_pass_at_once_then_the_rate_resumes() {
    let run = Run::new();
    let gate = new_gate(20.0, 5);
    // Empty the bucket first, so a refill beyond `burst` would show.
    let (drained, _) = backlog(&run, &gate, 10, Timers::OnTime, 5 * SECOND).await;
    assert!(drained.len() >= 100);
    run.run_until(run.now() + 10 * SECOND).await;

    let rush = run.now();
    let grants: Shared<Vec<Duration>> = Shared::default();
    for _ in 0..100 {
        let (run2, gate, grants) = (run.clone(), Arc::clone(&gate), Arc::clone(&grants));
        run.spawn(async move {
            gate.acquire(Priority::Normal).await;
            lock(&grants).push(run2.now());
        });
    }
    run.run_until(rush + SECOND).await;
    let grants = lock(&grants);
    let at_once = grants.iter().filter(|&&at| at == rush).count();
    assert_eq!(at_once, 5, "grants in the first instant after idling");
    // Then one every 50 ms: 20 more within the second.
    assert_eq!(grants.len(), 5 + 20);
    assert_eq!(grants[5], rush + 50 * MS);
    assert_eq!(gate.waiting(), [0, 75, 0]);
}

#[tokio::test(start_paused = true)]
async fn a_pause_holds_every_caller_and_the_rate_resumes_after_it() {
    let run = Run::new();
    let gate = empty_gate();
    let log = Log::default();
    // A 429 with Retry-After: 2 at 50 ms: nobody passes before 2,050 ms,
    // neither the callers waiting then nor those arriving meanwhile.
    queue(&run, &gate, &log, "waiting", Priority::Normal).await;
    run.run_until(50 * MS).await;
    gate.pause_for(2 * SECOND);
    run.run_until(SECOND).await;
    queue(&run, &gate, &log, "high", Priority::High).await;
    queue(&run, &gate, &log, "later", Priority::Normal).await;
    run.run_until(2 * SECOND).await;
    assert!(
        lock(&log).is_empty(),
        "granted during the pause: {:?}",
        lock(&log)
    );
    run.run_until(3 * SECOND).await;
    let log = lock(&log);
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

#[tokio::test(start_paused = true)]
async fn calls_bunched_after_a_stall_are_spaced_again_at_the_call() {
    // 10/s, burst 2. Twenty callers take their tokens over about two
    // seconds, but the calls are held up (a stalled store write) until
    // 2.5 s; then they all pace at once.
    let run = Run::new();
    let gate = new_gate(10.0, 2);
    let calls: Shared<Vec<Duration>> = Shared::default();
    for _ in 0..20 {
        let (gate, calls, run2) = (Arc::clone(&gate), Arc::clone(&calls), run.clone());
        run.spawn(async move {
            gate.acquire(Priority::Normal).await;
            run2.sleep_until(2500 * MS).await;
            gate.pace_call().await;
            lock(&calls).push(run2.now());
        });
    }
    run.run_until(10 * SECOND).await;
    let calls = lock(&calls);
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

#[tokio::test(start_paused = true)]
async fn after_a_pause_one_call_goes_then_the_rate_resumes_without_a_burst() {
    // 20/s burst 5, under a backlog; a 2 s pause at 3 s lets the bucket
    // refill, which must not come out as a burst when the pause ends.
    let run = Run::new();
    let gate = new_gate(20.0, 5);
    let calls: Shared<Vec<Duration>> = Shared::default();
    callers(&run, &gate, 30, &calls);
    run.run_until(3 * SECOND).await;
    gate.pause_for(2 * SECOND);
    let paused_at = lock(&calls).len();
    run.run_until(7 * SECOND).await;
    let calls = lock(&calls);
    let after: Vec<Duration> = calls[paused_at..].to_vec();
    assert!(after[0] >= 5 * SECOND, "a call during the pause: {after:?}");
    assert_eq!(after[0], 5 * SECOND, "the call at the end of the pause");
    assert_eq!(after[1], 5050 * MS, "then one every 50 ms: {after:?}");
    assert_eq!(after[2], 5100 * MS, "{after:?}");
    assert_eq!(after.len(), 41, "{after:?}");
    assert!(worst_window_excess(&calls, 20.0, 5) <= 1e-6);
}

#[tokio::test(start_paused = true)]
async fn a_shorter_pause_does_not_cut_a_longer_one() {
    let run = Run::new();
    let gate = empty_gate();
    let log = Log::default();
    gate.pause_for(SECOND);
    gate.pause_for(200 * MS);
    queue(&run, &gate, &log, "one", Priority::Normal).await;
    run.run_until(2 * SECOND).await;
    assert_eq!(lock(&log)[0].1, SECOND);
}

/// A 10/s, burst-1 gate built now: it starts empty, so the first token is
/// due 100 ms from now and one every 100 ms after.
fn empty_gate() -> Arc<ProviderGate> {
    new_gate(10.0, 1)
}

type Log = Shared<Vec<(String, Duration, Duration)>>;

/// Queues a caller named `name` that logs (name, grant time, wait), and
/// lets it join the line.
async fn queue(
    run: &Run,
    gate: &Arc<ProviderGate>,
    log: &Log,
    name: &str,
    priority: Priority,
) -> AbortHandle {
    let (run2, gate, log, name) = (
        run.clone(),
        Arc::clone(gate),
        Arc::clone(log),
        name.to_string(),
    );
    let task = run.spawn(async move {
        let waited = gate.acquire(priority).await;
        lock(&log).push((name, run2.now(), waited));
    });
    run.settle().await;
    task
}

fn names(log: &Log) -> Vec<String> {
    lock(log).iter().map(|(name, _, _)| name.clone()).collect()
}

#[tokio::test(start_paused = true)]
async fn a_high_caller_arriving_behind_queued_low_waiters_gets_the_very_next_token() {
    let run = Run::new();
    let gate = empty_gate();
    let log = Log::default();
    for i in 1..=5 {
        queue(&run, &gate, &log, &format!("low{i}"), Priority::Low).await;
    }
    run.run_until(30 * MS).await;
    queue(&run, &gate, &log, "high", Priority::High).await;
    assert_eq!(gate.waiting(), [1, 0, 5]);

    run.run_until(100 * MS).await;
    assert_eq!(lock(&log)[..], [("high".to_string(), 100 * MS, 70 * MS)]);
    run.run_until(SECOND).await;
    assert_eq!(
        names(&log),
        ["high", "low1", "low2", "low3", "low4", "low5"]
    );
    assert_eq!(lock(&log)[5].1, 600 * MS);
}

#[tokio::test(start_paused = true)]
async fn normal_waiters_go_before_low_ones_and_each_priority_keeps_arrival_order() {
    let run = Run::new();
    let gate = empty_gate();
    let log = Log::default();
    queue(&run, &gate, &log, "low1", Priority::Low).await;
    queue(&run, &gate, &log, "normal1", Priority::Normal).await;
    queue(&run, &gate, &log, "low2", Priority::Low).await;
    queue(&run, &gate, &log, "normal2", Priority::Normal).await;
    queue(&run, &gate, &log, "high1", Priority::High).await;
    assert_eq!(gate.waiting(), [1, 2, 2]);
    run.run_until(SECOND).await;
    assert_eq!(names(&log), ["high1", "normal1", "normal2", "low1", "low2"]);
    let times: Vec<_> = lock(&log).iter().map(|(_, at, _)| *at).collect();
    assert_eq!(times, [100 * MS, 200 * MS, 300 * MS, 400 * MS, 500 * MS]);
}

/// Queues a caller of `tenant` named `name`, logging like [`queue`].
async fn queue_for(run: &Run, gate: &Arc<ProviderGate>, log: &Log, name: &str, tenant: &str) {
    let (run2, gate, log, name, tenant) = (
        run.clone(),
        Arc::clone(gate),
        Arc::clone(log),
        name.to_string(),
        tenant.to_string(),
    );
    run.spawn(async move {
        let waited = gate.acquire_for(Priority::Normal, &tenant).await;
        lock(&log).push((name, run2.now(), waited));
    });
    run.settle().await;
}

#[tokio::test(start_paused = true)]
async fn tenants_of_one_priority_take_turns_so_a_first_message_is_not_behind_a_backlog() {
    let run = Run::new();
    let gate = empty_gate();
    let log = Log::default();
    for i in 1..=4 {
        queue_for(&run, &gate, &log, &format!("big{i}"), "big").await;
    }
    queue_for(&run, &gate, &log, "small1", "small").await;
    queue_for(&run, &gate, &log, "other1", "other").await;
    queue_for(&run, &gate, &log, "small2", "small").await;
    run.run_until(SECOND).await;
    assert_eq!(
        names(&log),
        ["big1", "small1", "other1", "big2", "small2", "big3", "big4"]
    );
}

/// Ten high callers and two low ones taking tokens of `gate` back to back
/// for `run_for`; returns the grants by priority rank.
async fn flood(run: &Run, gate: &Arc<ProviderGate>, run_for: Duration) -> [usize; PRIORITIES] {
    let counts: Shared<[usize; PRIORITIES]> = Shared::default();
    let tasks: Vec<_> = (0..12)
        .map(|i| {
            let priority = if i < 10 {
                Priority::High
            } else {
                Priority::Low
            };
            let (gate, counts) = (Arc::clone(gate), Arc::clone(&counts));
            run.spawn(async move {
                loop {
                    gate.acquire(priority).await;
                    lock(&counts)[priority.rank()] += 1;
                }
            })
        })
        .collect();
    run.run_until(run.now() + run_for).await;
    run.abort(&tasks).await;
    *lock(&counts)
}

#[tokio::test(start_paused = true)]
async fn under_a_flood_of_high_callers_low_ones_still_get_their_share_of_tokens() {
    let run = Run::new();
    let gate = Arc::new(ProviderGate::with_share(100.0, 1, 0.1));
    let [high, _, low] = flood(&run, &gate, 20 * SECOND).await;
    let share = low as f64 / (high + low) as f64;
    assert!(
        (0.085..=0.1).contains(&share),
        "low got {low} of {} tokens",
        high + low
    );
    // Strict priority (share 0) would give low nothing at all.
    let strict = new_gate(100.0, 1);
    let [_, _, low] = flood(&run, &strict, 5 * SECOND).await;
    assert!(low <= 2, "low got {low}");
}

#[tokio::test(start_paused = true)]
async fn the_share_rule_keeps_the_gate_within_burst_plus_rate() {
    let run = Run::new();
    let gate = Arc::new(ProviderGate::with_share(50.0, 5, 0.2));
    let (grants, _) = backlog(&run, &gate, 30, Timers::OnTime, 10 * SECOND).await;
    assert!(worst_window_excess(&grants, 50.0, 5) <= 1e-9);
    assert!(grants.len() as f64 >= 0.99 * 50.0 * 10.0);
}

#[tokio::test(start_paused = true)]
async fn a_caller_coming_back_for_another_token_queues_behind_those_already_waiting() {
    // Timers firing only every 250 ms let two tokens pile up while the
    // head sleeps, so at the wake-up one is still free when the served
    // caller asks again.
    let run = Run::new();
    let gate = new_gate(10.0, 5);
    let log = Log::default();
    for name in ["a", "b", "c"] {
        let (run2, gate, log) = (run.clone(), Arc::clone(&gate), Arc::clone(&log));
        run.spawn(async move {
            loop {
                let waited = gate.acquire(Priority::Normal).await;
                lock(&log).push((name.to_string(), run2.now(), waited));
            }
        });
    }
    run.run(Timers::Every(250 * MS), SECOND).await;
    let served: Vec<_> = names(&log).into_iter().take(9).collect();
    assert_eq!(served, ["a", "b", "c", "a", "b", "c", "a", "b", "c"]);
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_head_of_line_does_not_swallow_the_next_token() {
    let run = Run::new();
    let gate = empty_gate();
    let log = Log::default();
    queue(&run, &gate, &log, "low", Priority::Low).await;
    let high = queue(&run, &gate, &log, "high", Priority::High).await;
    run.run_until(50 * MS).await;
    run.abort(&[high]).await;
    assert_eq!(gate.waiting(), [0, 0, 1]);
    run.run_until(SECOND).await;
    assert_eq!(lock(&log)[..], [("low".to_string(), 100 * MS, 100 * MS)]);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_that_times_out_leaves_the_next_token_to_the_one_behind_it() {
    let run = Run::new();
    let gate = empty_gate();
    let log = Log::default();
    let timed_out: Shared<Option<(bool, Duration)>> = Shared::default();
    {
        let (run2, gate, timed_out) = (run.clone(), Arc::clone(&gate), Arc::clone(&timed_out));
        run.spawn(async move {
            let outcome = tokio::time::timeout(50 * MS, gate.acquire(Priority::High)).await;
            *lock(&timed_out) = Some((outcome.is_err(), run2.now()));
        });
    }
    queue(&run, &gate, &log, "normal", Priority::Normal).await;
    queue(&run, &gate, &log, "low", Priority::Low).await;
    run.run_until(SECOND).await;
    assert_eq!(*lock(&timed_out), Some((true, 50 * MS)));
    assert_eq!(names(&log), ["normal", "low"]);
    assert_eq!(lock(&log)[0].1, 100 * MS);
    assert_eq!(lock(&log)[1].1, 200 * MS);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_cancelled_just_after_being_woken_as_head_passes_the_turn_on() {
    let run = Run::new();
    let gate = empty_gate();
    let log = Log::default();
    let normal: Shared<Option<AbortHandle>> = Shared::default();
    {
        // The high caller, once served, cancels the normal caller that
        // its grant just woke, before that caller has run.
        let (run2, gate, log, normal) = (
            run.clone(),
            Arc::clone(&gate),
            Arc::clone(&log),
            Arc::clone(&normal),
        );
        run.spawn(async move {
            let waited = gate.acquire(Priority::High).await;
            lock(&log).push(("high".to_string(), run2.now(), waited));
            lock(&normal).take().expect("normal caller queued").abort();
        });
    }
    let task = queue(&run, &gate, &log, "normal", Priority::Normal).await;
    *lock(&normal) = Some(task);
    queue(&run, &gate, &log, "low", Priority::Low).await;
    run.run_until(SECOND).await;
    assert_eq!(names(&log), ["high", "low"]);
    assert_eq!(lock(&log)[1].1, 200 * MS);
    assert_eq!(gate.waiting(), [0, 0, 0]);
}

#[tokio::test(start_paused = true)]
async fn waiting_callers_are_woken_about_once_per_grant_not_once_per_waiter() {
    let run = Run::new();
    let gate = new_gate(20.0, 5);
    let (grants, polls) = backlog(&run, &gate, 50, Timers::OnTime, 30 * SECOND).await;
    // Each grant: the served caller returns and queues again, the next
    // head wakes and goes to sleep on the clock, the clock wakes it.
    let per_grant = polls as f64 / grants.len() as f64;
    assert!(per_grant <= 4.0, "{per_grant} polls per grant");
}

#[tokio::test(start_paused = true)]
async fn on_tokio_time_a_caller_waits_until_its_token_is_due() {
    let start = Instant::now();
    let gate = ProviderGate::new(4.0, 1);
    let first = gate.acquire(Priority::Normal).await;
    let waited = gate.acquire(Priority::Normal).await;
    // The gate starts empty: the first token is due 250 ms after it was
    // built, the second 250 ms after that; the caller sleeps on tokio's
    // clock until each.
    assert_eq!(first, 250 * MS, "the first caller's wait");
    assert_eq!(waited, 250 * MS, "the second caller's wait");
    assert_eq!(start.elapsed(), 500 * MS);
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

#[tokio::test(start_paused = true)]
async fn reports_the_rate_achieved_by_a_20_per_second_gate_over_30_seconds() {
    let run = Run::new();
    let gate = new_gate(20.0, 5);
    let (grants, _) = backlog(&run, &gate, 50, Timers::OnTime, 30 * SECOND).await;
    let at_start = grants.iter().filter(|&&at| at == Duration::ZERO).count();
    let achieved = grants.len() as f64 / 30.0;
    println!(
        "provider gate at {}/s burst {}: {} grants in 30 s of paused tokio time \
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
