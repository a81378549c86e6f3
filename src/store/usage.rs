//! Usage rows: per tenant, UTC day, channel and key kind, how many messages
//! were accepted and reached each outcome, and the SMS fragments sent.
//! They are counted in the same transaction as the change they count.
//! The lifecycle's moves count them ([`crate::store::lifecycle`]). On
//! PostgreSQL each move's statement appends its counts to `usage_deltas`,
//! and [`roll_up`] folds them into `usage` on one instance at a time; reads
//! add both. On SQLite the counts are summed over a writer's group in
//! [`sqlite::usage::Pending`] and written once per key before the group commits. The rows are apart from the messages, so retention
//! never changes them.

use super::usage_counters::COUNTERS;
use super::{Db, sqlite};
use crate::model::Scope;

/// Deltas folded per roll-up transaction.
const ROLL_UP_BATCH: i64 = 50_000;

/// One day's usage of one tenant's channel, live or test.
#[derive(Debug, Clone, Default, PartialEq, Eq, sqlx::FromRow)]
pub struct UsageRow {
    pub tenant_id: String,
    /// Days since 1970-01-01 (UTC).
    pub day: i64,
    pub channel: String,
    pub test: bool,
    pub accepted: i64,
    pub sent: i64,
    pub delivered: i64,
    pub bounced: i64,
    pub complained: i64,
    pub failed: i64,
    pub dead_lettered: i64,
    pub suppressed: i64,
    pub cancelled: i64,
    pub rejected: i64,
    pub fragments: i64,
}

/// Whose usage a read covers.
#[derive(Debug, Clone, Copy)]
pub enum Whose<'a> {
    /// Every tenant, both worlds (an operator's view).
    Everyone,
    /// One tenant, both worlds (an operator's view).
    Tenant(&'a str),
    /// One tenant in one world: what its own key may see.
    Scope(&'a Scope),
}

/// The usage rows of days `from_day..=to_day` of `whose`, ordered by
/// tenant, day, channel and kind.
pub async fn read(
    db: &Db,
    whose: Whose<'_>,
    from_day: i64,
    to_day: i64,
) -> anyhow::Result<Vec<UsageRow>> {
    let (tenant_id, test) = match whose {
        Whose::Everyone => (None, None),
        Whose::Tenant(tenant) => (Some(tenant), None),
        Whose::Scope(scope) => (Some(scope.tenant()), Some(scope.is_test())),
    };
    let columns = COUNTERS.join(", ");
    let source = match db {
        Db::Sqlite(_) => "usage".to_owned(),
        Db::Postgres(_) => format!(
            "(SELECT tenant_id, day, channel, test, {columns} FROM usage \
             UNION ALL SELECT tenant_id, day, channel, test, {columns} FROM usage_deltas)"
        ),
    };
    let sums: Vec<String> = COUNTERS
        .iter()
        .map(|c| format!("CAST(SUM({c}) AS BIGINT) AS {c}"))
        .collect();
    let sql = format!(
        "SELECT tenant_id, day, channel, test, {sums} FROM {source} AS u \
         WHERE day BETWEEN $1 AND $2 AND (CAST($3 AS TEXT) IS NULL OR tenant_id = $3) \
         AND (CAST($4 AS BOOLEAN) IS NULL OR test = $4) \
         GROUP BY tenant_id, day, channel, test ORDER BY tenant_id, day, channel, test",
        sums = sums.join(", ")
    );
    Ok(match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![from_day, to_day, tenant_id.map(str::to_owned), test];
            db.rows(sql, args, |row| {
                Ok(UsageRow {
                    tenant_id: row.get(0)?,
                    day: row.get(1)?,
                    channel: row.get(2)?,
                    test: row.get(3)?,
                    accepted: row.get(4)?,
                    sent: row.get(5)?,
                    delivered: row.get(6)?,
                    bounced: row.get(7)?,
                    complained: row.get(8)?,
                    failed: row.get(9)?,
                    dead_lettered: row.get(10)?,
                    suppressed: row.get(11)?,
                    cancelled: row.get(12)?,
                    rejected: row.get(13)?,
                    fragments: row.get(14)?,
                })
            })
            .await?
        }
        Db::Postgres(db) => {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(from_day)
                .bind(to_day)
                .bind(tenant_id)
                .bind(test)
                .fetch_all(&db.pool)
                .await?
        }
    })
}

/// PostgreSQL: folds the appended deltas into `usage`, one batch per
/// transaction, on one instance at a time (`None` from the others, and on
/// SQLite, which counts in place). Returns how many deltas it folded.
pub async fn roll_up(db: &Db) -> anyhow::Result<Option<u64>> {
    let Db::Postgres(pg) = db else {
        return Ok(None);
    };
    let columns = COUNTERS.join(", ");
    let sums: Vec<String> = COUNTERS.iter().map(|c| format!("SUM({c})")).collect();
    let adds: Vec<String> = COUNTERS
        .iter()
        .map(|c| format!("{c} = usage.{c} + excluded.{c}"))
        .collect();
    let sql = format!(
        "WITH moved AS (DELETE FROM usage_deltas WHERE id IN \
           (SELECT id FROM usage_deltas ORDER BY id LIMIT $1) RETURNING *), \
         folded AS (INSERT INTO usage (tenant_id, day, channel, test, {columns}) \
           SELECT tenant_id, day, channel, test, {sums} FROM moved \
           GROUP BY tenant_id, day, channel, test ORDER BY tenant_id, day, channel, test \
           ON CONFLICT (tenant_id, day, channel, test) DO UPDATE SET {adds} RETURNING 1) \
         SELECT (SELECT COUNT(*) FROM moved), (SELECT COUNT(*) FROM folded)",
        sums = sums.join(", "),
        adds = adds.join(", ")
    );
    let mut total = 0u64;
    loop {
        let Some(mut tx) =
            super::postgres::try_lock(pg, super::postgres::locks::USAGE_ROLL_UP).await?
        else {
            return Ok(None);
        };
        let (moved, _folded): (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(sql.clone()))
            .bind(ROLL_UP_BATCH)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        total += moved.max(0) as u64;
        if moved < ROLL_UP_BATCH {
            return Ok(Some(total));
        }
    }
}

/// (Being moved here: the usage operations, implemented per engine in
/// `sqlite/usage.rs` and `postgres/usage.rs`.)
#[async_trait::async_trait]
pub trait UsageStore: Send + Sync {}
