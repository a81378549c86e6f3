//! Retention on PostgreSQL: finding and erasing settled messages' personal
//! data, one instance's run at a time.

use crate::store::StoreResult;
use async_trait::async_trait;

use super::{PgDb, locks, try_lock};
use crate::store::retention::{Due, RetentionStore, RunLock, Scrubbed, settled_list};

#[async_trait]
impl RetentionStore for PgDb {
    async fn due_for_erasure(
        &self,
        tenant_id: &str,
        cutoff: i64,
        limit: usize,
    ) -> StoreResult<Vec<Due>> {
        let sql = format!(
            "SELECT id, status FROM messages \
             WHERE tenant_id = $1 AND erased_at IS NULL AND created_at < $2 \
             AND status IN {} ORDER BY created_at LIMIT $3",
            settled_list()
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(tenant_id)
            .bind(cutoff)
            .bind(limit as i64)
            .fetch_all(&self.pool)
            .await?)
    }

    async fn erase_messages(&self, ids: &[String], now: i64) -> StoreResult<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let messages = format!(
            "UPDATE messages SET reference = NULL, metadata = NULL, last_error = NULL, recipient = NULL, \
             erased_at = $1 WHERE erased_at IS NULL AND status IN {} AND id = ANY($2) \
             RETURNING id",
            settled_list()
        );
        let mut tx = self.pool.begin().await?;
        let erased: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(messages))
            .bind(now)
            .bind(ids)
            .fetch_all(&mut *tx)
            .await?;
        for statement in [
            "UPDATE message_events SET detail = NULL \
             WHERE detail IS NOT NULL AND message_id = ANY($1)",
            "DELETE FROM outbox WHERE message_id = ANY($1)",
            "DELETE FROM recipient_statuses WHERE message_id = ANY($1)",
        ] {
            sqlx::query(statement)
                .bind(&erased)
                .execute(&mut *tx)
                .await?;
        }
        // The messages' uses of files go, and then the files they used that
        // nothing uses any more, chunks and all (ON DELETE CASCADE): a file
        // goes with the last message that names it, as if it had expired
        // (the statement's "now" is the end of time).
        let files: Vec<String> = sqlx::query_scalar(
            "DELETE FROM attachment_uses WHERE message_id = ANY($1) RETURNING attachment_id",
        )
        .bind(&erased)
        .fetch_all(&mut *tx)
        .await?;
        if !files.is_empty() {
            sqlx::query(super::attachments::ERASE_UNUSED)
                .bind(i64::MAX)
                .bind(&files)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(erased.len() as u64)
    }

    async fn lock_retention_run(&self) -> StoreResult<Option<RunLock>> {
        Ok(try_lock(self, locks::RETENTION)
            .await?
            .map(RunLock::holding))
    }

    async fn undelivered(&self, tenant_id: &str) -> StoreResult<i64> {
        const UNDELIVERED: &str = "SELECT COUNT(*) FROM messages WHERE tenant_id = $1 \
             AND status IN ('scheduled', 'queued', 'sending', 'retrying')";
        Ok(sqlx::query_scalar(UNDELIVERED)
            .bind(tenant_id)
            .fetch_one(&self.pool)
            .await?)
    }

    async fn scrub_file(&self, _vacuum: bool) -> StoreResult<Scrubbed> {
        Ok(Scrubbed {
            vacuumed: false,
            log_truncated: true,
        })
    }
}
