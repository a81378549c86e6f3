//! A Twilio-compatible SMS endpoint with a fixed latency, for delivery
//! benchmarks (`bench/delivery.sh`). Not used by the service or the tests.
//!
//! `cargo run --release --example mock_sms -- PORT LATENCY_MS [SLOW_EVERY SLOW_MS]`
//!
//! With `SLOW_EVERY` = 100 and `SLOW_MS` = 2000, every hundredth request
//! takes 2 s instead (1 % stragglers). With `MOCK_SMS_LOG=FILE` set, each
//! request's arrival (seconds since the Unix epoch) and its `Body` are
//! appended to FILE as a tab-separated line, for the priority benchmarks
//! (`bench/priority.py`).

use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Form, Json, Router};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let port: u16 = args.next().unwrap_or_else(|| "18099".into()).parse()?;
    let latency = Duration::from_millis(args.next().unwrap_or_else(|| "50".into()).parse()?);
    let slow_every: u64 = args.next().unwrap_or_else(|| "0".into()).parse()?;
    let slow = Duration::from_millis(args.next().unwrap_or_else(|| "2000".into()).parse()?);
    let served = Arc::new(AtomicU64::new(0));
    let log = match std::env::var_os("MOCK_SMS_LOG") {
        Some(path) => Some(Arc::new(Mutex::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?,
        ))),
        None => None,
    };
    let app = Router::new()
        .route(
            "/2010-04-01/Accounts/{sid}/Messages.json",
            post(
                move |State(served): State<Arc<AtomicU64>>,
                      Form(form): Form<HashMap<String, String>>| {
                    let log = log.clone();
                    async move {
                        let n = served.fetch_add(1, Ordering::Relaxed);
                        if let Some(log) = &log {
                            let at = SystemTime::now()
                                .duration_since(UNIX_EPOCH)
                                .unwrap_or_default();
                            let body = form.get("Body").map_or("", String::as_str);
                            let mut file = log.lock().unwrap_or_else(|e| e.into_inner());
                            let _ = writeln!(file, "{:.6}\t{body}", at.as_secs_f64());
                        }
                        let straggler = slow_every > 0 && n % slow_every == slow_every - 1;
                        tokio::time::sleep(if straggler { slow } else { latency }).await;
                        (
                            StatusCode::CREATED,
                            Json(serde_json::json!({ "sid": format!("SM{n:08}") })),
                        )
                    }
                },
            ),
        )
        .with_state(served);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    axum::serve(listener, app).await?;
    Ok(())
}
