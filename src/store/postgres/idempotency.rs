//! The idempotency operations on postgres.

#[async_trait::async_trait]
impl crate::store::idempotency::IdempotencyStore for super::PgDb {}
