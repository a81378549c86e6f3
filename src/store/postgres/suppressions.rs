//! The suppression lists on PostgreSQL.

use crate::store::StoreResult;
use async_trait::async_trait;

use super::PgDb;
use crate::model::{Channel, now_ms};
use crate::store::suppressions::{Suppression, SuppressionStore};

/// Adds an address (normalised) unless it is already listed; the first
/// reason stays. Parameters: tenant, address, channel, reason, detail,
/// message id, when.
const INSERT: &str = "INSERT INTO suppressions (tenant_id, address, channel, reason, detail, \
     message_id, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7) \
     ON CONFLICT (tenant_id, address) DO NOTHING";

const COLUMNS: &str = "address, channel, reason, detail, message_id, created_at";

#[async_trait]
impl SuppressionStore for PgDb {
    async fn unsubscribe(
        &self,
        tenant_id: &str,
        channel: Channel,
        address: &str,
        message_id: &str,
        now: i64,
    ) -> StoreResult<bool> {
        let mut tx = self.pool.begin().await?;
        let added = sqlx::query(INSERT)
            .bind(tenant_id)
            .bind(address)
            .bind(channel.as_str())
            .bind("unsubscribe")
            .bind(None::<String>)
            .bind(message_id)
            .bind(now)
            .execute(&mut *tx)
            .await?
            .rows_affected()
            > 0;
        if added {
            super::lifecycle::note(&mut tx, message_id, tenant_id, "unsubscribed", now).await?;
        }
        tx.commit().await?;
        Ok(added)
    }

    async fn add_suppression(
        &self,
        tenant_id: &str,
        channel: Channel,
        address: &str,
        detail: Option<&str>,
    ) -> StoreResult<bool> {
        let added = sqlx::query(INSERT)
            .bind(tenant_id)
            .bind(address)
            .bind(channel.as_str())
            .bind("manual")
            .bind(detail)
            .bind(None::<String>)
            .bind(now_ms())
            .execute(&self.pool)
            .await?
            .rows_affected();
        Ok(added == 1)
    }

    async fn suppression(
        &self,
        tenant_id: &str,
        address: &str,
    ) -> StoreResult<Option<Suppression>> {
        let sql =
            format!("SELECT {COLUMNS} FROM suppressions WHERE tenant_id = $1 AND address = $2");
        let row = sqlx::query_as::<_, Suppression>(sqlx::AssertSqlSafe(sql))
            .bind(tenant_id)
            .bind(address)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(Suppression::dated))
    }

    async fn is_suppressed(&self, tenant_id: &str, address: &str) -> StoreResult<bool> {
        const LISTED: &str = "SELECT 1 FROM suppressions WHERE tenant_id = $1 AND address = $2";
        Ok(sqlx::query_scalar::<_, i32>(LISTED)
            .bind(tenant_id)
            .bind(address)
            .fetch_optional(&self.pool)
            .await?
            .is_some())
    }

    async fn suppressions_of(
        &self,
        tenant_id: &str,
        after: Option<&str>,
        limit: i64,
    ) -> StoreResult<Vec<Suppression>> {
        let sql = format!(
            "SELECT {COLUMNS} FROM suppressions \
             WHERE tenant_id = $1 AND address > $2 ORDER BY address LIMIT $3"
        );
        let rows = sqlx::query_as::<_, Suppression>(sqlx::AssertSqlSafe(sql))
            .bind(tenant_id)
            .bind(after.unwrap_or(""))
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.into_iter().map(Suppression::dated).collect())
    }

    async fn remove_suppression(&self, tenant_id: &str, address: &str) -> StoreResult<bool> {
        const REMOVE: &str = "DELETE FROM suppressions WHERE tenant_id = $1 AND address = $2";
        let removed = sqlx::query(REMOVE)
            .bind(tenant_id)
            .bind(address)
            .execute(&self.pool)
            .await?
            .rows_affected();
        Ok(removed == 1)
    }
}
