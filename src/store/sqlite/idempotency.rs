//! The idempotency operations on sqlite.

#[async_trait::async_trait]
impl crate::store::idempotency::IdempotencyStore for super::SqliteDb {}
