//! Delivery providers: the last hop of a message, from a [`DeliveryPayload`]
//! to Amazon SES (email), a Twilio-compatible HTTP API (SMS) or a JSON-lines
//! log (development).
//!
//! Each provider classifies its own failures as [`ProviderError::Permanent`],
//! [`ProviderError::Transient`] or [`ProviderError::Throttled`] where it knows
//! what the answer meant; the consumer decides on ack, retry and dead-letter
//! from that class alone. Providers do not retry: one call to
//! [`Provider::send`] is one provider call, so the consumer's attempt count
//! and backoff stay honest and throttling reaches the provider gate.

pub mod log;
pub mod ses;
pub mod sms_http;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::bail;
use async_trait::async_trait;

use crate::config::{ProviderKind, ProviderSettings};
use crate::message::DeliveryPayload;
use crate::model::Channel;

pub use self::log::LogProvider;
pub use self::ses::SesProvider;
pub use self::sms_http::SmsHttpProvider;

/// Request timeout when `timeout_ms` is not set.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// A way to deliver messages of one channel.
#[async_trait]
pub trait Provider: Send + Sync {
    /// Delivers one message; Ok carries the provider's message id.
    async fn send(&self, message: &DeliveryPayload) -> Result<Delivered, ProviderError>;

    /// Short stable name for metrics labels and logs: `ses`, `http` or `log`.
    fn name(&self) -> &'static str;
}

/// A message the provider accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivered {
    /// The provider's id for the message (SES `MessageId`, SMS `sid`,
    /// `log-<uuid>`), stored so an operator can trace it at the provider.
    pub provider_message_id: String,
}

/// Why a delivery failed, classified where the failure was understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProviderError {
    /// Retrying cannot help (rejected content, invalid recipient, bad
    /// credentials or account state): dead-letter at once.
    #[error("permanent provider error: {0}")]
    Permanent(String),
    /// The provider or the path to it failed (5xx, timeout, connection):
    /// retry with backoff, spending one attempt.
    #[error("transient provider error: {0}")]
    Transient(String),
    /// The provider asked us to slow down: defer without spending the retry
    /// budget, for `retry_after` when the provider said how long.
    #[error("provider throttled: {detail}")]
    Throttled {
        retry_after: Option<Duration>,
        detail: String,
    },
}

impl ProviderError {
    /// True when a later attempt may succeed (transient or throttled).
    pub fn is_retryable(&self) -> bool {
        !matches!(self, ProviderError::Permanent(_))
    }

    /// The word used for metrics labels: `permanent`, `transient`, `throttled`.
    pub fn kind(&self) -> &'static str {
        match self {
            ProviderError::Permanent(_) => "permanent",
            ProviderError::Transient(_) => "transient",
            ProviderError::Throttled { .. } => "throttled",
        }
    }
}

/// Builds the provider `settings` choose for `channel`.
///
/// Email goes through `ses` or `log`, SMS through `http` or `log`; other
/// combinations are refused (configuration validation refuses them too).
/// With `public_url`, the `http` SMS provider asks for status callbacks
/// (see [`crate::receipts::twilio`]).
pub async fn build(
    settings: &ProviderSettings,
    channel: Channel,
    public_url: Option<&str>,
) -> anyhow::Result<Arc<dyn Provider>> {
    let provider: Arc<dyn Provider> = match (channel, settings.kind) {
        (_, ProviderKind::Log) => Arc::new(LogProvider::open(settings.log_path.as_deref()).await?),
        (Channel::Email, ProviderKind::Ses) => {
            Arc::new(SesProvider::from_settings(settings).await?)
        }
        (Channel::Sms, ProviderKind::Http) => Arc::new(
            SmsHttpProvider::from_settings(settings)?
                .with_status_callback(public_url.map(|url| {
                    format!("{}{}", url.trim_end_matches('/'), sms_http::CALLBACK_PATH)
                })),
        ),
        (Channel::Email, ProviderKind::Http) => {
            bail!("providers.email.kind = \"http\" is not supported; use \"ses\" or \"log\"")
        }
        (Channel::Sms, ProviderKind::Ses) => {
            bail!("providers.sms.kind = \"ses\" is not supported; use \"http\" or \"log\"")
        }
    };
    tracing::info!(%channel, provider = provider.name(), "Provider ready.");
    Ok(provider)
}

/// Reads a `Retry-After` value: delay seconds (`7`) or an HTTP date
/// (`Wed, 21 Oct 2015 07:28:00 GMT`, counted from now; a past date is zero).
pub(crate) fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = chrono::DateTime::parse_from_rfc2822(value).ok()?;
    let at = SystemTime::from(at);
    Some(
        at.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

/// An error and its sources, joined with `: ` (the SDK's and reqwest's own
/// texts leave the cause in the source chain).
pub(crate) fn causes(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Cuts a provider's answer to a length fit for `last_error`, on a character
/// boundary.
pub(crate) fn truncate(text: &str, max_chars: usize) -> String {
    match text.char_indices().nth(max_chars) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Priority;

    #[test]
    fn retry_after_reads_seconds_and_http_dates() {
        assert_eq!(parse_retry_after("7"), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after(" 0 "), Some(Duration::ZERO));
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO)
        );
        let later = chrono::Utc::now() + chrono::Duration::seconds(120);
        let header = later.format("%a, %d %b %Y %H:%M:%S GMT").to_string();
        let parsed = parse_retry_after(&header).unwrap();
        assert!(
            parsed > Duration::from_secs(100) && parsed <= Duration::from_secs(120),
            "{parsed:?}"
        );
        assert_eq!(parse_retry_after("soon"), None);
        assert_eq!(parse_retry_after("-3"), None);
    }

    #[test]
    fn truncation_keeps_short_text_and_cuts_long_text_on_a_character() {
        assert_eq!(truncate("short", 10), "short");
        assert_eq!(truncate("ééééé", 3), "ééé…");
    }

    #[tokio::test]
    async fn build_refuses_a_provider_kind_of_the_other_channel() {
        let mut settings = settings(ProviderKind::Http);
        let err = build(&settings, Channel::Email, None).await.err().unwrap();
        assert!(err.to_string().contains("providers.email.kind"), "{err}");
        settings.kind = ProviderKind::Ses;
        let err = build(&settings, Channel::Sms, None).await.err().unwrap();
        assert!(err.to_string().contains("providers.sms.kind"), "{err}");
    }

    #[tokio::test]
    async fn build_chooses_the_provider_named_by_kind() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = settings(ProviderKind::Log);
        log.log_path = Some(dir.path().join("deliveries.jsonl"));
        assert_eq!(
            build(&log, Channel::Email, None).await.unwrap().name(),
            "log"
        );
        assert_eq!(build(&log, Channel::Sms, None).await.unwrap().name(), "log");

        let mut http = settings(ProviderKind::Http);
        http.base_url = Some("http://127.0.0.1:9".into());
        http.account_sid = Some("AC123".into());
        http.auth_token = Some("token".to_owned().into());
        http.from = Some("+15550001111".into());
        assert_eq!(
            build(&http, Channel::Sms, None).await.unwrap().name(),
            "http"
        );

        let mut ses = settings(ProviderKind::Ses);
        ses.region = Some("us-east-1".into());
        ses.endpoint_url = Some("http://127.0.0.1:9".into());
        ses.from = Some("noreply@example.com".into());
        assert_eq!(
            build(&ses, Channel::Email, None).await.unwrap().name(),
            "ses"
        );
    }

    #[test]
    fn error_classes_say_whether_to_retry() {
        assert!(!ProviderError::Permanent("x".into()).is_retryable());
        assert!(ProviderError::Transient("x".into()).is_retryable());
        let throttled = ProviderError::Throttled {
            retry_after: None,
            detail: "x".into(),
        };
        assert!(throttled.is_retryable());
        assert_eq!(throttled.kind(), "throttled");
    }

    pub(crate) fn settings(kind: ProviderKind) -> ProviderSettings {
        ProviderSettings {
            kind,
            rate_per_second: 10.0,
            burst: 10,
            from: None,
            region: None,
            endpoint_url: None,
            access_key_id: None,
            secret_access_key: None,
            base_url: None,
            account_sid: None,
            auth_token: None,
            timeout_ms: None,
            log_path: None,
            configuration_set: None,
            events_queue_url: None,
            breaker_failures: 5,
            breaker_open_ms: 1000,
            breaker_max_open_secs: 30,
        }
    }

    /// A small valid payload for provider tests.
    pub(crate) fn payload(channel: Channel, to: &str) -> DeliveryPayload {
        DeliveryPayload {
            id: "01J0000000000000000000000A".into(),
            tenant_id: "acme".into(),
            channel,
            to: to.into(),
            subject: (channel == Channel::Email).then(|| "Your code".into()),
            text: "Your code is 123456".into(),
            html: None,
            priority: Priority::High,
            reference: None,
        }
    }
}
