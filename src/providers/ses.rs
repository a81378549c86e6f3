//! Email through Amazon SES v2 `SendEmail` with raw content: the message
//! built as MIME by [`super::mime`] (text, or text and HTML as
//! `multipart/alternative`; To, Cc, Reply-To and the tenant's headers),
//! its recipients (Bcc too) in the call's destination, from the tenant's
//! identity or the configured sender address.
//!
//! Credentials and region come from the standard AWS chain (environment,
//! profile, web identity, IMDS); `region` and `endpoint_url` in the settings
//! override them, the latter for local SES-compatible servers. The SDK makes a
//! single attempt per call, bounded by `timeout_ms`: retrying is the
//! consumer's job, and SDK retries would multiply attempts and hide throttling
//! from the provider gate. Failures are classified from the SES error code and
//! the HTTP status of the answer.
//!
//! `last_error` gets a classified reason (`timeout`, `connection failed`,
//! `HTTP 503 (ServiceUnavailable)`, `provider rejected: MessageRejected
//! (HTTP 400): …`) with ARNs and account ids masked in SES's own message; the
//! SDK's error chain, which can name them, goes to the log only.

use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sesv2::config::http::HttpResponse;
use aws_sdk_sesv2::config::retry::RetryConfig;
use aws_sdk_sesv2::config::timeout::TimeoutConfig;
use aws_sdk_sesv2::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_sesv2::operation::send_email::SendEmailError;
use aws_sdk_sesv2::primitives::Blob;
use aws_sdk_sesv2::types::{Destination, EmailContent, MessageTag, RawMessage};
use tracing::debug;

use super::{
    DEFAULT_TIMEOUT, Delivered, Failure, Provider, ProviderError, causes, parse_retry_after,
    without_aws_ids,
};
use crate::config::{ProviderSettings, SesSettings};
use crate::message::DeliveryPayload;
use crate::model::Channel;

/// Longest piece of an SES error message kept in an error.
const MAX_ANSWER_CHARS: usize = 300;

/// SES error codes that mean "slow down", whatever the status says.
const THROTTLING_CODES: &[&str] = &[
    "TooManyRequestsException",
    "LimitExceededException",
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestThrottledException",
    "SlowDown",
];

/// 4xx error codes that a later attempt can outlive (expired credentials are
/// refreshed by the chain, a request timeout is a timeout).
const TRANSIENT_CODES: &[&str] = &[
    "RequestTimeout",
    "RequestTimeoutException",
    "ExpiredToken",
    "ExpiredTokenException",
    "RequestExpired",
    "IDPCommunicationError",
];

/// Sends email through SES v2.
#[derive(Debug, Clone)]
pub struct SesProvider {
    /// The SDK client; cheap to clone, shares connections.
    client: aws_sdk_sesv2::Client,
    /// `FromEmailAddress` of every message (a verified SES identity).
    from: String,
    /// `ConfigurationSetName` of every message whose sender identity names
    /// none: its event destination publishes the receipts fairlane reads
    /// (see [`crate::receipts::ses`]).
    configuration_set: Option<String>,
    /// Send `TenantName` = the tenant's id (`providers.email.ses_tenants`).
    ses_tenants: bool,
}

impl SesProvider {
    /// Builds the client from the AWS chain with the settings' overrides.
    pub async fn from_settings(
        settings: &ProviderSettings,
        ses: &SesSettings,
    ) -> anyhow::Result<Self> {
        let sdk_config = crate::aws::provider_config(ses, "SES").await?;
        let timeout = settings
            .timeout_ms
            .map_or(DEFAULT_TIMEOUT, Duration::from_millis);
        let timeouts = sdk_config
            .timeout_config()
            .map_or_else(TimeoutConfig::builder, TimeoutConfig::to_builder)
            .operation_timeout(timeout)
            .build();
        let config = aws_sdk_sesv2::config::Builder::from(&sdk_config)
            .retry_config(RetryConfig::standard().with_max_attempts(1))
            .timeout_config(timeouts)
            .build();
        Ok(
            Self::with_client(aws_sdk_sesv2::Client::from_conf(config), ses.from.clone())
                .with_configuration_set(ses.configuration_set.clone())
                .with_ses_tenants(ses.ses_tenants),
        )
    }

    /// Sends every email with `name` as its configuration set, whose event
    /// destination publishes the receipts (see [`crate::receipts::ses`]).
    pub fn with_configuration_set(mut self, name: Option<String>) -> Self {
        self.configuration_set = name;
        self
    }

    /// Sends each email with `TenantName` set to its fairlane tenant's id.
    pub fn with_ses_tenants(mut self, on: bool) -> Self {
        self.ses_tenants = on;
        self
    }

    /// Uses a ready client (tests pass static credentials and a local
    /// endpoint; give it one attempt, as [`Self::from_settings`] does).
    pub fn with_client(client: aws_sdk_sesv2::Client, from: impl Into<String>) -> Self {
        Self {
            client,
            from: from.into(),
            configuration_set: None,
            ses_tenants: false,
        }
    }
}

#[async_trait]
impl Provider for SesProvider {
    async fn send(&self, message: &DeliveryPayload) -> Result<Delivered, ProviderError> {
        if message.channel != Channel::Email {
            return Err(ProviderError::Permanent(Failure::plain(format!(
                "SES delivers email, not {}",
                message.channel
            ))));
        }
        if message.subject.is_none() {
            return Err(ProviderError::Permanent(Failure::plain(
                "an email needs a subject",
            )));
        }
        let sender = message.sender.as_ref();
        let (address, display_name) = match sender.and_then(|s| s.from.as_deref()) {
            Some(address) => (address, sender.and_then(|s| s.display_name.as_deref())),
            None => (self.from.as_str(), None),
        };
        let from = from_header(address, display_name);
        let raw = super::mime::raw_email(
            message,
            &super::mime::Sender {
                address,
                display_name,
                reply_to: sender.map_or(&[][..], |s| s.reply_to.as_slice()),
            },
        )
        .map_err(|err| {
            ProviderError::Permanent(Failure::new(
                "the email could not be built",
                format!("cannot write the MIME message: {err}"),
            ))
        })?;
        let raw = RawMessage::builder()
            .data(Blob::new(raw))
            .build()
            .map_err(|err| {
                ProviderError::Permanent(Failure::new(
                    "the email could not be built",
                    format!("cannot build the SES raw message: {err}"),
                ))
            })?;
        let content = EmailContent::builder().raw(raw);
        let configuration_set = sender
            .and_then(|s| s.configuration_set.clone())
            .or_else(|| self.configuration_set.clone());
        let destination = Destination::builder()
            .to_addresses(&message.to)
            .set_cc_addresses(Some(message.cc.clone()).filter(|list| !list.is_empty()))
            .set_bcc_addresses(Some(message.bcc.clone()).filter(|list| !list.is_empty()))
            .build();
        let output = self
            .client
            .send_email()
            .from_email_address(from)
            .set_configuration_set_name(configuration_set)
            .set_tenant_name(self.ses_tenants.then(|| message.tenant_id.clone()))
            .email_tags(tag("tenant", &message.tenant_id)?)
            .email_tags(tag("message_id", &message.id)?)
            .destination(destination)
            .content(content.build())
            .send()
            .await
            .map_err(classify)?;
        // A success without an id: SES has taken the message, so retrying
        // could send it twice; dead-letter it for an operator instead.
        let Some(provider_message_id) = output.message_id().filter(|id| !id.is_empty()) else {
            return Err(ProviderError::Permanent(Failure::plain(
                "provider accepted the request but returned no message id; not retried to avoid a duplicate",
            )));
        };
        debug!(message_id = %message.id, %provider_message_id, "SES accepted the message.");
        Ok(Delivered {
            provider_message_id: provider_message_id.to_owned(),
        })
    }

    fn name(&self) -> &'static str {
        "ses"
    }
}

/// `FromEmailAddress` with a display name: quoted when it is ASCII, an
/// RFC 2047 encoded word when it is not (SES wants non-ASCII names
/// encoded).
fn from_header(address: &str, display_name: Option<&str>) -> String {
    match display_name {
        None => address.to_owned(),
        Some(name) if name.is_ascii() => {
            let quoted = name.replace('\\', "\\\\").replace('"', "\\\"");
            format!("\"{quoted}\" <{address}>")
        }
        Some(name) => {
            use base64::Engine;
            let encoded = base64::engine::general_purpose::STANDARD.encode(name.as_bytes());
            format!("=?UTF-8?B?{encoded}?= <{address}>")
        }
    }
}

/// A message tag; tenant ids and message ids are within SES's tag
/// alphabet (letters, digits, `_`, `-`).
fn tag(name: &str, value: &str) -> Result<MessageTag, ProviderError> {
    MessageTag::builder()
        .name(name)
        .value(value)
        .build()
        .map_err(|err| {
            ProviderError::Permanent(Failure::new(
                "the email could not be built",
                format!("cannot build the SES message tag {name}: {err}"),
            ))
        })
}

/// Classifies a failed `SendEmail` call.
fn classify(err: SdkError<SendEmailError, HttpResponse>) -> ProviderError {
    let detail = causes(&err);
    let (status, retry_after, answered) = match &err {
        SdkError::ServiceError(service) => {
            let raw = service.raw();
            let status = raw.status().as_u16();
            let error = service.err();
            let answered = match error.code() {
                Some(code) => format!("{code} (HTTP {status})"),
                None => format!("HTTP {status}"),
            };
            if !(200..300).contains(&status) {
                let retry_after = raw
                    .headers()
                    .get("retry-after")
                    .and_then(|value| parse_retry_after(value, "ses"));
                return classify_service_error(error, status, retry_after, answered, detail);
            }
            (status, None, answered)
        }
        SdkError::ResponseError(response) => {
            let status = response.raw().status().as_u16();
            let retry_after = response
                .raw()
                .headers()
                .get("retry-after")
                .and_then(|value| parse_retry_after(value, "ses"));
            (status, retry_after, format!("HTTP {status}"))
        }
        SdkError::TimeoutError(_) => {
            return ProviderError::Transient(Failure::new(
                "timeout",
                format!("SES call timed out: {detail}"),
            ));
        }
        SdkError::DispatchFailure(failure) => {
            let reason = if failure.is_timeout() {
                "timeout"
            } else {
                "connection failed"
            };
            return ProviderError::Transient(Failure::new(
                reason,
                format!("SES call not completed: {detail}"),
            ));
        }
        // Construction fails before anything is sent; a later attempt may
        // succeed, and a lasting misconfiguration still ends in the DLQ once
        // attempts run out. (Credentials that cannot be resolved surface as
        // a dispatch failure, above.)
        _ => {
            return ProviderError::Transient(Failure::new(
                "request not sent",
                format!("SES request not sent: {detail}"),
            ));
        }
    };
    let detail = format!("SES answered {answered}: {detail}");
    match status {
        // SES took the request but we cannot read its answer: retrying could
        // send the email twice, so leave it to an operator.
        200..=299 => ProviderError::Permanent(Failure::new(
            format!(
                "provider answered HTTP {status} but its answer could not be read; \
                 not retried to avoid a duplicate"
            ),
            detail,
        )),
        429 => ProviderError::Throttled {
            retry_after,
            failure: Failure::new(answered, detail),
        },
        // A client error we cannot read is still a refusal of this request.
        400..=499 if status != 408 => ProviderError::Permanent(Failure::new(
            format!("provider rejected: {answered}"),
            detail,
        )),
        _ => ProviderError::Transient(Failure::new(answered, detail)),
    }
}

/// Classifies an error SES answered with. `answered` is its code and
/// status, `SES`'s message is added to a permanent refusal's reason (that
/// is what the tenant needs to fix the message), masked of ARNs and account
/// ids; `detail` is the SDK's chain, for the log.
fn classify_service_error(
    error: &SendEmailError,
    status: u16,
    retry_after: Option<Duration>,
    answered: String,
    detail: String,
) -> ProviderError {
    let code = error.code().unwrap_or_default();
    let detail = format!("SES answered {answered}: {detail}");
    let throttled = error.is_too_many_requests_exception()
        || error.is_limit_exceeded_exception()
        || status == 429
        || THROTTLING_CODES.contains(&code);
    if throttled {
        return ProviderError::Throttled {
            retry_after,
            failure: Failure::new(answered, detail),
        };
    }
    let permanent = error.is_message_rejected()
        || error.is_mail_from_domain_not_verified_exception()
        || error.is_account_suspended_exception()
        || error.is_sending_paused_exception()
        || error.is_bad_request_exception()
        || error.is_not_found_exception()
        || ((400..500).contains(&status) && status != 408 && !TRANSIENT_CODES.contains(&code));
    if permanent {
        let mut reason = format!("provider rejected: {answered}");
        if let Some(text) = error.message() {
            reason.push_str(&format!(": {}", without_aws_ids(text, MAX_ANSWER_CHARS)));
        }
        ProviderError::Permanent(Failure::new(reason, detail))
    } else {
        ProviderError::Transient(Failure::new(answered, detail))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::tests::payload;
    use aws_sdk_sesv2::config::Credentials;
    use serde_json::json;
    use wiremock::matchers::{method, path};
    use wiremock::{Mock, MockServer, Request, ResponseTemplate};

    const FROM: &str = "noreply@example.com";

    /// An SES client for a local endpoint: static test credentials, one
    /// attempt, a short timeout.
    fn local_client(endpoint_url: &str) -> aws_sdk_sesv2::Client {
        local_client_with_timeout(endpoint_url, Duration::from_secs(5))
    }

    fn local_client_with_timeout(endpoint_url: &str, timeout: Duration) -> aws_sdk_sesv2::Client {
        let config = aws_sdk_sesv2::Config::builder()
            .behavior_version(aws_config::BehaviorVersion::latest())
            .region(aws_sdk_sesv2::config::Region::new("us-east-1"))
            .credentials_provider(Credentials::new("test", "test", None, None, "test"))
            .endpoint_url(endpoint_url)
            .retry_config(RetryConfig::standard().with_max_attempts(1))
            .timeout_config(TimeoutConfig::builder().operation_timeout(timeout).build())
            .build();
        aws_sdk_sesv2::Client::from_conf(config)
    }

    async fn provider_answering(template: ResponseTemplate) -> (MockServer, SesProvider) {
        let server = MockServer::start().await;
        Mock::given(method("POST"))
            .and(path("/v2/email/outbound-emails"))
            .respond_with(template)
            .mount(&server)
            .await;
        let provider = SesProvider::with_client(local_client(&server.uri()), FROM);
        (server, provider)
    }

    fn ses_error(status: u16, code: &str, text: &str) -> ResponseTemplate {
        ResponseTemplate::new(status)
            .insert_header("x-amzn-ErrorType", code)
            .insert_header("content-type", "application/json")
            .set_body_json(json!({ "message": text }))
    }

    #[tokio::test]
    async fn an_accepted_email_returns_the_ses_message_id_and_sends_the_whole_message() {
        let (server, provider) = provider_answering(
            ResponseTemplate::new(200).set_body_json(json!({ "MessageId": "ses-0001" })),
        )
        .await;
        let mut message = payload(Channel::Email, "a@example.com");
        message.html = Some("<p>Your code is 123456</p>".into());

        let delivered = provider.send(&message).await.unwrap();

        assert_eq!(delivered.provider_message_id, "ses-0001");
        let requests: Vec<Request> = server.received_requests().await.unwrap();
        assert_eq!(requests.len(), 1);
        let body: serde_json::Value = requests[0].body_json().unwrap();
        assert_eq!(body["FromEmailAddress"], FROM);
        assert_eq!(body["Destination"]["ToAddresses"], json!(["a@example.com"]));
        use base64::Engine;
        let raw = base64::engine::general_purpose::STANDARD
            .decode(body["Content"]["Raw"]["Data"].as_str().unwrap())
            .unwrap();
        let mail = mail_parser::MessageParser::default().parse(&raw).unwrap();
        assert_eq!(mail.subject(), Some("Your code"));
        assert_eq!(mail.body_text(0).as_deref(), Some("Your code is 123456"));
        assert_eq!(
            mail.body_html(0).as_deref(),
            Some("<p>Your code is 123456</p>")
        );
        assert!(
            requests[0].headers.contains_key("authorization"),
            "the request is signed"
        );
    }

    #[tokio::test]
    async fn the_configuration_set_goes_with_every_email_when_set() {
        let (server, provider) = provider_answering(
            ResponseTemplate::new(200).set_body_json(json!({ "MessageId": "ses-0002" })),
        )
        .await;
        let message = payload(Channel::Email, "a@example.com");
        provider.send(&message).await.unwrap();
        let provider = provider.with_configuration_set(Some("fairlane-events".into()));
        provider.send(&message).await.unwrap();
        let requests: Vec<Request> = server.received_requests().await.unwrap();
        let first: serde_json::Value = requests[0].body_json().unwrap();
        let second: serde_json::Value = requests[1].body_json().unwrap();
        assert!(first.get("ConfigurationSetName").is_none(), "{first}");
        assert_eq!(second["ConfigurationSetName"], "fairlane-events");
    }

    #[tokio::test]
    async fn a_rejected_message_is_permanent() {
        let (_server, provider) = provider_answering(ses_error(
            400,
            "MessageRejected",
            "Email address is not verified.",
        ))
        .await;
        let err = provider
            .send(&payload(Channel::Email, "a@example.com"))
            .await
            .unwrap_err();
        match err {
            ProviderError::Permanent(failure) => assert_eq!(
                failure.reason,
                "provider rejected: MessageRejected (HTTP 400): Email address is not verified."
            ),
            other => panic!("expected Permanent, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn an_unverified_mail_from_domain_is_permanent() {
        let (_server, provider) =
            provider_answering(ses_error(400, "MailFromDomainNotVerifiedException", "no")).await;
        let err = provider
            .send(&payload(Channel::Email, "a@example.com"))
            .await
            .unwrap_err();
        assert!(matches!(err, ProviderError::Permanent(_)), "{err:?}");
    }

    #[tokio::test]
    async fn too_many_requests_is_throttled() {
        let (_server, provider) = provider_answering(ses_error(
            429,
            "TooManyRequestsException",
            "Maximum sending rate exceeded.",
        ))
        .await;
        let err = provider
            .send(&payload(Channel::Email, "a@example.com"))
            .await
            .unwrap_err();
        match err {
            ProviderError::Throttled {
                retry_after,
                failure,
            } => {
                assert_eq!(retry_after, None);
                assert_eq!(failure.reason, "TooManyRequestsException (HTTP 429)");
            }
            other => panic!("expected Throttled, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_throttle_with_retry_after_carries_the_delay() {
        let (_server, provider) = provider_answering(
            ses_error(429, "TooManyRequestsException", "slow down")
                .insert_header("Retry-After", "3"),
        )
        .await;
        let err = provider
            .send(&payload(Channel::Email, "a@example.com"))
            .await
            .unwrap_err();
        assert!(
            matches!(err, ProviderError::Throttled { retry_after: Some(d), .. } if d == Duration::from_secs(3)),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn a_server_error_is_transient() {
        let (_server, provider) =
            provider_answering(ses_error(500, "InternalFailure", "oops")).await;
        let err = provider
            .send(&payload(Channel::Email, "a@example.com"))
            .await
            .unwrap_err();
        match err {
            ProviderError::Transient(failure) => {
                assert_eq!(failure.reason, "InternalFailure (HTTP 500)");
                assert!(failure.detail.contains("oops"), "{failure:?}");
            }
            other => panic!("expected Transient, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_bare_500_without_an_error_type_is_transient() {
        let (_server, provider) = provider_answering(ResponseTemplate::new(500)).await;
        let err = provider
            .send(&payload(Channel::Email, "a@example.com"))
            .await
            .unwrap_err();
        assert!(matches!(err, ProviderError::Transient(_)), "{err:?}");
    }

    #[tokio::test]
    async fn an_unknown_client_error_is_permanent() {
        let (_server, provider) =
            provider_answering(ses_error(403, "AccessDeniedException", "not allowed")).await;
        let err = provider
            .send(&payload(Channel::Email, "a@example.com"))
            .await
            .unwrap_err();
        assert!(matches!(err, ProviderError::Permanent(_)), "{err:?}");
    }

    #[tokio::test]
    async fn arns_and_account_ids_in_an_ses_refusal_reach_the_log_only() {
        let (_server, provider) = provider_answering(ses_error(
            403,
            "AccessDeniedException",
            "User: arn:aws:iam::123456789012:user/fairlane is not authorized to perform: ses:SendEmail",
        ))
        .await;
        let err = provider
            .send(&payload(Channel::Email, "a@example.com"))
            .await
            .unwrap_err();
        let failure = err.failure();
        assert_eq!(
            failure.reason,
            "provider rejected: AccessDeniedException (HTTP 403): User: [arn] is not authorized \
             to perform: ses:SendEmail"
        );
        assert!(failure.detail.contains("123456789012"), "{failure:?}");
    }

    #[tokio::test]
    async fn an_unreachable_endpoint_is_transient() {
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let provider =
            SesProvider::with_client(local_client(&format!("http://127.0.0.1:{port}")), FROM);
        let err = provider
            .send(&payload(Channel::Email, "a@example.com"))
            .await
            .unwrap_err();
        match err {
            ProviderError::Transient(failure) => assert_eq!(failure.reason, "connection failed"),
            other => panic!("expected Transient, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn an_sms_payload_is_refused_without_a_call() {
        let (server, provider) = provider_answering(
            ResponseTemplate::new(200).set_body_json(json!({ "MessageId": "x" })),
        )
        .await;
        let err = provider
            .send(&payload(Channel::Sms, "+15551234567"))
            .await
            .unwrap_err();
        assert!(matches!(err, ProviderError::Permanent(_)), "{err:?}");
        assert!(server.received_requests().await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn an_answer_slower_than_the_timeout_is_transient() {
        let server = MockServer::start().await;
        Mock::given(method("POST"))
            .respond_with(
                ResponseTemplate::new(200)
                    .set_body_json(json!({ "MessageId": "late" }))
                    .set_delay(Duration::from_secs(5)),
            )
            .mount(&server)
            .await;
        let client = local_client_with_timeout(&server.uri(), Duration::from_millis(200));
        let provider = SesProvider::with_client(client, FROM);
        match provider
            .send(&payload(Channel::Email, "a@example.com"))
            .await
            .unwrap_err()
        {
            ProviderError::Transient(failure) => {
                assert_eq!(failure.reason, "timeout");
                assert!(failure.detail.contains("timed out"), "{failure:?}");
            }
            other => panic!("expected Transient, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_success_without_a_message_id_is_permanent_so_it_is_not_sent_twice() {
        for template in [
            ResponseTemplate::new(200).set_body_json(json!({})),
            ResponseTemplate::new(200).set_body_string("not json"),
        ] {
            let (_server, provider) = provider_answering(template).await;
            match provider
                .send(&payload(Channel::Email, "a@example.com"))
                .await
                .unwrap_err()
            {
                ProviderError::Permanent(failure) => {
                    assert!(failure.reason.contains("avoid a duplicate"), "{failure:?}");
                }
                other => panic!("expected Permanent, got {other:?}"),
            }
        }
    }
}
