//! The iothread spawner: a small process forked from the frontend at start-up, before the
//! frontend locks itself down, that starts `blkplane-iothread` processes on request.
//!
//! Why a separate process: the frontend restarts an iothread that died, which means `fork`
//! and `execve`, and an `execve`d binary must be allowed to open and map its libraries. A
//! frontend allowed all that could start any program and open any file; instead the frontend's
//! filter has neither, and the spawner, whose filter has them, does one thing: on a request
//! over its socket it starts the iothread binary with the control socket it was sent at
//! descriptor 3 and answers with a pidfd. A compromised frontend can make it start iothreads,
//! nothing else. The spawner also reaps the iothreads and logs how each one ended (an
//! iothread killed by its seccomp filter shows as `SIGSYS`).
//!
//! Lifetimes: the spawner dies with the frontend (`PR_SET_PDEATHSIG`, checked against a race
//! with the frontend's exit), and each iothread with the spawner, as before with the frontend
//! itself. It keeps the frontend's socket lock (see socket_lock.rs) open and lets iothreads
//! inherit it.
//!
//! Messages (`SOCK_SEQPACKET`): a request is [`REQUEST_LEN`] bytes — the iothread's index
//! (u32 LE), a CPU-set flag (u8), three bytes of padding, and a `cpu_set_t` — with the
//! control socket attached; the answer is the errno (i32 LE, 0 on success), the pid (u32
//! LE), and the pid (u32 LE) and raw wait status (i32 LE) of the previous iothread of that
//! index if it ended since the last request for it (status -1 if not), with the pidfd
//! attached on success. The
//! frontend kills and waits for a dead iothread's process before it asks for a new one, and
//! the spawner reaps before it answers, so that status is known by then.

use std::ffi::{CString, OsString};
use std::fs::File;
use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStringExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Mutex;

use log::{error, info};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// The descriptor number the iothread finds its control socket at (its `--control-fd`).
pub const CHILD_CONTROL_FD: RawFd = 3;

const CPU_SET_LEN: usize = size_of::<libc::cpu_set_t>();
/// Length of a spawn request.
const REQUEST_LEN: usize = 8 + CPU_SET_LEN;
/// Length of an answer.
const REPLY_LEN: usize = 16;
/// "No previous iothread ended" in an answer (no wait status is negative).
const NO_STATUS: i32 = -1;

/// Why an iothread could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SpawnerError {
    /// The spawner could not be started.
    #[error("starting the iothread spawner: {0}")]
    Start(io::Error),
    /// Talking to the spawner failed (it died?).
    #[error("iothread spawner: {0}")]
    Channel(io::Error),
    /// The spawner could not start the iothread.
    #[error("iothread spawner: cannot start {binary}: {source}")]
    Spawn {
        /// The iothread binary.
        binary: String,
        /// What fork or exec said.
        source: io::Error,
    },
    /// The spawner's answer is not one.
    #[error("iothread spawner: malformed answer")]
    Malformed,
}

/// A started iothread, as the frontend knows it.
#[derive(Debug)]
pub struct SpawnedIothread {
    /// Its pid (for logs and tests; signals go through the pidfd).
    pub pid: u32,
    /// Its pidfd: readable once the process has exited.
    pub pidfd: OwnedFd,
    /// How the previous iothread of the same index ended, if one did since the last start.
    pub previous: Option<ExitStatus>,
}

/// How an iothread process ended (from its wait status, which only the spawner can read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitStatus {
    /// Its pid.
    pub pid: u32,
    /// The raw wait status.
    pub status: i32,
}

impl ExitStatus {
    /// Whether the process died of a fault of its own: a crash signal (a stack overflow or a
    /// panic aborts, a forbidden system call is SIGSYS) — not a kill from outside (SIGKILL,
    /// SIGTERM, ...), and not an exit, which may be the environment's doing (a failed exec,
    /// no memory at set-up).
    pub fn is_own_fault(&self) -> bool {
        libc::WIFSIGNALED(self.status)
            && matches!(
                libc::WTERMSIG(self.status),
                libc::SIGSEGV
                    | libc::SIGBUS
                    | libc::SIGILL
                    | libc::SIGFPE
                    | libc::SIGABRT
                    | libc::SIGSYS
                    | libc::SIGTRAP
            )
    }
}

impl std::fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pid = self.pid;
        if libc::WIFSIGNALED(self.status) {
            match libc::WTERMSIG(self.status) {
                libc::SIGSYS => write!(
                    f,
                    "pid {pid} killed by signal {} (SIGSYS: a system call its seccomp filter \
                     forbids; the kernel's audit log names it)",
                    libc::SIGSYS
                ),
                libc::SIGKILL => {
                    write!(f, "pid {pid} killed by signal {} (SIGKILL)", libc::SIGKILL)
                }
                signal => write!(f, "pid {pid} killed by signal {signal}"),
            }
        } else {
            write!(
                f,
                "pid {pid} exited with status {}",
                libc::WEXITSTATUS(self.status)
            )
        }
    }
}

/// The frontend's end of the spawner.
#[derive(Debug)]
pub struct Spawner {
    /// One request at a time: requests and answers carry no id.
    socket: Mutex<UnixStream>,
    binary: String,
}

impl Spawner {
    /// Forks the spawner, which execs `binary` for every request. Must be called while the
    /// frontend has a single thread (the child runs Rust code after the fork). `keep` are
    /// descriptors the spawner and every iothread keep open (the socket lock); everything
    /// else the frontend has open is closed in the spawner. With `run_as`, the spawner switches
    /// to that user before it serves (needs CAP_SETUID and CAP_SETGID), so every iothread
    /// starts as it.
    pub fn start(
        binary: &Path,
        keep: &[RawFd],
        run_as: Option<&blkplane_sandbox::RunAs>,
    ) -> Result<Self, SpawnerError> {
        let program = CString::new(OsString::from(binary).into_vec())
            .map_err(|e| SpawnerError::Start(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
        let argv = Argv::new(&program).map_err(SpawnerError::Start)?;
        let (ours, theirs) = blkplane_proto::control::socket_pair().map_err(SpawnerError::Start)?;
        // SAFETY: the frontend is single-threaded here (the caller's contract), so the child
        // may run any code; it never returns from `serve`.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(SpawnerError::Start(io::Error::last_os_error()));
        }
        if pid == 0 {
            drop(ours);
            let parent = std::os::unix::process::parent_id();
            let code = match prepare(parent, theirs.as_raw_fd(), keep, run_as) {
                Ok(()) => serve(&theirs, &argv),
                Err(e) => {
                    error!("iothread spawner: {e}");
                    1
                }
            };
            // SAFETY: _exit ends this forked child without running the frontend's exit
            // handlers or destructors.
            unsafe { libc::_exit(code) };
        }
        drop(theirs);
        info!("iothread spawner running as pid {pid}");
        Ok(Self {
            socket: Mutex::new(ours),
            binary: binary.display().to_string(),
        })
    }

    /// Starts iothread `index` with `control` as its control socket, on `cpus` if given.
    pub fn spawn(
        &self,
        index: u32,
        control: RawFd,
        cpus: Option<&libc::cpu_set_t>,
    ) -> Result<SpawnedIothread, SpawnerError> {
        let mut request = [0u8; REQUEST_LEN];
        request[..4].copy_from_slice(&index.to_le_bytes());
        if let Some(set) = cpus {
            request[4] = 1;
            // SAFETY: cpu_set_t is plain bytes; we read exactly its size.
            let bytes: &[u8; CPU_SET_LEN] = unsafe { &*(set as *const libc::cpu_set_t).cast() };
            request[8..].copy_from_slice(bytes);
        }
        let socket = blkplane_lock::lock(&self.socket);
        socket
            .send_with_fds(&[&request[..]], &[control])
            .map_err(|e| SpawnerError::Channel(io::Error::from_raw_os_error(e.errno())))?;
        let mut reply = [0u8; REPLY_LEN];
        let (len, file) = socket
            .recv_with_fd(&mut reply)
            .map_err(|e| SpawnerError::Channel(io::Error::from_raw_os_error(e.errno())))?;
        drop(socket);
        if len == 0 {
            return Err(SpawnerError::Channel(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the spawner exited",
            )));
        }
        let (errno, pid, previous) = decode_reply(reply.get(..len).unwrap_or_default())?;
        match (errno, file) {
            (0, Some(file)) => Ok(SpawnedIothread {
                pid,
                pidfd: OwnedFd::from(file),
                previous,
            }),
            (0, None) => Err(SpawnerError::Malformed),
            (errno, _) => Err(SpawnerError::Spawn {
                binary: self.binary.clone(),
                source: io::Error::from_raw_os_error(errno),
            }),
        }
    }
}

fn decode_reply(bytes: &[u8]) -> Result<(i32, u32, Option<ExitStatus>), SpawnerError> {
    let bytes: &[u8; REPLY_LEN] = bytes.try_into().map_err(|_| SpawnerError::Malformed)?;
    let word = |i: usize| -> [u8; 4] {
        bytes
            .chunks_exact(4)
            .nth(i)
            .and_then(|w| w.try_into().ok())
            .unwrap_or_default()
    };
    let status = i32::from_le_bytes(word(3));
    let previous = (status != NO_STATUS).then(|| ExitStatus {
        pid: u32::from_le_bytes(word(2)),
        status,
    });
    Ok((
        i32::from_le_bytes(word(0)),
        u32::from_le_bytes(word(1)),
        previous,
    ))
}

fn encode_reply(errno: i32, pid: u32, previous: Option<ExitStatus>) -> [u8; REPLY_LEN] {
    let mut reply = [0u8; REPLY_LEN];
    let (previous_pid, status) = previous.map_or((0, NO_STATUS), |p| (p.pid, p.status));
    reply[..4].copy_from_slice(&errno.to_le_bytes());
    reply[4..8].copy_from_slice(&pid.to_le_bytes());
    reply[8..12].copy_from_slice(&previous_pid.to_le_bytes());
    reply[12..].copy_from_slice(&status.to_le_bytes());
    reply
}

/// The exec arguments, built before forking (the spawner allocates nothing between fork and
/// exec).
struct Argv {
    program: CString,
    control_flag: CString,
    control_fd: CString,
}

impl Argv {
    fn new(program: &CString) -> io::Result<Self> {
        let invalid = |e| io::Error::new(io::ErrorKind::InvalidInput, e);
        Ok(Self {
            program: program.clone(),
            control_flag: CString::new("--control-fd").map_err(invalid)?,
            control_fd: CString::new(CHILD_CONTROL_FD.to_string()).map_err(invalid)?,
        })
    }
}

/// The spawner's set-up: die with the frontend, close what it does not need, watch for its
/// children's exits, lock down.
fn prepare(
    parent: u32,
    socket: RawFd,
    keep: &[RawFd],
    run_as: Option<&blkplane_sandbox::RunAs>,
) -> io::Result<()> {
    // Its own name in ps and /proc/PID/comm (the command line stays the frontend's).
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"blkplane-spawn".as_ptr()) };
    // Before the death signal is armed: a change of credentials clears it.
    if let Some(run_as) = run_as {
        blkplane_sandbox::switch_identity(run_as).map_err(io::Error::other)?;
    }
    // SAFETY: PR_SET_PDEATHSIG takes a signal number.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // The frontend may have died before the death signal was armed.
    if std::os::unix::process::parent_id() != parent {
        return Err(io::Error::other("the frontend exited"));
    }
    let mut keep: Vec<RawFd> = keep.iter().copied().chain([socket]).collect();
    keep.sort_unstable();
    close_all_but(&keep)?;
    block_sigchld()?;
    blkplane_sandbox::lock_down(
        blkplane_sandbox::Profile::Spawner,
        blkplane_sandbox::Enforcement::from_env(),
    )
    .map_err(io::Error::other)
}

/// Closes every descriptor from 3 up except those in `keep` (sorted).
fn close_all_but(keep: &[RawFd]) -> io::Result<()> {
    let mut first: libc::c_uint = 3;
    for &fd in keep {
        let Ok(fd) = libc::c_uint::try_from(fd) else {
            continue;
        };
        if fd > first {
            close_range(first, fd.saturating_sub(1))?;
        }
        first = first.max(fd.saturating_add(1));
    }
    close_range(first, libc::c_uint::MAX)
}

fn close_range(first: libc::c_uint, last: libc::c_uint) -> io::Result<()> {
    // SAFETY: close_range only closes descriptors; none of them is owned by Rust code that
    // will run in this process (the spawner wraps only `keep`).
    if unsafe { libc::syscall(libc::SYS_close_range, first, last, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Makes SIGCHLD interrupt the spawner's `ppoll` and only that: a no-op handler (an ignored
/// signal would not interrupt it), and the signal blocked everywhere else, so that a child
/// exiting between a reap and the next wait still interrupts that wait (see
/// [`wait_for_request`]).
fn block_sigchld() -> io::Result<()> {
    extern "C" fn child_exited(_: libc::c_int) {}
    // SAFETY: sigset operations on local sets; sigaction and sigprocmask on this single
    // thread; the handler does nothing.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = child_exited as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(libc::SIGCHLD, &action, std::ptr::null_mut()) < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        if libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The spawner's loop: wait for a request or a child's exit, until the frontend closes the
/// socket. Returns the exit code.
fn serve(socket: &UnixStream, argv: &Argv) -> i32 {
    let mut children = Children::default();
    loop {
        children.reap();
        match wait_for_request(socket) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => {
                error!("iothread spawner: {e}");
                return 1;
            }
        }
        let mut request = [0u8; REQUEST_LEN];
        let (len, control) = match socket.recv_with_fd(&mut request) {
            Ok((0, _)) => return 0,
            Ok(received) => received,
            Err(e) if e.errno() == libc::EINTR => continue,
            Err(e) => {
                error!("iothread spawner: receiving: {e}");
                return 1;
            }
        };
        let index = u32::from_le_bytes([request[0], request[1], request[2], request[3]]);
        let reply = match (len, control) {
            (REQUEST_LEN, Some(control)) => spawn_one(&request, &control, argv),
            _ => Err(io::Error::from_raw_os_error(libc::EPROTO)),
        };
        let (errno, pid, pidfd) = match reply {
            Ok((pid, pidfd)) => {
                children.started(pid, index);
                (0, pid, Some(pidfd))
            }
            Err(e) => (e.raw_os_error().unwrap_or(libc::EIO), 0, None),
        };
        // The predecessor the frontend replaces has exited (the frontend waited for its
        // pidfd), but its SIGCHLD may not have woken this loop yet: reap it now, so that the
        // answer says how it ended.
        children.reap();
        let answer = encode_reply(errno, pid, children.take_ended(index));
        let fds: Vec<RawFd> = pidfd.iter().map(AsRawFd::as_raw_fd).collect();
        if let Err(e) = socket.send_with_fds(&[&answer[..]], &fds) {
            error!("iothread spawner: answering: {e}");
            return 1;
        }
    }
}

/// Waits until a request can be read (`true`) or SIGCHLD is pending (`false`).
fn wait_for_request(socket: &UnixStream) -> io::Result<bool> {
    let mut fds = [libc::pollfd {
        fd: socket.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    // SAFETY: an empty set: ppoll unblocks every signal while it waits, so a blocked SIGCHLD
    // interrupts it (EINTR) and stays pending for `reap`.
    let mut unblocked: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: sigemptyset on a local set.
    unsafe { libc::sigemptyset(&mut unblocked) };
    // SAFETY: one pollfd, no timeout, a valid signal mask.
    let rc = unsafe { libc::ppoll(fds.as_mut_ptr(), 1, std::ptr::null(), &unblocked) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::EINTR) {
            Ok(false)
        } else {
            Err(e)
        };
    }
    Ok(true)
}

/// The spawner's iothreads: which index each runs, and how the last one of each index ended
/// (until the next request for that index takes it). A handful of entries at most.
#[derive(Default)]
struct Children {
    running: Vec<(u32, u32)>,
    ended: Vec<(u32, ExitStatus)>,
}

impl Children {
    fn started(&mut self, pid: u32, index: u32) {
        self.running.push((pid, index));
    }

    fn take_ended(&mut self, index: u32) -> Option<ExitStatus> {
        let at = self.ended.iter().position(|&(i, _)| i == index)?;
        Some(self.ended.swap_remove(at).1)
    }

    /// Reaps every exited child, logs how it ended and keeps that for its index.
    fn reap(&mut self) {
        loop {
            let mut status = 0;
            // SAFETY: waitpid on our own children, without blocking.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            let Ok(pid) = u32::try_from(pid) else {
                return;
            };
            if pid == 0 {
                return;
            }
            let ended = ExitStatus { pid, status };
            if libc::WIFSIGNALED(status) && libc::WTERMSIG(status) != libc::SIGKILL {
                error!("iothread {ended}");
            } else {
                info!("iothread {ended}");
            }
            if let Some(at) = self.running.iter().position(|&(p, _)| p == pid) {
                let (_, index) = self.running.swap_remove(at);
                self.ended.retain(|&(i, _)| i != index);
                self.ended.push((index, ended));
            }
        }
    }
}

/// Forks and execs one iothread; returns its pid and pidfd.
fn spawn_one(
    request: &[u8; REQUEST_LEN],
    control: &File,
    argv: &Argv,
) -> io::Result<(u32, OwnedFd)> {
    let cpus = (request[4] != 0).then(|| {
        // SAFETY: an all-zero cpu_set_t is valid, and we fill exactly its bytes.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: cpu_set_t is plain bytes of CPU_SET_LEN.
        let bytes: &mut [u8; CPU_SET_LEN] =
            unsafe { &mut *(&mut set as *mut libc::cpu_set_t).cast() };
        bytes.copy_from_slice(&request[8..]);
        set
    });
    let args = [
        argv.program.as_ptr(),
        argv.control_flag.as_ptr(),
        argv.control_fd.as_ptr(),
        std::ptr::null(),
    ];
    let control_fd = control.as_raw_fd();
    let spawner = std::process::id();
    // SAFETY: the spawner is single-threaded; the child only makes async-signal-safe calls
    // on values prepared before the fork, then execs or exits.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        // SAFETY: see above; every call is async-signal-safe and uses no allocation.
        unsafe { exec_child(control_fd, cpus.as_ref(), spawner, &args) }
    }
    // SAFETY: pidfd_open on our own unreaped child (reaping happens only in `reap`, later).
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        let e = io::Error::last_os_error();
        // SAFETY: kill our own child, which we cannot hand over.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        return Err(e);
    }
    // Pids and pidfds are non-negative, and a pidfd fits a c_int.
    let (Ok(pidfd), Ok(pid)) = (RawFd::try_from(pidfd), u32::try_from(pid)) else {
        return Err(io::Error::from_raw_os_error(libc::EOVERFLOW));
    };
    // SAFETY: pidfd_open returned a new descriptor that nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    Ok((pid, pidfd))
}

/// The forked child: place the control socket, die with the spawner, restore the signal
/// mask, pin CPUs, exec. Never returns.
///
/// # Safety
/// Called only in a freshly forked child of the single-threaded spawner; `args` is a
/// null-terminated array of valid C strings.
unsafe fn exec_child(
    control_fd: RawFd,
    cpus: Option<&libc::cpu_set_t>,
    spawner: u32,
    args: &[*const libc::c_char; 4],
) -> ! {
    if control_fd == CHILD_CONTROL_FD {
        if libc::fcntl(control_fd, libc::F_SETFD, 0) < 0 {
            libc::_exit(126);
        }
    } else if libc::dup3(control_fd, CHILD_CONTROL_FD, 0) < 0 {
        libc::_exit(126);
    }
    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) < 0
        || libc::getppid() != spawner as libc::pid_t
    {
        libc::_exit(126);
    }
    let mut empty: libc::sigset_t = std::mem::zeroed();
    libc::sigemptyset(&mut empty);
    libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
    if let Some(set) = cpus {
        if libc::sched_setaffinity(0, CPU_SET_LEN, set) < 0 {
            libc::_exit(126);
        }
    }
    libc::execv(args[0], args.as_ptr());
    libc::_exit(127)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_crash_signals_are_an_iothreads_own_fault() {
        // A wait status: the signal in the low 7 bits, or the exit code in bits 8..16.
        let signalled = |signal: i32| ExitStatus {
            pid: 1,
            status: signal,
        };
        let exited = |code: i32| ExitStatus {
            pid: 1,
            status: code << 8,
        };
        for signal in [libc::SIGSEGV, libc::SIGABRT, libc::SIGSYS, libc::SIGBUS] {
            assert!(signalled(signal).is_own_fault(), "signal {signal}");
        }
        for signal in [libc::SIGKILL, libc::SIGTERM, libc::SIGINT] {
            assert!(!signalled(signal).is_own_fault(), "signal {signal}");
        }
        for code in [0, 1, 126, 127] {
            assert!(!exited(code).is_own_fault(), "exit {code}");
        }
    }

    #[test]
    fn replies_decode_only_at_their_length() {
        assert_eq!(
            decode_reply(&encode_reply(0, 7, None)).unwrap(),
            (0, 7, None)
        );
        let killed = ExitStatus {
            pid: 6,
            status: libc::SIGSYS,
        };
        assert_eq!(
            decode_reply(&encode_reply(0, 7, Some(killed))).unwrap(),
            (0, 7, Some(killed))
        );
        assert!(killed.to_string().contains("SIGSYS"), "{killed}");
        assert_eq!(
            decode_reply(&encode_reply(libc::EAGAIN, 0, None)).unwrap(),
            (libc::EAGAIN, 0, None)
        );
        assert!(decode_reply(&[0; REPLY_LEN - 1]).is_err());
        assert!(decode_reply(&[0; REPLY_LEN + 1]).is_err());
    }
}
