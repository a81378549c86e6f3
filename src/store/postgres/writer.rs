//! The group-committing writer of the PostgreSQL store: accepts (status
//! row, queue entry, idempotency record) and the delivery path's status
//! changes, many pieces per transaction of a few multi-row statements. An
//! accept's queue entry is an outbox row (SQS lanes) or, with the lanes in
//! PostgreSQL, its row in `lane_messages` (see `crate::queue::postgres`).

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use sqlx::postgres::PgPool;
use sqlx::{Postgres, Transaction};
use tokio::sync::{mpsc, oneshot};
use tracing::{Instrument, error, warn};

use super::PgDb;
use super::lanes::{LaneRows, insert_lane_rows};
use crate::model::now_ms;
use crate::store::AcceptEntry;
use crate::store::delivery::{BeforeSend, SendCheck};
use crate::store::lifecycle::{Failure, Move};
use crate::store::receipts::{Applied, Receipt};
use crate::store::streak::{FailureStreak, WriteFailed};

/// One piece of work for [`PgWriter`].
enum Piece {
    Accept {
        entries: Vec<AcceptEntry>,
        reply: oneshot::Sender<bool>,
    },
    /// Takes a message for sending: `scheduled`, `queued` or `retrying` (or `sending`
    /// since before `stale_before`, whose sender died) → `sending`; answers
    /// whether this instance got it.
    Claim {
        id: String,
        stale_before: i64,
        reply: oneshot::Sender<anyhow::Result<bool>>,
    },
    Sent {
        id: String,
        provider_message_id: String,
        provider: Option<String>,
        gate_wait_ms: Option<i64>,
        reply: oneshot::Sender<bool>,
    },
    Failure {
        id: String,
        /// Retry, dead letter, suppression or refusal.
        step: Move,
        error: String,
        counted: bool,
        provider: Option<String>,
        pinned: Option<bool>,
        reply: oneshot::Sender<anyhow::Result<u32>>,
    },
    /// A provider's receipt, recorded after the group's status changes.
    Receipt {
        /// Boxed: a receipt is the largest piece by far.
        receipt: Box<Receipt>,
        reply: oneshot::Sender<anyhow::Result<Applied>>,
    },
}

enum Command {
    Work(Piece),
    Stop,
}

/// The group-committing writer of the PostgreSQL store; cheap to clone.
#[derive(Clone)]
pub struct PgWriter {
    commands: mpsc::Sender<Command>,
    failures: FailureStreak,
    /// For the rare writes that need not wait for a group (cancels).
    pool: PgPool,
    /// Accepts go into the lanes' own table (`queue.backend =
    /// "postgres"`), not the outbox.
    into_lanes: Arc<AtomicBool>,
}

impl PgWriter {
    /// Starts the writer task; the receiver completes once it has stopped
    /// with everything it was given committed (see [`PgWriter::stop`]).
    pub fn spawn(db: &PgDb, max_group: usize) -> (PgWriter, oneshot::Receiver<()>) {
        let max_group = max_group.max(1);
        let (commands, receiver) = mpsc::channel(max_group * 8);
        let failures = FailureStreak::default();
        let (finished, done) = oneshot::channel();
        let into_lanes = Arc::new(AtomicBool::new(false));
        tokio::spawn(run(
            Sink {
                pool: db.pool.clone(),
                into_lanes: into_lanes.clone(),
            },
            receiver,
            max_group,
            failures.clone(),
            finished,
        ));
        (
            PgWriter {
                commands,
                failures,
                pool: db.pool.clone(),
                into_lanes,
            },
            done,
        )
    }

    /// Puts accepted messages into the lanes' table from now on, in the
    /// accept's own transaction, instead of the outbox.
    pub(crate) fn stage_into_lanes(&self) {
        self.into_lanes.store(true, Ordering::Relaxed);
    }

    /// The pool beside the writer, for what need not wait for a group.
    pub(super) fn pool(&self) -> &PgPool {
        &self.pool
    }

    async fn submit(&self, piece: Piece) {
        if let Err(mpsc::error::SendError(Command::Work(piece))) =
            self.commands.send(Command::Work(piece)).await
        {
            piece.fail("the store writer has stopped");
        }
    }

    /// Makes accepted messages durable (status rows, outbox rows and
    /// idempotency records), all or none; true once committed.
    pub async fn accept(&self, entries: Vec<AcceptEntry>) -> bool {
        let (reply, answer) = oneshot::channel();
        self.submit(Piece::Accept { entries, reply }).await;
        answer.await.unwrap_or(false)
    }

    /// Claims a message for sending, so that of several instances holding
    /// a copy only one calls the provider: true when this instance got it;
    /// false when another one is sending it (since `stale_before` or later)
    /// or it is no longer waiting to be sent. Returns once committed.
    pub async fn claim(&self, id: &str, stale_before: i64) -> anyhow::Result<bool> {
        let (reply, answer) = oneshot::channel();
        self.submit(Piece::Claim {
            id: id.to_owned(),
            stale_before,
            reply,
        })
        .await;
        answer
            .await
            .context("the store writer dropped a piece of work")?
    }

    /// Cancels those of `ids` (of `tenant_id`) still waiting to be sent,
    /// with their outbox rows; returns the ids cancelled. A row being
    /// claimed by a consumer at the same moment is locked, so one of the
    /// two waits and then finds the other's outcome.
    pub async fn cancel(
        &self,
        tenant_id: &str,
        test: Option<bool>,
        ids: &[String],
    ) -> anyhow::Result<Vec<String>> {
        let mut tx = self.pool.begin().await?;
        let now = now_ms();
        let cancelled = super::lifecycle::cancel(&mut tx, tenant_id, test, ids, now).await?;
        sqlx::query("DELETE FROM outbox WHERE message_id = ANY($1)")
            .bind(&cancelled)
            .execute(&mut *tx)
            .await?;
        if self.into_lanes.load(Ordering::Relaxed) {
            // Copies no consumer holds now; a held one is dropped by its
            // consumer, which finds the message cancelled.
            sqlx::query(
                "DELETE FROM lane_messages WHERE message_id = ANY($1) \
                 AND NOT (leased AND visible_at > $2)",
            )
            .bind(&cancelled)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(cancelled)
    }

    /// Records a successful send; returns once committed.
    pub async fn sent(
        &self,
        id: &str,
        provider_message_id: &str,
        provider: Option<&str>,
        gate_wait_ms: Option<i64>,
    ) -> anyhow::Result<()> {
        let (reply, answer) = oneshot::channel();
        self.submit(Piece::Sent {
            id: id.to_owned(),
            provider_message_id: provider_message_id.to_owned(),
            provider: provider.map(str::to_owned),
            gate_wait_ms,
            reply,
        })
        .await;
        match answer.await {
            Ok(true) => Ok(()),
            _ => anyhow::bail!("status change could not be committed"),
        }
    }

    /// Records a failed provider call; returns the attempts made so far.
    pub async fn failure(
        &self,
        id: &str,
        step: Move,
        error: &str,
        counted: bool,
        called: Option<crate::store::Called<'_>>,
    ) -> anyhow::Result<u32> {
        let (reply, answer) = oneshot::channel();
        self.submit(Piece::Failure {
            id: id.to_owned(),
            step,
            error: error.to_owned(),
            counted,
            provider: called.map(|called| called.provider.to_owned()),
            pinned: called.map(|called| called.pinned),
            reply,
        })
        .await;
        answer
            .await
            .context("the store writer dropped a piece of work")?
    }

    /// See [`crate::store::Writer::before_send`]: one statement on the pool
    /// beside the writer, in the order of `checks`.
    pub async fn before_send(&self, checks: &[SendCheck]) -> anyhow::Result<Vec<BeforeSend>> {
        let ids: Vec<&str> = checks.iter().map(|check| check.id.as_str()).collect();
        let tenants: Vec<&str> = checks
            .iter()
            .map(|check| check.tenant_id.as_str())
            .collect();
        let addresses: Vec<Option<&str>> = checks
            .iter()
            .map(|check| check.address.as_deref())
            .collect();
        let rows: Vec<(Option<String>, bool)> = sqlx::query_as(
            "SELECT m.status, EXISTS (SELECT 1 FROM suppressions s \
                 WHERE s.tenant_id = c.tenant_id AND s.address = c.address) \
             FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY \
                 AS c(id, tenant_id, address, n) \
             LEFT JOIN messages m ON m.id = c.id \
             ORDER BY c.n",
        )
        .bind(&ids)
        .bind(&tenants)
        .bind(&addresses)
        .fetch_all(&self.pool)
        .await?;
        anyhow::ensure!(
            rows.len() == checks.len(),
            "the look-up answered {} rows for {} messages",
            rows.len(),
            checks.len()
        );
        Ok(rows
            .into_iter()
            .map(|(status, suppressed)| BeforeSend {
                status: status.and_then(|word| word.parse().ok()),
                suppressed,
            })
            .collect())
    }

    /// The Retry-After to give when a write could not be made durable.
    pub fn retry_after(&self) -> Duration {
        self.failures.retry_after()
    }

    /// The writer's failure streak.
    pub fn failures(&self) -> &FailureStreak {
        &self.failures
    }

    /// Writes a row larger than any send and removes it in one
    /// transaction: whether a write would commit now.
    pub async fn probe(&self) -> anyhow::Result<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("INSERT INTO write_probe(filler) VALUES (decode(repeat('00', 262144), 'hex'))")
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM write_probe")
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        if self.failures.succeeded() > 0 {
            warn!("Store writes succeed again (a readiness probe committed).");
        }
        Ok(())
    }

    /// Records a provider's receipt (see `super::receipts::apply_group`) in the
    /// next group, so receipts at volume share commits instead of one
    /// transaction each; answers once it has committed.
    pub async fn apply_receipt(&self, receipt: Receipt) -> anyhow::Result<Applied> {
        let (reply, answer) = oneshot::channel();
        self.submit(Piece::Receipt {
            receipt: Box::new(receipt),
            reply,
        })
        .await;
        answer.await.context("the store writer dropped a receipt")?
    }

    /// Asks the writer to commit what it holds and stop; later work fails.
    pub async fn stop(&self) {
        let _ = self.commands.send(Command::Stop).await;
    }
}

impl Piece {
    fn fail(self, why: &str) {
        match self {
            Piece::Accept { reply, .. } | Piece::Sent { reply, .. } => {
                let _ = reply.send(false);
            }
            Piece::Failure { reply, .. } => {
                let _ = reply.send(Err(anyhow::anyhow!("{why}")));
            }
            Piece::Claim { reply, .. } => {
                let _ = reply.send(Err(anyhow::anyhow!("{why}")));
            }
            Piece::Receipt { reply, .. } => {
                let _ = reply.send(Err(anyhow::anyhow!("{why}")));
            }
        }
    }
}

/// Where a group is written: the pool, and where accepts are staged.
struct Sink {
    pool: PgPool,
    into_lanes: Arc<AtomicBool>,
}

async fn run(
    sink: Sink,
    mut receiver: mpsc::Receiver<Command>,
    max_group: usize,
    streak: FailureStreak,
    finished: oneshot::Sender<()>,
) {
    let mut commands = Vec::with_capacity(max_group);
    let mut stopping = false;
    while !stopping {
        if receiver.recv_many(&mut commands, max_group).await == 0 {
            break;
        }
        let mut group = Vec::with_capacity(commands.len());
        for command in commands.drain(..) {
            match command {
                Command::Work(piece) if !stopping => group.push(piece),
                Command::Work(piece) => piece.fail("the store writer has stopped"),
                Command::Stop => stopping = true,
            }
        }
        let span = crate::store::group_span(group.iter().flat_map(|piece| match piece {
            Piece::Accept { entries, .. } => entries.as_slice(),
            _ => &[],
        }));
        commit_group(&sink, group, &streak).instrument(span).await;
    }
    receiver.close();
    while let Some(command) = receiver.recv().await {
        if let Command::Work(piece) = command {
            piece.fail("the store writer has stopped");
        }
    }
    let _ = finished.send(());
}

/// Commits `group` in one transaction, or each piece alone if that fails,
/// and answers every piece.
async fn commit_group(sink: &Sink, group: Vec<Piece>, streak: &FailureStreak) {
    if group.is_empty() {
        return;
    }
    match write_pieces(sink, &group).await {
        Ok(Written {
            attempts,
            claimed,
            applied,
        }) => {
            let ended = streak.succeeded();
            if ended > 0 {
                warn!(failures = ended, "Store writes succeed again.");
            }
            answer(group, attempts, &claimed, applied);
        }
        Err(err) if group.len() == 1 => {
            let failures = streak.failed_because(&WriteFailed(format!("{err:#}").into()));
            // An unreachable server fails every write until it is back: say
            // so when it starts and now and then.
            if failures == 1 || failures.is_multiple_of(1000) {
                error!(error = %format!("{err:#}"), failures, "A store write failed; sends answer 503 until writes succeed.");
            }
            for piece in group {
                piece.fail(&format!("{err:#}"));
            }
        }
        Err(err) => {
            warn!(error = %format!("{err:#}"), pieces = group.len(), "A write group failed; trying its pieces one by one.");
            for piece in group {
                Box::pin(commit_group(sink, vec![piece], streak)).await;
            }
        }
    }
}

fn answer(
    group: Vec<Piece>,
    mut attempts: Vec<u32>,
    claimed: &HashSet<String>,
    mut applied: Vec<Applied>,
) {
    attempts.reverse();
    applied.reverse();
    for piece in group {
        match piece {
            Piece::Accept { reply, entries } => {
                if reply.send(true).is_err() {
                    let first = entries.first().map(|entry| entry.record.id.as_str());
                    warn!(
                        message_id = first.unwrap_or(""),
                        count = entries.len(),
                        "Caller went away before its messages were committed."
                    );
                }
            }
            Piece::Sent { reply, .. } => {
                let _ = reply.send(true);
            }
            Piece::Failure { reply, .. } => {
                let _ = reply.send(Ok(attempts.pop().unwrap_or(0)));
            }
            Piece::Claim { id, reply, .. } => {
                let _ = reply.send(Ok(claimed.contains(&id)));
            }
            Piece::Receipt { reply, .. } => {
                let _ =
                    reply.send(applied.pop().ok_or_else(|| {
                        anyhow::anyhow!("the write group lost a receipt's outcome")
                    }));
            }
        }
    }
}

/// What a committed group reports back.
struct Written {
    /// Attempts of each failure piece, in order.
    attempts: Vec<u32>,
    /// Ids the group's claims took.
    claimed: HashSet<String>,
    /// What each receipt piece did, in order.
    applied: Vec<Applied>,
}

/// Most accepted messages inserted by one statement.
const ACCEPT_ROWS: usize = 64;

/// Most messages one status statement changes.
const STATUS_ROWS: usize = 256;

/// Columns of the accepted messages of a group, one array each.
#[derive(Default)]
struct AcceptColumns {
    id: Vec<String>,
    tenant_id: Vec<String>,
    channel: Vec<String>,
    status: Vec<String>,
    priority: Vec<String>,
    lane: Vec<String>,
    attempts: Vec<i64>,
    reference: Vec<Option<String>>,
    metadata: Vec<Option<String>>,
    created_at: Vec<i64>,
    updated_at: Vec<i64>,
    send_at: Vec<Option<i64>>,
    test: Vec<bool>,
    fragments: Vec<Option<i64>>,
    recipient: Vec<Option<String>>,
    template_id: Vec<Option<String>>,
    template_version: Vec<Option<i64>>,
    attachment_bytes: Vec<Option<i64>>,
    /// The queue entries: lane rows, or (the same columns) outbox rows.
    queued: LaneRows,
    idem_tenant: Vec<String>,
    idem_key: Vec<String>,
    idem_hash: Vec<String>,
    idem_code: Vec<i64>,
    idem_body: Vec<String>,
    idem_message: Vec<String>,
    idem_created: Vec<i64>,
    idem_test: Vec<bool>,
    /// Of each idempotency record, the claim it answers (see
    /// [`crate::store::idempotency::KeyClaim`]), `None` for a plain insert.
    idem_claim: Vec<Option<String>>,
}

impl AcceptColumns {
    fn of(entries: &[&AcceptEntry]) -> AcceptColumns {
        let mut columns = AcceptColumns::default();
        for entry in entries {
            let record = &entry.record;
            columns.id.push(record.id.clone());
            columns.tenant_id.push(record.tenant_id.clone());
            columns.channel.push(record.channel.as_str().to_owned());
            columns.status.push(record.status.as_str().to_owned());
            columns.priority.push(record.priority.as_str().to_owned());
            columns.lane.push(entry.lane.as_str().to_owned());
            columns.attempts.push(i64::from(record.attempts));
            columns.reference.push(record.reference.clone());
            columns.metadata.push(record.metadata.clone());
            columns.created_at.push(record.created_at);
            columns.updated_at.push(record.updated_at);
            columns.send_at.push(record.send_at);
            columns.test.push(record.test);
            columns.fragments.push(record.fragments.map(i64::from));
            columns.recipient.push(record.recipient.clone());
            columns.template_id.push(record.template_id.clone());
            columns
                .template_version
                .push(record.template_version.map(i64::from));
            columns.attachment_bytes.push(record.attachment_bytes);
            columns.queued.push(entry.lane, &entry.outbound);
            for stored in &entry.idempotency {
                columns.idem_tenant.push(stored.tenant_id.clone());
                columns.idem_key.push(stored.key.clone());
                columns.idem_hash.push(stored.request_hash.clone());
                columns.idem_code.push(i64::from(stored.status_code));
                columns.idem_body.push(stored.response_body.clone());
                columns.idem_message.push(stored.message_id.clone());
                columns.idem_created.push(stored.created_at);
                columns.idem_test.push(stored.test);
                columns.idem_claim.push(stored.claimed_as.clone());
            }
        }
        columns
    }
}

/// Writes the group in one transaction.
async fn write_pieces(sink: &Sink, group: &[Piece]) -> anyhow::Result<Written> {
    let mut accepted: Vec<&AcceptEntry> = Vec::new();
    let (mut claim_ids, mut claim_stale) = (Vec::new(), Vec::new());
    let (mut sent_ids, mut sent_provider_ids) = (Vec::new(), Vec::new());
    let mut sent_by: Vec<Option<String>> = Vec::new();
    let mut sent_waits: Vec<Option<i64>> = Vec::new();
    for piece in group {
        match piece {
            Piece::Accept { entries, .. } => accepted.extend(entries),
            Piece::Sent {
                id,
                provider_message_id,
                provider,
                gate_wait_ms,
                ..
            } => {
                sent_ids.push(id.clone());
                sent_provider_ids.push(provider_message_id.clone());
                sent_by.push(provider.clone());
                sent_waits.push(*gate_wait_ms);
            }
            Piece::Claim {
                id, stale_before, ..
            } => {
                claim_ids.push(id.clone());
                claim_stale.push(*stale_before);
            }
            Piece::Failure { .. } | Piece::Receipt { .. } => {}
        }
    }
    let now = now_ms();
    let into_lanes = sink.into_lanes.load(Ordering::Relaxed);
    let mut tx = sink.pool.begin().await?;
    // Statements of at most ACCEPT_ROWS rows each: one large bind message
    // per group stalled on the socket (sqlx leaves Nagle's algorithm on,
    // and a message of a few hundred rows waited on delayed ACKs: 1,400
    // accepts/s at 128 concurrent against 25,000 with 64).
    for chunk in accepted.chunks(ACCEPT_ROWS) {
        insert_accepts(&mut tx, &AcceptColumns::of(chunk), into_lanes, now).await?;
    }
    let mut claimed = HashSet::new();
    // Status changes in statements of at most STATUS_ROWS ids, for the
    // same reason as the inserts above.
    for (ids, stale) in claim_ids
        .chunks(STATUS_ROWS)
        .zip(claim_stale.chunks(STATUS_ROWS))
    {
        let taken = super::lifecycle::claim(&mut tx, ids, stale, now).await?;
        claimed.extend(taken);
    }
    for (((ids, provider_ids), by), waits) in sent_ids
        .chunks(STATUS_ROWS)
        .zip(sent_provider_ids.chunks(STATUS_ROWS))
        .zip(sent_by.chunks(STATUS_ROWS))
        .zip(sent_waits.chunks(STATUS_ROWS))
    {
        super::lifecycle::sent(&mut tx, ids, provider_ids, by, waits, now).await?;
    }
    let mut attempts = Vec::new();
    for piece in group {
        if let Piece::Failure {
            id,
            step,
            error,
            counted,
            provider,
            pinned,
            ..
        } = piece
        {
            let failure = Failure {
                step: *step,
                error: Some(error),
                counted: *counted,
                provider: provider.as_deref(),
                pinned: *pinned,
            };
            let made = super::lifecycle::fail(&mut tx, id, &failure, now).await?;
            attempts.push(made.unwrap_or(0).max(0) as u32);
        }
    }
    // Receipts last: one for a message sent in this group sees it `sent`.
    let group_receipts: Vec<&Receipt> = group
        .iter()
        .filter_map(|piece| match piece {
            Piece::Receipt { receipt, .. } => Some(&**receipt),
            _ => None,
        })
        .collect();
    let applied = super::receipts::apply_group(&mut tx, &group_receipts, now).await?;
    tx.commit().await?;
    Ok(Written {
        attempts,
        claimed,
        applied,
    })
}

/// The status rows, queue entries (outbox rows, or lane rows) and
/// idempotency records of a group's accepts: three statements whatever the
/// group's size.
async fn insert_accepts(
    tx: &mut Transaction<'static, Postgres>,
    rows: &AcceptColumns,
    into_lanes: bool,
    now: i64,
) -> anyhow::Result<()> {
    sqlx::query(super::lifecycle::ACCEPT)
        .bind(&rows.id)
        .bind(&rows.tenant_id)
        .bind(&rows.channel)
        .bind(&rows.status)
        .bind(&rows.priority)
        .bind(&rows.lane)
        .bind(&rows.attempts)
        .bind(&rows.reference)
        .bind(&rows.metadata)
        .bind(&rows.created_at)
        .bind(&rows.updated_at)
        .bind(&rows.send_at)
        .bind(&rows.test)
        .bind(&rows.fragments)
        .bind(&rows.recipient)
        .bind(&rows.template_id)
        .bind(&rows.template_version)
        .bind(&rows.attachment_bytes)
        .execute(&mut **tx)
        .await
        .context("inserting status rows")?;
    if into_lanes {
        insert_lane_rows(tx, &rows.queued, now).await?;
    } else {
        sqlx::query(
            "INSERT INTO outbox (message_id, lane, tenant_id, channel, priority, body, created_at, due_at) \
             SELECT u.id, u.lane, u.tenant_id, u.channel, u.priority, u.body, $7, u.due_at \
             FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], \
             $8::bigint[]) AS u(id, lane, tenant_id, channel, priority, body, due_at)",
        )
        .bind(&rows.id)
        .bind(&rows.lane)
        .bind(&rows.tenant_id)
        .bind(&rows.channel)
        .bind(&rows.priority)
        .bind(&rows.queued.body)
        .bind(now)
        .bind(&rows.send_at)
        .execute(&mut **tx)
        .await
        .context("inserting outbox rows")?;
    }
    let (claimed, plain): (Vec<usize>, Vec<usize>) =
        (0..rows.idem_key.len()).partition(|&at| rows.idem_claim[at].is_some());
    if !claimed.is_empty() {
        answer_claims(tx, rows, &claimed).await?;
    }
    if !plain.is_empty() {
        // An expired answer under the same key is replaced, as on SQLite.
        sqlx::query(
            "INSERT INTO idempotency_keys (tenant_id, key, request_hash, status_code, \
             response_body, message_id, created_at, test) \
             SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[], \
             $6::text[], $7::bigint[], $8::boolean[]) \
             ON CONFLICT (tenant_id, test, key) DO UPDATE SET request_hash = excluded.request_hash, \
             status_code = excluded.status_code, response_body = excluded.response_body, \
             message_id = excluded.message_id, created_at = excluded.created_at",
        )
        .bind(pick(&rows.idem_tenant, &plain))
        .bind(pick(&rows.idem_key, &plain))
        .bind(pick(&rows.idem_hash, &plain))
        .bind(pick(&rows.idem_code, &plain))
        .bind(pick(&rows.idem_body, &plain))
        .bind(pick(&rows.idem_message, &plain))
        .bind(pick(&rows.idem_created, &plain))
        .bind(pick(&rows.idem_test, &plain))
        .execute(&mut **tx)
        .await
        .context("inserting idempotency records")?;
    }
    Ok(())
}

/// The items of `all` at the indices `at`, in their order.
fn pick<T: Clone>(all: &[T], at: &[usize]) -> Vec<T> {
    at.iter().map(|&i| all[i].clone()).collect()
}

/// Writes the answers of claimed keys over their claims, in the accept's
/// transaction; fails (and with it the whole transaction, so nothing of
/// these messages is written) when a claim is no longer the one this
/// accept made: it went stale and a retry under the same key took it over,
/// so the retry's message is the key's, and this one must not exist.
async fn answer_claims(
    tx: &mut Transaction<'static, Postgres>,
    rows: &AcceptColumns,
    claimed: &[usize],
) -> anyhow::Result<()> {
    let tokens: Vec<String> = claimed
        .iter()
        .map(|&at| rows.idem_claim[at].clone().unwrap_or_default())
        .collect();
    let answered = sqlx::query(
        "UPDATE idempotency_keys AS k SET request_hash = u.hash, status_code = u.code, \
         response_body = u.body, message_id = u.message, created_at = u.created \
         FROM UNNEST($1::text[], $2::text[], $3::boolean[], $4::text[], $5::text[], \
         $6::bigint[], $7::text[], $8::text[], $9::bigint[]) \
         AS u(tenant_id, key, test, token, hash, code, body, message, created) \
         WHERE k.tenant_id = u.tenant_id AND k.key = u.key AND k.test = u.test \
         AND k.message_id = u.token AND k.status_code = 0",
    )
    .bind(pick(&rows.idem_tenant, claimed))
    .bind(pick(&rows.idem_key, claimed))
    .bind(pick(&rows.idem_test, claimed))
    .bind(&tokens)
    .bind(pick(&rows.idem_hash, claimed))
    .bind(pick(&rows.idem_code, claimed))
    .bind(pick(&rows.idem_body, claimed))
    .bind(pick(&rows.idem_message, claimed))
    .bind(pick(&rows.idem_created, claimed))
    .execute(&mut **tx)
    .await
    .context("answering claimed idempotency keys")?;
    let expected = claimed.len() as u64;
    if answered.rows_affected() != expected {
        anyhow::bail!(
            "{} of {expected} claimed Idempotency-Keys are no longer this accept's \
             (a retry took a stale claim over); nothing of it is written",
            expected - answered.rows_affected()
        );
    }
    Ok(())
}
