//! The suppression lists on SQLite.

use crate::store::StoreResult;
use async_trait::async_trait;

use super::{SqliteDb, args};
use crate::model::{Channel, now_ms};
use crate::store::suppressions::{Suppression, SuppressionStore};

/// Adds an address (normalised) unless it is already listed, in the
/// caller's transaction; the first reason stays. Parameters: tenant,
/// address, channel, reason, detail, message id, when.
pub(crate) const INSERT: &str = "INSERT INTO suppressions (tenant_id, address, channel, reason, \
     detail, message_id, created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) \
     ON CONFLICT (tenant_id, address) DO NOTHING";

const COLUMNS: &str = "address, channel, reason, detail, message_id, created_at";

/// A [`Suppression`] from a row of [`COLUMNS`].
fn suppression_row(row: &rusqlite::Row) -> rusqlite::Result<Suppression> {
    Ok(Suppression {
        address: row.get(0)?,
        channel: row.get(1)?,
        reason: row.get(2)?,
        detail: row.get(3)?,
        message_id: row.get(4)?,
        created_at: String::new(),
        created_ms: row.get(5)?,
    })
}

#[async_trait]
impl SuppressionStore for SqliteDb {
    async fn unsubscribe(
        &self,
        tenant_id: &str,
        channel: Channel,
        address: &str,
        message_id: &str,
        now: i64,
    ) -> StoreResult<bool> {
        let (tenant_id, address, message_id) = (
            tenant_id.to_owned(),
            address.to_owned(),
            message_id.to_owned(),
        );
        Ok(self
            .transact(move |tx| {
                let added = tx.prepare_cached(INSERT)?.execute(rusqlite::params![
                    tenant_id,
                    address,
                    channel.as_str(),
                    "unsubscribe",
                    None::<String>,
                    message_id,
                    now
                ])? > 0;
                if added {
                    super::lifecycle::note(tx, &message_id, &tenant_id, "unsubscribed", now)?;
                }
                Ok(added)
            })
            .await?)
    }

    async fn add_suppression(
        &self,
        tenant_id: &str,
        channel: Channel,
        address: &str,
        detail: Option<&str>,
    ) -> StoreResult<bool> {
        let args = args![
            tenant_id.to_owned(),
            address.to_owned(),
            channel.as_str().to_owned(),
            "manual".to_owned(),
            detail.map(str::to_owned),
            None::<String>,
            now_ms()
        ];
        Ok(self.execute(INSERT, args).await? == 1)
    }

    async fn suppression(
        &self,
        tenant_id: &str,
        address: &str,
    ) -> StoreResult<Option<Suppression>> {
        let sql =
            format!("SELECT {COLUMNS} FROM suppressions WHERE tenant_id = ?1 AND address = ?2");
        let args = args![tenant_id.to_owned(), address.to_owned()];
        let row = self.row(sql, args, suppression_row).await?;
        Ok(row.map(Suppression::dated))
    }

    async fn is_suppressed(&self, tenant_id: &str, address: &str) -> StoreResult<bool> {
        const LISTED: &str = "SELECT 1 FROM suppressions WHERE tenant_id = ?1 AND address = ?2";
        let args = args![tenant_id.to_owned(), address.to_owned()];
        Ok(self.row(LISTED, args, |_| Ok(())).await?.is_some())
    }

    async fn suppressions_of(
        &self,
        tenant_id: &str,
        after: Option<&str>,
        limit: i64,
    ) -> StoreResult<Vec<Suppression>> {
        let sql = format!(
            "SELECT {COLUMNS} FROM suppressions \
             WHERE tenant_id = ?1 AND address > ?2 ORDER BY address LIMIT ?3"
        );
        let args = args![tenant_id.to_owned(), after.unwrap_or("").to_owned(), limit];
        let rows = self.rows(sql, args, suppression_row).await?;
        Ok(rows.into_iter().map(Suppression::dated).collect())
    }

    async fn remove_suppression(&self, tenant_id: &str, address: &str) -> StoreResult<bool> {
        const REMOVE: &str = "DELETE FROM suppressions WHERE tenant_id = ?1 AND address = ?2";
        let args = args![tenant_id.to_owned(), address.to_owned()];
        Ok(self.execute(REMOVE, args).await? == 1)
    }
}
