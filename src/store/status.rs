//! The delivery path's status changes, as pieces of work for the store's
//! one writer ([`StoreWriter`]): every delivered message changes its status
//! row twice (`sending` before the provider call, `sent` after), and these
//! ride in the same groups as accepts, receives and deletes instead of
//! taking transactions of their own.

use tokio::sync::oneshot;

use crate::model::{MessageStatus, now_ms};
use crate::store::postgres::PgWriter;
use crate::store::writer::{StoreWriter, Work, WriteFailed};

/// Handle for status changes; cheap to clone.
#[derive(Clone)]
pub struct StatusWriter {
    writer: Backend,
}

/// Whose writer the changes go through.
#[derive(Clone)]
enum Backend {
    Sqlite(StoreWriter),
    Postgres(PgWriter),
}

impl StatusWriter {
    pub fn new(writer: StoreWriter) -> Self {
        StatusWriter {
            writer: Backend::Sqlite(writer),
        }
    }

    pub fn postgres(writer: PgWriter) -> Self {
        StatusWriter {
            writer: Backend::Postgres(writer),
        }
    }

    /// Marks a message `sending` (best effort: the status is informational
    /// and is overwritten by the outcome, so this does not wait). Applied
    /// only to a `queued` or `retrying` message not changed since: an
    /// outcome written first wins.
    pub async fn sending(&self, id: &str) {
        let writer = match &self.writer {
            Backend::Sqlite(writer) => writer,
            Backend::Postgres(writer) => return writer.sending(id).await,
        };
        writer
            .submit(Box::new(Sending {
                id: id.to_owned(),
                at: now_ms(),
            }))
            .await;
    }

    /// Takes the message for this instance's provider call: `scheduled`,
    /// `queued` or `retrying` (or `sending` since before `stale_before`, in
    /// ms: its sender died mid-call) → `sending`, atomically and committed
    /// before it answers. False when the message is no longer waiting (sent,
    /// cancelled, …) or another instance is sending it: then nobody may
    /// call the provider for this copy. A cancel and a claim of one message
    /// are ordered by the store, so a cancelled message is never sent.
    pub async fn claim(&self, id: &str, stale_before: i64) -> anyhow::Result<bool> {
        match &self.writer {
            Backend::Sqlite(writer) => {
                let id = id.to_owned();
                writer
                    .run(move |tx| {
                        let taken = tx
                            .prepare_cached(
                                "UPDATE messages SET status = 'sending', updated_at = ?1 WHERE id = ?2 \
                                 AND (status IN ('scheduled', 'queued', 'retrying') \
                                 OR (status = 'sending' AND updated_at < ?3))",
                            )?
                            .execute(rusqlite::params![now_ms(), id, stale_before])?;
                        Ok(taken == 1)
                    })
                    .await
            }
            Backend::Postgres(writer) => writer.claim(id, stale_before).await,
        }
    }

    /// True when `address` (normalised) is on `tenant_id`'s suppression
    /// list. On SQLite the writer's connection reads it ahead of its next
    /// group, which costs a few microseconds against a pool round trip's
    /// tens: it runs for every message delivered.
    pub async fn is_suppressed(&self, tenant_id: &str, address: &str) -> anyhow::Result<bool> {
        match &self.writer {
            Backend::Sqlite(writer) => {
                let (tenant_id, address) = (tenant_id.to_owned(), address.to_owned());
                writer
                    .read(move |tx| {
                        Ok(tx
                            .prepare_cached(
                                "SELECT EXISTS (SELECT 1 FROM suppressions WHERE tenant_id = ?1 AND address = ?2)",
                            )?
                            .query_row(rusqlite::params![tenant_id, address], |row| row.get(0))?)
                    })
                    .await
            }
            Backend::Postgres(writer) => Ok(sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM suppressions WHERE tenant_id = $1 AND address = $2)",
            )
            .bind(tenant_id)
            .bind(address)
            .fetch_one(writer.pool())
            .await?),
        }
    }

    /// Records a successful send; returns once it is committed (the caller
    /// deletes the queue entry only then, so a redelivery finds `sent`).
    pub async fn sent(&self, id: &str, provider_message_id: &str) -> anyhow::Result<()> {
        let writer = match &self.writer {
            Backend::Sqlite(writer) => writer,
            Backend::Postgres(writer) => return writer.sent(id, provider_message_id).await,
        };
        let (done, committed) = oneshot::channel();
        writer
            .submit(Box::new(Sent {
                id: id.to_owned(),
                provider_message_id: provider_message_id.to_owned(),
                done: Some(done),
            }))
            .await;
        match committed.await {
            Ok(true) => Ok(()),
            _ => anyhow::bail!("status change could not be committed"),
        }
    }

    /// Records a failed provider call (`counted`: whether it was an
    /// attempt) and the state the message moves to; returns the attempts
    /// made so far.
    pub async fn failure(
        &self,
        id: &str,
        status: MessageStatus,
        error: &str,
        counted: bool,
    ) -> anyhow::Result<u32> {
        let writer = match &self.writer {
            Backend::Sqlite(writer) => writer,
            Backend::Postgres(writer) => return writer.failure(id, status, error, counted).await,
        };
        let (id, error) = (id.to_owned(), error.to_owned());
        writer
            .run(move |tx| {
                let attempts: Option<i64> = tx
                    .prepare_cached(
                        "UPDATE messages SET status = ?1, attempts = attempts + ?2, last_error = ?3, \
                         updated_at = ?4 WHERE id = ?5 RETURNING attempts",
                    )?
                    .query_row(
                        rusqlite::params![status.as_str(), i64::from(counted), error, now_ms(), id],
                        |row| row.get(0),
                    )
                    .map(Some)
                    .or_else(|err| match err {
                        rusqlite::Error::QueryReturnedNoRows => Ok(None),
                        err => Err(err),
                    })?;
                Ok(attempts.unwrap_or(0).max(0) as u32)
            })
            .await
    }
}

struct Sending {
    id: String,
    /// When the change was asked for (ms).
    at: i64,
}

impl Work for Sending {
    fn apply(&mut self, tx: &rusqlite::Transaction) -> anyhow::Result<()> {
        tx.prepare_cached(
            "UPDATE messages SET status = 'sending', updated_at = ?1 \
             WHERE id = ?2 AND status IN ('queued', 'retrying') AND updated_at <= ?3",
        )?
        .execute(rusqlite::params![now_ms(), self.id, self.at])?;
        Ok(())
    }

    fn finish(self: Box<Self>, _outcome: Result<(), WriteFailed>) {}
}

struct Sent {
    id: String,
    provider_message_id: String,
    done: Option<oneshot::Sender<bool>>,
}

impl Work for Sent {
    fn apply(&mut self, tx: &rusqlite::Transaction) -> anyhow::Result<()> {
        tx.prepare_cached(
            "UPDATE messages SET status = 'sent', attempts = attempts + 1, last_error = NULL, \
             sent_at = ?1, updated_at = ?1, provider_message_id = ?2 WHERE id = ?3",
        )?
        .execute(rusqlite::params![
            now_ms(),
            self.provider_message_id,
            self.id
        ])?;
        Ok(())
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if let Some(done) = self.done.take() {
            let _ = done.send(outcome.is_ok());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Channel, Lane, Priority};
    use crate::store::Db;
    use crate::store::messages::{self, MessageRecord};

    #[tokio::test]
    async fn sending_then_sent_are_committed_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("s.db"), false).await.unwrap();
        let record = MessageRecord {
            id: "m1".into(),
            tenant_id: "t".into(),
            channel: Channel::Sms,
            status: MessageStatus::Queued,
            priority: Priority::Normal,
            lane: Lane::Fast,
            attempts: 0,
            reference: None,
            metadata: None,
            created_at: 1,
            updated_at: 1,
            sent_at: None,
            last_error: None,
            provider_message_id: None,
            send_at: None,
        };
        let (store, finished) = StoreWriter::spawn(db.sqlite().unwrap(), 64).unwrap();
        let inserted = record.clone();
        store
            .run(move |tx| Ok(messages::insert_rows(tx, &[&inserted])?))
            .await
            .unwrap();
        let writer = StatusWriter::new(store.clone());
        writer.sending("m1").await;
        writer.sent("m1", "SM1").await.unwrap();
        // A late `sending` never overwrites `sent`.
        writer.sending("m1").await;
        let attempts = writer
            .failure("nope", MessageStatus::Retrying, "x", true)
            .await
            .unwrap();
        assert_eq!(attempts, 0, "an unknown id changes nothing");
        store.stop().await;
        finished.await.unwrap();
        let stored = messages::get(&db, "m1").await.unwrap().unwrap();
        assert_eq!(stored.status, MessageStatus::Sent);
        assert_eq!(stored.attempts, 1);
        assert_eq!(stored.provider_message_id.as_deref(), Some("SM1"));
    }
}
