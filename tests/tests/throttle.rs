//! I/O limits measured from a real client: libblkio drives a frontend while its limits are
//! set, changed and cleared over the admin channel (what blkplaned's SetThrottle sends), and
//! the completions it sees are counted over windows.
//!
//! - 1000 IOPS gives 1000 ± 10 %; 20 MiB/s of 128 KiB reads gives 20 ± 10 %; a limit changed
//!   mid-run holds within a second; clearing the limits gives the full rate back; the time
//!   requests waited shows in the statistics;
//! - a burst (iops_total_max 2000 for max_length 2 s over an average of 1000) lets 2000 IOPS
//!   through while the bucket fills — (2000 × 2) / (2000 − 1000) = 4 s by QEMU's model — and
//!   then settles at 1000;
//! - two disks, each in its own frontend process, in one throttle group of 1000 IOPS get
//!   about 500 each while both are busy, and one gets about 1000 when the other is idle.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use blkplane_proto::v1::{frontend_request, frontend_response, SetThrottle, ThrottleLimits};
use blkplane_tests::client::errno_name;
use blkplane_tests::*;

const MIB: u64 = 1 << 20;
const KIB: usize = 1024;

/// Sends SetThrottle to a frontend's admin socket.
fn set_throttle(admin: &Path, limits: ThrottleLimits, group: Option<(&Path, u32)>) {
    let request = SetThrottle {
        limits: Some(limits),
        group_state_path: group.map_or(String::new(), |(p, _)| p.to_str().unwrap().into()),
        member_index: group.map_or(0, |(_, i)| i),
    };
    // The group's file travels with the request, as blkplaned sends it.
    let file = group.map(|(p, _)| File::options().read(true).write(true).open(p).unwrap());
    match blkplane_tests::admin::call_with_file(
        admin,
        frontend_request::Request::SetThrottle(request),
        file.as_ref(),
    ) {
        Ok(frontend_response::Response::ThrottleSet(_)) => {}
        other => panic!("SetThrottle: {other:?}"),
    }
}

/// A frontend with an admin socket, on a fresh image.
fn frontend(dir: &TempDir, name: &str) -> (Frontend, PathBuf) {
    let image = create_image(&dir.join(&format!("{name}.img")), 64 * MIB);
    let admin = dir.join(&format!("{name}.admin"));
    let fe = Frontend::start(&image, &["--admin-socket", admin.to_str().unwrap()]);
    (fe, admin)
}

/// Reads of `block` bytes at queue depth `depth`, round and round a 32 MiB area, until
/// stopped; every completion's time is recorded.
struct Load {
    stop: Arc<AtomicBool>,
    done: Arc<Mutex<Vec<Instant>>>,
    thread: Option<JoinHandle<Result<(), String>>>,
}

impl Load {
    fn start(socket: &Path, block: usize, depth: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(Mutex::new(Vec::with_capacity(1 << 16)));
        let mut client = Client::connect_with(
            socket,
            &ClientOptions {
                buf_size: block * depth,
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("connect: {e}"));
        let (s, d) = (Arc::clone(&stop), Arc::clone(&done));
        let thread = std::thread::spawn(move || {
            let q = client.queue(0);
            let area = (32 * MIB) / block as u64;
            let mut next = 0u64;
            let op = |i: usize, n: u64| blkplane_tests::Op::Read {
                offset: (n % area) * block as u64,
                buf: i * block,
                len: block,
            };
            for i in 0..depth {
                q.submit(&op(i, next), i);
                next += 1;
            }
            while !s.load(Ordering::Relaxed) {
                for (i, ret) in q.wait(1) {
                    if ret != 0 {
                        return Err(format!("read failed: {}", errno_name(-ret)));
                    }
                    d.lock().unwrap().push(Instant::now());
                    q.submit(&op(i, next), i);
                    next += 1;
                }
            }
            while q.in_flight() > 0 {
                q.wait(1);
            }
            Ok(())
        });
        Load {
            stop,
            done,
            thread: Some(thread),
        }
    }

    /// Completions per second in `[from, to)`.
    fn rate(&self, from: Instant, to: Instant) -> f64 {
        let n = self
            .done
            .lock()
            .unwrap()
            .iter()
            .filter(|&&t| t >= from && t < to)
            .count();
        n as f64 / (to - from).as_secs_f64()
    }

    /// Waits until `at`, then the rate over `[at - window, at)`.
    fn rate_until(&self, at: Instant, window: Duration) -> f64 {
        if let Some(left) = at.checked_duration_since(Instant::now()) {
            std::thread::sleep(left);
        }
        self.rate(at - window, at)
    }

    fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().unwrap().unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[track_caller]
fn assert_near(what: &str, got: f64, want: f64, tolerance: f64) {
    assert!(
        (got - want).abs() <= want * tolerance,
        "{what}: {got:.0}/s, want {want:.0} ± {:.0}%",
        tolerance * 100.0
    );
    eprintln!(
        "throttle: {what}: {got:.0}/s (want {want:.0} ± {:.0}%)",
        tolerance * 100.0
    );
}

/// Two loads started together on a group of `total` IOPS: over seconds 1 to 4, together
/// `total` ± 10 %, each half of it ± 15 %.
#[track_caller]
fn assert_shared_fairly(what: &str, a: &Load, b: &Load, total: f64) {
    let at = Instant::now() + Duration::from_secs(4);
    let ra = a.rate_until(at, Duration::from_secs(3));
    let rb = b.rate(at - Duration::from_secs(3), at);
    assert_near(&format!("{what}: together"), ra + rb, total, 0.1);
    assert_near(&format!("{what}: disk a"), ra, total / 2.0, 0.15);
    assert_near(&format!("{what}: disk b"), rb, total / 2.0, 0.15);
}

fn iops(avg: u64) -> ThrottleLimits {
    blkplane_throttle::wire::named(&[("iops_total", avg)]).unwrap()
}

#[test]
fn limits_hold_change_live_and_clear() {
    let dir = TempDir::new("throttle");
    let (fe, admin) = frontend(&dir, "a");
    let load = Load::start(fe.socket(), 4 * KIB, 8);
    let t0 = Instant::now();
    let unlimited = load.rate_until(t0 + Duration::from_secs(1), Duration::from_millis(800));

    // 1000 IOPS: the first 100 ms of burst go at once; measured after it.
    set_throttle(&admin, iops(1000), None);
    let set = Instant::now();
    let limited = load.rate_until(set + Duration::from_secs(3), Duration::from_secs(2));
    assert_near("iops_total 1000", limited, 1000.0, 0.1);
    assert!(
        unlimited > 3000.0,
        "unlimited reads ran at only {unlimited:.0}/s: the limit is not what slows them"
    );

    // Changed while the load runs: in force within a second.
    set_throttle(&admin, iops(400), None);
    let changed = Instant::now();
    let after = load.rate_until(changed + Duration::from_secs(3), Duration::from_secs(2));
    assert_near("changed to iops_total 400 (from 1 s on)", after, 400.0, 0.1);
    let first_second = load.rate(
        changed + Duration::from_millis(200),
        changed + Duration::from_secs(1),
    );
    assert!(
        first_second < 600.0,
        "the new limit took more than a second: {first_second:.0}/s in its first second"
    );

    // The wait shows in the statistics.
    let stats = blkplane_tests::admin::stats(&admin).unwrap();
    let q = &stats.queues[0];
    assert!(
        q.throttled_ops > 1000 && q.throttled_ns > 1_000_000_000,
        "{q:?}"
    );

    // Cleared: no request waits any more, and they go far faster than the last limit (400/s).
    // Not against the unlimited rate: the other tests of this file run beside this one and
    // take this machine's two CPUs at different times.
    set_throttle(&admin, ThrottleLimits::default(), None);
    let cleared = Instant::now();
    std::thread::sleep(Duration::from_millis(300));
    let waited_before = blkplane_tests::admin::stats(&admin).unwrap().queues[0].throttled_ops;
    let free = load.rate_until(
        cleared + Duration::from_millis(1500),
        Duration::from_secs(1),
    );
    let waited_after = blkplane_tests::admin::stats(&admin).unwrap().queues[0].throttled_ops;
    assert_eq!(
        waited_after, waited_before,
        "requests still waited for limits after they were cleared"
    );
    assert!(
        free > 3000.0,
        "after clearing: {free:.0}/s (unlimited was {unlimited:.0}/s)"
    );
    eprintln!("throttle: unlimited {unlimited:.0}/s, after clearing {free:.0}/s");
    load.stop();

    // Bandwidth: 20 MiB/s of 128 KiB reads.
    let load = Load::start(fe.socket(), 128 * KIB, 4);
    set_throttle(
        &admin,
        blkplane_throttle::wire::named(&[("bps_total", 20 * MIB)]).unwrap(),
        None,
    );
    let set = Instant::now();
    let per_second = load.rate_until(set + Duration::from_secs(3), Duration::from_secs(2));
    // 128 KiB per read: eight reads per MiB.
    assert_near(
        "bps_total 20 MiB/s in 128 KiB reads (MiB/s)",
        per_second / 8.0,
        20.0,
        0.1,
    );
    load.stop();
    fe.finish();
}

#[test]
fn a_burst_goes_at_the_max_rate_then_settles_at_the_average() {
    let dir = TempDir::new("throttle-burst");
    let (fe, admin) = frontend(&dir, "b");
    // Set before any I/O: the buckets start empty.
    set_throttle(
        &admin,
        blkplane_throttle::wire::named(&[
            ("iops_total", 1000),
            ("iops_total_max", 2000),
            ("iops_total_max_length", 2),
        ])
        .unwrap(),
        None,
    );
    let load = Load::start(fe.socket(), 4 * KIB, 8);
    let t0 = Instant::now();
    // QEMU's model: the main bucket (2000 × 2 = 4000 operations) fills at 2000 − 1000 per
    // second while the burst bucket holds the rate at 2000: 4 s of burst, then 1000.
    let burst = load.rate_until(t0 + Duration::from_millis(3500), Duration::from_secs(3));
    assert_near("burst (iops_total_max 2000 for 2 s)", burst, 2000.0, 0.1);
    let settled = load.rate_until(t0 + Duration::from_secs(7), Duration::from_secs(2));
    assert_near("after the burst (iops_total 1000)", settled, 1000.0, 0.1);
    load.stop();
    fe.finish();
}

#[test]
fn a_group_shares_its_limits_fairly_between_processes() {
    let dir = TempDir::new("throttle-group");
    let (fe_a, admin_a) = frontend(&dir, "a");
    let (fe_b, admin_b) = frontend(&dir, "b");
    // What blkplaned does for a group: a zero-filled state file every member maps.
    let group = dir.join("g.state");
    std::fs::File::create(&group)
        .unwrap()
        .set_len(blkplane_throttle::GROUP_STATE_LEN as u64)
        .unwrap();
    set_throttle(&admin_a, iops(1000), Some((&group, 0)));
    set_throttle(&admin_b, iops(1000), Some((&group, 1)));
    let load_a = Load::start(fe_a.socket(), 4 * KIB, 8);
    let load_b = Load::start(fe_b.socket(), 4 * KIB, 8);
    assert_shared_fairly("group of 1000, both busy", &load_a, &load_b, 1000.0);
    // b goes idle: a gets the whole group.
    load_b.stop();
    let idle = Instant::now();
    let alone = load_a.rate_until(idle + Duration::from_secs(3), Duration::from_secs(2));
    assert_near("group of 1000: disk a alone", alone, 1000.0, 0.1);
    load_a.stop();
    fe_a.finish();
    fe_b.finish();
}

/// The same through blkplaned, as an operator does it: `blkplanectl disk throttle` puts two
/// disks in one group (blkplaned creates the group's file and tells both frontends), their
/// VMMs share 1000 IOPS; a limit set on one member changes the group's; `--clear` lifts it.
#[test]
fn blkplanectl_throttles_a_group_of_disks() {
    use blkplane_tests::daemon::Daemon;
    let d = Daemon::start("throttle-daemon", &[]);
    let events = blkplane_tests::daemon::Watcher::start(&d);
    let dir = TempDir::new("throttle-images");
    let mut sockets = Vec::new();
    for id in ["a", "b"] {
        let image = create_image(&dir.join(&format!("{id}.img")), 64 * MIB);
        let disk = d.ctl_json(&["disk", "add", id, "--image", image.to_str().unwrap()]);
        sockets.push(PathBuf::from(disk.get("config").get("vhost_socket").str()));
    }
    d.ctl_ok(&[
        "disk",
        "throttle",
        "a",
        "--iops-total",
        "1000",
        "--group",
        "g",
    ]);
    let b = d.ctl_json(&["disk", "throttle", "b", "--group", "g"]);
    assert_eq!(b.get("limits").get("iops_total").u64(), 1000, "{b:?}");
    // Each change is an event of the disks it changed.
    for id in ["a", "b"] {
        let e = events.wait("throttle_changed", id);
        assert!(e.get("message").str().contains("group g"), "{e:?}");
    }
    let load_a = Load::start(&sockets[0], 4 * KIB, 8);
    let load_b = Load::start(&sockets[1], 4 * KIB, 8);
    assert_shared_fairly("blkplaned group g of 1000", &load_a, &load_b, 1000.0);
    // Set on b, it is the group's: 400 together.
    d.ctl_ok(&["disk", "throttle", "b", "--iops-total", "400"]);
    let changed = Instant::now();
    let at = changed + Duration::from_secs(3);
    let a = load_a.rate_until(at, Duration::from_secs(2));
    let b = load_b.rate(at - Duration::from_secs(2), at);
    assert_near("group g changed to 400, together", a + b, 400.0, 0.1);
    for id in ["a", "b"] {
        d.ctl_ok(&["disk", "throttle", id, "--clear"]);
    }
    let cleared = Instant::now();
    let at = cleared + Duration::from_millis(1500);
    let a = load_a.rate_until(at, Duration::from_secs(1));
    assert!(a > 3000.0, "disk a after --clear: {a:.0}/s");
    // blkplanectl stats reports the waits per queue.
    let stats = d.ctl_json(&["stats", "a"]);
    let q = &stats.arr()[0].get("queues").arr()[0];
    assert!(
        q.get("throttled_ops").u64() > 1000 && q.get("throttled_ns").u64() > 1_000_000_000,
        "{q:?}"
    );
    load_a.stop();
    load_b.stop();
}
