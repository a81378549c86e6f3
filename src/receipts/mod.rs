//! Provider receipts: what happened to a message after the provider took it.
//!
//! A Twilio-compatible SMS API calls back ([`twilio`]); SES publishes events
//! to SNS, which fairlane reads from an SQS queue ([`ses`]). Both turn what
//! they read into a [`Receipt`], and [`ingest`] records it as one piece of
//! the store writer's group: the message's new status (`delivered`, `bounced`,
//! `complained`, `failed`), its event with the provider's detail, and for a
//! hard bounce or a complaint the address on the tenant's suppression list.
//! The event's insert also queues the tenant's webhook, in the same
//! transaction (see `crate::store::lifecycle`).
//!
//! A receipt can arrive before fairlane has recorded the provider's id (the
//! provider answers the send and calls back at once; the `sent` commit is
//! a moment later). Such a receipt is kept in `pending_receipts` and matched
//! again every few seconds for `receipts.match_for_secs` (default 10
//! minutes), then dropped with a warning.

pub mod ses;
pub mod twilio;

use std::time::Duration;

use tokio::sync::watch;
use tracing::{Instrument, debug, info, warn};

use crate::metrics as names;
use crate::model::now_ms;

pub use crate::store::receipts::{Applied, Receipt, ReportedRecipient};
use crate::store::{Db, Writer};

/// Applies `receipt`, keeping it for a later match when its message is not
/// found yet; counts it. An error means it was neither applied nor kept,
/// and the caller must not acknowledge it to the provider.
pub async fn ingest(db: &Db, writer: &Writer, receipt: &Receipt) -> anyhow::Result<Applied> {
    // Its own trace (or the callback request's): found from the message's
    // by `messaging.message.id`.
    let span = crate::telemetry::span!(
        "receipt",
        otel.name = %format!("receipt {}", receipt.event),
        fairlane.provider = %receipt.provider,
        fairlane.receipt.event = %receipt.event,
    );
    let applied = writer
        .apply_receipt(receipt)
        .instrument(span.clone())
        .await?;
    let label = match &applied {
        Applied::Matched {
            message_id,
            tenant_id,
            changed,
            ..
        } => {
            crate::telemetry::attribute(&span, "messaging.message.id", message_id.clone());
            crate::telemetry::attribute(&span, "fairlane.tenant_id", tenant_id.clone());
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
    crate::telemetry::attribute(&span, "fairlane.outcome", label);
    count(receipt, label);
    Ok(applied)
}

/// Counts a receipt under `label` in [`names::RECEIPTS_TOTAL`].
/// The provider label is the reporting provider's configured name (SES
/// events: `ses`), so its values are bounded by the configuration.
fn count(receipt: &Receipt, label: &'static str) {
    metrics::counter!(names::RECEIPTS_TOTAL, "provider" => receipt.provider.clone(), "outcome" => label)
        .increment(1);
}

/// How long after the first try an unmatched receipt is tried again.
const FIRST_RETRY: Duration = Duration::from_secs(2);

async fn keep_for_later(db: &Db, receipt: &Receipt) -> anyhow::Result<()> {
    let json = serde_json::to_string(receipt)?;
    Ok(db
        .keep_receipt(receipt, &json, now_ms() + FIRST_RETRY.as_millis() as i64)
        .await?)
}

/// How often kept receipts are matched again.
const RETRY_TICK: Duration = Duration::from_secs(1);

/// Most kept receipts matched again per tick.
const RETRY_BATCH: i64 = 500;

/// Matches kept receipts again until they match or are older than
/// `match_for`; runs until shutdown. Several instances may run it: a
/// receipt applied twice is recognised as a duplicate.
pub async fn retry_unmatched(
    db: Db,
    writer: Writer,
    match_for: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(RETRY_TICK) => {}
            _ = shutdown.changed() => return,
        }
        if let Err(err) = retry_due(&db, &writer, match_for).await {
            warn!(error = %format!("{err:#}"), "Could not match kept receipts; trying again shortly.");
        }
    }
}

/// One pass over the kept receipts that are due.
pub async fn retry_due(db: &Db, writer: &Writer, match_for: Duration) -> anyhow::Result<()> {
    let now = now_ms();
    let due = db.kept_receipts_due(now, RETRY_BATCH).await?;
    for (row, json, received_at, tries) in due {
        let receipt: Option<Receipt> = serde_json::from_str(&json).ok();
        let settled = match &receipt {
            None => true,
            Some(receipt) => !matches!(writer.apply_receipt(receipt).await?, Applied::Unmatched),
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
        db.settle_kept_receipt(row, settled || expired, next)
            .await?;
    }
    Ok(())
}
