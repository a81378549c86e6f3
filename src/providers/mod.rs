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
//!
//! Every failure is told twice ([`Failure`]): a classified reason the tenant
//! reads in `last_error` (`timeout`, `connection failed`, `HTTP 503`,
//! `provider rejected: …` with the provider's own code and message), and the
//! whole story for the operator's log, which may name the provider's URL
//! with the account SID, or an SDK's error chain with ARNs and account ids.
//! A provider's `Retry-After` is bounded by [`MAX_PROVIDER_PAUSE`].

pub mod log;
mod mime;
pub mod ses;
pub mod simulated;
pub mod sms_http;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::bail;
use async_trait::async_trait;
use tracing::warn;

use crate::config::{MAX_PROVIDER_PAUSE, ProviderKind, ProviderSettings};
use crate::message::DeliveryPayload;
use crate::model::Channel;

pub use self::log::LogProvider;
pub use self::ses::SesProvider;
pub use self::sms_http::SmsHttpProvider;

/// The reason of a call that timed out.
pub const TIMEOUT: &str = "timeout";
/// The reason of a call that failed in a way the transport does not name
/// (it may have reached the provider).
pub const REQUEST_FAILED: &str = "request failed";

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
/// Displayed, it shows the tenant-safe reason only.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProviderError {
    /// Retrying cannot help (rejected content, invalid recipient, bad
    /// credentials or account state): dead-letter at once.
    #[error("permanent provider error: {0}")]
    Permanent(Failure),
    /// The provider or the path to it failed (5xx, timeout, connection):
    /// retry with backoff, spending one attempt.
    #[error("transient provider error: {0}")]
    Transient(Failure),
    /// The provider asked us to slow down: defer without spending the retry
    /// budget, for `retry_after` when the provider said how long (at most
    /// [`MAX_PROVIDER_PAUSE`]).
    #[error("provider throttled: {failure}")]
    Throttled {
        retry_after: Option<Duration>,
        failure: Failure,
    },
}

/// One failed provider call, told twice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// Classified and safe to show the tenant: it becomes the message's
    /// `last_error` (`timeout`, `connection failed`, `HTTP 503`,
    /// `provider rejected: HTTP 400, code 21211: …`).
    pub reason: String,
    /// For the operator's log only: the transport's or SDK's error chain and
    /// the provider's raw answer, which can carry the provider's URL with
    /// the account SID, ARNs or account ids.
    pub detail: String,
}

impl Failure {
    pub fn new(reason: impl Into<String>, detail: impl Into<String>) -> Self {
        Failure {
            reason: reason.into(),
            detail: detail.into(),
        }
    }

    /// A failure of fairlane's own making whose reason says all there is
    /// (the log gets the same text).
    pub fn plain(reason: impl Into<String>) -> Self {
        let reason = reason.into();
        Failure {
            detail: reason.clone(),
            reason,
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

impl ProviderError {
    /// True when a later attempt may succeed (transient or throttled).
    pub fn is_retryable(&self) -> bool {
        !matches!(self, ProviderError::Permanent(_))
    }

    /// The reason and the detail, whatever the class.
    pub fn failure(&self) -> &Failure {
        match self {
            ProviderError::Permanent(failure)
            | ProviderError::Transient(failure)
            | ProviderError::Throttled { failure, .. } => failure,
        }
    }

    /// True when the provider may have taken the message although the call
    /// failed: it timed out after the request went out, or broke in a way
    /// that does not say. Such a message is tried again only by the same
    /// provider, never failed over to another one.
    pub fn may_have_arrived(&self) -> bool {
        matches!(self, ProviderError::Transient(failure)
            if matches!(failure.reason.as_str(), TIMEOUT | REQUEST_FAILED))
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
/// With `callback_url`, the `http` SMS provider asks for status callbacks
/// there (see [`crate::receipts::twilio`]).
pub async fn build(
    settings: &ProviderSettings,
    channel: Channel,
    callback_url: Option<String>,
) -> anyhow::Result<Arc<dyn Provider>> {
    if !settings.kind.serves(channel) {
        bail!(
            "providers.{channel}.kind = \"{}\" cannot deliver {channel}",
            settings.kind.name()
        );
    }
    let provider: Arc<dyn Provider> = match &settings.kind {
        ProviderKind::Log(log) => Arc::new(LogProvider::open(log.log_path.as_deref()).await?),
        ProviderKind::Ses(ses) => Arc::new(SesProvider::from_settings(settings, ses).await?),
        ProviderKind::Http(http) => Arc::new(
            SmsHttpProvider::from_settings(settings, http)?.with_status_callback(callback_url),
        ),
    };
    tracing::info!(%channel, provider = provider.name(), "Provider ready.");
    Ok(provider)
}

/// Reads `provider`'s `Retry-After` value: delay seconds (`7`) or an HTTP
/// date (`Wed, 21 Oct 2015 07:28:00 GMT`, counted from now; a past date is
/// zero). The provider chooses the value and the gate pauses every tenant's
/// sends for it, so it is bounded: anything longer than
/// [`MAX_PROVIDER_PAUSE`] (a number of seconds too large for any integer
/// included) is cut to it, with a WARN line.
pub(crate) fn parse_retry_after(value: &str, provider: &'static str) -> Option<Duration> {
    let value = value.trim();
    let asked = if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        value
            .parse::<u64>()
            .map_or(Duration::MAX, Duration::from_secs)
    } else {
        let at = SystemTime::from(chrono::DateTime::parse_from_rfc2822(value).ok()?);
        at.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO)
    };
    if asked > MAX_PROVIDER_PAUSE {
        warn!(
            provider,
            retry_after = value,
            max_secs = MAX_PROVIDER_PAUSE.as_secs(),
            "Provider asked for a longer pause than fairlane allows; its gate pauses for the maximum instead."
        );
        return Some(MAX_PROVIDER_PAUSE);
    }
    Some(asked)
}

/// A provider's own error text, fit for `last_error`: `secrets` (the SMS
/// account SID) masked wherever they appear, then cut to `max_chars`.
pub(crate) fn without_secrets(text: &str, secrets: &[&str], max_chars: usize) -> String {
    let mut text = text.to_owned();
    for secret in secrets.iter().filter(|secret| !secret.is_empty()) {
        text = text.replace(secret, "[account]");
    }
    truncate(&text, max_chars)
}

/// An AWS service's error message, fit for `last_error`: ARNs (`arn:…`)
/// and twelve-digit account ids masked, then cut to `max_chars`.
pub(crate) fn without_aws_ids(text: &str, max_chars: usize) -> String {
    let mut out = String::with_capacity(text.len());
    for piece in text.split_inclusive(char::is_whitespace) {
        let word = piece.trim_end();
        let space = &piece[word.len()..];
        let lead = word.len()
            - word
                .trim_start_matches(|c: char| !c.is_ascii_alphanumeric())
                .len();
        if word[lead..].starts_with("arn:") {
            let closing = word.trim_end_matches([')', ']', '"', '\'', ',', ';']);
            out.push_str(&word[..lead]);
            out.push_str("[arn]");
            out.push_str(&word[closing.len()..]);
        } else {
            out.push_str(&mask_account_ids(word));
        }
        out.push_str(space);
    }
    truncate(&out, max_chars)
}

/// `word` with every run of exactly twelve ASCII digits (an AWS account id)
/// replaced by `[account]`.
fn mask_account_ids(word: &str) -> String {
    let mut out = String::with_capacity(word.len());
    let mut digits = String::new();
    let flush = |digits: &mut String, out: &mut String| {
        if digits.len() == 12 {
            out.push_str("[account]");
        } else {
            out.push_str(digits);
        }
        digits.clear();
    };
    for c in word.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
        } else {
            flush(&mut digits, &mut out);
            out.push(c);
        }
    }
    flush(&mut digits, &mut out);
    out
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

/// `text` (a provider's error, which may quote the recipient: "The 'To'
/// number +1555… is not a valid phone number") with every email address
/// and phone number replaced by `[address]`, for the log lines of
/// `logging.log_addresses = false`. A phone number is a `+` and at least
/// eight digits (with spaces, dots, dashes or brackets between), or eight
/// to fifteen digits alone; dates, codes and counts are left as they are.
pub fn without_addresses(text: &str) -> std::borrow::Cow<'_, str> {
    static ADDRESS: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(
            r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+|\+\d[\d\s().-]{6,}\d|\b\d{8,15}\b",
        )
        .expect("the address pattern")
    });
    ADDRESS.replace_all(text, "[address]")
}

#[cfg(test)]
mod tests {

    #[test]
    fn addresses_leave_a_providers_error_and_the_rest_stays() {
        assert_eq!(
            without_addresses("The 'To' number +1 555 0100-901 is not a valid phone number."),
            "The 'To' number [address] is not a valid phone number."
        );
        assert_eq!(
            without_addresses("554 5.1.1 <Ada.Lovelace+news@mail.example.co.uk>: mailbox unknown"),
            "554 5.1.1 <[address]>: mailbox unknown"
        );
        assert_eq!(
            without_addresses("to 15550100901 refused"),
            "to [address] refused"
        );
        let kept = "HTTP 400 (code 21211) at 2026-11-27 10:00:01, 3 attempts";
        assert_eq!(without_addresses(kept), kept);
    }

    use super::*;
    use crate::config::{HttpSmsSettings, LogSettings, SesSettings};
    use crate::model::Priority;

    #[test]
    fn retry_after_reads_seconds_and_http_dates() {
        let parse = |value: &str| parse_retry_after(value, "test");
        assert_eq!(parse("7"), Some(Duration::from_secs(7)));
        assert_eq!(parse(" 0 "), Some(Duration::ZERO));
        assert_eq!(parse("Wed, 21 Oct 2015 07:28:00 GMT"), Some(Duration::ZERO));
        let later = chrono::Utc::now() + chrono::Duration::seconds(120);
        let header = later.format("%a, %d %b %Y %H:%M:%S GMT").to_string();
        let parsed = parse(&header).unwrap();
        assert!(
            parsed > Duration::from_secs(100) && parsed <= Duration::from_secs(120),
            "{parsed:?}"
        );
        assert_eq!(parse("soon"), None);
        assert_eq!(parse("-3"), None);
        assert_eq!(parse(""), None);
    }

    #[test]
    fn a_retry_after_longer_than_the_maximum_pause_is_cut_to_it() {
        let parse = |value: &str| parse_retry_after(value, "test");
        assert_eq!(MAX_PROVIDER_PAUSE, Duration::from_secs(3600));
        assert_eq!(parse("3600"), Some(MAX_PROVIDER_PAUSE));
        assert_eq!(parse("3601"), Some(MAX_PROVIDER_PAUSE));
        assert_eq!(parse("99999999999"), Some(MAX_PROVIDER_PAUSE));
        // u64::MAX seconds, and more digits than any integer holds.
        assert_eq!(parse("18446744073709551615"), Some(MAX_PROVIDER_PAUSE));
        assert_eq!(
            parse("99999999999999999999999999999999"),
            Some(MAX_PROVIDER_PAUSE)
        );
        assert_eq!(
            parse("Fri, 31 Dec 9999 23:59:59 GMT"),
            Some(MAX_PROVIDER_PAUSE)
        );
    }

    #[test]
    fn provider_texts_for_last_error_lose_account_sids_arns_and_account_ids() {
        assert_eq!(
            without_secrets(
                "The requested resource /2010-04-01/Accounts/AC0123/Messages.json was not found",
                &["AC0123"],
                300
            ),
            "The requested resource /2010-04-01/Accounts/[account]/Messages.json was not found"
        );
        assert_eq!(
            without_aws_ids(
                "User: arn:aws:iam::123456789012:user/sender is not authorized on (arn:aws:ses:us-east-1:123456789012:identity/example.com) for account 123456789012.",
                300
            ),
            "User: [arn] is not authorized on ([arn]) for account [account]."
        );
        // Other numbers stay: a phone number, a year, a code.
        assert_eq!(
            without_aws_ids("To +15551234567 in 2026, code 21211", 300),
            "To +15551234567 in 2026, code 21211"
        );
    }

    #[test]
    fn truncation_keeps_short_text_and_cuts_long_text_on_a_character() {
        assert_eq!(truncate("short", 10), "short");
        assert_eq!(truncate("ééééé", 3), "ééé…");
    }

    #[tokio::test]
    async fn build_refuses_a_provider_kind_of_the_other_channel() {
        let http =
            ProviderSettings::of_kind(ProviderKind::Http(http_settings("http://127.0.0.1:9")));
        let err = build(&http, Channel::Email, None).await.err().unwrap();
        assert!(err.to_string().contains("providers.email.kind"), "{err}");
        let ses = ProviderSettings::of_kind(ProviderKind::Ses(ses_settings("http://127.0.0.1:9")));
        let err = build(&ses, Channel::Sms, None).await.err().unwrap();
        assert!(err.to_string().contains("providers.sms.kind"), "{err}");
    }

    #[tokio::test]
    async fn build_chooses_the_provider_named_by_kind() {
        let dir = tempfile::tempdir().unwrap();
        let log = ProviderSettings::of_kind(ProviderKind::Log(LogSettings {
            from: None,
            log_path: Some(dir.path().join("deliveries.jsonl")),
        }));
        assert_eq!(
            build(&log, Channel::Email, None).await.unwrap().name(),
            "log"
        );
        assert_eq!(build(&log, Channel::Sms, None).await.unwrap().name(), "log");

        let http =
            ProviderSettings::of_kind(ProviderKind::Http(http_settings("http://127.0.0.1:9")));
        assert_eq!(
            build(&http, Channel::Sms, None).await.unwrap().name(),
            "http"
        );

        let ses = ProviderSettings::of_kind(ProviderKind::Ses(ses_settings("http://127.0.0.1:9")));
        assert_eq!(
            build(&ses, Channel::Email, None).await.unwrap().name(),
            "ses"
        );
    }

    #[test]
    fn error_classes_say_whether_to_retry() {
        assert!(!ProviderError::Permanent(Failure::plain("x")).is_retryable());
        assert!(ProviderError::Transient(Failure::plain("x")).is_retryable());
        let throttled = ProviderError::Throttled {
            retry_after: None,
            failure: Failure::plain("x"),
        };
        assert!(throttled.is_retryable());
        assert_eq!(throttled.kind(), "throttled");
    }

    pub(crate) fn http_settings(base_url: &str) -> HttpSmsSettings {
        HttpSmsSettings {
            base_url: base_url.into(),
            account_sid: "AC123".into(),
            auth_token: "token".to_owned().into(),
            from: "+15550001111".into(),
        }
    }

    pub(crate) fn ses_settings(endpoint_url: &str) -> SesSettings {
        SesSettings {
            from: "noreply@example.com".into(),
            region: Some("us-east-1".into()),
            endpoint_url: Some(endpoint_url.into()),
            access_key_id: None,
            secret_access_key: None,
            configuration_set: None,
            events_queue_url: None,
            ses_tenants: false,
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
            cc: Vec::new(),
            bcc: Vec::new(),
            priority: Priority::High,
            reference: None,
            sender: None,
            headers: Vec::new(),
            test: false,
            retrying: false,
            template: None,
            attachments: Vec::new(),
            traceparent: None,
        }
    }
}
