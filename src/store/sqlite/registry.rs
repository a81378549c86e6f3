//! The registry's rows on SQLite: plans, tenants, API keys and sender
//! identities. One instance owns the file, so nothing is announced.

use crate::store::StoreResult;
use async_trait::async_trait;
use rusqlite::OptionalExtension;

use super::{SqliteDb, args, prepare, tuple};
use crate::model::Plan;
use crate::store::registry::{
    KeyInsert, KeyListed, PLAN_COLUMNS, PlanRow, PlanSource, RegistryListener, RegistryRows,
    RegistryStore, SENDER_COLUMNS, SenderRow, StoredTenant, TENANT_COLUMNS, TenantDeletion,
    TenantInsert, TenantUpdate,
};

const ACTIVE_KEYS: &str =
    "SELECT id, tenant_id, secret_hash, kind FROM api_keys WHERE revoked_at IS NULL";

/// A [`PlanRow`] from a row of [`PLAN_COLUMNS`].
fn plan_row(row: &rusqlite::Row) -> rusqlite::Result<PlanRow> {
    Ok(PlanRow {
        name: row.get(0)?,
        lane: row.get(1)?,
        rate_per_second: row.get(2)?,
        burst: row.get(3)?,
        daily_quota: row.get(4)?,
        max_in_flight: row.get(5)?,
        uploads_per_minute: row.get(6)?,
        upload_bytes_held: row.get(7)?,
    })
}

/// A [`StoredTenant`] from a row of [`TENANT_COLUMNS`].
fn tenant_row(row: &rusqlite::Row) -> rusqlite::Result<StoredTenant> {
    Ok(StoredTenant {
        id: row.get(0)?,
        name: row.get(1)?,
        plan: row.get(2)?,
        status: row.get(3)?,
        isolation: row.get(4)?,
        max_concurrent_consumers: row.get(5)?,
        unsubscribe_default: row.get(6)?,
        unsubscribe_mailto: row.get(7)?,
        retention_days: row.get(8)?,
        created_at: row.get(9)?,
        updated_at: row.get(10)?,
    })
}

/// A [`SenderRow`] from a row of [`SENDER_COLUMNS`].
fn sender_row(row: &rusqlite::Row) -> rusqlite::Result<SenderRow> {
    Ok(SenderRow {
        id: row.get(0)?,
        tenant_id: row.get(1)?,
        channel: row.get(2)?,
        sender: row.get(3)?,
        display_name: row.get(4)?,
        reply_to: row.get(5)?,
        configuration_set: row.get(6)?,
        messaging_service_sid: row.get(7)?,
        is_default: row.get(8)?,
        created_at: row.get(9)?,
    })
}

#[async_trait]
impl RegistryStore for SqliteDb {
    fn changed_elsewhere(&self) -> bool {
        false
    }

    async fn read_registry(&self) -> StoreResult<RegistryRows> {
        let plans = format!("SELECT {PLAN_COLUMNS} FROM plans");
        let tenants = format!("SELECT {TENANT_COLUMNS} FROM tenants");
        let senders =
            format!("SELECT {SENDER_COLUMNS} FROM sender_identities ORDER BY tenant_id, id");
        Ok(self
            .read(move |conn| {
                let snapshot = conn.unchecked_transaction()?;
                let all = |sql: &str| prepare(&snapshot, sql);
                let rows = RegistryRows {
                    plans: all(&plans)?
                        .query_map([], plan_row)?
                        .collect::<Result<_, _>>()?,
                    tenants: all(&tenants)?
                        .query_map([], tenant_row)?
                        .collect::<Result<_, _>>()?,
                    keys: all(ACTIVE_KEYS)?
                        .query_map([], tuple)?
                        .collect::<Result<_, _>>()?,
                    senders: all(&senders)?
                        .query_map([], sender_row)?
                        .collect::<Result<_, _>>()?,
                };
                snapshot.finish()?;
                Ok(rows)
            })
            .await?)
    }

    async fn write_plan(&self, plan: &Plan, source: PlanSource, now: i64) -> StoreResult<()> {
        // A configured plan does not replace one an admin changed; an
        // admin's always replaces.
        const UPSERT: &str = "INSERT INTO plans (name, lane, rate_per_second, burst, \
             daily_quota, max_in_flight, uploads_per_minute, upload_bytes_held, source, updated_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10) \
             ON CONFLICT(name) DO UPDATE SET lane = excluded.lane, rate_per_second = excluded.rate_per_second, \
             burst = excluded.burst, daily_quota = excluded.daily_quota, max_in_flight = excluded.max_in_flight, \
             uploads_per_minute = excluded.uploads_per_minute, upload_bytes_held = excluded.upload_bytes_held, \
             source = excluded.source, updated_at = excluded.updated_at \
             WHERE plans.source = 'config' OR excluded.source = 'admin'";
        let args = args![
            plan.name.clone(),
            plan.lane.as_str().to_owned(),
            plan.rate_per_second,
            plan.burst as i64,
            plan.daily_quota as i64,
            plan.max_in_flight as i64,
            i64::from(plan.uploads_per_minute),
            plan.upload_bytes_held as i64,
            source.as_str().to_owned(),
            now
        ];
        self.execute(UPSERT, args).await?;
        Ok(())
    }

    async fn insert_tenant(&self, tenant: &TenantInsert<'_>) -> StoreResult<bool> {
        const INSERT: &str = "INSERT INTO tenants (id, name, plan, status, isolation, \
             max_concurrent_consumers, created_at, updated_at, retention_days) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, ?8) ON CONFLICT (id) DO NOTHING";
        let args = args![
            tenant.id.to_owned(),
            tenant.name.to_owned(),
            tenant.plan.to_owned(),
            tenant.status.as_str().to_owned(),
            tenant.isolation.as_str().to_owned(),
            i64::from(tenant.max_concurrent_consumers),
            tenant.created_at,
            tenant.retention_days.map(i64::from)
        ];
        Ok(self.execute(INSERT, args).await? == 1)
    }

    async fn update_tenant(
        &self,
        id: &str,
        change: &TenantUpdate<'_>,
        now: i64,
    ) -> StoreResult<Option<StoredTenant>> {
        let sql = format!(
            "UPDATE tenants SET plan = COALESCE(?1, plan), status = COALESCE(?2, status), \
             isolation = COALESCE(?5, isolation), \
             max_concurrent_consumers = COALESCE(?6, max_concurrent_consumers), \
             unsubscribe_default = COALESCE(?7, unsubscribe_default), \
             unsubscribe_mailto = CASE WHEN ?8 IS NULL THEN unsubscribe_mailto \
             WHEN ?8 = '' THEN NULL ELSE ?8 END, \
             retention_days = CASE WHEN ?9 THEN ?10 ELSE retention_days END, \
             updated_at = ?3 WHERE id = ?4 RETURNING {TENANT_COLUMNS}"
        );
        let args = args![
            change.plan.map(str::to_owned),
            change.status.map(|s| s.as_str().to_owned()),
            now,
            id.to_owned(),
            change.isolation.map(|i| i.as_str().to_owned()),
            change.max_concurrent_consumers.map(i64::from),
            change.unsubscribe_default,
            change.unsubscribe_mailto.map(str::to_owned),
            change.retention_days.is_some(),
            change.retention_days.flatten().map(i64::from)
        ];
        Ok(self
            .transact(move |tx| {
                Ok(prepare(tx, &sql)?
                    .query_row(rusqlite::params_from_iter(args), tenant_row)
                    .optional()?)
            })
            .await?)
    }

    async fn delete_tenant(&self, id: &str) -> StoreResult<TenantDeletion> {
        const PENDING: &str = "SELECT COUNT(*) FROM messages WHERE tenant_id = ?1 \
             AND status IN ('scheduled', 'queued', 'sending', 'retrying')";
        const ERASE: [&str; 15] = [
            "DELETE FROM api_keys WHERE tenant_id = ?1",
            "DELETE FROM idempotency_keys WHERE tenant_id = ?1",
            "DELETE FROM messages WHERE tenant_id = ?1",
            "DELETE FROM recipient_statuses WHERE tenant_id = ?1",
            // The newest event of all stays, as a blank line: SQLite gives
            // a new row the highest id plus one, and an id used again would
            // sit behind webhook positions already past it.
            "DELETE FROM message_events WHERE tenant_id = ?1 \
             AND id < (SELECT MAX(id) FROM message_events)",
            "UPDATE message_events SET tenant_id = '', message_id = '', detail = NULL, \
             provider_message_id = NULL WHERE tenant_id = ?1",
            "DELETE FROM webhook_deliveries WHERE tenant_id = ?1",
            "DELETE FROM webhooks WHERE tenant_id = ?1",
            "DELETE FROM suppressions WHERE tenant_id = ?1",
            "DELETE FROM sender_identities WHERE tenant_id = ?1",
            "DELETE FROM template_versions WHERE tenant_id = ?1",
            "DELETE FROM templates WHERE tenant_id = ?1",
            // Its files, chunks and all (ON DELETE CASCADE).
            "DELETE FROM attachments WHERE tenant_id = ?1",
            "DELETE FROM usage WHERE tenant_id = ?1",
            // Every message is settled, so each one reached its lane: an
            // outbox row still here only waits to be forgotten, and it
            // holds the message's text.
            "DELETE FROM outbox WHERE tenant_id = ?1",
        ];
        let id = id.to_owned();
        Ok(self
            .transact(move |tx| {
                let pending: i64 = tx.query_row(PENDING, [&id], |row| row.get(0))?;
                if pending > 0 {
                    return Ok(TenantDeletion::Undelivered(pending));
                }
                for statement in ERASE {
                    tx.execute(statement, [&id])?;
                }
                Ok(
                    match tx.execute("DELETE FROM tenants WHERE id = ?1", [&id])? {
                        0 => TenantDeletion::NotFound,
                        _ => TenantDeletion::Deleted,
                    },
                )
            })
            .await?)
    }

    async fn insert_key(&self, key: &KeyInsert<'_>) -> StoreResult<()> {
        const INSERT: &str = "INSERT INTO api_keys (id, tenant_id, secret_hash, created_at, kind) \
             VALUES (?1, ?2, ?3, ?4, ?5)";
        let args = args![
            key.id.to_owned(),
            key.tenant_id.to_owned(),
            key.secret_hash_hex.to_owned(),
            key.created_at,
            key.kind.to_owned()
        ];
        self.execute(INSERT, args).await?;
        Ok(())
    }

    async fn revoke_key(&self, tenant_id: &str, key_id: &str, now: i64) -> StoreResult<u64> {
        const REVOKE: &str = "UPDATE api_keys SET revoked_at = ?1 \
             WHERE id = ?2 AND tenant_id = ?3 AND revoked_at IS NULL";
        let args = args![now, key_id.to_owned(), tenant_id.to_owned()];
        Ok(self.execute(REVOKE, args).await? as u64)
    }

    async fn keys_of(&self, tenant_id: &str) -> StoreResult<Vec<KeyListed>> {
        const KEYS: &str = "SELECT id, created_at, revoked_at, kind, last_used_at FROM api_keys \
             WHERE tenant_id = ?1 ORDER BY created_at, id";
        Ok(self.rows(KEYS, args![tenant_id.to_owned()], tuple).await?)
    }

    async fn note_key_uses(&self, uses: &[(String, i64)]) -> StoreResult<()> {
        const NOTE: &str = "UPDATE api_keys SET last_used_at = ?1 \
             WHERE id = ?2 AND (last_used_at IS NULL OR last_used_at < ?1)";
        let uses = uses.to_vec();
        self.transact(move |tx| {
            for (id, at) in &uses {
                tx.execute(NOTE, rusqlite::params![at, id])?;
            }
            Ok(())
        })
        .await?;
        Ok(())
    }

    async fn insert_sender(&self, row: &SenderRow) -> StoreResult<()> {
        const UNSET: &str = "UPDATE sender_identities SET is_default = FALSE \
             WHERE tenant_id = ?1 AND channel = ?2 AND is_default";
        const INSERT: &str = "INSERT INTO sender_identities (id, tenant_id, channel, sender, \
             display_name, reply_to, configuration_set, messaging_service_sid, is_default, \
             created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)";
        let row = row.clone();
        Ok(self
            .transact(move |tx| {
                if row.is_default {
                    tx.execute(UNSET, rusqlite::params![row.tenant_id, row.channel])?;
                }
                tx.execute(
                    INSERT,
                    rusqlite::params![
                        row.id,
                        row.tenant_id,
                        row.channel,
                        row.sender,
                        row.display_name,
                        row.reply_to,
                        row.configuration_set,
                        row.messaging_service_sid,
                        row.is_default,
                        row.created_at
                    ],
                )?;
                Ok(())
            })
            .await?)
    }

    async fn set_default_sender(
        &self,
        tenant_id: &str,
        id: &str,
        default: bool,
    ) -> StoreResult<bool> {
        const CHANNEL: &str =
            "SELECT channel FROM sender_identities WHERE tenant_id = ?1 AND id = ?2";
        const UNSET_OTHERS: &str = "UPDATE sender_identities SET is_default = FALSE \
             WHERE tenant_id = ?1 AND channel = ?2 AND is_default AND id <> ?3";
        const SET: &str = "UPDATE sender_identities SET is_default = ?1 WHERE id = ?2";
        let (tenant_id, id) = (tenant_id.to_owned(), id.to_owned());
        Ok(self
            .transact(move |tx| {
                let channel: Option<String> = tx
                    .query_row(CHANNEL, [&tenant_id, &id], |row| row.get(0))
                    .optional()?;
                let Some(channel) = channel else {
                    return Ok(false);
                };
                if default {
                    tx.execute(UNSET_OTHERS, [&tenant_id, &channel, &id])?;
                }
                tx.execute(SET, rusqlite::params![default, id])?;
                Ok(true)
            })
            .await?)
    }

    async fn delete_sender(&self, tenant_id: &str, id: &str) -> StoreResult<bool> {
        const REMOVE: &str = "DELETE FROM sender_identities WHERE tenant_id = ?1 AND id = ?2";
        let args = args![tenant_id.to_owned(), id.to_owned()];
        Ok(self.execute(REMOVE, args).await? > 0)
    }

    async fn senders_of(&self, tenant_id: &str) -> StoreResult<Vec<SenderRow>> {
        let sql = format!(
            "SELECT {SENDER_COLUMNS} FROM sender_identities WHERE tenant_id = ?1 ORDER BY id"
        );
        Ok(self
            .rows(sql, args![tenant_id.to_owned()], sender_row)
            .await?)
    }

    async fn announce_registry(&self, _what: &str) -> StoreResult<()> {
        Ok(())
    }

    async fn listen_registry(&self) -> StoreResult<RegistryListener> {
        Err(anyhow::anyhow!("a SQLite store has no other instances to hear from").into())
    }
}
