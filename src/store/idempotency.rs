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
    /// The token of the claim this answer answers ([`KeyClaim::Claimed`]):
    /// the accept's commit then writes the answer into the claimed row,
    /// and fails whole if the claim is no longer that token's (it went
    /// stale and a retry took it over). `None` where the store needs no
    /// durable claim (SQLite: one process, which holds its keys in memory).
    pub claimed_as: Option<String>,
}

/// How long a claim may stay unanswered before a retry under the same key
/// takes it over: longer than any accept can take (the accept deadline,
/// `server.accept_deadline_ms`, is far shorter), so only the claim of a
/// process that died or lost its store is taken over. Should the first
/// accept still commit after that, its commit finds the claim gone and
/// fails whole: a key never names two messages.
pub const CLAIM_STALE_MS: i64 = 30_000;

/// What claiming a key found.
#[derive(Debug, Clone, PartialEq)]
pub enum KeyClaim {
    /// The key is this request's to answer; `durable` when the claim is a
    /// row every instance sees (PostgreSQL), which the accept's commit
    /// must answer (see [`IdempotencyStore::claim_key`]).
    Claimed { durable: bool },
    /// The key was answered within 24 hours: this is the answer.
    Answered(StoredResponse),
    /// Another request claimed the key at `claimed_at` (ms) and is still
    /// being answered, perhaps on another instance.
    Pending { claimed_at: i64 },
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

    /// Claims `key` in `scope` before its request is accepted, under
    /// `token`: on PostgreSQL a row with no answer yet, inserted without
    /// replacing one (the unique index makes a concurrent claim on another
    /// instance wait for this one's commit, then see it), taking over only
    /// an expired answer or a claim unanswered for [`CLAIM_STALE_MS`]. On
    /// SQLite, whose file one process serves, the answer is looked up and
    /// the claim is that process's in-memory hold.
    async fn claim_key(
        &self,
        scope: &Scope,
        key: &str,
        request_hash: &str,
        token: &str,
        now_ms: i64,
    ) -> StoreResult<KeyClaim>;

    /// Gives up the claim `token` holds on `key`, if it is still
    /// unanswered (the request was refused, or its accept failed whole).
    async fn release_key(&self, scope: &Scope, key: &str, token: &str) -> StoreResult<()>;

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
            claimed_as: None,
        }
    }
}
