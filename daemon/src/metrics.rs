//! The HTTP endpoint of `blkplaned --metrics-listen ADDR:PORT`: Prometheus metrics
//! (`GET /metrics`, text exposition format 0.0.4), liveness (`GET /healthz`) and readiness
//! (`GET /readyz`) for Kubernetes.
//!
//! **Where the numbers come from.** Disk-level values (state, restarts, VMM connected,
//! capacity, migration blockers) are what blkplaned already keeps: its runtime state and the
//! status each disk's supervisor polls every `--poll-interval-ms`. The per-queue I/O
//! statistics are read at scrape time from each running frontend's admin channel (its
//! `Stats` request, as GetStats does), all disks at once, each bounded by [`STATS_TIMEOUT`].
//! Why at scrape time rather than a cache filled by the poll: the frontend's counters are
//! lock-free atomics its queue workers update and its admin thread only reads, so asking
//! costs the I/O path nothing; blkplaned does no statistics work at all while nobody
//! scrapes; and every scrape sees counters as of that moment, not up to a poll interval old.
//! A frontend that does not answer in time only loses its queue series for that scrape
//! (`blkplane_disk_stats_available` is 0), and scrapes are serialized so that a burst of
//! them cannot pile connections onto the frontends' admin threads.
//!
//! **HTTP.** hyper's HTTP/1.1 server (already in the build through tonic), one task per
//! connection, at most [`MAX_CONNECTIONS`] at once (more are closed at accept), request
//! headers limited to [`MAX_REQUEST_BYTES`] and [`HEADER_TIMEOUT`], one request per
//! connection, every connection closed after [`CONNECTION_TIMEOUT`]: a slow or hostile client
//! costs one task and never blocks the daemon.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use blkplane_proto::v1::{FrontendStatus, LatencyHistogram, QueueStats};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use log::{debug, warn};
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::admin;
use crate::daemon::Daemon;
use crate::migration;
use crate::pb::{DiskState, MigrationBlockerReason as Reason};
use crate::runtime::serving;
use crate::server::ApiHealth;
use blkplane_api::names::{reason_name, state_name};

/// The `Content-Type` of `/metrics`: Prometheus' text exposition format 0.0.4 (UTF-8).
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4";
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

// ---------------------------------------------------------------------------------------------
// What a scrape reports.

/// Everything one scrape reports.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// Every disk, ordered by id.
    pub disks: Vec<DiskMetrics>,
}

/// What a scrape reports of one disk.
#[derive(Debug, Clone, PartialEq)]
pub struct DiskMetrics {
    /// The disk id.
    pub id: String,
    /// Its state.
    pub state: DiskState,
    /// Frontend starts by this blkplaned after the first one.
    pub frontend_restarts: u32,
    /// The frontend's status as last polled; `None` while no frontend runs.
    pub status: Option<FrontendStatus>,
    /// Its migration blockers now (automatic and the operator's).
    pub blockers: Vec<Reason>,
    /// Per-queue statistics read at this scrape; `None` when no frontend runs or it did not
    /// answer within [`STATS_TIMEOUT`].
    pub queues: Option<Vec<QueueStats>>,
}

/// The disk states as series of `blkplane_disk_state`, in the API's order.
const STATES: [DiskState; 7] = [
    DiskState::Starting,
    DiskState::Ready,
    DiskState::Connected,
    DiskState::Restarting,
    DiskState::Failed,
    DiskState::Stopping,
    DiskState::Drained,
];

/// The blocker reasons as series of `blkplane_disk_migration_blockers`, in the API's order.
const REASONS: [Reason; 8] = blkplane_api::names::BLOCKER_REASONS;

/// Reads the daemon's view of every disk and, all at once, each running frontend's
/// statistics (each bounded by [`STATS_TIMEOUT`]).
pub async fn collect(daemon: &Daemon) -> Snapshot {
    let now = blkplane_api::time::unix_time_ms();
    let mut disks = Vec::new();
    let mut asks = tokio::task::JoinSet::new();
    for (index, disk) in daemon.disks().into_iter().enumerate() {
        let rt = disk.runtime();
        let running = rt.pid != 0 && serving(rt.state);
        if running {
            let socket = disk.paths.admin_socket.clone();
            let id = disk.spec.id.clone();
            asks.spawn(async move {
                match admin::stats_within(&socket, STATS_TIMEOUT).await {
                    Ok(stats) => Some((index, stats.queues)),
                    Err(e) => {
                        debug!("disk {id}: no statistics for the metrics endpoint: {e}");
                        None
                    }
                }
            });
        }
        disks.push(DiskMetrics {
            id: disk.spec.id.clone(),
            state: rt.state,
            frontend_restarts: rt.restarts,
            blockers: migration::blockers(&rt, now)
                .iter()
                .map(|b| b.reason)
                .collect(),
            status: rt.status.filter(|_| rt.pid != 0),
            queues: None,
        });
    }
    while let Some(done) = asks.join_next().await {
        if let Ok(Some((index, queues))) = done {
            if let Some(d) = disks.get_mut(index) {
                d.queues = Some(queues);
            }
        }
    }
    Snapshot { disks }
}

// ---------------------------------------------------------------------------------------------
// Rendering.

/// The Prometheus type of a metric family.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// The text being rendered. A family is written only if it has samples, its HELP and TYPE
/// lines first and all its samples together, as the format requires.
struct Text {
    out: String,
}

/// One metric family's samples, collected before they are written.
struct Family {
    name: &'static str,
    kind: Kind,
    help: &'static str,
    lines: String,
}

impl Family {
    fn new(name: &'static str, kind: Kind, help: &'static str) -> Family {
        Family {
            name,
            kind,
            help,
            lines: String::new(),
        }
    }

    /// Adds a sample of this family (`suffix` is `_bucket`, `_sum` or `_count` for a
    /// histogram, else empty).
    fn sample(&mut self, suffix: &str, labels: &[(&str, &str)], value: &str) {
        let _ = write!(self.lines, "{}{suffix}", self.name);
        if !labels.is_empty() {
            self.lines.push('{');
            for (i, (name, value)) in labels.iter().enumerate() {
                if i > 0 {
                    self.lines.push(',');
                }
                let _ = write!(self.lines, "{name}=\"{}\"", escape_label(value));
            }
            self.lines.push('}');
        }
        let _ = writeln!(self.lines, " {value}");
    }
}

impl Text {
    fn add(&mut self, family: Family) {
        if family.lines.is_empty() {
            return;
        }
        let _ = writeln!(
            self.out,
            "# HELP {} {}",
            family.name,
            escape_help(family.help)
        );
        let _ = writeln!(self.out, "# TYPE {} {}", family.name, family.kind.name());
        self.out.push_str(&family.lines);
    }
}

/// A label value as the format wants it: backslash, double quote and newline escaped.
fn escape_label(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// A HELP text as the format wants it: backslash and newline escaped.
fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

/// Nanoseconds as exact decimal seconds ("0.000001", "3", "1.5"): no float rounding, so a
/// bucket bound reads the same in every scrape.
fn seconds(ns: u128) -> String {
    let whole = ns / 1_000_000_000;
    let frac = ns % 1_000_000_000;
    if frac == 0 {
        return whole.to_string();
    }
    let frac = format!("{frac:09}");
    format!("{whole}.{}", frac.trim_end_matches('0'))
}

fn flag(b: bool) -> &'static str {
    if b {
        "1"
    } else {
        "0"
    }
}

/// One queue's counters by request kind: (kind, ops, bytes); bytes are `None` for the kinds
/// that move none (flush, and GET_ID answered by the frontend, "other").
fn by_kind(q: &QueueStats) -> [(&'static str, u64, Option<u64>); 6] {
    [
        ("read", q.read_ops, Some(q.read_bytes)),
        ("write", q.write_ops, Some(q.write_bytes)),
        ("flush", q.flush_ops, None),
        ("discard", q.discard_ops, Some(q.discard_bytes)),
        (
            "write_zeroes",
            q.write_zeroes_ops,
            Some(q.write_zeroes_bytes),
        ),
        ("other", q.other_ops, None),
    ]
}

/// A latency histogram as Prometheus buckets: (upper bound `le` in seconds or "+Inf",
/// cumulative count), the last always "+Inf"; with the estimated sum in seconds and the
/// count. The frontend's last bound (u64::MAX µs) is its open-ended bucket; a histogram
/// without one gets a "+Inf" bucket holding the total.
///
/// The frontend counts requests per bucket, not their latencies' sum, so `_sum` is an
/// estimate: each request counted at the middle of its bucket (lower bound: the previous
/// bucket's upper bound, 0 for the first), those of the open-ended bucket at its lower bound.
fn histogram(h: &LatencyHistogram) -> (Vec<(String, u64)>, String, u64) {
    let mut buckets = Vec::with_capacity(h.counts.len() + 1);
    let mut cumulative: u64 = 0;
    // Sum of (lower + upper) in µs, i.e. twice the midpoint sum, to stay in integers.
    let mut twice_sum_us: u128 = 0;
    let mut lower_us: u64 = 0;
    let mut open_ended = false;
    for (&upper_us, &count) in h.upper_bounds_us.iter().zip(&h.counts) {
        cumulative = cumulative.saturating_add(count);
        if upper_us == u64::MAX {
            twice_sum_us += u128::from(count) * 2 * u128::from(lower_us);
            buckets.push(("+Inf".to_string(), cumulative));
            open_ended = true;
            break;
        }
        twice_sum_us += u128::from(count) * (u128::from(lower_us) + u128::from(upper_us));
        buckets.push((seconds(u128::from(upper_us) * 1000), cumulative));
        lower_us = upper_us;
    }
    if !open_ended {
        buckets.push(("+Inf".to_string(), cumulative));
    }
    // twice_sum_us / 2 µs = twice_sum_us * 500 ns.
    (buckets, seconds(twice_sum_us * 500), cumulative)
}

/// The per-queue rows of [`render`] with borrowed labels.
fn rows<'a>(
    queues: &'a [(&'a str, String, &'a QueueStats)],
) -> impl Iterator<Item = (&'a str, &'a str, &'a QueueStats)> + 'a {
    queues
        .iter()
        .map(|(disk, queue, q)| (*disk, queue.as_str(), *q))
}

/// The daemon's version, for `blkplane_build_info`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Renders a scrape in Prometheus' text exposition format 0.0.4.
pub fn render(snapshot: &Snapshot) -> String {
    let mut text = Text { out: String::new() };
    let disks = &snapshot.disks;

    let mut f = Family::new(
        "blkplane_build_info",
        Kind::Gauge,
        "Always 1; the label says which blkplaned serves the metrics.",
    );
    f.sample("", &[("version", VERSION)], "1");
    text.add(f);

    let mut f = Family::new(
        "blkplane_disks",
        Kind::Gauge,
        "Disks blkplaned owns, in any state.",
    );
    f.sample("", &[], &disks.len().to_string());
    text.add(f);

    let mut f = Family::new(
        "blkplane_disk_state",
        Kind::Gauge,
        "1 for the disk's current state (starting, ready, connected, restarting, failed, \
         stopping, drained), 0 for the others.",
    );
    for d in disks {
        for s in STATES {
            f.sample(
                "",
                &[("disk", d.id.as_str()), ("state", state_name(s))],
                flag(d.state == s),
            );
        }
    }
    text.add(f);

    let mut f = Family::new(
        "blkplane_disk_vmm_connected",
        Kind::Gauge,
        "1 while a VMM is connected to the disk's vhost-user socket (as of the last status poll).",
    );
    for d in disks {
        let connected = d.status.as_ref().is_some_and(|s| s.vmm_connected);
        f.sample("", &[("disk", d.id.as_str())], flag(connected));
    }
    text.add(f);

    let mut f = Family::new(
        "blkplane_disk_capacity_bytes",
        Kind::Gauge,
        "The disk's capacity in bytes, as its running frontend reports it (absent while none runs).",
    );
    for d in disks {
        if let Some(s) = &d.status {
            f.sample(
                "",
                &[("disk", d.id.as_str())],
                &s.capacity_bytes.to_string(),
            );
        }
    }
    text.add(f);

    let mut f = Family::new(
        "blkplane_disk_frontend_restarts_total",
        Kind::Counter,
        "Times this blkplaned started the disk's frontend again (after a crash or a failed \
         start); counted since blkplaned started.",
    );
    for d in disks {
        f.sample(
            "",
            &[("disk", d.id.as_str())],
            &d.frontend_restarts.to_string(),
        );
    }
    text.add(f);

    let mut f = Family::new(
        "blkplane_disk_iothread_restarts_total",
        Kind::Counter,
        "Iothreads the disk's frontend replaced since it started (absent while no frontend runs).",
    );
    for d in disks {
        if let Some(s) = &d.status {
            f.sample(
                "",
                &[("disk", d.id.as_str())],
                &s.iothread_restarts.to_string(),
            );
        }
    }
    text.add(f);

    let mut f = Family::new(
        "blkplane_disk_migratable",
        Kind::Gauge,
        "1 if the disk may be live-migrated now (it has no migration blocker), else 0.",
    );
    for d in disks {
        f.sample("", &[("disk", d.id.as_str())], flag(d.blockers.is_empty()));
    }
    text.add(f);

    let mut f = Family::new(
        "blkplane_disk_migration_blockers",
        Kind::Gauge,
        "1 for each reason that blocks the disk's live migration now, 0 for the others.",
    );
    for d in disks {
        for r in REASONS {
            f.sample(
                "",
                &[("disk", d.id.as_str()), ("reason", reason_name(r))],
                flag(d.blockers.contains(&r)),
            );
        }
    }
    text.add(f);

    let mut f = Family::new(
        "blkplane_disk_stats_available",
        Kind::Gauge,
        "1 if the disk's frontend answered this scrape's statistics request (then its \
         blkplane_queue_* series are present), 0 if none runs or it did not answer in time.",
    );
    for d in disks {
        f.sample("", &[("disk", d.id.as_str())], flag(d.queues.is_some()));
    }
    text.add(f);

    // Per queue: (disk id, queue index as a label, counters).
    let queues: Vec<(&str, String, &QueueStats)> = disks
        .iter()
        .flat_map(|d| {
            d.queues
                .iter()
                .flatten()
                .map(move |q| (d.id.as_str(), q.index.to_string(), q))
        })
        .collect();

    let mut f = Family::new(
        "blkplane_queue_ops_total",
        Kind::Counter,
        "Completed requests by kind (read, write, flush, discard, write_zeroes; other: GET_ID, \
         answered by the frontend), since the frontend started.",
    );
    for (disk, queue, q) in rows(&queues) {
        for (kind, ops, _) in by_kind(q) {
            f.sample(
                "",
                &[("disk", disk), ("queue", queue), ("kind", kind)],
                &ops.to_string(),
            );
        }
    }
    text.add(f);

    let mut f = Family::new(
        "blkplane_queue_bytes_total",
        Kind::Counter,
        "Bytes moved by completed requests by kind (read, write, discard, write_zeroes; flush \
         and other move none), since the frontend started.",
    );
    for (disk, queue, q) in rows(&queues) {
        for (kind, _, bytes) in by_kind(q) {
            if let Some(bytes) = bytes {
                f.sample(
                    "",
                    &[("disk", disk), ("queue", queue), ("kind", kind)],
                    &bytes.to_string(),
                );
            }
        }
    }
    text.add(f);

    let mut f = Family::new(
        "blkplane_queue_in_flight",
        Kind::Gauge,
        "Requests of the queue in flight now (including those waiting for the I/O limits).",
    );
    for (disk, queue, q) in rows(&queues) {
        f.sample(
            "",
            &[("disk", disk), ("queue", queue)],
            &q.in_flight.to_string(),
        );
    }
    text.add(f);

    let mut f = Family::new(
        "blkplane_queue_errors_total",
        Kind::Counter,
        "Requests completed with an error status (I/O errors and rejected requests).",
    );
    for (disk, queue, q) in rows(&queues) {
        f.sample(
            "",
            &[("disk", disk), ("queue", queue)],
            &q.errors.to_string(),
        );
    }
    text.add(f);

    let mut f = Family::new(
        "blkplane_queue_rejected_total",
        Kind::Counter,
        "Requests rejected by validation (most also count as errors; chains returned unread \
         count only here).",
    );
    for (disk, queue, q) in rows(&queues) {
        f.sample(
            "",
            &[("disk", disk), ("queue", queue)],
            &q.rejected.to_string(),
        );
    }
    text.add(f);

    let mut f = Family::new(
        "blkplane_queue_latency_seconds",
        Kind::Histogram,
        "Latency of requests that went to an iothread, from taking them off the ring to the \
         used entry (power-of-two microsecond buckets). The frontend keeps no sum: _sum is \
         estimated from the bucket bounds, each request at the middle of its bucket (those \
         above the last finite bound at that bound).",
    );
    for (disk, queue, q) in rows(&queues) {
        let Some(h) = &q.latency else {
            continue;
        };
        let (buckets, sum, count) = histogram(h);
        for (le, cumulative) in &buckets {
            f.sample(
                "_bucket",
                &[("disk", disk), ("queue", queue), ("le", le)],
                &cumulative.to_string(),
            );
        }
        f.sample("_sum", &[("disk", disk), ("queue", queue)], &sum);
        f.sample(
            "_count",
            &[("disk", disk), ("queue", queue)],
            &count.to_string(),
        );
    }
    text.add(f);

    let mut f = Family::new(
        "blkplane_queue_throttled_seconds_total",
        Kind::Counter,
        "Time the queue's requests spent waiting for the disk's I/O limits, summed over requests.",
    );
    for (disk, queue, q) in rows(&queues) {
        f.sample(
            "",
            &[("disk", disk), ("queue", queue)],
            &seconds(u128::from(q.throttled_ns)),
        );
    }
    text.add(f);

    let mut f = Family::new(
        "blkplane_queue_throttled_ops_total",
        Kind::Counter,
        "Requests of the queue that had to wait for the disk's I/O limits.",
    );
    for (disk, queue, q) in rows(&queues) {
        f.sample(
            "",
            &[("disk", disk), ("queue", queue)],
            &q.throttled_ops.to_string(),
        );
    }
    text.add(f);

    text.out
}

// ---------------------------------------------------------------------------------------------
// HTTP.

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
                let text = render(&collect(&self.daemon).await);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(index: u32) -> QueueStats {
        QueueStats {
            index,
            read_ops: 3,
            read_bytes: 3 * 4096,
            write_ops: 2,
            write_bytes: 8192,
            flush_ops: 1,
            other_ops: 1,
            in_flight: 1,
            errors: 1,
            rejected: 1,
            throttled_ns: 1_500_000_001,
            throttled_ops: 2,
            latency: Some(LatencyHistogram {
                upper_bounds_us: vec![1, 2, 4, u64::MAX],
                counts: vec![1, 0, 3, 1],
            }),
            ..Default::default()
        }
    }

    fn snapshot() -> Snapshot {
        Snapshot {
            disks: vec![
                DiskMetrics {
                    id: "a".into(),
                    state: DiskState::Connected,
                    frontend_restarts: 2,
                    status: Some(FrontendStatus {
                        vmm_connected: true,
                        capacity_bytes: 1 << 20,
                        iothread_restarts: 1,
                        ..Default::default()
                    }),
                    blockers: vec![Reason::UnsupportedFeature],
                    queues: Some(vec![queue(0), queue(1)]),
                },
                DiskMetrics {
                    id: "b".into(),
                    state: DiskState::Failed,
                    frontend_restarts: 5,
                    status: None,
                    blockers: vec![Reason::FrontendRestarting, Reason::OperatorBackup],
                    queues: None,
                },
            ],
        }
    }

    /// The sample lines of `text` whose name and labels start with `prefix`.
    fn lines<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
        text.lines().filter(|l| l.starts_with(prefix)).collect()
    }

    #[test]
    fn seconds_are_exact() {
        assert_eq!(seconds(0), "0");
        assert_eq!(seconds(1000), "0.000001");
        assert_eq!(seconds(1_500_000_001), "1.500000001");
        assert_eq!(seconds(4_194_304_000), "4.194304");
        assert_eq!(seconds(3_000_000_000), "3");
    }

    #[test]
    fn histogram_is_cumulative_with_inf() {
        let (b, sum, count) = histogram(&LatencyHistogram {
            upper_bounds_us: vec![1, 2, 4, u64::MAX],
            counts: vec![1, 0, 3, 1],
        });
        assert_eq!(
            b,
            [
                ("0.000001".to_string(), 1),
                ("0.000002".to_string(), 1),
                ("0.000004".to_string(), 4),
                ("+Inf".to_string(), 5)
            ]
        );
        assert_eq!(count, 5);
        // 1 × 0.5 µs + 3 × 3 µs + 1 × 4 µs (open-ended: its lower bound) = 13.5 µs.
        assert_eq!(sum, "0.0000135");
        // No open-ended bucket: one is added with the total.
        let (b, _, count) = histogram(&LatencyHistogram {
            upper_bounds_us: vec![10],
            counts: vec![2],
        });
        assert_eq!(b.last(), Some(&("+Inf".to_string(), 2)));
        assert_eq!(count, 2);
        // Empty.
        let (b, sum, count) = histogram(&LatencyHistogram::default());
        assert_eq!((b.len(), sum.as_str(), count), (1, "0", 0));
    }

    #[test]
    fn renders_every_family_once_with_help_and_type() {
        let text = render(&snapshot());
        let mut seen = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap();
                assert!(!seen.contains(&name.to_string()), "{name} twice");
                seen.push(name.to_string());
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                assert_eq!(rest.split(' ').next(), seen.last().map(|s| s.as_str()));
                continue;
            }
            // Every sample belongs to the family declared last.
            let family = seen.last().expect("a sample before any HELP");
            assert!(line.starts_with(family.as_str()), "{line} after {family}");
        }
        assert!(text.ends_with('\n'));
        assert!(text.contains("# TYPE blkplane_queue_latency_seconds histogram\n"));
        assert!(text.contains("# TYPE blkplane_queue_ops_total counter\n"));
        assert!(text.contains("# TYPE blkplane_disk_state gauge\n"));
    }

    #[test]
    fn disk_series() {
        let text = render(&snapshot());
        assert!(text.contains(&format!("blkplane_build_info{{version=\"{VERSION}\"}} 1\n")));
        assert!(text.contains("\nblkplane_disks 2\n"));
        assert!(text.contains("blkplane_disk_state{disk=\"a\",state=\"connected\"} 1\n"));
        assert!(text.contains("blkplane_disk_state{disk=\"a\",state=\"ready\"} 0\n"));
        assert!(text.contains("blkplane_disk_state{disk=\"b\",state=\"failed\"} 1\n"));
        assert_eq!(
            lines(&text, "blkplane_disk_state{disk=\"b\"").len(),
            STATES.len()
        );
        assert!(text.contains("blkplane_disk_vmm_connected{disk=\"a\"} 1\n"));
        assert!(text.contains("blkplane_disk_vmm_connected{disk=\"b\"} 0\n"));
        assert!(text.contains("blkplane_disk_capacity_bytes{disk=\"a\"} 1048576\n"));
        // No frontend, no capacity or iothread restarts.
        assert!(lines(&text, "blkplane_disk_capacity_bytes{disk=\"b\"").is_empty());
        assert!(lines(&text, "blkplane_disk_iothread_restarts_total{disk=\"b\"").is_empty());
        assert!(text.contains("blkplane_disk_iothread_restarts_total{disk=\"a\"} 1\n"));
        assert!(text.contains("blkplane_disk_frontend_restarts_total{disk=\"b\"} 5\n"));
        assert!(text.contains("blkplane_disk_migratable{disk=\"a\"} 0\n"));
        assert!(text.contains(
            "blkplane_disk_migration_blockers{disk=\"a\",reason=\"unsupported_feature\"} 1\n"
        ));
        assert!(text.contains(
            "blkplane_disk_migration_blockers{disk=\"b\",reason=\"operator_backup\"} 1\n"
        ));
        assert!(
            text.contains("blkplane_disk_migration_blockers{disk=\"b\",reason=\"incoming\"} 0\n")
        );
        assert!(text.contains("blkplane_disk_stats_available{disk=\"a\"} 1\n"));
        assert!(text.contains("blkplane_disk_stats_available{disk=\"b\"} 0\n"));
    }

    #[test]
    fn queue_series() {
        let text = render(&snapshot());
        for q in ["0", "1"] {
            let l = |rest: &str| format!("{{disk=\"a\",queue=\"{q}\"{rest}");
            assert!(text.contains(&format!(
                "blkplane_queue_ops_total{} 3\n",
                l(",kind=\"read\"}")
            )));
            assert!(text.contains(&format!(
                "blkplane_queue_ops_total{} 1\n",
                l(",kind=\"other\"}")
            )));
            assert!(text.contains(&format!(
                "blkplane_queue_bytes_total{} 8192\n",
                l(",kind=\"write\"}")
            )));
            assert!(text.contains(&format!("blkplane_queue_in_flight{} 1\n", l("}"))));
            assert!(text.contains(&format!(
                "blkplane_queue_latency_seconds_bucket{} 5\n",
                l(",le=\"+Inf\"}")
            )));
            assert!(text.contains(&format!(
                "blkplane_queue_latency_seconds_count{} 5\n",
                l("}")
            )));
            assert!(text.contains(&format!(
                "blkplane_queue_throttled_seconds_total{} 1.500000001\n",
                l("}")
            )));
        }
        // Six kinds of ops, four with bytes, per queue; no queue series of disk b.
        assert_eq!(lines(&text, "blkplane_queue_ops_total{").len(), 12);
        assert_eq!(lines(&text, "blkplane_queue_bytes_total{").len(), 8);
        assert!(!text.contains("disk=\"b\",queue="));
    }

    #[test]
    fn empty_families_are_left_out() {
        let text = render(&Snapshot::default());
        assert!(text.contains("\nblkplane_disks 0\n"));
        assert!(!text.contains("blkplane_queue"));
        assert!(!text.contains("blkplane_disk_state"));
    }

    #[test]
    fn escaping() {
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
        assert_eq!(escape_help("x\\y\nz"), "x\\\\y\\nz");
    }
}
