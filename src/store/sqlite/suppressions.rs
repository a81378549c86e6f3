//! The suppressions operations on sqlite.

#[async_trait::async_trait]
impl crate::store::suppressions::SuppressionStore for super::SqliteDb {}
