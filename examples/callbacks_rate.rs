//! Signed Twilio status callbacks at full speed, for `bench/receipts.sh`
//! (issue 27): how fast fairlane checks, matches and records them.
//!
//! `cargo run --release --example callbacks_rate -- BASE_URL AUTH_TOKEN SIDS_FILE [CONCURRENCY] [STATUS]`
//!
//! Reads one provider message id per line from SIDS_FILE, with fairlane's
//! id of the message after a space, and POSTs, for each, the form
//! `MessageSid=…&MessageStatus=STATUS` (default `delivered`) to
//! `BASE_URL/v1/callbacks/sms?message_id=…` (the URL fairlane gave the
//! provider for the message) with the
//! `X-Twilio-Signature` Twilio would send (keyed with AUTH_TOKEN, over that
//! URL: BASE_URL must be fairlane's `server.public_url`), from CONCURRENCY
//! tasks (default 64) on keep-alive connections. Prints the callbacks per
//! second, the latency p50/p99/max and the answers by status code.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use fairlane::receipts::twilio;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let usage = "BASE_URL AUTH_TOKEN SIDS_FILE [CONCURRENCY] [STATUS]";
    let base = args.next().ok_or_else(|| anyhow::anyhow!(usage))?;
    let token = args.next().ok_or_else(|| anyhow::anyhow!(usage))?;
    let sids_file = args.next().ok_or_else(|| anyhow::anyhow!(usage))?;
    let concurrency: usize = args.next().unwrap_or_else(|| "64".into()).parse()?;
    let status = args.next().unwrap_or_else(|| "delivered".into());
    let base_url = format!("{}/v1/callbacks/sms", base.trim_end_matches('/'));
    let sids: Vec<(String, String)> = std::fs::read_to_string(&sids_file)?
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .map(|line| {
            let (sid, id) = line.split_once(' ').unwrap_or((line, ""));
            (sid.to_owned(), id.trim().to_owned())
        })
        .collect();
    // Signed beforehand, so the figure is fairlane's, not this client's.
    let requests: Arc<Vec<(String, String, String)>> = Arc::new(
        sids.iter()
            .map(|(sid, id)| {
                let form = vec![
                    ("MessageSid".to_owned(), sid.clone()),
                    ("MessageStatus".to_owned(), status.clone()),
                ];
                let url = if id.is_empty() {
                    base_url.clone()
                } else {
                    format!("{base_url}?message_id={id}")
                };
                let signature = twilio::signature(&token, &url, &form);
                let body = format!("MessageSid={sid}&MessageStatus={status}");
                (url, body, signature)
            })
            .collect(),
    );
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()?;
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (client, requests, next) = (client.clone(), requests.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut seen: Vec<(Duration, u16)> = Vec::new();
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                let Some((url, body, signature)) = requests.get(n) else {
                    return seen;
                };
                let sent = Instant::now();
                let code = match client
                    .post(url)
                    .header("content-type", "application/x-www-form-urlencoded")
                    .header("x-twilio-signature", signature)
                    .body(body.clone())
                    .send()
                    .await
                {
                    Ok(answer) => answer.status().as_u16(),
                    Err(_) => 0,
                };
                seen.push((sent.elapsed(), code));
            }
        }));
    }
    let mut all = Vec::with_capacity(requests.len());
    for task in tasks {
        all.extend(task.await?);
    }
    let elapsed = started.elapsed();
    all.sort_by_key(|(latency, _)| *latency);
    let at = |q: f64| all[((all.len() as f64 * q) as usize).min(all.len() - 1)].0;
    let mut codes = std::collections::BTreeMap::new();
    for (_, code) in &all {
        *codes.entry(*code).or_insert(0usize) += 1;
    }
    println!(
        "callbacks_rate {} callbacks, {concurrency} at once, {:.1} s: {:.0}/s, latency p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms, answers {codes:?}",
        all.len(),
        elapsed.as_secs_f64(),
        all.len() as f64 / elapsed.as_secs_f64(),
        at(0.5).as_secs_f64() * 1e3,
        at(0.99).as_secs_f64() * 1e3,
        all.last()
            .map_or(0.0, |(latency, _)| latency.as_secs_f64() * 1e3),
    );
    Ok(())
}
