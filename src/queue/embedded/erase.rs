//! Erasure: removing for good the rows of a tenant's messages that wait
//! where no consumer takes them soon (dead letters, set-aside messages,
//! delayed rows of cancelled scheduled messages), for retention and for
//! tenant deletion. Rows in flight are left to the consumer that holds
//! them: it deletes them when it sees the message settled.

use std::collections::HashSet;
use std::sync::Arc;

use rusqlite::Transaction;

use super::state::LaneState;
use super::{EmbeddedQueue, Reply, answer, failed};
use crate::model::now_ms;
use crate::store::sqlite::writer::{Work, WriteFailed};

impl EmbeddedQueue {
    /// See [`crate::queue::TenantQueues::erase_waiting`].
    pub(super) async fn erase_rows(
        &self,
        tenant_id: &str,
        message_ids: Option<&[String]>,
    ) -> anyhow::Result<Vec<String>> {
        if message_ids.is_some_and(<[String]>::is_empty) {
            return Ok(Vec::new());
        }
        let mut erased = Vec::new();
        for state in self.states_of(tenant_id) {
            let wanted = message_ids.map(|ids| ids.iter().cloned().collect());
            erased.extend(
                self.through_writer(|reply| {
                    Box::new(EraseWork {
                        state,
                        tenant_id: tenant_id.to_owned(),
                        wanted,
                        removed: Removed::default(),
                        reply: Some(reply),
                    })
                })
                .await?,
            );
        }
        Ok(erased)
    }
}

/// What one erasure took from a queue's three names.
#[derive(Default)]
struct Removed {
    ids: Vec<String>,
    main: u64,
    dlq: u64,
    held: u64,
    /// Due times of delayed main rows removed.
    delayed: Vec<i64>,
}

struct EraseWork {
    state: Arc<LaneState>,
    tenant_id: String,
    /// `None`: every row of the tenant.
    wanted: Option<HashSet<String>>,
    removed: Removed,
    reply: Reply<Vec<String>>,
}

impl Work for EraseWork {
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        let names = self.state.names.clone();
        self.removed = Removed::default();
        let rows: Vec<(i64, String, String, i64)> = tx
            .prepare_cached(
                "SELECT seq, message_id, queue, visible_at FROM queue_messages \
                 WHERE queue IN (?1, ?2, ?3) AND tenant_id = ?4",
            )?
            .query_map(
                rusqlite::params![
                    names.main.as_str(),
                    names.dlq.as_str(),
                    names.held.as_str(),
                    self.tenant_id
                ],
                |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?)),
            )?
            .collect::<rusqlite::Result<_>>()?;
        let now = now_ms();
        let leased: HashSet<i64> = {
            let book = self.state.book();
            rows.iter()
                .filter(|(seq, ..)| book.leases.get(seq).is_some_and(|l| l.until > now))
                .map(|(seq, ..)| *seq)
                .collect()
        };
        let mut delete = tx.prepare_cached("DELETE FROM queue_messages WHERE seq = ?1")?;
        // Retention chose these messages by a status read before this
        // transaction; one redriven since is waiting to be sent again and
        // keeps its copy. Read here, in the writer's turn, nothing can
        // move it between the check and the delete.
        let mut still_ended = tx.prepare_cached(
            "SELECT 1 FROM messages WHERE id = ?1 AND status IN ('dead_lettered', 'cancelled')",
        )?;
        for (seq, message_id, queue, visible_at) in rows {
            let wanted = self
                .wanted
                .as_ref()
                .is_none_or(|ids| ids.contains(&message_id));
            if !wanted || leased.contains(&seq) {
                continue;
            }
            if self.wanted.is_some() && !still_ended.exists([&message_id])? {
                continue;
            }
            delete.execute([seq])?;
            if queue == names.main {
                self.removed.main += 1;
                if visible_at > now {
                    self.removed.delayed.push(visible_at);
                }
            } else if queue == names.dlq {
                self.removed.dlq += 1;
            } else {
                self.removed.held += 1;
            }
            self.removed.ids.push(message_id);
        }
        Ok(())
    }

    fn rolled_back(&mut self) {
        self.removed = Removed::default();
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if let Err(failure) = outcome {
            return failed(&mut self.reply, failure);
        }
        let removed = std::mem::take(&mut self.removed);
        {
            let mut book = self.state.book();
            book.rows = book.rows.saturating_sub(removed.main);
            book.dlq = book.dlq.saturating_sub(removed.dlq);
            book.held = book.held.saturating_sub(removed.held);
            for at in removed.delayed {
                book.remove_delayed(at);
            }
        }
        let _ = answer(&mut self.reply, Ok(removed.ids));
    }
}
