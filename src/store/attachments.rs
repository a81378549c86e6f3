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

    /// The finished file `id` of `scope`, claimed or not.
    async fn attachment(&self, scope: &Scope, id: &str) -> StoreResult<Option<AttachmentRow>>;

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
