//! Provider storms: a provider that answers 429 with `Retry-After` pauses
//! its gate for every message, not only the one it refused, and burns no
//! attempt.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use crate::delivery::{SMS_PATH, delivery_settings, status_is, wait_for};
use crate::support::{TestApp, sms, with};

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
            line.starts_with("fairlane_provider_pauses_total{")
                && line.contains("provider=\"http\"")
        })
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
        .expect("fairlane_provider_pauses_total{provider=\"http\"} is in every scrape")
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
        .find(|line| line.starts_with(&format!("{name}{{")) && line.contains("provider=\"http\""))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("{name}{{provider=\"http\"}} is in every scrape"))
}
