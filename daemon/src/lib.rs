//! `blkplaned`, the control plane of blkplane: the daemon that owns a node's disks. Its API is
//! the `blkplane-api` crate; its command-line client, `blkplanectl`, is `blkplane-cli`, which
//! does not link this crate.
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
//! | [`supervisor`] | the supervision of a disk: its handle, polling, restarting a crashed frontend with back-off |
//! | [`frontend`] | a frontend process: command line, start, adoption, strays, pid file and log |
//! | [`settings`] | how frontends are run: binary, directories, timeouts, restart policy |
//! | [`state`] | the persisted desired state |
//! | [`validate`] | input validation, with messages that name the field |
//! | [`admin`] | client of a frontend's admin channel |
//! | [`events`] | the WatchEvents broadcast |
//! | [`migration`] | migration blockers (automatic and the operator's) |
//! | [`mirror`] | copying a running disk to another node: what to send when, the image I/O, the job, the destination's writes |
//! | [`throttle`] | I/O limits and throttle groups: member indices, group files, what a frontend is sent |
//! | [`stats`] | a frontend's per-queue statistics added up (GetStats `total`) |
//! | [`sync`] | the poison-ignoring lock every module takes |
//! | [`server`] | listeners (UNIX, TCP+TLS), health and reflection |
//! | [`peer`] | reaching another node's blkplaned (TCP, mutual TLS) for a migration across nodes |
//! | [`metrics`] | the `--metrics-listen` HTTP endpoint: Prometheus metrics, `/healthz`, `/readyz` |
//! | [`runtime`] | what a disk looks like right now (state, pid, restarts, last status) |
//! | [`paths`] | a disk's files in the runtime directory |
//! | [`disk_log`] | the size cap of a disk's log: copytruncate rotation |

#![warn(missing_docs)]

pub mod admin;
pub mod daemon;
pub mod disk_log;
pub mod events;
pub mod frontend;
pub mod metrics;
pub mod migration;
pub mod mirror;
pub mod paths;
pub mod peer;
pub mod runtime;
pub mod server;
pub mod service;
pub mod settings;
pub mod state;
pub mod stats;
pub mod supervisor;
pub mod sync;
pub mod throttle;
pub mod validate;

/// The gRPC service and messages blkplaned serves (the `blkplane-api` crate's).
pub use blkplane_api::pb;
