//! An idle disk costs nothing: after I/O with the adaptive polling at its largest bound (so its
//! window has opened), a connected but idle disk's processes — the frontend, its iothread
//! spawner and its iothreads, every thread of each — are not woken once and use no CPU for
//! 10 s. A worker that kept polling, or any periodic timer, shows up here.
//!
//! On a tmpfs image every thread counts (its transfers run inline, so io_uring never starts a
//! worker thread). On a file on the real disk the kernel's io-wq worker threads of the
//! iothread's io_uring (`iou-wrk-*`, started for writes that allocate blocks) are left out:
//! the kernel keeps the last one and wakes it every 5 s to check whether it may exit, a cost
//! of io_uring itself that blkplane does not schedule. They are still checked to use no CPU.

use std::time::Duration;

use blkplane_tests::frontend::descendants_of;
use blkplane_tests::{create_image, pattern, Client, Frontend, TempDir};

/// How long the disk stays idle while it is watched.
const IDLE: Duration = Duration::from_secs(10);

/// Whether a thread name is one of io_uring's kernel worker threads.
fn is_io_wq(comm: &str) -> bool {
    comm.starts_with("iou-wrk-")
}

/// (context switches, CPU clock ticks) summed over the threads of `pids` (io-wq workers only
/// when `with_io_wq`).
fn cost(pids: &[u32], with_io_wq: bool) -> (u64, u64) {
    let mut switches = 0;
    let mut ticks = 0;
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for task in tasks.filter_map(Result::ok) {
            let dir = task.path();
            let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
            let stat = std::fs::read_to_string(dir.join("stat")).unwrap_or_default();
            // utime and stime are fields 14 and 15; the name (field 2) may contain spaces.
            if let Some((_, rest)) = stat.rsplit_once(')') {
                let fields: Vec<&str> = rest.split_whitespace().collect();
                ticks += fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
            }
            if is_io_wq(comm.trim()) && !with_io_wq {
                continue;
            }
            for line in status.lines() {
                if let Some(v) = line
                    .strip_prefix("voluntary_ctxt_switches:")
                    .or_else(|| line.strip_prefix("nonvoluntary_ctxt_switches:"))
                {
                    switches += v.trim().parse::<u64>().unwrap();
                }
            }
        }
    }
    (switches, ticks)
}

/// Every thread of `pids` with its name and counters, to say which one was woken.
fn per_thread(pids: &[u32]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for task in tasks.filter_map(Result::ok) {
            let dir = task.path();
            let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
            let switches: Vec<&str> = status
                .lines()
                .filter(|l| l.contains("ctxt_switches"))
                .collect();
            out.push((
                format!(
                    "{pid}/{} {}",
                    task.file_name().to_string_lossy(),
                    comm.trim()
                ),
                switches.join(" "),
            ));
        }
    }
    out
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
    let before = cost(&pids, with_io_wq);
    let threads_before = per_thread(&pids);
    std::thread::sleep(IDLE);
    let after = cost(&pids, with_io_wq);
    for (task, now) in per_thread(&pids) {
        let then = threads_before
            .iter()
            .find(|(t, _)| *t == task)
            .map(|(_, c)| c.clone());
        if then.as_ref() != Some(&now) {
            println!("changed: {task}: {then:?} -> {now:?}");
        }
    }
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
