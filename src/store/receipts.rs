//! Provider receipts in the store: applying one to its message (status,
//! event, suppressions) in one transaction, and keeping those that beat
//! their message's `sent` record for a later match.

use serde::{Deserialize, Serialize};

use super::{Db, in_transaction, on_pool, suppressions};
use crate::model::{MessageStatus, now_ms};

/// What a provider reported about one message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    /// The provider's metrics name: `ses` or `http`.
    pub provider: String,
    /// The id the provider gave when it took the message.
    pub provider_message_id: String,
    /// The status the report moves the message to, if any.
    pub outcome: Option<MessageStatus>,
    /// The event's name in the history: the outcome's word, or a provider
    /// update that changes no status (`sms_sent`, `transient_bounce`,
    /// `delivery_delayed`, …).
    pub event: String,
    /// The provider's words: bounce type and diagnostic, error code, …
    pub detail: Option<String>,
    /// Addresses to add to the tenant's suppression list, with the reason
    /// (`bounce` or `complaint`).
    pub suppress: Vec<String>,
    /// Why `suppress` is there: `bounce` or `complaint`.
    pub suppress_reason: Option<String>,
}

impl Receipt {
    /// The metrics label of the report: its outcome, or `event` for a
    /// provider update.
    pub fn outcome_label(&self) -> &'static str {
        self.outcome.map_or("event", MessageStatus::as_str)
    }
}

/// What a receipt did to its message (`apply_pg_in`, `apply_in`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// The message was found; `changed` when its status moved.
    Matched {
        message_id: String,
        tenant_id: String,
        changed: bool,
    },
    /// The same report again: nothing recorded.
    Duplicate,
    /// No message has this provider id (yet).
    Unmatched,
}

/// Order of the states a receipt may move a message through: a report
/// only moves it forward (a complaint after a delivery, not a delivery
/// after a bounce).
fn rank(status: MessageStatus) -> Option<u8> {
    match status {
        MessageStatus::Sent => Some(0),
        MessageStatus::Delivered => Some(1),
        MessageStatus::Failed | MessageStatus::Bounced => Some(2),
        MessageStatus::Complained => Some(3),
        _ => None,
    }
}

/// What a receipt does to a message whose status is `current`.
struct Decision {
    /// The status the message moves to, if it moves.
    moves: Option<MessageStatus>,
    /// The event's name in the history.
    event: String,
    /// The status recorded with the event.
    after: MessageStatus,
    /// The same outcome again: nothing to record.
    duplicate: bool,
    /// A report that moves nothing: a duplicate if the same event was
    /// recorded before (a replayed callback, a provider's retry).
    check_seen: bool,
}

fn decide(receipt: &Receipt, current: MessageStatus) -> Decision {
    let moves = receipt
        .outcome
        .filter(|outcome| match (rank(*outcome), rank(current)) {
            (Some(new), Some(old)) => new > old,
            _ => false,
        });
    let (event, after) = match (moves, receipt.outcome) {
        (Some(outcome), _) => (outcome.as_str().to_owned(), outcome),
        // Reported, but the message is already further on.
        (None, Some(outcome)) => (format!("provider_{}", outcome.as_str()), current),
        (None, None) => (receipt.event.clone(), current),
    };
    let duplicate = receipt.outcome.is_some() && receipt.outcome == Some(current);
    Decision {
        moves,
        event,
        after,
        duplicate,
        check_seen: !duplicate && moves.is_none(),
    }
}

/// `last_error` after a move to `outcome`: a failure's reason; a delivery
/// clears it.
fn error_after(receipt: &Receipt, outcome: MessageStatus) -> Option<String> {
    (outcome != MessageStatus::Delivered)
        .then(|| receipt.detail.clone())
        .flatten()
}

/// Records `receipt` against its message in PostgreSQL's transaction `tx`
/// (a piece of the group writer's group, so a receipt does not commit
/// alone); [`apply_in`] is SQLite's.
pub(crate) async fn apply_pg_in(
    tx: &mut sqlx::PgConnection,
    receipt: &Receipt,
    now: i64,
) -> anyhow::Result<Applied> {
    let applied = {
        let found: Option<(String, String, String, i64)> = sqlx::query_as(
            "SELECT id, tenant_id, status, attempts FROM messages \
         WHERE provider_message_id = $1 LIMIT 1",
        )
        .bind(&receipt.provider_message_id)
        .fetch_optional(&mut *tx)
        .await?;
        match found {
            None => Applied::Unmatched,
            Some((id, tenant_id, status, attempts)) => {
                let current: MessageStatus = status.parse().map_err(anyhow::Error::msg)?;
                let decision = decide(receipt, current);
                let mut duplicate = decision.duplicate;
                if decision.check_seen {
                    let seen: Option<i32> = sqlx::query_scalar(
                        "SELECT 1 FROM message_events WHERE message_id = $1 AND event = $2 \
                     AND detail IS NOT DISTINCT FROM $3 LIMIT 1",
                    )
                    .bind(&id)
                    .bind(&decision.event)
                    .bind(&receipt.detail)
                    .fetch_optional(&mut *tx)
                    .await?;
                    duplicate = seen.is_some();
                }
                if duplicate {
                    Applied::Duplicate
                } else {
                    if let Some(outcome) = decision.moves {
                        sqlx::query(
                        "UPDATE messages SET status = $1, last_error = $2, updated_at = $3 WHERE id = $4",
                    )
                    .bind(outcome.as_str())
                    .bind(error_after(receipt, outcome))
                    .bind(now)
                    .bind(&id)
                    .execute(&mut *tx)
                    .await?;
                    }
                    sqlx::query(INSERT_EVENT)
                        .bind(&id)
                        .bind(&tenant_id)
                        .bind(now)
                        .bind(&decision.event)
                        .bind(decision.after.as_str())
                        .bind(attempts)
                        .bind(&receipt.detail)
                        .bind(&receipt.provider_message_id)
                        .execute(&mut *tx)
                        .await?;
                    for (channel, address) in to_suppress(receipt) {
                        sqlx::query(suppressions::INSERT)
                            .bind(&tenant_id)
                            .bind(&address)
                            .bind(channel.as_str())
                            .bind(suppress_reason(receipt))
                            .bind(&receipt.detail)
                            .bind(&id)
                            .bind(now)
                            .execute(&mut *tx)
                            .await?;
                    }
                    Applied::Matched {
                        message_id: id,
                        tenant_id,
                        changed: decision.moves.is_some(),
                    }
                }
            }
        }
    };
    Ok(applied)
}

const INSERT_EVENT: &str = "INSERT INTO message_events (message_id, tenant_id, at, event, status, attempts, detail, provider_message_id) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8)";

/// The receipt's addresses to suppress, normalised (unreadable ones are
/// skipped).
fn to_suppress(receipt: &Receipt) -> impl Iterator<Item = (crate::model::Channel, String)> + '_ {
    receipt
        .suppress
        .iter()
        .filter_map(|address| suppressions::normalize(address))
}

fn suppress_reason(receipt: &Receipt) -> &str {
    receipt.suppress_reason.as_deref().unwrap_or("bounce")
}

/// [`apply_pg_in`]'s statements in the SQLite writer's transaction `tx`
/// (a piece of its group), so a receipt does not commit alone.
pub(crate) fn apply_in(
    tx: &rusqlite::Transaction,
    receipt: &Receipt,
    now: i64,
) -> anyhow::Result<Applied> {
    use rusqlite::OptionalExtension;
    let found: Option<(String, String, String, i64)> = tx
        .prepare_cached(
            "SELECT id, tenant_id, status, attempts FROM messages \
             WHERE provider_message_id = ?1 LIMIT 1",
        )?
        .query_row([&receipt.provider_message_id], |row| {
            Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?))
        })
        .optional()?;
    let Some((id, tenant_id, status, attempts)) = found else {
        return Ok(Applied::Unmatched);
    };
    let current: MessageStatus = status.parse().map_err(anyhow::Error::msg)?;
    let decision = decide(receipt, current);
    let mut duplicate = decision.duplicate;
    if decision.check_seen {
        duplicate = tx
            .prepare_cached(
                "SELECT 1 FROM message_events WHERE message_id = ?1 AND event = ?2 \
                 AND detail IS ?3 LIMIT 1",
            )?
            .exists(rusqlite::params![id, decision.event, receipt.detail])?;
    }
    if duplicate {
        return Ok(Applied::Duplicate);
    }
    if let Some(outcome) = decision.moves {
        tx.prepare_cached(
            "UPDATE messages SET status = ?1, last_error = ?2, updated_at = ?3 WHERE id = ?4",
        )?
        .execute(rusqlite::params![
            outcome.as_str(),
            error_after(receipt, outcome),
            now,
            id
        ])?;
    }
    tx.prepare_cached(INSERT_EVENT)?.execute(rusqlite::params![
        id,
        tenant_id,
        now,
        decision.event,
        decision.after.as_str(),
        attempts,
        receipt.detail,
        receipt.provider_message_id
    ])?;
    for (channel, address) in to_suppress(receipt) {
        tx.prepare_cached(suppressions::INSERT)?
            .execute(rusqlite::params![
                tenant_id,
                address,
                channel.as_str(),
                suppress_reason(receipt),
                receipt.detail,
                id,
                now
            ])?;
    }
    Ok(Applied::Matched {
        message_id: id,
        tenant_id,
        changed: decision.moves.is_some(),
    })
}

/// Keeps `receipt` (as `json`) to be matched again from `next_try_at`.
pub async fn keep(db: &Db, receipt: &Receipt, json: &str, next_try_at: i64) -> anyhow::Result<()> {
    in_transaction!(db, |tx| {
        sqlx::query(
            "INSERT INTO pending_receipts (provider, provider_message_id, receipt, received_at, next_try_at, tries) \
             VALUES ($1, $2, $3, $4, $5, 0)",
        )
        .bind(&receipt.provider)
        .bind(&receipt.provider_message_id)
        .bind(json)
        .bind(now_ms())
        .bind(next_try_at)
        .execute(&mut *tx)
        .await?;
    });
    Ok(())
}

/// Up to `limit` kept receipts due at `now`: row id, receipt JSON, when it
/// was received (ms), tries so far.
pub async fn kept_due(
    db: &Db,
    now: i64,
    limit: i64,
) -> anyhow::Result<Vec<(i64, String, i64, i64)>> {
    Ok(on_pool!(db, read, |pool| {
        sqlx::query_as(
            "SELECT id, receipt, received_at, tries FROM pending_receipts WHERE next_try_at <= $1 \
             ORDER BY next_try_at LIMIT $2",
        )
        .bind(now)
        .bind(limit)
        .fetch_all(pool)
        .await?
    }))
}

/// Removes kept receipt `row` (`done`: matched or expired), or counts a
/// try and makes it due again at `next`.
pub async fn settle_kept(db: &Db, row: i64, done: bool, next: i64) -> anyhow::Result<()> {
    in_transaction!(db, |tx| {
        if done {
            sqlx::query("DELETE FROM pending_receipts WHERE id = $1")
                .bind(row)
                .execute(&mut *tx)
                .await?
                .rows_affected()
        } else {
            sqlx::query(
                "UPDATE pending_receipts SET tries = tries + 1, next_try_at = $1 WHERE id = $2",
            )
            .bind(next)
            .bind(row)
            .execute(&mut *tx)
            .await?
            .rows_affected()
        }
    });
    Ok(())
}
