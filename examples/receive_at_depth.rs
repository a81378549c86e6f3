//! How long one receive of the embedded queue takes at depth (issue 8: "keep
//! receives O(batch) at depth: measure a receive at 1 M queued rows").
//!
//! `cargo run --release --example receive_at_depth -- [ROWS] [TENANTS]`
//!
//! Fills a fresh SQLite file's fast lane with ROWS messages (default
//! 1,000,000) from TENANTS tenants (default 100), a tenth of them high, the
//! rest normal and low, then times 100 receives of 10 messages each, deleting
//! what was received so every receive walks to fresh rows. Prints the median
//! and p99 receive time, and the same at a depth of 10,000 for comparison.

use std::time::{Duration, Instant};

use fairlane::config::Settings;
use fairlane::model::{Channel, Lane, Priority};
use fairlane::queue::embedded::EmbeddedQueue;
use fairlane::queue::{LaneQueue, OutboundMessage};
use fairlane::store::SqliteDb;
use fairlane::store::sqlite::writer::StoreWriter;

async fn measure(rows: usize, tenants: usize) -> anyhow::Result<(Duration, Duration)> {
    let dir = tempfile::tempdir()?;
    let db = SqliteDb::open(&dir.path().join("depth.db"), false).await?;
    let lanes = Settings::from_toml_overlay("")?.lanes;
    let (writer, _stopped) = StoreWriter::spawn(&db, 512)?;
    let queue = EmbeddedQueue::open(db, lanes, writer).await?;
    let mut sent = 0;
    while sent < rows {
        let batch: Vec<OutboundMessage> = (sent..(sent + 5000).min(rows))
            .map(|n| OutboundMessage {
                message_id: format!("m{n}"),
                tenant_id: format!("t{}", n % tenants),
                channel: Channel::Sms,
                priority: match n % 10 {
                    0 => Priority::High,
                    1..=5 => Priority::Normal,
                    _ => Priority::Low,
                },
                body: format!("{{\"n\":{n}}}"),
                delay: Duration::ZERO,
            })
            .collect();
        sent += batch.len();
        queue.send_batch(Lane::Fast, batch).await?;
    }
    let mut times = Vec::with_capacity(100);
    for _ in 0..100 {
        let started = Instant::now();
        let got = queue.receive(Lane::Fast, 10, Duration::ZERO).await?;
        times.push(started.elapsed());
        anyhow::ensure!(got.len() == 10, "a receive at depth returned {}", got.len());
        let receipts: Vec<String> = got.into_iter().map(|m| m.receipt).collect();
        queue.delete_batch(Lane::Fast, &receipts).await?;
    }
    times.sort();
    Ok((times[times.len() / 2], times[times.len() * 99 / 100]))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let rows: usize = args.next().unwrap_or_else(|| "1000000".into()).parse()?;
    let tenants: usize = args.next().unwrap_or_else(|| "100".into()).parse()?;
    for depth in [10_000, rows] {
        let (p50, p99) = measure(depth, tenants).await?;
        println!(
            "depth {depth:>9}: receive of 10: p50 {:.3} ms, p99 {:.3} ms",
            p50.as_secs_f64() * 1000.0,
            p99.as_secs_f64() * 1000.0
        );
    }
    Ok(())
}
