//! The HTTP server: hyper's connection builder (hyper-util, HTTP/1 and
//! HTTP/2) over a small accept loop, for two things `axum::serve` does not
//! offer:
//!
//! - **A head timeout.** A connection must send a whole request head within
//!   `server.header_read_timeout_secs` of opening, and of going idle after a
//!   response (hyper starts the same timer then), or it is closed. A client
//!   that sends half a head and waits (slowloris), or an idle keep-alive
//!   connection, cannot hold a connection longer. Bodies are bounded by
//!   `request_timeout_secs`, which covers reading them.
//! - **A cap on open connections** (`server.max_connections`, by default
//!   what the open-file limit leaves after a reserve for the store, the
//!   providers and the queue). At the cap, a new connection takes the place
//!   of the oldest one that is waiting for a request head (half-open or
//!   idle), which is closed; when every connection is busy with a request,
//!   the new one is answered `503` with `Retry-After` and closed. A flood of
//!   connections that send nothing cannot lock out a client that does.
//! - **A cap on requests per connection.** An HTTP/2 connection carries at
//!   most `server.http2_max_streams` requests at once, so
//!   `max_connections × http2_max_streams` bounds the requests in progress.
//!
//! The bookkeeping of a connection and of its requests is kept by drop
//! guards: a request or connection that ends by a panic gives its slot
//! back as one that ends normally does.
//!
//! At start the process raises its soft open-file limit to the hard limit
//! ([`raise_open_file_limit`]).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinSet;
use tower::ServiceExt;
use tracing::{debug, info, warn};

use crate::metrics as names;

/// Open files kept back from the connection cap, for the store, provider
/// and queue connections, log files and the like.
const FD_RESERVE: u64 = 128;
/// The fewest connections an automatic cap allows.
const MIN_AUTO_CONNECTIONS: u64 = 16;
/// How long a refused connection may take to receive its `503`.
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);

const REFUSAL: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
content-type: application/problem+json\r\n\
retry-after: 1\r\n\
connection: close\r\n\
content-length: 124\r\n\r\n\
{\"type\":\"urn:fairlane:problem:unavailable\",\"title\":\"Service unavailable\",\"status\":503,\"detail\":\"Too many open connections.\"}";

/// How connections are served; see the module documentation.
#[derive(Debug, Clone, Copy)]
pub struct ServeLimits {
    pub header_read_timeout: Duration,
    pub max_connections: usize,
    /// Most requests in progress on one HTTP/2 connection.
    pub http2_max_streams: u32,
}

/// Raises the soft limit on open files to the hard limit and logs both;
/// returns the soft limit in force afterwards.
pub fn raise_open_file_limit() -> u64 {
    let before = rlimit::getrlimit(rlimit::Resource::NOFILE).ok();
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(soft) => {
            let (was, hard) = before.unwrap_or((soft, soft));
            info!(
                soft_was = was,
                soft = soft,
                hard,
                "Open-file limit raised to the hard limit."
            );
            soft
        }
        Err(err) => {
            let soft = before.map_or(1024, |(soft, _)| soft);
            warn!(error = %err, soft, "Could not raise the open-file limit.");
            soft
        }
    }
}

/// The connection cap: `configured` (0: automatic), never above what the
/// open-file limit `soft_limit` leaves after [`FD_RESERVE`].
pub fn connection_cap(configured: usize, soft_limit: u64) -> usize {
    let room = soft_limit
        .saturating_sub(FD_RESERVE)
        .max(MIN_AUTO_CONNECTIONS);
    let room = usize::try_from(room).unwrap_or(usize::MAX);
    if configured == 0 {
        return room;
    }
    if configured > room {
        warn!(
            configured,
            cap = room,
            soft_limit,
            "server.max_connections is above what the open-file limit allows; using the lower figure."
        );
        return room;
    }
    configured
}

/// One open connection as the accept loop sees it.
struct Open {
    /// Requests being served on it now; 0: it waits for a request head.
    busy: usize,
    /// Closes it (dropping its serve future).
    close: Option<oneshot::Sender<()>>,
}

/// The open connections, by the order they were accepted.
#[derive(Default)]
struct Connections(Mutex<BTreeMap<u64, Open>>);

impl Connections {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Open>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes room for one more under `cap`: `true` when there is room, or
    /// when the oldest connection waiting for a head was told to close.
    fn make_room(&self, cap: usize) -> bool {
        let mut open = self.lock();
        if open.len() < cap {
            return true;
        }
        let oldest_waiting = open
            .iter_mut()
            .find(|(_, connection)| connection.busy == 0 && connection.close.is_some());
        match oldest_waiting {
            Some((id, connection)) => {
                metrics::counter!(names::CONNECTIONS_SHED_TOTAL, "action" => "evicted")
                    .increment(1);
                debug!(
                    connection = id,
                    "Connection cap reached; closing the oldest connection that waits for a request head."
                );
                if let Some(close) = connection.close.take() {
                    let _ = close.send(());
                }
                true
            }
            None => false,
        }
    }

    fn busy(&self, id: u64, change: isize) {
        if let Some(connection) = self.lock().get_mut(&id) {
            connection.busy = connection.busy.saturating_add_signed(change);
        }
    }
}

/// A request in progress on connection `id`: counted while it lives.
struct BusyGuard {
    connections: Arc<Connections>,
    id: u64,
}

impl BusyGuard {
    fn new(connections: Arc<Connections>, id: u64) -> Self {
        connections.busy(id, 1);
        BusyGuard { connections, id }
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.connections.busy(self.id, -1);
    }
}

/// An open connection's place in [`Connections`], given back when it ends,
/// however it ends.
struct OpenGuard {
    connections: Arc<Connections>,
    id: u64,
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.connections.lock().remove(&self.id);
    }
}

/// Serves `router` on `listener` until `shutdown` turns true, then stops
/// accepting, lets requests in progress finish and closes idle connections.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ServeLimits,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder
        .http2()
        .max_concurrent_streams(limits.http2_max_streams)
        .timer(TokioTimer::new())
        .keep_alive_interval(limits.header_read_timeout)
        .keep_alive_timeout(limits.header_read_timeout);
    let builder = Arc::new(builder);
    let connections = Arc::new(Connections::default());
    let mut tasks = JoinSet::new();
    let mut next_id: u64 = 0;
    info!(
        max_connections = limits.max_connections,
        http2_max_streams = limits.http2_max_streams,
        header_read_timeout_secs = limits.header_read_timeout.as_secs_f64(),
        "Serving HTTP."
    );
    loop {
        while tasks.try_join_next().is_some() {}
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.wait_for(|stop| *stop) => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                // Out of file descriptors and the like: wait a little
                // rather than spin.
                warn!(error = %err, "Accepting a connection failed.");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if !connections.make_room(limits.max_connections) {
            metrics::counter!(names::CONNECTIONS_SHED_TOTAL, "action" => "refused").increment(1);
            tasks.spawn(refuse(stream));
            continue;
        }
        next_id += 1;
        let id = next_id;
        let (close, closed) = oneshot::channel();
        connections.lock().insert(
            id,
            Open {
                busy: 0,
                close: Some(close),
            },
        );
        tasks.spawn(serve_one(
            id,
            (stream, peer),
            router.clone(),
            builder.clone(),
            connections.clone(),
            closed,
            shutdown.clone(),
        ));
    }
    // Stopped accepting; connections shut down gracefully on the same
    // signal.
    drop(listener);
    while tasks.join_next().await.is_some() {}
    Ok(())
}

async fn refuse(mut stream: TcpStream) {
    let _ = tokio::time::timeout(REFUSAL_WRITE_TIMEOUT, async {
        let _ = stream.write_all(REFUSAL).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

async fn serve_one(
    id: u64,
    (stream, peer): (TcpStream, std::net::SocketAddr),
    router: Router,
    builder: Arc<Builder<TokioExecutor>>,
    connections: Arc<Connections>,
    closed: oneshot::Receiver<()>,
    mut shutdown: watch::Receiver<bool>,
) {
    let _open = OpenGuard {
        connections: connections.clone(),
        id,
    };
    let _ = stream.set_nodelay(true);
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        let router = router.clone();
        let busy = BusyGuard::new(connections.clone(), id);
        // The client's address, as `axum::serve` leaves it (ConnectInfo):
        // the console's sign-in throttle counts by it.
        let mut request = request.map(axum::body::Body::new);
        request
            .extensions_mut()
            .insert(axum::extract::ConnectInfo(peer));
        async move {
            let response = router.oneshot(request).await;
            drop(busy);
            Ok::<_, Infallible>(response.unwrap_or_else(|never| match never {}))
        }
    });
    let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
    tokio::pin!(connection);
    let mut closed = closed;
    let mut shutting_down = false;
    loop {
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(err) = result {
                    debug!(connection = id, error = %err, "Connection ended with an error.");
                }
                break;
            }
            _ = &mut closed, if !shutting_down => {
                // Evicted at the cap: it was waiting for a head.
                break;
            }
            _ = shutdown.wait_for(|stop| *stop), if !shutting_down => {
                shutting_down = true;
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_stays_under_the_open_file_limit() {
        assert_eq!(connection_cap(0, 1024), 896);
        assert_eq!(connection_cap(500, 1024), 500);
        assert_eq!(connection_cap(5000, 1024), 896);
        assert_eq!(connection_cap(0, 100), 16);
        assert_eq!(connection_cap(0, 1_048_576), 1_048_448);
    }

    #[test]
    fn the_refusal_is_a_whole_http_response() {
        let text = std::str::from_utf8(REFUSAL).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let problem: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(problem["status"], 503);
    }

    #[test]
    fn at_the_cap_the_oldest_connection_waiting_for_a_head_makes_room() {
        let connections = Connections::default();
        let mut receivers = Vec::new();
        for id in 1..=3 {
            let (close, closed) = oneshot::channel();
            receivers.push(closed);
            connections.lock().insert(
                id,
                Open {
                    busy: 0,
                    close: Some(close),
                },
            );
        }
        connections.busy(1, 1);
        assert!(connections.make_room(4), "room below the cap");
        assert!(connections.make_room(3));
        // Connection 1 is busy: connection 2 was told to close.
        assert!(receivers[0].try_recv().is_err());
        assert!(receivers[1].try_recv().is_ok());
        assert!(connections.make_room(3));
        assert!(receivers[2].try_recv().is_ok());
        // Only the busy one is left that has not been told.
        assert!(!connections.make_room(3));
    }
}
