//! `POST /v1/messages/batch`: per-item results in the request's order,
//! partial admission under the plan's rate, replay of the whole batch by its
//! `Idempotency-Key` and of one item by its `idempotency_key`, and the 422s
//! and 413 of a body that is not a batch.

use reqwest::{Method, Response, StatusCode};
use serde_json::{Value, json};

use crate::support::*;

/// `POST /v1/messages/batch` with `body` as it is.
pub(crate) async fn post_batch(app: &TestApp, key: &str, body: &Value) -> Response {
    app.tenant(key, Method::POST, "/v1/messages/batch")
        .json(body)
        .send()
        .await
        .expect("send batch")
}

/// `POST /v1/messages/batch` of `messages` with an `Idempotency-Key` header.
async fn post_batch_idempotent(
    app: &TestApp,
    key: &str,
    idempotency_key: &str,
    messages: &[Value],
) -> Response {
    app.tenant(key, Method::POST, "/v1/messages/batch")
        .header("idempotency-key", idempotency_key)
        .json(&json!({ "messages": messages }))
        .send()
        .await
        .expect("send batch")
}

/// Sends `messages` as one batch; asserts the 200 and returns its answer.
pub(crate) async fn send_batch(app: &TestApp, key: &str, messages: &[Value]) -> Value {
    let response = post_batch(app, key, &json!({ "messages": messages })).await;
    expect_json(response, StatusCode::OK).await
}

/// The ids of the accepted items of a batch answer, in order.
pub(crate) fn accepted_ids(answer: &Value) -> Vec<String> {
    answer["results"]
        .as_array()
        .expect("results")
        .iter()
        .filter(|result| result["status"] == 202)
        .map(|result| {
            result["message"]["id"]
                .as_str()
                .expect("message id")
                .to_owned()
        })
        .collect()
}

/// Asserts that result `index` of `answer` is a 422 whose problem names `field`.
pub(crate) fn assert_item_names_field(answer: &Value, index: usize, field: &str) {
    let result = &answer["results"][index];
    assert_eq!(result["index"], index, "{answer}");
    assert_eq!(result["status"], 422, "item {index}: {answer}");
    assert_eq!(result["problem"]["status"], 422, "item {index}: {answer}");
    assert!(
        result["problem"]["errors"][field].is_string(),
        "item {index} should name {field:?}: {answer}"
    );
    assert!(result.get("message").is_none(), "{answer}");
}

/// One send every 10 s, bursts of 5.
async fn trickle_plan(app: &TestApp) {
    let response = app
        .admin(Method::PUT, "/v1/admin/plans/trickle")
        .json(&json!({"lane": "fast", "rate_per_second": 0.1, "burst": 5, "daily_quota": 1000, "max_in_flight": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
}

on_both_stores! {
    async fn a_batch_answers_each_item_in_order_and_queues_only_the_valid_ones() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let messages = [
            sms(),
            with(email(), "to", json!("not-an-address")),
            with(email(), "reference", json!("order-17")),
            with(sms(), "text", Value::Null),
            with(sms(), "priority", json!("high")),
        ];

        let answer = send_batch(&app, &key, &messages).await;

        assert_eq!(answer["accepted"], 3, "{answer}");
        assert_eq!(answer["refused"], 2, "{answer}");
        let results = answer["results"].as_array().unwrap();
        assert_eq!(results.len(), 5, "{answer}");
        assert_item_names_field(&answer, 1, "to");
        assert_item_names_field(&answer, 3, "text");
        for (index, channel, priority) in [(0, "sms", "normal"), (2, "email", "normal"), (4, "sms", "high")] {
            let result = &results[index];
            assert_eq!(result["index"], index, "{answer}");
            assert_eq!(result["status"], 202, "item {index}: {answer}");
            assert!(result.get("problem").is_none(), "{answer}");
            let accepted = &result["message"];
            assert_eq!(accepted["status"], "queued", "{answer}");
            assert_eq!(accepted["channel"], channel, "{answer}");
            assert_eq!(accepted["priority"], priority, "{answer}");
            assert_eq!(accepted["lane"], "fast", "{answer}");
            let id = accepted["id"].as_str().unwrap();
            let view = expect_json(app.get_message(&key, id).await, StatusCode::OK).await;
            assert_eq!(view["status"], "queued", "{view}");
            assert_eq!(view["channel"], channel, "{view}");
        }
        let view = expect_json(
            app.get_message(&key, results[2]["message"]["id"].as_str().unwrap()).await,
            StatusCode::OK,
        )
        .await;
        assert_eq!(view["reference"], "order-17", "{view}");
        assert_eq!(fast_lane_depth(&app).await, 3);
    }
}

on_both_stores! {
    async fn a_batch_over_the_plans_burst_accepts_the_burst_and_refuses_the_rest_with_429_and_retry_after() {
        let app = TestApp::start("").await;
        trickle_plan(&app).await;
        let key = app.tenant_with_key("acme", "trickle").await;
        let messages: Vec<Value> = (0..8)
            .map(|n| with(sms(), "text", json!(format!("message {n}"))))
            .collect();

        let answer = send_batch(&app, &key, &messages).await;

        assert_eq!(answer["accepted"], 5, "{answer}");
        assert_eq!(answer["refused"], 3, "{answer}");
        let results = answer["results"].as_array().unwrap();
        for (index, result) in results.iter().enumerate() {
            assert_eq!(result["index"], index, "{answer}");
            if index < 5 {
                assert_eq!(result["status"], 202, "item {index}: {answer}");
                continue;
            }
            assert_eq!(result["status"], 429, "item {index}: {answer}");
            assert!(
                result["retry_after"].as_u64().is_some_and(|secs| secs >= 1),
                "item {index} needs a retry_after of at least 1 s: {answer}"
            );
            let problem = &result["problem"];
            assert_eq!(problem["status"], 429, "{answer}");
            assert!(
                problem["type"].as_str().unwrap().contains("rate"),
                "{answer}"
            );
        }
        assert_eq!(fast_lane_depth(&app).await, 5, "refused items are not queued");
        // The burst is spent: a single send is refused too.
        assert_eq!(
            app.send(&key, &sms()).await.status(),
            StatusCode::TOO_MANY_REQUESTS
        );
    }
}

on_both_stores! {
    async fn a_repeated_batch_with_the_same_idempotency_key_gets_the_same_answer_and_queues_nothing_new() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let messages = [sms(), with(sms(), "to", json!("12")), email()];

        let first = post_batch_idempotent(&app, &key, "batch-17", &messages).await;
        assert_eq!(first.status(), StatusCode::OK);
        assert_eq!(header(first.headers(), "idempotent-replayed"), None);
        let first_body = first.text().await.unwrap();

        let second = post_batch_idempotent(&app, &key, "batch-17", &messages).await;
        assert_eq!(second.status(), StatusCode::OK);
        assert_eq!(header(second.headers(), "idempotent-replayed"), Some("true"));
        assert_eq!(
            header(second.headers(), "content-type"),
            Some("application/json")
        );
        let second_body = second.text().await.unwrap();
        assert_eq!(first_body, second_body, "a replay answers the identical body");

        let answer: Value = serde_json::from_str(&first_body).unwrap();
        let ids = accepted_ids(&answer);
        assert_eq!(ids.len(), 2, "{answer}");
        for id in &ids {
            let view = expect_json(app.get_message(&key, id).await, StatusCode::OK).await;
            assert_eq!(view["status"], "queued", "{view}");
        }
        assert_eq!(fast_lane_depth(&app).await, 2, "the replay queued nothing");
    }
}

on_both_stores! {
    async fn a_batch_idempotency_key_reused_with_another_body_is_a_422_problem() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let first = post_batch_idempotent(&app, &key, "batch-17", &[sms()]).await;
        assert_eq!(first.status(), StatusCode::OK);

        let other = post_batch_idempotent(&app, &key, "batch-17", &[sms(), email()]).await;
        expect_problem_kind(other, StatusCode::UNPROCESSABLE_ENTITY, "idempotency").await;
        assert_eq!(fast_lane_depth(&app).await, 1);
    }
}

on_both_stores! {
    async fn an_item_with_a_known_idempotency_key_is_replayed_in_a_later_batch_with_its_first_id() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let welcome = with(sms(), "idempotency_key", json!("welcome-ada"));
        let first = send_batch(&app, &key, &[welcome.clone(), email()]).await;
        assert_eq!(first["accepted"], 2, "{first}");
        assert!(first["results"][0].get("replayed").is_none(), "{first}");
        let welcome_id = first["results"][0]["message"]["id"].clone();

        // The same content with the same key, its fields in another order.
        let reordered = json!({"idempotency_key": "welcome-ada", "text": "Hello", "to": "+15551234567", "channel": "sms"});
        let second = send_batch(&app, &key, &[with(email(), "subject", json!("New")), reordered]).await;

        assert_eq!(second["accepted"], 2, "{second}");
        let fresh = &second["results"][0];
        assert!(fresh.get("replayed").is_none(), "{second}");
        assert_ne!(fresh["message"]["id"], welcome_id, "{second}");
        let replayed = &second["results"][1];
        assert_eq!(replayed["index"], 1, "{second}");
        assert_eq!(replayed["status"], 202, "{second}");
        assert_eq!(replayed["replayed"], true, "{second}");
        assert_eq!(replayed["message"]["id"], welcome_id, "{second}");
        assert_eq!(fast_lane_depth(&app).await, 3, "the replayed item was not queued again");
    }
}

on_both_stores! {
    async fn an_item_idempotency_key_reused_with_other_content_refuses_that_item_only() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        send_batch(&app, &key, &[with(sms(), "idempotency_key", json!("otp-1"))]).await;

        let changed = with(with(sms(), "text", json!("Another code")), "idempotency_key", json!("otp-1"));
        let answer = send_batch(&app, &key, &[changed, email()]).await;

        assert_eq!((answer["accepted"].clone(), answer["refused"].clone()), (json!(1), json!(1)), "{answer}");
        let refused = &answer["results"][0];
        assert_eq!(refused["status"], 422, "{answer}");
        assert!(
            refused["problem"]["type"].as_str().unwrap().contains("idempotency"),
            "{answer}"
        );
        assert_eq!(answer["results"][1]["status"], 202, "{answer}");
        assert_eq!(fast_lane_depth(&app).await, 2);
    }
}

on_both_stores! {
    async fn the_second_of_two_items_with_one_idempotency_key_is_a_409_and_a_replay_later() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let item = with(sms(), "idempotency_key", json!("twice"));

        let answer = send_batch(&app, &key, &[item.clone(), item]).await;

        assert_eq!(answer["results"][0]["status"], 202, "{answer}");
        // The first is not answered before the batch is: the second waits
        // like a repeat of a single send still in flight, and may be sent
        // again once the batch is answered (then it is a replay).
        let second = &answer["results"][1];
        assert_eq!(second["status"], 409, "{answer}");
        assert!(
            second["problem"]["type"].as_str().unwrap().contains("conflict"),
            "{answer}"
        );
        assert_eq!(answer["accepted"], 1, "{answer}");
        assert_eq!(fast_lane_depth(&app).await, 1);

        let again = send_batch(&app, &key, &[with(sms(), "idempotency_key", json!("twice"))]).await;
        assert_eq!(again["results"][0]["replayed"], true, "{again}");
        assert_eq!(
            again["results"][0]["message"]["id"],
            answer["results"][0]["message"]["id"],
            "{again}"
        );
        assert_eq!(fast_lane_depth(&app).await, 1);
    }
}

on_both_stores! {
    async fn a_body_that_is_not_a_batch_is_a_422_problem_naming_what_is_wrong() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let cases = [
            (json!([sms()]), "body"),
            (json!("messages"), "body"),
            (json!({}), "messages"),
            (json!({"messages": []}), "messages"),
            (json!({"messages": sms()}), "messages"),
            (json!({"messages": "all of them"}), "messages"),
            (json!({"messages": [sms()], "priority": "high"}), "priority"),
        ];
        for (body, field) in cases {
            let response = post_batch(&app, &key, &body).await;
            expect_field_error(response, field).await;
        }
        assert_eq!(fast_lane_depth(&app).await, 0);
    }
}

on_both_stores! {
    async fn a_batch_of_more_than_1000_messages_is_a_422_problem_and_queues_none() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "enterprise").await;
        let messages = vec![sms(); 1001];

        let response = post_batch(&app, &key, &json!({ "messages": messages })).await;

        let problem = expect_field_error(response, "messages").await;
        assert!(
            problem["errors"]["messages"].as_str().unwrap().contains("1000"),
            "{problem}"
        );
        assert_eq!(fast_lane_depth(&app).await, 0);
    }
}

/// 1,000 messages of about 400 bytes: more than a single send's body limit
/// (192 KiB), well under the batch's (8 MiB).
fn thousand_long_messages() -> Value {
    let messages: Vec<Value> = (0..1000)
        .map(|n| with(sms(), "text", json!(format!("{n:04} {}", "x".repeat(350)))))
        .collect();
    json!({ "messages": messages })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_1000_larger_than_a_single_sends_body_limit_is_accepted_whole() {
    let app = TestApp::start("").await;
    let key = app.tenant_with_key("acme", "enterprise").await;
    let body = thousand_long_messages();
    assert!(body.to_string().len() > app.state.settings.server.max_body_bytes);

    let answer = expect_json(post_batch(&app, &key, &body).await, StatusCode::OK).await;

    assert_eq!(
        (answer["accepted"].clone(), answer["refused"].clone()),
        (json!(1000), json!(0))
    );
    let results = answer["results"].as_array().unwrap();
    assert!(
        results.iter().enumerate().all(|(n, r)| r["index"] == n),
        "results are in the request's order"
    );
    assert_eq!(fast_lane_depth(&app).await, 1000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_body_over_max_batch_body_bytes_is_a_413_problem() {
    let app = TestApp::start_custom("", |settings| {
        settings.server.max_batch_body_bytes = settings.server.max_body_bytes;
    })
    .await;
    let key = app.tenant_with_key("acme", "enterprise").await;

    let response = post_batch(&app, &key, &thousand_long_messages()).await;

    expect_problem(response, StatusCode::PAYLOAD_TOO_LARGE).await;
    assert_eq!(fast_lane_depth(&app).await, 0);
}

/// While two batches of a tenant wait on the store (SQLite's write lock
/// held elsewhere), its third is refused at once, and the two held batches
/// are answered once the store writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_has_at_most_two_batches_in_progress() {
    let app = TestApp::start("").await;
    let key = app.tenant_with_key("acme", "pro").await;
    let writer = app.hold_write_lock().await;
    let held: Vec<_> = (0..2)
        .map(|_| {
            let request = app
                .tenant(&key, Method::POST, "/v1/messages/batch")
                .json(&json!({"messages": [email()]}));
            tokio::spawn(async move { request.send().await.unwrap().status() })
        })
        .collect();
    // Give both held batches time to arrive and take their slots (they
    // take them before anything else; then they wait on the store).
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let refused = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        post_batch(&app, &key, &json!({"messages": [email()]})),
    )
    .await
    .expect("a third batch is refused at once, not held");
    let (headers, _) =
        expect_problem_kind(refused, StatusCode::TOO_MANY_REQUESTS, "too-many-batches").await;
    assert_eq!(header_u64(&headers, "retry-after"), 1);
    writer.release().await;
    for batch in held {
        assert_eq!(batch.await.unwrap(), StatusCode::OK);
    }
    let after = post_batch(&app, &key, &json!({"messages": [email()]})).await;
    assert_eq!(after.status(), StatusCode::OK, "the slots came back");
}
