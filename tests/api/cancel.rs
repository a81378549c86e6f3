//! `DELETE /v1/messages/{id}` and `DELETE /v1/messages?reference=…`: an
//! unsent message becomes `cancelled` and is never sent, even when a
//! consumer already holds it waiting for a provider token; one being sent or
//! ended is a 409 naming its status; another tenant's is a 404.

use std::time::{Duration, Instant};

use fairlane::model::Lane;
use reqwest::{Method, Response, StatusCode};
use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::batch::{accepted_ids, send_batch};
use crate::delivery::{
    SMS_PATH, delivery_settings, mock_sms_ok, sms_requests, status_is, wait_for,
};
use crate::support::*;

/// `DELETE /v1/messages/{id}`.
async fn cancel(app: &TestApp, key: &str, id: &str) -> Response {
    app.tenant(key, Method::DELETE, &format!("/v1/messages/{id}"))
        .send()
        .await
        .expect("cancel message")
}

/// `DELETE /v1/messages` with `query` as the query string.
async fn cancel_where(app: &TestApp, key: &str, query: &str) -> Response {
    app.tenant(key, Method::DELETE, &format!("/v1/messages{query}"))
        .send()
        .await
        .expect("cancel by reference")
}

/// Cancels by `reference`; asserts the 200 and returns `(cancelled, not_cancelled)`.
async fn cancel_reference(app: &TestApp, key: &str, reference: &str) -> (u64, u64) {
    let response = cancel_where(app, key, &format!("?reference={reference}")).await;
    let counts = expect_json(response, StatusCode::OK).await;
    (
        counts["cancelled"].as_u64().expect("cancelled"),
        counts["not_cancelled"].as_u64().expect("not_cancelled"),
    )
}

/// The status a tenant reads for `id`.
async fn status_of(app: &TestApp, key: &str, id: &str) -> Value {
    let view = expect_json(app.get_message(key, id).await, StatusCode::OK).await;
    view["status"].clone()
}

/// Asserts a 409 problem whose detail names `status`.
async fn expect_conflict_naming(response: Response, status: &str) {
    let (_, problem) = expect_problem_kind(response, StatusCode::CONFLICT, "conflict").await;
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains(&format!("is {status}")),
        "the 409 should name {status:?}: {problem}"
    );
}

on_both_stores! {
    async fn a_queued_message_is_cancelled_and_a_second_cancel_is_a_409_naming_cancelled() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let id = app.send_accepted(&key, &sms()).await;

        let view = expect_json(cancel(&app, &key, &id).await, StatusCode::OK).await;

        assert_eq!(view["id"], id.as_str(), "{view}");
        assert_eq!(view["status"], "cancelled", "{view}");
        assert_eq!(status_of(&app, &key, &id).await, "cancelled");
        expect_conflict_naming(cancel(&app, &key, &id).await, "cancelled").await;
        assert_eq!(status_of(&app, &key, &id).await, "cancelled");
    }
}

on_both_stores! {
    async fn cancelling_an_unknown_id_or_another_tenants_message_is_a_404() {
        let app = TestApp::start("").await;
        let owner = app.tenant_with_key("acme", "pro").await;
        let stranger = app.tenant_with_key("globex", "pro").await;
        let id = app.send_accepted(&owner, &sms()).await;

        expect_problem(cancel(&app, &owner, "no-such-message").await, StatusCode::NOT_FOUND).await;
        expect_problem(
            cancel(&app, &owner, &uuid::Uuid::now_v7().to_string()).await,
            StatusCode::NOT_FOUND,
        )
        .await;
        expect_problem(cancel(&app, &stranger, &id).await, StatusCode::NOT_FOUND).await;

        assert_eq!(status_of(&app, &owner, &id).await, "queued");
    }
}

on_both_stores! {
    async fn cancel_by_reference_cancels_every_unsent_message_with_it_and_counts_the_ones_left() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let other_tenant = app.tenant_with_key("globex", "pro").await;
        let sale = with(sms(), "reference", json!("spring-sale"));
        let answer = send_batch(
            &app,
            &key,
            &[sale.clone(), sale.clone(), sale.clone(), with(sms(), "reference", json!("receipts"))],
        )
        .await;
        let ids = accepted_ids(&answer);
        let scheduled = with(
            sale.clone(),
            "send_at",
            json!(crate::scheduled::rfc3339_in(chrono::Duration::hours(1))),
        );
        let later = app.send_accepted(&key, &scheduled).await;
        let theirs = app.send_accepted(&other_tenant, &sale).await;
        // One of them has ended already.
        assert_eq!(cancel(&app, &key, &ids[0]).await.status(), StatusCode::OK);

        assert_eq!(cancel_reference(&app, &key, "spring-sale").await, (3, 1));

        for id in [&ids[1], &ids[2], &later] {
            assert_eq!(status_of(&app, &key, id).await, "cancelled", "{id}");
        }
        assert_eq!(status_of(&app, &key, &ids[3]).await, "queued", "another reference");
        assert_eq!(status_of(&app, &other_tenant, &theirs).await, "queued", "another tenant");
        assert_eq!(cancel_reference(&app, &key, "spring-sale").await, (0, 4));
        assert_eq!(cancel_reference(&app, &key, "no-such-reference").await, (0, 0));
    }
}

on_both_stores! {
    async fn cancel_by_reference_without_a_reference_is_a_400_and_with_an_empty_or_long_one_a_422() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let id = app.send_accepted(&key, &with(sms(), "reference", json!("x")))
            .await;

        expect_problem(cancel_where(&app, &key, "").await, StatusCode::BAD_REQUEST).await;
        expect_problem(cancel_where(&app, &key, "?ref=x").await, StatusCode::BAD_REQUEST).await;
        expect_field_error(cancel_where(&app, &key, "?reference=").await, "reference").await;
        let long = "r".repeat(256);
        expect_field_error(cancel_where(&app, &key, &format!("?reference={long}")).await, "reference")
            .await;

        assert_eq!(status_of(&app, &key, &id).await, "queued");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sent_message_cannot_be_cancelled_by_id_or_by_reference() {
    let sms_api = MockServer::start().await;
    mock_sms_ok(&sms_api, "SM-DONE").await;
    let app = TestApp::start(&delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", "")).await;
    let key = app.tenant_with_key("acme", "pro").await;
    let id = app
        .send_accepted(&key, &with(sms(), "reference", json!("done")))
        .await;
    let view = wait_for(&app, &key, &id, status_is("sent")).await;
    assert_eq!(view["status"], "sent", "{view}");

    expect_conflict_naming(cancel(&app, &key, &id).await, "sent").await;
    assert_eq!(cancel_reference(&app, &key, "done").await, (0, 1));
    assert_eq!(status_of(&app, &key, &id).await, "sent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_retrying_after_a_throttle_is_cancelled_and_not_tried_again() {
    let sms_api = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path(SMS_PATH))
        .respond_with(ResponseTemplate::new(429).insert_header("retry-after", "2"))
        .up_to_n_times(1)
        .with_priority(1)
        .mount(&sms_api)
        .await;
    mock_sms_ok(&sms_api, "SM-NEVER").await;
    let app = TestApp::start(&delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", "")).await;
    let key = app.tenant_with_key("acme", "pro").await;
    let id = app.send_accepted(&key, &sms()).await;
    let view = wait_for(&app, &key, &id, status_is("retrying")).await;
    assert_eq!(view["status"], "retrying", "{view}");

    let view = expect_json(cancel(&app, &key, &id).await, StatusCode::OK).await;
    assert_eq!(view["status"], "cancelled", "{view}");

    // The deferred copy comes back after the Retry-After and is dropped.
    wait_until_the_fast_lane_is_empty(&app).await;
    assert_eq!(sms_requests(&sms_api).await, 1, "only the throttled call");
    assert_eq!(status_of(&app, &key, &id).await, "cancelled");
}

/// The value of `name` in a form-encoded request body.
fn form_field(body: &[u8], name: &str) -> String {
    form_urlencoded::parse(body)
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.into_owned())
        .unwrap_or_else(|| panic!("no {name} in {}", String::from_utf8_lossy(body)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_cancelled_while_a_consumer_holds_them_waiting_for_provider_tokens_are_never_sent()
{
    let sms_api = MockServer::start().await;
    mock_sms_ok(&sms_api, "SM-RACE").await;
    // One SMS a second, no burst: after the first, each message the consumer
    // holds waits for its token before it may claim the message and send.
    let generous = delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", "");
    let one_a_second = generous.replacen(
        "rate_per_second = 1000.0\nburst = 100",
        "rate_per_second = 1.0\nburst = 1",
        1,
    );
    assert_ne!(one_a_second, generous);
    let app = TestApp::start(&one_a_second).await;
    let key = app.tenant_with_key("acme", "pro").await;
    let messages: Vec<Value> = (1..=5)
        .map(|n| {
            json!({"channel": "sms", "to": "+15551234567", "text": format!("flash {n}"), "reference": "flash-sale"})
        })
        .collect();
    let answer = send_batch(&app, &key, &messages).await;
    let ids = accepted_ids(&answer);
    assert_eq!(ids.len(), 5, "{answer}");

    // The first goes out at once; the consumer has taken all five from the lane.
    let deadline = Instant::now() + Duration::from_secs(10);
    while sms_requests(&sms_api).await == 0 {
        assert!(
            Instant::now() < deadline,
            "the first message was never sent"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = app.state.queue.stats(Lane::Fast).await.unwrap();
    assert_eq!(stats.depth, 0, "all five are with the consumer: {stats:?}");
    let requests = sms_api.received_requests().await.unwrap();
    let first_text = form_field(&requests[0].body, "Body");
    let first = first_text
        .strip_prefix("flash ")
        .and_then(|n| n.parse::<usize>().ok())
        .expect("a message of the batch")
        - 1;

    // The other four wait for tokens, one a second: cancel them right away.
    let waiting: Vec<&String> = ids
        .iter()
        .enumerate()
        .filter(|(n, _)| *n != first)
        .map(|(_, id)| id)
        .collect();
    for id in &waiting {
        let view = expect_json(cancel(&app, &key, id).await, StatusCode::OK).await;
        assert_eq!(view["status"], "cancelled", "{view}");
    }

    // Every copy is settled once the four tokens have come and gone.
    wait_until_the_fast_lane_is_empty(&app).await;
    let requests = sms_api.received_requests().await.unwrap();
    let sent: Vec<String> = requests
        .iter()
        .map(|r| form_field(&r.body, "Body"))
        .collect();
    assert_eq!(
        sent,
        vec![first_text],
        "only the uncancelled message reached the provider"
    );
    for id in waiting {
        assert_eq!(status_of(&app, &key, id).await, "cancelled", "{id}");
    }
    let view = wait_for(&app, &key, &ids[first], status_is("sent")).await;
    assert_eq!(view["status"], "sent", "{view}");
}
