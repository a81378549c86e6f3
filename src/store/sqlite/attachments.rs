//! Attachments on SQLite: the file's row and its chunks as blobs.

use async_trait::async_trait;
use rusqlite::params;

use super::{SqliteDb, args, id_list};
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

fn attachment_row(row: &rusqlite::Row) -> rusqlite::Result<AttachmentRow> {
    Ok(AttachmentRow {
        id: row.get(0)?,
        tenant_id: row.get(1)?,
        test: row.get(2)?,
        filename: row.get(3)?,
        content_type: row.get(4)?,
        size: row.get(5)?,
        sha256: row.get(6)?,
        messages: row.get(7)?,
        created_at: row.get(8)?,
        expires_at: row.get(9)?,
    })
}

/// Erases the files among those bound after it (`?` from the second on)
/// that nothing uses and that are expired or deleted at `?1`.
fn erase_unused(count: usize) -> String {
    format!(
        "DELETE FROM attachments WHERE (deleted_at IS NOT NULL OR expires_at <= ?1) \
         AND NOT EXISTS (SELECT 1 FROM attachment_uses AS u WHERE u.attachment_id = attachments.id) \
         AND id IN ({}",
        id_list(count)
    )
}

#[async_trait]
impl AttachmentStore for SqliteDb {
    async fn begin_attachment(&self, row: &AttachmentRow) -> StoreResult<()> {
        const INSERT: &str = "INSERT INTO attachments (id, tenant_id, test, filename, \
             content_type, size, sha256, created_at, expires_at) \
             VALUES ($1, $2, $3, $4, $5, 0, NULL, $6, $7)";
        let args = args![
            row.id.clone(),
            row.tenant_id.clone(),
            row.test,
            row.filename.clone(),
            row.content_type.clone(),
            row.created_at,
            row.expires_at
        ];
        self.execute(INSERT, args).await?;
        Ok(())
    }

    async fn add_attachment_chunk(&self, id: &str, seq: i64, data: Vec<u8>) -> StoreResult<()> {
        const INSERT: &str =
            "INSERT INTO attachment_chunks (attachment_id, seq, data) VALUES ($1, $2, $3)";
        self.execute(INSERT, args![id.to_owned(), seq, data])
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
        // In the write turn's immediate transaction: no other finish comes
        // between the sum and this one.
        const OTHERS_HELD: &str = "SELECT COALESCE(SUM(o.size), 0) FROM attachments AS a \
             JOIN attachments AS o ON o.tenant_id = a.tenant_id AND o.test = a.test \
             WHERE a.id = ?1 AND o.id <> ?1";
        const FINISH: &str = "UPDATE attachments SET size = ?2, sha256 = ?3 WHERE id = ?1";
        let (id, sha256) = (id.to_owned(), sha256.to_owned());
        Ok(self
            .transact(move |tx| {
                let others: i64 = tx.query_row(OTHERS_HELD, params![id], |row| row.get(0))?;
                if others.saturating_add(size) > held_at_most {
                    return Ok(false);
                }
                Ok(tx.execute(FINISH, params![id, size, sha256])? == 1)
            })
            .await?)
    }

    async fn held_attachment_bytes(&self, scope: &Scope) -> StoreResult<i64> {
        const HELD: &str =
            "SELECT COALESCE(SUM(size), 0) FROM attachments WHERE tenant_id = ?1 AND test = ?2";
        let (tenant, test) = (scope.tenant().to_owned(), scope.is_test());
        Ok(self
            .read(move |conn| {
                conn.prepare_cached(HELD)?
                    .query_row(params![tenant, test], |row| row.get(0))
            })
            .await?)
    }

    async fn drop_attachment(&self, id: &str) -> StoreResult<()> {
        // The chunks go with the row (ON DELETE CASCADE).
        self.execute(
            "DELETE FROM attachments WHERE id = $1",
            args![id.to_owned()],
        )
        .await?;
        Ok(())
    }

    async fn attachments_in(
        &self,
        scope: &Scope,
        ids: &[String],
    ) -> StoreResult<Vec<AttachmentRow>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let sql = format!(
            "SELECT {COLUMNS} FROM attachments AS a WHERE a.tenant_id = ? AND a.test = ? \
             AND a.sha256 IS NOT NULL AND a.deleted_at IS NULL AND a.id IN ({}",
            id_list(ids.len())
        );
        let mut args = args![scope.tenant().to_owned(), scope.is_test()];
        args.extend(ids.iter().cloned().map(rusqlite::types::Value::from));
        Ok(self.rows(sql, args, attachment_row).await?)
    }

    async fn use_attachments(
        &self,
        scope: &Scope,
        ids: &[String],
        message_id: &str,
        now: i64,
    ) -> StoreResult<Result<(), NotUsable>> {
        // In the write turn's immediate transaction: no DELETE or sweep
        // comes between the look and the use.
        let (scope, ids, message_id) = (scope.clone(), ids.to_vec(), message_id.to_owned());
        Ok(self
            .transact(move |tx| {
                let usable = format!(
                    "SELECT id FROM attachments WHERE tenant_id = ? AND test = ? \
                     AND sha256 IS NOT NULL AND deleted_at IS NULL AND expires_at > ? \
                     AND id IN ({}",
                    id_list(ids.len())
                );
                let mut args = args![scope.tenant().to_owned(), scope.is_test(), now];
                args.extend(ids.iter().cloned().map(rusqlite::types::Value::from));
                let free: std::collections::HashSet<String> = tx
                    .prepare(&usable)?
                    .query_map(rusqlite::params_from_iter(&args), |row| row.get(0))?
                    .collect::<rusqlite::Result<_>>()?;
                let gone: Vec<String> = ids
                    .iter()
                    .filter(|id| !free.contains(*id))
                    .cloned()
                    .collect();
                if !gone.is_empty() {
                    return Ok(Err(NotUsable { ids: gone }));
                }
                let mut used = tx.prepare(
                    "INSERT OR IGNORE INTO attachment_uses (attachment_id, message_id, used_at) \
                     VALUES (?1, ?2, ?3)",
                )?;
                for id in &ids {
                    used.execute(params![id, message_id, now])?;
                }
                Ok(Ok(()))
            })
            .await?)
    }

    async fn release_attachments(&self, message_id: &str) -> StoreResult<()> {
        const RELEASE: &str = "DELETE FROM attachment_uses WHERE message_id = $1";
        self.execute(RELEASE, args![message_id.to_owned()]).await?;
        Ok(())
    }

    async fn attachment_bytes(&self, message_id: &str, id: &str) -> StoreResult<Option<Vec<u8>>> {
        // One row per chunk; an empty file is one row without data, a file
        // that is not there (or not this message's) no row.
        const CHUNKS: &str = "SELECT a.size, c.data FROM attachments AS a \
             JOIN attachment_uses AS u ON u.attachment_id = a.id AND u.message_id = ?2 \
             LEFT JOIN attachment_chunks AS c ON c.attachment_id = a.id \
             WHERE a.id = ?1 ORDER BY c.seq";
        let (id, message_id) = (id.to_owned(), message_id.to_owned());
        Ok(self
            .read(move |conn| {
                // Each chunk is copied once, from SQLite's page into the
                // file's buffer.
                let mut chunks = conn.prepare_cached(CHUNKS)?;
                let mut rows = chunks.query(params![id, message_id])?;
                let mut bytes: Option<Vec<u8>> = None;
                while let Some(row) = rows.next()? {
                    let file = bytes.get_or_insert_with(|| {
                        let size: i64 = row.get(0).unwrap_or(0);
                        Vec::with_capacity(usize::try_from(size).unwrap_or(0))
                    });
                    if let Some(chunk) = row.get_ref(1)?.as_blob_or_null()? {
                        file.extend_from_slice(chunk);
                    }
                }
                Ok(bytes)
            })
            .await?)
    }

    async fn attachments_of(&self, message_id: &str) -> StoreResult<Vec<AttachmentRow>> {
        let sql = format!(
            "SELECT {COLUMNS} FROM attachment_uses AS m JOIN attachments AS a \
             ON a.id = m.attachment_id WHERE m.message_id = $1 ORDER BY m.used_at, a.id"
        );
        Ok(self
            .rows(sql, args![message_id.to_owned()], attachment_row)
            .await?)
    }

    async fn delete_attachment(&self, scope: &Scope, id: &str, now: i64) -> StoreResult<Deleted> {
        let (scope, id) = (scope.clone(), id.to_owned());
        Ok(self
            .transact(move |tx| {
                let marked = tx.execute(
                    "UPDATE attachments SET deleted_at = ?4 WHERE id = ?1 AND tenant_id = ?2 \
                     AND test = ?3 AND sha256 IS NOT NULL AND deleted_at IS NULL",
                    params![id, scope.tenant(), scope.is_test(), now],
                )?;
                if marked == 0 {
                    return Ok(Deleted::NotFound);
                }
                let erased = tx.execute(&erase_unused(1), params![now, id])?;
                Ok(if erased == 0 {
                    Deleted::Marked
                } else {
                    Deleted::Erased
                })
            })
            .await?)
    }

    async fn erase_stale_attachments(&self, now: i64) -> StoreResult<u64> {
        const ABANDONED: &str = "DELETE FROM attachment_uses WHERE used_at < ?1 \
             AND NOT EXISTS (SELECT 1 FROM messages AS m WHERE m.id = attachment_uses.message_id)";
        const STALE: &str = "DELETE FROM attachments WHERE (sha256 IS NULL AND created_at < ?2) \
             OR (sha256 IS NOT NULL AND (deleted_at IS NOT NULL OR expires_at <= ?1) \
             AND NOT EXISTS (SELECT 1 FROM attachment_uses AS u WHERE u.attachment_id = attachments.id))";
        self.execute(ABANDONED, args![now - ABANDONED_USE_MS])
            .await?;
        Ok(self
            .execute(STALE, args![now, now - UNFINISHED_FOR_MS])
            .await? as u64)
    }
}

/// Retention's statements for the erased messages `erased`: their uses
/// go, and then the files they used that nothing uses any more, chunks
/// and all.
pub(super) fn erase_of_messages(
    tx: &rusqlite::Transaction,
    erased: &[String],
) -> rusqlite::Result<()> {
    let uses = format!(
        "DELETE FROM attachment_uses WHERE message_id IN ({} RETURNING attachment_id",
        id_list(erased.len())
    );
    let files: Vec<String> = tx
        .prepare(&uses)?
        .query_map(rusqlite::params_from_iter(erased), |row| row.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    if files.is_empty() {
        return Ok(());
    }
    // A file goes with the last message that names it, as if it had
    // expired: the statement's "now" is the end of time.
    let mut args = args![i64::MAX];
    args.extend(files.iter().cloned().map(rusqlite::types::Value::from));
    tx.execute(&erase_unused(files.len()), rusqlite::params_from_iter(args))?;
    Ok(())
}
