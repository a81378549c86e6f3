//! Attachments on PostgreSQL: the file's row and its chunks as `bytea`.

use async_trait::async_trait;
use sqlx::Row;

use super::PgDb;
use crate::model::Scope;
use crate::store::StoreResult;
use crate::store::attachments::{
    ABANDONED_USE_MS, AttachmentRow, AttachmentStore, Deleted, NotUsable, UNFINISHED_FOR_MS,
};

/// A file's columns, its count of uses among them, read from
/// `attachments AS a`.
const COLUMNS: &str = "a.id, a.tenant_id, a.test, a.filename, a.content_type, a.size, a.sha256, \
     (SELECT COUNT(*) FROM attachment_uses AS u WHERE u.attachment_id = a.id), \
     a.created_at, a.expires_at";

/// Erases the files among `$2` that nothing uses and that are expired or
/// deleted at `$1`.
pub(super) const ERASE_UNUSED: &str = "DELETE FROM attachments AS a WHERE a.id = ANY($2) \
     AND (a.deleted_at IS NOT NULL OR a.expires_at <= $1) \
     AND NOT EXISTS (SELECT 1 FROM attachment_uses AS u WHERE u.attachment_id = a.id)";

fn attachment_row(row: &sqlx::postgres::PgRow) -> Result<AttachmentRow, sqlx::Error> {
    Ok(AttachmentRow {
        id: row.try_get(0)?,
        tenant_id: row.try_get(1)?,
        test: row.try_get(2)?,
        filename: row.try_get(3)?,
        content_type: row.try_get(4)?,
        size: row.try_get(5)?,
        sha256: row.try_get(6)?,
        messages: row.try_get(7)?,
        created_at: row.try_get(8)?,
        expires_at: row.try_get(9)?,
    })
}

#[async_trait]
impl AttachmentStore for PgDb {
    async fn begin_attachment(&self, row: &AttachmentRow) -> StoreResult<()> {
        const INSERT: &str = "INSERT INTO attachments (id, tenant_id, test, filename, \
             content_type, size, sha256, created_at, expires_at) \
             VALUES ($1, $2, $3, $4, $5, 0, NULL, $6, $7)";
        sqlx::query(INSERT)
            .bind(&row.id)
            .bind(&row.tenant_id)
            .bind(row.test)
            .bind(&row.filename)
            .bind(&row.content_type)
            .bind(row.created_at)
            .bind(row.expires_at)
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

    async fn finish_attachment(
        &self,
        id: &str,
        size: i64,
        sha256: &str,
        held_at_most: i64,
    ) -> StoreResult<bool> {
        // The world's advisory lock, held until the commit, puts the
        // finishes of one tenant's world in a line: each sums what the ones
        // before it committed.
        const LOCK_WORLD: &str = "SELECT pg_advisory_xact_lock(hashtextextended( \
             'fairlane:attachments:' || tenant_id || ':' || test::text, 0)) \
             FROM attachments WHERE id = $1";
        const OTHERS_HELD: &str = "SELECT COALESCE(SUM(o.size), 0)::BIGINT FROM attachments AS a \
             JOIN attachments AS o ON o.tenant_id = a.tenant_id AND o.test = a.test \
             WHERE a.id = $1 AND o.id <> $1";
        const FINISH: &str = "UPDATE attachments SET size = $2, sha256 = $3 WHERE id = $1";
        let mut tx = self.pool.begin().await?;
        sqlx::query(LOCK_WORLD).bind(id).execute(&mut *tx).await?;
        let others: i64 = sqlx::query_scalar(OTHERS_HELD)
            .bind(id)
            .fetch_one(&mut *tx)
            .await?;
        if others.saturating_add(size) > held_at_most {
            return Ok(false);
        }
        let finished = sqlx::query(FINISH)
            .bind(id)
            .bind(size)
            .bind(sha256)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(finished == 1)
    }

    async fn held_attachment_bytes(&self, scope: &Scope) -> StoreResult<i64> {
        const HELD: &str = "SELECT COALESCE(SUM(size), 0)::BIGINT FROM attachments \
             WHERE tenant_id = $1 AND test = $2";
        Ok(sqlx::query_scalar(HELD)
            .bind(scope.tenant())
            .bind(scope.is_test())
            .fetch_one(&self.pool)
            .await?)
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
            "SELECT {COLUMNS} FROM attachments AS a WHERE a.id = ANY($1) AND a.tenant_id = $2 \
             AND a.test = $3 AND a.sha256 IS NOT NULL AND a.deleted_at IS NULL"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(ids)
            .bind(scope.tenant())
            .bind(scope.is_test())
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(attachment_row).collect::<Result<_, _>>()?)
    }

    async fn use_attachments(
        &self,
        scope: &Scope,
        ids: &[String],
        message_id: &str,
        now: i64,
    ) -> StoreResult<Result<(), NotUsable>> {
        // The usable rows are locked (FOR SHARE) until the uses commit: a
        // DELETE waits for them, then sees the uses; a use after a DELETE
        // reads its `deleted_at` and refuses the file.
        const USABLE: &str = "SELECT id FROM attachments WHERE id = ANY($1) AND tenant_id = $2 \
             AND test = $3 AND sha256 IS NOT NULL AND deleted_at IS NULL AND expires_at > $4 \
             FOR SHARE";
        const USE: &str = "INSERT INTO attachment_uses (attachment_id, message_id, used_at) \
             SELECT unnest($1::text[]), $2, $3 ON CONFLICT DO NOTHING";
        let mut tx = self.pool.begin().await?;
        let usable: Vec<String> = sqlx::query_scalar(USABLE)
            .bind(ids)
            .bind(scope.tenant())
            .bind(scope.is_test())
            .bind(now)
            .fetch_all(&mut *tx)
            .await?;
        let gone: Vec<String> = ids
            .iter()
            .filter(|id| !usable.contains(id))
            .cloned()
            .collect();
        if !gone.is_empty() {
            tx.rollback().await?;
            return Ok(Err(NotUsable { ids: gone }));
        }
        sqlx::query(USE)
            .bind(ids)
            .bind(message_id)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Ok(()))
    }

    async fn release_attachments(&self, message_id: &str) -> StoreResult<()> {
        sqlx::query("DELETE FROM attachment_uses WHERE message_id = $1")
            .bind(message_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn attachment_bytes(&self, message_id: &str, id: &str) -> StoreResult<Option<Vec<u8>>> {
        // One row per chunk; an empty file is one row without data, a file
        // that is not there (or not this message's) no row.
        const CHUNKS: &str = "SELECT a.size, c.data FROM attachments AS a \
             JOIN attachment_uses AS u ON u.attachment_id = a.id AND u.message_id = $2 \
             LEFT JOIN attachment_chunks AS c ON c.attachment_id = a.id \
             WHERE a.id = $1 ORDER BY c.seq";
        let rows: Vec<(i64, Option<Vec<u8>>)> = sqlx::query_as(CHUNKS)
            .bind(id)
            .bind(message_id)
            .fetch_all(&self.pool)
            .await?;
        Ok(crate::store::attachments::joined(rows))
    }

    async fn attachments_of(&self, message_id: &str) -> StoreResult<Vec<AttachmentRow>> {
        let sql = format!(
            "SELECT {COLUMNS} FROM attachment_uses AS m JOIN attachments AS a \
             ON a.id = m.attachment_id WHERE m.message_id = $1 ORDER BY m.used_at, a.id"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(message_id)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(attachment_row).collect::<Result<_, _>>()?)
    }

    async fn delete_attachment(&self, scope: &Scope, id: &str, now: i64) -> StoreResult<Deleted> {
        // The mark locks the row: a use under way (FOR SHARE) commits
        // first, and the erase below, a statement of its own, sees it.
        const MARK: &str = "UPDATE attachments SET deleted_at = $4 WHERE id = $1 \
             AND tenant_id = $2 AND test = $3 AND sha256 IS NOT NULL AND deleted_at IS NULL";
        let mut tx = self.pool.begin().await?;
        let marked = sqlx::query(MARK)
            .bind(id)
            .bind(scope.tenant())
            .bind(scope.is_test())
            .bind(now)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if marked == 0 {
            tx.rollback().await?;
            return Ok(Deleted::NotFound);
        }
        let erased = sqlx::query(ERASE_UNUSED)
            .bind(now)
            .bind(vec![id.to_owned()])
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(if erased == 0 {
            Deleted::Marked
        } else {
            Deleted::Erased
        })
    }

    async fn erase_stale_attachments(&self, now: i64) -> StoreResult<u64> {
        const ABANDONED: &str = "DELETE FROM attachment_uses AS u WHERE u.used_at < $1 \
             AND NOT EXISTS (SELECT 1 FROM messages AS m WHERE m.id = u.message_id)";
        const STALE: &str = "DELETE FROM attachments AS a WHERE (a.sha256 IS NULL AND a.created_at < $2) \
             OR (a.sha256 IS NOT NULL AND (a.deleted_at IS NOT NULL OR a.expires_at <= $1) \
             AND NOT EXISTS (SELECT 1 FROM attachment_uses AS u WHERE u.attachment_id = a.id))";
        sqlx::query(ABANDONED)
            .bind(now - ABANDONED_USE_MS)
            .execute(&self.pool)
            .await?;
        Ok(sqlx::query(STALE)
            .bind(now)
            .bind(now - UNFINISHED_FOR_MS)
            .execute(&self.pool)
            .await?
            .rows_affected())
    }
}
