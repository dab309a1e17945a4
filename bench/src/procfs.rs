//! What the benchmark reads from /proc: CPU time and context switches of the back-end's
//! processes, their descendants, the flags they opened the image with, whether a socket
//! listens, and facts about the machine (and, from statfs, what file system a directory is on).

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Clock ticks per second, the unit of `utime`/`stime` in /proc/<pid>/stat.
fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}

/// The fields of /proc/<pid>/stat after the command name (field 3, the state, comes first).
/// The name may contain spaces and parentheses, hence the search for the last ')'.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let close = stat.rfind(')')?;
    Some(
        stat.get(close + 1..)?
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
    )
}

/// User plus system CPU seconds of every thread of `pid`, living or exited (utime + stime);
/// `None` when the process is gone.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let fields = stat_fields(pid)?;
    // utime and stime are fields 14 and 15, i.e. 11 and 12 after the state.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) as f64 / clock_ticks())
}

/// The children of `pid` (from the `ppid` of every /proc/<n>/stat, which works without
/// CONFIG_PROC_CHILDREN).
pub fn children(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found: Vec<u32> = dir
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&child| {
            stat_fields(child)
                .and_then(|fields| fields.get(1)?.parse::<u32>().ok())
                .is_some_and(|ppid| ppid == pid)
        })
        .collect();
    found.sort_unstable();
    found
}

/// `pid` and all its descendants, children before grandchildren: blkplane-frontend forks an
/// iothread spawner, whose children are the iothreads.
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut all = vec![pid];
    let mut next = 0;
    while next < all.len() {
        let parent = all[next];
        next += 1;
        for child in children(parent) {
            if !all.contains(&child) {
                all.push(child);
            }
        }
    }
    all
}

/// The `flags` (octal in /proc/<pid>/fdinfo/<fd>) of every descriptor of `pid` that refers to
/// `path`: how the process opened the image (`O_DIRECT` is 0o40000 on x86 and arm64).
pub fn open_flags(pid: u32, path: &Path) -> Vec<u32> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    let want = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
    fds.filter_map(|fd| {
        let fd = fd.ok()?;
        if std::fs::read_link(fd.path()).ok()? != want {
            return None;
        }
        let info =
            std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", fd.file_name().to_str()?))
                .ok()?;
        parse_fdinfo_flags(&info)
    })
    .collect()
}

/// The `flags:` line of an fdinfo file.
fn parse_fdinfo_flags(info: &str) -> Option<u32> {
    let flags = info
        .lines()
        .find_map(|line| line.strip_prefix("flags:"))?
        .trim();
    u32::from_str_radix(flags, 8).ok()
}

/// A file system type, from statfs(2)'s `f_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsType(pub i64);

impl FsType {
    /// tmpfs (also /dev/shm).
    pub const TMPFS: FsType = FsType(0x0102_1994);
    /// ramfs.
    pub const RAMFS: FsType = FsType(0x8584_58f6);

    /// Whether files there live in memory, not on a device.
    pub fn in_memory(self) -> bool {
        self == Self::TMPFS || self == Self::RAMFS
    }
}

/// The type of the file system `path` is on.
pub fn fs_type(path: &Path) -> io::Result<FsType> {
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: statfs writes one struct statfs into the zeroed value we pass; the path is a
    // NUL-terminated string that outlives the call.
    let mut buf: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c_path.as_ptr(), &mut buf) } != 0 {
        return Err(io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between libc targets.
    Ok(FsType(buf.f_type as i64))
}

/// Voluntary context switches (a thread went to sleep: roughly its wake-ups) of every living
/// thread of `pid`, by thread id. /proc/<pid>/status alone only counts the main thread, and a
/// thread's count leaves with it, so callers compare these per thread (see [`switches_between`]).
pub fn voluntary_switches(pid: u32) -> Vec<(u32, u64)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(|task| {
            let task = task.ok()?;
            let tid = task.file_name().to_str()?.parse::<u32>().ok()?;
            let status = std::fs::read_to_string(task.path().join("status")).ok()?;
            let count = status
                .lines()
                .find_map(|line| line.strip_prefix("voluntary_ctxt_switches:"))?
                .trim()
                .parse::<u64>()
                .ok()?;
            Some((tid, count))
        })
        .collect()
}

/// Switches between two samples of [`voluntary_switches`]: the growth of every thread alive at
/// the end, a thread born in between counting in full. Threads that exited in between are lost
/// (io_uring's io-wq workers come and go), so this is a lower bound; summing whole samples
/// instead would subtract everything such a thread ever did.
pub fn switches_between(before: &[(u32, u64)], after: &[(u32, u64)]) -> u64 {
    after
        .iter()
        .map(|&(tid, count)| {
            let earlier = before
                .iter()
                .find(|&&(t, _)| t == tid)
                .map_or(0, |&(_, c)| c);
            count.saturating_sub(earlier)
        })
        .sum()
}

/// The first line of /proc/loadavg.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into())
}

/// The 1-minute load average.
pub fn load1() -> f64 {
    loadavg()
        .split_whitespace()
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.0)
}

/// The CPU model name of the first processor.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find_map(|line| line.strip_prefix("model name"))
                .and_then(|rest| rest.split_once(':'))
                .map(|(_, name)| name.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// Online CPUs (not limited by this process's affinity, unlike `available_parallelism`).
pub fn online_cpus() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).unwrap_or(1).max(1)
}

/// The running kernel's release.
pub fn kernel() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into())
}

/// Total memory in GiB.
pub fn memory_gib() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|info| {
            let kib: f64 = info
                .lines()
                .find_map(|line| line.strip_prefix("MemTotal:"))?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()?;
            Some(kib / (1024.0 * 1024.0))
        })
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_is_visible() {
        let me = std::process::id();
        assert!(cpu_seconds(me).is_some());
        assert!(online_cpus() >= 1);
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        assert!(children(me).contains(&child.id()));
        child.kill().unwrap();
        child.wait().unwrap();
        // A grandchild is found too.
        let mut shell = std::process::Command::new("sh")
            .args(["-c", "sleep 5 & wait"])
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let family = loop {
            let family = descendants(me);
            if family.len() >= 3 || std::time::Instant::now() > deadline {
                break family;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        assert_eq!(family[0], me);
        assert!(family.contains(&shell.id()), "{family:?}");
        let grandchildren = children(shell.id());
        assert_eq!(grandchildren.len(), 1, "{family:?}");
        assert!(family.contains(&grandchildren[0]));
        for pid in grandchildren {
            // SAFETY: plain kill(2) of the sleep we just started.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
        shell.wait().unwrap();
        assert!(!voluntary_switches(me).is_empty());
    }

    #[test]
    fn open_flags_show_o_direct() {
        let dir = std::env::temp_dir().join(format!("bpb-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let me = std::process::id();
        let file = std::fs::File::open(&path).unwrap();
        let flags = open_flags(me, &path);
        assert_eq!(flags.len(), 1, "{flags:?}");
        assert_eq!(flags[0] & libc::O_DIRECT as u32, 0);
        drop(file);
        assert!(open_flags(me, &path).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            parse_fdinfo_flags("pos:\t0\nflags:\t0140002\nmnt_id:\t25\n"),
            Some(0o140002)
        );
        assert_eq!(0o140002 & libc::O_DIRECT as u32, libc::O_DIRECT as u32);
        assert_eq!(parse_fdinfo_flags("pos: 0\n"), None);
    }

    #[test]
    fn file_system_types() {
        assert!(FsType::TMPFS.in_memory() && FsType::RAMFS.in_memory());
        assert!(!FsType(0xEF53).in_memory()); // ext4
        if Path::new("/dev/shm").is_dir() {
            assert!(fs_type(Path::new("/dev/shm")).unwrap().in_memory());
        }
        assert!(fs_type(Path::new("/nonexistent/dir")).is_err());
    }

    #[test]
    fn switches_are_compared_per_thread() {
        let before = [(1, 10), (2, 500), (3, 7)];
        // Thread 2 exited, thread 4 was born, 1 and 3 went on.
        let after = [(1, 15), (3, 7), (4, 20)];
        assert_eq!(switches_between(&before, &after), 5 + 20);
    }
}
