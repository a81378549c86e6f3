//! A message's status history (`message_events`): one row per status change
//! and per provider update, written with each status change by the store's
//! lifecycle ([`crate::store::lifecycle`]).

use crate::store::{Db, on_pool};

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
    Ok(on_pool!(db, read, |pool| {
        sqlx::query_as::<_, EventRecord>(
            "SELECT id, at, event, status, attempts, detail, provider_message_id \
             FROM message_events WHERE message_id = $1 ORDER BY id LIMIT $2",
        )
        .bind(id)
        .bind(MAX_EVENTS)
        .fetch_all(pool)
        .await?
    }))
}
