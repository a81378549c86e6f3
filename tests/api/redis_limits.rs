//! `limits.backend = "redis"` over HTTP: a tenant sees the same answers as
//! with the local backend (status, problem type, Retry-After and the
//! `RateLimit-*` headers), and switching backends keeps its day's count.
//!
//! Needs a Redis (`FAIRLANE_TEST_REDIS_URL`, else 6379, else one
//! `tests/servers` starts). Each test uses a random key prefix and deletes
//! its keys at the end.

use reqwest::StatusCode;

use crate::support::*;

/// One send every 2 s, bursts of 2.
const TINY_PLAN: &str = "[plans.tiny]\nlane = \"fast\"\nrate_per_second = 0.5\nburst = 2\n\
                         daily_quota = 1000\nmax_in_flight = 1\n";

/// Three sends a day; a bucket of 10 that refills so slowly (one send per
/// 100 s) that `RateLimit-Remaining` does not depend on how fast the test runs.
const CAPPED_PLAN: &str = "[plans.capped]\nlane = \"fast\"\nrate_per_second = 0.01\n\
                           burst = 10\ndaily_quota = 3\nmax_in_flight = 1\n";

fn redis_url() -> String {
    crate::servers::redis_url()
}

/// A random key prefix on the test Redis; its keys are deleted on drop.
struct RedisPrefix {
    client: redis::Client,
    name: String,
}

impl RedisPrefix {
    /// Fails the test when no Redis answers.
    fn new() -> Self {
        let url = redis_url();
        let client =
            redis::Client::open(url.as_str()).expect("FAIRLANE_TEST_REDIS_URL is a Redis URL");
        let pong = client
            .get_connection()
            .and_then(|mut conn| redis::cmd("PING").query::<String>(&mut conn));
        assert!(
            pong.is_ok(),
            "no Redis answers at {url} (FAIRLANE_TEST_REDIS_URL): these tests need a real Redis; \
             start one with `redis-server` or point the variable at one ({pong:?})"
        );
        RedisPrefix {
            client,
            name: format!("fairlane-test-{}", uuid::Uuid::new_v4().simple()),
        }
    }

    /// The `[limits]` table of an app counting under this prefix.
    fn settings(&self) -> String {
        format!(
            "[limits]\nbackend = \"redis\"\nredis_url = \"{}\"\nkey_prefix = \"{}\"\n",
            redis_url(),
            self.name
        )
    }

    fn keys(&self) -> Vec<String> {
        self.client
            .get_connection()
            .and_then(|mut conn| {
                redis::cmd("KEYS")
                    .arg(format!("{}:*", self.name))
                    .query(&mut conn)
            })
            .unwrap_or_default()
    }
}

impl Drop for RedisPrefix {
    fn drop(&mut self) {
        let keys = self.keys();
        if !keys.is_empty()
            && let Ok(mut conn) = self.client.get_connection()
        {
            let _: redis::RedisResult<i64> = redis::cmd("DEL").arg(keys).query(&mut conn);
        }
    }
}

/// What a client can see of one answer to a send.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    status: StatusCode,
    problem: Option<String>,
    retry_after: Option<String>,
    limit: Option<String>,
    remaining: Option<String>,
    reset: Option<String>,
}

async fn send_and_look(app: &TestApp, key: &str) -> Seen {
    let response = app.send(key, &email()).await;
    let headers = response.headers().clone();
    let status = response.status();
    let body: serde_json::Value = response.json().await.expect("JSON body");
    let text = |name: &str| header(&headers, name).map(str::to_owned);
    Seen {
        status,
        problem: body["type"].as_str().map(str::to_owned),
        retry_after: text("retry-after"),
        limit: text("ratelimit-limit"),
        remaining: text("ratelimit-remaining"),
        reset: text("ratelimit-reset"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_rate_redis_answers_the_same_429_retry_after_and_ratelimit_headers_as_local() {
    let prefix = RedisPrefix::new();
    let mut answers = Vec::new();
    for extra in [String::new(), prefix.settings()] {
        let app = TestApp::start(&format!("{TINY_PLAN}{extra}")).await;
        let key = app.tenant_with_key("acme", "tiny").await;
        let mut seen = Vec::new();
        for _ in 0..3 {
            seen.push(send_and_look(&app, &key).await);
        }
        answers.push(seen);
    }
    let (local, redis) = (&answers[0], &answers[1]);
    assert_eq!(local[2].status, StatusCode::TOO_MANY_REQUESTS, "{local:?}");
    assert_eq!(local[2].retry_after.as_deref(), Some("2"), "{local:?}");
    assert_eq!(redis, local, "redis answered otherwise than local");
    assert!(
        prefix
            .keys()
            .iter()
            .any(|key| key.ends_with(":tenant:acme:rate")),
        "the redis app counted in Redis: {:?}",
        prefix.keys()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_daily_quota_redis_answers_the_same_429_as_local() {
    let prefix = RedisPrefix::new();
    let mut answers = Vec::new();
    for extra in [String::new(), prefix.settings()] {
        let app = TestApp::start(&format!("{CAPPED_PLAN}{extra}")).await;
        let key = app.tenant_with_key("acme", "capped").await;
        let mut seen = Vec::new();
        for _ in 0..4 {
            seen.push(send_and_look(&app, &key).await);
        }
        answers.push(seen);
    }
    let (mut local, mut redis) = (answers[0].clone(), answers[1].clone());
    // Seconds until midnight may tick over between the two runs.
    let secs = |seen: &Seen| -> i64 {
        seen.retry_after
            .as_deref()
            .expect("Retry-After on the quota refusal")
            .parse()
            .expect("whole seconds")
    };
    assert_eq!(local[3].status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        (secs(&local[3]) - secs(&redis[3])).abs() <= 1,
        "{local:?} {redis:?}"
    );
    local[3].retry_after = None;
    redis[3].retry_after = None;
    assert_eq!(redis, local, "redis answered otherwise than local");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_an_email_refused_by_the_rate_gives_back_what_it_took() {
    let prefix = RedisPrefix::new();
    let app = TestApp::start(&prefix.settings()).await;
    crate::recipients::rate_refusals_charge_nothing(&app).await;
    assert!(
        prefix
            .keys()
            .iter()
            .any(|key| key.ends_with(":tenant:acme:rate")),
        "counted in Redis: {:?}",
        prefix.keys()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_from_local_to_redis_keeps_the_tenants_day_count() {
    let prefix = RedisPrefix::new();
    let app = TestApp::start(CAPPED_PLAN).await;
    let key = app.tenant_with_key("acme", "capped").await;
    for _ in 0..2 {
        assert_eq!(app.send(&key, &sms()).await.status(), StatusCode::ACCEPTED);
    }
    let dir = app.stop().await;

    // Same store, now counting in Redis: the day's counter starts from the
    // two messages already in the store.
    let app = TestApp::start_in(dir, &format!("{CAPPED_PLAN}{}", prefix.settings()), |_| {}).await;
    assert_eq!(app.send(&key, &sms()).await.status(), StatusCode::ACCEPTED);
    let response = app.send(&key, &sms()).await;
    expect_problem_kind(response, StatusCode::TOO_MANY_REQUESTS, "quota").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_reports_redis_held_limits() {
    let prefix = RedisPrefix::new();
    let app = TestApp::start(&prefix.settings()).await;
    let response = app.client.get(app.url("/readyz")).send().await.unwrap();
    let body = expect_json(response, StatusCode::OK).await;
    assert_eq!(body["checks"]["limits"], "ok", "{body}");
    assert_eq!(body["checks"]["store"], "ok", "{body}");
}

/// A tenant's changes other than sends draw on one bucket for the fleet:
/// two instances under one prefix give it one burst, not two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_changes_share_one_bucket_across_instances_with_redis() {
    let prefix = RedisPrefix::new();
    let settings = format!(
        "{}tenant_writes_per_second = 0.01\ntenant_writes_burst = 3\n",
        prefix.settings()
    );
    let first = TestApp::start(&settings).await;
    let second = TestApp::start(&settings).await;
    let mut keys = Vec::new();
    for app in [&first, &second] {
        keys.push(app.tenant_with_key("acme", "pro").await);
    }
    let add = |app: &TestApp, key: &str, n: usize| {
        app.tenant(key, reqwest::Method::POST, "/v1/suppressions")
            .json(&serde_json::json!({"address": format!("x{n}@example.com")}))
            .send()
    };
    for n in 0..3 {
        let response = add(&first, &keys[0], n).await.unwrap();
        assert_eq!(response.status(), StatusCode::CREATED, "change {n}");
    }
    // The burst is spent on the first instance: the second refuses too.
    let (headers, _) = expect_problem_kind(
        add(&second, &keys[1], 3).await.unwrap(),
        StatusCode::TOO_MANY_REQUESTS,
        "too-many-changes",
    )
    .await;
    assert!(header_u64(&headers, "retry-after") >= 50, "{headers:?}");
    assert!(
        prefix
            .keys()
            .iter()
            .any(|key| key.ends_with(":tenant:acme:writes")),
        "the changes were counted in Redis: {:?}",
        prefix.keys()
    );
}
