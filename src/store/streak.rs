//! How writes are going: why a piece of work did not commit
//! ([`WriteFailed`]), and the failures in a row that set a 503's
//! Retry-After and `/readyz` ([`FailureStreak`]). Shared by both backends'
//! writers and the SQS outbox.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

/// Why a piece of work did not commit.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct WriteFailed(pub Arc<str>);

impl WriteFailed {
    pub(crate) fn from_error(err: &anyhow::Error) -> Self {
        WriteFailed(format!("{err:#}").into())
    }
}

/// Failures in a row, which set the Retry-After of the next 503: 1 s after
/// the first, doubling up to 30 s. Also remembers what the last failure
/// said, for `/readyz`.
#[derive(Debug, Clone, Default)]
pub struct FailureStreak(Arc<Streak>);

#[derive(Debug, Default)]
struct Streak {
    count: AtomicU32,
    last: std::sync::Mutex<Option<Arc<str>>>,
    /// When a failure last happened; kept past the streak's end, since on
    /// a nearly full file small writes commit between large ones that fail.
    last_at: std::sync::Mutex<Option<std::time::Instant>>,
}

impl FailureStreak {
    /// Ends the streak; returns how long it was.
    pub fn succeeded(&self) -> u32 {
        let ended = self.0.count.swap(0, Ordering::Relaxed);
        if ended > 0 {
            *self.0.last.lock().unwrap_or_else(PoisonError::into_inner) = None;
        }
        ended
    }

    /// Counts a failure; returns the streak length.
    pub fn failed(&self) -> u32 {
        *self
            .0
            .last_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(std::time::Instant::now());
        self.0.count.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Whether a failure happened within `window` (or the streak runs).
    pub fn failed_within(&self, window: Duration) -> bool {
        self.count() > 0
            || self
                .0
                .last_at
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_some_and(|at| at.elapsed() < window)
    }

    /// Counts a failure and remembers why; returns the streak length.
    pub fn failed_because(&self, why: &WriteFailed) -> u32 {
        *self.0.last.lock().unwrap_or_else(PoisonError::into_inner) = Some(why.0.clone());
        self.failed()
    }

    /// Failures in the current streak.
    pub fn count(&self) -> u32 {
        self.0.count.load(Ordering::Relaxed)
    }

    /// While failing: what the last failure said (or that there was one).
    pub fn failing(&self) -> Option<Arc<str>> {
        if self.0.count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let last = self.0.last.lock().unwrap_or_else(PoisonError::into_inner);
        Some(
            last.clone()
                .unwrap_or_else(|| "the last write failed".into()),
        )
    }

    pub fn retry_after(&self) -> Duration {
        let failures = self.0.count.load(Ordering::Relaxed).clamp(1, 6);
        Duration::from_secs((1u64 << (failures - 1)).min(30))
    }
}
