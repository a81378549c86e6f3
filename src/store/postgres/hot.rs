//! The PostgreSQL engine's hot path: [`PgWriter`] as the store's
//! [`HotPath`], each piece handed to its group-committing task (or, for
//! the rare cancel and the reads before a send, to the pool beside it).

use async_trait::async_trait;

use super::PgWriter;
use crate::store::delivery::{BeforeSend, Called, CallsRecord, PassRooms, SendCheck, TakenCalls};
use crate::store::hot::HotPath;
use crate::store::lifecycle::Move;
use crate::store::receipts::{Applied, Receipt};
use crate::store::staging::{AcceptEntry, Staging};
use crate::store::streak::FailureStreak;

#[async_trait]
impl HotPath for PgWriter {
    fn stage_into(&self, staging: Staging) -> anyhow::Result<()> {
        match staging {
            Staging::Outbox => Ok(()),
            Staging::Lanes => {
                self.stage_into_lanes();
                Ok(())
            }
            Staging::Queue(_) => anyhow::bail!(
                "the embedded queue needs a SQLite store (storage.url = \"sqlite://…\")"
            ),
        }
    }

    async fn accept_all(&self, entries: Vec<AcceptEntry>) -> bool {
        PgWriter::accept(self, entries).await
    }

    async fn cancel(
        &self,
        tenant_id: &str,
        test: Option<bool>,
        ids: Vec<String>,
    ) -> anyhow::Result<Vec<String>> {
        PgWriter::cancel(self, tenant_id, test, &ids).await
    }

    async fn claim(&self, id: &str, stale_before: i64) -> anyhow::Result<bool> {
        PgWriter::claim(self, id, stale_before).await
    }

    async fn before_send(&self, checks: Vec<SendCheck>) -> anyhow::Result<Vec<BeforeSend>> {
        PgWriter::before_send(self, &checks).await
    }

    async fn take_pass(
        &self,
        rooms: PassRooms,
        now: i64,
        lease_until: i64,
    ) -> anyhow::Result<Vec<TakenCalls>> {
        PgWriter::take_pass(self, rooms, now, lease_until).await
    }

    async fn record_calls(&self, record: CallsRecord) -> anyhow::Result<()> {
        PgWriter::record_calls(self, &record).await
    }

    async fn apply_receipt(&self, receipt: &Receipt) -> anyhow::Result<Applied> {
        PgWriter::apply_receipt(self, receipt.clone()).await
    }

    async fn sent(
        &self,
        id: &str,
        provider_message_id: &str,
        provider: Option<&str>,
        gate_wait_ms: Option<i64>,
    ) -> anyhow::Result<()> {
        PgWriter::sent(self, id, provider_message_id, provider, gate_wait_ms).await
    }

    async fn failure(
        &self,
        id: &str,
        step: Move,
        error: &str,
        counted: bool,
        called: Option<Called<'_>>,
    ) -> anyhow::Result<u32> {
        PgWriter::failure(self, id, step, error, counted, called).await
    }

    fn failures(&self) -> &FailureStreak {
        PgWriter::failures(self)
    }

    async fn probe(&self) -> anyhow::Result<()> {
        PgWriter::probe(self).await
    }

    async fn stop(&self) {
        PgWriter::stop(self).await
    }
}
