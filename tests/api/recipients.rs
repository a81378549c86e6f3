//! An email's HTML, its text alternative and its several recipients, as
//! SES receives them: one raw MIME message, parsed back here with a MIME
//! parser.

use reqwest::{Method, StatusCode};
use serde_json::json;

use crate::delivery::{delivery_settings, status_is, wait_for};
use crate::senders::{mail_of, ses_calls, ses_ok};
use crate::support::{
    TestApp, email, expect_field_error, expect_json, expect_problem_kind, header_u64,
    on_both_stores, sms, with,
};

on_both_stores! {
    /// An email with HTML only goes out as `multipart/alternative` with a
    /// text part derived from the HTML; its `cc` are in the message, its
    /// `bcc` only in the call's destination, and a suppressed copy is left
    /// out and named in the answer.
    async fn an_html_email_with_copies_goes_out_as_one_multipart_message() {
        let ses = ses_ok().await;
        let app = TestApp::start(&delivery_settings("http://127.0.0.1:9", &ses.uri(), "")).await;
        let acme = app.tenant_with_key("acme", "pro").await;
        let added = app
            .tenant(&acme, Method::POST, "/v1/suppressions")
            .json(&json!({"address": "Gone@Example.com"}))
            .send()
            .await
            .unwrap();
        expect_json(added, StatusCode::CREATED).await;

        let send = json!({
            "channel": "email", "to": "a@example.com", "subject": "Invoice 17",
            "cc": ["c@example.com", "gone@example.com"], "bcc": ["blind.copy@example.com"],
            "html": "<h1>Invoice 17</h1><p>Total: 10 EUR. <a href=\"https://example.com/i/17\">View it</a></p>"
        });
        let answer = expect_json(app.send(&acme, &send).await, StatusCode::ACCEPTED).await;
        assert_eq!(answer["suppressed"], json!(["gone@example.com"]), "{answer}");
        let id = answer["id"].as_str().unwrap().to_owned();
        wait_for(&app, &acme, &id, status_is("sent")).await;

        let calls = ses_calls(&ses).await;
        assert_eq!(calls.len(), 1, "{calls:?}");
        let call = &calls[0];
        assert_eq!(call["Destination"]["ToAddresses"], json!(["a@example.com"]));
        assert_eq!(call["Destination"]["CcAddresses"], json!(["c@example.com"]));
        assert_eq!(call["Destination"]["BccAddresses"], json!(["blind.copy@example.com"]));
        let mail = mail_of(call);
        assert_eq!(mail.content_type, "multipart/alternative");
        assert_eq!(mail.to, ["a@example.com"]);
        assert_eq!(mail.cc, ["c@example.com"]);
        let raw = String::from_utf8_lossy(&mail.raw);
        // An address no message id can spell: the `Message-ID` is the
        // message's id (hex) at the sender's domain, so `b@example.com`
        // stood in it whenever the id ended in `b`.
        assert!(!raw.contains("blind.copy@example.com"), "no Bcc in the message");
        assert!(!raw.contains("gone@example.com"), "the suppressed copy is left out");
        let text = mail.text.expect("a text part");
        for words in ["Invoice 17", "Total: 10 EUR.", "https://example.com/i/17"] {
            assert!(text.contains(words), "{words:?} in the derived text: {text}");
        }
        assert!(!text.contains('<'), "no markup in the text: {text}");
        assert!(mail.html.unwrap().contains("<h1>Invoice 17</h1>"));
    }
}

/// Copies are checked address by address, named by their place; SMS take
/// none; an email needs a text or an HTML part.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_and_parts_are_checked_naming_the_field() {
    let app = TestApp::start("").await;
    let acme = app.tenant_with_key("acme", "pro").await;
    let cases = [
        (with(email(), "cc", json!(["not an address"])), "cc[0]"),
        (
            with(email(), "cc", json!(["x@example.com", "A@example.com"])),
            "cc[1]",
        ),
        (with(email(), "bcc", json!("b@example.com")), "bcc"),
        (
            with(
                email(),
                "bcc",
                json!(
                    (0..50)
                        .map(|i| format!("r{i}@example.com"))
                        .collect::<Vec<_>>()
                ),
            ),
            "bcc",
        ),
        (with(sms(), "cc", json!(["c@example.com"])), "cc"),
        (with(email(), "text", json!(null)), "text"),
        (
            with(with(email(), "text", json!(null)), "html", json!("  ")),
            "text",
        ),
    ];
    for (body, field) in cases {
        expect_field_error(app.send(&acme, &body).await, field).await;
    }
    let most = with(
        email(),
        "bcc",
        json!(
            (0..49)
                .map(|i| format!("r{i}@example.com"))
                .collect::<Vec<_>>()
        ),
    );
    expect_json(app.send(&acme, &most).await, StatusCode::ACCEPTED).await;
}

on_both_stores! {
    /// Each address of an email is charged to the daily quota: a send
    /// whose copies do not fit is refused whole and charges nothing.
    async fn every_recipient_counts_against_the_daily_quota() {
        let app = TestApp::start("").await;
        let key = tenant_on_plan(&app, "four", 1000.0, 1000, 4).await;
        let three = with(email(), "bcc", json!(["b1@example.com", "b2@example.com"]));
        expect_json(app.send(&key, &three).await, StatusCode::ACCEPTED).await;
        let refused = app.send(&key, &three).await;
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS, "3 more do not fit in 1");
        expect_json(app.send(&key, &email()).await, StatusCode::ACCEPTED).await;
        let over = app.send(&key, &email()).await;
        assert_eq!(over.status(), StatusCode::TOO_MANY_REQUESTS, "the quota is used up");
    }
}

/// Tenant `acme`'s key, on plan `name` of the given rate, burst and
/// daily quota (made here).
async fn tenant_on_plan(app: &TestApp, name: &str, rate: f64, burst: u32, quota: u64) -> String {
    let plan = app
        .admin(Method::PUT, &format!("/v1/admin/plans/{name}"))
        .json(
            &json!({"lane": "fast", "rate_per_second": rate, "burst": burst,
                      "daily_quota": quota, "max_in_flight": 10}),
        )
        .send()
        .await
        .unwrap();
    assert!(plan.status().is_success(), "{}", plan.status());
    app.tenant_with_key("acme", name).await
}

/// An email to `n` addresses (`to` and `n - 1` copies).
fn email_to(n: usize) -> serde_json::Value {
    let copies: Vec<String> = (1..n).map(|i| format!("c{i}@example.com")).collect();
    with(email(), "cc", json!(copies))
}

/// With a plan of burst 3 refilling once in 100 s: an email wider than the
/// burst is 422 naming `to`, an email refused by the rate takes no token,
/// and neither refusal keeps the next single send from going.
pub(crate) async fn rate_refusals_charge_nothing(app: &TestApp) {
    let key = tenant_on_plan(app, "three", 0.01, 3, 1000).await;

    let wide = app.send(&key, &email_to(4)).await;
    let problem = expect_field_error(wide, "to").await;
    let why = problem["errors"]["to"].as_str().unwrap_or_default();
    assert!(
        why.contains("4 recipients") && why.contains("burst"),
        "{problem}"
    );

    let two = app.send(&key, &email_to(2)).await;
    assert_eq!(header_u64(two.headers(), "ratelimit-remaining"), 1);
    expect_json(two, StatusCode::ACCEPTED).await;
    for _ in 0..3 {
        let refused = app.send(&key, &email_to(3)).await;
        expect_problem_kind(refused, StatusCode::TOO_MANY_REQUESTS, "rate").await;
    }
    let one = app.send(&key, &email()).await;
    assert_eq!(
        one.status(),
        StatusCode::ACCEPTED,
        "the refused emails took nothing: {}",
        one.text().await.unwrap()
    );
    let spent = app.send(&key, &email()).await;
    expect_problem_kind(spent, StatusCode::TOO_MANY_REQUESTS, "rate").await;
}

on_both_stores! {
    /// Every recipient counts against the rate, and a refusal charges
    /// nothing (issue 68.2).
    async fn an_email_refused_by_the_rate_gives_back_what_it_took() {
        let app = TestApp::start("").await;
        rate_refusals_charge_nothing(&app).await;
    }
}
