//! One incarnation of a disk's frontend at a time, iothreads included.
//!
//! After `kill -9` of a frontend its iothreads get SIGKILL too (PR_SET_PDEATHSIG), but
//! asynchronously: one busy in the kernel may still run while a restarted frontend takes over
//! the socket and, with INFLIGHT_SHMFD, resubmits the requests that were in flight. Should the
//! old iothread's write of a block land after the guest, told the resubmitted write completed,
//! has written that block again, the newer data would be lost.
//!
//! So the frontend binds a datagram socket in the abstract namespace under a name derived from
//! its vhost-user socket path, and its iothreads inherit the descriptor. An abstract address
//! stays bound while any descriptor of its socket is open, so it is free only when the last
//! process of the previous incarnation has exited; a new frontend waits for that before it
//! spawns iothreads or listens. Unlike a lock file, nothing is left on disk. (The namespace is
//! per network namespace and open to every local process: one could hold the name and delay
//! a frontend's start — the wait is bounded and reported; hosts running blkplane do not run
//! untrusted code in the host's network namespace.)

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use log::{info, warn};

/// Lowest descriptor number the lock is moved to, so that it survives the iothread spawn,
/// which puts the control socket at descriptor 3 (see iothread.rs).
const LOCK_FD_MIN: libc::c_int = 10;
/// How often the name is tried while a predecessor holds it.
const RETRY: Duration = Duration::from_millis(20);

/// Why the lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum SocketLockError {
    /// Creating or binding the socket failed.
    #[error("lock {name} for {socket}: {source}")]
    Io {
        /// The vhost-user socket.
        socket: PathBuf,
        /// The abstract name.
        name: String,
        /// What failed.
        source: io::Error,
    },
    /// Someone still holds the name after the whole wait.
    #[error(
        "lock {name} for {socket} is still held after {waited:?}: another blkplane-frontend \
         serves this socket, or iothreads of a previous one are still running"
    )]
    Busy {
        /// The vhost-user socket.
        socket: PathBuf,
        /// The abstract name.
        name: String,
        /// How long we waited.
        waited: Duration,
    },
}

/// FNV-1a, 64 bits: stable across builds and versions (the name must be the same for the
/// frontend that crashed and the one that replaces it, whatever binary each runs).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// `socket` made absolute with its directory resolved (the socket itself may not exist yet),
/// so that every spelling of the same path gives the same name.
fn canonical(socket: &Path) -> PathBuf {
    let dir = match socket.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    match (dir.canonicalize(), socket.file_name()) {
        (Ok(dir), Some(name)) => dir.join(name),
        _ => socket.to_path_buf(),
    }
}

/// The abstract socket name of `socket`'s lock.
pub fn lock_name(socket: &Path) -> String {
    let path = canonical(socket);
    format!(
        "blkplane-frontend-lock:{:016x}",
        fnv1a(path.as_os_str().as_bytes())
    )
}

/// Takes the lock of `socket`, waiting up to `timeout` while a predecessor holds it. Keep the
/// returned descriptor open for the life of the process; child processes inherit it.
pub fn acquire(socket: &Path, timeout: Duration) -> Result<OwnedFd, SocketLockError> {
    let name = lock_name(socket);
    let io_error = |source| SocketLockError::Io {
        socket: socket.to_path_buf(),
        name: name.clone(),
        source,
    };
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(io_error)?;
    let started = Instant::now();
    let mut said = false;
    let bound = loop {
        match UnixDatagram::bind_addr(&addr) {
            Ok(bound) => break bound,
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => {}
            Err(e) => return Err(io_error(e)),
        }
        if started.elapsed() >= timeout {
            return Err(SocketLockError::Busy {
                socket: socket.to_path_buf(),
                name,
                waited: started.elapsed(),
            });
        }
        if !said {
            warn!(
                "lock {name} for {} is held: waiting for the previous frontend's processes to \
                 exit",
                socket.display()
            );
            said = true;
        }
        std::thread::sleep(RETRY);
    };
    if said {
        info!("lock {name} taken after {:?}", started.elapsed());
    }
    // Without CLOEXEC, at a number the iothread spawn leaves alone: inherited by every
    // iothread, so the name stays bound as long as the last of them lives.
    // SAFETY: F_DUPFD on a descriptor we own; the result is checked.
    let fd = unsafe { libc::fcntl(bound.as_raw_fd(), libc::F_DUPFD, LOCK_FD_MIN) };
    if fd < 0 {
        return Err(io_error(io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just created for us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_waits_until_the_first_is_gone() {
        let socket = std::env::temp_dir().join(format!("bp-lock-test-{}.sock", std::process::id()));
        let first = acquire(&socket, Duration::ZERO).unwrap();
        assert!(first.as_raw_fd() >= LOCK_FD_MIN);
        // SAFETY: F_GETFD on a descriptor we own.
        let flags = unsafe { libc::fcntl(first.as_raw_fd(), libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, 0, "inherited by the iothreads");
        assert!(matches!(
            acquire(&socket, Duration::from_millis(50)),
            Err(SocketLockError::Busy { .. })
        ));
        // Another socket has its own lock.
        let other = acquire(&socket.with_extension("other"), Duration::ZERO).unwrap();
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(first);
        });
        let second = acquire(&socket, Duration::from_secs(10)).unwrap();
        releaser.join().unwrap();
        drop((second, other));
    }

    #[test]
    fn every_spelling_of_a_path_gives_the_same_name() {
        let dir = std::env::temp_dir();
        let a = dir.join("disk.sock");
        let b = dir.join(".").join("disk.sock");
        assert_eq!(lock_name(&a), lock_name(&b));
        assert_ne!(lock_name(&a), lock_name(&dir.join("disk2.sock")));
        // The name fits an abstract socket address (at most 107 bytes).
        assert!(lock_name(&a).len() < 107);
        // Stable: the FNV-1a test vector.
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
