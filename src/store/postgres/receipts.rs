//! Provider receipts on PostgreSQL: a whole group of receipts recorded
//! in a few multi-row statements (SQLite records them one at a time in its
//! writer, `store::sqlite::receipts::apply_in`). What a receipt does to a message
//! is decided once, in `store::receipts`, for both.

use crate::store::StoreResult;
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};

use super::PgDb;
use crate::model::MessageStatus;
use crate::store::receipts::{
    Applied, Decision, KeptReceipt, Receipt, ReceiptStore, decide, error_after, rank,
    recipient_upsert_tail, reported_recipients, suppress_reason, to_suppress,
};

/// What the group's pass decided for one receipt before its rows are
/// written.
enum Plan {
    Unmatched,
    /// The message `found[message]` has had this report already.
    Duplicate {
        message: usize,
    },
    /// Record the event for message `found[message]`; `check` when it moves
    /// nothing, so an earlier record of the same event makes it a replay.
    Record {
        message: usize,
        decision: Decision,
        check: bool,
    },
}

/// A message a group's receipts name, with its status as the group's
/// earlier receipts left it.
struct Found {
    id: String,
    tenant_id: String,
    status: MessageStatus,
    attempts: i64,
    sent_at: Option<i64>,
}

/// The messages `receipts` name by provider and provider id, and where
/// each one is in that list. A message matches a receipt only when the
/// receipt's provider sent it (or when the message records no provider: it
/// was sent before fairlane recorded one). Two messages with one provider
/// id: the first found, as a single receipt's `LIMIT 1` would.
async fn find_by_provider_id(
    tx: &mut sqlx::PgConnection,
    receipts: &[&Receipt],
) -> anyhow::Result<(Vec<Found>, HashMap<(String, String), usize>)> {
    let provider_ids: Vec<&str> = receipts
        .iter()
        .map(|receipt| receipt.provider_message_id.as_str())
        .collect();
    let providers: Vec<&str> = receipts
        .iter()
        .map(|receipt| receipt.provider.as_str())
        .collect();
    let message_ids: Vec<Option<&str>> = receipts
        .iter()
        .map(|receipt| receipt.message_id.as_deref())
        .collect();
    type Row = (String, String, String, i64, String, Option<i64>, String);
    // By fairlane's id where the provider carried it back (the key, and
    // the provider's id must be the one recorded); by the provider's id
    // where it did not, among the messages sent before receipts carried
    // fairlane's id (the only ones its index holds).
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT m.id, m.tenant_id, m.status, m.attempts, m.provider_message_id, m.sent_at, r.provider \
         FROM UNNEST($1::text[], $2::text[], $3::text[]) AS r(provider_id, provider, message_id) \
         JOIN messages AS m ON m.id = r.message_id AND m.provider_message_id = r.provider_id \
         AND (m.provider = r.provider OR m.provider IS NULL) \
         UNION ALL \
         SELECT m.id, m.tenant_id, m.status, m.attempts, m.provider_message_id, m.sent_at, r.provider \
         FROM UNNEST($1::text[], $2::text[], $3::text[]) AS r(provider_id, provider, message_id) \
         JOIN messages AS m ON r.message_id IS NULL AND m.provider_message_id = r.provider_id \
         AND m.receipt_by_id IS NULL AND (m.provider = r.provider OR m.provider IS NULL)",
    )
    .bind(&provider_ids)
    .bind(&providers)
    .bind(&message_ids)
    .fetch_all(&mut *tx)
    .await?;
    let mut found = Vec::with_capacity(rows.len());
    let mut by_provider_id = HashMap::with_capacity(rows.len());
    for (id, tenant_id, status, attempts, provider_id, sent_at, provider) in rows {
        if let Entry::Vacant(slot) = by_provider_id.entry((provider, provider_id)) {
            slot.insert(found.len());
            found.push(Found {
                id,
                tenant_id,
                status: status.parse().map_err(anyhow::Error::msg)?,
                attempts,
                sent_at,
            });
        }
    }
    Ok((found, by_provider_id))
}

/// Of the receipts `plans` would record with a replay check, those whose
/// event the message already has from before this group (by index), in
/// one statement.
async fn seen_before(
    tx: &mut sqlx::PgConnection,
    receipts: &[&Receipt],
    plans: &[Plan],
    found: &[Found],
) -> anyhow::Result<HashSet<i64>> {
    let (mut ask_index, mut ask_id, mut ask_event, mut ask_detail) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (index, plan) in plans.iter().enumerate() {
        if let Plan::Record {
            message,
            decision,
            check: true,
        } = plan
        {
            ask_index.push(index as i64);
            ask_id.push(found[*message].id.as_str());
            ask_event.push(decision.event.as_str());
            ask_detail.push(receipts[index].detail.as_deref());
        }
    }
    Ok(if ask_index.is_empty() {
        HashSet::new()
    } else {
        sqlx::query_scalar::<_, i64>(
            "SELECT u.i FROM UNNEST($1::bigint[], $2::text[], $3::text[], $4::text[]) \
             AS u(i, id, event, detail) WHERE EXISTS (SELECT 1 FROM message_events AS e \
             WHERE e.message_id = u.id AND e.event = u.event \
             AND e.detail IS NOT DISTINCT FROM u.detail)",
        )
        .bind(&ask_index)
        .bind(&ask_id)
        .bind(&ask_event)
        .bind(&ask_detail)
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .collect()
    })
}

/// Decides each receipt of a group in order against the statuses its
/// messages reach as the group goes (`found` moves with them).
fn plan_receipts(
    receipts: &[&Receipt],
    by_provider_id: &HashMap<(String, String), usize>,
    found: &mut [Found],
) -> Vec<Plan> {
    let mut plans = Vec::with_capacity(receipts.len());
    for receipt in receipts {
        let key = (
            receipt.provider.clone(),
            receipt.provider_message_id.clone(),
        );
        let Some(&message) = by_provider_id.get(&key) else {
            plans.push(Plan::Unmatched);
            continue;
        };
        let decision = decide(receipt, found[message].status);
        if decision.duplicate {
            plans.push(Plan::Duplicate { message });
            continue;
        }
        if let Some(outcome) = decision.moves {
            found[message].status = outcome;
        }
        let check = decision.check_seen;
        plans.push(Plan::Record {
            message,
            decision,
            check,
        });
    }
    plans
}

/// Records a group's `receipts` against their messages in PostgreSQL's
/// transaction `tx` (the group writer's, so receipts do not commit alone),
/// in at most five statements whatever the group's size: find the
/// messages, look for replays, move the statuses, insert the events (with
/// their webhook calls, [`super::lifecycle`]) and add the suppressions. Each
/// receipt is decided in order, as if applied one after another: a second
/// report on the same message sees what the first did. [`apply_in`] is
/// SQLite's, one receipt at a time.
pub(crate) async fn apply_group(
    tx: &mut sqlx::PgConnection,
    receipts: &[&Receipt],
    now: i64,
) -> anyhow::Result<Vec<Applied>> {
    if receipts.is_empty() {
        return Ok(Vec::new());
    }
    let (mut found, by_provider_id) = find_by_provider_id(&mut *tx, receipts).await?;

    let plans = plan_receipts(receipts, &by_provider_id, &mut found);
    let seen_before = seen_before(&mut *tx, receipts, &plans, &found).await?;
    let recipients_moved = upsert_recipients(&mut *tx, receipts, &plans, &found, now).await?;

    let mut recorded: HashSet<(usize, &str, Option<&str>)> = HashSet::new();
    let mut moves: HashMap<usize, (MessageStatus, Option<String>)> = HashMap::new();
    let mut events = EventColumns::default();
    let mut suppress = SuppressColumns::default();
    let mut applied = Vec::with_capacity(plans.len());
    for (index, plan) in plans.iter().enumerate() {
        let receipt = receipts[index];
        // A report the message has already had may still be news for one
        // of its recipients (a second address delivered, another
        // complaining): no event, the recipient's status and suppression
        // only.
        let mut recipients_only = |message: usize| {
            if !recipients_moved.contains(&index) {
                return Applied::Duplicate;
            }
            let target = &found[message];
            for (channel, address) in to_suppress(receipt) {
                suppress.push(target, address, channel, receipt, now);
            }
            Applied::Matched {
                message_id: target.id.clone(),
                tenant_id: target.tenant_id.clone(),
                changed: false,
                sent_at: target.sent_at,
            }
        };
        let (message, decision, check) = match plan {
            Plan::Unmatched => {
                applied.push(Applied::Unmatched);
                continue;
            }
            Plan::Duplicate { message } => {
                applied.push(recipients_only(*message));
                continue;
            }
            Plan::Record {
                message,
                decision,
                check,
            } => (*message, decision, *check),
        };
        let key = (message, decision.event.as_str(), receipt.detail.as_deref());
        let replay = check && (seen_before.contains(&(index as i64)) || recorded.contains(&key));
        if replay {
            applied.push(recipients_only(message));
            continue;
        }
        recorded.insert(key);
        let target = &found[message];
        if let Some(outcome) = decision.moves {
            // The last move of a message in the group is the one that stays.
            moves.insert(message, (outcome, error_after(receipt, outcome)));
        }
        events.push(target, now, decision, receipt);
        for (channel, address) in to_suppress(receipt) {
            suppress.push(target, address, channel, receipt, now);
        }
        applied.push(Applied::Matched {
            message_id: target.id.clone(),
            tenant_id: target.tenant_id.clone(),
            changed: decision.moves.is_some(),
            sent_at: target.sent_at,
        });
    }

    if !moves.is_empty() {
        let (mut ids, mut outcomes, mut errors) = (Vec::new(), Vec::new(), Vec::new());
        for (message, (status, error)) in moves {
            ids.push(found[message].id.as_str());
            outcomes.push(status);
            errors.push(error);
        }
        super::lifecycle::receipts(&mut *tx, &ids, &outcomes, &errors, now).await?;
    }
    super::lifecycle::events(&mut *tx, &events.0).await?;
    suppress.insert(&mut *tx).await?;
    Ok(applied)
}

/// Records the statuses of the recipients a group's matched receipts name,
/// in one statement ([`recipient_upsert_tail`]); answers the receipts (by
/// index) that moved at least one recipient. A recipient named twice in
/// the group keeps the report that ranks higher (the later of equals), as
/// if the reports were applied one after another.
async fn upsert_recipients(
    tx: &mut sqlx::PgConnection,
    receipts: &[&Receipt],
    plans: &[Plan],
    found: &[Found],
    now: i64,
) -> anyhow::Result<HashSet<usize>> {
    // A report without an outcome (a delay, a transient bounce) ranks 0.
    let ranked = |receipt: &Receipt| receipt.outcome.and_then(rank).unwrap_or(0);
    let mut chosen: HashMap<(usize, String), (usize, Option<&str>)> = HashMap::new();
    for (index, plan) in plans.iter().enumerate() {
        let (Plan::Duplicate { message } | Plan::Record { message, .. }) = plan else {
            continue;
        };
        let receipt = receipts[index];
        let new_rank = ranked(receipt);
        for (address, detail) in reported_recipients(receipt) {
            match chosen.entry((*message, address)) {
                Entry::Occupied(mut slot) => {
                    if new_rank >= ranked(receipts[slot.get().0]) {
                        slot.insert((index, detail));
                    }
                }
                Entry::Vacant(slot) => {
                    slot.insert((index, detail));
                }
            }
        }
    }
    if chosen.is_empty() {
        return Ok(HashSet::new());
    }
    let mut rows = RecipientColumns::default();
    let mut by_row: HashMap<(&str, &str), usize> = HashMap::new();
    for ((message, address), (index, detail)) in &chosen {
        let target = &found[*message];
        rows.message_id.push(target.id.as_str());
        rows.address.push(address.as_str());
        rows.tenant_id.push(target.tenant_id.as_str());
        rows.status.push(receipts[*index].recipient_status());
        rows.detail.push(*detail);
        rows.updated_at.push(now);
        by_row.insert((target.id.as_str(), address.as_str()), *index);
    }
    let sql = format!(
        "INSERT INTO recipient_statuses (message_id, address, tenant_id, status, detail, \
         updated_at) SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], \
         $5::text[], $6::bigint[]) {} RETURNING message_id, address",
        recipient_upsert_tail("IS DISTINCT FROM")
    );
    let moved: Vec<(String, String)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(&rows.message_id)
        .bind(&rows.address)
        .bind(&rows.tenant_id)
        .bind(&rows.status)
        .bind(&rows.detail)
        .bind(&rows.updated_at)
        .fetch_all(&mut *tx)
        .await?;
    Ok(moved
        .iter()
        .filter_map(|(id, address)| by_row.get(&(id.as_str(), address.as_str())).copied())
        .collect())
}

/// The recipient status rows of a group's receipts, column by column.
#[derive(Default)]
struct RecipientColumns<'a> {
    message_id: Vec<&'a str>,
    address: Vec<&'a str>,
    tenant_id: Vec<&'a str>,
    status: Vec<&'a str>,
    detail: Vec<Option<&'a str>>,
    updated_at: Vec<i64>,
}

/// The event rows of a group's receipts.
#[derive(Default)]
struct EventColumns(super::lifecycle::EventColumns);

impl EventColumns {
    fn push(&mut self, message: &Found, now: i64, decision: &Decision, receipt: &Receipt) {
        let rows = &mut self.0;
        rows.message_id.push(message.id.clone());
        rows.tenant_id.push(message.tenant_id.clone());
        rows.at.push(now);
        rows.event.push(decision.event.clone());
        rows.status.push(decision.after.as_str());
        rows.attempts.push(message.attempts);
        rows.detail.push(receipt.detail.clone());
        rows.provider_message_id
            .push(receipt.provider_message_id.clone());
    }
}

/// The suppression rows of a group's receipts, column by column.
#[derive(Default)]
struct SuppressColumns {
    tenant_id: Vec<String>,
    address: Vec<String>,
    channel: Vec<&'static str>,
    reason: Vec<String>,
    detail: Vec<Option<String>>,
    message_id: Vec<String>,
    created_at: Vec<i64>,
}

impl SuppressColumns {
    fn push(
        &mut self,
        message: &Found,
        address: String,
        channel: crate::model::Channel,
        receipt: &Receipt,
        now: i64,
    ) {
        self.tenant_id.push(message.tenant_id.clone());
        self.address.push(address);
        self.channel.push(channel.as_str());
        self.reason.push(suppress_reason(receipt).to_owned());
        self.detail.push(receipt.detail.clone());
        self.message_id.push(message.id.clone());
        self.created_at.push(now);
    }

    /// One insert; an address listed before (or twice in the group) keeps
    /// its first entry.
    async fn insert(&self, tx: &mut sqlx::PgConnection) -> anyhow::Result<()> {
        if self.address.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "INSERT INTO suppressions (tenant_id, address, channel, reason, detail, message_id, \
             created_at) \
             SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], \
             $6::text[], $7::bigint[]) ON CONFLICT (tenant_id, address) DO NOTHING",
        )
        .bind(&self.tenant_id)
        .bind(&self.address)
        .bind(&self.channel)
        .bind(&self.reason)
        .bind(&self.detail)
        .bind(&self.message_id)
        .bind(&self.created_at)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

#[async_trait::async_trait]
impl ReceiptStore for PgDb {
    async fn keep_receipt(
        &self,
        receipt: &Receipt,
        json: &str,
        next_try_at: i64,
    ) -> StoreResult<()> {
        const KEEP: &str = "INSERT INTO pending_receipts \
             (provider, provider_message_id, receipt, received_at, next_try_at, tries) \
             VALUES ($1, $2, $3, $4, $5, 0)";
        sqlx::query(KEEP)
            .bind(&receipt.provider)
            .bind(&receipt.provider_message_id)
            .bind(json)
            .bind(crate::model::now_ms())
            .bind(next_try_at)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn kept_receipts_due(&self, now: i64, limit: i64) -> StoreResult<Vec<KeptReceipt>> {
        const DUE: &str = "SELECT id, receipt, received_at, tries FROM pending_receipts \
             WHERE next_try_at <= $1 ORDER BY next_try_at LIMIT $2";
        Ok(sqlx::query_as(DUE)
            .bind(now)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?)
    }

    async fn settle_kept_receipt(&self, row: i64, done: bool, next: i64) -> StoreResult<()> {
        if done {
            sqlx::query("DELETE FROM pending_receipts WHERE id = $1")
                .bind(row)
                .execute(&self.pool)
                .await?;
        } else {
            sqlx::query(
                "UPDATE pending_receipts SET tries = tries + 1, next_try_at = $1 WHERE id = $2",
            )
            .bind(next)
            .bind(row)
            .execute(&self.pool)
            .await?;
        }
        Ok(())
    }
}
