//! The lower-case names of the API's enums, as blkplanectl prints them, blkplaned uses them in
//! metrics labels and logs, and the frontend is sent them in blocker lines; and the admin
//! socket's suffix, which both sides rely on.

use crate::pb::{
    DiskState, EventKind, ImageFormat, MigrationBlockerReason as Reason, MigrationCopyPhase,
    MigrationStorage,
};

/// The name of an image format as blkplanectl prints it: QEMU's (`raw`, `qcow2`), and `probe`
/// for a disk whose frontend probes its image at each start (kept from before blkplaned kept
/// the format).
pub fn format_name(format: ImageFormat) -> &'static str {
    match format {
        ImageFormat::Unspecified => "probe",
        ImageFormat::Raw => "raw",
        ImageFormat::Qcow2 => "qcow2",
    }
}

/// The name of how a migrated disk's contents reach the destination node, as blkplanectl
/// prints it and takes it (`shared`, `local`).
pub fn storage_name(storage: MigrationStorage) -> &'static str {
    match storage {
        MigrationStorage::Unspecified => "unspecified",
        MigrationStorage::Shared => "shared",
        MigrationStorage::Local => "local",
    }
}

/// The name of a copy's phase (StartMigration) as blkplanectl prints it and the metrics
/// label it.
pub fn copy_phase_name(phase: MigrationCopyPhase) -> &'static str {
    match phase {
        MigrationCopyPhase::Unspecified => "unspecified",
        MigrationCopyPhase::Bulk => "bulk",
        MigrationCopyPhase::Dirty => "dirty",
        MigrationCopyPhase::Converged => "converged",
        MigrationCopyPhase::Complete => "complete",
        MigrationCopyPhase::Failed => "failed",
    }
}

/// The name of a disk state as blkplanectl prints it.
pub fn state_name(state: DiskState) -> &'static str {
    match state {
        DiskState::Unspecified => "unspecified",
        DiskState::Starting => "starting",
        DiskState::Ready => "ready",
        DiskState::Connected => "connected",
        DiskState::Restarting => "restarting",
        DiskState::Failed => "failed",
        DiskState::Stopping => "stopping",
        DiskState::Drained => "drained",
    }
}

/// The lower-case name of an event kind, as blkplanectl prints it.
pub fn kind_name(kind: EventKind) -> &'static str {
    match kind {
        EventKind::Unspecified => "unspecified",
        EventKind::Added => "added",
        EventKind::Removed => "removed",
        EventKind::Connected => "connected",
        EventKind::Disconnected => "disconnected",
        EventKind::Exited => "exited",
        EventKind::Restarted => "restarted",
        EventKind::Failed => "failed",
        EventKind::Adopted => "adopted",
        EventKind::Resized => "resized",
        EventKind::Drained => "drained",
        EventKind::Resumed => "resumed",
        EventKind::BlockerAdded => "blocker_added",
        EventKind::BlockerRemoved => "blocker_removed",
        EventKind::Migrated => "migrated",
        EventKind::BothServing => "both_serving",
        EventKind::IothreadRestarted => "iothread_restarted",
        EventKind::ThrottleChanged => "throttle_changed",
        EventKind::Snapshot => "snapshot",
        EventKind::MigrationOutgoing => "migration_outgoing",
        EventKind::MigrationCancelled => "migration_cancelled",
        EventKind::MigrationCopying => "migration_copying",
        EventKind::MigrationConverged => "migration_converged",
        EventKind::MigrationAutoConverge => "migration_auto_converge",
        EventKind::MigrationCopied => "migration_copied",
        EventKind::MigrationFailed => "migration_failed",
        EventKind::Commit => "commit",
    }
}

/// The suffix of a disk's admin socket, `RUNTIME_DIR/disks/ID.admin`: blkplaned names it so, and
/// blkplanectl refuses a `--socket` named so before sending anything to that frontend.
pub const ADMIN_SOCKET_SUFFIX: &str = ".admin";

/// The width of the longest [`kind_name`], so that a column of kinds stays aligned.
pub const KIND_NAME_WIDTH: usize = 23;

/// The lower-case name of a reason, as blkplanectl prints it and the frontend logs it.
pub fn reason_name(reason: Reason) -> &'static str {
    match reason {
        Reason::Unspecified => "unspecified",
        Reason::Draining => "draining",
        Reason::FrontendRestarting => "frontend_restarting",
        Reason::IothreadRestarted => "iothread_restarted",
        Reason::Incoming => "incoming",
        Reason::UnsupportedFeature => "unsupported_feature",
        Reason::OperatorBackup => "operator_backup",
        Reason::OperatorMaintenance => "operator_maintenance",
        Reason::OperatorOther => "operator_other",
    }
}

/// Every migration-blocker reason (not `Unspecified`), in the API's order.
pub const BLOCKER_REASONS: [Reason; 8] = [
    Reason::Draining,
    Reason::FrontendRestarting,
    Reason::IothreadRestarted,
    Reason::Incoming,
    Reason::UnsupportedFeature,
    Reason::OperatorBackup,
    Reason::OperatorMaintenance,
    Reason::OperatorOther,
];

/// A reason given on blkplanectl's command line: its name (`operator_backup`), the operator
/// names without the prefix (`backup`, `maintenance`, `other`), the .proto name
/// (`MIGRATION_BLOCKER_REASON_OPERATOR_BACKUP`), or a number, which is passed on as it is
/// (blkplaned says whether it is valid).
pub fn parse_reason(text: &str) -> Option<i32> {
    if let Ok(n) = text.parse::<i32>() {
        return Some(n);
    }
    let lower = text.to_ascii_lowercase();
    let name = lower
        .strip_prefix("migration_blocker_reason_")
        .unwrap_or(&lower);
    BLOCKER_REASONS
        .into_iter()
        .find(|r| {
            let full = reason_name(*r);
            full == name || full.strip_prefix("operator_") == Some(name)
        })
        .map(|r| r as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_parse_by_every_name() {
        assert_eq!(parse_reason("backup"), Some(Reason::OperatorBackup as i32));
        assert_eq!(
            parse_reason("operator_maintenance"),
            Some(Reason::OperatorMaintenance as i32)
        );
        assert_eq!(
            parse_reason("MIGRATION_BLOCKER_REASON_OPERATOR_OTHER"),
            Some(Reason::OperatorOther as i32)
        );
        assert_eq!(parse_reason("draining"), Some(Reason::Draining as i32));
        assert_eq!(parse_reason("99"), Some(99));
        assert_eq!(parse_reason("nonsense"), None);
    }

    #[test]
    fn names_round_trip_through_parse_reason() {
        for r in [Reason::Draining, Reason::Incoming, Reason::OperatorBackup] {
            assert_eq!(parse_reason(reason_name(r)), Some(r as i32));
        }
        assert_eq!(state_name(DiskState::Ready), "ready");
        assert_eq!(format_name(ImageFormat::Qcow2), "qcow2");
        assert_eq!(format_name(ImageFormat::Unspecified), "probe");
        assert_eq!(
            kind_name(EventKind::IothreadRestarted),
            "iothread_restarted"
        );
    }

    #[test]
    fn the_kind_column_fits_every_kind() {
        let widths: Vec<usize> = (0..=i32::from(u8::MAX))
            .filter_map(|n| EventKind::try_from(n).ok())
            .map(|k| kind_name(k).len())
            .collect();
        assert!(widths.len() > 17, "{widths:?}");
        assert_eq!(widths.iter().max(), Some(&KIND_NAME_WIDTH));
    }
}
