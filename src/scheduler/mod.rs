//! Work on a clock: scheduled sends that fall due, and the jobs that must
//! run once across instances (expiry of idempotency keys; the outbox sweep,
//! which sends rows no relay holds: those of an instance that died;
//! retention's erasure, [`retention`]; folding usage deltas on PostgreSQL). Each is a
//! task started by `crate::app` and stopped by the shutdown signal; with
//! several instances, the store makes sure each row or purge is taken by
//! one of them (row claims, advisory locks).

pub mod retention;

pub use retention::{Retention, RetentionRun, run_retention};

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::accept::outbox::Outbox;
use crate::model::now_ms;
use crate::store::Db;

/// How often expired idempotency keys are purged.
const IDEMPOTENCY_PURGE_INTERVAL: Duration = Duration::from_secs(3600);

/// How often usage deltas are folded into usage rows (PostgreSQL).
const USAGE_ROLL_UP_INTERVAL: Duration = Duration::from_secs(10);

/// How often scheduled messages are looked for: a message is in its lane
/// at most this long after it is due.
const SCHEDULER_TICK: Duration = Duration::from_secs(1);

/// Every [`SCHEDULER_TICK`], sends the scheduled messages that are due;
/// every half sweep age, also sends rows older than the sweep age that
/// this instance's relay does not hold. With several instances each row is claimed by one of them.
pub async fn run_outbox_sweeps(
    outbox: Arc<Outbox>,
    age: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(SCHEDULER_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let mut last_sweep = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = tick.tick() => {
                // Between sweeps only due scheduled rows qualify.
                let cutoff = if last_sweep.elapsed() >= age / 2 {
                    last_sweep = tokio::time::Instant::now();
                    now_ms() - age.as_millis() as i64
                } else {
                    i64::MIN
                };
                match outbox.sweep(Some(cutoff)).await {
                    Ok(0) => {}
                    Ok(resent) => info!(resent, "Outbox sent scheduled messages that fell due or re-sent messages whose send outcome was unknown."),
                    // While SQS fails the relay has said so (once).
                    Err(err) if outbox.health().is_behind() => {
                        debug!(error = %err, "Outbox sweep failed; the next one tries again.")
                    }
                    Err(err) => warn!(error = %err, "Outbox sweep failed; the next one tries again."),
                }
            }
            _ = shutdown.changed() => return,
        }
    }
}

/// Every [`IDEMPOTENCY_PURGE_INTERVAL`], removes the idempotency keys past
/// their 24 hours (on one instance at a time).
pub async fn purge_idempotency_keys(db: Db, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(IDEMPOTENCY_PURGE_INTERVAL);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                match db.purge_idempotency_keys(now_ms()).await {
                    Ok(None | Some(0)) => {}
                    Ok(Some(purged)) => info!(purged, "Expired idempotency keys purged."),
                    Err(err) => warn!(error = %err, "Could not purge idempotency keys."),
                }
            }
            _ = shutdown.changed() => return,
        }
    }
}

/// Every [`USAGE_ROLL_UP_INTERVAL`], folds the usage deltas the instances
/// appended into usage rows (one instance at a time); a store only one
/// instance counts in (SQLite) has none, and the run finds nothing.
pub async fn roll_up_usage(db: Db, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(USAGE_ROLL_UP_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                match db.roll_up_usage().await {
                    Ok(Some(folded)) if folded > 0 => debug!(folded, "Usage deltas folded."),
                    Ok(_) => {}
                    Err(err) => warn!(error = %err, "Could not fold usage deltas; the next roll-up tries again."),
                }
            }
            _ = shutdown.changed() => return,
        }
    }
}

/// How often the planner's statistics are refreshed.
const STATISTICS_INTERVAL: Duration = Duration::from_secs(3600);

/// Every [`STATISTICS_INTERVAL`], refreshes the query planner's statistics
/// ([`Db::refresh_statistics`]), so the message list keeps the index that
/// suits each filter as a tenant's messages grow.
pub async fn refresh_statistics(db: Db, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(STATISTICS_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if let Err(err) = db.refresh_statistics().await {
                    warn!(error = %err, "Could not refresh the query planner's statistics; the next run tries again.");
                }
            }
            _ = shutdown.changed() => return,
        }
    }
}
