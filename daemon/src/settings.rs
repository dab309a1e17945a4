//! How blkplaned runs frontends: the binary, the directories, the timeouts and the restart
//! policy, as the supervisor and the frontend starter read them.

use std::path::PathBuf;
use std::time::Duration;

use crate::disk_log::DiskLogLimit;
use crate::state::{DiskSpec, RunAsSpec};

/// When to give up on a crashing frontend, and how long to wait between restarts.
#[derive(Debug, Clone)]
pub struct RestartPolicy {
    /// This many exits within `window` mark the disk failed.
    pub max_crashes: usize,
    /// The window crashes are counted in.
    pub window: Duration,
    /// Delay before the first restart; doubled for each further crash in the window.
    pub initial_backoff: Duration,
    /// Longest delay between restarts.
    pub max_backoff: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            max_crashes: 5,
            window: Duration::from_secs(60),
            initial_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(10),
        }
    }
}

impl RestartPolicy {
    /// The delay before restarting after the `n`-th crash in the window (n ≥ 1).
    pub fn backoff(&self, n: usize) -> Duration {
        let shift = u32::try_from(n.saturating_sub(1))
            .unwrap_or(u32::MAX)
            .min(20);
        self.initial_backoff
            .saturating_mul(1 << shift)
            .min(self.max_backoff)
    }
}

/// What the supervisor needs to know about the daemon.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The `blkplane-frontend` to run.
    pub frontend_binary: PathBuf,
    /// `RUNTIME_DIR/disks`: admin sockets, pid files, logs (and default vhost-user sockets).
    pub disks_dir: PathBuf,
    /// Restart policy.
    pub policy: RestartPolicy,
    /// How long a frontend may take to serve after it was spawned.
    pub start_timeout: Duration,
    /// How often a running frontend's status is polled (VMM connects and disconnects are
    /// noticed this late at most).
    pub poll_interval: Duration,
    /// `RUNTIME_DIR/throttle`: the state files of throttle groups.
    pub throttle_dir: PathBuf,
    /// The user of disks whose configuration names none (blkplaned's `--disk-user`).
    pub disk_user: Option<RunAsSpec>,
    /// The size cap of each disk's log (`--disk-log-max-bytes`, `--disk-log-keep`).
    pub disk_log: DiskLogLimit,
    /// Whether blkplaned may run frontends as other users (see
    /// [`crate::validate::can_run_disks_as_other_users`]).
    pub can_run_as: bool,
    /// blkplaned's `--image-dir` directories, passed to every frontend: a qcow2 image's
    /// header is the image owner's to write, and names backing files the frontend opens at
    /// each start, so they are held to the directories the image is (empty: anywhere).
    pub image_dirs: Vec<PathBuf>,
}

impl Settings {
    /// The user `spec`'s processes run as: its own `run_as`, else `--disk-user`; `None`:
    /// blkplaned's own.
    pub fn user_of<'a>(&'a self, spec: &'a DiskSpec) -> Option<&'a RunAsSpec> {
        spec.run_as.as_ref().or(self.disk_user.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let p = RestartPolicy {
            max_crashes: 5,
            window: Duration::from_secs(60),
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(1000),
        };
        let d: Vec<u128> = (1..=6).map(|n| p.backoff(n).as_millis()).collect();
        assert_eq!(d, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(p.backoff(1000), Duration::from_millis(1000));
    }
}
