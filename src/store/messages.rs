//! Message status rows: one per accepted message, written in the same
//! transaction as its queue entry and read back by `GET /v1/messages/{id}`.

use super::{Db, sqlite};

use crate::model::{Lane, Scope};

pub use crate::message::MessageRecord;

/// A status row as read.
#[derive(sqlx::FromRow)]
struct MessageRow {
    id: String,
    tenant_id: String,
    channel: String,
    status: String,
    priority: String,
    lane: String,
    attempts: i64,
    reference: Option<String>,
    metadata: Option<String>,
    created_at: i64,
    updated_at: i64,
    sent_at: Option<i64>,
    last_error: Option<String>,
    provider_message_id: Option<String>,
    send_at: Option<i64>,
    test: bool,
    fragments: Option<i64>,
    erased_at: Option<i64>,
    provider: Option<String>,
}

macro_rules! message_columns {
    () => {
        concat!(
            "id, tenant_id, channel, status, priority, lane, attempts, reference, metadata, ",
            "created_at, updated_at, sent_at, last_error, provider_message_id, send_at, test, fragments, erased_at, provider"
        )
    };
}

macro_rules! select_message {
    ($where:literal) => {
        concat!("SELECT ", message_columns!(), " FROM messages ", $where)
    };
}

/// The columns [`select_message!`] reads, in its order.
const MESSAGE_COLUMNS: &str = message_columns!();

fn from_row(row: MessageRow) -> anyhow::Result<MessageRecord> {
    let parse_err = |what: &str, value: &str, err: String| {
        anyhow::anyhow!("stored {what} {value:?} is not valid: {err}")
    };
    Ok(MessageRecord {
        channel: row
            .channel
            .parse()
            .map_err(|e| parse_err("channel", &row.channel, e))?,
        status: row
            .status
            .parse()
            .map_err(|e| parse_err("status", &row.status, e))?,
        priority: row
            .priority
            .parse()
            .map_err(|e| parse_err("priority", &row.priority, e))?,
        lane: row
            .lane
            .parse()
            .map_err(|e| parse_err("lane", &row.lane, e))?,
        id: row.id,
        tenant_id: row.tenant_id,
        attempts: row.attempts.max(0) as u32,
        reference: row.reference,
        metadata: row.metadata,
        created_at: row.created_at,
        updated_at: row.updated_at,
        sent_at: row.sent_at,
        last_error: row.last_error,
        provider_message_id: row.provider_message_id,
        send_at: row.send_at,
        test: row.test,
        fragments: row
            .fragments
            .map(|n| n.clamp(0, i64::from(u32::MAX)) as u32),
        erased_at: row.erased_at,
        provider: row.provider,
    })
}

/// The message `id` if it belongs to `scope`: its tenant, in its world.
/// A test key's caller never gets a live message, nor a live key's caller a
/// test one.
pub async fn get_in(db: &Db, scope: &Scope, id: &str) -> anyhow::Result<Option<MessageRecord>> {
    const IN_SCOPE: &str = select_message!("WHERE id = $1 AND tenant_id = $2 AND test = $3");
    let row: Option<MessageRow> = match db {
        Db::Sqlite(sqlite) => {
            let args = sqlite::args![id.to_owned(), scope.tenant().to_owned(), scope.is_test()];
            sqlite.row(IN_SCOPE, args, message_row).await?
        }
        Db::Postgres(pg) => {
            sqlx::query_as(IN_SCOPE)
                .bind(id)
                .bind(scope.tenant())
                .bind(scope.is_test())
                .fetch_optional(&pg.pool)
                .await?
        }
    };
    row.map(from_row).transpose()
}

/// A [`MessageRow`] from a rusqlite row of [`select_message!`]'s columns.
fn message_row(row: &rusqlite::Row) -> rusqlite::Result<MessageRow> {
    Ok(MessageRow {
        id: row.get(0)?,
        tenant_id: row.get(1)?,
        channel: row.get(2)?,
        status: row.get(3)?,
        priority: row.get(4)?,
        lane: row.get(5)?,
        attempts: row.get(6)?,
        reference: row.get(7)?,
        metadata: row.get(8)?,
        created_at: row.get(9)?,
        updated_at: row.get(10)?,
        sent_at: row.get(11)?,
        last_error: row.get(12)?,
        provider_message_id: row.get(13)?,
        send_at: row.get(14)?,
        test: row.get(15)?,
        fragments: row.get(16)?,
        erased_at: row.get(17)?,
        provider: row.get(18)?,
    })
}

/// The message `id`, whoever owns it.
pub async fn get(db: &Db, id: &str) -> anyhow::Result<Option<MessageRecord>> {
    const BY_ID: &str = select_message!("WHERE id = $1");
    let row: Option<MessageRow> = match db {
        Db::Sqlite(db) => {
            db.row(BY_ID, sqlite::args![id.to_owned()], message_row)
                .await?
        }
        Db::Postgres(db) => {
            sqlx::query_as(BY_ID)
                .bind(id)
                .fetch_optional(&db.pool)
                .await?
        }
    };
    row.map(from_row).transpose()
}

/// The provider last called for message `id` and whether its next
/// attempt must go to that provider again (see [`crate::store::Called`]).
pub async fn last_provider(db: &Db, id: &str) -> anyhow::Result<Option<(String, bool)>> {
    const LAST: &str = "SELECT provider, provider_pinned FROM messages WHERE id = $1";
    let row: Option<(Option<String>, bool)> = match db {
        Db::Sqlite(db) => {
            db.row(LAST, sqlite::args![id.to_owned()], sqlite::tuple)
                .await?
        }
        Db::Postgres(db) => {
            sqlx::query_as(LAST)
                .bind(id)
                .fetch_optional(&db.pool)
                .await?
        }
    };
    Ok(row.and_then(|(provider, pinned)| provider.map(|provider| (provider, pinned))))
}

/// Live messages (not a test key's) `tenant_id` sent at or after
/// `since_ms`: what its daily quota has used (start-up).
pub async fn count_since(db: &Db, tenant_id: &str, since_ms: i64) -> anyhow::Result<u64> {
    const COUNT: &str = "SELECT COUNT(*) FROM messages \
         WHERE tenant_id = $1 AND test = FALSE AND created_at >= $2";
    let count: i64 = match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![tenant_id.to_owned(), since_ms];
            db.row(COUNT, args, |row| row.get(0)).await?.unwrap_or(0)
        }
        Db::Postgres(db) => {
            sqlx::query_scalar(COUNT)
                .bind(tenant_id)
                .bind(since_ms)
                .fetch_one(&db.pool)
                .await?
        }
    };
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
            let ids = ids.to_vec();
            sqlite
                .transact(move |tx| {
                    for id in &ids {
                        super::sqlite::lifecycle::redrive(tx, id, redrive_started, now)?;
                    }
                    Ok(())
                })
                .await?;
        }
        Db::Postgres(pg) => {
            let mut tx = pg.pool.begin().await?;
            super::postgres::lifecycle::redrive(&mut tx, ids, redrive_started, now).await?;
            tx.commit().await?;
        }
    }
    Ok(())
}

/// Undoes [`mark_requeued`] for messages that could not be moved after all.
pub async fn restore_dead_lettered(db: &Db, ids: &[String]) -> anyhow::Result<()> {
    match db {
        Db::Sqlite(sqlite) => {
            let (ids, now) = (ids.to_vec(), crate::model::now_ms());
            sqlite
                .transact(move |tx| {
                    for id in &ids {
                        super::sqlite::lifecycle::restore(tx, id, now)?;
                    }
                    Ok(())
                })
                .await?;
        }
        Db::Postgres(pg) => {
            let mut conn = pg.pool.acquire().await?;
            super::postgres::lifecycle::restore(&mut conn, ids, crate::model::now_ms()).await?;
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
            for chunk in ids.chunks(sqlite::IDS_PER_STATEMENT) {
                let sql = format!(
                    "{}{}",
                    select_message!("WHERE id IN ("),
                    sqlite::id_list(chunk.len())
                );
                let args = chunk
                    .iter()
                    .cloned()
                    .map(rusqlite::types::Value::from)
                    .collect();
                keep(sqlite.rows(sql, args, message_row).await?)?;
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

/// Of `scope`'s messages with `reference`: the ids of up to `limit` still
/// waiting to be sent, and how many there are in all.
pub async fn ids_by_reference(
    db: &Db,
    scope: &Scope,
    reference: &str,
    limit: i64,
) -> anyhow::Result<(Vec<String>, usize)> {
    const PENDING: &str = "SELECT id FROM messages \
         WHERE tenant_id = $1 AND test = $2 AND reference = $3 \
         AND status IN ('scheduled', 'queued', 'retrying') ORDER BY id LIMIT $4";
    const TOTAL: &str =
        "SELECT COUNT(*) FROM messages WHERE tenant_id = $1 AND test = $2 AND reference = $3";
    let (tenant, test) = (scope.tenant(), scope.is_test());
    let (pending, total): (Vec<String>, i64) = match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![tenant.to_owned(), test, reference.to_owned()];
            let mut with_limit = args.clone();
            with_limit.push(limit.into());
            (
                db.rows(PENDING, with_limit, |row| row.get(0)).await?,
                db.row(TOTAL, args, |row| row.get(0)).await?.unwrap_or(0),
            )
        }
        Db::Postgres(db) => (
            sqlx::query_scalar(PENDING)
                .bind(tenant)
                .bind(test)
                .bind(reference)
                .bind(limit)
                .fetch_all(&db.pool)
                .await?,
            sqlx::query_scalar(TOTAL)
                .bind(tenant)
                .bind(test)
                .bind(reference)
                .fetch_one(&db.pool)
                .await?,
        ),
    };
    Ok((pending, total.max(0) as usize))
}

/// Creates, if missing, the partial index of pending messages that
/// [`oldest_pending`] reads (the PostgreSQL schema has it from its first
/// migration). Its WHERE clause must match the query's word for word for
/// SQLite to use it.
pub async fn index_pending(db: &Db) -> anyhow::Result<()> {
    if let Db::Sqlite(sqlite) = db {
        let index = "CREATE INDEX IF NOT EXISTS messages_pending ON messages(lane, created_at) \
                     WHERE status IN ('queued', 'sending', 'retrying')";
        sqlite.execute(index, vec![]).await?;
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
    const OLDEST: &str = "SELECT MIN(created_at) FROM messages \
         WHERE lane = $1 AND status IN ('queued', 'sending', 'retrying')";
    const OLDEST_OF: &str = "SELECT MIN(created_at) FROM messages \
         WHERE lane = $1 AND status IN ('queued', 'sending', 'retrying') AND tenant_id = $2";
    let lane = lane.as_str();
    Ok(match (db, tenant) {
        (Db::Sqlite(db), None) => {
            let args = sqlite::args![lane.to_owned()];
            db.row(OLDEST, args, |row| row.get(0)).await?.flatten()
        }
        (Db::Sqlite(db), Some(tenant)) => {
            let args = sqlite::args![lane.to_owned(), tenant.to_owned()];
            db.row(OLDEST_OF, args, |row| row.get(0)).await?.flatten()
        }
        (Db::Postgres(db), None) => {
            sqlx::query_scalar(OLDEST)
                .bind(lane)
                .fetch_one(&db.pool)
                .await?
        }
        (Db::Postgres(db), Some(tenant)) => {
            sqlx::query_scalar(OLDEST_OF)
                .bind(lane)
                .bind(tenant)
                .fetch_one(&db.pool)
                .await?
        }
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
    let now = crate::model::now_ms();
    sqlite
        .transact(move |tx| Ok(super::sqlite::lifecycle::release_all(tx, now)?))
        .await
}

/// Which of a scope's messages a list shows (all given conditions hold).
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    pub reference: Option<String>,
    pub status: Option<crate::model::MessageStatus>,
    pub channel: Option<crate::model::Channel>,
    /// Created at or after (ms).
    pub since: Option<i64>,
    /// Created before (ms).
    pub until: Option<i64>,
    /// Only messages older than this `(created_at, id)`: the previous
    /// page's last.
    pub before: Option<(i64, String)>,
}

/// A page of a list, and where the next page goes on when the page ended
/// short because its scan ran out of budget.
#[derive(Debug)]
pub struct ListPage {
    pub rows: Vec<MessageRecord>,
    /// Set when a filter no index serves (a status or channel without a
    /// reference) read `scan_rows` messages without filling the page: the
    /// `(created_at, id)` of the last message it read, below which the next
    /// page's scan continues.
    pub scanned_to: Option<(i64, String)>,
}

/// A page of `scope`'s messages, newest first, at most `limit`: a test
/// key's messages or live ones, never both in one list. The
/// index `(tenant_id, test, created_at, id)` gives the order, so a page
/// reads about as many rows as it shows; a reference has an index of its
/// own. A status or channel (without a reference) is checked on each row
/// the index yields, and at most `scan_rows` rows are read for one page: a
/// rare or absent status then answers in bounded time with what it found
/// and [`ListPage::scanned_to`], never by walking the tenant's every row.
pub async fn list(
    db: &Db,
    scope: &Scope,
    filter: &ListFilter,
    limit: i64,
    scan_rows: i64,
) -> anyhow::Result<ListPage> {
    // $1 and $2 are the tenant and `test`; each condition given adds one
    // placeholder after them, numbered in the order of `binds`: first
    // those the list index serves (`window`), then those checked on each
    // row (`checked`).
    let mut binds: Vec<ListValue> = Vec::new();
    let mut window = String::new();
    let mut checked = String::new();
    let condition =
        |out: &mut String, binds: &mut Vec<ListValue>, column: &str, op: &str, value| {
            out.push_str(&format!(" AND {column} {op} ${}", binds.len() + 3));
            binds.push(value);
        };
    if let Some(since) = filter.since {
        condition(
            &mut window,
            &mut binds,
            "created_at",
            ">=",
            ListValue::Number(since),
        );
    }
    if let Some(until) = filter.until {
        condition(
            &mut window,
            &mut binds,
            "created_at",
            "<",
            ListValue::Number(until),
        );
    }
    if let Some((at, id)) = &filter.before {
        // A row value, which both engines read as a range of the index
        // (an OR of the two cases made PostgreSQL filter from the top).
        let (a, b) = (binds.len() + 3, binds.len() + 4);
        window.push_str(&format!(" AND (created_at, id) < (${a}, ${b})"));
        binds.push(ListValue::Number(*at));
        binds.push(ListValue::Text(id.clone()));
    }
    let window_binds = binds.len();
    let equal_to = [
        ("reference", filter.reference.clone()),
        ("status", filter.status.map(|s| s.as_str().to_owned())),
        ("channel", filter.channel.map(|c| c.as_str().to_owned())),
    ];
    for (column, value) in equal_to {
        if let Some(value) = value {
            condition(
                &mut checked,
                &mut binds,
                column,
                "=",
                ListValue::Text(value),
            );
        }
    }
    const NEWEST_FIRST: &str = " ORDER BY created_at DESC, id DESC";
    let bounded = filter.reference.is_none() && !checked.is_empty();
    let sql = if bounded {
        let scan = binds.len() + 3;
        binds.push(ListValue::Number(scan_rows));
        format!(
            "SELECT {MESSAGE_COLUMNS} FROM (SELECT * FROM messages \
             WHERE tenant_id = $1 AND test = $2{window}{NEWEST_FIRST} LIMIT ${scan}) AS scanned \
             WHERE TRUE{checked}{NEWEST_FIRST} LIMIT ${}",
            binds.len() + 3
        )
    } else {
        // SQLite's statistics come from a sample (`analysis_limit`), which
        // cannot see that one tenant holds a million rows: it then walks
        // the tenant's rows newest first looking for the reference
        // (seconds for a rare one) instead of reading the reference's own
        // rows and sorting them (milliseconds for a thousand). A reference
        // shared by a great many messages is the case this makes slower;
        // PostgreSQL samples rows at random and chooses well by itself.
        let index = match (db, filter.reference.is_some()) {
            (Db::Sqlite(_), true) => " INDEXED BY messages_tenant_reference",
            _ => "",
        };
        format!(
            "SELECT {MESSAGE_COLUMNS} FROM messages{index} \
             WHERE tenant_id = $1 AND test = $2{window}{checked}{NEWEST_FIRST} LIMIT ${}",
            binds.len() + 3
        )
    };
    binds.push(ListValue::Number(limit));
    // Where the scan stopped, asked when a bounded page comes back short
    // (and so the scan, not the page, ended it): the `scan_rows`-th row of
    // the window, read from the index alone. None past the tenant's last.
    let stop = bounded.then(|| {
        let mut stop_binds = binds[..window_binds].to_vec();
        let sql = format!(
            "SELECT created_at, id FROM messages \
             WHERE tenant_id = $1 AND test = $2{window}{NEWEST_FIRST} LIMIT 1 OFFSET ${}",
            stop_binds.len() + 3
        );
        stop_binds.push(ListValue::Number(scan_rows - 1));
        (sql, stop_binds)
    });
    let page = (sql, binds);
    let (rows, scanned_to) = match db {
        Db::Sqlite(db) => {
            let rows = db
                .rows(page.0, sqlite_list_args(scope, &page.1), message_row)
                .await?;
            let scanned_to = match stop {
                Some((sql, binds)) if (rows.len() as i64) < limit => {
                    db.row(sql, sqlite_list_args(scope, &binds), sqlite::tuple)
                        .await?
                }
                _ => None,
            };
            (rows, scanned_to)
        }
        Db::Postgres(db) => {
            let in_index_order = filter.reference.is_none();
            pg_list(db, scope, page, stop, limit, in_index_order).await?
        }
    };
    let rows = rows
        .into_iter()
        .map(from_row)
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(ListPage { rows, scanned_to })
}

/// A value bound to a list's statement.
#[derive(Debug, Clone)]
enum ListValue {
    Text(String),
    Number(i64),
}

/// A list's statement and the values of its placeholders after `$1`, `$2`.
type ListStatement = (String, Vec<ListValue>);

/// The PostgreSQL side of [`list`]: the page, and where its scan stopped
/// when `stop` is given and the page came back short, in one transaction.
/// `in_index_order`: the page is read in the list index's order (no
/// reference), and PostgreSQL is kept from sorting it. Its statistics may
/// lag a tenant's growth (autovacuum's `ANALYZE` comes later, or never
/// where autovacuum is off): expecting a few hundred rows where there are a
/// million, it would read all the tenant's rows and sort them (0.6 s for a
/// scan of 20,000 here) where the index holds them in order (6 ms).
async fn pg_list(
    db: &super::postgres::PgDb,
    scope: &Scope,
    page: ListStatement,
    stop: Option<ListStatement>,
    limit: i64,
    in_index_order: bool,
) -> anyhow::Result<(Vec<MessageRow>, Option<(i64, String)>)> {
    let mut tx = db.pool.begin().await?;
    if in_index_order {
        sqlx::query("SET LOCAL enable_sort = off")
            .execute(&mut *tx)
            .await?;
    }
    let rows: Vec<MessageRow> =
        pg_bind(sqlx::query_as(sqlx::AssertSqlSafe(page.0)), scope, &page.1)
            .fetch_all(&mut *tx)
            .await?;
    let scanned_to = match stop {
        Some((sql, binds)) if (rows.len() as i64) < limit => {
            pg_bind(sqlx::query_as(sqlx::AssertSqlSafe(sql)), scope, &binds)
                .fetch_optional(&mut *tx)
                .await?
        }
        _ => None,
    };
    tx.commit().await?;
    Ok((rows, scanned_to))
}

/// Binds the scope and then `binds` to a list's PostgreSQL statement.
fn pg_bind<'q, O>(
    mut query: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    scope: &'q Scope,
    binds: &'q [ListValue],
) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
    query = query.bind(scope.tenant()).bind(scope.is_test());
    for value in binds {
        query = match value {
            ListValue::Text(text) => query.bind(text.as_str()),
            ListValue::Number(number) => query.bind(*number),
        };
    }
    query
}

fn sqlite_list_args(scope: &Scope, binds: &[ListValue]) -> sqlite::Args {
    let mut args = sqlite::args![scope.tenant().to_owned(), scope.is_test()];
    args.extend(binds.iter().map(|value| match value {
        ListValue::Text(text) => text.clone().into(),
        ListValue::Number(number) => (*number).into(),
    }));
    args
}

/// (Being moved here: the messages operations, implemented per engine in
/// `sqlite/messages.rs` and `postgres/messages.rs`.)
#[async_trait::async_trait]
pub trait MessageStore: Send + Sync {}
