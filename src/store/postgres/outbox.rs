//! The outbox operations on postgres.

#[async_trait::async_trait]
impl crate::store::outbox::OutboxStore for super::PgDb {}
