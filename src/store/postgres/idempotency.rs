//! Remembered answers for `Idempotency-Key` on PostgreSQL.

use crate::store::StoreResult;
use async_trait::async_trait;

use super::{PgDb, locks, try_lock};
use crate::model::Scope;
use crate::store::idempotency::{
    AnswerRow, CLAIM_STALE_MS, IdempotencyStore, KeyClaim, RETENTION_MS, StoredResponse,
};

#[async_trait]
impl IdempotencyStore for PgDb {
    async fn remembered_answer(
        &self,
        scope: &Scope,
        key: &str,
        now_ms: i64,
    ) -> StoreResult<Option<StoredResponse>> {
        // A claim not answered yet (status 0) is no answer.
        const LOOKUP: &str = "SELECT request_hash, status_code, response_body, message_id, \
             created_at FROM idempotency_keys \
             WHERE tenant_id = $1 AND key = $2 AND created_at > $3 AND test = $4 \
             AND status_code <> 0";
        let row: Option<AnswerRow> = sqlx::query_as(LOOKUP)
            .bind(scope.tenant())
            .bind(key)
            .bind(now_ms - RETENTION_MS)
            .bind(scope.is_test())
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|row| StoredResponse::from_row(scope, key, row)))
    }

    /// A claim is a row with status 0 whose `message_id` holds the claim's
    /// token until the accept's commit writes the answer over it.
    async fn claim_key(
        &self,
        scope: &Scope,
        key: &str,
        request_hash: &str,
        token: &str,
        now_ms: i64,
    ) -> StoreResult<KeyClaim> {
        const CLAIM: &str = "INSERT INTO idempotency_keys AS k (tenant_id, key, request_hash, \
             status_code, response_body, message_id, created_at, test) \
             VALUES ($1, $2, $3, 0, '', $4, $5, $6) \
             ON CONFLICT (tenant_id, test, key) DO UPDATE SET request_hash = excluded.request_hash, \
             status_code = 0, response_body = '', message_id = excluded.message_id, \
             created_at = excluded.created_at \
             WHERE k.created_at <= $7 OR (k.status_code = 0 AND k.created_at <= $8) \
             RETURNING k.message_id";
        let claimed: Option<String> = sqlx::query_scalar(CLAIM)
            .bind(scope.tenant())
            .bind(key)
            .bind(request_hash)
            .bind(token)
            .bind(now_ms)
            .bind(scope.is_test())
            .bind(now_ms - RETENTION_MS)
            .bind(now_ms - CLAIM_STALE_MS)
            .fetch_optional(&self.pool)
            .await?;
        if claimed.is_some() {
            return Ok(KeyClaim::Claimed { durable: true });
        }
        const FOUND: &str = "SELECT request_hash, status_code, response_body, message_id, \
             created_at FROM idempotency_keys WHERE tenant_id = $1 AND key = $2 AND test = $3";
        let row: Option<AnswerRow> = sqlx::query_as(FOUND)
            .bind(scope.tenant())
            .bind(key)
            .bind(scope.is_test())
            .fetch_optional(&self.pool)
            .await?;
        Ok(match row {
            Some(row) if row.1 == 0 => KeyClaim::Pending { claimed_at: row.4 },
            Some(row) => KeyClaim::Answered(StoredResponse::from_row(scope, key, row)),
            // Purged between the two statements: a claim taken and given
            // up meanwhile; the caller may ask again.
            None => KeyClaim::Pending { claimed_at: now_ms },
        })
    }

    async fn release_key(&self, scope: &Scope, key: &str, token: &str) -> StoreResult<()> {
        sqlx::query(
            "DELETE FROM idempotency_keys WHERE tenant_id = $1 AND key = $2 AND test = $3 \
             AND message_id = $4 AND status_code = 0",
        )
        .bind(scope.tenant())
        .bind(key)
        .bind(scope.is_test())
        .bind(token)
        .execute(&self.pool)
        .await?;
        Ok(())
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
