//! Group commit for the delivery path's status changes.
//!
//! Every delivered message changes its status row twice (`sending` before
//! the provider call, `sent` after). One transaction each would make the
//! single SQLite writer the ceiling of delivery throughput, so consumers
//! hand these changes to one writer that applies everything waiting in one
//! transaction, as the accept writer does for new messages. Like the accept
//! writer it is a plain thread with its own SQLite connection (rusqlite) and
//! one cached statement per kind of change, so no SQL is parsed per group and
//! its turn at the write lock is as short as the writes themselves.

use std::sync::Arc;

use anyhow::Context;
use rusqlite::{Connection, TransactionBehavior};
use tokio::sync::{mpsc, oneshot};
use tracing::error;

use super::Db;
use crate::model::now_ms;

/// Most changes applied in one transaction.
const MAX_GROUP: usize = 512;

enum Change {
    Sending {
        id: String,
        /// When the change was asked for (ms).
        at: i64,
    },
    Sent {
        id: String,
        provider_message_id: String,
        done: oneshot::Sender<bool>,
    },
}

/// Handle to the status writer; cheap to clone.
#[derive(Clone)]
pub struct StatusWriter {
    changes: mpsc::Sender<Change>,
}

impl StatusWriter {
    /// Starts the writer on a thread of its own with its own connection to
    /// `db`'s file; the returned receiver completes when every handle is
    /// dropped and the last group is committed.
    pub fn spawn(db: Db) -> anyhow::Result<(Self, oneshot::Receiver<()>)> {
        let conn = crate::accept::open_connection(&db.path, db.fsync)
            .with_context(|| format!("opening {} for the status writer", db.path.display()))?;
        let (changes, receiver) = mpsc::channel(MAX_GROUP * 4);
        let (finished, done) = oneshot::channel();
        std::thread::Builder::new()
            .name("fairlane-status-writer".into())
            .spawn(move || {
                run(conn, db.turn, receiver);
                let _ = finished.send(());
            })?;
        Ok((StatusWriter { changes }, done))
    }

    /// Marks a message `sending` (best effort: the status is informational
    /// and is overwritten by the outcome, so this does not wait). Applied
    /// only to a `queued` or `retrying` message not changed since: an
    /// outcome written first (a fast failure recorded directly) wins.
    pub async fn sending(&self, id: &str) {
        let _ = self
            .changes
            .send(Change::Sending {
                id: id.to_owned(),
                at: now_ms(),
            })
            .await;
    }

    /// Records a successful send; returns once it is committed (the caller
    /// deletes the queue entry only then, so a redelivery finds `sent`).
    pub async fn sent(&self, id: &str, provider_message_id: &str) -> anyhow::Result<()> {
        let (done, committed) = oneshot::channel();
        self.changes
            .send(Change::Sent {
                id: id.to_owned(),
                provider_message_id: provider_message_id.to_owned(),
                done,
            })
            .await
            .map_err(|_| anyhow::anyhow!("status writer has stopped"))?;
        match committed.await {
            Ok(true) => Ok(()),
            _ => anyhow::bail!("status change could not be committed"),
        }
    }
}

fn run(
    mut conn: Connection,
    turn: Arc<tokio::sync::Mutex<()>>,
    mut receiver: mpsc::Receiver<Change>,
) {
    let mut group = Vec::with_capacity(MAX_GROUP);
    while let Some(first) = receiver.blocking_recv() {
        group.push(first);
        while group.len() < MAX_GROUP {
            match receiver.try_recv() {
                Ok(change) => group.push(change),
                Err(_) => break,
            }
        }
        let committed = {
            let _turn = turn.blocking_lock();
            apply(&mut conn, &group)
        };
        if let Err(err) = &committed {
            error!(error = %err, changes = group.len(), "Status changes could not be committed.");
        }
        for change in group.drain(..) {
            if let Change::Sent { done, .. } = change {
                let _ = done.send(committed.is_ok());
            }
        }
    }
}

/// One transaction for the group; `sending` changes first, so a `sent` in
/// the same group is the one that stays.
fn apply(conn: &mut Connection, group: &[Change]) -> rusqlite::Result<()> {
    let now = now_ms();
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    {
        let mut sending = tx.prepare_cached(
            "UPDATE messages SET status = 'sending', updated_at = ?1 \
             WHERE id = ?2 AND status IN ('queued', 'retrying') AND updated_at <= ?3",
        )?;
        for change in group {
            if let Change::Sending { id, at } = change {
                sending.execute(rusqlite::params![now, id, at])?;
            }
        }
        let mut sent = tx.prepare_cached(
            "UPDATE messages SET status = 'sent', attempts = attempts + 1, last_error = NULL, \
             sent_at = ?1, updated_at = ?1, provider_message_id = ?2 WHERE id = ?3",
        )?;
        for change in group {
            if let Change::Sent {
                id,
                provider_message_id,
                ..
            } = change
            {
                sent.execute(rusqlite::params![now, provider_message_id, id])?;
            }
        }
    }
    tx.commit()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Channel, Lane, MessageStatus, Priority};
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
        };
        let mut conn = rusqlite::Connection::open(dir.path().join("s.db")).unwrap();
        let tx = conn.transaction().unwrap();
        messages::insert_rows(&tx, &[&record]).unwrap();
        tx.commit().unwrap();

        let (writer, finished) = StatusWriter::spawn(db.clone()).unwrap();
        writer.sending("m1").await;
        writer.sent("m1", "SM1").await.unwrap();
        // A late `sending` never overwrites `sent`.
        writer.sending("m1").await;
        drop(writer);
        finished.await.unwrap();
        let stored = messages::get(&db.read, "m1").await.unwrap().unwrap();
        assert_eq!(stored.status, MessageStatus::Sent);
        assert_eq!(stored.attempts, 1);
        assert_eq!(stored.provider_message_id.as_deref(), Some("SM1"));
    }
}
