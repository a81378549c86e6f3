//! The `settings` table on SQLite.

use crate::store::StoreResult;
use async_trait::async_trait;

use super::{SqliteDb, args, tuple};
use crate::store::settings::SettingsStore;

#[async_trait]
impl SettingsStore for SqliteDb {
    async fn setting(&self, key: &str) -> StoreResult<Option<String>> {
        const READ: &str = "SELECT value FROM settings WHERE key = ?1";
        Ok(self
            .row(READ, args![key.to_owned()], tuple)
            .await?
            .map(|(value,)| value))
    }

    async fn set_setting(&self, key: &str, value: &str) -> StoreResult<()> {
        const WRITE: &str = "INSERT INTO settings(key, value) VALUES (?1, ?2) \
             ON CONFLICT(key) DO UPDATE SET value = excluded.value";
        self.execute(WRITE, args![key.to_owned(), value.to_owned()])
            .await?;
        Ok(())
    }

    async fn setting_or_insert(&self, key: &str, value: &str) -> StoreResult<String> {
        const KEEP: &str = "INSERT INTO settings(key, value) VALUES (?1, ?2) \
             ON CONFLICT(key) DO NOTHING";
        self.execute(KEEP, args![key.to_owned(), value.to_owned()])
            .await?;
        Ok(self
            .setting(key)
            .await?
            .ok_or_else(|| anyhow::anyhow!("setting {key} vanished after it was written"))?)
    }

    async fn refresh_statistics(&self) -> StoreResult<()> {
        Ok(SqliteDb::refresh_statistics(self).await?)
    }
}
