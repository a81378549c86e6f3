//! What an operator reads in the log: the real binary runs with
//! `FAIRLANE_LOG_FORMAT=json` and its stderr captured, sends one email
//! (log provider) and one SMS that the provider refuses for good, and
//! redrives the dead letter. Each of these state changes has one INFO line
//! with its fields; the accept is DEBUG only; and no line carries the
//! recipient's address unless `logging.log_addresses` is on.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::crash::{ChildGuard, free_port, unlimited_tenant, wait_ready};

pub(crate) const ADMIN: &str = "logging-test-admin-token-0123";
pub(crate) const EMAIL_TO: &str = "ada.lovelace@example.com";
pub(crate) const SMS_TO: &str = "+15557654321";
const SMS_PATH: &str = "/2010-04-01/Accounts/AC123/Messages.json";

/// The JSON log lines fairlane wrote, and the ids of the email and the SMS.
pub(crate) struct Run {
    pub(crate) lines: Vec<Value>,
    pub(crate) email_id: String,
    pub(crate) sms_id: String,
    /// The dead-lettered SMS's `last_error` as its status shows it.
    pub(crate) sms_last_error: String,
}

impl Run {
    /// The first line with `message` about message `id` (the redriven SMS
    /// may be dead-lettered a second time before the process is stopped).
    pub(crate) fn line(&self, message: &str, id: &str) -> &Value {
        self.lines
            .iter()
            .find(|line| line["fields"]["message"] == message && line["fields"]["message_id"] == id)
            .unwrap_or_else(|| panic!("no {message:?} line for {id} in {:#?}", self.lines))
    }
}

/// The JSON `url` answers to `token`.
async fn get_json(client: &reqwest::Client, url: String, token: &str) -> Value {
    client
        .get(url)
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn wait_for_status(client: &reqwest::Client, base: &str, key: &str, id: &str, want: &str) {
    for _ in 0..200 {
        let body = get_json(client, format!("{base}/v1/messages/{id}"), key).await;
        if body["status"] == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("message {id} did not reach {want}");
}

async fn send(client: &reqwest::Client, base: &str, key: &str, body: Value) -> String {
    let response = client
        .post(format!("{base}/v1/messages"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::ACCEPTED);
    let body: Value = response.json().await.unwrap();
    body["id"].as_str().unwrap().to_owned()
}

/// The real binary started by [`start`]: the process, its base URL and
/// the mock SMS provider it calls.
pub(crate) struct Started {
    pub(crate) child: ChildGuard,
    pub(crate) base: String,
    pub(crate) client: reqwest::Client,
    _provider: MockServer,
}

/// Starts the real binary in `dir` with `env` added: SQLite, the log
/// email provider, an SMS provider that refuses every number (quoting it,
/// as Twilio does), JSON log lines to `dir/stderr.log`; once it is ready.
pub(crate) async fn start(dir: &Path, env: &[(&str, &str)]) -> Started {
    let provider = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path(SMS_PATH))
        .respond_with(
            // As Twilio words it: the provider's text quotes the number.
            ResponseTemplate::new(400).set_body_json(json!({
                "code": 21211,
                "message": format!("The 'To' number {SMS_TO} is not a valid phone number.")
            })),
        )
        .mount(&provider)
        .await;
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let config = dir.join("fairlane.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nadmin_token = \"{ADMIN}\"\n\
             [storage]\nurl = \"sqlite://{db}\"\n\
             [providers.email]\nkind = \"log\"\nrate_per_second = 100.0\nburst = 10\nlog_path = \"{deliveries}\"\n\
             [providers.sms]\nkind = \"http\"\nbase_url = \"{sms}\"\naccount_sid = \"AC123\"\nauth_token = \"secret-token\"\n\
             from = \"+15550001111\"\nrate_per_second = 100.0\nburst = 10\n",
            db = dir.join("fairlane.db").display(),
            deliveries = dir.join("deliveries.jsonl").display(),
            sms = provider.uri(),
        ),
    )
    .unwrap();
    let stderr = std::fs::File::create(dir.join("stderr.log")).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_fairlane"));
    command
        .args(["serve", "--config"])
        .arg(&config)
        .env("RUST_LOG", "info")
        .env("FAIRLANE_LOG_FORMAT", "json")
        .env_remove("FAIRLANE_CONFIG")
        .stdout(Stdio::null())
        .stderr(stderr);
    for (name, value) in env {
        command.env(name, value);
    }
    let child = ChildGuard(command.spawn().expect("fairlane binary starts"));

    let client = reqwest::Client::new();
    wait_ready(&client, &base).await;
    Started {
        child,
        base,
        client,
        _provider: provider,
    }
}

/// Runs the binary through send, dead letter, redrive and the redriven
/// message's second dead letter, with `env` added; then stops it with
/// SIGTERM and waits for it to exit.
pub(crate) async fn run_with(dir: &Path, env: &[(&str, &str)]) -> Run {
    let Started {
        child,
        base,
        client,
        _provider,
    } = start(dir, env).await;
    let key = unlimited_tenant(&client, &base, ADMIN).await;
    let email_id = send(
        &client,
        &base,
        &key,
        json!({"channel": "email", "to": EMAIL_TO, "subject": "Your receipt", "text": "Thanks!"}),
    )
    .await;
    let sms_id = send(
        &client,
        &base,
        &key,
        json!({"channel": "sms", "to": SMS_TO, "text": "Your code is 123456"}),
    )
    .await;
    wait_for_status(&client, &base, &key, &email_id, "sent").await;
    wait_for_status(&client, &base, &key, &sms_id, "dead_lettered").await;
    // The status is written before the copy moves to the DLQ: a redrive
    // in between finds nothing to move, so wait until the DLQ lists it.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let listed = get_json(&client, format!("{base}/v1/admin/dlq"), ADMIN).await;
        let letters = listed["dead_letters"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if letters.iter().any(|letter| letter["id"] == sms_id.as_str()) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never in the DLQ: {listed}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let redrive: Value = client
        .post(format!("{base}/v1/admin/dlq/redrive"))
        .bearer_auth(ADMIN)
        .json(&json!({"ids": [&sms_id]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(redrive["redriven"], 1, "{redrive}");
    // The redrive answered with the message `queued` again.
    wait_for_status(&client, &base, &key, &sms_id, "dead_lettered").await;
    let view: Value = client
        .get(format!("{base}/v1/messages/{sms_id}"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let sms_last_error = view["last_error"].as_str().unwrap_or_default().to_owned();

    stop(child).await;

    let text = std::fs::read_to_string(dir.join("stderr.log")).unwrap();
    let lines = text
        .lines()
        .map(|line| {
            serde_json::from_str(line).unwrap_or_else(|err| panic!("{err}: not JSON: {line}"))
        })
        .collect();
    Run {
        lines,
        email_id,
        sms_id,
        sms_last_error,
    }
}

/// SIGTERM to the binary (our own child, by its PID); waits for its exit.
pub(crate) async fn stop(mut child: ChildGuard) {
    let signalled = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .expect("run kill");
    assert!(signalled.success(), "SIGTERM to fairlane failed");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.0.try_wait().expect("wait for fairlane") {
            assert!(status.success(), "fairlane exited with {status}");
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "fairlane did not exit within 30 s of SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sent_dead_lettered_and_redriven_are_info_lines_without_addresses() {
    let dir = tempfile::tempdir().unwrap();
    let run = run_with(dir.path(), &[]).await;

    let sent = run.line("Message sent.", &run.email_id);
    assert_eq!(sent["level"], "INFO", "{sent}");
    let fields = &sent["fields"];
    assert_eq!(fields["tenant"], "acme", "{sent}");
    assert_eq!(fields["channel"], "email", "{sent}");
    assert_eq!(fields["lane"], "fast", "{sent}");
    assert_eq!(fields["priority"], "normal", "{sent}");
    assert_eq!(fields["provider"], "email", "{sent}");
    assert!(fields["provider_message_id"].is_string(), "{sent}");
    assert!(fields.get("to").is_none(), "{sent}");

    let dead = run.line("Message dead-lettered.", &run.sms_id);
    assert_eq!(dead["level"], "INFO", "{dead}");
    let fields = &dead["fields"];
    assert_eq!(fields["tenant"], "acme", "{dead}");
    assert_eq!(fields["channel"], "sms", "{dead}");
    assert_eq!(fields["provider"], "sms", "{dead}");
    assert_eq!(fields["attempts"], 1, "{dead}");
    assert!(fields["reason"].is_string(), "{dead}");

    let redriven = run.line("Message redriven.", &run.sms_id);
    assert_eq!(redriven["level"], "INFO", "{redriven}");
    assert_eq!(redriven["fields"]["tenant"], "acme", "{redriven}");
    assert_eq!(redriven["fields"]["lane"], "fast", "{redriven}");

    assert!(
        !run.lines
            .iter()
            .any(|line| line["fields"]["message"] == "Message accepted."),
        "accepts are DEBUG only"
    );
    for line in &run.lines {
        let text = line.to_string();
        for private in [EMAIL_TO, SMS_TO, "Your code is", "Thanks!"] {
            assert!(!text.contains(private), "{private} in the log: {text}");
        }
    }
    // Nor in the error the tenant reads: the provider quoted the number.
    assert!(
        run.sms_last_error.contains("[address]") && !run.sms_last_error.contains(SMS_TO),
        "{}",
        run.sms_last_error
    );
    // The log provider writes deliveries to their own file, not the log.
    let deliveries = std::fs::read_to_string(dir.path().join("deliveries.jsonl")).unwrap();
    assert!(deliveries.contains(EMAIL_TO), "{deliveries}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_addresses_puts_the_recipient_into_the_sent_and_dead_lettered_lines() {
    let dir = tempfile::tempdir().unwrap();
    let run = run_with(dir.path(), &[("FAIRLANE__LOGGING__LOG_ADDRESSES", "true")]).await;

    let sent = run.line("Message sent.", &run.email_id);
    assert_eq!(sent["fields"]["to"], EMAIL_TO, "{sent}");
    let dead = run.line("Message dead-lettered.", &run.sms_id);
    assert_eq!(dead["fields"]["to"], SMS_TO, "{dead}");
    assert!(
        run.sms_last_error.contains(SMS_TO),
        "{}",
        run.sms_last_error
    );
    // Bodies stay out even so.
    for line in &run.lines {
        let text = line.to_string();
        assert!(
            !text.contains("Your code is") && !text.contains("Thanks!"),
            "{text}"
        );
    }
}
