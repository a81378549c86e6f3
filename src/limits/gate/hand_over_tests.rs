//! The line's hand-over, driven through every order of its operations: a
//! waiter joining, leaving served in turn or out of it (its Redis call
//! answered after another became the head), leaving cancelled or timed out,
//! and a caller served without waiting. After each one the head must be the
//! one it was (running, by induction), the caller who made the change, or
//! hold a wake-up; a head asleep without one is the lost wake-up that once
//! stopped a gate for good. The watchdog is checked on the paused clock.

use futures_util::FutureExt;
use proptest::prelude::*;

use super::line::Place;
use super::*;

#[derive(Debug, Clone)]
enum Op {
    Join {
        rank: usize,
        tenant: u8,
    },
    /// The `pick`-th waiter (modulo how many wait) got its token.
    Served {
        pick: usize,
    },
    /// The `pick`-th waiter's `acquire` was dropped.
    Cancelled {
        pick: usize,
    },
    /// A caller who found nobody of its priority waiting took a token.
    Grant {
        rank: usize,
        tenant: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..PRIORITIES, 0..4u8).prop_map(|(rank, tenant)| Op::Join { rank, tenant }),
        3 => any::<usize>().prop_map(|pick| Op::Served { pick }),
        2 => any::<usize>().prop_map(|pick| Op::Cancelled { pick }),
        1 => (0..PRIORITIES, 0..4u8).prop_map(|(rank, tenant)| Op::Grant { rank, tenant }),
    ]
}

/// True (and the wake-up used up) when `place` holds a wake-up.
fn woken(place: &Place<'_>) -> bool {
    place.wake.notified().now_or_never().is_some()
}

fn check_hand_over(gate: &ProviderGate, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut places: Vec<Place<'_>> = Vec::new();
    for op in ops {
        let before = gate.line().head_id();
        let mut actor = None;
        match *op {
            Op::Join { rank, tenant } => {
                let place = gate.line().join(gate, rank, &format!("t{tenant}"));
                actor = Some(place.id);
                places.push(place);
            }
            Op::Served { pick } if !places.is_empty() => {
                let place = places.remove(pick % places.len());
                gate.line().leave(place.rank, place.id, true);
                place.served();
            }
            Op::Cancelled { pick } if !places.is_empty() => {
                drop(places.remove(pick % places.len()));
            }
            Op::Grant { rank, tenant } => {
                let mut line = gate.line();
                if line.would_lead(rank) {
                    line.record_grant(rank, &format!("t{tenant}"));
                }
            }
            _ => {}
        }
        let head = gate.line().head_id();
        for place in &places {
            let had_wake = woken(place);
            if Some(place.id) == head && head != before && head != actor {
                prop_assert!(
                    had_wake,
                    "after {op:?} waiter {} became the head without a wake-up",
                    place.id
                );
            }
        }
        let waiting: usize = gate.waiting().iter().sum();
        prop_assert_eq!(waiting, places.len());
        prop_assert_eq!(head.is_some(), !places.is_empty());
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn whoever_becomes_the_head_of_the_line_is_woken(
        ops in proptest::collection::vec(op(), 1..60),
        share in prop_oneof![Just(0.0), Just(0.1), Just(0.5)],
    ) {
        let gate = ProviderGate::with_share(10.0, 1, share);
        check_hand_over(&gate, &ops)?;
    }
}

/// The sequence that stopped a gate in production, by hand. Tenant a was
/// served a moment ago. Its next high caller is the head and its Redis call
/// is under way; a low caller waits. A high caller of tenant b, never
/// served, arrives and goes ahead of a (start-time fair queuing): b's
/// caller is the head now, and running. a's call answers, so a's caller
/// takes its token and leaves out of turn; the grant gives low its share,
/// so the low caller is the head now. It was asleep: unless it is woken, b's
/// caller finds it is no longer the head and sleeps too, and nobody ever
/// asks for a token again.
#[test]
fn a_waiter_served_out_of_turn_wakes_the_head_it_leaves_behind() {
    let gate = ProviderGate::with_share(10.0, 1, 0.5);
    let high = Priority::High.rank();
    // a's first caller is served in turn while the low caller waits: low
    // earns half a turn, and a was served last.
    let first = gate.line().join(&gate, high, "a");
    let low = gate.line().join(&gate, Priority::Low.rank(), "c");
    gate.line().leave(first.rank, first.id, true);
    first.served();
    // a's next caller is the head (high goes first) and asks Redis.
    let a = gate.line().join(&gate, high, "a");
    assert_eq!(gate.line().head_id(), Some(a.id));
    let _ = woken(&low);
    // b, never served, goes ahead of a, which was: b is the head, running.
    let b = gate.line().join(&gate, high, "b");
    assert_eq!(gate.line().head_id(), Some(b.id), "b goes ahead of a");
    // a's Redis call answers: it takes its token, out of turn.
    gate.line().leave(a.rank, a.id, true);
    a.served();
    assert_eq!(
        gate.line().head_id(),
        Some(low.id),
        "low's share makes it the head"
    );
    assert!(
        woken(&low),
        "the new head was not woken: the line would stop"
    );
    drop(b);
}

#[tokio::test(start_paused = true)]
async fn the_watchdog_wakes_a_line_whose_head_does_not_act_and_readiness_sees_it_persist() {
    let gate = ProviderGate::with_share(10.0, 1, 0.0);
    assert!(!gate.watch(), "an empty line is never stuck");
    // A waiter that never acts: its place is held, nobody runs its acquire.
    let place = gate.line().join(&gate, Priority::Normal.rank(), "a");
    tokio::time::advance(STALL_GRACE / 2).await;
    assert!(!gate.watch(), "within the grace the head may still act");
    assert_eq!(gate.stuck_for(), None);
    tokio::time::advance(STALL_GRACE).await;
    assert!(gate.watch(), "past its grace the line is stuck");
    assert!(woken(&place), "the watchdog woke the head");
    assert_eq!(gate.stalls(), 1);
    // Still no one acts: the stall goes on and its age grows.
    for _ in 0..3 {
        tokio::time::advance(STALL_GRACE + Duration::from_millis(1)).await;
        assert!(gate.watch());
    }
    let stuck = gate.stuck_for().expect("stuck");
    assert!(stuck >= STUCK_UNREADY, "stuck for {stuck:?}");
    // The head acts (it asks for a token due in 100 ms): the stall is over.
    {
        let mut line = gate.line();
        let due = gate.timeline.now() + Nanos::from(Duration::from_millis(100));
        line.expect_head_by(due);
    }
    assert_eq!(gate.stuck_for(), None);
    assert!(!gate.watch());
    drop(place);
    tokio::time::advance(STALL_GRACE * 3).await;
    assert!(!gate.watch(), "nobody waits");
}

#[tokio::test(start_paused = true)]
async fn a_backlog_served_on_the_clock_never_trips_the_watchdog() {
    let gate = Arc::new(ProviderGate::with_share(2.0, 1, 0.1));
    let mut tasks = Vec::new();
    for i in 0..12 {
        let gate = Arc::clone(&gate);
        tasks.push(tokio::spawn(async move {
            let priority = Priority::ALL[i % 3];
            gate.acquire_for(priority, &format!("t{}", i % 4)).await;
        }));
    }
    // 12 callers at 2/s: about 6 s of tokens, with the head asleep on the
    // clock between them; a watchdog round every second finds no stall.
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!gate.watch(), "a line moving on the clock is not stuck");
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(gate.stalls(), 0);
}
