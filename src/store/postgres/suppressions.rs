//! The suppressions operations on postgres.

#[async_trait::async_trait]
impl crate::store::suppressions::SuppressionStore for super::PgDb {}
