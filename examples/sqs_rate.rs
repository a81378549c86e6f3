//! The rate an SQS-compatible server sustains alone, with the calls and
//! batch sizes fairlane makes per message, so a fairlane figure measured on
//! it can be given as a share of the server's own (issue 26).
//!
//! `cargo run --release --example sqs_rate -- ENDPOINT_URL [SECONDS] [SENDERS] [RECEIVERS]`
//!
//! Creates a standard queue of its own on ENDPOINT_URL (static test keys),
//! then for SECONDS (default 10) runs SENDERS tasks (default 4) making
//! SendMessageBatch calls of ten entries (fairlane's relay: a body of about
//! the size fairlane sends, `MessageGroupId`, four message attributes) and
//! RECEIVERS tasks (default 4) making ReceiveMessage calls of up to ten
//! (wait 1 s, the two system attributes and all message attributes, as
//! fairlane's consumer asks) each followed by one DeleteMessageBatch of
//! what it got. Senders stop while more than 5,000 messages wait, so the
//! queue stays shallow as fairlane's does. Prints messages sent/s,
//! received and deleted/s, and the calls made per message, with the same
//! SDK client fairlane uses. The queue is deleted at the end.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{
    DeleteMessageBatchRequestEntry, MessageAttributeValue, MessageSystemAttributeName,
    SendMessageBatchRequestEntry,
};

const BODY: &str = r#"{"channel":"sms","to":"+15551234567","text":"Your login code is 123456","reference":"bench","idempotency_key":null}"#;

#[derive(Default)]
struct Counts {
    sent: AtomicU64,
    deleted: AtomicU64,
    calls: AtomicU64,
}

fn attribute(value: &str) -> anyhow::Result<MessageAttributeValue> {
    Ok(MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()?)
}

async fn send_loop(
    client: Client,
    url: String,
    counts: Arc<Counts>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let backlog = counts.sent.load(Ordering::Relaxed) - counts.deleted.load(Ordering::Relaxed);
        if backlog > 5_000 {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        }
        let mut entries = Vec::with_capacity(10);
        for id in 0..10 {
            n += 1;
            let tenant = format!("t{}", n % 4 + 1);
            entries.push(
                SendMessageBatchRequestEntry::builder()
                    .id(id.to_string())
                    .message_body(BODY)
                    .message_group_id(&tenant)
                    .delay_seconds(0)
                    .message_attributes("tenant", attribute(&tenant)?)
                    .message_attributes("channel", attribute("sms")?)
                    .message_attributes("priority", attribute("high")?)
                    .message_attributes("message_id", attribute(&uuid::Uuid::now_v7().to_string())?)
                    .build()?,
            );
        }
        counts.calls.fetch_add(1, Ordering::Relaxed);
        let out = client
            .send_message_batch()
            .queue_url(&url)
            .set_entries(Some(entries))
            .send()
            .await?;
        counts
            .sent
            .fetch_add(out.successful().len() as u64, Ordering::Relaxed);
    }
    Ok(())
}

async fn receive_loop(
    client: Client,
    url: String,
    counts: Arc<Counts>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    while !stop.load(Ordering::Relaxed) {
        counts.calls.fetch_add(1, Ordering::Relaxed);
        let out = client
            .receive_message()
            .queue_url(&url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .visibility_timeout(30)
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .message_system_attribute_names(MessageSystemAttributeName::SentTimestamp)
            .message_attribute_names("All")
            .send()
            .await?;
        let entries: Vec<_> = out
            .messages()
            .iter()
            .enumerate()
            .filter_map(|(id, message)| {
                DeleteMessageBatchRequestEntry::builder()
                    .id(id.to_string())
                    .receipt_handle(message.receipt_handle()?)
                    .build()
                    .ok()
            })
            .collect();
        if entries.is_empty() {
            continue;
        }
        counts.calls.fetch_add(1, Ordering::Relaxed);
        let out = client
            .delete_message_batch()
            .queue_url(&url)
            .set_entries(Some(entries))
            .send()
            .await?;
        counts
            .deleted
            .fetch_add(out.successful().len() as u64, Ordering::Relaxed);
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let endpoint = args.next().ok_or_else(|| {
        anyhow::anyhow!("usage: sqs_rate ENDPOINT_URL [SECONDS] [SENDERS] [RECEIVERS]")
    })?;
    let seconds: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(10);
    let senders: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(4);
    let receivers: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(4);

    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new("us-east-1"))
        .endpoint_url(&endpoint)
        .credentials_provider(aws_sdk_sqs::config::Credentials::new(
            "test", "test", None, None, "sqs_rate",
        ))
        .load()
        .await;
    let client = Client::new(&config);
    let name = format!("sqs-rate-{}", std::process::id());
    let url = client
        .create_queue()
        .queue_name(&name)
        .send()
        .await?
        .queue_url()
        .ok_or_else(|| anyhow::anyhow!("no queue URL"))?
        .to_owned();

    let counts = Arc::new(Counts::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..senders {
        tasks.push(tokio::spawn(send_loop(
            client.clone(),
            url.clone(),
            counts.clone(),
            stop.clone(),
        )));
    }
    for _ in 0..receivers {
        tasks.push(tokio::spawn(receive_loop(
            client.clone(),
            url.clone(),
            counts.clone(),
            stop.clone(),
        )));
    }
    // One second of warm-up, then the measured window.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (sent0, deleted0, calls0) = (
        counts.sent.load(Ordering::Relaxed),
        counts.deleted.load(Ordering::Relaxed),
        counts.calls.load(Ordering::Relaxed),
    );
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let elapsed = started.elapsed().as_secs_f64();
    let sent = counts.sent.load(Ordering::Relaxed) - sent0;
    let deleted = counts.deleted.load(Ordering::Relaxed) - deleted0;
    let calls = counts.calls.load(Ordering::Relaxed) - calls0;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await??;
    }
    client.delete_queue().queue_url(&url).send().await?;
    println!(
        "sqs_rate {senders} senders, {receivers} receivers, batches of 10, {elapsed:.1} s: \
         sent {:.0}/s, received and deleted {:.0}/s, {:.2} calls per message",
        sent as f64 / elapsed,
        deleted as f64 / elapsed,
        calls as f64 / deleted.max(1) as f64,
    );
    Ok(())
}
