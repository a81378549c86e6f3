//! Stored answers for `Idempotency-Key`: per tenant and world (a test
//! key's answers are not a live key's), kept 24 hours, written
//! in the same transaction as the message they describe so a replay can
//! never name a message that was not accepted.

use super::{Db, sqlite};
use crate::model::Scope;

/// How long a key is remembered.
pub const RETENTION_MS: i64 = 24 * 60 * 60 * 1000;

/// One remembered answer.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredResponse {
    pub tenant_id: String,
    /// Answered to a test key: the key is remembered in the test world.
    pub test: bool,
    pub key: String,
    /// SHA-256 (hex) of the canonical request body.
    pub request_hash: String,
    pub status_code: u16,
    pub response_body: String,
    pub message_id: String,
    pub created_at: i64,
}

/// Inserts `rows` in the accept writer's transaction (replacing an
/// expired answer under the same key).
pub fn insert_rows(tx: &rusqlite::Transaction, rows: &[&StoredResponse]) -> rusqlite::Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut insert = tx.prepare_cached(
        "INSERT OR REPLACE INTO idempotency_keys (tenant_id, key, request_hash, status_code, response_body, message_id, created_at, test) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
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

/// The answer remembered for `key` in `scope`, if it is younger than 24
/// hours at `now_ms`.
pub async fn lookup(
    db: &Db,
    scope: &Scope,
    key: &str,
    now_ms: i64,
) -> anyhow::Result<Option<StoredResponse>> {
    const LOOKUP: &str = "SELECT request_hash, status_code, response_body, message_id, created_at \
         FROM idempotency_keys WHERE tenant_id = $1 AND key = $2 AND created_at > $3 AND test = $4";
    let since = now_ms - RETENTION_MS;
    let row: Option<(String, i64, String, String, i64)> = match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![
                scope.tenant().to_owned(),
                key.to_owned(),
                since,
                scope.is_test()
            ];
            db.row(LOOKUP, args, sqlite::tuple).await?
        }
        Db::Postgres(db) => {
            sqlx::query_as(LOOKUP)
                .bind(scope.tenant())
                .bind(key)
                .bind(since)
                .bind(scope.is_test())
                .fetch_optional(&db.pool)
                .await?
        }
    };
    Ok(row.map(
        |(request_hash, status_code, response_body, message_id, created_at)| StoredResponse {
            tenant_id: scope.tenant().to_owned(),
            test: scope.is_test(),
            key: key.to_owned(),
            request_hash,
            status_code: status_code as u16,
            response_body,
            message_id,
            created_at,
        },
    ))
}

/// Forgets keys older than 24 hours at `now_ms`; returns how many. With
/// several instances on PostgreSQL, one of them does it at a time (`None`
/// from the others).
pub async fn purge_expired(db: &Db, now_ms: i64) -> anyhow::Result<Option<u64>> {
    const PURGE: &str = "DELETE FROM idempotency_keys WHERE created_at <= $1";
    match db {
        Db::Sqlite(sqlite) => {
            let done = sqlite
                .execute(PURGE, sqlite::args![now_ms - RETENTION_MS])
                .await?;
            Ok(Some(done as u64))
        }
        Db::Postgres(pg) => {
            let Some(mut tx) =
                super::postgres::try_lock(pg, super::postgres::locks::IDEMPOTENCY_PURGE).await?
            else {
                return Ok(None);
            };
            let done = sqlx::query(PURGE)
                .bind(now_ms - RETENTION_MS)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(Some(done.rows_affected()))
        }
    }
}

/// (Being moved here: the idempotency operations, implemented per engine in
/// `sqlite/idempotency.rs` and `postgres/idempotency.rs`.)
#[async_trait::async_trait]
pub trait IdempotencyStore: Send + Sync {}
