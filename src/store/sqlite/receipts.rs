//! The receipts operations on sqlite.

#[async_trait::async_trait]
impl crate::store::receipts::ReceiptStore for super::SqliteDb {}
