//! StartMigration: the source node's copy of a disk to its incoming disk on another node
//! (local storage). The job itself is [`crate::mirror::source`]; here it is started, found,
//! stopped and reported.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use blkplane_api::endpoint::HostPort;
use blkplane_proto::v1::FrontendStatus;
use blkplane_proto::write_bitmap::WriteBitmap;
use log::{info, warn};
use tokio::sync::watch;

use crate::admin;
use crate::mirror::source::{self, CopyError, CopyRequest, Marks, Progress, SourceDisk};
use crate::pb::{self, EventKind, MigrationCopyPhase, StartMigrationRequest};
use crate::state::MigrationStorage;
use crate::supervisor::DiskHandle;
use crate::sync::lock;
use crate::validate::{self, ValidationError};

use super::{Daemon, DaemonError};

/// A copy job of the disk table.
#[derive(Debug)]
pub struct CopyJob {
    /// Its progress.
    pub progress: Progress,
    /// Its write bitmap, once it has one.
    marks: Marks,
    /// Set to stop it.
    stop: watch::Sender<bool>,
    /// Set once it ended and undid what it did to the disk (tracking, a write limit).
    finished: Arc<AtomicBool>,
}

impl CopyJob {
    /// Whether it has not ended (an ended job stays, for its progress, until the next
    /// StartMigration or the disk's removal).
    fn running(&self) -> bool {
        !self.finished.load(Ordering::Acquire)
    }

    /// Whether the copy is complete (the destination has the whole image and serves) and
    /// nothing was written on the source since (a write not yet noticed by the job, which
    /// looks every 20 ms, shows as a mark).
    pub fn complete(&self) -> bool {
        lock(&self.progress).phase == MigrationCopyPhase::Complete as i32
            && self.marks.get().is_none_or(|bitmap| bitmap.count() == 0)
    }
}

/// The source disk's frontend, as the job sees it.
struct Frontend(Arc<DiskHandle>);

impl SourceDisk for Frontend {
    async fn status(&self) -> Result<FrontendStatus, String> {
        let status = admin::status(&self.0.paths.admin_socket)
            .await
            .map_err(|e| e.to_string())?;
        self.0.record_status(&status);
        Ok(status)
    }

    async fn track_writes(&self, bitmap: Option<&WriteBitmap>) -> Result<(), String> {
        admin::track_writes(&self.0.paths.admin_socket, bitmap)
            .await
            .map_err(|e| e.to_string())
    }

    async fn limit_writes(&self, bytes_per_second: u64) -> Result<(), String> {
        self.0.cap_writes(bytes_per_second).await
    }
}

impl Daemon {
    /// StartMigration (see the .proto).
    pub async fn start_migration(
        self: &Arc<Self>,
        req: &StartMigrationRequest,
    ) -> Result<pb::Disk, DaemonError> {
        let _ops = self.ops.lock().await;
        let endpoint =
            HostPort::parse(&req.to_endpoint).ok_or_else(|| ValidationError::Invalid {
                field: "to_endpoint",
                reason: format!(
                "{:?} is not HOST:PORT: the destination node's blkplaned, as its --listen tcp: \
                 serves",
                req.to_endpoint
            ),
            })?;
        validate::check_id_in("to_disk", &req.to_disk)?;
        let disk = self.get_handle(&req.id)?;
        let id = &req.id;
        self.refuse_while_committing(id)?;
        let refused = |field: &'static str, reason: String| -> DaemonError {
            ValidationError::FailedPrecondition { field, reason }.into()
        };
        let outgoing = disk.runtime().lifecycle.outgoing;
        match &outgoing {
            Some(o) if o.disk == req.to_disk && o.storage == MigrationStorage::Local => {}
            Some(o) => {
                return Err(refused(
                    "to_disk",
                    format!(
                        "disk {id} is being migrated to {o} ({}), not to disk {} with local \
                         storage",
                        o.storage.name(),
                        req.to_disk
                    ),
                ))
            }
            None => {
                return Err(refused(
                    "to_disk",
                    format!(
                        "disk {id} has no outgoing migration: add disk {} on the destination \
                         node first (AddDisk with incoming_from, local storage)",
                        req.to_disk
                    ),
                ))
            }
        }
        if lock(&self.copies).get(id).is_some_and(CopyJob::running) {
            return Err(refused(
                "id",
                format!("disk {id} is being copied already (blkplanectl disk migrate {id} --cancel stops it)"),
            ));
        }
        self.running(&disk)?;
        let fresh = self.migratable_now(&disk).await?;
        let destination = format!("disk {} on {endpoint}", req.to_disk);
        let progress: Progress = Arc::new(Mutex::new(pb::MigrationCopy {
            destination: destination.clone(),
            phase: MigrationCopyPhase::Bulk as i32,
            bandwidth_bytes_per_second: req.bandwidth_bytes_per_second,
            started_unix_ms: blkplane_api::time::unix_time_ms(),
            ..pb::MigrationCopy::default()
        }));
        let (stop, stop_rx) = watch::channel(false);
        let marks = Marks::default();
        let finished = Arc::new(AtomicBool::new(false));
        let copy = CopyRequest {
            id: id.clone(),
            image: disk.spec.image.clone(),
            capacity: fresh.capacity_bytes,
            endpoint,
            to_disk: req.to_disk.clone(),
            bandwidth: req.bandwidth_bytes_per_second,
        };
        lock(&self.copies).insert(
            id.clone(),
            CopyJob {
                progress: Arc::clone(&progress),
                marks: Arc::clone(&marks),
                stop,
                finished: Arc::clone(&finished),
            },
        );
        let pid = disk.runtime().pid;
        self.events.emit(
            EventKind::MigrationCopying,
            id,
            pid,
            format!(
                "copying to {destination}{}",
                if copy.bandwidth == 0 {
                    String::new()
                } else {
                    format!(" at most {} bytes/s", copy.bandwidth)
                }
            ),
        );
        let daemon = Arc::clone(self);
        let handle = Arc::clone(&disk);
        tokio::spawn(async move {
            let result = source::run(
                &Frontend(Arc::clone(&handle)),
                &copy,
                &daemon.peers,
                &daemon.events,
                &progress,
                &marks,
                stop_rx,
            )
            .await;
            daemon.copy_ended(&copy.id, &progress, result);
            finished.store(true, Ordering::Release);
        });
        Ok(self.disk_info(&disk, false).await)
    }

    /// Records how a copy ended: a failure is shown in its progress and announced.
    fn copy_ended(&self, id: &str, progress: &Progress, result: Result<(), CopyError>) {
        match result {
            Ok(()) => info!("disk {id}: the copy job ended after the copy was complete"),
            Err(e) => {
                let message = format!(
                    "the copy to {} failed: {e}; the disk serves on here, untouched",
                    lock(progress).destination
                );
                warn!("disk {id}: {message}");
                {
                    let mut p = lock(progress);
                    p.phase = MigrationCopyPhase::Failed as i32;
                    p.failure = e.to_string();
                }
                self.events.emit(EventKind::MigrationFailed, id, 0, message);
            }
        }
    }

    /// Stops the write tracking of every frontend that marks writes for no copy of this
    /// blkplaned: a copy an earlier blkplaned ran when it died (the frontend outlived it).
    /// Left on, it would keep marking for nobody and refuse resizing.
    pub(super) async fn stop_stray_tracking(&self) {
        for disk in self.disks() {
            let id = &disk.spec.id;
            let tracking = disk.runtime().status.is_some_and(|s| s.tracking_writes);
            if !tracking || lock(&self.copies).contains_key(id) {
                continue;
            }
            match admin::track_writes(&disk.paths.admin_socket, None).await {
                Ok(()) => info!(
                    "disk {id}: stopped the write tracking of a copy an earlier blkplaned ran"
                ),
                Err(e) => warn!("disk {id}: stopping a stray write tracking: {e}"),
            }
        }
    }

    /// Stops disk `id`'s copy job, if it has one (its cancellation, its retirement, its
    /// removal).
    pub(super) fn stop_copy(&self, id: &str) {
        if let Some(job) = lock(&self.copies).get(id) {
            let _ = job.stop.send(true);
        }
    }

    /// Disk `id`'s copy progress, if it has a copy job.
    pub fn copy_progress(&self, id: &str) -> Option<pb::MigrationCopy> {
        lock(&self.copies)
            .get(id)
            .map(|job| lock(&job.progress).clone())
    }

    /// Whether disk `id`'s copy is complete.
    pub(super) fn copy_complete(&self, id: &str) -> bool {
        lock(&self.copies).get(id).is_some_and(CopyJob::complete)
    }
}
