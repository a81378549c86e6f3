//! Email attachments as the store keeps them: one row per file (its name,
//! type, size, hash, world and when it expires) and its bytes in chunks of
//! at most [`CHUNK_BYTES`], written as the upload streams in, so no file is
//! ever held whole in memory on the way in. A file is finished (its size
//! and hash set) once its last chunk is in; until then no send may name it.
//! A finished file serves any number of sends of its tenant and world until
//! it expires (a day after its upload) or the tenant deletes it: each send
//! records a use of its files (`attachment_uses`), in one statement that
//! takes all or none; the queue carries their ids, and the consumer reads
//! the bytes back by the use just before the provider call, so a send
//! accepted before the file expired or was deleted still goes out with it.
//! A file's bytes go when nothing uses it any more and it is expired or
//! deleted: at once on a DELETE of an unused file, when retention erases
//! the last message using it, or by
//! [`AttachmentStore::erase_stale_attachments`].

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
    /// How many messages use it (sends accepted with it, not yet erased).
    pub messages: i64,
    pub created_at: i64,
    /// When new sends stop taking it (ms): a day after its upload.
    pub expires_at: i64,
}

/// Why [`AttachmentStore::use_attachments`] took none of the files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotUsable {
    /// The files that expired, were deleted or are gone meanwhile.
    pub ids: Vec<String>,
}

/// What [`AttachmentStore::delete_attachment`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    /// No such finished, undeleted file in the scope.
    NotFound,
    /// Nothing used it: its bytes are gone.
    Erased,
    /// Messages use it: new sends refuse it, and its bytes go with the
    /// last of them.
    Marked,
}

/// How long an upload may stay unfinished before the sweep erases it (ms).
pub const UNFINISHED_FOR_MS: i64 = 60 * 60 * 1000;

/// How long a use may wait for its message's row before the sweep takes it
/// for one of an accept that never committed (ms).
pub const ABANDONED_USE_MS: i64 = 60 * 60 * 1000;

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

    /// Finishes an upload with its size and hash, if its world's files
    /// then hold at most `held_at_most` bytes in all (the plan's
    /// `upload_bytes_held`): true when finished, false when it would hold
    /// more, and then nothing changed. The sum and the finish are one step
    /// against every other finish of the world (SQLite's write turn, a
    /// PostgreSQL advisory lock of the tenant's world), so two uploads that
    /// each fit alone cannot both finish past the limit.
    async fn finish_attachment(
        &self,
        id: &str,
        size: i64,
        sha256: &str,
        held_at_most: i64,
    ) -> StoreResult<bool>;

    /// The bytes `scope`'s files hold in the store: every file whose bytes
    /// are not erased, used or not, expired or not, deleted or not.
    async fn held_attachment_bytes(&self, scope: &Scope) -> StoreResult<i64>;

    /// Removes an upload that did not finish (and its chunks).
    async fn drop_attachment(&self, id: &str) -> StoreResult<()>;

    /// The finished, undeleted files of `scope` among `ids`, expired or
    /// not, in no particular order (one read, whatever the number).
    async fn attachments_in(
        &self,
        scope: &Scope,
        ids: &[String],
    ) -> StoreResult<Vec<AttachmentRow>>;

    /// The finished, undeleted file `id` of `scope`.
    async fn attachment(&self, scope: &Scope, id: &str) -> StoreResult<Option<AttachmentRow>> {
        Ok(self.attachments_in(scope, &[id.to_owned()]).await?.pop())
    }

    /// Records that `message_id` uses the files `ids` of `scope`, all or
    /// none: each must be finished, not deleted and not expired at `now`.
    /// `Err(NotUsable)` names those that were not, and then nothing
    /// changed.
    async fn use_attachments(
        &self,
        scope: &Scope,
        ids: &[String],
        message_id: &str,
        now: i64,
    ) -> StoreResult<Result<(), NotUsable>>;

    /// Drops the uses of `message_id` (its accept did not commit).
    async fn release_attachments(&self, message_id: &str) -> StoreResult<()>;

    /// The bytes of file `id` as `message_id` uses it; none when it is not
    /// there (erased, or not used by this message).
    async fn attachment_bytes(&self, message_id: &str, id: &str) -> StoreResult<Option<Vec<u8>>>;

    /// The files `message_id` uses, without their bytes.
    async fn attachments_of(&self, message_id: &str) -> StoreResult<Vec<AttachmentRow>>;

    /// Deletes the finished file `id` of `scope` at `now`: its bytes go at
    /// once when no message uses it, else it is marked deleted.
    async fn delete_attachment(&self, scope: &Scope, id: &str, now: i64) -> StoreResult<Deleted>;

    /// The sweep at `now`: drops the uses older than [`ABANDONED_USE_MS`]
    /// whose message is not there (accepts that never committed), then
    /// erases the files nothing uses that are expired or deleted, and the
    /// uploads unfinished for [`UNFINISHED_FOR_MS`]. Returns how many files.
    async fn erase_stale_attachments(&self, now: i64) -> StoreResult<u64>;
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::store::Db;

    fn ids(list: &[&str]) -> Vec<String> {
        list.iter().map(|id| id.to_string()).collect()
    }

    /// On `db` (tenant `acme` exists): a file serves several sends; a use
    /// takes all of its files or none (an expired or unknown one refuses
    /// it); a deleted file that messages use is refused by new sends but
    /// still read by its uses, and an unused one goes at once; the sweep
    /// erases expired files nothing uses, then the uses of accepts that
    /// never committed and what they held.
    pub(crate) async fn files_serve_many_sends_until_expired_or_deleted(db: &Db) {
        let scope = Scope::new("acme", crate::model::World::Live);
        for (id, bytes, expires_at) in [
            ("att_a", &b"alpha"[..], 1_000),
            ("att_b", b"beta", 1_000),
            ("att_e", b"", 10),
        ] {
            let row = AttachmentRow {
                id: id.into(),
                tenant_id: "acme".into(),
                test: false,
                filename: format!("{id}.txt"),
                content_type: "text/plain".into(),
                size: 0,
                sha256: None,
                messages: 0,
                created_at: 1,
                expires_at,
            };
            db.begin_attachment(&row).await.unwrap();
            if !bytes.is_empty() {
                db.add_attachment_chunk(id, 0, bytes.to_vec())
                    .await
                    .unwrap();
            }
            assert!(
                db.finish_attachment(id, bytes.len() as i64, "hash", 9)
                    .await
                    .unwrap()
            );
        }
        // The world holds 9 bytes: a tenth does not fit under 9 and leaves
        // nothing finished; the other world holds none.
        assert_eq!(db.held_attachment_bytes(&scope).await.unwrap(), 9);
        let one_more = AttachmentRow {
            id: "att_f".into(),
            tenant_id: "acme".into(),
            test: false,
            filename: "f.txt".into(),
            content_type: "text/plain".into(),
            size: 0,
            sha256: None,
            messages: 0,
            created_at: 1,
            expires_at: 1_000,
        };
        db.begin_attachment(&one_more).await.unwrap();
        db.add_attachment_chunk("att_f", 0, b"f".to_vec())
            .await
            .unwrap();
        assert!(!db.finish_attachment("att_f", 1, "hash", 9).await.unwrap());
        assert!(db.attachment(&scope, "att_f").await.unwrap().is_none());
        db.drop_attachment("att_f").await.unwrap();
        assert_eq!(db.held_attachment_bytes(&scope).await.unwrap(), 9);
        let test_world = Scope::new("acme", crate::model::World::Test);
        assert_eq!(db.held_attachment_bytes(&test_world).await.unwrap(), 0);
        for message in ["m1", "m2"] {
            assert_eq!(
                db.use_attachments(&scope, &ids(&["att_a"]), message, 20)
                    .await
                    .unwrap(),
                Ok(())
            );
        }
        assert_eq!(
            db.use_attachments(&scope, &ids(&["att_b", "att_e", "att_x"]), "m3", 20)
                .await
                .unwrap(),
            Err(NotUsable {
                ids: ids(&["att_e", "att_x"])
            })
        );
        let mut counts: Vec<(String, i64)> = db
            .attachments_in(&scope, &ids(&["att_a", "att_b", "att_e", "att_x"]))
            .await
            .unwrap()
            .into_iter()
            .map(|row| (row.id, row.messages))
            .collect();
        counts.sort();
        assert_eq!(
            counts,
            [
                ("att_a".to_owned(), 2),
                ("att_b".to_owned(), 0),
                ("att_e".to_owned(), 0)
            ]
        );
        // Another world's caller sees none of them, and cannot delete them.
        let test = Scope::new("acme", crate::model::World::Test);
        assert!(
            db.attachments_in(&test, &ids(&["att_b"]))
                .await
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            db.delete_attachment(&test, "att_b", 30).await.unwrap(),
            Deleted::NotFound
        );
        // Deleted while used: refused by a new send, still read by its uses.
        assert_eq!(
            db.delete_attachment(&scope, "att_a", 30).await.unwrap(),
            Deleted::Marked
        );
        assert_eq!(
            db.use_attachments(&scope, &ids(&["att_a"]), "m3", 31)
                .await
                .unwrap(),
            Err(NotUsable {
                ids: ids(&["att_a"])
            })
        );
        assert!(db.attachment(&scope, "att_a").await.unwrap().is_none());
        assert_eq!(
            db.attachment_bytes("m2", "att_a").await.unwrap().as_deref(),
            Some(&b"alpha"[..])
        );
        assert_eq!(db.attachment_bytes("m3", "att_a").await.unwrap(), None);
        assert_eq!(
            db.delete_attachment(&scope, "att_b", 32).await.unwrap(),
            Deleted::Erased
        );
        assert_eq!(db.attachment_bytes("m1", "att_b").await.unwrap(), None);
        assert_eq!(
            db.delete_attachment(&scope, "att_b", 33).await.unwrap(),
            Deleted::NotFound
        );
        // The sweep: the expired, unused file goes; the deleted one stays
        // while its uses are young, and goes with them once they are
        // taken for uses of accepts that never committed (no m1, m2 rows).
        assert_eq!(db.erase_stale_attachments(40).await.unwrap(), 1);
        assert!(db.attachment(&scope, "att_e").await.unwrap().is_none());
        assert!(db.attachment_bytes("m1", "att_a").await.unwrap().is_some());
        let later = 20 + ABANDONED_USE_MS + 1;
        assert_eq!(db.erase_stale_attachments(later).await.unwrap(), 1);
        assert_eq!(db.attachment_bytes("m1", "att_a").await.unwrap(), None);
    }

    #[tokio::test]
    async fn files_serve_many_sends_until_expired_or_deleted_on_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("a.db"), false).await.unwrap();
        db.test_execute(
            "INSERT INTO plans VALUES ('p', 'fast', 1, 1, 1, 1, 'admin', 0, 60, 0); \
             INSERT INTO tenants (id, name, plan, status, created_at, updated_at) \
             VALUES ('acme', 'a', 'p', 'active', 0, 0);",
        )
        .await;
        files_serve_many_sends_until_expired_or_deleted(&db).await;
    }
}
