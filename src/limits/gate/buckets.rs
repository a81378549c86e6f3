//! The token buckets: governor quotas that start empty, taking a grant (and
//! what a pause saved up), the bucket that paces the calls themselves, and
//! the tokens a bucket holds as the admin view reads them.

use super::*;

impl ProviderGate {
    /// Takes one token of `bucket` (the member's, or its share during a
    /// Redis outage); the first taken after a pause also empties it.
    pub(super) fn take_grant(
        &self,
        member: &Member,
        bucket: &Bucket,
    ) -> Result<(), NotUntil<Nanos>> {
        let mut left = bucket.check()?.remaining_burst_capacity();
        if member.drain_grants.swap(false, Ordering::Relaxed) {
            drain(bucket, member.burst);
            left = 0;
        }
        *member.left.lock().unwrap_or_else(PoisonError::into_inner) = (left, self.timeline.now());
        Ok(())
    }

    /// The tokens provider `member`'s bucket holds now as this instance
    /// sees it: what its last grant left, plus what accrued since, at most
    /// the burst. A fleet-wide bucket's come from Redis (`None` while it
    /// cannot be reached).
    pub async fn tokens(&self) -> Vec<Option<u32>> {
        let now = Duration::from(self.timeline.now());
        let mut tokens = Vec::with_capacity(self.members.len());
        for member in &self.members {
            tokens.push(match &member.global {
                Some(global) => global
                    .redis
                    .gate_tokens(&global.provider, global.period_us, member.burst)
                    .await
                    .ok(),
                None => {
                    let (left, at) = *member.left.lock().unwrap_or_else(PoisonError::into_inner);
                    let accrued = now.saturating_sub(Duration::from(at)).as_secs_f64()
                        * member.rate_per_second;
                    let held = f64::from(left) + accrued.floor();
                    Some(held.min(f64::from(member.burst)) as u32)
                }
            });
        }
        tokens
    }

    /// Waits until a call to provider `member` may start without it seeing
    /// more than `burst + rate × t` calls in any window t; returns the
    /// wait. A token from [`ProviderGate::acquire_for`] spaces the grants,
    /// but what comes between grant and call (the claim's store write,
    /// waiting for a worker) can bunch calls after a stall: a writer held
    /// up for two seconds releases two seconds' worth of granted messages
    /// at once. This second bucket, of the same rate and one call more of
    /// burst (see `calls_quota`), spaces them again at the moment of the
    /// call. Normally it has a token ready and costs one check.
    ///
    /// Fleet-wide gates (Redis) have no local bucket to space calls again
    /// (it would refuse what the fleet's bucket granted, which other
    /// instances do not take). There a grant goes stale instead: a call
    /// starting more than [`STALE_GRANT`] (or one token interval, if
    /// longer) after its grant (`granted_at`) takes a fresh token first,
    /// on behalf of `priority` and `tenant`, from the same provider. The
    /// stale token is lost, so the fleet calls less, never more: calls held
    /// up by a stalled store are spaced again by the fleet's bucket rather
    /// than released together.
    pub async fn pace_call_of(
        &self,
        at: usize,
        granted_at: tokio::time::Instant,
        priority: Priority,
        tenant: &str,
    ) -> Duration {
        let Some(member) = self.members.get(at) else {
            return Duration::ZERO;
        };
        if member.global.is_some() {
            let period = crate::limits::period_of(member.rate_per_second);
            if granted_at.elapsed() <= STALE_GRANT.max(period) {
                return Duration::ZERO;
            }
            metrics::counter!(crate::metrics::GATE_STALE_GRANTS_TOTAL).increment(1);
            let (waited, _) = self.acquire_from(priority, tenant, Choice::Only(at)).await;
            return waited;
        }
        let started = self.timeline.now();
        loop {
            match member.calls.check() {
                Ok(_) => {
                    // A call granted before a pause may be paced during it;
                    // only the first after the pause drains.
                    if self.paused(member).is_none()
                        && member.drain_calls.swap(false, Ordering::Relaxed)
                    {
                        drain(&member.calls, member.burst.saturating_add(1));
                    }
                    return self.timeline.elapsed_since(started);
                }
                Err(not_until) => {
                    self.timeline
                        .sleep_until(not_until.earliest_possible())
                        .await
                }
            }
        }
    }

    /// [`ProviderGate::pace_call_of`] the first provider, granted now.
    #[cfg(test)]
    pub(crate) async fn pace_call(&self) -> Duration {
        self.pace_call_of(0, tokio::time::Instant::now(), Priority::Normal, "")
            .await
    }
}

/// How long a fleet-wide grant stays good for its call (see
/// [`ProviderGate::pace_call_of`]): a claim's commit and a free worker
/// normally take a few milliseconds; a call this much later would land on
/// the provider beside calls granted after it.
pub const STALE_GRANT: Duration = Duration::from_millis(100);

/// A quota of `rate_per_second` calls a second on average, `burst` at once
/// (the period never panics, see [`crate::limits::period_of`]).
pub(super) fn quota(rate_per_second: f64, burst: NonZeroU32) -> Quota {
    Quota::with_period(crate::limits::period_of(rate_per_second))
        .expect("period is at least one nanosecond")
        .allow_burst(burst)
}

/// The call-pacing bucket's quota: the gate's rate with one call more of
/// burst. Grants come exactly at the rate under a backlog, so a bucket of
/// the same burst at the call could never win back a call held up between
/// grant and call (a claim's commit): every later call would wait as long
/// as the longest such hold-up so far, whoever's it was. One cell more lets
/// a call that is up to one interval late be followed by the next on time,
/// at the price of at most one call over `burst + rate × t` at the
/// provider in the window around it.
pub(super) fn calls_quota(rate_per_second: f64, burst: NonZeroU32) -> Quota {
    quota(rate_per_second, burst.saturating_add(1))
}

/// A bucket with no token in it: the first is due one period after now,
/// and it fills up to its burst only by waiting, never by being built.
pub(super) fn empty_bucket(quota: Quota, timeline: &Timeline) -> Bucket {
    let bucket = RateLimiter::direct_with_clock(quota, timeline.clone())
        .with_middleware::<StateInformationMiddleware>();
    // Taking the whole burst at once always fits the bucket's capacity.
    let _ = bucket.check_n(quota.burst_size());
    bucket
}

/// Takes every whole token `bucket` holds now, in at most 33 all-or-nothing
/// checks: the largest powers of two first, which takes exactly the binary
/// digits of what is there.
fn drain(bucket: &Bucket, burst: u32) {
    let mut size = burst.checked_next_power_of_two().unwrap_or(1 << 31);
    while let Some(cells) = NonZeroU32::new(size) {
        // Too many for the bucket's capacity, or not there: either way
        // nothing is taken.
        let _ = bucket.check_n(cells);
        size /= 2;
    }
}
