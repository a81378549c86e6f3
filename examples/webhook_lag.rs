//! Two tenants' webhooks side by side, for `bench/webhook_lag.sh` (issue
//! 27): does a slow, then failing, endpoint hold back another tenant's
//! webhooks?
//!
//! `cargo run --release --example webhook_lag -- BASE_URL ADMIN_TOKEN [RATE] [SECONDS]`
//!
//! Against a running fairlane (BASE_URL, its admin token; webhooks to
//! `http://127.0.0.1` allowed), this program:
//! 1. serves two endpoints on 127.0.0.1: `/healthy` answers 204 at once and
//!    records each call's lag (the event's `timestamp` in the body → the
//!    call's arrival); `/troubled` answers 204 after 100 ms for the first
//!    [`SLOW_FOR`], then 500 for [`FAILING_FOR`], then 204 at once;
//! 2. makes a plan out of the way of the load and two tenants, `healthy`
//!    and `troubled`, each with a key and a webhook on `message.sent` to
//!    its endpoint;
//! 3. sends RATE emails a second for each tenant (default 500) for SECONDS
//!    (default 60), at most 64 requests in flight;
//! 4. waits until every accepted healthy message's call has arrived (at
//!    most 60 s more) and prints, per 5-second window of arrival, the
//!    healthy calls and their lag p50/p99/max, and the troubled endpoint's
//!    calls by answer; then the healthy lag over the whole run.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use serde_json::{Value, json};
use tokio::sync::Semaphore;

/// How long the troubled endpoint is slow before it fails.
const SLOW_FOR: Duration = Duration::from_secs(15);
/// How long it then fails.
const FAILING_FOR: Duration = Duration::from_secs(30);
/// The slow endpoint's delay.
const SLOW_ANSWER: Duration = Duration::from_millis(100);
/// The width of a window in the printed table.
const WINDOW_SECS: u64 = 5;

#[derive(Default)]
struct Seen {
    /// Healthy calls: (seconds since start at arrival, lag in ms).
    healthy: Vec<(f64, f64)>,
    /// Troubled calls: (seconds since start at arrival, answered 2xx).
    troubled: Vec<(f64, bool)>,
}

#[derive(Clone)]
struct Sink {
    started: Instant,
    seen: Arc<Mutex<Seen>>,
}

fn lag_ms(body: &[u8]) -> Option<f64> {
    let body: Value = serde_json::from_slice(body).ok()?;
    let at = chrono::DateTime::parse_from_rfc3339(body["timestamp"].as_str()?).ok()?;
    let lag = chrono::Utc::now().signed_duration_since(at);
    Some(lag.num_microseconds()? as f64 / 1000.0)
}

async fn healthy(State(sink): State<Sink>, body: Bytes) -> StatusCode {
    let at = sink.started.elapsed().as_secs_f64();
    let lag = lag_ms(&body).unwrap_or(f64::NAN);
    sink.seen.lock().unwrap().healthy.push((at, lag));
    StatusCode::NO_CONTENT
}

async fn troubled(State(sink): State<Sink>) -> StatusCode {
    let since = sink.started.elapsed();
    let answer = if since < SLOW_FOR {
        tokio::time::sleep(SLOW_ANSWER).await;
        StatusCode::NO_CONTENT
    } else if since < SLOW_FOR + FAILING_FOR {
        StatusCode::INTERNAL_SERVER_ERROR
    } else {
        StatusCode::NO_CONTENT
    };
    let at = sink.started.elapsed().as_secs_f64();
    sink.seen
        .lock()
        .unwrap()
        .troubled
        .push((at, answer.is_success()));
    answer
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let usage = "BASE_URL ADMIN_TOKEN [RATE] [SECONDS]";
    let base = args.next().ok_or_else(|| anyhow::anyhow!(usage))?;
    let base = base.trim_end_matches('/').to_owned();
    let admin = args.next().ok_or_else(|| anyhow::anyhow!(usage))?;
    let rate: u64 = args.next().unwrap_or_else(|| "500".into()).parse()?;
    let seconds: u64 = args.next().unwrap_or_else(|| "60".into()).parse()?;

    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()?;
    let admin_call = |method: reqwest::Method, path: &str, body: Value| {
        client
            .request(method, format!("{base}{path}"))
            .bearer_auth(&admin)
            .json(&body)
            .send()
    };
    let plan = json!({"lane": "fast", "rate_per_second": 1000000, "burst": 1000000,
                      "daily_quota": 1000000000, "max_in_flight": 100000});
    admin_call(reqwest::Method::PUT, "/v1/admin/plans/lagbench", plan)
        .await?
        .error_for_status()?;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let sink_at = listener.local_addr()?;
    let sink = Sink {
        started: Instant::now(),
        seen: Arc::default(),
    };
    let app = axum::Router::new()
        .route("/healthy", post(healthy))
        .route("/troubled", post(troubled))
        .with_state(sink.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let mut keys = Vec::new();
    for tenant in ["healthy", "troubled"] {
        admin_call(
            reqwest::Method::POST,
            "/v1/admin/tenants",
            json!({"id": tenant, "name": tenant, "plan": "lagbench"}),
        )
        .await?
        .error_for_status()?;
        let key: Value = admin_call(
            reqwest::Method::POST,
            &format!("/v1/admin/tenants/{tenant}/keys"),
            json!({}),
        )
        .await?
        .error_for_status()?
        .json()
        .await?;
        let key = key["key"].as_str().unwrap_or_default().to_owned();
        admin_call(
            reqwest::Method::PUT,
            &format!("/v1/admin/tenants/{tenant}/webhook"),
            json!({"url": format!("http://{sink_at}/{tenant}"), "events": ["message.sent"]}),
        )
        .await?
        .error_for_status()?;
        keys.push(key);
    }

    // The load: every 10 ms, RATE/100 sends per tenant (the remainder
    // spread over the ticks), at most 64 in flight.
    let in_flight = Arc::new(Semaphore::new(64));
    let accepted = Arc::new([
        std::sync::atomic::AtomicU64::new(0),
        std::sync::atomic::AtomicU64::new(0),
    ]);
    let refused = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let load_started = Instant::now();
    let mut owed = [0.0_f64; 2];
    let body = json!({"channel": "email", "to": "someone@example.com", "subject": "Lag",
                      "text": "Webhook lag bench.", "reference": "lag"});
    let mut tasks = Vec::new();
    while load_started.elapsed() < Duration::from_secs(seconds) {
        tick.tick().await;
        for (i, key) in keys.iter().enumerate() {
            owed[i] += rate as f64 / 100.0;
            while owed[i] >= 1.0 {
                owed[i] -= 1.0;
                let permit = in_flight.clone().acquire_owned().await?;
                let request = client
                    .post(format!("{base}/v1/messages"))
                    .bearer_auth(key)
                    .json(&body);
                let (accepted, refused) = (accepted.clone(), refused.clone());
                tasks.push(tokio::spawn(async move {
                    let answer = request.send().await;
                    drop(permit);
                    match answer {
                        Ok(answer) if answer.status() == StatusCode::ACCEPTED => {
                            accepted[i].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        _ => {
                            refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }));
            }
        }
    }
    for task in tasks {
        task.await?;
    }
    let load_secs = load_started.elapsed().as_secs_f64();
    let accepted = [0, 1].map(|i| accepted[i].load(std::sync::atomic::Ordering::Relaxed));
    println!(
        "sent for {load_secs:.1} s: healthy {} and troubled {} accepted ({:.0}/s each asked), {} refused",
        accepted[0],
        accepted[1],
        rate,
        refused.load(std::sync::atomic::Ordering::Relaxed)
    );

    let deadline = Instant::now() + Duration::from_secs(60);
    while (sink.seen.lock().unwrap().healthy.len() as u64) < accepted[0]
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seen = std::mem::take(&mut *sink.seen.lock().unwrap());
    println!(
        "the troubled endpoint: 100 ms answers until {} s, 500 until {} s, then 204 at once",
        SLOW_FOR.as_secs(),
        (SLOW_FOR + FAILING_FOR).as_secs()
    );
    println!(
        "{:>9} | {:>13} {:>8} {:>8} {:>8} | {:>14} {:>10}",
        "window s", "healthy calls", "p50 ms", "p99 ms", "max ms", "troubled 2xx", "troubled 500"
    );
    let last = seen
        .healthy
        .iter()
        .map(|(at, _)| *at)
        .chain(seen.troubled.iter().map(|(at, _)| *at))
        .fold(0.0_f64, f64::max);
    let mut window = 0;
    while (window * WINDOW_SECS) as f64 <= last {
        let (from, to) = (
            (window * WINDOW_SECS) as f64,
            ((window + 1) * WINDOW_SECS) as f64,
        );
        let mut lags: Vec<f64> = seen
            .healthy
            .iter()
            .filter(|(at, _)| (from..to).contains(at))
            .map(|(_, lag)| *lag)
            .collect();
        lags.sort_by(f64::total_cmp);
        let troubled: Vec<bool> = seen
            .troubled
            .iter()
            .filter(|(at, _)| (from..to).contains(at))
            .map(|(_, ok)| *ok)
            .collect();
        let ok = troubled.iter().filter(|ok| **ok).count();
        println!(
            "{:>4}-{:<4} | {:>13} {:>8.1} {:>8.1} {:>8.1} | {:>14} {:>10}",
            from,
            to,
            lags.len(),
            quantile(&lags, 0.5),
            quantile(&lags, 0.99),
            lags.last().copied().unwrap_or(f64::NAN),
            ok,
            troubled.len() - ok
        );
        window += 1;
    }
    let mut lags: Vec<f64> = seen.healthy.iter().map(|(_, lag)| *lag).collect();
    lags.sort_by(f64::total_cmp);
    let distinct_troubled_ok = seen.troubled.iter().filter(|(_, ok)| *ok).count();
    println!(
        "healthy: {} of {} calls arrived, lag p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; troubled: {} calls answered 2xx of {} accepted messages",
        lags.len(),
        accepted[0],
        quantile(&lags, 0.5),
        quantile(&lags, 0.99),
        lags.last().copied().unwrap_or(f64::NAN),
        distinct_troubled_ok,
        accepted[1]
    );
    Ok(())
}
