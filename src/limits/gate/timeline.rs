//! The gate's clock: tokio's, real or paused under `tokio::time::pause`
//! (the tests).

use super::*;

/// The gate's source of time: instants are nanoseconds since the gate was
/// built, which is what governor's arithmetic wants. It reads tokio's
/// clock, real time or paused time under `tokio::time::pause`.
#[derive(Clone)]
pub(super) struct Timeline {
    origin: tokio::time::Instant,
}

impl Timeline {
    pub(super) fn tokio() -> Self {
        Timeline {
            origin: tokio::time::Instant::now(),
        }
    }

    pub(super) fn elapsed_since(&self, earlier: Nanos) -> Duration {
        Duration::from(self.now().saturating_sub(earlier))
    }

    pub(super) async fn sleep_until(&self, at: Nanos) {
        tokio::time::sleep_until(self.origin + Duration::from(at)).await;
    }
}

impl Clock for Timeline {
    type Instant = Nanos;

    fn now(&self) -> Nanos {
        Nanos::from(self.origin.elapsed())
    }
}
