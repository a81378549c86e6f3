//! Status rows and their histories on PostgreSQL.

use std::collections::HashMap;

use crate::store::StoreResult;
use async_trait::async_trait;

use super::PgDb;
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

type Query<'q, O> = sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>;

/// Binds the scope and then `binds` to a list's statement.
fn bind_list<'q, O>(
    mut query: Query<'q, O>,
    scope: &'q Scope,
    binds: &'q [ListValue],
) -> Query<'q, O> {
    query = query.bind(scope.tenant()).bind(scope.is_test());
    for value in binds {
        query = match value {
            ListValue::Text(text) => query.bind(text.as_str()),
            ListValue::Number(number) => query.bind(*number),
        };
    }
    query
}

/// Message `$1` if it is tenant `$2`'s in world `$3` (test or live).
const IN_SCOPE: &str = select_message!("WHERE id = $1 AND tenant_id = $2 AND test = $3");

/// The recipients' statuses of message `$1`, by address.
const RECIPIENTS: &str = "SELECT address, status, detail, updated_at FROM recipient_statuses \
     WHERE message_id = $1 ORDER BY address";

/// A [`RECIPIENTS`] row: address, status, detail, updated at.
type RecipientRow = (String, String, Option<String>, i64);

fn recipient_of((address, status, detail, updated_at): RecipientRow) -> RecipientRecord {
    RecipientRecord {
        address,
        status,
        detail,
        updated_at,
    }
}

#[async_trait]
impl MessageStore for PgDb {
    async fn message_in(&self, scope: &Scope, id: &str) -> StoreResult<Option<MessageRecord>> {
        let row: Option<MessageRow> = sqlx::query_as(IN_SCOPE)
            .bind(id)
            .bind(scope.tenant())
            .bind(scope.is_test())
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(from_row).transpose()?)
    }

    async fn message(&self, id: &str) -> StoreResult<Option<MessageRecord>> {
        const BY_ID: &str = select_message!("WHERE id = $1");
        let row: Option<MessageRow> = sqlx::query_as(BY_ID)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(from_row).transpose()?)
    }

    async fn message_events(&self, id: &str) -> StoreResult<Vec<EventRecord>> {
        const LIST: &str = "SELECT id, at, event, status, attempts, detail, provider_message_id \
             FROM message_events WHERE message_id = $1 ORDER BY id LIMIT $2";
        Ok(sqlx::query_as(LIST)
            .bind(id)
            .bind(MAX_EVENTS)
            .fetch_all(&self.pool)
            .await?)
    }

    async fn recipient_statuses(&self, id: &str) -> StoreResult<Vec<RecipientRecord>> {
        let rows: Vec<RecipientRow> = sqlx::query_as(RECIPIENTS)
            .bind(id)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.into_iter().map(recipient_of).collect())
    }

    async fn message_with_recipients(
        &self,
        scope: &Scope,
        id: &str,
    ) -> StoreResult<Option<(MessageRecord, Vec<RecipientRecord>)>> {
        // One snapshot for both statements (READ COMMITTED takes one per
        // statement).
        let mut tx = self.pool.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *tx)
            .await?;
        let row: Option<MessageRow> = sqlx::query_as(IN_SCOPE)
            .bind(id)
            .bind(scope.tenant())
            .bind(scope.is_test())
            .fetch_optional(&mut *tx)
            .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        if !row.may_have_recipients() {
            return Ok(Some((from_row(row)?, Vec::new())));
        }
        let recipients: Vec<RecipientRow> = sqlx::query_as(RECIPIENTS)
            .bind(id)
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        let recipients = recipients.into_iter().map(recipient_of).collect();
        Ok(Some((from_row(row)?, recipients)))
    }

    async fn last_provider(&self, id: &str) -> StoreResult<Option<(String, bool)>> {
        const LAST: &str = "SELECT provider, provider_pinned FROM messages WHERE id = $1";
        let row: Option<(Option<String>, bool)> = sqlx::query_as(LAST)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.and_then(|(provider, pinned)| provider.map(|provider| (provider, pinned))))
    }

    async fn live_count_since(&self, tenant_id: &str, since_ms: i64) -> StoreResult<u64> {
        const COUNT: &str = "SELECT COUNT(*) FROM messages \
             WHERE tenant_id = $1 AND test = FALSE AND created_at >= $2";
        let count: i64 = sqlx::query_scalar(COUNT)
            .bind(tenant_id)
            .bind(since_ms)
            .fetch_one(&self.pool)
            .await?;
        Ok(count.max(0) as u64)
    }

    async fn mark_requeued(&self, ids: &[String], redrive_started: i64) -> StoreResult<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let mut tx = self.pool.begin().await?;
        super::lifecycle::redrive(&mut tx, ids, redrive_started, now_ms()).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn restore_dead_lettered(&self, ids: &[String]) -> StoreResult<()> {
        let mut conn = self.pool.acquire().await?;
        super::lifecycle::restore(&mut conn, ids, now_ms()).await?;
        Ok(())
    }

    async fn messages_by_id(&self, ids: &[String]) -> StoreResult<HashMap<String, MessageRecord>> {
        let rows: Vec<MessageRow> = sqlx::query_as(select_message!("WHERE id = ANY($1)"))
            .bind(ids)
            .fetch_all(&self.pool)
            .await?;
        let mut found = HashMap::new();
        for row in rows {
            let record = from_row(row)?;
            found.insert(record.id.clone(), record);
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
             WHERE tenant_id = $1 AND test = $2 AND reference = $3 \
             AND status IN ('scheduled', 'queued', 'retrying') ORDER BY id LIMIT $4";
        const TOTAL: &str =
            "SELECT COUNT(*) FROM messages WHERE tenant_id = $1 AND test = $2 AND reference = $3";
        let (tenant, test) = (scope.tenant(), scope.is_test());
        let pending = sqlx::query_scalar(PENDING)
            .bind(tenant)
            .bind(test)
            .bind(reference)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        let total: i64 = sqlx::query_scalar(TOTAL)
            .bind(tenant)
            .bind(test)
            .bind(reference)
            .fetch_one(&self.pool)
            .await?;
        Ok((pending, total.max(0) as usize))
    }

    /// The schema has it from its first migration.
    async fn index_pending(&self) -> StoreResult<()> {
        Ok(())
    }

    async fn oldest_pending(&self, lane: Lane, tenant: Option<&str>) -> StoreResult<Option<i64>> {
        const OLDEST: &str = "SELECT MIN(created_at) FROM messages \
             WHERE lane = $1 AND status IN ('queued', 'sending', 'retrying')";
        const OLDEST_OF: &str = "SELECT MIN(created_at) FROM messages \
             WHERE lane = $1 AND status IN ('queued', 'sending', 'retrying') AND tenant_id = $2";
        let lane = lane.as_str();
        Ok(match tenant {
            None => {
                sqlx::query_scalar(OLDEST)
                    .bind(lane)
                    .fetch_one(&self.pool)
                    .await?
            }
            Some(tenant) => {
                sqlx::query_scalar(OLDEST_OF)
                    .bind(lane)
                    .bind(tenant)
                    .fetch_one(&self.pool)
                    .await?
            }
        })
    }

    /// Another instance may be sending them: nothing changes.
    async fn release_interrupted_sends(&self) -> StoreResult<u64> {
        Ok(0)
    }

    /// The page, and where its scan stopped when it is bounded and came
    /// back short, in one transaction. Without a reference the page is read
    /// in the list index's order and PostgreSQL is kept from sorting it:
    /// its statistics may lag a tenant's growth (autovacuum's `ANALYZE`
    /// comes later, or never where autovacuum is off), and expecting a few
    /// hundred rows where there are a million, it would read all the
    /// tenant's rows and sort them (0.6 s for a scan of 20,000 here) where
    /// the index holds them in order (6 ms).
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
                 WHERE tenant_id = $1 AND test = $2{window}{NEWEST_FIRST} LIMIT ${scan}) \
                 AS scanned WHERE TRUE{checked}{NEWEST_FIRST} LIMIT ${}",
                binds.len() + 3
            )
        } else {
            format!(
                "SELECT {MESSAGE_COLUMNS} FROM messages \
                 WHERE tenant_id = $1 AND test = $2{window}{checked}{NEWEST_FIRST} LIMIT ${}",
                binds.len() + 3
            )
        };
        binds.push(ListValue::Number(limit));
        let mut tx = self.pool.begin().await?;
        if filter.reference.is_none() {
            sqlx::query("SET LOCAL enable_sort = off")
                .execute(&mut *tx)
                .await?;
        }
        let rows: Vec<MessageRow> =
            bind_list(sqlx::query_as(sqlx::AssertSqlSafe(sql)), scope, &binds)
                .fetch_all(&mut *tx)
                .await?;
        let scanned_to = if bounded && (rows.len() as i64) < limit {
            let mut stop_binds = binds[..window_binds].to_vec();
            let sql = format!(
                "SELECT created_at, id FROM messages \
                 WHERE tenant_id = $1 AND test = $2{window}{NEWEST_FIRST} LIMIT 1 OFFSET ${}",
                stop_binds.len() + 3
            );
            stop_binds.push(ListValue::Number(scan_rows - 1));
            bind_list(sqlx::query_as(sqlx::AssertSqlSafe(sql)), scope, &stop_binds)
                .fetch_optional(&mut *tx)
                .await?
        } else {
            None
        };
        tx.commit().await?;
        let rows = rows
            .into_iter()
            .map(from_row)
            .collect::<anyhow::Result<_>>()?;
        Ok(ListPage { rows, scanned_to })
    }
}
