//! The webhook dispatcher's PostgreSQL statements: a pass's due retries
//! with their leases, its streams' next events under their leases, the
//! message data of their events, and the record of calls made. SQLite does
//! the same in its writer's pieces (`store::sqlite::webhooks`). What both share (the endpoint's row, the
//! snapshot of a message at an event) is in `store::webhooks`.

use sqlx::PgPool;

use super::PgWriter;
use crate::store::delivery::{
    CallsRecord, NextEvent, PassRooms, StreamPass, StreamRead, TakenCalls, tenants_to_visit,
};
use crate::store::messages::MessageRecord;
use crate::store::webhooks::{
    Cursor, DueCall, HOLD, PENDING_TENANTS, STREAM_TENANTS, SnapshotRow, WEBHOOK_OF, Webhook,
    record_at_event,
};

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

#[async_trait::async_trait]
impl crate::store::webhooks::WebhookStore for super::PgDb {}
