//! Provider receipts: what happened to a message after the provider took it.
//!
//! A Twilio-compatible SMS API calls back ([`twilio`]); SES publishes events
//! to SNS, which fairlane reads from an SQS queue ([`ses`]). Both turn what
//! they read into a [`Receipt`], and [`apply`] records it in one
//! transaction: the message's new status (`delivered`, `bounced`,
//! `complained`, `failed`), its event with the provider's detail, and for a
//! hard bounce or a complaint the address on the tenant's suppression list.
//! The event's insert also queues the tenant's webhook, in the same
//! transaction (see the migration's trigger).
//!
//! A receipt can arrive before fairlane has recorded the provider's id (the
//! provider answers the send and calls back at once; the `sent` commit is
//! a moment later). Such a receipt is kept in `pending_receipts` and matched
//! again every few seconds for `receipts.match_for_secs` (default 10
//! minutes), then dropped with a warning.

pub mod ses;
pub mod twilio;

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::metrics as names;
use crate::model::{MessageStatus, now_ms};
use crate::store::suppressions;
use crate::store::{Db, in_transaction, on_pool};

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

/// What [`apply`] did.
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

/// Records `receipt` against its message, all in one transaction.
pub async fn apply(db: &Db, receipt: &Receipt) -> anyhow::Result<Applied> {
    let now = now_ms();
    let applied = in_transaction!(db, |tx| {
        let found: Option<(String, String, String, String, i64)> = sqlx::query_as(
            "SELECT id, tenant_id, status, channel, attempts FROM messages \
             WHERE provider_message_id = $1 LIMIT 1",
        )
        .bind(&receipt.provider_message_id)
        .fetch_optional(&mut *tx)
        .await?;
        match found {
            None => Applied::Unmatched,
            Some((id, tenant_id, status, channel, attempts)) => {
                let current: MessageStatus = status.parse().map_err(anyhow::Error::msg)?;
                let moves =
                    receipt
                        .outcome
                        .filter(|outcome| match (rank(*outcome), rank(current)) {
                            (Some(new), Some(old)) => new > old,
                            _ => false,
                        });
                let duplicate = receipt.outcome.is_some() && receipt.outcome == Some(current);
                if duplicate {
                    Applied::Duplicate
                } else {
                    let (event, after) = match (moves, receipt.outcome) {
                        (Some(outcome), _) => (outcome.as_str().to_owned(), outcome),
                        // Reported, but the message is already further on.
                        (None, Some(outcome)) => {
                            (format!("provider_{}", outcome.as_str()), current)
                        }
                        (None, None) => (receipt.event.clone(), current),
                    };
                    if let Some(outcome) = moves {
                        // `last_error` carries a failure's reason; a delivery clears it.
                        let error = (outcome != MessageStatus::Delivered)
                            .then(|| receipt.detail.clone())
                            .flatten();
                        sqlx::query(
                            "UPDATE messages SET status = $1, last_error = $2, updated_at = $3 WHERE id = $4",
                        )
                        .bind(outcome.as_str())
                        .bind(error)
                        .bind(now)
                        .bind(&id)
                        .execute(&mut *tx)
                        .await?;
                    }
                    sqlx::query(
                        "INSERT INTO message_events (message_id, tenant_id, at, event, status, attempts, detail, provider_message_id) \
                         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                    )
                    .bind(&id)
                    .bind(&tenant_id)
                    .bind(now)
                    .bind(&event)
                    .bind(after.as_str())
                    .bind(attempts)
                    .bind(&receipt.detail)
                    .bind(&receipt.provider_message_id)
                    .execute(&mut *tx)
                    .await?;
                    for address in &receipt.suppress {
                        let Some((channel, address)) = suppressions::normalize(address) else {
                            continue;
                        };
                        sqlx::query(suppressions::INSERT)
                            .bind(&tenant_id)
                            .bind(&address)
                            .bind(channel.as_str())
                            .bind(receipt.suppress_reason.as_deref().unwrap_or("bounce"))
                            .bind(&receipt.detail)
                            .bind(&id)
                            .bind(now)
                            .execute(&mut *tx)
                            .await?;
                    }
                    let _ = channel;
                    Applied::Matched {
                        message_id: id,
                        tenant_id,
                        changed: moves.is_some(),
                    }
                }
            }
        }
    });
    Ok(applied)
}

/// Applies `receipt`, keeping it for a later match when its message is not
/// found yet; counts it. An error means it was neither applied nor kept,
/// and the caller must not acknowledge it to the provider.
pub async fn ingest(db: &Db, receipt: &Receipt) -> anyhow::Result<Applied> {
    let applied = apply(db, receipt).await?;
    let label = match &applied {
        Applied::Matched {
            message_id,
            tenant_id,
            changed,
        } => {
            info!(%tenant_id, %message_id, provider = %receipt.provider, event = %receipt.event, changed, "Receipt recorded.");
            receipt.outcome_label()
        }
        Applied::Duplicate => "duplicate",
        Applied::Unmatched => {
            keep_for_later(db, receipt).await?;
            debug!(provider = %receipt.provider, provider_message_id = %receipt.provider_message_id, "Receipt for an unknown provider id kept for a later match.");
            "pending"
        }
    };
    count(receipt, label);
    Ok(applied)
}

/// Counts a receipt under `label` in [`names::RECEIPTS_TOTAL`].
fn count(receipt: &Receipt, label: &'static str) {
    let provider = if receipt.provider == "ses" {
        "ses"
    } else {
        "http"
    };
    metrics::counter!(names::RECEIPTS_TOTAL, "provider" => provider, "outcome" => label)
        .increment(1);
}

/// How long after the first try an unmatched receipt is tried again.
const FIRST_RETRY: Duration = Duration::from_secs(2);

async fn keep_for_later(db: &Db, receipt: &Receipt) -> anyhow::Result<()> {
    let now = now_ms();
    let json = serde_json::to_string(receipt)?;
    in_transaction!(db, |tx| {
        sqlx::query(
            "INSERT INTO pending_receipts (provider, provider_message_id, receipt, received_at, next_try_at, tries) \
             VALUES ($1, $2, $3, $4, $5, 0)",
        )
        .bind(&receipt.provider)
        .bind(&receipt.provider_message_id)
        .bind(json)
        .bind(now)
        .bind(now + FIRST_RETRY.as_millis() as i64)
        .execute(&mut *tx)
        .await?;
    });
    Ok(())
}

/// How often kept receipts are matched again.
const RETRY_TICK: Duration = Duration::from_secs(1);

/// Most kept receipts matched again per tick.
const RETRY_BATCH: i64 = 500;

/// Matches kept receipts again until they match or are older than
/// `match_for`; runs until shutdown. Several instances may run it: a
/// receipt applied twice is recognised as a duplicate.
pub async fn retry_unmatched(db: Db, match_for: Duration, mut shutdown: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(RETRY_TICK) => {}
            _ = shutdown.changed() => return,
        }
        if let Err(err) = retry_due(&db, match_for).await {
            warn!(error = %format!("{err:#}"), "Could not match kept receipts; trying again shortly.");
        }
    }
}

/// One pass over the kept receipts that are due.
pub async fn retry_due(db: &Db, match_for: Duration) -> anyhow::Result<()> {
    let now = now_ms();
    let due: Vec<(i64, String, i64, i64)> = on_pool!(db, read, |pool| {
        sqlx::query_as(
            "SELECT id, receipt, received_at, tries FROM pending_receipts WHERE next_try_at <= $1 \
             ORDER BY next_try_at LIMIT $2",
        )
        .bind(now)
        .bind(RETRY_BATCH)
        .fetch_all(pool)
        .await?
    });
    for (row, json, received_at, tries) in due {
        let receipt: Option<Receipt> = serde_json::from_str(&json).ok();
        let settled = match &receipt {
            None => true,
            Some(receipt) => !matches!(apply(db, receipt).await?, Applied::Unmatched),
        };
        let expired = now - received_at >= match_for.as_millis() as i64;
        if let Some(receipt) = &receipt {
            let label = if settled {
                receipt.outcome_label()
            } else if expired {
                "unmatched"
            } else {
                ""
            };
            if !label.is_empty() {
                count(receipt, label);
            }
            if expired && !settled {
                warn!(provider = %receipt.provider, provider_message_id = %receipt.provider_message_id, event = %receipt.event, "No message has this provider id; the receipt is dropped.");
            }
        }
        // Tried again after 2, 4, 8 … s, at most a minute apart.
        let next = now + (2_000i64 << tries.clamp(0, 5)).min(60_000);
        in_transaction!(db, |tx| {
            if settled || expired {
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
    }
    Ok(())
}
