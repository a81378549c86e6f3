//! `POST /v1/messages` and `GET /v1/messages/{id}`: validation, the shape of
//! accepted sends and status reads, and tenant isolation.

use reqwest::header::{CONTENT_TYPE, LOCATION};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::support::*;

/// Every field-level mistake a caller can make, with the field the answer
/// must name.
fn invalid_requests() -> Vec<(&'static str, Value, &'static str)> {
    vec![
        (
            "bad email address",
            with(email(), "to", json!("not-an-address")),
            "to",
        ),
        (
            "email address with display name",
            with(email(), "to", json!("A <a@example.com>")),
            "to",
        ),
        ("recipient missing", with(email(), "to", Value::Null), "to"),
        (
            "recipient not a string",
            with(email(), "to", json!(42)),
            "to",
        ),
        (
            "sms number without plus",
            with(sms(), "to", json!("15551234567")),
            "to",
        ),
        (
            "sms number with dashes",
            with(sms(), "to", json!("+1555-123-4567")),
            "to",
        ),
        (
            "email without subject",
            with(email(), "subject", Value::Null),
            "subject",
        ),
        (
            "email with blank subject",
            with(email(), "subject", json!("   ")),
            "subject",
        ),
        (
            "subject with a line break",
            with(email(), "subject", json!("Hi\r\nBcc: x@example.com")),
            "subject",
        ),
        (
            "subject with a bare newline",
            with(email(), "subject", json!("Hi\nthere")),
            "subject",
        ),
        (
            "email without text",
            with(email(), "text", Value::Null),
            "text",
        ),
        ("sms without text", with(sms(), "text", Value::Null), "text"),
        ("empty email text", with(email(), "text", json!("")), "text"),
        ("blank sms text", with(sms(), "text", json!("  ")), "text"),
        (
            "misspelt field",
            with(email(), "subjet", json!("Hi")),
            "subjet",
        ),
        (
            "email-only subject on an sms",
            with(sms(), "subject", json!("Hi")),
            "subject",
        ),
        (
            "email-only html on an sms",
            with(sms(), "html", json!("<p>Hi</p>")),
            "html",
        ),
        (
            "unknown priority",
            with(email(), "priority", json!("urgent")),
            "priority",
        ),
        (
            "priority not a string",
            with(email(), "priority", json!(1)),
            "priority",
        ),
        (
            "reference over 255 characters",
            with(email(), "reference", json!("r".repeat(256))),
            "reference",
        ),
        (
            "subject over 998 characters",
            with(email(), "subject", json!("s".repeat(999))),
            "subject",
        ),
        (
            "metadata with over 50 keys",
            with(
                email(),
                "metadata",
                Value::Object((0..51).map(|i| (format!("k{i}"), json!(i))).collect()),
            ),
            "metadata",
        ),
        (
            "metadata a string",
            with(email(), "metadata", json!("x")),
            "metadata",
        ),
        (
            "metadata an array",
            with(email(), "metadata", json!([1, 2])),
            "metadata",
        ),
        (
            "metadata over 4096 bytes",
            with(email(), "metadata", json!({"k": "x".repeat(4100)})),
            "metadata",
        ),
        (
            "email text over 100 KiB",
            with(email(), "text", json!("x".repeat(100 * 1024 + 1))),
            "text",
        ),
        (
            "email html over 100 KiB",
            with(email(), "html", json!("x".repeat(100 * 1024 + 1))),
            "html",
        ),
        (
            "sms text over 1600 characters",
            with(sms(), "text", json!("x".repeat(1601))),
            "text",
        ),
        (
            "channel missing",
            with(email(), "channel", Value::Null),
            "channel",
        ),
        (
            "unknown channel",
            with(email(), "channel", json!("fax")),
            "channel",
        ),
        (
            "channel not a string",
            with(email(), "channel", json!(true)),
            "channel",
        ),
    ]
}

on_both_stores! {
    async fn every_invalid_field_is_refused_with_a_422_problem_naming_it() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let mut failures = Vec::new();
        for (case, body, field) in invalid_requests() {
            let response = app.send(&key, &body).await;
            let status = response.status();
            let content_type = header(response.headers(), CONTENT_TYPE.as_str()).map(str::to_owned);
            let problem: Value = response.json().await.unwrap_or(Value::Null);
            let named = problem["errors"]
                .get(field)
                .and_then(Value::as_str)
                .is_some();
            let complete = ["type", "title", "detail"]
                .iter()
                .all(|k| problem[*k].as_str().is_some_and(|v| !v.is_empty()))
                && problem["status"] == json!(422);
            if status != StatusCode::UNPROCESSABLE_ENTITY
                || content_type.as_deref() != Some("application/problem+json")
                || !named
                || !complete
            {
                failures.push(format!(
                    "{case}: {status}, content type {content_type:?}, body {problem}"
                ));
            }
        }
        assert!(
            failures.is_empty(),
            "cases answered wrongly:\n{}",
            failures.join("\n")
        );
        assert_eq!(
            app.state
                .queue
                .stats(fairlane::model::Lane::Fast)
                .await
                .unwrap()
                .depth,
            0,
            "no refused request may be queued"
        );
    }
}

on_both_stores! {
    async fn a_misspelt_field_is_named_and_not_silently_dropped() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let body = json!({"channel": "email", "to": "a@example.com", "subjet": "Hi", "text": "Hello"});
        let problem = expect_field_error(app.send(&key, &body).await, "subjet").await;
        assert!(
            problem["type"].as_str().unwrap().contains("validation"),
            "{problem}"
        );
        // The intended field is still missing, and that is said too.
        assert!(problem["errors"].get("subject").is_some(), "{problem}");
    }
}

on_both_stores! {
    async fn every_bad_field_of_one_request_is_named_at_once() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let body = json!({"channel": "sms", "to": "5551234", "text": "", "priority": "urgent", "subject": "x"});
        let problem = expect_field_error(app.send(&key, &body).await, "to").await;
        for field in ["text", "priority", "subject"] {
            assert!(
                problem["errors"].get(field).is_some(),
                "{field} not named: {problem}"
            );
        }
    }
}

on_both_stores! {
    async fn values_exactly_at_each_limit_are_accepted() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        // {"k":"…"} is 8 bytes of JSON around the value.
        let metadata = json!({"k": "x".repeat(4096 - 8)});
        assert_eq!(serde_json::to_string(&metadata).unwrap().len(), 4096);
        let cases = [
            (
                "reference of 255 characters",
                with(email(), "reference", json!("r".repeat(255))),
            ),
            (
                "metadata of 4096 bytes",
                with(email(), "metadata", metadata),
            ),
            (
                "email text of 100 KiB",
                with(email(), "text", json!("x".repeat(100 * 1024))),
            ),
            (
                "sms text of 1600 characters",
                with(sms(), "text", json!("x".repeat(1600))),
            ),
            (
                "reference of 255 two-byte characters",
                with(email(), "reference", json!("é".repeat(255))),
            ),
            (
                "metadata with 50 keys",
                with(
                    email(),
                    "metadata",
                    Value::Object((0..50).map(|i| (format!("k{i}"), json!(i))).collect()),
                ),
            ),
            (
                "subject of 998 characters",
                with(email(), "subject", json!("s".repeat(998))),
            ),
            (
                "explicit null optional fields",
                with(with(email(), "reference", json!(null)), "html", json!(null)),
            ),
        ];
        for (case, body) in cases {
            let response = app.send(&key, &body).await;
            let status = response.status();
            let text = response.text().await.unwrap();
            assert_eq!(status, StatusCode::ACCEPTED, "{case}: {text}");
        }
    }
}

on_both_stores! {
    async fn malformed_json_is_a_400_problem() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        for body in ["{\"channel\": \"email\",", "not json", ""] {
            let response = app
                .tenant(&key, Method::POST, "/v1/messages")
                .header(CONTENT_TYPE, "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            expect_problem(response, StatusCode::BAD_REQUEST).await;
        }
    }
}

on_both_stores! {
    async fn a_json_array_body_is_a_422_problem() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let response = app.send(&key, &json!([email()])).await;
        let (_, problem) = expect_problem(response, StatusCode::UNPROCESSABLE_ENTITY).await;
        assert!(problem["errors"].is_object(), "{problem}");
    }
}

on_both_stores! {
    async fn a_body_that_is_not_declared_json_is_a_415_problem() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let body = email().to_string();

        let plain = app
            .tenant(&key, Method::POST, "/v1/messages")
            .header(CONTENT_TYPE, "text/plain")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        expect_problem(plain, StatusCode::UNSUPPORTED_MEDIA_TYPE).await;

        let undeclared = app
            .tenant(&key, Method::POST, "/v1/messages")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        expect_problem(undeclared, StatusCode::UNSUPPORTED_MEDIA_TYPE).await;

        // A charset parameter is still JSON.
        let with_charset = app
            .tenant(&key, Method::POST, "/v1/messages")
            .header(CONTENT_TYPE, "application/json; charset=utf-8")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(with_charset.status(), StatusCode::ACCEPTED);
    }
}

on_both_stores! {
    async fn a_body_over_max_body_bytes_is_a_413_problem() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let max = app.state.settings.server.max_body_bytes;
        assert_eq!(max, 196_608, "default server.max_body_bytes");
        let body = with(email(), "text", json!("x".repeat(max)));
        let response = app.send(&key, &body).await;
        expect_problem(response, StatusCode::PAYLOAD_TOO_LARGE).await;
    }
}

on_both_stores! {
    async fn an_accepted_email_answers_202_with_its_location_and_lane() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let response = app.send(&key, &email()).await;
        let headers = response.headers().clone();
        let body = expect_json(response, StatusCode::ACCEPTED).await;
        let id = body["id"].as_str().expect("id").to_owned();
        assert!(!id.is_empty());
        assert_eq!(
            body,
            json!({"id": id, "status": "queued", "channel": "email", "lane": "fast", "priority": "normal"})
        );
        assert_eq!(
            header(&headers, LOCATION.as_str()),
            Some(format!("/v1/messages/{id}").as_str())
        );
        assert_eq!(
            header(&headers, CONTENT_TYPE.as_str()),
            Some("application/json")
        );
        // Plan pro: bursts of 100; this was the first send.
        assert_eq!(header_u64(&headers, "ratelimit-limit"), 100);
        assert_eq!(header_u64(&headers, "ratelimit-remaining"), 99);
        header_u64(&headers, "ratelimit-reset");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_basic_plan_sends_on_the_slow_lane() {
    let app = TestApp::start("").await;
    let key = app.tenant_with_key("small", "basic").await;
    let body = expect_json(app.send(&key, &sms()).await, StatusCode::ACCEPTED).await;
    assert_eq!(body["lane"], "slow");
    assert_eq!(body["channel"], "sms");
    let stats = app
        .state
        .queue
        .stats(fairlane::model::Lane::Slow)
        .await
        .unwrap();
    assert_eq!(stats.depth, 1);
}

on_both_stores! {
    async fn a_queued_message_can_be_read_back_at_its_location() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let body = with(
            with(email(), "reference", json!("order-17")),
            "metadata",
            json!({"order": 17, "tags": ["a"]}),
        );
        let response = app.send(&key, &body).await;
        let location = header(response.headers(), LOCATION.as_str())
            .unwrap()
            .to_owned();
        let accepted = expect_json(response, StatusCode::ACCEPTED).await;

        let response = app
            .tenant(&key, Method::GET, &location)
            .send()
            .await
            .unwrap();
        let view = expect_json(response, StatusCode::OK).await;
        assert_eq!(view["id"], accepted["id"]);
        assert_eq!(view["channel"], "email");
        assert_eq!(view["status"], "queued");
        assert_eq!(view["priority"], "normal");
        assert_eq!(view["lane"], "fast");
        assert_eq!(view["attempts"], 0);
        assert_eq!(view["reference"], "order-17");
        assert_eq!(view["metadata"], json!({"order": 17, "tags": ["a"]}));
        for field in ["created_at", "updated_at"] {
            let time = view[field]
                .as_str()
                .unwrap_or_else(|| panic!("{field}: {view}"));
            assert!(
                time.ends_with('Z') && time.contains('T'),
                "{field} is RFC 3339 UTC: {time}"
            );
        }
        for field in ["sent_at", "last_error", "provider_message_id"] {
            assert!(
                view.get(field).is_some_and(Value::is_null),
                "{field} present and null: {view}"
            );
        }
    }
}

on_both_stores! {
    async fn a_requested_priority_is_echoed_and_stored() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        for priority in ["high", "low"] {
            let body = with(sms(), "priority", json!(priority));
            let accepted = expect_json(app.send(&key, &body).await, StatusCode::ACCEPTED).await;
            assert_eq!(accepted["priority"], priority);
            let id = accepted["id"].as_str().unwrap();
            let view = expect_json(app.get_message(&key, id).await, StatusCode::OK).await;
            assert_eq!(view["priority"], priority);
            assert!(view["reference"].is_null(), "{view}");
        }
    }
}

on_both_stores! {
    async fn another_tenants_message_is_not_found() {
        let app = TestApp::start("").await;
        let key_a = app.tenant_with_key("tenant-a", "pro").await;
        let key_b = app.tenant_with_key("tenant-b", "pro").await;
        let id = app.send_accepted(&key_a, &email()).await;

        let (_, problem) =
            expect_problem(app.get_message(&key_b, &id).await, StatusCode::NOT_FOUND).await;
        assert!(
            !problem.to_string().contains("tenant-a"),
            "leaks the owner: {problem}"
        );
        // The owner still sees it, so the 404 is about ownership.
        expect_json(app.get_message(&key_a, &id).await, StatusCode::OK).await;
    }
}

on_both_stores! {
    async fn an_unknown_message_id_is_not_found() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        for id in ["0190f0e0-0000-7000-8000-000000000000", "nope"] {
            expect_problem(app.get_message(&key, id).await, StatusCode::NOT_FOUND).await;
        }
    }
}
