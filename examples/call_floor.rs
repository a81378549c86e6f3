//! What a webhook call's client side costs with nothing else around it,
//! for `bench/call_floor.sh`: COUNT POSTs of a body shaped like a webhook's
//! (`message.sent`, about 700 bytes, signed headers) to URL, at most
//! CONCURRENCY at once, each answer read to its end. CLIENT is `fairlane`
//! (default: the dispatcher's own [`WebhookClient`], hyper's pooled
//! client) or `reqwest` (a reqwest client built as the dispatcher's was
//! before issue 27: timeout, no redirects, no proxy). Prints the calls a
//! second and this process's CPU per call.
//!
//!     cargo run --release --example call_floor -- http://127.0.0.1:8099/v1/messages 50000 64 fairlane

use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::header::HeaderValue;
use tokio::sync::Semaphore;

/// A signature of the right shape (not checked by the endpoint).
const SIGNATURE: &str = "v1,K5oZfzN95Z9UVu1EsfQmfVNQhnkZ2pj9o9NDN/H/pI4=";

/// This process's CPU time so far (user and system), in seconds (clock
/// ticks of 1/100 s, as Linux has them on x86-64).
fn cpu_secs() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // The fields after the command's closing parenthesis; utime and stime
    // are the 14th and 15th of the whole line.
    let rest = stat
        .rsplit_once(')')
        .ok_or_else(|| anyhow::anyhow!("unexpected /proc/self/stat"))?
        .1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    Ok(ticks / 100.0)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let url = args.next().ok_or_else(|| {
        anyhow::anyhow!("usage: call_floor URL [COUNT] [CONCURRENCY] [fairlane|reqwest]")
    })?;
    let count: usize = args.next().map_or(Ok(50_000), |n| n.parse())?;
    let concurrency: usize = args.next().map_or(Ok(64), |n| n.parse())?;
    let use_reqwest = match args.next().as_deref().unwrap_or("fairlane") {
        "fairlane" => false,
        "reqwest" => true,
        other => anyhow::bail!("CLIENT is fairlane or reqwest, not {other}"),
    };
    let settings = fairlane::config::WebhookSettings {
        allow_http: true,
        allow_private: vec!["127.0.0.1/32".parse()?],
        ..Default::default()
    };
    let policy = fairlane::webhooks::endpoint::EndpointPolicy::new(&settings);
    let ours = Arc::new(fairlane::webhooks::client::WebhookClient::new(
        &settings, &policy,
    )?);
    let parsed = url::Url::parse(&url)?;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .user_agent("fairlane-webhooks/bench")
        .build()?;
    let body = serde_json::to_vec(&serde_json::json!({
        "type": "message.sent",
        "timestamp": "2026-11-27T10:00:00.000Z",
        "data": {
            "id": "0193f3a4-7b1c-7d2e-9f00-0123456789ab",
            "tenant_id": "bench",
            "channel": "email",
            "status": "sent",
            "priority": "normal",
            "lane": "fast",
            "attempts": 1,
            "reference": null,
            "metadata": {},
            "provider_message_id": "log-0193f3a4-7b1c-7d2e-9f00-0123456789ab",
            "created_at": "2026-11-27T10:00:00.000Z",
            "sent_at": "2026-11-27T10:00:00.010Z",
            "updated_at": "2026-11-27T10:00:00.010Z",
            "send_at": null,
            "test": false,
            "fragments": null,
            "last_error": null
        }
    }))?;
    let slots = Arc::new(Semaphore::new(concurrency));
    let cpu0 = cpu_secs()?;
    let started = Instant::now();
    let mut calls = tokio::task::JoinSet::new();
    for n in 0..count {
        let permit = slots.clone().acquire_owned().await?;
        let (client, url, body) = (client.clone(), url.clone(), body.clone());
        let (ours, parsed) = (ours.clone(), parsed.clone());
        calls.spawn(async move {
            if !use_reqwest {
                let headers = [
                    (
                        "webhook-id",
                        HeaderValue::try_from(format!("evt_{n}")).unwrap(),
                    ),
                    ("webhook-timestamp", HeaderValue::from_static("1795000000")),
                    ("webhook-signature", HeaderValue::from_static(SIGNATURE)),
                ];
                let ok = ours
                    .post(&parsed, headers, body)
                    .await
                    .is_ok_and(|status| status.is_success());
                drop(permit);
                return ok;
            }
            let answer = client
                .post(&url)
                .header("content-type", "application/json")
                .header("webhook-id", format!("evt_{n}"))
                .header("webhook-timestamp", "1795000000")
                .header("webhook-signature", SIGNATURE)
                .body(body)
                .send()
                .await;
            let ok = match answer {
                Ok(response) => {
                    let ok = response.status().is_success();
                    let _ = response.bytes().await;
                    ok
                }
                Err(_) => false,
            };
            drop(permit);
            ok
        });
        while let Some(done) = calls.try_join_next() {
            anyhow::ensure!(done?, "a call was not answered 2xx");
        }
    }
    while let Some(done) = calls.join_next().await {
        anyhow::ensure!(done?, "a call was not answered 2xx");
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = cpu_secs()? - cpu0;
    println!(
        "{count} calls in {elapsed:.2} s: {:.0}/s; client CPU {:.1} µs per call",
        count as f64 / elapsed,
        1e6 * cpu / count as f64
    );
    Ok(())
}
