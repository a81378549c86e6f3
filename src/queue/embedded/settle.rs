//! Settling received messages by their receipts: deletes, visibility
//! changes (in memory only, where the leases live), deferrals (back into
//! the lane with a fresh fair key, the receive not counted) and moves to
//! the DLQ; and the dead letters themselves, listed and redriven back into
//! the lane with fresh fair keys and a fresh attempt budget.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use rusqlite::Transaction;

use super::receive::parse_receipt;
use super::state::LaneState;
use super::{EmbeddedQueue, Reply, answer, failed};
use crate::model::{Lane, Priority, now_ms};
use crate::queue::{DeadLetter, EntryResult, ReceivedMessage, RedriveFilter};
use crate::store::sqlite::lifecycle;
use crate::store::sqlite::writer::{Work, WriteFailed};

impl EmbeddedQueue {
    /// Deletes received messages of `lane`; one result per receipt.
    pub(super) async fn delete_received(
        &self,
        lane: Lane,
        receipts: &[String],
    ) -> anyhow::Result<Vec<EntryResult>> {
        let state = self.state(lane).clone();
        let receipts = receipts.to_vec();
        self.through_writer(|reply| {
            Box::new(DeleteWork {
                state,
                results: Vec::with_capacity(receipts.len()),
                receipts,
                deleted: Vec::new(),
                reply: Some(reply),
            })
        })
        .await
    }

    /// Sets the remaining invisibility of received messages of `lane`: only
    /// their leases change, so nothing is written.
    pub(super) fn change_leases(
        &self,
        lane: Lane,
        changes: &[(String, Duration)],
    ) -> Vec<EntryResult> {
        let state = self.state(lane);
        let now = now_ms();
        let mut returned_any = false;
        let results = {
            let mut book = state.book();
            changes
                .iter()
                .map(|(receipt, visibility)| {
                    let Some((seq, count)) = parse_receipt(receipt) else {
                        return Err(format!("receipt {receipt:?} is malformed"));
                    };
                    match book.leases.get_mut(&seq) {
                        Some(lease) if lease.count == count => {
                            lease.until = now + visibility.as_millis() as i64;
                            returned_any |= visibility.is_zero();
                            Ok(())
                        }
                        _ => Err(format!("receipt {receipt:?} is no longer valid")),
                    }
                })
                .collect()
        };
        if returned_any {
            state.arrived();
        }
        results
    }

    /// Puts a received message back into `lane`, receivable again after
    /// `delay`, the receive not counted.
    pub(super) async fn defer_received(
        &self,
        lane: Lane,
        message: &ReceivedMessage,
        delay: Duration,
    ) -> anyhow::Result<()> {
        self.move_received(lane, message, Destination::Deferred { delay })
            .await
    }

    /// Moves a received message of `lane` to the lane's DLQ.
    pub(super) async fn dead_letter_received(
        &self,
        lane: Lane,
        message: &ReceivedMessage,
    ) -> anyhow::Result<()> {
        self.move_received(lane, message, Destination::DeadLettered)
            .await
    }

    async fn move_received(
        &self,
        lane: Lane,
        message: &ReceivedMessage,
        to: Destination,
    ) -> anyhow::Result<()> {
        let state = self.state(lane).clone();
        let (receipt, tenant_id, priority) = (
            message.receipt.clone(),
            message.tenant_id.clone(),
            message.priority,
        );
        self.through_writer(|reply| {
            Box::new(MoveWork {
                state,
                receipt,
                tenant_id,
                priority,
                to,
                due: None,
                reply: Some(reply),
            })
        })
        .await
    }

    /// Dead letters of `lane`, oldest first.
    pub(super) async fn dead_letters(
        &self,
        lane: Lane,
        limit: usize,
    ) -> anyhow::Result<Vec<DeadLetter>> {
        type Row = (String, String, String, String, i64, i64, String);
        let rows: Vec<Row> = self
            .db
            .rows(
                "SELECT message_id, tenant_id, channel, priority, receive_count, enqueued_at, body \
                 FROM queue_messages WHERE queue = ? ORDER BY seq LIMIT ?",
                crate::store::sqlite::args![
                    self.state(lane).names.dlq.as_str().to_owned(),
                    limit as i64
                ],
                crate::store::sqlite::tuple,
            )
            .await?;
        rows.into_iter()
            .map(
                |(message_id, tenant_id, channel, priority, count, enqueued_at, body)| {
                    Ok(DeadLetter {
                        message_id,
                        tenant_id,
                        channel: channel.parse().map_err(anyhow::Error::msg)?,
                        priority: priority.parse().map_err(anyhow::Error::msg)?,
                        receive_count: count.max(0) as u32,
                        enqueued_at_ms: enqueued_at,
                        body,
                    })
                },
            )
            .collect()
    }

    /// Moves the dead letters of `lane` that match `filter` back into the
    /// lane; returns their ids.
    pub(super) async fn redrive_dead_letters(
        &self,
        lane: Lane,
        filter: &RedriveFilter,
    ) -> anyhow::Result<Vec<String>> {
        if filter.message_ids.as_ref().is_some_and(Vec::is_empty) {
            return Ok(Vec::new());
        }
        let state = self.state(lane).clone();
        let filter = filter.clone();
        self.through_writer(|reply| {
            Box::new(RedriveWork {
                state,
                filter,
                ids: Vec::new(),
                reply: Some(reply),
            })
        })
        .await
    }
}

/// Deletes received messages; one result per receipt.
struct DeleteWork {
    state: Arc<LaneState>,
    receipts: Vec<String>,
    results: Vec<EntryResult>,
    deleted: Vec<i64>,
    reply: Reply<Vec<EntryResult>>,
}

impl Work for DeleteWork {
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        let names = self.state.names.clone();
        let mut delete =
            tx.prepare_cached("DELETE FROM queue_messages WHERE seq = ?1 AND queue = ?2")?;
        let book = self.state.book();
        for receipt in &self.receipts {
            let Some((seq, count)) = parse_receipt(receipt) else {
                self.results
                    .push(Err(format!("receipt {receipt:?} is malformed")));
                continue;
            };
            let current = book.leases.get(&seq).is_some_and(|l| l.count == count);
            if current && delete.execute(rusqlite::params![seq, names.main.as_str()])? == 1 {
                self.deleted.push(seq);
                self.results.push(Ok(()));
            } else {
                self.results
                    .push(Err(format!("receipt {receipt:?} is no longer valid")));
            }
        }
        Ok(())
    }

    fn rolled_back(&mut self) {
        self.results.clear();
        self.deleted.clear();
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if let Err(failure) = outcome {
            return failed(&mut self.reply, failure);
        }
        {
            let mut book = self.state.book();
            for seq in &self.deleted {
                book.leases.remove(seq);
            }
            book.rows = book.rows.saturating_sub(self.deleted.len() as u64);
        }
        self.state
            .deleted
            .fetch_add(self.deleted.len() as u64, Ordering::Relaxed);
        let results = std::mem::take(&mut self.results);
        let _ = answer(&mut self.reply, Ok(results));
    }
}

/// What a received message is turned into by [`MoveWork`].
#[derive(Debug, Clone, Copy)]
enum Destination {
    /// Back into the lane after `delay`, with a fresh fair key, the receive
    /// not counted.
    Deferred { delay: Duration },
    /// Into the lane's DLQ.
    DeadLettered,
}

/// Moves one received message: a deferral or a move to the DLQ.
struct MoveWork {
    state: Arc<LaneState>,
    receipt: String,
    tenant_id: String,
    priority: Priority,
    to: Destination,
    /// When the deferred message is due (ms), once applied.
    due: Option<i64>,
    reply: Reply<()>,
}

impl Work for MoveWork {
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        let names = self.state.names.clone();
        let receipt = self.receipt.as_str();
        let (seq, count) =
            parse_receipt(receipt).with_context(|| format!("receipt {receipt:?} is malformed"))?;
        let current = self
            .state
            .book()
            .leases
            .get(&seq)
            .is_some_and(|l| l.count == count);
        let now = now_ms();
        let done = current
            && match self.to {
                Destination::Deferred { delay } => {
                    // A fresh fair key: the message queues behind its
                    // tenant's others. The receive is not counted.
                    let key = self.state.fair()[self.priority.rank()].next_key(&self.tenant_id);
                    let due = now + delay.as_millis() as i64;
                    self.due = Some(due);
                    tx.prepare_cached(
                        "UPDATE queue_messages SET visible_at = ?1, fair_key = ?2, receive_count = ?3 \
                         WHERE seq = ?4 AND queue = ?5",
                    )?
                    .execute(rusqlite::params![
                        due,
                        key,
                        count.saturating_sub(1),
                        seq,
                        names.main.as_str()
                    ])? == 1
                }
                Destination::DeadLettered => {
                    tx.prepare_cached(
                        "UPDATE queue_messages SET queue = ?1, visible_at = ?2, receive_count = ?3 \
                         WHERE seq = ?4 AND queue = ?5",
                    )?
                    .execute(rusqlite::params![
                        names.dlq.as_str(),
                        now,
                        count,
                        seq,
                        names.main.as_str()
                    ])? == 1
                }
            };
        if !done {
            // Not a failure of the group: only this receipt is stale.
            self.due = None;
            let _ = answer(
                &mut self.reply,
                Err(anyhow::Error::new(crate::queue::StaleReceipt(
                    receipt.to_owned(),
                ))),
            );
        }
        Ok(())
    }

    fn rolled_back(&mut self) {
        self.due = None;
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if let Err(failure) = outcome {
            return failed(&mut self.reply, failure);
        }
        if self.reply.is_none() {
            return; // answered as stale in apply
        }
        let Some((seq, _)) = parse_receipt(&self.receipt) else {
            return;
        };
        let now = now_ms();
        let mut book = self.state.book();
        book.leases.remove(&seq);
        match self.to {
            Destination::Deferred { .. } => {
                if let Some(due) = self.due {
                    book.add_delayed(due, now);
                    if due <= now {
                        drop(book);
                        self.state.arrived();
                    }
                }
            }
            Destination::DeadLettered => {
                book.rows = book.rows.saturating_sub(1);
                book.dlq += 1;
            }
        }
        let _ = answer(&mut self.reply, Ok(()));
    }
}

/// Moves matching dead letters back into the lane with fresh fair keys
/// and, in the same transaction, a fresh attempt budget.
struct RedriveWork {
    state: Arc<LaneState>,
    filter: RedriveFilter,
    ids: Vec<String>,
    reply: Reply<Vec<String>>,
}

impl Work for RedriveWork {
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        let names = self.state.names.clone();
        self.ids.clear();
        let wanted: Option<HashSet<&String>> = self
            .filter
            .message_ids
            .as_ref()
            .map(|ids| ids.iter().collect());
        let rows: Vec<(i64, String, String, String)> = tx
            .prepare_cached(
                "SELECT seq, message_id, tenant_id, priority FROM queue_messages \
                 WHERE queue = ?1 AND (?2 IS NULL OR tenant_id = ?2) ORDER BY seq",
            )?
            .query_map(
                rusqlite::params![names.dlq.as_str(), self.filter.tenant_id],
                |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?)),
            )?
            .collect::<rusqlite::Result<_>>()?;
        let now = now_ms();
        let mut move_back = tx.prepare_cached(
            "UPDATE queue_messages SET queue = ?1, visible_at = ?2, receive_count = 0, fair_key = ?3, \
             last_error = NULL WHERE seq = ?4",
        )?;
        for (seq, message_id, tenant_id, priority) in rows {
            if wanted
                .as_ref()
                .is_some_and(|ids| !ids.contains(&message_id))
            {
                continue;
            }
            let rank = priority.parse::<Priority>().map_or(1, Priority::rank);
            let key = self.state.fair()[rank].next_key(&tenant_id);
            move_back.execute(rusqlite::params![names.main.as_str(), now, key, seq])?;
            lifecycle::redrive(tx, &message_id, i64::MAX, now)?;
            self.ids.push(message_id);
        }
        Ok(())
    }

    fn rolled_back(&mut self) {
        self.ids.clear();
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if let Err(failure) = outcome {
            return failed(&mut self.reply, failure);
        }
        let moved = self.ids.len() as u64;
        if moved > 0 {
            {
                let mut book = self.state.book();
                book.dlq = book.dlq.saturating_sub(moved);
                book.rows += moved;
            }
            self.state.arrived();
        }
        let ids = std::mem::take(&mut self.ids);
        let _ = answer(&mut self.reply, Ok(ids));
    }
}
