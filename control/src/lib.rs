//! The control plane of blkplane: `blkplaned`, which owns a node's disks, and `blkplanectl`,
//! its command-line client.
//!
//! `blkplaned` serves the gRPC API of `proto/blkplane/v1/control.proto`. For each disk it runs
//! one `blkplane-frontend` (which runs the disk's iothreads), watches it through a pidfd,
//! restarts it with back-off when it crashes, and talks to it over the frontend's admin
//! channel (`proto/blkplane/v1/frontend.proto`) for status, statistics, resizing, draining,
//! migration blockers and I/O limits. The set of
//! disks is persisted; frontends outlive blkplaned and are adopted again when it restarts.
//!
//! | module | what |
//! |---|---|
//! | [`service`] | the gRPC service (status codes) |
//! | [`daemon`] | the disk table and its operations; start-up, orphan sweep; the takeover of an incoming (live-migration destination) disk |
//! | [`supervisor`] | starting, adopting, stopping and restarting frontends |
//! | [`state`] | the persisted desired state |
//! | [`validate`] | input validation, with messages that name the field |
//! | [`admin`] | client of a frontend's admin channel |
//! | [`events`] | the WatchEvents broadcast |
//! | [`migration`] | migration blockers (automatic and the operator's) |
//! | [`throttle`] | I/O limits and throttle groups: member indices, group files, what a frontend is sent |
//! | [`server`] | listeners (UNIX, TCP+TLS), health and reflection |
//! | [`metrics`] | the `--metrics-listen` HTTP endpoint: Prometheus metrics, `/healthz`, `/readyz` |
//! | [`proc`] | pidfds and /proc |
//! | [`ctl`] | blkplanectl's output formats and argument parsing helpers |

#![warn(missing_docs)]

pub mod admin;
pub mod ctl;
pub mod daemon;
pub mod events;
pub mod metrics;
pub mod migration;
pub mod proc;
pub mod server;
pub mod service;
pub mod state;
pub mod supervisor;
pub mod throttle;
pub mod validate;

/// gRPC service and messages of `blkplane/v1/control.proto` (package `blkplane.v1`). The
/// messages it shares with `frontend.proto` (QueueStats, QueueStatus, LatencyHistogram,
/// ResizeDone) are the types of [`blkplane_proto::v1`].
#[allow(missing_docs, clippy::all)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/blkplane.v1.rs"));

    /// The encoded `FileDescriptorSet` of control.proto and its imports, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/blkplane_descriptor.bin"));
}
