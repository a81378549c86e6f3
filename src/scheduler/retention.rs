//! The retention job: every `retention.interval_secs`, one instance at a
//! time erases the personal data of the settled messages that have passed
//! their tenant's retention: first the queue's waiting copies (dead
//! letters, set-aside and delayed rows of cancelled messages), then the
//! status row, its events, any outbox row and the files it carried, a
//! bounded batch per transaction (`crate::store::retention`). Uploaded
//! files no send took within a day are erased whatever the tenant's
//! retention. On SQLite the file is then
//! rewritten and its log truncated, so no old copy of the erased text is
//! left on disk. Each run writes
//! one INFO line and counts into the `fairlane_retention_*` metrics.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tracing::{info, warn};

use crate::metrics::{RETENTION_ERASED_TOTAL, RETENTION_QUEUE_ERASED_TOTAL, RETENTION_RUNS_TOTAL};
use crate::model::{MessageStatus, now_ms};
use crate::queue::TenantQueues;
use crate::store::Db;
use crate::tenants::Registry;

/// What one run did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RetentionRun {
    /// Tenants looked at.
    pub tenants: usize,
    /// Status rows whose personal data was erased.
    pub erased: u64,
    /// Queue copies removed (dead letters, set-aside and delayed rows).
    pub queue_copies: u64,
    /// SQLite: whether the file was rewritten (`VACUUM`) after erasing.
    pub vacuumed: bool,
    /// SQLite: whether the log was truncated after erasing.
    pub log_truncated: bool,
    /// Audit log entries past `retention.audit_days` removed.
    pub audit_pruned: u64,
    /// Uploaded files the sweep erased: expired or deleted ones nothing
    /// uses, and uploads left unfinished for an hour (a file a message
    /// used goes with that message's personal data, once no other message
    /// uses it and it is expired or deleted).
    pub unclaimed_files: u64,
}

/// The job's parts.
pub struct Retention {
    pub db: Db,
    pub registry: Arc<Registry>,
    pub queues: Arc<dyn TenantQueues>,
    /// Messages per transaction.
    pub batch: usize,
    /// SQLite: rewrite the file after a run that erased something
    /// (`retention.vacuum`).
    pub vacuum: bool,
    /// Days the audit log keeps an entry (`retention.audit_days`).
    pub audit_days: u16,
}

impl Retention {
    /// One run at `now` (ms); `None` when another instance is running one.
    pub async fn run_once(&self, now: i64) -> anyhow::Result<Option<RetentionRun>> {
        let Some(_lock) = self.db.lock_retention_run().await? else {
            return Ok(None);
        };
        let mut run = RetentionRun {
            audit_pruned: self
                .db
                .prune_audit(now - i64::from(self.audit_days) * 86_400_000)
                .await?,
            unclaimed_files: self.db.erase_stale_attachments(now).await?,
            ..RetentionRun::default()
        };
        for (tenant, days) in self.registry.retention_by_tenant() {
            run.tenants += 1;
            let cutoff = now - i64::from(days) * 86_400_000;
            loop {
                let due = self.db.due_for_erasure(&tenant, cutoff, self.batch).await?;
                let last = due.len() < self.batch;
                // Only these statuses leave a copy waiting in a queue.
                let waiting: Vec<String> = due
                    .iter()
                    .filter(|d| {
                        d.status == MessageStatus::DeadLettered.as_str()
                            || d.status == MessageStatus::Cancelled.as_str()
                    })
                    .map(|d| d.id.clone())
                    .collect();
                if !waiting.is_empty() {
                    let removed = self.queues.erase_waiting(&tenant, Some(&waiting)).await?;
                    run.queue_copies += removed.len() as u64;
                    metrics::counter!(RETENTION_QUEUE_ERASED_TOTAL).increment(removed.len() as u64);
                }
                let ids: Vec<String> = due.into_iter().map(|d| d.id).collect();
                let erased = self.db.erase_messages(&ids, now).await?;
                run.erased += erased;
                metrics::counter!(RETENTION_ERASED_TOTAL).increment(erased);
                if last {
                    break;
                }
            }
        }
        if run.erased > 0 || run.queue_copies > 0 || run.unclaimed_files > 0 {
            let scrubbed = self.db.scrub_file(self.vacuum).await?;
            (run.vacuumed, run.log_truncated) = (scrubbed.vacuumed, scrubbed.log_truncated);
        }
        Ok(Some(run))
    }
}

/// Runs [`Retention::run_once`] every `interval` until shutdown.
pub async fn run_retention(
    job: Retention,
    interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let started = Instant::now();
                match job.run_once(now_ms()).await {
                    Ok(Some(run)) => {
                        metrics::counter!(RETENTION_RUNS_TOTAL, "outcome" => "done").increment(1);
                        info!(
                            tenants = run.tenants,
                            erased = run.erased,
                            queue_copies = run.queue_copies,
                            vacuumed = run.vacuumed,
                            log_truncated = run.log_truncated,
                            audit_pruned = run.audit_pruned,
                            elapsed_ms = started.elapsed().as_millis() as u64,
                            "Retention run finished: personal data of settled messages past their tenant's retention erased."
                        );
                    }
                    Ok(None) => {
                        metrics::counter!(RETENTION_RUNS_TOTAL, "outcome" => "skipped").increment(1);
                    }
                    Err(err) => {
                        metrics::counter!(RETENTION_RUNS_TOTAL, "outcome" => "failed").increment(1);
                        warn!(error = %format!("{err:#}"), "Retention run failed; the next one goes on where it stopped.");
                    }
                }
            }
            _ = shutdown.changed() => return,
        }
    }
}
