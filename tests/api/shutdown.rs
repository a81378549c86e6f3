//! SIGTERM during a backlog: the real binary stops polling, returns what it
//! had buffered or was holding at the provider gate to the queue at once,
//! finishes the sends in flight and exits 0. Nothing is lost, and nothing is
//! left invisible for the visibility timeout.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::crash::{ChildGuard, free_port, unlimited_tenant, wait_ready};
use crate::support::sqlite_count;

const ADMIN: &str = "shutdown-test-admin-token-01";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_backlog_loses_nothing_and_leaves_nothing_invisible() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("fairlane.db");
    let deliveries = dir.path().join("sms.jsonl");
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    // SMS paced at 5/s so a backlog builds up behind the gate.
    let mut child = ChildGuard(
        Command::new(env!("CARGO_BIN_EXE_fairlane"))
            .arg("serve")
            .env("FAIRLANE__SERVER__LISTEN", format!("127.0.0.1:{port}"))
            .env("FAIRLANE__SERVER__ADMIN_TOKEN", ADMIN)
            .env(
                "FAIRLANE__STORAGE__URL",
                format!("sqlite://{}", db.display()),
            )
            .env("FAIRLANE__PROVIDERS__SMS__RATE_PER_SECOND", "5")
            .env("FAIRLANE__PROVIDERS__SMS__BURST", "1")
            .env("FAIRLANE__PROVIDERS__SMS__LOG_PATH", &deliveries)
            .env("FAIRLANE__LANES__FAST__VISIBILITY_TIMEOUT_SECS", "300")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("fairlane binary starts"),
    );
    let client = reqwest::Client::new();
    wait_ready(&client, &base).await;

    let key = unlimited_tenant(&client, &base, ADMIN).await;
    let total = 100;
    for n in 0..total {
        let response = client
            .post(format!("{base}/v1/messages"))
            .bearer_auth(&key)
            .json(&serde_json::json!({"channel":"sms","to":"+15551234567","text":format!("n{n}")}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 202);
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let killed = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "fairlane did not exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Not waiting for the whole backlog shows as messages still queued
    // (checked below), not as a wall-clock bound a loaded machine breaks.
    assert!(status.success(), "exit status after SIGTERM: {status}");

    let sent_lines = std::fs::read_to_string(&deliveries)
        .unwrap_or_default()
        .lines()
        .count();
    let now = chrono::Utc::now().timestamp_millis();
    let sent = sqlite_count(
        &db,
        "SELECT COUNT(*) FROM messages WHERE status = 'sent'",
        [],
    );
    let queued = sqlite_count(
        &db,
        "SELECT COUNT(*) FROM queue_messages WHERE queue = 'fast'",
        [],
    );
    let invisible = sqlite_count(
        &db,
        "SELECT COUNT(*) FROM queue_messages WHERE queue = 'fast' AND visible_at > ?",
        [now],
    );
    assert!(
        sent > 0 && (sent as usize) < total,
        "the test needs a backlog at SIGTERM: sent {sent}"
    );
    assert_eq!(
        sent as usize, sent_lines,
        "every sent message reached the provider once"
    );
    assert_eq!(
        sent + queued,
        total as i64,
        "sent {sent} + still queued {queued} must be all {total}"
    );
    assert_eq!(invisible, 0, "messages were left invisible after shutdown");
}
