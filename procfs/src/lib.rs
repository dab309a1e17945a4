//! Processes and the kernel's view of them: pidfds (which work for processes that are not our
//! children, such as frontends adopted after a blkplaned restart), /proc/PID/cmdline, the
//! listening state of UNIX sockets in /proc/net/unix, and a few device facts. Used by blkplaned
//! and by the end-to-end tests, so that each of these readers exists once.

#![warn(missing_docs)]

use std::ffi::OsString;
use std::fs::File;
use std::io::{Seek, SeekFrom};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;
use std::path::Path;

/// Opens a pidfd for `pid` (Linux ≥ 5.3). The pidfd keeps referring to that process even
/// after it exits and its pid is reused, so signals sent through it never hit a stranger.
pub fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    let pid =
        libc::pid_t::try_from(pid).map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: plain syscall with integer arguments; on success it returns a new fd we own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| std::io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sends `signal` to the process behind `pidfd`. ESRCH (already exited) is not an error.
pub fn pidfd_send_signal(pidfd: &OwnedFd, signal: i32) -> std::io::Result<()> {
    // SAFETY: plain syscall on a pidfd we own; a null siginfo is allowed.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ESRCH) {
            return Ok(());
        }
        return Err(e);
    }
    Ok(())
}

/// Whether the process behind `pidfd` has exited (the pidfd polls readable then).
pub fn pidfd_exited(pidfd: &OwnedFd) -> bool {
    let mut pfd = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n > 0 && pfd.revents & (libc::POLLIN | libc::POLLHUP) != 0
}

/// How a child process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// It called exit with this code.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
}

impl std::fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitStatus::Code(c) => write!(f, "exited with status {c}"),
            ExitStatus::Signal(libc::SIGSYS) => write!(
                f,
                "killed by signal {} (SIGSYS: a system call its seccomp filter forbids; the \
                 kernel's audit log names it)",
                libc::SIGSYS
            ),
            ExitStatus::Signal(s) => match signal_name(*s) {
                Some(name) => write!(f, "killed by signal {s} ({name})"),
                None => write!(f, "killed by signal {s}"),
            },
        }
    }
}

/// The name of the signals a supervised process usually dies of.
fn signal_name(signal: i32) -> Option<&'static str> {
    Some(match signal {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGABRT => "SIGABRT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGILL => "SIGILL",
        _ => return None,
    })
}

/// Reaps our child `pid` if it has exited. Returns `None` while it runs, and for processes
/// that are not our children (nothing to reap; their status is not ours to see).
pub fn try_reap(pid: u32) -> Option<ExitStatus> {
    let pid = libc::pid_t::try_from(pid).ok()?;
    let mut status = 0;
    // SAFETY: plain syscall writing into a local int.
    let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    if r != pid {
        return None;
    }
    if libc::WIFEXITED(status) {
        Some(ExitStatus::Code(libc::WEXITSTATUS(status)))
    } else if libc::WIFSIGNALED(status) {
        Some(ExitStatus::Signal(libc::WTERMSIG(status)))
    } else {
        None
    }
}

/// The command line of `pid` (argv), or `None` if the process is gone (or a zombie, whose
/// cmdline is empty).
pub fn cmdline(pid: u32) -> Option<Vec<OsString>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    if raw.is_empty() {
        return None;
    }
    Some(
        raw.split(|&b| b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| OsString::from_vec(a.to_vec()))
            .collect(),
    )
}

/// The state letter of `pid` from /proc/PID/stat (`R`, `S`, `Z`…), `None` if it is gone.
pub fn state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The comm field may contain spaces and parentheses: the state follows the last ')'.
    let close = stat.rfind(')')?;
    stat[close + 1..].split_whitespace().next()?.chars().next()
}

/// Whether `pid` is a live process (exists and is not a zombie).
pub fn alive(pid: u32) -> bool {
    state(pid).is_some_and(|s| !matches!(s, 'Z' | 'X' | 'x'))
}

/// The pid of every process (the numeric entries of /proc), sorted; empty without /proc.
pub fn pids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = dir
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()))
        .collect();
    pids.sort_unstable();
    pids
}

/// Pids of every process whose argv satisfies `pred` (a scan of /proc).
fn find_processes(pred: impl Fn(&[OsString]) -> bool) -> Vec<u32> {
    pids()
        .into_iter()
        .filter(|&pid| cmdline(pid).is_some_and(|argv| pred(&argv)))
        .collect()
}

/// Pids of every process whose argv contains `arg` exactly.
pub fn find_processes_with_arg(arg: &OsString) -> Vec<u32> {
    find_processes(|argv| argv.iter().any(|a| a == arg))
}

/// Pids of every process with an argument that starts with `prefix`.
pub fn find_processes_with_arg_prefix(prefix: &str) -> Vec<u32> {
    let prefix = prefix.as_bytes();
    find_processes(|argv| {
        argv.iter()
            .any(|a| std::os::unix::ffi::OsStrExt::as_bytes(a.as_os_str()).starts_with(prefix))
    })
}

/// `__SO_ACCEPTCON` in /proc/net/unix's Flags column: the socket is in listen().
const ACCEPTCON: u32 = 0x0001_0000;

/// Whether a UNIX socket bound to `path` is listening, from /proc/net/unix. This is how
/// readiness is checked without connecting: the frontend takes any connection on its
/// vhost-user socket for a VMM session.
pub fn is_listening(path: &Path) -> bool {
    let Ok(table) = std::fs::read_to_string("/proc/net/unix") else {
        return false;
    };
    listening_in(&table, path)
}

/// Whether the /proc/net/unix text `table` has a listening socket bound to `path`.
fn listening_in(table: &str, path: &Path) -> bool {
    let want = path.to_string_lossy();
    table.lines().skip(1).any(|line| {
        let cols: Vec<&str> = line.split_whitespace().collect();
        cols.len() >= 8
            && cols[7] == want
            && u32::from_str_radix(cols[3], 16).is_ok_and(|f| f & ACCEPTCON != 0)
    })
}

/// The CPUs this machine may have (/sys/devices/system/cpu/possible), `None` if unknown.
pub fn possible_cpus() -> Option<Vec<u32>> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/possible").ok()?;
    parse_cpu_list(text.trim()).ok()
}

/// Parses a CPU list such as `0-1,3` into the CPU numbers (sorted, without duplicates).
pub fn parse_cpu_list(list: &str) -> Result<Vec<u32>, String> {
    // Every CPU is below CPU_SETSIZE (1024), so it fits u32.
    blkplane_proto::cpus::parse_cpu_list(list)
        .map(|cpus| cpus.into_iter().map(|c| c as u32).collect())
}

/// The size in bytes of the block device at `path`.
pub fn block_device_size(path: &Path) -> std::io::Result<u64> {
    let mut f = File::open(path)?;
    f.seek(SeekFrom::End(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn proc_net_unix() {
        let table = "Num       RefCount Protocol Flags    Type St Inode Path\n\
            0000000000000000: 00000002 00000000 00010000 0001 01 12345 /run/a.sock\n\
            0000000000000000: 00000002 00000000 00000000 0001 03 12346 /run/b.sock\n\
            0000000000000000: 00000002 00000000 00000000 0001 03 12347\n";
        assert!(listening_in(table, Path::new("/run/a.sock")));
        assert!(!listening_in(table, Path::new("/run/b.sock")));
        assert!(!listening_in(table, Path::new("/run/c.sock")));
    }

    #[test]
    fn real_listener() {
        let dir = std::env::temp_dir().join(format!("bpp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("l.sock");
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        assert!(is_listening(&path));
        drop(l);
        // A child another test forks right now holds the listener until its exec: wait that out.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while is_listening(&path) {
            assert!(std::time::Instant::now() < deadline, "still listening");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    // The child is reaped by `try_reap`, the function under test, not by `Child::wait`.
    #[allow(clippy::zombie_processes)]
    fn pidfd_of_a_child() {
        let child = Command::new("sleep").arg("10").spawn().unwrap();
        let pid = child.id();
        let fd = pidfd_open(pid).unwrap();
        assert!(!pidfd_exited(&fd));
        assert!(alive(pid));
        // Right after fork the child may not have exec'd `sleep` yet: wait until it has.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let argv = loop {
            let argv = cmdline(pid).unwrap_or_default();
            if argv.last().is_some_and(|a| a == "10") {
                break argv;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "sleep never exec'd: {argv:?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        assert_eq!(argv.last().unwrap(), "10");
        assert!(find_processes_with_arg(&OsString::from("10")).contains(&pid));
        pidfd_send_signal(&fd, libc::SIGKILL).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !pidfd_exited(&fd) {
            assert!(std::time::Instant::now() < deadline);
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(try_reap(pid), Some(ExitStatus::Signal(libc::SIGKILL)));
        // Signalling an exited (reaped) process through its pidfd is harmless.
        pidfd_send_signal(&fd, libc::SIGKILL).unwrap();
        assert!(!alive(pid));
    }
}
