//! The rows of tenant webhooks: each tenant's endpoint (`webhooks`), its
//! place in its tenant's event log, and the calls that failed
//! (`webhook_deliveries`), read and leased by the dispatcher
//! (`crate::webhooks::dispatch`).
//!
//! The event log is the queue of calls. Each endpoint keeps a *position*
//! in its tenant's events (a [`Cursor`]): every event it wants up to there
//! was delivered or has a row. One instance at a time reads an endpoint's
//! events past the position (its *stream*), under a lease on the endpoint's
//! row, and keeps how far it has read (`read_*`): what lies between is in
//! flight. As calls end, the dispatcher moves the position past the
//! unbroken run of ended calls, a batch at a time. A call that fails gets a
//! row, with its retries and backoff; a later event of that message is
//! held behind it as a row too, so each message's events arrive in order.
//! So a delivered event costs no write of its own: the event row the
//! lifecycle writes anyway, and a share of one position update. If the
//! instance dies, its lease ends and another reads again from the
//! position (at least once, with the same `webhook-id`).
//!
//! The operations are [`WebhookStore`]'s, implemented per engine in
//! `store::sqlite::webhooks` and `store::postgres::webhooks`, which hold
//! their SQL.

use crate::store::StoreResult;
use async_trait::async_trait;

use super::messages::MessageRecord;
use crate::model::MessageStatus;

/// A place in a tenant's event log: (transaction id, event id). On
/// PostgreSQL an event's id is taken at insert, not at commit, so the
/// stream reads in (xid, id) order only the events of transactions older
/// than every one still running; on SQLite one writer commits events in id
/// order and every xid is 0.
pub type Cursor = (i64, i64);

/// A tenant's endpoint as stored.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Webhook {
    pub tenant_id: String,
    pub url: String,
    /// Space-separated, with a space at each end.
    pub events: String,
    pub secret: String,
    pub previous_secret: Option<String>,
    pub previous_until: Option<i64>,
    pub failing_since: Option<i64>,
    pub last_error: Option<String>,
    pub disabled_at: Option<i64>,
    pub created_at: i64,
    pub updated_at: i64,
    /// Events one call may carry: 1 posts each event alone, more post
    /// them as a batch (see `crate::webhooks::dispatch`).
    pub max_events_per_call: i64,
}

impl Webhook {
    /// The secrets that sign a call at `now`: the current one, and the
    /// previous one during its grace period.
    pub fn signing_secrets(&self, now: i64) -> Vec<&str> {
        let mut secrets = vec![self.secret.as_str()];
        if let (Some(previous), Some(until)) = (&self.previous_secret, self.previous_until)
            && now < until
        {
            secrets.push(previous);
        }
        secrets
    }
}

/// The columns of [`Webhook`], in order, for `concat!`.
macro_rules! webhook_columns {
    () => {
        "tenant_id, url, events, secret, previous_secret, previous_until, \
         failing_since, last_error, disabled_at, created_at, updated_at, max_events_per_call"
    };
}
pub(super) use webhook_columns;

/// What a `PUT` of a tenant's endpoint sets.
#[derive(Debug, Clone, Copy)]
pub struct Endpoint<'a> {
    pub url: &'a str,
    /// Space-separated, with a space at each end.
    pub events: &'a str,
    /// At least 1.
    pub max_events_per_call: i64,
}

/// A tenant's calls in one state.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeliveryCount {
    /// `pending` or `failed`.
    pub state: String,
    pub count: i64,
    /// Of those, the ones whose next attempt time has come (a call in
    /// flight is leased past it, so it is not counted).
    pub due: i64,
    /// Event time (ms) of the oldest.
    pub oldest: Option<i64>,
}

impl DeliveryCount {
    fn add(&mut self, count: i64, due: i64, oldest: Option<i64>) {
        self.count += count;
        self.due += due;
        self.oldest = match (self.oldest, oldest) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
}

/// A tenant's call rows in one state: state, count, due, oldest event time.
pub(super) type StateRow = (String, i64, i64, Option<i64>);

/// An endpoint's stream backlog: the events past its position that it
/// wants and that have no row, how many of them are due (past where its
/// stream is read, or all once the reader's lease has ended), the oldest
/// one's time, and whether the endpoint is disabled.
pub(super) type StreamBacklog = (i64, i64, Option<i64>, bool);

/// The tenant's calls by state, from its call rows by state and its
/// endpoint's stream backlog: the backlog is pending, or failed while the
/// endpoint is disabled (kept for a redrive).
pub(super) fn counts_by_state(
    rows: Vec<StateRow>,
    stream: Option<StreamBacklog>,
) -> Vec<DeliveryCount> {
    let mut counts: Vec<DeliveryCount> = rows
        .into_iter()
        .map(|(state, count, due, oldest)| DeliveryCount {
            state,
            count,
            due,
            oldest,
        })
        .collect();
    if let Some((count, due, oldest, disabled)) = stream.filter(|stream| stream.0 > 0) {
        let (state, due) = if disabled {
            ("failed", count)
        } else {
            ("pending", due)
        };
        match counts.iter_mut().find(|c| c.state == state) {
            Some(known) => known.add(count, due, oldest),
            None => counts.push(DeliveryCount {
                state: state.into(),
                count,
                due,
                oldest,
            }),
        }
    }
    counts
}

/// Every tenant's pending calls due, and the oldest one's event time,
/// from the due rows (count, oldest) and the enabled endpoints' stream
/// backlogs.
pub(super) fn due_of(
    (rows, oldest_row): (i64, Option<i64>),
    streams: Vec<StreamBacklog>,
) -> (i64, Option<i64>) {
    let mut total = DeliveryCount::default();
    total.add(rows, 0, oldest_row);
    for (_, due, oldest, _) in streams.into_iter().filter(|stream| stream.1 > 0) {
        total.add(due, 0, oldest);
    }
    (total.count, total.oldest)
}

/// How many events a redrive made due again from the endpoint's stream
/// backlog (those it kept while disabled).
pub(super) fn kept_count(kept: Option<StreamBacklog>) -> u64 {
    kept.map_or(0, |k| k.0.max(0) as u64)
}

/// Whether an endpoint failing since `failing_since` (as the failure's
/// update returned it; `None`: no enabled endpoint) is to be disabled at
/// `now`, having failed for `limit` ms.
pub(super) fn to_disable(failing_since: Option<Option<i64>>, now: i64, limit: i64) -> bool {
    matches!(failing_since, Some(Some(since)) if now - since >= limit)
}

/// A call taken for this instance.
#[derive(Debug, Clone)]
pub struct DueCall {
    pub event_id: i64,
    pub tenant_id: String,
    pub message_id: String,
    pub kind: String,
    pub created_at: i64,
    pub attempts: i64,
    /// Where the event is in its endpoint's stream, for a call taken from
    /// it; `None` for a failed call's retry (a row).
    pub cursor: Option<Cursor>,
}

/// Whose failed calls [`WebhookStore::failed_webhook_calls`] lists.
#[derive(Debug, Clone, Copy)]
pub enum CallsOf<'a> {
    Tenant(&'a str),
    Message(&'a str),
}

/// A call that failed at least once: its event id, message, event type,
/// the event's time, when it is due again, attempts made, `pending` or
/// `failed` (given up), and the last error.
pub type FailedCall = (i64, String, String, i64, i64, i64, String, Option<String>);

/// Tenants' endpoints and their calls, on either backend.
#[async_trait]
pub trait WebhookStore: Send + Sync {
    /// The tenant's endpoint, if it has one.
    async fn webhook(&self, tenant_id: &str) -> StoreResult<Option<Webhook>>;

    /// The tenant's calls by state, as of `now`: its failed calls' rows, and
    /// the events its stream has still to deliver (pending; failed while the
    /// endpoint is disabled, kept for a redrive).
    async fn webhook_delivery_counts(
        &self,
        tenant_id: &str,
        now: i64,
    ) -> StoreResult<Vec<DeliveryCount>>;

    /// Every tenant's pending calls due at `now`: how many, and the event time
    /// (ms) of the oldest, for the dispatcher's gauges.
    async fn webhook_calls_due(&self, now: i64) -> StoreResult<(i64, Option<i64>)>;

    /// Sets the tenant's endpoint. A new endpoint gets `secret` (returned); a
    /// changed one keeps its secret (None) and is enabled again, its failed
    /// events pending once more. A new endpoint gets the events from now on:
    /// its stream starts at the tenant's newest event.
    async fn put_webhook(
        &self,
        tenant_id: &str,
        endpoint: &Endpoint<'_>,
        secret: String,
    ) -> StoreResult<(Webhook, Option<String>)>;

    /// Gives the tenant's endpoint the new `secret`; the old one keeps signing
    /// beside it for `grace_ms`. None when there is no endpoint.
    async fn rotate_webhook_secret(
        &self,
        tenant_id: &str,
        secret: String,
        grace_ms: i64,
    ) -> StoreResult<Option<(Webhook, String)>>;

    /// Removes the tenant's endpoint and the events still waiting for it;
    /// true when there was one.
    async fn delete_webhook(&self, tenant_id: &str) -> StoreResult<bool>;

    /// Enables the tenant's endpoint again and makes its failed events pending,
    /// due now; returns how many, with the events its stream kept while it was
    /// disabled. None when there is no endpoint.
    async fn redrive_webhook(&self, tenant_id: &str) -> StoreResult<Option<u64>>;

    /// Endpoints that are failing or disabled, oldest failure first.
    async fn failing_webhooks(&self) -> StoreResult<Vec<Webhook>>;

    /// The calls that failed at least once (retrying, or given up) of a
    /// tenant or of one message, oldest event first, at most `limit`: the
    /// attempt log the console shows. A call taken at the first try has no
    /// row.
    async fn failed_webhook_calls(
        &self,
        of: CallsOf<'_>,
        limit: i64,
    ) -> StoreResult<Vec<FailedCall>>;

    /// The tenants with calls pending, by one index probe per such tenant (a
    /// "loose index scan"), not a pass over every pending row: a dead
    /// endpoint's backlog can be millions of rows.
    async fn tenants_with_pending_calls(&self) -> StoreResult<Vec<String>>;

    /// Gives back a lease taken but not used: the call is due again now.
    async fn release_webhook_lease(&self, event_id: i64) -> StoreResult<()>;

    /// Drops a call (its endpoint or message is gone).
    async fn forget_webhook_call(&self, event_id: i64) -> StoreResult<()>;

    /// A call failed at `now` with `error`: it is due again at `next` (or
    /// given up, `gave_up`), the message's later events move back with it,
    /// and the endpoint is marked failing; once it has failed for `limit` ms
    /// it is disabled and its pending calls given up. Returns whether it was
    /// disabled now. A call from the stream gets its row now; a retry's row
    /// counts one more attempt; given up, or its endpoint disabled
    /// meanwhile, it is kept failed, for a redrive. One transaction.
    async fn webhook_call_failed(
        &self,
        due: &DueCall,
        error: &str,
        next: i64,
        gave_up: bool,
        now: i64,
        limit: i64,
    ) -> StoreResult<bool>;
}

/// The columns of a message's status as it was at one of its events:
/// message id, tenant, at, status, attempts, detail, provider message id,
/// channel, priority, lane, reference, metadata, created at, sent at, send
/// at.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct SnapshotRow {
    pub id: String,
    pub tenant_id: String,
    /// The event's time, status, attempts, detail and provider id.
    pub at: i64,
    pub status: String,
    pub attempts: i64,
    pub detail: Option<String>,
    pub provider_message_id: Option<String>,
    pub channel: String,
    pub priority: String,
    pub lane: String,
    pub reference: Option<String>,
    pub metadata: Option<String>,
    pub created_at: i64,
    pub sent_at: Option<i64>,
    pub send_at: Option<i64>,
    pub test: bool,
    pub fragments: Option<i64>,
}

/// The message's status as it was at an event, from its [`SnapshotRow`].
pub(crate) fn record_at_event(row: SnapshotRow) -> anyhow::Result<MessageRecord> {
    let SnapshotRow {
        id,
        tenant_id,
        at,
        status,
        attempts,
        detail,
        provider_message_id,
        channel,
        priority,
        lane,
        reference,
        metadata,
        created_at,
        sent_at,
        send_at,
        test,
        fragments,
    } = row;
    let status: MessageStatus = status.parse().map_err(anyhow::Error::msg)?;
    let failure = !matches!(
        status,
        MessageStatus::Queued
            | MessageStatus::Sent
            | MessageStatus::Delivered
            | MessageStatus::Cancelled
    );
    Ok(MessageRecord {
        id,
        tenant_id,
        channel: channel.parse().map_err(anyhow::Error::msg)?,
        status,
        priority: priority.parse().map_err(anyhow::Error::msg)?,
        lane: lane.parse().map_err(anyhow::Error::msg)?,
        attempts: attempts.max(0) as u32,
        reference,
        metadata,
        created_at,
        updated_at: at,
        sent_at: sent_at.filter(|sent| *sent <= at),
        last_error: detail.filter(|_| failure),
        provider_message_id,
        send_at,
        test,
        fragments: fragments.map(|n| n.clamp(0, i64::from(u32::MAX)) as u32),
        erased_at: None,
        provider: None,
        recipient: None,
        gate_wait_ms: None,
        template_id: None,
        template_version: None,
        attachment_bytes: None,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::now_ms;
    use crate::store::Db;

    /// Checks [`WebhookStore::webhook_delivery_counts`] and
    /// [`WebhookStore::webhook_calls_due`] on `db` with call
    /// rows put in directly: due now, due later (a retry or a lease),
    /// failed, and another tenant's.
    pub(crate) async fn counts_tell_the_backlog_and_the_oldest_event(db: &Db) {
        let now = 1_000_000;
        // (event id, tenant, created_at, next_attempt_at, state)
        let rows = [
            (1_i64, "a", now - 9_000, now - 9_000, "pending"),
            (2, "a", now - 5_000, now + 60_000, "pending"),
            (3, "a", now - 1_000, now, "pending"),
            (4, "a", now - 20_000, now - 20_000, "failed"),
            (5, "b", now - 30_000, now + 1, "pending"),
        ];
        put_rows(db, &rows).await.unwrap();
        let mut counts = db.webhook_delivery_counts("a", now).await.unwrap();
        counts.sort_by(|x, y| x.state.cmp(&y.state));
        let seen: Vec<(&str, i64, i64, Option<i64>)> = counts
            .iter()
            .map(|c| (c.state.as_str(), c.count, c.due, c.oldest))
            .collect();
        assert_eq!(
            seen,
            [
                ("failed", 1, 1, Some(now - 20_000)),
                ("pending", 3, 2, Some(now - 9_000)),
            ]
        );
        assert!(
            db.webhook_delivery_counts("nobody", now)
                .await
                .unwrap()
                .is_empty()
        );
        // Tenant b's call is due a millisecond later; a's failed one never.
        assert_eq!(
            db.webhook_calls_due(now).await.unwrap(),
            (2, Some(now - 9_000))
        );
        assert_eq!(
            db.webhook_calls_due(now + 1).await.unwrap(),
            (3, Some(now - 30_000))
        );
        assert_eq!(db.webhook_calls_due(0).await.unwrap(), (0, None));
    }

    async fn put_rows(db: &Db, rows: &[(i64, &str, i64, i64, &str)]) -> anyhow::Result<()> {
        for (id, tenant, created, next, state) in rows {
            db.test_execute(&format!(
                "INSERT INTO webhook_deliveries \
                 (event_id, tenant_id, message_id, type, created_at, next_attempt_at, attempts, state) \
                 VALUES ({id}, '{tenant}', 'm{id}', 'message.sent', {created}, {next}, 0, '{state}')"
            ))
            .await;
        }
        Ok(())
    }

    fn rooms(owner: &str, room: usize, stream_until: i64) -> crate::store::PassRooms {
        crate::store::PassRooms {
            tenants: Default::default(),
            default_room: room,
            owner: owner.into(),
            stream_until,
        }
    }

    /// The (message, type) of each call taken for tenant `t`.
    fn calls_of(taken: &[crate::store::TakenCalls]) -> Vec<(String, String)> {
        taken
            .iter()
            .filter(|take| take.tenant == "t")
            .flat_map(|take| take.calls.iter())
            .map(|call| (call.message_id.clone(), call.kind.clone()))
            .collect()
    }

    fn call(message: &str, kind: &str) -> (String, String) {
        (message.to_owned(), format!("message.{kind}"))
    }

    /// An endpoint's stream on `db`: its events in order, none it does not
    /// want, read by one instance while that one's lease lasts, and by
    /// another from the position once it has run out; a message whose call
    /// failed has its later event held behind it as a row.
    pub(crate) async fn a_stream_is_read_in_order_by_one_instance_at_a_time(db: &Db) {
        use crate::store::{CallsRecord, Writer};
        let now = now_ms();
        db.test_execute(
            "INSERT INTO plans VALUES ('p', 'fast', 1, 1, 1, 1, 'admin', 0, 60, 0); \
             INSERT INTO tenants (id, name, plan, status, created_at, updated_at) \
             VALUES ('t', 't', 'p', 'active', 0, 0);",
        )
        .await;
        // An event before the endpoint existed is not its business.
        let write = |message: &'static str, kind: &'static str| async move {
            db.test_execute(&format!(
                "INSERT INTO message_events (message_id, tenant_id, at, event, status, attempts) \
                 VALUES ('{message}', 't', {now}, '{kind}', '{kind}', 1)"
            ))
            .await;
            // On PostgreSQL a stream reads an event once every transaction
            // older than it has ended; other tests' transactions on the
            // same server may hold that back a moment.
            if let Some(pg) = db.postgres() {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                loop {
                    let settled: bool = sqlx::query_scalar(
                        "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint \
                         > (SELECT MAX(xid) FROM message_events)",
                    )
                    .fetch_one(&pg.pool)
                    .await?;
                    if settled || std::time::Instant::now() > deadline {
                        break;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            }
            anyhow::Ok(())
        };
        write("m0", "sent").await.unwrap();
        let endpoint = Endpoint {
            url: "https://example.com/h",
            events: " message.sent message.delivered ",
            max_events_per_call: 1,
        };
        db.put_webhook("t", &endpoint, "s".into()).await.unwrap();
        for (message, kind) in [
            ("m1", "sent"),
            ("m1", "queued"),
            ("m2", "sent"),
            ("m1", "delivered"),
        ] {
            write(message, kind).await.unwrap();
        }
        let (writer, done) = Writer::start(db, 64, 0).unwrap();
        let lease = now + 60_000;
        let first = writer
            .take_pass(rooms("a", 10, lease), now, lease)
            .await
            .unwrap();
        // m1's `delivered` waits for its `sent`, in flight in this pass.
        assert_eq!(calls_of(&first), [call("m1", "sent"), call("m2", "sent")]);
        let read = first[0].stream.expect("a stream read");
        assert!(read.fresh);
        let cursors: Vec<Cursor> = first[0].calls.iter().filter_map(|c| c.cursor).collect();
        assert!(
            cursors[0] < cursors[1] && read.read == cursors[1],
            "{cursors:?} {read:?}"
        );
        // Another instance, within a's lease: nothing of t's.
        let other = writer
            .take_pass(rooms("b", 10, now + 60_000), now, now + 60_000)
            .await
            .unwrap();
        assert!(calls_of(&other).is_empty());
        // a delivered m1's `sent` (only): the position passes it.
        writer
            .record_calls(CallsRecord {
                positions: vec![("t".into(), cursors[0])],
                ..CallsRecord::default()
            })
            .await
            .unwrap();
        // a is gone; once its lease has run out, b reads from the position:
        // m2's `sent` again (at least once), then m1's `delivered`.
        let later = writer
            .take_pass(rooms("b", 10, lease + 60_000), lease + 1, lease + 60_000)
            .await
            .unwrap();
        assert_eq!(
            calls_of(&later),
            [call("m2", "sent"), call("m1", "delivered")]
        );
        assert!(later[0].stream.expect("read").fresh);
        // m3's `sent` fails: its row holds m3's `delivered` behind it.
        write("m3", "sent").await.unwrap();
        let third = writer
            .take_pass(rooms("b", 10, lease + 60_000), lease + 2, lease + 60_000)
            .await
            .unwrap();
        assert_eq!(calls_of(&third), [call("m3", "sent")]);
        let failed = third[0].calls[0].clone();
        db.webhook_call_failed(&failed, "HTTP 500", lease + 3, false, lease + 2, 1_000_000)
            .await
            .unwrap();
        write("m3", "delivered").await.unwrap();
        let fourth = writer
            .take_pass(rooms("b", 10, lease + 60_000), lease + 3, lease + 60_000)
            .await
            .unwrap();
        assert_eq!(calls_of(&fourth), [call("m3", "sent")], "the retry, alone");
        assert_eq!(fourth[0].calls[0].cursor, None, "a retry is a row");
        let rows = db
            .test_texts("SELECT message_id, type, state FROM webhook_deliveries ORDER BY event_id")
            .await;
        let row = |m: &str, kind: &str| {
            vec![
                Some(m.to_owned()),
                Some(format!("message.{kind}")),
                Some("pending".to_owned()),
            ]
        };
        assert_eq!(rows, [row("m3", "sent"), row("m3", "delivered")]);
        writer.stop().await;
        done.await.unwrap();
    }

    #[tokio::test]
    async fn a_stream_is_read_in_order_by_one_instance_at_a_time_on_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("w.db"), false).await.unwrap();
        a_stream_is_read_in_order_by_one_instance_at_a_time(&db).await;
    }

    #[tokio::test]
    async fn counts_tell_the_backlog_and_the_oldest_event_on_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("w.db"), false).await.unwrap();
        counts_tell_the_backlog_and_the_oldest_event(&db).await;
    }
}
