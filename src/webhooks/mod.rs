//! Tenant webhooks: each tenant may register one endpoint and the event
//! types it wants; fairlane POSTs every such event to it, signed to the
//! Standard Webhooks specification ([`sign`]).
//!
//! Delivery is durable: the call to make is a `webhook_deliveries` row,
//! written by the store in the same transaction as the event itself (see
//! the migration's triggers), and deleted only once the endpoint answered
//! 2xx. [`dispatch`] makes the calls: at least once, with the same
//! `webhook-id` on every attempt, in event order for each message, with
//! backoff, and with a bound on the calls to each tenant's endpoint so a
//! slow or dead endpoint delays only its own tenant. An endpoint that
//! fails for `webhooks.disable_after_secs` is disabled; its events are kept
//! as failed, listed by [`failing`], and sent again by [`redrive`].

pub mod dispatch;
pub mod sign;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::model::{MessageStatus, ms_to_rfc3339, now_ms};
use crate::store::{Db, in_transaction, on_pool};

/// A rotated-out secret keeps signing (beside the new one) this long.
pub const PREVIOUS_SECRET_GRACE_MS: i64 = 24 * 60 * 60 * 1000;

/// The event types a webhook can subscribe to: `message.{status}` for
/// every status a message can move to, except the moment of `sending`
/// and `scheduled`, which only an accept sets.
pub fn event_types() -> Vec<String> {
    MessageStatus::ALL
        .iter()
        .filter(|status| !matches!(status, MessageStatus::Sending | MessageStatus::Scheduled))
        .map(|status| format!("message.{}", status.as_str()))
        .collect()
}

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

/// Body of `PUT …/webhook`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WebhookInput {
    /// Where events are POSTed: an `http` or `https` URL, at most 2,048
    /// characters.
    #[schema(min_length = 1, max_length = 2048)]
    pub url: String,
    /// Event types to send, e.g. `["message.delivered", "message.bounced"]`;
    /// at least one, each `message.{status}` for a status other than
    /// `scheduled` and `sending`.
    #[schema(min_items = 1, max_items = 16)]
    pub events: Vec<String>,
}

/// A webhook endpoint's settings and health.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct WebhookView {
    pub tenant_id: String,
    pub url: String,
    pub events: Vec<String>,
    /// `active`, `failing` (its last call failed; retrying) or `disabled`
    /// (failed for `webhooks.disable_after_secs`; an admin redrive resumes it).
    pub state: String,
    /// RFC 3339: first failure of the current run of failures.
    pub failing_since: Option<String>,
    pub last_error: Option<String>,
    /// RFC 3339.
    pub disabled_at: Option<String>,
    /// Events waiting to be delivered.
    pub pending: i64,
    /// Events given up on (kept for a redrive).
    pub failed: i64,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339.
    pub updated_at: String,
}

/// The answer that shows a signing secret: on creation and on rotation.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct WebhookWithSecret {
    #[serde(flatten)]
    pub webhook: WebhookView,
    /// `whsec_…`: verifies `webhook-signature` (Standard Webhooks). Shown
    /// only in this answer.
    pub secret: String,
}

/// Checks a `PUT` body; Err names the field and what is wrong.
pub fn validate(input: &WebhookInput) -> Result<String, (&'static str, String)> {
    let url = input.url.trim();
    let parsed = reqwest::Url::parse(url).map_err(|err| ("url", format!("is not a URL: {err}")))?;
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
        return Err(("url", "must be an http or https URL with a host".into()));
    }
    if url.len() > 2048 {
        return Err(("url", "must be at most 2048 characters".into()));
    }
    if input.events.is_empty() {
        return Err(("events", "must name at least one event type".into()));
    }
    let known = event_types();
    let mut events: Vec<&str> = Vec::new();
    for event in &input.events {
        if !known.contains(event) {
            return Err((
                "events",
                format!(
                    "{event:?} is not an event type; known: {}",
                    known.join(", ")
                ),
            ));
        }
        if !events.contains(&event.as_str()) {
            events.push(event);
        }
    }
    Ok(format!(" {} ", events.join(" ")))
}

/// The columns of [`Webhook`], for `concat!`.
macro_rules! columns {
    () => {
        "tenant_id, url, events, secret, previous_secret, previous_until, \
         failing_since, last_error, disabled_at, created_at, updated_at"
    };
}

/// The tenant's endpoint, if it has one.
pub async fn get(db: &Db, tenant_id: &str) -> anyhow::Result<Option<Webhook>> {
    Ok(on_pool!(db, read, |pool| {
        sqlx::query_as::<_, Webhook>(concat!(
            "SELECT ",
            columns!(),
            " FROM webhooks WHERE tenant_id = $1"
        ))
        .bind(tenant_id)
        .fetch_optional(pool)
        .await?
    }))
}

/// The endpoint with its counts of pending and failed events.
pub async fn view(db: &Db, webhook: Webhook) -> anyhow::Result<WebhookView> {
    let counts: Vec<(String, i64)> = on_pool!(db, read, |pool| {
        sqlx::query_as(
            "SELECT state, COUNT(*) FROM webhook_deliveries WHERE tenant_id = $1 GROUP BY state",
        )
        .bind(&webhook.tenant_id)
        .fetch_all(pool)
        .await?
    });
    let count = |state: &str| {
        counts
            .iter()
            .find(|(s, _)| s == state)
            .map_or(0, |(_, n)| *n)
    };
    let state = if webhook.disabled_at.is_some() {
        "disabled"
    } else if webhook.failing_since.is_some() {
        "failing"
    } else {
        "active"
    };
    Ok(WebhookView {
        pending: count("pending"),
        failed: count("failed"),
        tenant_id: webhook.tenant_id,
        url: webhook.url,
        events: webhook
            .events
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
        state: state.into(),
        failing_since: webhook.failing_since.map(ms_to_rfc3339),
        last_error: webhook.last_error,
        disabled_at: webhook.disabled_at.map(ms_to_rfc3339),
        created_at: ms_to_rfc3339(webhook.created_at),
        updated_at: ms_to_rfc3339(webhook.updated_at),
    })
}

/// Sets the tenant's endpoint. A new endpoint gets a new secret (returned);
/// a changed one keeps its secret (None) and is enabled again, its failed
/// events pending once more.
pub async fn put(
    db: &Db,
    tenant_id: &str,
    url: &str,
    events: &str,
) -> anyhow::Result<(Webhook, Option<String>)> {
    let now = now_ms();
    let secret = sign::new_secret();
    let created = in_transaction!(db, |tx| {
        let existed: Option<String> =
            sqlx::query_scalar("SELECT tenant_id FROM webhooks WHERE tenant_id = $1")
                .bind(tenant_id)
                .fetch_optional(&mut *tx)
                .await?;
        if existed.is_some() {
            sqlx::query(
                "UPDATE webhooks SET url = $1, events = $2, failing_since = NULL, last_error = NULL, \
                 disabled_at = NULL, updated_at = $3 WHERE tenant_id = $4",
            )
            .bind(url)
            .bind(events)
            .bind(now)
            .bind(tenant_id)
            .execute(&mut *tx)
            .await?;
            sqlx::query(RESUME)
                .bind(now)
                .bind(tenant_id)
                .execute(&mut *tx)
                .await?;
        } else {
            sqlx::query(
                "INSERT INTO webhooks (tenant_id, url, events, secret, created_at, updated_at) \
                 VALUES ($1, $2, $3, $4, $5, $5)",
            )
            .bind(tenant_id)
            .bind(url)
            .bind(events)
            .bind(&secret)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
        existed.is_none()
    });
    let webhook = get(db, tenant_id)
        .await?
        .ok_or_else(|| anyhow::anyhow!("the webhook just written is gone"))?;
    Ok((webhook, created.then_some(secret)))
}

/// Makes a tenant's failed events pending again, due now (`$1`), for
/// tenant `$2`.
const RESUME: &str = "UPDATE webhook_deliveries SET state = 'pending', next_attempt_at = $1, \
     attempts = 0, last_error = NULL WHERE tenant_id = $2 AND state = 'failed'";

/// Gives the tenant's endpoint a new secret; the old one keeps signing
/// beside it for [`PREVIOUS_SECRET_GRACE_MS`]. None when there is no
/// endpoint.
pub async fn rotate(db: &Db, tenant_id: &str) -> anyhow::Result<Option<(Webhook, String)>> {
    let now = now_ms();
    let secret = sign::new_secret();
    let rotated = in_transaction!(db, |tx| {
        sqlx::query(
            "UPDATE webhooks SET previous_secret = secret, previous_until = $1, secret = $2, \
             updated_at = $3 WHERE tenant_id = $4",
        )
        .bind(now + PREVIOUS_SECRET_GRACE_MS)
        .bind(&secret)
        .bind(now)
        .bind(tenant_id)
        .execute(&mut *tx)
        .await?
        .rows_affected()
    });
    if rotated == 0 {
        return Ok(None);
    }
    Ok(get(db, tenant_id).await?.map(|webhook| (webhook, secret)))
}

/// Removes the tenant's endpoint and the events still waiting for it;
/// true when there was one.
pub async fn delete(db: &Db, tenant_id: &str) -> anyhow::Result<bool> {
    let removed = in_transaction!(db, |tx| {
        sqlx::query("DELETE FROM webhook_deliveries WHERE tenant_id = $1")
            .bind(tenant_id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM webhooks WHERE tenant_id = $1")
            .bind(tenant_id)
            .execute(&mut *tx)
            .await?
            .rows_affected()
    });
    Ok(removed == 1)
}

/// Enables the tenant's endpoint again and makes its failed events pending,
/// due now; returns how many. None when there is no endpoint.
pub async fn redrive(db: &Db, tenant_id: &str) -> anyhow::Result<Option<u64>> {
    let now = now_ms();
    let redriven = in_transaction!(db, |tx| {
        let enabled = sqlx::query(
            "UPDATE webhooks SET disabled_at = NULL, failing_since = NULL, updated_at = $1 \
             WHERE tenant_id = $2",
        )
        .bind(now)
        .bind(tenant_id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if enabled == 0 {
            None
        } else {
            Some(
                sqlx::query(RESUME)
                    .bind(now)
                    .bind(tenant_id)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected(),
            )
        }
    });
    Ok(redriven)
}

/// Endpoints that are failing or disabled, oldest failure first.
pub async fn failing(db: &Db) -> anyhow::Result<Vec<Webhook>> {
    Ok(on_pool!(db, read, |pool| {
        sqlx::query_as::<_, Webhook>(concat!(
            "SELECT ",
            columns!(),
            " FROM webhooks WHERE failing_since IS NOT NULL OR disabled_at IS NOT NULL \
             ORDER BY COALESCE(failing_since, disabled_at) LIMIT 1000"
        ))
        .fetch_all(pool)
        .await?
    }))
}
