//! Locks a blkplane process down once it has started: every capability dropped,
//! `no_new_privs`, and a seccomp filter that allows only the system calls its kind of process
//! makes while serving. Anything else kills the process (`SIGSYS`), and its supervisor
//! restarts it: a frontend is restarted by blkplaned, an iothread by its frontend.
//!
//! | process | after [`lock_down`] it can |
//! |---|---|
//! | [`Profile::Frontend`] | serve vhost-user on its sockets, map guest memory, make memfds, eventfds, timerfds and threads, ask its spawner for iothreads; no `open`, no `socket`, no `fork`/`exec` |
//! | [`Profile::Spawner`] | receive a request from its frontend and fork + exec the iothread binary (the only process that may `execve`); the filter must also let that binary start up until it locks itself down |
//! | [`Profile::Iothread`] | `io_uring_enter` on a ring restricted to six opcodes, map memory tables, talk to its frontend; nothing else |
//!
//! io_uring requests do not pass through seccomp, so the iothread also registers io_uring
//! restrictions on its ring before enabling it (see blkplane-iothread's engine).
//!
//! The filters list the calls glibc and Rust's standard library make for the code each
//! process runs; the lists are kept short and grouped by why a call is needed. A call that is
//! missing shows up as a process killed by `SIGSYS`, in blkplaned's events and the kernel's
//! audit log; `BLKPLANE_SECCOMP=log` makes the filter log instead of kill, to find it.

#![warn(missing_docs)]

mod caps;
mod filters;
mod identity;

use std::collections::BTreeMap;
use std::io;

use log::{info, warn};
use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};
use thiserror::Error;

pub use caps::drop_capabilities;
pub use identity::{
    keep_only_identity_capabilities, open_as, switch_identity, RunAs, RunAsError, MAX_GROUPS,
};

/// The kind of process a filter is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// `blkplane-frontend`, after its sockets listen and its workers run.
    Frontend,
    /// The frontend's iothread spawner (a fork of the frontend that execs iothreads).
    Spawner,
    /// `blkplane-iothread`, after its set-up handshake.
    Iothread,
}

impl Profile {
    fn name(self) -> &'static str {
        match self {
            Self::Frontend => "frontend",
            Self::Spawner => "spawner",
            Self::Iothread => "iothread",
        }
    }
}

/// Why a process could not be locked down. Every one of them is fatal: a process that
/// should run sandboxed does not serve unsandboxed.
#[derive(Debug, Error)]
pub enum SandboxError {
    /// The machine's architecture has no filter (seccompiler supports x86_64, aarch64 and
    /// riscv64).
    #[error("seccomp: no filter for architecture {0}")]
    Arch(&'static str),
    /// The filter could not be compiled.
    #[error("seccomp filter for the {profile}: {source}")]
    Compile {
        /// Which filter.
        profile: &'static str,
        /// What seccompiler said.
        source: seccompiler::BackendError,
    },
    /// The kernel refused the filter.
    #[error("seccomp: installing the {profile} filter: {source}")]
    Install {
        /// Which filter.
        profile: &'static str,
        /// What seccompiler said.
        source: seccompiler::Error,
    },
    /// The switch to a disk's configured user failed.
    #[error("switching to the configured user: {what}: {source}")]
    Identity {
        /// The step that failed.
        what: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// A capability could not be dropped.
    #[error("dropping capabilities: {what}: {source}")]
    Capabilities {
        /// The step that failed.
        what: &'static str,
        /// The OS error.
        source: io::Error,
    },
}

/// Closes every descriptor from 3 up: whatever a launcher let the process inherit (a
/// descriptor opened without close-on-exec by another thread of a multi-threaded parent, say)
/// is not the process's to keep. Call it first thing in `main`, before opening anything.
pub fn close_inherited_fds() -> io::Result<()> {
    // SAFETY: close_range only closes descriptors; at the start of `main` no Rust object owns
    // one from 3 up.
    if unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// What a filter does with a call it does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enforcement {
    /// Kill the process (`SECCOMP_RET_KILL_PROCESS`): the default.
    Kill,
    /// Let the call run and have the kernel log it (`SECCOMP_RET_LOG`): for finding a call a
    /// new kernel or C library makes, never for production.
    Log,
}

impl Enforcement {
    /// From `BLKPLANE_SECCOMP` (`log`; anything else or unset is [`Enforcement::Kill`]).
    pub fn from_env() -> Self {
        match std::env::var("BLKPLANE_SECCOMP").as_deref() {
            Ok("log") => Self::Log,
            _ => Self::Kill,
        }
    }
}

/// Drops every capability, sets `no_new_privs` and installs `profile`'s filter on every
/// thread of the process. Threads started later inherit it.
pub fn lock_down(profile: Profile, enforcement: Enforcement) -> Result<(), SandboxError> {
    drop_capabilities()?;
    let programs = compile(profile, enforcement)?;
    let install = |program: &BpfProgram| {
        // The kernel refuses TSYNC with another thread mid-way through its own seccomp call;
        // there is none here, so one attempt is enough.
        seccompiler::apply_filter_all_threads(program).map_err(|source| SandboxError::Install {
            profile: profile.name(),
            source,
        })
    };
    for program in &programs {
        install(program)?;
    }
    match enforcement {
        Enforcement::Kill => info!(
            "sandboxed: {} seccomp filter, no capabilities",
            profile.name()
        ),
        Enforcement::Log => warn!(
            "BLKPLANE_SECCOMP=log: the {} filter logs forbidden system calls instead of \
             killing the process",
            profile.name()
        ),
    }
    Ok(())
}

/// The BPF programs of `profile`, in installation order. Two, because a filter has one
/// action for a match: the first answers `clone3` with `ENOSYS` (its flags are behind a
/// pointer a filter cannot read, so the C library must fall back to `clone`, whose flags the
/// second can check); the second allows the profile's calls and kills (or logs) the rest.
/// The kernel applies the strictest answer of all filters.
fn compile(profile: Profile, enforcement: Enforcement) -> Result<Vec<BpfProgram>, SandboxError> {
    let arch = TargetArch::try_from(std::env::consts::ARCH)
        .map_err(|_| SandboxError::Arch(std::env::consts::ARCH))?;
    let failed = |source| SandboxError::Compile {
        profile: profile.name(),
        source,
    };
    let no_clone3 = SeccompFilter::new(
        BTreeMap::from([(libc::SYS_clone3, vec![])]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )
    .map_err(failed)?;
    let mismatch = match enforcement {
        Enforcement::Kill => SeccompAction::KillProcess,
        Enforcement::Log => SeccompAction::Log,
    };
    let allowed = SeccompFilter::new(
        filters::rules(profile).map_err(failed)?,
        mismatch,
        SeccompAction::Allow,
        arch,
    )
    .map_err(failed)?;
    [no_clone3, allowed]
        .into_iter()
        .map(|filter| BpfProgram::try_from(filter).map_err(failed))
        .collect()
}

/// Test hook, compiled only into debug builds: on `SIGUSR2` the process makes a system call
/// no filter allows (`socket(AF_INET, SOCK_STREAM)`), so that a test can prove the filter
/// kills it. Release builds have no handler (and `SIGUSR2` simply terminates them).
#[cfg(debug_assertions)]
pub fn arm_forbidden_syscall_hook() -> io::Result<()> {
    extern "C" fn forbidden_call(_: libc::c_int) {
        // SAFETY: socket() is async-signal-safe and takes no pointers. Under a filter the
        // process does not return from it; without one the socket is closed again.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
            if fd >= 0 {
                libc::close(fd);
            }
        }
    }
    let handler = forbidden_call as extern "C" fn(libc::c_int);
    // SAFETY: installs a handler that only makes async-signal-safe calls.
    let previous = unsafe { libc::signal(libc::SIGUSR2, handler as libc::sighandler_t) };
    if previous == libc::SIG_ERR {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_profile_compiles_for_this_machine() {
        for profile in [Profile::Frontend, Profile::Spawner, Profile::Iothread] {
            for enforcement in [Enforcement::Kill, Enforcement::Log] {
                let programs = compile(profile, enforcement).unwrap();
                assert_eq!(programs.len(), 2);
                assert!(programs.iter().all(|p| !p.is_empty()));
            }
        }
    }

    /// In a forked child (a filter cannot be removed): allowed calls work, `clone3` says
    /// ENOSYS, a forbidden call kills the process with SIGSYS.
    #[test]
    fn the_iothread_filter_kills_a_forbidden_call_in_a_child() {
        let programs = compile(Profile::Iothread, Enforcement::Kill).unwrap();
        // SAFETY: the child only makes raw system calls and exits; it touches no lock the
        // parent's other threads could hold.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: prctl and seccomp on this (single-threaded) child only.
            unsafe {
                libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
                for program in &programs {
                    let prog = libc::sock_fprog {
                        len: program.len() as u16,
                        filter: program.as_ptr() as *mut libc::sock_filter,
                    };
                    if libc::syscall(libc::SYS_seccomp, 1, 0, &prog) != 0 {
                        libc::_exit(10);
                    }
                }
                if libc::syscall(libc::SYS_getpid) <= 0 {
                    libc::_exit(11);
                }
                let rc = libc::syscall(libc::SYS_clone3, 0, 0);
                if rc != -1 || *libc::__errno_location() != libc::ENOSYS {
                    libc::_exit(12);
                }
                libc::syscall(libc::SYS_socket, libc::AF_INET, libc::SOCK_STREAM, 0);
                libc::_exit(13);
            }
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSYS,
            "child status {status:#x} (exit {})",
            libc::WEXITSTATUS(status)
        );
    }
}
