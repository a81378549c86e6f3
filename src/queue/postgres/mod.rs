//! Lanes in PostgreSQL (`queue.backend = "postgres"`): the queues of
//! several instances in the database they already share, without SQS.
//!
//! Two tables (migration `0027_lanes.sql`): `lane_messages`, a row per
//! waiting message (its lane or the lane's DLQ, its priority class, its
//! visibility and receive counts), and `lane_turns`, a row per tenant with
//! messages in a lane's class, ordered by turn. The accept path writes a
//! message's row in the same transaction as its status row
//! (`crate::store::Staging::Lanes`), so a 202 is on its lane the moment it
//! is answered, with no outbox and no relay.
//!
//! - **Receives** (`receive.rs`) take high before normal before low under
//!   the lanes' share rule, tenants in turn within a class, and lock what
//!   they take `FOR UPDATE SKIP LOCKED`: instances never hand out the same
//!   message, and a receive reads the batch's tenants and messages, not the
//!   lane's depth.
//! - **Visibility** is the row's `visible_at`; a receive leases a row until
//!   its visibility timeout ends, and a lease that runs out makes it visible
//!   again (a crashed instance's messages come back by themselves).
//!   Receipts are `seq:receives`: receiving a message again invalidates the
//!   receipt a slower consumer may still hold, as in SQS.
//! - **Dead letters**: a receive that finds a message received
//!   `max_receive_count` times already moves it to the lane's DLQ instead,
//!   and its message to `dead_lettered` in the same transaction; a redrive
//!   moves rows back and marks their messages `queued` in the same
//!   transaction.
//! - **Wake-ups**: an accept, a redrive or a message given back sends
//!   `NOTIFY fairlane_lanes` with the lane; every instance listens, so a
//!   long poll answers a new message in milliseconds, and an idle lane is
//!   looked at four times a second.
//!
//! - **Dedicated tenant queues** (`dedicated.rs`): a dedicated tenant's
//!   rows wait under a queue of its own (`fast:t:acme`), and an entry for
//!   it in the lane's attention queue (`fast:attention`) tells the
//!   attention workers; both are views of the same table through this
//!   type, so they receive, lease and dead-letter as the lanes do.
//!
//! What it does not have yet: setting a paused tenant's messages aside
//! (consumers put them back for `consumers.hold_delay_secs`, as on SQS).

mod dedicated;
mod receive;
#[cfg(test)]
mod tests;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use anyhow::Context;
use async_trait::async_trait;
use sqlx::postgres::PgPool;
use tokio::sync::Notify;
use tracing::warn;

use super::priority::PriorityShare;
use super::{
    DeadLetter, EntryResult, LaneQueue, OutboundMessage, QueueStats, ReceivedMessage, RedriveFilter,
};
use crate::config::LanesSettings;
use crate::model::{Lane, now_ms};
use crate::store::postgres::PgDb;
use crate::store::postgres::lanes::{LaneRows, insert_lane_rows};

/// Most messages per receive, delete and visibility call.
const PG_BATCH: usize = 50;

/// The channel of lane wake-ups; the payload is the lane.
const CHANNEL: &str = "fairlane_lanes";

/// Which queues of `lane_messages` a handle works on, in each lane.
#[derive(Clone)]
enum View {
    /// The shared lanes: `fast`, `slow`, and their `fast-dlq`, `slow-dlq`.
    Lanes,
    /// Each lane's attention queue, `fast:attention`: an entry per
    /// dedicated tenant queue that needs a slice of work.
    Attention,
    /// One tenant's own queue, `fast:t:acme` (dead letters in
    /// `fast:t:acme:dlq`), with the book of this handle on it.
    Tenant {
        tenant_id: Arc<str>,
        book: Arc<LaneBook>,
    },
}

/// A queue's names in `lane_messages.queue`: where its messages wait, and
/// its dead-letter queue.
struct Names {
    main: String,
    dlq: String,
}

impl Names {
    /// A shared lane: `fast`, dead letters in `fast-dlq`.
    fn lane(lane: Lane) -> Names {
        Names {
            main: lane.as_str().to_owned(),
            dlq: format!("{lane}-dlq"),
        }
    }

    /// `lane`'s attention queue: `fast:attention`.
    fn attention(lane: Lane) -> Names {
        Names::suffixed(format!("{lane}:attention"))
    }

    /// `tenant_id`'s own queue in `lane`: `fast:t:acme`.
    fn tenant(lane: Lane, tenant_id: &str) -> Names {
        Names::suffixed(format!("{lane}:t:{tenant_id}"))
    }

    /// A queue whose dead letters go to `{main}:dlq` (tenant ids have no
    /// `:`, so no two names collide).
    fn suffixed(main: String) -> Names {
        let dlq = format!("{main}:dlq");
        Names { main, dlq }
    }
}

/// The `seq` and hand-out a receipt names.
fn parse_receipt(receipt: &str) -> Option<(i64, i64)> {
    let (seq, receives) = receipt.split_once(':')?;
    Some((seq.parse().ok()?, receives.parse().ok()?))
}

/// What this instance keeps for one lane.
struct LaneBook {
    share: PriorityShare,
    /// The lane's figures as last counted, when, and what counting cost.
    counted: tokio::sync::Mutex<Option<Counted>>,
    /// Rung when something may have arrived (a notification, or a message
    /// this instance gave back).
    arrived: Notify,
    arrivals: AtomicU64,
    deleted: AtomicU64,
}

/// A lane's figures as counted at `at`, a count that took `cost`.
struct Counted {
    stats: QueueStats,
    at: std::time::Instant,
    cost: Duration,
}

impl Counted {
    /// Counting reads every row of the lane: a shallow lane is counted at
    /// every call, a deep one (a count of over [`CHEAP_COUNT`]) at most once
    /// in ten times what counting took, so that counting takes at most a
    /// tenth of the time.
    fn fresh(&self) -> bool {
        self.cost > CHEAP_COUNT && self.at.elapsed() < self.cost * 10
    }
}

/// A count that took longer is not repeated at once.
const CHEAP_COUNT: Duration = Duration::from_millis(20);

impl LaneBook {
    fn new(lanes: &LanesSettings, lane: Lane) -> LaneBook {
        LaneBook {
            share: PriorityShare::new(lanes.get(lane).low_priority_share),
            counted: tokio::sync::Mutex::new(None),
            arrived: Notify::new(),
            arrivals: AtomicU64::new(0),
            deleted: AtomicU64::new(0),
        }
    }

    fn ring(&self) {
        self.arrivals.fetch_add(1, Ordering::Relaxed);
        self.arrived.notify_waiters();
    }
}

/// What this instance keeps per lane for the lanes and for their
/// attention queues.
struct Books {
    lanes: [LaneBook; 2],
    attention: [LaneBook; 2],
}

/// `lane`'s place in [`Books`].
fn index(lane: Lane) -> usize {
    match lane {
        Lane::Fast => 0,
        Lane::Slow => 1,
    }
}

/// The lanes in the PostgreSQL store, or a view of other queues in their
/// table (see [`View`]); cheap to clone.
#[derive(Clone)]
pub struct PgLanes {
    db: PgDb,
    pool: PgPool,
    lanes: LanesSettings,
    books: Arc<Books>,
    view: View,
}

impl PgLanes {
    /// The lanes of `db` (its migrations made the tables), with a listener
    /// for wake-ups that lives as long as the returned queue.
    pub async fn open(db: &PgDb, lanes: LanesSettings) -> anyhow::Result<Arc<PgLanes>> {
        let book = |lane: Lane| LaneBook::new(&lanes, lane);
        let queue = Arc::new(PgLanes {
            db: db.clone(),
            pool: db.pool.clone(),
            books: Arc::new(Books {
                lanes: [book(Lane::Fast), book(Lane::Slow)],
                attention: [book(Lane::Fast), book(Lane::Slow)],
            }),
            lanes,
            view: View::Lanes,
        });
        let listener = db
            .listen(CHANNEL)
            .await
            .context("listening for lane wake-ups")?;
        tokio::spawn(follow(listener, Arc::downgrade(&queue)));
        Ok(queue)
    }

    fn book(&self, lane: Lane) -> &LaneBook {
        match &self.view {
            View::Lanes => &self.books.lanes[index(lane)],
            View::Attention => &self.books.attention[index(lane)],
            View::Tenant { book, .. } => book,
        }
    }

    /// This handle's queue in `lane`.
    fn names(&self, lane: Lane) -> Names {
        match &self.view {
            View::Lanes => Names::lane(lane),
            View::Attention => Names::attention(lane),
            View::Tenant { tenant_id, .. } => Names::tenant(lane, tenant_id),
        }
    }

    /// Wakes this instance's and the other instances' receivers of this
    /// handle's queue in `lane` (a tenant's own queue has none waiting:
    /// attention workers work it without waiting).
    async fn wake(&self, lane: Lane) {
        self.book(lane).ring();
        if matches!(self.view, View::Tenant { .. }) {
            return;
        }
        let queue = self.names(lane).main;
        if let Err(err) = sqlx::query("SELECT pg_notify($1, $2)")
            .bind(CHANNEL)
            .bind(&queue)
            .execute(&self.pool)
            .await
        {
            warn!(error = %err, queue, "Could not signal the other instances; they find the message on their next look.");
        }
    }

    /// Receipts as `(seq, receives)` columns; an unreadable one keeps its
    /// place with a seq no row has.
    fn receipts(receipts: &[String]) -> (Vec<i64>, Vec<i64>) {
        receipts
            .iter()
            .map(|receipt| parse_receipt(receipt).unwrap_or((-1, -1)))
            .unzip()
    }

    /// One result per receipt: whether its row was among `hit`.
    fn per_receipt(seqs: &[i64], receives: &[i64], hit: &[(i64, i64)]) -> Vec<EntryResult> {
        let hit: HashSet<(i64, i64)> = hit.iter().copied().collect();
        seqs.iter()
            .zip(receives)
            .map(|(&seq, &receives)| {
                if hit.contains(&(seq, receives)) {
                    Ok(())
                } else {
                    Err(
                        "the receipt is not valid (the message was received again, or is gone)"
                            .to_owned(),
                    )
                }
            })
            .collect()
    }

    /// Counts `lane`'s rows: waiting (visible or delayed), in flight,
    /// delayed, the oldest, and the dead letters. Reads every row of the
    /// lane and its DLQ (360 ms at a million rows on the bench machine).
    async fn count(&self, lane: Lane) -> anyhow::Result<QueueStats> {
        let now = now_ms();
        let names = self.names(lane);
        let (depth, in_flight, delayed, oldest, dead): (i64, i64, i64, Option<i64>, i64) =
            sqlx::query_as(
                "SELECT \
                 count(*) FILTER (WHERE queue = $1 AND NOT (leased AND visible_at > $3)), \
                 count(*) FILTER (WHERE queue = $1 AND leased AND visible_at > $3), \
                 count(*) FILTER (WHERE queue = $1 AND NOT leased AND visible_at > $3), \
                 min(enqueued_at) FILTER (WHERE queue = $1), \
                 count(*) FILTER (WHERE queue = $2) \
                 FROM lane_messages WHERE queue IN ($1, $2)",
            )
            .bind(&names.main)
            .bind(&names.dlq)
            .bind(now)
            .fetch_one(&self.pool)
            .await
            .context("reading a lane's figures")?;
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        Ok(QueueStats {
            depth: count(depth),
            in_flight: count(in_flight),
            delayed: count(delayed),
            oldest_age_secs: oldest.map(|at| (now - at).max(0) as f64 / 1000.0),
            dlq_depth: count(dead),
            held: 0,
        })
    }

    /// Puts messages on this handle's queue in `lane` outside the accept
    /// path (a send of the queue's own), as an accept does.
    async fn insert(&self, lane: Lane, messages: &[OutboundMessage]) -> anyhow::Result<()> {
        let queue = self.names(lane).main;
        let mut rows = LaneRows::default();
        for message in messages {
            rows.push_to(&queue, message);
        }
        let mut conn = self.pool.acquire().await?;
        insert_lane_rows(&mut conn, &rows, now_ms()).await
    }
}

/// Rings each lane's receivers on every notification for it, until the
/// queue is dropped. After the connection is lost (notifications may have
/// been missed) every lane is rung once it is back.
async fn follow(mut listener: sqlx::postgres::PgListener, queue: Weak<PgLanes>) {
    loop {
        let received = listener.try_recv().await;
        let Some(queue) = queue.upgrade() else {
            return;
        };
        match received {
            Ok(Some(notification)) => {
                let payload = notification.payload();
                let (books, lane) = match payload.strip_suffix(":attention") {
                    Some(lane) => (&queue.books.attention, lane),
                    None => (&queue.books.lanes, payload),
                };
                match lane.parse::<Lane>() {
                    Ok(lane) => books[index(lane)].ring(),
                    Err(_) => warn!(payload, "A lane wake-up named no lane."),
                }
            }
            Ok(None) => {
                for book in queue.books.lanes.iter().chain(&queue.books.attention) {
                    book.ring();
                }
            }
            Err(err) => {
                warn!(error = %err, "The lane wake-up listener failed; trying again in a second.");
                drop(queue);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

#[async_trait]
impl LaneQueue for PgLanes {
    async fn send_batch(
        &self,
        lane: Lane,
        messages: Vec<OutboundMessage>,
    ) -> anyhow::Result<Vec<EntryResult>> {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        // The insert signals the other instances itself.
        let results = match self.insert(lane, &messages).await {
            Ok(()) => vec![Ok(()); messages.len()],
            Err(err) => vec![Err(format!("{err:#}")); messages.len()],
        };
        self.book(lane).ring();
        Ok(results)
    }

    async fn receive(
        &self,
        lane: Lane,
        max: usize,
        wait: Duration,
    ) -> anyhow::Result<Vec<ReceivedMessage>> {
        self.long_poll(lane, max.min(PG_BATCH), wait).await
    }

    async fn receive_skipping(
        &self,
        lane: Lane,
        max: usize,
        skip: HashSet<String>,
    ) -> anyhow::Result<Vec<ReceivedMessage>> {
        let skip: Vec<String> = skip.into_iter().collect();
        self.take(lane, max.clamp(1, PG_BATCH), &skip).await
    }

    async fn arrival(&self, lane: Lane) {
        self.book(lane).arrived.notified().await;
    }

    fn arrivals_so_far(&self, lane: Lane) -> u64 {
        self.book(lane).arrivals.load(Ordering::Relaxed)
    }

    async fn delete_batch(
        &self,
        lane: Lane,
        receipts: &[String],
    ) -> anyhow::Result<Vec<EntryResult>> {
        let (seqs, receives) = Self::receipts(receipts);
        let deleted: Vec<(i64, i64)> = sqlx::query_as(
            "DELETE FROM lane_messages m USING UNNEST($1::bigint[], $2::bigint[]) AS r(seq, receives) \
             WHERE m.seq = r.seq AND m.receives = r.receives AND m.queue = $3 \
             RETURNING m.seq, m.receives",
        )
        .bind(&seqs)
        .bind(&receives)
        .bind(self.names(lane).main)
        .fetch_all(&self.pool)
        .await
        .context("deleting lane rows")?;
        self.book(lane)
            .deleted
            .fetch_add(deleted.len() as u64, Ordering::Relaxed);
        Ok(Self::per_receipt(&seqs, &receives, &deleted))
    }

    async fn change_visibility_batch(
        &self,
        lane: Lane,
        changes: &[(String, Duration)],
    ) -> anyhow::Result<Vec<EntryResult>> {
        let receipts: Vec<String> = changes.iter().map(|(r, _)| r.clone()).collect();
        let (seqs, receives) = Self::receipts(&receipts);
        let millis: Vec<i64> = changes
            .iter()
            .map(|(_, d)| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .collect();
        let changed: Vec<(i64, i64)> = sqlx::query_as(
            "UPDATE lane_messages m SET visible_at = $4 + r.ms, leased = r.ms > 0 \
             FROM UNNEST($1::bigint[], $2::bigint[], $3::bigint[]) AS r(seq, receives, ms) \
             WHERE m.seq = r.seq AND m.receives = r.receives AND m.queue = $5 \
             RETURNING m.seq, m.receives",
        )
        .bind(&seqs)
        .bind(&receives)
        .bind(&millis)
        .bind(now_ms())
        .bind(self.names(lane).main)
        .fetch_all(&self.pool)
        .await
        .context("changing the visibility of lane rows")?;
        if millis.contains(&0) && !changed.is_empty() {
            self.wake(lane).await;
        }
        Ok(Self::per_receipt(&seqs, &receives, &changed))
    }

    async fn defer(
        &self,
        lane: Lane,
        message: &ReceivedMessage,
        delay: Duration,
    ) -> anyhow::Result<()> {
        let Some((seq, receives)) = parse_receipt(&message.receipt) else {
            anyhow::bail!("not a receipt of this queue: {:?}", message.receipt);
        };
        let delay_ms = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
        // Behind the tenant's other visible messages (a receive reads a
        // tenant's messages by visibility), its receive given back. A
        // receipt gone stale (the lease ran out while this deferral could
        // not reach the database, and another receive took the row) leaves
        // the row to its new holder but still gives back one receive: the
        // lease ended because the store was away, not because of the
        // message, and a store outage must not dead-letter healthy
        // messages (issue 67).
        sqlx::query(
            "UPDATE lane_messages SET \
             visible_at = CASE WHEN receives = $2 THEN $3 + $4 ELSE visible_at END, \
             leased = CASE WHEN receives = $2 THEN false ELSE leased END, \
             receive_count = GREATEST(receive_count - 1, 0) \
             WHERE seq = $1 AND receives >= $2",
        )
        .bind(seq)
        .bind(receives)
        .bind(now_ms())
        .bind(delay_ms)
        .execute(&self.pool)
        .await
        .context("deferring a lane row")?;
        if delay.is_zero() {
            self.wake(lane).await;
        }
        Ok(())
    }

    /// No status here: the consumer recorded the message `dead_lettered`
    /// before it calls this (see [`LaneQueue::dead_letter`]).
    async fn dead_letter(&self, lane: Lane, message: &ReceivedMessage) -> anyhow::Result<()> {
        let Some((seq, receives)) = parse_receipt(&message.receipt) else {
            anyhow::bail!("not a receipt of this queue: {:?}", message.receipt);
        };
        sqlx::query(
            "UPDATE lane_messages SET queue = $3, leased = false, visible_at = $4 \
             WHERE seq = $1 AND receives = $2",
        )
        .bind(seq)
        .bind(receives)
        .bind(self.names(lane).dlq)
        .bind(now_ms())
        .execute(&self.pool)
        .await
        .context("moving a lane row to the DLQ")?;
        Ok(())
    }

    async fn stats(&self, lane: Lane) -> anyhow::Result<QueueStats> {
        let mut counted = self.book(lane).counted.lock().await;
        if let Some(last) = counted.as_ref().filter(|last| last.fresh()) {
            return Ok(last.stats.clone());
        }
        let started = std::time::Instant::now();
        let stats = self.count(lane).await?;
        *counted = Some(Counted {
            stats: stats.clone(),
            at: std::time::Instant::now(),
            cost: started.elapsed(),
        });
        Ok(stats)
    }

    async fn list_dead_letters(&self, lane: Lane, limit: usize) -> anyhow::Result<Vec<DeadLetter>> {
        let rows: Vec<(String, String, String, String, i32, i64, String)> = sqlx::query_as(
            "SELECT message_id, tenant_id, channel, priority, receive_count, enqueued_at, body \
             FROM lane_messages WHERE queue = $1 ORDER BY seq LIMIT $2",
        )
        .bind(self.names(lane).dlq)
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&self.pool)
        .await
        .context("listing dead letters")?;
        rows.into_iter()
            .map(
                |(message_id, tenant_id, channel, priority, receive_count, enqueued_at, body)| {
                    Ok(DeadLetter {
                        message_id,
                        tenant_id,
                        channel: channel.parse().map_err(anyhow::Error::msg)?,
                        priority: priority.parse().map_err(anyhow::Error::msg)?,
                        receive_count: u32::try_from(receive_count).unwrap_or(0),
                        enqueued_at_ms: enqueued_at,
                        body,
                    })
                },
            )
            .collect()
    }

    async fn redrive(&self, lane: Lane, filter: &RedriveFilter) -> anyhow::Result<Vec<String>> {
        if filter.message_ids.as_ref().is_some_and(Vec::is_empty) {
            return Ok(Vec::new());
        }
        let now = now_ms();
        let names = self.names(lane);
        let mut tx = self.pool.begin().await?;
        // The rows move back with a fresh receive budget and their tenants'
        // turns made (under the turn locks, as an accept), and the messages
        // are `queued` in the same commit, so no consumer sees a redriven
        // row of a dead letter.
        let ids: Vec<String> = sqlx::query_scalar(
            "WITH moved AS ( \
                 UPDATE lane_messages SET queue = $1, visible_at = $4, leased = false, \
                 receive_count = 0 \
                 WHERE queue = $2 AND ($3::text IS NULL OR tenant_id = $3) \
                 AND ($5::text[] IS NULL OR message_id = ANY($5)) \
                 RETURNING class, tenant_id, message_id), \
             turns AS (INSERT INTO lane_turns (queue, class, tenant_id, turn) \
                 SELECT $1, d.class, d.tenant_id, nextval('lane_turn_seq') \
                 FROM (SELECT DISTINCT class, tenant_id FROM moved) AS d \
                 CROSS JOIN LATERAL (SELECT pg_advisory_xact_lock_shared( \
                     hashtextextended($1 || ':' || d.class || ':' || d.tenant_id, 0))) AS l \
                 ON CONFLICT (queue, class, tenant_id) DO NOTHING) \
             SELECT message_id FROM moved",
        )
        .bind(&names.main)
        .bind(&names.dlq)
        .bind(filter.tenant_id.as_deref())
        .bind(now)
        .bind(filter.message_ids.as_deref())
        .fetch_all(&mut *tx)
        .await
        .context("moving dead letters back")?;
        crate::store::postgres::lifecycle::redrive(&mut tx, &ids, i64::MAX, now).await?;
        tx.commit().await.context("committing a redrive")?;
        if !ids.is_empty() {
            self.wake(lane).await;
        }
        Ok(ids)
    }

    fn deleted_total(&self, lane: Lane) -> u64 {
        self.book(lane).deleted.load(Ordering::Relaxed)
    }

    async fn ping(&self) -> bool {
        self.db.ping().await
    }

    fn trace_destination(
        &self,
        lane: Lane,
        _priority: crate::model::Priority,
    ) -> (&'static str, String) {
        ("postgresql", self.names(lane).main)
    }

    fn max_batch(&self) -> usize {
        PG_BATCH
    }
}
