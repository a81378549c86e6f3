//! Usage rows on PostgreSQL: each lifecycle move appends its counts to
//! `usage_deltas` (no two instances contend for one `usage` row), reads
//! add both tables, and a roll-up folds the deltas into `usage`.

use crate::store::StoreResult;
use async_trait::async_trait;

use super::{PgDb, locks, try_lock};
use crate::store::usage::{UsageRow, UsageStore, Whose, summed_counters};
use crate::store::usage_counters::COUNTERS;

/// Deltas folded per roll-up transaction.
const ROLL_UP_BATCH: i64 = 50_000;

#[async_trait]
impl UsageStore for PgDb {
    async fn usage(
        &self,
        whose: Whose<'_>,
        from_day: i64,
        to_day: i64,
    ) -> StoreResult<Vec<UsageRow>> {
        let (tenant_id, test) = whose.bounds();
        let columns = COUNTERS.join(", ");
        let sql = format!(
            "SELECT tenant_id, day, channel, test, {sums} FROM \
             (SELECT tenant_id, day, channel, test, {columns} FROM usage \
              UNION ALL SELECT tenant_id, day, channel, test, {columns} FROM usage_deltas) AS u \
             WHERE day BETWEEN $1 AND $2 AND (CAST($3 AS TEXT) IS NULL OR tenant_id = $3) \
             AND (CAST($4 AS BOOLEAN) IS NULL OR test = $4) \
             GROUP BY tenant_id, day, channel, test ORDER BY tenant_id, day, channel, test",
            sums = summed_counters()
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(from_day)
            .bind(to_day)
            .bind(tenant_id)
            .bind(test)
            .fetch_all(&self.pool)
            .await?)
    }

    async fn roll_up_usage(&self) -> StoreResult<Option<u64>> {
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
            let Some(mut tx) = try_lock(self, locks::USAGE_ROLL_UP).await? else {
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
}
