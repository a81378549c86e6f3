//! Dedicated tenant queues in the lanes' table: a dedicated tenant's rows
//! wait under a queue of its own in each lane (`fast:t:acme`), and an entry
//! for the tenant in the lane's attention queue (`fast:attention`, at most
//! one per tenant, in flight or not) tells the attention workers it needs a
//! slice of work. The accept statement routes a message there as the
//! tenants table says (`crate::store::postgres::lanes`), so every instance
//! routes alike at once; both kinds of queue are [`View`]s of [`PgLanes`],
//! received, leased and dead-lettered like the lanes.
//!
//! Also here: the erasure of a tenant's waiting copies (retention, tenant
//! deletion), which takes its own queues with the lanes.

use std::collections::HashSet;
use std::sync::Arc;

use anyhow::Context;
use async_trait::async_trait;

use super::{LaneBook, Names, PgLanes, View};
use crate::model::{Lane, now_ms};
use crate::queue::{LaneQueue, TenantQueues};
use crate::store::postgres::lanes::{LaneRows, insert_lane_rows};
use crate::store::postgres::lifecycle;

impl PgLanes {
    /// A handle on `view` sharing this one's pool, settings and books.
    fn with_view(&self, view: View) -> Arc<PgLanes> {
        Arc::new(PgLanes {
            view,
            ..self.clone()
        })
    }

    /// The queues, in both lanes, a tenant's copies can wait in: the lanes
    /// and their DLQs, its own queues and their DLQs.
    fn queues_of(tenant_id: &str) -> Vec<String> {
        let mut queues = Vec::new();
        for &lane in Lane::ALL {
            for names in [Names::lane(lane), Names::tenant(lane, tenant_id)] {
                queues.push(names.main);
                queues.push(names.dlq);
            }
        }
        queues
    }
}

#[async_trait]
impl TenantQueues for PgLanes {
    fn has_dedicated_queues(&self) -> bool {
        true
    }

    /// Routing reads the tenants table at each accept: nothing to do.
    fn set_tenant_dedicated(&self, _tenant_id: &str, _dedicated: bool) {}

    async fn dedicated_queue(
        &self,
        lane: Lane,
        tenant_id: &str,
    ) -> anyhow::Result<Option<Arc<dyn LaneQueue>>> {
        if !self.dedicated_lanes(tenant_id).await?.contains(&lane) {
            return Ok(None);
        }
        Ok(Some(self.with_view(View::Tenant {
            tenant_id: tenant_id.into(),
            book: Arc::new(LaneBook::new(&self.lanes, lane)),
        })))
    }

    fn attention_queue(&self, _lane: Lane) -> Option<Arc<dyn LaneQueue>> {
        Some(self.with_view(View::Attention))
    }

    /// One statement reads the tenant's queue; when rows remain, an
    /// attention entry is put (unless one waits), visible at once if a row
    /// can be received now, else when the first delay or lease ends.
    async fn settle_attention(&self, lane: Lane, tenant_id: &str) -> anyhow::Result<bool> {
        let now = now_ms();
        let (rows, next): (i64, Option<i64>) = sqlx::query_as(
            "SELECT count(*), min(visible_at) FROM lane_messages \
             WHERE queue = $1 AND class = ANY('{0,1,2}'::smallint[]) AND tenant_id = $2",
        )
        .bind(Names::tenant(lane, tenant_id).main)
        .bind(tenant_id)
        .fetch_one(&self.pool)
        .await
        .context("reading a dedicated queue's backlog")?;
        if rows == 0 {
            return Ok(false);
        }
        let mut signal = LaneRows::default();
        signal.push_signal(
            &Names::attention(lane).main,
            tenant_id,
            next.map_or(0, |at| (at - now).max(0)),
        );
        let mut conn = self.pool.acquire().await?;
        insert_lane_rows(&mut conn, &signal, now)
            .await
            .context("signalling a dedicated queue")?;
        Ok(true)
    }

    /// Settles every queue a tenant has had (`lane_tenant_queues`): those
    /// with rows and no attention entry get one.
    async fn reconcile_attention(&self) -> anyhow::Result<usize> {
        let queues: Vec<(String, String)> = sqlx::query_as(
            "SELECT tenant_id, lane FROM lane_tenant_queues ORDER BY tenant_id, lane",
        )
        .fetch_all(&self.pool)
        .await
        .context("listing dedicated tenant queues")?;
        let mut backlogged = 0;
        for (tenant_id, lane) in queues {
            let Ok(lane) = lane.parse::<Lane>() else {
                continue;
            };
            if self.settle_attention(lane, &tenant_id).await? {
                backlogged += 1;
            }
        }
        Ok(backlogged)
    }

    /// Takes the rows of the tenant's own queues that no consumer holds
    /// and cancels their messages not sent yet, in one transaction.
    async fn purge_dedicated(&self, tenant_id: &str) -> anyhow::Result<Vec<String>> {
        let now = now_ms();
        let own: Vec<String> = Lane::ALL
            .iter()
            .map(|&lane| Names::tenant(lane, tenant_id).main)
            .collect();
        let mut tx = self.pool.begin().await?;
        let ids: Vec<String> = sqlx::query_scalar(
            "DELETE FROM lane_messages WHERE queue = ANY($1) \
             AND class = ANY('{0,1,2}'::smallint[]) AND tenant_id = $2 \
             AND NOT (leased AND visible_at > $3) RETURNING message_id",
        )
        .bind(&own)
        .bind(tenant_id)
        .bind(now)
        .fetch_all(&mut *tx)
        .await
        .context("taking a dedicated queue's waiting rows")?;
        lifecycle::cancel(&mut tx, tenant_id, None, &ids, now).await?;
        tx.commit().await.context("committing a purge")?;
        Ok(ids)
    }

    async fn erase_waiting(
        &self,
        tenant_id: &str,
        message_ids: Option<&[String]>,
    ) -> anyhow::Result<Vec<String>> {
        if message_ids.is_some_and(<[String]>::is_empty) {
            return Ok(Vec::new());
        }
        let queues = Self::queues_of(tenant_id);
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        // The rows first, then the statuses, in the order a redrive locks
        // them (rows, then messages): a redrive that moved a row before
        // this erasure locked it has committed its `queued` by the time the
        // status is read, and its message keeps its row.
        let rows: Vec<(i64, String)> = sqlx::query_as(
            "SELECT seq, message_id FROM lane_messages \
             WHERE queue = ANY($1) AND class = ANY('{0,1,2}'::smallint[]) AND tenant_id = $2 \
             AND ($3::text[] IS NULL OR message_id = ANY($3)) \
             AND NOT (leased AND visible_at > $4) ORDER BY seq FOR UPDATE",
        )
        .bind(&queues)
        .bind(tenant_id)
        .bind(message_ids)
        .bind(now)
        .fetch_all(&mut *tx)
        .await
        .context("reading a tenant's waiting rows")?;
        let wanted: Vec<String> = rows.iter().map(|(_, id)| id.clone()).collect();
        // Tenant deletion takes every row; retention only those of
        // messages still ended.
        let ended: HashSet<String> = match message_ids {
            None => wanted.iter().cloned().collect(),
            Some(_) => sqlx::query_scalar::<_, String>(
                "SELECT id FROM messages WHERE id = ANY($1) \
                 AND status IN ('dead_lettered', 'cancelled') ORDER BY id FOR UPDATE",
            )
            .bind(&wanted)
            .fetch_all(&mut *tx)
            .await
            .context("reading the statuses of rows to erase")?
            .into_iter()
            .collect(),
        };
        let (seqs, erased): (Vec<i64>, Vec<String>) = rows
            .into_iter()
            .filter(|(_, id)| ended.contains(id))
            .unzip();
        sqlx::query("DELETE FROM lane_messages WHERE seq = ANY($1)")
            .bind(&seqs)
            .execute(&mut *tx)
            .await
            .context("erasing waiting rows")?;
        if message_ids.is_none() {
            // A deleted tenant's own queues go too: its attention entries
            // and the record that it had queues.
            let attention: Vec<String> = Lane::ALL
                .iter()
                .map(|&lane| Names::attention(lane).main)
                .collect();
            sqlx::query(
                "DELETE FROM lane_messages WHERE queue = ANY($1) AND class = 1 AND tenant_id = $2",
            )
            .bind(&attention)
            .bind(tenant_id)
            .execute(&mut *tx)
            .await
            .context("erasing a tenant's attention entries")?;
            sqlx::query("DELETE FROM lane_tenant_queues WHERE tenant_id = $1")
                .bind(tenant_id)
                .execute(&mut *tx)
                .await
                .context("forgetting a tenant's own queues")?;
        }
        tx.commit().await.context("committing an erasure")?;
        Ok(erased)
    }

    async fn dedicated_lanes(&self, tenant_id: &str) -> anyhow::Result<Vec<Lane>> {
        let lanes: Vec<String> = sqlx::query_scalar(
            "SELECT lane FROM lane_tenant_queues WHERE tenant_id = $1 ORDER BY lane",
        )
        .bind(tenant_id)
        .fetch_all(&self.pool)
        .await
        .context("listing a tenant's own queues")?;
        Ok(lanes.iter().filter_map(|lane| lane.parse().ok()).collect())
    }
}
