//! Tenant webhooks end to end: signed calls checked by the Standard
//! Webhooks reference library, isolation between tenants' endpoints,
//! at-least-once delivery in order per message, disabling and redrive,
//! no event lost over a restart, and where an endpoint may lead: https
//! only, no internal address (at `PUT` and again at every call), no
//! redirect, and only a general reason for a failure shown to the tenant.

use std::collections::HashMap;
use std::net::TcpListener;
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use crate::delivery::{mock_sms_ok, status_is, wait_for};
use crate::receipts::{app_with_callbacks, callback};
use crate::support::{
    TestApp, expect_field_error, expect_json, expect_problem, on_both_stores, sms, with,
};

/// Fast retries and polls so the tests run in seconds.
macro_rules! fast_webhooks {
    () => {
        "[webhooks]\npoll_interval_ms = 100\nretry_base_ms = 200\nretry_max_secs = 1\ntimeout_ms = 2000\n"
    };
}

/// Fast, and the endpoints these tests run (wiremock on
/// `http://127.0.0.1`) allowed: plain http and that one internal address.
pub(crate) const FAST_WEBHOOKS: &str = concat!(
    fast_webhooks!(),
    "allow_http = true\nallow_private = [\"127.0.0.1/32\"]\n"
);

/// Fast, with http allowed but no internal address.
const FAST_PUBLIC_ONLY: &str = concat!(fast_webhooks!(), "allow_http = true\n");

/// A Python with `standardwebhooks` (see `tests/servers`).
fn verifier_python() -> String {
    crate::servers::python()
}

/// Checks every recorded call's signature with the reference library.
pub(crate) fn verify_with_standard_webhooks(secret: &str, calls: &[Request]) {
    let recorded: Vec<Value> = calls
        .iter()
        .map(|call| {
            let headers: HashMap<String, String> =
                ["webhook-id", "webhook-timestamp", "webhook-signature"]
                    .iter()
                    .map(|name| {
                        let value = call.headers.get(*name).expect(name).to_str().unwrap();
                        ((*name).to_owned(), value.to_owned())
                    })
                    .collect();
            json!({"headers": headers, "body": String::from_utf8(call.body.clone()).unwrap()})
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("calls.json");
    std::fs::write(
        &file,
        json!({"secret": secret, "calls": recorded}).to_string(),
    )
    .unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/verify_webhooks.py");
    let output = std::process::Command::new(verifier_python())
        .arg(script)
        .arg(&file)
        .output()
        .expect("run the Standard Webhooks verifier");
    assert!(
        output.status.success(),
        "standardwebhooks refused a call: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

pub(crate) async fn set_webhook(app: &TestApp, key: &str, url: &str, events: &[&str]) -> Value {
    let response = app
        .tenant(key, Method::PUT, "/v1/webhook")
        .json(&json!({"url": url, "events": events}))
        .send()
        .await
        .unwrap();
    expect_json(response, StatusCode::CREATED).await
}

pub(crate) fn body_of(call: &Request) -> Value {
    serde_json::from_slice(&call.body).unwrap()
}

pub(crate) async fn endpoint_ok() -> MockServer {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(204))
        .mount(&server)
        .await;
    server
}

/// Waits until `server` has recorded `count` calls, or 15 s.
pub(crate) async fn calls_on(server: &MockServer, count: usize) -> Vec<Request> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let calls = server.received_requests().await.unwrap_or_default();
        if calls.len() >= count || Instant::now() > deadline {
            return calls;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

on_both_stores! {
    /// On either store: the migrations' triggers record the same events.
    async fn events_reach_the_tenants_endpoint_signed_to_the_standard_webhooks_spec() {
    let sms_api = MockServer::start().await;
    mock_sms_ok(&sms_api, "SM-HOOK-1").await;
    let app = app_with_callbacks(&sms_api, FAST_WEBHOOKS).await;
    let key = app.tenant_with_key("acme", "pro").await;
    let endpoint = endpoint_ok().await;
    let created = set_webhook(
        &app,
        &key,
        &endpoint.uri(),
        &["message.sent", "message.delivered"],
    )
    .await;
    let secret = created["secret"].as_str().unwrap().to_owned();
    assert!(secret.starts_with("whsec_"), "{created}");
    // The secret is shown once.
    let shown = expect_json(
        app.tenant(&key, Method::GET, "/v1/webhook")
            .send()
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await;
    assert!(shown.get("secret").is_none(), "{shown}");
    assert_eq!(shown["state"], "active");

    let id = app.send_accepted(&key, &sms()).await;
    wait_for(&app, &key, &id, status_is("sent")).await;
    callback(
        &app,
        "secret-token",
        &id,
        &[("MessageSid", "SM-HOOK-1"), ("MessageStatus", "delivered")],
    )
    .await;
    let calls = calls_on(&endpoint, 2).await;
    assert_eq!(calls.len(), 2, "{calls:?}");
    let first = body_of(&calls[0]);
    assert_eq!(first["type"], "message.sent", "{first}");
    assert_eq!(first["data"]["id"], id.as_str());
    assert_eq!(first["data"]["status"], "sent");
    let second = body_of(&calls[1]);
    assert_eq!(second["type"], "message.delivered", "{second}");
    assert_eq!(second["data"]["status"], "delivered");
    assert!(
        calls[0].headers["webhook-id"] != calls[1].headers["webhook-id"],
        "each event has its own webhook-id"
    );
    verify_with_standard_webhooks(&secret, &calls);

    // After a rotation each call carries both signatures: receivers on
    // either secret verify it.
    let rotated = expect_json(
        app.tenant(&key, Method::POST, "/v1/webhook/rotate")
            .send()
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await;
    let new_secret = rotated["secret"].as_str().unwrap().to_owned();
    assert_ne!(new_secret, secret);
    let next = app
        .send_accepted(&key, &with(sms(), "text", json!("Second")))
        .await;
    wait_for(&app, &key, &next, status_is("sent")).await;
    let calls = calls_on(&endpoint, 3).await;
    let last = &calls[2..];
    assert_eq!(body_of(&last[0])["data"]["id"], next.as_str());
    verify_with_standard_webhooks(&new_secret, last);
    verify_with_standard_webhooks(&secret, last);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_needs_an_https_url_and_known_event_types() {
    let sms_api = MockServer::start().await;
    let app = app_with_callbacks(&sms_api, FAST_WEBHOOKS).await;
    let key = app.tenant_with_key("acme", "pro").await;
    for (body, field) in [
        (
            json!({"url": "ftp://example.com/hook", "events": ["message.sent"]}),
            "url",
        ),
        (
            json!({"url": "not a url", "events": ["message.sent"]}),
            "url",
        ),
        (
            json!({"url": "https://", "events": ["message.sent"]}),
            "url",
        ),
        (
            json!({"url": "https://example.com/hook", "events": []}),
            "events",
        ),
        (
            json!({"url": "https://example.com/hook", "events": ["message.sending"]}),
            "events",
        ),
        (
            json!({"url": "https://example.com/hook", "events": ["message.sent"], "secret": "x"}),
            "secret",
        ),
    ] {
        let response = app
            .tenant(&key, Method::PUT, "/v1/webhook")
            .json(&body)
            .send()
            .await
            .unwrap();
        expect_field_error(response, field).await;
    }
    let missing = app
        .tenant(&key, Method::GET, "/v1/webhook")
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
}

/// An SMS API that answers every message with a sid of its own.
pub(crate) async fn sms_api_with_unique_sids() -> MockServer {
    let sms_api = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(UniqueSids(Default::default()))
        .mount(&sms_api)
        .await;
    sms_api
}

/// An SMS API that gives every message a sid of its own.
struct UniqueSids(std::sync::atomic::AtomicUsize);

impl wiremock::Respond for UniqueSids {
    fn respond(&self, _: &Request) -> ResponseTemplate {
        let n = self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ResponseTemplate::new(201).set_body_json(json!({"sid": format!("SM-U{n}")}))
    }
}

/// A free local port with nothing listening on it: calls to it are refused.
fn refused_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_endpoint_delays_only_its_own_tenant_and_gets_every_event_once_it_recovers() {
    let sms_api = sms_api_with_unique_sids().await;
    let app = app_with_callbacks(&sms_api, FAST_WEBHOOKS).await;
    let a = app.tenant_with_key("a", "pro").await;
    let b = app.tenant_with_key("b", "pro").await;
    let port = refused_port();
    let a_url = format!("http://127.0.0.1:{port}/hook");
    set_webhook(&app, &a, &a_url, &["message.sent", "message.delivered"]).await;
    let b_endpoint = endpoint_ok().await;
    set_webhook(&app, &b, &b_endpoint.uri(), &["message.sent"]).await;

    // A's endpoint refuses connections while both tenants send.
    let mut a_ids = Vec::new();
    let mut b_ids = Vec::new();
    for n in 0..10 {
        a_ids.push(
            app.send_accepted(&a, &with(sms(), "text", json!(format!("A {n}"))))
                .await,
        );
        b_ids.push(
            app.send_accepted(&b, &with(sms(), "text", json!(format!("B {n}"))))
                .await,
        );
    }
    for id in &a_ids {
        let view = wait_for(&app, &a, id, status_is("sent")).await;
        let sid = view["provider_message_id"].as_str().unwrap();
        let answer = callback(
            &app,
            "secret-token",
            id,
            &[("MessageSid", sid), ("MessageStatus", "delivered")],
        )
        .await;
        assert_eq!(answer.status(), StatusCode::NO_CONTENT);
    }
    let b_calls = calls_on(&b_endpoint, 10).await;
    assert_eq!(
        b_calls.len(),
        10,
        "B got {} of its 10 events",
        b_calls.len()
    );
    // Each of B's events arrived within a second of happening.
    for call in &b_calls {
        let body = body_of(call);
        let at = chrono::DateTime::parse_from_rfc3339(body["timestamp"].as_str().unwrap()).unwrap();
        let sent: i64 = call.headers["webhook-timestamp"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        let lag = sent - at.timestamp();
        assert!(
            lag <= 1,
            "B's event waited {lag} s behind A's dead endpoint: {body}"
        );
    }
    let failing = expect_json(
        app.admin(Method::GET, "/v1/admin/webhooks/failing")
            .send()
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await;
    assert_eq!(failing["webhooks"][0]["tenant_id"], "a", "{failing}");
    assert_eq!(failing["webhooks"][0]["state"], "failing", "{failing}");

    // Then it answers 500 for a while, then recovers.
    let listener = TcpListener::bind(("127.0.0.1", port)).expect("the refused port is free");
    let a_endpoint = MockServer::builder().listener(listener).start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(500))
        .up_to_n_times(5)
        .mount(&a_endpoint)
        .await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200))
        .mount(&a_endpoint)
        .await;
    // Every one of A's 20 events (sent and delivered of 10 messages) is
    // delivered: counted once per webhook-id among the 2xx answers.
    let deadline = Instant::now() + Duration::from_secs(30);
    let delivered = loop {
        let calls = a_endpoint.received_requests().await.unwrap_or_default();
        // The first five calls got 500.
        let ok: Vec<Request> = calls.into_iter().skip(5).collect();
        let ids: std::collections::HashSet<String> = ok
            .iter()
            .map(|c| c.headers["webhook-id"].to_str().unwrap().to_owned())
            .collect();
        if ids.len() >= 20 || Instant::now() > deadline {
            break ok;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut seen: HashMap<String, usize> = HashMap::new();
    for call in &delivered {
        *seen
            .entry(call.headers["webhook-id"].to_str().unwrap().to_owned())
            .or_default() += 1;
    }
    assert_eq!(seen.len(), 20, "A's distinct events delivered: {seen:?}");
    assert!(
        seen.values().all(|n| *n == 1),
        "an event was delivered twice: {seen:?}"
    );
    // In order per message: its `sent` before its `delivered`.
    let mut order: HashMap<String, Vec<String>> = HashMap::new();
    for call in &delivered {
        let body = body_of(call);
        order
            .entry(body["data"]["id"].as_str().unwrap().to_owned())
            .or_default()
            .push(body["type"].as_str().unwrap().to_owned());
    }
    for (id, types) in &order {
        assert_eq!(
            types,
            &["message.sent", "message.delivered"],
            "message {id}"
        );
    }
    let state = expect_json(
        app.tenant(&a, Method::GET, "/v1/webhook")
            .send()
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await;
    assert_eq!(state["state"], "active", "{state}");
    assert_eq!(state["pending"], 0, "{state}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_failing_too_long_is_disabled_and_an_admin_redrive_delivers_its_events() {
    let sms_api = MockServer::start().await;
    mock_sms_ok(&sms_api, "SM-DIS").await;
    let extra = format!("{FAST_WEBHOOKS}disable_after_secs = 1\n");
    let app = app_with_callbacks(&sms_api, &extra).await;
    let key = app.tenant_with_key("acme", "pro").await;
    let port = refused_port();
    set_webhook(
        &app,
        &key,
        &format!("http://127.0.0.1:{port}/"),
        &["message.sent"],
    )
    .await;
    let id = app.send_accepted(&key, &sms()).await;
    wait_for(&app, &key, &id, status_is("sent")).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    let view = loop {
        let view = expect_json(
            app.admin(Method::GET, "/v1/admin/tenants/acme/webhook")
                .send()
                .await
                .unwrap(),
            StatusCode::OK,
        )
        .await;
        if view["state"] == "disabled" || Instant::now() > deadline {
            break view;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(view["state"], "disabled", "{view}");
    assert_eq!(view["failed"], 1, "{view}");
    // Events while disabled are kept too.
    let later = app
        .send_accepted(&key, &with(sms(), "text", json!("later")))
        .await;
    wait_for(&app, &key, &later, status_is("sent")).await;

    let listener = TcpListener::bind(("127.0.0.1", port)).expect("the refused port is free");
    let endpoint = MockServer::builder().listener(listener).start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200))
        .mount(&endpoint)
        .await;
    let redriven = expect_json(
        app.admin(Method::POST, "/v1/admin/tenants/acme/webhook/redrive")
            .send()
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await;
    assert_eq!(redriven["redriven"], 2, "{redriven}");
    let calls = calls_on(&endpoint, 2).await;
    // Two messages: delivered side by side, so in either order.
    let mut ids: Vec<String> = calls
        .iter()
        .map(|c| body_of(c)["data"]["id"].as_str().unwrap().to_owned())
        .collect();
    ids.sort();
    let mut expected = vec![id, later];
    expected.sort();
    assert_eq!(ids, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_during_webhook_backoff_loses_no_event() {
    let sms_api = MockServer::start().await;
    mock_sms_ok(&sms_api, "SM-RST").await;
    let settings = crate::delivery::delivery_settings(
        &sms_api.uri(),
        "http://127.0.0.1:9",
        "[webhooks]\npoll_interval_ms = 100\nretry_base_ms = 2000\nretry_max_secs = 2\n\
         allow_http = true\nallow_private = [\"127.0.0.1/32\"]\n",
    );
    let app = TestApp::start(&settings).await;
    let key = app.tenant_with_key("acme", "pro").await;
    let port = refused_port();
    set_webhook(
        &app,
        &key,
        &format!("http://127.0.0.1:{port}/"),
        &["message.sent"],
    )
    .await;
    let id = app.send_accepted(&key, &sms()).await;
    wait_for(&app, &key, &id, status_is("sent")).await;
    // Wait until the first call has failed and the event waits in backoff.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let view = expect_json(
            app.tenant(&key, Method::GET, "/v1/webhook")
                .send()
                .await
                .unwrap(),
            StatusCode::OK,
        )
        .await;
        if view["state"] == "failing" {
            break;
        }
        assert!(Instant::now() < deadline, "the call never failed: {view}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let dir = app.stop().await;
    let listener = TcpListener::bind(("127.0.0.1", port)).expect("the refused port is free");
    let endpoint = MockServer::builder().listener(listener).start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200))
        .mount(&endpoint)
        .await;
    let restarted = TestApp::start_in(dir, &settings, |_| {}).await;
    let calls = calls_on(&endpoint, 1).await;
    assert_eq!(calls.len(), 1, "the event did not survive the restart");
    assert_eq!(body_of(&calls[0])["data"]["id"], id.as_str());
    drop(restarted);
}

// ----- where a webhook may lead -----

/// A public address, written in the URL so that setting it needs no DNS;
/// nothing is sent to it (no test here sends a message that would call it).
const PUBLIC: &str = "93.184.215.14";

async fn put_webhook(app: &TestApp, key: &str, url: &str) -> reqwest::Response {
    app.tenant(key, Method::PUT, "/v1/webhook")
        .json(&json!({"url": url, "events": ["message.sent"]}))
        .send()
        .await
        .unwrap()
}

async fn get_webhook(app: &TestApp, key: &str) -> reqwest::Response {
    app.tenant(key, Method::GET, "/v1/webhook")
        .send()
        .await
        .unwrap()
}

/// The tenant's webhook view (`GET /v1/webhook`, 200).
async fn webhook_view(app: &TestApp, key: &str) -> Value {
    expect_json(get_webhook(app, key).await, StatusCode::OK).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_addresses_are_refused_when_a_webhook_is_set() {
    let app = TestApp::start("[webhooks]\nallow_http = true\n").await;
    let key = app.tenant_with_key("acme", "pro").await;
    // A port something listens on: the refusal is not about the port.
    let endpoint = endpoint_ok().await;
    let port = endpoint.address().port();
    for url in [
        format!("http://127.0.0.1:{port}/hook"),
        "http://10.0.0.1/hook".to_owned(),
        "http://169.254.169.254/latest/meta-data/".to_owned(),
        format!("http://[::1]:{port}/hook"),
        format!("http://[::ffff:127.0.0.1]:{port}/hook"),
        format!("http://localhost:{port}/hook"),
        "https://172.16.5.4/".to_owned(),
        "https://192.168.1.1/".to_owned(),
        "https://100.64.0.1/".to_owned(),
        "https://0.0.0.0/".to_owned(),
        "https://255.255.255.255/".to_owned(),
        "https://224.0.0.1/".to_owned(),
        "https://[fd00::1]/".to_owned(),
        "https://[fe80::1]/".to_owned(),
        "https://[ff02::1]/".to_owned(),
        "https://[::]/".to_owned(),
        "https://2130706433/".to_owned(),
    ] {
        let body = expect_field_error(put_webhook(&app, &key, &url).await, "url").await;
        let why = body["errors"]["url"].as_str().unwrap();
        assert!(
            why.contains("internal") || why.contains("public addresses"),
            "{url}: {body}"
        );
    }
    // An admin setting it for the tenant is refused too.
    let response = app
        .admin(Method::PUT, "/v1/admin/tenants/acme/webhook")
        .json(&json!({"url": "http://169.254.169.254/", "events": ["message.sent"]}))
        .send()
        .await
        .unwrap();
    expect_field_error(response, "url").await;
    assert_eq!(
        get_webhook(&app, &key).await.status(),
        StatusCode::NOT_FOUND
    );
    assert!(endpoint.received_requests().await.unwrap().is_empty());
}

#[test]
fn the_webhook_url_is_documented_as_a_uri_of_at_most_2048_characters() {
    use utoipa::OpenApi;
    let doc = serde_json::to_value(fairlane::api::ApiDoc::openapi()).unwrap();
    let schemas = &doc["components"]["schemas"];
    let input = &schemas["WebhookInput"]["properties"]["url"];
    assert_eq!(input["format"], "uri", "{input}");
    assert_eq!(input["maxLength"], 2048, "{input}");
    let view = &schemas["WebhookView"]["properties"]["url"];
    assert_eq!(view["format"], "uri", "{view}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_allow_list_admits_the_listed_internal_ranges_and_no_other() {
    let app = TestApp::start(
        "[webhooks]\nallow_http = true\nallow_private = [\"127.0.0.1/32\", \"10.1.2.0/24\"]\n",
    )
    .await;
    let key = app.tenant_with_key("acme", "pro").await;
    let created = put_webhook(&app, &key, "http://127.0.0.1:9/hook").await;
    expect_json(created, StatusCode::CREATED).await;
    for url in ["http://10.1.2.3/hook", "http://[::ffff:127.0.0.1]:9/hook"] {
        expect_json(put_webhook(&app, &key, url).await, StatusCode::OK).await;
    }
    for url in [
        "http://10.1.3.1/hook",
        "http://127.0.0.2/hook",
        "http://[::1]/hook",
        "http://169.254.169.254/",
    ] {
        expect_field_error(put_webhook(&app, &key, url).await, "url").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_is_refused_unless_webhooks_allow_http_is_set() {
    let app = TestApp::start("").await;
    let key = app.tenant_with_key("acme", "pro").await;
    let body = expect_field_error(
        put_webhook(&app, &key, &format!("http://{PUBLIC}/hook")).await,
        "url",
    )
    .await;
    assert!(
        body["errors"]["url"].as_str().unwrap().contains("https"),
        "{body}"
    );
    assert_eq!(
        get_webhook(&app, &key).await.status(),
        StatusCode::NOT_FOUND
    );
    let created = put_webhook(&app, &key, &format!("https://{PUBLIC}/hook")).await;
    expect_json(created, StatusCode::CREATED).await;

    let app = TestApp::start("[webhooks]\nallow_http = true\n").await;
    let key = app.tenant_with_key("acme", "pro").await;
    let created = put_webhook(&app, &key, &format!("http://{PUBLIC}/hook")).await;
    expect_json(created, StatusCode::CREATED).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_with_user_info_or_control_characters_is_refused_and_one_is_stored_as_parsed() {
    let app = TestApp::start("").await;
    let key = app.tenant_with_key("acme", "pro").await;
    for url in [
        format!("https://user:secret@{PUBLIC}/hook"),
        format!("https://user@{PUBLIC}/hook"),
        format!("https://{PUBLIC}/hook\nX-Forged: yes"),
        format!("https://{PUBLIC}/ho\r\nok"),
        format!("https://{PUBLIC}/ho\tok"),
        format!("https://{PUBLIC}/hook\u{0}"),
    ] {
        expect_field_error(put_webhook(&app, &key, &url).await, "url").await;
    }
    assert_eq!(
        get_webhook(&app, &key).await.status(),
        StatusCode::NOT_FOUND
    );

    let created = expect_json(
        put_webhook(&app, &key, &format!(" HTTPS://{PUBLIC}:443/a b?x=1 ")).await,
        StatusCode::CREATED,
    )
    .await;
    let stored = format!("https://{PUBLIC}/a%20b?x=1");
    assert_eq!(created["url"], stored.as_str(), "{created}");
    let shown = expect_json(get_webhook(&app, &key).await, StatusCode::OK).await;
    assert_eq!(shown["url"], stored.as_str(), "{shown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disabled_tenant_cannot_change_its_webhook() {
    let app = TestApp::start("").await;
    let key = app.tenant_with_key("acme", "pro").await;
    let url = format!("https://{PUBLIC}/hook");
    expect_json(put_webhook(&app, &key, &url).await, StatusCode::CREATED).await;
    app.patch_tenant("acme", json!({"status": "disabled"}))
        .await;

    let other = format!("https://{PUBLIC}/other");
    let refused = [
        put_webhook(&app, &key, &other).await,
        app.tenant(&key, Method::DELETE, "/v1/webhook")
            .send()
            .await
            .unwrap(),
        app.tenant(&key, Method::POST, "/v1/webhook/rotate")
            .send()
            .await
            .unwrap(),
    ];
    for response in refused {
        let (_, body) = expect_problem(response, StatusCode::FORBIDDEN).await;
        assert!(
            body["detail"].as_str().unwrap().contains("disabled"),
            "{body}"
        );
    }
    // It may still read it, unchanged.
    let shown = expect_json(get_webhook(&app, &key).await, StatusCode::OK).await;
    assert_eq!(shown["url"], url.as_str(), "{shown}");

    app.patch_tenant("acme", json!({"status": "active"})).await;
    let changed = expect_json(put_webhook(&app, &key, &other).await, StatusCode::OK).await;
    assert_eq!(changed["url"], other.as_str(), "{changed}");
}

/// Stores a webhook for `tenant` without the checks of `PUT`, as if its
/// host had resolved to a public address then: a name that rebinds, or
/// an endpoint stored under other settings.
async fn store_webhook_unchecked(app: &TestApp, tenant: &str, url: &str) {
    app.state
        .db
        .put_webhook(
            tenant,
            &fairlane::store::webhooks::Endpoint {
                url,
                events: " message.sent ",
                max_events_per_call: 1,
            },
            fairlane::webhooks::sign::new_secret(),
        )
        .await
        .unwrap();
}

/// Polls the tenant's webhook until `last_error` is set, or 15 s.
async fn last_error(app: &TestApp, key: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let view = expect_json(get_webhook(app, key).await, StatusCode::OK).await;
        if !view["last_error"].is_null() || Instant::now() > deadline {
            return view;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_resolves_to_an_internal_address_at_call_time_is_not_called() {
    let sms_api = sms_api_with_unique_sids().await;
    let app = app_with_callbacks(&sms_api, FAST_PUBLIC_ONLY).await;
    let endpoint = endpoint_ok().await;
    let port = endpoint.address().port();
    // `localhost` stands for a name that resolved to a public address when
    // it was set and resolves to 127.0.0.1 now (DNS rebinding); the others
    // are addresses written in the URL, which the client does not resolve.
    for (tenant, url) in [
        ("rebinding", format!("http://localhost:{port}/hook")),
        ("literal", format!("http://127.0.0.1:{port}/hook")),
        ("mapped", format!("http://[::ffff:127.0.0.1]:{port}/hook")),
    ] {
        let key = app.tenant_with_key(tenant, "pro").await;
        store_webhook_unchecked(&app, tenant, &url).await;
        let id = app.send_accepted(&key, &sms()).await;
        wait_for(&app, &key, &id, status_is("sent")).await;
        let view = last_error(&app, &key).await;
        assert_eq!(
            view["last_error"], "address not allowed",
            "{tenant}: {view}"
        );
        assert_eq!(view["state"], "failing", "{tenant}: {view}");
    }
    // Retries are refused as well.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        endpoint.received_requests().await.unwrap().is_empty(),
        "an internal endpoint was called"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_not_followed() {
    let sms_api = MockServer::start().await;
    mock_sms_ok(&sms_api, "SM-REDIRECT").await;
    let app = app_with_callbacks(&sms_api, FAST_WEBHOOKS).await;
    let key = app.tenant_with_key("acme", "pro").await;
    let target = endpoint_ok().await;
    let redirecting = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(307).insert_header("location", format!("{}/", target.uri())),
        )
        .mount(&redirecting)
        .await;
    set_webhook(&app, &key, &redirecting.uri(), &["message.sent"]).await;
    let id = app.send_accepted(&key, &sms()).await;
    wait_for(&app, &key, &id, status_is("sent")).await;
    let view = last_error(&app, &key).await;
    assert_eq!(view["last_error"], "HTTP 307", "{view}");
    assert!(!redirecting.received_requests().await.unwrap().is_empty());
    assert!(target.received_requests().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenant_sees_a_general_reason_for_a_failed_call_and_no_network_detail() {
    let sms_api = sms_api_with_unique_sids().await;
    let extra = FAST_WEBHOOKS.replace("timeout_ms = 2000", "timeout_ms = 300");
    let app = app_with_callbacks(&sms_api, &extra).await;
    let failing = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(500).set_body_string("db01.internal: stack trace"))
        .mount(&failing)
        .await;
    let slow = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_delay(Duration::from_secs(2)))
        .mount(&slow)
        .await;
    let refused = format!("http://127.0.0.1:{}/hook", refused_port());
    for (tenant, url, reason) in [
        ("refused", refused, "connection failed"),
        ("failing", failing.uri(), "HTTP 500"),
        ("slow", slow.uri(), "timeout"),
    ] {
        let key = app.tenant_with_key(tenant, "pro").await;
        set_webhook(&app, &key, &url, &["message.sent"]).await;
        let id = app.send_accepted(&key, &sms()).await;
        wait_for(&app, &key, &id, status_is("sent")).await;
        let view = last_error(&app, &key).await;
        assert_eq!(view["last_error"], reason, "{tenant}: {view}");
    }
    let listed = expect_json(
        app.admin(Method::GET, "/v1/admin/webhooks/failing")
            .send()
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await;
    let mut reasons: Vec<&str> = listed["webhooks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["last_error"].as_str().unwrap())
        .collect();
    reasons.sort();
    assert_eq!(
        reasons,
        ["HTTP 500", "connection failed", "timeout"],
        "{listed}"
    );
}

/// An endpoint answering `status` after `delay`, which records the most
/// calls it had in progress at once.
struct CountingEndpoint {
    url: String,
    peak: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    answered: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    _server: tokio::task::JoinHandle<()>,
}

impl CountingEndpoint {
    async fn start(status: u16, delay: Duration) -> CountingEndpoint {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let (now, peak, answered) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
        );
        let counters = (now.clone(), peak.clone(), answered.clone());
        let app = axum::Router::new().fallback(move || {
            let (now, peak, answered) = counters.clone();
            async move {
                let at_once = now.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(at_once, Ordering::SeqCst);
                tokio::time::sleep(delay).await;
                now.fetch_sub(1, Ordering::SeqCst);
                answered.fetch_add(1, Ordering::SeqCst);
                axum::http::StatusCode::from_u16(status).unwrap()
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        CountingEndpoint {
            url,
            peak,
            answered,
            _server: server,
        }
    }

    fn peak(&self) -> usize {
        self.peak.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn answered(&self) -> usize {
        self.answered.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A healthy endpoint behind a backlog gets more calls at once than
/// `concurrency_per_tenant`, never more than `max_concurrency_per_tenant`;
/// a failing one never gets more than `concurrency_per_tenant`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_endpoint_with_a_backlog_gets_more_calls_at_once_and_a_failing_one_does_not() {
    const MESSAGES: usize = 150;
    let sms_api = sms_api_with_unique_sids().await;
    let settings = concat!(
        fast_webhooks!(),
        "allow_http = true\nallow_private = [\"127.0.0.1/32\"]\n",
        "concurrency_per_tenant = 2\nmax_concurrency_per_tenant = 12\n"
    );
    let app = app_with_callbacks(&sms_api, settings).await;
    crate::sqs::bulk_plan(&app).await;
    let healthy_key = app.tenant_with_key("healthy", "bulk").await;
    let failing_key = app.tenant_with_key("failing", "bulk").await;
    let healthy = CountingEndpoint::start(204, Duration::from_millis(50)).await;
    let failing = CountingEndpoint::start(500, Duration::from_millis(50)).await;
    set_webhook(&app, &healthy_key, &healthy.url, &["message.sent"]).await;
    set_webhook(&app, &failing_key, &failing.url, &["message.sent"]).await;
    for n in 0..MESSAGES {
        for key in [&healthy_key, &failing_key] {
            app.send_accepted(key, &with(sms(), "text", json!(format!("hook {n}"))))
                .await;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while healthy.answered() < MESSAGES && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Later copies (a call taken again before its removal committed)
    // would arrive by now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        healthy.answered(),
        MESSAGES,
        "every healthy call answered once"
    );
    assert!(
        (3..=12).contains(&healthy.peak()),
        "the healthy endpoint had at most {} calls at once (2 to begin with, 12 at most)",
        healthy.peak()
    );
    assert!(failing.answered() > 0, "the failing endpoint was called");
    assert!(
        failing.peak() <= 2,
        "the failing endpoint had {} calls at once",
        failing.peak()
    );
}

/// The dispatcher is woken by a delivery's outcome, not only by its poll:
/// with a poll every 10 s, a `message.sent` call still arrives within a
/// second of the send.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sent_message_wakes_the_dispatcher_without_waiting_for_its_poll() {
    let sms_api = MockServer::start().await;
    mock_sms_ok(&sms_api, "SM-WAKE").await;
    let settings = "[webhooks]\npoll_interval_ms = 10000\nallow_http = true\nallow_private = [\"127.0.0.1/32\"]\n";
    let app = app_with_callbacks(&sms_api, settings).await;
    let key = app.tenant_with_key("acme", "pro").await;
    let endpoint = endpoint_ok().await;
    set_webhook(&app, &key, &endpoint.uri(), &["message.sent"]).await;
    // The first poll after start-up has passed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for n in 0..3 {
        let sent_at = Instant::now();
        let id = app
            .send_accepted(&key, &with(sms(), "text", json!(format!("wake {n}"))))
            .await;
        let calls = calls_on(&endpoint, n + 1).await;
        let waited = sent_at.elapsed();
        assert_eq!(calls.len(), n + 1, "the call for {id} arrived");
        assert_eq!(body_of(&calls[n])["data"]["id"], id.as_str());
        assert!(
            waited < Duration::from_secs(3),
            "the call for {id} came {waited:?} after the send, with a 10 s poll"
        );
    }
}

/// The tenant's and the admin's webhook view show the endpoint's backlog:
/// pending events, those due and not yet called, and when the oldest one
/// happened; all clear once the calls are made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_view_shows_the_backlog_its_due_calls_and_the_oldest_event() {
    let sms_api = sms_api_with_unique_sids().await;
    let settings = concat!(
        fast_webhooks!(),
        "allow_http = true\nallow_private = [\"127.0.0.1/32\"]\n",
        "concurrency_per_tenant = 1\nmax_concurrency_per_tenant = 1\n"
    );
    let app = app_with_callbacks(&sms_api, settings).await;
    let key = app.tenant_with_key("acme", "pro").await;
    // Each call is held 1.5 s: one in flight, the others wait.
    let endpoint = CountingEndpoint::start(204, Duration::from_millis(1500)).await;
    set_webhook(&app, &key, &endpoint.url, &["message.sent"]).await;
    let before = chrono::Utc::now();
    let mut ids = Vec::new();
    for n in 0..5 {
        ids.push(
            app.send_accepted(&key, &with(sms(), "text", json!(format!("backlog {n}"))))
                .await,
        );
    }
    for id in &ids {
        wait_for(&app, &key, id, status_is("sent")).await;
    }
    // The first call is in progress (it is held 1.5 s).
    let deadline = Instant::now() + Duration::from_secs(10);
    while endpoint.peak() == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let tenant = webhook_view(&app, &key).await;
    let admin = expect_json(
        app.admin(Method::GET, "/v1/admin/tenants/acme/webhook")
            .send()
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await;
    let after = chrono::Utc::now();
    for seen in [&tenant, &admin] {
        let pending = seen["pending"].as_i64().unwrap();
        let due = seen["due"].as_i64().unwrap();
        // A first call that ended meanwhile is gone; one is in flight.
        assert!((3..=5).contains(&pending), "{seen}");
        assert_eq!(due, pending - 1, "one call in flight, the rest due: {seen}");
        let oldest = chrono::DateTime::parse_from_rfc3339(
            seen["oldest_pending_at"]
                .as_str()
                .expect("oldest_pending_at"),
        )
        .unwrap();
        assert!(
            oldest >= before - chrono::Duration::milliseconds(1) && oldest <= after,
            "{seen}"
        );
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while endpoint.answered() < 5 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(endpoint.answered(), 5);
    // The removal of the last call commits in its recorder's next batch.
    let deadline = Instant::now() + Duration::from_secs(5);
    let cleared = loop {
        let seen = webhook_view(&app, &key).await;
        if seen["pending"] == 0 || Instant::now() > deadline {
            break seen;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(cleared["pending"], 0, "{cleared}");
    assert_eq!(cleared["due"], 0, "{cleared}");
    assert!(cleared["oldest_pending_at"].is_null(), "{cleared}");
}

/// An endpoint that fails at once is paused after five failed calls in a
/// row and then tried one call at a time, instead of being called as fast
/// as events come and retries fall due. (That it gets every event once it
/// answers again: `a_dead_endpoint_delays_only_its_own_tenant_…`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_failing_at_once_is_paused_and_then_tried_one_call_at_a_time() {
    const MESSAGES: usize = 40;
    let sms_api = sms_api_with_unique_sids().await;
    let app = app_with_callbacks(&sms_api, FAST_WEBHOOKS).await;
    crate::sqs::bulk_plan(&app).await;
    let key = app.tenant_with_key("acme", "bulk").await;
    let failing = CountingEndpoint::start(500, Duration::ZERO).await;
    set_webhook(&app, &key, &failing.url, &["message.sent"]).await;
    let started = Instant::now();
    let mut ids = Vec::new();
    for n in 0..MESSAGES {
        ids.push(
            app.send_accepted(&key, &with(sms(), "text", json!(format!("paused {n}"))))
                .await,
        );
    }
    for id in &ids {
        wait_for(&app, &key, id, status_is("sent")).await;
    }
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(started.elapsed())).await;
    // Five failures and the calls then in flight (4 at once), then a
    // probe after each pause: 0.2, 0.4, 0.8, 1 s, … With no pause, each
    // of the 40 events is called at once and again every 0.1 – 1 s.
    let calls = failing.answered();
    assert!(
        (5..=20).contains(&calls),
        "{calls} calls in 3 s to an endpoint that fails at once"
    );
    let view = webhook_view(&app, &key).await;
    assert_eq!(view["state"], "failing", "{view}");
    assert_eq!(view["pending"], MESSAGES, "{view}");
}
