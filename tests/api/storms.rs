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
