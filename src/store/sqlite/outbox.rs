//! The outbox operations on sqlite.

#[async_trait::async_trait]
impl crate::store::outbox::OutboxStore for super::SqliteDb {}
