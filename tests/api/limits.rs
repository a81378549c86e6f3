//! Admission limits on the accept path: the tenant's token bucket, its daily
//! quota and the lane's high-water mark, each refused with a 429 problem and
//! a Retry-After taken from the real state.

use std::time::Duration;

use fairlane::model::Lane;
use reqwest::StatusCode;

use crate::support::*;

/// One send every 2 s, bursts of 2.
const TINY_PLAN: &str = "[plans.tiny]\nlane = \"fast\"\nrate_per_second = 0.5\nburst = 2\n\
                         daily_quota = 1000\nmax_in_flight = 1\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_over_the_rate_is_429_and_succeeds_after_retry_after() {
    let app = TestApp::start(TINY_PLAN).await;
    let key = app.tenant_with_key("acme", "tiny").await;

    for expected_remaining in [1, 0] {
        let response = app.send(&key, &email()).await;
        assert_eq!(response.status(), StatusCode::ACCEPTED);
        assert_eq!(header_u64(response.headers(), "ratelimit-limit"), 2);
        assert_eq!(
            header_u64(response.headers(), "ratelimit-remaining"),
            expected_remaining
        );
    }
    let response = app.send(&key, &email()).await;
    let (headers, _) = expect_problem_kind(response, StatusCode::TOO_MANY_REQUESTS, "rate").await;
    let retry_after = header_u64(&headers, "retry-after");
    assert!(
        (1..=2).contains(&retry_after),
        "one token per 2 s: Retry-After {retry_after}"
    );
    assert_eq!(header_u64(&headers, "ratelimit-remaining"), 0);
    assert_eq!(header_u64(&headers, "ratelimit-limit"), 2);
    assert_eq!(
        app.state.queue.stats(Lane::Fast).await.unwrap().depth,
        2,
        "the refused send is not queued"
    );

    tokio::time::sleep(Duration::from_secs(retry_after)).await;
    let response = app.send(&key, &email()).await;
    let status = response.status();
    assert_eq!(
        status,
        StatusCode::ACCEPTED,
        "after Retry-After: {}",
        response.text().await.unwrap()
    );
}

on_both_stores! {
    async fn a_replay_is_answered_even_when_the_tenant_is_over_its_rate() {
        let app = TestApp::start(TINY_PLAN).await;
        let key = app.tenant_with_key("acme", "tiny").await;
        let first = app.send_idempotent(&key, "k-1", &email()).await;
        let first = expect_json(first, StatusCode::ACCEPTED).await;
        assert_eq!(
            app.send(&key, &email()).await.status(),
            StatusCode::ACCEPTED
        );
        assert_eq!(
            app.send(&key, &email()).await.status(),
            StatusCode::TOO_MANY_REQUESTS
        );

        let replay = app.send_idempotent(&key, "k-1", &email()).await;
        assert_eq!(
            header(replay.headers(), "idempotent-replayed"),
            Some("true")
        );
        assert_eq!(expect_json(replay, StatusCode::ACCEPTED).await, first);
    }
}

on_both_stores! {
    async fn tenants_on_the_same_plan_have_their_own_buckets() {
        let app = TestApp::start(TINY_PLAN).await;
        let key_a = app.tenant_with_key("tenant-a", "tiny").await;
        let key_b = app.tenant_with_key("tenant-b", "tiny").await;
        for _ in 0..2 {
            assert_eq!(
                app.send(&key_a, &email()).await.status(),
                StatusCode::ACCEPTED
            );
        }
        assert_eq!(
            app.send(&key_a, &email()).await.status(),
            StatusCode::TOO_MANY_REQUESTS
        );
        assert_eq!(
            app.send(&key_b, &email()).await.status(),
            StatusCode::ACCEPTED
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_over_the_daily_quota_is_429_until_midnight() {
    let plan = "[plans.capped]\nlane = \"fast\"\nrate_per_second = 1000.0\nburst = 1000\n\
                daily_quota = 3\nmax_in_flight = 1\n";
    let app = TestApp::start(plan).await;
    let key = app.tenant_with_key("acme", "capped").await;
    for _ in 0..3 {
        assert_eq!(app.send(&key, &sms()).await.status(), StatusCode::ACCEPTED);
    }
    let response = app.send(&key, &sms()).await;
    let (headers, _) = expect_problem_kind(response, StatusCode::TOO_MANY_REQUESTS, "quota").await;
    let retry_after = header_u64(&headers, "retry-after");
    assert!(
        (1..=86_400).contains(&retry_after),
        "Retry-After {retry_after}"
    );
    assert_eq!(app.state.queue.stats(Lane::Fast).await.unwrap().depth, 3);
}

on_both_stores! {
    async fn a_refused_send_does_not_use_up_the_daily_quota() {
        let plan = "[plans.capped]\nlane = \"fast\"\nrate_per_second = 1000.0\nburst = 1000\n\
                    daily_quota = 2\nmax_in_flight = 1\n";
        let app = TestApp::start(plan).await;
        let key = app.tenant_with_key("acme", "capped").await;
        // Refused before admission: invalid fields.
        for _ in 0..3 {
            let response = app
                .send(&key, &with(email(), "to", serde_json::json!("x")))
                .await;
            assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY);
        }
        for _ in 0..2 {
            assert_eq!(
                app.send(&key, &email()).await.status(),
                StatusCode::ACCEPTED
            );
        }
        assert_eq!(
            app.send(&key, &email()).await.status(),
            StatusCode::TOO_MANY_REQUESTS
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_at_its_high_water_mark_refuses_with_429_and_the_other_lane_accepts() {
    let app = TestApp::start("[lanes.fast]\nhigh_water_mark = 3\n").await;
    let fast_key = app.tenant_with_key("paid", "pro").await;
    let slow_key = app.tenant_with_key("free", "basic").await;
    for n in 1..=3 {
        let response = app.send(&fast_key, &email()).await;
        assert_eq!(response.status(), StatusCode::ACCEPTED, "send {n}");
    }
    let response = app.send(&fast_key, &email()).await;
    let (headers, problem) =
        expect_problem_kind(response, StatusCode::TOO_MANY_REQUESTS, "lane-full").await;
    let retry_after = header_u64(&headers, "retry-after");
    assert!(retry_after > 0, "{problem}");
    assert_eq!(app.state.queue.stats(Lane::Fast).await.unwrap().depth, 3);

    let response = app.send(&slow_key, &email()).await;
    let accepted = expect_json(response, StatusCode::ACCEPTED).await;
    assert_eq!(accepted["lane"], "slow");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_lane_stays_full_after_the_depth_is_sampled_again() {
    let app = TestApp::start("[lanes.fast]\nhigh_water_mark = 2\n").await;
    let key = app.tenant_with_key("paid", "pro").await;
    for _ in 0..2 {
        assert_eq!(app.send(&key, &sms()).await.status(), StatusCode::ACCEPTED);
    }
    // The sampler reads the queue once a second; the refusal must not depend
    // on counting accepts since the last sample.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let response = app.send(&key, &sms()).await;
    expect_problem_kind(response, StatusCode::TOO_MANY_REQUESTS, "lane-full").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_a_consumer_holds_count_toward_the_high_water_mark() {
    // The slow lane's consumer takes messages into its buffer while they
    // wait for a provider that sends one every 5 s: they are in flight, not
    // waiting, and must still count, or the lane takes its mark plus the
    // consumer's whole buffer.
    let dir = tempfile::tempdir().unwrap();
    let deliveries = dir.path().join("deliveries.jsonl");
    let app = TestApp::start_in(
        dir,
        &format!(
            "[consumers]\nenabled = true\nreceive_wait_secs = 1\n\n\
             [lanes.slow]\nconcurrency = 8\nhigh_water_mark = 30\nvisibility_timeout_secs = 60\nmax_receive_count = 5\n\n\
             [providers.email]\nkind = \"log\"\nrate_per_second = 0.2\nburst = 1\nlog_path = \"{}\"\n\n\
             [plans.bulk]\nlane = \"slow\"\nrate_per_second = 1000.0\nburst = 1000\ndaily_quota = 100000\nmax_in_flight = 100\n",
            deliveries.display()
        ),
        |_| {},
    )
    .await;
    let key = app.tenant_with_key("bulk", "bulk").await;
    let mut first_refused = None;
    for n in 1..=120 {
        let response = app.send(&key, &email()).await;
        if response.status() == StatusCode::TOO_MANY_REQUESTS {
            let (_, problem) =
                expect_problem_kind(response, StatusCode::TOO_MANY_REQUESTS, "lane-full").await;
            assert!(
                problem["detail"]
                    .as_str()
                    .unwrap()
                    .contains("not yet delivered"),
                "{problem}"
            );
            first_refused.get_or_insert(n);
        } else {
            assert_eq!(response.status(), StatusCode::ACCEPTED, "send {n}");
            // Give the consumer time to take what is waiting into its buffer.
            if n % 10 == 0 {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    }
    let first_refused = first_refused.expect("no send was refused");
    // 30 accepted, plus the few the provider sent meanwhile (one at once,
    // then one in 5 s).
    assert!(
        (31..=34).contains(&first_refused),
        "the first 429 came at send {first_refused}, not near 31"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let queues = expect_json(
        app.admin(reqwest::Method::GET, "/v1/admin/queues")
            .send()
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await;
    let slow = &queues["lanes"][1];
    assert_eq!(slow["lane"], "slow", "{queues}");
    assert_eq!(slow["high_water_mark"], 30);
    let (depth, in_flight, backlog) = (
        slow["depth"].as_u64().unwrap(),
        slow["in_flight"].as_u64().unwrap(),
        slow["backlog"].as_u64().unwrap(),
    );
    assert_eq!(backlog, depth + in_flight, "{slow}");
    assert!(in_flight > 0, "the consumer holds messages: {slow}");
    assert!((28..=30).contains(&backlog), "{slow}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_changes_other_than_sends_have_a_bucket_of_their_own() {
    let app =
        TestApp::start("[limits]\ntenant_writes_per_second = 0.5\ntenant_writes_burst = 3\n").await;
    let key = app.tenant_with_key("acme", "pro").await;
    let other = app.tenant_with_key("globex", "pro").await;
    let add = |key: &str, n: usize| {
        app.tenant(key, reqwest::Method::POST, "/v1/suppressions")
            .json(&serde_json::json!({"address": format!("x{n}@example.com")}))
            .send()
    };
    for n in 0..3 {
        assert_eq!(
            add(&key, n).await.unwrap().status(),
            StatusCode::CREATED,
            "change {n}"
        );
    }
    let (headers, _) = expect_problem_kind(
        add(&key, 3).await.unwrap(),
        StatusCode::TOO_MANY_REQUESTS,
        "too-many-changes",
    )
    .await;
    assert!((1..=2).contains(&header_u64(&headers, "retry-after")));
    // A cancel draws on the same bucket; sends and other tenants do not.
    let cancel = app
        .tenant(&key, reqwest::Method::DELETE, "/v1/messages?reference=r-1")
        .send()
        .await
        .unwrap();
    expect_problem_kind(cancel, StatusCode::TOO_MANY_REQUESTS, "too-many-changes").await;
    assert_eq!(
        app.send(&key, &email()).await.status(),
        StatusCode::ACCEPTED
    );
    assert_eq!(add(&other, 0).await.unwrap().status(), StatusCode::CREATED);

    // A disabled tenant can change nothing.
    app.patch_tenant("globex", serde_json::json!({"status": "disabled"}))
        .await;
    let refused = add(&other, 1).await.unwrap();
    expect_problem_kind(refused, StatusCode::FORBIDDEN, "forbidden").await;
    let refused = app
        .tenant(
            &other,
            reqwest::Method::DELETE,
            "/v1/suppressions/x0@example.com",
        )
        .send()
        .await
        .unwrap();
    expect_problem_kind(refused, StatusCode::FORBIDDEN, "forbidden").await;
}
