//! The allow-lists, one group of calls per reason. A call with conditions is allowed only
//! when one of its rules matches (conditions in a rule are ANDed).

use std::collections::BTreeMap;

use seccompiler::{
    BackendError, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition, SeccompRule,
};

use crate::Profile;

type Rules = BTreeMap<i64, Vec<SeccompRule>>;

/// `BLKGETSIZE64` (`_IOR(0x12, 114, size_t)`): a block-device image's size, asked again on a
/// resize. Not in the libc crate.
const BLKGETSIZE64: u64 = 0x8008_1272;

/// Calls every Rust process makes while it runs: memory, threads' synchronisation, time,
/// signals (return from a handler, `abort`), logging to stderr, reading and writing the fds
/// it has, waiting on them.
const RUNTIME: &[i64] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_close,
    libc::SYS_lseek,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_brk,
    libc::SYS_futex,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_clock_gettime,
    libc::SYS_clock_getres,
    libc::SYS_gettimeofday,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_getrandom,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigprocmask,
    libc::SYS_sigaltstack,
    libc::SYS_restart_syscall,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_ppoll,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_ctl,
    libc::SYS_recvmsg,
    libc::SYS_sendmsg,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_poll,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_epoll_wait,
];

/// The frontend, after start-up: vhost-user sessions (accept, messages with fds, guest memory
/// maps, inflight memfds), the admin channel (a thread per connection), eventfds and timerfds
/// for its workers, fdatasync for flushes, drains and migration, fadvise for a migration's stale
/// page cache, and iothreads by way of its
/// spawner (socket pairs, pidfds).
const FRONTEND: &[i64] = &[
    libc::SYS_accept4,
    libc::SYS_shutdown,
    libc::SYS_getsockopt,
    libc::SYS_setsockopt,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_memfd_create,
    libc::SYS_ftruncate,
    libc::SYS_fallocate,
    libc::SYS_fdatasync,
    libc::SYS_fsync,
    // A live-migration destination on shared storage drops its stale page cache of the image.
    libc::SYS_fadvise64,
    libc::SYS_eventfd2,
    libc::SYS_timerfd_create,
    libc::SYS_timerfd_settime,
    libc::SYS_timerfd_gettime,
    libc::SYS_epoll_create1,
    libc::SYS_dup,
    libc::SYS_dup3,
    libc::SYS_pidfd_send_signal,
    libc::SYS_clone3,
];

/// The spawner: receive a request, fork, place the fds, exec the iothread binary, hand back a
/// pidfd, reap.
const SPAWNER: &[i64] = &[
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_execve,
    libc::SYS_wait4,
    libc::SYS_waitid,
    libc::SYS_pidfd_open,
    libc::SYS_dup3,
    libc::SYS_close_range,
    libc::SYS_sched_setaffinity,
    libc::SYS_getppid,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_dup2,
];

/// What the iothread binary does between `execve` and its own [`crate::lock_down`], all under
/// the spawner's filter: the dynamic loader (open and map its libraries), the C and Rust
/// runtimes' start-up, the set-up handshake (io_uring creation, image checks), and the
/// lock-down itself.
const IOTHREAD_START: &[i64] = &[
    libc::SYS_openat,
    libc::SYS_set_tid_address,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_prlimit64,
    libc::SYS_rt_sigaction,
    libc::SYS_getsockopt,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_register,
    // The image probe: a non-blocking read (RWF_NOWAIT) shows whether io_uring could try
    // requests inline itself.
    libc::SYS_preadv2,
    // imago opening a qcow2 image asks the file system for its zeroing alignment.
    libc::SYS_fstatfs,
    libc::SYS_capget,
    libc::SYS_capset,
    libc::SYS_seccomp,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_arch_prctl,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_access,
];

/// The iothread, after its lock-down: the ring does the I/O, or, for an image io_uring would
/// hand to worker threads (tmpfs), plain preadv/pwritev on its own fds; memory tables arrive
/// on the control socket (recvmsg with fds, mmap, munmap, fstat).
const IOTHREAD: &[i64] = &[
    libc::SYS_io_uring_enter,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    // qcow2 metadata through imago: zeroing a new cluster (FALLOC_FL_ZERO_RANGE, or
    // PUNCH_HOLE) and growing the image file to it. Only on the fds it was handed.
    libc::SYS_fallocate,
    libc::SYS_ftruncate,
    // A guest flush of a qcow2 image with an external data file syncs that file too (the
    // image file itself is synced through io_uring).
    libc::SYS_fdatasync,
];

fn cond(arg: u8, op: Op, value: u64) -> Result<SeccompCondition, BackendError> {
    SeccompCondition::new(arg, Len::Dword, op, value)
}

fn allow(rules: &mut Rules, calls: &[i64]) {
    for &call in calls {
        rules.insert(call, Vec::new());
    }
}

/// `fcntl` for what std and the fd-passing code do: duplicate close-on-exec, read and set fd
/// and status flags, read and add memfd seals.
fn fcntl(rules: &mut Rules) -> Result<(), BackendError> {
    let commands = [
        libc::F_DUPFD_CLOEXEC,
        libc::F_GETFD,
        libc::F_SETFD,
        libc::F_GETFL,
        libc::F_SETFL,
        libc::F_GET_SEALS,
        libc::F_ADD_SEALS,
    ];
    let rules_for = commands
        .iter()
        .map(|&c| SeccompRule::new(vec![cond(1, Op::Eq, c as u64)?]))
        .collect::<Result<_, _>>()?;
    rules.insert(libc::SYS_fcntl, rules_for);
    Ok(())
}

/// `ioctl` requests: `FIONBIO` (std's `set_nonblocking`), `FIOCLEX`, `TCGETS` (the logger
/// asks whether stderr is a terminal) and the extra ones given.
fn ioctl(rules: &mut Rules, extra: &[u64]) -> Result<(), BackendError> {
    let always: [u64; 3] = [libc::FIONBIO, libc::FIOCLEX, libc::TCGETS];
    let requests = always.into_iter().chain(extra.iter().copied());
    let rules_for = requests
        .map(|r| SeccompRule::new(vec![cond(1, Op::Eq, r)?]))
        .collect::<Result<_, _>>()?;
    rules.insert(libc::SYS_ioctl, rules_for);
    Ok(())
}

/// `prctl` options: naming a new thread, and those given.
fn prctl(rules: &mut Rules, extra: &[libc::c_int]) -> Result<(), BackendError> {
    let rules_for = std::iter::once(libc::PR_SET_NAME)
        .chain(extra.iter().copied())
        .map(|o| SeccompRule::new(vec![cond(0, Op::Eq, o as u64)?]))
        .collect::<Result<_, _>>()?;
    rules.insert(libc::SYS_prctl, rules_for);
    Ok(())
}

/// `clone` with `CLONE_THREAD` set (a thread, never a new process) or, when `fork` is true,
/// with it clear (a new process).
fn clone(rules: &mut Rules, fork: bool) -> Result<(), BackendError> {
    let thread = libc::CLONE_THREAD as u64;
    let wanted = if fork { 0 } else { thread };
    let rule = SeccompRule::new(vec![cond(0, Op::MaskedEq(thread), wanted)?])?;
    rules.insert(libc::SYS_clone, vec![rule]);
    Ok(())
}

/// `socketpair(AF_UNIX, …)` only: the frontend's new iothread control sockets. No other
/// socket is ever created after start-up, and `socket` itself is in no list.
fn unix_socketpair(rules: &mut Rules) -> Result<(), BackendError> {
    let rule = SeccompRule::new(vec![cond(0, Op::Eq, libc::AF_UNIX as u64)?])?;
    rules.insert(libc::SYS_socketpair, vec![rule]);
    Ok(())
}

/// `tgkill` of this process only (what `abort` does, after a panic in a release build).
fn tgkill_self(rules: &mut Rules) -> Result<(), BackendError> {
    let pid = std::process::id();
    let rule = SeccompRule::new(vec![cond(0, Op::Eq, u64::from(pid))?])?;
    rules.insert(libc::SYS_tgkill, vec![rule]);
    Ok(())
}

/// The rules of `profile`'s allow-list.
pub(crate) fn rules(profile: Profile) -> Result<Rules, BackendError> {
    let mut rules = Rules::new();
    allow(&mut rules, RUNTIME);
    fcntl(&mut rules)?;
    tgkill_self(&mut rules)?;
    match profile {
        Profile::Frontend => {
            allow(&mut rules, FRONTEND);
            ioctl(&mut rules, &[BLKGETSIZE64])?;
            prctl(&mut rules, &[])?;
            clone(&mut rules, false)?;
            unix_socketpair(&mut rules)?;
        }
        Profile::Spawner => {
            // Its children run under this filter too: what the iothread does once it runs
            // must pass both filters.
            allow(&mut rules, SPAWNER);
            allow(&mut rules, IOTHREAD_START);
            allow(&mut rules, IOTHREAD);
            // The image checks of the iothread's set-up ask block devices for their size and
            // logical block size.
            ioctl(&mut rules, &[BLKGETSIZE64, libc::BLKSSZGET])?;
            // The child's death signal; the iothread's own lock-down.
            prctl(
                &mut rules,
                &[
                    libc::PR_SET_PDEATHSIG,
                    libc::PR_CAPBSET_READ,
                    libc::PR_CAPBSET_DROP,
                    libc::PR_CAP_AMBIENT,
                    libc::PR_SET_NO_NEW_PRIVS,
                    libc::PR_SET_SECCOMP,
                ],
            )?;
            clone(&mut rules, true)?;
        }
        Profile::Iothread => {
            allow(&mut rules, IOTHREAD);
            ioctl(&mut rules, &[])?;
            prctl(&mut rules, &[])?;
        }
    }
    Ok(rules)
}
