//! Group commit for the delivery path's status changes.
//!
//! Every delivered message changes its status row twice (`sending` before
//! the provider call, `sent` after). One transaction each would make the
//! single SQLite writer the ceiling of delivery throughput, so consumers
//! hand these changes to one task that applies everything waiting in one
//! multi-statement transaction, as the accept writer does for new messages.

use sqlx::{QueryBuilder, Sqlite};
use tokio::sync::{mpsc, oneshot};
use tracing::error;

use super::Db;
use crate::model::now_ms;

/// Most changes applied in one transaction.
const MAX_GROUP: usize = 256;

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

/// Handle to the status writer task; cheap to clone.
#[derive(Clone)]
pub struct StatusWriter {
    changes: mpsc::Sender<Change>,
}

impl StatusWriter {
    /// Starts the writer task; it ends when every handle is dropped.
    pub fn spawn(db: Db) -> (Self, tokio::task::JoinHandle<()>) {
        let (changes, receiver) = mpsc::channel(MAX_GROUP * 4);
        (StatusWriter { changes }, tokio::spawn(run(db, receiver)))
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

async fn run(db: Db, mut receiver: mpsc::Receiver<Change>) {
    let mut group = Vec::with_capacity(MAX_GROUP);
    while receiver.recv_many(&mut group, MAX_GROUP).await > 0 {
        let now = now_ms();
        let mut transaction: QueryBuilder<Sqlite> = QueryBuilder::new("BEGIN IMMEDIATE;\n");
        for change in &group {
            if let Change::Sending { id, at } = change {
                transaction
                    .push("UPDATE messages SET status = 'sending', updated_at = ")
                    .push_bind(now)
                    .push(" WHERE id = ")
                    .push_bind(id.clone())
                    .push(" AND status IN ('queued', 'retrying') AND updated_at <= ")
                    .push_bind(*at)
                    .push(";\n");
            }
        }
        for change in &group {
            if let Change::Sent {
                id,
                provider_message_id,
                ..
            } = change
            {
                transaction
                    .push("UPDATE messages SET status = 'sent', attempts = attempts + 1, last_error = NULL, sent_at = ")
                    .push_bind(now)
                    .push(", updated_at = ")
                    .push_bind(now)
                    .push(", provider_message_id = ")
                    .push_bind(provider_message_id.clone())
                    .push(" WHERE id = ")
                    .push_bind(id.clone())
                    .push(";\n");
            }
        }
        transaction.push("COMMIT;");
        let _turn = db.write_turn().await;
        let committed = match db.write.acquire().await {
            Ok(mut conn) => match transaction
                .build()
                .persistent(false)
                .execute(&mut *conn)
                .await
            {
                Ok(_) => true,
                Err(err) => {
                    let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
                    error!(error = %err, changes = group.len(), "Status changes could not be committed.");
                    false
                }
            },
            Err(err) => {
                error!(error = %err, "No database connection for status changes.");
                false
            }
        };
        for change in group.drain(..) {
            if let Change::Sent { done, .. } = change {
                let _ = done.send(committed);
            }
        }
    }
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

        let (writer, task) = StatusWriter::spawn(db.clone());
        writer.sending("m1").await;
        writer.sent("m1", "SM1").await.unwrap();
        // A late `sending` never overwrites `sent`.
        writer.sending("m1").await;
        drop(writer);
        task.await.unwrap();
        let stored = messages::get(&db.read, "m1").await.unwrap().unwrap();
        assert_eq!(stored.status, MessageStatus::Sent);
        assert_eq!(stored.attempts, 1);
        assert_eq!(stored.provider_message_id.as_deref(), Some("SM1"));
    }
}
