//! Several events per webhook call: an endpoint set with
//! `max_events_per_call` above 1 gets batches (`{"events": [...]}`),
//! signed as one call, in event order, each event once, and a failed
//! batch's events are tried again until delivered. The field is checked
//! and shown like the others.

use std::collections::BTreeSet;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use crate::delivery::{mock_sms_ok, status_is, wait_for};
use crate::receipts::app_with_callbacks;
use crate::support::{TestApp, expect_field_error, expect_json, on_both_stores, sms, with};
use crate::webhooks::{FAST_WEBHOOKS, body_of, verify_with_standard_webhooks};

/// One call at a time per tenant, so events pile up while a call is out.
const ONE_CALL_AT_A_TIME: &str = "concurrency_per_tenant = 1\nmax_concurrency_per_tenant = 1\n";

const MESSAGES: usize = 30;

async fn put(app: &TestApp, key: &str, body: Value) -> reqwest::Response {
    app.tenant(key, Method::PUT, "/v1/webhook")
        .json(&body)
        .send()
        .await
        .unwrap()
}

/// An endpoint answering 204 after `delay`, first `failing` calls 500.
async fn slow_endpoint(delay: Duration, failing: u64) -> MockServer {
    let server = MockServer::start().await;
    if failing > 0 {
        Mock::given(method("POST"))
            .respond_with(ResponseTemplate::new(500).set_delay(delay))
            .up_to_n_times(failing)
            .with_priority(1)
            .mount(&server)
            .await;
    }
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(204).set_delay(delay))
        .with_priority(2)
        .mount(&server)
        .await;
    server
}

/// The event ids (`evt_…`) each call carried, in the order the calls came.
fn batches(calls: &[Request]) -> Vec<Vec<String>> {
    calls
        .iter()
        .map(|call| {
            let body = body_of(call);
            let events = body["events"].as_array().unwrap_or_else(|| {
                panic!("a batching endpoint's call is a batch: {body}");
            });
            events
                .iter()
                .map(|event| {
                    assert_eq!(event["type"], "message.sent", "{event}");
                    assert_eq!(event["data"]["status"], "sent", "{event}");
                    assert!(event["timestamp"].is_string(), "{event}");
                    event["id"].as_str().unwrap().to_owned()
                })
                .collect()
        })
        .collect()
}

fn number(id: &str) -> i64 {
    id.trim_start_matches("evt_").parse().unwrap()
}

/// Sends [`MESSAGES`] SMS and waits until each is `sent`; their ids.
async fn send_all(app: &TestApp, key: &str) -> Vec<String> {
    let mut ids = Vec::new();
    for n in 0..MESSAGES {
        let body = with(sms(), "text", json!(format!("Batch {n}")));
        ids.push(app.send_accepted(key, &body).await);
    }
    for id in &ids {
        wait_for(app, key, id, status_is("sent")).await;
    }
    ids
}

/// Waits until the calls answered 2xx (those after the first `failing`)
/// carry `count` distinct events, or 20 s; every call received.
async fn delivered(server: &MockServer, failing: usize, count: usize) -> Vec<Request> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let calls = server.received_requests().await.unwrap_or_default();
        let got: BTreeSet<String> = batches(calls.get(failing..).unwrap_or_default())
            .into_iter()
            .flatten()
            .collect();
        if got.len() >= count || std::time::Instant::now() > deadline {
            return calls;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

on_both_stores! {
    /// Thirty `message.sent` events to an endpoint taking ten per call,
    /// one call at a time and each taking 300 ms: they come in batches of
    /// at most ten, far fewer calls than events, in event order, each
    /// event once, and every call verifies with the reference library.
    async fn a_batching_endpoint_gets_its_events_several_per_call_in_order() {
    let sms_api = MockServer::start().await;
    mock_sms_ok(&sms_api, "SM-BATCH").await;
    let config = format!("{FAST_WEBHOOKS}{ONE_CALL_AT_A_TIME}");
    let app = app_with_callbacks(&sms_api, &config).await;
    let key = app.tenant_with_key("acme", "pro").await;
    let endpoint = slow_endpoint(Duration::from_millis(300), 0).await;
    let body = json!({"url": endpoint.uri(), "events": ["message.sent"], "max_events_per_call": 10});
    let created = expect_json(put(&app, &key, body).await, StatusCode::CREATED).await;
    assert_eq!(created["max_events_per_call"], 10, "{created}");
    let secret = created["secret"].as_str().unwrap().to_owned();

    let ids = send_all(&app, &key).await;
    let calls = delivered(&endpoint, 0, MESSAGES).await;
    let carried = batches(&calls);
    let events: Vec<String> = carried.iter().flatten().cloned().collect();
    let distinct: BTreeSet<&String> = events.iter().collect();
    assert_eq!(distinct.len(), MESSAGES, "every event delivered: {carried:?}");
    assert_eq!(events.len(), MESSAGES, "each event once: {carried:?}");
    assert!(carried.iter().all(|batch| (1..=10).contains(&batch.len())), "{carried:?}");
    assert!(
        carried.len() <= MESSAGES / 2,
        "{} calls for {MESSAGES} events: not batched ({carried:?})",
        carried.len()
    );
    let numbers: Vec<i64> = events.iter().map(|id| number(id)).collect();
    assert!(numbers.windows(2).all(|pair| pair[0] < pair[1]), "in event order: {numbers:?}");
    let messages: BTreeSet<String> = calls
        .iter()
        .flat_map(|call| {
            let body = body_of(call);
            body["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(|event| event["data"]["id"].as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(messages, ids.iter().cloned().collect(), "one event per message");
    for call in &calls {
        let id = call.headers["webhook-id"].to_str().unwrap();
        assert!(id.starts_with("evts_"), "{id}");
    }
    verify_with_standard_webhooks(&secret, &calls);
    }
}

on_both_stores! {
    /// The first two calls fail: the events they carried are tried again
    /// and all thirty reach the endpoint.
    async fn a_failed_batchs_events_are_tried_again_until_delivered() {
    let sms_api = MockServer::start().await;
    mock_sms_ok(&sms_api, "SM-BATCH-RETRY").await;
    let config = format!("{FAST_WEBHOOKS}{ONE_CALL_AT_A_TIME}");
    let app = app_with_callbacks(&sms_api, &config).await;
    let key = app.tenant_with_key("acme", "pro").await;
    let endpoint = slow_endpoint(Duration::from_millis(100), 2).await;
    let body = json!({"url": endpoint.uri(), "events": ["message.sent"], "max_events_per_call": 8});
    expect_json(put(&app, &key, body).await, StatusCode::CREATED).await;

    send_all(&app, &key).await;
    let calls = delivered(&endpoint, 2, MESSAGES).await;
    let carried = batches(&calls);
    let failed: BTreeSet<&String> = carried[..2].iter().flatten().collect();
    assert!(!failed.is_empty(), "{carried:?}");
    let answered: BTreeSet<&String> = carried[2..].iter().flatten().collect();
    assert_eq!(answered.len(), MESSAGES, "every event delivered: {carried:?}");
    assert!(failed.is_subset(&answered), "the failed calls' events came again: {carried:?}");
    }
}

/// `max_events_per_call` is 1 unless set, between 1 and 100, named when
/// wrong, and changed by a later `PUT`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_events_per_call_is_checked_shown_and_changed() {
    let app = TestApp::start(FAST_WEBHOOKS).await;
    let key = app.tenant_with_key("acme", "pro").await;
    let url = "http://127.0.0.1:9/hook";
    for wrong in [json!(0), json!(101), json!(-3)] {
        let body = json!({"url": url, "events": ["message.sent"], "max_events_per_call": wrong});
        expect_field_error(put(&app, &key, body).await, "max_events_per_call").await;
    }
    let body = json!({"url": url, "events": ["message.sent"], "max_events_per_call": "ten"});
    let refused = put(&app, &key, body).await;
    assert_eq!(refused.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let problem: Value = refused.json().await.unwrap();
    assert!(
        problem.to_string().contains("max_events_per_call"),
        "{problem}"
    );
    let body = json!({"url": url, "events": ["message.sent"]});
    let created = expect_json(put(&app, &key, body).await, StatusCode::CREATED).await;
    assert_eq!(created["max_events_per_call"], 1, "{created}");
    let body = json!({"url": url, "events": ["message.sent"], "max_events_per_call": 100});
    let changed = expect_json(put(&app, &key, body).await, StatusCode::OK).await;
    assert_eq!(changed["max_events_per_call"], 100, "{changed}");
}
