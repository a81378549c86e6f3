//! A message's status history (`message_events`): one row per status change
//! and per provider update, written with each status change by the store's
//! lifecycle ([`crate::store::lifecycle`]).

use crate::store::{Db, sqlite};

/// One row of a message's history.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct EventRecord {
    pub id: i64,
    pub at: i64,
    /// A status word, or a provider update's name.
    pub event: String,
    /// The message's status after the event.
    pub status: String,
    pub attempts: i64,
    pub detail: Option<String>,
    pub provider_message_id: Option<String>,
}

/// Most events listed for one message.
pub const MAX_EVENTS: i64 = 1000;

/// The events of message `id`, oldest first.
pub async fn list(db: &Db, id: &str) -> anyhow::Result<Vec<EventRecord>> {
    const LIST: &str = "SELECT id, at, event, status, attempts, detail, provider_message_id \
                        FROM message_events WHERE message_id = $1 ORDER BY id LIMIT $2";
    Ok(match db {
        Db::Sqlite(db) => {
            db.rows(LIST, sqlite::args![id.to_owned(), MAX_EVENTS], |row| {
                Ok(EventRecord {
                    id: row.get(0)?,
                    at: row.get(1)?,
                    event: row.get(2)?,
                    status: row.get(3)?,
                    attempts: row.get(4)?,
                    detail: row.get(5)?,
                    provider_message_id: row.get(6)?,
                })
            })
            .await?
        }
        Db::Postgres(db) => {
            sqlx::query_as(LIST)
                .bind(id)
                .bind(MAX_EVENTS)
                .fetch_all(&db.pool)
                .await?
        }
    })
}
