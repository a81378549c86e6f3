//! A store that cannot write: the SQLite file capped with
//! `storage.max_size_mb` (SQLite's `max_page_count`, the same failure as a
//! full disk) fills with a backlog while the provider is slow. Sends then
//! answer 503 with Retry-After, `/readyz` says why, and nothing refused is
//! ever delivered; once deliveries have made room both recover by
//! themselves and every accepted message is sent.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use crate::delivery::{SMS_PATH, delivery_settings, status_is, wait_for};
use crate::support::{TestApp, expect_problem, header_u64, sms, with};

/// Texts the provider was asked to send, in arrival order.
type Arrivals = Arc<Mutex<Vec<String>>>;

/// An SMS provider that answers each call after 3 s (within the provider
/// timeout of 5 s) while `slow` holds, so the backlog stays in the store,
/// and at once after.
async fn slow_provider(slow: Arc<AtomicBool>, arrivals: Arrivals) -> MockServer {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path(SMS_PATH))
        .respond_with(move |request: &Request| {
            let form: Vec<(String, String)> =
                form_urlencoded::parse(&request.body).into_owned().collect();
            let text = form
                .iter()
                .find(|(name, _)| name == "Body")
                .map(|(_, value)| value.clone())
                .unwrap_or_default();
            arrivals.lock().unwrap().push(text);
            let answer = ResponseTemplate::new(201).set_body_json(json!({"sid": "SM1"}));
            if slow.load(Ordering::SeqCst) {
                answer.set_delay(Duration::from_secs(3))
            } else {
                answer
            }
        })
        .mount(&server)
        .await;
    server
}

async fn readyz(app: &TestApp) -> (StatusCode, Value) {
    let response = app.client.get(app.url("/readyz")).send().await.unwrap();
    let status = response.status();
    (status, response.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_answers_503_with_retry_after_and_recovers_by_itself() {
    let slow = Arc::new(AtomicBool::new(true));
    let arrivals: Arrivals = Arc::default();
    let provider = slow_provider(slow.clone(), arrivals.clone()).await;
    let app = TestApp::start_custom(
        &delivery_settings(&provider.uri(), "http://127.0.0.1:9", ""),
        |settings| settings.storage.max_size_mb = 1,
    )
    .await;
    let key = app.tenant_with_key("acme", "enterprise").await;
    let (status, health) = readyz(&app).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "ready before the store fills: {health}"
    );

    // Fill the file: long texts until the store refuses one.
    let filler = "x".repeat(1500);
    let mut accepted = Vec::new();
    let mut refused = None;
    for n in 0..5000 {
        let text = format!("accepted {n} {filler}");
        let response = app.send(&key, &with(sms(), "text", json!(text))).await;
        match response.status() {
            StatusCode::ACCEPTED => {
                let body: Value = response.json().await.unwrap();
                accepted.push((body["id"].as_str().unwrap().to_owned(), text));
            }
            StatusCode::SERVICE_UNAVAILABLE => {
                refused = Some((n, response));
                break;
            }
            other => panic!(
                "send {n} answered {other}: {}",
                response.text().await.unwrap()
            ),
        }
    }
    let (refused_at, response) = refused.expect("a 1 MiB store never filled in 5,000 sends");
    eprintln!(
        "the store refused send {refused_at} after accepting {}",
        accepted.len()
    );
    assert!(
        accepted.len() > 20,
        "refused after only {} sends",
        accepted.len()
    );
    let (headers, problem) = expect_problem(response, StatusCode::SERVICE_UNAVAILABLE).await;
    let retry_after = header_u64(&headers, "retry-after");
    assert!(
        (1..=30).contains(&retry_after),
        "Retry-After {retry_after}: {problem}"
    );

    // Refused sends while full: each 503, none of them ever delivered.
    let mut refused_texts = HashSet::new();
    for n in 0..5 {
        let text = format!("refused {n} {filler}");
        let response = app.send(&key, &with(sms(), "text", json!(text))).await;
        let (headers, _) = expect_problem(response, StatusCode::SERVICE_UNAVAILABLE).await;
        assert!(header_u64(&headers, "retry-after") >= 1);
        refused_texts.insert(text);
    }
    let (status, health) = readyz(&app).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{health}");
    assert_eq!(health["checks"]["store"], "unavailable", "{health}");
    let reason = health["reasons"]["store"].as_str().unwrap_or_default();
    assert!(
        reason.contains("full"),
        "readyz gives no reason for the store: {health}"
    );

    // The provider speeds up: deliveries make room, and by themselves the
    // store takes writes again and readyz turns ready.
    slow.store(false, Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, health) = readyz(&app).await;
        if status == StatusCode::OK {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still not ready 60 s after the provider sped up: {health}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let text = format!("after recovery {filler}");
    let id = app
        .send_accepted(&key, &with(sms(), "text", json!(text)))
        .await;
    accepted.push((id, text));

    for (id, _) in &accepted {
        let view = wait_for(&app, &key, id, status_is("sent")).await;
        assert_eq!(view["status"], "sent", "{view}");
    }
    let arrivals = arrivals.lock().unwrap().clone();
    let sent: HashSet<&String> = arrivals.iter().collect();
    for (_, text) in &accepted {
        assert!(
            sent.contains(text),
            "an accepted message never reached the provider"
        );
    }
    let leaked: Vec<_> = arrivals
        .iter()
        .filter(|text| refused_texts.contains(*text))
        .collect();
    assert!(
        leaked.is_empty(),
        "{} refused sends were delivered",
        leaked.len()
    );
    let accepted_texts: HashSet<&String> = accepted.iter().map(|(_, text)| text).collect();
    let unknown = arrivals
        .iter()
        .filter(|text| !accepted_texts.contains(text))
        .count();
    assert_eq!(
        unknown, 0,
        "the provider got messages that were never accepted"
    );
    assert_eq!(
        arrivals.len(),
        accepted.len(),
        "a message was sent more than once"
    );
}

/// `host:port` of a `postgres://user@host:port/db` URL.
fn pg_authority(url: &str) -> String {
    let after_scheme = &url[url.find("://").expect("a URL") + 3..];
    let authority = after_scheme.split('/').next().unwrap();
    authority.rsplit('@').next().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_postgres_answers_503_with_retry_after_and_recovers_by_itself() {
    crate::support::STORE
        .scope(crate::support::Store::Postgres, async {
            let sms_api = MockServer::start().await;
            crate::delivery::mock_sms_ok(&sms_api, "SM1").await;
            let proxy =
                crate::support::TcpProxy::start(pg_authority(&crate::support::pg_server_url()))
                    .await;
            let app = TestApp::start_custom(
                &delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", ""),
                |settings| {
                    let direct = pg_authority(&settings.storage.url);
                    settings.storage.url = settings.storage.url.replacen(
                        &direct,
                        &format!("127.0.0.1:{}", proxy.port),
                        1,
                    );
                },
            )
            .await;
            let key = app.tenant_with_key("acme", "pro").await;
            let before = app.send_accepted(&key, &sms()).await;
            let view = wait_for(&app, &key, &before, status_is("sent")).await;
            assert_eq!(view["status"], "sent", "{view}");

            proxy.cut();
            let started = Instant::now();
            let response = app
                .send(
                    &key,
                    &with(sms(), "text", json!("while PostgreSQL is away")),
                )
                .await;
            let waited = started.elapsed();
            let (headers, problem) =
                expect_problem(response, StatusCode::SERVICE_UNAVAILABLE).await;
            let retry_after = header_u64(&headers, "retry-after");
            assert!(
                (1..=30).contains(&retry_after),
                "Retry-After {retry_after}: {problem}"
            );
            eprintln!("the send during the outage answered 503 after {waited:?}");
            // A read finds the store away too: 503 with Retry-After, not 500.
            let read = app.get_message(&key, &before).await;
            let (headers, problem) = expect_problem(read, StatusCode::SERVICE_UNAVAILABLE).await;
            let retry_after = header_u64(&headers, "retry-after");
            assert!(
                (1..=30).contains(&retry_after),
                "Retry-After {retry_after}: {problem}"
            );
            // So does an admin change: the store's typed error reaches the
            // API whole through the registry, a 503 with Retry-After.
            let issue = app
                .admin(Method::POST, "/v1/admin/tenants/acme/keys")
                .send()
                .await
                .unwrap();
            let (headers, problem) = expect_problem(issue, StatusCode::SERVICE_UNAVAILABLE).await;
            let retry_after = header_u64(&headers, "retry-after");
            assert!(
                (1..=30).contains(&retry_after),
                "Retry-After {retry_after}: {problem}"
            );
            let (status, health) = readyz(&app).await;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{health}");
            assert_eq!(health["checks"]["store"], "unavailable", "{health}");
            assert!(
                health["reasons"]["store"].is_string(),
                "readyz gives no reason for the store: {health}"
            );

            proxy.restore();
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let (status, health) = readyz(&app).await;
                if status == StatusCode::OK {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "still not ready 60 s after PostgreSQL came back: {health}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let after = app
                .send_accepted(&key, &with(sms(), "text", json!("after the outage")))
                .await;
            let view = wait_for(&app, &key, &after, status_is("sent")).await;
            assert_eq!(view["status"], "sent", "{view}");
        })
        .await;
}
