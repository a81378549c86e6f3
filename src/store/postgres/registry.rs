//! The registry's rows on PostgreSQL: plans, tenants, API keys and sender
//! identities, and the announcement that makes every instance reload them
//! after a change.

use crate::store::StoreResult;
use async_trait::async_trait;

use super::PgDb;
use crate::model::Plan;
use crate::store::registry::{
    KeyInsert, KeyListed, PLAN_COLUMNS, PlanSource, RegistryListener, RegistryRows, RegistryStore,
    SENDER_COLUMNS, SenderRow, StoredTenant, TENANT_COLUMNS, TenantDeletion, TenantInsert,
    TenantUpdate,
};

/// The channel registry changes are announced on.
const REGISTRY_CHANNEL: &str = "fairlane_registry";

#[async_trait]
impl RegistryStore for PgDb {
    fn changed_elsewhere(&self) -> bool {
        true
    }

    /// Read in one `REPEATABLE READ` snapshot.
    async fn read_registry(&self) -> StoreResult<RegistryRows> {
        const KEYS: &str =
            "SELECT id, tenant_id, secret_hash, kind FROM api_keys WHERE revoked_at IS NULL";
        let plans = format!("SELECT {PLAN_COLUMNS} FROM plans");
        let tenants = format!("SELECT {TENANT_COLUMNS} FROM tenants");
        let senders =
            format!("SELECT {SENDER_COLUMNS} FROM sender_identities ORDER BY tenant_id, id");
        let mut tx = self.pool.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .execute(&mut *tx)
            .await?;
        let rows = RegistryRows {
            plans: sqlx::query_as(sqlx::AssertSqlSafe(plans))
                .fetch_all(&mut *tx)
                .await?,
            tenants: sqlx::query_as(sqlx::AssertSqlSafe(tenants))
                .fetch_all(&mut *tx)
                .await?,
            keys: sqlx::query_as(KEYS).fetch_all(&mut *tx).await?,
            senders: sqlx::query_as(sqlx::AssertSqlSafe(senders))
                .fetch_all(&mut *tx)
                .await?,
        };
        tx.commit().await?;
        Ok(rows)
    }

    async fn write_plan(&self, plan: &Plan, source: PlanSource, now: i64) -> StoreResult<()> {
        // A configured plan does not replace one an admin changed; an
        // admin's always replaces.
        const UPSERT: &str = "INSERT INTO plans (name, lane, rate_per_second, burst, \
             daily_quota, max_in_flight, uploads_per_minute, upload_bytes_held, source, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) \
             ON CONFLICT(name) DO UPDATE SET lane = excluded.lane, rate_per_second = excluded.rate_per_second, \
             burst = excluded.burst, daily_quota = excluded.daily_quota, max_in_flight = excluded.max_in_flight, \
             uploads_per_minute = excluded.uploads_per_minute, upload_bytes_held = excluded.upload_bytes_held, \
             source = excluded.source, updated_at = excluded.updated_at \
             WHERE plans.source = 'config' OR excluded.source = 'admin'";
        sqlx::query(UPSERT)
            .bind(&plan.name)
            .bind(plan.lane.as_str())
            .bind(plan.rate_per_second)
            .bind(plan.burst as i64)
            .bind(plan.daily_quota as i64)
            .bind(plan.max_in_flight as i64)
            .bind(i64::from(plan.uploads_per_minute))
            .bind(plan.upload_bytes_held as i64)
            .bind(source.as_str())
            .bind(now)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn insert_tenant(&self, tenant: &TenantInsert<'_>) -> StoreResult<bool> {
        const INSERT: &str = "INSERT INTO tenants (id, name, plan, status, isolation, \
             max_concurrent_consumers, created_at, updated_at, retention_days) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $7, $8) ON CONFLICT (id) DO NOTHING";
        let inserted = sqlx::query(INSERT)
            .bind(tenant.id)
            .bind(tenant.name)
            .bind(tenant.plan)
            .bind(tenant.status.as_str())
            .bind(tenant.isolation.as_str())
            .bind(i64::from(tenant.max_concurrent_consumers))
            .bind(tenant.created_at)
            .bind(tenant.retention_days.map(i64::from))
            .execute(&self.pool)
            .await?
            .rows_affected();
        Ok(inserted == 1)
    }

    async fn update_tenant(
        &self,
        id: &str,
        change: &TenantUpdate<'_>,
        now: i64,
    ) -> StoreResult<Option<StoredTenant>> {
        let sql = format!(
            "UPDATE tenants SET plan = COALESCE($1, plan), status = COALESCE($2, status), \
             isolation = COALESCE($5, isolation), \
             max_concurrent_consumers = COALESCE($6, max_concurrent_consumers), \
             unsubscribe_default = COALESCE($7, unsubscribe_default), \
             unsubscribe_mailto = CASE WHEN CAST($8 AS TEXT) IS NULL THEN unsubscribe_mailto \
             WHEN CAST($8 AS TEXT) = '' THEN NULL ELSE CAST($8 AS TEXT) END, \
             retention_days = CASE WHEN CAST($9 AS BOOLEAN) THEN CAST($10 AS BIGINT) \
             ELSE retention_days END, \
             updated_at = $3 WHERE id = $4 RETURNING {TENANT_COLUMNS}"
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(change.plan)
            .bind(change.status.map(|s| s.as_str()))
            .bind(now)
            .bind(id)
            .bind(change.isolation.map(|i| i.as_str()))
            .bind(change.max_concurrent_consumers.map(i64::from))
            .bind(change.unsubscribe_default)
            .bind(change.unsubscribe_mailto)
            .bind(change.retention_days.is_some())
            .bind(change.retention_days.flatten().map(i64::from))
            .fetch_optional(&self.pool)
            .await?)
    }

    async fn delete_tenant(&self, id: &str) -> StoreResult<TenantDeletion> {
        const PENDING: &str = "SELECT COUNT(*) FROM messages WHERE tenant_id = $1 \
             AND status IN ('scheduled', 'queued', 'sending', 'retrying')";
        const ERASE: [&str; 16] = [
            "DELETE FROM api_keys WHERE tenant_id = $1",
            "DELETE FROM idempotency_keys WHERE tenant_id = $1",
            "DELETE FROM messages WHERE tenant_id = $1",
            "DELETE FROM recipient_statuses WHERE tenant_id = $1",
            // The newest event of all stays, as a blank line, as on SQLite
            // (a position past it must never see an older id again).
            "DELETE FROM message_events WHERE tenant_id = $1 \
             AND id < (SELECT MAX(id) FROM message_events)",
            "UPDATE message_events SET tenant_id = '', message_id = '', detail = NULL, \
             provider_message_id = NULL WHERE tenant_id = $1",
            "DELETE FROM webhook_deliveries WHERE tenant_id = $1",
            "DELETE FROM webhooks WHERE tenant_id = $1",
            "DELETE FROM suppressions WHERE tenant_id = $1",
            "DELETE FROM sender_identities WHERE tenant_id = $1",
            "DELETE FROM template_versions WHERE tenant_id = $1",
            "DELETE FROM templates WHERE tenant_id = $1",
            // Its files, chunks and all (ON DELETE CASCADE).
            "DELETE FROM attachments WHERE tenant_id = $1",
            "DELETE FROM usage WHERE tenant_id = $1",
            "DELETE FROM usage_deltas WHERE tenant_id = $1",
            // Every message is settled, so each one reached its lane: an
            // outbox row still here only waits to be forgotten, and it
            // holds the message's text.
            "DELETE FROM outbox WHERE tenant_id = $1",
        ];
        let mut tx = self.pool.begin().await?;
        let pending: i64 = sqlx::query_scalar(PENDING)
            .bind(id)
            .fetch_one(&mut *tx)
            .await?;
        if pending > 0 {
            return Ok(TenantDeletion::Undelivered(pending));
        }
        for statement in ERASE {
            sqlx::query(statement).bind(id).execute(&mut *tx).await?;
        }
        let removed = sqlx::query("DELETE FROM tenants WHERE id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(match removed {
            0 => TenantDeletion::NotFound,
            _ => TenantDeletion::Deleted,
        })
    }

    async fn insert_key(&self, key: &KeyInsert<'_>) -> StoreResult<()> {
        const INSERT: &str = "INSERT INTO api_keys (id, tenant_id, secret_hash, created_at, kind) \
             VALUES ($1, $2, $3, $4, $5)";
        sqlx::query(INSERT)
            .bind(key.id)
            .bind(key.tenant_id)
            .bind(key.secret_hash_hex)
            .bind(key.created_at)
            .bind(key.kind)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn revoke_key(&self, tenant_id: &str, key_id: &str, now: i64) -> StoreResult<u64> {
        const REVOKE: &str = "UPDATE api_keys SET revoked_at = $1 \
             WHERE id = $2 AND tenant_id = $3 AND revoked_at IS NULL";
        Ok(sqlx::query(REVOKE)
            .bind(now)
            .bind(key_id)
            .bind(tenant_id)
            .execute(&self.pool)
            .await?
            .rows_affected())
    }

    async fn keys_of(&self, tenant_id: &str) -> StoreResult<Vec<KeyListed>> {
        const KEYS: &str = "SELECT id, created_at, revoked_at, kind, last_used_at FROM api_keys \
             WHERE tenant_id = $1 ORDER BY created_at, id";
        Ok(sqlx::query_as(KEYS)
            .bind(tenant_id)
            .fetch_all(&self.pool)
            .await?)
    }

    async fn note_key_uses(&self, uses: &[(String, i64)]) -> StoreResult<()> {
        // One statement for the lot: the ids and times as two arrays.
        const NOTE: &str = "UPDATE api_keys AS k SET last_used_at = u.at \
             FROM UNNEST($1::text[], $2::bigint[]) AS u(id, at) \
             WHERE k.id = u.id AND (k.last_used_at IS NULL OR k.last_used_at < u.at)";
        let (ids, ats): (Vec<String>, Vec<i64>) = uses.iter().cloned().unzip();
        sqlx::query(NOTE)
            .bind(ids)
            .bind(ats)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn insert_sender(&self, row: &SenderRow) -> StoreResult<()> {
        const UNSET: &str = "UPDATE sender_identities SET is_default = FALSE \
             WHERE tenant_id = $1 AND channel = $2 AND is_default";
        const INSERT: &str = "INSERT INTO sender_identities (id, tenant_id, channel, sender, \
             display_name, reply_to, configuration_set, messaging_service_sid, is_default, \
             created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)";
        let mut tx = self.pool.begin().await?;
        if row.is_default {
            sqlx::query(UNSET)
                .bind(&row.tenant_id)
                .bind(&row.channel)
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query(INSERT)
            .bind(&row.id)
            .bind(&row.tenant_id)
            .bind(&row.channel)
            .bind(&row.sender)
            .bind(&row.display_name)
            .bind(&row.reply_to)
            .bind(&row.configuration_set)
            .bind(&row.messaging_service_sid)
            .bind(row.is_default)
            .bind(row.created_at)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn set_default_sender(
        &self,
        tenant_id: &str,
        id: &str,
        default: bool,
    ) -> StoreResult<bool> {
        const CHANNEL: &str =
            "SELECT channel FROM sender_identities WHERE tenant_id = $1 AND id = $2";
        const UNSET_OTHERS: &str = "UPDATE sender_identities SET is_default = FALSE \
             WHERE tenant_id = $1 AND channel = $2 AND is_default AND id <> $3";
        const SET: &str = "UPDATE sender_identities SET is_default = $1 WHERE id = $2";
        let mut tx = self.pool.begin().await?;
        let channel: Option<String> = sqlx::query_scalar(CHANNEL)
            .bind(tenant_id)
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(channel) = channel else {
            return Ok(false);
        };
        if default {
            sqlx::query(UNSET_OTHERS)
                .bind(tenant_id)
                .bind(&channel)
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query(SET)
            .bind(default)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn delete_sender(&self, tenant_id: &str, id: &str) -> StoreResult<bool> {
        const REMOVE: &str = "DELETE FROM sender_identities WHERE tenant_id = $1 AND id = $2";
        let removed = sqlx::query(REMOVE)
            .bind(tenant_id)
            .bind(id)
            .execute(&self.pool)
            .await?
            .rows_affected();
        Ok(removed > 0)
    }

    async fn senders_of(&self, tenant_id: &str) -> StoreResult<Vec<SenderRow>> {
        let sql = format!(
            "SELECT {SENDER_COLUMNS} FROM sender_identities WHERE tenant_id = $1 ORDER BY id"
        );
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(tenant_id)
            .fetch_all(&self.pool)
            .await?)
    }

    async fn announce_registry(&self, what: &str) -> StoreResult<()> {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(REGISTRY_CHANNEL)
            .bind(what)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn listen_registry(&self) -> StoreResult<RegistryListener> {
        Ok(RegistryListener(self.listen(REGISTRY_CHANNEL).await?))
    }
}
