//! Several SMS providers in one pool (issue 30): routing by weight and
//! health, failover of a refused call to another provider, a timed-out
//! call tried again only by the same provider, each provider within its
//! own rate, and the admin view of the pool. Both providers are wiremock
//! servers of the test's own that record when each call arrived and which
//! message it carried.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use crate::delivery::{SMS_PATH, status_is, wait_for};
use crate::support::{TestApp, expect_json, sms, with};

/// One call a mock provider received.
#[derive(Debug, Clone)]
struct Call {
    at: Instant,
    /// The message's text (each test message's is unique).
    text: String,
    /// True when the provider answered 2xx.
    took: bool,
    /// Where the provider was asked to report the message's status.
    callback: String,
}

type Calls = Arc<Mutex<Vec<Call>>>;

fn form_field(request: &Request, name: &str) -> String {
    form_urlencoded::parse(&request.body)
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.into_owned())
        .unwrap_or_default()
}

/// A Twilio-compatible provider that answers 503 while `failing` is set,
/// and otherwise as `answer` says for the message's text.
async fn provider(
    calls: Calls,
    failing: Arc<AtomicBool>,
    answer: impl Fn(&str) -> (ResponseTemplate, bool) + Send + Sync + 'static,
) -> MockServer {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path(SMS_PATH))
        .respond_with(move |request: &Request| {
            let text = form_field(request, "Body");
            let callback = form_field(request, "StatusCallback");
            let (response, took) = if failing.load(Ordering::SeqCst) {
                let down = ResponseTemplate::new(503).set_body_json(json!({"message": "down"}));
                (down, false)
            } else {
                answer(&text)
            };
            calls.lock().unwrap().push(Call {
                at: Instant::now(),
                text,
                took,
                callback,
            });
            response
        })
        .mount(&server)
        .await;
    server
}

/// A 201 with a fresh sid; the call took the message.
fn ok(text: &str) -> (ResponseTemplate, bool) {
    let answer = ResponseTemplate::new(201).set_body_json(json!({"sid": format!("SM-{text}")}));
    (answer, true)
}

/// A pool of two http SMS providers: `alpha` (the `providers.sms` table)
/// and `beta` (`providers.sms_pool.beta`).
fn pool_settings(alpha: &str, beta: &str, tuning: &str, health: &str) -> String {
    let provider = |base: &str| {
        format!(
            "kind = \"http\"\nbase_url = \"{base}\"\naccount_sid = \"AC123\"\n\
             auth_token = \"secret-token\"\nfrom = \"+15550001111\"\n"
        )
    };
    format!(
        "[consumers]\nenabled = true\nreceive_wait_secs = 1\nhold_delay_secs = 1\n\
         tenant_cap_delay_secs = 1\nshutdown_grace_secs = 5\n\n\
         [retry]\nmax_attempts = 10\nbase_delay_ms = 50\nmax_delay_secs = 1\n\n\
         [providers.sms]\nname = \"alpha\"\n{}{tuning}\n\n\
         [providers.sms_pool.beta]\n{}{tuning}\n\n\
         [providers.health]\n{health}\n",
        provider(alpha),
        provider(beta)
    )
}

/// Messages answered 2xx per text, over both providers.
fn taken_per_text(calls: &[&Calls]) -> std::collections::HashMap<String, usize> {
    let mut taken = std::collections::HashMap::new();
    for calls in calls {
        for call in calls.lock().unwrap().iter().filter(|call| call.took) {
            *taken.entry(call.text.clone()).or_insert(0) += 1;
        }
    }
    taken
}

async fn providers_view(app: &TestApp) -> Value {
    expect_json(
        app.admin(Method::GET, "/v1/admin/providers")
            .send()
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await
}

fn sms_provider<'v>(view: &'v Value, name: &str) -> &'v Value {
    view["providers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["channel"] == "sms" && p["name"] == name)
        .unwrap_or_else(|| panic!("no sms provider {name} in {view}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_provider_loses_its_share_within_seconds_and_wins_it_back() {
    let (alpha_calls, beta_calls): (Calls, Calls) = Default::default();
    let alpha_failing = Arc::new(AtomicBool::new(false));
    let alpha = provider(alpha_calls.clone(), alpha_failing.clone(), ok).await;
    let beta = provider(beta_calls.clone(), Arc::default(), ok).await;
    let app = TestApp::start(&pool_settings(
        &alpha.uri(),
        &beta.uri(),
        "rate_per_second = 50.0\nburst = 5\n",
        "window_secs = 2\nmin_calls = 5\nmax_failure_rate = 0.3\ndown_secs = 1\nrecover_secs = 2\n",
    ))
    .await;
    let key = app.tenant_with_key("acme", "pro").await;
    // Idle, the buckets (50/s, burst 5) are full within 100 ms.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let idle = providers_view(&app).await;
    assert_eq!(sms_provider(&idle, "alpha")["tokens"], 5, "{idle}");
    assert_eq!(sms_provider(&idle, "beta")["tokens"], 5, "{idle}");

    // 40 messages a second for 10 s; alpha answers 503 from 2 s to 5 s.
    let start = Instant::now();
    let (fail_at, recover_at) = (Duration::from_secs(2), Duration::from_secs(5));
    let mut ids = Vec::new();
    let mut mid_failure_view = None;
    for n in 0..400u32 {
        let due = Duration::from_millis(25 * u64::from(n));
        tokio::time::sleep_until((start + due).into()).await;
        alpha_failing.store(due >= fail_at && due < recover_at, Ordering::SeqCst);
        if mid_failure_view.is_none() && due >= fail_at + Duration::from_millis(1500) {
            mid_failure_view = Some(providers_view(&app).await);
        }
        let id = app
            .send_accepted(&key, &with(sms(), "text", json!(format!("pool {n}"))))
            .await;
        ids.push(id);
    }
    alpha_failing.store(false, Ordering::SeqCst);
    for id in &ids {
        let view = wait_for(&app, &key, id, status_is("sent")).await;
        assert_eq!(view["status"], "sent", "every message is sent: {view}");
    }

    // Each message was taken by exactly one provider, once.
    let taken = taken_per_text(&[&alpha_calls, &beta_calls]);
    assert_eq!(taken.len(), ids.len(), "every message was taken");
    let twice: Vec<_> = taken.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "sent twice: {twice:?}");

    // The status names the provider that took it.
    let alpha_took: std::collections::HashSet<String> = alpha_calls
        .lock()
        .unwrap()
        .iter()
        .filter(|call| call.took)
        .map(|call| call.text.clone())
        .collect();
    for (n, id) in ids.iter().enumerate().step_by(37) {
        let view = expect_json(app.get_message(&key, id).await, StatusCode::OK).await;
        let expected = if alpha_took.contains(&format!("pool {n}")) {
            "alpha"
        } else {
            "beta"
        };
        assert_eq!(view["provider"], expected, "{view}");
    }

    let calls_between = |calls: &Calls, from: Duration, to: Duration| {
        calls
            .lock()
            .unwrap()
            .iter()
            .filter(|call| call.at >= start + from && call.at < start + to)
            .count()
    };
    let secs = Duration::from_secs_f64;
    // From 2 s after it failed until it recovered, alpha got at most the
    // odd probe: beta took the messages.
    let (a, b) = (
        calls_between(&alpha_calls, fail_at + secs(2.0), recover_at),
        calls_between(&beta_calls, fail_at + secs(2.0), recover_at),
    );
    eprintln!("while alpha failed (from 2 s after): alpha {a} calls, beta {b}");
    assert!(
        (a as f64) <= 0.15 * (a + b) as f64,
        "alpha kept {a} of {} calls 2 s after it failed",
        a + b
    );
    // The view said so while it failed.
    let view = mid_failure_view.expect("viewed while alpha failed");
    let alpha_view = sms_provider(&view, "alpha");
    assert!(
        ["down", "paused", "recovering"].contains(&alpha_view["state"].as_str().unwrap()),
        "{alpha_view}"
    );
    assert!(alpha_view["share"].as_f64().unwrap() < 0.5, "{alpha_view}");
    assert_eq!(sms_provider(&view, "beta")["state"], "healthy");
    for name in ["alpha", "beta"] {
        let tokens = sms_provider(&view, name)["tokens"].as_u64();
        assert!(tokens.is_some_and(|t| t <= 5), "{view}");
    }
    // Recovered (down 1 s, then 2 s winning its weight back, the last
    // probe failing at 5 s at the latest): from 8 s it takes its share.
    let (a, b) = (
        calls_between(&alpha_calls, secs(8.0), secs(10.5)),
        calls_between(&beta_calls, secs(8.0), secs(10.5)),
    );
    eprintln!("after alpha recovered: alpha {a} calls, beta {b}");
    assert!(
        a as f64 >= 0.3 * (a + b) as f64,
        "alpha took {a} of {} calls after it recovered",
        a + b
    );
    let view = providers_view(&app).await;
    assert_eq!(sms_provider(&view, "alpha")["state"], "healthy", "{view}");
    assert!(sms_provider(&view, "alpha")["downs"].as_u64().unwrap() >= 1);
    let metrics = app.metrics_text().await;
    let downs: Vec<&str> = metrics
        .lines()
        .filter(|line| line.starts_with("fairlane_provider_downs_total{"))
        .collect();
    assert!(
        downs.iter().any(|line| line.contains("provider=\"alpha\"")),
        "downs counted by the provider's name: {downs:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_call_fails_over_but_a_timed_out_one_stays_with_its_provider() {
    let (alpha_calls, beta_calls): (Calls, Calls) = Default::default();
    let alpha = provider(alpha_calls.clone(), Arc::default(), |text| {
        if text.starts_with("refuse") {
            let busy = ResponseTemplate::new(503).set_body_json(json!({"message": "busy"}));
            (busy, false)
        } else if text.starts_with("slow") {
            // Answered after the call timed out: not taken as far as
            // fairlane knows (a real provider might have sent it).
            (ok(text).0.set_delay(Duration::from_millis(1500)), false)
        } else {
            ok(text)
        }
    })
    .await;
    let beta = provider(beta_calls.clone(), Arc::default(), ok).await;
    // alpha's weight makes it the first choice of every message.
    let mut settings = pool_settings(
        &alpha.uri(),
        &beta.uri(),
        "rate_per_second = 100.0\nburst = 10\ntimeout_ms = 300\nbreaker_failures = 0\n",
        "min_calls = 100\n",
    );
    settings = settings.replacen("[providers.sms]\n", "[providers.sms]\nweight = 1000\n", 1);
    settings = settings.replace("max_attempts = 10", "max_attempts = 3");
    let app = TestApp::start(&settings).await;
    let key = app.tenant_with_key("acme", "pro").await;
    // Both buckets start empty (see limits::gate); once they hold tokens,
    // routing by weight decides, not which bucket earned a token first.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let refused = app
        .send_accepted(&key, &with(sms(), "text", json!("refuse me")))
        .await;
    let view = wait_for(&app, &key, &refused, status_is("sent")).await;
    assert_eq!(view["status"], "sent", "{view}");
    assert_eq!(
        view["provider"], "beta",
        "the retry went to the other provider"
    );
    assert_eq!(view["attempts"], 2, "{view}");

    let slow = app
        .send_accepted(&key, &with(sms(), "text", json!("slow one")))
        .await;
    let view = wait_for(&app, &key, &slow, |view| {
        view["status"] == "dead_lettered" || view["status"] == "sent"
    })
    .await;
    assert_eq!(view["status"], "dead_lettered", "{view}");
    assert_eq!(view["provider"], "alpha", "{view}");
    let to = |calls: &Calls, text: &str| {
        calls
            .lock()
            .unwrap()
            .iter()
            .filter(|call| call.text == text)
            .count()
    };
    assert_eq!(
        to(&alpha_calls, "slow one"),
        3,
        "every attempt went to alpha"
    );
    assert_eq!(
        to(&beta_calls, "slow one"),
        0,
        "a timed-out message never goes to a second provider"
    );
    assert_eq!(to(&alpha_calls, "refuse me"), 1);
    assert_eq!(to(&beta_calls, "refuse me"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_healthy_providers_share_a_backlog_each_within_its_own_rate() {
    let (alpha_calls, beta_calls): (Calls, Calls) = Default::default();
    let alpha = provider(alpha_calls.clone(), Arc::default(), ok).await;
    let beta = provider(beta_calls.clone(), Arc::default(), ok).await;
    let app = TestApp::start(&pool_settings(
        &alpha.uri(),
        &beta.uri(),
        "rate_per_second = 20.0\nburst = 2\n",
        "",
    ))
    .await;
    let key = app.tenant_with_key("acme", "enterprise").await;
    let mut ids = Vec::new();
    for n in 0..120 {
        ids.push(
            app.send_accepted(&key, &with(sms(), "text", json!(format!("backlog {n}"))))
                .await,
        );
    }
    for id in &ids {
        let view = wait_for(&app, &key, id, status_is("sent")).await;
        assert_eq!(view["status"], "sent", "{view}");
    }
    let times = |calls: &Calls| -> Vec<Instant> {
        calls.lock().unwrap().iter().map(|call| call.at).collect()
    };
    let (a, b) = (times(&alpha_calls), times(&beta_calls));
    assert_eq!(a.len() + b.len(), 120, "one call per message");
    // Each within its own bucket: at most burst + rate × t in any window
    // (one call of slack for the time between the gate and the arrival,
    // and 5 ms on each window for when the mock stamps a call: a CI run
    // once saw exactly the allowed 51 calls in a window measured a hair
    // under 2.400 s, which the bare bound refused).
    for (name, arrivals) in [("alpha", &a), ("beta", &b)] {
        for i in 0..arrivals.len() {
            for j in i..arrivals.len() {
                let window = arrivals[j].duration_since(arrivals[i]).as_secs_f64();
                let allowed = 2.0 + 20.0 * (window + 0.005) + 1.0;
                assert!(
                    (j - i + 1) as f64 <= allowed,
                    "{name}: {} calls in {window:.3} s",
                    j - i + 1
                );
            }
        }
    }
    // Both used: the pool's rate is the sum of theirs.
    assert!(
        a.len() >= 40 && b.len() >= 40,
        "alpha {} beta {}",
        a.len(),
        b.len()
    );
    let all: Vec<Instant> = a.iter().chain(&b).copied().collect();
    let first = *all.iter().min().unwrap();
    let last = *all.iter().max().unwrap();
    let rate = (all.len() - 1) as f64 / last.duration_since(first).as_secs_f64();
    eprintln!("pool of two at 20/s each: {rate:.1} calls/s");
    assert!(
        rate > 25.0,
        "the pool ran at {rate:.1}/s, no faster than one provider"
    );
}

#[tokio::test]
async fn a_pool_entry_is_checked_like_any_provider() {
    use fairlane::config::Settings;
    let base = "[providers.sms_pool.backup]\nkind = \"http\"\nrate_per_second = 10.0\nburst = 5\n";
    let err = Settings::from_toml_overlay(base).unwrap_err();
    assert!(
        format!("{err:#}").contains("providers.sms_pool.backup: base_url is required"),
        "{err:#}"
    );
    let named = "[providers.sms]\nname = \"backup\"\n[providers.sms_pool.backup]\nkind = \"log\"\nrate_per_second = 10.0\nburst = 5\n";
    let err = Settings::from_toml_overlay(named).unwrap_err();
    assert!(format!("{err:#}").contains("used twice"), "{err:#}");
    let bad = "[providers.sms_pool.Bad]\nkind = \"log\"\nrate_per_second = 10.0\nburst = 5\n";
    let err = Settings::from_toml_overlay(bad).unwrap_err();
    assert!(format!("{err:#}").contains("a provider's name"), "{err:#}");
    let email =
        "[providers.email_pool.second]\nkind = \"http\"\nrate_per_second = 10.0\nburst = 5\n";
    let err = Settings::from_toml_overlay(email).unwrap_err();
    assert!(
        format!("{err:#}")
            .contains("providers.email_pool.second: kind \"http\" cannot deliver email"),
        "{err:#}"
    );
    // One name in both channels' pools: refused at start, since the
    // gate's Redis bucket is keyed by the name alone.
    let both = "[providers.email_pool.backup]\nkind = \"log\"\nfrom = \"news@acme.example\"\n\
                rate_per_second = 0.02\nburst = 1\n\
                [providers.sms_pool.backup]\nkind = \"log\"\nrate_per_second = 100.0\nburst = 5\n";
    let err = Settings::from_toml_overlay(both).unwrap_err();
    assert!(
        format!("{err:#}").contains("is already one of the email providers"),
        "{err:#}"
    );
    let zero =
        "[providers.sms_pool.b]\nkind = \"log\"\nrate_per_second = 10.0\nburst = 5\nweight = 0\n";
    let err = Settings::from_toml_overlay(zero).unwrap_err();
    assert!(format!("{err:#}").contains("weight"), "{err:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_providers_callbacks_come_to_its_own_url_and_its_token_verifies_them() {
    use crate::receipts::{PUBLIC_URL, twilio_signature};
    let (alpha_calls, beta_calls): (Calls, Calls) = Default::default();
    let alpha = provider(alpha_calls.clone(), Arc::default(), ok).await;
    let beta = provider(beta_calls.clone(), Arc::default(), ok).await;
    let settings = pool_settings(
        &alpha.uri(),
        &beta.uri(),
        "rate_per_second = 100.0\nburst = 10\n",
        "",
    );
    // beta has a token of its own and takes every message.
    let at = settings.rfind("auth_token = \"secret-token\"").unwrap();
    let mut settings = settings;
    settings.replace_range(
        at..,
        &settings[at..].replacen(
            "auth_token = \"secret-token\"",
            "auth_token = \"beta-token\"\nweight = 1000",
            1,
        ),
    );
    let app = TestApp::start_custom(&settings, |settings| {
        settings.server.public_url = Some(PUBLIC_URL.into());
    })
    .await;
    let key = app.tenant_with_key("acme", "pro").await;
    // Both buckets start empty (see limits::gate); once they hold tokens,
    // routing by weight decides, not which bucket earned a token first.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let id = app
        .send_accepted(&key, &with(sms(), "text", json!("to beta")))
        .await;
    let view = wait_for(&app, &key, &id, status_is("sent")).await;
    assert_eq!(view["provider"], "beta", "{view}");
    let call = beta_calls.lock().unwrap()[0].clone();
    let url = format!("{PUBLIC_URL}/v1/callbacks/sms/beta?message_id={id}");
    assert_eq!(call.callback, url, "beta reports to its own callback URL");
    let sid = format!("SM-{}", call.text);
    let form = [("MessageSid", sid.as_str()), ("MessageStatus", "delivered")];
    let post = |token: &str, path: &str| {
        let path = format!("{path}?message_id={id}");
        let signature = twilio_signature(token, &format!("{PUBLIC_URL}{path}"), &form);
        app.client
            .post(app.url(&path))
            .header("X-Twilio-Signature", signature)
            .form(&form)
            .send()
    };
    // alpha's token does not verify beta's callbacks, nor beta's alpha's.
    let response = post("secret-token", "/v1/callbacks/sms/beta")
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::FORBIDDEN);
    let response = post("beta-token", "/v1/callbacks/sms").await.unwrap();
    assert_eq!(response.status(), StatusCode::FORBIDDEN);
    let response = post("beta-token", "/v1/callbacks/sms/nobody")
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    // alpha, signing with its own token, reports on beta's message id: the
    // receipt is alpha's, and no message alpha sent has that id, so
    // beta's message does not move (the receipt waits for a match of its
    // own provider that never comes).
    let response = post("secret-token", "/v1/callbacks/sms").await.unwrap();
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    let view = expect_json(app.get_message(&key, &id).await, StatusCode::OK).await;
    assert_eq!(
        view["status"], "sent",
        "alpha's receipt moved beta's message: {view}"
    );
    let response = post("beta-token", "/v1/callbacks/sms/beta").await.unwrap();
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    let view = wait_for(&app, &key, &id, status_is("delivered")).await;
    assert_eq!(view["status"], "delivered", "{view}");
    assert!(alpha_calls.lock().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_whose_receipts_come_late_loses_its_share() {
    use crate::receipts::{PUBLIC_URL, twilio_signature};
    let (alpha_calls, beta_calls): (Calls, Calls) = Default::default();
    let alpha = provider(alpha_calls.clone(), Arc::default(), ok).await;
    let beta = provider(beta_calls.clone(), Arc::default(), ok).await;
    // beta takes the messages while it is healthy; any receipt more than
    // 1 ms after its send is late here.
    let settings = pool_settings(
        &alpha.uri(),
        &beta.uri(),
        "rate_per_second = 100.0\nburst = 10\n",
        "min_calls = 3\nmax_receipt_delay_ms = 1\ndown_secs = 60\n",
    );
    let at = settings.rfind("[providers.sms_pool.beta]\n").unwrap();
    let mut settings = settings;
    settings.insert_str(at + "[providers.sms_pool.beta]\n".len(), "weight = 1000\n");
    let app = TestApp::start_custom(&settings, |settings| {
        settings.server.public_url = Some(PUBLIC_URL.into());
    })
    .await;
    let key = app.tenant_with_key("acme", "pro").await;
    // Both buckets start empty (see limits::gate); once they hold tokens,
    // routing by weight decides, not which bucket earned a token first.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut ids = Vec::new();
    for n in 0..3 {
        let id = app
            .send_accepted(&key, &with(sms(), "text", json!(format!("late {n}"))))
            .await;
        let view = wait_for(&app, &key, &id, status_is("sent")).await;
        assert_eq!(view["provider"], "beta", "{view}");
        ids.push(id);
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    for (n, id) in ids.iter().enumerate() {
        let sid = format!("SM-late {n}");
        let form = [("MessageSid", sid.as_str()), ("MessageStatus", "delivered")];
        let path = format!("/v1/callbacks/sms/beta?message_id={id}");
        let signature = twilio_signature("secret-token", &format!("{PUBLIC_URL}{path}"), &form);
        let response = app
            .client
            .post(app.url(&path))
            .header("X-Twilio-Signature", signature)
            .form(&form)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::NO_CONTENT);
    }
    let view = providers_view(&app).await;
    let beta_view = sms_provider(&view, "beta");
    assert_eq!(beta_view["state"], "down", "{view}");
    assert_eq!(beta_view["share"], 0.0, "{view}");
    assert_eq!(sms_provider(&view, "alpha")["share"], 1.0, "{view}");
    // The next message goes to alpha despite beta's weight.
    let id = app
        .send_accepted(&key, &with(sms(), "text", json!("after")))
        .await;
    let view = wait_for(&app, &key, &id, status_is("sent")).await;
    assert_eq!(view["provider"], "alpha", "{view}");
    assert_eq!(alpha_calls.lock().unwrap().len(), 1);
}
