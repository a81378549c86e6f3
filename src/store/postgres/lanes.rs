//! How a message goes onto a lane in PostgreSQL (`queue.backend =
//! "postgres"`): the one statement both the accept path (in the writer's
//! group transaction) and the lanes' own sends (`crate::queue::postgres`)
//! use. It routes a dedicated tenant's messages to the tenant's own queue
//! with an attention entry for it, as the tenants table says at that
//! moment, so every instance routes alike without being told. The lanes'
//! tables and receives are `crate::queue::postgres`'s.

use anyhow::Context;
use sqlx::PgConnection;

use crate::message::OutboundMessage;
use crate::model::Lane;

/// Messages as rows of the lanes' table, one array per column.
#[derive(Default)]
pub(crate) struct LaneRows {
    pub id: Vec<String>,
    /// The queue each row goes to: a lane (`fast`, `slow`: a dedicated
    /// tenant's rows go to its own queue instead), or a queue named in
    /// full (a tenant's own, an attention queue), taken as it is.
    pub queue: Vec<String>,
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
    /// A message for `lane`: its tenant's own queue there if the tenant is
    /// dedicated.
    pub(crate) fn push(&mut self, lane: Lane, message: &OutboundMessage) {
        self.push_to(lane.as_str(), message);
    }

    /// A message for the queue named `queue`.
    pub(crate) fn push_to(&mut self, queue: &str, message: &OutboundMessage) {
        self.id.push(message.message_id.clone());
        self.queue.push(queue.to_owned());
        self.tenant_id.push(message.tenant_id.clone());
        self.channel.push(message.channel.as_str().to_owned());
        self.priority.push(message.priority.as_str().to_owned());
        self.body.push(message.body.clone());
        self.class.push(message.priority.rank() as i16);
        self.delay_ms
            .push(i64::try_from(message.delay.as_millis()).unwrap_or(i64::MAX));
    }

    /// An attention entry for `tenant_id` on the attention queue `queue`,
    /// visible after `delay_ms`: the row [`insert_lane_rows`] writes for a
    /// dedicated tenant's message (the tenant as its id, a normal class,
    /// no body).
    pub(crate) fn push_signal(&mut self, queue: &str, tenant_id: &str, delay_ms: i64) {
        self.id.push(tenant_id.to_owned());
        self.queue.push(queue.to_owned());
        self.tenant_id.push(tenant_id.to_owned());
        self.channel.push("email".to_owned());
        self.priority.push("normal".to_owned());
        self.body.push(String::new());
        self.class.push(1);
        self.delay_ms.push(delay_ms);
    }
}

/// Puts `rows` on their queues, each tenant's turn in its queue and class
/// made where it has none, and sends a `NOTIFY fairlane_lanes` per lane or
/// attention queue with a row visible now (delivered at the commit): one
/// statement.
///
/// A row for a lane of a tenant whose `isolation` is `dedicated` goes to
/// the tenant's own queue there (`fast:t:acme`), which is then listed in
/// `lane_tenant_queues`, with an entry for the tenant in the lane's
/// attention queue (`fast:attention`), visible when the first of the
/// tenant's rows is due. One waiting already (the `lane_messages_attention`
/// index keeps one per tenant) is brought forward to that instant if it
/// was due later and no worker holds it: a send due now never waits for
/// the tenant's scheduled one (issue 68).
///
/// Before it looks for a turn it holds the turn's advisory lock in shared
/// mode until the transaction ends (key: `hashtextextended('{queue}:{class}:
/// {tenant}', 0)`, as the receive's `drop_turns` computes it). A receive
/// drops the turn of a tenant it found with nothing left only under that
/// lock in exclusive mode, so it never drops one under rows being put on
/// the queue, and sends never wait for one another.
pub(crate) async fn insert_lane_rows(
    conn: &mut PgConnection,
    rows: &LaneRows,
    now: i64,
) -> anyhow::Result<()> {
    sqlx::query(
        "WITH given AS (SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], \
             $5::text[], $6::text[], $7::smallint[], $8::bigint[]) \
             AS g(id, queue, tenant_id, channel, priority, body, class, delay_ms)), \
         own AS (SELECT g.queue AS lane, g.tenant_id, min(g.delay_ms) AS delay_ms FROM given g \
             JOIN tenants t ON t.id = g.tenant_id AND t.isolation = 'dedicated' \
             WHERE g.queue IN ('fast', 'slow') GROUP BY g.queue, g.tenant_id), \
         u AS (SELECT g.id, CASE WHEN o.lane IS NULL THEN g.queue \
                 ELSE g.queue || ':t:' || g.tenant_id END AS queue, \
                 g.tenant_id, g.channel, g.priority, g.body, g.class, g.delay_ms \
             FROM given g LEFT JOIN own o ON o.lane = g.queue AND o.tenant_id = g.tenant_id \
             UNION ALL SELECT o.tenant_id, o.lane || ':attention', o.tenant_id, 'email', \
                 'normal', '', 1::smallint, o.delay_ms FROM own o), \
         turns AS (INSERT INTO lane_turns (queue, class, tenant_id, turn) \
             SELECT d.queue, d.class, d.tenant_id, nextval('lane_turn_seq') \
             FROM (SELECT DISTINCT queue, class, tenant_id FROM u) AS d \
             CROSS JOIN LATERAL (SELECT pg_advisory_xact_lock_shared( \
                 hashtextextended(d.queue || ':' || d.class || ':' || d.tenant_id, 0))) AS l \
             ON CONFLICT (queue, class, tenant_id) DO NOTHING), \
         queued AS (INSERT INTO lane_messages (queue, class, tenant_id, message_id, channel, \
             priority, body, enqueued_at, visible_at) \
             SELECT queue, class, tenant_id, id, channel, priority, body, $9, $9 + delay_ms FROM u \
             ON CONFLICT (queue, tenant_id) WHERE queue LIKE '%:attention' DO UPDATE \
             SET visible_at = EXCLUDED.visible_at \
             WHERE NOT lane_messages.leased AND lane_messages.visible_at > EXCLUDED.visible_at), \
         listed AS (INSERT INTO lane_tenant_queues (tenant_id, lane) \
             SELECT tenant_id, lane FROM own ON CONFLICT DO NOTHING) \
         SELECT count(pg_notify('fairlane_lanes', queue)) \
         FROM (SELECT DISTINCT queue FROM u WHERE delay_ms <= 0 AND queue NOT LIKE '%:t:%') AS woken",
    )
    .bind(&rows.id)
    .bind(&rows.queue)
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
