//! Held tenants (paused or disabled): holding only marks the tenant, and
//! receives set its messages aside in the queue's hold queue as they meet
//! them (`receive.rs`). Releasing moves them back at once, per priority
//! class in their order, with fresh fair keys that start where the tenant
//! would start now, from every queue they may sit beside: the lanes, the
//! attention queues and the tenant's own queues.

use std::sync::{Arc, PoisonError};

use rusqlite::Transaction;

use super::state::LaneState;
use super::{EmbeddedQueue, Reply, answer, failed};
use crate::model::{Lane, Priority, now_ms};
use crate::queue::priority::CLASSES;
use crate::store::sqlite::writer::{Work, WriteFailed};

impl EmbeddedQueue {
    /// Marks `tenant_id` held, or releases it and moves its set-aside
    /// messages back.
    pub(super) async fn set_held(&self, tenant_id: &str, held: bool) -> anyhow::Result<()> {
        if held {
            self.held
                .write()
                .expect("held lock")
                .insert(tenant_id.to_owned());
            return Ok(());
        }
        self.held.write().expect("held lock").remove(tenant_id);
        for state in self.states_of(tenant_id) {
            self.release_held(state, tenant_id).await?;
        }
        Ok(())
    }

    /// Releases every set-aside message whose tenant is no longer held (a
    /// tenant resumed by a process that stopped before moving them back).
    pub async fn release_unheld(&self) -> anyhow::Result<()> {
        let tenants: Vec<String> = self
            .db
            .rows(
                "SELECT DISTINCT tenant_id FROM queue_messages WHERE queue LIKE '%held'",
                vec![],
                |row| row.get(0),
            )
            .await?;
        for tenant in tenants {
            if !self.held.read().expect("held lock").contains(&tenant) {
                for state in self.states_of(&tenant) {
                    self.release_held(state, &tenant).await?;
                }
            }
        }
        Ok(())
    }

    /// Every queue state a tenant's held messages may sit beside: the
    /// lanes, their attention queues and its own queues.
    pub(super) fn states_of(&self, tenant_id: &str) -> Vec<Arc<LaneState>> {
        let mut states = vec![self.fast.clone(), self.slow.clone()];
        states.extend(self.dedicated.attention.iter().cloned());
        for lane in Lane::ALL {
            if let Some(state) = self
                .dedicated
                .queues
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&(*lane, tenant_id.to_owned()))
            {
                states.push(state.clone());
            }
        }
        states
    }

    /// Moves `tenant_id`'s set-aside messages of `state`'s queue back:
    /// per priority class, in their original order, with fair keys that
    /// start where the tenant would start now.
    async fn release_held(&self, state: Arc<LaneState>, tenant_id: &str) -> anyhow::Result<()> {
        self.through_writer(|reply| {
            Box::new(ReleaseWork {
                state,
                tenant_id: tenant_id.to_owned(),
                moved: 0,
                lasts: Vec::new(),
                reply: Some(reply),
            })
        })
        .await
    }
}

/// Moves a released tenant's set-aside messages back into the lane.
struct ReleaseWork {
    state: Arc<LaneState>,
    tenant_id: String,
    moved: u64,
    /// The tenant's last fair key per class after the move.
    lasts: Vec<(usize, i64)>,
    reply: Reply<()>,
}

impl Work for ReleaseWork {
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        let names = self.state.names.clone();
        self.lasts.clear();
        self.moved = 0;
        let counts: Vec<(String, i64)> = tx
            .prepare_cached(
                "SELECT priority, COUNT(*) FROM queue_messages WHERE queue = ?1 AND tenant_id = ?2 GROUP BY priority",
            )?
            .query_map(rusqlite::params![names.held.as_str(), self.tenant_id], |row| {
                Ok((row.get(0)?, row.get(1)?))
            })?
            .collect::<rusqlite::Result<_>>()?;
        if counts.is_empty() {
            return Ok(());
        }
        // Each class's keys run from the tenant's next key on; the fair
        // state is advanced past them only once the move has committed.
        let mut bases = [0i64; CLASSES];
        {
            let fair = self.state.fair();
            for (priority, count) in &counts {
                let rank = priority.parse::<Priority>().map_or(1, Priority::rank);
                let class = &fair[rank];
                let last = class
                    .last_key
                    .get(&self.tenant_id)
                    .copied()
                    .unwrap_or(i64::MIN);
                bases[rank] = last.max(class.virtual_now);
                self.lasts.push((rank, bases[rank] + count));
            }
        }
        self.moved = tx
            .prepare_cached(
                "UPDATE queue_messages SET queue = ?1, visible_at = MIN(visible_at, ?2), \
                   fair_key = CASE queue_messages.priority WHEN 'high' THEN ?3 WHEN 'normal' THEN ?4 ELSE ?5 END + ordered.place \
                 FROM (SELECT seq, ROW_NUMBER() OVER (PARTITION BY priority ORDER BY seq) AS place \
                       FROM queue_messages WHERE queue = ?6 AND tenant_id = ?7) AS ordered \
                 WHERE queue_messages.seq = ordered.seq",
            )?
            .execute(rusqlite::params![
                names.main.as_str(),
                now_ms(),
                bases[Priority::High.rank()],
                bases[Priority::Normal.rank()],
                bases[Priority::Low.rank()],
                names.held.as_str(),
                self.tenant_id,
            ])? as u64;
        Ok(())
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if let Err(failure) = outcome {
            return failed(&mut self.reply, failure);
        }
        if self.moved > 0 {
            {
                let mut book = self.state.book();
                book.held = book.held.saturating_sub(self.moved);
                book.rows += self.moved;
            }
            let mut fair = self.state.fair();
            for (rank, last) in &self.lasts {
                let key = fair[*rank]
                    .last_key
                    .entry(self.tenant_id.clone())
                    .or_insert(*last);
                *key = (*key).max(*last);
            }
            drop(fair);
            self.state.arrived();
        }
        let _ = answer(&mut self.reply, Ok(()));
    }
}
