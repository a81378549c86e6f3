//! Message status rows: one per accepted message, written in the same
//! transaction as its queue entry and read back by `GET /v1/messages/{id}`.

use crate::store::StoreResult;
use async_trait::async_trait;

use crate::model::{Lane, Scope};

pub use super::events::EventRecord;
pub use crate::message::{MessageRecord, RecipientRecord};

use std::collections::HashMap;

/// A status row as read.
#[derive(sqlx::FromRow)]
pub(super) struct MessageRow {
    pub(super) id: String,
    pub(super) tenant_id: String,
    pub(super) channel: String,
    pub(super) status: String,
    pub(super) priority: String,
    pub(super) lane: String,
    pub(super) attempts: i64,
    pub(super) reference: Option<String>,
    pub(super) metadata: Option<String>,
    pub(super) created_at: i64,
    pub(super) updated_at: i64,
    pub(super) sent_at: Option<i64>,
    pub(super) last_error: Option<String>,
    pub(super) provider_message_id: Option<String>,
    pub(super) send_at: Option<i64>,
    pub(super) test: bool,
    pub(super) fragments: Option<i64>,
    pub(super) erased_at: Option<i64>,
    pub(super) provider: Option<String>,
    pub(super) recipient: Option<String>,
    pub(super) gate_wait_ms: Option<i64>,
    pub(super) template_id: Option<String>,
    pub(super) template_version: Option<i64>,
    pub(super) attachment_bytes: Option<i64>,
}

impl MessageRow {
    /// Whether a provider may have reported on its recipients: a sent
    /// email whose personal data retention has not erased.
    pub(super) fn may_have_recipients(&self) -> bool {
        self.channel == crate::model::Channel::Email.as_str()
            && self.sent_at.is_some()
            && self.erased_at.is_none()
    }
}

macro_rules! message_columns {
    () => {
        concat!(
            "id, tenant_id, channel, status, priority, lane, attempts, reference, metadata, ",
            "created_at, updated_at, sent_at, last_error, provider_message_id, send_at, test, fragments, erased_at, provider, recipient, gate_wait_ms, ",
            "template_id, template_version, attachment_bytes"
        )
    };
}

pub(super) use message_columns;

/// A status row's columns, in [`MessageRow`]'s order.
pub(super) const MESSAGE_COLUMNS: &str = message_columns!();

/// The record of a status row as read.
pub(super) fn from_row(row: MessageRow) -> anyhow::Result<MessageRecord> {
    let parse_err = |what: &str, value: &str, err: String| {
        anyhow::anyhow!("stored {what} {value:?} is not valid: {err}")
    };
    Ok(MessageRecord {
        channel: row
            .channel
            .parse()
            .map_err(|e| parse_err("channel", &row.channel, e))?,
        status: row
            .status
            .parse()
            .map_err(|e| parse_err("status", &row.status, e))?,
        priority: row
            .priority
            .parse()
            .map_err(|e| parse_err("priority", &row.priority, e))?,
        lane: row
            .lane
            .parse()
            .map_err(|e| parse_err("lane", &row.lane, e))?,
        id: row.id,
        tenant_id: row.tenant_id,
        attempts: row.attempts.max(0) as u32,
        reference: row.reference,
        metadata: row.metadata,
        created_at: row.created_at,
        updated_at: row.updated_at,
        sent_at: row.sent_at,
        last_error: row.last_error,
        provider_message_id: row.provider_message_id,
        send_at: row.send_at,
        test: row.test,
        fragments: row
            .fragments
            .map(|n| n.clamp(0, i64::from(u32::MAX)) as u32),
        erased_at: row.erased_at,
        provider: row.provider,
        recipient: row.recipient,
        gate_wait_ms: row.gate_wait_ms,
        template_id: row.template_id,
        template_version: row.template_version.and_then(|n| u32::try_from(n).ok()),
        attachment_bytes: row.attachment_bytes,
    })
}

/// Status rows and their histories, on either backend. A status changes
/// only through the lifecycle ([`super::lifecycle`]); the moves here that
/// change one call it.
#[async_trait]
pub trait MessageStore: Send + Sync {
    /// The message `id` if it belongs to `scope`: its tenant, in its world.
    /// A test key's caller never gets a live message, nor a live key's
    /// caller a test one.
    async fn message_in(&self, scope: &Scope, id: &str) -> StoreResult<Option<MessageRecord>>;

    /// The message `id`, whoever owns it.
    async fn message(&self, id: &str) -> StoreResult<Option<MessageRecord>>;

    /// The events of message `id`, oldest first, at most
    /// [`super::events::MAX_EVENTS`].
    async fn message_events(&self, id: &str) -> StoreResult<Vec<EventRecord>>;

    /// What providers reported of message `id`'s recipients, by address.
    async fn recipient_statuses(&self, id: &str) -> StoreResult<Vec<RecipientRecord>>;

    /// [`Self::message_in`] with [`Self::recipient_statuses`], both read
    /// at one moment: a receipt commits a message's status and its
    /// recipients' together, so a view never shows one without the other.
    /// The recipients are read only for a sent email not erased (none
    /// otherwise).
    async fn message_with_recipients(
        &self,
        scope: &Scope,
        id: &str,
    ) -> StoreResult<Option<(MessageRecord, Vec<RecipientRecord>)>>;

    /// The provider last called for message `id` and whether its next
    /// attempt must go to that provider again (see [`crate::store::Called`]).
    async fn last_provider(&self, id: &str) -> StoreResult<Option<(String, bool)>>;

    /// Live messages (not a test key's) `tenant_id` sent at or after
    /// `since_ms`: what its daily quota has used (start-up).
    async fn live_count_since(&self, tenant_id: &str, since_ms: i64) -> StoreResult<u64>;

    /// Puts redriven messages back to `queued` with a fresh attempt budget,
    /// unless a consumer has already taken them up again since
    /// `redrive_started` (ms): a message sent, or dead-lettered once more, in
    /// the moment between its move back to the lane and this update keeps
    /// the newer status. Any status but `sent` and `rejected` from before the
    /// redrive is reset: a message SQS's own redrive policy moved to the DLQ
    /// still shows the status it had when it was last received. Queue
    /// backends that share the status store call this before moving
    /// messages (`redrive_started` = `i64::MAX`), so a consumer never sees a
    /// redriven message with its old budget.
    async fn mark_requeued(&self, ids: &[String], redrive_started: i64) -> StoreResult<()>;

    /// Undoes [`MessageStore::mark_requeued`] for messages that could not be
    /// moved after all.
    async fn restore_dead_lettered(&self, ids: &[String]) -> StoreResult<()>;

    /// Status rows of `ids` (any tenant), keyed by id.
    async fn messages_by_id(&self, ids: &[String]) -> StoreResult<HashMap<String, MessageRecord>>;

    /// Of `scope`'s messages with `reference`: the ids of up to `limit`
    /// still waiting to be sent, and how many there are in all.
    async fn pending_by_reference(
        &self,
        scope: &Scope,
        reference: &str,
        limit: i64,
    ) -> StoreResult<(Vec<String>, usize)>;

    /// Creates, if missing, the index of pending messages that
    /// [`MessageStore::oldest_pending`] reads (a SQLite file made before it;
    /// the PostgreSQL schema has it from its first migration).
    async fn index_pending(&self) -> StoreResult<()>;

    /// When the oldest pending message of `lane` (of `tenant`, when given)
    /// was created (ms).
    async fn oldest_pending(&self, lane: Lane, tenant: Option<&str>) -> StoreResult<Option<i64>>;

    /// Messages still `sending` in a SQLite file (which belongs to this one
    /// instance) were being sent by a process that is gone: they wait again,
    /// to be claimed by their redelivered copy (at least once). Returns how
    /// many. On PostgreSQL another instance may be sending them: nothing
    /// changes (a stale claim is taken over by [`crate::store::Writer::claim`]).
    async fn release_interrupted_sends(&self) -> StoreResult<u64>;

    /// A page of `scope`'s messages, newest first, at most `limit`: a test
    /// key's messages or live ones, never both in one list. The index
    /// `(tenant_id, test, created_at, id)` gives the order, so a page reads
    /// about as many rows as it shows; a reference has an index of its own.
    /// A status or channel (without a reference) is checked on each row the
    /// index yields, and at most `scan_rows` rows are read for one page: a
    /// rare or absent status then answers in bounded time with what it found
    /// and [`ListPage::scanned_to`], never by walking the tenant's every row.
    async fn list_messages(
        &self,
        scope: &Scope,
        filter: &ListFilter,
        limit: i64,
        scan_rows: i64,
    ) -> StoreResult<ListPage>;
}

/// Which of a scope's messages a list shows (all given conditions hold).
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    pub reference: Option<String>,
    /// Normalised as [`crate::store::suppressions::normalize`] does.
    pub recipient: Option<String>,
    pub status: Option<crate::model::MessageStatus>,
    pub channel: Option<crate::model::Channel>,
    /// Created at or after (ms).
    pub since: Option<i64>,
    /// Created before (ms).
    pub until: Option<i64>,
    /// Only messages older than this `(created_at, id)`: the previous
    /// page's last.
    pub before: Option<(i64, String)>,
}

/// A page of a list, and where the next page goes on when the page ended
/// short because its scan ran out of budget.
#[derive(Debug)]
pub struct ListPage {
    pub rows: Vec<MessageRecord>,
    /// Set when a filter no index serves (a status or channel without a
    /// reference) read `scan_rows` messages without filling the page: the
    /// `(created_at, id)` of the last message it read, below which the next
    /// page's scan continues.
    pub scanned_to: Option<(i64, String)>,
}

/// A value bound to a list's statement.
#[derive(Debug, Clone)]
pub(super) enum ListValue {
    Text(String),
    Number(i64),
}

/// A list's conditions, written once for both engines: `$1` and `$2` are
/// the tenant and `test`, and each condition given adds one placeholder
/// after them, numbered in the order of `binds`: first those the list
/// index serves (`window`, the first `window_binds`), then those checked
/// on each row (`checked`). Each backend writes the statements around
/// them.
pub(super) struct ListQuery {
    pub window: String,
    pub checked: String,
    pub binds: Vec<ListValue>,
    pub window_binds: usize,
    /// A status or channel without a reference: the page reads at most
    /// `scan_rows` rows of the window.
    pub bounded: bool,
}

/// Newest first, in the list index's order.
pub(super) const NEWEST_FIRST: &str = " ORDER BY created_at DESC, id DESC";

impl ListQuery {
    pub(super) fn of(filter: &ListFilter) -> ListQuery {
        let mut binds: Vec<ListValue> = Vec::new();
        let mut window = String::new();
        let mut checked = String::new();
        let condition =
            |out: &mut String, binds: &mut Vec<ListValue>, column: &str, op: &str, value| {
                out.push_str(&format!(" AND {column} {op} ${}", binds.len() + 3));
                binds.push(value);
            };
        if let Some(since) = filter.since {
            condition(
                &mut window,
                &mut binds,
                "created_at",
                ">=",
                ListValue::Number(since),
            );
        }
        if let Some(until) = filter.until {
            condition(
                &mut window,
                &mut binds,
                "created_at",
                "<",
                ListValue::Number(until),
            );
        }
        if let Some((at, id)) = &filter.before {
            // A row value, which both engines read as a range of the index
            // (an OR of the two cases made PostgreSQL filter from the top).
            let (a, b) = (binds.len() + 3, binds.len() + 4);
            window.push_str(&format!(" AND (created_at, id) < (${a}, ${b})"));
            binds.push(ListValue::Number(*at));
            binds.push(ListValue::Text(id.clone()));
        }
        let window_binds = binds.len();
        let equal_to = [
            ("reference", filter.reference.clone()),
            ("recipient", filter.recipient.clone()),
            ("status", filter.status.map(|s| s.as_str().to_owned())),
            ("channel", filter.channel.map(|c| c.as_str().to_owned())),
        ];
        for (column, value) in equal_to {
            if let Some(value) = value {
                condition(
                    &mut checked,
                    &mut binds,
                    column,
                    "=",
                    ListValue::Text(value),
                );
            }
        }
        let bounded = filter.reference.is_none() && !checked.is_empty();
        ListQuery {
            window,
            checked,
            binds,
            window_binds,
            bounded,
        }
    }
}
