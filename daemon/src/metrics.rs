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
//! **Exposition.** [`render`] writes the text through the `prometheus-client` crate
//! (`metrics/render.rs`); the endpoint is `metrics/http.rs`.
//!
//! **HTTP.** hyper's HTTP/1.1 server (already in the build through tonic), one task per
//! connection, at most [`MAX_CONNECTIONS`] at once (more are closed at accept), request
//! headers limited to [`MAX_REQUEST_BYTES`] and [`HEADER_TIMEOUT`], one request per
//! connection, every connection closed after [`CONNECTION_TIMEOUT`]: a slow or hostile client
//! costs one task and never blocks the daemon.

use blkplane_proto::v1::{FrontendStatus, QueueStats};
use log::debug;

use crate::admin;
use crate::daemon::Daemon;
use crate::migration;
use crate::pb::{DiskState, MigrationBlockerReason as Reason};
use crate::runtime::serving;
use crate::supervisor::DiskHandle;

mod http;
mod render;

pub use http::{
    bind, serve, MetricsError, CONNECTION_TIMEOUT, HEADER_TIMEOUT, MAX_CONNECTIONS,
    MAX_REQUEST_BYTES, STATS_TIMEOUT,
};
pub use render::{render, METRICS_CONTENT_TYPE, UNNAMED_REJECTION, VERSION};

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
    /// The live migration the disk takes part in now, if any.
    pub migration: Option<MigrationRole>,
    /// Its copy to another node (StartMigration), if it has one.
    pub copy: Option<crate::pb::MigrationCopy>,
}

/// A disk's part in a live migration under way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationRole {
    /// `source` or `destination`.
    pub role: &'static str,
    /// The other side: a disk of this node (`ID`), or of another (`ID@NODE` for a
    /// destination there, `ID@HOST:PORT` for a source there).
    pub peer: String,
}

/// The migration `disk` takes part in, as the metrics name it.
fn migration_role(daemon: &Daemon, disk: &DiskHandle) -> Option<MigrationRole> {
    let rt = disk.runtime();
    let destination = |peer| {
        Some(MigrationRole {
            role: "destination",
            peer,
        })
    };
    let source = |peer| {
        Some(MigrationRole {
            role: "source",
            peer,
        })
    };
    if let Some(from) = &rt.incoming_for {
        return destination(from.clone());
    }
    if let Some(from) = &rt.incoming_from {
        return destination(format!("{}@{}", from.disk, from.endpoint));
    }
    if let Some(to) = &rt.lifecycle.outgoing {
        return source(format!("{}@{}", to.disk, to.node));
    }
    daemon.incoming_disk_of(&disk.spec.id).and_then(source)
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
            migration: migration_role(daemon, &disk),
            copy: daemon.copy_progress(&disk.spec.id),
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
