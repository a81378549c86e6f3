//! The webhook dispatcher: finds due calls in `webhook_deliveries`, makes
//! them, and records the outcome.
//!
//! Each pass looks at the tenants with due calls one by one and takes, for
//! each, at most `webhooks.concurrency_per_tenant` calls less those it has
//! in flight, so a tenant whose endpoint is slow or dead holds only its own
//! slots and every other tenant's calls go out on the next pass. A call is
//! due only when no earlier event of its message is still waiting, so each
//! message's events arrive in order. Taking a call moves its
//! `next_attempt_at` past the call's timeout (a lease): another instance
//! does not take it meanwhile, and if this one dies, the call is made
//! again once the lease ends, with the same `webhook-id`.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::Rng;
use serde_json::json;
use tokio::sync::{Notify, Semaphore, watch};
use tracing::{debug, info, warn};

use super::sign::sign;
use crate::api::messages::MessageView;
use crate::config::WebhookSettings;
use crate::metrics as names;
use crate::model::{MessageStatus, ms_to_rfc3339, now_ms};
use crate::store::messages::MessageRecord;
use crate::store::{Db, in_transaction, on_pool};

/// A call taken for this instance.
#[derive(Debug, Clone, sqlx::FromRow)]
struct Due {
    event_id: i64,
    tenant_id: String,
    message_id: String,
    #[sqlx(rename = "type")]
    kind: String,
    created_at: i64,
    attempts: i64,
}

/// Makes the webhook calls of every tenant; one per instance.
pub struct Dispatcher {
    db: Db,
    settings: WebhookSettings,
    client: reqwest::Client,
    /// Event ids being called, by tenant.
    in_flight: Mutex<HashMap<String, HashSet<i64>>>,
    /// `webhooks.concurrency`: calls at once for all tenants.
    slots: Arc<Semaphore>,
    /// Woken when a call ends, so its tenant's next one need not wait for
    /// the poll interval.
    wake: Notify,
}

impl Dispatcher {
    pub fn new(db: Db, settings: WebhookSettings) -> anyhow::Result<Arc<Self>> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_millis(settings.timeout_ms))
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("fairlane-webhooks/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(Arc::new(Dispatcher {
            slots: Arc::new(Semaphore::new(settings.concurrency)),
            db,
            settings,
            client,
            in_flight: Mutex::default(),
            wake: Notify::new(),
        }))
    }

    /// Passes every `poll_interval_ms` until shutdown.
    pub async fn run(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let interval = Duration::from_millis(self.settings.poll_interval_ms);
        loop {
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = self.wake.notified() => {}
                _ = shutdown.wait_for(|stop| *stop) => return,
            }
            if let Err(err) = self.pass().await {
                warn!(error = %format!("{err:#}"), "Could not look for due webhook calls; trying again shortly.");
            }
        }
    }

    /// One pass: takes and starts the due calls each tenant has room for.
    pub async fn pass(self: &Arc<Self>) -> anyhow::Result<()> {
        let tenants: Vec<Option<String>> = on_pool!(&self.db, read, |pool| {
            // One index probe per tenant with pending calls (a "loose index
            // scan"), not a pass over every pending row: a dead endpoint's
            // backlog can be millions of rows.
            sqlx::query_scalar(
                "WITH RECURSIVE pending(tenant_id) AS ( \
                   SELECT MIN(tenant_id) FROM webhook_deliveries WHERE state = 'pending' \
                   UNION ALL \
                   SELECT (SELECT MIN(d.tenant_id) FROM webhook_deliveries AS d \
                           WHERE d.state = 'pending' AND d.tenant_id > pending.tenant_id) \
                   FROM pending WHERE pending.tenant_id IS NOT NULL) \
                 SELECT tenant_id FROM pending WHERE tenant_id IS NOT NULL",
            )
            .fetch_all(pool)
            .await?
        });
        for tenant in tenants.into_iter().flatten() {
            self.fill(&tenant).await?;
        }
        Ok(())
    }

    /// Takes and starts the due calls `tenant` has room for. Each call that
    /// ends wakes the next pass at once, so a busy endpoint is kept at
    /// `concurrency_per_tenant` calls rather than that many per interval.
    async fn fill(self: &Arc<Self>, tenant: &str) -> anyhow::Result<()> {
        let now = now_ms();
        let busy: HashSet<i64> = self.busy(tenant);
        let room = self
            .settings
            .concurrency_per_tenant
            .saturating_sub(busy.len());
        if room == 0 {
            return Ok(());
        }
        let candidates: Vec<Due> = on_pool!(&self.db, read, |pool| {
            sqlx::query_as(
                "SELECT d.event_id, d.tenant_id, d.message_id, d.type, d.created_at, d.attempts \
                 FROM webhook_deliveries AS d \
                 WHERE d.tenant_id = $1 AND d.state = 'pending' AND d.next_attempt_at <= $2 \
                 AND NOT EXISTS (SELECT 1 FROM webhook_deliveries AS e \
                                 WHERE e.message_id = d.message_id AND e.event_id < d.event_id) \
                 ORDER BY d.next_attempt_at, d.event_id LIMIT $3",
            )
            .bind(tenant)
            .bind(now)
            .bind((room + busy.len()) as i64)
            .fetch_all(pool)
            .await?
        });
        let wanted: Vec<Due> = candidates
            .into_iter()
            .filter(|due| !busy.contains(&due.event_id))
            .take(room)
            .collect();
        if wanted.is_empty() {
            return Ok(());
        }
        for due in self.take(wanted, now).await? {
            let admitted = {
                let mut in_flight = self.in_flight.lock().expect("in-flight lock");
                let ids = in_flight.entry(due.tenant_id.clone()).or_default();
                // Another fill of this tenant may have got here first and
                // taken its room.
                ids.len() < self.settings.concurrency_per_tenant && ids.insert(due.event_id)
            };
            if !admitted {
                self.release(&due).await?;
                continue;
            }
            let dispatcher = self.clone();
            tokio::spawn(async move {
                let (tenant, event_id) = (due.tenant_id.clone(), due.event_id);
                if let Err(err) = dispatcher.call(&due).await {
                    warn!(%tenant, event_id, error = %format!("{err:#}"), "Could not record a webhook call; it is made again after its lease.");
                }
                dispatcher.done(&tenant, event_id);
                // Room again: the next pass starts now, not at its interval.
                dispatcher.wake.notify_one();
            });
        }
        Ok(())
    }

    /// Gives back a lease taken but not used: the call is due again now.
    async fn release(&self, due: &Due) -> anyhow::Result<()> {
        in_transaction!(&self.db, |tx| {
            sqlx::query("UPDATE webhook_deliveries SET next_attempt_at = $1 WHERE event_id = $2")
                .bind(now_ms())
                .bind(due.event_id)
                .execute(&mut *tx)
                .await?;
        });
        Ok(())
    }

    fn busy(&self, tenant: &str) -> HashSet<i64> {
        self.in_flight
            .lock()
            .expect("in-flight lock")
            .get(tenant)
            .cloned()
            .unwrap_or_default()
    }

    fn done(&self, tenant: &str, event_id: i64) {
        let mut in_flight = self.in_flight.lock().expect("in-flight lock");
        if let Some(ids) = in_flight.get_mut(tenant) {
            ids.remove(&event_id);
            if ids.is_empty() {
                in_flight.remove(tenant);
            }
        }
    }

    /// Leases `wanted` to this instance; returns those it got (another
    /// instance may have taken some since they were read).
    async fn take(&self, wanted: Vec<Due>, now: i64) -> anyhow::Result<Vec<Due>> {
        let lease_until = now + self.settings.timeout_ms as i64 + 30_000;
        let taken = in_transaction!(&self.db, |tx| {
            let mut taken = Vec::with_capacity(wanted.len());
            for due in wanted {
                let done = sqlx::query(
                    "UPDATE webhook_deliveries SET next_attempt_at = $1 \
                     WHERE event_id = $2 AND state = 'pending' AND next_attempt_at <= $3",
                )
                .bind(lease_until)
                .bind(due.event_id)
                .bind(now)
                .execute(&mut *tx)
                .await?;
                if done.rows_affected() == 1 {
                    taken.push(due);
                }
            }
            taken
        });
        Ok(taken)
    }

    /// Makes one call and records how it went.
    async fn call(&self, due: &Due) -> anyhow::Result<()> {
        let _slot = self.slots.acquire().await?;
        let Some(webhook) = super::get(&self.db, &due.tenant_id).await? else {
            return self.forget(due).await;
        };
        let Some(data) = snapshot(&self.db, due.event_id).await? else {
            return self.forget(due).await;
        };
        let body = serde_json::to_vec(&json!({
            "type": due.kind,
            "timestamp": ms_to_rfc3339(due.created_at),
            "data": data,
        }))?;
        let id = format!("evt_{}", due.event_id);
        let now = now_ms();
        let timestamp = now / 1000;
        let signatures = webhook
            .signing_secrets(now)
            .into_iter()
            .map(|secret| sign(secret, &id, timestamp, &body))
            .collect::<anyhow::Result<Vec<_>>>()?
            .join(" ");
        let answer = self
            .client
            .post(&webhook.url)
            .header("content-type", "application/json")
            .header("webhook-id", &id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signatures)
            .body(body)
            .send()
            .await;
        let failure = match answer {
            Ok(response) if response.status().is_success() => None,
            Ok(response) => Some((
                "rejected",
                format!("the endpoint answered HTTP {}", response.status().as_u16()),
            )),
            Err(err) if err.is_timeout() => Some((
                "unreachable",
                format!("no answer within {} ms", self.settings.timeout_ms),
            )),
            Err(err) => Some((
                "unreachable",
                format!(
                    "cannot reach the endpoint: {}",
                    crate::providers::causes(&err)
                ),
            )),
        };
        match failure {
            None => self.delivered(due).await,
            Some((result, error)) => self.failed(due, result, &error).await,
        }
    }

    /// The endpoint or the message is gone: the call is dropped.
    async fn forget(&self, due: &Due) -> anyhow::Result<()> {
        in_transaction!(&self.db, |tx| {
            sqlx::query("DELETE FROM webhook_deliveries WHERE event_id = $1")
                .bind(due.event_id)
                .execute(&mut *tx)
                .await?;
        });
        Ok(())
    }

    async fn delivered(&self, due: &Due) -> anyhow::Result<()> {
        in_transaction!(&self.db, |tx| {
            sqlx::query("DELETE FROM webhook_deliveries WHERE event_id = $1")
                .bind(due.event_id)
                .execute(&mut *tx)
                .await?;
            sqlx::query(
                "UPDATE webhooks SET failing_since = NULL, last_error = NULL \
                 WHERE tenant_id = $1 AND failing_since IS NOT NULL",
            )
            .bind(&due.tenant_id)
            .execute(&mut *tx)
            .await?;
        });
        let lag = (now_ms() - due.created_at).max(0) as f64 / 1000.0;
        metrics::counter!(names::WEBHOOK_ATTEMPTS_TOTAL, "result" => "delivered").increment(1);
        metrics::histogram!(names::WEBHOOK_LAG_SECONDS).record(lag);
        debug!(tenant = %due.tenant_id, message_id = %due.message_id, kind = %due.kind, event_id = due.event_id, "Webhook delivered.");
        Ok(())
    }

    /// Schedules the next try, or gives the event up once it has failed
    /// for `disable_after_secs`; disables the endpoint once it has failed
    /// that long.
    async fn failed(&self, due: &Due, result: &'static str, error: &str) -> anyhow::Result<()> {
        let now = now_ms();
        let limit = (self.settings.disable_after_secs * 1000) as i64;
        let gave_up = now - due.created_at >= limit;
        let next = now + self.backoff(due.attempts as u32 + 1).as_millis() as i64;
        let disabled = in_transaction!(&self.db, |tx| {
            sqlx::query(
                "UPDATE webhook_deliveries SET attempts = attempts + 1, last_error = $1, \
                 next_attempt_at = $2, state = $3 WHERE event_id = $4",
            )
            .bind(error)
            .bind(next)
            .bind(if gave_up { "failed" } else { "pending" })
            .bind(due.event_id)
            .execute(&mut *tx)
            .await?;
            // The message's later events wait for this one anyway: moving
            // them back with it keeps them out of the next passes' reads.
            sqlx::query(
                "UPDATE webhook_deliveries SET next_attempt_at = $1 \
                 WHERE message_id = $2 AND event_id > $3 AND state = 'pending' AND next_attempt_at < $1",
            )
            .bind(next)
            .bind(&due.message_id)
            .bind(due.event_id)
            .execute(&mut *tx)
            .await?;
            let failing_since: Option<Option<i64>> = sqlx::query_scalar(
                "UPDATE webhooks SET failing_since = COALESCE(failing_since, $1), last_error = $2 \
                 WHERE tenant_id = $3 AND disabled_at IS NULL RETURNING failing_since",
            )
            .bind(now)
            .bind(error)
            .bind(&due.tenant_id)
            .fetch_optional(&mut *tx)
            .await?;
            let disable = matches!(failing_since, Some(Some(since)) if now - since >= limit);
            if disable {
                sqlx::query("UPDATE webhooks SET disabled_at = $1 WHERE tenant_id = $2")
                    .bind(now)
                    .bind(&due.tenant_id)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query(
                    "UPDATE webhook_deliveries SET state = 'failed' \
                     WHERE tenant_id = $1 AND state = 'pending'",
                )
                .bind(&due.tenant_id)
                .execute(&mut *tx)
                .await?;
            }
            disable
        });
        metrics::counter!(names::WEBHOOK_ATTEMPTS_TOTAL, "result" => result).increment(1);
        if gave_up {
            metrics::counter!(names::WEBHOOK_ATTEMPTS_TOTAL, "result" => "gave_up").increment(1);
        }
        if disabled {
            metrics::counter!(names::WEBHOOKS_DISABLED_TOTAL).increment(1);
            warn!(tenant = %due.tenant_id, error, "Webhook endpoint disabled after failing for webhooks.disable_after_secs; its events are kept for a redrive.");
        } else {
            info!(tenant = %due.tenant_id, event_id = due.event_id, attempts = due.attempts + 1, error, retry_in_ms = next - now, "Webhook call failed; retrying later.");
        }
        Ok(())
    }

    /// Wait before try `attempt` (1-based): between half and all of
    /// `retry_base_ms × 2^(attempt-1)`, at most `retry_max_secs`.
    fn backoff(&self, attempt: u32) -> Duration {
        let base = self.settings.retry_base_ms;
        let ceiling = base
            .saturating_mul(1u64 << attempt.saturating_sub(1).min(30))
            .min(self.settings.retry_max_secs.saturating_mul(1000))
            .max(1);
        Duration::from_millis(rand::rng().random_range(ceiling / 2..=ceiling))
    }
}

/// The message's status object as it was at event `event_id`: the
/// webhook's `data`. None when the event or its message is gone.
async fn snapshot(db: &Db, event_id: i64) -> anyhow::Result<Option<MessageView>> {
    type Row = (
        String,
        String,
        i64,
        String,
        i64,
        Option<String>,
        Option<String>,
        String,
        String,
        String,
        Option<String>,
        Option<String>,
        i64,
        Option<i64>,
        Option<i64>,
    );
    let row: Option<Row> = on_pool!(db, read, |pool| {
        sqlx::query_as(
            "SELECT m.id, m.tenant_id, e.at, e.status, e.attempts, e.detail, e.provider_message_id, \
             m.channel, m.priority, m.lane, m.reference, m.metadata, m.created_at, m.sent_at, m.send_at \
             FROM message_events AS e JOIN messages AS m ON m.id = e.message_id WHERE e.id = $1",
        )
        .bind(event_id)
        .fetch_optional(pool)
        .await?
    });
    let Some((
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
    )) = row
    else {
        return Ok(None);
    };
    let status: MessageStatus = status.parse().map_err(anyhow::Error::msg)?;
    let failure = !matches!(
        status,
        MessageStatus::Queued
            | MessageStatus::Sent
            | MessageStatus::Delivered
            | MessageStatus::Cancelled
    );
    let record = MessageRecord {
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
    };
    Ok(Some(record.into()))
}
