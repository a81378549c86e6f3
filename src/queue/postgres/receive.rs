//! Receives: a fair, priority-aware take of up to a batch, and the long
//! poll around it.
//!
//! A take is two statements. The first reads, without locking, the
//! candidates of each class: the tenants of the class in turn order, and
//! for each its first visible messages (the `(queue, class, tenant_id,
//! visible_at, seq)` index), so it touches the batch's tenants and messages
//! and not the lane's depth. The share rule of [`crate::queue::priority`]
//! splits the batch among the classes; within a class the messages go
//! round-robin over the tenants (each tenant's first message, in turn
//! order, then each one's second, …). The second statement locks the
//! chosen rows `FOR UPDATE SKIP LOCKED` (another instance's take skips
//! them; a row another instance took since the read fails its visibility
//! check and is left), leases them, gives the tenants it served a new turn
//! behind everyone, and reads each message's status, all in one statement
//! and one round trip.
//!
//! A row received `max_receive_count` times already is not leased: the
//! take reports it spent, and a transaction of its own moves it to the DLQ
//! and its message to `dead_lettered` in the same commit, so a dead letter
//! never says `queued` (issue 67). Only a take that found such rows pays
//! for that transaction; a crash between the two leaves the row visible in
//! its lane, and the next take finds it spent again.
//!
//! A tenant whose turn came with nothing visible (its messages delayed or
//! in flight) goes to the back of the line; one with no rows left loses its
//! turn row in a small transaction of its own, under the turn's advisory
//! lock: an accept holds it (shared) from before it looks for the turn
//! until it commits, so a turn is never dropped under rows being accepted,
//! and neither accepts nor receives wait for one another.

use std::time::Duration;

use anyhow::Context;
use tokio::time::Instant;
use tracing::{info, warn};

use super::{Names, PgLanes, View};
use crate::model::{Lane, now_ms};
use crate::queue::priority::CLASSES;
use crate::queue::{RECEIVED_TOO_OFTEN, ReceivedMessage};
use crate::store::postgres::lifecycle;

/// Longest nap of an idle long poll between two looks: delayed messages
/// coming due, leases running out and a missed notification cost at most
/// this much.
const IDLE_NAP: Duration = Duration::from_millis(250);

/// Most takes one receive makes when rows it chose went to another
/// instance or to the DLQ.
const TAKE_ROUNDS: usize = 3;

/// The candidates of each class: its first `n` tenants in turn order, `n`
/// = the batch `$3` or fewer when the class has fewer tenants, and of each
/// its first `ceil($3 / n)` visible messages (so about a batch of rows
/// whatever the number of tenants: one each from 50 tenants, or 50 from
/// one); a tenant with none visible comes back once, with whether it has
/// any row at all.
const CANDIDATES: &str = "\
    WITH c AS MATERIALIZED ( \
        SELECT k.class, GREATEST(1, LEAST($3, (SELECT count(*) FROM lane_turns \
            WHERE queue = $1 AND class = k.class))) AS n \
        FROM (VALUES (0::smallint), (1::smallint), (2::smallint)) AS k(class)) \
    SELECT c.class, t.tenant_id, t.turn, t.seq, t.rn, \
        (t.seq IS NULL AND NOT EXISTS (SELECT 1 FROM lane_messages r \
            WHERE r.queue = $1 AND r.class = c.class AND r.tenant_id = t.tenant_id)) AS gone \
    FROM c CROSS JOIN LATERAL ( \
        SELECT o.tenant_id, o.turn, v.seq, v.rn FROM ( \
            SELECT tenant_id, turn FROM lane_turns \
            WHERE queue = $1 AND class = c.class AND tenant_id <> ALL($4) \
            ORDER BY turn LIMIT c.n) AS o \
        LEFT JOIN LATERAL ( \
            SELECT s.seq, row_number() OVER (ORDER BY s.visible_at, s.seq) AS rn FROM ( \
                SELECT seq, visible_at FROM lane_messages \
                WHERE queue = $1 AND class = c.class AND tenant_id = o.tenant_id \
                AND visible_at <= $2 ORDER BY visible_at, seq \
                LIMIT ($3 + c.n - 1) / c.n) AS s) AS v ON true) AS t";

/// Takes the chosen rows that are still visible and not locked: leases
/// those received fewer than `$5` times, gives the served tenants (and
/// those `$7`/`$8` whose turn found nothing visible) a new turn, and
/// returns each leased row with its message's status. A row received `$5`
/// times already is not leased: it comes back as bound for the DLQ (its
/// queue given as `$6`, no status), for [`SPEND`] to move with its status.
/// A turn another instance's receive is moving at the same moment is left
/// to it: receives never wait for one another.
const TAKE: &str = "\
    WITH picked AS ( \
        SELECT seq FROM lane_messages WHERE seq = ANY($1) AND visible_at <= $2 \
        ORDER BY seq FOR UPDATE SKIP LOCKED), \
    taken AS ( \
        UPDATE lane_messages m SET visible_at = $3, leased = true, \
            receive_count = m.receive_count + 1, receives = m.receives + 1 \
        FROM picked WHERE m.seq = picked.seq AND m.receive_count < $5 \
        RETURNING m.seq, m.queue, m.class, m.tenant_id, m.message_id, m.channel, m.priority, \
            m.body, m.enqueued_at, m.receive_count, m.receives), \
    spent AS ( \
        SELECT m.seq, m.class, m.tenant_id, m.message_id, m.channel, m.priority, \
            m.enqueued_at, m.receive_count, m.receives \
        FROM lane_messages m JOIN picked ON m.seq = picked.seq WHERE m.receive_count >= $5), \
    served AS ( \
        SELECT class, tenant_id FROM taken \
        UNION SELECT class, tenant_id FROM spent \
        UNION SELECT * FROM UNNEST($7::smallint[], $8::text[])), \
    locked AS ( \
        SELECT t.class, t.tenant_id FROM lane_turns t JOIN served s \
        ON t.queue = $4 AND t.class = s.class AND t.tenant_id = s.tenant_id \
        FOR UPDATE OF t SKIP LOCKED), \
    turned AS ( \
        UPDATE lane_turns t SET turn = nextval('lane_turn_seq') FROM locked s \
        WHERE t.queue = $4 AND t.class = s.class AND t.tenant_id = s.tenant_id) \
    SELECT taken.seq, taken.queue, taken.tenant_id, taken.message_id, taken.channel, \
        taken.priority, taken.body, taken.enqueued_at, taken.receive_count, taken.receives, \
        s.status \
    FROM taken LEFT JOIN messages s ON s.id = taken.message_id \
    UNION ALL SELECT seq, $6::text, tenant_id, message_id, channel, priority, ''::text, \
        enqueued_at, receive_count, receives, NULL::text FROM spent";

/// Moves rows [`TAKE`] found spent (`$1`, each still at its hand-out `$2`:
/// no receipt settled it since) from the queue `$3` to its DLQ `$4`, unless
/// another instance's receive is moving them; returns the messages moved.
/// It runs in one transaction with their move to `dead_lettered`.
const SPEND: &str = "\
    WITH picked AS ( \
        SELECT m.seq FROM lane_messages m \
        JOIN UNNEST($1::bigint[], $2::bigint[]) AS r(seq, receives) \
        ON m.seq = r.seq AND m.receives = r.receives \
        WHERE m.queue = $3 AND m.receive_count >= $5 AND m.visible_at <= $6 \
        ORDER BY m.seq FOR UPDATE OF m SKIP LOCKED) \
    UPDATE lane_messages m SET queue = $4, visible_at = $6, leased = false, \
        receives = m.receives + 1 \
    FROM picked WHERE m.seq = picked.seq RETURNING m.message_id";

/// One candidate row: a tenant's `rn`-th visible message of a class, or
/// (no `seq`) a tenant with nothing visible.
type Candidate = (i16, String, i64, Option<i64>, Option<i64>, bool);

/// A taken row, as [`TAKE`] returns it.
type Taken = (
    i64,
    String,
    String,
    String,
    String,
    String,
    String,
    i64,
    i32,
    i64,
    Option<String>,
);

/// What a candidate read chose.
#[derive(Default)]
struct Choice {
    seqs: Vec<i64>,
    /// Tenants whose turn found nothing visible but rows remain.
    idle: Vec<(i16, String)>,
    /// Tenants with no row left in the class.
    gone: Vec<(i16, String)>,
}

impl PgLanes {
    /// Receives up to `max` messages of `lane`, waiting up to `wait` for
    /// the first one: woken by a `NOTIFY` for the lane, else looking again
    /// every [`IDLE_NAP`].
    pub(super) async fn long_poll(
        &self,
        lane: Lane,
        max: usize,
        wait: Duration,
    ) -> anyhow::Result<Vec<ReceivedMessage>> {
        let deadline = Instant::now() + wait;
        let book = self.book(lane);
        loop {
            let notified = book.arrived.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let got = self.take(lane, max.max(1), &[]).await?;
            let now = Instant::now();
            if !got.is_empty() || now >= deadline {
                return Ok(got);
            }
            let nap = (deadline - now).min(IDLE_NAP);
            let _ = tokio::time::timeout(nap, notified).await;
        }
    }

    /// Takes up to `max` visible messages of `lane` at once, none of the
    /// tenants in `skip`.
    pub(super) async fn take(
        &self,
        lane: Lane,
        max: usize,
        skip: &[String],
    ) -> anyhow::Result<Vec<ReceivedMessage>> {
        let names = self.names(lane);
        let mut out = Vec::new();
        for _ in 0..TAKE_ROUNDS {
            let want = max - out.len();
            let now = now_ms();
            let choice = self.choose(lane, &names, want, skip, now).await?;
            if !choice.gone.is_empty() {
                self.drop_turns(&names, &choice.gone).await?;
            }
            if choice.seqs.is_empty() && choice.idle.is_empty() {
                break;
            }
            let chosen = choice.seqs.len();
            let taken = self.take_rows(lane, &names, &choice, now).await?;
            let before = out.len();
            let mut spent = Vec::new();
            for row in taken {
                match received(&names, row)? {
                    Took::Leased(message) => out.push(message),
                    Took::Spent { seq, receives } => spent.push((seq, receives)),
                }
            }
            // The messages leased are handed out whatever happens here: a
            // spent row left in its lane is found spent again next time.
            if !spent.is_empty()
                && let Err(err) = self.spend(lane, &names, &spent, now).await
            {
                warn!(error = %format!("{err:#}"), queue = names.main, "Could not move spent rows to the DLQ; a later receive tries again.");
            }
            // Every chosen row handed out: the classes had no more (or only
            // idle turns were read, now moved back; the next look goes past
            // them). Rows another instance took, or that went to the DLQ,
            // leave room to look again.
            if out.len() >= max || out.len() - before == chosen {
                break;
            }
        }
        Ok(out)
    }

    /// Reads the candidates of the queue `names` in `lane` and chooses up
    /// to `max` of them.
    async fn choose(
        &self,
        lane: Lane,
        names: &Names,
        max: usize,
        skip: &[String],
        now: i64,
    ) -> anyhow::Result<Choice> {
        let rows: Vec<Candidate> = sqlx::query_as(CANDIDATES)
            .bind(&names.main)
            .bind(now)
            .bind(max as i64)
            .bind(skip)
            .fetch_all(&self.pool)
            .await
            .context("reading a lane's candidates")?;
        let mut choice = Choice::default();
        let mut classes: [Vec<(i64, i64, i64)>; CLASSES] = Default::default();
        for (class, tenant, turn, seq, rn, gone) in rows {
            let rank = usize::try_from(class)
                .unwrap_or(CLASSES - 1)
                .min(CLASSES - 1);
            match (seq, rn) {
                (Some(seq), Some(rn)) => classes[rank].push((rn, turn, seq)),
                _ if gone => choice.gone.push((class, tenant)),
                _ => choice.idle.push((class, tenant)),
            }
        }
        for class in &mut classes {
            class.sort_unstable();
        }
        let available = [classes[0].len(), classes[1].len(), classes[2].len()];
        let split = self.book(lane).share.split(available, max);
        for (class, take) in classes.iter().zip(split) {
            choice
                .seqs
                .extend(class.iter().take(take).map(|&(_, _, seq)| seq));
        }
        Ok(choice)
    }

    /// Runs [`TAKE`] for what `choice` chose.
    async fn take_rows(
        &self,
        lane: Lane,
        names: &Names,
        choice: &Choice,
        now: i64,
    ) -> anyhow::Result<Vec<Taken>> {
        let settings = self.lanes.get(lane);
        let lease_end = now.saturating_add(
            i64::try_from(settings.visibility_timeout_secs.saturating_mul(1000))
                .unwrap_or(i64::MAX),
        );
        let (idle_classes, idle_tenants): (Vec<i16>, Vec<String>) =
            choice.idle.iter().cloned().unzip();
        sqlx::query_as(TAKE)
            .bind(&choice.seqs)
            .bind(now)
            .bind(lease_end)
            .bind(&names.main)
            .bind(i64::from(settings.max_receive_count))
            .bind(&names.dlq)
            .bind(&idle_classes)
            .bind(&idle_tenants)
            .fetch_all(&self.pool)
            .await
            .context("taking messages from a lane")
    }

    /// Moves the rows of `spent` (`(seq, receives)`) to the DLQ and their
    /// messages to `dead_lettered`, in one transaction: a dead letter
    /// never says `queued`. An attention entry has no message: only its
    /// row moves.
    async fn spend(
        &self,
        lane: Lane,
        names: &Names,
        spent: &[(i64, i64)],
        now: i64,
    ) -> anyhow::Result<()> {
        let (seqs, receives): (Vec<i64>, Vec<i64>) = spent.iter().copied().unzip();
        let mut tx = self.pool.begin().await?;
        let ids: Vec<String> = sqlx::query_scalar(SPEND)
            .bind(&seqs)
            .bind(&receives)
            .bind(&names.main)
            .bind(&names.dlq)
            .bind(i64::from(self.lanes.get(lane).max_receive_count))
            .bind(now)
            .fetch_all(&mut *tx)
            .await
            .context("moving spent lane rows to the DLQ")?;
        if !ids.is_empty() && !matches!(self.view, View::Attention) {
            lifecycle::dead_letter(&mut tx, &ids, RECEIVED_TOO_OFTEN, now)
                .await
                .context("marking spent messages dead-lettered")?;
        }
        tx.commit().await.context("committing dead letters")?;
        if !ids.is_empty() {
            info!(queue = names.main, count = ids.len(), message_ids = ?ids, "Messages received max_receive_count times without being deleted were dead-lettered.");
        }
        Ok(())
    }

    /// Removes the turn rows of tenants that had no row left when read.
    /// Each under its turn lock in exclusive mode, taken without waiting
    /// (an accept adding rows under the turn holds it in shared mode until
    /// it commits: that turn is left for a later receive); the check is a
    /// statement of its own, after the lock, so it sees every accept that
    /// committed before.
    async fn drop_turns(&self, names: &Names, gone: &[(i16, String)]) -> anyhow::Result<()> {
        let (classes, tenants): (Vec<i16>, Vec<String>) = gone.iter().cloned().unzip();
        let mut tx = self.pool.begin().await?;
        let locked: Vec<(i16, String)> = sqlx::query_as(
            "SELECT g.class, g.tenant_id FROM UNNEST($2::smallint[], $3::text[]) AS g(class, tenant_id) \
             WHERE pg_try_advisory_xact_lock(hashtextextended($1 || ':' || g.class || ':' || g.tenant_id, 0))",
        )
        .bind(&names.main)
        .bind(&classes)
        .bind(&tenants)
        .fetch_all(&mut *tx)
        .await?;
        let (classes, tenants): (Vec<i16>, Vec<String>) = locked.into_iter().unzip();
        sqlx::query(
            "DELETE FROM lane_turns t USING UNNEST($2::smallint[], $3::text[]) AS g(class, tenant_id) \
             WHERE t.queue = $1 AND t.class = g.class AND t.tenant_id = g.tenant_id \
             AND NOT EXISTS (SELECT 1 FROM lane_messages m WHERE m.queue = $1 \
                 AND m.class = g.class AND m.tenant_id = g.tenant_id)",
        )
        .bind(&names.main)
        .bind(&classes)
        .bind(&tenants)
        .execute(&mut *tx)
        .await?;
        tx.commit().await.context("dropping idle turns")?;
        Ok(())
    }
}

/// What [`TAKE`] did with a row.
enum Took {
    /// Leased: handed out.
    Leased(ReceivedMessage),
    /// Received `max_receive_count` times already: bound for the DLQ.
    Spent { seq: i64, receives: i64 },
}

/// A taken row as a received message, or a spent one.
fn received(names: &Names, row: Taken) -> anyhow::Result<Took> {
    let (
        seq,
        queue,
        tenant_id,
        message_id,
        channel,
        priority,
        body,
        enqueued_at,
        receive_count,
        receives,
        status,
    ) = row;
    if queue != names.main {
        return Ok(Took::Spent { seq, receives });
    }
    Ok(Took::Leased(ReceivedMessage {
        receipt: format!("{seq}:{receives}"),
        message_id,
        tenant_id,
        channel: channel.parse().map_err(anyhow::Error::msg)?,
        priority: priority.parse().map_err(anyhow::Error::msg)?,
        body,
        receive_count: u32::try_from(receive_count).unwrap_or(0),
        enqueued_at_ms: enqueued_at,
        status_at_receive: status.and_then(|word| word.parse().ok()),
        suppressed_at_receive: None,
        test: false,
    }))
}
