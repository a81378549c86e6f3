//! How a message goes onto a lane in PostgreSQL (`queue.backend =
//! "postgres"`): the one statement both the accept path (in the writer's
//! group transaction) and the lanes' own sends (`crate::queue::postgres`)
//! use. The lanes' tables and receives are `crate::queue::postgres`'s.

use anyhow::Context;
use sqlx::PgConnection;

use crate::message::OutboundMessage;
use crate::model::Lane;

/// Messages as rows of the lanes' table, one array per column.
#[derive(Default)]
pub(crate) struct LaneRows {
    pub id: Vec<String>,
    pub lane: Vec<String>,
    pub tenant_id: Vec<String>,
    pub channel: Vec<String>,
    pub priority: Vec<String>,
    pub body: Vec<String>,
    /// The priority's rank, the lanes' class.
    pub class: Vec<i16>,
    /// How long the row stays invisible (a scheduled send), in ms.
    pub delay_ms: Vec<i64>,
}

impl LaneRows {
    pub(crate) fn push(&mut self, lane: Lane, message: &OutboundMessage) {
        self.id.push(message.message_id.clone());
        self.lane.push(lane.as_str().to_owned());
        self.tenant_id.push(message.tenant_id.clone());
        self.channel.push(message.channel.as_str().to_owned());
        self.priority.push(message.priority.as_str().to_owned());
        self.body.push(message.body.clone());
        self.class.push(message.priority.rank() as i16);
        self.delay_ms
            .push(i64::try_from(message.delay.as_millis()).unwrap_or(i64::MAX));
    }
}

/// Puts `rows` on their lanes, each tenant's turn in its lane and class made
/// where it has none, and sends a `NOTIFY fairlane_lanes` per lane with a
/// message visible now (delivered at the commit): one statement.
///
/// Before it looks for a turn it holds the turn's advisory lock in shared
/// mode until the transaction ends (key: `hashtextextended('{lane}:{class}:
/// {tenant}', 0)`, as the receive's `drop_turns` computes it). A receive
/// drops the turn of a tenant it found with nothing left only under that
/// lock in exclusive mode, so it never drops one under rows being put on
/// the lane, and sends never wait for one another.
pub(crate) async fn insert_lane_rows(
    conn: &mut PgConnection,
    rows: &LaneRows,
    now: i64,
) -> anyhow::Result<()> {
    sqlx::query(
        "WITH u AS (SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], \
             $5::text[], $6::text[], $7::smallint[], $8::bigint[]) \
             AS u(id, lane, tenant_id, channel, priority, body, class, delay_ms)), \
         turns AS (INSERT INTO lane_turns (queue, class, tenant_id, turn) \
             SELECT d.lane, d.class, d.tenant_id, nextval('lane_turn_seq') \
             FROM (SELECT DISTINCT lane, class, tenant_id FROM u) AS d \
             CROSS JOIN LATERAL (SELECT pg_advisory_xact_lock_shared( \
                 hashtextextended(d.lane || ':' || d.class || ':' || d.tenant_id, 0))) AS l \
             ON CONFLICT (queue, class, tenant_id) DO NOTHING), \
         queued AS (INSERT INTO lane_messages (queue, class, tenant_id, message_id, channel, \
             priority, body, enqueued_at, visible_at) \
             SELECT lane, class, tenant_id, id, channel, priority, body, $9, $9 + delay_ms FROM u) \
         SELECT count(pg_notify('fairlane_lanes', lane)) \
         FROM (SELECT DISTINCT lane FROM u WHERE delay_ms <= 0) AS woken",
    )
    .bind(&rows.id)
    .bind(&rows.lane)
    .bind(&rows.tenant_id)
    .bind(&rows.channel)
    .bind(&rows.priority)
    .bind(&rows.body)
    .bind(&rows.class)
    .bind(&rows.delay_ms)
    .bind(now)
    .execute(conn)
    .await
    .context("inserting lane rows")?;
    Ok(())
}
