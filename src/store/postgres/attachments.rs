//! Attachments on PostgreSQL: the file's row and its chunks as `bytea`.

use async_trait::async_trait;
use sqlx::Row;

use super::PgDb;
use crate::model::Scope;
use crate::store::StoreResult;
use crate::store::attachments::{AttachmentRow, AttachmentStore, NotClaimed};

const COLUMNS: &str =
    "id, tenant_id, test, filename, content_type, size, sha256, message_id, created_at";

fn attachment_row(row: &sqlx::postgres::PgRow) -> Result<AttachmentRow, sqlx::Error> {
    Ok(AttachmentRow {
        id: row.try_get(0)?,
        tenant_id: row.try_get(1)?,
        test: row.try_get(2)?,
        filename: row.try_get(3)?,
        content_type: row.try_get(4)?,
        size: row.try_get(5)?,
        sha256: row.try_get(6)?,
        message_id: row.try_get(7)?,
        created_at: row.try_get(8)?,
    })
}

#[async_trait]
impl AttachmentStore for PgDb {
    async fn begin_attachment(&self, row: &AttachmentRow) -> StoreResult<()> {
        const INSERT: &str = "INSERT INTO attachments (id, tenant_id, test, filename, \
             content_type, size, sha256, message_id, created_at) \
             VALUES ($1, $2, $3, $4, $5, 0, NULL, NULL, $6)";
        sqlx::query(INSERT)
            .bind(&row.id)
            .bind(&row.tenant_id)
            .bind(row.test)
            .bind(&row.filename)
            .bind(&row.content_type)
            .bind(row.created_at)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn add_attachment_chunk(&self, id: &str, seq: i64, data: Vec<u8>) -> StoreResult<()> {
        const INSERT: &str =
            "INSERT INTO attachment_chunks (attachment_id, seq, data) VALUES ($1, $2, $3)";
        sqlx::query(INSERT)
            .bind(id)
            .bind(i32::try_from(seq).unwrap_or(i32::MAX))
            .bind(data)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn finish_attachment(&self, id: &str, size: i64, sha256: &str) -> StoreResult<()> {
        sqlx::query("UPDATE attachments SET size = $2, sha256 = $3 WHERE id = $1")
            .bind(id)
            .bind(size)
            .bind(sha256)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn drop_attachment(&self, id: &str) -> StoreResult<()> {
        sqlx::query("DELETE FROM attachments WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn attachments_in(
        &self,
        scope: &Scope,
        ids: &[String],
    ) -> StoreResult<Vec<AttachmentRow>> {
        let sql = format!(
            "SELECT {COLUMNS} FROM attachments WHERE id = ANY($1) AND tenant_id = $2 \
             AND test = $3 AND sha256 IS NOT NULL"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(ids)
            .bind(scope.tenant())
            .bind(scope.is_test())
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(attachment_row).collect::<Result<_, _>>()?)
    }

    async fn claim_attachments(
        &self,
        scope: &Scope,
        ids: &[String],
        message_id: &str,
        now: i64,
    ) -> StoreResult<Result<(), NotClaimed>> {
        const CLAIM: &str = "UPDATE attachments SET message_id = $1, claimed_at = $2 \
             WHERE id = ANY($3) AND tenant_id = $4 AND test = $5 AND sha256 IS NOT NULL \
             AND message_id IS NULL RETURNING id";
        let mut tx = self.pool.begin().await?;
        let claimed: Vec<String> = sqlx::query_scalar(CLAIM)
            .bind(message_id)
            .bind(now)
            .bind(ids)
            .bind(scope.tenant())
            .bind(scope.is_test())
            .fetch_all(&mut *tx)
            .await?;
        let taken: Vec<String> = ids
            .iter()
            .filter(|id| !claimed.contains(id))
            .cloned()
            .collect();
        if !taken.is_empty() {
            tx.rollback().await?;
            return Ok(Err(NotClaimed { ids: taken }));
        }
        tx.commit().await?;
        Ok(Ok(()))
    }

    async fn release_attachments(&self, message_id: &str) -> StoreResult<()> {
        sqlx::query(
            "UPDATE attachments SET message_id = NULL, claimed_at = NULL WHERE message_id = $1",
        )
        .bind(message_id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn attachment_bytes(&self, message_id: &str, id: &str) -> StoreResult<Option<Vec<u8>>> {
        // One row per chunk; an empty file is one row without data, a file
        // that is not there (or not this message's) no row.
        const CHUNKS: &str = "SELECT a.size, c.data FROM attachments AS a \
             LEFT JOIN attachment_chunks AS c ON c.attachment_id = a.id \
             WHERE a.id = $1 AND a.message_id = $2 ORDER BY c.seq";
        let rows: Vec<(i64, Option<Vec<u8>>)> = sqlx::query_as(CHUNKS)
            .bind(id)
            .bind(message_id)
            .fetch_all(&self.pool)
            .await?;
        Ok(crate::store::attachments::joined(rows))
    }

    async fn attachments_of(&self, message_id: &str) -> StoreResult<Vec<AttachmentRow>> {
        let sql = format!(
            "SELECT {COLUMNS} FROM attachments WHERE message_id = $1 ORDER BY claimed_at, id"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(message_id)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(attachment_row).collect::<Result<_, _>>()?)
    }

    async fn erase_stale_attachments(&self, before: i64) -> StoreResult<u64> {
        const STALE: &str = "DELETE FROM attachments AS a WHERE a.created_at < $1 \
             AND (a.message_id IS NULL \
             OR NOT EXISTS (SELECT 1 FROM messages AS m WHERE m.id = a.message_id))";
        Ok(sqlx::query(STALE)
            .bind(before)
            .execute(&self.pool)
            .await?
            .rows_affected())
    }
}
