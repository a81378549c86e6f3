//! Status rows and their histories on SQLite.

use std::collections::HashMap;

use crate::store::StoreResult;
use async_trait::async_trait;
use rusqlite::OptionalExtension;

use super::{Args, IDS_PER_STATEMENT, SqliteDb, args, id_list, tuple};
use crate::model::{Lane, Scope, now_ms};
use crate::store::events::{EventRecord, MAX_EVENTS};
use crate::store::messages::{
    ListFilter, ListPage, ListQuery, ListValue, MESSAGE_COLUMNS, MessageRecord, MessageRow,
    MessageStore, NEWEST_FIRST, RecipientRecord, from_row, message_columns,
};

/// A status row's statement: its columns from `messages`, then `$where`.
macro_rules! select_message {
    ($where:literal) => {
        concat!("SELECT ", message_columns!(), " FROM messages ", $where)
    };
}

/// Message `?1` if it is tenant `?2`'s in world `?3` (test or live).
const IN_SCOPE: &str = select_message!("WHERE id = ?1 AND tenant_id = ?2 AND test = ?3");

/// The recipients' statuses of message `?1`, by address.
const RECIPIENTS: &str = "SELECT address, status, detail, updated_at FROM recipient_statuses \
     WHERE message_id = ?1 ORDER BY address";

fn recipient_row(row: &rusqlite::Row) -> rusqlite::Result<RecipientRecord> {
    Ok(RecipientRecord {
        address: row.get(0)?,
        status: row.get(1)?,
        detail: row.get(2)?,
        updated_at: row.get(3)?,
    })
}

/// A [`MessageRow`] from a row of [`MESSAGE_COLUMNS`].
fn message_row(row: &rusqlite::Row) -> rusqlite::Result<MessageRow> {
    Ok(MessageRow {
        id: row.get(0)?,
        tenant_id: row.get(1)?,
        channel: row.get(2)?,
        status: row.get(3)?,
        priority: row.get(4)?,
        lane: row.get(5)?,
        attempts: row.get(6)?,
        reference: row.get(7)?,
        metadata: row.get(8)?,
        created_at: row.get(9)?,
        updated_at: row.get(10)?,
        sent_at: row.get(11)?,
        last_error: row.get(12)?,
        provider_message_id: row.get(13)?,
        send_at: row.get(14)?,
        test: row.get(15)?,
        fragments: row.get(16)?,
        erased_at: row.get(17)?,
        provider: row.get(18)?,
        recipient: row.get(19)?,
        gate_wait_ms: row.get(20)?,
        template_id: row.get(21)?,
        template_version: row.get(22)?,
        attachment_bytes: row.get(23)?,
    })
}

/// The scope's tenant and world, then the list's `binds`.
fn list_args(scope: &Scope, binds: &[ListValue]) -> Args {
    let mut args = args![scope.tenant().to_owned(), scope.is_test()];
    args.extend(binds.iter().map(|value| match value {
        ListValue::Text(text) => text.clone().into(),
        ListValue::Number(number) => (*number).into(),
    }));
    args
}

#[async_trait]
impl MessageStore for SqliteDb {
    async fn message_in(&self, scope: &Scope, id: &str) -> StoreResult<Option<MessageRecord>> {
        let args = args![id.to_owned(), scope.tenant().to_owned(), scope.is_test()];
        let row = self.row(IN_SCOPE, args, message_row).await?;
        Ok(row.map(from_row).transpose()?)
    }

    async fn message_with_recipients(
        &self,
        scope: &Scope,
        id: &str,
    ) -> StoreResult<Option<(MessageRecord, Vec<RecipientRecord>)>> {
        let (id, tenant, test) = (id.to_owned(), scope.tenant().to_owned(), scope.is_test());
        let read = self
            .read(move |conn| {
                // One read transaction: both statements see one snapshot.
                let tx = conn.unchecked_transaction()?;
                let Some(row) = tx
                    .prepare_cached(IN_SCOPE)?
                    .query_row(rusqlite::params![id, tenant, test], message_row)
                    .optional()?
                else {
                    return Ok(None);
                };
                if !row.may_have_recipients() {
                    return Ok(Some((row, Vec::new())));
                }
                let recipients = tx
                    .prepare_cached(RECIPIENTS)?
                    .query_map([&id], recipient_row)?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                Ok(Some((row, recipients)))
            })
            .await?;
        Ok(match read {
            Some((row, recipients)) => Some((from_row(row)?, recipients)),
            None => None,
        })
    }

    async fn message(&self, id: &str) -> StoreResult<Option<MessageRecord>> {
        const BY_ID: &str = select_message!("WHERE id = ?1");
        let row = self.row(BY_ID, args![id.to_owned()], message_row).await?;
        Ok(row.map(from_row).transpose()?)
    }

    async fn message_events(&self, id: &str) -> StoreResult<Vec<EventRecord>> {
        const LIST: &str = "SELECT id, at, event, status, attempts, detail, provider_message_id \
             FROM message_events WHERE message_id = ?1 ORDER BY id LIMIT ?2";
        Ok(self
            .rows(LIST, args![id.to_owned(), MAX_EVENTS], |row| {
                Ok(EventRecord {
                    id: row.get(0)?,
                    at: row.get(1)?,
                    event: row.get(2)?,
                    status: row.get(3)?,
                    attempts: row.get(4)?,
                    detail: row.get(5)?,
                    provider_message_id: row.get(6)?,
                })
            })
            .await?)
    }

    async fn recipient_statuses(&self, id: &str) -> StoreResult<Vec<RecipientRecord>> {
        Ok(self
            .rows(RECIPIENTS, args![id.to_owned()], recipient_row)
            .await?)
    }

    async fn last_provider(&self, id: &str) -> StoreResult<Option<(String, bool)>> {
        const LAST: &str = "SELECT provider, provider_pinned FROM messages WHERE id = ?1";
        let row: Option<(Option<String>, bool)> =
            self.row(LAST, args![id.to_owned()], tuple).await?;
        Ok(row.and_then(|(provider, pinned)| provider.map(|provider| (provider, pinned))))
    }

    async fn live_count_since(&self, tenant_id: &str, since_ms: i64) -> StoreResult<u64> {
        const COUNT: &str = "SELECT COUNT(*) FROM messages \
             WHERE tenant_id = ?1 AND test = FALSE AND created_at >= ?2";
        let args = args![tenant_id.to_owned(), since_ms];
        let count: i64 = self.row(COUNT, args, |row| row.get(0)).await?.unwrap_or(0);
        Ok(count.max(0) as u64)
    }

    async fn mark_requeued(&self, ids: &[String], redrive_started: i64) -> StoreResult<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let (ids, now) = (ids.to_vec(), now_ms());
        Ok(self
            .transact(move |tx| {
                for id in &ids {
                    super::lifecycle::redrive(tx, id, redrive_started, now)?;
                }
                Ok(())
            })
            .await?)
    }

    async fn restore_dead_lettered(&self, ids: &[String]) -> StoreResult<()> {
        let (ids, now) = (ids.to_vec(), now_ms());
        Ok(self
            .transact(move |tx| {
                for id in &ids {
                    super::lifecycle::restore(tx, id, now)?;
                }
                Ok(())
            })
            .await?)
    }

    async fn messages_by_id(&self, ids: &[String]) -> StoreResult<HashMap<String, MessageRecord>> {
        let mut found = HashMap::new();
        for chunk in ids.chunks(IDS_PER_STATEMENT) {
            let sql = format!(
                "{}{}",
                select_message!("WHERE id IN ("),
                id_list(chunk.len())
            );
            let args = chunk
                .iter()
                .cloned()
                .map(rusqlite::types::Value::from)
                .collect();
            for row in self.rows(sql, args, message_row).await? {
                let record = from_row(row)?;
                found.insert(record.id.clone(), record);
            }
        }
        Ok(found)
    }

    async fn pending_by_reference(
        &self,
        scope: &Scope,
        reference: &str,
        limit: i64,
    ) -> StoreResult<(Vec<String>, usize)> {
        const PENDING: &str = "SELECT id FROM messages \
             WHERE tenant_id = ?1 AND test = ?2 AND reference = ?3 \
             AND status IN ('scheduled', 'queued', 'retrying') ORDER BY id LIMIT ?4";
        const TOTAL: &str =
            "SELECT COUNT(*) FROM messages WHERE tenant_id = ?1 AND test = ?2 AND reference = ?3";
        let args = args![
            scope.tenant().to_owned(),
            scope.is_test(),
            reference.to_owned()
        ];
        let mut with_limit = args.clone();
        with_limit.push(limit.into());
        let pending = self.rows(PENDING, with_limit, |row| row.get(0)).await?;
        let total: i64 = self.row(TOTAL, args, |row| row.get(0)).await?.unwrap_or(0);
        Ok((pending, total.max(0) as usize))
    }

    /// Its WHERE clause must match [`MessageStore::oldest_pending`]'s word
    /// for word for SQLite to use it.
    async fn index_pending(&self) -> StoreResult<()> {
        const INDEX: &str = "CREATE INDEX IF NOT EXISTS messages_pending \
             ON messages(lane, created_at) WHERE status IN ('queued', 'sending', 'retrying')";
        self.execute(INDEX, vec![]).await?;
        Ok(())
    }

    async fn oldest_pending(&self, lane: Lane, tenant: Option<&str>) -> StoreResult<Option<i64>> {
        const OLDEST: &str = "SELECT MIN(created_at) FROM messages \
             WHERE lane = ?1 AND status IN ('queued', 'sending', 'retrying')";
        const OLDEST_OF: &str = "SELECT MIN(created_at) FROM messages \
             WHERE lane = ?1 AND status IN ('queued', 'sending', 'retrying') AND tenant_id = ?2";
        let lane = lane.as_str().to_owned();
        let (sql, args) = match tenant {
            None => (OLDEST, args![lane]),
            Some(tenant) => (OLDEST_OF, args![lane, tenant.to_owned()]),
        };
        Ok(self.row(sql, args, |row| row.get(0)).await?.flatten())
    }

    async fn release_interrupted_sends(&self) -> StoreResult<u64> {
        let now = now_ms();
        Ok(self
            .transact(move |tx| Ok(super::lifecycle::release_all(tx, now)?))
            .await?)
    }

    async fn list_messages(
        &self,
        scope: &Scope,
        filter: &ListFilter,
        limit: i64,
        scan_rows: i64,
    ) -> StoreResult<ListPage> {
        let ListQuery {
            window,
            checked,
            mut binds,
            window_binds,
            bounded,
        } = ListQuery::of(filter);
        let sql = if bounded {
            let scan = binds.len() + 3;
            binds.push(ListValue::Number(scan_rows));
            format!(
                "SELECT {MESSAGE_COLUMNS} FROM (SELECT * FROM messages \
                 WHERE tenant_id = ?1 AND test = ?2{window}{NEWEST_FIRST} LIMIT ?{scan}) \
                 AS scanned WHERE TRUE{checked}{NEWEST_FIRST} LIMIT ?{}",
                binds.len() + 3
            )
        } else {
            // SQLite's statistics come from a sample (`analysis_limit`),
            // which cannot see that one tenant holds a million rows: it then
            // walks the tenant's rows newest first looking for the reference
            // (seconds for a rare one) instead of reading the reference's
            // own rows and sorting them (milliseconds for a thousand). A
            // reference shared by a great many messages is the case this
            // makes slower.
            let index = if filter.reference.is_some() {
                " INDEXED BY messages_tenant_reference"
            } else {
                ""
            };
            format!(
                "SELECT {MESSAGE_COLUMNS} FROM messages{index} \
                 WHERE tenant_id = ?1 AND test = ?2{window}{checked}{NEWEST_FIRST} LIMIT ?{}",
                binds.len() + 3
            )
        };
        binds.push(ListValue::Number(limit));
        let rows = self
            .rows(sql, list_args(scope, &binds), message_row)
            .await?;
        // Where the scan stopped, asked when a bounded page comes back short
        // (and so the scan, not the page, ended it): the `scan_rows`-th row
        // of the window, read from the index alone. None past the tenant's
        // last. (A second read, not the page's snapshot: a message inserted
        // in between only moves the place, it cannot skip a row.)
        let scanned_to = if bounded && (rows.len() as i64) < limit {
            let mut stop_binds = binds[..window_binds].to_vec();
            let sql = format!(
                "SELECT created_at, id FROM messages \
                 WHERE tenant_id = ?1 AND test = ?2{window}{NEWEST_FIRST} LIMIT 1 OFFSET ?{}",
                stop_binds.len() + 3
            );
            stop_binds.push(ListValue::Number(scan_rows - 1));
            self.row(sql, list_args(scope, &stop_binds), tuple).await?
        } else {
            None
        };
        let rows = rows
            .into_iter()
            .map(from_row)
            .collect::<anyhow::Result<_>>()?;
        Ok(ListPage { rows, scanned_to })
    }
}
