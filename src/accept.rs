//! The accept path's durable write.
//!
//! A transaction per request would cap the accept rate at the number of
//! commits SQLite can make per second. Instead each accepted message is a
//! piece of work for the store's one writer ([`StoreWriter`]), which commits
//! everything waiting in one transaction (status rows, queue entries or
//! outbox rows, idempotency records, and the consumers' receives, deletes
//! and status changes beside them) and only then answers each request.
//! Under load, groups grow by themselves while a commit is running; when
//! idle, a lone request commits at once.

use std::sync::Arc;
use std::time::Duration;

use rusqlite::Transaction;
use tokio::sync::oneshot;

use crate::model::{Lane, now_ms};
use crate::queue::OutboundMessage;
use crate::queue::embedded::{EmbeddedQueue, Inserted};
use crate::store::idempotency::{self, StoredResponse};
use crate::store::messages::{self, MessageRecord};
use crate::store::postgres::PgWriter;
pub use crate::store::writer::FailureStreak;
use crate::store::writer::{StoreWriter, Work, WriteFailed};

/// One message to make durable.
#[derive(Debug, Clone)]
pub struct AcceptEntry {
    pub lane: Lane,
    pub record: MessageRecord,
    pub outbound: OutboundMessage,
    /// Answers to remember with it: its own `Idempotency-Key`'s, and a
    /// batch's (on one of the batch's entries).
    pub idempotency: Vec<StoredResponse>,
}

/// The write could not be made durable; retry after the given time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NotDurable {
    pub retry_after: Duration,
}

/// Where the queue entries of a group go.
pub enum Staging {
    /// Into the embedded queue, in the group's transaction.
    Embedded(Arc<EmbeddedQueue>),
    /// Into the outbox table, in the group's transaction; the request then
    /// sends to SQS through [`crate::outbox::Outbox`].
    Outbox,
}

/// Makes accepted messages durable through the store's writer.
pub enum AcceptWriter {
    /// The SQLite store's writer, staging queue entries as configured.
    Sqlite {
        writer: StoreWriter,
        staging: Arc<Staging>,
    },
    /// The PostgreSQL store's writer (always through the outbox: the lanes
    /// are SQS queues).
    Postgres(PgWriter),
}

impl AcceptWriter {
    pub fn new(writer: StoreWriter, staging: Staging) -> Self {
        AcceptWriter::Sqlite {
            writer,
            staging: Arc::new(staging),
        }
    }

    /// Makes `entry` durable; returns once its group has committed.
    pub async fn accept(&self, entry: AcceptEntry) -> Result<(), NotDurable> {
        self.accept_all(vec![entry]).await
    }

    /// Makes every entry durable in one transaction, all or none (a batch
    /// send); returns once it has committed.
    pub async fn accept_all(&self, entries: Vec<AcceptEntry>) -> Result<(), NotDurable> {
        if entries.is_empty() {
            return Ok(());
        }
        let (writer, staging) = match self {
            AcceptWriter::Sqlite { writer, staging } => (writer, staging),
            AcceptWriter::Postgres(writer) => {
                return match writer.accept(entries).await {
                    true => Ok(()),
                    false => Err(NotDurable {
                        retry_after: writer.retry_after(),
                    }),
                };
            }
        };
        let (reply, answer) = oneshot::channel();
        writer
            .submit(Box::new(AcceptWork {
                entries,
                staging: staging.clone(),
                inserted: Inserted::default(),
                reply: Some(reply),
            }))
            .await;
        match answer.await {
            Ok(true) => Ok(()),
            _ => Err(NotDurable {
                retry_after: writer.retry_after(),
            }),
        }
    }
}

impl AcceptWriter {
    /// The store writer's failure streak.
    pub fn failures(&self) -> &FailureStreak {
        match self {
            AcceptWriter::Sqlite { writer, .. } => writer.failures(),
            AcceptWriter::Postgres(writer) => writer.failures(),
        }
    }

    /// Whether a write needing new room would commit now (see
    /// [`StoreWriter::probe`]).
    pub async fn probe(&self) -> anyhow::Result<()> {
        match self {
            AcceptWriter::Sqlite { writer, .. } => writer.probe().await,
            AcceptWriter::Postgres(writer) => writer.probe().await,
        }
    }

    /// Cancels those of `ids` (of `tenant_id`) that are still waiting to be
    /// sent; returns the ids cancelled. Ordered with the consumers' claims
    /// by the store, so a message cancelled here is never sent, and one
    /// being sent is not cancelled. A scheduled message's outbox row goes
    /// too, so it never reaches its lane.
    pub async fn cancel(&self, tenant_id: &str, ids: Vec<String>) -> anyhow::Result<Vec<String>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let tenant_id = tenant_id.to_owned();
        match self {
            AcceptWriter::Sqlite { writer, .. } => {
                writer
                    .run(move |tx| {
                        let mut cancel = tx.prepare_cached(
                            "UPDATE messages SET status = 'cancelled', updated_at = ?1 \
                             WHERE id = ?2 AND tenant_id = ?3 AND status IN ('scheduled', 'queued', 'retrying')",
                        )?;
                        let mut forget = tx.prepare_cached("DELETE FROM outbox WHERE message_id = ?1")?;
                        let mut cancelled = Vec::new();
                        let now = now_ms();
                        for id in &ids {
                            if cancel.execute(rusqlite::params![now, id, tenant_id])? == 1 {
                                forget.execute([id])?;
                                cancelled.push(id.clone());
                            }
                        }
                        Ok(cancelled)
                    })
                    .await
            }
            AcceptWriter::Postgres(writer) => writer.cancel(&tenant_id, &ids).await,
        }
    }
}

/// Accepted messages: their status rows, queue entries (or outbox rows)
/// and idempotency records, all or nothing.
struct AcceptWork {
    entries: Vec<AcceptEntry>,
    staging: Arc<Staging>,
    inserted: Inserted,
    reply: Option<oneshot::Sender<bool>>,
}

impl Work for AcceptWork {
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        self.inserted = Inserted::default();
        let now = now_ms();
        for entry in &self.entries {
            messages::insert_rows(tx, &[&entry.record])?;
            match self.staging.as_ref() {
                Staging::Embedded(queue) => {
                    queue.insert_rows(tx, entry.lane, &[&entry.outbound], &mut self.inserted)?;
                }
                Staging::Outbox => {
                    crate::outbox::insert_rows(
                        tx,
                        &[(entry.lane, &entry.outbound, entry.record.send_at)],
                        now,
                    )?;
                }
            }
            let remembered: Vec<&StoredResponse> = entry.idempotency.iter().collect();
            idempotency::insert_rows(tx, &remembered)?;
        }
        Ok(())
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if outcome.is_ok()
            && let Staging::Embedded(queue) = self.staging.as_ref()
        {
            queue.inserted(&self.inserted);
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
