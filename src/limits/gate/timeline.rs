//! The gate's clock: tokio's (real, or paused under `tokio::time::pause`),
//! or the tests' simulated one.

use super::*;

/// The gate's source of time: instants are nanoseconds since the gate was
/// built, which is what governor's arithmetic wants.
#[derive(Clone)]
pub(super) enum Timeline {
    /// tokio's clock: real time, or paused time under `tokio::time::pause`.
    Tokio { origin: tokio::time::Instant },
    /// The tests' simulated clock.
    #[cfg(test)]
    Simulated(Arc<super::sim::SimClock>),
}

impl Timeline {
    pub(super) fn tokio() -> Self {
        Timeline::Tokio {
            origin: tokio::time::Instant::now(),
        }
    }

    pub(super) fn elapsed_since(&self, earlier: Nanos) -> Duration {
        Duration::from(self.now().saturating_sub(earlier))
    }

    pub(super) async fn sleep_until(&self, at: Nanos) {
        match self {
            Timeline::Tokio { origin } => {
                tokio::time::sleep_until(*origin + Duration::from(at)).await;
            }
            #[cfg(test)]
            Timeline::Simulated(clock) => clock.sleep_until(at).await,
        }
    }
}

impl Clock for Timeline {
    type Instant = Nanos;

    fn now(&self) -> Nanos {
        match self {
            Timeline::Tokio { origin } => Nanos::from(origin.elapsed()),
            #[cfg(test)]
            Timeline::Simulated(clock) => clock.now(),
        }
    }
}
