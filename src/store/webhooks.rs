//! The rows of tenant webhooks: each tenant's endpoint (`webhooks`), its
//! place in its tenant's event log, and the calls that failed
//! (`webhook_deliveries`), read and leased by the dispatcher
//! (`crate::webhooks::dispatch`).
//!
//! The event log is the queue of calls. Each endpoint keeps a *position*
//! in its tenant's events (a [`Cursor`]): every event it wants up to there
//! was delivered or has a row. One instance at a time reads an endpoint's
//! events past the position (its *stream*), under a lease on the endpoint's
//! row, and keeps how far it has read (`read_*`): what lies between is in
//! flight. As calls end, the dispatcher moves the position past the
//! unbroken run of ended calls, a batch at a time. A call that fails gets a
//! row, with its retries and backoff; a later event of that message is
//! held behind it as a row too, so each message's events arrive in order.
//! So a delivered event costs no write of its own: the event row the
//! lifecycle writes anyway, and a share of one position update. If the
//! instance dies, its lease ends and another reads again from the
//! position (at least once, with the same `webhook-id`).

use super::messages::MessageRecord;
use rusqlite::OptionalExtension;

use super::{Db, sqlite};
use crate::model::{MessageStatus, now_ms};

/// A place in a tenant's event log: (transaction id, event id). On
/// PostgreSQL an event's id is taken at insert, not at commit, so the
/// stream reads in (xid, id) order only the events of transactions older
/// than every one still running; on SQLite one writer commits events in id
/// order and every xid is 0.
pub type Cursor = (i64, i64);

/// A tenant's endpoint as stored.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Webhook {
    pub tenant_id: String,
    pub url: String,
    /// Space-separated, with a space at each end.
    pub events: String,
    pub secret: String,
    pub previous_secret: Option<String>,
    pub previous_until: Option<i64>,
    pub failing_since: Option<i64>,
    pub last_error: Option<String>,
    pub disabled_at: Option<i64>,
    pub created_at: i64,
    pub updated_at: i64,
}

impl Webhook {
    /// The secrets that sign a call at `now`: the current one, and the
    /// previous one during its grace period.
    pub fn signing_secrets(&self, now: i64) -> Vec<&str> {
        let mut secrets = vec![self.secret.as_str()];
        if let (Some(previous), Some(until)) = (&self.previous_secret, self.previous_until)
            && now < until
        {
            secrets.push(previous);
        }
        secrets
    }
}

/// The columns of [`Webhook`], for `concat!`.
macro_rules! columns {
    () => {
        "tenant_id, url, events, secret, previous_secret, previous_until, \
         failing_since, last_error, disabled_at, created_at, updated_at"
    };
}

/// The endpoint of tenant `$1`: the columns of [`Webhook`], in order.
pub(crate) const WEBHOOK_OF: &str =
    concat!("SELECT ", columns!(), " FROM webhooks WHERE tenant_id = $1");

/// The tenant's endpoint, if it has one.
pub async fn get(db: &Db, tenant_id: &str) -> anyhow::Result<Option<Webhook>> {
    Ok(match db {
        Db::Sqlite(db) => {
            db.row(WEBHOOK_OF, sqlite::args![tenant_id.to_owned()], webhook_row)
                .await?
        }
        Db::Postgres(db) => {
            sqlx::query_as::<_, Webhook>(WEBHOOK_OF)
                .bind(tenant_id)
                .fetch_optional(&db.pool)
                .await?
        }
    })
}

/// A [`Webhook`] from a rusqlite row of its columns.
pub(crate) fn webhook_row(row: &rusqlite::Row) -> rusqlite::Result<Webhook> {
    Ok(Webhook {
        tenant_id: row.get(0)?,
        url: row.get(1)?,
        events: row.get(2)?,
        secret: row.get(3)?,
        previous_secret: row.get(4)?,
        previous_until: row.get(5)?,
        failing_since: row.get(6)?,
        last_error: row.get(7)?,
        disabled_at: row.get(8)?,
        created_at: row.get(9)?,
        updated_at: row.get(10)?,
    })
}

/// Every row of `sql` (parameters `args`) on either store, as tuples.
async fn tuples<T>(db: &Db, sql: String, args: Vec<Arg>) -> anyhow::Result<Vec<T>>
where
    T: for<'a> TryFrom<&'a rusqlite::Row<'a>, Error = rusqlite::Error>
        + for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>
        + Send
        + Unpin
        + 'static,
{
    Ok(match db {
        Db::Sqlite(db) => {
            let args = args.into_iter().map(Arg::into_sqlite).collect();
            db.rows(sql, args, sqlite::tuple).await?
        }
        Db::Postgres(db) => {
            let mut query = sqlx::query_as(sqlx::AssertSqlSafe(sql));
            for arg in args {
                query = match arg {
                    Arg::Text(text) => query.bind(text),
                    Arg::Number(number) => query.bind(number),
                };
            }
            query.fetch_all(&db.pool).await?
        }
    })
}

/// A parameter of [`tuples`].
enum Arg {
    Text(Option<String>),
    Number(i64),
}

impl Arg {
    fn into_sqlite(self) -> rusqlite::types::Value {
        match self {
            Arg::Text(text) => text.into(),
            Arg::Number(number) => number.into(),
        }
    }
}

/// A tenant's calls in one state.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeliveryCount {
    /// `pending` or `failed`.
    pub state: String,
    pub count: i64,
    /// Of those, the ones whose next attempt time has come (a call in
    /// flight is leased past it, so it is not counted).
    pub due: i64,
    /// Event time (ms) of the oldest.
    pub oldest: Option<i64>,
}

impl DeliveryCount {
    fn add(&mut self, count: i64, due: i64, oldest: Option<i64>) {
        self.count += count;
        self.due += due;
        self.oldest = match (self.oldest, oldest) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
}

/// Whether the endpoint `w` wants the event `e`, in `db`'s dialect.
fn wanted(db: &Db) -> &'static str {
    if db.is_shared() {
        "strpos(w.events, ' message.' || e.event || ' ') > 0"
    } else {
        "instr(w.events, ' message.' || e.event || ' ') > 0"
    }
}

/// `e`'s place is past (`xid`, `id`), in `db`'s dialect. PostgreSQL seeks
/// the row value in the `(tenant_id, xid, id)` index; SQLite would walk
/// every one of the tenant's events for it, and its xids are all 0, so it
/// compares the ids alone.
fn past(db: &Db, xid: &str, id: &str) -> String {
    if db.is_shared() {
        format!("(e.xid, e.id) > ({xid}, {id})")
    } else {
        format!("e.xid = 0 AND e.id > {id}")
    }
}

/// The events past the endpoint's position that it wants and that have no
/// row: how many, how many are past where its stream is read (the rest
/// are in flight; once the reader's lease has ended, all are due again),
/// and the oldest one's time. `$1` the tenant (or NULL for all), `$2` now.
fn stream_backlog(db: &Db, whose: &str) -> String {
    format!(
        "SELECT COUNT(e.id), \
         COALESCE(SUM(CASE WHEN COALESCE(w.stream_until, 0) <= $2 \
                             OR (e.xid, e.id) > (w.read_xid, w.read_id) THEN 1 ELSE 0 END), 0), \
         MIN(e.at), w.disabled_at IS NOT NULL \
         FROM webhooks AS w JOIN message_events AS e ON e.tenant_id = w.tenant_id \
         WHERE {whose} AND {} AND {} \
         AND NOT EXISTS (SELECT 1 FROM webhook_deliveries AS d WHERE d.event_id = e.id) \
         GROUP BY w.tenant_id, w.disabled_at",
        past(db, "w.position_xid", "w.position_id"),
        wanted(db)
    )
}

/// The tenant's calls by state, as of `now`: its failed calls' rows, and
/// the events its stream has still to deliver (pending; failed while the
/// endpoint is disabled, kept for a redrive).
pub async fn delivery_counts(
    db: &Db,
    tenant_id: &str,
    now: i64,
) -> anyhow::Result<Vec<DeliveryCount>> {
    let rows: Vec<(String, i64, i64, Option<i64>)> = tuples(
        db,
        "SELECT state, COUNT(*) AS count, \
         COALESCE(SUM(CASE WHEN next_attempt_at <= $2 THEN 1 ELSE 0 END), 0) AS due, \
         MIN(created_at) AS oldest \
         FROM webhook_deliveries WHERE tenant_id = $1 GROUP BY state"
            .to_owned(),
        vec![Arg::Text(Some(tenant_id.to_owned())), Arg::Number(now)],
    )
    .await?;
    let sql = stream_backlog(db, "w.tenant_id = $1");
    let stream: Option<(i64, i64, Option<i64>, bool)> = tuples(
        db,
        sql,
        vec![Arg::Text(Some(tenant_id.to_owned())), Arg::Number(now)],
    )
    .await?
    .pop();
    let mut counts: Vec<DeliveryCount> = rows
        .into_iter()
        .map(|(state, count, due, oldest)| DeliveryCount {
            state,
            count,
            due,
            oldest,
        })
        .collect();
    if let Some((count, due, oldest, disabled)) = stream.filter(|stream| stream.0 > 0) {
        let (state, due) = if disabled {
            ("failed", count)
        } else {
            ("pending", due)
        };
        match counts.iter_mut().find(|c| c.state == state) {
            Some(known) => known.add(count, due, oldest),
            None => counts.push(DeliveryCount {
                state: state.into(),
                count,
                due,
                oldest,
            }),
        }
    }
    Ok(counts)
}

/// Every tenant's pending calls due at `now`: how many, and the event time
/// (ms) of the oldest, for the dispatcher's gauges.
pub async fn due_overall(db: &Db, now: i64) -> anyhow::Result<(i64, Option<i64>)> {
    let (rows, oldest_row): (i64, Option<i64>) = tuples(
        db,
        "SELECT COUNT(*), MIN(created_at) FROM webhook_deliveries \
         WHERE state = 'pending' AND next_attempt_at <= $1"
            .to_owned(),
        vec![Arg::Number(now)],
    )
    .await?
    .pop()
    .unwrap_or_default();
    let sql = stream_backlog(db, "w.disabled_at IS NULL AND $1::text IS NULL");
    let sql = if db.is_shared() {
        sql
    } else {
        sql.replace("$1::text IS NULL", "$1 IS NULL")
    };
    let streams: Vec<(i64, i64, Option<i64>, bool)> =
        tuples(db, sql, vec![Arg::Text(None), Arg::Number(now)]).await?;
    let mut total = DeliveryCount::default();
    total.add(rows, 0, oldest_row);
    for (_, due, oldest, _) in streams.into_iter().filter(|stream| stream.1 > 0) {
        total.add(due, 0, oldest);
    }
    Ok((total.count, total.oldest))
}

/// Sets the tenant's endpoint. A new endpoint gets `secret` (returned); a
/// changed one keeps its secret (None) and is enabled again, its failed
/// events pending once more.
pub async fn put(
    db: &Db,
    tenant_id: &str,
    url: &str,
    events: &str,
    secret: String,
) -> anyhow::Result<(Webhook, Option<String>)> {
    const EXISTS: &str = "SELECT tenant_id FROM webhooks WHERE tenant_id = $1";
    const CHANGE: &str = "UPDATE webhooks SET url = $1, events = $2, failing_since = NULL, \
         last_error = NULL, disabled_at = NULL, updated_at = $3 WHERE tenant_id = $4";
    // A new endpoint gets the events from now on: its stream starts at the
    // tenant's newest event.
    const CREATE: &str = "INSERT INTO webhooks (tenant_id, url, events, secret, created_at, \
         updated_at, position_xid, position_id, read_xid, read_id) \
         SELECT $1, $2, $3, $4, $5, $5, top.xid, top.id, top.xid, top.id FROM \
         (SELECT xid, id FROM message_events WHERE tenant_id = $1 \
          UNION ALL SELECT 0, 0 ORDER BY 1 DESC, 2 DESC LIMIT 1) AS top";
    let now = now_ms();
    let created = match db {
        Db::Sqlite(db) => {
            let (tenant_id, url, events, secret) = (
                tenant_id.to_owned(),
                url.to_owned(),
                events.to_owned(),
                secret.clone(),
            );
            db.transact(move |tx| {
                let existed = sqlite::prepare(tx, EXISTS)?
                    .query_row([&tenant_id], |_| Ok(()))
                    .optional()?
                    .is_some();
                if existed {
                    sqlite::prepare(tx, CHANGE)?
                        .execute(rusqlite::params![url, events, now, tenant_id])?;
                    sqlite::prepare(tx, RESUME)?.execute(rusqlite::params![now, tenant_id])?;
                } else {
                    sqlite::prepare(tx, CREATE)?
                        .execute(rusqlite::params![tenant_id, url, events, secret, now])?;
                }
                Ok(!existed)
            })
            .await?
        }
        Db::Postgres(db) => {
            let mut tx = db.pool.begin().await?;
            let existed: Option<String> = sqlx::query_scalar(EXISTS)
                .bind(tenant_id)
                .fetch_optional(&mut *tx)
                .await?;
            if existed.is_some() {
                sqlx::query(CHANGE)
                    .bind(url)
                    .bind(events)
                    .bind(now)
                    .bind(tenant_id)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query(RESUME)
                    .bind(now)
                    .bind(tenant_id)
                    .execute(&mut *tx)
                    .await?;
            } else {
                sqlx::query(CREATE)
                    .bind(tenant_id)
                    .bind(url)
                    .bind(events)
                    .bind(&secret)
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            existed.is_none()
        }
    };
    let webhook = get(db, tenant_id)
        .await?
        .ok_or_else(|| anyhow::anyhow!("the webhook just written is gone"))?;
    Ok((webhook, created.then_some(secret)))
}

/// Makes a tenant's failed events pending again, due now (`$1`), for
/// tenant `$2`.
const RESUME: &str = "UPDATE webhook_deliveries SET state = 'pending', next_attempt_at = $1, \
     attempts = 0, last_error = NULL WHERE tenant_id = $2 AND state = 'failed'";

/// Gives the tenant's endpoint the new `secret`; the old one keeps signing
/// beside it for `grace_ms`. None when there is no endpoint.
pub async fn rotate(
    db: &Db,
    tenant_id: &str,
    secret: String,
    grace_ms: i64,
) -> anyhow::Result<Option<(Webhook, String)>> {
    const ROTATE: &str = "UPDATE webhooks SET previous_secret = secret, previous_until = $1, \
         secret = $2, updated_at = $3 WHERE tenant_id = $4";
    let now = now_ms();
    let rotated = match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![now + grace_ms, secret.clone(), now, tenant_id.to_owned()];
            db.execute(ROTATE, args).await? as u64
        }
        Db::Postgres(db) => sqlx::query(ROTATE)
            .bind(now + grace_ms)
            .bind(&secret)
            .bind(now)
            .bind(tenant_id)
            .execute(&db.pool)
            .await?
            .rows_affected(),
    };
    if rotated == 0 {
        return Ok(None);
    }
    Ok(get(db, tenant_id).await?.map(|webhook| (webhook, secret)))
}

/// Removes the tenant's endpoint and the events still waiting for it;
/// true when there was one.
pub async fn delete(db: &Db, tenant_id: &str) -> anyhow::Result<bool> {
    const CALLS: &str = "DELETE FROM webhook_deliveries WHERE tenant_id = $1";
    const ENDPOINT: &str = "DELETE FROM webhooks WHERE tenant_id = $1";
    let removed = match db {
        Db::Sqlite(db) => {
            let tenant_id = tenant_id.to_owned();
            db.transact(move |tx| {
                tx.execute(CALLS, [&tenant_id])?;
                Ok(tx.execute(ENDPOINT, [&tenant_id])? as u64)
            })
            .await?
        }
        Db::Postgres(db) => {
            let mut tx = db.pool.begin().await?;
            sqlx::query(CALLS).bind(tenant_id).execute(&mut *tx).await?;
            let removed = sqlx::query(ENDPOINT)
                .bind(tenant_id)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            removed.rows_affected()
        }
    };
    Ok(removed == 1)
}

/// Enables the tenant's endpoint again and makes its failed events pending,
/// due now; returns how many, with the events its stream kept while it was
/// disabled. None when there is no endpoint.
pub async fn redrive(db: &Db, tenant_id: &str) -> anyhow::Result<Option<u64>> {
    let now = now_ms();
    const ENABLE: &str = "UPDATE webhooks SET disabled_at = NULL, failing_since = NULL, \
         updated_at = $1 WHERE tenant_id = $2";
    let backlog = stream_backlog(db, "w.tenant_id = $1");
    let kept_of =
        |kept: Option<(i64, i64, Option<i64>, bool)>| kept.map_or(0, |k| k.0.max(0) as u64);
    Ok(match db {
        Db::Sqlite(db) => {
            let tenant_id = tenant_id.to_owned();
            db.transact(move |tx| {
                if sqlite::prepare(tx, ENABLE)?.execute(rusqlite::params![now, tenant_id])? == 0 {
                    return Ok(None);
                }
                let rows =
                    sqlite::prepare(tx, RESUME)?.execute(rusqlite::params![now, tenant_id])?;
                let kept = sqlite::prepare(tx, &backlog)?
                    .query_row(rusqlite::params![tenant_id, now], sqlite::tuple)
                    .optional()?;
                Ok(Some(rows as u64 + kept_of(kept)))
            })
            .await?
        }
        Db::Postgres(db) => {
            let mut tx = db.pool.begin().await?;
            let enabled = sqlx::query(ENABLE)
                .bind(now)
                .bind(tenant_id)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if enabled == 0 {
                return Ok(None);
            }
            let rows = sqlx::query(RESUME)
                .bind(now)
                .bind(tenant_id)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            let kept = sqlx::query_as(sqlx::AssertSqlSafe(backlog))
                .bind(tenant_id)
                .bind(now)
                .fetch_optional(&mut *tx)
                .await?;
            tx.commit().await?;
            Some(rows + kept_of(kept))
        }
    })
}

/// Endpoints that are failing or disabled, oldest failure first.
pub async fn failing(db: &Db) -> anyhow::Result<Vec<Webhook>> {
    const FAILING: &str = concat!(
        "SELECT ",
        columns!(),
        " FROM webhooks WHERE failing_since IS NOT NULL OR disabled_at IS NOT NULL \
         ORDER BY COALESCE(failing_since, disabled_at) LIMIT 1000"
    );
    Ok(match db {
        Db::Sqlite(db) => db.rows(FAILING, vec![], webhook_row).await?,
        Db::Postgres(db) => {
            sqlx::query_as::<_, Webhook>(FAILING)
                .fetch_all(&db.pool)
                .await?
        }
    })
}

/// A call taken for this instance.
#[derive(Debug, Clone)]
pub struct DueCall {
    pub event_id: i64,
    pub tenant_id: String,
    pub message_id: String,
    pub kind: String,
    pub created_at: i64,
    pub attempts: i64,
    /// Where the event is in its endpoint's stream, for a call taken from
    /// it; `None` for a failed call's retry (a row).
    pub cursor: Option<Cursor>,
}

/// The tenants whose enabled endpoint has events past where its stream is
/// read, or whose reader's lease (`$1`: now) has ended with calls still
/// between the position and the read; PostgreSQL's (for SQLite's, see
/// [`STREAM_TENANTS_SQLITE`]).
pub(crate) const STREAM_TENANTS: &str = "SELECT w.tenant_id FROM webhooks AS w WHERE w.disabled_at IS NULL AND ( \
       EXISTS (SELECT 1 FROM message_events AS e WHERE e.tenant_id = w.tenant_id \
               AND (e.xid, e.id) > (w.read_xid, w.read_id)) \
       OR (COALESCE(w.stream_until, 0) <= $1 \
           AND (w.read_xid, w.read_id) > (w.position_xid, w.position_id)))";

/// [`STREAM_TENANTS`] on SQLite, whose xids are all 0: a row value would
/// walk every one of the tenant's events, the id alone seeks the index.
pub(crate) const STREAM_TENANTS_SQLITE: &str = "SELECT w.tenant_id FROM webhooks AS w WHERE w.disabled_at IS NULL AND ( \
       EXISTS (SELECT 1 FROM message_events AS e WHERE e.tenant_id = w.tenant_id \
               AND e.xid = 0 AND e.id > w.read_id) \
       OR (COALESCE(w.stream_until, 0) <= $1 AND w.read_id > w.position_id))";

/// Holds event `$1` (tenant `$2`, message `$3`, type `message.$4`, at `$5`)
/// behind its message's failed call: a row, failed if one of those was
/// given up, else due as it happened; [`DUE_CALLS`] takes it once no
/// earlier event of its message has a row.
pub(crate) const HOLD: &str = "INSERT INTO webhook_deliveries (event_id, tenant_id, message_id, type, created_at, \
     next_attempt_at, attempts, state) \
     SELECT $1, $2, $3, 'message.' || $4, $5, $5, 0, m.state \
     FROM (SELECT MIN(state) AS state FROM webhook_deliveries WHERE message_id = $3) AS m \
     WHERE m.state IS NOT NULL \
     ON CONFLICT (event_id) DO NOTHING";

/// The tenants with calls pending, by one index probe per such tenant (a
/// "loose index scan"), not a pass over every pending row: a dead
/// endpoint's backlog can be millions of rows.
pub(crate) const PENDING_TENANTS: &str = "WITH RECURSIVE pending(tenant_id) AS ( \
       SELECT MIN(tenant_id) FROM webhook_deliveries WHERE state = 'pending' \
       UNION ALL \
       SELECT (SELECT MIN(d.tenant_id) FROM webhook_deliveries AS d \
               WHERE d.state = 'pending' AND d.tenant_id > pending.tenant_id) \
       FROM pending WHERE pending.tenant_id IS NOT NULL) \
     SELECT tenant_id FROM pending WHERE tenant_id IS NOT NULL";

/// The tenants with calls pending.
pub async fn tenants_with_pending(db: &Db) -> anyhow::Result<Vec<String>> {
    let tenants: Vec<(Option<String>,)> = tuples(db, PENDING_TENANTS.to_owned(), vec![]).await?;
    let tenants: Vec<Option<String>> = tenants.into_iter().map(|(tenant,)| tenant).collect();
    Ok(tenants.into_iter().flatten().collect())
}

/// The tenant's (`$1`) calls due at `$2`, each the earliest waiting event
/// of its message, soonest first, at most `$3`: the columns of
/// [`DueCall`].
pub(crate) const DUE_CALLS: &str = "SELECT d.event_id, d.tenant_id, d.message_id, d.type, d.created_at, d.attempts \
     FROM webhook_deliveries AS d \
     WHERE d.tenant_id = $1 AND d.state = 'pending' AND d.next_attempt_at <= $2 \
     AND NOT EXISTS (SELECT 1 FROM webhook_deliveries AS e \
                     WHERE e.message_id = d.message_id AND e.event_id < d.event_id) \
     ORDER BY d.next_attempt_at, d.event_id LIMIT $3";

/// Gives back a lease taken but not used: the call is due again now.
pub async fn release_lease(db: &Db, event_id: i64) -> anyhow::Result<()> {
    const RELEASE: &str = "UPDATE webhook_deliveries SET next_attempt_at = $1 WHERE event_id = $2";
    match db {
        Db::Sqlite(db) => {
            db.execute(RELEASE, sqlite::args![now_ms(), event_id])
                .await?;
        }
        Db::Postgres(db) => {
            sqlx::query(RELEASE)
                .bind(now_ms())
                .bind(event_id)
                .execute(&db.pool)
                .await?;
        }
    }
    Ok(())
}

/// Drops a call (its endpoint or message is gone).
pub async fn forget_call(db: &Db, event_id: i64) -> anyhow::Result<()> {
    const FORGET: &str = "DELETE FROM webhook_deliveries WHERE event_id = $1";
    match db {
        Db::Sqlite(db) => {
            db.execute(FORGET, sqlite::args![event_id]).await?;
        }
        Db::Postgres(db) => {
            sqlx::query(FORGET).bind(event_id).execute(&db.pool).await?;
        }
    }
    Ok(())
}

/// A call failed at `now` with `error`: it is due again at `next` (or
/// given up, `gave_up`), the message's later events move back with it,
/// and the endpoint is marked failing; once it has failed for `limit` ms
/// it is disabled and its pending calls given up. Returns whether it was
/// disabled now.
pub async fn call_failed(
    db: &Db,
    due: &DueCall,
    error: &str,
    next: i64,
    gave_up: bool,
    now: i64,
    limit: i64,
) -> anyhow::Result<bool> {
    // A call from the stream gets its row now; a retry's row counts one
    // more attempt. Given up, or its endpoint disabled meanwhile: kept
    // failed, for a redrive.
    const UPSERT: &str = "INSERT INTO webhook_deliveries (event_id, tenant_id, message_id, type, \
         created_at, next_attempt_at, attempts, state, last_error) \
         SELECT $1, $2, $3, $4, $5, $6, 1, \
         CASE WHEN $7 = 1 OR EXISTS (SELECT 1 FROM webhooks AS w WHERE w.tenant_id = $2 \
                                     AND w.disabled_at IS NOT NULL) \
              THEN 'failed' ELSE 'pending' END, $8 \
         WHERE TRUE \
         ON CONFLICT (event_id) DO UPDATE SET attempts = webhook_deliveries.attempts + 1, \
         last_error = excluded.last_error, next_attempt_at = excluded.next_attempt_at, \
         state = excluded.state";
    // The message's later events wait for this one anyway: moving them
    // back with it keeps them out of the next passes' reads.
    const LATER: &str = "UPDATE webhook_deliveries SET next_attempt_at = $1 \
         WHERE message_id = $2 AND event_id > $3 AND state = 'pending' AND next_attempt_at < $1";
    const FAILING: &str = "UPDATE webhooks SET failing_since = COALESCE(failing_since, $1), \
         last_error = $2 WHERE tenant_id = $3 AND disabled_at IS NULL RETURNING failing_since";
    const DISABLE: &str = "UPDATE webhooks SET disabled_at = $1 WHERE tenant_id = $2";
    const GIVE_UP: &str = "UPDATE webhook_deliveries SET state = 'failed' \
         WHERE tenant_id = $1 AND state = 'pending'";
    let disable = move |failing_since: Option<Option<i64>>| matches!(failing_since, Some(Some(since)) if now - since >= limit);
    Ok(match db {
        Db::Sqlite(db) => {
            let (due, error) = (due.clone(), error.to_owned());
            db.transact(move |tx| {
                sqlite::prepare(tx, UPSERT)?.execute(rusqlite::params![
                    due.event_id,
                    due.tenant_id,
                    due.message_id,
                    due.kind,
                    due.created_at,
                    next,
                    i32::from(gave_up),
                    error
                ])?;
                sqlite::prepare(tx, LATER)?.execute(rusqlite::params![
                    next,
                    due.message_id,
                    due.event_id
                ])?;
                let failing_since = sqlite::prepare(tx, FAILING)?
                    .query_row(rusqlite::params![now, error, due.tenant_id], |row| {
                        row.get(0)
                    })
                    .optional()?;
                let disabled = disable(failing_since);
                if disabled {
                    sqlite::prepare(tx, DISABLE)?.execute(rusqlite::params![now, due.tenant_id])?;
                    sqlite::prepare(tx, GIVE_UP)?.execute([&due.tenant_id])?;
                }
                Ok(disabled)
            })
            .await?
        }
        Db::Postgres(db) => {
            let mut tx = db.pool.begin().await?;
            sqlx::query(UPSERT)
                .bind(due.event_id)
                .bind(&due.tenant_id)
                .bind(&due.message_id)
                .bind(&due.kind)
                .bind(due.created_at)
                .bind(next)
                .bind(i32::from(gave_up))
                .bind(error)
                .execute(&mut *tx)
                .await?;
            sqlx::query(LATER)
                .bind(next)
                .bind(&due.message_id)
                .bind(due.event_id)
                .execute(&mut *tx)
                .await?;
            let failing_since: Option<Option<i64>> = sqlx::query_scalar(FAILING)
                .bind(now)
                .bind(error)
                .bind(&due.tenant_id)
                .fetch_optional(&mut *tx)
                .await?;
            let disabled = disable(failing_since);
            if disabled {
                sqlx::query(DISABLE)
                    .bind(now)
                    .bind(&due.tenant_id)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query(GIVE_UP)
                    .bind(&due.tenant_id)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            disabled
        }
    })
}

/// The columns of a message's status as it was at one of its events:
/// message id, tenant, at, status, attempts, detail, provider message id,
/// channel, priority, lane, reference, metadata, created at, sent at, send
/// at.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct SnapshotRow {
    pub id: String,
    pub tenant_id: String,
    /// The event's time, status, attempts, detail and provider id.
    pub at: i64,
    pub status: String,
    pub attempts: i64,
    pub detail: Option<String>,
    pub provider_message_id: Option<String>,
    pub channel: String,
    pub priority: String,
    pub lane: String,
    pub reference: Option<String>,
    pub metadata: Option<String>,
    pub created_at: i64,
    pub sent_at: Option<i64>,
    pub send_at: Option<i64>,
    pub test: bool,
    pub fragments: Option<i64>,
}

/// Reads a [`SnapshotRow`] by event id (SQLite's writer connection;
/// PostgreSQL reads a group's at once, `store::postgres::webhooks`).
pub(crate) const SNAPSHOT: &str = "SELECT m.id, m.tenant_id, e.at, e.status, e.attempts, e.detail, e.provider_message_id, \
     m.channel, m.priority, m.lane, m.reference, m.metadata, m.created_at, m.sent_at, m.send_at, m.test, m.fragments \
     FROM message_events AS e JOIN messages AS m ON m.id = e.message_id WHERE e.id = $1";

/// The message's status as it was at an event, from its [`SnapshotRow`].
pub(crate) fn record_at_event(row: SnapshotRow) -> anyhow::Result<MessageRecord> {
    let SnapshotRow {
        id,
        tenant_id,
        at,
        status,
        attempts,
        detail,
        provider_message_id,
        channel,
        priority,
        lane,
        reference,
        metadata,
        created_at,
        sent_at,
        send_at,
        test,
        fragments,
    } = row;
    let status: MessageStatus = status.parse().map_err(anyhow::Error::msg)?;
    let failure = !matches!(
        status,
        MessageStatus::Queued
            | MessageStatus::Sent
            | MessageStatus::Delivered
            | MessageStatus::Cancelled
    );
    Ok(MessageRecord {
        id,
        tenant_id,
        channel: channel.parse().map_err(anyhow::Error::msg)?,
        status,
        priority: priority.parse().map_err(anyhow::Error::msg)?,
        lane: lane.parse().map_err(anyhow::Error::msg)?,
        attempts: attempts.max(0) as u32,
        reference,
        metadata,
        created_at,
        updated_at: at,
        sent_at: sent_at.filter(|sent| *sent <= at),
        last_error: detail.filter(|_| failure),
        provider_message_id,
        send_at,
        test,
        fragments: fragments.map(|n| n.clamp(0, i64::from(u32::MAX)) as u32),
        erased_at: None,
        provider: None,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Checks [`delivery_counts`] and [`due_overall`] on `db` with call
    /// rows put in directly: due now, due later (a retry or a lease),
    /// failed, and another tenant's.
    pub(crate) async fn counts_tell_the_backlog_and_the_oldest_event(db: &Db) {
        let now = 1_000_000;
        // (event id, tenant, created_at, next_attempt_at, state)
        let rows = [
            (1_i64, "a", now - 9_000, now - 9_000, "pending"),
            (2, "a", now - 5_000, now + 60_000, "pending"),
            (3, "a", now - 1_000, now, "pending"),
            (4, "a", now - 20_000, now - 20_000, "failed"),
            (5, "b", now - 30_000, now + 1, "pending"),
        ];
        put_rows(db, &rows).await.unwrap();
        let mut counts = delivery_counts(db, "a", now).await.unwrap();
        counts.sort_by(|x, y| x.state.cmp(&y.state));
        let seen: Vec<(&str, i64, i64, Option<i64>)> = counts
            .iter()
            .map(|c| (c.state.as_str(), c.count, c.due, c.oldest))
            .collect();
        assert_eq!(
            seen,
            [
                ("failed", 1, 1, Some(now - 20_000)),
                ("pending", 3, 2, Some(now - 9_000)),
            ]
        );
        assert!(delivery_counts(db, "nobody", now).await.unwrap().is_empty());
        // Tenant b's call is due a millisecond later; a's failed one never.
        assert_eq!(due_overall(db, now).await.unwrap(), (2, Some(now - 9_000)));
        assert_eq!(
            due_overall(db, now + 1).await.unwrap(),
            (3, Some(now - 30_000))
        );
        assert_eq!(due_overall(db, 0).await.unwrap(), (0, None));
    }

    async fn put_rows(db: &Db, rows: &[(i64, &str, i64, i64, &str)]) -> anyhow::Result<()> {
        for (id, tenant, created, next, state) in rows {
            db.test_execute(&format!(
                "INSERT INTO webhook_deliveries \
                 (event_id, tenant_id, message_id, type, created_at, next_attempt_at, attempts, state) \
                 VALUES ({id}, '{tenant}', 'm{id}', 'message.sent', {created}, {next}, 0, '{state}')"
            ))
            .await;
        }
        Ok(())
    }

    fn rooms(owner: &str, room: usize, stream_until: i64) -> crate::store::PassRooms {
        crate::store::PassRooms {
            tenants: Default::default(),
            default_room: room,
            owner: owner.into(),
            stream_until,
        }
    }

    /// The (message, type) of each call taken for tenant `t`.
    fn calls_of(taken: &[crate::store::TakenCalls]) -> Vec<(String, String)> {
        taken
            .iter()
            .filter(|take| take.tenant == "t")
            .flat_map(|take| take.calls.iter())
            .map(|call| (call.message_id.clone(), call.kind.clone()))
            .collect()
    }

    fn call(message: &str, kind: &str) -> (String, String) {
        (message.to_owned(), format!("message.{kind}"))
    }

    /// An endpoint's stream on `db`: its events in order, none it does not
    /// want, read by one instance while that one's lease lasts, and by
    /// another from the position once it has run out; a message whose call
    /// failed has its later event held behind it as a row.
    pub(crate) async fn a_stream_is_read_in_order_by_one_instance_at_a_time(db: &Db) {
        use crate::store::{CallsRecord, Writer};
        let now = now_ms();
        db.test_execute(
            "INSERT INTO plans VALUES ('p', 'fast', 1, 1, 1, 1, 'admin', 0); \
             INSERT INTO tenants (id, name, plan, status, created_at, updated_at) \
             VALUES ('t', 't', 'p', 'active', 0, 0);",
        )
        .await;
        // An event before the endpoint existed is not its business.
        let write = |message: &'static str, kind: &'static str| async move {
            db.test_execute(&format!(
                "INSERT INTO message_events (message_id, tenant_id, at, event, status, attempts) \
                 VALUES ('{message}', 't', {now}, '{kind}', '{kind}', 1)"
            ))
            .await;
            // On PostgreSQL a stream reads an event once every transaction
            // older than it has ended; other tests' transactions on the
            // same server may hold that back a moment.
            if let Some(pg) = db.postgres() {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                loop {
                    let settled: bool = sqlx::query_scalar(
                        "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint \
                         > (SELECT MAX(xid) FROM message_events)",
                    )
                    .fetch_one(&pg.pool)
                    .await?;
                    if settled || std::time::Instant::now() > deadline {
                        break;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            }
            anyhow::Ok(())
        };
        write("m0", "sent").await.unwrap();
        put(
            db,
            "t",
            "https://example.com/h",
            " message.sent message.delivered ",
            "s".into(),
        )
        .await
        .unwrap();
        for (message, kind) in [
            ("m1", "sent"),
            ("m1", "queued"),
            ("m2", "sent"),
            ("m1", "delivered"),
        ] {
            write(message, kind).await.unwrap();
        }
        let (writer, done) = Writer::start(db, 64, 0).unwrap();
        let lease = now + 60_000;
        let first = writer
            .take_pass(rooms("a", 10, lease), now, lease)
            .await
            .unwrap();
        // m1's `delivered` waits for its `sent`, in flight in this pass.
        assert_eq!(calls_of(&first), [call("m1", "sent"), call("m2", "sent")]);
        let read = first[0].stream.expect("a stream read");
        assert!(read.fresh);
        let cursors: Vec<Cursor> = first[0].calls.iter().filter_map(|c| c.cursor).collect();
        assert!(
            cursors[0] < cursors[1] && read.read == cursors[1],
            "{cursors:?} {read:?}"
        );
        // Another instance, within a's lease: nothing of t's.
        let other = writer
            .take_pass(rooms("b", 10, now + 60_000), now, now + 60_000)
            .await
            .unwrap();
        assert!(calls_of(&other).is_empty());
        // a delivered m1's `sent` (only): the position passes it.
        writer
            .record_calls(CallsRecord {
                positions: vec![("t".into(), cursors[0])],
                ..CallsRecord::default()
            })
            .await
            .unwrap();
        // a is gone; once its lease has run out, b reads from the position:
        // m2's `sent` again (at least once), then m1's `delivered`.
        let later = writer
            .take_pass(rooms("b", 10, lease + 60_000), lease + 1, lease + 60_000)
            .await
            .unwrap();
        assert_eq!(
            calls_of(&later),
            [call("m2", "sent"), call("m1", "delivered")]
        );
        assert!(later[0].stream.expect("read").fresh);
        // m3's `sent` fails: its row holds m3's `delivered` behind it.
        write("m3", "sent").await.unwrap();
        let third = writer
            .take_pass(rooms("b", 10, lease + 60_000), lease + 2, lease + 60_000)
            .await
            .unwrap();
        assert_eq!(calls_of(&third), [call("m3", "sent")]);
        let failed = third[0].calls[0].clone();
        call_failed(
            db,
            &failed,
            "HTTP 500",
            lease + 3,
            false,
            lease + 2,
            1_000_000,
        )
        .await
        .unwrap();
        write("m3", "delivered").await.unwrap();
        let fourth = writer
            .take_pass(rooms("b", 10, lease + 60_000), lease + 3, lease + 60_000)
            .await
            .unwrap();
        assert_eq!(calls_of(&fourth), [call("m3", "sent")], "the retry, alone");
        assert_eq!(fourth[0].calls[0].cursor, None, "a retry is a row");
        let rows = db
            .test_texts("SELECT message_id, type, state FROM webhook_deliveries ORDER BY event_id")
            .await;
        let row = |m: &str, kind: &str| {
            vec![
                Some(m.to_owned()),
                Some(format!("message.{kind}")),
                Some("pending".to_owned()),
            ]
        };
        assert_eq!(rows, [row("m3", "sent"), row("m3", "delivered")]);
        writer.stop().await;
        done.await.unwrap();
    }

    #[tokio::test]
    async fn a_stream_is_read_in_order_by_one_instance_at_a_time_on_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("w.db"), false).await.unwrap();
        a_stream_is_read_in_order_by_one_instance_at_a_time(&db).await;
    }

    #[tokio::test]
    async fn counts_tell_the_backlog_and_the_oldest_event_on_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("w.db"), false).await.unwrap();
        counts_tell_the_backlog_and_the_oldest_event(&db).await;
    }
}

/// (Being moved here: the webhooks operations, implemented per engine in
/// `sqlite/webhooks.rs` and `postgres/webhooks.rs`.)
#[async_trait::async_trait]
pub trait WebhookStore: Send + Sync {}
