//! Dedicated tenant queues: a tenant's own queue in each lane
//! (`fast:t:acme`), served by attention workers through the lane's
//! attention queue (`fast:attention`), which holds one entry per tenant
//! queue that needs a slice of work. Here: routing a tenant's new messages
//! there or not (the routing itself is an insert's), views of one queue as
//! a [`LaneQueue`], the attention signal after a slice and at start-up,
//! and the purge of a tenant's queues.

use std::sync::{Arc, PoisonError};

use rusqlite::Transaction;

use super::insert::Inserted;
use super::state::LaneState;
use super::{EmbeddedQueue, Reply, answer, failed};
use crate::model::{Lane, now_ms};
use crate::queue::LaneQueue;
use crate::store::sqlite::lifecycle;
use crate::store::sqlite::writer::{Work, WriteFailed};

impl EmbeddedQueue {
    /// Routes `tenant_id`'s new messages to its own queues, or back to the
    /// lanes.
    pub(super) fn set_dedicated(&self, tenant_id: &str, dedicated: bool) {
        let mut tenants = self
            .dedicated
            .tenants
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if dedicated {
            tenants.insert(tenant_id.to_owned());
        } else {
            tenants.remove(tenant_id);
        }
    }

    /// `tenant_id`'s own queue in `lane` as a queue of its own, if it has
    /// ever had one there.
    pub(super) fn tenant_queue(&self, lane: Lane, tenant_id: &str) -> Option<Arc<dyn LaneQueue>> {
        let state = self
            .dedicated
            .queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(lane, tenant_id.to_owned()))
            .cloned();
        state.map(|state| self.view(state))
    }

    /// The lanes in which `tenant_id` has a queue of its own.
    pub(super) fn tenant_lanes(&self, tenant_id: &str) -> Vec<Lane> {
        let queues = self
            .dedicated
            .queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Lane::ALL
            .iter()
            .copied()
            .filter(|lane| queues.contains_key(&(*lane, tenant_id.to_owned())))
            .collect()
    }

    /// A view of one queue of this file as a [`LaneQueue`].
    pub(super) fn view(&self, state: Arc<LaneState>) -> Arc<dyn LaneQueue> {
        Arc::new(EmbeddedQueue {
            pinned: Some(state),
            ..self.clone()
        })
    }

    /// After a slice of `tenant_id`'s queue in `lane`: when rows remain,
    /// makes sure an attention entry waits for them. Returns whether
    /// backlog remains.
    pub(super) async fn signal_backlog(&self, lane: Lane, tenant_id: &str) -> anyhow::Result<bool> {
        let Some(state) = self
            .dedicated
            .queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(lane, tenant_id.to_owned()))
            .cloned()
        else {
            return Ok(false);
        };
        let queue = self.clone();
        let tenant_id = tenant_id.to_owned();
        self.through_writer(|reply| {
            Box::new(SignalWork {
                queue,
                state,
                tenant_id,
                inserted: Inserted::default(),
                backlog: false,
                reply: Some(reply),
            })
        })
        .await
    }

    /// Signals attention for every dedicated tenant queue that has rows;
    /// returns how many have backlog.
    pub(super) async fn signal_backlogs(&self) -> anyhow::Result<usize> {
        let queues: Vec<((Lane, String), Arc<LaneState>)> = self
            .dedicated
            .queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(_, state)| state.book().rows > 0)
            .map(|(key, state)| (key.clone(), state.clone()))
            .collect();
        let mut backlogged = 0;
        for ((lane, tenant_id), _) in queues {
            if self.signal_backlog(lane, &tenant_id).await? {
                backlogged += 1;
            }
        }
        Ok(backlogged)
    }

    /// Removes the rows of `tenant_id`'s own queues that are not in flight,
    /// marks their messages `cancelled` where not sent yet, and returns
    /// their ids.
    pub(super) async fn purge_tenant_queues(&self, tenant_id: &str) -> anyhow::Result<Vec<String>> {
        let mut ids = Vec::new();
        for lane in self.tenant_lanes(tenant_id) {
            let Some(state) = self
                .dedicated
                .queues
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&(lane, tenant_id.to_owned()))
                .cloned()
            else {
                continue;
            };
            ids.extend(
                self.through_writer(|reply| {
                    Box::new(PurgeWork {
                        state,
                        purged: Vec::new(),
                        reply: Some(reply),
                    })
                })
                .await?,
            );
        }
        Ok(ids)
    }
}

/// After a slice: when a dedicated queue still has rows, makes sure an
/// attention entry waits, visible when the first of them can be received.
struct SignalWork {
    queue: EmbeddedQueue,
    state: Arc<LaneState>,
    tenant_id: String,
    inserted: Inserted,
    backlog: bool,
    reply: Reply<bool>,
}

impl Work for SignalWork {
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        self.inserted = Inserted::default();
        let now = now_ms();
        let delay = {
            let mut book = self.state.book();
            let delayed = book.delayed_now(now);
            let in_flight = book.in_flight(now) as u64;
            self.backlog = book.rows > 0;
            if !self.backlog {
                None
            } else if book.rows > delayed + in_flight {
                Some(0)
            } else {
                // Everything waits for a delay or a lease: wake then.
                Some(book.next_due(now).map_or(1000, |at| at - now))
            }
        };
        if let Some(delay) = delay {
            self.queue.signal_attention(
                tx,
                self.state.lane,
                &self.tenant_id,
                delay,
                &mut self.inserted,
            )?;
        }
        Ok(())
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if let Err(failure) = outcome {
            return failed(&mut self.reply, failure);
        }
        self.inserted.book();
        let _ = answer(&mut self.reply, Ok(self.backlog));
    }
}

/// Removes the rows of a dedicated queue that are not in flight and marks
/// their messages `cancelled` where they were not sent yet.
struct PurgeWork {
    state: Arc<LaneState>,
    purged: Vec<(i64, String)>,
    reply: Reply<Vec<String>>,
}

impl Work for PurgeWork {
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        self.purged.clear();
        let now = now_ms();
        let rows: Vec<(i64, String)> = tx
            .prepare_cached("SELECT seq, message_id FROM queue_messages WHERE queue = ?1")?
            .query_map([self.state.names.main.as_str()], |row| {
                Ok((row.get(0)?, row.get(1)?))
            })?
            .collect::<rusqlite::Result<_>>()?;
        let book = self.state.book();
        let mut delete = tx.prepare_cached("DELETE FROM queue_messages WHERE seq = ?1")?;
        for (seq, message_id) in rows {
            if book.leases.get(&seq).is_some_and(|lease| lease.until > now) {
                continue;
            }
            delete.execute([seq])?;
            lifecycle::cancel(tx, &message_id, None, None, now)?;
            self.purged.push((seq, message_id));
        }
        Ok(())
    }

    fn rolled_back(&mut self) {
        self.purged.clear();
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if let Err(failure) = outcome {
            return failed(&mut self.reply, failure);
        }
        {
            let mut book = self.state.book();
            for (seq, _) in &self.purged {
                book.leases.remove(seq);
            }
            book.rows = book.rows.saturating_sub(self.purged.len() as u64);
        }
        let ids = self.purged.drain(..).map(|(_, id)| id).collect();
        let _ = answer(&mut self.reply, Ok(ids));
    }
}
