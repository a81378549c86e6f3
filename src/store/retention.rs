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

use super::{Db, sqlite};

/// A message due for erasure.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Due {
    pub id: String,
    pub status: String,
}

/// Up to `limit` settled messages of `tenant_id` created before `cutoff`
/// (ms) whose personal data is still kept, oldest first.
pub async fn due(db: &Db, tenant_id: &str, cutoff: i64, limit: usize) -> anyhow::Result<Vec<Due>> {
    let sql = format!(
        "SELECT id, status FROM messages \
         WHERE tenant_id = $1 AND erased_at IS NULL AND created_at < $2 \
         AND status IN {SETTLED} ORDER BY created_at LIMIT $3"
    );
    Ok(match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![tenant_id.to_owned(), cutoff, limit as i64];
            db.rows(sql, args, |row| {
                Ok(Due {
                    id: row.get(0)?,
                    status: row.get(1)?,
                })
            })
            .await?
        }
        Db::Postgres(db) => {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(tenant_id)
                .bind(cutoff)
                .bind(limit as i64)
                .fetch_all(&db.pool)
                .await?
        }
    })
}

/// The statuses after which nothing more is sent (receipts may still
/// follow `sent`): what retention may erase.
const SETTLED: &str = "('sent', 'delivered', 'bounced', 'complained', 'failed', 'suppressed', \
     'dead_lettered', 'rejected', 'cancelled')";

/// Erases the personal data of the messages `ids` (at most
/// [`super::sqlite::IDS_PER_STATEMENT`] of them) in one transaction: the
/// status row's reference, metadata and error, its events' details, and an
/// outbox row if one is left. A message no longer settled (a redrive put it
/// back after [`due`] read it) is left whole. Returns how many status rows
/// it erased.
pub async fn erase(db: &Db, ids: &[String], now: i64) -> anyhow::Result<u64> {
    if ids.is_empty() {
        return Ok(0);
    }
    let messages = format!(
        "UPDATE messages SET reference = NULL, metadata = NULL, last_error = NULL, \
         erased_at = $1 WHERE erased_at IS NULL AND status IN {SETTLED} AND id "
    );
    const EVENTS: &str =
        "UPDATE message_events SET detail = NULL WHERE detail IS NOT NULL AND message_id ";
    const OUTBOX: &str = "DELETE FROM outbox WHERE message_id ";
    match db {
        Db::Sqlite(sqlite) => {
            let ids = ids.to_vec();
            sqlite
                .transact(move |tx| {
                    let sql = format!("{messages}IN ({} RETURNING id", sqlite::id_list(ids.len()));
                    let mut args = sqlite::args![now];
                    args.extend(ids.into_iter().map(rusqlite::types::Value::from));
                    let erased: Vec<String> = tx
                        .prepare(&sql)?
                        .query_map(rusqlite::params_from_iter(args), |row| row.get(0))?
                        .collect::<rusqlite::Result<_>>()?;
                    if !erased.is_empty() {
                        for head in [EVENTS, OUTBOX] {
                            let sql = format!("{head}IN ({}", sqlite::id_list(erased.len()));
                            tx.execute(&sql, rusqlite::params_from_iter(&erased))?;
                        }
                    }
                    Ok(erased.len() as u64)
                })
                .await
        }
        Db::Postgres(pg) => {
            let mut tx = pg.pool.begin().await?;
            let erased: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "{messages}= ANY($2) RETURNING id"
            )))
            .bind(now)
            .bind(ids)
            .fetch_all(&mut *tx)
            .await?;
            for head in [EVENTS, OUTBOX] {
                sqlx::query(sqlx::AssertSqlSafe(format!("{head}= ANY($1)")))
                    .bind(&erased)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            Ok(erased.len() as u64)
        }
    }
}

/// Held through a retention run: on PostgreSQL the advisory lock that
/// keeps other instances' runs out until it is dropped.
pub struct RunLock {
    _held: Option<sqlx::Transaction<'static, sqlx::Postgres>>,
}

/// The right to run retention now; `None` while another instance runs it.
pub async fn lock_run(db: &Db) -> anyhow::Result<Option<RunLock>> {
    match db {
        Db::Sqlite(_) => Ok(Some(RunLock { _held: None })),
        Db::Postgres(pg) => Ok(
            super::postgres::try_lock(pg, super::postgres::locks::RETENTION)
                .await?
                .map(|tx| RunLock { _held: Some(tx) }),
        ),
    }
}

/// How many of `tenant_id`'s messages are not delivered yet (`scheduled`,
/// `queued`, `sending`, `retrying`).
pub async fn undelivered(db: &Db, tenant_id: &str) -> anyhow::Result<i64> {
    const UNDELIVERED: &str = "SELECT COUNT(*) FROM messages WHERE tenant_id = $1 \
         AND status IN ('scheduled', 'queued', 'sending', 'retrying')";
    Ok(match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![tenant_id.to_owned()];
            db.row(UNDELIVERED, args, |row| row.get(0))
                .await?
                .unwrap_or(0)
        }
        Db::Postgres(db) => {
            sqlx::query_scalar(UNDELIVERED)
                .bind(tenant_id)
                .fetch_one(&db.pool)
                .await?
        }
    })
}

/// What [`scrub_file`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Scrubbed {
    /// The file was rewritten (`VACUUM`).
    pub vacuumed: bool,
    /// The log was checkpointed into the file and truncated.
    pub log_truncated: bool,
}

/// Checkpoints tried while readers keep the log from being truncated, and
/// the pause between them (writes wait meanwhile: at most about 1 s).
const TRUNCATE_TRIES: u32 = 20;
const TRUNCATE_PAUSE: std::time::Duration = std::time::Duration::from_millis(50);

/// SQLite: leaves no old copy of erased or deleted text on disk.
/// `secure_delete` zeroes the space a write frees, but when SQLite
/// rebuilds a page (a split or a merge) it leaves the bytes that were in
/// the page's unused middle as they were, old copies of rows among them;
/// `VACUUM` (when `vacuum`) writes every page anew. Then the log, which
/// holds the old page images, is copied into the file and truncated.
/// Writes wait for their turn meanwhile. `log_truncated` is false when
/// readers kept the checkpoint from finishing through
/// [`TRUNCATE_TRIES`] tries; the next run tries again.
/// Nothing to do on PostgreSQL, whose rows are read only through its
/// tables.
pub async fn scrub_file(db: &Db, vacuum: bool) -> anyhow::Result<Scrubbed> {
    let Db::Sqlite(sqlite) = db else {
        return Ok(Scrubbed {
            vacuumed: false,
            log_truncated: true,
        });
    };
    let _turn = sqlite.write_turn().await;
    if vacuum {
        sqlite
            .on_rare_connection(|conn| Ok(conn.execute_batch("VACUUM")?))
            .await?;
    }
    // A reader's snapshot (a request, a long-poll receive) keeps the
    // checkpoint from truncating the log; such snapshots last milliseconds,
    // so try again a few times before leaving it to the next run.
    let mut busy = 1;
    for attempt in 0..TRUNCATE_TRIES {
        if attempt > 0 {
            tokio::time::sleep(TRUNCATE_PAUSE).await;
        }
        let now_busy: i64 = sqlite
            .on_rare_connection(|conn| {
                Ok(conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |row| row.get(0))?)
            })
            .await?;
        busy = now_busy;
        if busy == 0 {
            break;
        }
    }
    Ok(Scrubbed {
        vacuumed: vacuum,
        log_truncated: busy == 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
                due(&db, tenant, i64::MAX, 20_000)
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|d| d.id),
            );
        }
        let mut erased = 0;
        for chunk in ids.chunks(crate::store::sqlite::IDS_PER_STATEMENT) {
            erased += erase(&db, chunk, 1).await.unwrap();
        }
        assert_eq!(erased, 20_000);
        let scrubbed = scrub_file(&db, true).await.unwrap();
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

/// (Being moved here: the retention operations, implemented per engine in
/// `sqlite/retention.rs` and `postgres/retention.rs`.)
#[async_trait::async_trait]
pub trait RetentionStore: Send + Sync {}
