//! What the benchmark reads from /proc: CPU time and context switches of the back-end's
//! processes, their children, whether a socket listens, and facts about the machine.

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

/// Whether a UNIX socket listens at `path`, read from /proc/net/unix rather than probed, so
/// that checking never counts as a client connecting.
pub fn is_listening(path: &Path) -> bool {
    /// `__SO_ACCEPTCON` in the Flags column: the socket is in listen().
    const ACCEPTCON: u32 = 0x0001_0000;
    let Ok(table) = std::fs::read_to_string("/proc/net/unix") else {
        return std::os::unix::net::UnixStream::connect(path).is_ok();
    };
    let want = path.to_string_lossy();
    table.lines().skip(1).any(|line| {
        let cols: Vec<&str> = line.split_whitespace().collect();
        cols.len() >= 8
            && cols[7] == want
            && u32::from_str_radix(cols[3], 16).is_ok_and(|flags| flags & ACCEPTCON != 0)
    })
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
        assert!(!is_listening(Path::new("/nonexistent/socket")));
        assert!(!voluntary_switches(me).is_empty());
    }

    #[test]
    fn switches_are_compared_per_thread() {
        let before = [(1, 10), (2, 500), (3, 7)];
        // Thread 2 exited, thread 4 was born, 1 and 3 went on.
        let after = [(1, 15), (3, 7), (4, 20)];
        assert_eq!(switches_between(&before, &after), 5 + 20);
    }
}
