//! How webhook calls travel: over HTTP/2 when the endpoint offers it in
//! its TLS handshake, on kept-alive HTTP/1.1 connections when it does not,
//! and to an endpoint whose certificate chains to `webhooks.ca_file`.

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::Version;
use axum::response::IntoResponse;
use serde_json::json;

use crate::receipts::app_with_callbacks;
use crate::support::{sms, with};

/// Accepts TCP connections and completes their TLS handshake, counting
/// them; a failed handshake is dropped.
struct TlsListener {
    tcp: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    connections: Arc<AtomicUsize>,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((tcp, addr)) = self.tcp.accept().await else {
                continue;
            };
            if let Ok(tls) = self.acceptor.accept(tcp).await {
                self.connections.fetch_add(1, Ordering::SeqCst);
                return (tls, addr);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

/// An https endpoint on 127.0.0.1 answering 204, with a certificate made
/// for it by a CA made for the test (written to `ca_file`), offering the
/// `alpn` protocols; it records each call's HTTP version.
struct TlsEndpoint {
    url: String,
    ca_file: tempfile::NamedTempFile,
    versions: Arc<Mutex<Vec<Version>>>,
    connections: Arc<AtomicUsize>,
}

impl TlsEndpoint {
    async fn start(alpn: &[&[u8]]) -> TlsEndpoint {
        TlsEndpoint::answering(alpn, None).await
    }

    /// As [`TlsEndpoint::start`]; with `body`, each call is answered 200
    /// with that JSON body instead of 204.
    async fn answering(alpn: &[&[u8]], body: Option<&'static str>) -> TlsEndpoint {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "fairlane test CA");
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap();
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let cert = params.signed_by(&key, &issuer).unwrap();
        let mut ca_file = tempfile::NamedTempFile::new().unwrap();
        ca_file.write_all(ca.pem().as_bytes()).unwrap();

        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut tls = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .unwrap();
        tls.alpn_protocols = alpn.iter().map(|protocol| protocol.to_vec()).collect();

        let versions: Arc<Mutex<Vec<Version>>> = Arc::default();
        let connections = Arc::new(AtomicUsize::new(0));
        let listener = TlsListener {
            tcp: tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(tls)),
            connections: connections.clone(),
        };
        let url = format!(
            "https://{}/hook",
            axum::serve::Listener::local_addr(&listener).unwrap()
        );
        let seen = versions.clone();
        let app = axum::Router::new().fallback(move |request: axum::extract::Request| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(request.version());
                match body {
                    Some(body) => (
                        axum::http::StatusCode::OK,
                        [("content-type", "application/json")],
                        body,
                    )
                        .into_response(),
                    None => axum::http::StatusCode::NO_CONTENT.into_response(),
                }
            }
        });
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        TlsEndpoint {
            url,
            ca_file,
            versions,
            connections,
        }
    }

    fn versions(&self) -> Vec<Version> {
        self.versions.lock().unwrap().clone()
    }
}

/// Sends `count` SMS for a tenant whose webhook (`message.sent`) is
/// `endpoint`, and waits until the endpoint has had that many calls.
async fn calls_to(endpoint: &TlsEndpoint, count: usize) -> Vec<Version> {
    let sms_api = crate::webhooks::sms_api_with_unique_sids().await;
    // Two calls at once at most: without kept-alive connections the
    // HTTP/1.1 endpoint would see one connection per call.
    let settings = format!(
        "[webhooks]\npoll_interval_ms = 100\nallow_private = [\"127.0.0.1/32\"]\n\
         concurrency_per_tenant = 2\nmax_concurrency_per_tenant = 2\nca_file = \"{}\"\n",
        endpoint.ca_file.path().display()
    );
    let app = app_with_callbacks(&sms_api, &settings).await;
    let key = app.tenant_with_key("acme", "pro").await;
    let set = app
        .tenant(&key, reqwest::Method::PUT, "/v1/webhook")
        .json(&json!({"url": endpoint.url, "events": ["message.sent"]}))
        .send()
        .await
        .unwrap();
    assert!(set.status().is_success(), "{}", set.text().await.unwrap());
    for n in 0..count {
        app.send_accepted(&key, &with(sms(), "text", json!(format!("tls {n}"))))
            .await;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while endpoint.versions().len() < count && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    endpoint.versions()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_offering_http2_gets_every_call_as_a_stream_of_one_connection() {
    let endpoint = TlsEndpoint::start(&[b"h2", b"http/1.1"]).await;
    let versions = calls_to(&endpoint, 20).await;
    assert_eq!(versions.len(), 20, "calls that arrived: {versions:?}");
    assert!(
        versions.iter().all(|version| *version == Version::HTTP_2),
        "{versions:?}"
    );
    // The first two calls may each open a connection before either has
    // learnt (from the handshake) that it could carry both.
    let connections = endpoint.connections.load(Ordering::SeqCst);
    assert!(
        connections <= 2,
        "20 calls, at most 2 at once, took {connections} connections"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_endpoint_gets_its_calls_on_kept_alive_connections() {
    let endpoint = TlsEndpoint::start(&[b"http/1.1"]).await;
    let versions = calls_to(&endpoint, 20).await;
    assert_eq!(versions.len(), 20, "calls that arrived: {versions:?}");
    assert!(
        versions.iter().all(|version| *version == Version::HTTP_11),
        "{versions:?}"
    );
    let connections = endpoint.connections.load(Ordering::SeqCst);
    assert!(
        connections <= 2,
        "20 calls, at most 2 at once, took {connections} connections"
    );
}

/// Many endpoints answer a call with a body (a JSON acknowledgement, an
/// HTML page); its connection still carries the next call: fairlane reads
/// the answer to its end. (Dropped unread, a body larger than what arrived
/// with the answer's head closes the connection: 20 connections for 20
/// calls.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_answering_with_a_body_keeps_its_connections_alive() {
    let answer = format!(
        r#"{{"received": true, "note": "{}"}}"#,
        "x".repeat(32 * 1024)
    );
    let endpoint = TlsEndpoint::answering(&[b"http/1.1"], Some(answer.leak())).await;
    let versions = calls_to(&endpoint, 20).await;
    assert_eq!(versions.len(), 20, "calls that arrived: {versions:?}");
    let connections = endpoint.connections.load(Ordering::SeqCst);
    assert!(
        connections <= 2,
        "20 calls answered with a 32 KiB body, at most 2 at once, took {connections} connections"
    );
}
