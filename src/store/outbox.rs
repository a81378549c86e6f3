//! The outbox's rows: queue messages waiting to reach SQS, written in the
//! accept's transaction (see `crate::accept::outbox` for the relay). A
//! scheduled message's row waits here until it is due.

use crate::store::StoreResult;
use async_trait::async_trait;
use futures_util::future::BoxFuture;

use crate::model::Lane;

/// An outbox row: message id, lane, tenant, channel, priority, body.
pub type OutboxRow = (String, String, String, String, String, String);

/// What [`OutboxStore::drain_outbox`] hands each page of rows to: it sends
/// them on and answers the ids their queue took.
pub type SendRows<'a> =
    dyn FnMut(Vec<OutboxRow>) -> BoxFuture<'a, anyhow::Result<Vec<String>>> + Send + 'a;

/// The outbox, on either backend. Rows are written by the accept path's
/// hot writer, in the accept's transaction.
#[async_trait]
pub trait OutboxStore: Send + Sync {
    /// Hands the rows created at or before `cutoff` (ms) and the scheduled
    /// rows that are due to `send`, a page of `page` rows at a time; `send`
    /// answers the ids the queue took, whose rows are then removed (a
    /// scheduled message is `queued` from then on, [`Move::Due`]). Returns
    /// how many were sent.
    ///
    /// On PostgreSQL, where several instances sweep, each page is claimed
    /// with `FOR UPDATE SKIP LOCKED` in a transaction that also removes the
    /// rows sent, so two sweepers never send the same row and one that dies
    /// mid-page leaves its rows to the next.
    ///
    /// [`Move::Due`]: super::lifecycle::Move::Due
    async fn drain_outbox(
        &self,
        cutoff: i64,
        page: i64,
        send: &mut SendRows<'_>,
    ) -> StoreResult<usize>;

    /// Outbox rows per lane (fast, slow): messages accepted and not yet in
    /// SQS, scheduled ones included. One scan of a table that is small
    /// unless SQS is behind (and then bounded by the lanes' high-water
    /// marks).
    async fn outbox_by_lane(&self) -> StoreResult<[u64; 2]>;

    /// The cutoff (ms) of the sweep at start-up, given the sweep's age
    /// (ms): `None`, every row, where the store belongs to this one
    /// instance (a row left then belongs to a process that is gone);
    /// `now - sweep_age` where other instances may be sending their rows
    /// right now.
    fn start_up_cutoff(&self, now: i64, sweep_age: i64) -> Option<i64>;

    /// Scheduled messages (waiting in the outbox for their time) per
    /// tenant, by the index of scheduled rows: the console's overview. With
    /// the lanes in PostgreSQL, also the lane rows waiting for their time
    /// (scheduled, or a retry's backoff).
    async fn scheduled_by_tenant(&self) -> StoreResult<Vec<(String, i64)>>;

    /// Removes the outbox rows of `ids` (sent messages).
    async fn forget_outbox_rows(&self, ids: &[String]) -> StoreResult<()>;

    /// The ids of `tenant_id`'s messages still waiting in the outbox to
    /// reach their lane (scheduled ones, which wait for their time, left
    /// out), at most `limit`: what a purge of the tenant's queues must
    /// cancel too, or the relay would deliver them after it.
    async fn outbox_waiting_of_tenant(
        &self,
        tenant_id: &str,
        limit: i64,
    ) -> StoreResult<Vec<String>>;
}

/// Outbox rows per lane (fast, slow) from `(lane, count)` rows.
pub(super) fn counts_by_lane(rows: Vec<(String, i64)>) -> [u64; 2] {
    let mut counts = [0; 2];
    for (lane, count) in rows {
        if let Ok(lane) = lane.parse::<Lane>() {
            counts[usize::from(lane == Lane::Slow)] = count.max(0) as u64;
        }
    }
    counts
}
