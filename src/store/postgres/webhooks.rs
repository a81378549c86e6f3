//! The webhook dispatcher's PostgreSQL statements: a pass's due retries
//! with their leases, its streams' next events under their leases, the
//! message data of their events, and the record of calls made. SQLite does
//! the same in its writer's pieces (`store::sqlite::webhooks`). What both share (the endpoint's row, the
//! snapshot of a message at an event) is in `store::webhooks`. And the
//! rest of [`WebhookStore`] on PostgreSQL: the endpoints' rows, their
//! counts, and the record of a failed call.

use crate::store::StoreResult;
use async_trait::async_trait;
use sqlx::PgPool;

use super::{PgDb, PgWriter};
use crate::model::now_ms;
use crate::store::delivery::{
    CallsRecord, NextEvent, PassRooms, StreamPass, StreamRead, TakenCalls, tenants_to_visit,
};
use crate::store::messages::MessageRecord;
use crate::store::webhooks::{
    CallsOf, Cursor, DeliveryCount, DueCall, Endpoint, FailedCall, SnapshotRow, StateRow,
    StreamBacklog, Webhook, WebhookStore, counts_by_state, due_of, kept_count, record_at_event,
    to_disable, webhook_columns,
};

/// The endpoint of tenant `$1`: the columns of [`Webhook`], in order.
const WEBHOOK_OF: &str = concat!(
    "SELECT ",
    webhook_columns!(),
    " FROM webhooks WHERE tenant_id = $1"
);

/// The tenants whose enabled endpoint has events past where its stream is
/// read, or whose reader's lease (`$1`: now) has ended with calls still
/// between the position and the read.
const STREAM_TENANTS: &str = "SELECT w.tenant_id FROM webhooks AS w WHERE w.disabled_at IS NULL AND ( \
       EXISTS (SELECT 1 FROM message_events AS e WHERE e.tenant_id = w.tenant_id \
               AND (e.xid, e.id) > (w.read_xid, w.read_id)) \
       OR (COALESCE(w.stream_until, 0) <= $1 \
           AND (w.read_xid, w.read_id) > (w.position_xid, w.position_id)))";

/// Holds event `$1` (tenant `$2`, message `$3`, type `message.$4`, at `$5`)
/// behind its message's failed call: a row, failed if one of those was
/// given up, else due as it happened; [`take_due`] takes it once no
/// earlier event of its message has a row.
const HOLD: &str = "INSERT INTO webhook_deliveries (event_id, tenant_id, message_id, type, created_at, \
     next_attempt_at, attempts, state) \
     SELECT $1, $2, $3, 'message.' || $4, $5, $5, 0, m.state \
     FROM (SELECT MIN(state) AS state FROM webhook_deliveries WHERE message_id = $3) AS m \
     WHERE m.state IS NOT NULL \
     ON CONFLICT (event_id) DO NOTHING";

/// The tenants with calls pending, by one index probe per such tenant (a
/// "loose index scan"), not a pass over every pending row: a dead
/// endpoint's backlog can be millions of rows.
const PENDING_TENANTS: &str = "WITH RECURSIVE pending(tenant_id) AS ( \
       SELECT MIN(tenant_id) FROM webhook_deliveries WHERE state = 'pending' \
       UNION ALL \
       SELECT (SELECT MIN(d.tenant_id) FROM webhook_deliveries AS d \
               WHERE d.state = 'pending' AND d.tenant_id > pending.tenant_id) \
       FROM pending WHERE pending.tenant_id IS NOT NULL) \
     SELECT tenant_id FROM pending WHERE tenant_id IS NOT NULL";

impl PgWriter {
    /// See [`crate::store::Writer::take_pass`]: a statement finds the
    /// tenants with calls to make; for each, one statement finds and
    /// leases its due retries, a transaction takes its stream's lease and
    /// next events, one statement reads their data and one its endpoint.
    pub(crate) async fn take_pass(
        &self,
        rooms: PassRooms,
        now: i64,
        lease_until: i64,
    ) -> anyhow::Result<Vec<TakenCalls>> {
        let pool = self.pool();
        let pending: Vec<Option<String>> =
            sqlx::query_scalar(PENDING_TENANTS).fetch_all(pool).await?;
        let streams: Vec<String> = sqlx::query_scalar(STREAM_TENANTS)
            .bind(now)
            .fetch_all(pool)
            .await?;
        let tenants = tenants_to_visit(pending, streams, &rooms);
        let mut taken = Vec::new();
        for tenant in tenants {
            let (busy, room) = rooms.of(&tenant);
            let busy_ids: Vec<i64> = busy
                .map(|busy| busy.busy.iter().copied().collect())
                .unwrap_or_default();
            let mut calls = if room > 0 {
                take_due(pool, &tenant, &busy_ids, room, now, lease_until).await?
            } else {
                Vec::new()
            };
            let retries = calls.len();
            let stream = StreamPass {
                tenant: &tenant,
                owner: &rooms.owner,
                busy,
                room: room - retries,
                now,
                lease_until: rooms.stream_until,
            };
            let read = read_stream(pool, &stream, &mut calls).await?;
            if calls.is_empty() && read.is_none() {
                continue;
            }
            let ids: Vec<i64> = calls.iter().map(|due| due.event_id).collect();
            let data = snapshots(pool, &ids).await?.into_iter().collect();
            let webhook: Option<Webhook> = sqlx::query_as(WEBHOOK_OF)
                .bind(&tenant)
                .fetch_optional(pool)
                .await?;
            taken.push(TakenCalls {
                room,
                wanted: calls.len(),
                tenant,
                calls,
                data,
                webhook,
                stream: read,
            });
        }
        Ok(taken)
    }

    /// See [`crate::store::Writer::record_calls`].
    pub(crate) async fn record_calls(&self, record: &CallsRecord) -> anyhow::Result<()> {
        record_calls(self.pool(), record).await
    }
}

/// Takes (or keeps) the lease on the tenant's stream (`$1`) for `$2` (now
/// `$3`, until `$4`); a lease taken anew (not `kept`) reads again from the
/// position. No row when the endpoint is disabled, absent, or read by
/// another instance.
const CLAIM: &str = "UPDATE webhooks AS w SET stream_owner = $2, stream_until = $4, \
     read_xid = CASE WHEN o.kept THEN w.read_xid ELSE w.position_xid END, \
     read_id = CASE WHEN o.kept THEN w.read_id ELSE w.position_id END \
     FROM (SELECT tenant_id, COALESCE(stream_owner = $2 AND stream_until > $3, FALSE) AS kept \
           FROM webhooks WHERE tenant_id = $1 AND disabled_at IS NULL \
           AND (stream_owner IS NULL OR stream_owner = $2 OR stream_until <= $3) FOR UPDATE) AS o \
     WHERE w.tenant_id = o.tenant_id \
     RETURNING o.kept, w.read_xid, w.read_id, w.events";

/// Up to `$5` of tenant `$1`'s events past (`$2`, `$3`) that the endpoint
/// (events `$4`) wants, in stream order, each with whether its message has
/// a failed call's row; then one row (`top`) with the newest event the
/// stream may pass. Only events of transactions older than every one still
/// running: none can commit behind them. One statement, so one snapshot.
const NEXT_EVENTS: &str = "WITH horizon AS (SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS xmin), \
     picked AS (SELECT e.xid, e.id, e.message_id, e.event, e.at, \
                EXISTS (SELECT 1 FROM webhook_deliveries AS d WHERE d.message_id = e.message_id) AS held \
                FROM message_events AS e, horizon \
                WHERE e.tenant_id = $1 AND (e.xid, e.id) > ($2, $3) AND e.xid < horizon.xmin \
                AND strpos($4, ' message.' || e.event || ' ') > 0 \
                ORDER BY e.xid, e.id LIMIT $5), \
     top AS (SELECT e.xid, e.id FROM message_events AS e, horizon \
             WHERE e.tenant_id = $1 AND e.xid < horizon.xmin ORDER BY e.xid DESC, e.id DESC LIMIT 1) \
     SELECT xid, id, message_id, event, at, held, FALSE AS top FROM picked \
     UNION ALL SELECT xid, id, '', '', 0, FALSE, TRUE FROM top";

/// A row of [`NEXT_EVENTS`].
#[derive(sqlx::FromRow)]
struct NextRow {
    xid: i64,
    id: i64,
    message_id: String,
    event: String,
    at: i64,
    held: bool,
    top: bool,
}

/// Takes (or keeps) the lease on the tenant's stream and reads up to its
/// room of the events its endpoint wants past the read, in order, as
/// [`StreamPass::plan`] says: calls, and rows held behind a failed call.
/// None when the endpoint is disabled, absent, or read by another
/// instance.
async fn read_stream(
    pool: &PgPool,
    stream: &StreamPass<'_>,
    calls: &mut Vec<DueCall>,
) -> anyhow::Result<Option<StreamRead>> {
    // A lease or a read lost in a crash only makes calls again.
    let mut tx = pool.begin().await?;
    sqlx::query("SET LOCAL synchronous_commit = off")
        .execute(&mut *tx)
        .await?;
    let claimed: Option<(bool, i64, i64, String)> = sqlx::query_as(CLAIM)
        .bind(stream.tenant)
        .bind(stream.owner)
        .bind(stream.now)
        .bind(stream.lease_until)
        .fetch_optional(&mut *tx)
        .await?;
    let Some((kept, read_xid, read_id, events)) = claimed else {
        tx.commit().await?;
        return Ok(None);
    };
    let mut read: Cursor = (read_xid, read_id);
    if stream.room > 0 {
        let found: Vec<NextRow> = sqlx::query_as(NEXT_EVENTS)
            .bind(stream.tenant)
            .bind(read.0)
            .bind(read.1)
            .bind(&events)
            .bind(stream.room as i64)
            .fetch_all(&mut *tx)
            .await?;
        let top = found
            .iter()
            .find(|row| row.top)
            .map(|row| (row.xid, row.id));
        let mut next: Vec<NextEvent> = found
            .into_iter()
            .filter(|row| !row.top)
            .map(|row| NextEvent {
                cursor: (row.xid, row.id),
                message_id: row.message_id,
                event: row.event,
                at: row.at,
                held: row.held,
            })
            .collect();
        next.sort_by_key(|event| event.cursor);
        let plan = stream.plan(read, next, top);
        for event in &plan.holds {
            sqlx::query(HOLD)
                .bind(event.cursor.1)
                .bind(stream.tenant)
                .bind(&event.message_id)
                .bind(&event.event)
                .bind(event.at)
                .execute(&mut *tx)
                .await?;
        }
        calls.extend(plan.calls);
        read = plan.read;
    }
    sqlx::query("UPDATE webhooks SET read_xid = $2, read_id = $3 WHERE tenant_id = $1")
        .bind(stream.tenant)
        .bind(read.0)
        .bind(read.1)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(Some(StreamRead { fresh: !kept, read }))
}

/// Finds up to `room` of the tenant's calls due at `now`
/// (each the earliest waiting event of its message, none of `busy`) and
/// leases them until `lease_until`, in one statement; rows another
/// instance is leasing at that moment are skipped. Soonest first.
pub(super) async fn take_due(
    pool: &PgPool,
    tenant: &str,
    busy: &[i64],
    room: usize,
    now: i64,
    lease_until: i64,
) -> anyhow::Result<Vec<DueCall>> {
    // A lease need not survive a crash (the call is then due again, as it
    // would be once the lease ended), so its commit does not wait for the
    // WAL to reach the disk.
    let mut tx = pool.begin().await?;
    sqlx::query("SET LOCAL synchronous_commit = off")
        .execute(&mut *tx)
        .await?;
    let mut taken: Vec<(i64, DueCall)> = sqlx::query_as::<_, (i64, i64, String, String, String, i64, i64)>(
        "UPDATE webhook_deliveries AS w SET next_attempt_at = $5 \
         FROM (SELECT d.event_id, d.next_attempt_at FROM webhook_deliveries AS d \
               WHERE d.tenant_id = $1 AND d.state = 'pending' AND d.next_attempt_at <= $2 \
               AND NOT (d.event_id = ANY($3)) \
               AND NOT EXISTS (SELECT 1 FROM webhook_deliveries AS e \
                               WHERE e.message_id = d.message_id AND e.event_id < d.event_id) \
               ORDER BY d.next_attempt_at, d.event_id LIMIT $4 \
               FOR UPDATE SKIP LOCKED) AS due \
         WHERE w.event_id = due.event_id \
         RETURNING due.next_attempt_at, w.event_id, w.tenant_id, w.message_id, w.type, w.created_at, w.attempts",
    )
    .bind(tenant)
    .bind(now)
    .bind(busy)
    .bind(room as i64)
    .bind(lease_until)
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|(due_at, event_id, tenant_id, message_id, kind, created_at, attempts)| {
        (
            due_at,
            DueCall {
                event_id,
                tenant_id,
                message_id,
                kind,
                created_at,
                attempts,
                cursor: None,
            },
        )
    })
    .collect();
    tx.commit().await?;
    taken.sort_by_key(|(due_at, call)| (*due_at, call.event_id));
    Ok(taken.into_iter().map(|(_, call)| call).collect())
}

/// See [`crate::store::Writer::record_calls`], in one transaction for the
/// lot (SQLite's is a piece of its writer, `sqlite::webhooks::record_calls`).
pub(super) async fn record_calls(pool: &PgPool, record: &CallsRecord) -> anyhow::Result<()> {
    // A record lost in a crash only makes its calls again, with the same
    // `webhook-id` (delivery is at least once), so its commit does not
    // wait for the WAL to reach the disk.
    let mut tx = pool.begin().await?;
    sqlx::query("SET LOCAL synchronous_commit = off")
        .execute(&mut *tx)
        .await?;
    if !record.delivered_rows.is_empty() {
        sqlx::query("DELETE FROM webhook_deliveries WHERE event_id = ANY($1)")
            .bind(&record.delivered_rows)
            .execute(&mut *tx)
            .await?;
    }
    if !record.healthy.is_empty() {
        sqlx::query(
            "UPDATE webhooks SET failing_since = NULL, last_error = NULL \
             WHERE tenant_id = ANY($1) AND failing_since IS NOT NULL",
        )
        .bind(&record.healthy)
        .execute(&mut *tx)
        .await?;
    }
    for (tenant, (xid, id)) in &record.positions {
        sqlx::query(
            "UPDATE webhooks SET position_xid = $2, position_id = $3 \
             WHERE tenant_id = $1 AND (position_xid, position_id) < ($2, $3)",
        )
        .bind(tenant)
        .bind(xid)
        .bind(id)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// A [`SnapshotRow`] with the id of its event (PostgreSQL's read).
#[derive(sqlx::FromRow)]
struct EventSnapshot {
    event_id: i64,
    #[sqlx(flatten)]
    row: SnapshotRow,
}

/// The message's status rows at each of `event_ids`' events, by event id
/// (one statement); an event or message that is gone is
/// missing.
pub(super) async fn snapshots(
    pool: &PgPool,
    event_ids: &[i64],
) -> anyhow::Result<Vec<(i64, MessageRecord)>> {
    let rows: Vec<EventSnapshot> = sqlx::query_as(
        "SELECT e.id AS event_id, m.id, m.tenant_id, e.at, e.status, e.attempts, e.detail, \
         e.provider_message_id, m.channel, m.priority, m.lane, m.reference, m.metadata, \
         m.created_at, m.sent_at, m.send_at, m.test, m.fragments \
         FROM message_events AS e JOIN messages AS m ON m.id = e.message_id WHERE e.id = ANY($1)",
    )
    .bind(event_ids)
    .fetch_all(pool)
    .await?;
    rows.into_iter()
        .map(|snapshot| Ok((snapshot.event_id, record_at_event(snapshot.row)?)))
        .collect()
}

/// Makes a tenant's failed events pending again, due now (`$1`), for
/// tenant `$2`.
const RESUME: &str = "UPDATE webhook_deliveries SET state = 'pending', next_attempt_at = $1, \
     attempts = 0, last_error = NULL WHERE tenant_id = $2 AND state = 'failed'";

/// The events past the endpoint's position that it wants and that have no
/// row, as a [`StreamBacklog`]: how many, how many are past where its
/// stream is read (the rest are in flight; once the reader's lease has
/// ended, all are due again), and the oldest one's time. `$1` the tenant
/// (or NULL for all), `$2` now. An event's place past the position seeks
/// the row value in the `(tenant_id, xid, id)` index.
fn stream_backlog(whose: &str) -> String {
    format!(
        "SELECT COUNT(e.id), \
         COALESCE(SUM(CASE WHEN COALESCE(w.stream_until, 0) <= $2 \
                             OR (e.xid, e.id) > (w.read_xid, w.read_id) THEN 1 ELSE 0 END), 0), \
         MIN(e.at), w.disabled_at IS NOT NULL \
         FROM webhooks AS w JOIN message_events AS e ON e.tenant_id = w.tenant_id \
         WHERE {whose} AND (e.xid, e.id) > (w.position_xid, w.position_id) \
         AND strpos(w.events, ' message.' || e.event || ' ') > 0 \
         AND NOT EXISTS (SELECT 1 FROM webhook_deliveries AS d WHERE d.event_id = e.id) \
         GROUP BY w.tenant_id, w.disabled_at"
    )
}

#[async_trait]
impl WebhookStore for PgDb {
    async fn webhook(&self, tenant_id: &str) -> StoreResult<Option<Webhook>> {
        Ok(sqlx::query_as::<_, Webhook>(WEBHOOK_OF)
            .bind(tenant_id)
            .fetch_optional(&self.pool)
            .await?)
    }

    async fn webhook_delivery_counts(
        &self,
        tenant_id: &str,
        now: i64,
    ) -> StoreResult<Vec<DeliveryCount>> {
        let rows: Vec<StateRow> = sqlx::query_as(
            "SELECT state, COUNT(*) AS count, \
             COALESCE(SUM(CASE WHEN next_attempt_at <= $2 THEN 1 ELSE 0 END), 0) AS due, \
             MIN(created_at) AS oldest \
             FROM webhook_deliveries WHERE tenant_id = $1 GROUP BY state",
        )
        .bind(tenant_id)
        .bind(now)
        .fetch_all(&self.pool)
        .await?;
        let stream: Option<StreamBacklog> =
            sqlx::query_as(sqlx::AssertSqlSafe(stream_backlog("w.tenant_id = $1")))
                .bind(tenant_id)
                .bind(now)
                .fetch_all(&self.pool)
                .await?
                .pop();
        Ok(counts_by_state(rows, stream))
    }

    async fn webhook_calls_due(&self, now: i64) -> StoreResult<(i64, Option<i64>)> {
        let rows: (i64, Option<i64>) = sqlx::query_as(
            "SELECT COUNT(*), MIN(created_at) FROM webhook_deliveries \
             WHERE state = 'pending' AND next_attempt_at <= $1",
        )
        .bind(now)
        .fetch_all(&self.pool)
        .await?
        .pop()
        .unwrap_or_default();
        let streams: Vec<StreamBacklog> = sqlx::query_as(sqlx::AssertSqlSafe(stream_backlog(
            "w.disabled_at IS NULL AND $1::text IS NULL",
        )))
        .bind(None::<String>)
        .bind(now)
        .fetch_all(&self.pool)
        .await?;
        Ok(due_of(rows, streams))
    }

    async fn put_webhook(
        &self,
        tenant_id: &str,
        endpoint: &Endpoint<'_>,
        secret: String,
    ) -> StoreResult<(Webhook, Option<String>)> {
        const EXISTS: &str = "SELECT tenant_id FROM webhooks WHERE tenant_id = $1";
        const CHANGE: &str = "UPDATE webhooks SET url = $1, events = $2, failing_since = NULL, \
             last_error = NULL, disabled_at = NULL, updated_at = $3, max_events_per_call = $5 \
             WHERE tenant_id = $4";
        // A new endpoint's stream starts at the tenant's newest event.
        const CREATE: &str = "INSERT INTO webhooks (tenant_id, url, events, secret, created_at, \
             updated_at, position_xid, position_id, read_xid, read_id, max_events_per_call) \
             SELECT $1, $2, $3, $4, $5, $5, top.xid, top.id, top.xid, top.id, $6 FROM \
             (SELECT xid, id FROM message_events WHERE tenant_id = $1 \
              UNION ALL SELECT 0, 0 ORDER BY 1 DESC, 2 DESC LIMIT 1) AS top";
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        let existed: Option<String> = sqlx::query_scalar(EXISTS)
            .bind(tenant_id)
            .fetch_optional(&mut *tx)
            .await?;
        if existed.is_some() {
            sqlx::query(CHANGE)
                .bind(endpoint.url)
                .bind(endpoint.events)
                .bind(now)
                .bind(tenant_id)
                .bind(endpoint.max_events_per_call)
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
                .bind(endpoint.url)
                .bind(endpoint.events)
                .bind(&secret)
                .bind(now)
                .bind(endpoint.max_events_per_call)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        let created = existed.is_none();
        let webhook = self
            .webhook(tenant_id)
            .await?
            .ok_or_else(|| anyhow::anyhow!("the webhook just written is gone"))?;
        Ok((webhook, created.then_some(secret)))
    }

    async fn rotate_webhook_secret(
        &self,
        tenant_id: &str,
        secret: String,
        grace_ms: i64,
    ) -> StoreResult<Option<(Webhook, String)>> {
        const ROTATE: &str = "UPDATE webhooks SET previous_secret = secret, previous_until = $1, \
             secret = $2, updated_at = $3 WHERE tenant_id = $4";
        let now = now_ms();
        let rotated = sqlx::query(ROTATE)
            .bind(now + grace_ms)
            .bind(&secret)
            .bind(now)
            .bind(tenant_id)
            .execute(&self.pool)
            .await?
            .rows_affected();
        if rotated == 0 {
            return Ok(None);
        }
        Ok(self
            .webhook(tenant_id)
            .await?
            .map(|webhook| (webhook, secret)))
    }

    async fn delete_webhook(&self, tenant_id: &str) -> StoreResult<bool> {
        const CALLS: &str = "DELETE FROM webhook_deliveries WHERE tenant_id = $1";
        const ENDPOINT: &str = "DELETE FROM webhooks WHERE tenant_id = $1";
        let mut tx = self.pool.begin().await?;
        sqlx::query(CALLS).bind(tenant_id).execute(&mut *tx).await?;
        let removed = sqlx::query(ENDPOINT)
            .bind(tenant_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(removed.rows_affected() == 1)
    }

    async fn redrive_webhook(&self, tenant_id: &str) -> StoreResult<Option<u64>> {
        const ENABLE: &str = "UPDATE webhooks SET disabled_at = NULL, failing_since = NULL, \
             updated_at = $1 WHERE tenant_id = $2";
        let now = now_ms();
        let backlog = stream_backlog("w.tenant_id = $1");
        let mut tx = self.pool.begin().await?;
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
        let kept: Option<StreamBacklog> = sqlx::query_as(sqlx::AssertSqlSafe(backlog))
            .bind(tenant_id)
            .bind(now)
            .fetch_optional(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Some(rows + kept_count(kept)))
    }

    async fn failing_webhooks(&self) -> StoreResult<Vec<Webhook>> {
        const FAILING: &str = concat!(
            "SELECT ",
            webhook_columns!(),
            " FROM webhooks WHERE failing_since IS NOT NULL OR disabled_at IS NOT NULL \
             ORDER BY COALESCE(failing_since, disabled_at) LIMIT 1000"
        );
        Ok(sqlx::query_as::<_, Webhook>(FAILING)
            .fetch_all(&self.pool)
            .await?)
    }

    async fn failed_webhook_calls(
        &self,
        of: CallsOf<'_>,
        limit: i64,
    ) -> StoreResult<Vec<FailedCall>> {
        const OF_TENANT: &str = "SELECT event_id, message_id, type, created_at, \
             next_attempt_at, attempts, state, last_error FROM webhook_deliveries \
             WHERE tenant_id = $1 ORDER BY event_id LIMIT $2";
        const OF_MESSAGE: &str = "SELECT event_id, message_id, type, created_at, \
             next_attempt_at, attempts, state, last_error FROM webhook_deliveries \
             WHERE message_id = $1 ORDER BY event_id LIMIT $2";
        let (sql, who) = match of {
            CallsOf::Tenant(tenant) => (OF_TENANT, tenant),
            CallsOf::Message(message) => (OF_MESSAGE, message),
        };
        Ok(sqlx::query_as(sql)
            .bind(who)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?)
    }

    async fn tenants_with_pending_calls(&self) -> StoreResult<Vec<String>> {
        let tenants: Vec<(Option<String>,)> = sqlx::query_as(PENDING_TENANTS)
            .fetch_all(&self.pool)
            .await?;
        Ok(tenants.into_iter().filter_map(|(tenant,)| tenant).collect())
    }

    async fn release_webhook_lease(&self, event_id: i64) -> StoreResult<()> {
        const RELEASE: &str =
            "UPDATE webhook_deliveries SET next_attempt_at = $1 WHERE event_id = $2";
        sqlx::query(RELEASE)
            .bind(now_ms())
            .bind(event_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn forget_webhook_call(&self, event_id: i64) -> StoreResult<()> {
        const FORGET: &str = "DELETE FROM webhook_deliveries WHERE event_id = $1";
        sqlx::query(FORGET)
            .bind(event_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn webhook_call_failed(
        &self,
        due: &DueCall,
        error: &str,
        next: i64,
        gave_up: bool,
        now: i64,
        limit: i64,
    ) -> StoreResult<bool> {
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
        let mut tx = self.pool.begin().await?;
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
        let disabled = to_disable(failing_since, now, limit);
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
        Ok(disabled)
    }
}
