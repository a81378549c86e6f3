//! Retention and usage: a tenant's settled messages past its retention
//! lose their body, recipient, reference, metadata and error details
//! everywhere fairlane keeps them (status rows, events, queue copies, the
//! SQLite file and its log, PostgreSQL's tables, the SQS DLQ), while their
//! status and the usage counts stay; a deleted tenant leaves no dead
//! letter behind; usage counts what was sent.

use fairlane::model::{MessageStatus, now_ms};
use fairlane::scheduler::{Retention, RetentionRun};
use fairlane::store::Db;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use wiremock::matchers::{body_string_contains, method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::delivery::{SMS_PATH, delivery_settings, mock_sms_ok, status_is, wait_for};
use crate::senders::ses_ok;
use crate::support::{
    TestApp, expect_field_error, expect_json, on_both_stores, sms, sqlite_file, with,
};
use crate::test_keys::issue;

/// Written into every personal field of the messages under test; lower
/// case, because an email address may be stored lower-cased.
const SENTINEL: &str = "zq7sentinel";
/// The sentinel phone numbers all start with this.
const NUMBER_SENTINEL: &str = "555777000";

/// An SMS API that refuses `+15557770002` and `+15550000002` for good,
/// quoting the number as Twilio does, and takes every other message.
async fn sms_api_refusing_one_number() -> MockServer {
    let sms_api = MockServer::start().await;
    for number in ["15557770002", "15550000002"] {
        Mock::given(method("POST"))
            .and(path(SMS_PATH))
            .and(body_string_contains(format!("To=%2B{number}")))
            .respond_with(ResponseTemplate::new(400).set_body_json(json!({
                "code": 21211,
                "message": format!("The 'To' number +{number} is not a valid phone number."),
            })))
            .with_priority(1)
            .mount(&sms_api)
            .await;
    }
    mock_sms_ok(&sms_api, "SM-retention").await;
    sms_api
}

/// A message carrying the sentinel in every personal field.
fn personal(channel: &str, to: &str) -> Value {
    let mut body = json!({
        "channel": channel,
        "to": to,
        "text": format!("Your code is {SENTINEL}-body"),
        "reference": format!("{SENTINEL}-ref"),
        "metadata": {"note": format!("{SENTINEL}-meta")},
    });
    if channel == "email" {
        body["subject"] = json!(format!("{SENTINEL} subject"));
    }
    body
}

/// Runs one retention pass now, as the scheduler does (once the app's own
/// run at start-up, which holds PostgreSQL's lock meanwhile, is over).
pub(crate) async fn run_retention(app: &TestApp) -> RetentionRun {
    let job = Retention {
        db: app.state.db.clone(),
        registry: app.state.registry.clone(),
        queues: app.state.tenant_queues.clone(),
        batch: 2,
        vacuum: true,
        audit_days: 365,
    };
    for _ in 0..100 {
        if let Some(run) = job.run_once(now_ms()).await.expect("a retention run") {
            return run;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("another retention run held the lock for 5 s");
}

/// Moves the creation of `tenant`'s messages `days` into the past, as if
/// the clock had moved on.
pub(crate) async fn age_messages(app: &TestApp, tenant: &str, days: i64) {
    const AGE: &str = "UPDATE messages SET created_at = created_at - $1 WHERE tenant_id = $2";
    let by = days * 86_400_000;
    match &app.state.db {
        Db::Sqlite(db) => {
            sqlite_file(&db.path)
                .execute(&AGE.replace('$', "?"), rusqlite::params![by, tenant])
                .unwrap();
        }
        Db::Postgres(db) => {
            sqlx::query(AGE)
                .bind(by)
                .bind(tenant)
                .execute(&db.pool)
                .await
                .unwrap();
        }
    }
}

/// Where the sentinels are still found in what the store keeps: the
/// SQLite file and its log as bytes, or every PostgreSQL table as text.
async fn sentinels_in_store(app: &TestApp) -> Vec<String> {
    let mut found = Vec::new();
    match &app.state.db {
        Db::Sqlite(db) => {
            let mut wal = db.path.clone().into_os_string();
            wal.push("-wal");
            for file in [db.path.clone(), wal.into()] {
                let bytes = std::fs::read(&file)
                    .unwrap_or_default()
                    .to_ascii_lowercase();
                for needle in [SENTINEL, NUMBER_SENTINEL] {
                    if bytes.windows(needle.len()).any(|w| w == needle.as_bytes()) {
                        found.push(format!("{needle} in {}", file.display()));
                    }
                }
            }
        }
        Db::Postgres(db) => {
            let tables: Vec<String> = sqlx::query_scalar(
                "SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'public'",
            )
            .fetch_all(&db.pool)
            .await
            .unwrap();
            assert!(tables.len() > 10, "{tables:?}");
            for table in tables {
                let hits: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT COUNT(*) FROM \"{table}\" AS r WHERE lower(r::text) LIKE '%{SENTINEL}%' \
                     OR r::text LIKE '%{NUMBER_SENTINEL}%'"
                )))
                .fetch_one(&db.pool)
                .await
                .unwrap();
                if hits > 0 {
                    found.push(format!("{hits} rows of {table}"));
                }
            }
            // A file's bytes are `bytea`, which the text of a row shows
            // in hex.
            let in_files: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT COUNT(*) FROM attachment_chunks WHERE data LIKE '%{SENTINEL}%'::bytea"
            )))
            .fetch_one(&db.pool)
            .await
            .unwrap();
            if in_files > 0 {
                found.push(format!("{in_files} rows of attachment_chunks"));
            }
        }
    }
    found
}

async fn get_json(request: reqwest::RequestBuilder) -> Value {
    expect_json(request.send().await.unwrap(), StatusCode::OK).await
}

fn mentions_sentinel(value: &Value) -> bool {
    let text = value.to_string().to_ascii_lowercase();
    text.contains(SENTINEL) || text.contains(NUMBER_SENTINEL)
}

on_both_stores! {
    /// Email, SMS, a dead letter and a scheduled-then-cancelled message
    /// carry a sentinel in body, address, reference, metadata and (for the
    /// dead letter) the provider's error. After retention at its minimum
    /// with the messages two days old, the sentinel is nowhere: not in the
    /// API's answers, not in the dead-letter queue, not in the store's
    /// bytes. Each status still answers with its id and outcome, and usage
    /// is what it was.
    async fn retention_erases_personal_data_everywhere_and_keeps_outcomes_and_usage() {
        let sms_api = sms_api_refusing_one_number().await;
        let ses = ses_ok().await;
        // With `log_addresses` on, the provider's error keeps the number
        // it quotes (off, it is replaced at once): retention must erase it.
        let with_addresses = "[logging]\nlog_addresses = true\n";
        let app = TestApp::start(&delivery_settings(&sms_api.uri(), &ses.uri(), with_addresses)).await;
        let key = app.tenant_with_key("acme", "pro").await;
        let later = (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339();

        // The email carries a file holding the sentinel (issue 48).
        let file = crate::attachments::uploaded(
            &app, &key, "note.txt", "text/plain", format!("A note for {SENTINEL}-file").into_bytes(),
        )
        .await;
        let file_path = format!("/v1/attachments/{}", file["id"].as_str().unwrap());
        let email = app
            .send_accepted(
                &key,
                &with(personal("email", &format!("{SENTINEL}.ada@example.com")), "attachments", json!([file["id"]])),
            )
            .await;
        let text = app.send_accepted(&key, &personal("sms", "+15557770001")).await;
        let dead = app.send_accepted(&key, &personal("sms", "+15557770002")).await;
        // A send by template keeps only its personalisation, which the
        // dead letter carries until retention erases it (issue 48).
        let template = expect_json(
            app.tenant(&key, Method::POST, "/v1/templates")
                .json(&json!({"name": "code", "channel": "sms", "text": "Your code is ((code))"}))
                .send()
                .await
                .unwrap(),
            StatusCode::CREATED,
        )
        .await;
        let templated = app
            .send_accepted(
                &key,
                &json!({"channel": "sms", "to": "+15557770002", "template_id": template["id"],
                        "personalisation": {"code": format!("{SENTINEL}-personal")}}),
            )
            .await;
        let scheduled = app
            .send_accepted(&key, &with(personal("sms", "+15557770003"), "send_at", json!(later)))
            .await;
        let cancelled = app
            .tenant(&key, Method::DELETE, &format!("/v1/messages/{scheduled}"))
            .send()
            .await
            .unwrap();
        assert_eq!(cancelled.status(), StatusCode::OK);
        let outcomes = [
            (&email, "sent"),
            (&text, "sent"),
            (&dead, "dead_lettered"),
            (&templated, "dead_lettered"),
            (&scheduled, "cancelled"),
        ];
        for (id, outcome) in outcomes {
            let view = wait_for(&app, &key, id, status_is(outcome)).await;
            assert_eq!(view["status"], outcome, "{view}");
        }
        let dead_view = wait_for(&app, &key, &dead, status_is("dead_lettered")).await;
        assert!(mentions_sentinel(&dead_view), "the error quotes the number: {dead_view}");
        let dlq = get_json(app.admin(Method::GET, "/v1/admin/dlq")).await;
        assert!(mentions_sentinel(&dlq), "the dead letter is listed with its body: {dlq}");
        let found = sentinels_in_store(&app).await;
        assert!(!found.is_empty(), "the store holds the sentinel before retention");
        let usage_before = get_json(app.tenant(&key, Method::GET, "/v1/usage")).await;
        assert_eq!(usage_before["totals"].as_array().unwrap().len(), 2, "{usage_before}");

        // Nothing is erased before the tenant's retention has passed.
        let early = run_retention(&app).await;
        assert_eq!(early.erased, 0, "{early:?}");
        let tenant = app.patch_tenant("acme", json!({"retention_days": 1})).await;
        assert_eq!(tenant["retention_days"], 1, "{tenant}");
        age_messages(&app, "acme", 2).await;

        let run = run_retention(&app).await;
        assert_eq!(run.erased, 5, "{run:?}");
        // The two dead letters, and on the embedded queue the cancelled
        // message's delayed row (SQS mode keeps a scheduled message in the
        // outbox, which the cancel emptied).
        let copies = if app.state.db.is_shared() { 2 } else { 3 };
        assert_eq!(run.queue_copies, copies, "{run:?}");
        assert!(run.log_truncated, "{run:?}");
        assert_eq!(run.vacuumed, !app.state.db.is_shared(), "{run:?}");
        assert_eq!(run_retention(&app).await.erased, 0, "a second run finds nothing");

        for (id, outcome) in outcomes {
            let view = expect_json(app.get_message(&key, id).await, StatusCode::OK).await;
            assert_eq!(view["id"], id.as_str());
            assert_eq!(view["status"], outcome, "{view}");
            assert!(view["erased_at"].is_string(), "{view}");
            for erased in ["reference", "metadata", "last_error"] {
                assert!(view.get(erased).is_none(), "{erased} is erased: {view}");
            }
            let events = get_json(app.tenant(&key, Method::GET, &format!("/v1/messages/{id}/events"))).await;
            assert!(!mentions_sentinel(&events), "{events}");
        }
        let listed = get_json(app.tenant(&key, Method::GET, &format!("/v1/messages?reference={SENTINEL}-ref"))).await;
        assert_eq!(listed["messages"], json!([]), "{listed}");
        let all = get_json(app.tenant(&key, Method::GET, "/v1/messages")).await;
        assert_eq!(all["messages"].as_array().unwrap().len(), 5, "{all}");
        assert!(!mentions_sentinel(&all), "{all}");
        let dlq = get_json(app.admin(Method::GET, "/v1/admin/dlq")).await;
        assert!(!mentions_sentinel(&dlq), "{dlq}");
        let found = sentinels_in_store(&app).await;
        assert!(found.is_empty(), "erased text is still stored: {found:?}");
        let file_after = app.tenant(&key, Method::GET, &file_path).send().await.unwrap();
        assert_eq!(file_after.status(), StatusCode::NOT_FOUND, "the file went with its message");

        let usage_after = get_json(app.tenant(&key, Method::GET, "/v1/usage")).await;
        assert_eq!(usage_after["totals"], usage_before["totals"]);
        assert_eq!(usage_after["days"], usage_before["days"]);

        // A late report about an erased message brings an address back: the
        // message is looked at again, and the next run erases it again.
        let sent = app.state.db.message(&text).await.unwrap().unwrap();
        let late_report = fairlane::store::receipts::Receipt {
            // The provider that sent it: a receipt matches only its own.
            provider: sent.provider.clone().expect("a sent message names its provider"),
            provider_message_id: sent.provider_message_id.expect("a sent message has the provider's id"),
            message_id: Some(text.clone()),
            outcome: Some(MessageStatus::Failed),
            event: "failed".into(),
            detail: Some(format!("30006 landline {SENTINEL}")),
            suppress: Vec::new(),
            suppress_reason: None,
            recipients: Vec::new(),
        };
        app.state.writer.apply_receipt(&late_report).await.unwrap();
        let late = expect_json(app.get_message(&key, &text).await, StatusCode::OK).await;
        assert!(late.get("erased_at").is_none() && mentions_sentinel(&late), "{late}");
        let again = run_retention(&app).await;
        assert_eq!(again.erased, 1, "{again:?}");
        let erased = expect_json(app.get_message(&key, &text).await, StatusCode::OK).await;
        assert!(erased["erased_at"].is_string() && !mentions_sentinel(&erased), "{erased}");
        assert_eq!(erased["status"], "failed", "{erased}");
        let found = sentinels_in_store(&app).await;
        assert!(found.is_empty(), "the late text is still stored: {found:?}");
        let metrics = app.metrics_text().await;
        assert!(metrics.contains("fairlane_retention_erased_total"), "{metrics}");
    }
}

on_both_stores! {
    /// Deleting a tenant takes its dead letters and its files with it.
    async fn deleting_a_tenant_erases_its_dead_letters() {
        let sms_api = sms_api_refusing_one_number().await;
        let app = TestApp::start(&delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", "")).await;
        let key = app.tenant_with_key("acme", "pro").await;
        let other = app.tenant_with_key("globex", "pro").await;
        let dead = app.send_accepted(&key, &personal("sms", "+15557770002")).await;
        let kept = app.send_accepted(&other, &sms()).await;
        let refused = app
            .send_accepted(&other, &with(sms(), "to", json!("+15550000002")))
            .await;
        for (key, id, outcome) in [(&key, &dead, "dead_lettered"), (&other, &kept, "sent"), (&other, &refused, "dead_lettered")] {
            let view = wait_for(&app, key, id, status_is(outcome)).await;
            assert_eq!(view["status"], outcome, "{view}");
        }
        // A file uploaded and not yet sent goes with its tenant too.
        crate::attachments::uploaded(&app, &key, "list.csv", "text/csv", format!("name\n{SENTINEL}\n").into_bytes()).await;
        assert!(!sentinels_in_store(&app).await.is_empty());
        let response = app.admin(Method::DELETE, "/v1/admin/tenants/acme").send().await.unwrap();
        assert_eq!(response.status(), StatusCode::NO_CONTENT);
        let dlq = get_json(app.admin(Method::GET, "/v1/admin/dlq")).await;
        let letters: Vec<&str> = dlq["dead_letters"]
            .as_array()
            .map(|list| list.iter().filter_map(|l| l["id"].as_str()).collect())
            .unwrap_or_default();
        assert_eq!(letters, vec![refused.as_str()], "{dlq}");
        let found = sentinels_in_store(&app).await;
        assert!(found.is_empty(), "the deleted tenant's text is still stored: {found:?}");
    }
}

on_both_stores! {
    /// Usage counts per day, channel and key kind: accepted, sent, the
    /// outcomes and the SMS fragments of what was sent; test keys apart;
    /// the same through the tenant's, the admin's per-tenant and the
    /// all-tenants answers.
    async fn usage_sums_match_what_was_sent() {
        let sms_api = sms_api_refusing_one_number().await;
        let ses = ses_ok().await;
        let app = TestApp::start(&delivery_settings(&sms_api.uri(), &ses.uri(), "")).await;
        let key = app.tenant_with_key("acme", "pro").await;
        let test_key = issue(&app, "acme", Some("test")).await["key"]
            .as_str()
            .unwrap()
            .to_owned();
        let other = app.tenant_with_key("globex", "pro").await;
        let long = "x".repeat(161); // two GSM-7 fragments
        let euro = "€".repeat(80); // 160 septets: one fragment
        let emoji = format!("{}😀", "a".repeat(69)); // UCS-2, 71 units: two
        let mut waits = Vec::new();
        for (k, body, outcome) in [
            (&key, with(sms(), "text", json!(long)), "sent"),
            (&key, with(sms(), "text", json!(euro)), "sent"),
            (&key, with(sms(), "text", json!(emoji)), "sent"),
            (&key, with(sms(), "to", json!("+15557770002")), "dead_lettered"),
            (&key, crate::support::email(), "sent"),
            (&key, crate::support::email(), "sent"),
            (&test_key, with(sms(), "to", json!("+15005550001")), "delivered"),
            (&other, sms(), "sent"),
        ] {
            let id = app.send_accepted(k, &body).await;
            waits.push((k.clone(), id, outcome));
        }
        let later = (chrono::Utc::now() + chrono::Duration::hours(2)).to_rfc3339();
        let scheduled = app.send_accepted(&key, &with(sms(), "send_at", json!(later))).await;
        let response = app.tenant(&key, Method::DELETE, &format!("/v1/messages/{scheduled}")).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let mut fragments_sent = 0;
        for (k, id, outcome) in &waits {
            let view = wait_for(&app, k, id, status_is(outcome)).await;
            assert_eq!(view["status"], *outcome, "{view}");
            if view["channel"] == "sms" && *outcome == "sent" && k == &key {
                fragments_sent += view["fragments"].as_i64().unwrap();
            }
        }
        assert_eq!(fragments_sent, 2 + 1 + 2);

        // The admin's view holds both worlds; each key sees its own.
        let usage = get_json(app.admin(Method::GET, "/v1/admin/tenants/acme/usage")).await;
        let total = |channel: &str, test: bool| -> Value {
            usage["totals"]
                .as_array()
                .unwrap()
                .iter()
                .find(|t| t["channel"] == channel && t["test"] == test)
                .cloned()
                .unwrap_or_else(|| panic!("no {channel} total (test {test}): {usage}"))
        };
        let live_sms = total("sms", false);
        assert_eq!(live_sms["accepted"], 5, "{usage}");
        assert_eq!(live_sms["sent"], 3, "{usage}");
        assert_eq!(live_sms["dead_lettered"], 1, "{usage}");
        assert_eq!(live_sms["cancelled"], 1, "{usage}");
        assert_eq!(live_sms["fragments"], fragments_sent, "{usage}");
        let live_email = total("email", false);
        assert_eq!((live_email["accepted"].as_i64(), live_email["sent"].as_i64()), (Some(2), Some(2)), "{usage}");
        assert_eq!(live_email["fragments"], 0);
        let test_sms = total("sms", true);
        assert_eq!(test_sms["accepted"], 1, "{usage}");
        assert_eq!(test_sms["sent"], 1, "{usage}");
        assert_eq!(test_sms["delivered"], 1, "{usage}");
        let today = chrono::Utc::now().format("%Y-%m-%d").to_string();
        assert_eq!(usage["to"], today.as_str());
        assert!(usage["days"].as_array().unwrap().iter().all(|d| d["date"] == today.as_str() && d["tenant_id"] == "acme"), "{usage}");

        let world = |test: bool| -> Value {
            let totals = usage["totals"].as_array().unwrap();
            totals.iter().filter(|t| t["test"] == test).cloned().collect()
        };
        let live = get_json(app.tenant(&key, Method::GET, "/v1/usage")).await;
        assert_eq!(live["totals"], world(false), "{live}");
        let test = get_json(app.tenant(&test_key, Method::GET, "/v1/usage")).await;
        assert_eq!(test["totals"], world(true), "{test}");
        let everyone = get_json(app.admin(Method::GET, &format!("/v1/admin/usage?from={today}&to={today}"))).await;
        let tenants: std::collections::BTreeSet<&str> = everyone["days"].as_array().unwrap().iter().filter_map(|d| d["tenant_id"].as_str()).collect();
        assert_eq!(tenants.into_iter().collect::<Vec<_>>(), ["acme", "globex"], "{everyone}");
        let all_live_sms = everyone["totals"].as_array().unwrap().iter().find(|t| t["channel"] == "sms" && t["test"] == false).unwrap().clone();
        assert_eq!(all_live_sms["sent"], 4, "{everyone}");

        // PostgreSQL folds the appended counts into usage rows; the answer
        // is the same before and after.
        app.state.db.roll_up_usage().await.unwrap();
        let folded = get_json(app.tenant(&key, Method::GET, "/v1/usage")).await;
        assert_eq!(folded["totals"], live["totals"]);
        assert_eq!(folded["days"], live["days"]);

        let yesterday = (chrono::Utc::now() - chrono::Duration::days(1)).format("%Y-%m-%d").to_string();
        let before = get_json(app.tenant(&key, Method::GET, &format!("/v1/usage?to={yesterday}"))).await;
        assert_eq!(before["days"], json!([]), "{before}");
        for (query, field) in [("?from=2026-13-01", "from"), ("?from=2026-02-01&to=2026-01-01", "from"), ("?from=2020-01-01&to=2026-01-01", "to")] {
            let response = app.tenant(&key, Method::GET, &format!("/v1/usage{query}")).send().await.unwrap();
            expect_field_error(response, field).await;
        }
        let unknown = app.admin(Method::GET, "/v1/admin/tenants/nobody/usage").send().await.unwrap();
        assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
    }
}

/// A tenant's retention is 1-90 days; `null` returns it to the configured
/// default, which the configuration sets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_days_are_checked_and_default_to_the_configuration() {
    let app = TestApp::start("[retention]\ndefault_days = 14\n").await;
    let made = app.create_tenant("acme", "pro").await;
    assert_eq!(made["retention_days"], 14, "{made}");
    for bad in [json!(0), json!(91), json!("7"), json!(-1)] {
        let response = app
            .admin(Method::PATCH, "/v1/admin/tenants/acme")
            .json(&json!({"retention_days": bad}))
            .send()
            .await
            .unwrap();
        expect_field_error(response, "retention_days").await;
    }
    assert_eq!(
        app.patch_tenant("acme", json!({"retention_days": 90}))
            .await["retention_days"],
        90
    );
    assert_eq!(
        app.patch_tenant("acme", json!({"plan": "pro"})).await["retention_days"],
        90
    );
    assert_eq!(
        app.patch_tenant("acme", json!({"retention_days": null}))
            .await["retention_days"],
        14
    );
    let response = app
        .admin(Method::POST, "/v1/admin/tenants")
        .json(&json!({"id": "globex", "name": "Globex", "plan": "pro", "retention_days": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        expect_json(response, StatusCode::CREATED).await["retention_days"],
        3
    );
    let response = app
        .admin(Method::POST, "/v1/admin/tenants")
        .json(&json!({"id": "initech", "name": "Initech", "plan": "pro", "retention_days": 100}))
        .send()
        .await
        .unwrap();
    expect_field_error(response, "retention_days").await;
}
