//! Message status rows: one per accepted message, written in the same
//! transaction as its queue entry and read back by `GET /v1/messages/{id}`.

use sqlx::{QueryBuilder, Sqlite};

use super::{Db, on_pool};

use crate::model::Lane;

pub use crate::message::MessageRecord;

/// One status row, every column bound in order.
const INSERT_ROW: &str = "INSERT INTO messages (id, tenant_id, channel, status, priority, lane, attempts, reference, metadata, created_at, updated_at, sent_at, last_error, provider_message_id, send_at, test) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)";

/// Inserts `rows` in the accept writer's transaction, through one cached
/// single-row statement.
pub fn insert_rows(tx: &rusqlite::Transaction, rows: &[&MessageRecord]) -> rusqlite::Result<()> {
    let mut insert = tx.prepare_cached(INSERT_ROW)?;
    for record in rows {
        insert.execute(rusqlite::params![
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
        ])?;
    }
    Ok(())
}

type MessageRow = (
    String,
    String,
    String,
    String,
    String,
    String,
    i64,
    Option<String>,
    Option<String>,
    i64,
    i64,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<i64>,
    bool,
);

macro_rules! select_message {
    ($where:literal) => {
        concat!(
            "SELECT id, tenant_id, channel, status, priority, lane, attempts, reference, metadata, ",
            "created_at, updated_at, sent_at, last_error, provider_message_id, send_at, test FROM messages ",
            $where
        )
    };
}

fn from_row(row: MessageRow) -> anyhow::Result<MessageRecord> {
    let parse_err = |what: &str, value: &str, err: String| {
        anyhow::anyhow!("stored {what} {value:?} is not valid: {err}")
    };
    Ok(MessageRecord {
        channel: row.2.parse().map_err(|e| parse_err("channel", &row.2, e))?,
        status: row.3.parse().map_err(|e| parse_err("status", &row.3, e))?,
        priority: row
            .4
            .parse()
            .map_err(|e| parse_err("priority", &row.4, e))?,
        lane: row.5.parse().map_err(|e| parse_err("lane", &row.5, e))?,
        id: row.0,
        tenant_id: row.1,
        attempts: row.6.max(0) as u32,
        reference: row.7,
        metadata: row.8,
        created_at: row.9,
        updated_at: row.10,
        sent_at: row.11,
        last_error: row.12,
        provider_message_id: row.13,
        send_at: row.14,
        test: row.15,
    })
}

/// The message `id` if it belongs to `tenant_id`.
pub async fn get_for_tenant(
    db: &Db,
    tenant_id: &str,
    id: &str,
) -> anyhow::Result<Option<MessageRecord>> {
    let row: Option<MessageRow> = on_pool!(db, read, |pool| {
        sqlx::query_as(select_message!("WHERE id = $1 AND tenant_id = $2"))
            .bind(id)
            .bind(tenant_id)
            .fetch_optional(pool)
            .await?
    });
    row.map(from_row).transpose()
}

/// The message `id`, whoever owns it.
pub async fn get(db: &Db, id: &str) -> anyhow::Result<Option<MessageRecord>> {
    let row: Option<MessageRow> = on_pool!(db, read, |pool| {
        sqlx::query_as(select_message!("WHERE id = $1"))
            .bind(id)
            .fetch_optional(pool)
            .await?
    });
    row.map(from_row).transpose()
}

/// Live messages (not a test key's) `tenant_id` sent at or after
/// `since_ms`: what its daily quota has used (start-up).
pub async fn count_since(db: &Db, tenant_id: &str, since_ms: i64) -> anyhow::Result<u64> {
    let count: i64 = on_pool!(db, read, |pool| {
        sqlx::query_scalar(
            "SELECT COUNT(*) FROM messages WHERE tenant_id = $1 AND created_at >= $2 AND NOT test",
        )
        .bind(tenant_id)
        .bind(since_ms)
        .fetch_one(pool)
        .await?
    });
    Ok(count.max(0) as u64)
}

/// Puts redriven messages back to `queued` with a fresh attempt budget,
/// unless a consumer has already taken them up again since `redrive_started`
/// (ms): a message sent, or dead-lettered once more, in the moment between
/// its move back to the lane and this update keeps the newer status. Any
/// status but `sent` and `rejected` from before the redrive is reset: a
/// message SQS's own redrive policy moved to the DLQ still shows the status
/// it had when it was last received. Queue backends that share the status
/// store call this before moving messages (`redrive_started` = `i64::MAX`),
/// so a consumer never sees a redriven message with its old budget.
pub async fn mark_requeued(db: &Db, ids: &[String], redrive_started: i64) -> anyhow::Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    let now = crate::model::now_ms();
    match db {
        Db::Sqlite(sqlite) => {
            sqlite
                .execute_for_ids(ids, |query| {
                    query
                        .push("UPDATE messages SET status = 'queued', attempts = 0, updated_at = ")
                        .push_bind(now)
                        .push(" WHERE status NOT IN ('sent', 'rejected') AND updated_at <= ")
                        .push_bind(redrive_started)
                        .push(" AND id IN (");
                })
                .await?;
        }
        Db::Postgres(pg) => {
            sqlx::query(
                "UPDATE messages SET status = 'queued', attempts = 0, updated_at = $1 \
                 WHERE status NOT IN ('sent', 'rejected') AND updated_at <= $2 AND id = ANY($3)",
            )
            .bind(now)
            .bind(redrive_started)
            .bind(ids)
            .execute(&pg.pool)
            .await?;
        }
    }
    Ok(())
}

/// Undoes [`mark_requeued`] for messages that could not be moved after all.
pub async fn restore_dead_lettered(db: &Db, ids: &[String]) -> anyhow::Result<()> {
    match db {
        Db::Sqlite(sqlite) => {
            sqlite
                .execute_for_ids(ids, |query| {
                    query.push(
                        "UPDATE messages SET status = 'dead_lettered' WHERE status = 'queued' AND id IN (",
                    );
                })
                .await?;
        }
        Db::Postgres(pg) => {
            sqlx::query(
                "UPDATE messages SET status = 'dead_lettered' WHERE status = 'queued' AND id = ANY($1)",
            )
                .bind(ids)
                .execute(&pg.pool)
                .await?;
        }
    }
    Ok(())
}

/// Status rows of `ids` (any tenant), keyed by id.
pub async fn get_many(
    db: &Db,
    ids: &[String],
) -> anyhow::Result<std::collections::HashMap<String, MessageRecord>> {
    let mut found = std::collections::HashMap::new();
    let mut keep = |rows: Vec<MessageRow>| -> anyhow::Result<()> {
        for row in rows {
            let record = from_row(row)?;
            found.insert(record.id.clone(), record);
        }
        Ok(())
    };
    match db {
        Db::Sqlite(sqlite) => {
            for chunk in ids.chunks(super::sqlite::IDS_PER_STATEMENT) {
                let mut builder: QueryBuilder<Sqlite> =
                    QueryBuilder::new(select_message!("WHERE id IN ("));
                super::sqlite::push_id_list(&mut builder, chunk);
                keep(
                    builder
                        .build_query_as()
                        .persistent(false)
                        .fetch_all(&sqlite.read)
                        .await?,
                )?;
            }
        }
        Db::Postgres(pg) => keep(
            sqlx::query_as(select_message!("WHERE id = ANY($1)"))
                .bind(ids)
                .fetch_all(&pg.pool)
                .await?,
        )?,
    }
    Ok(found)
}

/// Of `tenant_id`'s messages with `reference`: the ids of up to `limit`
/// still waiting to be sent, and how many there are in all.
pub async fn ids_by_reference(
    db: &Db,
    tenant_id: &str,
    reference: &str,
    limit: i64,
) -> anyhow::Result<(Vec<String>, usize)> {
    let pending: Vec<String> = on_pool!(db, read, |pool| {
        sqlx::query_scalar(
            "SELECT id FROM messages WHERE tenant_id = $1 AND reference = $2 \
             AND status IN ('scheduled', 'queued', 'retrying') ORDER BY id LIMIT $3",
        )
        .bind(tenant_id)
        .bind(reference)
        .bind(limit)
        .fetch_all(pool)
        .await?
    });
    let total: i64 = on_pool!(db, read, |pool| {
        sqlx::query_scalar("SELECT COUNT(*) FROM messages WHERE tenant_id = $1 AND reference = $2")
            .bind(tenant_id)
            .bind(reference)
            .fetch_one(pool)
            .await?
    });
    Ok((pending, total.max(0) as usize))
}

/// Creates, if missing, the partial index of pending messages that
/// [`oldest_pending`] reads (the PostgreSQL schema has it from its first
/// migration). Its WHERE clause must match the query's word for word for
/// SQLite to use it.
pub async fn index_pending(db: &Db) -> anyhow::Result<()> {
    if let Db::Sqlite(sqlite) = db {
        sqlx::query(
            "CREATE INDEX IF NOT EXISTS messages_pending ON messages(lane, created_at) WHERE status IN ('queued', 'sending', 'retrying')",
        )
        .execute(&sqlite.write)
        .await?;
    }
    Ok(())
}

/// When the oldest pending message of `lane` (of `tenant`, when given) was
/// created (ms).
pub async fn oldest_pending(
    db: &Db,
    lane: Lane,
    tenant: Option<&str>,
) -> anyhow::Result<Option<i64>> {
    Ok(match tenant {
        None => on_pool!(db, read, |pool| {
            sqlx::query_scalar(
                "SELECT MIN(created_at) FROM messages WHERE lane = $1 AND status IN ('queued', 'sending', 'retrying')",
            )
            .bind(lane.as_str())
            .fetch_one(pool)
            .await?
        }),
        Some(tenant) => on_pool!(db, read, |pool| {
            sqlx::query_scalar(
                "SELECT MIN(created_at) FROM messages WHERE lane = $1 AND status IN ('queued', 'sending', 'retrying') AND tenant_id = $2",
            )
            .bind(lane.as_str())
            .bind(tenant)
            .fetch_one(pool)
            .await?
        }),
    })
}

/// Messages still `sending` in a SQLite file (which belongs to this one
/// instance) were being sent by a process that is gone: they wait again,
/// to be claimed by their redelivered copy (at least once). Returns how
/// many. On PostgreSQL another instance may be sending them: nothing
/// changes (a stale claim is taken over by [`crate::store::Writer::claim`]).
pub async fn release_interrupted_sends(db: &Db) -> anyhow::Result<u64> {
    let Db::Sqlite(sqlite) = db else {
        return Ok(0);
    };
    let reset = sqlx::query("UPDATE messages SET status = 'queued' WHERE status = 'sending'")
        .execute(&sqlite.write)
        .await?;
    Ok(reset.rows_affected())
}
