//! The retention operations on sqlite.

#[async_trait::async_trait]
impl crate::store::retention::RetentionStore for super::SqliteDb {}
