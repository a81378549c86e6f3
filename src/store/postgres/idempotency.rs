//! Remembered answers for `Idempotency-Key` on PostgreSQL.

use crate::store::StoreResult;
use async_trait::async_trait;

use super::{PgDb, locks, try_lock};
use crate::model::Scope;
use crate::store::idempotency::{AnswerRow, IdempotencyStore, RETENTION_MS, StoredResponse};

#[async_trait]
impl IdempotencyStore for PgDb {
    async fn remembered_answer(
        &self,
        scope: &Scope,
        key: &str,
        now_ms: i64,
    ) -> StoreResult<Option<StoredResponse>> {
        const LOOKUP: &str = "SELECT request_hash, status_code, response_body, message_id, \
             created_at FROM idempotency_keys \
             WHERE tenant_id = $1 AND key = $2 AND created_at > $3 AND test = $4";
        let row: Option<AnswerRow> = sqlx::query_as(LOOKUP)
            .bind(scope.tenant())
            .bind(key)
            .bind(now_ms - RETENTION_MS)
            .bind(scope.is_test())
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|row| StoredResponse::from_row(scope, key, row)))
    }

    /// One instance at a time, under an advisory lock.
    async fn purge_idempotency_keys(&self, now_ms: i64) -> StoreResult<Option<u64>> {
        let Some(mut tx) = try_lock(self, locks::IDEMPOTENCY_PURGE).await? else {
            return Ok(None);
        };
        let done = sqlx::query("DELETE FROM idempotency_keys WHERE created_at <= $1")
            .bind(now_ms - RETENTION_MS)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Some(done.rows_affected()))
    }
}
