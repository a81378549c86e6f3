//! Slow and idle clients against the real binary, its open-file limit set
//! to 1,024 (soft and hard, as on many hosts): connections that send half a
//! request head and wait must neither lock out a client that sends a whole
//! request nor stay open past the head timeout.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::crash::{ChildGuard, free_port, unlimited_tenant, wait_ready};

const ADMIN: &str = "slow-clients-admin-token-0123";
const HALF_OPEN: usize = 1_100;
const HEAD_TIMEOUT_SECS: u64 = 3;

/// The binary under `ulimit -n 1024`, on `port`, with the given head
/// timeout.
fn start_with_1024_files(db: &std::path::Path, port: u16) -> ChildGuard {
    ChildGuard(
        Command::new("bash")
            .arg("-c")
            .arg("ulimit -n 1024 && exec \"$0\" serve")
            .arg(env!("CARGO_BIN_EXE_fairlane"))
            .env("FAIRLANE__SERVER__LISTEN", format!("127.0.0.1:{port}"))
            .env("FAIRLANE__SERVER__ADMIN_TOKEN", ADMIN)
            .env(
                "FAIRLANE__SERVER__HEADER_READ_TIMEOUT_SECS",
                HEAD_TIMEOUT_SECS.to_string(),
            )
            .env(
                "FAIRLANE__STORAGE__URL",
                format!("sqlite://{}", db.display()),
            )
            .env("FAIRLANE__CONSUMERS__ENABLED", "false")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("bash and the fairlane binary start"),
    )
}

/// True once the server has closed `stream` (end of file or a reset).
async fn closed_by_server(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 256];
    loop {
        match tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            // A 503 refusal or a 408 before the close: read on.
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_connections_neither_lock_out_a_sending_client_nor_stay_open() {
    // This test holds more than 1,100 sockets itself.
    let soft = rlimit::increase_nofile_limit(u64::MAX).unwrap_or(0);
    assert!(
        soft >= (HALF_OPEN as u64) + 256,
        "the test process may open only {soft} files; it needs {} (raise the hard limit: ulimit -Hn)",
        HALF_OPEN + 256
    );
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    let _server = start_with_1024_files(&dir.path().join("fairlane.db"), port);
    wait_ready(&client, &base).await;
    let key = unlimited_tenant(&client, &base, ADMIN).await;

    // Half a request head each, then silence (slowloris).
    let mut half_open = Vec::with_capacity(HALF_OPEN);
    for _ in 0..HALF_OPEN {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        stream
            .write_all(b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            .await
            .unwrap();
        half_open.push(stream);
    }
    let opened = Instant::now();

    // A client that sends a whole request, on a connection of its own.
    let fresh = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let started = Instant::now();
    let response = fresh
        .post(format!("{base}/v1/messages"))
        .bearer_auth(&key)
        .json(&serde_json::json!({"channel": "sms", "to": "+15551234567", "text": "still served"}))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .expect("a sending client gets an answer beside 1,100 half-open connections");
    let took = started.elapsed();
    assert_eq!(response.status(), 202, "{:?}", response.text().await);
    eprintln!("202 beside {HALF_OPEN} half-open connections in {took:?}");
    assert!(took < Duration::from_secs(1), "the 202 took {took:?}");

    // The server closes every half-open connection by itself: the oldest
    // ones to make room at its connection cap, the others after the head
    // timeout.
    tokio::time::sleep(Duration::from_secs(HEAD_TIMEOUT_SECS + 1).saturating_sub(opened.elapsed()))
        .await;
    let mut still_open = 0;
    for stream in &mut half_open {
        if !closed_by_server(stream).await {
            still_open += 1;
            if still_open == 5 {
                break;
            }
        }
    }
    assert_eq!(
        still_open,
        0,
        "{still_open} (counting stops at 5) of {HALF_OPEN} half-open connections were still open {:?} after they opened",
        opened.elapsed()
    );
}

/// A send whose body trickles in, a byte every 300 ms (each byte within
/// any per-read timeout): answered 503 once `request_timeout_secs` has
/// passed since its head, and its connection closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_whose_body_trickles_in_is_cut_off_at_the_request_timeout() {
    let app = crate::support::TestApp::start_custom("", |settings| {
        settings.server.request_timeout_secs = 2
    })
    .await;
    let key = app.tenant_with_key("acme", "pro").await;
    let body = r#"{"channel":"sms","to":"+15551234567","text":"drip"}"#;
    let mut stream = TcpStream::connect(app.addr).await.unwrap();
    let head = format!(
        "POST /v1/messages HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    for byte in body.bytes() {
        if stream.write_all(&[byte]).await.is_err() {
            break;
        }
        match tokio::time::timeout(Duration::from_millis(300), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => answer.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
        if !answer.is_empty() {
            break;
        }
    }
    // Whatever is still in flight, then the close.
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(3), stream.read(&mut buf)).await
    {
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&buf[..n]);
    }
    let waited = started.elapsed();
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 503"),
        "after {waited:?} the trickling send got: {answer:?}"
    );
    assert!(
        answer.to_ascii_lowercase().contains("retry-after: 1"),
        "{answer}"
    );
    assert!(answer.contains("request_timeout_secs"), "{answer}");
    assert!(
        waited >= Duration::from_millis(1900) && waited < Duration::from_secs(6),
        "cut off after {waited:?}, with a request timeout of 2 s"
    );
    // And a whole send on a new connection is taken at once.
    let sent = app.send(&key, &crate::support::sms()).await;
    assert_eq!(sent.status(), reqwest::StatusCode::ACCEPTED);
}
