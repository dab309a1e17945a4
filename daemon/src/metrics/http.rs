//! The HTTP side of `blkplaned --metrics-listen`: `/metrics`, `/healthz` and `/readyz` on
//! hyper's HTTP/1.1 server, bounded in connections, request size and time (see the module
//! above).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use log::{debug, warn};
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::{collect, render, METRICS_CONTENT_TYPE};
use crate::daemon::Daemon;
use crate::server::ApiHealth;

/// How long a scrape waits for one frontend's statistics. Its admin thread answers from
/// atomics in microseconds, so a frontend that takes longer is stuck or starved; the scrape
/// goes on without its queue series (Prometheus' default scrape timeout is 10 s).
pub const STATS_TIMEOUT: Duration = Duration::from_secs(1);
/// Connections served at once; more are closed as soon as they are accepted.
pub const MAX_CONNECTIONS: usize = 32;
/// The longest a connection may live, request and response included.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client may take to send its request headers.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest request head accepted (hyper's smallest read buffer; a GET needs far less).
pub const MAX_REQUEST_BYTES: usize = 8192;

/// Setting up the metrics endpoint failed.
#[derive(Debug, Error)]
pub enum MetricsError {
    /// The address could not be bound (in use, not local, no permission).
    #[error("--metrics-listen {addr}: cannot listen: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

/// Binds the metrics endpoint's TCP socket (before anything else starts, so that a port in
/// use stops blkplaned at once).
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, MetricsError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind { addr, source })
}

/// What every connection's handler needs.
#[derive(Debug, Clone)]
struct Endpoint {
    daemon: Arc<Daemon>,
    health: ApiHealth,
    /// One scrape at a time: concurrent scrapers wait rather than each opening a connection
    /// to every frontend's admin thread.
    scrape: Arc<tokio::sync::Mutex<()>>,
}

type Body = Full<Bytes>;

/// A response with `body` as `content_type`.
fn response(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// A plain-text response.
fn plain(status: StatusCode, body: &'static str) -> Response<Body> {
    response(status, "text/plain; charset=utf-8", body)
}

impl Endpoint {
    /// Answers one request.
    async fn handle(&self, req: Request<Incoming>) -> Response<Body> {
        let path = req.uri().path();
        if !matches!(path, "/metrics" | "/healthz" | "/readyz") {
            return plain(StatusCode::NOT_FOUND, "not found\n");
        }
        if req.method() != Method::GET && req.method() != Method::HEAD {
            let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "only GET and HEAD\n");
            r.headers_mut()
                .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
            return r;
        }
        match path {
            "/metrics" => {
                let _one = self.scrape.lock().await;
                let text = render(collect(&self.daemon).await);
                response(StatusCode::OK, METRICS_CONTENT_TYPE, text)
            }
            "/healthz" => {
                if self.health.serving().await {
                    plain(StatusCode::OK, "ok")
                } else {
                    plain(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "not serving: the gRPC API is not up\n",
                    )
                }
            }
            _ => {
                if !self.health.serving().await {
                    plain(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "not ready: the gRPC API is not up\n",
                    )
                } else if !self.daemon.startup_done() {
                    plain(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "not ready: the disks of the state are still being adopted or started\n",
                    )
                } else {
                    plain(StatusCode::OK, "ok")
                }
            }
        }
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` for as long as the returned
/// future runs (blkplaned runs it as a task of its own).
pub async fn serve(listener: TcpListener, daemon: Arc<Daemon>, health: ApiHealth) {
    let endpoint = Endpoint {
        daemon,
        health,
        scrape: Arc::new(tokio::sync::Mutex::new(())),
    };
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors, mostly: wait instead of spinning on the error.
                warn!("metrics endpoint: accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            debug!("metrics endpoint: {MAX_CONNECTIONS} connections open; closing {peer}'s");
            continue;
        };
        let endpoint = endpoint.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let service = hyper::service::service_fn(move |req| {
                let endpoint = endpoint.clone();
                async move { Ok::<_, Infallible>(endpoint.handle(req).await) }
            });
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .max_buf_size(MAX_REQUEST_BYTES)
                // One request per connection: the connection's lifetime bounds the client.
                .keep_alive(false);
            let connection = http.serve_connection(TokioIo::new(stream), service);
            match tokio::time::timeout(CONNECTION_TIMEOUT, connection).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => debug!("metrics endpoint: {peer}: {e}"),
                Err(_) => debug!("metrics endpoint: {peer}: closed after {CONNECTION_TIMEOUT:?}"),
            }
        });
    }
}
