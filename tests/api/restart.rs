//! Durability: a 202 survives a restart on the same SQLite file, and a send
//! that is not answered 202 leaves nothing queued.

use std::time::Duration;

use fairlane::model::Lane;
use reqwest::StatusCode;
use serde_json::json;
use tokio::task::JoinSet;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_accepted_message_is_still_queued_after_a_restart() {
    let app = TestApp::start("").await;
    let key = app.tenant_with_key("acme", "pro").await;

    let mut sends = JoinSet::new();
    for n in 0..50 {
        let client = app.client.clone();
        let url = app.url("/v1/messages");
        let key = key.clone();
        sends.spawn(async move {
            let body = with(email(), "reference", json!(format!("ref-{n}")));
            let response = client
                .post(url)
                .bearer_auth(key)
                .json(&body)
                .send()
                .await
                .unwrap();
            let accepted = expect_json(response, StatusCode::ACCEPTED).await;
            (n, accepted["id"].as_str().unwrap().to_owned())
        });
    }
    let mut ids = Vec::new();
    while let Some(sent) = sends.join_next().await {
        ids.push(sent.unwrap());
    }
    assert_eq!(ids.len(), 50);
    let remembered = app.send_idempotent(&key, "before-restart", &sms()).await;
    let remembered = expect_json(remembered, StatusCode::ACCEPTED).await;

    let dir = app.stop().await;
    let app = TestApp::start_in(dir, "", |_| {}).await;

    let stats = app.state.queue.stats(Lane::Fast).await.unwrap();
    assert_eq!(stats.depth, 51, "{stats:?}");
    assert_eq!(stats.in_flight, 0, "{stats:?}");
    for (n, id) in &ids {
        let view = expect_json(app.get_message(&key, id).await, StatusCode::OK).await;
        assert_eq!(view["status"], "queued", "{view}");
        assert_eq!(view["reference"], format!("ref-{n}"), "{view}");
    }
    // Idempotency keys are remembered across the restart.
    let replay = app.send_idempotent(&key, "before-restart", &sms()).await;
    assert_eq!(
        header(replay.headers(), "idempotent-replayed"),
        Some("true")
    );
    let replay = expect_json(replay, StatusCode::ACCEPTED).await;
    assert_eq!(replay, remembered);
    // The tenant and its key survive too, and sends go on.
    assert_eq!(
        app.send(&key, &email()).await.status(),
        StatusCode::ACCEPTED
    );
    assert_eq!(app.state.queue.stats(Lane::Fast).await.unwrap().depth, 52);
}

/// A send still being answered when shutdown begins is finished, answered
/// 202 and therefore still queued after the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_in_flight_at_shutdown_is_answered_and_kept() {
    let mut app = TestApp::start("").await;
    let key = app.tenant_with_key("acme", "pro").await;
    let writer = app.hold_write_lock().await;

    let send = app.send_in_background(&key, sms());
    // Let the request reach the accept writer, then begin shutting down.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!send.is_finished(), "the send waits for the held writer");
    app.begin_shutdown();
    tokio::time::sleep(Duration::from_millis(200)).await;
    writer.release().await;

    let response = tokio::time::timeout(Duration::from_secs(10), send)
        .await
        .expect("the in-flight send is answered")
        .unwrap();
    let accepted = expect_json(response, StatusCode::ACCEPTED).await;
    let id = accepted["id"].as_str().unwrap().to_owned();
    let dir = app.stop().await;

    let app = TestApp::start_in(dir, "", |_| {}).await;
    let view = expect_json(app.get_message(&key, &id).await, StatusCode::OK).await;
    assert_eq!(view["status"], "queued");
    assert_eq!(app.state.queue.stats(Lane::Fast).await.unwrap().depth, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_changes_survive_a_restart() {
    let app = TestApp::start("").await;
    let put = app
        .admin(reqwest::Method::PUT, "/v1/admin/plans/starter")
        .json(&json!({"lane": "fast", "rate_per_second": 1.0, "burst": 3, "daily_quota": 2, "max_in_flight": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), StatusCode::CREATED);
    let key = app.tenant_with_key("acme", "starter").await;
    app.patch_tenant("acme", json!({"status": "paused"})).await;
    for _ in 0..2 {
        assert_eq!(app.send(&key, &sms()).await.status(), StatusCode::ACCEPTED);
    }
    let last_use = |tenant: &serde_json::Value| tenant["keys"][0]["last_used_at"].clone();
    let before = expect_json(
        app.admin(reqwest::Method::GET, "/v1/admin/tenants/acme")
            .send()
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await;
    assert!(
        last_use(&before).is_string(),
        "the key's use is shown at once: {before}"
    );

    let dir = app.stop().await;
    let app = TestApp::start_in(dir, "", |_| {}).await;
    let tenant = app
        .admin(reqwest::Method::GET, "/v1/admin/tenants/acme")
        .send()
        .await
        .unwrap();
    let tenant = expect_json(tenant, StatusCode::OK).await;
    assert_eq!(tenant["plan"], "starter");
    assert_eq!(tenant["status"], "paused");
    // The key's last use was written to the store as the process stopped.
    assert_eq!(last_use(&tenant), last_use(&before), "{tenant}");
    // The quota of 2 was used before the restart; it still is.
    let response = app.send(&key, &sms()).await;
    expect_problem_kind(response, StatusCode::TOO_MANY_REQUESTS, "quota").await;
}

/// DESIGN.md: "202 means durable … leave nothing half-done". Once a send
/// is with the accept writer, the request timeout must not answer 503 while
/// the commit still lands later: the send waits for its own commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_held_past_the_request_timeout_is_answered_by_its_commit() {
    let app = TestApp::start_custom("", |settings| settings.server.request_timeout_secs = 1).await;
    let key = app.tenant_with_key("acme", "pro").await;
    let writer = app.hold_write_lock().await;
    let send = app.send_in_background(&key, email());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !send.is_finished(),
        "the send was cut off by the request timeout"
    );
    writer.release().await;
    let response = tokio::time::timeout(Duration::from_secs(10), send)
        .await
        .expect("the send is answered once the store is free")
        .unwrap();
    let accepted = expect_json(response, StatusCode::ACCEPTED).await;
    let id = accepted["id"].as_str().unwrap();
    let view = expect_json(app.get_message(&key, id).await, StatusCode::OK).await;
    assert_eq!(view["status"], "queued");
    assert_eq!(app.state.queue.stats(Lane::Fast).await.unwrap().depth, 1);
}

/// DESIGN.md: "Every 429 and 503 carries a Retry-After", and errors are
/// problem+json. The request timeout answers 503 too, with the timeout as
/// its Retry-After: here a message list on a PostgreSQL store with every
/// connection of the app's pool held by the test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_that_times_out_is_a_503_problem_with_retry_after() {
    crate::support::STORE
        .scope(crate::support::Store::Postgres, async {
            let app =
                TestApp::start_custom("", |settings| settings.server.request_timeout_secs = 1)
                    .await;
            let key = app.tenant_with_key("acme", "pro").await;
            app.send_accepted(&key, &email()).await;
            let pool = &app.state.db.postgres().expect("a PostgreSQL store").pool;
            let mut held = Vec::new();
            while let Ok(Ok(connection)) =
                tokio::time::timeout(Duration::from_millis(200), pool.acquire()).await
            {
                held.push(connection);
            }
            let response = app
                .tenant(&key, reqwest::Method::GET, "/v1/messages")
                .send()
                .await
                .unwrap();
            drop(held);
            let (headers, _) = expect_problem(response, StatusCode::SERVICE_UNAVAILABLE).await;
            assert_eq!(header_u64(&headers, "retry-after"), 1);
        })
        .await
}
