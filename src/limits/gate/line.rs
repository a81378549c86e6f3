//! The gate's line of waiters: per priority, tenants taking turns, each
//! tenant's callers in arrival order; the head alone asks the buckets for
//! a token (see the gate's module documentation).
//!
//! The hand-over rule, kept by construction: every change of the line
//! (a waiter joining, leaving served, in turn or out of it, leaving
//! cancelled or timed out, a grant to a caller who never waited) compares
//! the head before and after, and when it moved, wakes the new head unless
//! the new head is the caller making the change (it is running already).
//! So at every moment the head is either running, asleep on the clock
//! until the instant it asked for, or holds a wake-up; no waiter can sleep
//! for ever with tokens to give. The head also notes when it will act
//! next ([`Line::expect_head_by`]), which the watchdog
//! ([`ProviderGate::watch`]) checks.

use super::*;

/// The waiters: per priority rank, one FIFO per tenant, and the tenants
/// taking turns.
pub(super) struct Line {
    /// Waiting callers by priority rank, grouped by tenant; the tenants of a
    /// rank are served in rotation, each tenant's callers in arrival order.
    pub(super) tiers: [VecDeque<TenantWaiters>; PRIORITIES],
    /// Which priority the next token goes to: the highest waiting, except
    /// that lower priorities keep their share while they have waiters.
    pub(super) share: ShareCredit,
    /// Source of waiter ids, so a waiter can find itself in its queue.
    pub(super) next_id: u64,
    /// Smooth weighted round robin over the providers: each one's running
    /// credit (see [`Line::order`]).
    pub(super) current: Vec<f64>,
    /// A recovering provider's allowance: it grows by the provider's
    /// health factor with every grant the pool makes, and the provider
    /// may take a token only with a whole one.
    pub(super) allowance: Vec<f64>,
    /// Grants made so far, and the grant count at each tenant's last
    /// grant: a tenant that starts waiting goes ahead of the tenants
    /// served since it was last served (see [`Line::join`]).
    pub(super) grants: u64,
    pub(super) last_served: HashMap<Arc<str>, u64>,
    /// What the watchdog reads: when the head is due to act.
    pub(super) progress: Progress,
    /// The gate's clock, for [`Progress`].
    timeline: Timeline,
}

/// The head's promise to act, and what the watchdog made of it.
pub(super) struct Progress {
    /// By when the head of the line will act again: take a token, ask
    /// Redis for one, or wake from its sleep until the instant a token is
    /// due. Set to "now" whenever the head changes, since a new head acts
    /// at once.
    pub(super) due: Nanos,
    /// Since when the watchdog has found the line stuck (waiters, and a
    /// head past its `due` by [`STALL_GRACE`]); cleared when the head acts.
    pub(super) stuck_since: Option<Nanos>,
    /// Stalls found so far (each one repaired by waking the head).
    pub(super) stalls: u64,
}

/// How far past its promised instant a head may be before the watchdog
/// calls the line stuck: a woken task may wait for a busy runtime's thread,
/// but not for seconds.
pub(super) const STALL_GRACE: Duration = Duration::from_secs(2);

/// How many tenants' last grants the line remembers; one forgotten counts
/// as served long ago, which it was.
pub(super) const REMEMBERED_TENANTS: usize = 4096;

/// One tenant's waiters of one priority, oldest first.
pub(super) struct TenantWaiters {
    pub(super) tenant: Arc<str>,
    pub(super) waiters: VecDeque<Waiter>,
}

pub(super) struct Waiter {
    pub(super) id: u64,
    /// Rung when this waiter becomes the head of the line.
    pub(super) wake: Arc<Notify>,
}

impl Line {
    pub(super) fn new(low_priority_share: f64, members: usize, timeline: Timeline) -> Self {
        Line {
            tiers: Default::default(),
            share: ShareCredit::new(low_priority_share),
            next_id: 0,
            current: vec![0.0; members],
            allowance: vec![0.0; members],
            grants: 0,
            last_served: HashMap::new(),
            progress: Progress {
                due: timeline.now(),
                stuck_since: None,
                stalls: 0,
            },
            timeline,
        }
    }

    /// The hand-over rule (see the module documentation): if the head is
    /// no longer `before`, the new head is due now and is woken, unless it
    /// is `actor`, the waiter making the change, which is running.
    fn hand_over(&mut self, before: Option<u64>, actor: Option<u64>) {
        let after = self.head_id();
        if after == before {
            return;
        }
        self.progress.due = self.timeline.now();
        if let Some(head) = self.head().filter(|head| Some(head.id) != actor) {
            head.wake.notify_one();
        }
    }

    /// The head notes that it will act again by `at` (it sleeps until a
    /// token is due then, or waits for Redis's answer until then).
    pub(super) fn expect_head_by(&mut self, at: Nanos) {
        self.progress.due = at;
        self.progress.stuck_since = None;
    }

    /// Notes a grant to `tenant`.
    pub(super) fn served(&mut self, tenant: &str) {
        self.grants += 1;
        if self.last_served.len() >= REMEMBERED_TENANTS && !self.last_served.contains_key(tenant) {
            let horizon = self.grants.saturating_sub(REMEMBERED_TENANTS as u64);
            self.last_served.retain(|_, at| *at > horizon);
        }
        match self.last_served.get_mut(tenant) {
            Some(at) => *at = self.grants,
            None => {
                self.last_served.insert(Arc::from(tenant), self.grants);
            }
        }
    }

    pub(super) fn last_served(&self, tenant: &str) -> u64 {
        self.last_served.get(tenant).copied().unwrap_or(0)
    }

    /// The order in which the head tries the providers of `weights` (each
    /// with its weight and health factor now): highest running credit
    /// plus weight first, as smooth weighted round robin would pick; ties
    /// by configuration order. A recovering provider (factor below 1)
    /// without a whole allowance is left out while another can serve, so
    /// under a backlog it gets about its factor's part of the grants
    /// instead of its whole rate.
    pub(super) fn order(&self, weights: &[Weighed]) -> Vec<usize> {
        let mut order: Vec<(usize, f64)> = weights
            .iter()
            .filter(|w| weights.len() == 1 || w.factor >= 1.0 || self.allowance[w.member] >= 1.0)
            .map(|w| (w.member, self.current[w.member] + w.weight))
            .collect();
        if order.is_empty() {
            order = weights.iter().map(|w| (w.member, w.weight)).collect();
        }
        order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        order.into_iter().map(|(member, _)| member).collect()
    }

    /// Books a grant of provider `member`: smooth weighted round robin
    /// (every candidate's credit grows by its weight, the chosen one's
    /// falls by their sum) and the recovering providers' allowances.
    pub(super) fn granted(&mut self, member: usize, weights: &[Weighed]) {
        if weights.len() < 2 {
            return;
        }
        let total: f64 = weights.iter().map(|w| w.weight).sum();
        for w in weights {
            self.current[w.member] += w.weight;
            if w.factor < 1.0 {
                self.allowance[w.member] = (self.allowance[w.member] + w.factor).min(2.0);
            }
        }
        self.current[member] -= total;
        if let Some(w) = weights
            .iter()
            .find(|w| w.member == member && w.factor < 1.0)
        {
            self.allowance[w.member] = (self.allowance[w.member] - 1.0).max(0.0);
        }
    }

    pub(super) fn waiting_ranks(&self) -> [bool; PRIORITIES] {
        std::array::from_fn(|rank| !self.tiers[rank].is_empty())
    }

    /// True when a new caller of `rank` would be the head of the line: no
    /// one of its priority waits and the share rule would serve its
    /// priority next. It may then take a free token at once.
    pub(super) fn would_lead(&self, rank: usize) -> bool {
        let mut waiting = self.waiting_ranks();
        if waiting[rank] {
            return false;
        }
        waiting[rank] = true;
        self.share.pick(waiting) == Some(rank)
    }

    /// Books a token given to a caller of `rank` who was not waiting.
    /// Credit may move the head to another priority: that waiter is woken.
    pub(super) fn record_grant(&mut self, rank: usize, tenant: &str) {
        self.served(tenant);
        let before = self.head_id();
        let mut waiting = self.waiting_ranks();
        waiting[rank] = true;
        self.share.record(rank, waiting);
        self.hand_over(before, None);
    }

    pub(super) fn head(&self) -> Option<&Waiter> {
        let rank = self.share.pick(self.waiting_ranks())?;
        self.tiers[rank]
            .front()
            .and_then(|turn| turn.waiters.front())
    }

    pub(super) fn head_id(&self) -> Option<u64> {
        self.head().map(|waiter| waiter.id)
    }

    pub(super) fn waiting(&self, rank: usize) -> usize {
        self.tiers[rank].iter().map(|turn| turn.waiters.len()).sum()
    }

    /// Queues a waiter at the back of its tenant's queue in its priority. A
    /// tenant with no one waiting there joins the rotation ahead of every
    /// tenant served since it was last served (start-time fair queuing):
    /// a quiet tenant beside a busy one takes the very next token instead
    /// of waiting for the busy one's turn first, while a tenant that was
    /// just served and comes back at once goes to the back.
    pub(super) fn join<'g>(
        &mut self,
        gate: &'g ProviderGate,
        rank: usize,
        tenant: &str,
    ) -> Place<'g> {
        let before = self.head_id();
        let id = self.next_id;
        self.next_id += 1;
        let wake = Arc::new(Notify::new());
        let waiter = Waiter {
            id,
            wake: Arc::clone(&wake),
        };
        let known = self.tiers[rank]
            .iter()
            .position(|turn| &*turn.tenant == tenant);
        match known {
            Some(at) => self.tiers[rank][at].waiters.push_back(waiter),
            None => {
                let last = self.last_served(tenant);
                let at = self.tiers[rank]
                    .iter()
                    .position(|turn| self.last_served(&turn.tenant) > last)
                    .unwrap_or(self.tiers[rank].len());
                self.tiers[rank].insert(
                    at,
                    TenantWaiters {
                        tenant: Arc::from(tenant),
                        waiters: VecDeque::from([waiter]),
                    },
                );
            }
        }
        self.hand_over(before, Some(id));
        Place {
            gate,
            rank,
            id,
            wake,
            served: false,
        }
    }

    /// Removes a waiter, served (it got its token, as the head or out of
    /// turn while its Redis call was under way) or not (cancelled, timed
    /// out); whoever is the head afterwards, if that changed, is woken (the
    /// hand-over rule). A tenant whose waiter was `served` goes to the back
    /// of the rotation.
    pub(super) fn leave(&mut self, rank: usize, id: u64, served: bool) {
        let before = self.head_id();
        if served {
            self.share.record(rank, self.waiting_ranks());
        }
        let at = self.tiers[rank]
            .iter()
            .position(|turn| turn.waiters.iter().any(|w| w.id == id));
        if let (true, Some(at)) = (served, at) {
            let tenant = Arc::clone(&self.tiers[rank][at].tenant);
            self.served(&tenant);
        }
        let tier = &mut self.tiers[rank];
        if let Some(at) = at {
            let turn = &mut tier[at];
            turn.waiters.retain(|w| w.id != id);
            if turn.waiters.is_empty() {
                tier.remove(at);
            } else if served && at == 0 {
                tier.rotate_left(1);
            }
        }
        self.hand_over(before, None);
    }
}

/// A caller's place in line. Dropping it unserved (the `acquire` future was
/// cancelled) takes the caller out of the line.
pub(super) struct Place<'g> {
    /// The gate whose line to leave on cancellation.
    pub(super) gate: &'g ProviderGate,
    /// Which queue the caller is in, and its id there.
    pub(super) rank: usize,
    pub(super) id: u64,
    /// This caller's end of its [`Waiter::wake`].
    pub(super) wake: Arc<Notify>,
    /// Set once the caller got its token and already left the line.
    pub(super) served: bool,
}

impl Place<'_> {
    /// Drops the place without touching the line (the caller already left
    /// it, under the lock the caller still holds).
    pub(super) fn served(mut self) {
        self.served = true;
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        if !self.served {
            self.gate.line().leave(self.rank, self.id, false);
        }
    }
}
