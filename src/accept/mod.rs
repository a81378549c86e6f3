//! The accept path: a send request becomes a durable message, or a refusal
//! that says why. One path for the single and the batch send:
//!
//! validate → idempotency (hold the key, replay a remembered answer) →
//! prepare (id, status row, queue message, answer) → admit (the lane's
//! high-water mark, then the tenant's rate and daily quota) → make durable
//! through the store's one [`Writer`] (with the embedded queue's entry, or
//! an outbox row on SQS) → count it. That commit is the accept: on SQS the
//! message is then handed to the [`outbox`]'s relay, which sends it to its
//! lane off the request path.
//!
//! A refusal after admission gives the tenant's quota back. HTTP stays in
//! the API: it reads headers and bodies, calls [`Acceptor`], and writes
//! answers and problems from what comes back ([`Sent`], [`Refused`]).

mod batch;
mod idempotency;
pub mod outbox;
mod prepare;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;
use tracing::Instrument;
use utoipa::ToSchema;

pub use self::batch::MAX_ITEM_BYTES;
use self::batch::{BatchSlot, BatchSlots};
use self::idempotency::{HeldKey, Hold, InFlightKeys, hold};
pub use self::idempotency::{MAX_KEY_LEN, header_key, is_valid_key, request_hash};
use self::outbox::Outbox;
use self::prepare::{Handed, Prepared, prepare};
use crate::limits::admission::TenantLimits;
use crate::limits::backpressure::LaneBackpressure;
use crate::limits::tenant::{Grant, RateInfo, Refusal};
use crate::message::{NewMessage, validate};
use crate::metrics as names;
use crate::model::{Channel, Lane, MessageStatus, Priority, TenantStatus, now_ms};
pub use crate::store::{AcceptEntry, FailureStreak, NotDurable};
use crate::store::{Db, Writer, idempotency as remembered_answers};
use crate::tenants::Caller;

/// Most messages in one batch.
pub const MAX_BATCH: usize = 1000;

/// The answer to an accepted send.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SendAccepted {
    pub id: String,
    /// `queued`, or `scheduled` with a `send_at` in the future.
    pub status: MessageStatus,
    pub channel: Channel,
    pub lane: Lane,
    pub priority: Priority,
    /// RFC 3339: when a scheduled message is due.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub send_at: Option<String>,
    /// SMS: the fragments its text is sent in (for a send by template, its
    /// rendered text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fragments: Option<u32>,
    /// Email: `cc` and `bcc` addresses on the tenant's suppression list,
    /// left out of the message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub suppressed: Vec<String>,
}

/// Why a limit refused a send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitReason {
    Rate,
    Quota,
    Lane,
    /// The tenant has `server.max_batches_per_tenant` batches in progress.
    Batches,
    /// The tenant's changes other than sends (`limits.tenant_writes_*`).
    Writes,
    /// The tenant's message list reads (`limits.tenant_list_reads`).
    Reads,
    /// The tenant's uploads (its plan's `uploads_per_minute`).
    Uploads,
}

impl LimitReason {
    pub fn as_str(self) -> &'static str {
        match self {
            LimitReason::Rate => "rate",
            LimitReason::Quota => "quota",
            LimitReason::Lane => "lane",
            LimitReason::Batches => "batches",
            LimitReason::Writes => "writes",
            LimitReason::Reads => "reads",
            LimitReason::Uploads => "uploads",
        }
    }
}

/// Why a send was not accepted. Nothing of a refused message is durable.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// Field → what is wrong with it (422).
    #[error("request body has invalid fields")]
    Invalid(BTreeMap<String, String>),
    /// A malformed `Idempotency-Key` header (400).
    #[error("{0}")]
    BadKey(String),
    /// The body is not JSON (400).
    #[error("{0}")]
    Malformed(String),
    /// The tenant is disabled (403).
    #[error("{0}")]
    Disabled(String),
    /// A request with the same key is still being answered, here or on
    /// another instance (409 with `Retry-After`).
    #[error("{detail}")]
    KeyInFlight {
        detail: String,
        retry_after: Duration,
    },
    /// The key was used with another body (422).
    #[error("{0}")]
    KeyReused(String),
    /// The message would not fit in the queue (413).
    #[error("{0}")]
    TooLarge(String),
    /// A limit refused it (429).
    #[error("{detail}")]
    Limited {
        reason: LimitReason,
        detail: String,
        retry_after: Duration,
        /// The tenant's rate figures, for a rate refusal.
        rate: Option<RateInfo>,
    },
    /// It could not be made durable (503).
    #[error("{detail}")]
    Unavailable {
        detail: String,
        retry_after: Duration,
    },
    /// The store failed; the API maps its typed error (a store away or
    /// full is a 503 with Retry-After).
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

impl Refused {
    /// 422 naming `field`.
    pub fn field(field: &str, message: impl Into<String>) -> Self {
        Refused::Invalid(BTreeMap::from([(field.to_owned(), message.into())]))
    }
}

/// What a single send came to.
#[derive(Debug)]
pub enum Sent {
    /// Durable: answer 202 with `body`.
    Accepted {
        id: String,
        body: String,
        rate: RateInfo,
    },
    /// The answer remembered for its `Idempotency-Key`.
    Replayed {
        id: String,
        status: u16,
        body: String,
    },
}

/// One message of a batch, in the batch's order.
#[derive(Debug)]
pub enum BatchItem {
    Accepted {
        answer: SendAccepted,
        /// The remembered answer to an earlier send with the item's key.
        replayed: bool,
    },
    Refused(Refused),
}

/// What a batch came to: the answer's body, written by the caller's
/// `render` from the items.
#[derive(Debug)]
pub enum BatchSent {
    Answered(String),
    /// The answer remembered for the batch's `Idempotency-Key`.
    Replayed(String),
}

/// The accept path, with what it needs; one per instance.
pub struct Acceptor {
    db: Db,
    writer: Writer,
    /// SQS mode: relays what the writer committed to its lane.
    outbox: Option<Arc<Outbox>>,
    limits: TenantLimits,
    backpressure: Arc<LaneBackpressure>,
    in_flight: InFlightKeys,
    batches: BatchSlots,
    /// Signs one-click unsubscribe links (none without a public URL).
    links: Option<Arc<crate::unsubscribe::Links>>,
    /// The tenants' templates, for sends by template.
    templates: Arc<crate::templates::Templates>,
    /// `server.accept_deadline_ms`.
    accept_deadline: Duration,
}

/// `server.accept_deadline_ms`'s default.
const DEFAULT_ACCEPT_DEADLINE: Duration = Duration::from_secs(5);

impl Acceptor {
    /// Each tenant's admitted sends in the last hour, by minute (this
    /// instance's).
    pub fn last_hour(&self) -> &crate::limits::last_hour::LastHour {
        self.limits.last_hour()
    }
}

impl Acceptor {
    pub fn new(
        db: Db,
        writer: Writer,
        outbox: Option<Arc<Outbox>>,
        limits: TenantLimits,
        backpressure: Arc<LaneBackpressure>,
        max_batches_per_tenant: usize,
    ) -> Self {
        Acceptor {
            templates: Arc::new(crate::templates::Templates::new(db.clone())),
            db,
            writer,
            outbox,
            limits,
            backpressure,
            in_flight: InFlightKeys::default(),
            batches: BatchSlots::new(max_batches_per_tenant),
            links: None,
            accept_deadline: DEFAULT_ACCEPT_DEADLINE,
        }
    }

    /// Sets how long a send waits for its durable write
    /// (`server.accept_deadline_ms`).
    pub fn with_accept_deadline(mut self, deadline: Duration) -> Self {
        self.accept_deadline = deadline;
        self
    }

    /// The templates this acceptor reads, to share with the API and the
    /// consumers (one cache per instance).
    pub fn templates(&self) -> &Arc<crate::templates::Templates> {
        &self.templates
    }

    /// Gives emails that ask for it a one-click unsubscribe link.
    pub fn with_unsubscribe(mut self, links: Option<Arc<crate::unsubscribe::Links>>) -> Self {
        self.links = links;
        self
    }

    /// 403 for a disabled tenant: its sends are refused until re-enabled.
    pub fn refuse_disabled(caller: &Caller) -> Result<(), Refused> {
        if caller.tenant.status == TenantStatus::Disabled {
            return Err(Refused::Disabled(format!(
                "Tenant {:?} is disabled; sends are refused until an admin re-enables it.",
                caller.tenant.id
            )));
        }
        Ok(())
    }

    /// Accepts one send request (`value`, the JSON body) for `caller`;
    /// `key_header` is the `Idempotency-Key` header's text, if sent.
    pub async fn send(
        &self,
        caller: &Caller,
        value: &Value,
        key_header: Option<&str>,
    ) -> Result<Sent, Refused> {
        let message = validate(value).map_err(Refused::Invalid)?;
        let mut remembered_as = None;
        let held = match header_key(key_header)? {
            None => None,
            Some(key) => {
                let hash = request_hash(value);
                match self.hold_key(caller, &key, &hash).await? {
                    Hold::Replay(stored) => {
                        return Ok(Sent::Replayed {
                            id: stored.message_id,
                            status: stored.status_code,
                            body: stored.response_body,
                        });
                    }
                    Hold::Fresh(held) => {
                        remembered_as = Some((key, hash));
                        Some(held)
                    }
                }
            }
        };
        let message = self.resolve(caller, message).await?;
        let mut prepared = prepare(caller, message, remembered_as, self.links.as_deref())?;
        if let Some(held) = &held {
            prepared.claimed_as(held.token());
        }
        let charge = self.admit_and_claim(caller, &prepared).await?;
        let (entry, mut handed) = prepared.into_parts(self.outbox.is_some());
        match self.write_durably(vec![entry], Vec::from_iter(held)).await {
            Ok(()) => {}
            Err(NotWritten::Failed(failed)) => {
                self.release(caller, &charge).await;
                self.free_files(&handed).await;
                return Err(Refused::Unavailable {
                    detail: "The message could not be queued durably; nothing was accepted.".into(),
                    retry_after: failed.retry_after,
                });
            }
            Err(NotWritten::Late) => return Err(late()),
        }
        self.hand_to_lane(&mut handed);
        self.counted(&handed);
        Ok(Sent::Accepted {
            id: handed.id,
            body: handed.answer_body,
            rate: charge.info,
        })
    }

    /// Holds `key` (see [`hold`]) within `server.accept_deadline_ms`: a
    /// stalled store must not hold the request past it. A claim that was
    /// still under way when the deadline passed may have been written; it
    /// then answers 409 until it goes stale, never a second message.
    async fn hold_key(&self, caller: &Caller, key: &str, hash: &str) -> Result<Hold, Refused> {
        let scope = caller.scope();
        let holding = hold(&self.in_flight, &self.db, &scope, key, hash);
        match tokio::time::timeout(self.accept_deadline, holding).await {
            Ok(held) => held,
            Err(_) => {
                metrics::counter!(names::REJECTED_TOTAL, "reason" => "deadline").increment(1);
                tracing::warn!(
                    deadline_ms = self.accept_deadline.as_millis() as u64,
                    "Claiming a send's Idempotency-Key did not finish within the accept deadline; answered 503."
                );
                Err(late())
            }
        }
    }

    /// Hands `entries` to the store writer and waits for their commit, at
    /// most `server.accept_deadline_ms`. The write goes on if the wait
    /// ends first (its commit may land later, which the answer must not
    /// deny), holding the keys `held` until it is done: a retry under
    /// one of them meanwhile is 409, and after a commit gets its answer.
    /// A failed write gives the keys' claims up.
    async fn write_durably(
        &self,
        entries: Vec<AcceptEntry>,
        held: Vec<HeldKey>,
    ) -> Result<(), NotWritten> {
        let waiting = durable_wait_span(entries.len());
        let trace = crate::telemetry::span_context(&waiting);
        let mut entries = entries;
        for entry in &mut entries {
            entry.trace = trace.clone();
        }
        let writer = self.writer.clone();
        let write = tokio::spawn(
            async move {
                let committed = writer.accept_all(entries).await;
                if committed.is_ok() {
                    held.into_iter().for_each(HeldKey::keep);
                }
                committed
            }
            .instrument(waiting),
        );
        match tokio::time::timeout(self.accept_deadline, write).await {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(failed))) => Err(NotWritten::Failed(failed)),
            Ok(Err(join)) => {
                tracing::error!(error = %join, "The durable write's task failed.");
                Err(NotWritten::Failed(crate::store::NotDurable {
                    retry_after: self.writer.retry_after(),
                }))
            }
            Err(_) => {
                metrics::counter!(names::REJECTED_TOTAL, "reason" => "deadline").increment(1);
                tracing::warn!(
                    deadline_ms = self.accept_deadline.as_millis() as u64,
                    "A send's durable write did not finish within the accept deadline; answered 503, the write goes on."
                );
                Err(NotWritten::Late)
            }
        }
    }

    /// Accepts a batch (`body`, the JSON text `{"messages": [...]}`): each
    /// message validated, rate-limited and charged on its own, in turn
    /// (see [`batch`] for what that costs), the accepted ones made durable
    /// in one transaction. `render` writes the answer's body from the
    /// items, once; with a batch key, the answer is remembered with the
    /// batch.
    pub async fn send_batch(
        &self,
        caller: &Caller,
        body: &[u8],
        key_header: Option<&str>,
        render: impl Fn(&[BatchItem]) -> anyhow::Result<String>,
    ) -> Result<BatchSent, Refused> {
        let tenant_id = caller.tenant.id.as_str();
        let _slot: BatchSlot = self.batches.take(tenant_id).inspect_err(|_| {
            metrics::counter!(names::REJECTED_TOTAL, "reason" => "batches").increment(1);
        })?;
        let items = batch::items(body)?;
        let mut batch_key = None;
        let batch_held = match header_key(key_header)? {
            None => None,
            Some(key) => {
                let hash = batch::request_hash(&items);
                match self.hold_key(caller, &key, &hash).await? {
                    Hold::Replay(stored) => return Ok(BatchSent::Replayed(stored.response_body)),
                    Hold::Fresh(held) => {
                        batch_key = Some((key, hash));
                        Some(held)
                    }
                }
            }
        };

        // Each item: validated, replayed, or admitted and prepared.
        let mut results: Vec<BatchItem> = Vec::with_capacity(items.len());
        let mut admitted = Vec::new();
        let mut item_guards = Vec::new();
        for (index, item) in items.iter().enumerate() {
            match self.admit_item(caller, item).await {
                Ok(Admitted::Replayed(answer)) => results.push(BatchItem::Accepted {
                    answer,
                    replayed: true,
                }),
                Ok(Admitted::Ready(prepared, grant, guard)) => {
                    results.push(BatchItem::Accepted {
                        answer: prepared.answer.clone(),
                        replayed: false,
                    });
                    item_guards.extend(guard);
                    admitted.push((index, *prepared, grant));
                }
                Err(refused) => results.push(refused_item(refused)),
            }
        }

        // The answer as it will read if every admitted message is accepted;
        // remembered under the batch's key in the same transaction.
        let answer_body = render(&results)?;
        let sqs = self.outbox.is_some();
        let (mut entries, admitted): (Vec<AcceptEntry>, Vec<_>) = admitted
            .into_iter()
            .map(|(index, prepared, grant)| {
                let (entry, handed) = prepared.into_parts(sqs);
                (entry, (index, handed, grant))
            })
            .unzip();
        if let (Some((key, request_hash)), Some(first)) = (batch_key.clone(), entries.first_mut()) {
            first.idempotency.push(remembered_answers::StoredResponse {
                tenant_id: tenant_id.to_owned(),
                test: caller.test,
                key,
                request_hash,
                status_code: 200,
                response_body: answer_body.clone(),
                message_id: first.record.id.clone(),
                created_at: now_ms(),
                claimed_as: batch_held.as_ref().and_then(HeldKey::token),
            });
        }
        item_guards.extend(batch_held);
        match self.write_durably(entries, item_guards).await {
            Ok(()) => {}
            Err(NotWritten::Failed(failed)) => {
                for (_, handed, charge) in &admitted {
                    self.release(caller, charge).await;
                    self.free_files(handed).await;
                }
                return Err(Refused::Unavailable {
                    detail: "The batch could not be queued durably; nothing was accepted.".into(),
                    retry_after: failed.retry_after,
                });
            }
            Err(NotWritten::Late) => return Err(late()),
        }

        for (_, mut handed, _) in admitted {
            self.hand_to_lane(&mut handed);
            self.counted(&handed);
        }
        Ok(BatchSent::Answered(answer_body))
    }

    /// One item of a batch through the single send's checks, in its order;
    /// parsed here and dropped when done.
    async fn admit_item(&self, caller: &Caller, item: &RawValue) -> Result<Admitted, Refused> {
        batch::refuse_oversized(item)?;
        let mut item: Value = serde_json::from_str(item.get()).map_err(anyhow::Error::from)?;
        let key = match &mut item {
            Value::Object(object) => match object.remove("idempotency_key") {
                None | Some(Value::Null) => None,
                Some(Value::String(key)) if is_valid_key(&key) => Some(key),
                Some(_) => {
                    return Err(Refused::field(
                        "idempotency_key",
                        format!("must be 1-{MAX_KEY_LEN} visible ASCII characters"),
                    ));
                }
            },
            _ => None,
        };
        let message = validate(&item).map_err(Refused::Invalid)?;
        let (remembered_as, held) = match key {
            None => (None, None),
            Some(key) => {
                let hash = request_hash(&item);
                match self.hold_key(caller, &key, &hash).await? {
                    Hold::Replay(stored) => {
                        let answer: SendAccepted = serde_json::from_str(&stored.response_body)
                            .map_err(anyhow::Error::from)?;
                        return Ok(Admitted::Replayed(answer));
                    }
                    Hold::Fresh(held) => (Some((key, hash)), Some(held)),
                }
            }
        };
        drop(item);
        let message = self.resolve(caller, message).await?;
        let mut prepared = prepare(caller, message, remembered_as, self.links.as_deref())?;
        if let Some(held) = &held {
            prepared.claimed_as(held.token());
        }
        let charge = self.admit_and_claim(caller, &prepared).await?;
        Ok(Admitted::Ready(Box::new(prepared), charge, held))
    }

    /// [`Self::admit`], then the uses of the uploaded files the message
    /// carries (all or none), so that the consumer reads their bytes by
    /// them even once the files expire or are deleted; a use refused (a
    /// file expired or deleted meanwhile) gives the charge back.
    async fn admit_and_claim(
        &self,
        caller: &Caller,
        prepared: &Prepared,
    ) -> Result<Grant, Refused> {
        let charge = self
            .admit(caller, prepared.lane, prepared.recipients)
            .await?;
        if prepared.attachments.is_empty() {
            return Ok(charge);
        }
        let used = self
            .db
            .use_attachments(
                &caller.scope(),
                &prepared.attachments,
                &prepared.id,
                now_ms(),
            )
            .await;
        match used {
            Ok(Ok(())) => Ok(charge),
            Ok(Err(not)) => {
                self.release(caller, &charge).await;
                let index = prepared
                    .attachments
                    .iter()
                    .position(|id| not.ids.contains(id))
                    .unwrap_or(0);
                Err(Refused::field(
                    &format!("attachments[{index}]"),
                    "the file expired or was deleted meanwhile; upload it again to send it",
                ))
            }
            Err(err) => {
                self.release(caller, &charge).await;
                Err(err.into())
            }
        }
    }

    /// Drops the uses of files of a message whose accept did not commit;
    /// the stale-file sweep drops them if this fails.
    async fn free_files(&self, handed: &Handed) {
        if !handed.files {
            return;
        }
        if let Err(err) = self.db.release_attachments(&handed.id).await {
            tracing::warn!(error = %err, message_id = %handed.id, "could not free the files of a send that was not accepted");
        }
    }

    /// A validated send made ready for [`prepare`]: rendered once if it is
    /// by template, and its copies to suppressed addresses dropped.
    async fn resolve(&self, caller: &Caller, message: NewMessage) -> Result<NewMessage, Refused> {
        let mut message = self.with_template(caller, message).await?;
        self.drop_suppressed_copies(caller, &mut message).await?;
        self.with_files(caller, &mut message).await?;
        Ok(message)
    }

    /// The files an email names, each found among the caller's uploads
    /// (its world's: a test key's uploads are not a live key's), neither
    /// deleted nor expired, and together within
    /// [`crate::attachments::MAX_TOTAL_BYTES`]: their names, types and
    /// sizes filled in.
    async fn with_files(&self, caller: &Caller, message: &mut NewMessage) -> Result<(), Refused> {
        if message.attachments.is_empty() {
            return Ok(());
        }
        let ids: Vec<String> = message.attachments.iter().map(|f| f.id.clone()).collect();
        let mut found: std::collections::HashMap<String, _> = self
            .db
            .attachments_in(&caller.scope(), &ids)
            .await?
            .into_iter()
            .map(|row| (row.id.clone(), row))
            .collect();
        let mut total = 0i64;
        let now = now_ms();
        for (index, file) in message.attachments.iter_mut().enumerate() {
            let field = format!("attachments[{index}]");
            let Some(row) = found.remove(&file.id) else {
                return Err(Refused::field(
                    &field,
                    "no uploaded file of the tenant has this id (a test key's uploads and a live key's are apart), or it was deleted",
                ));
            };
            if row.expires_at <= now {
                return Err(Refused::field(
                    &field,
                    format!(
                        "the file expired at {}; upload it again to send it",
                        crate::model::ms_to_rfc3339(row.expires_at)
                    ),
                ));
            }
            total += row.size;
            file.filename = row.filename;
            file.content_type = row.content_type;
            file.size = row.size;
        }
        if total > crate::attachments::MAX_TOTAL_BYTES {
            return Err(Refused::field(
                "attachments",
                format!(
                    "the files come to {total} bytes; an email may carry at most {}",
                    crate::attachments::MAX_TOTAL_BYTES
                ),
            ));
        }
        Ok(())
    }

    /// Drops the `cc` and `bcc` addresses on the tenant's suppression
    /// list, noting them for the answer; the `to` address is checked at
    /// delivery, as for any send.
    async fn drop_suppressed_copies(
        &self,
        caller: &Caller,
        message: &mut NewMessage,
    ) -> Result<(), Refused> {
        for list in [&mut message.cc, &mut message.bcc] {
            let mut kept = Vec::with_capacity(list.len());
            for address in list.drain(..) {
                let normalized = crate::store::suppressions::normalize(&address)
                    .map_or_else(|| address.to_lowercase(), |(_, to)| to);
                if self
                    .db
                    .is_suppressed(&caller.tenant.id, &normalized)
                    .await?
                {
                    message.suppressed.push(address);
                } else {
                    kept.push(address);
                }
            }
            *list = kept;
        }
        Ok(())
    }

    /// A send by template resolved against the tenant's templates: the
    /// version (the newest unless named), the locale's variant, the
    /// personalisation checked by rendering it once (the rendered text
    /// kept for an SMS's fragment count, not queued), and the template's
    /// priority and lane applied. Any other send as it is.
    async fn with_template(
        &self,
        caller: &Caller,
        mut message: NewMessage,
    ) -> Result<NewMessage, Refused> {
        let Some(asked) = message.template.as_mut() else {
            return Ok(message);
        };
        let found = self
            .templates
            .for_send(&caller.tenant.id, &asked.id, asked.version)
            .await?;
        let Some(version) = found else {
            return Err(match asked.version {
                Some(n) => Refused::field(
                    "template_version",
                    format!("template {:?} has no version {n}", asked.id),
                ),
                None => Refused::field("template_id", "no template of the tenant has this id"),
            });
        };
        let content = &version.content;
        if content.channel != message.channel {
            return Err(Refused::field(
                "template_id",
                format!(
                    "is an {} template; the send's channel is {}",
                    content.channel, message.channel
                ),
            ));
        }
        let rendered = content
            .render(asked.locale.as_deref(), &asked.personalisation)
            .map_err(Refused::Invalid)?;
        asked.version = Some(version.number);
        asked.locale = rendered.locale;
        message.text = rendered.text;
        if let Some(priority) = content.priority {
            message.priority = priority;
        }
        message.lane = content.lane;
        Ok(message)
    }

    /// The lane's high-water mark, then the tenant's rate and daily quota
    /// for all `recipients` at once (an email with copies counts each
    /// address, as SES counts recipients against its own sending rate): a
    /// refusal charges nothing, and a send
    /// with more recipients than the plan's burst, which could never pass,
    /// is a 422 rather than a 429 that no wait would end. Every charge is
    /// taken here and given back by [`Self::release`].
    async fn admit(
        &self,
        caller: &Caller,
        lane: Lane,
        recipients: usize,
    ) -> Result<Grant, Refused> {
        let units = u32::try_from(recipients).unwrap_or(u32::MAX).max(1);
        if units > caller.plan.burst {
            return Err(Refused::field(
                "to",
                format!(
                    "the email has {units} recipients (to, cc and bcc together) and plan {:?} lets at most {} go at once (its burst); send it as several emails",
                    caller.plan.name, caller.plan.burst
                ),
            ));
        }
        self.admit_units(caller, lane, units).await
    }

    /// Gives back what a charge took when its send was not accepted: its
    /// units in the tenant's bucket and of the day's quota.
    async fn release(&self, caller: &Caller, charge: &Grant) {
        self.limits.release(&caller.scope(), charge).await;
    }

    /// [`Self::admit`] past its check of the burst.
    async fn admit_units(&self, caller: &Caller, lane: Lane, units: u32) -> Result<Grant, Refused> {
        if let Err(full) = self.backpressure.check(lane) {
            metrics::counter!(names::REJECTED_TOTAL, "reason" => "lane").increment(1);
            return Err(Refused::Limited {
                reason: LimitReason::Lane,
                detail: format!(
                    "Lane {} holds about {} messages not yet delivered, at or above its high-water mark of {}.",
                    full.lane, full.backlog, full.high_water_mark
                ),
                retry_after: full.retry_after,
                rate: None,
            });
        }
        match self
            .limits
            .admit(&caller.scope(), &caller.plan, units)
            .await?
        {
            Ok(grant) => Ok(grant),
            Err(Refusal::Rate { retry_after, info }) => {
                metrics::counter!(names::REJECTED_TOTAL, "reason" => "rate").increment(1);
                Err(Refused::Limited {
                    reason: LimitReason::Rate,
                    detail: format!(
                        "Plan {:?} allows {} messages per second with bursts of {}.",
                        caller.plan.name, caller.plan.rate_per_second, caller.plan.burst
                    ),
                    retry_after,
                    rate: Some(info),
                })
            }
            Err(Refusal::Quota { retry_after, quota }) => {
                metrics::counter!(names::REJECTED_TOTAL, "reason" => "quota").increment(1);
                Err(Refused::Limited {
                    reason: LimitReason::Quota,
                    detail: if units == 1 {
                        format!(
                            "The daily quota of {quota} messages is used up; it renews at 00:00 UTC."
                        )
                    } else {
                        format!(
                            "The daily quota of {quota} messages has fewer than the {units} this email's recipients need left; it renews at 00:00 UTC."
                        )
                    },
                    retry_after,
                    rate: None,
                })
            }
        }
    }

    /// SQS mode: hands a committed message to the relay, which sends it
    /// to its lane (a scheduled one waits for the scheduler instead).
    fn hand_to_lane(&self, handed: &mut Handed) {
        if let (Some(outbox), Some(message)) = (&self.outbox, handed.to_send.take()) {
            outbox.hand(handed.lane, message);
        }
    }

    fn counted(&self, handed: &Handed) {
        tracing::debug!(message_id = %handed.id, tenant = %handed.tenant_id, channel = handed.channel.as_str(), lane = handed.lane.as_str(), "Message accepted.");
        self.backpressure.record_accepted(handed.lane, 1);
        metrics::counter!(names::ACCEPTED_TOTAL, "lane" => handed.lane.as_str(), "channel" => handed.channel.as_str())
            .increment(1);
    }
}

/// Why [`Acceptor::write_durably`] did not see its commit.
enum NotWritten {
    /// The write failed: nothing of it is durable.
    Failed(crate::store::NotDurable),
    /// The deadline passed first; the write goes on and may still commit.
    Late,
}

/// The 503 of a send whose write outlived the accept deadline. What a
/// client may conclude (the book's "Errors and idempotency"): the message
/// may or may not be accepted, and a retry under the same Idempotency-Key
/// is safe, answered 409 until the write has ended, then with the message
/// if it committed.
fn late() -> Refused {
    Refused::Unavailable {
        detail: "The store did not confirm the message within the accept deadline; it may still be accepted. Retry with the same Idempotency-Key: the retry is answered with this message if it was accepted, and accepts it otherwise.".into(),
        retry_after: idempotency::IN_FLIGHT_RETRY,
    }
}

/// The span of a request waiting for its messages' group commit; the
/// group's span links to it.
fn durable_wait_span(messages: usize) -> tracing::Span {
    crate::telemetry::span!(
        "wait for the durable write",
        fairlane.messages = messages as u64
    )
}

/// A batch item past its checks.
enum Admitted {
    /// The stored answer to an earlier send with the item's key.
    Replayed(SendAccepted),
    /// To be made durable, with its limit grant and the hold on its key.
    Ready(Box<Prepared>, Grant, Option<HeldKey>),
}

/// A refused batch item; an internal failure is logged here, once.
fn refused_item(refused: Refused) -> BatchItem {
    match &refused {
        Refused::Internal(err) => {
            tracing::error!(error = %format!("{err:#}"), "A batch item failed with an internal error.");
        }
        Refused::Store(err) => {
            tracing::error!(error = %format!("{err:#}"), "A batch item failed in the store.");
        }
        _ => {}
    }
    BatchItem::Refused(refused)
}
