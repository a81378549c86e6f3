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

    async fn attachment(&self, scope: &Scope, id: &str) -> StoreResult<Option<AttachmentRow>> {
        let sql = format!(
            "SELECT {COLUMNS} FROM attachments WHERE id = $1 AND tenant_id = $2 AND test = $3 \
             AND sha256 IS NOT NULL"
        );
        let args = args![id.to_owned(), scope.tenant().to_owned(), scope.is_test()];
        Ok(self.row(sql, args, attachment_row).await?)
    }

    async fn claim_attachments(
        &self,
        scope: &Scope,
        ids: &[String],
        message_id: &str,
        now: i64,
    ) -> StoreResult<Result<(), NotClaimed>> {
        const CLAIM: &str = "UPDATE attachments SET message_id = ?1, claimed_at = ?2 \
             WHERE id = ?3 AND tenant_id = ?4 AND test = ?5 AND sha256 IS NOT NULL \
             AND message_id IS NULL";
        let (scope, ids, message_id) = (scope.clone(), ids.to_vec(), message_id.to_owned());
        Ok(self
            .transact(move |tx| {
                let mut claim = tx.prepare_cached(CLAIM)?;
                let mut taken = Vec::new();
                for id in &ids {
                    let changed = claim.execute(params![
                        message_id,
                        now,
                        id,
                        scope.tenant(),
                        scope.is_test()
                    ])?;
                    if changed == 0 {
                        taken.push(id.clone());
                    }
                }
                if taken.is_empty() {
                    Ok(Ok(()))
                } else {
                    // Nothing of the claim may stay: undo it by failing the
                    // transaction, and answer which files were not free.
                    Err(anyhow::Error::new(Unclaimed(NotClaimed { ids: taken })))
                }
            })
            .await
            .or_else(|err| match err.downcast::<Unclaimed>() {
                Ok(Unclaimed(not)) => Ok(Err(not)),
                Err(err) => Err(err),
            })?)
    }

    async fn release_attachments(&self, message_id: &str) -> StoreResult<()> {
        const RELEASE: &str =
            "UPDATE attachments SET message_id = NULL, claimed_at = NULL WHERE message_id = $1";
        self.execute(RELEASE, args![message_id.to_owned()]).await?;
        Ok(())
    }

    async fn attachment_bytes(&self, message_id: &str, id: &str) -> StoreResult<Option<Vec<u8>>> {
        const CHUNKS: &str = "SELECT c.data FROM attachments AS a \
             JOIN attachment_chunks AS c ON c.attachment_id = a.id \
             WHERE a.id = ?1 AND a.message_id = ?2 ORDER BY c.seq";
        const THERE: &str = "SELECT size FROM attachments WHERE id = ?1 AND message_id = ?2";
        let (id, message_id) = (id.to_owned(), message_id.to_owned());
        Ok(self
            .read(move |conn| {
                let tx = conn.unchecked_transaction()?;
                let size: Option<i64> = {
                    use rusqlite::OptionalExtension;
                    tx.query_row(THERE, params![id, message_id], |row| row.get(0))
                        .optional()?
                };
                let Some(size) = size else {
                    return Ok(None);
                };
                let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
                let mut chunks = tx.prepare_cached(CHUNKS)?;
                let mut rows = chunks.query(params![id, message_id])?;
                while let Some(row) = rows.next()? {
                    bytes.extend_from_slice(row.get_ref(0)?.as_blob()?);
                }
                Ok(Some(bytes))
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

/// A claim that found a file not free: carried out of the transaction as
/// its error, so the transaction rolls back.
#[derive(Debug)]
struct Unclaimed(NotClaimed);

impl std::fmt::Display for Unclaimed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "attachments not free: {:?}", self.0.ids)
    }
}

impl std::error::Error for Unclaimed {}

/// The statement that erases the files of the messages whose ids are bound
/// after it (retention): their chunks go with them.
pub(super) fn erase_of_messages(count: usize) -> String {
    format!(
        "DELETE FROM attachments WHERE message_id IN ({}",
        id_list(count)
    )
}
