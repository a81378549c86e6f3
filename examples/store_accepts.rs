//! Durable accepts per second of the store's write path on SQLite and on
//! PostgreSQL, and what a second instance adds on PostgreSQL (issue 10).
//!
//! `cargo run --release --example store_accepts -- [SECONDS] [CONCURRENCY] [PG_SERVER_URL]`
//!
//! Each run drives one accept writer (or two, as two instances would: a
//! pool and a group-committing writer each, on one database) from
//! CONCURRENCY tasks (default 64) for SECONDS (default 10): every accept is
//! a status row, an outbox row (the SQS backend's accept path, the only one
//! a PostgreSQL store has) and, for every other message, an idempotency
//! record, answered once its group committed. Four tenants. Prints accepts
//! per second and the p50/p99 wait of one accept.
//!
//! *Partial* by design: no HTTP and no SQS. The HTTP accept path on the SQS
//! backend waits for SQS's confirmation of each message, and against a
//! local moto server that bounds everything near 50-80 requests/s whatever
//! the store (see bench/instances.sh); this isolates the part this issue
//! changed. PG_SERVER_URL defaults to postgres://root@127.0.0.1:5432/postgres;
//! a database of its own is created there and dropped afterwards.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use fairlane::model::{Channel, Lane, MessageStatus, Priority, now_ms};
use fairlane::queue::OutboundMessage;
use fairlane::store::idempotency::StoredResponse;
use fairlane::store::messages::MessageRecord;
use fairlane::store::{AcceptEntry, Db, Writer};
use sqlx::{Connection, Executor, PgConnection};

fn entry(n: u64) -> AcceptEntry {
    let id = uuid::Uuid::now_v7().to_string();
    let tenant = format!("tenant-{}", n % 4);
    let now = now_ms();
    AcceptEntry {
        lane: Lane::Fast,
        record: MessageRecord {
            id: id.clone(),
            tenant_id: tenant.clone(),
            channel: Channel::Sms,
            status: MessageStatus::Queued,
            priority: Priority::Normal,
            lane: Lane::Fast,
            attempts: 0,
            reference: Some("bench".into()),
            metadata: None,
            created_at: now,
            updated_at: now,
            sent_at: None,
            last_error: None,
            provider_message_id: None,
            send_at: None,
            test: false,
            fragments: None,
            erased_at: None,
            provider: None,
            recipient: Some("+15550100".to_owned()),
            gate_wait_ms: None,
            template_id: None,
            template_version: None,
            attachment_bytes: None,
        },
        outbound: OutboundMessage {
            message_id: id.clone(),
            tenant_id: tenant.clone(),
            channel: Channel::Sms,
            priority: Priority::Normal,
            body: format!(
                r#"{{"id":"{id}","tenant_id":"{tenant}","channel":"sms","to":"+15551234567","text":"Your login code is 123456","priority":"normal"}}"#
            ),
            delay: Duration::ZERO,
        },
        idempotency: if n.is_multiple_of(2) {
            vec![StoredResponse {
                tenant_id: tenant,
                test: false,
                key: format!("key-{id}"),
                request_hash: "0".repeat(64),
                status_code: 202,
                response_body: format!(r#"{{"id":"{id}","status":"queued"}}"#),
                message_id: id,
                created_at: now,
                claimed_as: None,
            }]
        } else {
            Vec::new()
        },
        trace: None,
    }
}

/// Drives `writers` (round robin) from `concurrency` tasks for `seconds`;
/// returns accepts, and the sorted waits in µs.
async fn drive(writers: Vec<Arc<Writer>>, seconds: u64, concurrency: usize) -> (u64, Vec<u64>) {
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for task in 0..concurrency {
        let writer = writers[task % writers.len()].clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut waits = Vec::new();
            let mut n = task as u64;
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                if writer.accept(entry(n)).await.is_ok() {
                    waits.push(started.elapsed().as_micros() as u64);
                }
                n += concurrency as u64;
            }
            waits
        }));
    }
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut waits = Vec::new();
    for task in tasks {
        waits.extend(task.await.expect("task"));
    }
    waits.sort_unstable();
    (waits.len() as u64, waits)
}

fn report(label: &str, seconds: u64, (count, waits): (u64, Vec<u64>)) {
    let at = |q: f64| {
        waits
            .get(((waits.len() as f64) * q) as usize)
            .copied()
            .unwrap_or(0)
    };
    println!(
        "{label:<28} {:>9.0} accepts/s   p50 {:>6.2} ms   p99 {:>6.2} ms",
        count as f64 / seconds as f64,
        at(0.5) as f64 / 1000.0,
        at(0.99) as f64 / 1000.0
    );
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = fairlane::telemetry::init(&Default::default())?;
    let args: Vec<String> = std::env::args().collect();
    let seconds: u64 = args.get(1).map_or(Ok(10), |s| s.parse())?;
    let concurrency: usize = args.get(2).map_or(Ok(64), |s| s.parse())?;
    let server = args
        .get(3)
        .cloned()
        .unwrap_or_else(|| "postgres://root@127.0.0.1:5432/postgres".into());
    println!(
        "store_accepts: {seconds} s, {concurrency} concurrent accepts, outbox staging, 4 tenants"
    );

    // SQLite: the file and writer of one instance.
    let dir = tempfile::tempdir()?;
    let sqlite = Db::open(&dir.path().join("bench.db"), false).await?;
    let (writer, _stopped) = Writer::start(&sqlite, 512, 0)?;
    let sqlite_writer = Arc::new(writer);
    report(
        "sqlite, one instance",
        seconds,
        drive(vec![sqlite_writer], seconds, concurrency).await,
    );

    // PostgreSQL: one database; one instance, then two.
    let name = format!("fl_store_bench_{}", std::process::id());
    let mut admin = PgConnection::connect(&server).await?;
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .await?;
    let (base, _) = server.rsplit_once('/').expect("a database URL");
    let url = format!("{base}/{name}");
    let outcome = async {
        for instances in [1usize, 2] {
            let mut writers = Vec::new();
            for _ in 0..instances {
                let pg = Db::connect(&url, false).await?;
                let (writer, _stopped) = Writer::start(&pg, 512, 0)?;
                writers.push(Arc::new(writer));
            }
            let label = format!("postgres, {instances} instance(s)");
            report(&label, seconds, drive(writers, seconds, concurrency).await);
        }
        anyhow::Ok(())
    }
    .await;
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE {name} WITH (FORCE)"
        )))
        .await?;
    outcome
}
