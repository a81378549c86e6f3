//! A tenant's two worlds, kept apart: what a test key sends and what a live
//! key sends never meet. A test key cannot read, cancel or count live
//! messages (nor a live key test ones), an `Idempotency-Key` is remembered
//! per world, test messages have in-flight places of their own, and the
//! settings both worlds share (webhook, suppressions) change only with a
//! live key.

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use wiremock::MockServer;

use crate::delivery::{delivery_settings, mock_sms_ok, status_is, wait_for, wait_until};
use crate::support::{TestApp, email, expect_json, expect_problem, on_both_stores, sms, with};
use crate::test_keys::issue;
use crate::webhooks::endpoint_ok;

/// A live and a test key of tenant `acme` on `plan`.
async fn live_and_test_keys(app: &TestApp, plan: &str) -> (String, String) {
    app.create_tenant("acme", plan).await;
    let live = issue(app, "acme", Some("live")).await["key"]
        .as_str()
        .unwrap()
        .to_owned();
    let test = issue(app, "acme", Some("test")).await["key"]
        .as_str()
        .unwrap()
        .to_owned();
    (live, test)
}

async fn status_of(app: &TestApp, key: &str, id: &str) -> Value {
    expect_json(app.get_message(key, id).await, StatusCode::OK).await
}

/// What `key` gets for the other world's message `id`: 404 on every route.
async fn other_world_is_not_found(app: &TestApp, key: &str, id: &str) {
    for (method, path) in [
        (Method::GET, format!("/v1/messages/{id}")),
        (Method::GET, format!("/v1/messages/{id}/events")),
        (Method::DELETE, format!("/v1/messages/{id}")),
    ] {
        let response = app.tenant(key, method.clone(), &path).send().await.unwrap();
        expect_problem(response, StatusCode::NOT_FOUND).await;
    }
}

async fn cancel_reference(app: &TestApp, key: &str, reference: &str) -> Value {
    let response = app
        .tenant(
            key,
            Method::DELETE,
            &format!("/v1/messages?reference={reference}"),
        )
        .send()
        .await
        .unwrap();
    expect_json(response, StatusCode::OK).await
}

on_both_stores! {
    /// Consumers are off here, so both messages wait `queued` until one of
    /// the cancels reaches it.
    async fn a_key_reaches_only_its_own_worlds_messages() {
        let app = TestApp::start("").await;
        let (live, test) = live_and_test_keys(&app, "pro").await;
        let body = with(email(), "reference", json!("order-7"));
        let live_id = app.send_accepted(&live, &body).await;
        let test_id = app.send_accepted(&test, &body).await;

        other_world_is_not_found(&app, &test, &live_id).await;
        other_world_is_not_found(&app, &live, &test_id).await;

        // A cancel by reference reaches the caller's world only.
        let cancelled = cancel_reference(&app, &test, "order-7").await;
        assert_eq!(cancelled, json!({"cancelled": 1, "not_cancelled": 0}));
        assert_eq!(status_of(&app, &live, &live_id).await["status"], "queued");
        assert_eq!(status_of(&app, &test, &test_id).await["status"], "cancelled");
        let cancelled = cancel_reference(&app, &live, "order-7").await;
        assert_eq!(cancelled, json!({"cancelled": 1, "not_cancelled": 0}));
        assert_eq!(status_of(&app, &live, &live_id).await["status"], "cancelled");

        // Each key's usage counts its own world only.
        for (key, test_world) in [(&live, false), (&test, true)] {
            let usage = expect_json(
                app.tenant(key, Method::GET, "/v1/usage").send().await.unwrap(),
                StatusCode::OK,
            )
            .await;
            let days = usage["days"].as_array().unwrap();
            assert!(!days.is_empty(), "{usage}");
            assert!(days.iter().all(|day| day["test"] == test_world), "{usage}");
            let totals = usage["totals"].as_array().unwrap();
            assert_eq!(totals.len(), 1, "{usage}");
            assert_eq!(totals[0]["accepted"], 1, "{usage}");
            assert_eq!(totals[0]["cancelled"], 1, "{usage}");
        }
        // The admin sees both.
        let usage = expect_json(
            app.admin(Method::GET, "/v1/admin/tenants/acme/usage").send().await.unwrap(),
            StatusCode::OK,
        )
        .await;
        assert_eq!(usage["totals"].as_array().unwrap().len(), 2, "{usage}");
    }
}

on_both_stores! {
    /// A live send after a test send with the same `Idempotency-Key` is a
    /// message of its own, and it is sent.
    async fn an_idempotency_key_is_remembered_per_world() {
        let sms_api = MockServer::start().await;
        mock_sms_ok(&sms_api, "SM-LIVE").await;
        let settings = delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", "");
        let app = TestApp::start(&settings).await;
        let (live, test) = live_and_test_keys(&app, "pro").await;

        let first = app.send_idempotent(&test, "order-8", &sms()).await;
        let test_answer = expect_json(first, StatusCode::ACCEPTED).await;
        let second = app.send_idempotent(&live, "order-8", &sms()).await;
        assert!(second.headers().get("idempotent-replayed").is_none());
        let live_answer = expect_json(second, StatusCode::ACCEPTED).await;
        assert_ne!(live_answer["id"], test_answer["id"]);

        let live_id = live_answer["id"].as_str().unwrap();
        let view = wait_for(&app, &live, live_id, status_is("sent")).await;
        assert_eq!(view["status"], "sent", "{view}");
        assert_eq!(sms_api.received_requests().await.unwrap().len(), 1);

        // Each world replays its own answer.
        for (key, answer) in [(&live, &live_answer), (&test, &test_answer)] {
            let again = app.send_idempotent(key, "order-8", &sms()).await;
            assert_eq!(
                again.headers().get("idempotent-replayed").map(|v| v.to_str().unwrap()),
                Some("true")
            );
            assert_eq!(expect_json(again, StatusCode::ACCEPTED).await["id"], answer["id"]);
        }
    }
}

/// Two test sends that never answer fill the test world's two places; a
/// live send of the same tenant goes out while both are still in their
/// first call. Were the places shared, the live send would wait for one of
/// those calls to time out, and so find a test message with an attempt
/// counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_sends_stuck_at_the_provider_do_not_hold_live_sends() {
    let sms_api = MockServer::start().await;
    mock_sms_ok(&sms_api, "SM-LIVE").await;
    let plan = "[plans.two]\nlane = \"fast\"\nrate_per_second = 100.0\nburst = 100\n\
                daily_quota = 1000\nmax_in_flight = 2\n";
    let settings = delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", plan);
    let app = TestApp::start_custom(&settings, |settings| {
        // The simulated timeout lasts the real provider's timeout.
        settings.providers.sms.timeout_ms = Some(20_000);
    })
    .await;
    let (live, test) = live_and_test_keys(&app, "two").await;
    let never_answers = with(sms(), "to", json!("+15005550005"));
    let mut stuck = Vec::new();
    for _ in 0..2 {
        stuck.push(app.send_accepted(&test, &never_answers).await);
    }
    for id in &stuck {
        let view = wait_for(&app, &test, id, status_is("sending")).await;
        assert_eq!(view["status"], "sending", "{view}");
    }

    let live_id = app.send_accepted(&live, &sms()).await;
    let view = wait_until(
        &app,
        &live,
        &live_id,
        status_is("sent"),
        Instant::now() + Duration::from_secs(15),
    )
    .await;
    assert_eq!(view["status"], "sent", "{view}");
    for id in &stuck {
        let view = status_of(&app, &test, id).await;
        assert_eq!(view["attempts"], 0, "still in its first call: {view}");
    }
}

/// The webhook and the suppression list serve both worlds: a test key may
/// read them, but only a live key changes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_test_key_cannot_change_what_live_messages_share() {
    let app =
        TestApp::start("[webhooks]\nallow_http = true\nallow_private = [\"127.0.0.1/32\"]\n").await;
    let (live, test) = live_and_test_keys(&app, "pro").await;
    let endpoint = endpoint_ok().await;
    let webhook = json!({"url": endpoint.uri(), "events": ["message.sent"]});
    let suppression = json!({"address": "someone@example.com"});

    let refused = [
        (Method::PUT, "/v1/webhook", Some(&webhook)),
        (Method::DELETE, "/v1/webhook", None),
        (Method::POST, "/v1/webhook/rotate", None),
        (Method::POST, "/v1/suppressions", Some(&suppression)),
        (Method::DELETE, "/v1/suppressions/someone@example.com", None),
    ];
    for (method, path, body) in &refused {
        let mut request = app.tenant(&test, method.clone(), path);
        if let Some(body) = body {
            request = request.json(body);
        }
        let (_, problem) =
            expect_problem(request.send().await.unwrap(), StatusCode::FORBIDDEN).await;
        assert!(
            problem["detail"].as_str().unwrap().contains("live key"),
            "{method} {path}: {problem}"
        );
    }

    // The live key sets both; the test key reads them and still cannot
    // lift the suppression.
    let response = app
        .tenant(&live, Method::PUT, "/v1/webhook")
        .json(&webhook)
        .send()
        .await
        .unwrap();
    expect_json(response, StatusCode::CREATED).await;
    let response = app
        .tenant(&live, Method::POST, "/v1/suppressions")
        .json(&suppression)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let seen = app
        .tenant(&test, Method::GET, "/v1/webhook")
        .send()
        .await
        .unwrap();
    let seen = expect_json(seen, StatusCode::OK).await;
    assert!(
        seen["url"]
            .as_str()
            .is_some_and(|url| url.starts_with(&endpoint.uri())),
        "{seen}"
    );
    let path = "/v1/suppressions/someone@example.com";
    let lift = app
        .tenant(&test, Method::DELETE, path)
        .send()
        .await
        .unwrap();
    expect_problem(lift, StatusCode::FORBIDDEN).await;
    let still = app.tenant(&test, Method::GET, path).send().await.unwrap();
    expect_json(still, StatusCode::OK).await;
}
