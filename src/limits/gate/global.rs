//! Fleet-wide buckets in Redis ([`ProviderGate::with_global_bucket`]): the
//! head of the line takes its token from the provider's bucket there, or
//! from this instance's share of it while Redis cannot be reached (see the
//! gate's module documentation).

use super::*;

/// A provider's bucket in Redis, shared by every instance, and this
/// instance's share of it for when Redis cannot be reached.
pub(super) struct GlobalBucket {
    pub(super) redis: Arc<RedisLimits>,
    /// The provider's name in the key, `{prefix}:gate:{provider}`.
    pub(super) provider: String,
    /// The gate's rate as whole microseconds per call, rounded up.
    pub(super) period_us: u64,
    /// The local share, built afresh for each outage.
    share: Mutex<Option<ShareBucket>>,
    /// The last outage whose share-paced calls the bucket in Redis was
    /// charged for (emptied on the first take after it, see
    /// [`GlobalBucket::owed_outage`]).
    charged: AtomicU64,
}

/// This instance's share of a provider's rate during one outage.
struct ShareBucket {
    /// Which outage it was built for ([`RedisLimits`] counts them).
    outage: u64,
    bucket: Arc<Bucket>,
}

impl ProviderGate {
    /// Makes the gate fleet-wide: the head of the line takes each
    /// provider's tokens from the bucket `{prefix}:gate:{name}` in Redis
    /// (`provider` for a gate of one provider), which every instance with
    /// this prefix shares, so together they keep each provider's rate and
    /// burst. While Redis is unreachable, this instance paces its calls at
    /// its share of both (see the module documentation).
    pub fn with_global_bucket(mut self, redis: Arc<RedisLimits>, provider: &str) -> Self {
        let single = self.members.len() == 1;
        for member in &mut self.members {
            let key = if single || member.name.is_empty() {
                provider.to_owned()
            } else {
                member.name.clone()
            };
            member.global = Some(GlobalBucket {
                redis: Arc::clone(&redis),
                provider: key,
                period_us: period_micros(member.rate_per_second),
                share: Mutex::new(None),
                charged: AtomicU64::new(0),
            });
        }
        self
    }

    /// [`ProviderGate::acquire_from`] with fleet-wide buckets: the same
    /// line, but the head takes its token from Redis, or from this
    /// instance's share while Redis is down. Every caller queues first (no
    /// fast path), because the Redis call cannot be made under the line's
    /// lock; a caller that finds the line empty is its head at once, so it
    /// costs nothing but the queue operations.
    pub(super) async fn acquire_global(
        &self,
        rank: usize,
        tenant: &str,
        choice: Choice,
    ) -> (Duration, usize) {
        let started = self.timeline.now();
        let place = self.line().join(self, rank, tenant);
        'wait: loop {
            let candidates = {
                let mut line = self.line();
                let head = line.head_id() == Some(place.id);
                if head {
                    // Each Redis call answers or fails within its timeout.
                    let calls = u32::try_from(self.members.len()).unwrap_or(u32::MAX);
                    let answered_by =
                        self.timeline.now() + Nanos::from(self.redis_timeout() * calls);
                    line.expect_head_by(answered_by);
                }
                head.then(|| self.candidates(&line, choice))
            };
            let Some((order, weights)) = candidates else {
                place.wake.notified().await;
                continue;
            };
            let mut due: Option<Nanos> = None;
            let mut earliest = |at: Nanos| due = Some(due.map_or(at, |d: Nanos| d.min(at)));
            for i in order {
                let member = &self.members[i];
                let global = member.global.as_ref().expect("every member is global");
                if let Some(until) = self.paused(member) {
                    earliest(until);
                    continue;
                }
                if global.redis.is_up() {
                    let owed = global.owed_outage();
                    let taken = global
                        .redis
                        .take_gate_token(
                            &global.provider,
                            global.period_us,
                            member.burst,
                            owed.is_some(),
                        )
                        .await;
                    if let (Some(outage), Ok(_)) = (owed, &taken) {
                        global.charged.fetch_max(outage, Ordering::SeqCst);
                    }
                    match taken {
                        Ok(None) => {
                            {
                                let mut line = self.line();
                                line.granted(i, &weights);
                                line.leave(rank, place.id, true);
                            }
                            place.served();
                            return (self.timeline.elapsed_since(started), i);
                        }
                        Ok(Some(wait)) => {
                            earliest(Nanos::from(Duration::from(self.timeline.now()) + wait));
                        }
                        // Redis is marked down now: the next round takes from
                        // this instance's share.
                        Err(_) => continue 'wait,
                    }
                    continue;
                }
                let share = global.share(self, member);
                let taken = {
                    let mut line = self.line();
                    if line.head_id() != Some(place.id) {
                        None
                    } else {
                        let taken = self.take_grant(member, &share);
                        if taken.is_ok() {
                            line.granted(i, &weights);
                            line.leave(rank, place.id, true);
                        }
                        Some(taken)
                    }
                };
                match taken {
                    None => continue 'wait,
                    Some(Ok(())) => {
                        place.served();
                        return (self.timeline.elapsed_since(started), i);
                    }
                    Some(Err(not_until)) => earliest(not_until.earliest_possible()),
                }
            }
            let due = due.expect("a gate has at least one provider and choice allows one");
            {
                let mut line = self.line();
                if line.head_id() == Some(place.id) {
                    line.expect_head_by(due);
                }
            }
            self.timeline.sleep_until(due).await;
        }
    }
}

impl ProviderGate {
    /// The longest a Redis call of the gate takes before it counts as
    /// failed (`limits.timeout_ms`).
    fn redis_timeout(&self) -> Duration {
        self.members
            .iter()
            .filter_map(|member| member.global.as_ref())
            .map(|global| global.redis.call_timeout())
            .max()
            .unwrap_or_default()
    }
}

impl GlobalBucket {
    /// The outage this instance paced calls on its share during and has not
    /// yet charged to the bucket in Redis. The first take after it empties
    /// that bucket: whatever it saved up while nobody took from it (or a
    /// restarted Redis's fresh, full bucket) would otherwise come on top of
    /// the calls the shares just made, up to a whole burst over
    /// `burst + rate × t` at the provider. Emptying it costs the fleet at
    /// most one burst's worth of calls after each outage this instance used
    /// its share in; an outage it made no call in is not charged.
    fn owed_outage(&self) -> Option<u64> {
        let share = self.share.lock().unwrap_or_else(PoisonError::into_inner);
        let outage = share.as_ref()?.outage;
        (outage > self.charged.load(Ordering::SeqCst)).then_some(outage)
    }

    /// This instance's share of `member`'s bucket for the current outage:
    /// rate and burst divided by the live instances last counted (the burst
    /// at least one). It starts empty, so that the fleet's switch to shares
    /// adds no burst on top of the tokens just taken from Redis.
    fn share(&self, gate: &ProviderGate, member: &Member) -> Arc<Bucket> {
        let outage = self.redis.outages();
        let mut share = self.share.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(current) = share.as_ref().filter(|s| s.outage == outage) {
            return Arc::clone(&current.bucket);
        }
        let instances = self.redis.live_instances().max(1);
        let rate = member.rate_per_second / f64::from(instances);
        let burst = NonZeroU32::new((member.burst / instances).max(1)).expect("at least 1");
        let bucket = Arc::new(empty_bucket(quota(rate, burst), &gate.timeline));
        *share = Some(ShareBucket {
            outage,
            bucket: Arc::clone(&bucket),
        });
        bucket
    }
}
