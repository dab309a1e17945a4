//! Live external snapshots (Snapshot): drain, a new qcow2 overlay on the current image,
//! the configuration switched and persisted, the frontend restarted on the overlay, resume.
//!
//! The frontend is restarted rather than told to reopen: it is sandboxed (it opens nothing
//! once it serves), and a restarted frontend is the path crash-safe reconnect already takes —
//! drained, nothing is in flight, and a VMM with `reconnect-ms` reconnects to the new process
//! on the same socket. A failure at any step puts the disk back on its old image (restarting
//! it there if the old frontend was already stopped), resumes it as it was, and removes the
//! overlay.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;

use blkplane_chain::ImageFormat;
use log::{info, warn};

use crate::admin;
use crate::frontend;
use crate::paths::DiskPaths;
use crate::pb::{self, EventKind};
use crate::state::{DiskSpec, Format, StoredDisk};
use crate::supervisor::{DiskHandle, Initial};
use crate::sync::lock;
use crate::throttle;
use crate::validate::{self, ValidationError};

use super::{frontend_error, Daemon, DaemonError};

impl Daemon {
    /// Snapshot: see the module and control.proto.
    pub async fn snapshot(&self, id: &str, overlay: &str) -> Result<pb::Disk, DaemonError> {
        // The disk's lifecycle first, then the table, as Drain, Resume and a copy's
        // switch-over take them. AddDisk and RemoveDisk wait: the table entry is replaced
        // below.
        let (disk, op) = self.lock_lifecycle(id).await?;
        let ops = self.ops.lock().await;
        // Removed while this waited for the table.
        self.still_in_table(id, &disk)?;
        let disk = &disk;
        let overlay = validate::disk::check_overlay(overlay, &self.ctx.image_dirs)?;
        self.image_may_change(id, disk)?;
        self.refuse_while_committing(id)?;
        let old = disk.config();
        let was_drained = disk.runtime().lifecycle.drained;
        let handle = self.put_overlay_over(disk, &overlay, op, ops).await?;
        info!(
            "disk {id}: snapshot: now serving {} over {}",
            overlay.display(),
            old.image.display()
        );
        self.events.emit(
            EventKind::Snapshot,
            id,
            handle.runtime().pid,
            format!(
                "serving the overlay {}; {} is its backing file from now on",
                overlay.display(),
                old.image.display()
            ),
        );
        if !was_drained {
            self.resume(id).await?;
        }
        Ok(self.disk_info(&handle, true).await)
    }

    /// NOT_FOUND unless `disk` is still the table's disk `id` (the caller waited for locks).
    pub(super) fn still_in_table(
        &self,
        id: &str,
        disk: &Arc<DiskHandle>,
    ) -> Result<(), DaemonError> {
        if lock(&self.disks)
            .get(id)
            .is_some_and(|d| Arc::ptr_eq(d, disk))
        {
            Ok(())
        } else {
            Err(DaemonError::NotFound(id.to_string()))
        }
    }

    /// Refuses to change the image of disk `id` unless its frontend runs and no live migration
    /// (on this node or across nodes) has it.
    pub(super) fn image_may_change(&self, id: &str, disk: &DiskHandle) -> Result<(), DaemonError> {
        self.running(disk)?;
        if let Some((origin, destination)) = self.migration_of(disk) {
            return Err(DaemonError::Migrating {
                id: id.to_string(),
                origin,
                destination,
            });
        }
        self.refuse_while_outgoing(id, disk)
    }

    /// Puts a new qcow2 overlay at `overlay` over the disk's image and restarts the disk on
    /// it, drained (the caller resumes it if it was not drained before, and holds `op` and
    /// `ops`, released here once the disk's new handle is in the table). On failure the disk is
    /// back on its old image, resumed as it was, and the overlay is gone.
    pub(super) async fn put_overlay_over(
        &self,
        disk: &Arc<DiskHandle>,
        overlay: &Path,
        op: tokio::sync::OwnedMutexGuard<()>,
        ops: tokio::sync::MutexGuard<'_, ()>,
    ) -> Result<Arc<DiskHandle>, DaemonError> {
        let id = &disk.spec.id;
        let old = disk.config();
        let socket = disk.paths.admin_socket.clone();
        let was_drained = disk.runtime().lifecycle.drained;

        // Drained (persisted first, as Drain does: a frontend restarted meanwhile comes back
        // drained) and flushed: the image is complete on disk before it becomes a backing file.
        self.set_drained(disk, true)?;
        let drained = admin::drain(&socket, true).await;
        let capacity = match drained.and(admin::status(&socket).await) {
            Ok(status) => status.capacity_bytes,
            Err(e) => {
                self.undo_drain(disk, &socket, was_drained).await;
                return Err(frontend_error(id, e));
            }
        };
        let new = match make_overlay(overlay, &old, capacity, &self.ctx.image_dirs) {
            Ok(()) => DiskSpec {
                image: overlay.to_owned(),
                format: Some(Format::Qcow2),
                ..old.clone()
            },
            Err(e) => {
                self.undo_drain(disk, &socket, was_drained).await;
                return Err(e);
            }
        };
        let switched = self.switch_image(disk, &new).await;
        drop(op);
        drop(ops);
        match switched {
            Ok(handle) => Ok(handle),
            Err(e) => {
                let _ = std::fs::remove_file(overlay);
                // Back on the old image; resumed as it was.
                if !was_drained {
                    if let Err(r) = self.resume(id).await {
                        warn!("disk {id}: resuming after a failed snapshot: {r}");
                    }
                }
                Err(e)
            }
        }
    }

    /// Sets the disk's persisted `drained`, without the `ops` lock (the caller holds it).
    pub(super) fn set_drained(&self, disk: &DiskHandle, drained: bool) -> Result<(), DaemonError> {
        let old = disk.runtime().lifecycle.drained;
        disk.update(|rt| rt.lifecycle.drained = drained);
        if let Err(e) = self.persist() {
            disk.update(|rt| rt.lifecycle.drained = old);
            return Err(e);
        }
        Ok(())
    }

    /// Undoes the snapshot's drain of a disk that was not drained before.
    pub(super) async fn undo_drain(&self, disk: &DiskHandle, socket: &Path, was_drained: bool) {
        if was_drained {
            return;
        }
        if let Err(e) = admin::resume(socket).await {
            warn!("disk {}: undoing a snapshot's drain: {e}", disk.spec.id);
        }
        if let Err(e) = self.set_drained(disk, false) {
            warn!("disk {}: undoing a snapshot's drain: {e}", disk.spec.id);
        }
    }

    /// Persists `new` as the disk's configuration, stops its frontend and starts one (drained)
    /// on `new`, under a new supervisor. On failure the old configuration is persisted again
    /// and a frontend started on it (drained: the caller resumes).
    pub(super) async fn switch_image(
        &self,
        disk: &Arc<DiskHandle>,
        new: &DiskSpec,
    ) -> Result<Arc<DiskHandle>, DaemonError> {
        let id = &disk.spec.id;
        let rt = disk.runtime();
        self.save_with(id, new, &rt.lifecycle, rt.restarts)?;
        disk.stop().await;
        let throttle =
            throttle::frontend_request(&rt.lifecycle.throttle, &self.settings.throttle_dir);
        let paths = DiskPaths::new(&self.settings.disks_dir, new);
        let (spec, started, result) =
            match frontend::start_throttled(&self.settings, new, &paths, true, &throttle).await {
                Ok(started) => (new.clone(), started, Ok(())),
                Err(source) => {
                    let failed = DaemonError::Start {
                        id: id.clone(),
                        source,
                    };
                    warn!(
                        "disk {id}: snapshot: the frontend did not start on the overlay: {failed}"
                    );
                    let old = disk.config();
                    if let Err(e) = self.save_with(id, &old, &rt.lifecycle, rt.restarts) {
                        warn!("disk {id}: persisting the old image again: {e}");
                    }
                    let old_paths = DiskPaths::new(&self.settings.disks_dir, &old);
                    match frontend::start_throttled(
                        &self.settings,
                        &old,
                        &old_paths,
                        true,
                        &throttle,
                    )
                    .await
                    {
                        Ok(started) => (old, started, Err(failed)),
                        Err(source) => {
                            // Supervision starts it again with back-off, as after a crash.
                            warn!("disk {id}: restarting on the old image: {source}");
                            let handle = DiskHandle::spawn(
                                old,
                                rt.lifecycle.clone(),
                                rt.restarts,
                                Arc::clone(&self.settings),
                                self.events.clone(),
                                Initial::AdoptOrStart,
                            );
                            lock(&self.disks).insert(id.clone(), handle);
                            return Err(failed);
                        }
                    }
                }
            };
        let handle = DiskHandle::spawn(
            spec,
            rt.lifecycle.clone(),
            rt.restarts,
            Arc::clone(&self.settings),
            self.events.clone(),
            Initial::Running(Box::new(started)),
        );
        lock(&self.disks).insert(id.clone(), Arc::clone(&handle));
        result.map(|()| handle)
    }

    /// Writes the state with disk `id`'s configuration replaced by `spec`.
    fn save_with(
        &self,
        id: &str,
        spec: &DiskSpec,
        lifecycle: &crate::state::DiskLifecycle,
        restarts: u32,
    ) -> Result<(), DaemonError> {
        let mut state = Self::state_from(&lock(&self.disks));
        state.disks.retain(|d| d.spec.id != id);
        state.disks.push(StoredDisk {
            spec: spec.clone(),
            lifecycle: lifecycle.clone(),
            frontend_restarts: restarts,
        });
        state.disks.sort_by(|a, b| a.spec.id.cmp(&b.spec.id));
        self.store.save(&state).map_err(DaemonError::from)
    }
}

/// Creates the overlay on `old`'s image: a qcow2 image of `capacity` bytes whose backing file
/// is the image (absolute path, its format), owned and permitted as the image is (so the
/// disk's user, who could open the image, can open the overlay), and checks the chain the
/// frontend will open. Nothing is left at `overlay` on failure.
fn make_overlay(
    overlay: &Path,
    old: &DiskSpec,
    capacity: u64,
    image_dirs: &[std::path::PathBuf],
) -> Result<(), DaemonError> {
    const F: &str = "overlay";
    let format = match old.format {
        Some(Format::Raw) => ImageFormat::Raw,
        Some(Format::Qcow2) => ImageFormat::Qcow2,
        // Probed at each start (a disk from before formats were kept): probe it once more.
        None => {
            let file = std::fs::File::open(&old.image).map_err(|e| DaemonError::Io {
                what: "opening the image",
                path: old.image.clone(),
                source: e,
            })?;
            blkplane_chain::probe(&file, &old.image).map_err(|e| ValidationError::Invalid {
                field: F,
                reason: e.to_string(),
            })?
        }
    };
    let image_meta = std::fs::metadata(&old.image).map_err(|e| DaemonError::Io {
        what: "reading the image's metadata",
        path: old.image.clone(),
        source: e,
    })?;
    blkplane_chain::create_overlay(overlay, &old.image, format, capacity).map_err(|e| match e {
        blkplane_chain::CreateError::Create { source, .. }
            if source.kind() == std::io::ErrorKind::AlreadyExists =>
        {
            ValidationError::AlreadyExists {
                field: F,
                reason: format!("{} exists", overlay.display()),
            }
            .into()
        }
        other => DaemonError::Io {
            what: "creating the overlay",
            path: overlay.to_owned(),
            source: std::io::Error::other(other.to_string()),
        },
    })?;
    let undo = |e: DaemonError| {
        let _ = std::fs::remove_file(overlay);
        e
    };
    std::os::unix::fs::chown(overlay, Some(image_meta.uid()), Some(image_meta.gid()))
        .and_then(|()| {
            std::fs::set_permissions(
                overlay,
                std::fs::Permissions::from_mode(image_meta.mode() & 0o7777),
            )
        })
        .map_err(|e| {
            undo(DaemonError::Io {
                what: "giving the overlay the image's owner and mode",
                path: overlay.to_owned(),
                source: e,
            })
        })?;
    let file = std::fs::File::open(overlay).map_err(|e| {
        undo(DaemonError::Io {
            what: "opening the overlay",
            path: overlay.to_owned(),
            source: e,
        })
    })?;
    blkplane_chain::open(&file, overlay, image_dirs).map_err(|e| {
        undo(
            ValidationError::FailedPrecondition {
                field: F,
                reason: format!("the frontend could not open the new chain: {e}"),
            }
            .into(),
        )
    })?;
    Ok(())
}
