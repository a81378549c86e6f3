//! What a hostile tenant's body costs the real binary: a batch of 1,000
//! items, each with 700 unknown fields (7.7 MB, under the batch body
//! limit), is answered with a bounded body, and the server's resident
//! memory grows by less than 64 MiB, whether the batch carries an
//! `Idempotency-Key` or not.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::crash::{ADMIN, free_port, start, unlimited_tenant, wait_ready};

/// Resident memory of process `pid`, in KiB (Linux).
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("/proc/<pid>/status is readable (these tests run on Linux)");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .expect("VmRSS in /proc/<pid>/status")
}

/// 1,000 items of 700 unknown fields each, and one valid item first so
/// that a batch key makes the answer remembered.
fn hostile_batch() -> String {
    let mut items =
        vec![json!({"channel": "email", "to": "a@example.com", "subject": "Hi", "text": "Hello"})];
    for _ in 1..1_000 {
        let mut fields = serde_json::Map::new();
        fields.insert("channel".into(), json!("email"));
        for n in 0..700 {
            fields.insert(format!("k{n}"), json!(n));
        }
        items.push(Value::Object(fields));
    }
    json!({ "messages": items }).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_unknown_fields_costs_little_memory_and_gets_a_small_answer() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let server = start(&dir.path().join("fairlane.db"), port);
    let pid = server.0.id();
    let client = reqwest::Client::new();
    wait_ready(&client, &base).await;
    let key = unlimited_tenant(&client, &base, ADMIN).await;
    let body = hostile_batch();
    assert!(body.len() > 7_000_000, "{} bytes", body.len());

    // A small batch first, so that what every request needs (buffers,
    // pools, the writer) is in place before the measure starts.
    let warm = client
        .post(format!("{base}/v1/messages/batch"))
        .bearer_auth(&key)
        .json(&json!({"messages": [{"channel": "sms", "to": "+15551234567", "text": "warm"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(warm.status(), StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = rss_kib(pid);

    for (round, batch_key) in [None, Some("hostile-1"), Some("hostile-2")]
        .into_iter()
        .enumerate()
    {
        let mut request = client
            .post(format!("{base}/v1/messages/batch"))
            .bearer_auth(&key)
            .header("content-type", "application/json")
            .body(body.clone());
        if let Some(batch_key) = batch_key {
            request = request.header("idempotency-key", batch_key);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "round {round}");
        let answer = response.bytes().await.unwrap();
        assert!(
            answer.len() < 1024 * 1024,
            "round {round}: the answer has {} bytes",
            answer.len()
        );
        let answer: Value = serde_json::from_slice(&answer).unwrap();
        assert_eq!(answer["accepted"], 1, "round {round}");
        assert_eq!(answer["refused"], 999, "round {round}");
        let errors = answer["results"][5]["problem"]["errors"]
            .as_object()
            .unwrap();
        assert!(errors.len() <= 8, "round {round}: {errors:?}");
        assert_eq!(
            errors["body"], "has 697 more unknown fields, not named here",
            "round {round}"
        );
        eprintln!(
            "round {round}: answer {} bytes, RSS {} KiB (+{} KiB)",
            serde_json::to_vec(&answer).unwrap().len(),
            rss_kib(pid),
            rss_kib(pid).saturating_sub(before)
        );
    }
    let grown = rss_kib(pid).saturating_sub(before);
    assert!(
        grown < 64 * 1024,
        "three hostile batches grew the server's RSS by {grown} KiB"
    );
}
