//! Running one `blkplane-frontend` process, and looking at it (and its iothreads) in /proc.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::{binaries, TempDir};

/// How long a frontend may take to start listening.
pub const START_TIMEOUT: Duration = Duration::from_secs(10);

/// The iothread command name as the kernel reports it (`comm` is cut to 15 bytes).
const IOTHREAD_COMM: &str = "blkplane-iothre";

/// A running `blkplane-frontend`, killed (with its iothreads) and reaped on drop.
///
/// Its socket and a file with its stderr live in a private temp dir. The stderr is printed on
/// drop when the test is failing (libtest shows it with the failure) or when the frontend exited
/// on its own, so a failing test always shows what the frontend said.
pub struct Frontend {
    child: Child,
    socket: PathBuf,
    stderr_path: PathBuf,
    args: Vec<String>,
    dir: TempDir,
}

impl Frontend {
    /// Starts a frontend serving `image` with extra command-line `args` (e.g.
    /// `["--num-queues", "2"]`) and waits until its socket accepts connections; panics (with
    /// the frontend's stderr) if it exits or does not listen within [`START_TIMEOUT`].
    pub fn start(image: &Path, args: &[&str]) -> Frontend {
        Self::try_start(image, args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Like [`Frontend::start`], but reports failure to start as an error string.
    pub fn try_start(image: &Path, args: &[&str]) -> Result<Frontend, String> {
        let dir = TempDir::new("fe");
        let socket = dir.join("vhost.sock");
        let stderr_path = dir.join("stderr.log");
        let stderr = File::create(&stderr_path).unwrap();
        let mut all_args: Vec<String> = vec![
            "--socket".into(),
            socket.to_str().unwrap().into(),
            "--image".into(),
            image.to_str().unwrap().into(),
        ];
        all_args.extend(args.iter().map(|s| s.to_string()));
        let child = spawn(&all_args, stderr)?;
        let mut fe = Frontend {
            child,
            socket,
            stderr_path,
            args: all_args,
            dir,
        };
        fe.wait_listening()?;
        Ok(fe)
    }

    /// Kills the frontend with SIGKILL — its iothreads die with it (PR_SET_PDEATHSIG) — and
    /// starts it again with the same arguments on the same socket, as blkplaned's supervision
    /// would; the new process's stderr is appended to the same log, after a line saying so.
    /// Waits until the new process listens. Returns the old pid.
    pub fn kill9_and_restart(&mut self) -> Result<u32, String> {
        let old = self.pid();
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut log = OpenOptions::new()
            .append(true)
            .open(&self.stderr_path)
            .map_err(|e| format!("{}: {e}", self.stderr_path.display()))?;
        let _ = writeln!(
            log,
            "---- test: frontend {old} killed with SIGKILL; starting it again ----"
        );
        self.child = spawn(&self.args, log)?;
        self.wait_listening()?;
        Ok(old)
    }

    fn wait_listening(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Err(format!(
                    "frontend {:?} exited during startup with {status}; stderr:\n{}",
                    self.args,
                    self.stderr()
                ));
            }
            if blkplane_procfs::is_listening(&self.socket) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "frontend {:?} did not listen on {} within {START_TIMEOUT:?}; stderr:\n{}",
                    self.args,
                    self.socket.display(),
                    self.stderr()
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The vhost-user socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A scratch directory that lives as long as the frontend.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Everything the frontend wrote to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read(&self.stderr_path)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_else(|e| format!("(cannot read stderr: {e})"))
    }

    /// The exit status if the frontend is no longer running.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().unwrap()
    }

    /// Panics (showing stderr) if the frontend is not running any more: the check after each
    /// piece of bad input that it must survive.
    #[track_caller]
    pub fn assert_running(&mut self, after: &str) {
        if let Some(status) = self.exit_status() {
            panic!(
                "frontend died after {after}: {status}; stderr:\n{}",
                self.stderr()
            );
        }
    }

    /// The live (non-zombie) iothread processes of this frontend.
    pub fn iothread_pids(&self) -> Vec<u32> {
        iothread_pids(self.pid())
    }

    /// Waits until exactly `n` live iothreads exist that are not in `exclude`, and returns them.
    pub fn wait_iothreads(&self, n: usize, exclude: &[u32], timeout: Duration) -> Vec<u32> {
        crate::wait_for(timeout, || {
            let pids: Vec<u32> = self
                .iothread_pids()
                .into_iter()
                .filter(|p| !exclude.contains(p))
                .collect();
            (pids.len() == n).then_some(pids)
        })
        .unwrap_or_else(|| {
            panic!(
                "expected {n} iothreads (excluding {exclude:?}) of frontend {} within {timeout:?}, \
                 have {:?}; stderr:\n{}",
                self.pid(),
                self.iothread_pids(),
                self.stderr()
            )
        })
    }

    /// The number of open file descriptors of the frontend process.
    pub fn fd_count(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// What the frontend's fds point to, for leak diagnostics.
    pub fn fd_targets(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| {
                        let target = std::fs::read_link(e.path())
                            .map(|t| t.display().to_string())
                            .unwrap_or_default();
                        format!("{} -> {target}", e.file_name().to_string_lossy())
                    })
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// Asserts the frontend is still running, then stops it (the normal end of a test).
    #[track_caller]
    pub fn finish(mut self) {
        self.assert_running("the test");
    }
}

impl Drop for Frontend {
    fn drop(&mut self) {
        let pid = self.pid() as libc::pid_t;
        let exited = self.child.try_wait().ok().flatten();
        if exited.is_none() {
            // Freeze it first so it cannot respawn iothreads while we kill them; then its
            // children (all started on our behalf) and finally the frontend itself.
            // SAFETY: plain syscalls on a pid we spawned and have not reaped yet.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
            for child in descendants_of(pid as u32) {
                // SAFETY: as above; the process descends from our (stopped) child.
                unsafe { libc::kill(child as libc::pid_t, libc::SIGKILL) };
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() || exited.is_some() {
            let stderr = self.stderr();
            let tail = if stderr.len() > 64 * 1024 {
                &stderr[stderr.len() - 64 * 1024..]
            } else {
                &stderr[..]
            };
            eprintln!(
                "---- blkplane-frontend {:?} (pid {pid}, {}) stderr ----\n{tail}\n---- end of \
                 frontend stderr ----",
                self.args,
                match exited {
                    Some(s) => format!("exited by itself: {s}"),
                    None => "killed by the test".into(),
                }
            );
        }
    }
}

/// Starts `blkplane-frontend` with `args`, stderr into `stderr`.
fn spawn(args: &[String], stderr: File) -> Result<Child, String> {
    let bins = binaries();
    let mut cmd = Command::new(&bins.frontend);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .env("RUST_BACKTRACE", "1");
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", "info");
    }
    cmd.spawn()
        .map_err(|e| format!("spawning {}: {e}", bins.frontend.display()))
}

/// The children of `pid` as (pid, comm, state), from /proc/*/stat (works without
/// CONFIG_PROC_CHILDREN).
pub fn children_of(pid: u32) -> Vec<(u32, String, char)> {
    let mut out = Vec::new();
    for child in blkplane_procfs::pids() {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        if let Some((comm, state, ppid)) = parse_stat(&stat) {
            if ppid == pid {
                out.push((child, comm, state));
            }
        }
    }
    out.sort();
    out
}

/// (comm, state, ppid) from the text of /proc/<pid>/stat. The comm may contain spaces and
/// parentheses, hence the search for the last ')'.
fn parse_stat(stat: &str) -> Option<(String, char, u32)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat[open + 1..close].to_string();
    let mut rest = stat[close + 1..].split_whitespace();
    let state = rest.next()?.chars().next()?;
    let ppid = rest.next()?.parse().ok()?;
    Some((comm, state, ppid))
}

/// The spawner's `comm` (frontend/src/spawner.rs): the frontend's child that starts its
/// iothreads.
pub const SPAWNER_COMM: &str = "blkplane-spawn";

/// The live (not zombie, not dead) `blkplane-iothread` processes of frontend `pid`: the
/// children of its spawner.
pub fn iothread_pids(pid: u32) -> Vec<u32> {
    children_of(pid)
        .into_iter()
        .filter(|(_, comm, _)| comm == SPAWNER_COMM)
        .flat_map(|(spawner, _, _)| children_of(spawner))
        .filter(|(_, comm, state)| comm == IOTHREAD_COMM && !matches!(state, 'Z' | 'X' | 'x'))
        .map(|(p, _, _)| p)
        .collect()
}

/// Every descendant of `pid` (children first, then theirs).
pub fn descendants_of(pid: u32) -> Vec<u32> {
    let mut found: Vec<u32> = Vec::new();
    let mut next = 0;
    let mut parents = vec![pid];
    while let Some(&parent) = parents.get(next) {
        for (child, _, _) in children_of(parent) {
            found.push(child);
            parents.push(child);
        }
        next += 1;
    }
    found
}

/// Sends SIGKILL to `iothread` if it still is an iothread child of `frontend` (so a recycled
/// pid is never hit). Returns whether the signal was sent.
pub fn kill_iothread(frontend: u32, iothread: u32) -> bool {
    if !iothread_pids(frontend).contains(&iothread) {
        return false;
    }
    // SAFETY: plain syscall; the pid was verified to be our descendant just above.
    unsafe { libc::kill(iothread as libc::pid_t, libc::SIGKILL) == 0 }
}
