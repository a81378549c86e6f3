//! Ops endpoints: liveness, readiness, the OpenAPI document and its UI, and
//! the answer for a route that does not exist.

use reqwest::StatusCode;
use serde_json::Value;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_answers_ok() {
    let app = TestApp::start("").await;
    let response = app.client.get(app.url("/healthz")).send().await.unwrap();
    let body = expect_json(response, StatusCode::OK).await;
    assert_eq!(body["status"], "ok");
}

on_both_stores! {
    async fn readyz_reports_the_store_and_the_queue_ok() {
        let app = TestApp::start("").await;
        let response = app.client.get(app.url("/readyz")).send().await.unwrap();
        let body = expect_json(response, StatusCode::OK).await;
        assert_eq!(body["status"], "ok");
        assert_eq!(body["checks"]["store"], "ok", "{body}");
        assert_eq!(body["checks"]["queue"], "ok", "{body}");
        assert!(body["checks"].get("limits").is_none(), "no Redis, no limits check: {body}");
    }
}

on_both_stores! {
    async fn every_metric_carries_the_instance_label() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        expect_json(app.send(&key, &sms()).await, StatusCode::ACCEPTED).await;
        let text = app.metrics_text().await;
        let samples: Vec<&str> = text
            .lines()
            .filter(|line| line.starts_with("fairlane_"))
            .collect();
        assert!(!samples.is_empty(), "no samples in {text}");
        for sample in samples {
            assert!(sample.contains("instance=\""), "{sample} has no instance label");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_describes_the_send_endpoint() {
    let app = TestApp::start("").await;
    let response = app
        .client
        .get(app.url("/openapi.json"))
        .send()
        .await
        .unwrap();
    let doc = expect_json(response, StatusCode::OK).await;
    let paths = doc["paths"].as_object().expect("paths object");
    for path in [
        "/v1/messages",
        "/v1/messages/{id}",
        "/v1/admin/tenants",
        "/healthz",
    ] {
        assert!(
            paths.contains_key(path),
            "{path} missing from {:?}",
            paths.keys()
        );
    }
    assert!(doc["paths"]["/v1/messages"]["post"].is_object());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_docs_page_is_served_as_html() {
    let app = TestApp::start("").await;
    let response = app.client.get(app.url("/docs/")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let content_type = header(response.headers(), "content-type")
        .unwrap_or_default()
        .to_owned();
    assert!(content_type.starts_with("text/html"), "{content_type}");
    let page = response.text().await.unwrap();
    assert!(page.to_ascii_lowercase().contains("<html"), "{page}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_route_is_a_404_problem() {
    let app = TestApp::start("").await;
    for path in ["/nope", "/v1/message", "/v1/admin/nothing"] {
        let response = app.client.get(app.url(path)).send().await.unwrap();
        let (_, body) = expect_problem_kind(response, StatusCode::NOT_FOUND, "not-found").await;
        assert!(body.get("errors").is_none_or(Value::is_null), "{body}");
    }
}

/// DESIGN.md: errors are application/problem+json.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_method_on_a_known_route_is_a_405_problem() {
    let app = TestApp::start("").await;
    let response = app
        .client
        .put(app.url("/v1/messages"))
        .send()
        .await
        .unwrap();
    expect_problem(response, StatusCode::METHOD_NOT_ALLOWED).await;
}

/// Every metric name in the book's "Metrics" table
/// (docs/src/operations/metrics.md), read from the table.
fn documented_metrics() -> Vec<String> {
    let table = include_str!("../../docs/src/operations/metrics.md");
    table
        .lines()
        .filter_map(|line| line.strip_prefix("| `fairlane_"))
        .filter_map(|rest| rest.split('`').next())
        .map(|name| format!("fairlane_{name}"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_metric_is_in_the_first_scrape_with_its_help() {
    // Consumers on: the providers' series (pauses, breaker, receipts) are
    // registered with the providers, which an app without consumers has
    // none of; without them this test passed only after another test of
    // the process had set a provider up.
    let app = TestApp::start("[consumers]\nenabled = true\n").await;
    let text = app.metrics_text().await;
    let documented = documented_metrics();
    assert!(
        documented.len() >= 15,
        "read {documented:?} from docs/src/operations/metrics.md"
    );
    for name in &documented {
        assert!(
            text.lines()
                .any(|line| line.starts_with(&format!("{name}{{"))
                    || line.starts_with(&format!("{name}_bucket{{"))
                    || line.starts_with(&format!("{name} "))),
            "{name} is documented but not in the first scrape"
        );
        assert!(
            text.contains(&format!("# HELP {name} ")),
            "{name} has no HELP line"
        );
    }
}
