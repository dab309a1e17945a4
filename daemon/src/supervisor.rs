//! Per-disk processes: starting a frontend and waiting until it serves, adopting one that
//! survived a blkplaned restart, stopping one, and the supervision loop that restarts a
//! crashed frontend with back-off and marks the disk failed when it crashes too often.
//!
//! Every frontend is watched through a pidfd, which works the same for our own children and
//! for adopted processes (children of an earlier blkplaned, now of init). Our own children are
//! reaped as soon as their pidfd says they exited, so no zombie is left.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use blkplane_proto::v1::{FrontendStatus, SetThrottle};
use log::{debug, info, warn};
use thiserror::Error;
use tokio::io::unix::AsyncFd;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::{self, AdminError};
use crate::events::EventBus;
use crate::migration;
use crate::paths::{pid_tmp, DiskPaths};
use crate::pb::{self, DiskState, EventKind, MigrationBlockerReason};
use crate::proc;
use crate::runtime::{serving, Runtime};
use crate::state::{DiskLifecycle, DiskSpec, RunAsSpec};
use crate::throttle;
use blkplane_api::names::reason_name;

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
    /// Whether blkplaned may run frontends as other users (see
    /// [`crate::validate::can_run_disks_as_other_users`]).
    pub can_run_as: bool,
}

impl Settings {
    /// The user `spec`'s processes run as: its own `run_as`, else `--disk-user`; `None`:
    /// blkplaned's own.
    pub fn user_of<'a>(&'a self, spec: &'a DiskSpec) -> Option<&'a RunAsSpec> {
        spec.run_as.as_ref().or(self.disk_user.as_ref())
    }
}

/// Why a frontend could not be started.
#[derive(Debug, Error)]
pub enum StartError {
    /// The disk runs as another user, and blkplaned cannot start processes as one.
    #[error(
        "the disk runs as uid {uid} (run_as), but blkplaned lacks CAP_SETUID, CAP_SETGID, \
         CAP_CHOWN, CAP_DAC_OVERRIDE or CAP_KILL: run it as root, or remove and add the disk \
         without run_as"
    )]
    RunAs {
        /// The disk's uid.
        uid: u32,
    },
    /// The log file could not be opened.
    #[error("cannot open the log {}: {source}", path.display())]
    Log {
        /// The log file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The frontend binary could not be executed.
    #[error("cannot run {}: {source}", binary.display())]
    Spawn {
        /// The binary.
        binary: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The process could not be watched.
    #[error("cannot open a pidfd for {pid}: {source}")]
    Pidfd {
        /// The process.
        pid: u32,
        /// The OS error.
        source: std::io::Error,
    },
    /// The pid file could not be written.
    #[error("cannot write {}: {source}", path.display())]
    PidFile {
        /// The pid file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The frontend exited before it served.
    #[error("the frontend {status} during startup{}", log_suffix(.log))]
    Exited {
        /// How it ended.
        status: String,
        /// The end of its log.
        log: String,
    },
    /// The frontend did not serve in time.
    #[error("the frontend did not serve within {timeout:?} ({last}){}", log_suffix(.log))]
    Timeout {
        /// The limit.
        timeout: Duration,
        /// The last admin-channel error, or what was still missing.
        last: String,
        /// The end of its log.
        log: String,
    },
}

fn log_suffix(log: &str) -> String {
    if log.is_empty() {
        String::new()
    } else {
        format!("; its log ends with:\n{log}")
    }
}

/// The last few lines of a log file (for error messages).
pub fn log_tail(path: &Path) -> String {
    const MAX_LINES: usize = 10;
    let Ok(text) = std::fs::read(path) else {
        return String::new();
    };
    let text = String::from_utf8_lossy(&text);
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with("--- blkplaned:"))
        .collect();
    lines[lines.len().saturating_sub(MAX_LINES)..].join("\n")
}

/// A running frontend process, watched through its pidfd.
#[derive(Debug)]
pub struct Frontend {
    pid: u32,
    pidfd: AsyncFd<OwnedFd>,
    /// Whether it is our child (then we reap it and see its exit status).
    child: bool,
}

impl Frontend {
    fn new(pid: u32, pidfd: OwnedFd, child: bool) -> std::io::Result<Frontend> {
        Ok(Frontend {
            pid,
            // SAFETY: an OwnedFd's as_raw_fd is its own open fd for as long as it lives, and
            // the AsyncFd owns it (never replaced or closed behind its back).
            pidfd: unsafe {
                AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE)?
            },
            child,
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the process exited (without waiting).
    pub fn exited(&self) -> bool {
        proc::pidfd_exited(self.pidfd.get_ref())
    }

    /// Sends a signal through the pidfd.
    pub fn signal(&self, signal: i32) {
        if let Err(e) = proc::pidfd_send_signal(self.pidfd.get_ref(), signal) {
            warn!("signal {signal} to frontend {}: {e}", self.pid);
        }
    }

    /// Waits until the process exits, reaps it if it is our child, and says how it ended.
    pub async fn wait(&self) -> String {
        loop {
            match self.pidfd.readable().await {
                // A pidfd stays readable once the process exited: no need to clear readiness.
                Ok(_guard) => break,
                Err(e) => {
                    warn!("waiting for frontend {}: {e}", self.pid);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    if self.exited() {
                        break;
                    }
                }
            }
        }
        self.reap()
    }

    /// Reaps the exited process if it is ours; describes how it ended.
    fn reap(&self) -> String {
        if !self.child {
            return "exited (it was adopted, so its exit status is unknown)".into();
        }
        // The pidfd is readable before the zombie is reapable in rare races; retry briefly.
        for _ in 0..100 {
            if let Some(status) = proc::try_reap(self.pid) {
                return status.to_string();
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        "exited (status unavailable)".into()
    }

    /// Waits up to `timeout` for the process to exit; returns how it ended, or `None`.
    pub async fn wait_for(&self, timeout: Duration) -> Option<String> {
        tokio::time::timeout(timeout, self.wait()).await.ok()
    }

    /// Stops the process: SIGTERM, then SIGKILL after `grace`. Returns how it ended.
    pub async fn stop(&self, grace: Duration) -> String {
        self.signal(libc::SIGTERM);
        if let Some(how) = self.wait_for(grace).await {
            return how;
        }
        warn!(
            "frontend {} did not exit within {grace:?} of SIGTERM; sending SIGKILL",
            self.pid
        );
        self.signal(libc::SIGKILL);
        self.wait().await
    }
}

/// The frontend's command line for `spec` (without the program), starting drained if
/// `drained`. Options use the `--opt=value` form so that a value starting with '-' (a serial,
/// say) is never taken for an option.
pub fn frontend_args(
    spec: &DiskSpec,
    paths: &DiskPaths,
    drained: bool,
    user: Option<&RunAsSpec>,
) -> Vec<OsString> {
    let mut args: Vec<OsString> = Vec::new();
    let mut opt = |name: &str, value: &dyn AsRef<std::ffi::OsStr>| {
        let mut a = OsString::from(format!("--{name}="));
        a.push(value.as_ref());
        args.push(a);
    };
    opt("socket", &paths.vhost_socket);
    opt("admin-socket", &paths.admin_socket);
    opt("image", &spec.image);
    if !spec.serial.is_empty() {
        opt("serial", &spec.serial);
    }
    opt("num-queues", &spec.num_queues.to_string());
    opt("queue-size", &spec.queue_size.to_string());
    opt("iothreads", &spec.iothreads.to_string());
    opt("block-size", &spec.block_size.to_string());
    opt("cache", &spec.cache.as_arg());
    if !spec.iothread_cpus.is_empty() {
        opt("iothread-cpus", &spec.iothread_cpus);
    }
    if let Some(run_as) = user {
        opt("run-as", &run_as.to_arg());
    }
    if let Some(us) = spec.poll_max_us {
        opt("poll-max-us", &us.to_string());
    }
    if spec.read_only {
        args.push("--read-only".into());
    }
    if drained {
        args.push("--drained".into());
    }
    args
}

/// The argument that identifies a disk's frontend in /proc/PID/cmdline (its admin socket is
/// unique per runtime directory and disk).
pub fn identity_arg(paths: &DiskPaths) -> OsString {
    let mut a = OsString::from("--admin-socket=");
    a.push(&paths.admin_socket);
    a
}

/// Whether `pid` runs a frontend for `paths` (by its command line).
pub fn is_frontend_of(pid: u32, paths: &DiskPaths) -> bool {
    let want = identity_arg(paths);
    proc::cmdline(pid).is_some_and(|argv| argv.contains(&want))
}

/// Removes a file if it exists; other errors are logged.
fn remove_file(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => debug!("removed {}", path.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => warn!("removing {}: {e}", path.display()),
    }
}

/// Removes the files a stopped frontend leaves: its sockets, pid file and log. The
/// vhost-user socket is only removed if it still is a socket.
pub fn remove_files(paths: &DiskPaths) {
    if std::fs::symlink_metadata(&paths.vhost_socket).is_ok_and(|m| m.file_type().is_socket()) {
        remove_file(&paths.vhost_socket);
    }
    remove_file(&paths.admin_socket);
    remove_file(&paths.pid_file);
    remove_file(&pid_tmp(&paths.pid_file));
    remove_file(&paths.log_file);
}

/// Writes the pid file atomically (temp file and rename), so that a reader never sees half.
fn write_pid_file(path: &Path, pid: u32) -> std::io::Result<()> {
    let tmp = pid_tmp(path);
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    writeln!(f, "{pid}")?;
    drop(f);
    std::fs::rename(&tmp, path)
}

/// Reads a pid file.
fn read_pid_file(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Starts a frontend for `spec` (drained from the start if `drained`: it serves no request
/// until resumed) and waits until it serves: its admin channel answers with its pid and its
/// vhost-user socket is listening. On failure nothing of it is left running, and its pid file
/// and admin socket are removed (the log stays, for the caller to keep or drop).
pub async fn start(
    settings: &Settings,
    spec: &DiskSpec,
    paths: &DiskPaths,
    drained: bool,
) -> Result<(Frontend, FrontendStatus), StartError> {
    let user = settings.user_of(spec);
    if let (Some(user), false) = (user, settings.can_run_as) {
        return Err(StartError::RunAs { uid: user.uid });
    }
    // A dead predecessor may have left its admin socket; ours must be fresh.
    remove_file(&paths.admin_socket);
    let mut log = OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(&paths.log_file)
        .map_err(|source| StartError::Log {
            path: paths.log_file.clone(),
            source,
        })?;
    let args = frontend_args(spec, paths, drained, user);
    let _ = writeln!(
        log,
        "--- blkplaned: starting {} {} (unix time {} ms)",
        settings.frontend_binary.display(),
        args.iter()
            .map(|a| a.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" "),
        blkplane_api::time::unix_time_ms()
    );
    let stderr = log.try_clone().map_err(|source| StartError::Log {
        path: paths.log_file.clone(),
        source,
    })?;
    let mut cmd = Command::new(&settings.frontend_binary);
    cmd.args(&args)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(stderr);
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", "info");
    }
    // SAFETY: setsid is async-signal-safe and touches no memory of the parent. A session of
    // its own keeps the frontend out of blkplaned's process group and terminal, so a Ctrl-C
    // or hang-up aimed at blkplaned does not take the disks down with it.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(|source| StartError::Spawn {
        binary: settings.frontend_binary.clone(),
        source,
    })?;
    let pid = child.id();
    // The Child handle is dropped: the pidfd below watches the process, `Frontend::wait`
    // reaps it (std never reaps on drop).
    drop(child);
    let pidfd = match proc::pidfd_open(pid) {
        Ok(fd) => fd,
        Err(source) => {
            kill_and_reap_pid(pid);
            return Err(StartError::Pidfd { pid, source });
        }
    };
    let fe = match Frontend::new(pid, pidfd, true) {
        Ok(fe) => fe,
        Err(source) => {
            kill_and_reap_pid(pid);
            return Err(StartError::Pidfd { pid, source });
        }
    };
    if let Err(source) = write_pid_file(&paths.pid_file, pid) {
        abort_start(&fe, paths).await;
        return Err(StartError::PidFile {
            path: paths.pid_file.clone(),
            source,
        });
    }
    info!(
        "disk {}: started frontend pid {pid} on {}",
        spec.id,
        paths.vhost_socket.display()
    );
    match wait_serving(&fe, paths, settings.start_timeout).await {
        Ok(status) => Ok((fe, status)),
        Err(e) => {
            abort_start(&fe, paths).await;
            Err(e)
        }
    }
}

/// A frontend [`start_throttled`] started.
#[derive(Debug)]
pub struct Started {
    /// The process.
    pub frontend: Frontend,
    /// Its status once it serves.
    pub status: FrontendStatus,
    /// The I/O limits it has; `None` when sending them failed (it serves unthrottled until a
    /// poll sends them again).
    pub throttle: Option<SetThrottle>,
}

/// Starts a frontend as [`start`] does, and gives it the I/O limits `throttle` before it
/// serves any request: unless `throttle` is "no limits, no group" (what a new frontend has),
/// the frontend starts drained, is sent the limits, and is then resumed — unless the disk
/// itself is to stay `drained`. A failed resume is logged, and undone by the poll (which
/// makes the frontend follow the disk's drained state).
pub async fn start_throttled(
    settings: &Settings,
    spec: &DiskSpec,
    paths: &DiskPaths,
    drained: bool,
    throttle: &SetThrottle,
) -> Result<Started, StartError> {
    if *throttle == throttle::unthrottled_request() {
        let (frontend, status) = start(settings, spec, paths, drained).await?;
        return Ok(Started {
            frontend,
            status,
            throttle: Some(throttle.clone()),
        });
    }
    // Drained from its first moment: a VMM that connects at once (QEMU reconnecting to a
    // restarted frontend) has its requests wait until the limits are in force.
    let (fe, mut status) = start(settings, spec, paths, true).await?;
    let socket = &paths.admin_socket;
    let applied = match admin::set_throttle(socket, throttle.clone()).await {
        Ok(()) => Some(throttle.clone()),
        Err(e) => {
            warn!(
                "disk {}: frontend {} did not take its I/O limits ({e}); it serves unthrottled \
                 until they are sent again",
                spec.id,
                fe.pid()
            );
            None
        }
    };
    if !drained {
        if let Err(e) = admin::resume(socket).await {
            warn!(
                "disk {}: resuming frontend {} after giving it its I/O limits: {e}",
                spec.id,
                fe.pid()
            );
        }
    }
    if let Ok(s) = admin::status(socket).await {
        if s.pid == fe.pid() {
            status = s;
        }
    }
    Ok(Started {
        frontend: fe,
        status,
        throttle: applied,
    })
}

/// Kills a child that could not be watched (no pidfd) and reaps it.
fn kill_and_reap_pid(pid: u32) {
    if let Ok(p) = libc::pid_t::try_from(pid) {
        // SAFETY: plain syscalls on our own unreaped child, so the pid cannot be reused.
        unsafe {
            libc::kill(p, libc::SIGKILL);
            let mut status = 0;
            libc::waitpid(p, &mut status, 0);
        }
    }
}

/// Kills a frontend that failed to start and removes its pid file and admin socket.
async fn abort_start(fe: &Frontend, paths: &DiskPaths) {
    fe.signal(libc::SIGKILL);
    fe.wait().await;
    remove_file(&paths.pid_file);
    remove_file(&paths.admin_socket);
}

/// Polls until the frontend serves (admin status answers with its pid, vhost-user socket
/// listening), it exits, or `timeout` passes.
async fn wait_serving(
    fe: &Frontend,
    paths: &DiskPaths,
    timeout: Duration,
) -> Result<FrontendStatus, StartError> {
    let deadline = Instant::now() + timeout;
    loop {
        if fe.exited() {
            let status = fe.reap();
            return Err(StartError::Exited {
                status,
                log: log_tail(&paths.log_file),
            });
        }
        let last = match admin::status(&paths.admin_socket).await {
            Ok(status) if status.pid != 0 && status.pid != fe.pid => {
                format!(
                    "the admin socket is answered by pid {}, not {}",
                    status.pid, fe.pid
                )
            }
            Ok(status) => {
                if proc::is_listening(&paths.vhost_socket) {
                    return Ok(status);
                }
                format!("{} is not listening yet", paths.vhost_socket.display())
            }
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            return Err(StartError::Timeout {
                timeout,
                last,
                log: log_tail(&paths.log_file),
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Why a running frontend could not be adopted.
#[derive(Debug, Error)]
pub enum AdoptError {
    /// No pid file (the frontend was never started, or the runtime dir was cleaned).
    #[error("no pid file {}", .0.display())]
    NoPidFile(PathBuf),
    /// The recorded process is gone.
    #[error("process {0} is not running")]
    Gone(u32),
    /// The recorded pid now belongs to some other program.
    #[error("process {0} is not this disk's frontend")]
    NotOurs(u32),
    /// The process runs but its admin channel does not answer as it should.
    #[error("frontend {pid} does not answer on its admin socket: {reason}")]
    Unresponsive {
        /// The process.
        pid: u32,
        /// What went wrong.
        reason: String,
    },
}

/// Takes over the frontend recorded in the pid file without disturbing it: the process must
/// be alive, its command line must name this disk's admin socket, and that socket must
/// answer with the same pid. An unresponsive impostor of this disk is killed, so that a
/// fresh frontend can take the sockets.
pub async fn adopt(paths: &DiskPaths) -> Result<Frontend, AdoptError> {
    let pid = read_pid_file(&paths.pid_file)
        .ok_or_else(|| AdoptError::NoPidFile(paths.pid_file.clone()))?;
    // Open the pidfd first and check the command line after: if the pid was recycled in
    // between, the check fails; if it passes, the pidfd is known to be that process.
    let pidfd = proc::pidfd_open(pid).map_err(|_| AdoptError::Gone(pid))?;
    if !is_frontend_of(pid, paths) {
        return Err(if proc::alive(pid) {
            AdoptError::NotOurs(pid)
        } else {
            AdoptError::Gone(pid)
        });
    }
    let fe = Frontend::new(pid, pidfd, false).map_err(|e| AdoptError::Unresponsive {
        pid,
        reason: e.to_string(),
    })?;
    let reason = match admin::status(&paths.admin_socket).await {
        Ok(status) if status.pid == pid => {
            if !fe.exited() {
                return Ok(fe);
            }
            return Err(AdoptError::Gone(pid));
        }
        Ok(status) => format!("answered by pid {}", status.pid),
        Err(e) => e.to_string(),
    };
    warn!(
        "frontend {pid} of {} is unresponsive ({reason}); killing it",
        paths.admin_socket.display()
    );
    fe.signal(libc::SIGKILL);
    let _ = fe.wait_for(Duration::from_secs(5)).await;
    Err(AdoptError::Unresponsive { pid, reason })
}

/// Kills every process whose command line names `paths`' admin socket (an orphan of a disk
/// that is no longer wanted, or a leftover of a crashed start). Returns the pids killed.
pub async fn kill_strays(paths: &DiskPaths) -> Vec<u32> {
    let mut killed = Vec::new();
    for pid in proc::find_processes_with_arg(&identity_arg(paths)) {
        let Ok(pidfd) = proc::pidfd_open(pid) else {
            continue;
        };
        if !is_frontend_of(pid, paths) {
            continue;
        }
        let child = false;
        if let Ok(fe) = Frontend::new(pid, pidfd, child) {
            fe.signal(libc::SIGKILL);
            let _ = fe.wait_for(Duration::from_secs(5)).await;
            // It may have been our child after all (a crashed start of this very process).
            let _ = proc::try_reap(pid);
            killed.push(pid);
        }
    }
    killed
}

/// Waits (bounded) until the iothreads of a stopped frontend are gone. They die with their
/// frontend (PR_SET_PDEATHSIG); one still alive after the wait is killed if it still is an
/// iothread.
async fn wait_iothreads_gone(pids: &[u32]) {
    const IOTHREAD_COMM: &str = "blkplane-iothre";
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let alive: Vec<u32> = pids.iter().copied().filter(|&p| proc::alive(p)).collect();
        if alive.is_empty() {
            return;
        }
        if Instant::now() >= deadline {
            for pid in alive {
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                if comm.trim() == IOTHREAD_COMM {
                    if let Ok(fd) = proc::pidfd_open(pid) {
                        warn!("iothread {pid} outlived its frontend; killing it");
                        let _ = proc::pidfd_send_signal(&fd, libc::SIGKILL);
                    }
                }
            }
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A migration blocker as last published: its message and since when it holds.
#[derive(Debug, Clone)]
struct Published {
    message: String,
    since_unix_ms: u64,
}

/// How the supervision of a disk begins.
#[derive(Debug)]
pub enum Initial {
    /// AddDisk already started the frontend ([`start_throttled`]).
    Running(Box<Started>),
    /// blkplaned (re)started: adopt the running frontend, or start one if there is none.
    AdoptOrStart,
}

/// Why the takeover of an incoming disk is waiting, as last logged (each reason is logged,
/// and turned into an event where there is one, once when it begins).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TakeoverWait {
    /// The source's frontend still serves a running ring: both sides serve the image.
    BothServing,
    /// The source's frontend runs but did not answer, so whether its rings run is unknown.
    SourceUnknown,
}

/// One disk: its configuration, its runtime state, and its supervision task.
#[derive(Debug)]
pub struct DiskHandle {
    /// The configuration as added. Its `incoming_for` is always `None` here: whether the disk
    /// is still incoming changes while it runs, so that lives in [`Runtime::incoming_for`];
    /// [`DiskHandle::config`] has both together.
    pub spec: DiskSpec,
    /// Its files.
    pub paths: DiskPaths,
    runtime: Mutex<Runtime>,
    events: EventBus,
    stop_tx: watch::Sender<bool>,
    task: Mutex<Option<JoinHandle<()>>>,
    /// Held by Drain and Resume for their whole call, and by the poll while it makes the
    /// frontend follow the desired drained state, so that they never cross.
    pub lifecycle_op: tokio::sync::Mutex<()>,
    /// The blockers last published, by reason number (their events were emitted).
    published: Mutex<BTreeMap<i32, Published>>,
    /// The blocker lines last sent to the frontend, and the pid that took them; the lock
    /// orders the sends.
    pushed: tokio::sync::Mutex<Option<(u32, Vec<String>)>>,
    /// Orders the sends of I/O limits (held across one send).
    throttle_push: tokio::sync::Mutex<()>,
    /// The I/O limits the frontend has, and its pid: the last ones it took (or started with).
    /// Read without waiting for a send under way, for `pending`.
    throttle_pushed: Mutex<Option<(u32, SetThrottle)>>,
    /// `RUNTIME_DIR/throttle`, where the group files are.
    throttle_dir: PathBuf,
    /// For an incoming disk: why its takeover waited at the last attempt, if it did.
    pub takeover_wait: Mutex<Option<TakeoverWait>>,
}

impl DiskHandle {
    /// Starts supervising a disk with its persisted `lifecycle`; the task runs until
    /// [`DiskHandle::stop`].
    pub fn spawn(
        mut spec: DiskSpec,
        lifecycle: DiskLifecycle,
        settings: Arc<Settings>,
        events: EventBus,
        initial: Initial,
    ) -> Arc<DiskHandle> {
        // One place for a value that changes: the runtime (see the `spec` field).
        let incoming_for = spec.incoming_for.take();
        let paths = DiskPaths::new(&settings.disks_dir, &spec);
        let (stop_tx, stop_rx) = watch::channel(false);
        let (state, pid, status, throttle_pushed) = match &initial {
            Initial::Running(started) => (
                state_of(Some(&started.status)),
                started.frontend.pid(),
                Some(started.status.clone()),
                started
                    .throttle
                    .clone()
                    .map(|t| (started.frontend.pid(), t)),
            ),
            Initial::AdoptOrStart => (DiskState::Starting, 0, None, None),
        };
        let disk = Arc::new(DiskHandle {
            spec,
            paths,
            runtime: Mutex::new(Runtime {
                state,
                reason: String::new(),
                pid,
                restarts: 0,
                status,
                lifecycle,
                restarted_unix_ms: 0,
                incoming_for,
            }),
            events: events.clone(),
            stop_tx,
            task: Mutex::new(None),
            lifecycle_op: tokio::sync::Mutex::new(()),
            published: Mutex::new(BTreeMap::new()),
            pushed: tokio::sync::Mutex::new(None),
            throttle_push: tokio::sync::Mutex::new(()),
            throttle_pushed: Mutex::new(throttle_pushed),
            throttle_dir: settings.throttle_dir.clone(),
            takeover_wait: Mutex::new(None),
        });
        disk.refresh_migration();
        let task = tokio::spawn(supervise(
            Arc::clone(&disk),
            settings,
            events,
            initial,
            stop_rx,
        ));
        *lock(&disk.task) = Some(task);
        disk
    }

    /// A copy of the runtime state.
    pub fn runtime(&self) -> Runtime {
        lock(&self.runtime).clone()
    }

    /// The disk's configuration now, as it is persisted and shown: [`DiskHandle::spec`] with
    /// the current `incoming_for`.
    pub fn config(&self) -> DiskSpec {
        DiskSpec {
            incoming_for: lock(&self.runtime).incoming_for.clone(),
            ..self.spec.clone()
        }
    }

    /// Records a fresh status of the running frontend (from the supervisor's poll or an API
    /// read), and emits `connected` / `disconnected` when the VMM came or went since the last
    /// one. Ignored unless the frontend that answered is the one being supervised and running.
    pub fn record_status(&self, status: &FrontendStatus) {
        let (change, iothread_restarted) = {
            let mut rt = lock(&self.runtime);
            if rt.pid != status.pid || !serving(rt.state) {
                return;
            }
            let was = rt.status.as_ref().is_some_and(|s| s.vmm_connected);
            // Replacements since the last status of this same process (a new frontend counts
            // from zero, and its start has events of its own).
            let replaced = rt.status.as_ref().is_some_and(|s| {
                s.pid == status.pid && status.iothread_restarts > s.iothread_restarts
            });
            rt.state = state_of(Some(status));
            rt.reason.clear();
            rt.status = Some(status.clone());
            (
                (was != status.vmm_connected).then_some(rt.pid),
                replaced.then(|| status.last_iothread_exit.clone()),
            )
        };
        if let Some(how) = iothread_restarted {
            self.events.emit(
                EventKind::IothreadRestarted,
                &self.spec.id,
                status.pid,
                format!(
                    "replaced ({} replacement(s) so far); the old one: {how}",
                    status.iothread_restarts
                ),
            );
        }
        if let Some(pid) = change {
            let kind = if status.vmm_connected {
                EventKind::Connected
            } else {
                EventKind::Disconnected
            };
            self.events.emit(kind, &self.spec.id, pid, "");
        }
        self.refresh_migration();
    }

    /// Changes the runtime state (and publishes what that changes about migration).
    pub fn update(&self, f: impl FnOnce(&mut Runtime)) {
        f(&mut lock(&self.runtime));
        self.refresh_migration();
    }

    /// The disk's migration blockers now, dated; blockers that appeared or went away since
    /// the last call (or an operator blocker whose message changed) become events.
    pub fn refresh_migration(&self) -> Vec<pb::MigrationBlocker> {
        let rt = self.runtime();
        let now = blkplane_api::time::unix_time_ms();
        let current = migration::blockers(&rt, now);
        let mut events = Vec::new();
        let mut out = Vec::with_capacity(current.len());
        {
            let mut published = lock(&self.published);
            let present: BTreeSet<i32> = current.iter().map(|b| b.reason as i32).collect();
            published.retain(|reason, _| {
                let keep = present.contains(reason);
                if !keep {
                    let name = MigrationBlockerReason::try_from(*reason)
                        .map(reason_name)
                        .unwrap_or("unknown");
                    events.push((EventKind::BlockerRemoved, name.to_string()));
                }
                keep
            });
            for b in current {
                let automatic = b.is_automatic();
                let entry = published.entry(b.reason as i32);
                let since = match entry {
                    std::collections::btree_map::Entry::Occupied(mut e) => {
                        let p = e.get_mut();
                        // Automatic messages may say more as things go on (a restart's
                        // delay); only an operator's new words are news.
                        if !automatic && p.message != b.message {
                            events.push((EventKind::BlockerAdded, b.line()));
                        }
                        p.message = b.message.clone();
                        if let Some(since) = b.since_unix_ms {
                            p.since_unix_ms = since;
                        }
                        p.since_unix_ms
                    }
                    std::collections::btree_map::Entry::Vacant(e) => {
                        events.push((EventKind::BlockerAdded, b.line()));
                        let since = b.since_unix_ms.unwrap_or(now);
                        e.insert(Published {
                            message: b.message.clone(),
                            since_unix_ms: since,
                        });
                        since
                    }
                };
                out.push(pb::MigrationBlocker {
                    reason: b.reason as i32,
                    message: b.message,
                    automatic,
                    since_unix_ms: since,
                });
            }
        }
        for (kind, message) in events {
            self.events.emit(kind, &self.spec.id, rt.pid, message);
        }
        out
    }

    /// Sends the current blocker lines to the frontend if it does not have them yet (a new
    /// frontend, or a change). Failures are left to the next poll.
    pub async fn push_blockers(&self) {
        let mut pushed = self.pushed.lock().await;
        let rt = self.runtime();
        if rt.pid == 0 || !serving(rt.state) {
            return;
        }
        let lines: Vec<String> = migration::blockers(&rt, blkplane_api::time::unix_time_ms())
            .iter()
            .map(migration::Blocker::line)
            .collect();
        if pushed
            .as_ref()
            .is_some_and(|(pid, sent)| *pid == rt.pid && *sent == lines)
        {
            return;
        }
        match admin::set_migration_blockers(&self.paths.admin_socket, lines.clone()).await {
            Ok(()) => *pushed = Some((rt.pid, lines)),
            Err(e) => debug!("disk {}: sending migration blockers: {e}", self.spec.id),
        }
    }

    /// What the frontend is to be sent for the disk's current I/O limits and group.
    fn throttle_request(&self, rt: &Runtime) -> SetThrottle {
        throttle::frontend_request(&rt.lifecycle.throttle, &self.throttle_dir)
    }

    /// Sends the disk's current I/O limits to its frontend unless it has them (a new
    /// frontend, an adopted one, or a change). Ok when the frontend has them, or when none is
    /// running (a frontend started later gets them before it serves); the admin error when
    /// sending failed (the next poll tries again).
    pub async fn push_throttle(&self) -> Result<(), AdminError> {
        let _order = self.throttle_push.lock().await;
        let rt = self.runtime();
        if rt.pid == 0 || !serving(rt.state) {
            return Ok(());
        }
        let want = self.throttle_request(&rt);
        if lock(&self.throttle_pushed)
            .as_ref()
            .is_some_and(|(pid, had)| *pid == rt.pid && *had == want)
        {
            return Ok(());
        }
        admin::set_throttle(&self.paths.admin_socket, want.clone()).await?;
        *lock(&self.throttle_pushed) = Some((rt.pid, want));
        Ok(())
    }

    /// Whether the running frontend does not have the disk's current I/O limits (yet). False
    /// when no frontend runs.
    pub fn throttle_pending(&self) -> bool {
        let rt = self.runtime();
        if rt.pid == 0 || !serving(rt.state) {
            return false;
        }
        let want = self.throttle_request(&rt);
        lock(&self.throttle_pushed)
            .as_ref()
            .is_none_or(|(pid, had)| *pid != rt.pid || *had != want)
    }

    /// Stops supervision: the frontend (if any) is stopped and its files removed. Returns
    /// once everything is gone.
    pub async fn stop(&self) {
        self.update(|rt| rt.state = DiskState::Stopping);
        let _ = self.stop_tx.send(true);
        let task = lock(&self.task).take();
        if let Some(task) = task {
            if let Err(e) = task.await {
                warn!("disk {}: supervisor task ended badly: {e}", self.spec.id);
            }
        }
    }
}

/// Locks a mutex, ignoring poisoning (the data is plain state that stays consistent).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The disk state a running frontend's status implies.
fn state_of(status: Option<&FrontendStatus>) -> DiskState {
    match status {
        Some(s) if s.drained => DiskState::Drained,
        Some(s) if s.vmm_connected => DiskState::Connected,
        _ => DiskState::Ready,
    }
}

/// Grace between SIGTERM and SIGKILL when a disk is removed.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Waits until a stop is requested (or the handle is gone).
async fn stop_requested(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

/// The supervision loop of one disk.
async fn supervise(
    disk: Arc<DiskHandle>,
    settings: Arc<Settings>,
    events: EventBus,
    initial: Initial,
    mut stop_rx: watch::Receiver<bool>,
) {
    let id = disk.spec.id.clone();
    let policy = &settings.policy;
    let mut crashes: VecDeque<Instant> = VecDeque::new();
    let mut current: Option<Frontend> = None;
    // Why the next start is a restart (None: the start needs no event, it is AddDisk's).
    let mut restart_reason: Option<String> = None;
    match initial {
        Initial::Running(started) => current = Some(started.frontend),
        Initial::AdoptOrStart => match adopt(&disk.paths).await {
            Ok(fe) => {
                let status = admin::status(&disk.paths.admin_socket).await.ok();
                let pid = fe.pid();
                disk.update(|rt| {
                    rt.pid = pid;
                    rt.state = state_of(status.as_ref());
                    rt.status = status;
                });
                note_in_log(
                    &disk.paths,
                    &format!("frontend {pid} adopted by blkplaned {}", std::process::id()),
                );
                events.emit(EventKind::Adopted, &id, pid, "");
                current = Some(fe);
            }
            Err(e) => {
                info!("disk {id}: not adopting a frontend ({e}); starting one");
                // Whatever else still runs for this disk would hold its sockets.
                for pid in kill_strays(&disk.paths).await {
                    warn!("disk {id}: killed stray frontend {pid}");
                }
                restart_reason = Some(format!("no running frontend to adopt: {e}"));
            }
        },
    }

    loop {
        let fe = match current.take() {
            Some(fe) => fe,
            None => {
                disk.update(|rt| {
                    rt.state = DiskState::Starting;
                    rt.pid = 0;
                    rt.status = None;
                });
                // Not cancelled by a stop request: a start is bounded by start_timeout and
                // cleans up after itself, while a dropped half-start could leave a process.
                // A drained disk comes back drained: its frontend starts that way.
                // A throttled disk's frontend gets its limits before it serves.
                let rt = disk.runtime();
                let throttle = disk.throttle_request(&rt);
                let drained = rt.lifecycle.drained;
                match start_throttled(&settings, &disk.spec, &disk.paths, drained, &throttle).await
                {
                    Ok(Started {
                        frontend: fe,
                        status,
                        throttle,
                    }) => {
                        let pid = fe.pid();
                        *lock(&disk.throttle_pushed) = throttle.map(|t| (pid, t));
                        disk.update(|rt| {
                            rt.pid = pid;
                            rt.restarts += 1;
                            rt.state = state_of(Some(&status));
                            rt.reason.clear();
                            rt.status = Some(status);
                            rt.restarted_unix_ms = blkplane_api::time::unix_time_ms();
                        });
                        events.emit(
                            EventKind::Restarted,
                            &id,
                            pid,
                            restart_reason.take().unwrap_or_default(),
                        );
                        fe
                    }
                    Err(e) => {
                        let reason = format!("start failed: {e}");
                        warn!("disk {id}: {reason}");
                        if !crashed(&disk, &events, policy, &mut crashes, reason, &mut stop_rx)
                            .await
                        {
                            break;
                        }
                        restart_reason = Some("after a failed start".into());
                        continue;
                    }
                }
            }
        };

        // Running: watch for exit, stop requests and VMM connects/disconnects. A new frontend
        // learns its migration blockers at once, not at the first poll; so does an adopted
        // one its I/O limits (which it may have had from before, but blkplaned cannot tell:
        // the limits may have changed while it was down), or a new one whose start could not
        // give them.
        let pid = fe.pid();
        if let Err(e) = disk.push_throttle().await {
            let unthrottled =
                disk.throttle_request(&disk.runtime()) == throttle::unthrottled_request();
            if unthrottled {
                debug!("disk {id}: sending the I/O limits to frontend {pid}: {e}");
            } else {
                warn!("disk {id}: sending the I/O limits to frontend {pid}: {e}; trying again at every poll");
            }
        }
        disk.push_blockers().await;
        let reason = loop {
            tokio::select! {
                _ = stop_requested(&mut stop_rx) => {
                    let iothreads = disk.runtime().status.map(|s| s.iothread_pids).unwrap_or_default();
                    let how = fe.stop(STOP_GRACE).await;
                    info!("disk {id}: frontend {pid} stopped ({how})");
                    wait_iothreads_gone(&iothreads).await;
                    remove_files(&disk.paths);
                    return;
                }
                how = fe.wait() => break how,
                _ = tokio::time::sleep(settings.poll_interval) => {
                    poll(&disk).await;
                }
            }
        };
        let was_connected = disk
            .runtime()
            .status
            .is_some_and(|s| s.vmm_connected && s.pid == pid);
        note_in_log(&disk.paths, &format!("frontend {pid} {reason}"));
        events.emit(EventKind::Exited, &id, pid, format!("frontend {reason}"));
        if was_connected {
            events.emit(EventKind::Disconnected, &id, pid, "the frontend exited");
        }
        if !crashed(
            &disk,
            &events,
            policy,
            &mut crashes,
            format!("frontend {pid} {reason}"),
            &mut stop_rx,
        )
        .await
        {
            break;
        }
        restart_reason = Some(format!("frontend {pid} {reason}"));
    }
    // Stopped while not running (failed, or during back-off).
    remove_files(&disk.paths);
}

/// Records a crash. Returns true to restart (after the back-off delay, already waited), false
/// when the supervisor should end: a stop was requested, during back-off or after the disk
/// was marked failed.
async fn crashed(
    disk: &DiskHandle,
    events: &EventBus,
    policy: &RestartPolicy,
    crashes: &mut VecDeque<Instant>,
    reason: String,
    stop_rx: &mut watch::Receiver<bool>,
) -> bool {
    let now = Instant::now();
    crashes.push_back(now);
    while crashes
        .front()
        .is_some_and(|t| now.duration_since(*t) > policy.window)
    {
        crashes.pop_front();
    }
    let id = &disk.spec.id;
    if crashes.len() >= policy.max_crashes {
        let why = format!(
            "{} crashes within {:?}; the last: {reason}",
            crashes.len(),
            policy.window
        );
        disk.update(|rt| {
            rt.state = DiskState::Failed;
            rt.reason = why.clone();
            rt.pid = 0;
            rt.status = None;
        });
        events.emit(EventKind::Failed, id, 0, why);
        stop_requested(stop_rx).await;
        return false;
    }
    let delay = policy.backoff(crashes.len());
    disk.update(|rt| {
        rt.state = DiskState::Restarting;
        rt.reason = format!("{reason}; restarting in {delay:?}");
        rt.pid = 0;
        rt.status = None;
    });
    tokio::select! {
        _ = stop_requested(stop_rx) => false,
        _ = tokio::time::sleep(delay) => true,
    }
}

/// Reads the frontend's status; connects and disconnects become events. Then makes the
/// frontend follow the desired state: drained or not (after an adoption, or a Drain or
/// Resume that failed half-way), the current migration blockers, and the current I/O limits
/// (until a frontend that failed to take them has them).
async fn poll(disk: &DiskHandle) {
    match admin::status(&disk.paths.admin_socket).await {
        Ok(status) => {
            disk.record_status(&status);
            follow_drained(disk, &status).await;
            disk.push_blockers().await;
            if let Err(e) = disk.push_throttle().await {
                debug!("disk {}: sending the I/O limits: {e}", disk.spec.id);
            }
        }
        Err(e) => {
            debug!("disk {}: status: {e}", disk.spec.id);
            disk.update(|rt| rt.reason = format!("status unavailable: {e}"));
        }
    }
}

/// Drains or resumes the frontend when it is not as the disk's lifecycle wants it. Skipped
/// while a Drain or Resume call is under way (it does the same, and reports it).
async fn follow_drained(disk: &DiskHandle, status: &FrontendStatus) {
    let Ok(_op) = disk.lifecycle_op.try_lock() else {
        return;
    };
    let rt = disk.runtime();
    if rt.pid != status.pid || rt.lifecycle.drained == status.drained {
        return;
    }
    let id = &disk.spec.id;
    let socket = &disk.paths.admin_socket;
    let result = if rt.lifecycle.drained {
        warn!(
            "disk {id}: frontend {} is not drained as it should be; draining it",
            rt.pid
        );
        admin::drain(socket, false).await.map(|_| ())
    } else {
        warn!(
            "disk {id}: frontend {} is drained but should not be; resuming it",
            rt.pid
        );
        admin::resume(socket).await
    };
    match result {
        Ok(()) => {
            if let Ok(status) = admin::status(socket).await {
                disk.record_status(&status);
            }
        }
        Err(e) => warn!("disk {id}: {e}"),
    }
}

/// Appends a line from blkplaned to a disk's log, so that the log tells the whole story
/// (starts, adoptions, exits) next to what the frontend said.
pub fn note_in_log(paths: &DiskPaths, note: &str) {
    if let Ok(mut f) = OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(&paths.log_file)
    {
        let _ = writeln!(f, "--- blkplaned: {note}");
    }
}

/// Kills any frontend still serving disk `id`, which is not in the desired state, and removes
/// its files except those in `protected` (the files of the wanted disks). Used at startup for
/// leftovers of a crash between a start and the state write, or during a removal.
pub async fn sweep_orphan(disks_dir: &Path, id: &str, protected: &BTreeSet<PathBuf>) {
    let paths = DiskPaths::for_id(disks_dir, id, PathBuf::new());
    // Its vhost-user socket is only known from the frontend's command line, if it runs.
    let mut vhost = None;
    for pid in proc::find_processes_with_arg(&identity_arg(&paths)) {
        if let Some(argv) = proc::cmdline(pid) {
            vhost = argv
                .iter()
                .find_map(|a| a.to_str()?.strip_prefix("--socket=").map(PathBuf::from));
        }
    }
    for pid in kill_strays(&paths).await {
        warn!("killed orphan frontend {pid} of unknown disk {id}");
    }
    let mut files = vec![
        paths.admin_socket.clone(),
        paths.pid_file.clone(),
        pid_tmp(&paths.pid_file),
        paths.log_file.clone(),
    ];
    files.extend(vhost);
    for f in files {
        if !protected.contains(&f) {
            remove_file(&f);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Cache;

    fn spec() -> DiskSpec {
        DiskSpec {
            id: "d".into(),
            image: "/img/d.img".into(),
            read_only: true,
            serial: "-S".into(),
            num_queues: 4,
            queue_size: 128,
            block_size: 4096,
            iothreads: 2,
            cache: Cache::Writeback,
            iothread_cpus: "0-1".into(),
            vhost_socket: "/run/d.sock".into(),
            incoming_for: None,
            run_as: None,
            poll_max_us: None,
        }
    }

    #[test]
    fn command_line() {
        let paths = DiskPaths::new(Path::new("/run/bp/disks"), &spec());
        let args: Vec<String> = frontend_args(&spec(), &paths, false, None)
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect();
        assert_eq!(
            args,
            [
                "--socket=/run/d.sock",
                "--admin-socket=/run/bp/disks/d.admin",
                "--image=/img/d.img",
                "--serial=-S",
                "--num-queues=4",
                "--queue-size=128",
                "--iothreads=2",
                "--block-size=4096",
                "--cache=writeback",
                "--iothread-cpus=0-1",
                "--read-only",
            ]
        );
        assert_eq!(identity_arg(&paths), "--admin-socket=/run/bp/disks/d.admin");
        // The polling bound only when configured (0 included: it disables polling).
        for (us, arg) in [(0, "--poll-max-us=0"), (50, "--poll-max-us=50")] {
            let polling = DiskSpec {
                poll_max_us: Some(us),
                ..spec()
            };
            assert!(frontend_args(&polling, &paths, false, None)
                .iter()
                .any(|a| a == arg));
        }
        let drained = frontend_args(&spec(), &paths, true, None);
        assert_eq!(drained.last().unwrap(), "--drained");
        // The disk's own user, else blkplaned's --disk-user.
        let own = RunAsSpec {
            uid: 107,
            gid: 108,
            groups: vec![36, 995],
        };
        let node = RunAsSpec {
            uid: 64055,
            gid: 64055,
            groups: vec![],
        };
        let mut settings = Settings {
            frontend_binary: PathBuf::from("/bin/false"),
            disks_dir: PathBuf::from("/run/bp/disks"),
            policy: RestartPolicy::default(),
            start_timeout: Duration::from_secs(1),
            poll_interval: Duration::from_secs(1),
            throttle_dir: PathBuf::from("/run/bp/throttle"),
            disk_user: None,
            can_run_as: true,
        };
        let mut other_user = spec();
        assert_eq!(settings.user_of(&other_user), None);
        settings.disk_user = Some(node.clone());
        assert_eq!(settings.user_of(&other_user), Some(&node));
        other_user.run_as = Some(own.clone());
        assert_eq!(settings.user_of(&other_user), Some(&own));
        let args = frontend_args(&other_user, &paths, false, settings.user_of(&other_user));
        assert!(
            args.iter().any(|a| a == "--run-as=107:108:36,995"),
            "{args:?}"
        );
    }

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

    #[test]
    fn pid_files() {
        let dir = std::env::temp_dir().join(format!("bpsv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("x.pid");
        write_pid_file(&f, 1234).unwrap();
        assert_eq!(read_pid_file(&f), Some(1234));
        std::fs::write(&f, "garbage").unwrap();
        assert_eq!(read_pid_file(&f), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn log_tail_skips_our_notes() {
        let dir = std::env::temp_dir().join(format!("bplt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("x.log");
        let mut text = String::from("--- blkplaned: starting\n");
        for i in 0..20 {
            text.push_str(&format!("line {i}\n"));
        }
        std::fs::write(&f, text).unwrap();
        let tail = log_tail(&f);
        assert!(
            tail.starts_with("line 10\n") && tail.ends_with("line 19"),
            "{tail}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A fake frontend (a shell script) that exits at once: start() reports it with the log.
    #[tokio::test]
    async fn start_reports_an_early_exit() {
        let dir = std::env::temp_dir().join(format!("bpst-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = dir.join("fake-frontend");
        std::fs::write(&script, "#!/bin/sh\necho 'cannot open image' >&2\nexit 3\n").unwrap();
        std::os::unix::fs::PermissionsExt::set_mode(
            &mut std::fs::metadata(&script).unwrap().permissions(),
            0o755,
        );
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let settings = Settings {
            frontend_binary: script,
            disks_dir: dir.clone(),
            policy: RestartPolicy::default(),
            start_timeout: Duration::from_secs(10),
            poll_interval: Duration::from_millis(100),
            throttle_dir: dir.clone(),
            disk_user: None,
            can_run_as: false,
        };
        let mut s = spec();
        s.vhost_socket = dir.join("d.sock");
        let paths = DiskPaths::new(&dir, &s);
        let err = start(&settings, &s, &paths, false).await.unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("exited with status 3"), "{msg}");
        assert!(msg.contains("cannot open image"), "{msg}");
        assert!(!paths.pid_file.exists());
        assert!(!paths.admin_socket.exists());

        // A disk of another user under a blkplaned that cannot start one: nothing is run
        // (the script would say "cannot open image"), and the error says why.
        s.run_as = Some(RunAsSpec {
            uid: 107,
            gid: 107,
            groups: vec![],
        });
        let err = start(&settings, &s, &paths, false).await.unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, StartError::RunAs { uid: 107 }), "{msg}");
        assert!(msg.contains("CAP_KILL"), "{msg}");
        assert!(!std::fs::read_to_string(&paths.log_file)
            .unwrap_or_default()
            .contains("run-as"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
