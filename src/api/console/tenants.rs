//! Tenants, plans, API keys, sender identities and suppressions in the
//! console: the pages, and the changes an operator makes on them. Each
//! change reads its form as the admin API's body for the same change
//! ([`super::forms`]) and makes it with the API's own calls, so it is
//! checked, refused and logged as the API's is.

use axum::Form;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, IntoResponseParts, Redirect, Response};
use maud::{Markup, html};

use super::forms::{Kind, field, typed};
use super::session::Session;
use super::{Refused, csrf_field, page, row_button};
use crate::api::admin::{
    CreateTenant, PatchTenant, PlanInput, create_tenant_with, patch_tenant_with, tenant_before,
};
use crate::api::audit::{AuditAfter, AuditBefore, AuditTarget};
use crate::api::error::ApiError;
use crate::api::suppressions::{SuppressionInput, add_entry, remove_for};
use crate::api::{ApiPath, AppState};
use crate::model::{Lane, Plan, TenantStatus};
use crate::tenants::{KeyKind, NewSender};

/// Suppressions shown on a tenant's page (all of them: the API's list).
const SUPPRESSION_ROWS: i64 = 50;

/// The fields of a form, as posted.
type Fields = Form<Vec<(String, String)>>;

/// Refuses a change whose form does not carry the session's CSRF token,
/// or that a viewer makes.
pub(super) fn admit(session: &Session, fields: &[(String, String)]) -> Result<(), ApiError> {
    super::actions::admit(session, field(fields, "csrf"))
}

/// The answer to a change made on tenant `id`'s page: the audit log's
/// `parts` (before, after), and back to the page.
fn back_to_tenant(id: &str, parts: impl IntoResponseParts) -> Result<Response, Refused> {
    Ok((parts, Redirect::to(&format!("/console/tenants/{id}"))).into_response())
}

/// A `<select>` of the plans, `chosen` selected.
fn plan_select(id: &str, plans: &[Plan], chosen: &str) -> Markup {
    html! {
        select id=(id) name="plan" {
            @for plan in plans { option value=(plan.name) selected[plan.name == chosen] { (plan.name) } }
        }
    }
}

/// Every tenant, with pause and resume and a form for a new one.
pub async fn list(State(state): State<AppState>, session: Session) -> Markup {
    let tenants = state.registry.tenants();
    let plans = state.registry.plans();
    let body = html! {
        div.box tabindex="0" { table {
            thead { tr { th scope="col" { "Tenant" } th scope="col" { "Name" } th scope="col" { "Plan" }
                th scope="col" { "Status" } @if session.may_change() { th scope="col" { "Change" } } } }
            tbody { @for tenant in &tenants { tr {
                th scope="row" { a href=(format!("/console/tenants/{}", tenant.id)) { (tenant.id) } }
                td { (tenant.name) } td { (tenant.plan) } td { (tenant.status.as_str()) }
                @if session.may_change() { td { (status_button(&session, &tenant.id, tenant.status, "list")) } }
            } } }
        } }
        @if session.may_change() {
            h2 { "New tenant" }
            form method="post" action="/console/tenants" {
                (csrf_field(&session))
                label for="new-id" { "Id (a-z 0-9 _ -)" } input id="new-id" name="id" required;
                label for="new-name" { "Name" } input id="new-name" name="name" required;
                label for="new-plan" { "Plan" } (plan_select("new-plan", &plans, ""))
                label for="new-retention" { "Retention in days (empty: the default)" }
                input id="new-retention" name="retention_days" inputmode="numeric";
                p { button type="submit" { "Create tenant" } }
            }
        }
    };
    page("Tenants", Some(&session), body)
}

/// The pause or resume button of a tenant; the change returns to the
/// tenants' list (`from` = `list`) or to the tenant's page.
fn status_button(session: &Session, id: &str, status: TenantStatus, from: &str) -> Markup {
    let (to, label) = if status == TenantStatus::Active {
        ("paused", "Pause")
    } else {
        ("active", "Resume")
    };
    let fields = [("status", to), ("from", from)];
    let action = format!("/console/tenants/{id}");
    row_button(session, &action, &fields, label, &format!("{label} {id}"))
}

/// Creates a tenant, as `POST /v1/admin/tenants` does; on to its page.
pub async fn create(
    State(state): State<AppState>,
    session: Session,
    Form(fields): Fields,
) -> Result<Response, Refused> {
    admit(&session, &fields)?;
    let kinds = [
        ("retention_days", Kind::Number),
        ("max_concurrent_consumers", Kind::Number),
    ];
    let input: CreateTenant = typed(&fields, &kinds)?;
    let tenant = create_tenant_with(&state, input).await?;
    let target = AuditTarget(format!("/v1/admin/tenants/{}", tenant.id));
    back_to_tenant(&tenant.id, (target, AuditAfter::of(&tenant)))
}

/// Changes a tenant (plan, consumers, retention, status), as `PATCH
/// /v1/admin/tenants/{id}` does; back to where the form was.
pub async fn change(
    State(state): State<AppState>,
    session: Session,
    ApiPath(id): ApiPath<String>,
    Form(fields): Fields,
) -> Result<Response, Refused> {
    admit(&session, &fields)?;
    let kinds = [
        ("retention_days", Kind::Number),
        ("max_concurrent_consumers", Kind::Number),
    ];
    // The pause buttons of the tenants' list post here too.
    let from_list = field(&fields, "from") == "list";
    let fields: Vec<_> = fields.into_iter().filter(|(k, _)| k != "from").collect();
    let input: PatchTenant = typed(&fields, &kinds)?;
    let before = tenant_before(&state, &id);
    let tenant = patch_tenant_with(&state, &id, input).await?;
    let to = if from_list {
        "/console/tenants".to_owned()
    } else {
        format!("/console/tenants/{id}")
    };
    let target = AuditTarget(format!("/v1/admin/tenants/{id}"));
    Ok((target, before, AuditAfter::of(&tenant), Redirect::to(&to)).into_response())
}

/// One tenant: its settings, keys, sender identities and suppressions,
/// each with its changes for an operator.
pub async fn detail(
    State(state): State<AppState>,
    session: Session,
    ApiPath(id): ApiPath<String>,
) -> Result<Markup, Refused> {
    let tenant = state
        .registry
        .tenant(&id)
        .ok_or_else(|| ApiError::NotFound(format!("No tenant {id:?}.")))?
        .view(state.registry.retention_default());
    let keys = state.registry.keys_of(&id).await?;
    let senders = state.registry.senders_of(&id).await?;
    let suppressed = state
        .db
        .suppressions_of(&id, None, SUPPRESSION_ROWS)
        .await?;
    let plans = state.registry.plans();
    let change = session.may_change();
    let action = format!("/console/tenants/{id}");
    let body = html! {
        p { a href=(format!("/console/messages?tenant={id}")) { "Its messages" } }
        dl {
            dt { "Name" } dd { (tenant.name) }
            dt { "Status" } dd { (tenant.status.as_str()) @if change { " " (status_button(&session, &id, tenant.status, "tenant")) } }
            dt { "Plan" } dd { (tenant.plan) }
            dt { "Isolation" } dd { (tenant.isolation.as_str()) }
            dt { "Consumers of its own queue" } dd { (tenant.max_concurrent_consumers) }
            dt { "Retention" } dd { (tenant.retention_days) " days" }
        }
        @if change {
            h2 { "Change" }
            form method="post" action=(action) {
                (csrf_field(&session))
                label for="plan" { "Plan" } (plan_select("plan", &plans, &tenant.plan))
                label for="consumers" { "Consumers of its own queue (1-64)" }
                input id="consumers" name="max_concurrent_consumers" inputmode="numeric" value=(tenant.max_concurrent_consumers);
                label for="retention" { "Retention in days (1-90)" }
                input id="retention" name="retention_days" inputmode="numeric" value=(tenant.retention_days);
                p { button type="submit" { "Save" } }
            }
        }
        (keys_section(&session, &id, &keys))
        (senders_section(&session, &id, &senders))
        (suppressions_section(&session, &id, &suppressed))
    };
    Ok(page(&format!("Tenant {id}"), Some(&session), body))
}

fn keys_section(session: &Session, id: &str, keys: &[crate::tenants::KeyInfo]) -> Markup {
    html! {
        h2 { "API keys" }
        div.box tabindex="0" { table {
            thead { tr { th scope="col" { "Key" } th scope="col" { "Kind" } th scope="col" { "Issued" }
                th scope="col" { "Last used" } th scope="col" { "Revoked" } @if session.may_change() { th scope="col" { "Change" } } } }
            tbody { @for key in keys { tr {
                td { (key.id) } td { (key.kind.as_str()) } td { (key.created_at) }
                td { (key.last_used_at.as_deref().unwrap_or("never")) }
                td { (key.revoked_at.as_deref().unwrap_or("")) }
                @if session.may_change() { td { @if key.revoked_at.is_none() {
                    (row_button(session, &format!("/console/tenants/{id}/keys/{}/revoke", key.id), &[], "Revoke", &format!("Revoke key {}", key.id)))
                } } }
            } } }
        } }
        @if session.may_change() {
            form method="post" action=(format!("/console/tenants/{id}/keys")) {
                (csrf_field(session))
                label for="key-kind" { "Kind of key" }
                select id="key-kind" name="kind" {
                    option value="live" { "live: sends through the providers" }
                    option value="test" { "test: reaches no provider" }
                }
                p { button type="submit" { "Issue key" } }
            }
        }
    }
}

fn senders_section(
    session: &Session,
    id: &str,
    senders: &[crate::tenants::SenderIdentity],
) -> Markup {
    html! {
        h2 { "Sender identities" }
        @if senders.is_empty() { p { "None: its sends use the configured sender." } } @else {
            div.box tabindex="0" { table {
                thead { tr { th scope="col" { "Identity" } th scope="col" { "Channel" } th scope="col" { "From" }
                    th scope="col" { "Name" } th scope="col" { "Default" } @if session.may_change() { th scope="col" { "Change" } } } }
                tbody { @for sender in senders { tr {
                    td { (sender.id) } td { (sender.channel.as_str()) }
                    td { (sender.from.as_deref().or(sender.messaging_service_sid.as_deref()).unwrap_or("")) }
                    td { (sender.display_name.as_deref().unwrap_or("")) } td { @if sender.default { "yes" } }
                    @if session.may_change() { td {
                        (row_button(session, &format!("/console/tenants/{id}/senders/{}/remove", sender.id), &[], "Remove", &format!("Remove identity {}", sender.id)))
                    } }
                } } }
            } }
        }
        @if session.may_change() {
            form method="post" action=(format!("/console/tenants/{id}/senders")) {
                (csrf_field(session))
                label for="sender-channel" { "Channel" }
                select id="sender-channel" name="channel" { option value="email" { "email" } option value="sms" { "sms" } }
                label for="sender-from" { "From (an address, a number or a sender id)" } input id="sender-from" name="from";
                label for="sender-name" { "Display name (email)" } input id="sender-name" name="display_name";
                label for="sender-service" { "Messaging service (SMS, instead of from)" } input id="sender-service" name="messaging_service_sid";
                label { input type="checkbox" name="default"; " The default of its channel" }
                p { button type="submit" { "Add identity" } }
            }
        }
    }
}

fn suppressions_section(
    session: &Session,
    id: &str,
    suppressed: &[crate::store::suppressions::Suppression],
) -> Markup {
    html! {
        h2 { "Suppressions" }
        @if suppressed.is_empty() { p { "No address is suppressed." } } @else {
            p.note { "The first " (SUPPRESSION_ROWS) " by address; all of them: GET /v1/admin/tenants/" (id) "/suppressions." }
            div.box tabindex="0" { table {
                thead { tr { th scope="col" { "Address" } th scope="col" { "Channel" } th scope="col" { "Reason" }
                    th scope="col" { "Detail" } th scope="col" { "Since" } @if session.may_change() { th scope="col" { "Change" } } } }
                tbody { @for entry in suppressed { tr {
                    td { (entry.address) } td { (entry.channel) } td { (entry.reason) }
                    td { (entry.detail.as_deref().unwrap_or("")) } td { (entry.created_at) }
                    @if session.may_change() { td {
                        (row_button(session, &format!("/console/tenants/{id}/suppressions/remove"), &[("address", &entry.address)], "Remove", &format!("Remove {}", entry.address)))
                    } }
                } } }
            } }
        }
        @if session.may_change() {
            form method="post" action=(format!("/console/tenants/{id}/suppressions")) {
                (csrf_field(session))
                label for="suppress-address" { "Address or E.164 number" } input id="suppress-address" name="address" required;
                label for="suppress-detail" { "Note" } input id="suppress-detail" name="detail";
                p { button type="submit" { "Suppress" } }
            }
        }
    }
}

/// Issues a key, as `POST /v1/admin/tenants/{id}/keys` does, and shows it
/// this once.
pub async fn issue_key(
    State(state): State<AppState>,
    session: Session,
    ApiPath(id): ApiPath<String>,
    Form(fields): Fields,
) -> Result<Response, Refused> {
    admit(&session, &fields)?;
    let kind = match field(&fields, "kind") {
        "" | "live" => KeyKind::Live,
        "test" => KeyKind::Test,
        _ => return Err(ApiError::field("kind", "must be live or test").into()),
    };
    let (key_id, key) = state.registry.issue_key(&id, kind).await?;
    let body = html! {
        p role="status" { "A " (kind.as_str()) " key for " (id) " was issued. Copy it now: it is not shown again." }
        label for="issued-key" { "The key" }
        input id="issued-key" readonly size="80" value=(key);
        p { a href=(format!("/console/tenants/{id}")) { "Back to " (id) } }
    };
    let after = serde_json::json!({"tenant": id, "key_id": key_id, "kind": kind});
    let page = page("Key issued", Some(&session), body);
    let target = AuditTarget(format!("/v1/admin/tenants/{id}/keys"));
    Ok((StatusCode::CREATED, target, AuditAfter::of(&after), page).into_response())
}

/// Revokes a key, as `DELETE /v1/admin/tenants/{id}/keys/{key_id}` does.
pub async fn revoke_key(
    State(state): State<AppState>,
    session: Session,
    ApiPath((id, key_id)): ApiPath<(String, String)>,
    Form(fields): Fields,
) -> Result<Response, Refused> {
    admit(&session, &fields)?;
    state.registry.revoke_key(&id, &key_id).await?;
    let after = serde_json::json!({"tenant": id, "key_id": key_id, "revoked": true});
    let target = AuditTarget(format!("/v1/admin/tenants/{id}/keys/{key_id}"));
    back_to_tenant(&id, (target, AuditAfter::of(&after)))
}

/// Adds a sender identity, as `POST /v1/admin/tenants/{id}/senders` does.
pub async fn add_sender(
    State(state): State<AppState>,
    session: Session,
    ApiPath(id): ApiPath<String>,
    Form(fields): Fields,
) -> Result<Response, Refused> {
    admit(&session, &fields)?;
    let input: NewSender = typed(&fields, &[("default", Kind::Checkbox)])?;
    let sender = state.registry.add_sender(&id, &input).await?;
    let target = AuditTarget(format!("/v1/admin/tenants/{id}/senders/{}", sender.id));
    back_to_tenant(&id, (target, AuditAfter::of(&sender)))
}

/// Removes a sender identity, as `DELETE
/// /v1/admin/tenants/{id}/senders/{sender_id}` does.
pub async fn remove_sender(
    State(state): State<AppState>,
    session: Session,
    ApiPath((id, sender_id)): ApiPath<(String, String)>,
    Form(fields): Fields,
) -> Result<Response, Refused> {
    admit(&session, &fields)?;
    let before = state
        .registry
        .senders_of(&id)
        .await?
        .into_iter()
        .find(|sender| sender.id == sender_id)
        .map(|sender| AuditBefore::of(&sender));
    state.registry.remove_sender(&id, &sender_id).await?;
    let target = AuditTarget(format!("/v1/admin/tenants/{id}/senders/{sender_id}"));
    back_to_tenant(&id, (target, before))
}

/// Suppresses an address, as `POST /v1/admin/tenants/{id}/suppressions`
/// does.
pub async fn suppress(
    State(state): State<AppState>,
    session: Session,
    ApiPath(id): ApiPath<String>,
    Form(fields): Fields,
) -> Result<Response, Refused> {
    admit(&session, &fields)?;
    let input: SuppressionInput = typed(&fields, &[])?;
    crate::api::known_tenant(&state, &id)?;
    let (_, entry) = add_entry(&state, &id, &input).await?;
    let target = AuditTarget(format!("/v1/admin/tenants/{id}/suppressions"));
    back_to_tenant(&id, (target, AuditAfter::of(&entry)))
}

/// Takes an address off the list, as `DELETE
/// /v1/admin/tenants/{id}/suppressions/{address}` does.
pub async fn unsuppress(
    State(state): State<AppState>,
    session: Session,
    ApiPath(id): ApiPath<String>,
    Form(fields): Fields,
) -> Result<Response, Refused> {
    admit(&session, &fields)?;
    let address = field(&fields, "address");
    crate::api::known_tenant(&state, &id)?;
    remove_for(&state, &id, address).await?;
    let after = serde_json::json!({"tenant": id, "address": address, "removed": true});
    let target = AuditTarget(format!("/v1/admin/tenants/{id}/suppressions/{address}"));
    back_to_tenant(&id, (target, AuditAfter::of(&after)))
}

/// The plans, with a form that creates or replaces one.
pub async fn plans(State(state): State<AppState>, session: Session) -> Markup {
    let plans = state.registry.plans();
    let body = html! {
        div.box tabindex="0" { table {
            thead { tr { th scope="col" { "Plan" } th scope="col" { "Lane" } th scope="col" { "Rate / s" }
                th scope="col" { "Burst" } th scope="col" { "Daily quota" } th scope="col" { "In flight" }
                th scope="col" { "Uploads / min" } th scope="col" { "Upload bytes held" } } }
            tbody { @for plan in &plans { tr {
                th scope="row" { (plan.name) } td { (plan.lane.as_str()) } td.num { (plan.rate_per_second) }
                td.num { (plan.burst) } td.num { (plan.daily_quota) } td.num { (plan.max_in_flight) }
                td.num { (plan.uploads_per_minute) } td.num { (plan.upload_bytes_held) }
            } } }
        } }
        @if session.may_change() {
            h2 { "Create or replace a plan" }
            p.note { "A plan of an existing name is replaced; it wins over the configuration file from then on." }
            form method="post" action="/console/plans" {
                (csrf_field(&session))
                label for="plan-name" { "Name (a-z 0-9 _ -)" } input id="plan-name" name="name" required;
                label for="plan-lane" { "Lane" }
                select id="plan-lane" name="lane" { @for lane in Lane::ALL { option value=(lane.as_str()) { (lane.as_str()) } } }
                label for="plan-rate" { "Sends per second" } input id="plan-rate" name="rate_per_second" inputmode="decimal" required;
                label for="plan-burst" { "Burst" } input id="plan-burst" name="burst" inputmode="numeric" required;
                label for="plan-quota" { "Daily quota" } input id="plan-quota" name="daily_quota" inputmode="numeric" required;
                label for="plan-in-flight" { "Messages in flight per consumer" } input id="plan-in-flight" name="max_in_flight" inputmode="numeric" required;
                label for="plan-uploads" { "Uploads per minute, in each world (empty: 60)" } input id="plan-uploads" name="uploads_per_minute" inputmode="numeric";
                label for="plan-held" { "Upload bytes held, in each world (empty: 1073741824, 1 GiB)" } input id="plan-held" name="upload_bytes_held" inputmode="numeric";
                p { button type="submit" { "Save plan" } }
            }
        }
    };
    page("Plans", Some(&session), body)
}

/// Creates or replaces a plan, as `PUT /v1/admin/plans/{name}` does.
pub async fn put_plan(
    State(state): State<AppState>,
    session: Session,
    Form(fields): Fields,
) -> Result<Response, Refused> {
    admit(&session, &fields)?;
    let name = field(&fields, "name").to_owned();
    let fields: Vec<_> = fields.into_iter().filter(|(k, _)| k != "name").collect();
    let kinds = [
        ("rate_per_second", Kind::Number),
        ("burst", Kind::Number),
        ("daily_quota", Kind::Number),
        ("max_in_flight", Kind::Number),
        ("uploads_per_minute", Kind::Number),
        ("upload_bytes_held", Kind::Number),
    ];
    let plan = typed::<PlanInput>(&fields, &kinds)?.named(&name);
    let before = state.registry.plan(&name).map(|old| AuditBefore::of(&*old));
    state.registry.put_plan(plan.clone()).await?;
    Ok((
        AuditTarget(format!("/v1/admin/plans/{name}")),
        before,
        AuditAfter::of(&plan),
        Redirect::to("/console/plans"),
    )
        .into_response())
}
