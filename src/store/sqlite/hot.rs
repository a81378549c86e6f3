//! The hot statements of the SQLite store, as pieces of work for its one
//! writer ([`StoreWriter`]): accepts (status rows, queue entries or outbox
//! rows, idempotency records), claims, the `sending` and `sent` changes,
//! failures and cancels. They ride in the same groups as the embedded
//! queue's receives and deletes instead of taking transactions of their
//! own; each answers only once its group has committed.

use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use rusqlite::{OptionalExtension, Transaction};
use tokio::sync::oneshot;

use super::lifecycle;
use super::webhooks as sqlite_webhooks;
use super::writer::{StoreWriter, Work, WriteFailed};
use crate::model::now_ms;
use crate::store::delivery::{BeforeSend, Called, CallsRecord, PassRooms, SendCheck, TakenCalls};
use crate::store::hot::HotPath;
use crate::store::idempotency::StoredResponse;
use crate::store::lifecycle::{Failure, Move};
use crate::store::receipts::{Applied, Receipt};
use crate::store::staging::{AcceptEntry, AfterCommit, Staging};
use crate::store::streak::FailureStreak;
use crate::store::webhooks;

/// The SQLite engine's hot path: its writer thread, and where accepts
/// stage their queue entries (the outbox until told otherwise).
pub(crate) struct SqliteHot {
    writer: StoreWriter,
    staging: OnceLock<Arc<Staging>>,
    outbox: Arc<Staging>,
}

impl SqliteHot {
    pub(crate) fn new(writer: StoreWriter) -> SqliteHot {
        SqliteHot {
            writer,
            staging: OnceLock::new(),
            outbox: Arc::new(Staging::Outbox),
        }
    }

    fn staging(&self) -> &Arc<Staging> {
        self.staging.get().unwrap_or(&self.outbox)
    }
}

#[async_trait]
impl HotPath for SqliteHot {
    fn stage_into(&self, staging: Staging) -> anyhow::Result<()> {
        if let Staging::Lanes = staging {
            anyhow::bail!(
                "queue.backend = \"postgres\" needs a PostgreSQL store (storage.url = \"postgres://…\")"
            );
        }
        self.staging
            .set(Arc::new(staging))
            .map_err(|_| anyhow::anyhow!("the store writer's staging is set once"))
    }

    async fn accept_all(&self, entries: Vec<AcceptEntry>) -> bool {
        accept(&self.writer, self.staging(), entries).await
    }

    async fn cancel(
        &self,
        tenant_id: &str,
        test: Option<bool>,
        ids: Vec<String>,
    ) -> anyhow::Result<Vec<String>> {
        cancel(&self.writer, tenant_id.to_owned(), test, ids).await
    }

    async fn claim(&self, id: &str, stale_before: i64) -> anyhow::Result<bool> {
        claim(&self.writer, id, stale_before).await
    }

    async fn before_send(&self, checks: Vec<SendCheck>) -> anyhow::Result<Vec<BeforeSend>> {
        before_send(&self.writer, checks).await
    }

    async fn take_pass(
        &self,
        rooms: PassRooms,
        now: i64,
        lease_until: i64,
    ) -> anyhow::Result<Vec<TakenCalls>> {
        let taken = sqlite_webhooks::take_pass(&self.writer, rooms, now, lease_until).await?;
        taken
            .into_iter()
            .map(|take| {
                let data = take
                    .rows
                    .into_iter()
                    .map(|(event, row)| Ok((event, webhooks::record_at_event(row)?)))
                    .collect::<anyhow::Result<_>>()?;
                Ok(TakenCalls {
                    tenant: take.tenant,
                    room: take.room,
                    wanted: take.wanted,
                    calls: take.calls,
                    data,
                    webhook: take.webhook,
                    stream: take.stream,
                })
            })
            .collect()
    }

    async fn record_calls(&self, record: CallsRecord) -> anyhow::Result<()> {
        sqlite_webhooks::record_calls(&self.writer, record).await
    }

    async fn apply_receipt(&self, receipt: &Receipt) -> anyhow::Result<Applied> {
        let receipt = receipt.clone();
        let now = now_ms();
        self.writer
            .run(move |tx| super::receipts::apply_in(tx, &receipt, now))
            .await
    }

    async fn sent(
        &self,
        id: &str,
        provider_message_id: &str,
        provider: Option<&str>,
        gate_wait_ms: Option<i64>,
    ) -> anyhow::Result<()> {
        sent(
            &self.writer,
            id,
            provider_message_id,
            provider,
            gate_wait_ms,
        )
        .await
    }

    async fn failure(
        &self,
        id: &str,
        step: Move,
        error: &str,
        counted: bool,
        called: Option<Called<'_>>,
    ) -> anyhow::Result<u32> {
        failure(&self.writer, id, step, error, counted, called).await
    }

    fn failures(&self) -> &FailureStreak {
        self.writer.failures()
    }

    async fn probe(&self) -> anyhow::Result<()> {
        self.writer.probe().await
    }

    async fn stop(&self) {
        self.writer.stop().await
    }

    fn sqlite_writer(&self) -> Option<&StoreWriter> {
        Some(&self.writer)
    }
}

/// Makes `entries` durable in one transaction, all or none; true once
/// committed.
async fn accept(writer: &StoreWriter, staging: &Arc<Staging>, entries: Vec<AcceptEntry>) -> bool {
    let (reply, answer) = oneshot::channel();
    writer
        .submit(Box::new(AcceptWork {
            entries,
            staging: staging.clone(),
            after_commit: None,
            reply: Some(reply),
        }))
        .await;
    matches!(answer.await, Ok(true))
}

/// Accepted messages: their status rows, queue entries (or outbox rows)
/// and idempotency records, all or nothing.
struct AcceptWork {
    entries: Vec<AcceptEntry>,
    staging: Arc<Staging>,
    /// What the queue does once its rows are committed.
    after_commit: Option<AfterCommit>,
    reply: Option<oneshot::Sender<bool>>,
}

impl Work for AcceptWork {
    fn accepted(&self) -> &[AcceptEntry] {
        &self.entries
    }

    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        self.after_commit = None;
        let now = now_ms();
        for entry in &self.entries {
            lifecycle::accept(tx, &[&entry.record])?;
            if let Staging::Outbox = self.staging.as_ref() {
                super::outbox::insert_rows(
                    tx,
                    &[(entry.lane, &entry.outbound, entry.record.send_at)],
                    now,
                )?;
            }
            let remembered: Vec<&StoredResponse> = entry.idempotency.iter().collect();
            super::idempotency::insert_rows(tx, &remembered)?;
        }
        if let Staging::Queue(queue) = self.staging.as_ref() {
            let rows: Vec<_> = self
                .entries
                .iter()
                .map(|entry| (entry.lane, &entry.outbound))
                .collect();
            self.after_commit = Some(queue.insert(tx, &rows)?);
        }
        Ok(())
    }

    fn rolled_back(&mut self) {
        self.after_commit = None;
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if outcome.is_ok()
            && let Some(after_commit) = self.after_commit.take()
        {
            after_commit();
        }
        if let Some(reply) = self.reply.take()
            && reply.send(outcome.is_ok()).is_err()
        {
            let first = self.entries.first().map(|entry| entry.record.id.as_str());
            tracing::warn!(
                message_id = first.unwrap_or(""),
                count = self.entries.len(),
                "Caller went away before its messages were committed."
            );
        }
    }
}

/// See [`crate::store::Writer::cancel`].
async fn cancel(
    writer: &StoreWriter,
    tenant_id: String,
    test: Option<bool>,
    ids: Vec<String>,
) -> anyhow::Result<Vec<String>> {
    writer
        .run(move |tx| {
            let mut forget = tx.prepare_cached("DELETE FROM outbox WHERE message_id = ?1")?;
            let mut cancelled = Vec::new();
            let now = now_ms();
            for id in &ids {
                if lifecycle::cancel(tx, id, Some(&tenant_id), test, now)? {
                    forget.execute([id])?;
                    cancelled.push(id.clone());
                }
            }
            Ok(cancelled)
        })
        .await
}

/// See [`crate::store::Writer::claim`].
async fn claim(writer: &StoreWriter, id: &str, stale_before: i64) -> anyhow::Result<bool> {
    let id = id.to_owned();
    writer
        .run(move |tx| Ok(lifecycle::claim(tx, &id, now_ms(), stale_before)?))
        .await
}

/// See [`crate::store::Writer::before_send`]: read by the writer's
/// connection ahead of its next group, which costs a few microseconds
/// against a pool round trip's tens.
async fn before_send(
    writer: &StoreWriter,
    checks: Vec<SendCheck>,
) -> anyhow::Result<Vec<BeforeSend>> {
    writer
        .read(move |tx| {
            let mut status = tx.prepare_cached("SELECT status FROM messages WHERE id = ?1")?;
            let mut suppressed = tx.prepare_cached(
                "SELECT EXISTS (SELECT 1 FROM suppressions WHERE tenant_id = ?1 AND address = ?2)",
            )?;
            let mut found = Vec::with_capacity(checks.len());
            for check in &checks {
                let word: Option<String> =
                    status.query_row([&check.id], |row| row.get(0)).optional()?;
                let on_list = match &check.address {
                    Some(address) => suppressed
                        .query_row(rusqlite::params![check.tenant_id, address], |row| {
                            row.get(0)
                        })?,
                    None => false,
                };
                found.push(BeforeSend {
                    status: word.and_then(|word| word.parse().ok()),
                    suppressed: on_list,
                });
            }
            Ok(found)
        })
        .await
}

/// See [`crate::store::Writer::sent_by`].
async fn sent(
    writer: &StoreWriter,
    id: &str,
    provider_message_id: &str,
    provider: Option<&str>,
    gate_wait_ms: Option<i64>,
) -> anyhow::Result<()> {
    let (done, committed) = oneshot::channel();
    writer
        .submit(Box::new(Sent {
            id: id.to_owned(),
            provider_message_id: provider_message_id.to_owned(),
            provider: provider.map(str::to_owned),
            gate_wait_ms,
            done: Some(done),
        }))
        .await;
    match committed.await {
        Ok(true) => Ok(()),
        _ => anyhow::bail!("status change could not be committed"),
    }
}

/// See [`crate::store::Writer::failure`].
async fn failure(
    writer: &StoreWriter,
    id: &str,
    step: Move,
    error: &str,
    counted: bool,
    called: Option<Called<'_>>,
) -> anyhow::Result<u32> {
    let (id, error) = (id.to_owned(), error.to_owned());
    let provider = called.map(|called| called.provider.to_owned());
    let pinned = called.map(|called| called.pinned);
    writer
        .run(move |tx| {
            let failure = Failure {
                step,
                error: Some(&error),
                counted,
                provider: provider.as_deref(),
                pinned,
            };
            let attempts = lifecycle::fail(tx, &id, &failure, now_ms())?;
            Ok(attempts.unwrap_or(0).max(0) as u32)
        })
        .await
}

struct Sent {
    id: String,
    provider_message_id: String,
    provider: Option<String>,
    gate_wait_ms: Option<i64>,
    done: Option<oneshot::Sender<bool>>,
}

impl Work for Sent {
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        Ok(lifecycle::sent(
            tx,
            &self.id,
            &self.provider_message_id,
            self.provider.as_deref(),
            self.gate_wait_ms,
            now_ms(),
        )?)
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if let Some(done) = self.done.take() {
            let _ = done.send(outcome.is_ok());
        }
    }
}
