//! A tenant's message list reads (`GET /v1/messages` and the admin's list
//! of its messages) take one of `limits.tenant_list_reads` turns for the
//! tenant (default 2). A list read that must scan (a rare status, a
//! reference with many matches) holds one of the store's readers while it
//! runs, so one tenant's clients scanning at once would otherwise take all
//! of them and every other tenant's status reads would wait behind the
//! scans. Reads past a tenant's turns wait in line, at most half the
//! request timeout; then the answer is 429 with a `Retry-After` of about
//! one of the tenant's recent list reads.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// Tenants kept with no read in progress before the idle ones are let go.
const KEPT_IDLE: usize = 1024;

/// The list-read turns of every tenant, in this process.
pub struct TenantReads {
    per_tenant: usize,
    wait: Duration,
    tenants: Mutex<HashMap<String, Arc<Turns>>>,
}

/// One tenant's turns and how long its recent list reads took.
struct Turns {
    permits: Arc<Semaphore>,
    /// A moving mean of its list reads, in ms.
    mean_ms: AtomicU64,
}

/// A list read's turn, given back when dropped.
pub struct ReadTurn {
    _permit: OwnedSemaphorePermit,
    turns: Arc<Turns>,
    started: Instant,
}

impl Drop for ReadTurn {
    fn drop(&mut self) {
        let took = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let _ = self
            .turns
            .mean_ms
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |mean| {
                Some(mean.saturating_mul(3).saturating_add(took) / 4)
            });
    }
}

impl TenantReads {
    /// `per_tenant` list reads at once per tenant (at least 1); a read
    /// waits at most `wait` for its turn.
    pub fn new(per_tenant: usize, wait: Duration) -> Self {
        TenantReads {
            per_tenant: per_tenant.max(1),
            wait,
            tenants: Mutex::new(HashMap::new()),
        }
    }

    /// Waits for one of `tenant_id`'s turns; `Err` with how long to wait
    /// before asking again when none came in time.
    pub async fn take(&self, tenant_id: &str) -> Result<ReadTurn, Duration> {
        let turns = self.turns(tenant_id);
        let permit = tokio::time::timeout(self.wait, Arc::clone(&turns.permits).acquire_owned())
            .await
            .map_err(|_| Duration::from_millis(turns.mean_ms.load(Ordering::Relaxed)))?
            .expect("a tenant's read turns are never closed");
        Ok(ReadTurn {
            _permit: permit,
            turns,
            started: Instant::now(),
        })
    }

    fn turns(&self, tenant_id: &str) -> Arc<Turns> {
        let mut tenants = self.tenants.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(turns) = tenants.get(tenant_id) {
            return Arc::clone(turns);
        }
        if tenants.len() >= KEPT_IDLE {
            let all = self.per_tenant;
            tenants.retain(|_, turns| {
                Arc::strong_count(turns) > 1 || turns.permits.available_permits() < all
            });
        }
        let turns = Arc::new(Turns {
            permits: Arc::new(Semaphore::new(self.per_tenant)),
            mean_ms: AtomicU64::new(0),
        });
        tenants.insert(tenant_id.to_owned(), Arc::clone(&turns));
        turns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_tenant_has_its_turns_others_are_not_held_and_a_long_wait_is_refused() {
        let reads = TenantReads::new(2, Duration::from_secs(5));
        let first = reads.take("a").await.unwrap();
        let _second = reads.take("a").await.unwrap();
        // Another tenant is not held by a's reads.
        drop(reads.take("b").await.unwrap());
        // a's third read waits for a turn, and takes the one given back.
        let third = {
            let reads = &reads;
            async move { reads.take("a").await }
        };
        let (third, ()) = tokio::join!(third, async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            drop(first);
        });
        let third = third.expect("a turn came within the wait");
        // With a's turns held past the wait: refused, with a's mean read
        // time (its first read took 2 s: a quarter of that after one read).
        let refused = reads.take("a").await.err().expect("no turn within 5 s");
        assert_eq!(refused, Duration::from_millis(500));
        drop(third);
    }
}
