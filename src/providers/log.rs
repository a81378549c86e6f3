//! The development provider: instead of sending, it writes each delivery as
//! one JSON line to `log_path` (appended; created when missing) or to stdout,
//! and answers with a made-up `log-<uuid>` provider id.
//!
//! It lets `cargo run` and the integration tests exercise the whole path
//! without credentials, and a developer read what would have been sent (the
//! text is included). Writes go through one mutex so concurrent deliveries
//! never interleave inside a line. It fails only when the write fails, and
//! then transiently.
//!
//! A file is appended to with plain writes on the calling task's thread: a
//! line is a few hundred bytes into the page cache. A tokio `File` would
//! hand every line to the blocking pool and back: two thread switches per
//! delivery, about a fifth of a message's CPU in the pipeline benchmark
//! (bench/README.md, "Where a message's CPU goes"). Stdout stays
//! asynchronous: a pipe whose reader stalls must not stall a runtime
//! thread.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::PoisonError;

use anyhow::Context;
use async_trait::async_trait;
use serde::Serialize;
use tokio::io::AsyncWriteExt;
use tracing::debug;

use super::{Delivered, Failure, Provider, ProviderError};
use crate::message::DeliveryPayload;
use crate::model::{Channel, Priority};

/// Writes deliveries as JSON lines.
#[derive(Debug)]
pub struct LogProvider {
    /// Where lines go.
    sink: Sink,
    /// The file written to, for error messages; `None` for stdout.
    path: Option<PathBuf>,
}

/// Each behind a mutex that keeps each line whole.
#[derive(Debug)]
enum Sink {
    File(std::sync::Mutex<std::fs::File>),
    Stdout(tokio::sync::Mutex<tokio::io::Stdout>),
}

/// One line of the log.
#[derive(Serialize)]
struct Line<'a> {
    /// When the delivery was written, RFC 3339 UTC.
    timestamp: String,
    provider_message_id: &'a str,
    id: &'a str,
    tenant_id: &'a str,
    channel: Channel,
    priority: Priority,
    to: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    subject: Option<&'a str>,
    text: &'a str,
    /// Bytes of the text, to spot oversize SMS at a glance.
    text_bytes: usize,
    /// Bytes of the HTML part; the part itself is left out to keep lines short.
    #[serde(skip_serializing_if = "Option::is_none")]
    html_bytes: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reference: Option<&'a str>,
    /// The tenant's sender identity, when the message has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    sender: Option<&'a crate::message::SenderOnMessage>,
    /// Headers an email adds (the tenant's, `List-Unsubscribe`).
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    headers: &'a [crate::message::EmailHeader],
}

impl LogProvider {
    /// Appends to `path` (created if missing), or writes to stdout when
    /// `path` is `None`. Opening fails early, at start-up, when the file
    /// cannot be written.
    pub async fn open(path: Option<&Path>) -> anyhow::Result<Self> {
        let sink = match path {
            Some(path) => Sink::File(std::sync::Mutex::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .with_context(|| format!("cannot open delivery log {}", path.display()))?,
            )),
            None => Sink::Stdout(tokio::sync::Mutex::new(tokio::io::stdout())),
        };
        Ok(Self {
            sink,
            path: path.map(Path::to_path_buf),
        })
    }
}

#[async_trait]
impl Provider for LogProvider {
    async fn send(&self, message: &DeliveryPayload) -> Result<Delivered, ProviderError> {
        let provider_message_id = format!("log-{}", uuid::Uuid::new_v4());
        let line = Line {
            timestamp: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            provider_message_id: &provider_message_id,
            id: &message.id,
            tenant_id: &message.tenant_id,
            channel: message.channel,
            priority: message.priority,
            to: &message.to,
            subject: message.subject.as_deref(),
            text: &message.text,
            text_bytes: message.text.len(),
            html_bytes: message.html.as_deref().map(str::len),
            reference: message.reference.as_deref(),
            sender: message.sender.as_ref(),
            headers: &message.headers,
        };
        let mut bytes = serde_json::to_vec(&line).map_err(|err| {
            ProviderError::Transient(Failure::new(
                "delivery log not written",
                format!("cannot encode delivery log line: {err}"),
            ))
        })?;
        bytes.push(b'\n');

        let written = match &self.sink {
            Sink::File(file) => file
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .write_all(&bytes),
            Sink::Stdout(stdout) => {
                let mut stdout = stdout.lock().await;
                match stdout.write_all(&bytes).await {
                    // Waits until the line has left tokio's buffer.
                    Ok(()) => stdout.flush().await,
                    Err(err) => Err(err),
                }
            }
        };
        written.map_err(|err| {
            let target = self
                .path
                .as_deref()
                .map_or_else(|| "stdout".to_owned(), |p| p.display().to_string());
            ProviderError::Transient(Failure::new(
                "delivery log not written",
                format!("cannot write delivery log {target}: {err}"),
            ))
        })?;
        debug!(message_id = %message.id, %provider_message_id, "Delivery logged.");
        Ok(Delivered {
            provider_message_id,
        })
    }

    fn name(&self) -> &'static str {
        "log"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::tests::payload;
    use serde_json::Value;

    #[tokio::test]
    async fn two_deliveries_become_two_json_lines_with_their_ids() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("deliveries.jsonl");
        let provider = LogProvider::open(Some(&path)).await.unwrap();
        let mut first = payload(Channel::Email, "a@example.com");
        first.id = "msg-1".into();
        first.html = Some("<p>hi</p>".into());
        let mut second = payload(Channel::Sms, "+15551234567");
        second.id = "msg-2".into();

        let one = provider.send(&first).await.unwrap();
        let two = provider.send(&second).await.unwrap();

        let text = tokio::fs::read_to_string(&path).await.unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert_eq!(lines[0]["id"], "msg-1");
        assert_eq!(lines[0]["channel"], "email");
        assert_eq!(lines[0]["subject"], "Your code");
        assert_eq!(lines[0]["html_bytes"], 9);
        assert_eq!(
            lines[0]["provider_message_id"],
            one.provider_message_id.as_str()
        );
        assert_eq!(lines[1]["id"], "msg-2");
        assert_eq!(lines[1]["tenant_id"], "acme");
        assert_eq!(lines[1]["to"], "+15551234567");
        assert_eq!(lines[1]["priority"], "high");
        assert_eq!(
            lines[1]["provider_message_id"],
            two.provider_message_id.as_str()
        );
        assert!(one.provider_message_id.starts_with("log-"));
        assert_ne!(one.provider_message_id, two.provider_message_id);
    }

    #[tokio::test]
    async fn an_existing_log_is_appended_to() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("deliveries.jsonl");
        tokio::fs::write(&path, "{\"earlier\":true}\n")
            .await
            .unwrap();
        let provider = LogProvider::open(Some(&path)).await.unwrap();
        provider
            .send(&payload(Channel::Sms, "+15551234567"))
            .await
            .unwrap();
        let text = tokio::fs::read_to_string(&path).await.unwrap();
        assert!(text.starts_with("{\"earlier\":true}\n"), "{text}");
        assert_eq!(text.lines().count(), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_deliveries_never_share_a_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("deliveries.jsonl");
        let provider = std::sync::Arc::new(LogProvider::open(Some(&path)).await.unwrap());
        let tasks: Vec<_> = (0..20)
            .map(|i| {
                let provider = provider.clone();
                tokio::spawn(async move {
                    let mut message = payload(Channel::Sms, "+15551234567");
                    message.id = format!("msg-{i}");
                    message.text = "x".repeat(4000);
                    provider.send(&message).await.unwrap();
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        let text = tokio::fs::read_to_string(&path).await.unwrap();
        let mut ids: Vec<String> = text
            .lines()
            .map(|line| {
                serde_json::from_str::<Value>(line).unwrap()["id"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 20);
    }

    #[tokio::test]
    async fn a_log_in_a_missing_directory_fails_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let err = LogProvider::open(Some(&dir.path().join("no/such/dir/log.jsonl")))
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("cannot open delivery log"),
            "{err}"
        );
    }
}
