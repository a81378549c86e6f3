//! A handler that panics: answered 500 problem+json, and neither a caught
//! nor an uncaught panic keeps a connection slot.

use std::time::Duration;

use axum::Router;
use axum::routing::get;
use fairlane::serve::{ServeLimits, serve};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Few slots, so a leak of one per panic shows within a handful.
const SLOTS: usize = 4;

async fn always_panics() -> &'static str {
    panic!("a handler bug");
}

async fn ok() -> &'static str {
    "ok"
}

/// Serves `router` with [`SLOTS`] connections; returns its address and the
/// switch that stops it.
async fn start(router: Router) -> (std::net::SocketAddr, watch::Sender<bool>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (stop, stopping) = watch::channel(false);
    let limits = ServeLimits {
        header_read_timeout: Duration::from_secs(5),
        max_connections: SLOTS,
        http2_max_streams: 4,
    };
    tokio::spawn(serve(listener, router, limits, stopping));
    (address, stop)
}

/// One GET on a new connection; the whole response as text ("" when the
/// server closed the connection without an answer).
async fn get_once(address: std::net::SocketAddr, path: &str) -> String {
    let mut stream = TcpStream::connect(address).await.unwrap();
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
    let mut answer = Vec::new();
    // Generous: with RUST_BACKTRACE set, the first panic's backtrace loads
    // the test binary's debug information, which took over 5 s once in CI
    // on two busy cores. A slot that leaked never answers, whatever the wait.
    let _ = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut answer))
        .await
        .expect("the server neither answered nor closed the connection");
    String::from_utf8_lossy(&answer).into_owned()
}

fn routes() -> Router {
    Router::new()
        .route("/panic", get(always_panics))
        .route("/ok", get(ok))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_is_answered_500_and_frees_its_connection_every_time() {
    let (address, stop) = start(fairlane::api::answering_panics(routes())).await;
    for round in 0..1_000 {
        let answer = get_once(address, "/panic").await;
        assert!(
            answer.starts_with("HTTP/1.1 500"),
            "round {round}: {answer}"
        );
        assert!(
            answer.contains("application/problem+json")
                && answer.contains("urn:fairlane:problem:internal")
                && !answer.contains("a handler bug"),
            "round {round}: the 500 must be problem+json without internals: {answer}"
        );
        let answer = get_once(address, "/ok").await;
        assert!(
            answer.starts_with("HTTP/1.1 200"),
            "round {round}: a request after a panic was not served: {answer}"
        );
    }
    let _ = stop.send(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_that_is_not_caught_still_gives_its_connection_slot_back() {
    // No catch-panic layer: the connection's task unwinds. Its slot must
    // come back all the same, or after SLOTS panics every connection would
    // be refused 503.
    let (address, stop) = start(routes()).await;
    for round in 0..(SLOTS * 25) {
        let answer = get_once(address, "/panic").await;
        assert!(
            !answer.starts_with("HTTP/1.1 200"),
            "round {round}: {answer}"
        );
        let answer = get_once(address, "/ok").await;
        assert!(
            answer.starts_with("HTTP/1.1 200"),
            "round {round}: a connection slot leaked with the panic: {answer}"
        );
    }
    let _ = stop.send(true);
}

/// Requests in progress at once in the `/slow` handler, and the most seen.
#[derive(Default)]
struct InProgress {
    now: std::sync::atomic::AtomicUsize,
    most: std::sync::atomic::AtomicUsize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_http2_connection_carries_at_most_its_streams_at_once() {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;

    let seen = Arc::new(InProgress::default());
    let counted = seen.clone();
    let router = Router::new().route(
        "/slow",
        get(move || {
            let counted = counted.clone();
            async move {
                let now = counted.now.fetch_add(1, Ordering::SeqCst) + 1;
                counted.most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
                counted.now.fetch_sub(1, Ordering::SeqCst);
                "ok"
            }
        }),
    );
    // start() allows 4 streams per connection.
    let (address, stop) = start(router).await;
    let stream = TcpStream::connect(address).await.unwrap();
    let (sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .expect("an h2c (prior knowledge) handshake");
    tokio::spawn(connection);
    // One request first: once it is answered the client has the server's
    // SETTINGS (4 streams) and queues what is over them, rather than
    // opening streams the server would refuse before it knew.
    let first = hyper::Request::get(format!("http://{address}/slow"))
        .body(axum::body::Body::empty())
        .unwrap();
    let mut warm = sender.clone();
    warm.ready().await.unwrap();
    assert!(
        warm.send_request(first)
            .await
            .unwrap()
            .status()
            .is_success()
    );
    let requests = (0..20).map(|_| {
        let mut sender = sender.clone();
        async move {
            let request = hyper::Request::get(format!("http://{address}/slow"))
                .body(axum::body::Body::empty())
                .unwrap();
            sender.ready().await.unwrap();
            sender.send_request(request).await.unwrap().status()
        }
    });
    let statuses = futures_util::future::join_all(requests).await;
    assert!(
        statuses.iter().all(|status| status.is_success()),
        "{statuses:?}"
    );
    let most = seen.most.load(Ordering::SeqCst);
    assert!(
        (1..=4).contains(&most),
        "{most} requests were in progress at once on one connection allowed 4 streams"
    );
    let _ = stop.send(true);
}
