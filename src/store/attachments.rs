//! Email attachments as the store keeps them: one row per file (its name,
//! type, size, hash, world and the message that claimed it) and its bytes
//! in chunks of at most [`CHUNK_BYTES`], written as the upload streams in,
//! so no file is ever held whole in memory on the way in. A file is
//! finished (its size and hash set) once its last chunk is in; until then
//! no send may name it. A send claims its files for its message, in one
//! statement that takes all or none; the queue carries their ids, and the
//! consumer reads the bytes back just before the provider call.
//! Retention erases a message's files with its personal data; files no
//! send claimed are erased by [`AttachmentStore::erase_stale_attachments`].

use async_trait::async_trait;

use super::StoreResult;
use crate::model::Scope;

/// Most bytes of one chunk row.
pub const CHUNK_BYTES: usize = 256 * 1024;

/// An attachment's row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachmentRow {
    pub id: String,
    pub tenant_id: String,
    pub test: bool,
    pub filename: String,
    pub content_type: String,
    pub size: i64,
    /// Hex SHA-256 of the bytes; none while the upload is under way.
    pub sha256: Option<String>,
    /// The message that claimed it, if one did.
    pub message_id: Option<String>,
    pub created_at: i64,
}

/// Why [`AttachmentStore::claim_attachments`] took none of the files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotClaimed {
    /// The files another send claimed meanwhile, or that are gone.
    pub ids: Vec<String>,
}

/// A file's bytes from its chunk rows (`size`, chunk) as PostgreSQL reads
/// them, with a left join in chunk order: `None` when no row came (no such
/// file for the message), empty for a file of no bytes.
pub(super) fn joined(rows: Vec<(i64, Option<Vec<u8>>)>) -> Option<Vec<u8>> {
    let size = rows.first()?.0;
    let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    for chunk in rows.into_iter().filter_map(|(_, chunk)| chunk) {
        bytes.extend_from_slice(&chunk);
    }
    Some(bytes)
}

/// Attachments, on either backend.
#[async_trait]
pub trait AttachmentStore: Send + Sync {
    /// Starts an upload: the row, not yet finished (`sha256` none).
    async fn begin_attachment(&self, row: &AttachmentRow) -> StoreResult<()>;

    /// Stores chunk `seq` (from 0) of an unfinished upload.
    async fn add_attachment_chunk(&self, id: &str, seq: i64, data: Vec<u8>) -> StoreResult<()>;

    /// Finishes an upload with its size and hash.
    async fn finish_attachment(&self, id: &str, size: i64, sha256: &str) -> StoreResult<()>;

    /// Removes an upload that did not finish (and its chunks).
    async fn drop_attachment(&self, id: &str) -> StoreResult<()>;

    /// The finished files of `scope` among `ids`, claimed or not, in no
    /// particular order (one read, whatever the number).
    async fn attachments_in(
        &self,
        scope: &Scope,
        ids: &[String],
    ) -> StoreResult<Vec<AttachmentRow>>;

    /// The finished file `id` of `scope`, claimed or not.
    async fn attachment(&self, scope: &Scope, id: &str) -> StoreResult<Option<AttachmentRow>> {
        Ok(self.attachments_in(scope, &[id.to_owned()]).await?.pop())
    }

    /// Claims the finished, unclaimed files `ids` of `scope` for
    /// `message_id`, all or none: `Err(NotClaimed)` names those that were
    /// not free, and then nothing changed.
    async fn claim_attachments(
        &self,
        scope: &Scope,
        ids: &[String],
        message_id: &str,
        now: i64,
    ) -> StoreResult<Result<(), NotClaimed>>;

    /// Frees the files `message_id` claimed (its accept did not commit).
    async fn release_attachments(&self, message_id: &str) -> StoreResult<()>;

    /// The bytes of file `id` as `message_id` claimed it; none when it is
    /// not there (erased, or never claimed by this message).
    async fn attachment_bytes(&self, message_id: &str, id: &str) -> StoreResult<Option<Vec<u8>>>;

    /// The files `message_id` claimed, without their bytes.
    async fn attachments_of(&self, message_id: &str) -> StoreResult<Vec<AttachmentRow>>;

    /// Erases the files uploaded before `before` (ms) that no message
    /// holds: never claimed, unfinished, or claimed by a send whose accept
    /// never committed (its message is not there). Returns how many.
    async fn erase_stale_attachments(&self, before: i64) -> StoreResult<u64>;
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::store::Db;

    /// On `db` (tenant `acme` exists): a claim takes all of its files or
    /// none; one file already taken leaves the others free, and the
    /// answer names it; an empty file reads back empty, a file of another
    /// message not at all.
    pub(crate) async fn a_claim_takes_all_or_none(db: &Db) {
        let scope = Scope::new("acme", crate::model::World::Live);
        for (id, bytes) in [("att_a", &b"alpha"[..]), ("att_b", b"beta"), ("att_e", b"")] {
            let row = AttachmentRow {
                id: id.into(),
                tenant_id: "acme".into(),
                test: false,
                filename: format!("{id}.txt"),
                content_type: "text/plain".into(),
                size: 0,
                sha256: None,
                message_id: None,
                created_at: 1,
            };
            db.begin_attachment(&row).await.unwrap();
            if !bytes.is_empty() {
                db.add_attachment_chunk(id, 0, bytes.to_vec())
                    .await
                    .unwrap();
            }
            db.finish_attachment(id, bytes.len() as i64, "hash")
                .await
                .unwrap();
        }
        let ids = |list: &[&str]| list.iter().map(|id| id.to_string()).collect::<Vec<_>>();
        assert_eq!(
            db.claim_attachments(&scope, &ids(&["att_a"]), "m1", 2)
                .await
                .unwrap(),
            Ok(())
        );
        let refused = db
            .claim_attachments(&scope, &ids(&["att_b", "att_a", "att_e"]), "m2", 3)
            .await
            .unwrap();
        assert_eq!(
            refused,
            Err(NotClaimed {
                ids: ids(&["att_a"])
            })
        );
        let rows = db
            .attachments_in(&scope, &ids(&["att_a", "att_b", "att_e", "att_x"]))
            .await
            .unwrap();
        let mut holders: Vec<(String, Option<String>)> = rows
            .into_iter()
            .map(|row| (row.id, row.message_id))
            .collect();
        holders.sort();
        assert_eq!(
            holders,
            [
                ("att_a".to_owned(), Some("m1".to_owned())),
                ("att_b".to_owned(), None),
                ("att_e".to_owned(), None),
            ]
        );
        // Another world's caller sees none of them.
        assert!(
            db.attachments_in(
                &Scope::new("acme", crate::model::World::Test),
                &ids(&["att_b"])
            )
            .await
            .unwrap()
            .is_empty()
        );
        assert_eq!(
            db.claim_attachments(&scope, &ids(&["att_b", "att_e"]), "m2", 4)
                .await
                .unwrap(),
            Ok(())
        );
        assert_eq!(
            db.attachment_bytes("m1", "att_a").await.unwrap().as_deref(),
            Some(&b"alpha"[..])
        );
        assert_eq!(
            db.attachment_bytes("m2", "att_e").await.unwrap().as_deref(),
            Some(&b""[..])
        );
        assert_eq!(db.attachment_bytes("m2", "att_a").await.unwrap(), None);
    }

    #[tokio::test]
    async fn a_claim_takes_all_or_none_on_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("a.db"), false).await.unwrap();
        db.test_execute(
            "INSERT INTO plans VALUES ('p', 'fast', 1, 1, 1, 1, 'admin', 0); \
             INSERT INTO tenants (id, name, plan, status, created_at, updated_at) \
             VALUES ('acme', 'a', 'p', 'active', 0, 0);",
        )
        .await;
        a_claim_takes_all_or_none(&db).await;
    }
}
