//! A message's life in one place: its states, the moves between them and
//! what each move writes besides the status.
//!
//! ```text
//!             accept                claim           sent
//!   (none) ─────────► scheduled ─► queued ─────► sending ──────► sent ──► delivered
//!                         │  due ▲   ▲  │            │                 ├─► bounced
//!                         │      │   │  │ cancel     │ retry           ├─► failed
//!                         │      │   │  ▼            ▼                 └─► complained
//!                         │      │   │ cancelled   retrying ─► (claim again)
//!                         │      │   │                │
//!                         │      │   └── redrive ── dead_lettered ◄── dead letter
//!                         │      └── release (a sender that died, SQLite)
//!                         └── (any waiting state) ─► suppressed, rejected
//! ```
//!
//! Each backend has one file that writes `messages.status`
//! (`store/sqlite/lifecycle.rs`, `store/postgres/lifecycle.rs`); each of its
//! statements takes the states a move may start from out of [`Move::from`],
//! so a move from anywhere else changes nothing, and writes in the same
//! transaction what [`Effects::of`] says: the event in the message's
//! history, the usage counter, and the unmarking of an erased message. No
//! SQL trigger does any of it (migrations 0017 dropped them).

use crate::model::MessageStatus::{self, *};

/// Why a message's status changes: each cause is one move of the diagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Move {
    /// A consumer takes the message for its provider call.
    Claim,
    /// The provider took it.
    Sent,
    /// A failure that will be tried again.
    Retry,
    /// Given up on: the lane's dead-letter queue holds it.
    DeadLetter,
    /// Its address is on the tenant's suppression list.
    Suppress,
    /// The provider refused it for good before sending.
    Reject,
    /// The tenant or an operator cancelled it while it waited.
    Cancel,
    /// A scheduled message reached its lane.
    Due,
    /// Its sender died mid-call (one SQLite instance at start-up).
    Release,
    /// An operator moved it back from the dead-letter queue.
    Redrive,
    /// A redrive that could not move it after all.
    Restore,
    /// A provider's receipt moved it on (to delivered, bounced, failed or
    /// complained, as [`super::receipts`] decides).
    Receipt(MessageStatus),
}

/// The states a message waits in, for a consumer or a schedule.
const WAITING: &[MessageStatus] = &[Scheduled, Queued, Retrying];
/// Waiting, or taken by a consumer. A failure may follow a failure: two
/// senders of one message (a stale claim taken over) each fail once.
const UNSETTLED: &[MessageStatus] = &[Scheduled, Queued, Retrying, Sending];
/// What a provider took may still be written as taken: a sender whose stale
/// claim was taken over, or a copy dead-lettered while the call was out,
/// must not leave a sent message to be sent again. A second `sent` of a
/// sent message only updates the provider's id.
const SENDABLE: &[MessageStatus] = &[Scheduled, Queued, Retrying, Sending, Sent, DeadLettered];
/// Anything a redrive may put back: not what was sent or refused.
const REDRIVABLE: &[MessageStatus] = &[
    Scheduled,
    Queued,
    Retrying,
    Sending,
    DeadLettered,
    Suppressed,
    Cancelled,
];
/// What a receipt may move on from (its order is [`super::receipts`]'s).
const RECEIVED: &[MessageStatus] = &[Sent, Delivered, Failed, Bounced, Complained];

impl Move {
    /// The status the message has after the move.
    pub fn to(self) -> MessageStatus {
        match self {
            Move::Claim => Sending,
            Move::Sent => Sent,
            Move::Retry => Retrying,
            Move::DeadLetter | Move::Restore => DeadLettered,
            Move::Suppress => Suppressed,
            Move::Reject => Rejected,
            Move::Cancel => Cancelled,
            Move::Due | Move::Release | Move::Redrive => Queued,
            Move::Receipt(outcome) => outcome,
        }
    }

    /// The states the move may start from; from any other the store
    /// changes nothing. A claim also takes over a `sending` whose claim
    /// went stale (its sender died), which the claim's statement checks.
    pub fn from(self) -> &'static [MessageStatus] {
        match self {
            Move::Claim | Move::Cancel => WAITING,
            Move::Sent => SENDABLE,
            Move::Retry | Move::DeadLetter | Move::Suppress | Move::Reject => UNSETTLED,
            Move::Due => &[Scheduled],
            Move::Release => &[Sending],
            Move::Redrive => REDRIVABLE,
            Move::Restore => &[Queued],
            Move::Receipt(_) => RECEIVED,
        }
    }

    /// The delivery path's failure moves.
    pub const FAILURES: [Move; 4] = [Move::Retry, Move::DeadLetter, Move::Suppress, Move::Reject];

    /// The failure move that writes `to`, if one does.
    pub fn failure(to: MessageStatus) -> Option<Move> {
        Move::FAILURES.into_iter().find(|step| step.to() == to)
    }

    /// `from` as a SQL list of the store's words: `'queued', 'retrying'`.
    pub fn sources_sql(self) -> String {
        sql_list(self.from())
    }
}

/// A failure's move and what it writes with the status: `counted` adds an
/// attempt, `error` (if any) becomes `last_error`, and a provider that was
/// called (with whether the next attempt must go to it again) is kept.
#[derive(Debug, Clone, Copy)]
pub struct Failure<'a> {
    /// One of [`Move::FAILURES`].
    pub step: Move,
    pub error: Option<&'a str>,
    pub counted: bool,
    pub provider: Option<&'a str>,
    pub pinned: Option<bool>,
}

impl Failure<'_> {
    /// Where the move is in [`Move::FAILURES`] (a backend's statements are
    /// kept in that order).
    pub fn index(&self) -> usize {
        Move::FAILURES
            .iter()
            .position(|step| *step == self.step)
            .unwrap_or_else(|| unreachable!("{:?} is not a failure", self.step))
    }
}

/// Whether a status change is written to the message's history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// Not an event: `sending` is a moment, and a receipt writes its own
    /// event with the provider's name for it and its detail.
    No,
    Yes,
    /// `sent` happens once to every delivered message and the message row
    /// keeps its time and provider id, so the history reads it from there;
    /// it is an event only for a tenant with a webhook, whose call the
    /// event is.
    WithWebhook,
}

/// The detail of a redrive's event.
pub const REDRIVEN: &str = "redriven: back in its lane, its attempts counted from 0 again";

/// What a change of status to a state writes besides the status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Effects {
    pub event: Recorded,
    /// The event carries the message's `last_error` as its detail.
    pub detail: bool,
    /// The event's detail when it is not an error: what the move was, where
    /// its status alone does not say (a redrive's `queued`).
    pub note: Option<&'static str>,
    /// The usage counter the change adds one to (`usage`'s column).
    pub counter: Option<&'static str>,
    /// A change after the message's erasure marks it unerased, so the next
    /// retention run looks at it again (the error may quote an address).
    pub unerases: bool,
}

impl Effects {
    /// The effects of `step` (the store writes none when the status
    /// stays). A redrive counts `redriven`, so that `dead_lettered` less
    /// `redriven` is what the dead-letter queue holds of a period; a
    /// restore undoes a redrive, so it counts the dead letter again.
    pub fn of(step: Move) -> Effects {
        let to = step.to();
        let event = match to {
            Sending | Delivered | Bounced | Complained | Failed => Recorded::No,
            Sent => Recorded::WithWebhook,
            _ => Recorded::Yes,
        };
        let counter = match to {
            Sent => Some("sent"),
            Delivered => Some("delivered"),
            Bounced => Some("bounced"),
            Complained => Some("complained"),
            Failed => Some("failed"),
            DeadLettered => Some("dead_lettered"),
            Suppressed => Some("suppressed"),
            Cancelled => Some("cancelled"),
            Rejected => Some("rejected"),
            Queued if step == Move::Redrive => Some("redriven"),
            Scheduled | Queued | Sending | Retrying => None,
        };
        Effects {
            event,
            detail: matches!(to, Retrying | DeadLettered | Suppressed | Rejected),
            note: (step == Move::Redrive).then_some(REDRIVEN),
            counter,
            unerases: !matches!(to, Scheduled | Queued | Sending | Sent),
        }
    }
}

/// `statuses` as a SQL list of quoted words.
fn sql_list(statuses: &[MessageStatus]) -> String {
    statuses
        .iter()
        .map(|status| format!("'{}'", status.as_str()))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// True when some move takes a message from `from` to `to`.
    fn may(from: MessageStatus, to: MessageStatus) -> bool {
        ALL_MOVES
            .iter()
            .chain(RECEIPT_MOVES.iter())
            .any(|step| step.to() == to && step.from().contains(&from))
    }

    const ALL_MOVES: [Move; 11] = [
        Move::Claim,
        Move::Sent,
        Move::Retry,
        Move::DeadLetter,
        Move::Suppress,
        Move::Reject,
        Move::Cancel,
        Move::Due,
        Move::Release,
        Move::Redrive,
        Move::Restore,
    ];
    const RECEIPT_MOVES: [Move; 4] = [
        Move::Receipt(Delivered),
        Move::Receipt(Bounced),
        Move::Receipt(Failed),
        Move::Receipt(Complained),
    ];

    /// The usage counters a change to each status adds to, in `usage`'s column
    /// order after `accepted` (`fragments` rides with `sent`).
    const COUNTED: [MessageStatus; 9] = [
        Sent,
        Delivered,
        Bounced,
        Complained,
        Failed,
        DeadLettered,
        Suppressed,
        Cancelled,
        Rejected,
    ];

    #[test]
    fn no_move_starts_from_where_it_ends_but_a_second_send_or_failure() {
        for step in ALL_MOVES.iter().chain(RECEIPT_MOVES.iter()) {
            let again = step.from().contains(&step.to());
            assert_eq!(
                again,
                matches!(
                    step,
                    Move::Sent | Move::Retry | Move::Redrive | Move::Receipt(_)
                ),
                "{step:?}"
            );
        }
    }

    #[test]
    fn nothing_leaves_a_refused_message_and_nothing_sends_twice() {
        for to in MessageStatus::ALL {
            assert!(!may(Rejected, *to), "rejected → {to:?}");
            if *to != Sent {
                assert!(!may(Sent, *to) || to.is_receipt(), "sent → {to:?}");
            }
        }
        assert!(
            !may(Cancelled, Sending),
            "a cancelled message is never claimed"
        );
        assert!(
            !may(Delivered, Queued),
            "a delivered message is never redriven"
        );
        assert!(may(DeadLettered, Queued) && may(Queued, DeadLettered));
    }

    #[test]
    fn every_counted_outcome_has_its_counter_and_only_those() {
        for step in ALL_MOVES.iter().chain(RECEIPT_MOVES.iter()) {
            let counter = Effects::of(*step).counter;
            let counted = COUNTED.contains(&step.to()) || *step == Move::Redrive;
            assert_eq!(counter.is_some(), counted, "{step:?}");
            if let Some(column) = counter {
                let expected = match step {
                    Move::Redrive => "redriven",
                    _ => step.to().as_str(),
                };
                assert_eq!(column, expected);
            }
        }
    }

    #[test]
    fn receipts_move_only_where_the_lifecycle_lets_them() {
        use crate::store::receipts::{Receipt, decide};
        for current in MessageStatus::ALL {
            for outcome in [Delivered, Bounced, Failed, Complained] {
                let receipt = Receipt {
                    provider: "ses".into(),
                    provider_message_id: "p".into(),
                    message_id: None,
                    outcome: Some(outcome),
                    event: outcome.as_str().into(),
                    detail: None,
                    suppress: Vec::new(),
                    suppress_reason: None,
                    recipients: Vec::new(),
                };
                if let Some(moved) = decide(&receipt, *current).moves {
                    assert!(may(*current, moved), "{current:?} → {moved:?}");
                }
            }
        }
    }

    #[test]
    fn lists_quote_the_stores_words() {
        assert_eq!(
            Move::Cancel.sources_sql(),
            "'scheduled', 'queued', 'retrying'"
        );
    }

    /// The moves of one store, read back from outside: each writes its
    /// status, event (which its tenant's webhook reads) and usage count as
    /// [`Effects::of`] says,
    /// a move from the wrong state changes nothing, and the store has no
    /// trigger left to do any of it behind the code's back.
    pub(crate) async fn moves_write_what_the_lifecycle_says(db: &crate::store::Db) {
        use crate::model::{Scope, World};
        use crate::store::{Writer, usage};
        db.test_execute(
            "INSERT INTO plans VALUES ('p', 'fast', 1, 1, 1, 1, 'admin', 0, 60, 0); \
             INSERT INTO tenants (id, name, plan, status, created_at, updated_at) \
             VALUES ('hooked', 'h', 'p', 'active', 0, 0); \
             INSERT INTO webhooks (tenant_id, url, events, secret, created_at, updated_at) \
             VALUES ('hooked', 'https://example.com/h', \
             ' message.sent message.cancelled message.retrying ', 's', 0, 0);",
        )
        .await;
        let (writer, done) = Writer::start(db, 64, 0).unwrap();
        let ids = ["plain", "hooked-1", "retried", "hooked-2", "late"];
        for id in ids {
            let tenant = if id.starts_with("hooked") {
                "hooked"
            } else {
                "acme"
            };
            writer
                .accept(crate::store::hot::tests::queued_entry(id, tenant))
                .await
                .unwrap();
        }
        for id in ["plain", "hooked-1", "retried"] {
            assert!(writer.claim(id, 0).await.unwrap(), "{id} claimed");
        }
        writer.sent_by("plain", "SM1", None).await.unwrap();
        writer.sent_by("hooked-1", "SM2", None).await.unwrap();
        let attempts = writer
            .failure("retried", Retrying, "503 from provider", true)
            .await
            .unwrap();
        assert_eq!(attempts, 1);
        let hooked = Scope::new("hooked", World::Live);
        assert_eq!(
            writer
                .cancel(&hooked, vec!["hooked-2".into()])
                .await
                .unwrap(),
            ["hooked-2"]
        );
        // Moves from the wrong state: refused, nothing written.
        assert!(
            !writer.claim("hooked-2", 0).await.unwrap(),
            "cancelled is never claimed"
        );
        let after_sent = writer
            .failure("plain", Retrying, "late", true)
            .await
            .unwrap();
        assert_eq!(after_sent, 0, "a sent message does not go back to retrying");
        let acme = Scope::new("acme", World::Live);
        assert!(
            writer
                .cancel(&acme, vec!["plain".into()])
                .await
                .unwrap()
                .is_empty()
        );
        writer.stop().await;
        done.await.unwrap();

        let status =
            |id: &'static str| async move { db.message(id).await.unwrap().unwrap().status };
        assert_eq!(status("plain").await, Sent);
        assert_eq!(status("hooked-2").await, Cancelled);
        assert_eq!(status("late").await, Queued);
        let events = db
            .test_texts(
                "SELECT message_id, event, detail FROM message_events ORDER BY message_id, id",
            )
            .await;
        let event = |id: &str, word: &str, detail: Option<&str>| {
            vec![
                Some(id.to_owned()),
                Some(word.to_owned()),
                detail.map(str::to_owned),
            ]
        };
        assert_eq!(
            events,
            [
                event("hooked-1", "sent", None),
                event("hooked-2", "cancelled", None),
                event("retried", "retrying", Some("503 from provider")),
            ],
            "a claim is no event, and `sent` is one only for a tenant with a webhook"
        );
        // No call rows: the endpoint reads its tenant's events, and finds
        // the two of the types it wants waiting (`retrying` was acme's).
        let rows = db
            .test_count("SELECT COUNT(*) FROM webhook_deliveries")
            .await;
        assert_eq!(rows, 0, "an event is no call row");
        let backlog = db
            .webhook_delivery_counts("hooked", i64::MAX)
            .await
            .unwrap();
        assert_eq!(
            backlog
                .iter()
                .map(|c| (c.state.as_str(), c.count, c.due))
                .collect::<Vec<_>>(),
            [("pending", 2, 2)],
            "{backlog:?}"
        );
        let rows = db
            .usage(usage::Whose::Everyone, 0, i64::MAX / 86_400_000)
            .await
            .unwrap();
        let sum = |pick: fn(&usage::UsageRow) -> i64| rows.iter().map(pick).sum::<i64>();
        assert_eq!(
            (
                sum(|r| r.accepted),
                sum(|r| r.sent),
                sum(|r| r.cancelled),
                sum(|r| r.failed)
            ),
            (5, 2, 1, 0),
            "{rows:?}"
        );
        let triggers = db
            .test_count(match db {
                crate::store::Db::Sqlite(_) => {
                    "SELECT COUNT(*) FROM sqlite_master WHERE type = 'trigger'"
                }
                crate::store::Db::Postgres(_) => {
                    "SELECT COUNT(*) FROM pg_trigger WHERE NOT tgisinternal"
                }
            })
            .await;
        assert_eq!(triggers, 0, "no trigger writes behind the lifecycle's back");
    }

    #[tokio::test]
    async fn moves_write_what_the_lifecycle_says_on_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let db = crate::store::Db::open(&dir.path().join("l.db"), false)
            .await
            .unwrap();
        moves_write_what_the_lifecycle_says(&db).await;
    }
}
