//! The hot statements of the SQLite store, as pieces of work for its one
//! writer ([`StoreWriter`]): accepts (status rows, queue entries or outbox
//! rows, idempotency records), claims, the `sending` and `sent` changes,
//! failures and cancels. They ride in the same groups as the embedded
//! queue's receives and deletes instead of taking transactions of their
//! own; each answers only once its group has committed.

use std::sync::Arc;

use rusqlite::{OptionalExtension, Transaction};
use tokio::sync::oneshot;

use super::lifecycle;
use super::writer::{StoreWriter, Work, WriteFailed};
use crate::model::now_ms;
use crate::store::delivery::{BeforeSend, PassRooms, SendCheck};
use crate::store::idempotency::{self, StoredResponse};
use crate::store::lifecycle::{Failure, Move};
use crate::store::staging::{AcceptEntry, AfterCommit, Staging};
use crate::store::webhooks::{
    DUE_CALLS, DueCall, PENDING_TENANTS, SNAPSHOT, SnapshotRow, WEBHOOK_OF, Webhook,
};

/// Makes `entries` durable in one transaction, all or none; true once
/// committed.
pub(crate) async fn accept(
    writer: &StoreWriter,
    staging: &Arc<Staging>,
    entries: Vec<AcceptEntry>,
) -> bool {
    let (reply, answer) = oneshot::channel();
    writer
        .submit(Box::new(AcceptWork {
            entries,
            staging: staging.clone(),
            after_commit: None,
            reply: Some(reply),
        }))
        .await;
    matches!(answer.await, Ok(true))
}

/// Accepted messages: their status rows, queue entries (or outbox rows)
/// and idempotency records, all or nothing.
struct AcceptWork {
    entries: Vec<AcceptEntry>,
    staging: Arc<Staging>,
    /// What the queue does once its rows are committed.
    after_commit: Option<AfterCommit>,
    reply: Option<oneshot::Sender<bool>>,
}

impl Work for AcceptWork {
    fn accepted(&self) -> &[AcceptEntry] {
        &self.entries
    }

    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        self.after_commit = None;
        let now = now_ms();
        for entry in &self.entries {
            lifecycle::accept(tx, &[&entry.record])?;
            if let Staging::Outbox = self.staging.as_ref() {
                crate::store::outbox::insert_rows(
                    tx,
                    &[(entry.lane, &entry.outbound, entry.record.send_at)],
                    now,
                )?;
            }
            let remembered: Vec<&StoredResponse> = entry.idempotency.iter().collect();
            idempotency::insert_rows(tx, &remembered)?;
        }
        if let Staging::Queue(queue) = self.staging.as_ref() {
            let rows: Vec<_> = self
                .entries
                .iter()
                .map(|entry| (entry.lane, &entry.outbound))
                .collect();
            self.after_commit = Some(queue.insert(tx, &rows)?);
        }
        Ok(())
    }

    fn rolled_back(&mut self) {
        self.after_commit = None;
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if outcome.is_ok()
            && let Some(after_commit) = self.after_commit.take()
        {
            after_commit();
        }
        if let Some(reply) = self.reply.take()
            && reply.send(outcome.is_ok()).is_err()
        {
            let first = self.entries.first().map(|entry| entry.record.id.as_str());
            tracing::warn!(
                message_id = first.unwrap_or(""),
                count = self.entries.len(),
                "Caller went away before its messages were committed."
            );
        }
    }
}

/// See [`crate::store::Writer::cancel`].
pub(crate) async fn cancel(
    writer: &StoreWriter,
    tenant_id: String,
    test: Option<bool>,
    ids: Vec<String>,
) -> anyhow::Result<Vec<String>> {
    writer
        .run(move |tx| {
            let mut forget = tx.prepare_cached("DELETE FROM outbox WHERE message_id = ?1")?;
            let mut cancelled = Vec::new();
            let now = now_ms();
            for id in &ids {
                if lifecycle::cancel(tx, id, Some(&tenant_id), test, now)? {
                    forget.execute([id])?;
                    cancelled.push(id.clone());
                }
            }
            Ok(cancelled)
        })
        .await
}

/// See [`crate::store::Writer::claim`].
pub(crate) async fn claim(
    writer: &StoreWriter,
    id: &str,
    stale_before: i64,
) -> anyhow::Result<bool> {
    let id = id.to_owned();
    writer
        .run(move |tx| Ok(lifecycle::claim(tx, &id, now_ms(), stale_before)?))
        .await
}

/// See [`crate::store::Writer::is_suppressed`]: the writer's connection
/// reads it ahead of its next group, which costs a few microseconds
/// against a pool round trip's tens.
pub(crate) async fn is_suppressed(
    writer: &StoreWriter,
    tenant_id: &str,
    address: &str,
) -> anyhow::Result<bool> {
    let (tenant_id, address) = (tenant_id.to_owned(), address.to_owned());
    writer
        .read(move |tx| {
            Ok(tx
                .prepare_cached(
                    "SELECT EXISTS (SELECT 1 FROM suppressions WHERE tenant_id = ?1 AND address = ?2)",
                )?
                .query_row(rusqlite::params![tenant_id, address], |row| row.get(0))?)
        })
        .await
}

/// See [`crate::store::Writer::before_send`]: read by the writer's
/// connection ahead of its next group, like [`is_suppressed`].
pub(crate) async fn before_send(
    writer: &StoreWriter,
    checks: Vec<SendCheck>,
) -> anyhow::Result<Vec<BeforeSend>> {
    writer
        .read(move |tx| {
            let mut status = tx.prepare_cached("SELECT status FROM messages WHERE id = ?1")?;
            let mut suppressed = tx.prepare_cached(
                "SELECT EXISTS (SELECT 1 FROM suppressions WHERE tenant_id = ?1 AND address = ?2)",
            )?;
            let mut found = Vec::with_capacity(checks.len());
            for check in &checks {
                let word: Option<String> =
                    status.query_row([&check.id], |row| row.get(0)).optional()?;
                let on_list = match &check.address {
                    Some(address) => suppressed
                        .query_row(rusqlite::params![check.tenant_id, address], |row| {
                            row.get(0)
                        })?,
                    None => false,
                };
                found.push(BeforeSend {
                    status: word.and_then(|word| word.parse().ok()),
                    suppressed: on_list,
                });
            }
            Ok(found)
        })
        .await
}

/// See [`crate::store::Writer::sent_by`].
pub(crate) async fn sent(
    writer: &StoreWriter,
    id: &str,
    provider_message_id: &str,
    provider: Option<&str>,
) -> anyhow::Result<()> {
    let (done, committed) = oneshot::channel();
    writer
        .submit(Box::new(Sent {
            id: id.to_owned(),
            provider_message_id: provider_message_id.to_owned(),
            provider: provider.map(str::to_owned),
            done: Some(done),
        }))
        .await;
    match committed.await {
        Ok(true) => Ok(()),
        _ => anyhow::bail!("status change could not be committed"),
    }
}

/// See [`crate::store::Writer::failure`].
pub(crate) async fn failure(
    writer: &StoreWriter,
    id: &str,
    step: Move,
    error: &str,
    counted: bool,
    called: Option<crate::store::Called<'_>>,
) -> anyhow::Result<u32> {
    let (id, error) = (id.to_owned(), error.to_owned());
    let provider = called.map(|called| called.provider.to_owned());
    let pinned = called.map(|called| called.pinned);
    writer
        .run(move |tx| {
            let failure = Failure {
                step,
                error: Some(&error),
                counted,
                provider: provider.as_deref(),
                pinned,
            };
            let attempts = lifecycle::fail(tx, &id, &failure, now_ms())?;
            Ok(attempts.unwrap_or(0).max(0) as u32)
        })
        .await
}

struct Sent {
    id: String,
    provider_message_id: String,
    provider: Option<String>,
    done: Option<oneshot::Sender<bool>>,
}

impl Work for Sent {
    fn apply(&mut self, tx: &Transaction) -> anyhow::Result<()> {
        Ok(lifecycle::sent(
            tx,
            &self.id,
            &self.provider_message_id,
            self.provider.as_deref(),
            now_ms(),
        )?)
    }

    fn finish(mut self: Box<Self>, outcome: Result<(), WriteFailed>) {
        if let Some(done) = self.done.take() {
            let _ = done.send(outcome.is_ok());
        }
    }
}

/// A tenant's calls taken by [`take_pass`], their data still as rows: they
/// become records off the writer's thread.
pub(crate) struct TenantTake {
    pub tenant: String,
    /// Its room in the pass.
    pub room: usize,
    /// Calls due for the room (at most the room).
    pub wanted: usize,
    /// Those leased.
    pub calls: Vec<DueCall>,
    /// The leased calls' data rows, by event id.
    pub rows: Vec<(i64, SnapshotRow)>,
    pub webhook: Option<Webhook>,
}

/// See [`crate::store::Writer::take_pass`]: on SQLite the tenants with
/// pending calls, each one's due calls, their leases, their data and the
/// tenant's endpoint are read and written in one piece of the writer's
/// group, rather than two pool reads and a piece per tenant.
pub(crate) async fn take_pass(
    writer: &StoreWriter,
    rooms: PassRooms,
    now: i64,
    lease_until: i64,
) -> anyhow::Result<Vec<TenantTake>> {
    writer
        .run(move |tx| {
            let tenants: Vec<Option<String>> = tx
                .prepare_cached(PENDING_TENANTS)?
                .query_map([], |row| row.get(0))?
                .collect::<Result<_, _>>()?;
            let mut taken = Vec::new();
            for tenant in tenants.into_iter().flatten() {
                let (busy, room) = rooms.of(&tenant);
                if room == 0 {
                    continue;
                }
                let (wanted, calls, rows) = take_calls(tx, &tenant, busy, room, now, lease_until)?;
                if calls.is_empty() {
                    continue;
                }
                let webhook = tx
                    .prepare_cached(WEBHOOK_OF)?
                    .query_row([&tenant], webhook_row)
                    .optional()?;
                taken.push(TenantTake {
                    tenant,
                    room,
                    wanted,
                    calls,
                    rows,
                    webhook,
                });
            }
            Ok(taken)
        })
        .await
}

/// How many calls were wanted, those leased and their data rows.
type Taken = (usize, Vec<DueCall>, Vec<(i64, SnapshotRow)>);

/// Up to `room` of `tenant`'s due calls, other than `busy` ones, leased
/// until `lease_until`: how many were wanted, those leased and their data
/// rows.
fn take_calls(
    tx: &Transaction,
    tenant: &str,
    busy: Option<&std::collections::HashSet<i64>>,
    room: usize,
    now: i64,
    lease_until: i64,
) -> rusqlite::Result<Taken> {
    let is_busy = |event_id: i64| busy.is_some_and(|busy| busy.contains(&event_id));
    let mut due = tx.prepare_cached(DUE_CALLS)?;
    let limit = (room + busy.map_or(0, |busy| busy.len())) as i64;
    let wanted: Vec<DueCall> = due
        .query_map(rusqlite::params![tenant, now, limit], |row| {
            Ok(DueCall {
                event_id: row.get(0)?,
                tenant_id: row.get(1)?,
                message_id: row.get(2)?,
                kind: row.get(3)?,
                created_at: row.get(4)?,
                attempts: row.get(5)?,
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

/// A [`WEBHOOK_OF`] row.
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
    })
}

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

/// See [`crate::store::Writer::calls_delivered`].
pub(crate) async fn calls_delivered(
    writer: &StoreWriter,
    event_ids: Vec<i64>,
    tenant_ids: Vec<String>,
) -> anyhow::Result<()> {
    writer
        .run(move |tx| {
            let mut remove =
                tx.prepare_cached("DELETE FROM webhook_deliveries WHERE event_id = ?1")?;
            for event_id in &event_ids {
                remove.execute([event_id])?;
            }
            let mut healthy = tx.prepare_cached(
                "UPDATE webhooks SET failing_since = NULL, last_error = NULL \
                 WHERE tenant_id = ?1 AND failing_since IS NOT NULL",
            )?;
            for tenant_id in &tenant_ids {
                healthy.execute([tenant_id])?;
            }
            Ok(())
        })
        .await
}
