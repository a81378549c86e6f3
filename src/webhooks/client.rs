//! The webhook calls' HTTP client: hyper's pooled client, without
//! reqwest's layers around it.
//!
//! A call's whole client side is on the delivery path of every event, and
//! with reqwest's request building, timeout and response wrapping around
//! hyper it cost about 25 µs of CPU per call against hyper's own 18
//! (`bench/call_floor.sh`, issue 27). What the dispatcher needs of a
//! client is small, and kept here:
//! - names resolved through [`EndpointPolicy`] ([`CheckingResolver`]), so a
//!   connection is only made to an address checked at that moment;
//! - no redirects followed and no proxy (hyper does neither);
//! - TLS with the platform's roots and `webhooks.ca_file`'s, offering
//!   HTTP/2 and HTTP/1.1 (ALPN): an endpoint that picks HTTP/2 gets its
//!   calls as streams of one connection, others kept-alive HTTP/1.1
//!   connections;
//! - one timeout for the whole call, answer read to its end included.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::StatusCode;
use hyper::header::{CONTENT_TYPE, HeaderValue, USER_AGENT};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::connect::dns::Name;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use url::Url;

use super::endpoint::{EndpointPolicy, Refusal};
use crate::config::WebhookSettings;

/// The most of an answer's body that is read (and dropped) so that its
/// connection can carry the next call; a longer body is left unread and
/// its connection closed.
const READ_OUT_LIMIT: usize = 64 * 1024;

const AGENT: &str = concat!("fairlane-webhooks/", env!("CARGO_PKG_VERSION"));

/// Makes webhook calls (see the module documentation).
pub struct WebhookClient {
    client: Client<HttpsConnector<HttpConnector<CheckingResolver>>, Full<Bytes>>,
    timeout: Duration,
}

/// Why a call got no answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("the call failed")]
    Failed(#[source] hyper_util::client::legacy::Error),
    #[error("the request could not be built")]
    Request(#[source] hyper::http::Error),
}

impl WebhookClient {
    pub fn new(settings: &WebhookSettings, policy: &EndpointPolicy) -> anyhow::Result<Self> {
        let extra = match &settings.ca_file {
            Some(path) => extra_roots(path)?,
            None => Vec::new(),
        };
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let verifier =
            rustls_platform_verifier::Verifier::new_with_extra_roots(extra, provider.clone())
                .context("loading the platform's root certificates for webhook calls")?;
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth();
        let mut http = HttpConnector::new_with_resolver(CheckingResolver(policy.clone()));
        // https is wrapped around it; plain http passes through.
        http.enforce_http(false);
        http.set_nodelay(true);
        // The call's timeout ends the wait, not a connect the pool carries
        // on with in the background: this bounds that connect too.
        http.set_connect_timeout(Some(Duration::from_millis(settings.timeout_ms)));
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http);
        // Idle connections are closed after 90 s, as reqwest's pool did; the
        // timer lets the pool drop them while nobody checks one out.
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_timer(TokioTimer::new())
            .build(connector);
        Ok(WebhookClient {
            client,
            timeout: Duration::from_millis(settings.timeout_ms),
        })
    }

    /// POSTs `body` (JSON) with `headers` to `url` and reads the answer
    /// to its end (up to [`READ_OUT_LIMIT`]): its status.
    pub async fn post(
        &self,
        url: &Url,
        headers: [(&'static str, HeaderValue); 3],
        body: Vec<u8>,
    ) -> Result<StatusCode, CallError> {
        let mut request = hyper::Request::post(url.as_str())
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .header(USER_AGENT, HeaderValue::from_static(AGENT));
        for (name, value) in headers {
            request = request.header(name, value);
        }
        let request = request
            .body(Full::new(Bytes::from(body)))
            .map_err(CallError::Request)?;
        let call = async {
            let answer = self
                .client
                .request(request)
                .await
                .map_err(CallError::Failed)?;
            let status = answer.status();
            let mut body = answer.into_body();
            let mut read = 0;
            while read <= READ_OUT_LIMIT {
                match body.frame().await {
                    Some(Ok(frame)) => read += frame.data_ref().map_or(0, |data| data.len()),
                    Some(Err(_)) | None => break,
                }
            }
            Ok(status)
        };
        tokio::time::timeout(self.timeout, call)
            .await
            .unwrap_or(Err(CallError::Timeout(self.timeout)))
    }
}

/// The webhook client's DNS resolver: the system's, through
/// [`EndpointPolicy::resolve`], so a connection is only ever made to an
/// address checked at that moment. An address written in the URL is not
/// resolved; [`EndpointPolicy::check_call`] checks it before the call.
#[derive(Clone)]
pub struct CheckingResolver(EndpointPolicy);

impl tower::Service<Name> for CheckingResolver {
    type Response = std::vec::IntoIter<std::net::SocketAddr>;
    type Error = Refusal;
    type Future =
        Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let policy = self.0.clone();
        Box::pin(async move { Ok(policy.resolve(name.as_str()).await?.into_iter()) })
    }
}

/// The certificates of `webhooks.ca_file`, at least one.
fn extra_roots(
    path: &std::path::Path,
) -> anyhow::Result<Vec<rustls::pki_types::CertificateDer<'static>>> {
    use rustls::pki_types::pem::PemObject;
    let shown = path.display();
    let pem = std::fs::read(path).with_context(|| format!("reading webhooks.ca_file {shown}"))?;
    let roots = rustls::pki_types::CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("webhooks.ca_file {shown} is not a PEM bundle"))?;
    if roots.is_empty() {
        anyhow::bail!("webhooks.ca_file {shown} holds no PEM certificate");
    }
    Ok(roots)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ca_file_that_cannot_be_read_or_holds_no_certificate_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let err = format!("{:#}", extra_roots(&missing).unwrap_err());
        assert!(
            err.contains("webhooks.ca_file") && err.contains("missing.pem"),
            "{err}"
        );
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let err = format!("{:#}", extra_roots(&empty).unwrap_err());
        assert!(err.contains("holds no PEM certificate"), "{err}");
    }
}
