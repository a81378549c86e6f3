//! The webhook dispatcher's PostgreSQL statements: a pass's due calls
//! with their leases, the message data of their events, and the removal of
//! delivered calls. SQLite does the same in its writer's pieces
//! (`store::sqlite::hot`). What both share (the endpoint's row, the
//! snapshot of a message at an event) is in `store::webhooks`.

use sqlx::PgPool;

use super::PgWriter;
use crate::store::delivery::{PassRooms, TakenCalls};
use crate::store::messages::MessageRecord;
use crate::store::webhooks::{
    DueCall, PENDING_TENANTS, SnapshotRow, WEBHOOK_OF, Webhook, record_at_event,
};

impl PgWriter {
    /// See [`crate::store::Writer::take_pass`]: a statement finds the
    /// tenants with pending calls, and for each one statement finds and
    /// leases its calls, one reads their data and one its endpoint.
    pub(crate) async fn take_pass(
        &self,
        rooms: PassRooms,
        now: i64,
        lease_until: i64,
    ) -> anyhow::Result<Vec<TakenCalls>> {
        let pool = self.pool();
        let tenants: Vec<Option<String>> =
            sqlx::query_scalar(PENDING_TENANTS).fetch_all(pool).await?;
        let mut taken = Vec::new();
        for tenant in tenants.into_iter().flatten() {
            let (busy, room) = rooms.of(&tenant);
            if room == 0 {
                continue;
            }
            let busy: Vec<i64> = busy.into_iter().flatten().copied().collect();
            let calls = take_due(pool, &tenant, &busy, room, now, lease_until).await?;
            if calls.is_empty() {
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
            });
        }
        Ok(taken)
    }

    /// See [`crate::store::Writer::calls_delivered`].
    pub(crate) async fn calls_delivered(
        &self,
        event_ids: &[i64],
        tenant_ids: &[String],
    ) -> anyhow::Result<()> {
        calls_delivered(self.pool(), event_ids, tenant_ids).await
    }
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
            },
        )
    })
    .collect();
    tx.commit().await?;
    taken.sort_by_key(|(due_at, call)| (*due_at, call.event_id));
    Ok(taken.into_iter().map(|(_, call)| call).collect())
}

/// Calls that succeeded: they are removed and their tenants' endpoints are
/// healthy again, in one transaction for the lot (SQLite's removals are a
/// piece of its writer, `sqlite::hot::calls_delivered`).
pub(super) async fn calls_delivered(
    pool: &PgPool,
    event_ids: &[i64],
    tenant_ids: &[String],
) -> anyhow::Result<()> {
    // A removal lost in a crash only makes its calls again, with the same
    // `webhook-id` (delivery is at least once), so its commit does not
    // wait for the WAL to reach the disk.
    let mut tx = pool.begin().await?;
    sqlx::query("SET LOCAL synchronous_commit = off")
        .execute(&mut *tx)
        .await?;
    sqlx::query("DELETE FROM webhook_deliveries WHERE event_id = ANY($1)")
        .bind(event_ids)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "UPDATE webhooks SET failing_since = NULL, last_error = NULL \
         WHERE tenant_id = ANY($1) AND failing_since IS NOT NULL",
    )
    .bind(tenant_ids)
    .execute(&mut *tx)
    .await?;
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
