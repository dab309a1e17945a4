//! An idle disk costs nothing: after I/O with the adaptive polling at its largest bound (so its
//! window has opened), a connected but idle disk's processes — the frontend, its iothread
//! spawner and its iothreads, every thread of each — are not woken once and use no CPU for
//! 10 s. A worker or iothread that kept polling, or any periodic timer, shows up here.
//!
//! Polling is bounded by what it can catch: requests that come further apart than the bound
//! close the windows (the workers' on the avail rings, the iothreads' on their submission
//! queues), so such a disk does not spin out the bound after every request.
//!
//! On a tmpfs image every thread counts (its transfers run inline, so io_uring never starts a
//! worker thread). On a file on the real disk the kernel's io-wq worker threads of the
//! iothread's io_uring (`iou-wrk-*`, started for writes that allocate blocks) are left out:
//! the kernel keeps the last one and wakes it every 5 s to check whether it may exit, a cost
//! of io_uring itself that blkplane does not schedule. They are still checked to use no CPU.

use std::time::{Duration, Instant};

use blkplane_tests::frontend::descendants_of;
use blkplane_tests::{create_image, pattern, Client, Frontend, TempDir};

/// How long the disk stays idle while it is watched.
const IDLE: Duration = Duration::from_secs(10);

/// Whether a thread name is one of io_uring's kernel worker threads.
fn is_io_wq(comm: &str) -> bool {
    comm.starts_with("iou-wrk-")
}

/// One thread's counters.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ThreadCost {
    /// `PID/TID NAME`.
    name: String,
    /// Voluntary plus involuntary context switches.
    switches: u64,
    /// utime + stime in clock ticks.
    ticks: u64,
}

/// Every thread of `pids` with its counters.
fn threads(pids: &[u32]) -> Vec<ThreadCost> {
    let mut out = Vec::new();
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for task in tasks.filter_map(Result::ok) {
            let dir = task.path();
            let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
            let switches = read("status")
                .lines()
                .filter_map(|l| {
                    l.strip_prefix("voluntary_ctxt_switches:")
                        .or_else(|| l.strip_prefix("nonvoluntary_ctxt_switches:"))
                })
                .map(|v| v.trim().parse::<u64>().unwrap())
                .sum();
            // utime and stime are fields 14 and 15; the name (field 2) may contain spaces.
            let stat = read("stat");
            let ticks = stat.rsplit_once(')').map_or(0, |(_, rest)| {
                let fields: Vec<&str> = rest.split_whitespace().collect();
                fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
            });
            out.push(ThreadCost {
                name: format!(
                    "{pid}/{} {}",
                    task.file_name().to_string_lossy(),
                    read("comm").trim()
                ),
                switches,
                ticks,
            });
        }
    }
    out
}

/// (context switches, CPU clock ticks) summed over `threads`; io-wq workers' switches only
/// when `with_io_wq` (their CPU always counts).
fn cost(threads: &[ThreadCost], with_io_wq: bool) -> (u64, u64) {
    threads.iter().fold((0, 0), |(switches, ticks), t| {
        let io_wq = t.name.split(' ').nth(1).is_some_and(is_io_wq);
        let counted = if io_wq && !with_io_wq { 0 } else { t.switches };
        (switches + counted, ticks + t.ticks)
    })
}

/// Does I/O on `image` with polling at its bound, then checks 10 s of idleness cost nothing.
fn idle_costs_nothing(image: &std::path::Path, with_io_wq: bool) {
    let fe = Frontend::start(image, &["--poll-max-us", "1000", "--iothreads", "1"]);
    let mut vmm = Client::connect(fe.socket()).expect("libblkio connect");
    let data = pattern(0x1d1e, 4096);
    let q = vmm.queue(0);
    for i in 0..2000u64 {
        q.write_at((i % 256) * 4096, &data).unwrap();
    }
    assert_eq!(q.read_at(0, data.len()).unwrap(), data);

    let mut pids = vec![fe.pid()];
    pids.extend(descendants_of(fe.pid()));
    assert!(pids.len() >= 3, "frontend, spawner and iothread: {pids:?}");
    // Let the last completions' effects settle (the worker's final epoll_wait, logging).
    std::thread::sleep(Duration::from_millis(200));
    let threads_before = threads(&pids);
    std::thread::sleep(IDLE);
    let threads_after = threads(&pids);
    for now in &threads_after {
        let then = threads_before.iter().find(|t| t.name == now.name);
        if then != Some(now) {
            println!("changed: {then:?} -> {now:?}");
        }
    }
    let before = cost(&threads_before, with_io_wq);
    let after = cost(&threads_after, with_io_wq);
    println!(
        "{} processes idle for {IDLE:?}: {} context switches, {} CPU ticks",
        pids.len(),
        after.0 - before.0,
        after.1 - before.1
    );
    assert_eq!(after.0, before.0, "the idle disk's threads were woken");
    assert_eq!(after.1, before.1, "the idle disk's threads used CPU");
    // Still serving.
    assert_eq!(q.read_at(0, data.len()).unwrap(), data);
    drop(vmm);
    fe.finish();
}

#[test]
fn an_idle_disk_on_tmpfs_is_never_woken() {
    let dir = TempDir::new_in(std::path::Path::new("/dev/shm"), "idle-shm");
    idle_costs_nothing(&create_image(&dir.join("disk.img"), 16 << 20), true);
}

#[test]
fn an_idle_disk_on_a_real_disk_is_never_woken() {
    let dir = TempDir::new_in(std::path::Path::new("/var/tmp"), "idle-disk");
    idle_costs_nothing(&create_image(&dir.join("disk.img"), 16 << 20), false);
}

/// What `requests` writes `gap` apart cost the processes of a disk started with `args`, after
/// a burst of back-to-back writes that opens the polling windows.
fn cost_of_sparse_writes(
    image: &std::path::Path,
    args: &[&str],
    requests: u64,
    gap: Duration,
) -> Duration {
    let fe = Frontend::start(image, args);
    let mut vmm = Client::connect(fe.socket()).expect("libblkio connect");
    let data = pattern(0x5bac, 4096);
    let q = vmm.queue(0);
    for i in 0..1000u64 {
        q.write_at((i % 256) * 4096, &data).unwrap();
    }
    let mut pids = vec![fe.pid()];
    pids.extend(descendants_of(fe.pid()));
    let before = cost(&threads(&pids), true);
    let started = Instant::now();
    for i in 0..requests {
        q.write_at((i % 256) * 4096, &data).unwrap();
        std::thread::sleep(gap);
    }
    let elapsed = started.elapsed();
    let after = cost(&threads(&pids), true);
    // SAFETY: sysconf has no memory effects.
    let ticks_per_second = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).unwrap();
    let cpu = Duration::from_millis((after.1 - before.1) * 1000 / ticks_per_second);
    println!(
        "{args:?}: {requests} writes {gap:?} apart in {elapsed:?}: {cpu:?} CPU, {} context switches",
        after.0 - before.0
    );
    assert_eq!(q.read_at(0, data.len()).unwrap(), data);
    drop(vmm);
    fe.finish();
    cpu
}

/// Writes 5 ms apart on a disk whose polling bound is 1 ms: no wait is short enough for
/// polling to catch, so after the first the windows stay closed and the disk costs what the
/// same disk costs with polling off. Spinning out the bound after each write would cost up to
/// 1 ms per write and poller (measured with the window kept open: 250 ms more for 200).
#[test]
fn requests_further_apart_than_the_bound_are_not_polled_for() {
    const REQUESTS: u64 = 200;
    const GAP: Duration = Duration::from_millis(5);
    let dir = TempDir::new_in(std::path::Path::new("/dev/shm"), "poll-bound");
    let image = create_image(&dir.join("disk.img"), 16 << 20);
    let off = ["--poll-max-us", "0", "--iothreads", "1"];
    let polled = ["--poll-max-us", "1000", "--iothreads", "1"];
    let without = cost_of_sparse_writes(&image, &off, REQUESTS, GAP);
    let with = cost_of_sparse_writes(&image, &polled, REQUESTS, GAP);
    // Half a millisecond per write: half of what spinning out the bound once would cost.
    let allowance = Duration::from_micros(500) * REQUESTS as u32;
    assert!(
        with < without + allowance,
        "{with:?} of CPU with a 1 ms polling bound, {without:?} without, for {REQUESTS} writes \
         {GAP:?} apart: the disk polled for them"
    );
}
