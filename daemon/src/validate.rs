//! Validation of API input: every rule says which field broke it, so that a caller (or a
//! person reading `blkplanectl`'s error) knows what to fix.
//!
//! Checks here look at the request and the file system only; the checks against other disks
//! (duplicate id, image or socket) are done by the service, which sees the disk table and
//! hands [`resolve_incoming`] the source disk of an incoming one. A disk's settings (AddDisk)
//! are checked in [`disk`], an incoming disk's against its source in [`incoming`]; the other
//! requests' fields here.

use std::path::PathBuf;

use blkplane_proto::v1::ThrottleLimits;
use thiserror::Error;

use crate::migration;
use crate::pb::MigrationBlockerReason;
use crate::state::OperatorReason;
use blkplane_api::names::reason_name;

pub mod disk;
pub mod incoming;

pub use disk::{
    can_run_disks_as_other_users, check_add, check_cpu_list, check_image, image_identity,
    resolve_vhost_socket, ImageIdentity, DEFAULT_BLOCK_SIZE, DEFAULT_IOTHREADS, DEFAULT_QUEUES,
    DEFAULT_QUEUE_SIZE, MAX_IOTHREADS, MAX_POLL_MAX_US, MAX_QUEUES, MAX_QUEUE_SIZE, MAX_SERIAL_LEN,
    MAX_SOCKET_PATH,
};
pub use incoming::{
    check_incoming_from, resolve_incoming, resolve_remote_incoming, MigrationSource,
};

/// Longest disk id.
pub const MAX_ID_LEN: usize = 64;
/// Longest operator migration-blocker message, in bytes.
pub const MAX_BLOCKER_MESSAGE: usize = 256;

/// A rejected input. The message always starts with the field's name (as in the .proto).
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ValidationError {
    /// The field is malformed or out of range (INVALID_ARGUMENT).
    #[error("{field}: {reason}")]
    Invalid {
        /// The request field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The field names something that does not exist (NOT_FOUND).
    #[error("{field}: {reason}")]
    NotFound {
        /// The request field.
        field: &'static str,
        /// What was not found.
        reason: String,
    },
    /// The field names something another disk (or process) already has (ALREADY_EXISTS).
    #[error("{field}: {reason}")]
    AlreadyExists {
        /// The request field.
        field: &'static str,
        /// Who has it.
        reason: String,
    },
    /// The field names a disk whose state forbids the request (FAILED_PRECONDITION).
    #[error("{field}: {reason}")]
    FailedPrecondition {
        /// The request field.
        field: &'static str,
        /// What about that disk forbids it.
        reason: String,
    },
    /// The field names something that is full (RESOURCE_EXHAUSTED): a throttle group with
    /// the most members it can have.
    #[error("{field}: {reason}")]
    ResourceExhausted {
        /// The request field.
        field: &'static str,
        /// What is full.
        reason: String,
    },
    /// The field asks for something blkplaned cannot do yet (UNIMPLEMENTED).
    #[error("{field}: {reason}")]
    Unimplemented {
        /// The request field.
        field: &'static str,
        /// What is not built.
        reason: String,
    },
}

impl ValidationError {
    /// The request field that was rejected.
    pub fn field(&self) -> &'static str {
        match self {
            ValidationError::Invalid { field, .. }
            | ValidationError::NotFound { field, .. }
            | ValidationError::AlreadyExists { field, .. }
            | ValidationError::FailedPrecondition { field, .. }
            | ValidationError::ResourceExhausted { field, .. }
            | ValidationError::Unimplemented { field, .. } => field,
        }
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ValidationError {
    ValidationError::Invalid {
        field,
        reason: reason.into(),
    }
}

/// What validation needs to know about the daemon.
#[derive(Debug, Clone)]
pub struct Context {
    /// `RUNTIME_DIR/disks`: default home of vhost-user sockets, and of every disk's admin
    /// socket, pid file and log.
    pub disks_dir: PathBuf,
    /// If not empty, vhost-user sockets must be inside one of these directories.
    pub socket_dirs: Vec<PathBuf>,
    /// If not empty, images must be inside one of these directories (after resolving
    /// symlinks).
    pub image_dirs: Vec<PathBuf>,
    /// Whether blkplaned may run disks as other users (DiskSettings `run_as`): it has the
    /// capabilities a frontend needs for that (see [`can_run_disks_as_other_users`]).
    pub can_run_as: bool,
    /// This node's name (`--node-name`): how a disk migrating here from another node names
    /// its destination node to the source node.
    pub node_name: String,
}

/// Checks a disk id: 1..=64 characters of `[A-Za-z0-9._-]`, not starting with '.' (so that it
/// can name files: no separators, no `.`/`..`, no hidden files).
pub fn check_id(id: &str) -> Result<(), ValidationError> {
    check_id_in("id", id)
}

/// [`check_id`] for a disk id in request field `field`.
pub fn check_id_in(field: &'static str, id: &str) -> Result<(), ValidationError> {
    if id.is_empty() {
        return Err(invalid(field, "must not be empty"));
    }
    if id.len() > MAX_ID_LEN {
        return Err(invalid(
            field,
            format!("{} characters; at most {MAX_ID_LEN} are allowed", id.len()),
        ));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(invalid(
            field,
            format!("{id:?} contains {c:?}; only A-Z, a-z, 0-9, '.', '_' and '-' are allowed"),
        ));
    }
    if id.starts_with('.') {
        return Err(invalid(field, format!("{id:?} must not start with '.'")));
    }
    Ok(())
}

/// Checks a throttle group's name: the rules of a disk id (it names the group's file in the
/// runtime directory).
pub fn check_group(group: &str) -> Result<(), ValidationError> {
    check_id_in("group", group)
}

/// Checks I/O limits with QEMU's rules (the `blkplane-throttle` crate's, which the frontend
/// applies too) and returns them in one spelling: a bucket that is all zero is left out, as an
/// absent one, so that limits compare equal when they limit the same. The error names the
/// request field (`limits.iops_total.max: requires iops_total to be set`).
pub fn check_limits(limits: &ThrottleLimits) -> Result<ThrottleLimits, ValidationError> {
    let checked = blkplane_throttle::ThrottleLimits::from(limits);
    checked.validate().map_err(|e| {
        let (field, reason) = blkplane_api::limits::api_error(&e);
        invalid(field, reason)
    })?;
    Ok(ThrottleLimits::from(&checked))
}

/// Checks a ResizeDisk size against the disk's block size (the current capacity is checked
/// by the service, which asks the frontend).
pub fn check_new_size(new_size: u64, block_size: u32) -> Result<(), ValidationError> {
    if new_size == 0 {
        return Err(invalid("new_size_bytes", "must not be 0"));
    }
    if !new_size.is_multiple_of(u64::from(block_size)) {
        return Err(invalid(
            "new_size_bytes",
            format!("{new_size} is not a multiple of the block size {block_size}"),
        ));
    }
    Ok(())
}

/// Checks the reason of an operator migration blocker: a MigrationBlockerReason value, and
/// one of the operator's (the others are blkplaned's own).
pub fn check_operator_reason(reason: i32) -> Result<OperatorReason, ValidationError> {
    const F: &str = "reason";
    let r = MigrationBlockerReason::try_from(reason)
        .map_err(|_| invalid(F, format!("{reason} is not a MigrationBlockerReason value")))?;
    if r == MigrationBlockerReason::Unspecified {
        return Err(invalid(
            F,
            "must be set: operator_backup, operator_maintenance or operator_other",
        ));
    }
    migration::to_operator(r).ok_or_else(|| {
        invalid(
            F,
            format!(
                "{} is set and cleared by blkplaned itself; operators use operator_backup, \
                 operator_maintenance or operator_other",
                reason_name(r)
            ),
        )
    })
}

/// Checks an operator migration-blocker message: 1 to 256 bytes, no control characters (it
/// ends up in logs and one-line event messages).
pub fn check_blocker_message(message: &str) -> Result<(), ValidationError> {
    const F: &str = "message";
    if message.trim().is_empty() {
        return Err(invalid(
            F,
            "must not be empty: say why the disk must not migrate",
        ));
    }
    if message.len() > MAX_BLOCKER_MESSAGE {
        return Err(invalid(
            F,
            format!(
                "{} bytes; at most {MAX_BLOCKER_MESSAGE} are allowed",
                message.len()
            ),
        ));
    }
    if let Some(c) = message.chars().find(|c| c.is_control()) {
        return Err(invalid(F, format!("contains the control character {c:?}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        for good in ["a", "disk0", "A.b_c-9", &"x".repeat(64)] {
            assert_eq!(check_id(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            ".hidden",
            "..",
            "a/b",
            "../etc",
            "a b",
            "é",
            "a\0",
            &"x".repeat(65),
        ] {
            let e = check_id(bad).expect_err(bad);
            assert_eq!(e.field(), "id");
            assert!(e.to_string().starts_with("id: "), "{e}");
        }
    }

    #[test]
    fn throttle_input() {
        let ok = blkplane_api::limits::named(&[
            ("iops_total", 100),
            ("iops_total_max", 200),
            ("iops_total_max_length", 10),
            ("bps_read", 1 << 20),
            ("iops_size", 4096),
        ])
        .unwrap();
        assert_eq!(check_limits(&ok), Ok(ok));
        assert_eq!(
            check_limits(&ThrottleLimits::default()),
            Ok(ThrottleLimits::default())
        );
        // An all-zero bucket means no limit, spelled as an absent one.
        let zero_bucket = ThrottleLimits {
            bps_read: Some(Default::default()),
            ..Default::default()
        };
        assert_eq!(check_limits(&zero_bucket), Ok(ThrottleLimits::default()));
        let cases: [(ThrottleLimits, &str); 5] = [
            (
                blkplane_api::limits::named(&[("iops_total_max", 5)]).unwrap(),
                "limits.iops_total.max",
            ),
            (
                blkplane_api::limits::named(&[("bps_total", 1), ("bps_write", 1)]).unwrap(),
                "limits.bps_write.avg",
            ),
            (
                blkplane_api::limits::named(&[("iops_size", 512)]).unwrap(),
                "limits.iops_size",
            ),
            (
                blkplane_api::limits::named(&[("bps_read", 10), ("bps_read_max", 5)]).unwrap(),
                "limits.bps_read.max",
            ),
            (
                blkplane_api::limits::named(&[("iops_write", 1), ("iops_write_max_length", 3)])
                    .unwrap(),
                "limits.iops_write.max_length",
            ),
        ];
        for (limits, field) in cases {
            let e = check_limits(&limits).unwrap_err();
            assert_eq!(e.field(), field, "{e}");
            let text = e.to_string();
            assert!(text.starts_with(&format!("{field}: ")), "{text}");
            // The field is named once, not twice ("limits.x: x: ...").
            assert!(!text[field.len() + 2..].starts_with(&field[7..]), "{text}");
            assert!(matches!(e, ValidationError::Invalid { .. }));
        }
        assert_eq!(check_group("tenant-A_1.x"), Ok(()));
        for bad in ["", ".g", "a/b", "a b", &"g".repeat(65)] {
            assert_eq!(check_group(bad).unwrap_err().field(), "group", "{bad:?}");
        }
    }

    #[test]
    fn blocker_input() {
        assert_eq!(
            check_operator_reason(MigrationBlockerReason::OperatorBackup as i32),
            Ok(OperatorReason::Backup)
        );
        for bad in [0, 99, -1, MigrationBlockerReason::Draining as i32] {
            assert_eq!(check_operator_reason(bad).unwrap_err().field(), "reason");
        }
        assert!(check_operator_reason(1)
            .unwrap_err()
            .to_string()
            .contains("draining is set and cleared by blkplaned"));
        assert_eq!(check_blocker_message("nightly backup of vd1"), Ok(()));
        for bad in ["", "  ", "a\nb", &"x".repeat(257)] {
            assert_eq!(check_blocker_message(bad).unwrap_err().field(), "message");
        }
    }

    #[test]
    fn new_sizes() {
        assert_eq!(check_new_size(4096, 512), Ok(()));
        assert_eq!(
            check_new_size(0, 512).unwrap_err().field(),
            "new_size_bytes"
        );
        assert_eq!(
            check_new_size(4096 + 512, 4096).unwrap_err().field(),
            "new_size_bytes"
        );
    }
}
