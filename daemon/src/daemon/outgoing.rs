//! The source side of a live migration to another node: the destination node's blkplaned
//! asks this one to record the migration (PrepareMigrationSource), to retire the source disk
//! once the VM runs there (RetireMigrationSource), or to forget it (CancelMigrationSource).

use log::info;

use crate::migration;
use crate::pb::{self, EventKind, MigrationSourceRequest, RetireOutcome};
use crate::state::{Format, MigrationStorage, OutgoingMigration};
use crate::supervisor::TakeoverWait;
use crate::validate::{self, ValidationError};

use super::{Daemon, DaemonError};

/// Checks MigrationSourceRequest `destination` and returns it as stored.
fn check_destination(d: &pb::OutgoingMigration) -> Result<OutgoingMigration, ValidationError> {
    validate::check_id_in("destination.node", &d.node)?;
    validate::check_id_in("destination.disk", &d.disk)?;
    let storage = MigrationStorage::from_pb(d.storage).ok_or_else(|| ValidationError::Invalid {
        field: "destination.storage",
        reason: format!("{} is not shared or local", d.storage),
    })?;
    Ok(OutgoingMigration {
        node: d.node.clone(),
        disk: d.disk.clone(),
        storage,
    })
}

/// [`check_destination`] of a destination the call requires.
fn required_destination(
    d: Option<&pb::OutgoingMigration>,
) -> Result<OutgoingMigration, ValidationError> {
    check_destination(d.ok_or_else(|| ValidationError::Invalid {
        field: "destination",
        reason: "must be set: the destination node and disk".into(),
    })?)
}

impl Daemon {
    /// PrepareMigrationSource: checks that disk `id` may be migrated to the destination now
    /// and records the migration (see the .proto). Returns the disk as GetDisk does.
    pub async fn prepare_migration_source(
        &self,
        req: &MigrationSourceRequest,
    ) -> Result<pb::Disk, DaemonError> {
        let _ops = self.ops.lock().await;
        let destination = required_destination(req.destination.as_ref())?;
        let disk = self.get_handle(&req.id)?;
        let id = &req.id;
        self.refuse_while_committing(id)?;
        let refused = |reason: String| -> DaemonError {
            ValidationError::FailedPrecondition {
                field: "id",
                reason,
            }
            .into()
        };
        let rt = disk.runtime();
        if rt.is_incoming() {
            return Err(refused(format!(
                "disk {id} is itself the incoming destination of a live migration; it has to \
                 take over before it can be migrated on"
            )));
        }
        if let Some((_, other)) = self.migration_of_id(id) {
            return Err(refused(format!(
                "disk {id} already has an incoming disk on its own node, {other}; remove \
                 {other} to migrate it elsewhere"
            )));
        }
        let asked_again = match &rt.lifecycle.outgoing {
            // Asked again (the destination retried): the same answer, if the disk still may
            // be migrated.
            Some(current) if *current == destination => true,
            Some(current) => {
                return Err(refused(format!(
                    "disk {id} is already being migrated to {current}; cancel that first \
                     (blkplanectl disk migrate {id} --cancel)"
                )))
            }
            None => false,
        };
        if disk.spec.format == Some(Format::Qcow2) {
            return Err(refused(format!(
                "the image {} of disk {id} is qcow2, and live migration of a qcow2 disk is \
                 not supported yet (both frontends would cache and write its metadata)",
                disk.spec.image.display()
            )));
        }
        let fresh = self.migratable_now(&disk).await?;
        if asked_again {
            return Ok(fresh);
        }
        let recorded = destination.clone();
        self.change_lifecycle_held(&disk, |l| l.outgoing = Some(recorded))?;
        info!("disk {id}: source of a live migration to {destination}");
        self.events.emit(
            EventKind::MigrationOutgoing,
            id,
            disk.runtime().pid,
            format!(
                "source of a live migration to {destination} ({})",
                destination.storage.name()
            ),
        );
        Ok(self.disk_info(&disk, false).await)
    }

    /// RetireMigrationSource: retires disk `id` if its frontend serves no running ring (the
    /// VM runs on the destination), as RemoveDisk with `force` would; otherwise says why not.
    pub async fn retire_migration_source(
        &self,
        req: &MigrationSourceRequest,
    ) -> Result<RetireOutcome, DaemonError> {
        let _ops = self.ops.lock().await;
        let destination = required_destination(req.destination.as_ref())?;
        let disk = self.get_handle(&req.id)?;
        let id = &req.id;
        if disk.runtime().lifecycle.outgoing.as_ref() != Some(&destination) {
            return Err(ValidationError::FailedPrecondition {
                field: "destination",
                reason: format!("disk {id} has no outgoing live migration to {destination}"),
            }
            .into());
        }
        // Local storage: the destination serves only a complete image; a copy that is not
        // complete here (it was reopened) means the source serves again.
        if destination.storage == MigrationStorage::Local && !self.copy_complete(id) {
            return Ok(RetireOutcome::SourceServes);
        }
        match self.source_serves(&disk).await {
            Some(TakeoverWait::BothServing) => return Ok(RetireOutcome::SourceServes),
            Some(TakeoverWait::SourceUnknown | TakeoverWait::SourceForgot) => {
                return Ok(RetireOutcome::SourceUnknown)
            }
            None => {}
        }
        info!("disk {id}: {destination} runs the migrated VM; retiring it");
        self.forget_and_stop(
            id,
            &disk,
            format!("retired: {destination} took over from it (live migration)"),
        )
        .await?;
        Ok(RetireOutcome::Retired)
    }

    /// CancelMigrationSource: forgets disk `id`'s outgoing migration (only one to
    /// `destination`, when given). Returns the migration that was cancelled.
    pub async fn cancel_migration_source(
        &self,
        req: &MigrationSourceRequest,
    ) -> Result<Option<OutgoingMigration>, DaemonError> {
        let _ops = self.ops.lock().await;
        let destination = req
            .destination
            .as_ref()
            .map(check_destination)
            .transpose()?;
        let disk = self.get_handle(&req.id)?;
        let id = &req.id;
        let Some(current) = disk.runtime().lifecycle.outgoing else {
            return Ok(None);
        };
        if destination.as_ref().is_some_and(|d| *d != current) {
            return Err(ValidationError::FailedPrecondition {
                field: "destination",
                reason: format!(
                    "disk {id} is being migrated to {current}, not to {}",
                    destination.map(|d| d.to_string()).unwrap_or_default()
                ),
            }
            .into());
        }
        self.change_lifecycle_held(&disk, |l| l.outgoing = None)?;
        self.stop_copy(id);
        info!("disk {id}: the live migration to {current} was cancelled");
        self.events.emit(
            EventKind::MigrationCancelled,
            id,
            disk.runtime().pid,
            format!("the live migration to {current} was cancelled"),
        );
        Ok(Some(current))
    }

    /// Disk `disk` as GetDisk describes it, asked now (the status the blockers read is the
    /// frontend's current one), if it may be migrated; FAILED_PRECONDITION `id` naming every
    /// blocker otherwise.
    pub(super) async fn migratable_now(
        &self,
        disk: &crate::supervisor::DiskHandle,
    ) -> Result<pb::Disk, DaemonError> {
        let fresh = self.disk_info(disk, true).await;
        if fresh.migratable {
            return Ok(fresh);
        }
        let blockers = migration::blockers(&disk.runtime(), blkplane_api::time::unix_time_ms())
            .iter()
            .map(migration::Blocker::line)
            .collect::<Vec<_>>()
            .join("; ");
        Err(ValidationError::FailedPrecondition {
            field: "id",
            reason: format!("disk {} must not be migrated now: {blockers}", disk.spec.id),
        }
        .into())
    }

    /// The disk named `id` in an outgoing migration refuses ResizeDisk and Snapshot: the
    /// destination's frontend, on the same image, would keep the old capacity or image.
    pub(super) fn refuse_while_outgoing(
        &self,
        id: &str,
        disk: &crate::supervisor::DiskHandle,
    ) -> Result<(), DaemonError> {
        if let Some(outgoing) = disk.runtime().lifecycle.outgoing {
            return Err(DaemonError::MigratingAcross {
                id: id.to_string(),
                what: format!("to {outgoing}"),
            });
        }
        if let Some(from) = disk.runtime().incoming_from {
            return Err(DaemonError::MigratingAcross {
                id: id.to_string(),
                what: format!("from {from}"),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations_are_checked_field_by_field() {
        let ok = pb::OutgoingMigration {
            node: "node-b".into(),
            disk: "vd1".into(),
            storage: pb::MigrationStorage::Shared as i32,
        };
        assert_eq!(
            required_destination(Some(&ok)).unwrap(),
            OutgoingMigration {
                node: "node-b".into(),
                disk: "vd1".into(),
                storage: MigrationStorage::Shared
            }
        );
        assert_eq!(
            required_destination(None).unwrap_err().field(),
            "destination"
        );
        for (bad, field) in [
            (
                pb::OutgoingMigration {
                    node: "../x".into(),
                    ..ok.clone()
                },
                "destination.node",
            ),
            (
                pb::OutgoingMigration {
                    disk: String::new(),
                    ..ok.clone()
                },
                "destination.disk",
            ),
            (
                pb::OutgoingMigration {
                    storage: 0,
                    ..ok.clone()
                },
                "destination.storage",
            ),
        ] {
            assert_eq!(check_destination(&bad).unwrap_err().field(), field);
        }
    }
}
