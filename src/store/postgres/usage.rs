//! The usage operations on postgres.

#[async_trait::async_trait]
impl crate::store::usage::UsageStore for super::PgDb {}
