//! Test keys end to end: a key issued with `{"kind": "test"}` sends through
//! validation, the lane and the consumer, but a simulated provider answers
//! (no provider call), each magic recipient ends as documented with the
//! webhooks a real message would bring, and the daily quota and the live
//! sends' rate bucket are left alone.

use std::collections::BTreeMap;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use wiremock::MockServer;

use crate::delivery::{delivery_settings, mock_sms_ok, status_is, wait_for};
use crate::senders::{ses_calls, ses_ok};
use crate::support::{
    TestApp, email, expect_json, expect_problem, expect_problem_kind, header_u64, on_both_stores,
    sms, with,
};
use crate::webhooks::{FAST_WEBHOOKS, body_of, calls_on, endpoint_ok, set_webhook};

/// Issues a key of `kind` (`None`: no body) for `tenant`; returns the answer.
pub(crate) async fn issue(app: &TestApp, tenant: &str, kind: Option<&str>) -> Value {
    let mut request = app.admin(Method::POST, &format!("/v1/admin/tenants/{tenant}/keys"));
    if let Some(kind) = kind {
        request = request.json(&json!({ "kind": kind }));
    }
    expect_json(request.send().await.unwrap(), StatusCode::CREATED).await
}

fn settled(view: &Value) -> bool {
    matches!(
        view["status"].as_str(),
        Some("delivered" | "bounced" | "failed" | "dead_lettered")
    )
}

on_both_stores! {
    async fn a_test_keys_messages_reach_no_provider_and_end_as_their_recipient_says() {
        let ses = ses_ok().await;
        let sms_api = MockServer::start().await;
        mock_sms_ok(&sms_api, "SM-LIVE").await;
        let settings = delivery_settings(&sms_api.uri(), &ses.uri(), FAST_WEBHOOKS);
        let app = TestApp::start_custom(&settings, |settings| {
            // A call that never answers times out after this.
            settings.providers.email.timeout_ms = Some(200);
            settings.providers.sms.timeout_ms = Some(200);
        })
        .await;
        app.create_tenant("acme", "pro").await;
        let test = issue(&app, "acme", Some("test")).await;
        assert_eq!(test["kind"], "test", "{test}");
        let test_key = test["key"].as_str().unwrap().to_owned();
        assert!(test_key.starts_with("fl_test_"), "{test_key}");
        let live = issue(&app, "acme", None).await;
        assert_eq!(live["kind"], "live", "{live}");
        let live_key = live["key"].as_str().unwrap().to_owned();
        assert!(!live_key.starts_with("fl_test_"), "{live_key}");
        let endpoint = endpoint_ok().await;
        // The webhook both worlds share is set with the live key.
        set_webhook(
            &app,
            &live_key,
            &endpoint.uri(),
            &["message.delivered", "message.bounced", "message.failed", "message.dead_lettered"],
        )
        .await;

        let domain = "simulator.fairlane.test";
        let cases = [
            (with(email(), "to", json!(format!("delivered@{domain}"))), "delivered", 1),
            (with(email(), "to", json!("anyone@example.com")), "delivered", 1),
            (with(email(), "to", json!(format!("bounced@{domain}"))), "bounced", 1),
            (with(email(), "to", json!(format!("failed@{domain}"))), "dead_lettered", 1),
            (with(email(), "to", json!(format!("temporary@{domain}"))), "delivered", 2),
            (with(email(), "to", json!(format!("timeout@{domain}"))), "dead_lettered", 3),
            (with(sms(), "to", json!("+15005550001")), "delivered", 1),
            (with(sms(), "to", json!("+15005550002")), "failed", 1),
        ];
        let mut sent = Vec::new();
        for (body, _, _) in &cases {
            sent.push(app.send_accepted(&test_key, body).await);
        }
        let mut expected_calls = BTreeMap::new();
        for (id, (body, status, attempts)) in sent.iter().zip(&cases) {
            let view = wait_for(&app, &test_key, id, settled).await;
            assert_eq!(view["status"], *status, "{body} → {view}");
            assert_eq!(view["attempts"], *attempts, "{body} → {view}");
            assert_eq!(view["test"], true, "{view}");
            *expected_calls.entry(format!("message.{status}")).or_insert(0) += 1;
        }
        // The bounced address and the undelivered number are suppressed.
        for address in [format!("bounced@{domain}"), "+15005550002".to_owned()] {
            let listed = expect_json(
                app.tenant(&test_key, Method::GET, &format!("/v1/suppressions/{address}"))
                    .send()
                    .await
                    .unwrap(),
                StatusCode::OK,
            )
            .await;
            assert_eq!(listed["reason"], "bounce", "{listed}");
        }
        // Every outcome's webhook arrived, as for a real message.
        let calls = calls_on(&endpoint, cases.len()).await;
        let mut seen = BTreeMap::new();
        for call in &calls {
            let event = body_of(call);
            assert_eq!(event["data"]["test"], true, "{event}");
            *seen.entry(event["type"].as_str().unwrap().to_owned()).or_insert(0) += 1;
        }
        assert_eq!(seen, expected_calls, "webhook calls by type");
        // Nothing reached a provider.
        assert_eq!(ses_calls(&ses).await.len(), 0, "no SES call");
        assert_eq!(sms_api.received_requests().await.unwrap().len(), 0, "no SMS call");

        // The live key of the same tenant sends for real.
        let real = app.send_accepted(&live_key, &email()).await;
        let view = wait_for(&app, &live_key, &real, settled).await;
        assert!(view.get("test").is_none(), "{view}");
        assert_eq!(ses_calls(&ses).await.len(), 1, "one real SES call");

        // The kinds show in the tenant's key list; a live key's secret under
        // the test prefix is refused.
        let detail = expect_json(
            app.admin(Method::GET, "/v1/admin/tenants/acme").send().await.unwrap(),
            StatusCode::OK,
        )
        .await;
        let kinds: Vec<&str> = detail["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k["kind"].as_str().unwrap())
            .collect();
        assert_eq!(kinds.len(), 2, "{detail}");
        assert!(kinds.contains(&"test") && kinds.contains(&"live"), "{detail}");
        let disguised = live_key.replacen("fl_", "fl_test_", 1);
        let refused = app.send(&disguised, &email()).await;
        expect_problem(refused, StatusCode::UNAUTHORIZED).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_sends_use_neither_the_daily_quota_nor_the_live_rate_bucket() {
    let plan = "[plans.capped]\nlane = \"fast\"\nrate_per_second = 0.01\nburst = 100\n\
                daily_quota = 2\nmax_in_flight = 1\n";
    let app = TestApp::start(plan).await;
    app.create_tenant("acme", "capped").await;
    let live = issue(&app, "acme", Some("live")).await["key"]
        .as_str()
        .unwrap()
        .to_owned();
    let test = issue(&app, "acme", Some("test")).await["key"]
        .as_str()
        .unwrap()
        .to_owned();
    let first = app.send(&live, &sms()).await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let remaining = header_u64(first.headers(), "ratelimit-remaining");
    for _ in 0..5 {
        let response = app.send(&test, &sms()).await;
        assert_eq!(response.status(), StatusCode::ACCEPTED);
    }
    let second = app.send(&live, &sms()).await;
    assert_eq!(second.status(), StatusCode::ACCEPTED);
    assert_eq!(
        header_u64(second.headers(), "ratelimit-remaining"),
        remaining - 1,
        "test sends took nothing from the live bucket"
    );
    // Two live sends used the quota of two; test sends still go.
    expect_problem_kind(
        app.send(&live, &sms()).await,
        StatusCode::TOO_MANY_REQUESTS,
        "quota",
    )
    .await;
    assert_eq!(app.send(&test, &sms()).await.status(), StatusCode::ACCEPTED);

    // After a restart the quota counted from the store leaves them out too.
    let dir = app.stop().await;
    let app = TestApp::start_in(dir, plan, |_| {}).await;
    expect_problem_kind(
        app.send(&live, &sms()).await,
        StatusCode::TOO_MANY_REQUESTS,
        "quota",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_kind_other_than_live_or_test_is_refused_naming_it() {
    let app = TestApp::start("").await;
    app.create_tenant("acme", "pro").await;
    let response = app
        .admin(Method::POST, "/v1/admin/tenants/acme/keys")
        .json(&json!({"kind": "sandbox"}))
        .send()
        .await
        .unwrap();
    let (_, body) = expect_problem(response, StatusCode::UNPROCESSABLE_ENTITY).await;
    assert!(body.to_string().contains("kind"), "{body}");
}

on_both_stores! {
    /// A test key's email to several addresses gets the simulated
    /// provider's report per address, as SES gives one: the `bounced@` copy
    /// bounces and is suppressed, the others are delivered, and the message
    /// ends `bounced`, its recipients each with their own status.
    async fn a_test_email_to_several_addresses_reports_each_recipient() {
        let ses = ses_ok().await;
        let sms_api = MockServer::start().await;
        let settings = delivery_settings(&sms_api.uri(), &ses.uri(), "");
        let app = TestApp::start(&settings).await;
        app.create_tenant("acme", "pro").await;
        let test = issue(&app, "acme", Some("test")).await;
        let key = test["key"].as_str().unwrap().to_owned();
        let domain = "simulator.fairlane.test";
        let body = json!({"channel": "email", "to": format!("delivered@{domain}"),
            "cc": [format!("bounced@{domain}")], "bcc": ["anyone@example.com"],
            "subject": "Hi", "text": "Hello"});
        let id = app.send_accepted(&key, &body).await;
        let view = wait_for(&app, &key, &id, status_is("bounced")).await;
        assert_eq!(view["status"], "bounced", "{view}");
        let recipients: Vec<(&str, &str)> = view["recipients"]
            .as_array()
            .unwrap_or_else(|| panic!("no recipients: {view}"))
            .iter()
            .map(|r| (r["address"].as_str().unwrap(), r["status"].as_str().unwrap()))
            .collect();
        let bounced = format!("bounced@{domain}");
        let delivered = format!("delivered@{domain}");
        assert_eq!(
            recipients,
            [
                ("anyone@example.com", "delivered"),
                (bounced.as_str(), "bounced"),
                (delivered.as_str(), "delivered"),
            ],
            "{view}"
        );
        let listed = expect_json(
            app.tenant(&key, Method::GET, &format!("/v1/suppressions/{bounced}"))
                .send()
                .await
                .unwrap(),
            StatusCode::OK,
        )
        .await;
        assert_eq!(listed["reason"], "bounce", "{listed}");
        assert_eq!(ses_calls(&ses).await.len(), 0, "no SES call");
        // The console's page of the message lists them too.
        let (cookie, _) = crate::console::session_of(&app, crate::support::ADMIN_TOKEN).await;
        let page =
            crate::console::console_page(&app, &cookie, &format!("/console/messages/{id}")).await;
        let listed = page.split("<h2>Recipients</h2>").nth(1).unwrap_or_default();
        assert!(
            listed.contains("anyone@example.com")
                && listed.contains(&bounced)
                && listed.contains("Permanent: General (simulated)"),
            "{page}"
        );
    }
}
