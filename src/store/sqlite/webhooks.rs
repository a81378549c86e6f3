//! The webhook dispatcher's SQLite work, as pieces for the store's one
//! writer ([`StoreWriter`]): a pass (the tenants with calls to make, each
//! one's failed calls now due and the next events of its endpoint's
//! stream, with their data and the endpoint) and the record of calls made.
//! PostgreSQL does the same in `store::postgres::webhooks`; what both share
//! (the endpoint's row, the snapshot of a message at an event) is in
//! `store::webhooks`. And the rest of [`WebhookStore`] on SQLite: the
//! endpoints' rows, their counts, and the record of a failed call.

use crate::store::StoreResult;
use async_trait::async_trait;
use rusqlite::{OptionalExtension, Transaction};

use super::writer::StoreWriter;
use super::{SqliteDb, args, prepare, tuple};
use crate::model::now_ms;
use crate::store::delivery::{
    CallsRecord, NextEvent, PassRooms, StreamPass, StreamRead, TenantRoom, tenants_to_visit,
};
use crate::store::webhooks::{
    CallsOf, Cursor, DeliveryCount, DueCall, Endpoint, FailedCall, SnapshotRow, StateRow,
    StreamBacklog, Webhook, WebhookStore, counts_by_state, due_of, kept_count, to_disable,
    webhook_columns,
};

/// The endpoint of tenant `?1`: the columns of [`Webhook`], in order.
const WEBHOOK_OF: &str = concat!(
    "SELECT ",
    webhook_columns!(),
    " FROM webhooks WHERE tenant_id = ?1"
);

/// A [`Webhook`] from a row of its columns.
fn webhook_row(row: &rusqlite::Row) -> rusqlite::Result<Webhook> {
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
        max_events_per_call: row.get(11)?,
    })
}

/// The tenants whose enabled endpoint has events past where its stream is
/// read, or whose reader's lease (`?1`: now) has ended with calls still
/// between the position and the read. The xids are all 0: a row value
/// would walk every one of the tenant's events, the id alone seeks the
/// index.
const STREAM_TENANTS: &str = "SELECT w.tenant_id FROM webhooks AS w WHERE w.disabled_at IS NULL AND ( \
       EXISTS (SELECT 1 FROM message_events AS e WHERE e.tenant_id = w.tenant_id \
               AND e.xid = 0 AND e.id > w.read_id) \
       OR (COALESCE(w.stream_until, 0) <= ?1 AND w.read_id > w.position_id))";

/// Holds event `?1` (tenant `?2`, message `?3`, type `message.?4`, at `?5`)
/// behind its message's failed call: a row, failed if one of those was
/// given up, else due as it happened; [`DUE_CALLS`] takes it once no
/// earlier event of its message has a row.
const HOLD: &str = "INSERT INTO webhook_deliveries (event_id, tenant_id, message_id, type, created_at, \
     next_attempt_at, attempts, state) \
     SELECT ?1, ?2, ?3, 'message.' || ?4, ?5, ?5, 0, m.state \
     FROM (SELECT MIN(state) AS state FROM webhook_deliveries WHERE message_id = ?3) AS m \
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

/// The tenant's (`?1`) calls due at `?2`, each the earliest waiting event
/// of its message, soonest first, at most `?3`: the columns of
/// [`DueCall`].
const DUE_CALLS: &str = "SELECT d.event_id, d.tenant_id, d.message_id, d.type, d.created_at, d.attempts \
     FROM webhook_deliveries AS d \
     WHERE d.tenant_id = ?1 AND d.state = 'pending' AND d.next_attempt_at <= ?2 \
     AND NOT EXISTS (SELECT 1 FROM webhook_deliveries AS e \
                     WHERE e.message_id = d.message_id AND e.event_id < d.event_id) \
     ORDER BY d.next_attempt_at, d.event_id LIMIT ?3";

/// Reads a [`SnapshotRow`] by event id, on the writer's connection.
const SNAPSHOT: &str = "SELECT m.id, m.tenant_id, e.at, e.status, e.attempts, e.detail, e.provider_message_id, \
     m.channel, m.priority, m.lane, m.reference, m.metadata, m.created_at, m.sent_at, m.send_at, m.test, m.fragments \
     FROM message_events AS e JOIN messages AS m ON m.id = e.message_id WHERE e.id = ?1";

/// A tenant's calls taken by [`take_pass`], their data still as rows: they
/// become records off the writer's thread.
pub(crate) struct TenantTake {
    pub tenant: String,
    /// Its room in the pass.
    pub room: usize,
    /// Calls due for the room (at most the room).
    pub wanted: usize,
    /// Those leased: retries first, then the stream's.
    pub calls: Vec<DueCall>,
    /// The leased calls' data rows, by event id.
    pub rows: Vec<(i64, SnapshotRow)>,
    pub webhook: Option<Webhook>,
    pub stream: Option<StreamRead>,
}

/// See [`crate::store::Writer::take_pass`]: on SQLite the tenants with
/// calls to make, each one's due retries and stream events, their leases,
/// their data and the tenant's endpoint are read and written in one piece
/// of the writer's group, rather than pool reads and a piece per tenant.
pub(crate) async fn take_pass(
    writer: &StoreWriter,
    rooms: PassRooms,
    now: i64,
    lease_until: i64,
) -> anyhow::Result<Vec<TenantTake>> {
    writer
        .run(move |tx| {
            let pending: Vec<Option<String>> = tx
                .prepare_cached(PENDING_TENANTS)?
                .query_map([], |row| row.get(0))?
                .collect::<Result<_, _>>()?;
            let streams: Vec<String> = tx
                .prepare_cached(STREAM_TENANTS)?
                .query_map([now], |row| row.get(0))?
                .collect::<Result<_, _>>()?;
            let tenants = tenants_to_visit(pending, streams, &rooms);
            let mut taken = Vec::new();
            for tenant in tenants {
                let (busy, room) = rooms.of(&tenant);
                let (wanted, mut calls, mut rows) =
                    take_retries(tx, &tenant, busy, room, now, lease_until)?;
                let retries = calls.len();
                let stream = StreamPass {
                    tenant: &tenant,
                    owner: &rooms.owner,
                    busy,
                    room: room - calls.len(),
                    now,
                    lease_until: rooms.stream_until,
                };
                let read = read_stream(tx, &stream, &mut calls, &mut rows)?;
                if calls.is_empty() && read.is_none() {
                    continue;
                }
                let webhook = tx
                    .prepare_cached(WEBHOOK_OF)?
                    .query_row([&tenant], webhook_row)
                    .optional()?;
                taken.push(TenantTake {
                    wanted: wanted + calls.len() - retries,
                    tenant,
                    room,
                    calls,
                    rows,
                    webhook,
                    stream: read,
                });
            }
            Ok(taken)
        })
        .await
}

/// How many retries were wanted, those leased and their data rows.
type Taken = (usize, Vec<DueCall>, Vec<(i64, SnapshotRow)>);

/// Up to `room` of `tenant`'s failed calls due again, other than `busy`
/// ones, leased until `lease_until`: how many were wanted,
/// those leased and their data rows.
fn take_retries(
    tx: &Transaction,
    tenant: &str,
    busy: Option<&TenantRoom>,
    room: usize,
    now: i64,
    lease_until: i64,
) -> rusqlite::Result<Taken> {
    if room == 0 {
        return Ok((0, Vec::new(), Vec::new()));
    }
    let is_busy = |event_id: i64| busy.is_some_and(|busy| busy.busy.contains(&event_id));
    let mut due = tx.prepare_cached(DUE_CALLS)?;
    let limit = (room + busy.map_or(0, |busy| busy.busy.len())) as i64;
    let wanted: Vec<DueCall> = due
        .query_map(rusqlite::params![tenant, now, limit], |row| {
            Ok(DueCall {
                event_id: row.get(0)?,
                tenant_id: row.get(1)?,
                message_id: row.get(2)?,
                kind: row.get(3)?,
                created_at: row.get(4)?,
                attempts: row.get(5)?,
                cursor: None,
            })
        })?
        .filter(|call| call.as_ref().map_or(true, |call| !is_busy(call.event_id)))
        .take(room)
        .collect::<Result<_, _>>()?;
    let mut lease = tx.prepare_cached(LEASE)?;
    let mut read = tx.prepare_cached(SNAPSHOT)?;
    let mut taken = Vec::with_capacity(wanted.len());
    let mut data = Vec::with_capacity(wanted.len());
    for call in &wanted {
        if lease.execute(rusqlite::params![lease_until, call.event_id, now])? != 1 {
            continue;
        }
        if let Some(row) = read.query_row([call.event_id], snapshot_row).optional()? {
            data.push((call.event_id, row));
        }
        taken.push(call.clone());
    }
    Ok((wanted.len(), taken, data))
}

/// Takes (or keeps) the lease on the tenant's stream and reads up to its
/// room of the events its endpoint wants past the read, in order, as
/// [`StreamPass::plan`] says: calls (with their data rows) and rows held
/// behind a failed call. None when the endpoint is disabled, absent, or
/// read by another instance.
fn read_stream(
    tx: &Transaction,
    stream: &StreamPass,
    calls: &mut Vec<DueCall>,
    rows: &mut Vec<(i64, SnapshotRow)>,
) -> rusqlite::Result<Option<StreamRead>> {
    let held: Option<StreamRow> = tx
        .prepare_cached(
            "SELECT stream_owner, stream_until, read_xid, read_id, position_xid, position_id, events \
             FROM webhooks WHERE tenant_id = ?1 AND disabled_at IS NULL",
        )?
        .query_row([stream.tenant], |row| {
            Ok((
                row.get(0)?,
                row.get(1)?,
                (row.get(2)?, row.get(3)?),
                (row.get(4)?, row.get(5)?),
                row.get(6)?,
            ))
        })
        .optional()?;
    let Some((owner, until, read, position, events)) = held else {
        return Ok(None);
    };
    let lease_on = until.is_some_and(|until| until > stream.now);
    let mine = owner.as_deref() == Some(stream.owner) && lease_on;
    if lease_on && !mine && owner.is_some() {
        return Ok(None);
    }
    let fresh = !mine;
    let mut read = if fresh { position } else { read };
    if stream.room > 0 {
        read = read_events(tx, stream, (read, &events), calls, rows)?;
    }
    tx.prepare_cached(
        "UPDATE webhooks SET stream_owner = ?2, stream_until = ?3, read_xid = ?4, read_id = ?5 \
         WHERE tenant_id = ?1",
    )?
    .execute(rusqlite::params![
        stream.tenant,
        stream.owner,
        stream.lease_until,
        read.0,
        read.1
    ])?;
    Ok(Some(StreamRead { fresh, read }))
}

/// [`read_stream`]'s read of up to the stream's room of the `events` its
/// endpoint wants past `read`: holds what waits behind a failed call, adds the calls (and their
/// data rows), and gives the read's new place.
fn read_events(
    tx: &Transaction,
    stream: &StreamPass,
    (read, events): (Cursor, &str),
    calls: &mut Vec<DueCall>,
    rows: &mut Vec<(i64, SnapshotRow)>,
) -> rusqlite::Result<Cursor> {
    let next: Vec<NextEvent> = tx
        .prepare_cached(
            "SELECT e.xid, e.id, e.message_id, e.event, e.at, \
             EXISTS (SELECT 1 FROM webhook_deliveries AS d WHERE d.message_id = e.message_id) \
             FROM message_events AS e \
             WHERE e.tenant_id = ?1 AND e.xid = ?2 AND e.id > ?3 \
             AND instr(?4, ' message.' || e.event || ' ') > 0 \
             ORDER BY e.xid, e.id LIMIT ?5",
        )?
        .query_map(
            rusqlite::params![stream.tenant, read.0, read.1, events, stream.room as i64],
            |row| {
                Ok(NextEvent {
                    cursor: (row.get(0)?, row.get(1)?),
                    message_id: row.get(2)?,
                    event: row.get(3)?,
                    at: row.get(4)?,
                    held: row.get(5)?,
                })
            },
        )?
        .collect::<Result<_, _>>()?;
    // Fewer than the room: the read may pass what the endpoint does
    // not want, up to the tenant's newest event.
    let top: Option<Cursor> = if next.len() < stream.room {
        tx.prepare_cached(
            "SELECT xid, id FROM message_events WHERE tenant_id = ?1 \
             ORDER BY xid DESC, id DESC LIMIT 1",
        )?
        .query_row([stream.tenant], |row| Ok((row.get(0)?, row.get(1)?)))
        .optional()?
    } else {
        None
    };
    let plan = stream.plan(read, next, top);
    let mut hold = tx.prepare_cached(HOLD)?;
    for event in &plan.holds {
        hold.execute(rusqlite::params![
            event.cursor.1,
            stream.tenant,
            event.message_id,
            event.event,
            event.at
        ])?;
    }
    let mut snapshot = tx.prepare_cached(SNAPSHOT)?;
    for call in &plan.calls {
        if let Some(row) = snapshot
            .query_row([call.event_id], snapshot_row)
            .optional()?
        {
            rows.push((call.event_id, row));
        }
    }
    calls.extend(plan.calls);
    Ok(plan.read)
}

/// An endpoint's stream as its row holds it: reader, lease end, read,
/// position and the event types it wants.
type StreamRow = (Option<String>, Option<i64>, Cursor, Cursor, String);

/// Leases a call (`?2`) until `?1` if it is still due at `?3`.
const LEASE: &str = "UPDATE webhook_deliveries SET next_attempt_at = ?1 \
     WHERE event_id = ?2 AND state = 'pending' AND next_attempt_at <= ?3";

/// A [`SNAPSHOT`] row.
fn snapshot_row(row: &rusqlite::Row) -> rusqlite::Result<SnapshotRow> {
    Ok(SnapshotRow {
        id: row.get(0)?,
        tenant_id: row.get(1)?,
        at: row.get(2)?,
        status: row.get(3)?,
        attempts: row.get(4)?,
        detail: row.get(5)?,
        provider_message_id: row.get(6)?,
        channel: row.get(7)?,
        priority: row.get(8)?,
        lane: row.get(9)?,
        reference: row.get(10)?,
        metadata: row.get(11)?,
        created_at: row.get(12)?,
        sent_at: row.get(13)?,
        send_at: row.get(14)?,
        test: row.get(15)?,
        fragments: row.get(16)?,
    })
}

/// See [`crate::store::Writer::record_calls`].
pub(crate) async fn record_calls(writer: &StoreWriter, record: CallsRecord) -> anyhow::Result<()> {
    writer
        .run(move |tx| {
            let mut remove =
                tx.prepare_cached("DELETE FROM webhook_deliveries WHERE event_id = ?1")?;
            for event_id in &record.delivered_rows {
                remove.execute([event_id])?;
            }
            let mut healthy = tx.prepare_cached(
                "UPDATE webhooks SET failing_since = NULL, last_error = NULL \
                 WHERE tenant_id = ?1 AND failing_since IS NOT NULL",
            )?;
            for tenant_id in &record.healthy {
                healthy.execute([tenant_id])?;
            }
            let mut advance = tx.prepare_cached(
                "UPDATE webhooks SET position_xid = ?2, position_id = ?3 \
                 WHERE tenant_id = ?1 AND (position_xid, position_id) < (?2, ?3)",
            )?;
            for (tenant_id, (xid, id)) in &record.positions {
                advance.execute(rusqlite::params![tenant_id, xid, id])?;
            }
            Ok(())
        })
        .await
}

/// Makes a tenant's failed events pending again, due now (`?1`), for
/// tenant `?2`.
const RESUME: &str = "UPDATE webhook_deliveries SET state = 'pending', next_attempt_at = ?1, \
     attempts = 0, last_error = NULL WHERE tenant_id = ?2 AND state = 'failed'";

/// The events past the endpoint's position that it wants and that have no
/// row, as a [`StreamBacklog`]: how many, how many are past where its
/// stream is read (the rest are in flight; once the reader's lease has
/// ended, all are due again), and the oldest one's time. `?1` the tenant
/// (or NULL for all), `?2` now. The xids are all 0, so an event's place
/// past the position compares the ids alone: a row value would walk every
/// one of the tenant's events.
fn stream_backlog(whose: &str) -> String {
    format!(
        "SELECT COUNT(e.id), \
         COALESCE(SUM(CASE WHEN COALESCE(w.stream_until, 0) <= ?2 \
                             OR (e.xid, e.id) > (w.read_xid, w.read_id) THEN 1 ELSE 0 END), 0), \
         MIN(e.at), w.disabled_at IS NOT NULL \
         FROM webhooks AS w JOIN message_events AS e ON e.tenant_id = w.tenant_id \
         WHERE {whose} AND e.xid = 0 AND e.id > w.position_id \
         AND instr(w.events, ' message.' || e.event || ' ') > 0 \
         AND NOT EXISTS (SELECT 1 FROM webhook_deliveries AS d WHERE d.event_id = e.id) \
         GROUP BY w.tenant_id, w.disabled_at"
    )
}

#[async_trait]
impl WebhookStore for SqliteDb {
    async fn webhook(&self, tenant_id: &str) -> StoreResult<Option<Webhook>> {
        Ok(self
            .row(WEBHOOK_OF, args![tenant_id.to_owned()], webhook_row)
            .await?)
    }

    async fn webhook_delivery_counts(
        &self,
        tenant_id: &str,
        now: i64,
    ) -> StoreResult<Vec<DeliveryCount>> {
        let rows: Vec<StateRow> = self
            .rows(
                "SELECT state, COUNT(*) AS count, \
                 COALESCE(SUM(CASE WHEN next_attempt_at <= ?2 THEN 1 ELSE 0 END), 0) AS due, \
                 MIN(created_at) AS oldest \
                 FROM webhook_deliveries WHERE tenant_id = ?1 GROUP BY state",
                args![tenant_id.to_owned(), now],
                tuple,
            )
            .await?;
        let stream: Option<StreamBacklog> = self
            .rows(
                stream_backlog("w.tenant_id = ?1"),
                args![tenant_id.to_owned(), now],
                tuple,
            )
            .await?
            .pop();
        Ok(counts_by_state(rows, stream))
    }

    async fn webhook_calls_due(&self, now: i64) -> StoreResult<(i64, Option<i64>)> {
        let rows: (i64, Option<i64>) = self
            .rows(
                "SELECT COUNT(*), MIN(created_at) FROM webhook_deliveries \
                 WHERE state = 'pending' AND next_attempt_at <= ?1",
                args![now],
                tuple,
            )
            .await?
            .pop()
            .unwrap_or_default();
        let streams: Vec<StreamBacklog> = self
            .rows(
                stream_backlog("w.disabled_at IS NULL AND ?1 IS NULL"),
                args![None::<String>, now],
                tuple,
            )
            .await?;
        Ok(due_of(rows, streams))
    }

    async fn put_webhook(
        &self,
        tenant_id: &str,
        endpoint: &Endpoint<'_>,
        secret: String,
    ) -> StoreResult<(Webhook, Option<String>)> {
        const EXISTS: &str = "SELECT tenant_id FROM webhooks WHERE tenant_id = ?1";
        const CHANGE: &str = "UPDATE webhooks SET url = ?1, events = ?2, failing_since = NULL, \
             last_error = NULL, disabled_at = NULL, updated_at = ?3, max_events_per_call = ?5 \
             WHERE tenant_id = ?4";
        // A new endpoint's stream starts at the tenant's newest event.
        const CREATE: &str = "INSERT INTO webhooks (tenant_id, url, events, secret, created_at, \
             updated_at, position_xid, position_id, read_xid, read_id, max_events_per_call) \
             SELECT ?1, ?2, ?3, ?4, ?5, ?5, top.xid, top.id, top.xid, top.id, ?6 FROM \
             (SELECT xid, id FROM message_events WHERE tenant_id = ?1 \
              UNION ALL SELECT 0, 0 ORDER BY 1 DESC, 2 DESC LIMIT 1) AS top";
        let now = now_ms();
        let created = {
            let (tenant_id, url, events, secret) = (
                tenant_id.to_owned(),
                endpoint.url.to_owned(),
                endpoint.events.to_owned(),
                secret.clone(),
            );
            let per_call = endpoint.max_events_per_call;
            self.transact(move |tx| {
                let existed = prepare(tx, EXISTS)?
                    .query_row([&tenant_id], |_| Ok(()))
                    .optional()?
                    .is_some();
                if existed {
                    prepare(tx, CHANGE)?
                        .execute(rusqlite::params![url, events, now, tenant_id, per_call])?;
                    prepare(tx, RESUME)?.execute(rusqlite::params![now, tenant_id])?;
                } else {
                    prepare(tx, CREATE)?.execute(rusqlite::params![
                        tenant_id, url, events, secret, now, per_call
                    ])?;
                }
                Ok(!existed)
            })
            .await?
        };
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
        const ROTATE: &str = "UPDATE webhooks SET previous_secret = secret, previous_until = ?1, \
             secret = ?2, updated_at = ?3 WHERE tenant_id = ?4";
        let now = now_ms();
        let args = args![now + grace_ms, secret.clone(), now, tenant_id.to_owned()];
        if self.execute(ROTATE, args).await? == 0 {
            return Ok(None);
        }
        Ok(self
            .webhook(tenant_id)
            .await?
            .map(|webhook| (webhook, secret)))
    }

    async fn delete_webhook(&self, tenant_id: &str) -> StoreResult<bool> {
        const CALLS: &str = "DELETE FROM webhook_deliveries WHERE tenant_id = ?1";
        const ENDPOINT: &str = "DELETE FROM webhooks WHERE tenant_id = ?1";
        let tenant_id = tenant_id.to_owned();
        let removed = self
            .transact(move |tx| {
                tx.execute(CALLS, [&tenant_id])?;
                Ok(tx.execute(ENDPOINT, [&tenant_id])?)
            })
            .await?;
        Ok(removed == 1)
    }

    async fn redrive_webhook(&self, tenant_id: &str) -> StoreResult<Option<u64>> {
        const ENABLE: &str = "UPDATE webhooks SET disabled_at = NULL, failing_since = NULL, \
             updated_at = ?1 WHERE tenant_id = ?2";
        let now = now_ms();
        let backlog = stream_backlog("w.tenant_id = ?1");
        let tenant_id = tenant_id.to_owned();
        Ok(self
            .transact(move |tx| {
                if prepare(tx, ENABLE)?.execute(rusqlite::params![now, tenant_id])? == 0 {
                    return Ok(None);
                }
                let rows = prepare(tx, RESUME)?.execute(rusqlite::params![now, tenant_id])?;
                let kept = prepare(tx, &backlog)?
                    .query_row(rusqlite::params![tenant_id, now], tuple)
                    .optional()?;
                Ok(Some(rows as u64 + kept_count(kept)))
            })
            .await?)
    }

    async fn failing_webhooks(&self) -> StoreResult<Vec<Webhook>> {
        const FAILING: &str = concat!(
            "SELECT ",
            webhook_columns!(),
            " FROM webhooks WHERE failing_since IS NOT NULL OR disabled_at IS NOT NULL \
             ORDER BY COALESCE(failing_since, disabled_at) LIMIT 1000"
        );
        Ok(self.rows(FAILING, vec![], webhook_row).await?)
    }

    async fn failed_webhook_calls(
        &self,
        of: CallsOf<'_>,
        limit: i64,
    ) -> StoreResult<Vec<FailedCall>> {
        const OF_TENANT: &str = "SELECT event_id, message_id, type, created_at, \
             next_attempt_at, attempts, state, last_error FROM webhook_deliveries \
             WHERE tenant_id = ?1 ORDER BY event_id LIMIT ?2";
        const OF_MESSAGE: &str = "SELECT event_id, message_id, type, created_at, \
             next_attempt_at, attempts, state, last_error FROM webhook_deliveries \
             WHERE message_id = ?1 ORDER BY event_id LIMIT ?2";
        let (sql, who) = match of {
            CallsOf::Tenant(tenant) => (OF_TENANT, tenant),
            CallsOf::Message(message) => (OF_MESSAGE, message),
        };
        Ok(self.rows(sql, args![who.to_owned(), limit], tuple).await?)
    }

    async fn tenants_with_pending_calls(&self) -> StoreResult<Vec<String>> {
        let tenants: Vec<(Option<String>,)> = self.rows(PENDING_TENANTS, vec![], tuple).await?;
        Ok(tenants.into_iter().filter_map(|(tenant,)| tenant).collect())
    }

    async fn release_webhook_lease(&self, event_id: i64) -> StoreResult<()> {
        const RELEASE: &str =
            "UPDATE webhook_deliveries SET next_attempt_at = ?1 WHERE event_id = ?2";
        self.execute(RELEASE, args![now_ms(), event_id]).await?;
        Ok(())
    }

    async fn forget_webhook_call(&self, event_id: i64) -> StoreResult<()> {
        const FORGET: &str = "DELETE FROM webhook_deliveries WHERE event_id = ?1";
        self.execute(FORGET, args![event_id]).await?;
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
             SELECT ?1, ?2, ?3, ?4, ?5, ?6, 1, \
             CASE WHEN ?7 = 1 OR EXISTS (SELECT 1 FROM webhooks AS w WHERE w.tenant_id = ?2 \
                                         AND w.disabled_at IS NOT NULL) \
                  THEN 'failed' ELSE 'pending' END, ?8 \
             WHERE TRUE \
             ON CONFLICT (event_id) DO UPDATE SET attempts = webhook_deliveries.attempts + 1, \
             last_error = excluded.last_error, next_attempt_at = excluded.next_attempt_at, \
             state = excluded.state";
        // The message's later events wait for this one anyway: moving them
        // back with it keeps them out of the next passes' reads.
        const LATER: &str = "UPDATE webhook_deliveries SET next_attempt_at = ?1 \
             WHERE message_id = ?2 AND event_id > ?3 AND state = 'pending' AND next_attempt_at < ?1";
        const FAILING: &str = "UPDATE webhooks SET failing_since = COALESCE(failing_since, ?1), \
             last_error = ?2 WHERE tenant_id = ?3 AND disabled_at IS NULL RETURNING failing_since";
        const DISABLE: &str = "UPDATE webhooks SET disabled_at = ?1 WHERE tenant_id = ?2";
        const GIVE_UP: &str = "UPDATE webhook_deliveries SET state = 'failed' \
             WHERE tenant_id = ?1 AND state = 'pending'";
        let (due, error) = (due.clone(), error.to_owned());
        Ok(self
            .transact(move |tx| {
                prepare(tx, UPSERT)?.execute(rusqlite::params![
                    due.event_id,
                    due.tenant_id,
                    due.message_id,
                    due.kind,
                    due.created_at,
                    next,
                    i32::from(gave_up),
                    error
                ])?;
                prepare(tx, LATER)?.execute(rusqlite::params![
                    next,
                    due.message_id,
                    due.event_id
                ])?;
                let failing_since = prepare(tx, FAILING)?
                    .query_row(rusqlite::params![now, error, due.tenant_id], |row| {
                        row.get(0)
                    })
                    .optional()?;
                let disabled = to_disable(failing_since, now, limit);
                if disabled {
                    prepare(tx, DISABLE)?.execute(rusqlite::params![now, due.tenant_id])?;
                    prepare(tx, GIVE_UP)?.execute([&due.tenant_id])?;
                }
                Ok(disabled)
            })
            .await?)
    }
}
