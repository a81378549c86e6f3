//! The messages operations on sqlite.

#[async_trait::async_trait]
impl crate::store::messages::MessageStore for super::SqliteDb {}
