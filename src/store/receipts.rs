//! Provider receipts in the store: applying one to its message (status,
//! event, suppressions) in one transaction, and keeping those that beat
//! their message's `sent` record for a later match.

use serde::{Deserialize, Serialize};

use crate::store::StoreResult;
use async_trait::async_trait;

use super::suppressions;
use crate::model::MessageStatus;

/// What a provider reported about one message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    /// The configured name of the provider that reported it: the SMS
    /// provider whose callback URL it came to, the SES provider whose events
    /// queue held it, `test` for a test key's simulated one. Only a message
    /// that provider sent matches it (or one sent before fairlane recorded
    /// its provider), so one provider's callbacks cannot move another's
    /// messages.
    pub provider: String,
    /// The id the provider gave when it took the message.
    pub provider_message_id: String,
    /// fairlane's own id of the message, when the provider carried it back
    /// (SES's `message_id` message tag; the `message_id` in the URL of a
    /// Twilio status callback, which the callback's signature covers): the
    /// receipt then finds its message by its key, and the provider's id
    /// must be the one recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_id: Option<String>,
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
    /// The recipients the report names, each with the provider's words for
    /// it (SES: the delivered, bounced, complained or delayed addresses);
    /// empty when it names none (an SMS, a rejected email). Each address's
    /// status is kept beside the message's (`recipient_statuses`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recipients: Vec<ReportedRecipient>,
}

/// One address a provider's report names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportedRecipient {
    pub address: String,
    /// The provider's words for this address (a bounce's diagnostic, the
    /// receiving server's answer).
    pub detail: Option<String>,
}

impl Receipt {
    /// The metrics label of the report: its outcome, or `event` for a
    /// provider update.
    pub fn outcome_label(&self) -> &'static str {
        self.outcome.map_or("event", MessageStatus::as_str)
    }

    /// The status the report gives each recipient it names: its outcome's
    /// word, or the provider update's event (`transient_bounce`,
    /// `delivery_delayed`).
    pub fn recipient_status(&self) -> &str {
        match self.outcome {
            Some(outcome) => outcome.as_str(),
            None => &self.event,
        }
    }
}

/// What a receipt did to its message (`postgres::receipts::apply_group`, `apply_in`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// The message was found; `changed` when its status moved.
    Matched {
        message_id: String,
        tenant_id: String,
        changed: bool,
        /// When the message was sent (ms), for the provider's receipt
        /// latency.
        sent_at: Option<i64>,
    },
    /// The same report again: nothing recorded.
    Duplicate,
    /// No message has this provider id (yet).
    Unmatched,
}

/// Order of the states a receipt may move a message through: a report
/// only moves it forward (a complaint after a delivery, not a delivery
/// after a bounce).
pub(super) fn rank(status: MessageStatus) -> Option<u8> {
    match status {
        MessageStatus::Sent => Some(0),
        MessageStatus::Delivered => Some(1),
        MessageStatus::Failed | MessageStatus::Bounced => Some(2),
        MessageStatus::Complained => Some(3),
        _ => None,
    }
}

/// What a receipt does to a message whose status is `current`.
pub(super) struct Decision {
    /// The status the message moves to, if it moves.
    pub(super) moves: Option<MessageStatus>,
    /// The event's name in the history.
    pub(super) event: String,
    /// The status recorded with the event.
    pub(super) after: MessageStatus,
    /// The same outcome again: nothing to record.
    pub(super) duplicate: bool,
    /// A report that moves nothing: a duplicate if the same event was
    /// recorded before (a replayed callback, a provider's retry).
    pub(super) check_seen: bool,
}

pub(super) fn decide(receipt: &Receipt, current: MessageStatus) -> Decision {
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
pub(super) fn error_after(receipt: &Receipt, outcome: MessageStatus) -> Option<String> {
    (outcome != MessageStatus::Delivered)
        .then(|| receipt.detail.clone())
        .flatten()
}

/// The receipt's addresses to suppress, normalised (unreadable ones are
/// skipped).
pub(super) fn to_suppress(
    receipt: &Receipt,
) -> impl Iterator<Item = (crate::model::Channel, String)> + '_ {
    receipt
        .suppress
        .iter()
        .filter_map(|address| suppressions::normalize(address))
}

/// The recipients `receipt` names, as addresses are kept (lower case), with
/// the provider's words for each; unreadable and SMS ones are skipped.
pub(super) fn reported_recipients(
    receipt: &Receipt,
) -> impl Iterator<Item = (String, Option<&str>)> + '_ {
    receipt.recipients.iter().filter_map(|recipient| {
        match suppressions::normalize(&recipient.address)? {
            (crate::model::Channel::Email, address) => Some((address, recipient.detail.as_deref())),
            _ => None,
        }
    })
}

/// SQL for the [`rank`] of the recipient status in `column`; a provider
/// update that settles nothing (a delay, a transient bounce) ranks 0.
fn recipient_rank_sql(column: &str) -> String {
    let mut sql = format!("CASE {column}");
    for status in [
        MessageStatus::Delivered,
        MessageStatus::Failed,
        MessageStatus::Bounced,
        MessageStatus::Complained,
    ] {
        let rank = rank(status).unwrap_or(0);
        sql.push_str(&format!(" WHEN '{}' THEN {rank}", status.as_str()));
    }
    sql.push_str(" ELSE 0 END");
    sql
}

/// The end of the statement that records a recipient's status (`INSERT
/// INTO recipient_statuses (message_id, address, tenant_id, status, detail,
/// updated_at) …`): a recipient only moves forward, as a message does
/// ([`rank`]); among updates that settle nothing the latest wins; the same
/// word again changes no row. `distinct` is the dialect's null-safe
/// inequality (`IS NOT`, `IS DISTINCT FROM`).
pub(super) fn recipient_upsert_tail(distinct: &str) -> String {
    let new = recipient_rank_sql("excluded.status");
    let old = recipient_rank_sql("recipient_statuses.status");
    format!(
        "ON CONFLICT (message_id, address) DO UPDATE SET status = excluded.status, \
         detail = excluded.detail, updated_at = excluded.updated_at \
         WHERE {new} > {old} OR ({new} = 0 AND {old} = 0 \
         AND (excluded.status <> recipient_statuses.status \
         OR excluded.detail {distinct} recipient_statuses.detail))"
    )
}

pub(super) fn suppress_reason(receipt: &Receipt) -> &str {
    receipt.suppress_reason.as_deref().unwrap_or("bounce")
}

/// A kept receipt: row id, receipt JSON, when it was received (ms), tries
/// so far.
pub type KeptReceipt = (i64, String, i64, i64);

/// Receipts kept for a later match, on either backend. Applying a receipt
/// is a piece of the hot writer's group (`store::Writer::receipt`).
#[async_trait]
pub trait ReceiptStore: Send + Sync {
    /// Keeps `receipt` (as `json`) to be matched again from `next_try_at`.
    async fn keep_receipt(
        &self,
        receipt: &Receipt,
        json: &str,
        next_try_at: i64,
    ) -> StoreResult<()>;

    /// Up to `limit` kept receipts due at `now`.
    async fn kept_receipts_due(&self, now: i64, limit: i64) -> StoreResult<Vec<KeptReceipt>>;

    /// Removes kept receipt `row` (`done`: matched or expired), or counts a
    /// try and makes it due again at `next`.
    async fn settle_kept_receipt(&self, row: i64, done: bool, next: i64) -> StoreResult<()>;
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::store::Db;
    use crate::store::Writer;

    /// On `db`: a receipt moves only a message its own provider sent. Two
    /// providers gave one provider id (their ids are their own); each
    /// one's report moves its own message, and a report naming a provider
    /// that sent nothing with that id matches nothing.
    pub(crate) async fn a_receipt_moves_only_what_its_provider_sent(db: &Db) {
        let (writer, done) = Writer::start(db, 64, 0).unwrap();
        for (id, provider) in [("by-alpha", "alpha"), ("by-beta", "beta")] {
            writer
                .accept(crate::store::hot::tests::queued_entry(id, "acme"))
                .await
                .unwrap();
            assert!(writer.claim(id, 0).await.unwrap());
            writer.sent_by(id, "SM-SAME", Some(provider)).await.unwrap();
        }
        let report = |provider: &str, id: &str, outcome: MessageStatus| Receipt {
            provider: provider.into(),
            provider_message_id: "SM-SAME".into(),
            message_id: Some(id.into()),
            outcome: Some(outcome),
            event: outcome.as_str().into(),
            detail: None,
            suppress: Vec::new(),
            suppress_reason: None,
            recipients: Vec::new(),
        };
        let gamma = writer
            .apply_receipt(&report("gamma", "by-alpha", MessageStatus::Delivered))
            .await
            .unwrap();
        assert_eq!(gamma, Applied::Unmatched, "gamma sent nothing");
        let crossed = writer
            .apply_receipt(&report("beta", "by-alpha", MessageStatus::Failed))
            .await
            .unwrap();
        assert_eq!(crossed, Applied::Unmatched, "beta did not send by-alpha");
        let beta = writer
            .apply_receipt(&report("beta", "by-beta", MessageStatus::Failed))
            .await
            .unwrap();
        assert!(
            matches!(&beta, Applied::Matched { message_id, changed: true, .. } if message_id == "by-beta"),
            "{beta:?}"
        );
        let alpha = writer
            .apply_receipt(&report("alpha", "by-alpha", MessageStatus::Delivered))
            .await
            .unwrap();
        assert!(
            matches!(&alpha, Applied::Matched { message_id, changed: true, .. } if message_id == "by-alpha"),
            "{alpha:?}"
        );
        writer.stop().await;
        done.await.unwrap();
        let status =
            |id: &'static str| async move { db.message(id).await.unwrap().unwrap().status };
        assert_eq!(status("by-alpha").await, MessageStatus::Delivered);
        assert_eq!(status("by-beta").await, MessageStatus::Failed);
    }

    /// On `db`: reports naming recipients keep each address's status. A
    /// report the message already had is news for an address it had not
    /// named; a recipient moves only forward; reports applied in one group
    /// (several at once) end as if applied in turn; a complaint from a
    /// second address still suppresses it; retention deletes the rows.
    pub(crate) async fn recipients_keep_their_own_statuses(db: &Db) {
        let (writer, done) = Writer::start(db, 64, 0).unwrap();
        writer
            .accept(crate::store::hot::tests::queued_entry("many", "acme"))
            .await
            .unwrap();
        assert!(writer.claim("many", 0).await.unwrap());
        writer.sent_by("many", "SES-1", Some("ses")).await.unwrap();
        let report = |outcome: Option<MessageStatus>, event: &str, to: &[&str]| Receipt {
            provider: "ses".into(),
            provider_message_id: "SES-1".into(),
            message_id: Some("many".into()),
            outcome,
            event: event.into(),
            detail: Some(format!("{event} report")),
            suppress: match outcome {
                Some(MessageStatus::Complained) => to.iter().map(|a| a.to_string()).collect(),
                _ => Vec::new(),
            },
            suppress_reason: Some("complaint".into()),
            recipients: to
                .iter()
                .map(|address| ReportedRecipient {
                    address: address.to_string(),
                    detail: Some(format!("250 ok for {address}")),
                })
                .collect(),
        };
        let delivered = Some(MessageStatus::Delivered);
        let first = writer
            .apply_receipt(&report(
                delivered,
                "delivered",
                &["A@example.com", "b@example.com"],
            ))
            .await
            .unwrap();
        assert!(
            matches!(first, Applied::Matched { changed: true, .. }),
            "{first:?}"
        );
        // The message is delivered already; the news is c's.
        let second = writer
            .apply_receipt(&report(delivered, "delivered", &["c@example.com"]))
            .await
            .unwrap();
        assert!(
            matches!(second, Applied::Matched { changed: false, .. }),
            "{second:?}"
        );
        let again = writer
            .apply_receipt(&report(delivered, "delivered", &["c@example.com"]))
            .await
            .unwrap();
        assert_eq!(again, Applied::Duplicate);
        // At once (one group on PostgreSQL): d is delayed, then delivered,
        // then a delay comes late and changes nothing; b complains.
        let group = futures_util::future::join_all(
            [
                report(None, "delivery_delayed", &["d@example.com"]),
                report(delivered, "delivered", &["d@example.com"]),
                report(None, "delivery_delayed", &["d@example.com"]),
                report(
                    Some(MessageStatus::Complained),
                    "complained",
                    &["b@example.com"],
                ),
            ]
            .iter()
            .map(|receipt| writer.apply_receipt(receipt)),
        )
        .await;
        assert!(group.iter().all(Result::is_ok), "{group:?}");
        // The first report again, after b complained: a moves no further
        // back than delivered, and b stays complained.
        writer
            .apply_receipt(&report(
                delivered,
                "delivered",
                &["a@example.com", "b@example.com"],
            ))
            .await
            .unwrap();
        let b_again = writer
            .apply_receipt(&report(
                Some(MessageStatus::Complained),
                "complained",
                &["e@example.com"],
            ))
            .await
            .unwrap();
        assert!(
            matches!(b_again, Applied::Matched { changed: false, .. }),
            "{b_again:?}"
        );
        writer.stop().await;
        done.await.unwrap();

        let kept: Vec<(String, String)> = db
            .recipient_statuses("many")
            .await
            .unwrap()
            .into_iter()
            .map(|row| (row.address, row.status))
            .collect();
        let expected = [
            ("a@example.com", "delivered"),
            ("b@example.com", "complained"),
            ("c@example.com", "delivered"),
            ("d@example.com", "delivered"),
            ("e@example.com", "complained"),
        ]
        .map(|(a, s)| (a.to_owned(), s.to_owned()));
        assert_eq!(kept, expected);
        let c = &db.recipient_statuses("many").await.unwrap()[2];
        assert_eq!(c.detail.as_deref(), Some("250 ok for c@example.com"));
        let message = db.message("many").await.unwrap().unwrap();
        assert_eq!(message.status, MessageStatus::Complained);
        // The second complaining address is suppressed too.
        for address in ["b@example.com", "e@example.com"] {
            assert!(
                db.suppression("acme", address).await.unwrap().is_some(),
                "{address} suppressed"
            );
        }
        assert_eq!(db.erase_messages(&["many".to_owned()], 1).await.unwrap(), 1);
        assert!(db.recipient_statuses("many").await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn recipients_keep_their_own_statuses_on_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("r.db"), false).await.unwrap();
        recipients_keep_their_own_statuses(&db).await;
    }

    #[tokio::test]
    async fn a_receipt_moves_only_what_its_provider_sent_on_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("r.db"), false).await.unwrap();
        a_receipt_moves_only_what_its_provider_sent(&db).await;
    }
}
