//! Retention on SQLite: finding and erasing settled messages' personal
//! data, and scrubbing the file so no old copy of it stays on disk.

use crate::store::StoreResult;
use async_trait::async_trait;

use super::{SqliteDb, args, id_list};
use crate::store::retention::{Due, RetentionStore, RunLock, Scrubbed, settled_list};

/// Checkpoints tried while readers keep the log from being truncated, and
/// the pause between them (writes wait meanwhile: at most about 1 s).
const TRUNCATE_TRIES: u32 = 20;
const TRUNCATE_PAUSE: std::time::Duration = std::time::Duration::from_millis(50);

#[async_trait]
impl RetentionStore for SqliteDb {
    async fn due_for_erasure(
        &self,
        tenant_id: &str,
        cutoff: i64,
        limit: usize,
    ) -> StoreResult<Vec<Due>> {
        let sql = format!(
            "SELECT id, status FROM messages \
             WHERE tenant_id = ?1 AND erased_at IS NULL AND created_at < ?2 \
             AND status IN {} ORDER BY created_at LIMIT ?3",
            settled_list()
        );
        let args = args![tenant_id.to_owned(), cutoff, limit as i64];
        Ok(self
            .rows(sql, args, |row| {
                Ok(Due {
                    id: row.get(0)?,
                    status: row.get(1)?,
                })
            })
            .await?)
    }

    async fn erase_messages(&self, ids: &[String], now: i64) -> StoreResult<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let messages = format!(
            "UPDATE messages SET reference = NULL, metadata = NULL, last_error = NULL, recipient = NULL, \
             erased_at = ? WHERE erased_at IS NULL AND status IN {} AND id IN ({} RETURNING id",
            settled_list(),
            id_list(ids.len())
        );
        const EVENTS: &str = "UPDATE message_events SET detail = NULL \
             WHERE detail IS NOT NULL AND message_id IN (";
        const OUTBOX: &str = "DELETE FROM outbox WHERE message_id IN (";
        const RECIPIENTS: &str = "DELETE FROM recipient_statuses WHERE message_id IN (";
        let ids = ids.to_vec();
        Ok(self
            .transact(move |tx| {
                let mut args = args![now];
                args.extend(ids.into_iter().map(rusqlite::types::Value::from));
                let erased: Vec<String> = tx
                    .prepare(&messages)?
                    .query_map(rusqlite::params_from_iter(args), |row| row.get(0))?
                    .collect::<rusqlite::Result<_>>()?;
                if !erased.is_empty() {
                    for head in [EVENTS, OUTBOX, RECIPIENTS] {
                        let sql = format!("{head}{}", id_list(erased.len()));
                        tx.execute(&sql, rusqlite::params_from_iter(&erased))?;
                    }
                    // The files the messages carried, chunks and all.
                    super::attachments::erase_of_messages(tx, &erased)?;
                }
                Ok(erased.len() as u64)
            })
            .await?)
    }

    async fn lock_retention_run(&self) -> StoreResult<Option<RunLock>> {
        Ok(Some(RunLock::alone()))
    }

    async fn undelivered(&self, tenant_id: &str) -> StoreResult<i64> {
        const UNDELIVERED: &str = "SELECT COUNT(*) FROM messages WHERE tenant_id = ?1 \
             AND status IN ('scheduled', 'queued', 'sending', 'retrying')";
        let args = args![tenant_id.to_owned()];
        Ok(self
            .row(UNDELIVERED, args, |row| row.get(0))
            .await?
            .unwrap_or(0))
    }

    async fn scrub_file(&self, vacuum: bool) -> StoreResult<Scrubbed> {
        let _turn = self.write_turn().await;
        if vacuum {
            self.on_rare_connection(|conn| Ok(conn.execute_batch("VACUUM")?))
                .await?;
        }
        // A reader's snapshot (a request, a long-poll receive) keeps the
        // checkpoint from truncating the log; such snapshots last
        // milliseconds, so try again a few times before leaving it to the
        // next run.
        let mut busy = 1;
        for attempt in 0..TRUNCATE_TRIES {
            if attempt > 0 {
                tokio::time::sleep(TRUNCATE_PAUSE).await;
            }
            let now_busy: i64 = self
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
}
