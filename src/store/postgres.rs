//! The PostgreSQL store: the state of several instances in one database.
//!
//! Tables and columns are those of the SQLite store (`migrations/postgres`
//! mirrors `migrations/sqlite`), so rare reads and writes share their SQL
//! with it (see [`super::on_pool!`]). What differs lives here:
//!
//! - **The hot writes** (accepts with their outbox row and idempotency
//!   record; the `sending`, `sent` and failure status changes) go through
//!   [`PgWriter`], a task that takes everything waiting and commits it in
//!   one transaction of a few multi-row statements (`UNNEST` of arrays), so
//!   a busy instance makes one commit per group, not per message. As on
//!   SQLite, each piece is answered only after its group committed; if the
//!   group fails, each piece is tried again alone, so one bad piece fails by
//!   itself.
//! - **Changes reach every instance**: a registry change sends
//!   `NOTIFY fairlane_registry`; every instance listens and reloads its
//!   cache (see [`crate::tenants::Registry::follow`]).
//! - **Work that must run once** takes a transaction-scoped advisory lock
//!   ([`try_lock`]) or claims rows with `FOR UPDATE SKIP LOCKED`.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::Context;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Postgres, Transaction};
use tokio::sync::{mpsc, oneshot};
use tracing::{error, warn};

use crate::accept::AcceptEntry;
use crate::model::{MessageStatus, now_ms};
use crate::store::writer::{FailureStreak, WriteFailed};

/// The channel registry changes are announced on.
pub const REGISTRY_CHANNEL: &str = "fairlane_registry";

/// Longest wait for a pooled connection before a query fails.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// Connections per instance: the writer's, the listener's, and readers.
const MAX_CONNECTIONS: u32 = 16;

/// Handle to the database; cheap to clone.
#[derive(Clone, Debug)]
pub struct PgDb {
    pub pool: PgPool,
    /// The URL, for the listener's own connection.
    url: String,
}

impl PgDb {
    /// Connects to `url` and runs the migrations (under sqlx's advisory
    /// lock, so instances starting together migrate once).
    pub async fn connect(url: &str) -> anyhow::Result<PgDb> {
        let options: PgConnectOptions = url
            .parse()
            .with_context(|| format!("storage.url {:?} is not a PostgreSQL URL", redact(url)))?;
        let pool = PgPoolOptions::new()
            .max_connections(MAX_CONNECTIONS)
            .min_connections(2)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_with(options.application_name("fairlane"))
            .await
            .with_context(|| format!("connecting to PostgreSQL at {}", redact(url)))?;
        sqlx::migrate!("./migrations/postgres")
            .run(&pool)
            .await
            .context("migrating the PostgreSQL database")?;
        Ok(PgDb {
            pool,
            url: url.to_owned(),
        })
    }

    pub async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }

    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// A listener on its own connection, subscribed to `channel`.
    pub async fn listen(&self, channel: &str) -> anyhow::Result<sqlx::postgres::PgListener> {
        let mut listener = sqlx::postgres::PgListener::connect(&self.url)
            .await
            .context("connecting the PostgreSQL listener")?;
        listener.listen(channel).await?;
        Ok(listener)
    }
}

/// `url` with any password replaced, for messages.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    match rest.split_once('@') {
        Some((credentials, host)) if credentials.contains(':') => {
            let user = credentials.split(':').next().unwrap_or("");
            format!("{scheme}://{user}:***@{host}")
        }
        _ => url.to_owned(),
    }
}

/// A transaction holding the advisory lock `key`, unless another instance
/// holds it now (`None`): the caller does its once-only work in it and
/// commits. The lock ends with the transaction, so a crashed holder never
/// keeps it.
pub async fn try_lock(
    db: &PgDb,
    key: i64,
) -> anyhow::Result<Option<Transaction<'static, Postgres>>> {
    let mut tx = db.pool.begin().await?;
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
        .bind(key)
        .fetch_one(&mut *tx)
        .await?;
    Ok(locked.then_some(tx))
}

/// Advisory lock keys of the jobs that run on one instance at a time.
pub mod locks {
    /// The outbox sweeper.
    pub const OUTBOX_SWEEP: i64 = 0x6661_6972_0001;
    /// Expiry of idempotency keys.
    pub const IDEMPOTENCY_PURGE: i64 = 0x6661_6972_0002;
}

/// One piece of work for [`PgWriter`].
enum Piece {
    Accept {
        entries: Vec<AcceptEntry>,
        reply: oneshot::Sender<bool>,
    },
    Sending {
        id: String,
        /// When the change was asked for (ms): an outcome written since wins.
        at: i64,
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
        reply: oneshot::Sender<bool>,
    },
    Failure {
        id: String,
        status: MessageStatus,
        error: String,
        counted: bool,
        reply: oneshot::Sender<anyhow::Result<u32>>,
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
}

impl PgWriter {
    /// Starts the writer task; the receiver completes once it has stopped
    /// with everything it was given committed (see [`PgWriter::stop`]).
    pub fn spawn(db: &PgDb, max_group: usize) -> (PgWriter, oneshot::Receiver<()>) {
        let max_group = max_group.max(1);
        let (commands, receiver) = mpsc::channel(max_group * 8);
        let failures = FailureStreak::default();
        let (finished, done) = oneshot::channel();
        tokio::spawn(run(
            db.pool.clone(),
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
            },
            done,
        )
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

    /// Marks a message `sending` without waiting (see
    /// [`crate::store::status::StatusWriter::sending`]).
    pub async fn sending(&self, id: &str) {
        self.submit(Piece::Sending {
            id: id.to_owned(),
            at: now_ms(),
        })
        .await;
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
    pub async fn cancel(&self, tenant_id: &str, ids: &[String]) -> anyhow::Result<Vec<String>> {
        let mut tx = self.pool.begin().await?;
        let cancelled: Vec<String> = sqlx::query_scalar(
            "UPDATE messages SET status = 'cancelled', updated_at = $1 \
             WHERE tenant_id = $2 AND id = ANY($3) AND status IN ('scheduled', 'queued', 'retrying') \
             RETURNING id",
        )
        .bind(now_ms())
        .bind(tenant_id)
        .bind(ids)
        .fetch_all(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM outbox WHERE message_id = ANY($1)")
            .bind(&cancelled)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(cancelled)
    }

    /// Records a successful send; returns once committed.
    pub async fn sent(&self, id: &str, provider_message_id: &str) -> anyhow::Result<()> {
        let (reply, answer) = oneshot::channel();
        self.submit(Piece::Sent {
            id: id.to_owned(),
            provider_message_id: provider_message_id.to_owned(),
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
        status: MessageStatus,
        error: &str,
        counted: bool,
    ) -> anyhow::Result<u32> {
        let (reply, answer) = oneshot::channel();
        self.submit(Piece::Failure {
            id: id.to_owned(),
            status,
            error: error.to_owned(),
            counted,
            reply,
        })
        .await;
        answer
            .await
            .context("the store writer dropped a piece of work")?
    }

    /// The pool beside the writer, for reads on the delivery path.
    pub fn pool(&self) -> &PgPool {
        &self.pool
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
            Piece::Sending { .. } => {}
            Piece::Failure { reply, .. } => {
                let _ = reply.send(Err(anyhow::anyhow!("{why}")));
            }
            Piece::Claim { reply, .. } => {
                let _ = reply.send(Err(anyhow::anyhow!("{why}")));
            }
        }
    }
}

async fn run(
    pool: PgPool,
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
        commit_group(&pool, group, &streak).await;
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
async fn commit_group(pool: &PgPool, group: Vec<Piece>, streak: &FailureStreak) {
    if group.is_empty() {
        return;
    }
    match write_pieces(pool, &group).await {
        Ok(Written { attempts, claimed }) => {
            let ended = streak.succeeded();
            if ended > 0 {
                warn!(failures = ended, "Store writes succeed again.");
            }
            answer(group, attempts, &claimed);
        }
        Err(err) if group.len() == 1 => {
            let failures = streak.failed_because(&WriteFailed(format!("{err:#}").into()));
            // An unreachable server fails every write until it is back: say
            // so when it starts and now and then.
            if failures == 1 || failures % 1000 == 0 {
                error!(error = %format!("{err:#}"), failures, "A store write failed; sends answer 503 until writes succeed.");
            }
            for piece in group {
                piece.fail(&format!("{err:#}"));
            }
        }
        Err(err) => {
            warn!(error = %format!("{err:#}"), pieces = group.len(), "A write group failed; trying its pieces one by one.");
            for piece in group {
                Box::pin(commit_group(pool, vec![piece], streak)).await;
            }
        }
    }
}

fn answer(group: Vec<Piece>, mut attempts: Vec<u32>, claimed: &HashSet<String>) {
    attempts.reverse();
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
            Piece::Sending { .. } => {}
            Piece::Sent { reply, .. } => {
                let _ = reply.send(true);
            }
            Piece::Failure { reply, .. } => {
                let _ = reply.send(Ok(attempts.pop().unwrap_or(0)));
            }
            Piece::Claim { id, reply, .. } => {
                let _ = reply.send(Ok(claimed.contains(&id)));
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
    body: Vec<String>,
    idem_tenant: Vec<String>,
    idem_key: Vec<String>,
    idem_hash: Vec<String>,
    idem_code: Vec<i64>,
    idem_body: Vec<String>,
    idem_message: Vec<String>,
    idem_created: Vec<i64>,
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
            columns.body.push(entry.outbound.body.clone());
            for stored in &entry.idempotency {
                columns.idem_tenant.push(stored.tenant_id.clone());
                columns.idem_key.push(stored.key.clone());
                columns.idem_hash.push(stored.request_hash.clone());
                columns.idem_code.push(i64::from(stored.status_code));
                columns.idem_body.push(stored.response_body.clone());
                columns.idem_message.push(stored.message_id.clone());
                columns.idem_created.push(stored.created_at);
            }
        }
        columns
    }
}

/// Writes the group in one transaction.
async fn write_pieces(pool: &PgPool, group: &[Piece]) -> anyhow::Result<Written> {
    let mut accepted: Vec<&AcceptEntry> = Vec::new();
    let (mut claim_ids, mut claim_stale) = (Vec::new(), Vec::new());
    let (mut sending_ids, mut sending_at) = (Vec::new(), Vec::new());
    let (mut sent_ids, mut sent_provider_ids) = (Vec::new(), Vec::new());
    for piece in group {
        match piece {
            Piece::Accept { entries, .. } => accepted.extend(entries),
            Piece::Sending { id, at } => {
                sending_ids.push(id.clone());
                sending_at.push(*at);
            }
            Piece::Sent {
                id,
                provider_message_id,
                ..
            } => {
                sent_ids.push(id.clone());
                sent_provider_ids.push(provider_message_id.clone());
            }
            Piece::Claim {
                id, stale_before, ..
            } => {
                claim_ids.push(id.clone());
                claim_stale.push(*stale_before);
            }
            Piece::Failure { .. } => {}
        }
    }
    let now = now_ms();
    let mut tx = pool.begin().await?;
    // Statements of at most ACCEPT_ROWS rows each: one large bind message
    // per group stalled on the socket (sqlx leaves Nagle's algorithm on,
    // and a message of a few hundred rows waited on delayed ACKs: 1,400
    // accepts/s at 128 concurrent against 25,000 with 64).
    for chunk in accepted.chunks(ACCEPT_ROWS) {
        insert_accepts(&mut tx, &AcceptColumns::of(chunk), now).await?;
    }
    let mut claimed = HashSet::new();
    // Status changes in statements of at most STATUS_ROWS ids, for the
    // same reason as the inserts above.
    for (ids, stale) in claim_ids
        .chunks(STATUS_ROWS)
        .zip(claim_stale.chunks(STATUS_ROWS))
    {
        // A row locked by another instance's claim waits for it, then is
        // re-checked: two instances never both see their claim succeed.
        let taken: Vec<String> = sqlx::query_scalar(
            "UPDATE messages AS m SET status = 'sending', updated_at = $1 \
             FROM UNNEST($2::text[], $3::bigint[]) AS u(id, stale_before) \
             WHERE m.id = u.id AND (m.status IN ('scheduled', 'queued', 'retrying') \
             OR (m.status = 'sending' AND m.updated_at < u.stale_before)) RETURNING m.id",
        )
        .bind(now)
        .bind(ids)
        .bind(stale)
        .fetch_all(&mut *tx)
        .await?;
        claimed.extend(taken);
    }
    for (ids, at) in sending_ids
        .chunks(STATUS_ROWS)
        .zip(sending_at.chunks(STATUS_ROWS))
    {
        sqlx::query(
            "UPDATE messages AS m SET status = 'sending', updated_at = $1 \
             FROM UNNEST($2::text[], $3::bigint[]) AS u(id, at) \
             WHERE m.id = u.id AND m.status IN ('queued', 'retrying') AND m.updated_at <= u.at",
        )
        .bind(now)
        .bind(ids)
        .bind(at)
        .execute(&mut *tx)
        .await?;
    }
    for (ids, provider_ids) in sent_ids
        .chunks(STATUS_ROWS)
        .zip(sent_provider_ids.chunks(STATUS_ROWS))
    {
        sqlx::query(
            "UPDATE messages AS m SET status = 'sent', attempts = m.attempts + 1, last_error = NULL, \
             sent_at = $1, updated_at = $1, provider_message_id = u.provider_id \
             FROM UNNEST($2::text[], $3::text[]) AS u(id, provider_id) WHERE m.id = u.id",
        )
        .bind(now)
        .bind(ids)
        .bind(provider_ids)
        .execute(&mut *tx)
        .await?;
    }
    let mut attempts = Vec::new();
    for piece in group {
        if let Piece::Failure {
            id,
            status,
            error,
            counted,
            ..
        } = piece
        {
            let made: Option<i64> = sqlx::query_scalar(
                "UPDATE messages SET status = $1, attempts = attempts + $2, last_error = $3, \
                 updated_at = $4 WHERE id = $5 RETURNING attempts",
            )
            .bind(status.as_str())
            .bind(i64::from(*counted))
            .bind(error)
            .bind(now)
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
            attempts.push(made.unwrap_or(0).max(0) as u32);
        }
    }
    tx.commit().await?;
    Ok(Written { attempts, claimed })
}

/// The status rows, outbox rows and idempotency records of a group's
/// accepts: three statements whatever the group's size.
async fn insert_accepts(
    tx: &mut Transaction<'static, Postgres>,
    rows: &AcceptColumns,
    now: i64,
) -> anyhow::Result<()> {
    sqlx::query(
        "INSERT INTO messages (id, tenant_id, channel, status, priority, lane, attempts, reference, \
         metadata, created_at, updated_at, send_at) \
         SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], \
         $6::text[], $7::bigint[], $8::text[], $9::text[], $10::bigint[], $11::bigint[], $12::bigint[])",
    )
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
    .execute(&mut **tx)
    .await
    .context("inserting status rows")?;
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
    .bind(&rows.body)
    .bind(now)
    .bind(&rows.send_at)
    .execute(&mut **tx)
    .await
    .context("inserting outbox rows")?;
    if !rows.idem_key.is_empty() {
        // An expired answer under the same key is replaced, as on SQLite.
        sqlx::query(
            "INSERT INTO idempotency_keys (tenant_id, key, request_hash, status_code, \
             response_body, message_id, created_at) \
             SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[], \
             $6::text[], $7::bigint[]) \
             ON CONFLICT (tenant_id, key) DO UPDATE SET request_hash = excluded.request_hash, \
             status_code = excluded.status_code, response_body = excluded.response_body, \
             message_id = excluded.message_id, created_at = excluded.created_at",
        )
        .bind(&rows.idem_tenant)
        .bind(&rows.idem_key)
        .bind(&rows.idem_hash)
        .bind(&rows.idem_code)
        .bind(&rows.idem_body)
        .bind(&rows.idem_message)
        .bind(&rows.idem_created)
        .execute(&mut **tx)
        .await
        .context("inserting idempotency records")?;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    //! Against the PostgreSQL `crate::test_servers` finds or starts
    //! (`FAIRLANE_TEST_PG_URL`, default 5432): each test makes a
    //! database of its own and drops it at the end, even when it fails.

    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use sqlx::{Connection, Executor, PgConnection};

    use super::*;
    use crate::accept::{AcceptEntry, AcceptWriter};
    use crate::model::{Channel, Lane, Priority};
    use crate::queue::OutboundMessage;
    use crate::store::idempotency::{self, StoredResponse};
    use crate::store::messages::{self, MessageRecord};
    use crate::store::{Db, status::StatusWriter};

    /// A database of the test's own, dropped with this value.
    pub(crate) struct TestDatabase {
        pub url: String,
        server: String,
        name: String,
    }

    impl TestDatabase {
        pub(crate) async fn create() -> TestDatabase {
            let server = crate::test_servers::pg_url();
            let mut admin = PgConnection::connect(&server).await.unwrap_or_else(|err| {
                panic!(
                    "no PostgreSQL answers at {server} (FAIRLANE_TEST_PG_URL): these tests need a real \
                     PostgreSQL server: {err}"
                )
            });
            let name = format!("fairlane_test_{}", crate::tenants::random_hex(6));
            admin
                .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
                .await
                .expect("create the test database");
            let (base, _) = server.rsplit_once('/').expect("a database URL");
            TestDatabase {
                url: format!("{base}/{name}"),
                server,
                name,
            }
        }

        pub(crate) async fn open(&self) -> Db {
            Db::Postgres(PgDb::connect(&self.url).await.expect("connect and migrate"))
        }
    }

    impl Drop for TestDatabase {
        fn drop(&mut self) {
            let (server, name) = (self.server.clone(), self.name.clone());
            // A thread of its own: Drop may run inside a runtime.
            let dropped = std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                runtime.block_on(async {
                    let mut admin = PgConnection::connect(&server).await?;
                    admin
                        .execute(sqlx::AssertSqlSafe(format!(
                            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                        )))
                        .await?;
                    anyhow::Ok(())
                })
            })
            .join();
            if !matches!(dropped, Ok(Ok(()))) {
                eprintln!("could not drop test database {}", self.name);
            }
        }
    }

    fn entry(id: &str, tenant: &str, key: Option<&str>) -> AcceptEntry {
        let now = now_ms();
        AcceptEntry {
            lane: Lane::Fast,
            record: MessageRecord {
                id: id.into(),
                tenant_id: tenant.into(),
                channel: Channel::Sms,
                status: MessageStatus::Queued,
                priority: Priority::Normal,
                lane: Lane::Fast,
                attempts: 0,
                reference: Some(format!("ref-{id}")),
                metadata: None,
                created_at: now,
                updated_at: now,
                sent_at: None,
                last_error: None,
                provider_message_id: None,
                send_at: None,
            },
            outbound: OutboundMessage {
                message_id: id.into(),
                tenant_id: tenant.into(),
                channel: Channel::Sms,
                priority: Priority::Normal,
                body: format!("{{\"id\":\"{id}\"}}"),
                delay: Duration::ZERO,
            },
            idempotency: Vec::from_iter(key.map(|key| StoredResponse {
                tenant_id: tenant.into(),
                key: key.into(),
                request_hash: "h".into(),
                status_code: 202,
                response_body: "{}".into(),
                message_id: id.into(),
                created_at: now,
            })),
        }
    }

    async fn count(db: &Db, sql: &str) -> i64 {
        let pg = db.postgres().unwrap();
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_one(&pg.pool)
            .await
            .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn accepts_and_status_changes_commit_in_groups_and_read_back() {
        let database = TestDatabase::create().await;
        let db = database.open().await;
        let (writer, done) = PgWriter::spawn(db.postgres().unwrap(), 64);
        let accept = Arc::new(AcceptWriter::Postgres(writer.clone()));
        let tasks: Vec<_> = (0..200)
            .map(|i| {
                let accept = accept.clone();
                tokio::spawn(async move {
                    let key = (i % 2 == 0).then(|| format!("key-{i}"));
                    accept
                        .accept(entry(&format!("m{i}"), "acme", key.as_deref()))
                        .await
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap().expect("accepted");
        }
        assert_eq!(count(&db, "SELECT COUNT(*) FROM messages").await, 200);
        assert_eq!(count(&db, "SELECT COUNT(*) FROM outbox").await, 200);
        assert_eq!(
            count(&db, "SELECT COUNT(*) FROM idempotency_keys").await,
            100
        );
        let remembered = idempotency::lookup(&db, "acme", "key-4", now_ms())
            .await
            .unwrap()
            .expect("remembered");
        assert_eq!(remembered.message_id, "m4");

        let status = StatusWriter::postgres(writer.clone());
        status.sending("m1").await;
        status.sent("m1", "SM1").await.unwrap();
        status.sending("m1").await; // late: never overwrites `sent`
        let attempts = status
            .failure("m2", MessageStatus::Retrying, "503 from provider", true)
            .await
            .unwrap();
        assert_eq!(attempts, 1);
        let unknown = status
            .failure("nope", MessageStatus::Retrying, "x", true)
            .await
            .unwrap();
        assert_eq!(unknown, 0, "an unknown id changes nothing");
        writer.stop().await;
        done.await.unwrap();
        assert!(accept.accept(entry("late", "acme", None)).await.is_err());

        let sent = messages::get(&db, "m1").await.unwrap().unwrap();
        assert_eq!(sent.status, MessageStatus::Sent);
        assert_eq!(sent.attempts, 1);
        assert_eq!(sent.provider_message_id.as_deref(), Some("SM1"));
        let retrying = messages::get_for_tenant(&db, "acme", "m2")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(retrying.status, MessageStatus::Retrying);
        assert_eq!(retrying.last_error.as_deref(), Some("503 from provider"));
        assert!(
            messages::get_for_tenant(&db, "other", "m2")
                .await
                .unwrap()
                .is_none()
        );
        let many = messages::get_many(&db, &["m3".into(), "m5".into(), "zz".into()])
            .await
            .unwrap();
        assert_eq!(many.len(), 2);
        assert_eq!(messages::count_since(&db, "acme", 0).await.unwrap(), 200);
        db.close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bad_piece_fails_alone_and_the_rest_of_its_group_commits() {
        let database = TestDatabase::create().await;
        let db = database.open().await;
        let (writer, _done) = PgWriter::spawn(db.postgres().unwrap(), 64);
        // Submitted together, so they share a group; "dup" twice breaks the
        // primary key.
        let (a, d1, d2, c) = tokio::join!(
            writer.accept(vec![entry("a", "t", None)]),
            writer.accept(vec![entry("dup", "t", None)]),
            writer.accept(vec![entry("dup", "t", None)]),
            writer.accept(vec![entry("c", "t", None)]),
        );
        assert!(a && c);
        assert!(d1 != d2, "exactly one of the two copies commits");
        assert_eq!(count(&db, "SELECT COUNT(*) FROM messages").await, 3);
        assert_eq!(count(&db, "SELECT COUNT(*) FROM outbox").await, 3);
        db.close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn of_two_instances_claiming_one_message_exactly_one_gets_it() {
        let database = TestDatabase::create().await;
        let (one, two) = (database.open().await, database.open().await);
        let (first, _) = PgWriter::spawn(one.postgres().unwrap(), 64);
        let (second, _) = PgWriter::spawn(two.postgres().unwrap(), 64);
        for i in 0..50 {
            assert!(first.accept(vec![entry(&format!("m{i}"), "t", None)]).await);
        }
        let stale_before = now_ms() - 60_000;
        let claims: Vec<_> = (0..50)
            .map(|i| {
                let (first, second) = (first.clone(), second.clone());
                tokio::spawn(async move {
                    let id = format!("m{i}");
                    let (a, b) = tokio::join!(
                        first.claim(&id, stale_before),
                        second.claim(&id, stale_before)
                    );
                    (a.unwrap(), b.unwrap())
                })
            })
            .collect();
        for claim in claims {
            let (a, b) = claim.await.unwrap();
            assert!(a != b, "exactly one of the two claims succeeds ({a}, {b})");
        }
        // A sent message is claimed by nobody; a claim older than
        // `stale_before` (its sender died) is taken over.
        first.sent("m0", "SM0").await.unwrap();
        assert!(!second.claim("m0", now_ms() + 1).await.unwrap());
        assert!(!second.claim("m1", now_ms() - 60_000).await.unwrap());
        assert!(second.claim("m1", now_ms() + 1).await.unwrap());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_run_once_lock_is_held_by_one_instance_at_a_time() {
        let database = TestDatabase::create().await;
        let (first, second) = (database.open().await, database.open().await);
        let (first, second) = (first.postgres().unwrap(), second.postgres().unwrap());
        let held = try_lock(first, locks::OUTBOX_SWEEP)
            .await
            .unwrap()
            .expect("free at first");
        assert!(
            try_lock(second, locks::OUTBOX_SWEEP)
                .await
                .unwrap()
                .is_none()
        );
        assert!(
            try_lock(second, locks::IDEMPOTENCY_PURGE)
                .await
                .unwrap()
                .is_some(),
            "another job's lock is independent"
        );
        held.commit().await.unwrap();
        assert!(
            try_lock(second, locks::OUTBOX_SWEEP)
                .await
                .unwrap()
                .is_some()
        );
        // The purge runs under its lock and reports what it removed.
        let old = now_ms() - idempotency::RETENTION_MS - 1;
        sqlx::query(
            "INSERT INTO idempotency_keys VALUES ('t', 'k', 'h', 202, '{}', 'm', $1), ('t', 'k2', 'h', 202, '{}', 'm2', $2)",
        )
        .bind(old)
        .bind(now_ms())
        .execute(&first.pool)
        .await
        .unwrap();
        let db = Db::Postgres(first.clone());
        assert_eq!(
            idempotency::purge_expired(&db, now_ms()).await.unwrap(),
            Some(1)
        );
        let blocker = try_lock(second, locks::IDEMPOTENCY_PURGE)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            idempotency::purge_expired(&db, now_ms()).await.unwrap(),
            None,
            "skipped while another instance purges"
        );
        blocker.rollback().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_registry_change_made_through_one_instance_reaches_another_within_a_second() {
        let database = TestDatabase::create().await;
        let plans = crate::config::Settings::from_toml_overlay("")
            .unwrap()
            .plans;
        let a = Arc::new(
            crate::tenants::Registry::load(database.open().await, &plans)
                .await
                .unwrap(),
        );
        let b = Arc::new(
            crate::tenants::Registry::load(database.open().await, &plans)
                .await
                .unwrap(),
        );
        let (_stop, stopped) = tokio::sync::watch::channel(false);
        tokio::spawn(b.clone().follow(stopped));
        // The follower's first reload tells us it listens.
        tokio::time::sleep(Duration::from_millis(300)).await;

        let within_a_second = |check: &dyn Fn() -> bool| {
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(1) {
                if check() {
                    return Some(started.elapsed());
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            None
        };
        a.create_tenant("acme", "Acme", "pro", Default::default())
            .await
            .unwrap();
        let (key_id, key) = a.issue_key("acme").await.unwrap();
        let seen =
            tokio::task::block_in_place(|| within_a_second(&|| b.authenticate(&key).is_some()));
        assert!(seen.is_some(), "the new key works on the other instance");

        a.update_tenant(
            "acme",
            &crate::tenants::TenantChange {
                plan: Some("basic".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        let moved = tokio::task::block_in_place(|| {
            within_a_second(&|| b.tenant("acme").is_some_and(|t| t.plan == "basic"))
        });
        assert!(
            moved.is_some(),
            "the plan change reaches the other instance"
        );

        a.revoke_key("acme", &key_id).await.unwrap();
        let refused =
            tokio::task::block_in_place(|| within_a_second(&|| b.authenticate(&key).is_none()));
        assert!(
            refused.is_some(),
            "a revoked key is refused on the other instance within 1 s"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_sweepers_never_send_the_same_outbox_row() {
        let database = TestDatabase::create().await;
        let db = database.open().await;
        let mut sqs = crate::config::Settings::from_toml_overlay("")
            .unwrap()
            .queue
            .sqs;
        sqs.outbox_sweep_secs = 3600;
        // Two instances' outboxes, each sending to a queue of its own (the
        // embedded queue in a SQLite file), so every row sent is counted
        // where it went.
        let dir = tempfile::tempdir().unwrap();
        let mut outboxes = Vec::new();
        let mut files = Vec::new();
        let (_stop, stopped) = tokio::sync::watch::channel(false);
        for name in ["a", "b"] {
            let sqlite =
                crate::store::SqliteDb::open(&dir.path().join(format!("{name}.db")), false)
                    .await
                    .unwrap();
            let lanes = crate::config::Settings::from_toml_overlay("")
                .unwrap()
                .lanes;
            let (writer, _done) = crate::store::writer::StoreWriter::spawn(&sqlite, 64).unwrap();
            let queue: Arc<dyn crate::queue::LaneQueue> = Arc::new(
                crate::queue::embedded::EmbeddedQueue::open(sqlite.clone(), lanes, writer)
                    .await
                    .unwrap(),
            );
            let (outbox, _tasks) =
                crate::outbox::Outbox::start(db.clone(), queue, &sqs, stopped.clone())
                    .await
                    .unwrap();
            outboxes.push(outbox);
            files.push(sqlite);
        }
        // 250 rows an instance that died left behind, 10 minutes ago.
        let old = now_ms() - 600_000;
        sqlx::query(
            "INSERT INTO outbox SELECT 'm' || n, 'fast', 't', 'sms', 'normal', '{}', $1 FROM generate_series(1, 250) AS n",
        )
        .bind(old)
        .execute(&db.postgres().unwrap().pool)
        .await
        .unwrap();
        let cutoff = Some(now_ms() - 1000);
        let (a, b) = tokio::join!(outboxes[0].sweep(cutoff), outboxes[1].sweep(cutoff));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a + b, 250, "every row re-sent once ({a} + {b})");
        let mut ids = std::collections::HashSet::new();
        for sqlite in &files {
            let sent: Vec<String> = sqlx::query_scalar("SELECT message_id FROM queue_messages")
                .fetch_all(&sqlite.read)
                .await
                .unwrap();
            for id in sent {
                assert!(ids.insert(id.clone()), "{id} was sent by both sweepers");
            }
        }
        assert_eq!(ids.len(), 250);
        assert_eq!(count(&db, "SELECT COUNT(*) FROM outbox").await, 0);
    }
}
