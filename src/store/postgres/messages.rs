//! The messages operations on postgres.

#[async_trait::async_trait]
impl crate::store::messages::MessageStore for super::PgDb {}
