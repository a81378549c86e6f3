//! The hot path's one writer: accepts and the delivery path's status
//! changes, on either engine.
//!
//! A transaction per request would cap the accept rate at the number of
//! commits the store can make per second. Instead each piece goes to the
//! engine's group-committing writer (SQLite: [`StoreWriter`], a thread
//! that also runs the embedded queue's receives and deletes; PostgreSQL:
//! [`super::postgres::PgWriter`], a task of multi-row statements), which
//! commits everything waiting in one transaction and only then answers
//! each caller. Under load, groups grow by themselves while a commit is
//! running; when idle, a lone piece commits at once.
//!
//! [`HotPath`] is what each engine's writer does; [`Writer`] is the handle
//! the service holds, the same on both. Where an accept's queue entry goes
//! is the [`Staging`]: on SQLite with the embedded queue, into the queue's
//! own rows in the same transaction (written by the queue through
//! [`QueueRows`](super::QueueRows), so the store knows nothing of queue
//! tables); otherwise into the outbox, sent to SQS afterwards.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::oneshot;

use super::Db;
use super::delivery::{BeforeSend, Called, CallsRecord, PassRooms, SendCheck, TakenCalls};
use super::lifecycle::Move;
use super::receipts::{Applied, Receipt};
use super::sqlite::writer::StoreWriter;
use super::staging::{AcceptEntry, NotDurable, Staging};
use super::streak::FailureStreak;
use crate::model::{MessageStatus, Scope};

/// What an engine's group-committing writer does for the hot path; one
/// implementation per engine (`sqlite::hot::SqliteHot`, `PgWriter`). Each
/// piece answers once its group has committed.
#[async_trait]
pub(crate) trait HotPath: Send + Sync {
    /// Sends accepted entries to `staging` from now on (once, before the
    /// accept path starts); refused when the engine cannot hold that
    /// queue.
    fn stage_into(&self, staging: Staging) -> anyhow::Result<()>;

    /// Makes every entry durable in one transaction, all or none; true
    /// once committed.
    async fn accept_all(&self, entries: Vec<AcceptEntry>) -> bool;

    /// See [`Writer::cancel`]; `test`: the world (`None`: both).
    async fn cancel(
        &self,
        tenant_id: &str,
        test: Option<bool>,
        ids: Vec<String>,
    ) -> anyhow::Result<Vec<String>>;

    /// See [`Writer::claim`].
    async fn claim(&self, id: &str, stale_before: i64) -> anyhow::Result<bool>;

    /// See [`Writer::before_send`].
    async fn before_send(&self, checks: Vec<SendCheck>) -> anyhow::Result<Vec<BeforeSend>>;

    /// See [`Writer::take_pass`].
    async fn take_pass(
        &self,
        rooms: PassRooms,
        now: i64,
        lease_until: i64,
    ) -> anyhow::Result<Vec<TakenCalls>>;

    /// See [`Writer::record_calls`].
    async fn record_calls(&self, record: CallsRecord) -> anyhow::Result<()>;

    /// See [`Writer::apply_receipt`].
    async fn apply_receipt(&self, receipt: &Receipt) -> anyhow::Result<Applied>;

    /// See [`Writer::sent_after_wait`].
    async fn sent(
        &self,
        id: &str,
        provider_message_id: &str,
        provider: Option<&str>,
        gate_wait_ms: Option<i64>,
    ) -> anyhow::Result<()>;

    /// See [`Writer::failure_of`]; `step` is a failure's move.
    async fn failure(
        &self,
        id: &str,
        step: Move,
        error: &str,
        counted: bool,
        called: Option<Called<'_>>,
    ) -> anyhow::Result<u32>;

    /// The writer's failure streak.
    fn failures(&self) -> &FailureStreak;

    /// See [`Writer::probe`].
    async fn probe(&self) -> anyhow::Result<()>;

    /// See [`Writer::stop`].
    async fn stop(&self);

    /// The SQLite writer thread, whose groups the embedded queue's own
    /// work rides in; `None` on another engine. Asked only by the store
    /// ([`Db::embedded_engine`]).
    fn sqlite_writer(&self) -> Option<&StoreWriter> {
        None
    }
}

/// The hot path's writer; cheap to clone.
#[derive(Clone)]
pub struct Writer {
    hot: Arc<dyn HotPath>,
    /// Rung after a delivery outcome (`sent`, a failure) has committed: a
    /// status change that may have written an event.
    changed: Arc<tokio::sync::Notify>,
}

impl Writer {
    /// Starts the writer of `db`'s engine, staging accepts into the
    /// outbox until [`Writer::stage_into`] says otherwise. `max_group`
    /// bounds the pieces per transaction; `max_size_mb` caps a SQLite file
    /// (0: no cap). The receiver completes once the writer has stopped
    /// with everything it was given committed.
    pub fn start(
        db: &Db,
        max_group: usize,
        max_size_mb: u64,
    ) -> anyhow::Result<(Writer, oneshot::Receiver<()>)> {
        let (hot, done) = db.start_hot_path(max_group, max_size_mb)?;
        Ok((
            Writer {
                hot,
                changed: Arc::default(),
            },
            done,
        ))
    }

    /// Sends accepted entries to `staging` from now on. Call once, before
    /// the accept path starts. A PostgreSQL store stages into its outbox
    /// or its lanes' table, a SQLite one into its outbox or the embedded
    /// queue.
    pub fn stage_into(&self, staging: Staging) -> anyhow::Result<()> {
        self.hot.stage_into(staging)
    }

    /// The SQLite writer thread, for the embedded queue's own work; `None`
    /// on PostgreSQL.
    pub(super) fn sqlite(&self) -> Option<&StoreWriter> {
        self.hot.sqlite_writer()
    }

    /// Makes `entry` durable; returns once its group has committed.
    pub async fn accept(&self, entry: AcceptEntry) -> Result<(), NotDurable> {
        self.accept_all(vec![entry]).await
    }

    /// Makes every entry durable in one transaction, all or none (a batch
    /// send); returns once it has committed.
    pub async fn accept_all(&self, entries: Vec<AcceptEntry>) -> Result<(), NotDurable> {
        if entries.is_empty() {
            return Ok(());
        }
        match self.hot.accept_all(entries).await {
            true => Ok(()),
            false => Err(NotDurable {
                retry_after: self.retry_after(),
            }),
        }
    }

    /// Cancels those of `ids` (of `scope`: its tenant, in its world) that
    /// are still waiting to be sent; returns the ids cancelled. Ordered
    /// with the consumers' claims by the store, so a message cancelled here
    /// is never sent, and one being sent is not cancelled. A scheduled
    /// message's outbox row goes too, so it never reaches its lane.
    pub async fn cancel(&self, scope: &Scope, ids: Vec<String>) -> anyhow::Result<Vec<String>> {
        self.cancel_where(scope.tenant(), Some(scope.is_test()), ids)
            .await
    }

    /// [`Writer::cancel`] for an operator: `tenant_id`'s messages of both
    /// worlds (a purge of the tenant's own queue).
    pub async fn cancel_either_world(
        &self,
        tenant_id: &str,
        ids: Vec<String>,
    ) -> anyhow::Result<Vec<String>> {
        self.cancel_where(tenant_id, None, ids).await
    }

    async fn cancel_where(
        &self,
        tenant_id: &str,
        test: Option<bool>,
        ids: Vec<String>,
    ) -> anyhow::Result<Vec<String>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        self.hot.cancel(tenant_id, test, ids).await
    }

    /// Takes the message for this instance's provider call: `scheduled`,
    /// `queued` or `retrying` (or `sending` since before `stale_before`, in
    /// ms: its sender died mid-call) → `sending`, atomically and committed
    /// before it answers. False when the message is no longer waiting (sent,
    /// cancelled, …) or another instance is sending it: then nobody may
    /// call the provider for this copy. A cancel and a claim of one message
    /// are ordered by the store, so a cancelled message is never sent.
    pub async fn claim(&self, id: &str, stale_before: i64) -> anyhow::Result<bool> {
        self.hot.claim(id, stale_before).await
    }

    /// What the store says of received messages before they are sent, in
    /// one read for the lot (a receive's batch): each one's status (`None`
    /// when it has no row) and whether its address is on its tenant's
    /// suppression list. One statement on PostgreSQL instead of two round
    /// trips per message; on SQLite one piece for the writer's connection.
    pub async fn before_send(&self, checks: Vec<SendCheck>) -> anyhow::Result<Vec<BeforeSend>> {
        if checks.is_empty() {
            return Ok(Vec::new());
        }
        self.hot.before_send(checks).await
    }

    /// One pass of the webhook dispatcher: for each tenant with calls to
    /// make (failed calls due again, events past its endpoint's stream
    /// read, a stream this instance reads) and room in `rooms`, takes up to
    /// its room of calls (not its busy ones): its due retries, leased until
    /// `lease_until`, then the next events of its endpoint's stream, under
    /// the stream's lease (until `lease_until`, for `rooms.owner`). Each
    /// call comes with the message's status at its event (absent when the
    /// message is gone) and the tenant's endpoint. Also says how many were
    /// due (at most the room): as many as room means a backlog. Tenants
    /// that got nothing are left out. On SQLite one piece of the writer's
    /// group does it all, so a pass costs the dispatcher one hand-off.
    pub async fn take_pass(
        &self,
        rooms: PassRooms,
        now: i64,
        lease_until: i64,
    ) -> anyhow::Result<Vec<TakenCalls>> {
        self.hot.take_pass(rooms, now, lease_until).await
    }

    /// Records the calls made since the last record, in one transaction
    /// (on SQLite, the writer's group): delivered retries' rows removed,
    /// answering endpoints no longer failing, streams' positions moved on.
    pub async fn record_calls(&self, record: CallsRecord) -> anyhow::Result<()> {
        if record.delivered_rows.is_empty()
            && record.healthy.is_empty()
            && record.positions.is_empty()
        {
            return Ok(());
        }
        self.hot.record_calls(record).await
    }

    /// Records a provider's receipt against its message as a piece of the
    /// writer's group (SQLite: `sqlite::receipts::apply_in`; PostgreSQL:
    /// `postgres::receipts::apply_group`), so receipts at volume commit together
    /// with the delivery path's changes instead of one transaction each.
    pub async fn apply_receipt(&self, receipt: &Receipt) -> anyhow::Result<Applied> {
        self.hot.apply_receipt(receipt).await
    }

    /// Records a successful send by `provider` (its name in the channel's
    /// pool); returns once it is committed (the caller deletes the queue
    /// entry only then, so a redelivery finds `sent`).
    pub async fn sent_by(
        &self,
        id: &str,
        provider_message_id: &str,
        provider: Option<&str>,
    ) -> anyhow::Result<()> {
        self.sent_after_wait(id, provider_message_id, provider, None)
            .await
    }

    /// [`Writer::sent_by`], noting how long the call waited for its
    /// provider's token (ms).
    pub async fn sent_after_wait(
        &self,
        id: &str,
        provider_message_id: &str,
        provider: Option<&str>,
        gate_wait_ms: Option<i64>,
    ) -> anyhow::Result<()> {
        let recorded = self
            .hot
            .sent(id, provider_message_id, provider, gate_wait_ms)
            .await;
        if recorded.is_ok() {
            self.changed.notify_one();
        }
        recorded
    }

    /// Rung after a `sent` or a failure has committed (see
    /// [`tokio::sync::Notify::notify_one`]: one wake-up is kept for a
    /// waiter that was not waiting yet), for the webhook dispatcher.
    pub fn changed(&self) -> &tokio::sync::Notify {
        &self.changed
    }

    /// Records a failed provider call (`counted`: whether it was an
    /// attempt) and the state the message moves to (`retrying`,
    /// `dead_lettered`, `suppressed` or `rejected`; any other is an error);
    /// returns the attempts made so far, 0 when the message was not where
    /// such a move starts (see [`super::lifecycle`]).
    pub async fn failure(
        &self,
        id: &str,
        status: MessageStatus,
        error: &str,
        counted: bool,
    ) -> anyhow::Result<u32> {
        self.failure_of(id, status, error, counted, None).await
    }

    /// [`Writer::failure`] of a call to a provider of the channel's pool:
    /// its name, and whether the next attempt must go to it again (see
    /// [`Called`]).
    pub async fn failure_of(
        &self,
        id: &str,
        status: MessageStatus,
        error: &str,
        counted: bool,
        called: Option<Called<'_>>,
    ) -> anyhow::Result<u32> {
        let step = Move::failure(status)
            .ok_or_else(|| anyhow::anyhow!("{} is not a failure's status", status.as_str()))?;
        let recorded = self.hot.failure(id, step, error, counted, called).await;
        if recorded.is_ok() {
            self.changed.notify_one();
        }
        recorded
    }

    /// The writer's failure streak.
    pub fn failures(&self) -> &FailureStreak {
        self.hot.failures()
    }

    /// The Retry-After to give when a write could not be made durable.
    pub fn retry_after(&self) -> Duration {
        self.failures().retry_after()
    }

    /// Whether a write needing new room would commit now: writes a row
    /// larger than any send and removes it in one transaction.
    pub async fn probe(&self) -> anyhow::Result<()> {
        self.hot.probe().await
    }

    /// Asks the writer to commit what it holds and stop; later work fails.
    pub async fn stop(&self) {
        self.hot.stop().await
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::{Channel, Lane, Priority};
    use crate::store::messages::MessageRecord;

    /// Checks [`Writer::before_send`] on `db`, where `m1` (tenant `t`) is
    /// `queued`: statuses and suppression, in the order asked, for a
    /// message with no row, one with no address, and another tenant's
    /// list.
    pub(crate) async fn before_send_reads_status_and_suppression_in_order(db: &Db) {
        db.add_suppression("t", Channel::Sms, "+15551230001", None)
            .await
            .unwrap();
        let (writer, finished) = Writer::start(db, 64, 0).unwrap();
        let record = queued_record("m1");
        let outbound = crate::message::OutboundMessage {
            message_id: "m1".into(),
            tenant_id: "t".into(),
            channel: Channel::Sms,
            priority: Priority::Normal,
            body: "{}".into(),
            delay: Duration::ZERO,
        };
        writer
            .accept(AcceptEntry {
                lane: Lane::Fast,
                record,
                outbound,
                idempotency: Vec::new(),
                trace: None,
            })
            .await
            .unwrap();
        let check = |id: &str, tenant: &str, address: Option<&str>| SendCheck {
            id: id.into(),
            tenant_id: tenant.into(),
            address: address.map(str::to_owned),
        };
        let found = writer
            .before_send(vec![
                check("nope", "t", Some("+15551230001")),
                check("m1", "t", Some("+15551230001")),
                check("m1", "t", None),
                check("m1", "other", Some("+15551230001")),
                check("m1", "t", Some("+15551230002")),
            ])
            .await
            .unwrap();
        let queued = Some(MessageStatus::Queued);
        assert_eq!(
            found,
            vec![
                BeforeSend {
                    status: None,
                    suppressed: true
                },
                BeforeSend {
                    status: queued,
                    suppressed: true
                },
                BeforeSend {
                    status: queued,
                    suppressed: false
                },
                BeforeSend {
                    status: queued,
                    suppressed: false
                },
                BeforeSend {
                    status: queued,
                    suppressed: false
                },
            ]
        );
        assert!(writer.before_send(Vec::new()).await.unwrap().is_empty());
        writer.stop().await;
        finished.await.unwrap();
    }

    #[tokio::test]
    async fn before_send_reads_what_it_is_asked_on_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("s.db"), false).await.unwrap();
        before_send_reads_status_and_suppression_in_order(&db).await;
    }

    /// An accept of a queued SMS `id` of `tenant`, staged in the outbox.
    pub(crate) fn queued_entry(id: &str, tenant: &str) -> AcceptEntry {
        let mut record = queued_record(id);
        record.tenant_id = tenant.into();
        let outbound = crate::message::OutboundMessage {
            message_id: id.into(),
            tenant_id: tenant.into(),
            channel: Channel::Sms,
            priority: Priority::Normal,
            body: "{}".into(),
            delay: Duration::ZERO,
        };
        AcceptEntry {
            lane: Lane::Fast,
            record,
            outbound,
            idempotency: Vec::new(),
            trace: None,
        }
    }

    fn queued_record(id: &str) -> MessageRecord {
        MessageRecord {
            id: id.into(),
            tenant_id: "t".into(),
            channel: Channel::Sms,
            status: MessageStatus::Queued,
            priority: Priority::Normal,
            lane: Lane::Fast,
            attempts: 0,
            reference: None,
            metadata: None,
            created_at: 1,
            updated_at: 1,
            sent_at: None,
            last_error: None,
            provider_message_id: None,
            send_at: None,
            test: false,
            fragments: None,
            erased_at: None,
            provider: None,
            recipient: None,
            gate_wait_ms: None,
            template_id: None,
            template_version: None,
            attachment_bytes: None,
        }
    }

    #[tokio::test]
    async fn claim_then_sent_are_committed_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("s.db"), false).await.unwrap();
        let record = queued_record("m1");
        let (writer, finished) = Writer::start(&db, 64, 0).unwrap();
        let store = writer.sqlite().unwrap().clone();
        let inserted = record.clone();
        store
            .run(move |tx| Ok(crate::store::sqlite::lifecycle::accept(tx, &[&inserted])?))
            .await
            .unwrap();
        assert!(writer.claim("m1", 0).await.unwrap());
        writer.sent_by("m1", "SM1", None).await.unwrap();
        // A late claim never takes a sent message back.
        assert!(!writer.claim("m1", 0).await.unwrap());
        let attempts = writer
            .failure("nope", MessageStatus::Retrying, "x", true)
            .await
            .unwrap();
        assert_eq!(attempts, 0, "an unknown id changes nothing");
        writer.stop().await;
        finished.await.unwrap();
        let stored = db.message("m1").await.unwrap().unwrap();
        assert_eq!(stored.status, MessageStatus::Sent);
        assert_eq!(stored.attempts, 1);
        assert_eq!(stored.provider_message_id.as_deref(), Some("SM1"));
    }

    /// On SQLite the writer sums `accepted` and `sent` over a group: a
    /// piece that fails (a duplicate id) leaves no count behind, the pieces
    /// of its group that commit alone count once, and a second `sent` of
    /// the same message counts nothing.
    #[tokio::test]
    async fn the_sqlite_writer_counts_usage_once_per_committed_change() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("s.db"), false).await.unwrap();
        let (writer, finished) = Writer::start(&db, 64, 0).unwrap();
        let store = writer.sqlite().unwrap().clone();
        let insert = |id: &'static str, fragments: Option<u32>| {
            let store = store.clone();
            let mut record = queued_record(id);
            record.fragments = fragments;
            async move {
                store
                    .run(move |tx| Ok(crate::store::sqlite::lifecycle::accept(tx, &[&record])?))
                    .await
            }
        };
        // Submitted together, so they share a group; "m2" twice breaks the
        // primary key and the group is applied piece by piece.
        let (a, b, c, d) = tokio::join!(
            insert("m1", Some(2)),
            insert("m2", Some(3)),
            insert("m2", Some(3)),
            insert("m3", None)
        );
        assert!(a.is_ok() && c.is_ok() != b.is_ok() && d.is_ok());
        for id in ["m1", "m2"] {
            assert!(writer.claim(id, 0).await.unwrap());
            writer.sent_by(id, "SM", None).await.unwrap();
        }
        writer.sent_by("m1", "SM", None).await.unwrap();
        writer.stop().await;
        finished.await.unwrap();
        let rows = db
            .usage(
                crate::store::usage::Whose::Tenant("t"),
                0,
                i64::MAX / 86_400_000,
            )
            .await
            .unwrap();
        let accepted: i64 = rows.iter().map(|r| r.accepted).sum();
        let sent: i64 = rows.iter().map(|r| r.sent).sum();
        let fragments: i64 = rows.iter().map(|r| r.fragments).sum();
        assert_eq!((accepted, sent, fragments), (3, 2, 5), "{rows:?}");
    }
}
