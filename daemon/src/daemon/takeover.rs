//! The takeover of an incoming disk (a live-migration destination) from its source on this
//! node: which disks are ready for it, the check that the source no longer serves a running
//! ring, the swap in the disk table, and the watcher that tries every poll interval (which
//! also hands incoming disks whose source is on another node to `remote`).

use std::sync::Weak;
use std::time::Duration;

use log::{debug, error, info, warn};

use crate::admin;
use crate::migration;
use crate::pb::EventKind;
use crate::runtime::serving;
use crate::state::RemoteSource;
use crate::supervisor::{DiskHandle, TakeoverWait};
use crate::sync::lock;

use super::{Daemon, DaemonError};

impl Daemon {
    /// The live migration `disk` takes part in, as (source, destination) ids: it is incoming,
    /// or another disk is incoming for it.
    pub(super) fn migration_of(&self, disk: &DiskHandle) -> Option<(String, String)> {
        match disk.runtime().incoming_for {
            Some(source) => Some((source, disk.spec.id.clone())),
            None => self.migration_of_id(&disk.spec.id),
        }
    }

    /// The live migration whose source is named `id` (whether or not that disk exists), as
    /// (source, destination) ids.
    pub(super) fn migration_of_id(&self, id: &str) -> Option<(String, String)> {
        lock(&self.disks)
            .values()
            .find(|d| d.runtime().incoming_for.as_deref() == Some(id))
            .map(|d| (id.to_string(), d.spec.id.clone()))
    }

    /// The id of the disk of this node that is incoming for disk `id`, if one is.
    pub fn incoming_disk_of(&self, id: &str) -> Option<String> {
        self.migration_of_id(id).map(|(_, destination)| destination)
    }

    /// The incoming disks whose VMM, by the supervisor's last poll, runs the migrated VM.
    pub(super) fn takeover_candidates(&self) -> Vec<String> {
        lock(&self.disks)
            .values()
            .filter(|d| {
                let rt = d.runtime();
                rt.is_incoming()
                    && rt.pid != 0
                    && serving(rt.state)
                    && rt
                        .status
                        .as_ref()
                        .is_some_and(|s| s.pid == rt.pid && migration::destination_runs(s))
            })
            .map(|d| d.spec.id.clone())
            .collect()
    }

    /// The takeover of incoming disk `id` from its migration source, once its VMM runs the
    /// migrated VM (connected, a ring started; asked again now, not taken from the last
    /// poll). The source is retired as RemoveDisk with force does it — its frontend and
    /// iothreads stopped, its files and state entry removed, a REMOVED event — and the
    /// disk's `incoming_for` is cleared, both in one state write, then MIGRATED is emitted.
    /// The source is not retired while its frontend serves a running ring (the VM would
    /// then run on both sides; BOTH_SERVING, once, and an error in the log) or while it
    /// cannot tell (its frontend runs but does not answer): the next call tries again. A
    /// source that is gone is not waited for.
    pub async fn take_over(&self, id: &str) -> Result<(), DaemonError> {
        let ops = self.ops.lock().await;
        // Removed, or already taken over, since it was seen running.
        let Ok(disk) = self.get_handle(id) else {
            return Ok(());
        };
        let rt = disk.runtime();
        if !rt.is_incoming() || rt.pid == 0 || !serving(rt.state) {
            return Ok(());
        }
        let status = admin::status(&disk.paths.admin_socket)
            .await
            .map_err(|source| DaemonError::Admin {
                id: id.to_string(),
                source,
            })?;
        disk.record_status(&status);
        if status.pid != rt.pid || !migration::destination_runs(&status) {
            return Ok(());
        }
        // A copy from another node not complete yet: the frontend serves nothing, the VM
        // does not run here.
        if RemoteSource::awaits_image(rt.incoming_from.as_ref()) {
            return Ok(());
        }
        let Some(source_id) = rt.incoming_for.clone() else {
            // The other node may be slow to answer: AddDisk, RemoveDisk and the rest do not
            // wait for it (take_over_remote takes `ops` again for its own state write).
            drop(ops);
            return match &rt.incoming_from {
                Some(from) => self.take_over_remote(&disk, from).await,
                None => Ok(()),
            };
        };
        let source = lock(&self.disks).get(&source_id).cloned();
        if let Some(src) = &source {
            if let Some(wait) = self.source_serves(src).await {
                let first = disk.note_takeover_wait(wait);
                if first {
                    self.report_takeover_wait(id, &source_id, rt.pid, wait);
                }
                return Ok(());
            }
        }
        info!(
            "disk {id}: its VMM runs the migrated VM; taking over from disk {source_id}{}",
            if source.is_some() {
                " and retiring it"
            } else {
                ", which is gone"
            }
        );
        // One write for both changes: after a crash the source is either still there with
        // this disk incoming (the takeover runs again), or gone with this disk taken over.
        let mut state = Self::state_from(&lock(&self.disks));
        state.disks.retain(|d| d.spec.id != source_id);
        for d in state.disks.iter_mut().filter(|d| d.spec.id == id) {
            d.spec.incoming_for = None;
        }
        self.store.save(&state)?;
        if source.is_some() {
            lock(&self.disks).remove(&source_id);
        }
        disk.update(|rt| rt.incoming_for = None);
        *lock(&disk.takeover_wait) = None;
        disk.push_blockers().await;
        let message = match &source {
            Some(src) => {
                let pid = src.runtime().pid;
                src.stop().await;
                self.drop_group_if_empty(&src.runtime().lifecycle.throttle.group);
                self.events.emit(
                    EventKind::Removed,
                    &source_id,
                    pid,
                    format!("retired: disk {id} took over from it (live migration)"),
                );
                format!("disk {id} took over from {source_id}; {source_id} retired")
            }
            None => format!(
                "disk {id} took over from {source_id}; {source_id} had already been removed"
            ),
        };
        self.events
            .emit(EventKind::Migrated, id, disk.runtime().pid, message);
        Ok(())
    }

    /// Why the migration source `src` must not be retired now, if it must not: its frontend
    /// serves a running ring, or it runs but cannot be asked. A source without a running
    /// frontend (failed, restarting, starting) serves nothing.
    pub(super) async fn source_serves(&self, src: &DiskHandle) -> Option<TakeoverWait> {
        let rt = src.runtime();
        if rt.pid == 0 {
            return None;
        }
        match admin::status(&src.paths.admin_socket).await {
            Ok(status) if status.pid == rt.pid => {
                src.record_status(&status);
                migration::serves_running_ring(&status).then_some(TakeoverWait::BothServing)
            }
            Ok(status) => {
                debug!(
                    "disk {}: the admin socket answers for pid {}, not {}",
                    src.spec.id, status.pid, rt.pid
                );
                Some(TakeoverWait::SourceUnknown)
            }
            Err(e) => {
                debug!("disk {}: status: {e}", src.spec.id);
                Some(TakeoverWait::SourceUnknown)
            }
        }
    }

    /// Logs (and, for both sides serving, announces) why the takeover of `id` from
    /// `source` waits; called once when that reason begins.
    pub(super) fn report_takeover_wait(
        &self,
        id: &str,
        source: &str,
        pid: u32,
        wait: TakeoverWait,
    ) {
        match wait {
            TakeoverWait::BothServing => {
                let message = format!(
                    "the VMM of disk {id} runs its rings while the frontend of disk {source}, \
                     its migration source, still serves a running ring: the image is served \
                     by both at once; {source} is retired once its rings stop"
                );
                error!("disk {id}: {message}");
                self.events.emit(EventKind::BothServing, id, pid, message);
            }
            TakeoverWait::SourceForgot => {
                let message = format!(
                    "the VMM of disk {id} runs the migrated VM, but the node of {source} no \
                     longer records a migration to this disk (it was cancelled there): the \
                     source was not retired and both nodes may serve the image; remove the \
                     disk the VM no longer uses"
                );
                error!("disk {id}: {message}");
                self.events.emit(EventKind::BothServing, id, pid, message);
            }
            TakeoverWait::SourceUnknown => warn!(
                "disk {id}: its VMM runs, but the frontend of disk {source}, its migration \
                 source, does not answer, so whether it still serves a ring is unknown; \
                 {source} is retired once it answers without running rings (or is removed)"
            ),
        }
    }
}

/// Hands every incoming disk whose VMM runs the migrated VM to [`Daemon::take_over`], every
/// `interval` (the supervisors' poll interval, whose status it reads), for as long as the
/// daemon lives.
pub(super) async fn watch_incoming(daemon: Weak<Daemon>, interval: Duration) {
    loop {
        tokio::time::sleep(interval).await;
        let Some(daemon) = daemon.upgrade() else {
            return;
        };
        for id in daemon.takeover_candidates() {
            if let Err(e) = daemon.take_over(&id).await {
                warn!("disk {id}: takeover: {e}; trying again");
            }
        }
    }
}
