//! The destination side of a live migration from another node (AddDiskRequest
//! `incoming_from`): asking the source node's blkplaned to agree to the migration, to retire
//! its disk once the VM runs here, or to forget the migration when it is given up here.

use blkplane_api::endpoint::HostPort;
use std::sync::Arc;

use log::{info, warn};

use crate::pb::{self, EventKind, MigrationSourceRequest, RetireOutcome};
use crate::state::RemoteSource;
use crate::supervisor::{DiskHandle, TakeoverWait};
use crate::sync::lock;

use super::{Daemon, DaemonError};

/// What telling the source node to forget a migration came to.
pub(super) enum Cancelled {
    /// It forgot it.
    There,
    /// It no longer has the disk (retired, or removed there).
    Gone,
    /// It could not be told, for this reason.
    Failed(String),
}

impl Daemon {
    /// The request that names source `from` and this node's disk `id` as the destination
    /// (this node by the name it gave when the source agreed).
    fn source_request(&self, id: &str, from: &RemoteSource) -> MigrationSourceRequest {
        MigrationSourceRequest {
            id: from.disk.clone(),
            destination: Some(pb::OutgoingMigration {
                node: from.as_node.clone(),
                disk: id.to_string(),
                storage: from.storage.to_pb() as i32,
            }),
        }
    }

    /// Asks the source node to agree to migrating `from` to disk `id` here
    /// (PrepareMigrationSource); returns the source disk as it described it.
    pub(super) async fn prepare_remote_source(
        &self,
        id: &str,
        from: &RemoteSource,
        endpoint: &HostPort,
    ) -> Result<pb::Disk, DaemonError> {
        let request = self.source_request(id, from);
        self.peers
            .call(endpoint, |mut client| async move {
                client.prepare_migration_source(request).await
            })
            .await
            .map_err(|source| DaemonError::Peer {
                field: "incoming_from",
                source,
            })
    }

    /// Tells the source node to forget the migration of `from` to disk `id` here; a failure
    /// is logged too (the source node's operator can cancel there).
    pub(super) async fn cancel_remote_source(
        &self,
        id: &str,
        from: &RemoteSource,
        endpoint: &HostPort,
    ) -> Cancelled {
        let request = self.source_request(id, from);
        let cancelled = self
            .peers
            .call(endpoint, |mut client| async move {
                client.cancel_migration_source(request).await
            })
            .await;
        match cancelled {
            Ok(_) => Cancelled::There,
            // Gone there (retired by an earlier takeover, or removed): nothing to forget.
            Err(e) if e.is_not_found() => Cancelled::Gone,
            Err(e) => {
                warn!(
                    "disk {id}: {from} could not be told to forget its migration here: {e}; \
                     cancel it there with blkplanectl disk migrate {} --cancel",
                    from.disk
                );
                Cancelled::Failed(e.to_string())
            }
        }
    }

    /// After RemoveDisk of incoming disk `id`: the source node forgets the migration; emits
    /// MIGRATION_CANCELLED saying whether it could be told.
    pub(super) async fn cancel_incoming_from(&self, id: &str, from: &RemoteSource) {
        let message = match HostPort::parse(&from.endpoint) {
            Some(endpoint) => match self.cancel_remote_source(id, from, &endpoint).await {
                Cancelled::There => {
                    format!("the live migration from {from} was cancelled there too")
                }
                Cancelled::Gone => format!(
                    "the live migration from {from} ended: that disk is gone from its node \
                     (retired or removed), nothing to cancel there"
                ),
                Cancelled::Failed(why) => format!(
                    "the live migration from {from} could not be cancelled there ({why}); \
                     cancel it with blkplanectl disk migrate {} --cancel on that node",
                    from.disk
                ),
            },
            None => format!("the stored endpoint of {from} is not HOST:PORT"),
        };
        self.events
            .emit(EventKind::MigrationCancelled, id, 0, message);
    }

    /// The takeover of incoming disk `id` (whose VMM runs the migrated VM, as the caller
    /// checked) from `from` on another node: that node retires its disk if its rings have
    /// stopped; then `incoming_from` is cleared (persisted) and MIGRATED emitted. A source
    /// that still serves, or whose node cannot tell, is waited for (the next poll asks
    /// again); one that node no longer has is not. Called without `ops`, which it takes only
    /// for its state write, so that a slow node holds up no other call.
    pub(super) async fn take_over_remote(
        &self,
        disk: &DiskHandle,
        from: &RemoteSource,
    ) -> Result<(), DaemonError> {
        let id = &disk.spec.id;
        let Some(endpoint) = HostPort::parse(&from.endpoint) else {
            warn!("disk {id}: the stored endpoint of {from} is not HOST:PORT");
            return Ok(());
        };
        let request = self.source_request(id, from);
        let answer = self
            .peers
            .call(&endpoint, |mut client| async move {
                client.retire_migration_source(request).await
            })
            .await;
        let wait = match answer {
            Ok(r) if r.outcome == RetireOutcome::Retired as i32 => None,
            Ok(r) if r.outcome == RetireOutcome::SourceServes as i32 => {
                Some(TakeoverWait::BothServing)
            }
            Ok(_) => Some(TakeoverWait::SourceUnknown),
            Err(e) if e.is_not_found() => None,
            // The source node no longer records this migration: it was cancelled there while
            // the VM came to run here.
            Err(e) if e.is_refused_precondition() => Some(TakeoverWait::SourceForgot),
            Err(e) => {
                warn!("disk {id}: asking {from} to retire: {e}");
                Some(TakeoverWait::SourceUnknown)
            }
        };
        let pid = disk.runtime().pid;
        if let Some(wait) = wait {
            let first = disk.note_takeover_wait(wait);
            if first {
                self.report_takeover_wait(id, &from.to_string(), pid, wait);
            }
            return Ok(());
        }
        info!("disk {id}: its VMM runs the migrated VM; {from} is retired");
        let _ops = self.ops.lock().await;
        // Removed while the other node was asked: nothing left to take over.
        if !lock(&self.disks)
            .get(id)
            .is_some_and(|d| std::ptr::eq(Arc::as_ptr(d), disk))
        {
            info!("disk {id} was removed while {from} was being retired there");
            return Ok(());
        }
        disk.update(|rt| rt.incoming_from = None);
        if let Err(e) = self.persist() {
            // Still incoming: the next poll asks again, and the source node, which no longer
            // has the disk, answers NOT_FOUND.
            disk.update(|rt| rt.incoming_from = Some(from.clone()));
            return Err(e);
        }
        *lock(&disk.takeover_wait) = None;
        disk.push_blockers().await;
        self.events.emit(
            EventKind::Migrated,
            id,
            pid,
            format!("disk {id} took over from {from}; retired there"),
        );
        Ok(())
    }
}
