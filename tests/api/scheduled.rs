//! `send_at`: a scheduled message answers and reads `scheduled` until it is
//! due, is not handed to the provider before then, is sent once after (on
//! the embedded queue, across a restart, and on SQS through the outbox's
//! scheduler), and is never sent when cancelled first. Dates that are not
//! RFC 3339 with an offset, or more than 30 days ahead, are 422s.

use std::time::Duration;

use chrono::{DateTime, FixedOffset, SecondsFormat, Utc};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use wiremock::MockServer;

use crate::backends::{moto_url, sqs_settings};
use crate::batch::send_batch;
use crate::delivery::{delivery_settings, mock_sms_ok, sms_requests, status_is, wait_for};
use crate::support::*;

/// `now + offset` as RFC 3339 in UTC, to the millisecond (the precision the
/// service keeps).
pub(crate) fn rfc3339_in(offset: chrono::Duration) -> String {
    (Utc::now() + offset).to_rfc3339_opts(SecondsFormat::Millis, true)
}

fn instant(text: &Value) -> DateTime<FixedOffset> {
    let text = text
        .as_str()
        .unwrap_or_else(|| panic!("not a date-time: {text}"));
    DateTime::parse_from_rfc3339(text).unwrap_or_else(|err| panic!("{text:?}: {err}"))
}

/// An SMS due `secs` seconds from now.
fn sms_due_in(secs: i64, text: &str) -> Value {
    let body = with(sms(), "text", json!(text));
    with(
        body,
        "send_at",
        json!(rfc3339_in(chrono::Duration::seconds(secs))),
    )
}

/// Until shortly before `due`, asserts every 100 ms that the message still
/// reads `scheduled` and the provider has had no request.
async fn assert_held_until_shortly_before(
    app: &TestApp,
    key: &str,
    id: &str,
    due: DateTime<FixedOffset>,
    sms_api: &MockServer,
) {
    while Utc::now() + chrono::Duration::milliseconds(300) < due {
        let view = expect_json(app.get_message(key, id).await, StatusCode::OK).await;
        assert_eq!(view["status"], "scheduled", "{view}");
        assert_eq!(sms_requests(sms_api).await, 0, "sent before it was due");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Asserts that `view` was sent, and not before its `send_at`.
fn assert_sent_when_due(view: &Value) {
    assert_eq!(view["status"], "sent", "{view}");
    assert!(
        instant(&view["sent_at"]) >= instant(&view["send_at"]),
        "sent before it was due: {view}"
    );
}

on_both_stores! {
    async fn a_scheduled_send_answers_scheduled_with_its_send_at_and_reads_scheduled_until_due() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        // An hour ahead, written with another offset: the same instant.
        let due = Utc::now() + chrono::Duration::hours(1);
        let written = due
            .with_timezone(&FixedOffset::east_opt(2 * 3600).unwrap())
            .to_rfc3339_opts(SecondsFormat::Millis, false);
        assert!(written.ends_with("+02:00"), "{written}");

        let response = app.send(&key, &with(sms(), "send_at", json!(written))).await;

        let accepted = expect_json(response, StatusCode::ACCEPTED).await;
        assert_eq!(accepted["status"], "scheduled", "{accepted}");
        assert_eq!(
            instant(&accepted["send_at"]).timestamp_millis(),
            due.timestamp_millis(),
            "{accepted}"
        );
        let view = expect_json(
            app.get_message(&key, accepted["id"].as_str().unwrap()).await,
            StatusCode::OK,
        )
        .await;
        assert_eq!(view["status"], "scheduled", "{view}");
        assert_eq!(view["send_at"], accepted["send_at"], "{view}");
    }
}

on_both_stores! {
    async fn a_batch_item_with_send_at_is_scheduled_and_the_others_are_queued() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;

        let answer = send_batch(&app, &key, &[sms(), sms_due_in(3600, "later")]).await;

        assert_eq!(answer["accepted"], 2, "{answer}");
        let now = &answer["results"][0]["message"];
        assert_eq!(now["status"], "queued", "{answer}");
        assert!(now.get("send_at").is_none(), "{answer}");
        let later = &answer["results"][1]["message"];
        assert_eq!(later["status"], "scheduled", "{answer}");
        let view = expect_json(
            app.get_message(&key, later["id"].as_str().unwrap()).await,
            StatusCode::OK,
        )
        .await;
        assert_eq!(view["status"], "scheduled", "{view}");
        assert_eq!(view["send_at"], later["send_at"], "{view}");
    }
}

on_both_stores! {
    async fn a_send_at_in_the_past_means_now() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let past = with(sms(), "send_at", json!("2020-01-01T00:00:00Z"));

        let accepted = expect_json(app.send(&key, &past).await, StatusCode::ACCEPTED).await;

        assert_eq!(accepted["status"], "queued", "{accepted}");
        let view = expect_json(
            app.get_message(&key, accepted["id"].as_str().unwrap()).await,
            StatusCode::OK,
        )
        .await;
        assert_eq!(view["status"], "queued", "{view}");
    }
}

on_both_stores! {
    async fn a_send_at_more_than_30_days_ahead_is_a_422_naming_send_at() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let too_far = json!(rfc3339_in(chrono::Duration::days(30) + chrono::Duration::minutes(5)));

        let response = app.send(&key, &with(sms(), "send_at", too_far.clone())).await;
        expect_field_error(response, "send_at").await;

        let answer = send_batch(&app, &key, &[with(sms(), "send_at", too_far)]).await;
        assert_eq!(answer["results"][0]["status"], 422, "{answer}");
        assert!(
            answer["results"][0]["problem"]["errors"]["send_at"].is_string(),
            "{answer}"
        );

        // Just inside the limit is fine.
        let within = json!(rfc3339_in(chrono::Duration::days(30) - chrono::Duration::minutes(5)));
        let accepted =
            expect_json(app.send(&key, &with(sms(), "send_at", within)).await, StatusCode::ACCEPTED)
                .await;
        assert_eq!(accepted["status"], "scheduled", "{accepted}");
    }
}

on_both_stores! {
    async fn a_send_at_that_is_not_rfc_3339_with_an_offset_is_a_422_naming_send_at() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        for bad in [
            json!("tomorrow"),
            json!("2030-01-01"),
            json!("2030-01-01T09:00:00"),
            json!("01/02/2030 09:00"),
            json!(1_900_000_000),
            json!(""),
        ] {
            let response = app.send(&key, &with(sms(), "send_at", bad.clone())).await;
            let problem = expect_field_error(response, "send_at").await;
            assert_eq!(problem["status"], 422, "{bad}: {problem}");
        }
        assert_eq!(fast_lane_depth(&app).await, 0, "nothing was queued");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_due_in_2_s_stays_scheduled_until_due_then_is_sent_once() {
    let sms_api = MockServer::start().await;
    mock_sms_ok(&sms_api, "SM-LATER").await;
    let app = TestApp::start(&delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", "")).await;
    let key = app.tenant_with_key("acme", "pro").await;

    let response = app.send(&key, &sms_due_in(2, "due in two")).await;

    let accepted = expect_json(response, StatusCode::ACCEPTED).await;
    assert_eq!(accepted["status"], "scheduled", "{accepted}");
    let id = accepted["id"].as_str().unwrap();
    let due = instant(&accepted["send_at"]);
    assert_held_until_shortly_before(&app, &key, id, due, &sms_api).await;
    let view = wait_for(&app, &key, id, status_is("sent")).await;
    assert_sent_when_due(&view);
    assert_eq!(view["attempts"], 1, "{view}");
    wait_until_the_fast_lane_is_empty(&app).await;
    assert_eq!(sms_requests(&sms_api).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_message_cancelled_before_it_is_due_is_never_sent() {
    let sms_api = MockServer::start().await;
    mock_sms_ok(&sms_api, "SM-KEPT").await;
    let app = TestApp::start(&delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", "")).await;
    let key = app.tenant_with_key("acme", "pro").await;
    // Both due at the same moment; the kept one shows when that has passed.
    let answer = send_batch(
        &app,
        &key,
        &[sms_due_in(2, "cancelled"), sms_due_in(2, "kept")],
    )
    .await;
    let [cancelled, kept] = [0, 1].map(|n| {
        answer["results"][n]["message"]["id"]
            .as_str()
            .unwrap()
            .to_owned()
    });

    let response = app
        .tenant(&key, Method::DELETE, &format!("/v1/messages/{cancelled}"))
        .send()
        .await
        .unwrap();
    let view = expect_json(response, StatusCode::OK).await;
    assert_eq!(view["status"], "cancelled", "{view}");

    let view = wait_for(&app, &key, &kept, status_is("sent")).await;
    assert_sent_when_due(&view);
    // Past the due time, and every copy has been taken from the lane.
    wait_until_the_fast_lane_is_empty(&app).await;
    let requests = sms_api.received_requests().await.unwrap();
    assert_eq!(requests.len(), 1, "only the kept message is sent");
    let form = String::from_utf8_lossy(&requests[0].body);
    assert!(form.contains("Body=kept"), "{form}");
    let view = expect_json(app.get_message(&key, &cancelled).await, StatusCode::OK).await;
    assert_eq!(view["status"], "cancelled", "{view}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_message_is_sent_once_due_after_a_restart_while_it_waited() {
    let sms_api = MockServer::start().await;
    mock_sms_ok(&sms_api, "SM-RESTART").await;
    let consuming = delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", "");
    let accepting = consuming.replace(
        "[consumers]\nenabled = true",
        "[consumers]\nenabled = false",
    );
    assert_ne!(accepting, consuming);
    let app = TestApp::start(&accepting).await;
    let key = app.tenant_with_key("acme", "pro").await;
    let accepted = expect_json(
        app.send(&key, &sms_due_in(3, "after restart")).await,
        StatusCode::ACCEPTED,
    )
    .await;
    let id = accepted["id"].as_str().unwrap().to_owned();

    let dir = app.stop().await;
    let app = TestApp::start_in(dir, &consuming, |_| {}).await;

    // A restart takes well under the 3 s the message still has to wait.
    let view = expect_json(app.get_message(&key, &id).await, StatusCode::OK).await;
    assert_eq!(view["status"], "scheduled", "{view}");
    let view = wait_for(&app, &key, &id, status_is("sent")).await;
    assert_sent_when_due(&view);
    assert_eq!(view["provider_message_id"], "SM-RESTART", "{view}");
    wait_until_the_fast_lane_is_empty(&app).await;
    assert_eq!(sms_requests(&sms_api).await, 1);
}

on_sqlite_and_postgres! {
    /// On SQS a scheduled message
    /// waits in the outbox and the scheduler puts it on its lane when due.
    async fn a_scheduled_message_on_sqs_is_sent_once_due_and_a_cancelled_one_is_not() {
        let moto = moto_url();
        let sms_api = MockServer::start().await;
        mock_sms_ok(&sms_api, "SM-SQS-LATER").await;
        // A PostgreSQL app is on SQS already; a SQLite one is moved there.
        let queue = match STORE.try_with(|store| *store).unwrap_or(Store::Sqlite) {
            Store::Postgres => String::new(),
            Store::Sqlite | Store::PostgresLanes => sqs_settings(&moto, "sched", ""),
        };
        let app =
            TestApp::start(&delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", &queue)).await;
        assert!(app.state.queue.api_calls().is_some(), "the app is on SQS");
        let key = app.tenant_with_key("acme", "pro").await;
        let answer = send_batch(
            &app,
            &key,
            &[sms_due_in(2, "sqs+kept"), sms_due_in(2, "sqs+cancelled")],
        )
        .await;
        let [kept, cancelled] = [0, 1].map(|n| {
            answer["results"][n]["message"]["id"]
                .as_str()
                .unwrap()
                .to_owned()
        });
        assert_eq!(answer["results"][0]["message"]["status"], "scheduled", "{answer}");
        let cancel = app
            .tenant(&key, Method::DELETE, &format!("/v1/messages/{cancelled}"))
            .send()
            .await
            .unwrap();
        assert_eq!(expect_json(cancel, StatusCode::OK).await["status"], "cancelled");

        let due = instant(&answer["results"][0]["message"]["send_at"]);
        assert_held_until_shortly_before(&app, &key, &kept, due, &sms_api).await;
        let view = wait_for(&app, &key, &kept, status_is("sent")).await;
        assert_sent_when_due(&view);
        // Both were due at the same tick of the scheduler; give a copy of the
        // cancelled one, had it been sent to SQS, time to reach a consumer.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let requests = sms_api.received_requests().await.unwrap();
        assert_eq!(requests.len(), 1, "one message was sent, once");
        let form = String::from_utf8_lossy(&requests[0].body);
        assert!(form.contains("Body=sqs%2Bkept"), "{form}");
        let view = expect_json(app.get_message(&key, &cancelled).await, StatusCode::OK).await;
        assert_eq!(view["status"], "cancelled", "{view}");
    }
}
