//! One SQLite driver or two (issue 45, item 3): the same point read of a
//! status row through sqlx's SQLite pool and through a rusqlite connection
//! on a thread of its own (how the store writer reads), from CONCURRENCY
//! tasks (default 64) for SECONDS (default 5) each.
//!
//! `cargo run --release --features driver-bench --example sqlite_drivers -- [SECONDS] [CONCURRENCY] [ROWS]`
//!
//! The file is a migrated fairlane store with ROWS (default 100,000)
//! messages. Prints reads per second and this process's CPU per read for
//! each driver. *Partial* by design: a read alone, no HTTP, no writer
//! traffic beside it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fairlane::store::Db;
use tokio::sync::{mpsc, oneshot};

/// This process's CPU time so far (user + system).
fn cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // utime and stime are fields 14 and 15; 12 and 13 after the ')'.
    Duration::from_millis((ticks(11) + ticks(12)) * 10)
}

type Ask = (String, oneshot::Sender<Option<String>>);

/// A rusqlite connection on a thread of its own, answering reads in order.
fn rusqlite_reader(path: std::path::PathBuf) -> mpsc::Sender<Ask> {
    let (asks, mut received) = mpsc::channel::<Ask>(1024);
    std::thread::spawn(move || {
        let conn = rusqlite::Connection::open(path).expect("open");
        while let Some((id, answer)) = received.blocking_recv() {
            let status = conn
                .prepare_cached("SELECT status FROM messages WHERE id = ?1")
                .and_then(|mut read| read.query_row([&id], |row| row.get::<_, String>(0)))
                .ok();
            let _ = answer.send(status);
        }
    });
    asks
}

async fn drive<F, Fut>(label: &str, seconds: u64, concurrency: usize, rows: u64, read: F)
where
    F: Fn(String) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Option<String>> + Send,
{
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let (started, cpu0) = (Instant::now(), cpu());
    let mut tasks = Vec::new();
    for task in 0..concurrency as u64 {
        let (stop, reads, read) = (stop.clone(), reads.clone(), read.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = task;
            while !stop.load(Ordering::Relaxed) {
                let found = read(format!("m{}", n % rows)).await;
                assert!(found.is_some(), "every row is there");
                reads.fetch_add(1, Ordering::Relaxed);
                n = n.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.expect("reader task");
    }
    let (elapsed, spent) = (started.elapsed(), cpu() - cpu0);
    let count = reads.load(Ordering::Relaxed);
    println!(
        "{label}: {count} reads in {:.1} s = {:.0}/s, {:.1} µs of CPU per read",
        elapsed.as_secs_f64(),
        count as f64 / elapsed.as_secs_f64(),
        spent.as_secs_f64() * 1e6 / count.max(1) as f64
    );
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let seconds = args.first().copied().unwrap_or(5);
    let concurrency = args.get(1).copied().unwrap_or(64) as usize;
    let rows = args.get(2).copied().unwrap_or(100_000);
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("drivers.db");
    let db = Db::open(&path, false).await?;
    {
        let mut conn = rusqlite::Connection::open(&path)?;
        let tx = conn.transaction()?;
        {
            let mut insert = tx.prepare(
                "INSERT INTO messages (id, tenant_id, channel, status, priority, lane, attempts, \
                 created_at, updated_at, test) VALUES (?1, 't', 'email', 'queued', 'normal', 'fast', 0, 1, 1, 0)",
            )?;
            for n in 0..rows {
                insert.execute([format!("m{n}")])?;
            }
        }
        tx.commit()?;
    }
    // sqlx's pool as the store had it: four read-only connections.
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(
            sqlx::sqlite::SqliteConnectOptions::new()
                .filename(&path)
                .read_only(true),
        )
        .await?;
    drive(
        "sqlx pool (4 readers)",
        seconds,
        concurrency,
        rows,
        move |id| {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, String>("SELECT status FROM messages WHERE id = $1")
                    .bind(id)
                    .fetch_optional(&pool)
                    .await
                    .ok()
                    .flatten()
            }
        },
    )
    .await;
    let reader = rusqlite_reader(path.clone());
    drive(
        "rusqlite, one thread",
        seconds,
        concurrency,
        rows,
        move |id| {
            let reader = reader.clone();
            async move {
                let (answer, answered) = oneshot::channel();
                reader.send((id, answer)).await.ok()?;
                answered.await.ok().flatten()
            }
        },
    )
    .await;
    Ok(())
}
