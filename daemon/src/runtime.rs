//! What a disk looks like right now, as the supervisor keeps it and the API, the metrics and
//! the migration blockers read it.

use blkplane_proto::v1::FrontendStatus;

use crate::pb::DiskState;
use crate::state::{DiskLifecycle, RemoteSource};

/// What a disk looks like right now (shared between the supervisor and the API).
#[derive(Debug, Clone)]
pub struct Runtime {
    /// Where the disk is in its life.
    pub state: DiskState,
    /// Why it is failed or restarting, or a status-read problem.
    pub reason: String,
    /// The frontend's pid, 0 when none runs.
    pub pid: u32,
    /// Frontend starts after the disk's first one (AddDisk's), persisted in the state so that
    /// they are counted across restarts of blkplaned.
    pub restarts: u32,
    /// The last status the frontend reported.
    pub status: Option<FrontendStatus>,
    /// What the operator set: drained, operator migration blockers. Persisted in the state;
    /// the frontend is made to follow `drained`.
    pub lifecycle: DiskLifecycle,
    /// When blkplaned last restarted the frontend (not its first start), in ms since the
    /// epoch; 0 if it never did.
    pub restarted_unix_ms: u64,
    /// The disk this one is the incoming live-migration destination of, until it takes over
    /// (persisted with the configuration; see `DiskHandle::config` in the supervisor).
    pub incoming_for: Option<String>,
    /// The disk on another node this one is the incoming live-migration destination of,
    /// until it takes over (persisted with the configuration, like `incoming_for`).
    pub incoming_from: Option<RemoteSource>,
}

impl Runtime {
    /// Whether the disk is the destination of a live migration that has not taken over yet
    /// (from this node or another).
    pub fn is_incoming(&self) -> bool {
        self.incoming_for.is_some() || self.incoming_from.is_some()
    }

    /// Whether the frontend should be drained: the operator drained the disk, or it is the
    /// destination of a copy from another node whose image is not complete yet.
    pub fn wants_drained(&self) -> bool {
        self.lifecycle.drained || RemoteSource::awaits_image(self.incoming_from.as_ref())
    }
}

/// Whether a frontend in `state` serves (the admin channel is expected to answer).
pub fn serving(state: DiskState) -> bool {
    matches!(
        state,
        DiskState::Ready | DiskState::Connected | DiskState::Drained
    )
}
