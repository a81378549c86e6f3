//! SMS through a Twilio-compatible Messages API (Twilio, SignalWire's
//! compatibility API, …): `POST {base_url}/2010-04-01/Accounts/{sid}/Messages.json`
//! with form fields `To`, `From`, `Body` and HTTP Basic auth
//! `account_sid:auth_token`.
//!
//! The answer is classified here: 2xx with a `sid` is success, 429 is
//! throttling (with `Retry-After` when given), 408, 5xx, timeouts and
//! connection failures are transient, and every other 4xx is permanent, with
//! the provider's `code` and `message` kept for `last_error` (e.g. 21211,
//! invalid `To`). A 2xx without a readable `sid` is permanent: the provider
//! has most likely taken the message, and retrying could text the recipient
//! twice, so it goes to the DLQ where an operator decides.
//!
//! `last_error` gets a classified reason only (`timeout`, `connection
//! failed`, `HTTP 503`, `provider rejected: HTTP 400, code 21211: …`), with
//! the account SID masked wherever the provider's own text repeats it:
//! reqwest's errors name the request URL, which holds the SID, and an
//! unparsed answer may be anyone's page (a proxy's, a load balancer's).
//! Those go to the log only.

use std::time::Duration;

use anyhow::Context;
use async_trait::async_trait;
use reqwest::header::RETRY_AFTER;
use reqwest::{StatusCode, Url};
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use tracing::debug;

use super::{
    DEFAULT_TIMEOUT, Delivered, Failure, Provider, ProviderError, causes, parse_retry_after,
    truncate, without_secrets,
};
use crate::config::{HttpSmsSettings, ProviderSettings};
use crate::message::DeliveryPayload;
use crate::model::Channel;

/// Path of fairlane's status callback endpoint, named in each request
/// (`StatusCallback`) when `server.public_url` is set; served by the API
/// and read by `crate::receipts::twilio`.
pub const CALLBACK_PATH: &str = "/v1/callbacks/sms";

/// The query parameter of a status callback's URL that names the message
/// by fairlane's id.
pub const CALLBACK_MESSAGE_ID: &str = "message_id";

/// `url` (the provider's callback URL) naming the message `id`.
fn callback_for(url: &str, id: &str) -> String {
    let encoded: String = form_urlencoded::byte_serialize(id.as_bytes()).collect();
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{CALLBACK_MESSAGE_ID}={encoded}")
}

/// Longest piece of an unparseable answer kept in an error.
const MAX_ANSWER_CHARS: usize = 300;

/// Sends SMS through a Twilio-compatible HTTP API.
#[derive(Debug)]
pub struct SmsHttpProvider {
    /// One client per provider, so connections (and TLS sessions) are reused.
    client: reqwest::Client,
    /// The account's Messages resource, built once from `base_url`.
    messages_url: Url,
    /// Basic-auth user, and part of the URL.
    account_sid: String,
    /// Basic-auth password; exposed only when a request is built.
    auth_token: SecretString,
    /// Sender number (or messaging service / alphanumeric id).
    from: String,
    /// Bound on one request, reported in timeout errors.
    timeout: Duration,
    /// Sent as `StatusCallback` with every message, so the provider reports
    /// its delivery (`{server.public_url}/v1/callbacks/sms`).
    status_callback: Option<String>,
}

/// The form of a Messages request.
#[derive(serde::Serialize)]
struct SmsForm<'a> {
    #[serde(rename = "To")]
    to: &'a str,
    #[serde(rename = "From", skip_serializing_if = "Option::is_none")]
    from: Option<&'a str>,
    /// Instead of `From`: the messaging service that picks the sender.
    #[serde(
        rename = "MessagingServiceSid",
        skip_serializing_if = "Option::is_none"
    )]
    messaging_service_sid: Option<&'a str>,
    #[serde(rename = "Body")]
    body: &'a str,
    #[serde(rename = "StatusCallback", skip_serializing_if = "Option::is_none")]
    status_callback: Option<String>,
}

/// The fields of a Messages answer we read, success or error.
#[derive(Debug, Default, Deserialize)]
struct Answer {
    sid: Option<String>,
    code: Option<serde_json::Value>,
    message: Option<String>,
}

impl SmsHttpProvider {
    /// Builds the provider from `providers.sms` (kind `http`).
    pub fn from_settings(
        settings: &ProviderSettings,
        http: &HttpSmsSettings,
    ) -> anyhow::Result<Self> {
        let timeout = settings
            .timeout_ms
            .map_or(DEFAULT_TIMEOUT, Duration::from_millis);
        Self::new(
            &http.base_url,
            http.account_sid.clone(),
            http.auth_token.clone(),
            http.from.clone(),
            timeout,
        )
    }

    /// Builds the provider from its parts.
    pub fn new(
        base_url: &str,
        account_sid: String,
        auth_token: SecretString,
        from: String,
        timeout: Duration,
    ) -> anyhow::Result<Self> {
        let mut messages_url = Url::parse(base_url)
            .with_context(|| format!("providers.sms.base_url {base_url:?} is not a URL"))?;
        messages_url
            .path_segments_mut()
            .map_err(|()| {
                anyhow::anyhow!("providers.sms.base_url {base_url:?} cannot be a base URL")
            })?
            .pop_if_empty()
            .extend(["2010-04-01", "Accounts", &account_sid, "Messages.json"]);
        let client = reqwest::Client::builder()
            .timeout(timeout)
            // A redirect would turn the POST into a GET; report it instead.
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("fairlane/", env!("CARGO_PKG_VERSION")))
            .build()
            .context("cannot build the SMS HTTP client")?;
        Ok(Self {
            client,
            messages_url,
            account_sid,
            auth_token,
            from,
            timeout,
            status_callback: None,
        })
    }

    /// Asks the provider to report each message's status to `url`.
    pub fn with_status_callback(mut self, url: Option<String>) -> Self {
        self.status_callback = url;
        self
    }

    /// The form that sends `message`: the tenant's identity (its sender,
    /// or its messaging service and no From; without one, the configured
    /// sender), and the callback naming the message by fairlane's own id,
    /// so its receipt finds the message by its key (the signature covers
    /// the URL, query included).
    fn form<'a>(&'a self, message: &'a DeliveryPayload) -> SmsForm<'a> {
        let sender = message.sender.as_ref();
        let messaging_service_sid = sender.and_then(|s| s.messaging_service_sid.as_deref());
        let from = match messaging_service_sid {
            Some(_) => None,
            None => Some(sender.and_then(|s| s.from.as_deref()).unwrap_or(&self.from)),
        };
        SmsForm {
            to: &message.to,
            from,
            messaging_service_sid,
            body: &message.text,
            status_callback: self
                .status_callback
                .as_deref()
                .map(|url| callback_for(url, &message.id)),
        }
    }

    fn transport_error(&self, err: &reqwest::Error) -> ProviderError {
        let cause = causes(err);
        ProviderError::Transient(if err.is_timeout() {
            Failure::new(
                "timeout",
                format!(
                    "SMS provider did not answer within {} ms: {cause}",
                    self.timeout.as_millis()
                ),
            )
        } else if err.is_connect() {
            Failure::new(
                "connection failed",
                format!("cannot connect to the SMS provider: {cause}"),
            )
        } else {
            Failure::new("request failed", format!("SMS request failed: {cause}"))
        })
    }
}

#[async_trait]
impl Provider for SmsHttpProvider {
    async fn send(&self, message: &DeliveryPayload) -> Result<Delivered, ProviderError> {
        if message.channel != Channel::Sms {
            return Err(ProviderError::Permanent(Failure::plain(format!(
                "the SMS provider cannot deliver {}",
                message.channel
            ))));
        }
        let response = self
            .client
            .post(self.messages_url.clone())
            .basic_auth(&self.account_sid, Some(self.auth_token.expose_secret()))
            .form(&self.form(message))
            .send()
            .await
            .map_err(|err| self.transport_error(&err))?;

        let status = response.status();
        let retry_after = response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| parse_retry_after(value, self.name()));
        let location = response
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        let body = match response.text().await {
            Ok(body) => body,
            Err(err) if status.is_success() => {
                return Err(ProviderError::Permanent(Failure::new(
                    format!(
                        "provider answered HTTP {} but its answer could not be read; \
                         not retried to avoid a duplicate",
                        status.as_u16()
                    ),
                    format!(
                        "SMS provider answered HTTP {status} but its body could not be read: {}",
                        causes(&err)
                    ),
                )));
            }
            Err(err) => return Err(self.transport_error(&err)),
        };
        let answer: Option<Answer> = serde_json::from_str(&body).ok();

        if status.is_success() {
            return match answer.and_then(|a| a.sid).filter(|sid| !sid.is_empty()) {
                Some(sid) => {
                    debug!(message_id = %message.id, provider_message_id = %sid, "SMS provider accepted the message.");
                    Ok(Delivered {
                        provider_message_id: sid,
                    })
                }
                None => Err(ProviderError::Permanent(Failure::new(
                    format!(
                        "provider answered HTTP {} without a message id; not retried to avoid a duplicate",
                        status.as_u16()
                    ),
                    format!(
                        "SMS provider answered HTTP {status} without a sid: {}",
                        truncate(&body, MAX_ANSWER_CHARS)
                    ),
                ))),
            };
        }

        let answered = self.answered(status, answer.as_ref());
        let detail = describe(status, answer.as_ref(), &body, location.as_deref());
        Err(match status {
            StatusCode::TOO_MANY_REQUESTS => ProviderError::Throttled {
                retry_after,
                failure: Failure::new(answered, detail),
            },
            StatusCode::REQUEST_TIMEOUT => ProviderError::Transient(Failure::new(answered, detail)),
            s if s.is_client_error() => ProviderError::Permanent(Failure::new(
                format!("provider rejected: {answered}"),
                detail,
            )),
            s if s.is_redirection() => ProviderError::Permanent(Failure::new(answered, detail)),
            _ => ProviderError::Transient(Failure::new(answered, detail)),
        })
    }

    fn name(&self) -> &'static str {
        "http"
    }
}

impl SmsHttpProvider {
    /// What the provider answered, for `last_error`: `HTTP 400, code 21211:
    /// invalid To` from its JSON answer, only `HTTP 502` when the answer is
    /// not one (it may be a proxy's page); the account SID masked.
    fn answered(&self, status: StatusCode, answer: Option<&Answer>) -> String {
        let mut text = format!("HTTP {}", status.as_u16());
        let code = answer.and_then(|a| a.code.as_ref()).map(|code| match code {
            serde_json::Value::String(text) => text.clone(),
            other => other.to_string(),
        });
        let message = answer.and_then(|a| a.message.as_deref());
        let secrets = [self.account_sid.as_str()];
        if let Some(code) = code {
            text.push_str(&format!(", code {}", without_secrets(&code, &secrets, 40)));
        }
        if let Some(message) = message {
            text.push_str(&format!(
                ": {}",
                without_secrets(message, &secrets, MAX_ANSWER_CHARS)
            ));
        }
        text
    }
}

/// For the log: `SMS provider answered HTTP 400, code 21211: invalid To`,
/// falling back to the raw answer.
fn describe(
    status: StatusCode,
    answer: Option<&Answer>,
    body: &str,
    location: Option<&str>,
) -> String {
    let mut detail = format!("SMS provider answered HTTP {}", status.as_u16());
    let code = answer.and_then(|a| a.code.as_ref()).map(|code| match code {
        serde_json::Value::String(text) => text.clone(),
        other => other.to_string(),
    });
    let text = answer.and_then(|a| a.message.as_deref());
    match (code, text) {
        (Some(code), Some(text)) => detail.push_str(&format!(
            ", code {code}: {}",
            truncate(text, MAX_ANSWER_CHARS)
        )),
        (Some(code), None) => detail.push_str(&format!(", code {code}")),
        (None, Some(text)) => detail.push_str(&format!(": {}", truncate(text, MAX_ANSWER_CHARS))),
        (None, None) if !body.trim().is_empty() => {
            detail.push_str(&format!(": {}", truncate(body.trim(), MAX_ANSWER_CHARS)));
        }
        (None, None) => {}
    }
    if let Some(location) = location.filter(|_| status.is_redirection()) {
        detail.push_str(&format!(
            " (redirect to {location}; check providers.sms.base_url)"
        ));
    }
    detail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::tests::payload;
    use serde_json::json;
    use wiremock::matchers::{body_string_contains, header, method, path};
    use wiremock::{Mock, MockServer, ResponseTemplate};

    const SID: &str = "AC123";
    const TOKEN: &str = "secret-token";
    /// base64("AC123:secret-token"), written out so the test does not share
    /// the code under test.
    const BASIC_AUTH: &str = "Basic QUMxMjM6c2VjcmV0LXRva2Vu";
    const FROM: &str = "+15550001111";
    const TO: &str = "+15551234567";

    fn provider(base_url: &str, timeout: Duration) -> SmsHttpProvider {
        SmsHttpProvider::new(
            base_url,
            SID.into(),
            TOKEN.to_owned().into(),
            FROM.into(),
            timeout,
        )
        .unwrap()
    }

    async fn provider_answering(template: ResponseTemplate) -> (MockServer, SmsHttpProvider) {
        let server = MockServer::start().await;
        Mock::given(method("POST"))
            .and(path("/2010-04-01/Accounts/AC123/Messages.json"))
            .respond_with(template)
            .mount(&server)
            .await;
        let provider = provider(&server.uri(), Duration::from_secs(5));
        (server, provider)
    }

    async fn send(provider: &SmsHttpProvider) -> Result<Delivered, ProviderError> {
        provider.send(&payload(Channel::Sms, TO)).await
    }

    #[tokio::test]
    async fn a_created_message_returns_its_sid_after_an_authenticated_form_post() {
        let server = MockServer::start().await;
        Mock::given(method("POST"))
            .and(path("/2010-04-01/Accounts/AC123/Messages.json"))
            .and(header("authorization", BASIC_AUTH))
            .and(header("content-type", "application/x-www-form-urlencoded"))
            .and(body_string_contains("To=%2B15551234567"))
            .and(body_string_contains("From=%2B15550001111"))
            .and(body_string_contains("Body=Your+code+is+123456"))
            .respond_with(
                ResponseTemplate::new(201)
                    .set_body_json(json!({ "sid": "SM0001", "status": "queued" })),
            )
            .expect(1)
            .mount(&server)
            .await;
        let provider = provider(&server.uri(), Duration::from_secs(5));

        let delivered = send(&provider).await.unwrap();

        assert_eq!(delivered.provider_message_id, "SM0001");
    }

    #[tokio::test]
    async fn a_base_url_with_a_path_keeps_it() {
        let server = MockServer::start().await;
        Mock::given(method("POST"))
            .and(path("/compat/2010-04-01/Accounts/AC123/Messages.json"))
            .respond_with(ResponseTemplate::new(200).set_body_json(json!({ "sid": "SM0002" })))
            .mount(&server)
            .await;
        let provider = provider(&format!("{}/compat/", server.uri()), Duration::from_secs(5));
        assert_eq!(send(&provider).await.unwrap().provider_message_id, "SM0002");
    }

    #[tokio::test]
    async fn an_invalid_number_is_permanent_and_names_the_provider_code() {
        let (_server, provider) = provider_answering(
            ResponseTemplate::new(400)
                .set_body_json(json!({ "code": 21211, "message": "invalid To", "status": 400 })),
        )
        .await;
        match send(&provider).await.unwrap_err() {
            ProviderError::Permanent(failure) => {
                assert_eq!(
                    failure.reason,
                    "provider rejected: HTTP 400, code 21211: invalid To"
                );
            }
            other => panic!("expected Permanent, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn bad_credentials_are_permanent() {
        let (_server, provider) =
            provider_answering(ResponseTemplate::new(401).set_body_string("Authenticate")).await;
        match send(&provider).await.unwrap_err() {
            ProviderError::Permanent(failure) => {
                // Not JSON: the provider's page goes to the log only.
                assert_eq!(failure.reason, "provider rejected: HTTP 401");
                assert!(failure.detail.contains("Authenticate"), "{failure:?}");
            }
            other => panic!("expected Permanent, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn too_many_requests_is_throttled_for_the_retry_after_seconds() {
        let (_server, provider) = provider_answering(
            ResponseTemplate::new(429)
                .insert_header("Retry-After", "7")
                .set_body_json(json!({ "code": 20429, "message": "Too Many Requests" })),
        )
        .await;
        match send(&provider).await.unwrap_err() {
            ProviderError::Throttled {
                retry_after,
                failure,
            } => {
                assert_eq!(retry_after, Some(Duration::from_secs(7)));
                assert_eq!(failure.reason, "HTTP 429, code 20429: Too Many Requests");
            }
            other => panic!("expected Throttled, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_retry_after_of_thousands_of_years_is_cut_to_the_maximum_pause() {
        for asked in ["99999999999", "18446744073709551615"] {
            let (_server, provider) =
                provider_answering(ResponseTemplate::new(429).insert_header("Retry-After", asked))
                    .await;
            match send(&provider).await.unwrap_err() {
                ProviderError::Throttled { retry_after, .. } => {
                    assert_eq!(retry_after, Some(crate::config::MAX_PROVIDER_PAUSE));
                }
                other => panic!("expected Throttled, got {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn the_account_sid_in_a_providers_own_error_text_is_masked_for_last_error() {
        let (_server, provider) = provider_answering(ResponseTemplate::new(404).set_body_json(
            json!({ "code": 20404, "message": "The requested resource /2010-04-01/Accounts/AC123/Messages.json was not found" }),
        ))
        .await;
        match send(&provider).await.unwrap_err() {
            ProviderError::Permanent(failure) => {
                assert_eq!(
                    failure.reason,
                    "provider rejected: HTTP 404, code 20404: The requested resource \
                     /2010-04-01/Accounts/[account]/Messages.json was not found"
                );
            }
            other => panic!("expected Permanent, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn too_many_requests_without_retry_after_is_throttled_with_no_delay() {
        let (_server, provider) = provider_answering(ResponseTemplate::new(429)).await;
        let err = send(&provider).await.unwrap_err();
        assert!(
            matches!(
                err,
                ProviderError::Throttled {
                    retry_after: None,
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn server_errors_are_transient() {
        for status in [500, 502, 503] {
            let (_server, provider) = provider_answering(
                ResponseTemplate::new(status).set_body_string("upstream trouble"),
            )
            .await;
            match send(&provider).await.unwrap_err() {
                ProviderError::Transient(failure) => {
                    assert_eq!(failure.reason, format!("HTTP {status}"));
                    assert!(failure.detail.contains("upstream trouble"), "{failure:?}");
                }
                other => panic!("expected Transient for {status}, got {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn an_answer_slower_than_the_timeout_is_transient() {
        let server = MockServer::start().await;
        Mock::given(method("POST"))
            .respond_with(
                ResponseTemplate::new(201)
                    .set_body_json(json!({ "sid": "SM-late" }))
                    .set_delay(Duration::from_secs(5)),
            )
            .mount(&server)
            .await;
        let provider = provider(&server.uri(), Duration::from_millis(200));
        match send(&provider).await.unwrap_err() {
            ProviderError::Transient(failure) => {
                assert_eq!(failure.reason, "timeout");
                assert!(failure.detail.contains("within 200 ms"), "{failure:?}");
            }
            other => panic!("expected Transient, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_refused_connection_is_transient() {
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let provider = provider(&format!("http://127.0.0.1:{port}"), Duration::from_secs(5));
        match send(&provider).await.unwrap_err() {
            ProviderError::Transient(failure) => {
                assert_eq!(failure.reason, "connection failed");
                // reqwest's text names the URL, account SID included: log only.
                assert!(failure.detail.contains("cannot connect"), "{failure:?}");
                assert!(failure.detail.contains(SID), "{failure:?}");
            }
            other => panic!("expected Transient, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_success_without_a_sid_is_permanent_so_it_is_not_sent_twice() {
        let (_server, provider) =
            provider_answering(ResponseTemplate::new(201).set_body_string("OK")).await;
        match send(&provider).await.unwrap_err() {
            ProviderError::Permanent(failure) => {
                assert!(
                    failure.reason.contains("without a message id"),
                    "{failure:?}"
                );
                assert!(failure.reason.contains("avoid a duplicate"), "{failure:?}");
            }
            other => panic!("expected Permanent, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn an_email_payload_is_refused_without_a_call() {
        let (server, provider) = provider_answering(
            ResponseTemplate::new(201).set_body_json(json!({ "sid": "SM0003" })),
        )
        .await;
        let err = provider
            .send(&payload(Channel::Email, "a@example.com"))
            .await
            .unwrap_err();
        assert!(matches!(err, ProviderError::Permanent(_)), "{err:?}");
        assert!(server.received_requests().await.unwrap().is_empty());
    }

    #[test]
    fn a_base_url_that_is_not_a_url_is_refused_by_name() {
        let http = crate::providers::tests::http_settings("not a url");
        let settings = ProviderSettings::of_kind(crate::config::ProviderKind::Http(http.clone()));
        let err = SmsHttpProvider::from_settings(&settings, &http).unwrap_err();
        assert!(err.to_string().contains("base_url"), "{err}");
    }

    #[test]
    fn the_auth_token_does_not_print() {
        let provider = provider("http://127.0.0.1:9", Duration::from_secs(1));
        assert!(!format!("{provider:?}").contains(TOKEN));
    }
}
