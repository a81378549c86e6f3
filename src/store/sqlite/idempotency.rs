//! Remembered answers for `Idempotency-Key` on SQLite.

use crate::store::StoreResult;
use async_trait::async_trait;

use super::{SqliteDb, args, tuple};
use crate::model::Scope;
use crate::store::idempotency::{IdempotencyStore, KeyClaim, RETENTION_MS, StoredResponse};

/// Inserts `rows` in the accept writer's transaction (replacing an
/// expired answer under the same key).
pub(crate) fn insert_rows(
    tx: &rusqlite::Transaction,
    rows: &[&StoredResponse],
) -> rusqlite::Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut insert = tx.prepare_cached(
        "INSERT OR REPLACE INTO idempotency_keys (tenant_id, key, request_hash, status_code, \
         response_body, message_id, created_at, test) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )?;
    for stored in rows {
        insert.execute(rusqlite::params![
            stored.tenant_id,
            stored.key,
            stored.request_hash,
            i64::from(stored.status_code),
            stored.response_body,
            stored.message_id,
            stored.created_at,
            stored.test,
        ])?;
    }
    Ok(())
}

#[async_trait]
impl IdempotencyStore for SqliteDb {
    async fn remembered_answer(
        &self,
        scope: &Scope,
        key: &str,
        now_ms: i64,
    ) -> StoreResult<Option<StoredResponse>> {
        const LOOKUP: &str = "SELECT request_hash, status_code, response_body, message_id, \
             created_at FROM idempotency_keys \
             WHERE tenant_id = ?1 AND key = ?2 AND created_at > ?3 AND test = ?4";
        let args = args![
            scope.tenant().to_owned(),
            key.to_owned(),
            now_ms - RETENTION_MS,
            scope.is_test()
        ];
        let row = self.row(LOOKUP, args, tuple).await?;
        Ok(row.map(|row| StoredResponse::from_row(scope, key, row)))
    }

    /// One process serves the file and holds its keys in flight in memory
    /// (`crate::accept`), so the claim writes nothing: the answer, if any.
    async fn claim_key(
        &self,
        scope: &Scope,
        key: &str,
        _request_hash: &str,
        _token: &str,
        now_ms: i64,
    ) -> StoreResult<KeyClaim> {
        Ok(match self.remembered_answer(scope, key, now_ms).await? {
            Some(stored) => KeyClaim::Answered(stored),
            None => KeyClaim::Claimed { durable: false },
        })
    }

    async fn release_key(&self, _scope: &Scope, _key: &str, _token: &str) -> StoreResult<()> {
        Ok(())
    }

    async fn purge_idempotency_keys(&self, now_ms: i64) -> StoreResult<Option<u64>> {
        const PURGE: &str = "DELETE FROM idempotency_keys WHERE created_at <= ?1";
        let done = self.execute(PURGE, args![now_ms - RETENTION_MS]).await?;
        Ok(Some(done as u64))
    }
}
