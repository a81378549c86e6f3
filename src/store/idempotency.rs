//! Stored answers for `Idempotency-Key`: per tenant and world (a test
//! key's answers are not a live key's), kept 24 hours, written
//! in the same transaction as the message they describe so a replay can
//! never name a message that was not accepted.

use crate::store::StoreResult;
use async_trait::async_trait;

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

/// Remembered answers, on either backend. The accept path writes them in
/// its own transaction, through the backend's hot writer.
#[async_trait]
pub trait IdempotencyStore: Send + Sync {
    /// The answer remembered for `key` in `scope`, if it is younger than 24
    /// hours at `now_ms`.
    async fn remembered_answer(
        &self,
        scope: &Scope,
        key: &str,
        now_ms: i64,
    ) -> StoreResult<Option<StoredResponse>>;

    /// Forgets keys older than 24 hours at `now_ms`; returns how many. With
    /// several instances on PostgreSQL, one of them does it at a time
    /// (`None` from the others).
    async fn purge_idempotency_keys(&self, now_ms: i64) -> StoreResult<Option<u64>>;
}

/// A remembered answer from its stored columns: request hash, status code,
/// body, message id, when.
pub(super) type AnswerRow = (String, i64, String, String, i64);

impl StoredResponse {
    /// The answer stored for `key` in `scope` as `row`.
    pub(super) fn from_row(scope: &Scope, key: &str, row: AnswerRow) -> StoredResponse {
        let (request_hash, status_code, response_body, message_id, created_at) = row;
        StoredResponse {
            tenant_id: scope.tenant().to_owned(),
            test: scope.is_test(),
            key: key.to_owned(),
            request_hash,
            status_code: status_code as u16,
            response_body,
            message_id,
            created_at,
        }
    }
}
