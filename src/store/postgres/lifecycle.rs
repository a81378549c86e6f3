//! Every write of a message's status on PostgreSQL, each with what
//! [`crate::store::lifecycle`] says it brings. A move is one statement
//! whatever the group's size: the `UPDATE` of the messages is a
//! data-modifying CTE, and the same statement inserts the moved messages'
//! events, their webhook calls and their usage deltas from its `RETURNING`
//! rows. No other file writes `messages.status`, and no trigger does.

use std::collections::HashSet;
use std::sync::LazyLock;

use sqlx::PgConnection;

use crate::model::MessageStatus;
use crate::store::lifecycle::{Effects, Failure, Move, Recorded};

/// The update of `step`: `set` adds columns, `from` a `FROM` clause and
/// `which` the rows (`$1` is always the time).
fn update(step: Move, set: &str, from: &str, which: &str) -> String {
    let erase = if Effects::of(step).unerases {
        ", erased_at = NULL"
    } else {
        ""
    };
    format!(
        "UPDATE messages AS m SET status = '{}', updated_at = $1{erase}{set}{from} \
         WHERE {which} AND m.status IN ({})",
        step.to().as_str(),
        step.sources_sql(),
    )
}

/// `update` (of [`update`]) as one statement that also writes `step`'s
/// effects; it yields each moved message's id and attempts.
fn with_effects(step: Move, update: &str) -> String {
    let to = step.to().as_str();
    let effects = Effects::of(step);
    let mut parts = vec![format!(
        "moved AS ({update} RETURNING m.id, m.tenant_id, m.channel, m.test, m.fragments, \
         m.attempts, m.last_error, m.provider_message_id, m.updated_at)"
    )];
    let recorded = match effects.event {
        Recorded::No => None,
        Recorded::Yes => Some("TRUE"),
        Recorded::WithWebhook => {
            Some("EXISTS (SELECT 1 FROM webhooks AS w WHERE w.tenant_id = moved.tenant_id)")
        }
    };
    if let Some(condition) = recorded {
        let detail = match effects.note {
            Some(note) => format!("'{}'", note.replace('\'', "''")),
            None if effects.detail => "last_error".to_owned(),
            None => "NULL".to_owned(),
        };
        parts.push(format!(
            "events AS (INSERT INTO message_events (message_id, tenant_id, at, event, status, \
             attempts, detail, provider_message_id) \
             SELECT id, tenant_id, updated_at, '{to}', '{to}', attempts, {detail}, \
             provider_message_id FROM moved WHERE {condition} \
             RETURNING id, tenant_id, message_id, event, at)"
        ));
    }
    if let Some(counter) = effects.counter {
        let (columns, sums) = if counter == "sent" {
            ("sent, fragments", "count(*), coalesce(sum(fragments), 0)")
        } else {
            (counter, "count(*)")
        };
        parts.push(format!(
            "counted AS (INSERT INTO usage_deltas (tenant_id, day, channel, test, {columns}) \
             SELECT tenant_id, updated_at / 86400000, channel, test, {sums} FROM moved \
             GROUP BY 1, 2, 3, 4)"
        ));
    }
    format!("WITH {} SELECT id, attempts FROM moved", parts.join(", "))
}

/// Accepted messages' rows (`$1`… the columns of
/// [`super::writer`]'s accept group, in its order), counted `accepted` in
/// the same statement. The accept is no event: the row's `created_at` is.
pub(super) const ACCEPT: &str = "WITH inserted AS (INSERT INTO messages (id, tenant_id, channel, \
     status, priority, lane, attempts, reference, metadata, created_at, updated_at, send_at, test, \
     fragments, recipient, template_id, template_version, attachment_bytes) \
     SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], \
     $6::text[], $7::bigint[], $8::text[], $9::text[], $10::bigint[], $11::bigint[], $12::bigint[], \
     $13::boolean[], $14::bigint[], $15::text[], $16::text[], $17::bigint[], $18::bigint[]) \
     RETURNING tenant_id, created_at, channel, test, attachment_bytes) \
     INSERT INTO usage_deltas (tenant_id, day, channel, test, accepted, attachment_bytes) \
     SELECT tenant_id, created_at / 86400000, channel, test, count(*), \
     coalesce(sum(attachment_bytes), 0) FROM inserted \
     GROUP BY 1, 2, 3, 4";

/// [`Move::Claim`] of `ids`, each from a waiting state or from a `sending`
/// older than its `stale` (its sender died); returns the ids taken. A row
/// locked by another instance's claim waits for it and is checked again,
/// so two instances never both see their claim succeed.
pub(super) async fn claim(
    tx: &mut PgConnection,
    ids: &[String],
    stale: &[i64],
    now: i64,
) -> anyhow::Result<Vec<String>> {
    static CLAIM: LazyLock<String> = LazyLock::new(|| {
        format!(
            "UPDATE messages AS m SET status = 'sending', updated_at = $1 \
             FROM UNNEST($2::text[], $3::bigint[]) AS u(id, stale_before) \
             WHERE m.id = u.id AND (m.status IN ({}) \
             OR (m.status = 'sending' AND m.updated_at < u.stale_before)) RETURNING m.id",
            Move::Claim.sources_sql()
        )
    });
    Ok(sqlx::query_scalar(CLAIM.as_str())
        .bind(now)
        .bind(ids)
        .bind(stale)
        .fetch_all(tx)
        .await?)
}

/// [`Move::Sent`] of `ids`, each by its provider under its id. A second
/// `sent` of a sent message only updates the provider's id.
pub(super) async fn sent(
    tx: &mut PgConnection,
    ids: &[String],
    provider_ids: &[String],
    by: &[Option<String>],
    waits: &[Option<i64>],
    now: i64,
) -> anyhow::Result<()> {
    const SET: &str = ", attempts = m.attempts + 1, last_error = NULL, sent_at = $1, \
         provider_message_id = u.provider_id, provider = COALESCE(u.provider, m.provider), \
         provider_pinned = FALSE, gate_wait_ms = u.gate_wait_ms, receipt_by_id = TRUE";
    const FROM: &str = " FROM UNNEST($2::text[], $3::text[], $4::text[], $5::bigint[]) \
         AS u(id, provider_id, provider, gate_wait_ms)";
    static SENT: LazyLock<String> = LazyLock::new(|| {
        with_effects(
            Move::Sent,
            &update(Move::Sent, SET, FROM, "m.id = u.id AND m.status <> 'sent'"),
        )
    });
    let moved: Vec<(String, i64)> = sqlx::query_as(SENT.as_str())
        .bind(now)
        .bind(ids)
        .bind(provider_ids)
        .bind(by)
        .bind(waits)
        .fetch_all(&mut *tx)
        .await?;
    if moved.len() < ids.len() {
        let moved: HashSet<&str> = moved.iter().map(|(id, _)| id.as_str()).collect();
        let again: Vec<usize> = (0..ids.len())
            .filter(|&i| !moved.contains(ids[i].as_str()))
            .collect();
        let pick = |column: &[String]| -> Vec<String> {
            again.iter().map(|&i| column[i].clone()).collect()
        };
        let again_by: Vec<Option<String>> = again.iter().map(|&i| by[i].clone()).collect();
        let again_waits: Vec<Option<i64>> = again.iter().map(|&i| waits[i]).collect();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE messages AS m SET updated_at = $1{SET}{FROM} WHERE m.id = u.id AND m.status = 'sent'"
        )))
        .bind(now)
        .bind(pick(ids))
        .bind(pick(provider_ids))
        .bind(again_by)
        .bind(again_waits)
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}

/// A failure's move ([`Failure`]) of message `id`. Returns the attempts
/// made, or `None` when the message was not where the move starts.
pub(super) async fn fail(
    tx: &mut PgConnection,
    id: &str,
    failure: &Failure<'_>,
    now: i64,
) -> anyhow::Result<Option<i64>> {
    const SET: &str = ", attempts = m.attempts + $3, last_error = COALESCE($4, m.last_error), \
         provider = COALESCE($5, m.provider), provider_pinned = COALESCE($6, m.provider_pinned)";
    static FAILS: LazyLock<[String; 4]> = LazyLock::new(|| {
        Move::FAILURES.map(|step| with_effects(step, &update(step, SET, "", "m.id = $2")))
    });
    let moved: Option<(String, i64)> = sqlx::query_as(FAILS[failure.index()].as_str())
        .bind(now)
        .bind(id)
        .bind(i64::from(failure.counted))
        .bind(failure.error)
        .bind(failure.provider)
        .bind(failure.pinned)
        .fetch_optional(tx)
        .await?;
    Ok(moved.map(|(_, attempts)| attempts))
}

/// [`Move::DeadLetter`] of `ids` by their queue, which moved their rows to
/// a dead-letter queue in the same transaction (they were received
/// `max_receive_count` times without being deleted): `error` becomes their
/// `last_error`, and no attempt is counted. Returns the ids moved; a
/// message not where the move starts (one already sent, say) keeps its
/// status.
pub(crate) async fn dead_letter(
    tx: &mut PgConnection,
    ids: &[String],
    error: &str,
    now: i64,
) -> anyhow::Result<Vec<String>> {
    static DEAD_LETTER: LazyLock<String> = LazyLock::new(|| {
        with_effects(
            Move::DeadLetter,
            &update(Move::DeadLetter, ", last_error = $3", "", "m.id = ANY($2)"),
        )
    });
    let moved: Vec<(String, i64)> = sqlx::query_as(DEAD_LETTER.as_str())
        .bind(now)
        .bind(ids)
        .bind(error)
        .fetch_all(tx)
        .await?;
    Ok(moved.into_iter().map(|(id, _)| id).collect())
}

/// [`Move::Cancel`] of those of `ids` of `tenant_id` (in the world `test`
/// says; either when `None`) still waiting; returns the ids cancelled.
pub(crate) async fn cancel(
    tx: &mut PgConnection,
    tenant_id: &str,
    test: Option<bool>,
    ids: &[String],
    now: i64,
) -> anyhow::Result<Vec<String>> {
    static CANCEL: LazyLock<String> = LazyLock::new(|| {
        with_effects(
            Move::Cancel,
            &update(
                Move::Cancel,
                "",
                "",
                "m.tenant_id = $2 AND m.id = ANY($3) AND ($4::boolean IS NULL OR m.test = $4)",
            ),
        )
    });
    let moved: Vec<(String, i64)> = sqlx::query_as(CANCEL.as_str())
        .bind(now)
        .bind(tenant_id)
        .bind(ids)
        .bind(test)
        .fetch_all(tx)
        .await?;
    Ok(moved.into_iter().map(|(id, _)| id).collect())
}

/// [`Move::Due`]: scheduled messages that reached their lane are `queued`
/// (a message cancelled meanwhile stays cancelled; the consumer drops it).
pub(crate) async fn due(tx: &mut PgConnection, ids: &[String], now: i64) -> anyhow::Result<()> {
    static DUE: LazyLock<String> =
        LazyLock::new(|| with_effects(Move::Due, &update(Move::Due, "", "", "m.id = ANY($2)")));
    sqlx::query(DUE.as_str())
        .bind(now)
        .bind(ids)
        .execute(tx)
        .await?;
    Ok(())
}

/// [`Move::Redrive`] of `ids`: back to `queued` with a fresh attempt
/// budget, unless a message changed after `started` (ms). One already
/// `queued` gets its budget back and no event.
pub(crate) async fn redrive(
    tx: &mut PgConnection,
    ids: &[String],
    started: i64,
    now: i64,
) -> anyhow::Result<()> {
    static REDRIVE: LazyLock<String> = LazyLock::new(|| {
        with_effects(
            Move::Redrive,
            &update(
                Move::Redrive,
                ", attempts = 0",
                "",
                "m.id = ANY($2) AND m.updated_at <= $3 AND m.status <> 'queued'",
            ),
        )
    });
    sqlx::query(
        "UPDATE messages SET attempts = 0, updated_at = $1 \
         WHERE id = ANY($2) AND updated_at <= $3 AND status = 'queued'",
    )
    .bind(now)
    .bind(ids)
    .bind(started)
    .execute(&mut *tx)
    .await?;
    sqlx::query(REDRIVE.as_str())
        .bind(now)
        .bind(ids)
        .bind(started)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// [`Move::Restore`] of `ids`: a redrive that could not move them.
pub(crate) async fn restore(tx: &mut PgConnection, ids: &[String], now: i64) -> anyhow::Result<()> {
    static RESTORE: LazyLock<String> = LazyLock::new(|| {
        with_effects(
            Move::Restore,
            &update(Move::Restore, "", "", "m.id = ANY($2)"),
        )
    });
    sqlx::query(RESTORE.as_str())
        .bind(now)
        .bind(ids)
        .execute(tx)
        .await?;
    Ok(())
}

/// [`Move::Receipt`]s of a group: message `ids[i]` to `outcomes[i]` with
/// `errors[i]` its `last_error`; one statement per outcome present. The
/// receipts' own events follow through [`events`].
pub(super) async fn receipts(
    tx: &mut PgConnection,
    ids: &[&str],
    outcomes: &[MessageStatus],
    errors: &[Option<String>],
    now: i64,
) -> anyhow::Result<()> {
    const OUTCOMES: [MessageStatus; 4] = [
        MessageStatus::Delivered,
        MessageStatus::Bounced,
        MessageStatus::Failed,
        MessageStatus::Complained,
    ];
    static RECEIPTS: LazyLock<Vec<String>> = LazyLock::new(|| {
        OUTCOMES
            .iter()
            .map(|outcome| {
                let step = Move::Receipt(*outcome);
                with_effects(
                    step,
                    &update(
                        step,
                        ", last_error = u.error",
                        " FROM UNNEST($2::text[], $3::text[]) AS u(id, error)",
                        &format!("m.id = u.id AND m.status <> '{}'", outcome.as_str()),
                    ),
                )
            })
            .collect()
    });
    for (index, outcome) in OUTCOMES.iter().enumerate() {
        let (mut these, mut their_errors) = (Vec::new(), Vec::new());
        for (i, to) in outcomes.iter().enumerate() {
            if to == outcome {
                these.push(ids[i]);
                their_errors.push(errors[i].clone());
            }
        }
        if these.is_empty() {
            continue;
        }
        sqlx::query(RECEIPTS[index].as_str())
            .bind(now)
            .bind(&these)
            .bind(&their_errors)
            .execute(&mut *tx)
            .await?;
    }
    Ok(())
}

/// Event rows column by column, for `UNNEST`: a group's receipts' events,
/// with the provider's names and details.
#[derive(Default)]
pub(crate) struct EventColumns {
    pub message_id: Vec<String>,
    pub tenant_id: Vec<String>,
    pub at: Vec<i64>,
    pub event: Vec<String>,
    pub status: Vec<&'static str>,
    pub attempts: Vec<i64>,
    pub detail: Vec<Option<String>>,
    pub provider_message_id: Vec<String>,
}

/// Inserts `rows` in their order (so each message's events keep the order
/// they were reported in); an event with a
/// detail (a provider's diagnostic may quote an address) unmarks its
/// erased message.
pub(super) async fn events(tx: &mut PgConnection, rows: &EventColumns) -> anyhow::Result<()> {
    const EVENTS: &str = "WITH events AS (INSERT INTO message_events (message_id, tenant_id, at, event, status, \
             attempts, detail, provider_message_id) \
             SELECT u.message_id, u.tenant_id, u.at, u.event, u.status, u.attempts, u.detail, \
             u.provider_message_id FROM UNNEST($1::text[], $2::text[], $3::bigint[], $4::text[], \
             $5::text[], $6::bigint[], $7::text[], $8::text[]) WITH ORDINALITY \
             AS u(message_id, tenant_id, at, event, status, attempts, detail, provider_message_id, i) \
             ORDER BY u.i RETURNING message_id, detail), \
             unerased AS (UPDATE messages AS m SET erased_at = NULL FROM events AS e \
             WHERE e.detail IS NOT NULL AND m.id = e.message_id AND m.erased_at IS NOT NULL) \
             SELECT count(*) FROM events";
    if rows.message_id.is_empty() {
        return Ok(());
    }
    sqlx::query(EVENTS)
        .bind(&rows.message_id)
        .bind(&rows.tenant_id)
        .bind(&rows.at)
        .bind(&rows.event)
        .bind(&rows.status)
        .bind(&rows.attempts)
        .bind(&rows.detail)
        .bind(&rows.provider_message_id)
        .execute(tx)
        .await?;
    Ok(())
}

/// An event that changes no status (`name`: `unsubscribed`, …) on
/// `tenant_id`'s message `message_id`, as its row stands; nothing when the
/// message is gone.
pub(crate) async fn note(
    tx: &mut PgConnection,
    message_id: &str,
    tenant_id: &str,
    name: &str,
    now: i64,
) -> anyhow::Result<()> {
    const NOTE: &str = "WITH events AS (INSERT INTO message_events (message_id, tenant_id, at, event, status, \
             attempts, detail, provider_message_id) \
             SELECT id, tenant_id, $3, $4, status, attempts, NULL, provider_message_id \
             FROM messages WHERE id = $1 AND tenant_id = $2 \
             RETURNING id) \
             SELECT count(*) FROM events";
    sqlx::query(NOTE)
        .bind(message_id)
        .bind(tenant_id)
        .bind(now)
        .bind(name)
        .execute(tx)
        .await?;
    Ok(())
}
