//! `Idempotency-Key`: a repeat gets the first answer, a reuse with another
//! body gets 422, a repeat while the first is in flight gets 409.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::task::JoinSet;

use crate::support::*;

on_both_stores! {
    async fn a_repeated_request_gets_the_same_answer_and_queues_one_message() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;

        let first = app.send_idempotent(&key, "order-17", &email()).await;
        assert_eq!(first.status(), StatusCode::ACCEPTED);
        let first_location = header(first.headers(), "location").map(str::to_owned);
        assert_eq!(header(first.headers(), "idempotent-replayed"), None);
        let first_body = first.text().await.unwrap();

        // The same request with other key order and whitespace is the same request.
        let reordered =
            json!({"text": "Hello", "subject": "Hi", "to": "a@example.com", "channel": "email"});
        let second = app.send_idempotent(&key, "order-17", &reordered).await;
        assert_eq!(second.status(), StatusCode::ACCEPTED);
        assert_eq!(
            header(second.headers(), "idempotent-replayed"),
            Some("true")
        );
        assert_eq!(
            header(second.headers(), "location").map(str::to_owned),
            first_location
        );
        assert_eq!(
            header(second.headers(), "content-type"),
            Some("application/json")
        );
        let second_body = second.text().await.unwrap();

        assert_eq!(
            first_body, second_body,
            "a replay answers the identical body"
        );
        let id = serde_json::from_str::<Value>(&first_body).unwrap()["id"].clone();
        assert!(id.is_string());
        assert_eq!(fast_lane_depth(&app).await, 1, "only one message is queued");
    }
}

on_both_stores! {
    async fn idempotency_keys_are_per_tenant() {
        let app = TestApp::start("").await;
        let key_a = app.tenant_with_key("tenant-a", "pro").await;
        let key_b = app.tenant_with_key("tenant-b", "pro").await;
        let a = expect_json(
            app.send_idempotent(&key_a, "k-1", &email()).await,
            StatusCode::ACCEPTED,
        )
        .await;
        let b = app.send_idempotent(&key_b, "k-1", &email()).await;
        assert_eq!(header(b.headers(), "idempotent-replayed"), None);
        let b = expect_json(b, StatusCode::ACCEPTED).await;
        assert_ne!(a["id"], b["id"]);
        assert_eq!(fast_lane_depth(&app).await, 2);
    }
}

on_both_stores! {
    async fn a_reused_key_with_another_body_is_a_422_problem() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        assert_eq!(
            app.send_idempotent(&key, "k-1", &email()).await.status(),
            StatusCode::ACCEPTED
        );

        let other = with(email(), "text", json!("Hello again"));
        let response = app.send_idempotent(&key, "k-1", &other).await;
        expect_problem_kind(response, StatusCode::UNPROCESSABLE_ENTITY, "idempotency").await;
        assert_eq!(fast_lane_depth(&app).await, 1);
    }
}

on_both_stores! {
    async fn concurrent_repeats_get_one_id_or_409_and_queue_one_message() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let mut requests = JoinSet::new();
        for _ in 0..20 {
            let client = app.client.clone();
            let url = app.url("/v1/messages");
            let key = key.clone();
            requests.spawn(async move {
                let response = client
                    .post(url)
                    .bearer_auth(key)
                    .header("idempotency-key", "same")
                    .json(&email())
                    .send()
                    .await
                    .unwrap();
                let status = response.status();
                let content_type = header(response.headers(), "content-type").map(str::to_owned);
                (
                    status,
                    content_type,
                    response.json::<Value>().await.unwrap(),
                )
            });
        }
        let mut ids = Vec::new();
        let mut conflicts = 0;
        while let Some(answer) = requests.join_next().await {
            let (status, content_type, body) = answer.unwrap();
            match status {
                StatusCode::ACCEPTED => ids.push(body["id"].clone()),
                StatusCode::CONFLICT => {
                    assert_eq!(content_type.as_deref(), Some("application/problem+json"));
                    conflicts += 1;
                }
                other => panic!("unexpected {other}: {body}"),
            }
        }
        assert!(!ids.is_empty(), "at least one request is accepted");
        assert!(
            ids.iter().all(|id| id == &ids[0]),
            "one id for all: {ids:?}"
        );
        assert_eq!(ids.len() + conflicts, 20);
        assert_eq!(fast_lane_depth(&app).await, 1, "only one message is queued");
    }
}

/// While SQLite's write lock is held elsewhere, a first request with
/// a key cannot finish; a second with the same key must get 409 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeat_while_the_first_is_in_flight_is_a_409_problem() {
    let app = TestApp::start("").await;
    let key = app.tenant_with_key("acme", "pro").await;
    let writer = app.hold_write_lock().await;

    let mut requests = JoinSet::new();
    for _ in 0..2 {
        let client = app.client.clone();
        let url = app.url("/v1/messages");
        let key = key.clone();
        requests.spawn(async move {
            let response = client
                .post(url)
                .bearer_auth(key)
                .header("idempotency-key", "held")
                .json(&email())
                .send()
                .await
                .unwrap();
            let status = response.status();
            (status, response.text().await.unwrap())
        });
    }
    // Whichever request claimed the key waits on the writer; the other one
    // is answered first, and must be a conflict.
    let (status, body) = tokio::time::timeout(Duration::from_secs(5), requests.join_next())
        .await
        .expect("the duplicate is answered while the first is held")
        .unwrap()
        .unwrap();
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    let problem: Value = serde_json::from_str(&body).unwrap();
    assert!(
        problem["type"].as_str().unwrap().contains("conflict"),
        "{problem}"
    );

    writer.release().await;
    let (status, body) = requests.join_next().await.unwrap().unwrap();
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let accepted: Value = serde_json::from_str(&body).unwrap();

    // Once answered, a repeat is a replay, not a conflict.
    let replay = app.send_idempotent(&key, "held", &email()).await;
    assert_eq!(
        header(replay.headers(), "idempotent-replayed"),
        Some("true")
    );
    let replayed = expect_json(replay, StatusCode::ACCEPTED).await;
    assert_eq!(replayed["id"], accepted["id"]);
    assert_eq!(fast_lane_depth(&app).await, 1);
}

on_both_stores! {
    async fn an_invalid_idempotency_key_header_is_a_400_problem() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        for bad in ["k".repeat(256), "k".repeat(300), "has space".to_owned()] {
            let response = app.send_idempotent(&key, &bad, &email()).await;
            expect_problem(response, StatusCode::BAD_REQUEST).await;
        }
        assert_eq!(fast_lane_depth(&app).await, 0);
        // 255 visible characters are fine.
        let response = app.send_idempotent(&key, &"k".repeat(255), &email()).await;
        assert_eq!(response.status(), StatusCode::ACCEPTED);
    }
}

/// A send whose durable write outlives `server.accept_deadline_ms` answers
/// 503 with `Retry-After`, and the write goes on. Its key stays held until
/// the write has ended: a retry meanwhile is 409 with `Retry-After`, and a
/// retry after the commit is answered with the message the write made.
/// One key, one message, even when the client retries a 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_past_the_accept_deadline_is_a_503_and_its_key_answers_the_late_commit() {
    let app = TestApp::start_custom("", |settings| settings.server.accept_deadline_ms = 400).await;
    let key = app.tenant_with_key("acme", "pro").await;
    let writer = app.hold_write_lock().await;

    let first = app.send_idempotent(&key, "slow-store", &email()).await;
    let (headers, problem) = expect_problem(first, StatusCode::SERVICE_UNAVAILABLE).await;
    assert!(header_u64(&headers, "retry-after") >= 1);
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("may still be accepted"),
        "{problem}"
    );
    let retry = app.send_idempotent(&key, "slow-store", &email()).await;
    let (headers, _) = expect_problem(retry, StatusCode::CONFLICT).await;
    assert!(header_u64(&headers, "retry-after") >= 1);

    writer.release().await;
    // The held write commits; the next retry is its answer.
    let mut replayed = None;
    for _ in 0..50 {
        let retry = app.send_idempotent(&key, "slow-store", &email()).await;
        if retry.status() == StatusCode::ACCEPTED {
            assert_eq!(
                header(retry.headers(), "idempotent-replayed"),
                Some("true"),
                "the retry must replay the late commit, not accept a second message"
            );
            replayed = Some(expect_json(retry, StatusCode::ACCEPTED).await);
            break;
        }
        assert_eq!(retry.status(), StatusCode::CONFLICT);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let replayed = replayed.expect("the key was answered within 5 s of the store's release");
    let id = replayed["id"].as_str().unwrap();
    let view = expect_json(app.get_message(&key, id).await, StatusCode::OK).await;
    assert_eq!(view["status"], "queued");
    assert_eq!(fast_lane_depth(&app).await, 1, "one key, one message");
}
