//! Receipts on SQLite: applying one in the store writer's transaction, and
//! the receipts kept for a later match.

use crate::store::StoreResult;
use async_trait::async_trait;

use super::{SqliteDb, args, tuple};
use crate::model::{MessageStatus, now_ms};
use crate::store::receipts::{
    Applied, KeptReceipt, Receipt, ReceiptStore, decide, error_after, recipient_upsert_tail,
    reported_recipients, suppress_reason, to_suppress,
};

/// Records one recipient's status ([`recipient_upsert_tail`]).
static RECIPIENT_UPSERT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "INSERT INTO recipient_statuses (message_id, address, tenant_id, status, detail, \
         updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6) {}",
        recipient_upsert_tail("IS NOT")
    )
});

/// Records `receipt` in the SQLite writer's transaction `tx` (a piece of
/// its group), so a receipt does not commit alone; [`crate::store::postgres::receipts::apply_group`] does
/// the same for a whole group on PostgreSQL.
pub(crate) fn apply_in(
    tx: &rusqlite::Transaction,
    receipt: &Receipt,
    now: i64,
) -> anyhow::Result<Applied> {
    let found = find(tx, receipt)?;
    let Some((id, tenant_id, status, attempts, sent_at)) = found else {
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
    let mut recipients_moved = 0;
    for (address, detail) in reported_recipients(receipt) {
        recipients_moved += tx
            .prepare_cached(&RECIPIENT_UPSERT)?
            .execute(rusqlite::params![
                id,
                address,
                tenant_id,
                receipt.recipient_status(),
                detail,
                now
            ])?;
    }
    if duplicate && recipients_moved == 0 {
        return Ok(Applied::Duplicate);
    }
    // A report the message has already had, but news for one of its
    // recipients (a second address delivered, another complaining): no
    // event, the recipient's status and suppression only.
    if !duplicate {
        if let Some(outcome) = decision.moves {
            let error = error_after(receipt, outcome);
            super::lifecycle::receipt(tx, &id, outcome, error.as_deref(), now)?;
        }
        super::lifecycle::event(
            tx,
            &super::lifecycle::Event {
                message_id: &id,
                tenant_id: &tenant_id,
                at: now,
                name: &decision.event,
                status: decision.after,
                attempts,
                detail: receipt.detail.as_deref(),
                provider_message_id: Some(&receipt.provider_message_id),
            },
        )?;
    }
    for (channel, address) in to_suppress(receipt) {
        tx.prepare_cached(super::suppressions::INSERT)?
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
        changed: !duplicate && decision.moves.is_some(),
        sent_at,
    })
}

/// A message a receipt names: its id, tenant, status, attempts and
/// `sent_at`.
type Found = (String, String, String, i64, Option<i64>);

/// The message `receipt` names: by fairlane's id when the provider carried it back (the
/// key); by the provider's id otherwise, among the messages sent before
/// receipts carried fairlane's id (the only ones its index holds).
fn find(tx: &rusqlite::Transaction, receipt: &Receipt) -> rusqlite::Result<Option<Found>> {
    use rusqlite::OptionalExtension;
    Ok(match &receipt.message_id {
        Some(message_id) => tx
            .prepare_cached(
                "SELECT id, tenant_id, status, attempts, sent_at FROM messages \
                 WHERE id = ?1 AND provider_message_id = ?2 \
                 AND (provider = ?3 OR provider IS NULL)",
            )?
            .query_row(
                [message_id, &receipt.provider_message_id, &receipt.provider],
                tuple,
            )
            .optional()?,
        None => tx
            .prepare_cached(
                "SELECT id, tenant_id, status, attempts, sent_at FROM messages \
                 WHERE provider_message_id = ?1 AND receipt_by_id IS NULL \
                 AND (provider = ?2 OR provider IS NULL) LIMIT 1",
            )?
            .query_row([&receipt.provider_message_id, &receipt.provider], tuple)
            .optional()?,
    })
}

#[async_trait]
impl ReceiptStore for SqliteDb {
    async fn keep_receipt(
        &self,
        receipt: &Receipt,
        json: &str,
        next_try_at: i64,
    ) -> StoreResult<()> {
        const KEEP: &str = "INSERT INTO pending_receipts \
             (provider, provider_message_id, receipt, received_at, next_try_at, tries) \
             VALUES (?1, ?2, ?3, ?4, ?5, 0)";
        let args = args![
            receipt.provider.clone(),
            receipt.provider_message_id.clone(),
            json.to_owned(),
            now_ms(),
            next_try_at
        ];
        self.execute(KEEP, args).await?;
        Ok(())
    }

    async fn kept_receipts_due(&self, now: i64, limit: i64) -> StoreResult<Vec<KeptReceipt>> {
        const DUE: &str = "SELECT id, receipt, received_at, tries FROM pending_receipts \
             WHERE next_try_at <= ?1 ORDER BY next_try_at LIMIT ?2";
        Ok(self.rows(DUE, args![now, limit], tuple).await?)
    }

    async fn settle_kept_receipt(&self, row: i64, done: bool, next: i64) -> StoreResult<()> {
        if done {
            self.execute("DELETE FROM pending_receipts WHERE id = ?1", args![row])
                .await?;
        } else {
            self.execute(
                "UPDATE pending_receipts SET tries = tries + 1, next_try_at = ?1 WHERE id = ?2",
                args![next, row],
            )
            .await?;
        }
        Ok(())
    }
}
