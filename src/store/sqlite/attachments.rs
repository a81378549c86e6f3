//! Attachments on SQLite: the file's row and its chunks as blobs.

use async_trait::async_trait;
use rusqlite::params;

use super::{SqliteDb, args, id_list};
use crate::model::Scope;
use crate::store::StoreResult;
use crate::store::attachments::{AttachmentRow, AttachmentStore, NotClaimed};

const COLUMNS: &str =
    "id, tenant_id, test, filename, content_type, size, sha256, message_id, created_at";

fn attachment_row(row: &rusqlite::Row) -> rusqlite::Result<AttachmentRow> {
    Ok(AttachmentRow {
        id: row.get(0)?,
        tenant_id: row.get(1)?,
        test: row.get(2)?,
        filename: row.get(3)?,
        content_type: row.get(4)?,
        size: row.get(5)?,
        sha256: row.get(6)?,
        message_id: row.get(7)?,
        created_at: row.get(8)?,
    })
}

#[async_trait]
impl AttachmentStore for SqliteDb {
    async fn begin_attachment(&self, row: &AttachmentRow) -> StoreResult<()> {
        let sql = format!(
            "INSERT INTO attachments ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, 0, NULL, NULL, $6)"
        );
        let args = args![
            row.id.clone(),
            row.tenant_id.clone(),
            row.test,
            row.filename.clone(),
            row.content_type.clone(),
            row.created_at
        ];
        self.execute(sql, args).await?;
        Ok(())
    }

    async fn add_attachment_chunk(&self, id: &str, seq: i64, data: Vec<u8>) -> StoreResult<()> {
        const INSERT: &str =
            "INSERT INTO attachment_chunks (attachment_id, seq, data) VALUES ($1, $2, $3)";
        self.execute(INSERT, args![id.to_owned(), seq, data])
            .await?;
        Ok(())
    }

    async fn finish_attachment(&self, id: &str, size: i64, sha256: &str) -> StoreResult<()> {
        const FINISH: &str = "UPDATE attachments SET size = $2, sha256 = $3 WHERE id = $1";
        self.execute(FINISH, args![id.to_owned(), size, sha256.to_owned()])
            .await?;
        Ok(())
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
            "SELECT {COLUMNS} FROM attachments WHERE tenant_id = ? AND test = ? \
             AND sha256 IS NOT NULL AND id IN ({}",
            id_list(ids.len())
        );
        let mut args = args![scope.tenant().to_owned(), scope.is_test()];
        args.extend(ids.iter().cloned().map(rusqlite::types::Value::from));
        Ok(self.rows(sql, args, attachment_row).await?)
    }

    async fn claim_attachments(
        &self,
        scope: &Scope,
        ids: &[String],
        message_id: &str,
        now: i64,
    ) -> StoreResult<Result<(), NotClaimed>> {
        // In the write turn's immediate transaction: nothing claims a file
        // between the look and the claim.
        let (scope, ids, message_id) = (scope.clone(), ids.to_vec(), message_id.to_owned());
        Ok(self
            .transact(move |tx| {
                let scoped = |head: &str| {
                    format!(
                        "{head} WHERE tenant_id = ? AND test = ? AND sha256 IS NOT NULL \
                         AND message_id IS NULL AND id IN ({}",
                        id_list(ids.len())
                    )
                };
                let mut args = args![scope.tenant().to_owned(), scope.is_test()];
                args.extend(ids.iter().cloned().map(rusqlite::types::Value::from));
                let free: std::collections::HashSet<String> = tx
                    .prepare(&scoped("SELECT id FROM attachments"))?
                    .query_map(rusqlite::params_from_iter(&args), |row| row.get(0))?
                    .collect::<rusqlite::Result<_>>()?;
                let taken: Vec<String> = ids
                    .iter()
                    .filter(|id| !free.contains(*id))
                    .cloned()
                    .collect();
                if !taken.is_empty() {
                    return Ok(Err(NotClaimed { ids: taken }));
                }
                let mut claim_args = args![message_id, now];
                claim_args.extend(args);
                tx.execute(
                    &scoped("UPDATE attachments SET message_id = ?, claimed_at = ?"),
                    rusqlite::params_from_iter(claim_args),
                )?;
                Ok(Ok(()))
            })
            .await?)
    }

    async fn release_attachments(&self, message_id: &str) -> StoreResult<()> {
        const RELEASE: &str =
            "UPDATE attachments SET message_id = NULL, claimed_at = NULL WHERE message_id = $1";
        self.execute(RELEASE, args![message_id.to_owned()]).await?;
        Ok(())
    }

    async fn attachment_bytes(&self, message_id: &str, id: &str) -> StoreResult<Option<Vec<u8>>> {
        // One row per chunk; an empty file is one row without data, a file
        // that is not there (or not this message's) no row.
        const CHUNKS: &str = "SELECT a.size, c.data FROM attachments AS a \
             LEFT JOIN attachment_chunks AS c ON c.attachment_id = a.id \
             WHERE a.id = ?1 AND a.message_id = ?2 ORDER BY c.seq";
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
            "SELECT {COLUMNS} FROM attachments WHERE message_id = $1 ORDER BY claimed_at, id"
        );
        Ok(self
            .rows(sql, args![message_id.to_owned()], attachment_row)
            .await?)
    }

    async fn erase_stale_attachments(&self, before: i64) -> StoreResult<u64> {
        const STALE: &str = "DELETE FROM attachments WHERE created_at < ?1 AND (message_id IS NULL \
             OR NOT EXISTS (SELECT 1 FROM messages AS m WHERE m.id = attachments.message_id))";
        Ok(self.execute(STALE, args![before]).await? as u64)
    }
}

/// The statement that erases the files of the messages whose ids are bound
/// after it (retention): their chunks go with them.
pub(super) fn erase_of_messages(count: usize) -> String {
    format!(
        "DELETE FROM attachments WHERE message_id IN ({}",
        id_list(count)
    )
}
