//! Migration blockers of the disk table: a disk's migration status, and the operator's
//! blockers added and removed (persisted with the disk, pushed to its frontend).

use crate::migration::from_operator;
use crate::pb;
use crate::state::OperatorBlocker;
use crate::supervisor::DiskHandle;
use crate::validate;
use blkplane_api::names::reason_name;

use super::{Daemon, DaemonError};

impl Daemon {
    /// The disk's migration status now.
    pub(super) fn migration_status(&self, disk: &DiskHandle) -> pb::MigrationStatus {
        let blockers = disk.refresh_migration();
        pb::MigrationStatus {
            id: disk.spec.id.clone(),
            migratable: blockers.is_empty(),
            blockers,
        }
    }

    /// AddMigrationBlocker: an operator blocker with `reason` (replacing the message of one
    /// the disk has already), persisted, and sent to the frontend.
    pub async fn add_migration_blocker(
        &self,
        id: &str,
        reason: i32,
        message: &str,
    ) -> Result<pb::MigrationStatus, DaemonError> {
        let disk = self.get_handle(id)?;
        let reason = validate::check_operator_reason(reason)?;
        validate::check_blocker_message(message)?;
        let now = blkplane_api::time::unix_time_ms();
        self.change_lifecycle(&disk, |l| {
            match l.migration_blockers.iter_mut().find(|b| b.reason == reason) {
                Some(b) if b.message == message => {}
                Some(b) => {
                    b.message = message.to_string();
                    b.since_unix_ms = now;
                }
                None => l.migration_blockers.push(OperatorBlocker {
                    reason,
                    message: message.to_string(),
                    since_unix_ms: now,
                }),
            }
        })
        .await?;
        disk.push_blockers().await;
        Ok(self.migration_status(&disk))
    }

    /// RemoveMigrationBlocker: the operator blocker with `reason` goes; NOT_FOUND if there is
    /// none.
    pub async fn remove_migration_blocker(
        &self,
        id: &str,
        reason: i32,
    ) -> Result<pb::MigrationStatus, DaemonError> {
        let disk = self.get_handle(id)?;
        let reason = validate::check_operator_reason(reason)?;
        if !disk
            .runtime()
            .lifecycle
            .migration_blockers
            .iter()
            .any(|b| b.reason == reason)
        {
            return Err(DaemonError::NoSuchBlocker {
                id: id.to_string(),
                reason: reason_name(from_operator(reason)),
            });
        }
        self.change_lifecycle(&disk, |l| {
            l.migration_blockers.retain(|b| b.reason != reason)
        })
        .await?;
        disk.push_blockers().await;
        Ok(self.migration_status(&disk))
    }
}
