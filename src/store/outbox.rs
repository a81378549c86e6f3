//! The outbox's rows: queue messages waiting to reach SQS, written in the
//! accept's transaction (see `crate::accept::outbox` for the relay). A
//! scheduled message's row waits here until it is due.

use super::lifecycle::Move;
use std::future::Future;

use super::Db;
use crate::message::OutboundMessage;
use crate::model::{Lane, now_ms};

/// An outbox row: message id, lane, tenant, channel, priority, body.
pub type OutboxRow = (String, String, String, String, String, String);

/// Inserts the outbox rows of a group in the SQLite writer's transaction.
/// Each row's `Option<i64>` is when a scheduled message is due (ms): the
/// scheduler sends it then; `None` rows are sent by the relay at once.
pub(crate) fn insert_rows(
    tx: &rusqlite::Transaction,
    rows: &[(Lane, &OutboundMessage, Option<i64>)],
    now: i64,
) -> rusqlite::Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut insert = tx.prepare_cached(
        "INSERT OR REPLACE INTO outbox (message_id, lane, tenant_id, channel, priority, body, created_at, due_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )?;
    for (lane, message, due_at) in rows {
        insert.execute(rusqlite::params![
            message.message_id,
            lane.as_str(),
            message.tenant_id,
            message.channel.as_str(),
            message.priority.as_str(),
            message.body,
            now,
            due_at,
        ])?;
    }
    Ok(())
}

/// Hands the rows created at or before `cutoff` (ms) and the scheduled
/// rows that are due to `send`, a page of `page` rows at a time; `send`
/// answers the ids the queue took, whose rows are then removed (a
/// scheduled message is `queued` from then on). Returns how many were
/// sent.
///
/// On PostgreSQL, where several instances sweep, each page is claimed with
/// `FOR UPDATE SKIP LOCKED` in a transaction that also removes the rows
/// sent, so two sweepers never send the same row and one that dies
/// mid-page leaves its rows to the next.
pub async fn drain_due<F, Fut>(
    db: &Db,
    cutoff: i64,
    page: i64,
    mut send: F,
) -> anyhow::Result<usize>
where
    F: FnMut(Vec<OutboxRow>) -> Fut,
    Fut: Future<Output = anyhow::Result<Vec<String>>>,
{
    let mut resent = 0;
    match db {
        Db::Sqlite(sqlite) => {
            let mut after = String::new();
            loop {
                let rows: Vec<OutboxRow> = sqlite
                    .rows(
                        "SELECT message_id, lane, tenant_id, channel, priority, body FROM outbox \
                         WHERE ((due_at IS NULL AND created_at <= ?1) OR due_at <= ?2) \
                         AND message_id > ?3 ORDER BY message_id LIMIT ?4",
                        super::sqlite::args![cutoff, now_ms(), after.clone(), page],
                        super::sqlite::tuple,
                    )
                    .await?;
                let Some(last) = rows.last() else {
                    return Ok(resent);
                };
                after = last.0.clone();
                let page_len = rows.len();
                let sent = send(rows).await?;
                resent += sent.len();
                mark_due_queued(db, &sent).await?;
                forget(db, &sent).await?;
                if (page_len as i64) < page {
                    return Ok(resent);
                }
            }
        }
        Db::Postgres(pg) => loop {
            let mut tx = pg.pool.begin().await?;
            let rows: Vec<OutboxRow> = sqlx::query_as(
                "SELECT message_id, lane, tenant_id, channel, priority, body FROM outbox \
                 WHERE (due_at IS NULL AND created_at <= $1) OR due_at <= $2 \
                 ORDER BY created_at LIMIT $3 FOR UPDATE SKIP LOCKED",
            )
            .bind(cutoff)
            .bind(now_ms())
            .bind(page)
            .fetch_all(&mut *tx)
            .await?;
            let page_len = rows.len();
            let sent = send(rows).await?;
            sqlx::query("DELETE FROM outbox WHERE message_id = ANY($1)")
                .bind(&sent)
                .execute(&mut *tx)
                .await?;
            super::postgres::lifecycle::due(&mut tx, &sent, now_ms()).await?;
            tx.commit().await?;
            resent += sent.len();
            if (page_len as i64) < page || sent.is_empty() {
                return Ok(resent);
            }
        },
    }
}

/// Scheduled messages that reached their lane are `queued` ([`Move::Due`]).
async fn mark_due_queued(db: &Db, ids: &[String]) -> anyhow::Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    match db {
        Db::Sqlite(sqlite) => {
            let (ids, now) = (ids.to_vec(), now_ms());
            sqlite
                .transact(move |tx| {
                    for id in &ids {
                        super::sqlite::lifecycle::requeue(tx, id, Move::Due, now)?;
                    }
                    Ok(())
                })
                .await?;
        }
        Db::Postgres(pg) => {
            let mut conn = pg.pool.acquire().await?;
            super::postgres::lifecycle::due(&mut conn, ids, now_ms()).await?;
        }
    }
    Ok(())
}

/// Outbox rows per lane (fast, slow): messages accepted and not yet in
/// SQS, scheduled ones included. One scan of a table that is small unless
/// SQS is behind (and then bounded by the lanes' high-water marks).
pub async fn pending_by_lane(db: &Db) -> anyhow::Result<[u64; 2]> {
    const COUNT: &str = "SELECT lane, COUNT(*) FROM outbox GROUP BY lane";
    let rows: Vec<(String, i64)> = match db {
        Db::Sqlite(sqlite) => sqlite.rows(COUNT, vec![], super::sqlite::tuple).await?,
        Db::Postgres(pg) => sqlx::query_as(COUNT).fetch_all(&pg.pool).await?,
    };
    let mut counts = [0; 2];
    for (lane, count) in rows {
        if let Ok(lane) = lane.parse::<Lane>() {
            counts[usize::from(lane == Lane::Slow)] = count.max(0) as u64;
        }
    }
    Ok(counts)
}

/// Removes the outbox rows of `ids` (sent messages).
pub async fn forget(db: &Db, ids: &[String]) -> anyhow::Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    match db {
        Db::Sqlite(sqlite) => {
            sqlite
                .execute_for_ids(ids, "DELETE FROM outbox WHERE message_id IN (")
                .await?;
        }
        Db::Postgres(pg) => {
            sqlx::query("DELETE FROM outbox WHERE message_id = ANY($1)")
                .bind(ids)
                .execute(&pg.pool)
                .await?;
        }
    }
    Ok(())
}

/// The ids of `tenant_id`'s messages still waiting in the outbox to reach
/// their lane (scheduled ones, which wait for their time, left out), at
/// most `limit`: what a purge of the tenant's queues must cancel too, or
/// the relay would deliver them after it.
pub async fn waiting_of_tenant(
    db: &Db,
    tenant_id: &str,
    limit: i64,
) -> anyhow::Result<Vec<String>> {
    const WAITING: &str = "SELECT message_id FROM outbox \
         WHERE tenant_id = $1 AND due_at IS NULL ORDER BY message_id LIMIT $2";
    Ok(match db {
        Db::Sqlite(sqlite) => {
            let args = super::sqlite::args![tenant_id.to_owned(), limit];
            sqlite.rows(WAITING, args, |row| row.get(0)).await?
        }
        Db::Postgres(pg) => {
            sqlx::query_scalar(WAITING)
                .bind(tenant_id)
                .bind(limit)
                .fetch_all(&pg.pool)
                .await?
        }
    })
}

/// (Being moved here: the outbox operations, implemented per engine in
/// `sqlite/outbox.rs` and `postgres/outbox.rs`.)
#[async_trait::async_trait]
pub trait OutboxStore: Send + Sync {}
