//! A 202 survives `kill -9`: the real binary is killed with SIGKILL while
//! clients are sending, restarted on the same SQLite file, and every message
//! that was answered 202 must still have its status row and queue entry.

use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::sqlite_file;

pub(crate) const ADMIN: &str = "crash-test-admin-token-0123";

pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A child process that is killed when the test ends, pass or fail.
pub(crate) struct ChildGuard(pub Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The binary serving on `port` over the SQLite file `db`, consumers off.
pub(crate) fn start(db: &std::path::Path, port: u16) -> ChildGuard {
    ChildGuard(
        Command::new(env!("CARGO_BIN_EXE_fairlane"))
            .arg("serve")
            .env("FAIRLANE__SERVER__LISTEN", format!("127.0.0.1:{port}"))
            .env("FAIRLANE__SERVER__ADMIN_TOKEN", ADMIN)
            .env(
                "FAIRLANE__STORAGE__URL",
                format!("sqlite://{}", db.display()),
            )
            .env("FAIRLANE__CONSUMERS__ENABLED", "false")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("fairlane binary starts"),
    )
}

pub(crate) async fn wait_ready(client: &reqwest::Client, base: &str) {
    for _ in 0..200 {
        if let Ok(response) = client.get(format!("{base}/readyz")).send().await
            && response.status().is_success()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("fairlane did not become ready at {base}");
}

/// Creates tenant `acme` on a plan whose limits are out of the way (fast
/// lane, 64 in flight) through a separately running binary; returns its key.
pub(crate) async fn unlimited_tenant(client: &reqwest::Client, base: &str, admin: &str) -> String {
    let plan = client
        .put(format!("{base}/v1/admin/plans/unlimited"))
        .bearer_auth(admin)
        .json(&serde_json::json!({"lane":"fast","rate_per_second":1000000.0,"burst":1000000,"daily_quota":1000000000u64,"max_in_flight":64}))
        .send()
        .await
        .unwrap();
    assert!(plan.status().is_success());
    let tenant = client
        .post(format!("{base}/v1/admin/tenants"))
        .bearer_auth(admin)
        .json(&serde_json::json!({"id":"acme","name":"Acme","plan":"unlimited"}))
        .send()
        .await
        .unwrap();
    assert_eq!(tenant.status(), 201);
    let key: serde_json::Value = client
        .post(format!("{base}/v1/admin/tenants/acme/keys"))
        .bearer_auth(admin)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    key["key"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_answered_202_survives_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("fairlane.db");
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    let mut child = start(&db, port);
    wait_ready(&client, &base).await;

    let key = unlimited_tenant(&client, &base, ADMIN).await;

    let accepted = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut senders = Vec::new();
    for worker in 0..16 {
        let (client, base, key, accepted) =
            (client.clone(), base.clone(), key.clone(), accepted.clone());
        senders.push(tokio::spawn(async move {
            for n in 0..10_000 {
                let sent = client
                    .post(format!("{base}/v1/messages"))
                    .bearer_auth(&key)
                    .json(&serde_json::json!({"channel":"sms","to":"+15551234567","text":format!("w{worker} n{n}")}))
                    .send()
                    .await;
                let Ok(response) = sent else { return };
                if response.status() != 202 {
                    continue;
                }
                let Ok(body) = response.json::<serde_json::Value>().await else { return };
                accepted.lock().unwrap().push(body["id"].as_str().unwrap().to_owned());
            }
        }));
    }
    // Let the senders get going, then kill without warning.
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if accepted.lock().unwrap().len() >= 300 {
            break;
        }
    }
    child.0.kill().unwrap(); // SIGKILL
    child.0.wait().unwrap();
    for sender in senders {
        sender.await.unwrap();
    }
    let accepted = accepted.lock().unwrap().clone();
    assert!(
        accepted.len() >= 100,
        "only {} sends were accepted before the kill",
        accepted.len()
    );

    // Restart on the same file: every accepted id is still queued.
    let child = start(&db, port);
    wait_ready(&client, &base).await;
    for id in &accepted {
        let response = client
            .get(format!("{base}/v1/messages/{id}"))
            .bearer_auth(&key)
            .send()
            .await
            .unwrap();
        assert_eq!(
            response.status(),
            200,
            "message {id} was answered 202 but is gone"
        );
        let body: serde_json::Value = response.json().await.unwrap();
        assert_eq!(body["status"], "queued");
    }
    drop(child);

    let queued: std::collections::HashSet<String> = sqlite_file(&db)
        .prepare("SELECT message_id FROM queue_messages WHERE queue = 'fast'")
        .unwrap()
        .query_map([], |row| row.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    for id in &accepted {
        assert!(
            queued.contains(id),
            "message {id} has no queue entry after the crash"
        );
    }
}
