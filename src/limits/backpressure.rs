//! Lane backpressure: answers 429 when a lane's backlog reaches its
//! high-water mark, with a Retry-After estimated from the lane's recent
//! drain rate. The backlog is what is not yet delivered
//! ([`QueueStats::backlog`]): waiting, delayed and scheduled messages and
//! those a consumer holds (in flight), so a consumer's buffer cannot carry
//! the lane past its mark.
//!
//! The queue is asked for its figures by a background sampler every
//! [`LaneQueue::stats_interval`] (a second for the embedded queue,
//! `queue.sqs.stats_interval_secs` for SQS), not on every request. Between samples, accepts made by this
//! process are added to the sampled depth, so a burst cannot overshoot the
//! mark by a second's worth of traffic.
//!
//! On SQS, a message accepted is committed with an outbox row and reaches
//! SQS a moment later, or much later while SQS fails: the outbox's rows of
//! a lane ([`PendingCounts`], read once per sample from the store) count
//! toward its backlog, so the high-water mark bounds the outbox too.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tracing::warn;

use crate::config::LanesSettings;
use crate::metrics as names;
use crate::model::Lane;
use crate::queue::{LaneQueue, QueueStats};

/// Weight of the newest drain-rate sample in the moving average.
const DRAIN_SMOOTHING: f64 = 0.3;

/// Retry-After when nothing has left the lane recently: without a drain
/// there is no rate to divide by, so clients are told to come back after
/// this long, when a fresh estimate exists.
pub const NO_DRAIN_RETRY_AFTER: Duration = Duration::from_secs(30);

/// Longest Retry-After the estimate may give.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// Messages accepted into each lane ([`Lane::ALL`] order) that are not in
/// its queue yet: the SQS outbox's rows. Passed in by the caller, so the
/// limits know nothing of the store.
#[async_trait::async_trait]
pub trait PendingCounts: Send + Sync {
    async fn pending(&self) -> anyhow::Result<[u64; 2]>;
}

#[derive(Debug, Default)]
struct LaneGauge {
    /// Last sampled statistics.
    stats: RwLock<(QueueStats, Option<Instant>)>,
    /// Last sampled count of accepted messages not yet in the queue (SQS
    /// outbox rows).
    pending: AtomicU64,
    /// Accepted into the lane since the last sample.
    accepted_since_sample: AtomicU64,
    /// Smoothed messages/s leaving the lane, as f64 bits.
    drain_rate_bits: AtomicU64,
}

pub struct LaneBackpressure {
    lanes: LanesSettings,
    fast: LaneGauge,
    slow: LaneGauge,
    /// SQS mode: the outbox's rows per lane.
    pending: Option<Arc<dyn PendingCounts>>,
}

/// The lane is full; come back after `retry_after`.
#[derive(Debug, Clone, PartialEq)]
pub struct LaneFull {
    pub lane: Lane,
    /// Messages the lane holds not yet delivered.
    pub backlog: u64,
    pub high_water_mark: u64,
    pub retry_after: Duration,
}

impl LaneBackpressure {
    pub fn new(lanes: LanesSettings) -> Self {
        LaneBackpressure {
            lanes,
            fast: LaneGauge::default(),
            slow: LaneGauge::default(),
            pending: None,
        }
    }

    /// Counts `pending` (the SQS outbox) toward each lane's backlog.
    pub fn with_pending(mut self, pending: Arc<dyn PendingCounts>) -> Self {
        self.pending = Some(pending);
        self
    }

    fn gauge(&self, lane: Lane) -> &LaneGauge {
        match lane {
            Lane::Fast => &self.fast,
            Lane::Slow => &self.slow,
        }
    }

    /// Sampled backlog (the queue's, and what waits to enter it) plus what
    /// was accepted since.
    pub fn estimated_backlog(&self, lane: Lane) -> u64 {
        let gauge = self.gauge(lane);
        let sampled = gauge.stats.read().expect("stats lock").0.backlog();
        sampled
            + gauge.pending.load(Ordering::Relaxed)
            + gauge.accepted_since_sample.load(Ordering::Relaxed)
    }

    /// Smoothed drain rate of `lane` in messages per second.
    pub fn drain_rate(&self, lane: Lane) -> f64 {
        f64::from_bits(self.gauge(lane).drain_rate_bits.load(Ordering::Relaxed))
    }

    /// The last sampled statistics of `lane`.
    pub fn last_stats(&self, lane: Lane) -> QueueStats {
        self.gauge(lane).stats.read().expect("stats lock").0.clone()
    }

    /// `Err` when `lane` is at or above its high-water mark.
    pub fn check(&self, lane: Lane) -> Result<(), LaneFull> {
        let high_water_mark = self.lanes.get(lane).high_water_mark;
        let backlog = self.estimated_backlog(lane);
        if backlog < high_water_mark {
            return Ok(());
        }
        let excess = (backlog - high_water_mark + 1) as f64;
        let rate = self.drain_rate(lane);
        let retry_after = if rate > 0.01 {
            Duration::from_secs_f64(excess / rate).min(MAX_RETRY_AFTER)
        } else {
            NO_DRAIN_RETRY_AFTER
        };
        Err(LaneFull {
            lane,
            backlog,
            high_water_mark,
            retry_after,
        })
    }

    /// Counts an accepted message toward the lane's depth until the next sample.
    pub fn record_accepted(&self, lane: Lane, count: u64) {
        self.gauge(lane)
            .accepted_since_sample
            .fetch_add(count, Ordering::Relaxed);
    }

    /// Takes one sample of every lane. Returns the deleted totals seen, so
    /// the caller can pass them to the next call.
    pub async fn sample(&self, queue: &dyn LaneQueue, previous: &mut [(u64, Instant); 2]) {
        let accepted_before = [Lane::Fast, Lane::Slow].map(|lane| {
            self.gauge(lane)
                .accepted_since_sample
                .load(Ordering::Relaxed)
        });
        // Read before the queue: a message that moves from the outbox to
        // the queue in between is counted twice, never missed.
        let pending = match &self.pending {
            None => None,
            Some(counts) => match counts.pending().await {
                Ok(pending) => Some(pending),
                Err(err) => {
                    warn!(error = %format!("{err:#}"), "Could not count the outbox's rows.");
                    None
                }
            },
        };
        for (i, lane) in Lane::ALL.iter().enumerate() {
            let gauge = self.gauge(*lane);
            let accepted_before = accepted_before[i];
            if let Some(pending) = pending {
                metrics::gauge!(names::OUTBOX_PENDING, "lane" => lane.as_str())
                    .set(pending[i] as f64);
                gauge.pending.store(pending[i], Ordering::Relaxed);
            }
            match queue.stats(*lane).await {
                Ok(stats) => {
                    let label = lane.as_str();
                    metrics::gauge!(names::LANE_DEPTH, "lane" => label).set(stats.depth as f64);
                    metrics::gauge!(names::LANE_IN_FLIGHT, "lane" => label)
                        .set(stats.in_flight as f64);
                    metrics::gauge!(names::LANE_DLQ_DEPTH, "lane" => label)
                        .set(stats.dlq_depth as f64);
                    metrics::gauge!(names::LANE_OLDEST_AGE_SECONDS, "lane" => label)
                        .set(stats.oldest_age_secs.unwrap_or(0.0));
                    *gauge.stats.write().expect("stats lock") = (stats, Some(Instant::now()));
                    // Accepts that raced with the query may be counted twice
                    // until the next sample; that errs on the safe side.
                    gauge
                        .accepted_since_sample
                        .fetch_sub(accepted_before, Ordering::Relaxed);
                }
                Err(err) => {
                    warn!(lane = %lane, error = %err, "Could not read lane statistics.");
                    // What was accepted since is in the outbox's count now.
                    if pending.is_some() {
                        gauge
                            .accepted_since_sample
                            .fetch_sub(accepted_before, Ordering::Relaxed);
                    }
                }
            }
            let deleted = queue.deleted_total(*lane);
            let now = Instant::now();
            let (last_deleted, last_at) = previous[i];
            let elapsed = now.duration_since(last_at).as_secs_f64();
            if elapsed > 0.0 {
                let instant_rate = deleted.saturating_sub(last_deleted) as f64 / elapsed;
                let old = self.drain_rate(*lane);
                let smoothed = if old == 0.0 {
                    instant_rate
                } else {
                    DRAIN_SMOOTHING * instant_rate + (1.0 - DRAIN_SMOOTHING) * old
                };
                gauge
                    .drain_rate_bits
                    .store(smoothed.to_bits(), Ordering::Relaxed);
            }
            previous[i] = (deleted, now);
        }
    }

    /// Samples every [`LaneQueue::stats_interval`] until `shutdown` fires.
    pub async fn run(
        self: Arc<Self>,
        queue: Arc<dyn LaneQueue>,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) {
        let start = Instant::now();
        let mut previous = [
            (queue.deleted_total(Lane::Fast), start),
            (queue.deleted_total(Lane::Slow), start),
        ];
        let mut tick = tokio::time::interval(queue.stats_interval());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => self.sample(queue.as_ref(), &mut previous).await,
                _ = shutdown.changed() => return,
            }
        }
    }
}
