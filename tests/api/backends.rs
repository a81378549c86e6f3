//! The delivery flows, run once on each queue backend: the embedded queue,
//! the lanes in PostgreSQL, and SQS (moto: `FAIRLANE_TEST_SQS_URL`, or one
//! the test support starts).
//! Email goes through SES on moto and is read back from moto's recorded
//! sends; SMS goes to wiremock.

use crate::senders::{SentMail, mail_of};
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::delivery::{
    SMS_PATH, delivery_settings, mock_sms_ok, sms_requests, status_is, wait_for,
};
use crate::support::{TestApp, expect_json, sms, with};

/// Which queue backend a run uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Backend {
    Embedded,
    Sqs,
    /// The lanes in the PostgreSQL store.
    Postgres,
}

/// moto's base URL: `FAIRLANE_TEST_SQS_URL`, or a moto the test support
/// starts (see `tests/servers`).
pub fn moto_url() -> String {
    crate::servers::sqs_url()
}

/// A queue prefix no other test uses on the shared moto server.
pub fn unique_prefix(tag: &str) -> String {
    let random = uuid::Uuid::new_v4().simple().to_string();
    format!("ft-{tag}-{}", &random[..12])
}

/// `[queue]` settings for SQS on moto with a fresh prefix.
pub fn sqs_settings(moto: &str, tag: &str, extra_sqs: &str) -> String {
    format!(
        "[queue]\nbackend = \"sqs\"\n\n[queue.sqs]\nendpoint_url = \"{moto}\"\nregion = \"us-east-1\"\nqueue_prefix = \"{}\"\ncreate_queues = true\naccess_key_id = \"test\"\nsecret_access_key = \"test\"\n{extra_sqs}\n",
        unique_prefix(tag)
    )
}

/// An SQS client of moto (test credentials, us-east-1).
pub fn sqs_client(moto: &str) -> aws_sdk_sqs::Client {
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(aws_sdk_sqs::config::BehaviorVersion::latest())
        .region(aws_sdk_sqs::config::Region::new("us-east-1"))
        .endpoint_url(moto)
        .credentials_provider(aws_sdk_sqs::config::Credentials::new(
            "test", "test", None, None, "tests",
        ))
        .build();
    aws_sdk_sqs::Client::from_conf(config)
}

/// Makes `noreply@example.com` a sending identity on moto's SES (sends
/// from an unknown identity are refused). Creating it twice is harmless.
pub async fn ses_identity(moto: &str) {
    let config = aws_sdk_sesv2::Config::builder()
        .behavior_version(aws_sdk_sesv2::config::BehaviorVersion::latest())
        .region(aws_sdk_sesv2::config::Region::new("us-east-1"))
        .endpoint_url(moto)
        .credentials_provider(aws_sdk_sesv2::config::Credentials::new(
            "test", "test", None, None, "tests",
        ))
        .build();
    let client = aws_sdk_sesv2::Client::from_conf(config);
    let _ = client
        .create_email_identity()
        .email_identity("noreply@example.com")
        .send()
        .await;
}

/// The emails moto's SES recorded with this subject (SES's raw messages,
/// their MIME parsed back), with their `source`, `destinations` and `id`.
async fn ses_sent_with_subject(moto: &str, subject: &str) -> Vec<(Value, SentMail)> {
    let data: Value = reqwest::get(format!("{moto}/moto-api/data.json"))
        .await
        .expect("moto data")
        .json()
        .await
        .expect("moto data is JSON");
    data["ses"]["RawMessage"]
        .as_array()
        .map(|sent| {
            sent.iter()
                .map(|message| {
                    use base64::Engine;
                    let raw = message["raw_data"].as_str().unwrap_or_default();
                    let call = json!({"Content": {"Raw": {"Data":
                        base64::engine::general_purpose::STANDARD.encode(raw)}}});
                    (message.clone(), mail_of(&call))
                })
                .filter(|(_, mail)| mail.subject.as_deref() == Some(subject))
                .collect()
        })
        .unwrap_or_default()
}

/// A running app on `backend` with SMS going to a wiremock server.
struct Flow {
    app: TestApp,
    sms_api: MockServer,
}

impl Flow {
    /// `needs_ses`: the flow sends email, which needs moto's SES whatever
    /// the queue backend.
    async fn start(backend: Backend, needs_ses: bool, extra: &str) -> Flow {
        let moto = match (backend, needs_ses) {
            (Backend::Embedded | Backend::Postgres, false) => None,
            _ => Some(moto_url()),
        };
        let sms_api = MockServer::start().await;
        let ses_endpoint = match &moto {
            Some(moto) if needs_ses => {
                ses_identity(moto).await;
                moto.clone()
            }
            _ => "http://127.0.0.1:9".to_owned(),
        };
        let queue = match (&moto, backend) {
            (Some(moto), Backend::Sqs) => sqs_settings(moto, "flow", "stats_interval_secs = 1"),
            _ => String::new(),
        };
        let settings = delivery_settings(&sms_api.uri(), &ses_endpoint, &format!("{queue}{extra}"));
        let app = TestApp::start(&settings).await;
        Flow { app, sms_api }
    }

    async fn dead_letter_ids(&self) -> Vec<String> {
        let listed = expect_json(
            self.app
                .admin(Method::GET, "/v1/admin/dlq")
                .send()
                .await
                .unwrap(),
            StatusCode::OK,
        )
        .await;
        listed["dead_letters"]
            .as_array()
            .expect("dead_letters")
            .iter()
            .map(|letter| letter["id"].as_str().unwrap().to_owned())
            .collect()
    }
}

impl Backend {
    /// Runs `flow` on this backend: the lanes in PostgreSQL in a
    /// PostgreSQL store of the test's own, the others as they start.
    pub async fn run<F: std::future::Future>(self, flow: impl FnOnce(Backend) -> F) -> F::Output {
        match self {
            Backend::Postgres => {
                crate::support::STORE
                    .scope(crate::support::Store::PostgresLanes, flow(self))
                    .await
            }
            Backend::Embedded | Backend::Sqs => flow(self).await,
        }
    }
}

/// Generates, for each flow, a module of one test per `ARM => BACKEND`.
macro_rules! on_backends {
    ([$($arm:ident => $backend:ident),+] $(,)?) => {};
    ([$($arm:ident => $backend:ident),+] $flow:ident $(, $rest:ident)* $(,)?) => {
        mod $flow {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $arm() {
                    super::Backend::$backend.run(super::$flow).await
                }
            )+
        }
        on_backends!([$($arm => $backend),+] $($rest),*);
    };
}

/// Generates `embedded`, `sqs` and `postgres` tests for each flow.
macro_rules! on_every_backend {
    ($($flow:ident),* $(,)?) => {
        on_backends!([embedded => Embedded, sqs => Sqs, postgres => Postgres] $($flow),*);
    };
}

on_every_backend!(
    an_email_goes_through_ses_and_ends_sent,
    an_sms_goes_through_the_sms_api_and_ends_sent,
    a_5xx_dead_letters_after_retries_and_redrive_delivers_it,
    a_paused_tenant_is_held_past_max_receive_count_without_dead_lettering,
    a_suppressed_address_ends_suppressed_and_the_next_one_is_sent,
);

/// The consumer reads each receive's statuses and suppressions at once
/// (one store call per receive): a suppressed recipient among others ends
/// `suppressed` without a provider call, the others are sent, and another
/// tenant's list does not apply.
async fn a_suppressed_address_ends_suppressed_and_the_next_one_is_sent(backend: Backend) {
    let flow = Flow::start(backend, false, "").await;
    mock_sms_ok(&flow.sms_api, "SM-FLOW").await;
    let acme = flow.app.tenant_with_key("acme", "pro").await;
    let globex = flow.app.tenant_with_key("globex", "pro").await;
    let listed = flow
        .app
        .tenant(&acme, Method::POST, "/v1/suppressions")
        .json(&json!({"address": "+15551230001"}))
        .send()
        .await
        .unwrap();
    assert_eq!(listed.status(), StatusCode::CREATED);
    let to = |number: &str| with(sms(), "to", json!(number));
    let mut ids = Vec::new();
    for (key, number) in [
        (&acme, "+15551230001"),
        (&acme, "+15551230002"),
        (&globex, "+15551230001"),
        (&acme, "+15551230001"),
    ] {
        ids.push((key, flow.app.send_accepted(key, &to(number)).await));
    }
    let expected = ["suppressed", "sent", "sent", "suppressed"];
    for ((key, id), status) in ids.iter().zip(expected) {
        let view = wait_for(&flow.app, key, id, status_is(status)).await;
        assert_eq!(view["status"], status, "{view}");
    }
    // Two calls: acme's second number and globex's, nothing for the two
    // suppressed messages.
    let mut called: Vec<String> = flow
        .sms_api
        .received_requests()
        .await
        .unwrap()
        .iter()
        .map(|request| {
            let form = String::from_utf8_lossy(&request.body).to_string();
            let to = form.split('&').find_map(|pair| pair.strip_prefix("To="));
            to.unwrap_or_default().replace("%2B", "+")
        })
        .collect();
    called.sort();
    assert_eq!(called, ["+15551230001", "+15551230002"]);
    let requests = sms_requests(&flow.sms_api).await;
    assert_eq!(requests, 2);
}

async fn an_email_goes_through_ses_and_ends_sent(backend: Backend) {
    let flow = Flow::start(backend, true, "").await;
    let moto = moto_url();
    let key = flow.app.tenant_with_key("acme", "pro").await;
    let subject = format!("Receipt {}", uuid::Uuid::new_v4());
    let id = flow
        .app
        .send_accepted(
            &key,
            &json!({"channel": "email", "to": "customer@example.com", "subject": subject, "text": "Thanks for your order."}),
        )
        .await;

    let view = wait_for(&flow.app, &key, &id, status_is("sent")).await;
    assert_eq!(view["status"], "sent", "{view}");
    let sent = ses_sent_with_subject(&moto, &subject).await;
    assert_eq!(sent.len(), 1, "moto recorded {sent:?}");
    let (recorded, mail) = &sent[0];
    assert_eq!(recorded["source"], "noreply@example.com");
    assert_eq!(recorded["destinations"][0], "customer@example.com");
    assert_eq!(mail.text.as_deref(), Some("Thanks for your order."));
    assert_eq!(view["provider_message_id"], recorded["id"], "{view}");
}

async fn an_sms_goes_through_the_sms_api_and_ends_sent(backend: Backend) {
    let flow = Flow::start(backend, false, "").await;
    mock_sms_ok(&flow.sms_api, "SM-FLOW").await;
    let key = flow.app.tenant_with_key("acme", "pro").await;
    let text = format!(
        "Your code is {}",
        &uuid::Uuid::new_v4().simple().to_string()[..6]
    );
    let id = flow
        .app
        .send_accepted(&key, &with(sms(), "text", json!(text)))
        .await;

    let view = wait_for(&flow.app, &key, &id, status_is("sent")).await;
    assert_eq!(view["status"], "sent", "{view}");
    assert_eq!(view["provider_message_id"], "SM-FLOW");
    let requests = flow.sms_api.received_requests().await.unwrap();
    assert_eq!(requests.len(), 1);
    let form = String::from_utf8_lossy(&requests[0].body).to_string();
    assert!(form.contains("Your+code+is"), "{form}");
}

async fn a_5xx_dead_letters_after_retries_and_redrive_delivers_it(backend: Backend) {
    let flow = Flow::start(backend, false, "").await;
    Mock::given(method("POST"))
        .and(path(SMS_PATH))
        .respond_with(ResponseTemplate::new(503))
        .mount(&flow.sms_api)
        .await;
    let key = flow.app.tenant_with_key("acme", "pro").await;
    let id = flow.app.send_accepted(&key, &sms()).await;

    let dead = wait_for(&flow.app, &key, &id, status_is("dead_lettered")).await;
    assert_eq!(dead["status"], "dead_lettered", "{dead}");
    assert_eq!(dead["attempts"], 3, "retry.max_attempts = 3: {dead}");
    assert!(
        dead["last_error"].as_str().unwrap_or("").contains("503"),
        "{dead}"
    );
    assert_eq!(sms_requests(&flow.sms_api).await, 3);
    // The admin listing reads the lane's DLQ itself (on SQS: the DLQ queue).
    // The status is written just before the move, so allow a moment.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut listed = flow.dead_letter_ids().await;
    while listed.is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        listed = flow.dead_letter_ids().await;
    }
    assert_eq!(listed, vec![id.clone()]);

    flow.sms_api.reset().await;
    mock_sms_ok(&flow.sms_api, "SM-REDRIVEN").await;
    let redriven = expect_json(
        flow.app
            .admin(Method::POST, "/v1/admin/dlq/redrive")
            .json(&json!({"ids": [id]}))
            .send()
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await;
    assert_eq!(redriven["redriven"], 1, "{redriven}");
    let view = wait_for(&flow.app, &key, &id, status_is("sent")).await;
    assert_eq!(view["status"], "sent", "{view}");
    assert_eq!(view["provider_message_id"], "SM-REDRIVEN");
    assert_eq!(
        view["attempts"], 1,
        "redrive gives a fresh attempt budget before the message can be received: {view}"
    );
    assert_eq!(sms_requests(&flow.sms_api).await, 1);
    assert!(flow.dead_letter_ids().await.is_empty());
}

async fn a_paused_tenant_is_held_past_max_receive_count_without_dead_lettering(backend: Backend) {
    // Held messages come back every second; two receives would dead-letter
    // a message that was not deferred properly.
    let extra = "[lanes.fast]\nmax_receive_count = 2\n";
    let flow = Flow::start(backend, false, extra).await;
    mock_sms_ok(&flow.sms_api, "SM-HELD").await;
    let key = flow.app.tenant_with_key("acme", "pro").await;
    flow.app
        .patch_tenant("acme", json!({"status": "paused"}))
        .await;
    let id = flow.app.send_accepted(&key, &sms()).await;

    // hold_delay_secs = 1: about five deferrals in this time, more than
    // twice max_receive_count.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let held = expect_json(flow.app.get_message(&key, &id).await, StatusCode::OK).await;
    assert_eq!(held["status"], "queued", "{held}");
    assert_eq!(held["attempts"], 0, "{held}");
    assert_eq!(sms_requests(&flow.sms_api).await, 0);
    assert!(flow.dead_letter_ids().await.is_empty());

    flow.app
        .patch_tenant("acme", json!({"status": "active"}))
        .await;
    let view = wait_for(&flow.app, &key, &id, status_is("sent")).await;
    assert_eq!(view["status"], "sent", "{view}");
    assert_eq!(view["attempts"], 1, "{view}");
    assert_eq!(sms_requests(&flow.sms_api).await, 1);
}
