//! Every write of a message's status on SQLite, each with what
//! [`crate::store::lifecycle`] says it brings: the event, the usage count,
//! the webhook call and the unmarking of an erased message, in the caller's
//! transaction. The store writer's pieces, the embedded queue's moves and
//! the rare writers ([`super::SqliteDb::transact`]) all call in here; no
//! other file writes `messages.status`, and no trigger does.

use std::sync::LazyLock;

use rusqlite::{Connection, OptionalExtension, params};

use super::usage::Pending;
use crate::message::MessageRecord;
use crate::model::MessageStatus;
use crate::store::lifecycle::{Effects, Failure, Move, Recorded};

/// What a moved row says, for the move's effects.
struct Moved {
    id: String,
    tenant_id: String,
    channel: String,
    test: bool,
    fragments: Option<i64>,
    attempts: i64,
    last_error: Option<String>,
    provider_message_id: Option<String>,
}

const RETURNING: &str =
    " RETURNING id, tenant_id, channel, test, fragments, attempts, last_error, provider_message_id";

fn moved(row: &rusqlite::Row) -> rusqlite::Result<Moved> {
    Ok(Moved {
        id: row.get(0)?,
        tenant_id: row.get(1)?,
        channel: row.get(2)?,
        test: row.get(3)?,
        fragments: row.get(4)?,
        attempts: row.get(5)?,
        last_error: row.get(6)?,
        provider_message_id: row.get(7)?,
    })
}

/// The statement of `step` for one message: `?1` is the time, `?2` the id,
/// `set` adds columns (its parameters from `?3`) and `also` conditions.
fn statement(step: Move, set: &str, also: &str) -> String {
    let erase = if Effects::of(step).unerases {
        ", erased_at = NULL"
    } else {
        ""
    };
    format!(
        "UPDATE messages SET status = '{}', updated_at = ?1{erase}{set} \
         WHERE id = ?2 AND status IN ({}){also}{RETURNING}",
        step.to().as_str(),
        step.sources_sql(),
    )
}

/// Writes the effects of `step` on `row`, changed at `now`.
fn effects(tx: &Connection, step: Move, row: &Moved, now: i64) -> rusqlite::Result<()> {
    let to = step.to();
    let effects = Effects::of(step);
    if let Some(counter) = effects.counter {
        Pending::reached(
            &row.tenant_id,
            now,
            &row.channel,
            row.test,
            counter,
            row.fragments,
        );
    }
    let recorded = match effects.event {
        Recorded::No => false,
        Recorded::Yes => true,
        Recorded::WithWebhook => has_webhook(tx, &row.tenant_id)?,
    };
    if recorded {
        event(
            tx,
            &Event {
                message_id: &row.id,
                tenant_id: &row.tenant_id,
                at: now,
                name: to.as_str(),
                status: to,
                attempts: row.attempts,
                detail: match effects.note {
                    Some(note) => Some(note),
                    None => row.last_error.as_deref().filter(|_| effects.detail),
                },
                provider_message_id: row.provider_message_id.as_deref(),
            },
        )?;
    }
    Ok(())
}

fn has_webhook(tx: &Connection, tenant_id: &str) -> rusqlite::Result<bool> {
    tx.prepare_cached("SELECT EXISTS (SELECT 1 FROM webhooks WHERE tenant_id = ?1)")?
        .query_row([tenant_id], |row| row.get(0))
}

/// One line of a message's history.
pub(crate) struct Event<'a> {
    pub message_id: &'a str,
    pub tenant_id: &'a str,
    pub at: i64,
    /// The status word, or a provider update's name.
    pub name: &'a str,
    /// The message's status after the event, and its attempts then.
    pub status: MessageStatus,
    pub attempts: i64,
    pub detail: Option<&'a str>,
    pub provider_message_id: Option<&'a str>,
}

/// Writes `event` (a tenant's webhook endpoint reads it from there, see
/// `store::webhooks`) and, when it carries a detail (a provider's
/// diagnostic may quote an address), unmarks an erased message.
pub(crate) fn event(tx: &Connection, event: &Event) -> rusqlite::Result<()> {
    tx.prepare_cached(
        "INSERT INTO message_events (message_id, tenant_id, at, event, status, attempts, detail, provider_message_id) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )?
    .execute(params![
        event.message_id,
        event.tenant_id,
        event.at,
        event.name,
        event.status.as_str(),
        event.attempts,
        event.detail,
        event.provider_message_id
    ])?;
    if event.detail.is_some() {
        tx.prepare_cached(
            "UPDATE messages SET erased_at = NULL WHERE id = ?1 AND erased_at IS NOT NULL",
        )?
        .execute([event.message_id])?;
    }
    Ok(())
}

/// An event that changes no status (`name`: `unsubscribed`, …) on
/// `tenant_id`'s message `message_id`, as its row stands; nothing when the
/// message is gone.
pub(crate) fn note(
    tx: &Connection,
    message_id: &str,
    tenant_id: &str,
    name: &str,
    now: i64,
) -> rusqlite::Result<()> {
    let row: Option<(String, i64, Option<String>)> = tx
        .prepare_cached(
            "SELECT status, attempts, provider_message_id FROM messages WHERE id = ?1 AND tenant_id = ?2",
        )?
        .query_row([message_id, tenant_id], |row| {
            Ok((row.get(0)?, row.get(1)?, row.get(2)?))
        })
        .optional()?;
    let Some((status, attempts, provider_message_id)) = row else {
        return Ok(());
    };
    let Ok(status) = status.parse::<MessageStatus>() else {
        return Ok(());
    };
    event(
        tx,
        &Event {
            message_id,
            tenant_id,
            at: now,
            name,
            status,
            attempts,
            detail: None,
            provider_message_id: provider_message_id.as_deref(),
        },
    )
}

/// One status row, every column bound in order.
const INSERT_ROW: &str = "INSERT INTO messages (id, tenant_id, channel, status, priority, lane, attempts, reference, metadata, created_at, updated_at, sent_at, last_error, provider_message_id, send_at, test, fragments, recipient, template_id, template_version, attachment_bytes) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21)";

/// Accepted messages (`queued` or `scheduled`): their rows, counted
/// `accepted`. The accept is no event: the row's `created_at` is.
pub(crate) fn accept(tx: &Connection, rows: &[&MessageRecord]) -> rusqlite::Result<()> {
    let mut insert = tx.prepare_cached(INSERT_ROW)?;
    for record in rows {
        Pending::accepted(
            &record.tenant_id,
            record.created_at,
            record.channel.as_str(),
            record.test,
            record.attachment_bytes.unwrap_or(0),
        );
        insert.execute(params![
            record.id,
            record.tenant_id,
            record.channel.as_str(),
            record.status.as_str(),
            record.priority.as_str(),
            record.lane.as_str(),
            i64::from(record.attempts),
            record.reference,
            record.metadata,
            record.created_at,
            record.updated_at,
            record.sent_at,
            record.last_error,
            record.provider_message_id,
            record.send_at,
            record.test,
            record.fragments,
            record.recipient,
            record.template_id,
            record.template_version,
            record.attachment_bytes,
        ])?;
    }
    Ok(())
}

/// [`Move::Claim`]: true when this caller took the message, from a waiting
/// state or from a `sending` older than `stale_before` (its sender died).
pub(crate) fn claim(
    tx: &Connection,
    id: &str,
    now: i64,
    stale_before: i64,
) -> rusqlite::Result<bool> {
    static CLAIM: LazyLock<String> = LazyLock::new(|| {
        format!(
            "UPDATE messages SET status = 'sending', updated_at = ?1 WHERE id = ?2 \
             AND (status IN ({}) OR (status = 'sending' AND updated_at < ?3))",
            Move::Claim.sources_sql()
        )
    });
    Ok(tx
        .prepare_cached(&CLAIM)?
        .execute(params![now, id, stale_before])?
        == 1)
}

/// [`Move::Sent`], by `provider` (a pool's provider) under its id. A second
/// `sent` of a sent message only updates the provider's id.
pub(crate) fn sent(
    tx: &Connection,
    id: &str,
    provider_message_id: &str,
    provider: Option<&str>,
    gate_wait_ms: Option<i64>,
    now: i64,
) -> rusqlite::Result<()> {
    const SET: &str = ", attempts = attempts + 1, last_error = NULL, sent_at = ?1, \
         provider_message_id = ?3, provider = COALESCE(?4, provider), provider_pinned = 0, \
         gate_wait_ms = ?5, receipt_by_id = 1";
    static SENT: LazyLock<String> =
        LazyLock::new(|| statement(Move::Sent, SET, " AND status <> 'sent'"));
    let values = params![now, id, provider_message_id, provider, gate_wait_ms];
    let changed = tx
        .prepare_cached(&SENT)?
        .query_row(values, moved)
        .optional()?;
    match changed {
        Some(row) => effects(tx, Move::Sent, &row, now),
        None => {
            tx.prepare_cached(&format!(
                "UPDATE messages SET updated_at = ?1{SET} WHERE id = ?2 AND status = 'sent'"
            ))?
            .execute(values)?;
            Ok(())
        }
    }
}

/// A failure's move ([`Failure`]) of message `id`. Returns the attempts
/// made, or `None` when the message was not where the move starts.
pub(crate) fn fail(
    tx: &Connection,
    id: &str,
    failure: &Failure,
    now: i64,
) -> rusqlite::Result<Option<i64>> {
    const SET: &str = ", attempts = attempts + ?3, last_error = COALESCE(?4, last_error), \
         provider = COALESCE(?5, provider), provider_pinned = COALESCE(?6, provider_pinned)";
    static FAILS: LazyLock<[String; 4]> =
        LazyLock::new(|| Move::FAILURES.map(|step| statement(step, SET, "")));
    let changed = tx
        .prepare_cached(&FAILS[failure.index()])?
        .query_row(
            params![
                now,
                id,
                i64::from(failure.counted),
                failure.error,
                failure.provider,
                failure.pinned
            ],
            moved,
        )
        .optional()?;
    match changed {
        Some(row) => {
            effects(tx, failure.step, &row, now)?;
            Ok(Some(row.attempts))
        }
        None => Ok(None),
    }
}

/// [`Move::Cancel`] of a waiting message, of `tenant_id` (any when `None`)
/// in the world `test` says (either when `None`); true when cancelled.
pub(crate) fn cancel(
    tx: &Connection,
    id: &str,
    tenant_id: Option<&str>,
    test: Option<bool>,
    now: i64,
) -> rusqlite::Result<bool> {
    static CANCEL: LazyLock<String> = LazyLock::new(|| {
        statement(
            Move::Cancel,
            "",
            " AND (?3 IS NULL OR tenant_id = ?3) AND (?4 IS NULL OR test = ?4)",
        )
    });
    let changed = tx
        .prepare_cached(&CANCEL)?
        .query_row(params![now, id, tenant_id, test], moved)
        .optional()?;
    match changed {
        Some(row) => effects(tx, Move::Cancel, &row, now).map(|()| true),
        None => Ok(false),
    }
}

/// A move back to `queued` without a new attempt budget: a scheduled
/// message that reached its lane ([`Move::Due`]), or one whose sender died
/// ([`Move::Release`]). True when it moved.
pub(crate) fn requeue(tx: &Connection, id: &str, step: Move, now: i64) -> rusqlite::Result<bool> {
    static DUE: LazyLock<String> = LazyLock::new(|| statement(Move::Due, "", ""));
    static RELEASE: LazyLock<String> = LazyLock::new(|| statement(Move::Release, "", ""));
    let sql = match step {
        Move::Due => &DUE,
        Move::Release => &RELEASE,
        other => unreachable!("{other:?} is not a plain requeue"),
    };
    let changed = tx
        .prepare_cached(sql)?
        .query_row(params![now, id], moved)
        .optional()?;
    match changed {
        Some(row) => effects(tx, step, &row, now).map(|()| true),
        None => Ok(false),
    }
}

/// Every message left `sending` by a process that is gone ([`Move::Release`]);
/// returns how many.
pub(crate) fn release_all(tx: &Connection, now: i64) -> rusqlite::Result<u64> {
    let ids: Vec<String> = tx
        .prepare("SELECT id FROM messages WHERE status = 'sending'")?
        .query_map([], |row| row.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    let mut released = 0;
    for id in ids {
        released += u64::from(requeue(tx, &id, Move::Release, now)?);
    }
    Ok(released)
}

/// [`Move::Redrive`]: back to `queued` with a fresh attempt budget, unless
/// the message changed after `started` (ms; a consumer took it up again
/// since). A message already `queued` gets its budget back and no event.
pub(crate) fn redrive(tx: &Connection, id: &str, started: i64, now: i64) -> rusqlite::Result<bool> {
    static REDRIVE: LazyLock<String> = LazyLock::new(|| {
        statement(
            Move::Redrive,
            ", attempts = 0",
            " AND updated_at <= ?3 AND status <> 'queued'",
        )
    });
    let changed = tx
        .prepare_cached(&REDRIVE)?
        .query_row(params![now, id, started], moved)
        .optional()?;
    if let Some(row) = changed {
        effects(tx, Move::Redrive, &row, now)?;
        return Ok(true);
    }
    let reset = tx
        .prepare_cached(
            "UPDATE messages SET attempts = 0, updated_at = ?1 \
             WHERE id = ?2 AND status = 'queued' AND updated_at <= ?3",
        )?
        .execute(params![now, id, started])?;
    Ok(reset == 1)
}

/// [`Move::Restore`]: a redrive that could not move the message after all.
pub(crate) fn restore(tx: &Connection, id: &str, now: i64) -> rusqlite::Result<bool> {
    static RESTORE: LazyLock<String> = LazyLock::new(|| statement(Move::Restore, "", ""));
    let changed = tx
        .prepare_cached(&RESTORE)?
        .query_row(params![now, id], moved)
        .optional()?;
    match changed {
        Some(row) => effects(tx, Move::Restore, &row, now).map(|()| true),
        None => Ok(false),
    }
}

/// [`Move::Receipt`]: a provider's receipt moves a sent message on to
/// `outcome`, with `error` its `last_error`. The receipt's own event
/// follows through [`event`], with the provider's detail.
pub(crate) fn receipt(
    tx: &Connection,
    id: &str,
    outcome: MessageStatus,
    error: Option<&str>,
    now: i64,
) -> rusqlite::Result<bool> {
    static RECEIPTS: LazyLock<Vec<(MessageStatus, String)>> = LazyLock::new(|| {
        [
            MessageStatus::Delivered,
            MessageStatus::Bounced,
            MessageStatus::Failed,
            MessageStatus::Complained,
        ]
        .map(|outcome| {
            (
                outcome,
                statement(
                    Move::Receipt(outcome),
                    ", last_error = ?3",
                    " AND status <> ?4",
                ),
            )
        })
        .to_vec()
    });
    let Some((_, sql)) = RECEIPTS.iter().find(|(to, _)| *to == outcome) else {
        return Ok(false);
    };
    let changed = tx
        .prepare_cached(sql)?
        .query_row(params![now, id, error, outcome.as_str()], moved)
        .optional()?;
    match changed {
        Some(row) => effects(tx, Move::Receipt(outcome), &row, now).map(|()| true),
        None => Ok(false),
    }
}
