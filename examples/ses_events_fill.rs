//! Fills an SQS queue with SES `Delivery` events, for `bench/ses_events.sh`
//! (issue 27): a deep events queue for fairlane's poller to drain.
//!
//! `cargo run --release --example ses_events_fill -- ENDPOINT_URL QUEUE_NAME IDS_FILE`
//!
//! Creates QUEUE_NAME on ENDPOINT_URL (static test keys), then sends, for
//! each line of IDS_FILE (a provider message id, then fairlane's id of the message), an SES event as a
//! configuration set writes it (`eventType: Delivery`, `mail.messageId`),
//! in SendMessageBatch calls of ten from eight tasks. Prints the queue's URL
//! on the last line.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::SendMessageBatchRequestEntry;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let usage = "ENDPOINT_URL QUEUE_NAME IDS_FILE";
    let endpoint = args.next().ok_or_else(|| anyhow::anyhow!(usage))?;
    let name = args.next().ok_or_else(|| anyhow::anyhow!(usage))?;
    let ids_file = args.next().ok_or_else(|| anyhow::anyhow!(usage))?;
    // A provider id a line, with fairlane's id of its message after a
    // space (the `message_id` tag SES carries back).
    let ids: Arc<Vec<(String, String)>> = Arc::new(
        std::fs::read_to_string(&ids_file)?
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty())
            .map(|line| {
                let (id, message_id) = line.split_once(' ').unwrap_or((line, ""));
                (id.to_owned(), message_id.trim().to_owned())
            })
            .collect(),
    );
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .endpoint_url(&endpoint)
        .region(aws_config::Region::new("us-east-1"))
        .credentials_provider(aws_sdk_sqs::config::Credentials::new(
            "test", "test", None, None, "static",
        ))
        .load()
        .await;
    let client = Client::new(&config);
    let url = client
        .create_queue()
        .queue_name(&name)
        .send()
        .await?
        .queue_url()
        .unwrap_or_default()
        .to_owned();
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (client, url, ids, next) = (client.clone(), url.clone(), ids.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let start = next.fetch_add(10, Ordering::Relaxed);
                if start >= ids.len() {
                    return anyhow::Ok(());
                }
                let entries = ids[start..(start + 10).min(ids.len())]
                    .iter()
                    .enumerate()
                    .map(|(n, (id, message_id))| {
                        let event = serde_json::json!({
                            "eventType": "Delivery",
                            "mail": {"messageId": id, "destination": ["customer@example.com"],
                                "tags": {"message_id": [message_id]}},
                            "delivery": {"recipients": ["customer@example.com"], "smtpResponse": "250 2.0.0 OK"}
                        });
                        SendMessageBatchRequestEntry::builder()
                            .id(n.to_string())
                            .message_body(event.to_string())
                            .build()
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                client
                    .send_message_batch()
                    .queue_url(&url)
                    .set_entries(Some(entries))
                    .send()
                    .await?;
            }
        }));
    }
    for task in tasks {
        task.await??;
    }
    eprintln!("{} events sent", ids.len());
    println!("{url}");
    Ok(())
}
