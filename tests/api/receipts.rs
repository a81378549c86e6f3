//! Receipts end to end: a Twilio-compatible SMS API's signed status
//! callbacks, SES events read from an SQS queue on moto, the status history
//! they leave, and the suppression lists they fill.

use base64::Engine;
use hmac::{Hmac, Mac};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use wiremock::MockServer;

use crate::backends::{moto_url, ses_identity};
use std::time::Duration;

use crate::delivery::{
    delivery_settings, mock_sms_after, mock_sms_ok, sms_requests, status_is, wait_for,
};
use crate::support::{TestApp, expect_json, expect_problem, on_both_stores, sms, with};

/// What `server.public_url` is in these tests: the URL Twilio would call.
pub(crate) const PUBLIC_URL: &str = "https://notify.example.com";
/// The SMS provider's auth token in [`delivery_settings`].
const AUTH_TOKEN: &str = "secret-token";

/// Twilio's signature of a callback, written here from Twilio's
/// documentation rather than with fairlane's code: Base64 HMAC-SHA1 of the
/// URL followed by each parameter's name and value, sorted by name.
pub(crate) fn twilio_signature(token: &str, url: &str, form: &[(&str, &str)]) -> String {
    let mut sorted = form.to_vec();
    sorted.sort();
    let mut text = url.to_owned();
    for (name, value) in sorted {
        text.push_str(name);
        text.push_str(value);
    }
    let mut mac = Hmac::<sha1::Sha1>::new_from_slice(token.as_bytes()).unwrap();
    mac.update(text.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
}

/// Posts a status callback on message `id` to the URL fairlane gave the
/// provider for it, signed with `token`.
pub(crate) async fn callback(
    app: &TestApp,
    token: &str,
    id: &str,
    form: &[(&str, &str)],
) -> reqwest::Response {
    callback_at(
        app,
        token,
        &format!("/v1/callbacks/sms?message_id={id}"),
        form,
    )
    .await
}

/// Posts a status callback to `path` (with its query), signed with `token`
/// over the public URL as Twilio signs it.
async fn callback_at(
    app: &TestApp,
    token: &str,
    path: &str,
    form: &[(&str, &str)],
) -> reqwest::Response {
    let url = format!("{PUBLIC_URL}{path}");
    let signature = twilio_signature(token, &url, form);
    app.client
        .post(app.url(path))
        .header("X-Twilio-Signature", signature)
        .form(form)
        .send()
        .await
        .unwrap()
}

/// An app that delivers SMS through `sms_api` and asks for callbacks.
pub(crate) async fn app_with_callbacks(sms_api: &MockServer, extra: &str) -> TestApp {
    let settings = delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", extra);
    TestApp::start_custom(&settings, |settings| {
        settings.server.public_url = Some(PUBLIC_URL.into());
    })
    .await
}

async fn events(app: &TestApp, key: &str, id: &str) -> Vec<Value> {
    let listed = expect_json(
        app.tenant(key, Method::GET, &format!("/v1/messages/{id}/events"))
            .send()
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await;
    listed["events"].as_array().unwrap().clone()
}

fn names(events: &[Value]) -> Vec<&str> {
    events
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect()
}

on_both_stores! {
    /// On either store: the migrations' triggers record the same events.
    async fn a_signed_sms_callback_makes_the_message_delivered_and_a_bad_signature_changes_nothing() {
    let sms_api = MockServer::start().await;
    mock_sms_ok(&sms_api, "SM-RCPT-1").await;
    let app = app_with_callbacks(&sms_api, "").await;
    let key = app.tenant_with_key("acme", "pro").await;
    let id = app.send_accepted(&key, &sms()).await;
    wait_for(&app, &key, &id, status_is("sent")).await;

    // Every SMS request asked for status callbacks at the public URL,
    // naming the message by fairlane's id.
    let requests = sms_api.received_requests().await.unwrap();
    let form: Vec<(String, String)> = form_urlencoded::parse(&requests[0].body)
        .into_owned()
        .collect();
    assert!(
        form.contains(&(
            "StatusCallback".into(),
            format!("{PUBLIC_URL}/v1/callbacks/sms?message_id={id}")
        )),
        "{form:?}"
    );

    let delivered = [
        ("MessageSid", "SM-RCPT-1"),
        ("MessageStatus", "delivered"),
        ("To", "+15551234567"),
    ];
    // Signed with another token: refused, nothing recorded.
    let forged = callback(&app, "not-the-token", &id, &delivered).await;
    expect_problem(forged, StatusCode::FORBIDDEN).await;
    let unsigned = app
        .client
        .post(app.url("/v1/callbacks/sms"))
        .form(&delivered)
        .send()
        .await
        .unwrap();
    expect_problem(unsigned, StatusCode::FORBIDDEN).await;
    let view = expect_json(app.get_message(&key, &id).await, StatusCode::OK).await;
    assert_eq!(view["status"], "sent", "{view}");
    assert_eq!(names(&events(&app, &key, &id).await), ["queued", "sent"]);

    // An intermediate status is an event only; `delivered` ends it.
    let sent = [("MessageSid", "SM-RCPT-1"), ("MessageStatus", "sent")];
    assert_eq!(
        callback(&app, AUTH_TOKEN, &id, &sent).await.status(),
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        callback(&app, AUTH_TOKEN, &id, &delivered).await.status(),
        StatusCode::NO_CONTENT
    );
    let view = expect_json(app.get_message(&key, &id).await, StatusCode::OK).await;
    assert_eq!(view["status"], "delivered", "{view}");
    let history = events(&app, &key, &id).await;
    assert_eq!(names(&history), ["queued", "sent", "sms_sent", "delivered"]);
    assert_eq!(history[3]["status"], "delivered");
    assert_eq!(history[3]["provider_message_id"], "SM-RCPT-1");

    // The same report again changes nothing; nor does a replayed
    // intermediate status (no second event, so no second webhook call).
    for replayed in [&delivered[..], &sent[..], &sent[..]] {
        assert_eq!(
            callback(&app, AUTH_TOKEN, &id, replayed).await.status(),
            StatusCode::NO_CONTENT
        );
    }
    assert_eq!(events(&app, &key, &id).await.len(), 4);

    // A body larger than any provider's form is refused before its
    // signature is computed.
    let padding = "x".repeat(20 * 1024);
    let padded = [("MessageSid", "SM-RCPT-1"), ("MessageStatus", "sent"), ("Pad", padding.as_str())];
    expect_problem(
        callback(&app, AUTH_TOKEN, &id, &padded).await,
        StatusCode::PAYLOAD_TOO_LARGE,
    )
    .await;

    // A signed form without the fields it needs names them.
    let (_, problem) = expect_problem(
        callback(&app, AUTH_TOKEN, &id, &[("MessageSid", "SM-RCPT-1")]).await,
        StatusCode::UNPROCESSABLE_ENTITY,
    )
    .await;
    assert!(problem["errors"]["MessageStatus"].is_string(), "{problem}");

    // Another tenant cannot read the history.
    let other = app.tenant_with_key("globex", "pro").await;
    let response = app
        .tenant(&other, Method::GET, &format!("/v1/messages/{id}/events"))
        .send()
        .await
        .unwrap();
    expect_problem(response, StatusCode::NOT_FOUND).await;
    let metrics = app.metrics_text().await;
    assert!(
        metrics
            .lines()
            .any(|line| line.starts_with("fairlane_receipts_total{")
                && line.contains("provider=\"sms\"")
                && line.contains("outcome=\"delivered\"")
                // One recorder per process: other tests count too.
                && !line.ends_with(" 0")),
        "{metrics}"
    );
    }
}

on_both_stores! {
    async fn an_undelivered_sms_fails_with_its_error_code_and_a_stop_suppresses_the_number() {
        let sms_api = MockServer::start().await;
        mock_sms_ok(&sms_api, "SM-RCPT-2").await;
        let app = app_with_callbacks(&sms_api, "").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let id = app.send_accepted(&key, &sms()).await;
        wait_for(&app, &key, &id, status_is("sent")).await;
        let failed = [
            ("MessageSid", "SM-RCPT-2"),
            ("MessageStatus", "undelivered"),
            ("ErrorCode", "21610"),
            ("To", "+15551234567"),
        ];
        assert_eq!(
            callback(&app, AUTH_TOKEN, &id, &failed).await.status(),
            StatusCode::NO_CONTENT
        );
        let view = expect_json(app.get_message(&key, &id).await, StatusCode::OK).await;
        assert_eq!(view["status"], "failed", "{view}");
        assert!(
            view["last_error"].as_str().unwrap().contains("21610"),
            "{view}"
        );

        // The number replied STOP: the tenant's next text to it is not sent.
        let listed = expect_json(
            app.tenant(&key, Method::GET, "/v1/suppressions/+15551234567")
                .send()
                .await
                .unwrap(),
            StatusCode::OK,
        )
        .await;
        assert_eq!(listed["reason"], "complaint", "{listed}");
        let calls = sms_requests(&sms_api).await;
        let next = app.send_accepted(&key, &sms()).await;
        let view = wait_for(&app, &key, &next, status_is("suppressed")).await;
        assert_eq!(view["status"], "suppressed", "{view}");
        assert_eq!(sms_requests(&sms_api).await, calls, "no provider call");
    }
}

on_both_stores! {
    async fn a_receipt_that_beats_the_sent_record_is_kept_and_matched_later() {
        let sms_api = MockServer::start().await;
        // The provider takes 3 s to answer, and reports meanwhile:
        // before fairlane has recorded the sid.
        mock_sms_after(&sms_api, "SM-EARLY", Duration::from_secs(3)).await;
        let app = app_with_callbacks(&sms_api, "").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let id = app.send_accepted(&key, &sms()).await;
        wait_for(&app, &key, &id, status_is("sending")).await;
        let delivered = [("MessageSid", "SM-EARLY"), ("MessageStatus", "delivered")];
        assert_eq!(
            callback(&app, AUTH_TOKEN, &id, &delivered).await.status(),
            StatusCode::NO_CONTENT
        );
        let view = expect_json(app.get_message(&key, &id).await, StatusCode::OK).await;
        assert_eq!(view["status"], "sending", "the sid is not recorded yet: {view}");
        let view = wait_for(&app, &key, &id, status_is("delivered")).await;
        assert_eq!(view["status"], "delivered", "{view}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sms_callbacks_are_not_found_without_a_public_url() {
    let sms_api = MockServer::start().await;
    let settings = delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", "");
    let app = TestApp::start(&settings).await;
    let response = callback_at(
        &app,
        AUTH_TOKEN,
        "/v1/callbacks/sms",
        &[("MessageSid", "SM1"), ("MessageStatus", "delivered")],
    )
    .await;
    expect_problem(response, StatusCode::NOT_FOUND).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suppressed_address_ends_suppressed_without_a_provider_call_for_that_tenant_only() {
    let sms_api = MockServer::start().await;
    mock_sms_ok(&sms_api, "SM-SUP").await;
    let app = app_with_callbacks(&sms_api, "").await;
    let acme = app.tenant_with_key("acme", "pro").await;
    let globex = app.tenant_with_key("globex", "pro").await;
    let added = app
        .tenant(&acme, Method::POST, "/v1/suppressions")
        .json(&json!({"address": "+15551234567", "detail": "asked us to stop"}))
        .send()
        .await
        .unwrap();
    let entry = expect_json(added, StatusCode::CREATED).await;
    assert_eq!(entry["reason"], "manual");
    let bad = app
        .tenant(&acme, Method::POST, "/v1/suppressions")
        .json(&json!({"address": "nobody"}))
        .send()
        .await
        .unwrap();
    crate::support::expect_field_error(bad, "address").await;

    let suppressed = app.send_accepted(&acme, &sms()).await;
    let view = wait_for(&app, &acme, &suppressed, status_is("suppressed")).await;
    assert_eq!(view["status"], "suppressed", "{view}");
    assert_eq!(sms_requests(&sms_api).await, 0);
    // Another tenant's list is its own: globex's text goes out.
    let sent = app.send_accepted(&globex, &sms()).await;
    wait_for(&app, &globex, &sent, status_is("sent")).await;
    assert_eq!(sms_requests(&sms_api).await, 1);
    let globex_view = expect_json(
        app.tenant(&globex, Method::GET, "/v1/suppressions/+15551234567")
            .send()
            .await
            .unwrap(),
        StatusCode::NOT_FOUND,
    )
    .await;
    assert_eq!(globex_view["status"], 404);

    // The admin sees acme's list; removing the entry lets texts out again.
    let listed = expect_json(
        app.admin(Method::GET, "/v1/admin/tenants/acme/suppressions")
            .send()
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await;
    assert_eq!(
        listed["suppressions"][0]["address"], "+15551234567",
        "{listed}"
    );
    let removed = app
        .admin(
            Method::DELETE,
            "/v1/admin/tenants/acme/suppressions/+15551234567",
        )
        .send()
        .await
        .unwrap();
    assert_eq!(removed.status(), StatusCode::NO_CONTENT);
    let again = app
        .send_accepted(&acme, &with(sms(), "text", json!("Again")))
        .await;
    wait_for(&app, &acme, &again, status_is("sent")).await;
    assert_eq!(sms_requests(&sms_api).await, 2);
}

/// An SQS client on moto for the SES events queue.
async fn events_queue(moto: &str) -> (aws_sdk_sqs::Client, String) {
    let client = crate::backends::sqs_client(moto);
    let name = crate::backends::unique_prefix("ses-events");
    let url = client
        .create_queue()
        .queue_name(name)
        .send()
        .await
        .expect("create the events queue on moto")
        .queue_url
        .unwrap();
    (client, url)
}

/// Publishes an SES event to the queue as SNS delivers it.
async fn publish(client: &aws_sdk_sqs::Client, queue: &str, event: Value) {
    let envelope = json!({
        "Type": "Notification",
        "MessageId": uuid::Uuid::new_v4().to_string(),
        "TopicArn": "arn:aws:sns:us-east-1:123456789012:ses-events",
        "Message": event.to_string(),
        "Timestamp": "2026-11-24T00:00:00.000Z",
    });
    client
        .send_message()
        .queue_url(queue)
        .message_body(envelope.to_string())
        .send()
        .await
        .expect("publish to the events queue");
}

/// Sends an email through SES on moto until `sent`; returns its id and
/// the SES message id.
async fn email_sent(app: &TestApp, key: &str, to: &str) -> (String, String) {
    let id = app
        .send_accepted(
            key,
            &json!({"channel": "email", "to": to, "subject": "Order", "text": "Thanks."}),
        )
        .await;
    let view = wait_for(app, key, &id, status_is("sent")).await;
    assert_eq!(view["status"], "sent", "{view}");
    (id, view["provider_message_id"].as_str().unwrap().to_owned())
}

/// How many emails moto's SES recorded to `to`.
async fn ses_sends_to(moto: &str, to: &str) -> usize {
    let data: Value = reqwest::get(format!("{moto}/moto-api/data.json"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    data["ses"]["RawMessage"].as_array().map_or(0, |sent| {
        sent.iter().filter(|m| m["destinations"][0] == to).count()
    })
}

async fn ses_receipt_suppresses(kind: &str) {
    let moto = moto_url();
    ses_identity(&moto).await;
    let (sqs, queue) = events_queue(&moto).await;
    let sms_api = MockServer::start().await;
    let extra = format!("events_queue_url = \"{queue}\"\n");
    // The events queue is read with the email provider's settings.
    let settings = delivery_settings(&sms_api.uri(), &moto, "").replace(
        "from = \"noreply@example.com\"\n",
        &format!("from = \"noreply@example.com\"\n{extra}"),
    );
    let app = TestApp::start(&settings).await;
    let key = app.tenant_with_key("acme", "pro").await;
    let to = format!(
        "{}-{}@example.com",
        kind.to_lowercase(),
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let (id, ses_id) = email_sent(&app, &key, &to).await;

    let event = match kind {
        "Bounce" => json!({
            "eventType": "Bounce",
            "mail": {"messageId": ses_id, "destination": [to], "tags": {"message_id": [id]}},
            "bounce": {"bounceType": "Permanent", "bounceSubType": "General",
                "bouncedRecipients": [{"emailAddress": to.to_uppercase(), "diagnosticCode": format!("smtp; 550 5.1.1 <{to}>: user unknown")}]}
        }),
        _ => json!({
            "eventType": "Complaint",
            "mail": {"messageId": ses_id, "destination": [to], "tags": {"message_id": [id]}},
            "complaint": {"complainedRecipients": [{"emailAddress": to}], "complaintFeedbackType": "abuse"}
        }),
    };
    publish(&sqs, &queue, event).await;
    let status = if kind == "Bounce" {
        "bounced"
    } else {
        "complained"
    };
    let view = wait_for(&app, &key, &id, status_is(status)).await;
    assert_eq!(view["status"], status, "{view}");
    if kind == "Bounce" {
        // logging.log_addresses is off: the diagnostic is kept without
        // the address it quotes.
        let error = view["last_error"].as_str().unwrap_or_default();
        assert!(
            error.contains("550 5.1.1 <[address]>") && !error.contains(&to),
            "{view}"
        );
    }
    let entry = expect_json(
        app.admin(
            Method::GET,
            &format!("/v1/admin/tenants/acme/suppressions/{to}"),
        )
        .send()
        .await
        .unwrap(),
        StatusCode::OK,
    )
    .await;
    assert_eq!(entry["message_id"], id.as_str(), "{entry}");

    // The next email to the address is not sent.
    let before = ses_sends_to(&moto, &to).await;
    assert_eq!(before, 1);
    let next = app
        .send_accepted(
            &key,
            &json!({"channel": "email", "to": to, "subject": "Again", "text": "Hello?"}),
        )
        .await;
    let view = wait_for(&app, &key, &next, status_is("suppressed")).await;
    assert_eq!(view["status"], "suppressed", "{view}");
    assert_eq!(ses_sends_to(&moto, &to).await, before, "no SES call");
    let history = events(&app, &key, &id).await;
    assert_eq!(names(&history), ["queued", "sent", status]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ses_permanent_bounce_bounces_the_email_and_suppresses_the_address() {
    ses_receipt_suppresses("Bounce").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ses_complaint_marks_the_email_complained_and_suppresses_the_address() {
    ses_receipt_suppresses("Complaint").await;
}

on_both_stores! {
    /// An email to three addresses (to, cc, bcc) through SES on moto: SES's
    /// events name each recipient, and the status shows each one's word. A
    /// delivery for two, a later delivery for the third (the message is
    /// delivered already; the news is the third's), then a permanent bounce
    /// for one: the message is `bounced`, its recipients each their own, the
    /// bounced address suppressed and its diagnostic without the address.
    async fn an_email_to_several_addresses_shows_each_recipients_status() {
        let moto = moto_url();
        ses_identity(&moto).await;
        let (sqs, queue) = events_queue(&moto).await;
        let sms_api = MockServer::start().await;
        let settings = delivery_settings(&sms_api.uri(), &moto, "").replace(
            "from = \"noreply@example.com\"\n",
            &format!("from = \"noreply@example.com\"\nevents_queue_url = \"{queue}\"\n"),
        );
        let app = TestApp::start(&settings).await;
        let key = app.tenant_with_key("acme", "pro").await;
        let tag = &uuid::Uuid::new_v4().simple().to_string()[..8];
        let [to, cc, bcc] = ["to", "cc", "bcc"].map(|role| format!("{role}-{tag}@example.com"));
        let id = app
            .send_accepted(
                &key,
                &json!({"channel": "email", "to": to, "cc": [cc], "bcc": [bcc],
                    "subject": "Team notice", "text": "Hello all."}),
            )
            .await;
        let view = wait_for(&app, &key, &id, status_is("sent")).await;
        assert!(view.get("recipients").is_none(), "no report yet: {view}");
        let ses_id = view["provider_message_id"].as_str().unwrap().to_owned();
        let mail = json!({"messageId": ses_id, "destination": [to, cc, bcc],
            "tags": {"message_id": [id]}});
        publish(&sqs, &queue, json!({"eventType": "Delivery", "mail": mail,
            "delivery": {"recipients": [to.to_uppercase(), cc], "smtpResponse": "250 2.0.0 OK"}}))
        .await;
        let recipients_are = |count: usize| {
            move |view: &Value| view["recipients"].as_array().is_some_and(|r| r.len() == count)
        };
        let view = wait_for(&app, &key, &id, recipients_are(2)).await;
        assert!(recipients_are(2)(&view), "{view}");
        assert_eq!(view["status"], "delivered", "{view}");
        publish(&sqs, &queue, json!({"eventType": "Delivery", "mail": mail,
            "delivery": {"recipients": [bcc], "smtpResponse": "250 2.0.0 OK"}}))
        .await;
        let view = wait_for(&app, &key, &id, recipients_are(3)).await;
        assert!(recipients_are(3)(&view), "{view}");
        publish(&sqs, &queue, json!({"eventType": "Bounce", "mail": mail,
            "bounce": {"bounceType": "Permanent", "bounceSubType": "General",
                "bouncedRecipients": [{"emailAddress": cc,
                    "diagnosticCode": format!("smtp; 550 5.1.1 <{cc}>: user unknown")}]}}))
        .await;
        let view = wait_for(&app, &key, &id, status_is("bounced")).await;
        assert_eq!(view["status"], "bounced", "{view}");
        let mut expected = vec![
            (bcc.clone(), "delivered", "250 2.0.0 OK"),
            (cc.clone(), "bounced", "smtp; 550 5.1.1 <[address]>: user unknown"),
            (to.clone(), "delivered", "250 2.0.0 OK"),
        ];
        expected.sort();
        let shown: Vec<(String, &str, &str)> = view["recipients"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                assert!(r["updated_at"].is_string(), "{r}");
                (
                    r["address"].as_str().unwrap().to_owned(),
                    r["status"].as_str().unwrap(),
                    r["detail"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(shown, expected, "{view}");
        // One event per report that moved the message; the third
        // recipient's delivery is in its row, not in the history.
        let history = events(&app, &key, &id).await;
        assert_eq!(names(&history), ["queued", "sent", "delivered", "bounced"]);
        let suppressed = app
            .admin(Method::GET, &format!("/v1/admin/tenants/acme/suppressions/{cc}"))
            .send()
            .await
            .unwrap();
        assert_eq!(suppressed.status(), StatusCode::OK);
        app.stop().await;
    }
}

on_both_stores! {
    /// A callback finds its message by the id in its URL: two messages the
    /// provider gave one SID are told apart, and a callback naming another
    /// message with this SID moves nothing. (One without the id, from a
    /// message sent before callbacks carried it, is matched by the SID:
    /// the test above.)
    async fn a_callback_finds_its_message_by_the_id_in_its_url() {
        let sms_api = MockServer::start().await;
        mock_sms_ok(&sms_api, "SM-SHARED").await;
        let app = app_with_callbacks(&sms_api, "").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let first = app.send_accepted(&key, &sms()).await;
        wait_for(&app, &key, &first, status_is("sent")).await;
        let second = app.send_accepted(&key, &sms()).await;
        wait_for(&app, &key, &second, status_is("sent")).await;
        let delivered = [("MessageSid", "SM-SHARED"), ("MessageStatus", "delivered")];

        let to_second = format!("/v1/callbacks/sms?message_id={second}");
        let answer = callback_at(&app, AUTH_TOKEN, &to_second, &delivered).await;
        assert_eq!(answer.status(), StatusCode::NO_CONTENT);
        let view = wait_for(&app, &key, &second, status_is("delivered")).await;
        assert_eq!(view["status"], "delivered", "{view}");
        let view = expect_json(app.get_message(&key, &first).await, StatusCode::OK).await;
        assert_eq!(view["status"], "sent", "the other message of the SID: {view}");

        // The id of a message the SID is not recorded for: nothing moves.
        let other = app.send_accepted(&key, &json!({"channel": "sms", "to": "+15557654321", "text": "Hi"})).await;
        let failed = [("MessageSid", "SM-OTHER"), ("MessageStatus", "failed")];
        let to_other = format!("/v1/callbacks/sms?message_id={other}");
        let answer = callback_at(&app, AUTH_TOKEN, &to_other, &failed).await;
        assert_eq!(answer.status(), StatusCode::NO_CONTENT);
        let view = wait_for(&app, &key, &other, status_is("sent")).await;
        assert_eq!(view["status"], "sent", "{view}");

        // The id is under the signature: the same form signed for the URL
        // without it is refused at the URL with it.
        let signature = twilio_signature(AUTH_TOKEN, &format!("{PUBLIC_URL}/v1/callbacks/sms"), &delivered);
        let moved = app
            .client
            .post(app.url(&format!("/v1/callbacks/sms?message_id={first}")))
            .header("X-Twilio-Signature", signature)
            .form(&delivered)
            .send()
            .await
            .unwrap();
        expect_problem(moved, StatusCode::FORBIDDEN).await;
        let view = expect_json(app.get_message(&key, &first).await, StatusCode::OK).await;
        assert_eq!(view["status"], "sent", "{view}");

        // A callback without the id is matched by the SID among the
        // messages sent before callbacks carried it (marked so here, as
        // the migration leaves them), and no other: `first` has the SID
        // too, and was sent first.
        sent_before_receipts_carried_ids(&app, &other).await;
        let delivered = [("MessageSid", "SM-SHARED"), ("MessageStatus", "delivered")];
        let answer = callback_at(&app, AUTH_TOKEN, "/v1/callbacks/sms", &delivered).await;
        assert_eq!(answer.status(), StatusCode::NO_CONTENT);
        let view = wait_for(&app, &key, &other, status_is("delivered")).await;
        assert_eq!(view["status"], "delivered", "{view}");
        let view = expect_json(app.get_message(&key, &first).await, StatusCode::OK).await;
        assert_eq!(view["status"], "sent", "a message sent now is not found by its SID alone: {view}");
    }
}

/// Marks message `id` as one sent before receipts carried fairlane's id.
async fn sent_before_receipts_carried_ids(app: &TestApp, id: &str) {
    use fairlane::store::Db;
    match &app.state.db {
        Db::Sqlite(db) => {
            crate::support::sqlite_file(&db.path)
                .execute(
                    "UPDATE messages SET receipt_by_id = NULL WHERE id = ?1",
                    [id],
                )
                .unwrap();
        }
        Db::Postgres(db) => {
            sqlx::query("UPDATE messages SET receipt_by_id = NULL WHERE id = $1")
                .bind(id)
                .execute(&db.pool)
                .await
                .unwrap();
        }
    }
}
