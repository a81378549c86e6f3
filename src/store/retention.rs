//! Retention's statements: which settled messages of a tenant have passed
//! its retention with their personal data still kept, and erasing that
//! data from the status row, its events and the outbox. The queues' own
//! copies (dead letters, held and delayed rows) are the queue's to erase;
//! `crate::scheduler::retention` runs the job that calls both.
//!
//! Erasing keeps what usage, support and late receipts need: id, tenant,
//! channel, status, priority, lane, attempts, times, fragments and the
//! provider's message id. A row marked erased that receives something
//! personal again (a late bounce's error, an event's detail) is unmarked by
//! the lifecycle's move, and the next run erases it again.

use crate::store::StoreResult;
use async_trait::async_trait;

/// A message due for erasure.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Due {
    pub id: String,
    pub status: String,
}

/// Retention's reads and erasures, on either backend.
#[async_trait]
pub trait RetentionStore: Send + Sync {
    /// Up to `limit` settled messages of `tenant_id` created before
    /// `cutoff` (ms) whose personal data is still kept, oldest first.
    async fn due_for_erasure(
        &self,
        tenant_id: &str,
        cutoff: i64,
        limit: usize,
    ) -> StoreResult<Vec<Due>>;

    /// Erases the personal data of the messages `ids` (at most
    /// [`super::sqlite::IDS_PER_STATEMENT`] of them) in one transaction: the
    /// status row's reference, metadata and error, its events' details, and
    /// an outbox row if one is left. A message no longer settled (a redrive
    /// put it back after [`RetentionStore::due_for_erasure`] read it) is left
    /// whole. Returns how many status rows it erased.
    async fn erase_messages(&self, ids: &[String], now: i64) -> StoreResult<u64>;

    /// The right to run retention now; `None` while another instance runs
    /// it (PostgreSQL's advisory lock, held until the [`RunLock`] drops; a
    /// SQLite file has one instance).
    async fn lock_retention_run(&self) -> StoreResult<Option<RunLock>>;

    /// How many of `tenant_id`'s messages are not delivered yet
    /// (`scheduled`, `queued`, `sending`, `retrying`).
    async fn undelivered(&self, tenant_id: &str) -> StoreResult<i64>;

    /// Leaves no old copy of erased or deleted text on disk. On SQLite,
    /// `secure_delete` zeroes the space a write frees, but when SQLite
    /// rebuilds a page (a split or a merge) it leaves the bytes that were
    /// in the page's unused middle as they were, old copies of rows among
    /// them; `VACUUM` (when `vacuum`) writes every page anew. Then the log,
    /// which holds the old page images, is copied into the file and
    /// truncated. Writes wait for their turn meanwhile. `log_truncated` is
    /// false when readers kept the checkpoint from finishing through a few
    /// tries; the next run tries again. Nothing to do on PostgreSQL, whose
    /// rows are read only through its tables.
    async fn scrub_file(&self, vacuum: bool) -> StoreResult<Scrubbed>;
}

/// Held through a retention run; see [`RetentionStore::lock_retention_run`].
pub struct RunLock {
    _held: Option<Box<dyn Send>>,
}

impl RunLock {
    /// A run that needs no lock (one instance).
    pub(super) fn alone() -> RunLock {
        RunLock { _held: None }
    }

    /// A run that keeps `held` (a lock released when dropped) until it ends.
    pub(super) fn holding(held: impl Send + 'static) -> RunLock {
        RunLock {
            _held: Some(Box::new(held)),
        }
    }
}

/// The statuses after which nothing more is sent (receipts may still
/// follow `sent`): what retention may erase.
pub(super) const SETTLED: [&str; 9] = [
    "sent",
    "delivered",
    "bounced",
    "complained",
    "failed",
    "suppressed",
    "dead_lettered",
    "rejected",
    "cancelled",
];

/// [`SETTLED`] as an SQL list: `('sent', …)`.
pub(super) fn settled_list() -> String {
    let quoted: Vec<String> = SETTLED.iter().map(|s| format!("'{s}'")).collect();
    format!("({})", quoted.join(", "))
}

/// What [`RetentionStore::scrub_file`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Scrubbed {
    /// The file was rewritten (`VACUUM`).
    pub vacuumed: bool,
    /// The log was checkpointed into the file and truncated.
    pub log_truncated: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Db;

    const SENTINEL: &[u8] = b"zq7sentinel";

    /// Twenty thousand settled messages, all erased tenant by tenant as
    /// the job does: after the scrub, neither the file nor its log holds
    /// any of their text as bytes. (The stray copies `VACUUM` removes
    /// did not show at this size here; `bench/retention.sh` finds them
    /// among a million messages written beside live sends.)
    #[tokio::test]
    async fn no_copy_of_erased_text_is_left_in_the_sqlite_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.db");
        let db = Db::open(&path, false).await.unwrap();
        // Settled messages of four tenants, interleaved (as a busy store
        // holds them), written by one statement so SQLite splits pages
        // as it goes.
        db.test_execute(
            "WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c WHERE n < 20000) \
             INSERT INTO messages (id, tenant_id, channel, status, priority, lane, attempts, \
             reference, metadata, created_at, updated_at, last_error) \
             SELECT 'm' || n, 't' || (n % 4), 'email', 'bounced', 'normal', 'fast', 1, \
             'ref-zq7sentinel-' || n, '{\"who\":\"zq7sentinel-' || n || '@example.com\"}', \
             n, n, 'bounced: zq7sentinel-' || n || '@example.com' FROM c",
        )
        .await;
        let mut ids = Vec::new();
        for tenant in ["t0", "t1", "t2", "t3"] {
            ids.extend(
                db.due_for_erasure(tenant, i64::MAX, 20_000)
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|d| d.id),
            );
        }
        let mut erased = 0;
        for chunk in ids.chunks(crate::store::sqlite::IDS_PER_STATEMENT) {
            erased += db.erase_messages(chunk, 1).await.unwrap();
        }
        assert_eq!(erased, 20_000);
        let scrubbed = db.scrub_file(true).await.unwrap();
        assert_eq!(
            scrubbed,
            Scrubbed {
                vacuumed: true,
                log_truncated: true
            }
        );
        let mut wal = path.clone().into_os_string();
        wal.push("-wal");
        for file in [path.clone(), wal.into()] {
            let bytes = std::fs::read(&file).unwrap_or_default();
            let copies = bytes
                .windows(SENTINEL.len())
                .filter(|w| *w == SENTINEL)
                .count();
            assert_eq!(
                copies,
                0,
                "{copies} copies of erased text in {}",
                file.display()
            );
        }
    }
}
