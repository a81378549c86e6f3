//! The webhook dispatcher's SQLite work, as pieces for the store's one
//! writer ([`StoreWriter`]): a pass (the tenants with calls to make, each
//! one's failed calls now due and the next events of its endpoint's
//! stream, with their data and the endpoint) and the record of calls made.
//! PostgreSQL does the same in `store::postgres::webhooks`; what both share
//! (the endpoint's row, the stream's statements, the snapshot of a message
//! at an event) is in `store::webhooks`.

use rusqlite::{OptionalExtension, Transaction};

use super::writer::StoreWriter;
use crate::store::delivery::{
    CallsRecord, NextEvent, PassRooms, StreamPass, StreamRead, TenantRoom, tenants_to_visit,
};
use crate::store::webhooks::{
    Cursor, DUE_CALLS, DueCall, HOLD, PENDING_TENANTS, SNAPSHOT, STREAM_TENANTS_SQLITE,
    SnapshotRow, WEBHOOK_OF, Webhook, webhook_row,
};

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
                .prepare_cached(STREAM_TENANTS_SQLITE)?
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
        read = plan.read;
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

#[async_trait::async_trait]
impl crate::store::webhooks::WebhookStore for super::SqliteDb {}
