//! The size cap of a disk's log (`RUNTIME_DIR/disks/ID.log`, the frontend's stdout and
//! stderr): past `--disk-log-max-bytes` it is rotated to `ID.log.1` (the older copies shifted
//! to `ID.log.2` … `ID.log.KEEP`) and emptied, at the supervisor's status poll.
//!
//! Rotation is copytruncate, not rename-and-reopen: the frontend writes to the fd blkplaned
//! opened for it at its start, and it outlives blkplaned (a restarted blkplaned adopts it), so
//! nobody can make it open a new file, and putting blkplaned between the frontend and the file
//! (a pipe) would tie the disks' stderr to blkplaned's life. The fd is O_APPEND, so after the
//! truncation the frontend's next write lands at the new end, offset 0. The price: what the
//! frontend writes between the end of the copy and the truncation is lost.

use std::fs::OpenOptions;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::paths;

/// How large a disk's log may grow and how many rotated copies are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskLogLimit {
    /// Rotate once the log is larger than this; 0: never.
    pub max_bytes: u64,
    /// Rotated copies kept (`ID.log.1` newest); 0: the log is emptied without a copy.
    pub keep: u32,
}

/// `--disk-log-max-bytes` by default: 8 MiB, a week of a busy disk's connects and iothread
/// restarts, small on a tmpfs.
pub const DEFAULT_MAX_BYTES: u64 = 8 << 20;
/// `--disk-log-keep` by default.
pub const DEFAULT_KEEP: u32 = 2;

impl Default for DiskLogLimit {
    fn default() -> Self {
        DiskLogLimit {
            max_bytes: DEFAULT_MAX_BYTES,
            keep: DEFAULT_KEEP,
        }
    }
}

/// A rotation step that failed.
#[derive(Debug, Error)]
#[error("{what} {}: {source}", path.display())]
pub struct DiskLogError {
    /// What was being done.
    what: &'static str,
    /// The file.
    path: PathBuf,
    /// The OS error.
    source: std::io::Error,
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> DiskLogError + 'a {
    move |source| DiskLogError {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// Whether `log` is over `limit` (a missing log is not).
pub fn over(log: &Path, limit: &DiskLogLimit) -> bool {
    limit.max_bytes != 0 && std::fs::metadata(log).is_ok_and(|m| m.len() > limit.max_bytes)
}

/// Rotates `log` if it is over `limit`: `LOG.(keep-1)` … `LOG.1` move up one, `LOG` is copied
/// to `LOG.1` and truncated, and copies beyond `keep` (from a larger `--disk-log-keep`
/// before) are removed. Returns whether it rotated.
pub fn rotate_if_over(log: &Path, limit: &DiskLogLimit) -> Result<bool, DiskLogError> {
    if !over(log, limit) {
        return Ok(false);
    }
    for n in (1..limit.keep).rev() {
        let from = paths::rotated_log(log, n);
        match std::fs::rename(&from, paths::rotated_log(log, n + 1)) {
            Err(e) if e.kind() != ErrorKind::NotFound => return Err(io("renaming", &from)(e)),
            _ => {}
        }
    }
    for (n, stale) in rotated(log) {
        if n > limit.keep {
            std::fs::remove_file(&stale).map_err(io("removing", &stale))?;
        }
    }
    if limit.keep > 0 {
        let first = paths::rotated_log(log, 1);
        // fs::copy gives the copy the log's mode (0600).
        std::fs::copy(log, &first).map_err(io("copying to", &first))?;
    }
    OpenOptions::new()
        .write(true)
        .open(log)
        .and_then(|f| f.set_len(0))
        .map_err(io("truncating", log))?;
    Ok(true)
}

/// The rotated copies of `log` that exist, with their numbers, by number.
pub fn rotated(log: &Path) -> Vec<(u32, PathBuf)> {
    let (Some(dir), Some(name)) = (log.parent(), log.file_name()) else {
        return Vec::new();
    };
    let name = name.to_string_lossy();
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter_map(|e| {
                    let file = e.file_name().to_string_lossy().into_owned();
                    let n = paths::rotated_number(&file, &name)?;
                    Some((n, e.path()))
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;

    fn limit(max_bytes: u64, keep: u32) -> DiskLogLimit {
        DiskLogLimit { max_bytes, keep }
    }

    fn read(p: &Path) -> String {
        std::fs::read_to_string(p).unwrap()
    }

    fn numbers(log: &Path) -> Vec<u32> {
        rotated(log).into_iter().map(|(n, _)| n).collect()
    }

    #[test]
    fn rotation_order_and_keep_count() {
        let scratch = blkplane_tests::TempDir::new("disklog");
        let log = scratch.join("d.log");
        // The frontend's fd: O_APPEND, opened once, never reopened.
        let mut fd = OpenOptions::new()
            .append(true)
            .create(true)
            .open(&log)
            .unwrap();
        std::fs::set_permissions(&log, std::fs::Permissions::from_mode(0o600)).unwrap();
        let cap = limit(10, 2);
        for round in ["first-round\n", "second-round\n", "third-round\n"] {
            assert!(!rotate_if_over(&log, &cap).unwrap());
            fd.write_all(round.as_bytes()).unwrap();
            assert!(rotate_if_over(&log, &cap).unwrap());
            assert_eq!(std::fs::metadata(&log).unwrap().len(), 0);
        }
        // Newest first, two kept.
        assert_eq!(numbers(&log), [1, 2]);
        assert_eq!(read(&paths::rotated_log(&log, 1)), "third-round\n");
        assert_eq!(read(&paths::rotated_log(&log, 2)), "second-round\n");
        let mode = std::fs::metadata(paths::rotated_log(&log, 1))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        // The fd writes on at the start of the emptied file, with no hole before it.
        fd.write_all(b"after\n").unwrap();
        assert_eq!(read(&log), "after\n");
        // At the cap exactly: not over.
        fd.write_all(b"1234").unwrap();
        assert!(!rotate_if_over(&log, &cap).unwrap());
    }

    #[test]
    fn fewer_copies_than_before_and_none() {
        let scratch = blkplane_tests::TempDir::new("disklog-keep");
        let log = scratch.join("d.log");
        for n in 1..=4 {
            std::fs::write(paths::rotated_log(&log, n), format!("old {n}\n")).unwrap();
        }
        // Another disk's files are not this log's copies.
        std::fs::write(scratch.join("d.log.x"), "").unwrap();
        std::fs::write(scratch.join("dd.log.1"), "").unwrap();
        std::fs::write(&log, "0123456789abc\n").unwrap();
        assert!(rotate_if_over(&log, &limit(8, 2)).unwrap());
        assert_eq!(numbers(&log), [1, 2]);
        assert_eq!(read(&paths::rotated_log(&log, 2)), "old 1\n");
        // keep 0: emptied, no copy, the old copies gone.
        std::fs::write(&log, "0123456789abc\n").unwrap();
        assert!(rotate_if_over(&log, &limit(8, 0)).unwrap());
        assert_eq!(read(&log), "");
        assert_eq!(numbers(&log), Vec::<u32>::new());
        assert!(scratch.join("d.log.x").exists() && scratch.join("dd.log.1").exists());
    }

    #[test]
    fn cap_zero_and_missing_log() {
        let scratch = blkplane_tests::TempDir::new("disklog-zero");
        let log = scratch.join("d.log");
        assert!(!rotate_if_over(&log, &limit(1, 2)).unwrap());
        std::fs::write(&log, vec![b'x'; 1 << 16]).unwrap();
        assert!(!rotate_if_over(&log, &limit(0, 2)).unwrap());
        assert_eq!(std::fs::metadata(&log).unwrap().len(), 1 << 16);
        assert!(numbers(&log).is_empty());
        assert_eq!(DiskLogLimit::default(), limit(8 << 20, 2));
    }
}
