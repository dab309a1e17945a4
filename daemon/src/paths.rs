//! The files of a disk in blkplaned's runtime directory (`RUNTIME_DIR/disks`): the admin
//! socket, the pid file, the log and the default vhost-user socket, each the disk id and a
//! suffix, so that a file name alone tells which disk it belongs to; and the log's rotated
//! copies, `ID.log.N`.

use std::path::{Path, PathBuf};

use crate::state::DiskSpec;

/// The files of one disk in the runtime directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskPaths {
    /// The vhost-user socket (from the disk's configuration).
    pub vhost_socket: PathBuf,
    /// The frontend's admin socket.
    pub admin_socket: PathBuf,
    /// The frontend's pid, for adoption after a blkplaned restart.
    pub pid_file: PathBuf,
    /// The frontend's stderr.
    pub log_file: PathBuf,
}

/// Suffix of a disk's admin socket in `RUNTIME_DIR/disks` (after the disk id).
pub const ADMIN_SUFFIX: &str = blkplane_api::names::ADMIN_SOCKET_SUFFIX;
/// Suffix of a disk's pid file.
pub const PID_SUFFIX: &str = ".pid";
/// Suffix of a pid file being written.
pub const PID_TMP_SUFFIX: &str = ".pidtmp";
/// Suffix of a disk's log.
pub const LOG_SUFFIX: &str = ".log";
/// Suffix of a disk's default vhost-user socket.
pub const SOCKET_SUFFIX: &str = ".sock";
/// Every suffix of a per-disk file. None of them ends with another, so two different ids never
/// give the same file name, and a file name tells which disk it belongs to.
pub const SUFFIXES: [&str; 5] = [
    ADMIN_SUFFIX,
    PID_SUFFIX,
    PID_TMP_SUFFIX,
    LOG_SUFFIX,
    SOCKET_SUFFIX,
];

/// The disk id and suffix of a per-disk file name in `RUNTIME_DIR/disks`.
pub fn split_runtime_name(name: &str) -> Option<(&str, &'static str)> {
    SUFFIXES
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix).map(|id| (id, *suffix)))
        .filter(|(id, _)| !id.is_empty())
}

impl DiskPaths {
    /// The paths of `spec`'s disk under `disks_dir`.
    pub fn new(disks_dir: &Path, spec: &DiskSpec) -> DiskPaths {
        Self::for_id(disks_dir, &spec.id, spec.vhost_socket.clone())
    }

    /// The paths of disk `id` under `disks_dir`, with `vhost_socket`.
    pub fn for_id(disks_dir: &Path, id: &str, vhost_socket: PathBuf) -> DiskPaths {
        DiskPaths {
            vhost_socket,
            admin_socket: disks_dir.join(format!("{id}{ADMIN_SUFFIX}")),
            pid_file: disks_dir.join(format!("{id}{PID_SUFFIX}")),
            log_file: disks_dir.join(format!("{id}{LOG_SUFFIX}")),
        }
    }

    /// The files blkplaned itself names after the disk id (not the vhost-user socket).
    pub fn own_files(&self) -> [&Path; 3] {
        [&self.admin_socket, &self.pid_file, &self.log_file]
    }
}

/// The `n`-th rotated copy of a disk's log (`ID.log.N`, 1 the newest; see `disk_log`). Its
/// name ends with a digit, which no suffix of [`SUFFIXES`] does, so it is never taken for a
/// file of another disk.
pub fn rotated_log(log_file: &Path, n: u32) -> PathBuf {
    let mut name = log_file.as_os_str().to_owned();
    name.push(format!(".{n}"));
    PathBuf::from(name)
}

/// The number N of `file_name` if it is a rotated copy of the log named `log_name`
/// (`LOG.N`, N from 1, without leading zeros).
pub fn rotated_number(file_name: &str, log_name: &str) -> Option<u32> {
    let digits = file_name.strip_prefix(log_name)?.strip_prefix('.')?;
    if digits.starts_with('0') || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The disk id of a rotated log's file name in `RUNTIME_DIR/disks` (`ID.log.N`).
pub fn split_rotated_log_name(name: &str) -> Option<&str> {
    let (log, _) = name.rsplit_once('.')?;
    rotated_number(name, log)?;
    log.strip_suffix(LOG_SUFFIX).filter(|id| !id.is_empty())
}

/// The temp file a pid file is written to.
pub fn pid_tmp(pid_file: &Path) -> PathBuf {
    let mut name = pid_file.as_os_str().to_owned();
    name.push(PID_TMP_SUFFIX.strip_prefix(PID_SUFFIX).unwrap_or(".tmp"));
    PathBuf::from(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtime_names_never_collide() {
        // No suffix ends with another, so (id, suffix) ↔ file name is one-to-one.
        for a in SUFFIXES {
            for b in SUFFIXES {
                assert!(a == b || !a.ends_with(b), "{a} ends with {b}");
            }
        }
        assert_eq!(split_runtime_name("x.admin"), Some(("x", ADMIN_SUFFIX)));
        assert_eq!(
            split_runtime_name("x.admin.sock"),
            Some(("x.admin", SOCKET_SUFFIX))
        );
        assert_eq!(
            split_runtime_name("a.b.pidtmp"),
            Some(("a.b", PID_TMP_SUFFIX))
        );
        assert_eq!(split_runtime_name(".sock"), None);
        assert_eq!(split_runtime_name("x.img"), None);
        assert_eq!(pid_tmp(Path::new("/r/x.pid")), PathBuf::from("/r/x.pidtmp"));
    }

    #[test]
    fn rotated_log_names() {
        let log = Path::new("/r/x.log");
        assert_eq!(rotated_log(log, 2), PathBuf::from("/r/x.log.2"));
        assert_eq!(rotated_number("x.log.2", "x.log"), Some(2));
        assert_eq!(rotated_number("x.log.12", "x.log"), Some(12));
        for not in [
            "x.log", "x.log.", "x.log.0", "x.log.01", "x.log.1a", "x.logs.1", "y.log.1",
        ] {
            assert_eq!(rotated_number(not, "x.log"), None, "{not}");
        }
        // A rotated copy is no disk's own file, and names the disk whose log it copies, also
        // for ids that look like file names themselves.
        assert_eq!(split_runtime_name("x.log.1"), None);
        assert_eq!(split_rotated_log_name("x.log.1"), Some("x"));
        assert_eq!(split_rotated_log_name("a.log.1.log.3"), Some("a.log.1"));
        assert_eq!(
            split_runtime_name("a.log.1.log"),
            Some(("a.log.1", LOG_SUFFIX))
        );
        for not in ["x.log", ".log.1", "x.sock.1", "x.log.0", "x.1"] {
            assert_eq!(split_rotated_log_name(not), None, "{not}");
        }
    }
}
