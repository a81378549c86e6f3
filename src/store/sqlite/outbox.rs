//! The outbox on SQLite (a SQLite store with SQS lanes).

use crate::store::StoreResult;
use async_trait::async_trait;

use super::{SqliteDb, args, tuple};
use crate::message::OutboundMessage;
use crate::model::{Lane, now_ms};
use crate::store::lifecycle::Move;
use crate::store::outbox::{OutboxRow, OutboxStore, SendRows, counts_by_lane};

/// Inserts the outbox rows of a group in the SQLite writer's transaction.
/// Each row's `Option<i64>` is when a scheduled message is due (ms): the
/// scheduler sends it then; `None` rows are sent by the relay at once.
pub(crate) fn insert_rows(
    tx: &rusqlite::Transaction,
    rows: &[(Lane, &OutboundMessage, Option<i64>)],
    now: i64,
) -> rusqlite::Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut insert = tx.prepare_cached(
        "INSERT OR REPLACE INTO outbox (message_id, lane, tenant_id, channel, priority, body, \
         created_at, due_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )?;
    for (lane, message, due_at) in rows {
        insert.execute(rusqlite::params![
            message.message_id,
            lane.as_str(),
            message.tenant_id,
            message.channel.as_str(),
            message.priority.as_str(),
            message.body,
            now,
            due_at,
        ])?;
    }
    Ok(())
}

impl SqliteDb {
    /// Scheduled messages that reached their lane are `queued`
    /// ([`Move::Due`]).
    async fn mark_due_queued(&self, ids: &[String]) -> anyhow::Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let (ids, now) = (ids.to_vec(), now_ms());
        self.transact(move |tx| {
            for id in &ids {
                super::lifecycle::requeue(tx, id, Move::Due, now)?;
            }
            Ok(())
        })
        .await
    }
}

#[async_trait]
impl OutboxStore for SqliteDb {
    /// A SQLite file belongs to one instance: every row left is taken.
    fn start_up_cutoff(&self, _now: i64, _sweep_age: i64) -> Option<i64> {
        None
    }

    /// Pages in id order, each read on a reader, sent, then marked and
    /// removed (one instance sweeps a SQLite file).
    async fn drain_outbox(
        &self,
        cutoff: i64,
        page: i64,
        send: &mut SendRows<'_>,
    ) -> StoreResult<usize> {
        const DUE: &str = "SELECT message_id, lane, tenant_id, channel, priority, body FROM outbox \
             WHERE ((due_at IS NULL AND created_at <= ?1) OR due_at <= ?2) \
             AND message_id > ?3 ORDER BY message_id LIMIT ?4";
        let mut resent = 0;
        let mut after = String::new();
        loop {
            let rows: Vec<OutboxRow> = self
                .rows(DUE, args![cutoff, now_ms(), after.clone(), page], tuple)
                .await?;
            let Some(last) = rows.last() else {
                return Ok(resent);
            };
            after = last.0.clone();
            let page_len = rows.len();
            let sent = send(rows).await?;
            resent += sent.len();
            self.mark_due_queued(&sent).await?;
            self.forget_outbox_rows(&sent).await?;
            if (page_len as i64) < page {
                return Ok(resent);
            }
        }
    }

    async fn outbox_by_lane(&self) -> StoreResult<[u64; 2]> {
        const COUNT: &str = "SELECT lane, COUNT(*) FROM outbox GROUP BY lane";
        Ok(counts_by_lane(self.rows(COUNT, vec![], tuple).await?))
    }

    async fn scheduled_by_tenant(&self) -> StoreResult<Vec<(String, i64)>> {
        const COUNT: &str = "SELECT tenant_id, COUNT(*) FROM outbox INDEXED BY outbox_due \
             WHERE due_at IS NOT NULL GROUP BY tenant_id";
        Ok(self.rows(COUNT, vec![], tuple).await?)
    }

    async fn forget_outbox_rows(&self, ids: &[String]) -> StoreResult<()> {
        if ids.is_empty() {
            return Ok(());
        }
        Ok(self
            .execute_for_ids(ids, "DELETE FROM outbox WHERE message_id IN (")
            .await?)
    }

    async fn outbox_waiting_of_tenant(
        &self,
        tenant_id: &str,
        limit: i64,
    ) -> StoreResult<Vec<String>> {
        const WAITING: &str = "SELECT message_id FROM outbox \
             WHERE tenant_id = ?1 AND due_at IS NULL ORDER BY message_id LIMIT ?2";
        Ok(self
            .rows(WAITING, args![tenant_id.to_owned(), limit], |row| {
                row.get(0)
            })
            .await?)
    }
}
