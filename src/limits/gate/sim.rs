//! A simulated clock and a single-threaded executor for the tests: every
//! ready task runs before time moves on to the next timer, the way tokio's
//! paused clock does, and every timer fires on a tick boundary, the way
//! tokio's millisecond timer wheel does.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use governor::nanos::Nanos;

use super::{ProviderGate, Timeline};

/// Simulated time in nanoseconds and the timers waiting on it.
pub struct SimClock {
    /// Timers fire on multiples of this many nanoseconds.
    tick: u64,
    state: Mutex<ClockState>,
}

#[derive(Default)]
struct ClockState {
    now: u64,
    next_key: u64,
    /// Pending timers by (fire time, key).
    timers: BTreeMap<(u64, u64), Waker>,
}

impl SimClock {
    pub fn now(&self) -> Nanos {
        Nanos::from(self.state.lock().unwrap().now)
    }

    pub fn sleep_until(self: &Arc<Self>, at: Nanos) -> SimSleep {
        let fire_at = at.as_u64().div_ceil(self.tick).saturating_mul(self.tick);
        SimSleep {
            clock: Arc::clone(self),
            fire_at,
            key: None,
        }
    }

    fn next_timer(&self) -> Option<u64> {
        let state = self.state.lock().unwrap();
        state.timers.keys().next().map(|&(at, _)| at)
    }

    /// Moves time to `to` and wakes the timers due by then.
    fn advance_to(&self, to: u64) {
        let mut state = self.state.lock().unwrap();
        state.now = state.now.max(to);
        let first_later = (state.now + 1, 0);
        let later = state.timers.split_off(&first_later);
        let due = std::mem::replace(&mut state.timers, later);
        drop(state);
        due.into_values().for_each(Waker::wake);
    }
}

pub struct SimSleep {
    clock: Arc<SimClock>,
    fire_at: u64,
    key: Option<(u64, u64)>,
}

impl Future for SimSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let mut state = this.clock.state.lock().unwrap();
        if state.now >= this.fire_at {
            if let Some(key) = this.key.take() {
                state.timers.remove(&key);
            }
            return Poll::Ready(());
        }
        let key = *this.key.get_or_insert_with(|| {
            state.next_key += 1;
            (this.fire_at, state.next_key)
        });
        state.timers.insert(key, cx.waker().clone());
        Poll::Pending
    }
}

impl Drop for SimSleep {
    fn drop(&mut self) {
        if let Some(key) = self.key {
            self.clock.state.lock().unwrap().timers.remove(&key);
        }
    }
}

/// Resolves to `None` if `future` is not done `after` from now.
pub async fn timeout<F: Future>(
    clock: &Arc<SimClock>,
    after: Duration,
    future: F,
) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    let mut sleep = clock.sleep_until(Nanos::from(Duration::from(clock.now()) + after));
    std::future::poll_fn(|cx| {
        if let Poll::Ready(output) = future.as_mut().poll(cx) {
            return Poll::Ready(Some(output));
        }
        Pin::new(&mut sleep).poll(cx).map(|()| None)
    })
    .await
}

type Task = Pin<Box<dyn Future<Output = ()>>>;

/// Polls tasks in the order they were woken; cloning shares it, so a
/// task can abort another.
#[derive(Clone)]
pub struct Sim(Rc<Executor>);

struct Executor {
    clock: Arc<SimClock>,
    tasks: RefCell<HashMap<usize, Task>>,
    ready: Arc<Mutex<VecDeque<usize>>>,
    next_id: Cell<usize>,
    polls: Cell<u64>,
}

struct TaskWaker {
    id: usize,
    ready: Arc<Mutex<VecDeque<usize>>>,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.ready.lock().unwrap().push_back(self.id);
    }
}

impl Sim {
    /// Starts at time zero; timers fire on multiples of `tick`.
    pub fn new(tick: Duration) -> Self {
        let clock = SimClock {
            tick: Nanos::from(tick).as_u64().max(1),
            state: Mutex::default(),
        };
        Sim(Rc::new(Executor {
            clock: Arc::new(clock),
            tasks: RefCell::default(),
            ready: Arc::default(),
            next_id: Cell::new(0),
            polls: Cell::new(0),
        }))
    }

    pub fn gate(&self, rate_per_second: f64, burst: u32) -> Arc<ProviderGate> {
        self.gate_with_share(rate_per_second, burst, 0.0)
    }

    pub fn gate_with_share(
        &self,
        rate_per_second: f64,
        burst: u32,
        share: f64,
    ) -> Arc<ProviderGate> {
        let timeline = Timeline::Simulated(self.clock());
        Arc::new(ProviderGate::with_timeline(
            rate_per_second,
            burst,
            share,
            timeline,
        ))
    }

    pub fn pool(
        &self,
        members: &[super::MemberSpec],
        health: &crate::config::ProviderHealthSettings,
    ) -> Arc<ProviderGate> {
        let timeline = Timeline::Simulated(self.clock());
        Arc::new(ProviderGate::pool_with_timeline(
            members, 0.0, health, timeline,
        ))
    }

    pub fn clock(&self) -> Arc<SimClock> {
        Arc::clone(&self.0.clock)
    }

    pub fn now(&self) -> Duration {
        Duration::from(self.0.clock.now())
    }

    /// Task polls so far.
    pub fn polls(&self) -> u64 {
        self.0.polls.get()
    }

    pub fn spawn(&self, task: impl Future<Output = ()> + 'static) -> usize {
        let id = self.0.next_id.get();
        self.0.next_id.set(id + 1);
        self.0.tasks.borrow_mut().insert(id, Box::pin(task));
        self.0.ready.lock().unwrap().push_back(id);
        id
    }

    /// Drops a task's future wherever it is waiting. A task cannot abort
    /// itself.
    pub fn abort(&self, id: usize) {
        let task = self.0.tasks.borrow_mut().remove(&id);
        drop(task);
    }

    /// Runs tasks until none is ready, without moving time.
    pub fn settle(&self) {
        let mut polls_here = 0u64;
        loop {
            let next = self.0.ready.lock().unwrap().pop_front();
            let Some(id) = next else { return };
            let task = self.0.tasks.borrow_mut().remove(&id);
            let Some(mut task) = task else { continue };
            let waker = Waker::from(Arc::new(TaskWaker {
                id,
                ready: Arc::clone(&self.0.ready),
            }));
            self.0.polls.set(self.0.polls.get() + 1);
            polls_here += 1;
            assert!(
                polls_here < 1_000_000,
                "tasks keep waking each other without time passing"
            );
            if task
                .as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_pending()
            {
                self.0.tasks.borrow_mut().insert(id, task);
            }
        }
    }

    /// Runs tasks and moves time from timer to timer up to `until`.
    pub fn run_until(&self, until: Duration) {
        let until = Nanos::from(until).as_u64();
        loop {
            self.settle();
            match self.0.clock.next_timer() {
                Some(at) if at <= until => self.0.clock.advance_to(at),
                _ => break,
            }
        }
        self.0.clock.advance_to(until);
        self.settle();
    }
}
