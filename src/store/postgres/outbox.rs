//! The outbox on PostgreSQL, swept by several instances at once.

use crate::store::StoreResult;
use async_trait::async_trait;

use super::PgDb;
use crate::model::now_ms;
use crate::store::outbox::{OutboxRow, OutboxStore, SendRows, counts_by_lane};

#[async_trait]
impl OutboxStore for PgDb {
    /// Another instance may be sending its rows: only those past the
    /// sweep's age are taken.
    fn start_up_cutoff(&self, now: i64, sweep_age: i64) -> Option<i64> {
        Some(now - sweep_age)
    }

    /// Each page claimed with `FOR UPDATE SKIP LOCKED`, its sent rows
    /// removed and marked in the same transaction.
    async fn drain_outbox(
        &self,
        cutoff: i64,
        page: i64,
        send: &mut SendRows<'_>,
    ) -> StoreResult<usize> {
        const DUE: &str = "SELECT message_id, lane, tenant_id, channel, priority, body FROM outbox \
             WHERE (due_at IS NULL AND created_at <= $1) OR due_at <= $2 \
             ORDER BY created_at LIMIT $3 FOR UPDATE SKIP LOCKED";
        let mut resent = 0;
        loop {
            let mut tx = self.pool.begin().await?;
            let rows: Vec<OutboxRow> = sqlx::query_as(DUE)
                .bind(cutoff)
                .bind(now_ms())
                .bind(page)
                .fetch_all(&mut *tx)
                .await?;
            let page_len = rows.len();
            let sent = send(rows).await?;
            sqlx::query("DELETE FROM outbox WHERE message_id = ANY($1)")
                .bind(&sent)
                .execute(&mut *tx)
                .await?;
            super::lifecycle::due(&mut tx, &sent, now_ms()).await?;
            tx.commit().await?;
            resent += sent.len();
            if (page_len as i64) < page || sent.is_empty() {
                return Ok(resent);
            }
        }
    }

    async fn outbox_by_lane(&self) -> StoreResult<[u64; 2]> {
        const COUNT: &str = "SELECT lane, COUNT(*) FROM outbox GROUP BY lane";
        Ok(counts_by_lane(
            sqlx::query_as(COUNT).fetch_all(&self.pool).await?,
        ))
    }

    async fn scheduled_by_tenant(&self) -> StoreResult<Vec<(String, i64)>> {
        // The lanes' rows are there only with `queue.backend = "postgres"`
        // (otherwise the table is empty): a delayed row not held by a
        // consumer, of a message scheduled or waiting for its retry (a
        // paused tenant's messages wait too, and are not counted).
        const COUNT: &str = "SELECT tenant_id, COUNT(*) FROM ( \
             SELECT tenant_id FROM outbox WHERE due_at IS NOT NULL \
             UNION ALL SELECT l.tenant_id FROM lane_messages l JOIN messages m ON m.id = l.message_id \
             WHERE (l.queue IN ('fast', 'slow') OR (l.queue LIKE '%:t:%' AND l.queue NOT LIKE '%:t:%:dlq')) \
             AND NOT l.leased AND l.visible_at > $1 \
             AND m.status IN ('scheduled', 'retrying')) AS w \
            GROUP BY tenant_id";
        Ok(sqlx::query_as(COUNT)
            .bind(now_ms())
            .fetch_all(&self.pool)
            .await?)
    }

    async fn forget_outbox_rows(&self, ids: &[String]) -> StoreResult<()> {
        if ids.is_empty() {
            return Ok(());
        }
        sqlx::query("DELETE FROM outbox WHERE message_id = ANY($1)")
            .bind(ids)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn outbox_waiting_of_tenant(
        &self,
        tenant_id: &str,
        limit: i64,
    ) -> StoreResult<Vec<String>> {
        const WAITING: &str = "SELECT message_id FROM outbox \
             WHERE tenant_id = $1 AND due_at IS NULL ORDER BY message_id LIMIT $2";
        Ok(sqlx::query_scalar(WAITING)
            .bind(tenant_id)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?)
    }
}
