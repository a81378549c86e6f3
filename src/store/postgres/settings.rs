//! The `settings` table on PostgreSQL.

use crate::store::StoreResult;
use async_trait::async_trait;

use super::PgDb;
use crate::store::settings::SettingsStore;

#[async_trait]
impl SettingsStore for PgDb {
    async fn setting(&self, key: &str) -> StoreResult<Option<String>> {
        Ok(
            sqlx::query_scalar("SELECT value FROM settings WHERE key = $1")
                .bind(key)
                .fetch_optional(&self.pool)
                .await?,
        )
    }

    async fn set_setting(&self, key: &str, value: &str) -> StoreResult<()> {
        const WRITE: &str = "INSERT INTO settings(key, value) VALUES ($1, $2) \
             ON CONFLICT(key) DO UPDATE SET value = excluded.value";
        sqlx::query(WRITE)
            .bind(key)
            .bind(value)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn setting_or_insert(&self, key: &str, value: &str) -> StoreResult<String> {
        const KEEP: &str = "INSERT INTO settings(key, value) VALUES ($1, $2) \
             ON CONFLICT(key) DO NOTHING";
        sqlx::query(KEEP)
            .bind(key)
            .bind(value)
            .execute(&self.pool)
            .await?;
        Ok(self
            .setting(key)
            .await?
            .ok_or_else(|| anyhow::anyhow!("setting {key} vanished after it was written"))?)
    }

    async fn refresh_statistics(&self) -> StoreResult<()> {
        Ok(())
    }
}
