//! A disk's frontend process as blkplaned runs it: its command line, starting it and waiting
//! until it serves, adopting one that survived a blkplaned restart, killing strays and
//! sweeping an orphan's files, its pid file and its log (with the log's rotated copies).

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use blkplane_proto::v1::{FrontendStatus, SetThrottle};
use log::{debug, info, warn};
use thiserror::Error;
use tokio::io::unix::AsyncFd;

use crate::admin::{self};
use crate::disk_log;
use crate::paths::{pid_tmp, DiskPaths};
use crate::state::{DiskSpec, MigrationStorage, RemoteSource, RunAsSpec};
use crate::throttle;
use blkplane_procfs as proc;

use crate::settings::Settings;

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
/// `drained`, as `user` if given, with a qcow2 image's backing files held to `image_dirs`
/// (blkplaned's `--image-dir`). Options use the `--opt=value` form so that a value starting with '-' (a serial,
/// say) is never taken for an option.
pub fn frontend_args(
    spec: &DiskSpec,
    paths: &DiskPaths,
    drained: bool,
    user: Option<&RunAsSpec>,
    image_dirs: &[PathBuf],
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
    if let Some(format) = spec.format {
        opt("format", &format.as_arg());
    }
    for dir in image_dirs {
        opt("image-dir", dir);
    }
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
    // A destination of a copy from another node serves nothing before its image is complete.
    let incomplete = RemoteSource::awaits_image(spec.incoming_from.as_ref());
    if drained || incomplete {
        args.push("--drained".into());
    }
    // A destination on storage another node wrote last: its page cache of the image may be
    // stale until the rings start.
    if spec
        .incoming_from
        .as_ref()
        .is_some_and(|from| from.storage == MigrationStorage::Shared)
    {
        args.push("--incoming-shared".into());
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

/// Removes the files a stopped frontend leaves: its sockets, pid file, log and the log's
/// rotated copies. The vhost-user socket is only removed if it still is a socket.
pub fn remove_files(paths: &DiskPaths) {
    if std::fs::symlink_metadata(&paths.vhost_socket).is_ok_and(|m| m.file_type().is_socket()) {
        remove_file(&paths.vhost_socket);
    }
    remove_file(&paths.admin_socket);
    remove_file(&paths.pid_file);
    remove_file(&pid_tmp(&paths.pid_file));
    remove_file(&paths.log_file);
    for (_, copy) in disk_log::rotated(&paths.log_file) {
        remove_file(&copy);
    }
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
    let args = frontend_args(spec, paths, drained, user, &settings.image_dirs);
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
pub async fn wait_iothreads_gone(pids: &[u32]) {
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
    files.extend(
        disk_log::rotated(&paths.log_file)
            .into_iter()
            .map(|(_, p)| p),
    );
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
    use crate::settings::RestartPolicy;
    use crate::state::{Cache, RemoteSource};

    fn spec() -> DiskSpec {
        DiskSpec {
            id: "d".into(),
            image: "/img/d.img".into(),
            format: Some(crate::state::Format::Qcow2),
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
            incoming_from: None,
            run_as: None,
            poll_max_us: None,
        }
    }

    #[test]
    fn command_line() {
        let paths = DiskPaths::new(Path::new("/run/bp/disks"), &spec());
        let dirs = [PathBuf::from("/srv/images"), PathBuf::from("/mnt/golden")];
        let args: Vec<String> = frontend_args(&spec(), &paths, false, None, &dirs)
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect();
        assert_eq!(
            args,
            [
                "--socket=/run/d.sock",
                "--admin-socket=/run/bp/disks/d.admin",
                "--image=/img/d.img",
                "--format=qcow2",
                "--image-dir=/srv/images",
                "--image-dir=/mnt/golden",
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
        // A disk kept from before the format was: the frontend probes, as it did then.
        let probed = DiskSpec {
            format: None,
            ..spec()
        };
        assert!(!frontend_args(&probed, &paths, false, None, &[])
            .iter()
            .any(|a| a.to_string_lossy().starts_with("--format")));
        // The polling bound only when configured (0 included: it disables polling).
        for (us, arg) in [(0, "--poll-max-us=0"), (50, "--poll-max-us=50")] {
            let polling = DiskSpec {
                poll_max_us: Some(us),
                ..spec()
            };
            assert!(frontend_args(&polling, &paths, false, None, &[])
                .iter()
                .any(|a| a == arg));
        }
        let drained = frontend_args(&spec(), &paths, true, None, &[]);
        assert_eq!(drained.last().unwrap(), "--drained");
        // An incoming disk on shared storage drops its stale page cache; nothing else does.
        let incoming = DiskSpec {
            incoming_from: Some(RemoteSource {
                endpoint: "node-a:7070".into(),
                disk: "a".into(),
                storage: MigrationStorage::Shared,
                as_node: "node-b".into(),
                image_incomplete: false,
            }),
            ..spec()
        };
        assert_eq!(
            frontend_args(&incoming, &paths, false, None, &[])
                .last()
                .unwrap(),
            "--incoming-shared"
        );
        assert!(!drained.iter().any(|a| a == "--incoming-shared"));
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
            disk_log: crate::disk_log::DiskLogLimit::default(),
            can_run_as: true,
            image_dirs: Vec::new(),
        };
        let mut other_user = spec();
        assert_eq!(settings.user_of(&other_user), None);
        settings.disk_user = Some(node.clone());
        assert_eq!(settings.user_of(&other_user), Some(&node));
        other_user.run_as = Some(own.clone());
        assert_eq!(settings.user_of(&other_user), Some(&own));
        let args = frontend_args(
            &other_user,
            &paths,
            false,
            settings.user_of(&other_user),
            &settings.image_dirs,
        );
        assert!(
            args.iter().any(|a| a == "--run-as=107:108:36,995"),
            "{args:?}"
        );
    }

    #[test]
    fn pid_files() {
        let scratch = blkplane_tests::TempDir::new("bpsv");
        let dir = scratch.path().to_path_buf();
        let f = dir.join("x.pid");
        write_pid_file(&f, 1234).unwrap();
        assert_eq!(read_pid_file(&f), Some(1234));
        std::fs::write(&f, "garbage").unwrap();
        assert_eq!(read_pid_file(&f), None);
    }

    #[test]
    fn log_tail_skips_our_notes() {
        let scratch = blkplane_tests::TempDir::new("bplt");
        let dir = scratch.path().to_path_buf();
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
    }

    /// A fake frontend (a shell script) that exits at once: start() reports it with the log.
    #[tokio::test]
    async fn start_reports_an_early_exit() {
        let scratch = blkplane_tests::TempDir::new("bpst");
        let dir = scratch.path().to_path_buf();
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
            disk_log: crate::disk_log::DiskLogLimit::default(),
            can_run_as: false,
            image_dirs: Vec::new(),
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
    }
}
