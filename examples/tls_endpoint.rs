//! A webhook endpoint over https for `bench/pipeline.sh` (`WEBHOOK=h2` or
//! `WEBHOOK=h1`): the same handler as `bare_axum` (parse the JSON body,
//! answer 202 with a small JSON body) behind TLS, with a certificate made
//! on the spot by a CA made on the spot, whose PEM it writes to CA_FILE for
//! fairlane's `webhooks.ca_file`. It offers HTTP/2 and HTTP/1.1 in its
//! handshake (ALPN), or HTTP/1.1 only with `h1`, as production endpoints
//! behind a load balancer or CDN do.
//!
//!     cargo run --release --example tls_endpoint -- 127.0.0.1:8443 /tmp/ca.pem h2

use std::sync::Arc;

use axum::Json;
use axum::http::StatusCode;
use axum::routing::post;
use serde_json::{Value, json};

async fn accept(Json(body): Json<Value>) -> (StatusCode, Json<Value>) {
    let channel = body.get("channel").cloned().unwrap_or(Value::Null);
    (
        StatusCode::ACCEPTED,
        Json(
            json!({"id": "00000000-0000-0000-0000-000000000000", "status": "queued", "channel": channel}),
        ),
    )
}

/// Accepts TCP connections and completes their TLS handshakes, each on
/// its own task so that one slow handshake holds up no other connection.
struct TlsListener {
    handshaken: tokio::sync::mpsc::Receiver<(
        tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
        std::net::SocketAddr,
    )>,
    local: std::net::SocketAddr,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.handshaken.recv().await {
            Some(connection) => connection,
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let listen = args.next().unwrap_or_else(|| "127.0.0.1:8443".to_owned());
    let ca_file = args
        .next()
        .ok_or_else(|| anyhow::anyhow!("usage: tls_endpoint LISTEN CA_FILE [h2|h1]"))?;
    let alpn: Vec<Vec<u8>> = match args.next().as_deref().unwrap_or("h2") {
        "h2" => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
        "h1" => vec![b"http/1.1".to_vec()],
        other => anyhow::bail!("the protocol is h2 or h1, not {other}"),
    };

    let ca_key = rcgen::KeyPair::generate()?;
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "fairlane bench CA");
    let ca = ca_params.self_signed(&ca_key)?;
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])?;
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params.signed_by(&key, &issuer)?;
    std::fs::write(&ca_file, ca.pem())?;

    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )?;
    tls.alpn_protocols = alpn;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));

    let tcp = tokio::net::TcpListener::bind(&listen).await?;
    let local = tcp.local_addr()?;
    let (handshaken_tx, handshaken) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let Ok((stream, addr)) = tcp.accept().await else {
                continue;
            };
            let (acceptor, handshaken_tx) = (acceptor.clone(), handshaken_tx.clone());
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(stream).await {
                    let _ = handshaken_tx.send((tls, addr)).await;
                }
            });
        }
    });
    let app = axum::Router::new().route("/v1/messages", post(accept));
    axum::serve(TlsListener { handshaken, local }, app).await?;
    Ok(())
}
