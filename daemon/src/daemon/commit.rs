//! Commit: a disk's image merged into its backing file while the disk runs, then the disk
//! switched to the backing file (QEMU's active block-commit with pivot).
//!
//! Only the disk's iothreads may write its image (two writers of one qcow2 file, each with its
//! own metadata caches, corrupt it), so the image is first frozen under a temporary overlay
//! beside it ([`Daemon::put_overlay_over`], a snapshot: one short drain, and the VMM reconnects).
//! The guest then writes into the overlay while blkplaned copies what the image holds itself
//! into the backing file ([`blkplane_chain::merge_into_backing`]): every range written there
//! is one the image holds, so the iothreads, which read the backing file through the image, never
//! read it there, and their cached view of the backing file's metadata stays true for what they
//! read — except where imago would move a cluster of the backing file whose rest they still read
//! (a compressed one, written in part, is copied to a new place and its old place handed out
//! again): those parts wait ([`blkplane_chain::Readers::ThroughTop`]). Then the disk is drained
//! again, the parts that waited are copied, then what the overlay holds (the guest's writes
//! since the freeze), past the image, which the backing file now includes; the disk's frontend
//! is restarted on the backing file and resumed, and the overlay removed. The second drain
//! lasts as long as that last copy: mostly the guest's writes during the first.
//!
//! A failure after the freeze merges the overlay back into the image, which is written by
//! nobody else by then, and serves the image again: the disk ends where it started. If even
//! that fails the disk stays on the overlay, a valid chain, and the error says so. A blkplaned
//! that dies during a commit leaves the disk on the overlay, persisted; the backing file then
//! holds part of the image's data, in ranges the image holds too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blkplane_chain::{merge_into_backing, ImageFormat, MergeError, Merged, Readers};
use log::{info, warn};

use crate::admin;
use crate::pb::{self, EventKind};
use crate::state::{DiskSpec, Format};
use crate::supervisor::DiskHandle;
use crate::supervisor::Initial;
use crate::sync::lock;
use crate::validate::{self, ImageIdentity};

use super::{frontend_error, Daemon, DaemonError};

/// How long the end of a commit waits for a frontend that is being restarted.
const RESTART_WAIT: Duration = Duration::from_secs(30);

/// The disks whose commit runs, each claimed while its Commit call lasts, with the files it
/// works on (the image and its backing file) once it knows them.
#[derive(Debug, Default)]
pub struct Commits(Mutex<BTreeMap<String, Vec<ImageIdentity>>>);

/// A disk's claim on [`Commits`], given up when dropped.
struct Claim<'a> {
    commits: &'a Commits,
    id: String,
}

impl Commits {
    /// Claims disk `id`; [`DaemonError::Committing`] if its commit runs already.
    fn claim(&self, id: &str) -> Result<Claim<'_>, DaemonError> {
        let mut commits = lock(&self.0);
        if commits.contains_key(id) {
            return Err(DaemonError::Committing(id.to_string()));
        }
        commits.insert(id.to_string(), Vec::new());
        drop(commits);
        Ok(Claim {
            commits: self,
            id: id.to_string(),
        })
    }

    /// Whether disk `id`'s commit runs.
    pub(super) fn running(&self, id: &str) -> bool {
        lock(&self.0).contains_key(id)
    }

    /// The disk whose running commit works on the file `identity`, if one does.
    pub(super) fn holding(&self, identity: ImageIdentity) -> Option<String> {
        lock(&self.0)
            .iter()
            .find(|(_, files)| files.contains(&identity))
            .map(|(id, _)| id.clone())
    }
}

impl Claim<'_> {
    /// Records the files the commit works on.
    fn works_on(&self, files: &[&Path]) {
        let identities = files
            .iter()
            .filter_map(|f| validate::image_identity(f))
            .collect();
        lock(&self.commits.0).insert(self.id.clone(), identities);
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        lock(&self.commits.0).remove(&self.id);
    }
}

/// The temporary overlay a commit of `image` freezes it under: beside it, so inside the same
/// image directory.
pub fn temporary_overlay(image: &Path) -> PathBuf {
    let mut name = image.file_name().unwrap_or_default().to_owned();
    name.push(".commit.qcow2");
    image.with_file_name(name)
}

/// Why disk `id` cannot be committed.
fn cannot(id: &str, reason: impl Into<String>) -> DaemonError {
    DaemonError::CannotCommit {
        id: id.to_string(),
        reason: reason.into(),
    }
}

impl Daemon {
    /// Commit: see the module and control.proto.
    pub async fn commit(self: &Arc<Self>, id: &str) -> Result<pb::Disk, DaemonError> {
        let daemon = Arc::clone(self);
        let owned = id.to_string();
        // A task of its own: a client that gives up (its deadline) must not stop a commit
        // half-way, between its drains.
        tokio::spawn(async move { daemon.run_commit(&owned).await })
            .await
            .unwrap_or_else(|e| {
                Err(DaemonError::CommitFailed {
                    id: id.to_string(),
                    reason: format!("the commit's task failed: {e}"),
                })
            })
    }

    /// The commit itself, claimed for its whole length.
    async fn run_commit(&self, id: &str) -> Result<pb::Disk, DaemonError> {
        let claim = self.commits.claim(id)?;
        let (disk, op) = self.lock_lifecycle(id).await?;
        let ops = self.ops.lock().await;
        // Removed while this waited for the table.
        self.still_in_table(id, &disk)?;
        let disk = &disk;
        self.image_may_change(id, disk)?;
        let old = disk.config();
        if old.read_only {
            return Err(cannot(
                id,
                "the disk is read-only: its image holds nothing to commit",
            ));
        }
        let (base, base_format, capacity) = self.commit_target(id, &old).await?;
        self.refuse_shared_backing(id, &base)?;
        claim.works_on(&[&old.image, &base]);
        let overlay = temporary_overlay(&old.image);
        if overlay.symlink_metadata().is_ok() {
            return Err(cannot(
                id,
                format!(
                    "{} exists (the temporary overlay of a commit that did not finish? the disk \
                     serves it if its chain names it)",
                    overlay.display()
                ),
            ));
        }
        let was_drained = disk.runtime().lifecycle.drained;
        self.put_overlay_over(disk, &overlay, op, ops).await?;
        info!(
            "disk {id}: commit: {} frozen under {}; merging it into {}",
            old.image.display(),
            overlay.display(),
            base.display()
        );
        // A resume that fails here is owed: the disk ends resumed all the same.
        let mut owed = None;
        if !was_drained {
            if let Err(e) = self.resume(id).await {
                warn!("disk {id}: resuming after the commit's freeze: {e}");
                owed = Some(false);
            }
        }

        let image = old.image.clone();
        let dirs = self.ctx.image_dirs.clone();
        let live = move || merge_into_backing(&image, 0, &dirs, Readers::ThroughTop, None);
        let merged = match merge(live).await {
            Ok(merged) => merged,
            Err(e) => return Err(self.undo(id, &old, &overlay, e, owed).await),
        };
        let new = DiskSpec {
            image: base.clone(),
            format: Some(match base_format {
                ImageFormat::Raw => Format::Raw,
                ImageFormat::Qcow2 => Format::Qcow2,
            }),
            ..old.clone()
        };
        // Drained: the parts the live merge left (clusters the iothreads still read the rest
        // of), then the guest's writes since the freeze, past the image the target now holds.
        let (image, top, dirs) = (
            old.image.clone(),
            overlay.clone(),
            self.ctx.image_dirs.clone(),
        );
        let deferred = merged.deferred.clone();
        let last = move || {
            let rest = merge_into_backing(&image, 0, &dirs, Readers::None, Some(&deferred))?;
            let mut last = merge_into_backing(&top, 1, &dirs, Readers::None, None)?;
            last.data_bytes = last.data_bytes.saturating_add(rest.data_bytes);
            last.zero_bytes = last.zero_bytes.saturating_add(rest.zero_bytes);
            Ok(last)
        };
        let (handle, last) = match self.merge_and_switch(id, last, &new, owed).await {
            Ok(done) => done,
            Err(e) => return Err(self.undo(id, &old, &overlay, e, owed).await),
        };
        if let Err(e) = std::fs::remove_file(&overlay) {
            warn!(
                "disk {id}: removing the commit's temporary overlay {}: {e}",
                overlay.display()
            );
        }
        let message = format!(
            "{} committed into {}, which the disk serves now ({} bytes of data and {} of zeroes \
             copied, {} and {} of them while the disk was drained at the end); {} is no longer \
             used; capacity {capacity}",
            old.image.display(),
            base.display(),
            merged.data_bytes.saturating_add(last.data_bytes),
            merged.zero_bytes.saturating_add(last.zero_bytes),
            last.data_bytes,
            last.zero_bytes,
            old.image.display(),
        );
        info!("disk {id}: commit: {message}");
        self.events
            .emit(EventKind::Commit, id, handle.runtime().pid, message);
        drop(handle);
        let now = self.get_handle(id)?;
        Ok(self.disk_info(&now, true).await)
    }

    /// The file a commit of `spec`'s image merges it into: the image's backing file, its format
    /// and the disk's capacity now. Refused for a raw image, one without a backing file, or a
    /// backing file larger than the disk.
    async fn commit_target(
        &self,
        id: &str,
        spec: &DiskSpec,
    ) -> Result<(PathBuf, ImageFormat, u64), DaemonError> {
        let file = std::fs::File::open(&spec.image).map_err(|e| DaemonError::Io {
            what: "opening the image",
            path: spec.image.clone(),
            source: e,
        })?;
        let format = match spec.format {
            Some(Format::Raw) => ImageFormat::Raw,
            Some(Format::Qcow2) => ImageFormat::Qcow2,
            None => {
                blkplane_chain::probe(&file, &spec.image).map_err(|e| cannot(id, e.to_string()))?
            }
        };
        if format == ImageFormat::Raw {
            return Err(cannot(id, "the image is raw: it has no backing file"));
        }
        let chain = blkplane_chain::open(&file, &spec.image, &self.ctx.image_dirs)
            .map_err(|e| cannot(id, e.to_string()))?;
        if chain.data_file.is_some() {
            return Err(cannot(
                id,
                "the image keeps its data in an external data file, and the commit's freeze \
                 would make it a backing file, which cannot have one",
            ));
        }
        if chain.backing.len() >= blkplane_chain::MAX_BACKING_FILES as usize {
            return Err(cannot(
                id,
                format!(
                    "its chain is {} backing files deep, and the commit's temporary overlay \
                     would add one",
                    chain.backing.len()
                ),
            ));
        }
        let size = chain.size;
        let Some(base) = chain.backing.into_iter().next() else {
            return Err(cannot(id, "the image has no backing file"));
        };
        let disk = self.get_handle(id)?;
        let capacity = admin::status(&disk.paths.admin_socket)
            .await
            .map_err(|e| frontend_error(id, e))?
            .capacity_bytes;
        let base_size = match base.format {
            ImageFormat::Raw => base.file.metadata().map(|m| m.len()),
            ImageFormat::Qcow2 => {
                blkplane_chain::open(&base.file, &base.path, &self.ctx.image_dirs)
                    .map(|c| c.size)
                    .map_err(|e| std::io::Error::other(e.to_string()))
            }
        }
        .map_err(|e| cannot(id, format!("{}: {e}", base.path.display())))?;
        if size != capacity {
            return Err(cannot(
                id,
                format!(
                    "the image's virtual size ({size} bytes) is not the disk's capacity \
                     ({capacity} bytes, whole blocks): the temporary overlay, which has the \
                     capacity, could not be merged into a backing file grown to the image's size"
                ),
            ));
        }
        if base_size > capacity {
            return Err(cannot(
                id,
                format!(
                    "the backing file {} ({base_size} bytes) is larger than the disk ({capacity} \
                     bytes): serving it would grow the disk",
                    base.path.display()
                ),
            ));
        }
        Ok((base.path, base.format, capacity))
    }

    /// Refuses a backing file that another disk's chain holds (its image or one of its backing
    /// files): writing it would change what that disk's guest reads. A chain that cannot be
    /// read counts as holding it.
    fn refuse_shared_backing(&self, id: &str, base: &Path) -> Result<(), DaemonError> {
        let Some(identity) = validate::image_identity(base) else {
            return Err(cannot(id, format!("{} cannot be read", base.display())));
        };
        let others: Vec<DiskSpec> = lock(&self.disks)
            .values()
            .filter(|d| d.spec.id != id)
            .map(|d| d.config())
            .collect();
        for other in others {
            let files = super::chain_files(&other, &self.ctx.image_dirs).map_err(|e| {
                cannot(
                    id,
                    format!(
                        "the chain of disk {} cannot be read to see whether it holds {} ({e})",
                        other.id,
                        base.display()
                    ),
                )
            })?;
            if files
                .iter()
                .any(|path| validate::image_identity(path) == Some(identity))
            {
                return Err(cannot(
                    id,
                    format!(
                        "its backing file {} is in the chain of disk {} too",
                        base.display(),
                        other.id
                    ),
                ));
            }
        }
        Ok(())
    }

    /// FAILED_PRECONDITION while disk `id`'s commit runs.
    pub(super) fn refuse_while_committing(&self, id: &str) -> Result<(), DaemonError> {
        if self.commits.running(id) {
            return Err(DaemonError::Committing(id.to_string()));
        }
        Ok(())
    }

    /// Drains disk `id`, stops its frontend, runs `merge_drained` (nobody reads the files
    /// meanwhile), and starts the disk on `new`; resumes it unless it was drained before
    /// (`was_drained`, or as its state says if `None`). Returns the disk's new handle and what
    /// was copied. On failure the disk serves what it served, resumed as it was, by a new
    /// frontend: a merge that ran, even in part, may have moved clusters whose old places the
    /// old frontend's iothreads hold in their caches — which is also why the old frontend is
    /// stopped before the merge, so that a blkplaned that dies meanwhile finds none to adopt.
    async fn merge_and_switch(
        &self,
        id: &str,
        merge_drained: impl FnOnce() -> Result<Merged, MergeError> + Send + 'static,
        new: &DiskSpec,
        was_drained: Option<bool>,
    ) -> Result<(Arc<DiskHandle>, Merged), String> {
        let disk = self.get_handle(id).map_err(|e| e.to_string())?;
        // A frontend that crashed during the merge is being restarted by its supervisor.
        let deadline = Instant::now() + RESTART_WAIT;
        while self.running(&disk).is_err() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // The disk's lifecycle for the whole of it; the table (`ops`, which every other disk's
        // AddDisk, RemoveDisk, Drain and Resume take) only to persist the drain and to switch.
        let op = disk.lifecycle_op.lock().await;
        let (socket, was_drained) = {
            let _ops = self.ops.lock().await;
            self.still_in_table(id, &disk).map_err(|e| e.to_string())?;
            self.running(&disk).map_err(|e| e.to_string())?;
            let was_drained = was_drained.unwrap_or(disk.runtime().lifecycle.drained);
            self.set_drained(&disk, true).map_err(|e| e.to_string())?;
            (disk.paths.admin_socket.clone(), was_drained)
        };
        if let Err(e) = admin::drain(&socket, true).await {
            let _ops = self.ops.lock().await;
            self.undo_drain(&disk, &socket, was_drained).await;
            return Err(frontend_error(id, e).to_string());
        }
        // Drained and flushed: nothing in flight, the image complete in its file.
        disk.stop().await;
        let merged = merge(merge_drained).await;
        let target = if merged.is_ok() {
            new.clone()
        } else {
            disk.config()
        };
        let ops = self.ops.lock().await;
        let switched = self.switch_image(&disk, &target).await;
        if switched.is_err() && self.still_in_table(id, &disk).is_ok() {
            // Refused before it stopped anything (the state could not be written): the
            // frontend is replaced all the same, on the configuration the state has.
            self.restart_afresh(&disk).await;
        }
        drop(ops);
        drop(op);
        if !was_drained {
            if let Err(e) = self.resume(id).await {
                warn!("disk {id}: resuming after a commit's switch: {e}");
            }
        }
        match (merged, switched) {
            (Ok(merged), Ok(handle)) => Ok((handle, merged)),
            (Err(e), _) => Err(e),
            (Ok(_), Err(e)) => Err(e.to_string()),
        }
    }

    /// Stops disk `id`'s frontend and supervises a new one on its configuration (started
    /// drained if the disk is, as after a crash).
    async fn restart_afresh(&self, disk: &Arc<DiskHandle>) {
        let rt = disk.runtime();
        disk.stop().await;
        let handle = DiskHandle::spawn(
            disk.config(),
            rt.lifecycle.clone(),
            rt.restarts,
            Arc::clone(&self.settings),
            self.events.clone(),
            Initial::AdoptOrStart,
        );
        lock(&self.disks).insert(disk.spec.id.clone(), handle);
    }

    /// After a commit failed (`why`) once the disk serves `overlay` over `old`'s image: merges
    /// the overlay back into the image and serves the image again, resumed unless it was
    /// drained before (`was_drained`, or as its state says if `None`). Returns the error for
    /// the caller, which says where the disk is.
    async fn undo(
        &self,
        id: &str,
        old: &DiskSpec,
        overlay: &Path,
        why: String,
        was_drained: Option<bool>,
    ) -> DaemonError {
        warn!(
            "disk {id}: commit failed: {why}; merging {} back",
            overlay.display()
        );
        let (top, dirs) = (overlay.to_owned(), self.ctx.image_dirs.clone());
        let back = move || merge_into_backing(&top, 0, &dirs, Readers::None, None);
        let reason = match self.merge_and_switch(id, back, old, was_drained).await {
            Ok(_) => {
                if let Err(e) = std::fs::remove_file(overlay) {
                    warn!("disk {id}: removing {}: {e}", overlay.display());
                }
                format!("{why}; the disk serves {} again", old.image.display())
            }
            Err(e) => format!(
                "{why}; merging the temporary overlay back failed too ({e}): the disk serves \
                 {} over {}",
                overlay.display(),
                old.image.display()
            ),
        };
        let pid = self.get_handle(id).map(|d| d.runtime().pid).unwrap_or(0);
        self.events.emit(
            EventKind::Commit,
            id,
            pid,
            format!("commit of {} failed: {reason}", old.image.display()),
        );
        DaemonError::CommitFailed {
            id: id.to_string(),
            reason,
        }
    }
}

/// Runs a merge on a blocking thread (imago's calls are synchronous here); its error as text.
async fn merge(
    run: impl FnOnce() -> Result<Merged, MergeError> + Send + 'static,
) -> Result<Merged, String> {
    match tokio::task::spawn_blocking(run).await {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(e) => Err(format!("the merge's thread failed: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_temporary_overlay_is_beside_the_image() {
        assert_eq!(
            temporary_overlay(Path::new("/images/vm1/disk.qcow2")),
            PathBuf::from("/images/vm1/disk.qcow2.commit.qcow2")
        );
    }

    #[test]
    fn a_disk_is_claimed_once_at_a_time() {
        let commits = Commits::default();
        let claim = commits.claim("a").unwrap();
        assert!(commits.running("a"));
        assert!(matches!(
            commits.claim("a"),
            Err(DaemonError::Committing(_))
        ));
        let other = commits.claim("b").unwrap();
        drop(claim);
        assert!(!commits.running("a"));
        assert!(commits.running("b"));
        drop(other);
        assert!(commits.claim("a").is_ok());
    }

    #[test]
    fn a_commit_holds_the_files_it_works_on() {
        let dir = std::env::temp_dir().join(format!("blkplane-commits-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (image, base) = (dir.join("image"), dir.join("base"));
        std::fs::write(&image, b"i").unwrap();
        std::fs::write(&base, b"b").unwrap();
        let commits = Commits::default();
        let claim = commits.claim("a").unwrap();
        let identity = |p: &Path| validate::image_identity(p).unwrap();
        assert_eq!(commits.holding(identity(&base)), None);
        claim.works_on(&[&image, &base]);
        assert_eq!(commits.holding(identity(&base)).as_deref(), Some("a"));
        assert_eq!(commits.holding(identity(&image)).as_deref(), Some("a"));
        drop(claim);
        assert_eq!(commits.holding(identity(&base)), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
