//! The console's pages: each reads what the admin API's route of the same
//! view reads, and renders it.

use std::collections::{BTreeMap, HashMap};

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;

use super::session::Session;
use super::{bar, page};
use crate::api::error::ApiError;
use crate::api::{ApiPath, AppState};
use crate::model::{Lane, MessageStatus, Scope, TenantStatus, World, ms_to_rfc3339, now_ms};
use crate::store::admins::AuditQuery;
use crate::store::events::EventRecord;
use crate::store::lifecycle::REDRIVEN;
use crate::store::messages::ListFilter;
use crate::store::usage::{UsageRow, Whose};
use crate::store::webhooks::CallsOf;

/// Rows of a message search page.
const SEARCH_ROWS: i64 = 50;
/// Audit entries on its page.
const AUDIT_ROWS: u32 = 100;
/// Failed webhook calls on a message's timeline.
const TIMELINE_CALL_ROWS: i64 = 100;
/// Dead letters listed per lane.
const DEAD_LETTER_ROWS: usize = 100;

/// What a tenant's live messages reached over some days.
#[derive(Default)]
struct Outcomes {
    accepted: i64,
    sent: i64,
    delivered: i64,
    failed: i64,
    bounced: i64,
    complained: i64,
}

impl Outcomes {
    fn add(&mut self, row: &UsageRow) {
        self.accepted += row.accepted;
        self.sent += row.sent;
        self.delivered += row.delivered;
        // A redriven dead letter is no failure any more: whatever became of
        // it next is counted where it ended.
        self.failed += row.failed + row.dead_lettered - row.redriven;
        self.bounced += row.bounced;
        self.complained += row.complained;
    }

    /// The five cells, each labelled `{when}: …` for the narrow layout.
    fn cells(&self, when: &str) -> Markup {
        let cell = |what: &str, count: i64| {
            html! { td.num data-label=(format!("{when}: {what}")) { (count) } }
        };
        html! {
            (cell("sent", self.sent)) (cell("delivered", self.delivered)) (cell("failed", self.failed))
            (cell("bounced", self.bounced)) (cell("complaints", self.complained))
        }
    }
}

/// The overview: each tenant's outcomes today and over 7 days with its
/// quota, and each lane's backlog against its high-water mark.
pub async fn overview(
    State(state): State<AppState>,
    session: Session,
) -> Result<Response, ApiError> {
    let today = now_ms() / 86_400_000;
    let rows = state.db.usage(Whose::Everyone, today - 6, today).await?;
    let mut week: BTreeMap<String, (Outcomes, Outcomes)> = BTreeMap::new();
    for row in rows.iter().filter(|row| !row.test) {
        let (day, days) = week.entry(row.tenant_id.clone()).or_default();
        days.add(row);
        if row.day == today {
            day.add(row);
        }
    }
    let mut lanes = Vec::new();
    for lane in Lane::ALL {
        let stats = state.queue.stats(*lane).await?;
        let mark = state.settings.lanes.get(*lane).high_water_mark;
        lanes.push((*lane, stats, mark));
    }
    let tenants = state.registry.tenants();
    let counts = TenantCounts::read(&state).await?;
    let now = now_ms();
    let body = html! {
        p.note {
            "Live messages by UTC day, as of " (crate::model::ms_to_rfc3339(now)) ". "
            a href="/console" { "Refresh" }
        }
        h2 { "Lanes" }
        div.box tabindex="0" { table {
            caption.skip { "Each lane's backlog against its high-water mark" }
            thead { tr { th scope="col" { "Lane" } th scope="col" { "Backlog / high-water mark" }
                th scope="col" { "In flight" } th scope="col" { "Delayed" } th scope="col" { "Held" }
                th scope="col" { "Oldest (s)" } th scope="col" { "Dead letters" } } }
            tbody { @for (lane, stats, mark) in &lanes { tr {
                th scope="row" { (lane.as_str()) }
                td { (bar(stats.backlog(), *mark)) }
                td.num { (stats.in_flight) } td.num { (stats.delayed) } td.num { (stats.held) }
                td.num { (stats.oldest_age_secs.map_or("–".to_owned(), |age| format!("{age:.0}"))) }
                td.num class=(if stats.dlq_depth > 0 { "num warn" } else { "num" }) {
                    a href="/console/dlq" { (stats.dlq_depth) } }
            } } }
        } }
        h2 { "Tenants" }
        // Too many columns for a phone: below 700 px each row is a card of
        // labelled cells (the style sheet's `table.cards`).
        div.box tabindex="0" { table.cards {
            thead {
                tr { th scope="col" rowspan="2" { "Tenant" } th scope="col" rowspan="2" { "Status" }
                    th scope="col" rowspan="2" { "Quota today" }
                    th scope="col" rowspan="2" { "Last hour (dotted: the plan's rate)" }
                    th scope="col" rowspan="2" { "Scheduled or retrying" } th scope="col" rowspan="2" { "Held" }
                    th scope="col" rowspan="2" { "At the gate" }
                    th scope="colgroup" colspan="5" { "Today" } th scope="colgroup" colspan="5" { "7 days" } }
                tr { @for _ in 0..2 { th scope="col" { "Sent" } th scope="col" { "Delivered" }
                    th scope="col" { "Failed" } th scope="col" { "Bounced" } th scope="col" { "Complaints" } } }
            }
            tbody { @for tenant in &tenants {
                @let empty = (Outcomes::default(), Outcomes::default());
                @let (day, days) = week.get(&tenant.id).unwrap_or(&empty);
                @let plan = state.registry.plan(&tenant.plan);
                @let quota = plan.as_ref().map_or(0, |plan| plan.daily_quota);
                @let per_minute = plan.as_ref().map_or(0.0, |plan| plan.rate_per_second * 60.0);
                tr {
                    th scope="row" { a href=(format!("/console/tenants/{}", tenant.id)) { (tenant.id) } }
                    td data-label="Status" class=(if tenant.status == TenantStatus::Active { "" } else { "warn" }) { (tenant.status.as_str()) }
                    td data-label="Quota today" { (bar(day.accepted.max(0) as u64, quota)) }
                    td data-label="Last hour" { (last_hour(&state.accept.last_hour().of(&tenant.id, now), per_minute)) }
                    td.num data-label="Scheduled or retrying" { (counts.delayed(&tenant.id)) }
                    td.num data-label="Held" { (counts.held(&tenant.id)) }
                    td.num data-label="At the gate" { (counts.at_gate(&tenant.id)) }
                    (day.cells("Today")) (days.cells("7 days"))
                }
            } }
        } }
    };
    Ok(page("Overview", Some(&session), body).into_response())
}

/// Per tenant: messages delayed (scheduled, or waiting for a retry),
/// held (set aside while it is paused), and waiting at the providers'
/// gates now.
struct TenantCounts {
    delayed: HashMap<String, i64>,
    /// `None`: the queue does not set messages aside (SQS).
    held: Option<HashMap<String, i64>>,
    at_gate: HashMap<std::sync::Arc<str>, usize>,
}

impl TenantCounts {
    async fn read(state: &AppState) -> Result<TenantCounts, ApiError> {
        // Scheduled messages wait in the outbox in SQS mode, in the queue
        // itself on the embedded one.
        let mut delayed: HashMap<String, i64> =
            state.db.scheduled_by_tenant().await?.into_iter().collect();
        let mut held = None;
        if let Some(waiting) = state.queue.waiting_by_tenant().await? {
            let mut by_tenant = HashMap::new();
            for (tenant, later, set_aside) in waiting {
                *delayed.entry(tenant.clone()).or_default() += later;
                by_tenant.insert(tenant, set_aside);
            }
            held = Some(by_tenant);
        }
        let mut at_gate: HashMap<std::sync::Arc<str>, usize> = HashMap::new();
        for (_, pool) in &state.providers {
            for (tenant, waiting) in pool.gate.waiting_by_tenant() {
                *at_gate.entry(tenant).or_default() += waiting;
            }
        }
        Ok(TenantCounts {
            delayed,
            held,
            at_gate,
        })
    }

    fn delayed(&self, tenant: &str) -> i64 {
        self.delayed.get(tenant).copied().unwrap_or(0)
    }

    fn held(&self, tenant: &str) -> String {
        self.held.as_ref().map_or("–".to_owned(), |held| {
            held.get(tenant).copied().unwrap_or(0).to_string()
        })
    }

    fn at_gate(&self, tenant: &str) -> usize {
        self.at_gate.get(tenant).copied().unwrap_or(0)
    }
}

/// The last hour's sends by minute as a small bar chart, against the
/// plan's rate (a line at `per_minute`), with the figures as text for a
/// screen reader.
fn last_hour(minutes: &[u32; crate::limits::last_hour::MINUTES], per_minute: f64) -> Markup {
    let total: u64 = minutes.iter().map(|n| u64::from(*n)).sum();
    let busiest = minutes.iter().copied().max().unwrap_or(0);
    let top = per_minute.max(f64::from(busiest)).max(1.0);
    let height = |n: f64| (n / top * 24.0).round();
    let limit_y = 24.0 - height(per_minute);
    let label = format!(
        "{total} sends in the last hour; the busiest minute {busiest}, against a limit of {per_minute:.0} a minute"
    );
    html! {
        svg.spark width="120" height="24" viewBox="0 0 120 24" role="img" aria-label=(label) {
            @for (age, n) in minutes.iter().enumerate() {
                @let h = height(f64::from(*n));
                rect x=(age * 2) y=(24.0 - h) width="2" height=(h) class=(if f64::from(*n) >= per_minute && *n > 0 { "high" } else { "" }) {}
            }
            line x1="0" x2="120" y1=(limit_y) y2=(limit_y) {}
        }
        " " (total)
    }
}

/// What the message search asks.
#[derive(Debug, Default, Deserialize)]
pub struct Search {
    #[serde(default)]
    id: String,
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    reference: String,
    #[serde(default)]
    recipient: String,
    #[serde(default)]
    status: String,
    #[serde(default)]
    test: Option<String>,
}

/// Message search: by id (any tenant), or a tenant's messages by
/// reference, recipient and status, newest first. A filter no index
/// serves reads at most `limits.list_scan_rows` of the tenant's newest
/// messages, as the API's list does.
pub async fn messages(
    State(state): State<AppState>,
    session: Session,
    Query(search): Query<Search>,
) -> Result<Response, ApiError> {
    let id = search.id.trim();
    if !id.is_empty() && state.db.message(id).await?.is_some() {
        return Ok(Redirect::to(&format!("/console/messages/{id}")).into_response());
    }
    let status = match search.status.as_str() {
        "" => None,
        word => Some(
            word.parse::<MessageStatus>()
                .map_err(|_| ApiError::field("status", "is not a message status"))?,
        ),
    };
    let recipient = match search.recipient.trim() {
        "" => None,
        address => Some(
            crate::store::suppressions::normalize(address)
                .map(|(_, address)| address)
                .ok_or_else(|| {
                    ApiError::field("recipient", "is not an email address or an E.164 number")
                })?,
        ),
    };
    let tenant = search.tenant.trim();
    let found = if tenant.is_empty() {
        None
    } else {
        let scope = Scope::new(tenant, World::of_test(search.test.is_some()));
        let filter = ListFilter {
            reference: Some(search.reference.trim().to_owned()).filter(|r| !r.is_empty()),
            recipient,
            status,
            ..ListFilter::default()
        };
        let scan = state.settings.limits.list_scan_rows;
        Some(
            state
                .db
                .list_messages(&scope, &filter, SEARCH_ROWS, scan)
                .await?,
        )
    };
    let body = html! {
        form method="get" action="/console/messages" role="search" {
            label for="id" { "Message id" } input id="id" name="id" value=(search.id);
            p.note { "or a tenant's messages:" }
            label for="tenant" { "Tenant" } input id="tenant" name="tenant" value=(search.tenant);
            label for="reference" { "Reference" } input id="reference" name="reference" value=(search.reference);
            label for="recipient" { "Recipient (an email address or +E.164 number)" } input id="recipient" name="recipient" value=(search.recipient);
            label for="status" { "Status" } input id="status" name="status" value=(search.status) placeholder="e.g. sent, dead_lettered";
            label { input type="checkbox" name="test" value="1" checked[search.test.is_some()]; " Test messages" }
            p { button type="submit" { "Search" } }
        }
        @if !id.is_empty() { p.warn role="status" { "No message has the id " (id) "." } }
        @if let Some(page) = &found {
            @let rows = &page.rows;
            p role="status" { (rows.len()) @if rows.len() == 1 { " message" } @else { " messages" } @if rows.len() as i64 == SEARCH_ROWS { " (the newest " (SEARCH_ROWS) ")" } "."
                @if page.scanned_to.is_some() { " The search read the tenant's newest " (state.settings.limits.list_scan_rows) " messages (limits.list_scan_rows); older ones were not searched." } }
            div.box tabindex="0" { table {
                thead { tr { th scope="col" { "Id" } th scope="col" { "Created" } th scope="col" { "Channel" }
                    th scope="col" { "Recipient" }
                    th scope="col" { "Status" } th scope="col" { "Attempts" } th scope="col" { "Reference" } } }
                tbody { @for message in rows { tr {
                    td { a href=(format!("/console/messages/{}", message.id)) { (message.id) } }
                    td { (ms_to_rfc3339(message.created_at)) } td { (message.channel.as_str()) }
                    // Erased by retention once the message settled.
                    td { (message.recipient.as_deref().unwrap_or("(erased)")) }
                    td { (message.status.as_str()) } td.num { (message.attempts) }
                    td { (message.reference.as_deref().unwrap_or("")) }
                } } }
            } }
        }
    };
    Ok(page("Messages", Some(&session), body).into_response())
}

/// One message and its timeline: every event from acceptance on.
pub async fn message(
    State(state): State<AppState>,
    session: Session,
    ApiPath(id): ApiPath<String>,
) -> Result<Markup, ApiError> {
    let missing = || ApiError::NotFound(format!("No message {id:?}."));
    // The first read only finds the message's tenant and world; its view
    // and its recipients' statuses come from one snapshot, as the status
    // poll's do (a receipt commits both together).
    let found = state.db.message(&id).await?.ok_or_else(missing)?;
    let scope = Scope::new(found.tenant_id, World::of_test(found.test));
    let (message, recipients) = state
        .db
        .message_with_recipients(&scope, &id)
        .await?
        .ok_or_else(missing)?;
    let events = state.db.message_events(&id).await?;
    let calls = state
        .db
        .failed_webhook_calls(CallsOf::Message(&id), TIMELINE_CALL_ROWS)
        .await?;
    let webhook = state.db.webhook(&message.tenant_id).await?;
    // `sent` is an event only for a tenant with a webhook; the row keeps
    // its time and provider for everyone.
    let sent_event = events.iter().any(|event| event.event == "sent");
    let (in_all, redrives) = attempts_in_all(&events, i64::from(message.attempts));
    let body = html! {
        dl {
            dt { "Tenant" } dd { (message.tenant_id) @if message.test { " (test)" } }
            dt { "Recipient" } dd { (message.recipient.as_deref().unwrap_or(if message.erased_at.is_some() { "erased by retention" } else { "–" })) }
            dt { "Channel, priority, lane" } dd { (message.channel.as_str()) ", " (message.priority.as_str()) ", " (message.lane.as_str()) }
            dt { "Status" } dd { (message.status.as_str()) }
            dt { "Attempts" } dd { (message.attempts)
                @if redrives > 0 { " since its last redrive; " (in_all) " in all, over " (redrives) @if redrives == 1 { " redrive" } @else { " redrives" } } }
            @if let (Some(sent), Some(ms)) = (message.sent_at, message.gate_wait_ms) {
                dt { "Accepted to sent" } dd { (sent - message.created_at) " ms, of which " (ms) " ms at the provider's gate (its last attempt)" }
            }
            dt { "Provider" } dd { (message.provider.as_deref().unwrap_or("–")) " " (message.provider_message_id.as_deref().unwrap_or("")) }
            @if let Some(error) = &message.last_error { dt { "Last error" } dd.warn { (error) } }
        }
        @if !recipients.is_empty() {
            h2 { "Recipients" }
            div.box tabindex="0" { table {
                thead { tr { th scope="col" { "Address" } th scope="col" { "Status" }
                    th scope="col" { "Reported" } th scope="col" { "Detail" } } }
                tbody { @for recipient in &recipients { tr {
                    td { (recipient.address) } td { (recipient.status) }
                    td { (ms_to_rfc3339(recipient.updated_at)) } td { (recipient.detail.as_deref().unwrap_or("")) }
                } } }
            } }
        }
        h2 { "Timeline" }
        div.box tabindex="0" { table {
            thead { tr { th scope="col" { "At" } th scope="col" { "Event" } th scope="col" { "Status after" }
                th scope="col" { "Attempts" } th scope="col" { "Detail" } } }
            tbody {
                tr { td { (ms_to_rfc3339(message.created_at)) } td { "accepted" } td { "queued" } td.num { "0" }
                    td { "on the " (message.lane.as_str()) " lane" @if let Some(at) = message.send_at { ", to send at " (ms_to_rfc3339(at)) } } }
                @for event in &events { tr {
                td { (ms_to_rfc3339(event.at)) } td { (event.event) } td { (event.status) }
                td.num { (event.attempts) } td { (event.detail.as_deref().unwrap_or("")) }
                } }
                @if let (Some(at), false) = (message.sent_at, sent_event) { tr {
                    td { (ms_to_rfc3339(at)) } td { "sent" } td { "sent" } td.num { (message.attempts) }
                    td { "by " (message.provider.as_deref().unwrap_or("the provider")) " " (message.provider_message_id.as_deref().unwrap_or(""))
                        @if let Some(ms) = message.gate_wait_ms { ", after " (ms) " ms waiting for its token" } }
                } }
            }
        } }
        p.note { "The wait of each attempt at its provider's gate is in the message's trace (span \"wait for a provider token\"); the time above is its last attempt's." }
        h2 { "Webhook calls" }
        @match &webhook {
            None => p { "The tenant has no webhook." },
            Some(webhook) => {
                p { "Endpoint " (webhook.url) ". "
                    @if calls.is_empty() { "Every call of this message was taken at its first try, or is on its way." }
                    @else { "Calls not listed were taken at their first try, or are on their way." } }
                (super::delivery::failed_calls(&calls))
            }
        }
    };
    Ok(page(&format!("Message {id}"), Some(&session), body))
}

/// A message's provider attempts in all, and its redrives: a redrive
/// counts its attempts from 0 again, so those it had before each redrive
/// (the attempts of the event just before it) are added to `since`.
fn attempts_in_all(events: &[EventRecord], since: i64) -> (i64, usize) {
    let (mut before, mut last, mut redrives) = (0, 0, 0);
    for event in events {
        if event.detail.as_deref() == Some(REDRIVEN) {
            before += last;
            redrives += 1;
        }
        last = event.attempts;
    }
    (before + since, redrives)
}

/// Which tenant's dead letters the page shows (empty: everyone's).
#[derive(Debug, Default, Deserialize)]
pub struct DeadLetterQuery {
    #[serde(default)]
    tenant: String,
}

/// Dead letters lane by lane (of one tenant, when asked), with redrive of
/// the selected ones, of the tenant's or of the whole lane for an
/// operator.
pub async fn dead_letters(
    State(state): State<AppState>,
    session: Session,
    Query(query): Query<DeadLetterQuery>,
) -> Result<Markup, ApiError> {
    let tenant = query.tenant.trim();
    let mut lanes = Vec::new();
    for lane in Lane::ALL {
        let letters = state
            .queue
            .list_dead_letters(*lane, DEAD_LETTER_ROWS)
            .await?;
        let mut views = crate::api::dlq::dead_letter_views(&state, *lane, letters).await?;
        views.retain(|letter| tenant.is_empty() || letter.tenant == tenant);
        lanes.push((*lane, views));
    }
    let body = html! {
        form method="get" action="/console/dlq" {
            label for="dlq-tenant" { "Tenant (empty: every tenant)" }
            input id="dlq-tenant" name="tenant" value=(tenant);
            button type="submit" { "Show" }
        }
        @for (lane, letters) in &lanes {
            h2 { "Lane " (lane.as_str()) }
            @if letters.is_empty() { p { "No dead letters." } } @else {
                form method="post" action="/console/dlq/redrive" {
                    @if session.may_change() {
                        input type="hidden" name="csrf" value=(session.csrf);
                        input type="hidden" name="lane" value=(lane.as_str());
                        input type="hidden" name="tenant" value=(tenant);
                    }
                    div.box tabindex="0" { table {
                        thead { tr { @if session.may_change() { th scope="col" { "Select" } }
                            th scope="col" { "Message" } th scope="col" { "Tenant" } th scope="col" { "Attempts" }
                            th scope="col" { "Last error" } th scope="col" { "Since" } } }
                        tbody { @for letter in letters { tr {
                            @if session.may_change() { td { input type="checkbox" name="id" value=(letter.id) aria-label=(format!("Select {}", letter.id)); } }
                            td { a href=(format!("/console/messages/{}", letter.id)) { (letter.id) } }
                            td { (letter.tenant) } td.num { (letter.attempts) }
                            td { (letter.last_error.as_deref().unwrap_or("")) } td { (letter.enqueued_at) }
                        } } }
                    } }
                    @if session.may_change() { p {
                        button type="submit" name="what" value="selected" { "Redrive the selected" } " "
                        button type="submit" name="what" value="all" {
                            "Redrive all of the " (lane.as_str()) " lane's dead letters"
                            @if !tenant.is_empty() { " of " (tenant) }
                        }
                    } }
                }
            }
        }
    };
    Ok(page("Dead letters", Some(&session), body))
}

/// The newest entries of the audit log.
pub async fn audit(State(state): State<AppState>, session: Session) -> Result<Markup, ApiError> {
    let query = AuditQuery {
        limit: AUDIT_ROWS,
        ..AuditQuery::default()
    };
    let entries = state.db.audit_page(&query).await?;
    let body = html! {
        p.note { "The newest " (AUDIT_ROWS) " changes; all of them: GET /v1/admin/audit." }
        div.box tabindex="0" { table {
            thead { tr { th scope="col" { "At" } th scope="col" { "Admin" } th scope="col" { "Action" }
                th scope="col" { "Target" } th scope="col" { "Status" } } }
            tbody { @for entry in &entries { tr {
                td { (ms_to_rfc3339(entry.at)) } td { (entry.actor_name) " (" (entry.actor_role) ")" }
                td { (entry.action) } td { (entry.target) } td.num { (entry.status) }
            } } }
        } }
    };
    Ok(page("Audit log", Some(&session), body))
}
