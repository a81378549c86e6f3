//! Provider storms: a provider that answers 429 with `Retry-After` pauses
//! its gate for every message, not only the one it refused, and burns no
//! attempt; however long the pause it asks for, fairlane pauses an hour at
//! most.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use crate::crash::{ChildGuard, free_port, unlimited_tenant, wait_ready};
use crate::delivery::{SMS_PATH, delivery_settings, status_is, wait_for};
use crate::support::{TestApp, sms, sqlite_file, with};
use rusqlite::OptionalExtension;

const ADMIN: &str = "storms-test-admin-token-0123456";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_with_retry_after_pauses_the_providers_sends_for_every_message() {
    let sms_api = MockServer::start().await;
    let calls = Arc::new(AtomicUsize::new(0));
    let arrivals: Arc<Mutex<Vec<(Instant, u16)>>> = Arc::default();
    let (counter, log) = (calls.clone(), arrivals.clone());
    Mock::given(method("POST"))
        .and(path(SMS_PATH))
        .respond_with(move |_: &Request| {
            let status = if counter.fetch_add(1, Ordering::SeqCst) == 0 {
                429
            } else {
                201
            };
            log.lock().unwrap().push((Instant::now(), status));
            match status {
                429 => ResponseTemplate::new(429)
                    .insert_header("Retry-After", "2")
                    .set_body_json(json!({"code": 20429, "message": "Too Many Requests"})),
                _ => ResponseTemplate::new(201).set_body_json(json!({"sid": "SM1"})),
            }
        })
        .mount(&sms_api)
        .await;
    let app = TestApp::start(&delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", "")).await;
    let key = app.tenant_with_key("acme", "pro").await;

    let paused_before = pauses_of_http(&app.metrics_text().await);
    let first = app.send_accepted(&key, &sms()).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while calls.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the provider was never called");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Nine more, sent while the provider's pause runs.
    let mut ids = vec![first];
    for n in 0..9 {
        ids.push(
            app.send_accepted(
                &key,
                &with(sms(), "text", json!(format!("after the 429, {n}"))),
            )
            .await,
        );
    }
    for id in &ids {
        let view = wait_for(&app, &key, id, status_is("sent")).await;
        assert_eq!(view["status"], "sent", "{view}");
        assert_eq!(view["attempts"], 1, "the 429 burnt an attempt: {view}");
    }
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), 11, "one 429 and ten sends: {arrivals:?}");
    let (throttled_at, status) = arrivals[0];
    assert_eq!(status, 429);
    let soonest = arrivals[1..]
        .iter()
        .map(|(at, _)| at.duration_since(throttled_at))
        .min()
        .unwrap();
    eprintln!("first call after the 429 came {soonest:?} later");
    // Retry-After is whole seconds; the pause is 2 s from when fairlane
    // read the answer, a little after the provider wrote it.
    assert!(
        soonest >= Duration::from_millis(1950),
        "a send went {soonest:?} after a 429 that said Retry-After: 2"
    );
    // The recorder is shared by the tests of this process: at least this
    // test's pause is counted.
    let pauses = pauses_of_http(&app.metrics_text().await);
    assert!(
        pauses > paused_before,
        "pauses counted: {paused_before} then {pauses}"
    );
}

fn pauses_of_http(metrics: &str) -> u64 {
    metrics
        .lines()
        .find(|line| {
            line.starts_with("fairlane_provider_pauses_total{") && line.contains("provider=\"sms\"")
        })
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
        .expect("fairlane_provider_pauses_total{provider=\"sms\"} is in every scrape")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_of_5xx_opens_the_providers_breaker_for_a_growing_interval() {
    let sms_api = MockServer::start().await;
    let arrivals: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let first_call: Arc<Mutex<Option<Instant>>> = Arc::default();
    let (log, first) = (arrivals.clone(), first_call.clone());
    // Down for 1.5 s from its first call, then up.
    Mock::given(method("POST"))
        .and(path(SMS_PATH))
        .respond_with(move |_: &Request| {
            let now = Instant::now();
            log.lock().unwrap().push(now);
            let since = now.duration_since(*first.lock().unwrap().get_or_insert(now));
            if since < Duration::from_millis(1500) {
                ResponseTemplate::new(503).set_body_json(json!({"message": "down"}))
            } else {
                ResponseTemplate::new(201).set_body_json(json!({"sid": "SM1"}))
            }
        })
        .mount(&sms_api)
        .await;
    let app = TestApp::start_custom(
        &delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", ""),
        |settings| {
            settings.retry.max_attempts = 10;
            settings.providers.sms.breaker_failures = 3;
            settings.providers.sms.breaker_open_ms = 1000;
            settings.providers.sms.breaker_max_open_secs = 30;
        },
    )
    .await;
    let key = app.tenant_with_key("acme", "pro").await;
    let opened_before = counter_of_http(
        &app.metrics_text().await,
        "fairlane_provider_breaker_opens_total",
    );
    let mut ids = Vec::new();
    for n in 0..10 {
        ids.push(
            app.send_accepted(&key, &with(sms(), "text", json!(format!("storm {n}"))))
                .await,
        );
    }
    for id in &ids {
        let view = wait_for(&app, &key, id, status_is("sent")).await;
        assert_eq!(view["status"], "sent", "{view}");
    }
    let arrivals = arrivals.lock().unwrap().clone();
    let start = arrivals[0];
    let offsets: Vec<f64> = arrivals
        .iter()
        .map(|at| at.duration_since(start).as_secs_f64())
        .collect();
    eprintln!("provider calls at {offsets:.3?} s");
    // The third failure opens the breaker for 1 s: calls already past the
    // gate may still land just after it, then none until it ends.
    let opened = offsets[2];
    let quiet = |from: f64, to: f64| offsets.iter().filter(|t| **t > from && **t < to).count();
    assert_eq!(
        quiet(opened + 0.2, opened + 0.95),
        0,
        "calls while the breaker was open: {offsets:.3?}"
    );
    // The trial after it fails (the provider is down for 1.5 s): open again
    // at once, for 2 s.
    let trial = *offsets
        .iter()
        .find(|t| **t >= opened + 0.95)
        .expect("a call after the breaker's first interval");
    assert!(
        trial < 1.5,
        "the trial came at {trial:.3} s, after the provider was up"
    );
    assert_eq!(
        quiet(trial + 0.2, trial + 1.95),
        0,
        "calls while the breaker was open the second time: {offsets:.3?}"
    );
    assert!(
        arrivals.len() <= 40,
        "{} calls for 10 messages: the breaker did not hold the workers back",
        arrivals.len()
    );
    let opened_after = counter_of_http(
        &app.metrics_text().await,
        "fairlane_provider_breaker_opens_total",
    );
    assert!(
        opened_after >= opened_before + 2,
        "breaker openings counted: {opened_before} then {opened_after}"
    );
}

fn counter_of_http(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .find(|line| line.starts_with(&format!("{name}{{")) && line.contains("provider=\"sms\""))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("{name}{{provider=\"sms\"}} is in every scrape"))
}

/// The real binary, JSON logs captured: the SMS provider answers 429 with a
/// `Retry-After` of thousands of years, or more seconds than any integer
/// holds. fairlane pauses the SMS gate for an hour at most (the clamp, with a
/// WARN line), defers the message by the same hour, panics nowhere, and
/// keeps delivering through its other provider.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_of_thousands_of_years_pauses_the_gate_an_hour_at_most_and_nothing_panics() {
    for asked in ["99999999999", "18446744073709551615"] {
        let dir = tempfile::tempdir().unwrap();
        let sms_api = MockServer::start().await;
        Mock::given(method("POST"))
            .and(path(SMS_PATH))
            .respond_with(
                ResponseTemplate::new(429)
                    .insert_header("Retry-After", asked)
                    .set_body_json(json!({"code": 20429, "message": "Too Many Requests"})),
            )
            .mount(&sms_api)
            .await;
        let port = free_port();
        let base = format!("http://127.0.0.1:{port}");
        let db = dir.path().join("fairlane.db");
        let config = dir.path().join("fairlane.toml");
        std::fs::write(
            &config,
            format!(
                "[server]\nlisten = \"127.0.0.1:{port}\"\nadmin_token = \"{ADMIN}\"\n\
                 [storage]\nurl = \"sqlite://{db}\"\n\
                 [providers.email]\nkind = \"log\"\nrate_per_second = 100.0\nburst = 10\nlog_path = \"{deliveries}\"\n\
                 [providers.sms]\nkind = \"http\"\nbase_url = \"{sms}\"\naccount_sid = \"AC123\"\nauth_token = \"secret-token\"\n\
                 from = \"+15550001111\"\nrate_per_second = 100.0\nburst = 10\n",
                db = db.display(),
                deliveries = dir.path().join("deliveries.jsonl").display(),
                sms = sms_api.uri(),
            ),
        )
        .unwrap();
        let stderr = std::fs::File::create(dir.path().join("stderr.log")).unwrap();
        let child = ChildGuard(
            Command::new(env!("CARGO_BIN_EXE_fairlane"))
                .args(["serve", "--config"])
                .arg(&config)
                .env("RUST_LOG", "warn")
                .env("FAIRLANE_LOG_FORMAT", "json")
                .env_remove("FAIRLANE_CONFIG")
                .stdout(Stdio::null())
                .stderr(stderr)
                .spawn()
                .expect("fairlane binary starts"),
        );
        let client = reqwest::Client::new();
        wait_ready(&client, &base).await;
        let key = unlimited_tenant(&client, &base, ADMIN).await;

        let sms_id = send(&client, &base, &key, sms()).await;
        let throttled = wait_for_view(&client, &base, &key, &sms_id, |view| {
            view["status"] == "retrying"
        })
        .await;
        assert_eq!(
            throttled["last_error"],
            "throttled by provider: HTTP 429, code 20429: Too Many Requests",
            "{throttled}"
        );
        assert_eq!(throttled["attempts"], 0, "{throttled}");
        // The message is deferred by the clamped pause: the deferral is the
        // last thing its processing does, so it also shows that nothing on
        // the way panicked.
        let deferred_by = deferral_of(&db, &sms_id).await;
        assert!(
            deferred_by > Duration::from_secs(3500) && deferred_by <= Duration::from_secs(3600),
            "Retry-After: {asked} deferred the message by {deferred_by:?}"
        );
        // The consumers go on: an email goes out while the SMS gate waits.
        let email_id = send(
            &client,
            &base,
            &key,
            json!({"channel": "email", "to": "ada@example.com", "subject": "Hi", "text": "Hello"}),
        )
        .await;
        let sent = wait_for_view(&client, &base, &key, &email_id, |view| {
            view["status"] == "sent"
        })
        .await;
        assert_eq!(sent["status"], "sent", "{sent}");
        assert_eq!(
            sms_api.received_requests().await.unwrap().len(),
            1,
            "the SMS gate is paused"
        );
        drop(child);

        let log = std::fs::read_to_string(dir.path().join("stderr.log")).unwrap();
        assert!(!log.contains("panicked"), "{log}");
        let lines: Vec<Value> = log
            .lines()
            .map(|line| serde_json::from_str(line).unwrap_or_else(|err| panic!("{err}: {line}")))
            .collect();
        let line = |message: &str| {
            lines
                .iter()
                .find(|line| line["fields"]["message"] == message)
                .unwrap_or_else(|| panic!("no {message:?} line in {log}"))
                .clone()
        };
        let clamped = line(
            "Provider asked for a longer pause than fairlane allows; its gate pauses for the maximum instead.",
        );
        assert_eq!(clamped["level"], "WARN", "{clamped}");
        assert_eq!(clamped["fields"]["provider"], "http", "{clamped}");
        assert_eq!(clamped["fields"]["retry_after"], asked, "{clamped}");
        assert_eq!(clamped["fields"]["max_secs"], 3600, "{clamped}");
        let paused = line(
            "Provider answered 429 with Retry-After; its gate pauses every send for that long.",
        );
        assert_eq!(paused["fields"]["pause_secs"], 3600.0, "{paused}");
    }
}

async fn send(client: &reqwest::Client, base: &str, key: &str, body: Value) -> String {
    let response = client
        .post(format!("{base}/v1/messages"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202);
    let body: Value = response.json().await.unwrap();
    body["id"].as_str().unwrap().to_owned()
}

/// Polls `GET /v1/messages/{id}` until `done` holds (10 s at most); returns
/// the last view.
async fn wait_for_view(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    id: &str,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let view: Value = client
            .get(format!("{base}/v1/messages/{id}"))
            .bearer_auth(key)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if done(&view) || Instant::now() > deadline {
            return view;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How far in the future the embedded queue has put message `id`, once
/// something has put it more than a minute ahead (a deferral, not a
/// receive's lease); waits up to 10 s for that.
async fn deferral_of(db: &std::path::Path, id: &str) -> Duration {
    let conn = sqlite_file(db);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = chrono::Utc::now().timestamp_millis();
        let visible_at: Option<(i64,)> = conn
            .query_row(
                "SELECT visible_at FROM queue_messages WHERE message_id = ? AND queue = 'fast'",
                [id],
                |row| Ok((row.get(0)?,)),
            )
            .optional()
            .unwrap();
        if let Some((at,)) = visible_at
            && at - now > 60_000
        {
            return Duration::from_millis((at - now) as u64);
        }
        assert!(
            Instant::now() < deadline,
            "message {id} was never deferred (visible_at {visible_at:?}, now {now})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
