//! A message's status history (`message_events`): one row per status change
//! and per provider update, written with each status change by the store's
//! lifecycle ([`crate::store::lifecycle`]), read through
//! [`super::MessageStore::message_events`].

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
