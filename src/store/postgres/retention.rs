//! The retention operations on postgres.

#[async_trait::async_trait]
impl crate::store::retention::RetentionStore for super::PgDb {}
