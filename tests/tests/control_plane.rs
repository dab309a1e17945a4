//! The control plane end to end, with real processes and real gRPC: `blkplaned` started here,
//! driven with `blkplanectl` (whose JSON output is read back), disks served by real frontends
//! and exercised with libblkio.
//!
//! - three disks added, verified I/O on all three; one removed while the other two keep going
//!   without a single error;
//! - blkplaned killed with SIGKILL during I/O (the I/O goes on), restarted: same disks, same
//!   frontend pids;
//! - a frontend killed with SIGKILL: restarted on the same socket, a new client verifies the
//!   data;
//! - a disk resized, the new capacity seen by a new client;
//! - a crash loop marks a disk failed; the frontend restart count survives a blkplaned
//!   restart (SIGKILL and SIGTERM);
//! - blkplanectl over TCP with mutual TLS, and the refusals of missing or foreign
//!   certificates;
//! - a disk's log capped and rotated (copytruncate), the copies removed with the disk;
//! - every kind of bad input refused with its status code and the field's name, leaving no
//!   process, socket or state entry behind;
//! - drain and resume under QD-8 writes (nothing completes and the image does not change
//!   while drained, every waiting request completes after resume, data verified; the drained
//!   state survives an iothread and a frontend SIGKILL);
//! - migration blockers: operator ones added, listed, persisted, removed; automatic ones
//!   (draining, restarts, a VMM that did not negotiate dirty logging); the frontend refuses
//!   LOG_ALL with a REPLY_ACK error and the session goes on;
//! - live migration on one node: an incoming disk on the source's image does not retire the
//!   source while the source's rings run (an event says both serve), and takes over once they
//!   stopped: the source retired, its data read through the destination.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use blkplane_tests::client::{check_fresh_connection, errno_name};
use blkplane_tests::daemon::*;
use blkplane_tests::raw::RawDevice;
use blkplane_tests::*;
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK;

const MIB: u64 = 1 << 20;
/// Bytes per request of the background I/O.
const CHUNK: usize = 64 * 1024;
/// Chunks per round of the background I/O (it covers CHUNK × CHUNKS bytes of the disk).
const CHUNKS: u64 = 64;

// ---------------------------------------------------------------------------------------------
// Background I/O.

/// A thread doing write + read-back rounds over the first CHUNK × CHUNKS bytes of a disk
/// through its own libblkio connection, until stopped.
struct IoLoad {
    stop: Arc<AtomicBool>,
    ops: Arc<AtomicU64>,
    error: Arc<Mutex<Option<String>>>,
    handle: Option<JoinHandle<Result<u64, String>>>,
}

/// The seed of chunk `chunk` in round `round` of disk `disk`.
fn seed(disk: u64, round: u64, chunk: u64) -> u64 {
    (disk << 48) | (round << 16) | chunk
}

/// The rounds of [`IoLoad`]; returns the last round whose every chunk was written and verified.
fn io_rounds(socket: &Path, disk: u64, stop: &AtomicBool, ops: &AtomicU64) -> Result<u64, String> {
    let mut c =
        Client::connect(socket).map_err(|e| format!("connect to {}: {e}", socket.display()))?;
    let q = c.queue(0);
    let mut done_round = 0;
    for round in 1.. {
        for chunk in 0..CHUNKS {
            let offset = chunk * CHUNK as u64;
            let data = pattern(seed(disk, round, chunk), CHUNK);
            q.write_at(offset, &data)
                .map_err(|e| format!("round {round} write at {offset}: {}", errno_name(e)))?;
            let back = q
                .read_at(offset, CHUNK)
                .map_err(|e| format!("round {round} read at {offset}: {}", errno_name(e)))?;
            if back != data {
                return Err(format!("round {round}: wrong data at {offset}"));
            }
            ops.fetch_add(2, Ordering::SeqCst);
        }
        done_round = round;
        if stop.load(Ordering::SeqCst) {
            break;
        }
    }
    Ok(done_round)
}

impl IoLoad {
    fn start(socket: &Path, disk: u64) -> IoLoad {
        let stop = Arc::new(AtomicBool::new(false));
        let ops = Arc::new(AtomicU64::new(0));
        let error = Arc::new(Mutex::new(None));
        let (s, o, e) = (Arc::clone(&stop), Arc::clone(&ops), Arc::clone(&error));
        let socket = socket.to_path_buf();
        let handle = std::thread::spawn(move || {
            let r = io_rounds(&socket, disk, &s, &o);
            if let Err(msg) = &r {
                *e.lock().unwrap() = Some(msg.clone());
            }
            r
        });
        IoLoad {
            stop,
            ops,
            error,
            handle: Some(handle),
        }
    }

    fn ops(&self) -> u64 {
        self.ops.load(Ordering::SeqCst)
    }

    /// Waits until at least `n` more requests completed than now (bounded); panics with the
    /// I/O error if the I/O failed.
    #[track_caller]
    fn wait_progress(&self, n: u64, what: &str) {
        let target = self.ops() + n;
        let ok = wait_for(TIMEOUT, || {
            (self.ops() >= target || self.error.lock().unwrap().is_some()).then_some(())
        })
        .is_some();
        if let Some(e) = self.error.lock().unwrap().as_ref() {
            panic!("I/O ({what}) failed: {e}");
        }
        assert!(ok, "I/O ({what}) made no progress within {TIMEOUT:?}");
    }

    /// Stops after the current round; returns the last completed round, or the first error.
    fn finish(mut self) -> Result<u64, String> {
        self.stop.store(true, Ordering::SeqCst);
        match self.handle.take().map(JoinHandle::join) {
            Some(Ok(r)) => r,
            _ => Err("the I/O thread panicked".into()),
        }
    }
}

impl Drop for IoLoad {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Reads the disk through a new connection and checks it holds round `round` of `disk`.
#[track_caller]
fn verify_round(socket: &Path, disk: u64, round: u64) {
    let mut c = Client::connect(socket).unwrap_or_else(|e| panic!("connect: {e}"));
    let q = c.queue(0);
    for chunk in 0..CHUNKS {
        let offset = chunk * CHUNK as u64;
        let back = q
            .read_at(offset, CHUNK)
            .unwrap_or_else(|e| panic!("read at {offset}: {}", errno_name(e)));
        assert_same_data(
            &format!("chunk {chunk} of round {round}"),
            &back,
            &pattern(seed(disk, round, chunk), CHUNK),
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The tests.

/// The whole life of three disks: add, I/O, remove one under load of the others, blkplaned
/// SIGKILLed and re-adopting, a frontend SIGKILLed and restarted, a resize, a forced removal.
#[test]
fn three_disks_through_crashes_and_restarts() {
    let d = Daemon::start("cp", &[]);
    let images = TempDir::new("cpimg");
    let watcher = Watcher::start(&d);

    // Three disks; the first with two queues and two iothreads pinned to CPU 0, the last with
    // 4 KiB blocks.
    let img: Vec<PathBuf> = (0..3)
        .map(|i| create_image(&images.join(&format!("d{i}.img")), 32 * MIB))
        .collect();
    let d0 = add_disk(
        &d,
        "d0",
        &img[0],
        &[
            "--num-queues",
            "2",
            "--iothreads",
            "2",
            "--iothread-cpus",
            "0",
        ],
    );
    let d1 = add_disk(&d, "d1", &img[1], &["--serial", "SERIAL-1"]);
    let d2 = add_disk(&d, "d2", &img[2], &["--block-size", "4096"]);
    for (disk, id) in [(&d0, "d0"), (&d1, "d1"), (&d2, "d2")] {
        assert_eq!(disk.get("id").str(), id);
        assert_eq!(disk.get("state").str(), "ready", "{disk:?}");
        assert!(disk.get("frontend_pid").u64() > 0);
        assert_eq!(disk.get("capacity_bytes").u64(), 32 * MIB);
        assert_eq!(
            socket_of(disk),
            d.disks_dir().join(format!("{id}.sock")),
            "default vhost-user socket"
        );
        watcher.wait("added", id);
    }
    assert_eq!(d0.get("iothread_pids").arr().len(), 2);
    assert_eq!(d0.get("config").get("iothread_cpus").str(), "0");
    for pid in d0.get("iothread_pids").arr() {
        let status = std::fs::read_to_string(format!("/proc/{}/status", pid.u64())).unwrap();
        let cpus = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .map(str::trim);
        assert_eq!(
            cpus,
            Some("0"),
            "iothread {} of d0 is not pinned",
            pid.u64()
        );
    }
    assert_eq!(d.state_ids(), ["d0", "d1", "d2"]);
    let listed = d.ctl_json(&["disk", "list"]);
    assert_eq!(listed.arr().len(), 3);

    // Verified I/O on all three.
    let sockets: Vec<PathBuf> = [&d0, &d1, &d2].iter().map(|j| socket_of(j)).collect();
    let load0 = IoLoad::start(&sockets[0], 0);
    let load1 = IoLoad::start(&sockets[1], 1);
    let load2 = IoLoad::start(&sockets[2], 2);
    load0.wait_progress(100, "d0");
    load1.wait_progress(100, "d1");
    load2.wait_progress(100, "d2");
    for id in ["d0", "d1", "d2"] {
        d.wait_disk(id, "connected", |j| j.get("vmm_connected").bool());
        watcher.wait("connected", id);
    }
    let stats = d.ctl_json(&["stats", "d0"]);
    assert!(
        stats.arr()[0].get("total").get("write_ops").u64() > 0,
        "{stats:?}"
    );
    assert_eq!(stats.arr()[0].get("queues").arr().len(), 2);

    // d2 is refused removal while its VMM is connected; once it left, it goes, while d0 and
    // d1 keep doing I/O.
    d.ctl_refused(&["disk", "remove", "d2"], "FAILED_PRECONDITION", "VMM");
    let pid2 = d.disk("d2").get("frontend_pid").u64() as u32;
    load2.finish().expect("I/O on d2");
    d.wait_disk("d2", "disconnected", |j| !j.get("vmm_connected").bool());
    watcher.wait("disconnected", "d2");
    let before = (load0.ops(), load1.ops());
    d.ctl_ok(&["disk", "remove", "d2"]);
    watcher.wait("removed", "d2");
    assert!(!alive(pid2), "d2's frontend {pid2} survived its removal");
    assert!(!sockets[2].exists(), "d2's socket was left behind");
    assert_eq!(d.state_ids(), ["d0", "d1"]);
    assert!(
        !d.runtime_files().iter().any(|f| f.starts_with("d2.")),
        "{:?}",
        d.runtime_files()
    );
    d.ctl_refused(&["disk", "show", "d2"], "NOT_FOUND", "d2");
    load0.wait_progress(100, "d0 after removing d2");
    load1.wait_progress(100, "d1 after removing d2");
    assert!(load0.ops() > before.0 && load1.ops() > before.1);

    // blkplaned SIGKILLed during I/O: the disks do not notice.
    let pids: Vec<u64> = ["d0", "d1"]
        .iter()
        .map(|id| d.disk(id).get("frontend_pid").u64())
        .collect();
    drop(watcher);
    d.kill9();
    load0.wait_progress(100, "d0 without blkplaned");
    load1.wait_progress(100, "d1 without blkplaned");
    // Restarted: the same disks, served by the same processes, still connected.
    d.spawn();
    let watcher = Watcher::start(&d);
    let listed = d.ctl_json(&["disk", "list"]);
    let ids: Vec<&str> = listed.arr().iter().map(|j| j.get("id").str()).collect();
    assert_eq!(ids, ["d0", "d1"]);
    for (id, pid) in ["d0", "d1"].iter().zip(&pids) {
        let j = d.wait_disk(id, "connected after the restart", |j| {
            j.get("state").str() == "connected"
        });
        assert_eq!(
            j.get("frontend_pid").u64(),
            *pid,
            "{id} was not adopted: {j:?}"
        );
        assert_eq!(j.get("restarts").u64(), 0);
    }
    load0.wait_progress(100, "d0 after the restart");
    load1.wait_progress(100, "d1 after the restart");

    // A frontend SIGKILLed: restarted on the same socket; a new client finds the data.
    let round0 = load0.finish().expect("I/O on d0");
    let round1 = load1.finish().expect("I/O on d1");
    d.wait_disk("d0", "disconnected", |j| !j.get("vmm_connected").bool());
    let old = pids[0] as u32;
    assert!(cmdline(old)
        .iter()
        .any(|a| a.starts_with("--admin-socket=")));
    kill(old, libc::SIGKILL);
    let j = d.wait_disk("d0", "restarted", |j| {
        j.get("state").str() == "ready" && j.get("frontend_pid").u64() as u32 != old
    });
    assert_eq!(j.get("restarts").u64(), 1, "{j:?}");
    assert_eq!(socket_of(&j), sockets[0]);
    watcher.wait("exited", "d0");
    watcher.wait("restarted", "d0");
    verify_round(&sockets[0], 0, round0);
    check_fresh_connection(&sockets[0], 16 * MIB, 77);

    // Grow d1 while nobody is connected; a new client sees the new size. Shrinking is refused.
    let out = d.ctl_json(&["disk", "resize", "d1", "48M"]);
    assert_eq!(out.get("capacity_bytes").u64(), 48 * MIB);
    let resized = watcher.wait("resized", "d1");
    assert!(resized
        .get("message")
        .str()
        .contains(&(48 * MIB).to_string()));
    d.ctl_refused(
        &["disk", "resize", "d1", "32M"],
        "FAILED_PRECONDITION",
        "new_size_bytes",
    );
    d.ctl_refused(
        &["disk", "resize", "d1", "50000001"],
        "INVALID_ARGUMENT",
        "new_size_bytes",
    );
    assert_eq!(d.disk("d1").get("capacity_bytes").u64(), 48 * MIB);
    assert_eq!(std::fs::metadata(&img[1]).unwrap().len(), 48 * MIB);
    let client = Client::connect(&sockets[1]).unwrap_or_else(|e| panic!("connect: {e}"));
    assert_eq!(client.capacity(), 48 * MIB);
    drop(client);
    verify_round(&sockets[1], 1, round1);
    check_fresh_connection(&sockets[1], 40 * MIB, 78);

    // Forced removal while a VMM is connected.
    let mut client = Client::connect(&sockets[1]).unwrap_or_else(|e| panic!("connect: {e}"));
    client.queue(0).write_at(0, &pattern(5, 4096)).unwrap();
    d.wait_disk("d1", "connected", |j| j.get("vmm_connected").bool());
    d.ctl_refused(&["disk", "remove", "d1"], "FAILED_PRECONDITION", "d1");
    d.ctl_ok(&["disk", "remove", "d1", "--force"]);
    drop(client);
    d.ctl_ok(&["disk", "remove", "d0"]);
    assert!(d.state_ids().is_empty());
    assert_eq!(d.frontends(), Vec::<u32>::new());
    assert_eq!(d.runtime_files(), Vec::<String>::new());
    drop(watcher);
    d.stop();
}

/// Every kind of bad input is refused with its status code and a message naming the field,
/// and leaves no process, socket, file or state entry behind.
#[test]
fn bad_input_is_refused_without_leftovers() {
    let d = Daemon::start("cpbad", &[]);
    let dir = TempDir::new("cpbadimg");
    let good_img = create_image(&dir.join("good.img"), 8 * MIB);
    let other_img = create_image(&dir.join("other.img"), 8 * MIB);
    let tiny_img = create_image(&dir.join("tiny.img"), 100);
    let link = dir.join("link.img");
    std::os::unix::fs::symlink(&good_img, &link).unwrap();
    let good = add_disk(&d, "good", &good_img, &[]);
    let good_socket = socket_of(&good);
    let good_pid = good.get("frontend_pid").u64() as u32;

    let other = other_img.to_str().unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let long_id = "x".repeat(65);
    let missing = s(&dir.join("missing.img"));
    let dirpath = s(dir.path());
    let tiny = s(&tiny_img);
    let goodp = s(&good_img);
    let linkp = s(&link);
    let good_sock = s(&good_socket);
    let traversal = format!(
        "{}/../{}/t.sock",
        dirpath,
        dir.path().file_name().unwrap().to_str().unwrap()
    );
    let nodir = s(&dir.join("nodir/x.sock"));
    let long_sock = format!("{}/{}.sock", dirpath, "s".repeat(110));
    let state_file = s(&d.state_dir.join("state.json"));
    let cases: Vec<(Vec<&str>, &str, &str)> = vec![
        (vec!["bad/id", "--image", other], "INVALID_ARGUMENT", "id"),
        (vec![".hidden", "--image", other], "INVALID_ARGUMENT", "id"),
        (vec![&long_id, "--image", other], "INVALID_ARGUMENT", "id"),
        (vec!["good", "--image", other], "ALREADY_EXISTS", "id"),
        (
            vec!["n1", "--image", &missing],
            "NOT_FOUND",
            "settings.image",
        ),
        (
            vec!["n2", "--image", &dirpath],
            "INVALID_ARGUMENT",
            "settings.image",
        ),
        (
            vec!["n3", "--image", &tiny],
            "INVALID_ARGUMENT",
            "settings.image",
        ),
        (
            vec!["n4", "--image", &goodp],
            "ALREADY_EXISTS",
            "settings.image",
        ),
        (
            vec!["n5", "--image", &linkp],
            "ALREADY_EXISTS",
            "settings.image",
        ),
        (
            vec!["n5b", "--image", &state_file],
            "INVALID_ARGUMENT",
            "settings.image",
        ),
        (
            vec!["n6", "--image", other, "--vhost-socket", &good_sock],
            "ALREADY_EXISTS",
            "settings.vhost_socket",
        ),
        (
            vec!["n7", "--image", other, "--vhost-socket", &traversal],
            "INVALID_ARGUMENT",
            "settings.vhost_socket",
        ),
        (
            vec!["n8", "--image", other, "--vhost-socket", other],
            "INVALID_ARGUMENT",
            "settings.vhost_socket",
        ),
        (
            vec!["n9", "--image", other, "--vhost-socket", &nodir],
            "NOT_FOUND",
            "settings.vhost_socket",
        ),
        (
            vec!["n10", "--image", other, "--vhost-socket", &long_sock],
            "INVALID_ARGUMENT",
            "settings.vhost_socket",
        ),
        (
            vec!["n11", "--image", other, "--num-queues", "257"],
            "INVALID_ARGUMENT",
            "settings.num_queues",
        ),
        (
            vec!["n12", "--image", other, "--queue-size", "3"],
            "INVALID_ARGUMENT",
            "settings.queue_size",
        ),
        (
            vec!["n13", "--image", other, "--queue-size", "65536"],
            "INVALID_ARGUMENT",
            "settings.queue_size",
        ),
        (
            vec!["n14", "--image", other, "--block-size", "1024"],
            "INVALID_ARGUMENT",
            "settings.block_size",
        ),
        (
            vec!["n15", "--image", other, "--iothreads", "2"],
            "INVALID_ARGUMENT",
            "settings.iothreads",
        ),
        (
            vec![
                "n16",
                "--image",
                other,
                "--num-queues",
                "4",
                "--iothreads",
                "5",
            ],
            "INVALID_ARGUMENT",
            "settings.iothreads",
        ),
        (
            vec!["n17", "--image", other, "--serial", "123456789012345678901"],
            "INVALID_ARGUMENT",
            "settings.serial",
        ),
        (
            vec!["n18", "--image", other, "--iothread-cpus", "0-x"],
            "INVALID_ARGUMENT",
            "settings.iothread_cpus",
        ),
        (
            vec!["n19", "--image", other, "--iothread-cpus", "99999"],
            "INVALID_ARGUMENT",
            "settings.iothread_cpus",
        ),
    ];
    for (args, code, field) in &cases {
        let mut all = vec!["disk", "add"];
        all.extend_from_slice(args);
        d.ctl_refused(&all, code, field);
    }
    d.ctl_refused(&["disk", "remove", "nope"], "NOT_FOUND", "id");
    d.ctl_refused(&["disk", "show", "nope"], "NOT_FOUND", "id");
    d.ctl_refused(&["stats", "nope"], "NOT_FOUND", "id");
    d.ctl_refused(&["disk", "resize", "nope", "1G"], "NOT_FOUND", "id");
    d.ctl_refused(
        &["disk", "resize", "good", "1000"],
        "INVALID_ARGUMENT",
        "new_size_bytes",
    );
    d.ctl_refused(
        &["disk", "resize", "good", "4M"],
        "FAILED_PRECONDITION",
        "new_size_bytes",
    );
    // A command-line error is blkplanectl's own (exit status 2), not the server's.
    assert_eq!(d.ctl(&["disk", "add"]).code, Some(2));

    // Nothing behind: one disk, one frontend, its files only, no stray sockets.
    let listed = d.ctl_json(&["disk", "list"]);
    assert_eq!(listed.arr().len(), 1);
    assert_eq!(d.state_ids(), ["good"]);
    assert_eq!(d.frontends(), [good_pid]);
    assert_eq!(
        d.runtime_files(),
        ["good.admin", "good.log", "good.pid", "good.sock"]
    );
    assert!(!dir.join("t.sock").exists());
    assert_eq!(std::fs::metadata(&other_img).unwrap().len(), 8 * MIB);
    assert!(std::fs::metadata(&other_img).unwrap().is_file());
    check_fresh_connection(&good_socket, 0, 9);
}

/// A frontend that fails at start-up: AddDisk reports it with the frontend's own words
/// (INTERNAL) and leaves nothing behind. Uses a stand-in frontend, so it needs no admin
/// channel.
#[test]
fn failed_start_leaves_nothing() {
    let dir = TempDir::new("cpfail");
    let fake = dir.join("fake-frontend");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho \"fake-frontend: cannot open the image ($*)\" >&2\nexit 7\n",
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let d = Daemon::start("cpfd", &["--frontend-binary", fake.to_str().unwrap()]);
    let img = create_image(&dir.join("disk.img"), 8 * MIB);
    let err = d.ctl_refused(
        &["disk", "add", "d", "--image", img.to_str().unwrap()],
        "INTERNAL",
        "cannot open the image",
    );
    assert!(err.contains("exited with status 7"), "{err}");
    assert!(d.state_ids().is_empty());
    assert_eq!(d.runtime_files(), Vec::<String>::new());
    assert!(d.ctl_json(&["disk", "list"]).arr().is_empty());
    // The id is free for a later attempt.
    d.ctl_refused(
        &["disk", "add", "d", "--image", img.to_str().unwrap()],
        "INTERNAL",
        "exited with status 7",
    );
}

/// A frontend that keeps crashing is restarted with back-off and then marked failed, with the
/// reason; removing the failed disk leaves nothing behind.
#[test]
fn crash_loop_marks_the_disk_failed() {
    let d = Daemon::start("cploop", &["--restart-max", "3"]);
    let dir = TempDir::new("cploopimg");
    let img = create_image(&dir.join("disk.img"), 8 * MIB);
    let watcher = Watcher::start(&d);
    let mut pid = add_disk(&d, "loop", &img, &[]).get("frontend_pid").u64() as u32;
    for crash in 1..=3 {
        kill(pid, libc::SIGKILL);
        if crash < 3 {
            let j = d.wait_disk("loop", "restarted", |j| {
                j.get("state").str() == "ready" && j.get("frontend_pid").u64() as u32 != pid
            });
            assert_eq!(j.get("restarts").u64(), crash);
            pid = j.get("frontend_pid").u64() as u32;
        }
    }
    let j = d.wait_disk("loop", "failed", |j| j.get("state").str() == "failed");
    let reason = j.get("state_reason").str();
    assert!(
        reason.contains("3 crashes") && reason.contains("signal 9"),
        "{reason}"
    );
    assert_eq!(j.get("frontend_pid").u64(), 0);
    let failed = watcher.wait("failed", "loop");
    assert!(failed.get("message").str().contains("signal 9"));
    assert_eq!(d.frontends(), Vec::<u32>::new());
    d.ctl_refused(&["stats", "loop"], "FAILED_PRECONDITION", "failed");
    d.ctl_ok(&["disk", "remove", "loop"]);
    assert!(d.state_ids().is_empty());
    assert_eq!(d.runtime_files(), Vec::<String>::new());
}

/// blkplanectl's completions and the daemon's refusal to serve TCP without TLS.
#[test]
fn completions_and_listen_rules() {
    let out = Command::new(&binaries().blkplanectl)
        .args(["completions", "bash"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("blkplanectl"));
    // The global options mean nothing to `completions`: not offered there, refused if given,
    // offered to the commands that connect (before and after them).
    let run = |args: &[&str]| {
        Command::new(&binaries().blkplanectl)
            .args(args)
            .output()
            .unwrap()
    };
    let globals = [
        "--socket",
        "--endpoint",
        "--tls-ca",
        "--tls-cert",
        "--tls-key",
        "--timeout",
        "--output",
    ];
    let help = String::from_utf8_lossy(&run(&["completions", "--help"]).stdout).into_owned();
    assert!(help.contains("<SHELL>"), "{help}");
    for option in globals {
        assert!(
            !help.contains(option),
            "completions --help offers {option}:\n{help}"
        );
    }
    for command in [
        &["disk", "list", "--help"][..],
        &["--help"],
        &["health", "--help"],
    ] {
        let help = String::from_utf8_lossy(&run(command).stdout).into_owned();
        for option in globals {
            assert!(help.contains(option), "{command:?} lacks {option}:\n{help}");
        }
    }
    for (args, option) in [
        (&["completions", "bash", "--timeout", "5"][..], "--timeout"),
        (
            &["--socket", "/s", "completions", "bash"],
            "--socket means nothing to `completions`",
        ),
        (
            &["-o", "json", "completions", "bash"],
            "--output means nothing to `completions`",
        ),
    ] {
        let out = run(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(option), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
    let dir = TempDir::new("cptls");
    let out = Command::new(&binaries().blkplaned)
        .args(["--state-dir", dir.join("s").to_str().unwrap()])
        .args(["--runtime-dir", dir.join("r").to_str().unwrap()])
        .args(["--listen", "tcp:127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--tls-client-ca"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Unreachable daemon: a clear error and exit status 1.
    let out = Command::new(&binaries().blkplanectl)
        .args([
            "--socket",
            dir.join("none.sock").to_str().unwrap(),
            "disk",
            "list",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach blkplaned"));
}

/// blkplanectl reaches a blkplaned that serves only TCP with mutual TLS: with the CA and a
/// client certificate the calls are served; without the client's options blkplanectl names
/// what is missing, with a certificate of another CA it says that the TLS handshake refused
/// it, and TLS options with a UNIX socket, or `--socket` with `--endpoint`, are refused.
#[test]
fn blkplanectl_over_tcp_with_mutual_tls() {
    use blkplane_tests::tls::{free_port, make_test_certs, server_options};
    let certs = TempDir::new("cptls-certs");
    let c = certs.path();
    make_test_certs(c);
    let port = free_port();
    let p = |f: &str| c.join(f).to_str().unwrap().to_string();
    let endpoint = format!("tcp:127.0.0.1:{port}");
    let (ca, cert, key) = (p("server-ca.pem"), p("client.pem"), p("client.key"));
    // blkplanectl's options for `endpoint` with these files.
    let tls = |ca: &str, cert: &str, key: &str| {
        [
            "--endpoint",
            &endpoint,
            "--tls-ca",
            ca,
            "--tls-cert",
            cert,
            "--tls-key",
            key,
        ]
        .map(String::from)
    };
    let reach = tls(&ca, &cert, &key);
    let reach: Vec<&str> = reach.iter().map(String::as_str).collect();
    let server = server_options(c, port);
    let server: Vec<&str> = server.iter().map(String::as_str).collect();
    let d = Daemon::start_reached_by("cptcp", &server, Some(&reach));
    assert!(d.ctl_json(&["disk", "list"]).arr().is_empty());
    let version = d.ctl_ok(&["version"]);
    assert!(version.contains("blkplaned "), "{version}");
    // The banner says how to reach it.
    let hint = format!("--endpoint {endpoint} --tls-ca CA.pem --tls-cert CLIENT.pem");
    assert!(
        wait_for(TIMEOUT, || d.log_text().contains(&hint).then_some(())).is_some(),
        "{}",
        d.log_text()
    );
    // The options after the command, and the endpoint from the environment.
    let out = Command::new(&binaries().blkplanectl)
        .args(["disk", "list", "--tls-ca", &ca, "--tls-cert", &cert])
        .args(["--tls-key", &key])
        .env("BLKPLANE_ENDPOINT", &endpoint)
        .env_remove("BLKPLANE_SOCKET")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");

    let ctl = |args: &[String]| {
        let out = Command::new(&binaries().blkplanectl)
            .args(args)
            .args(["--timeout", "10", "disk", "list"])
            .stdin(Stdio::null())
            .output()
            .expect("running blkplanectl");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stderr) = ctl(&tls(&ca, &cert, &key)[..4]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("needs --tls-cert, --tls-key") && stderr.contains(&endpoint),
        "{stderr}"
    );
    let (code, stderr) = ctl(&tls(&ca, &p("stranger.pem"), &p("stranger.key")));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("TLS handshake was refused by blkplaned")
            && stderr.contains("client certificate")
            && stderr.contains(&endpoint),
        "{stderr}"
    );
    // blkplanectl does not trust a server certificate of another CA either.
    let (code, stderr) = ctl(&tls(&p("other-ca.pem"), &cert, &key));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("TLS handshake failed") && stderr.contains("--tls-ca"),
        "{stderr}"
    );
    let missing = p("missing.key");
    let (code, stderr) = ctl(&tls(&ca, &cert, &missing));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("--tls-key {missing}: ")),
        "{stderr}"
    );
    let (code, stderr) =
        ctl(&["--endpoint", "unix:/nonexistent.sock", "--tls-cert", &cert].map(String::from));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("--tls-cert apply to tcp: endpoints only"),
        "{stderr}"
    );
    let (code, stderr) = ctl(&["--socket", "/s", "--endpoint", &endpoint].map(String::from));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--socket") && stderr.contains("--endpoint"),
        "{stderr}"
    );
    // Nothing listening: named as the TCP endpoint it is.
    drop(d);
    let (code, stderr) = ctl(&tls(&ca, &cert, &key));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot reach blkplaned at {endpoint}")),
        "{stderr}"
    );
}

/// A disk's log is capped: with `--disk-log-max-bytes 2048 --disk-log-keep 2`, a frontend
/// that logs tens of KiB (two lines per VMM connection) keeps a log within the cap and what
/// one slow poll lets through, the overflow in ID.log.1 and ID.log.2 and no third copy; the
/// removal of the disk leaves none of them.
#[test]
fn disk_logs_are_capped_and_rotated() {
    const CAP: u64 = 2048;
    // What the frontend may write between two polls that rotate (100 ms apart, later on a
    // loaded machine), at one connection every 10 ms: about 150 bytes each.
    const SLACK: u64 = 8192;
    const CONNECTIONS: usize = 400;
    let d = Daemon::start(
        "cplog",
        &["--disk-log-max-bytes", "2048", "--disk-log-keep", "2"],
    );
    let dir = TempDir::new("cplogimg");
    let img = create_image(&dir.join("d.img"), 8 * MIB);
    let disk = add_disk(&d, "lg", &img, &[]);
    let socket = socket_of(&disk);
    let log = PathBuf::from(disk.get("log_path").str());
    let copy = |n: u32| PathBuf::from(format!("{}.{n}", log.display()));
    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    let mut largest = 0;
    for _ in 0..CONNECTIONS {
        // "VMM connected", then "VMM disconnected: …" once the frontend reads the EOF.
        drop(std::os::unix::net::UnixStream::connect(&socket).unwrap());
        std::thread::sleep(Duration::from_millis(10));
        largest = largest.max(size(&log));
    }
    wait_for(TIMEOUT, || copy(2).exists().then_some(())).expect("no second rotated copy");
    let copies = [size(&copy(1)), size(&copy(2))];
    assert!(
        largest <= CAP + SLACK,
        "the log reached {largest} bytes (copies: {copies:?})"
    );
    // Each copy is a log that had just passed the cap.
    for (n, len) in copies.iter().enumerate() {
        assert!(
            *len > CAP && *len <= CAP + SLACK,
            "{}: {len} bytes",
            copy(n as u32 + 1).display()
        );
    }
    assert!(!copy(3).exists(), "a third copy with --disk-log-keep 2");
    let text = String::from_utf8_lossy(&std::fs::read(copy(1)).unwrap()).into_owned();
    assert!(
        text.contains("VMM connected") && text.contains("VMM disconnected"),
        "{text}"
    );
    // The frontend logs on at the start of the emptied file: its fd is O_APPEND. (One at its
    // old offset would leave a hole of zeros.)
    for p in [log.clone(), copy(1), copy(2)] {
        let bytes = std::fs::read(&p).unwrap();
        assert!(!bytes.contains(&0), "{} has a hole", p.display());
    }
    eprintln!("largest log {largest} bytes, copies {copies:?}");
    let files = d.runtime_files();
    assert!(files.contains(&"lg.log.1".to_string()), "{files:?}");
    d.ctl_ok(&["disk", "remove", "lg"]);
    assert_eq!(d.runtime_files(), Vec::<String>::new());
}

/// The frontend restart count survives blkplaned: a frontend SIGKILLed once is restarted
/// (count 1, written to state.json), and a blkplaned SIGKILLed or stopped with SIGTERM and
/// started again on the same directories adopts the new frontend and still says 1; the next
/// crash makes it 2.
#[test]
fn restart_counts_survive_blkplaned() {
    let d = Daemon::start("cprestarts", &[]);
    let dir = TempDir::new("cprestartsimg");
    let img = create_image(&dir.join("d.img"), 8 * MIB);
    let first = add_disk(&d, "rc", &img, &[]).get("frontend_pid").u64() as u32;
    let path = d.state_dir.join("state.json");
    let state_says = |n: u64| {
        let want = format!("\"frontend_restarts\": {n}");
        wait_for(TIMEOUT, || {
            std::fs::read_to_string(&path)
                .is_ok_and(|t| t.contains(&want))
                .then_some(())
        })
        .unwrap_or_else(|| {
            panic!(
                "state.json does not say {want}: {}",
                std::fs::read_to_string(&path).unwrap_or_default()
            )
        })
    };
    let crash = |d: &Daemon, pid: u32, count: u64| {
        kill(pid, libc::SIGKILL);
        let j = d.wait_disk("rc", "restarted", |j| {
            j.get("state").str() == "ready" && j.get("frontend_pid").u64() as u32 != pid
        });
        assert_eq!(j.get("restarts").u64(), count, "{j:?}");
        j.get("frontend_pid").u64() as u32
    };
    let second = crash(&d, first, 1);
    state_says(1);
    for how in ["SIGKILL", "SIGTERM"] {
        if how == "SIGKILL" {
            d.kill9();
        } else {
            d.stop();
        }
        d.spawn();
        let j = d.wait_disk("rc", "adopted", |j| j.get("state").str() == "ready");
        assert_eq!(
            j.get("frontend_pid").u64() as u32,
            second,
            "not adopted after {how}"
        );
        assert_eq!(j.get("restarts").u64(), 1, "after {how}: {j:?}");
    }
    crash(&d, second, 2);
    state_says(2);
    d.ctl_ok(&["disk", "remove", "rc"]);
}

/// blkplanectl at a socket that is not blkplaned's, or that never answers: a disk's admin
/// socket is refused by name before anything is sent, a disk's vhost-user socket is said to give
/// no gRPC answer (and the disk serves on), and a silent socket ends at `--timeout` with
/// DEADLINE_EXCEEDED, not a hang.
#[test]
fn sockets_that_are_not_blkplaned_and_deadlines() {
    let d = Daemon::start("cpsock", &[]);
    let dir = TempDir::new("cpsock-img");
    let img = create_image(&dir.join("d.img"), 8 * MIB);
    let disk = add_disk(&d, "d", &img, &[]);
    let ctl_at = |socket: &Path, extra: &[&str]| {
        let started = Instant::now();
        let out = Command::new(&binaries().blkplanectl)
            .arg("--socket")
            .arg(socket)
            .args(extra)
            .args(["disk", "list"])
            .stdin(Stdio::null())
            .output()
            .expect("running blkplanectl");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code(), stderr, started.elapsed())
    };

    let admin = d.disks_dir().join("d.admin");
    assert!(admin.exists(), "{}", admin.display());
    let (code, stderr, _) = ctl_at(&admin, &[]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("is a disk's admin socket"), "{stderr}");

    let vhost = socket_of(&disk);
    let (code, stderr, _) = ctl_at(&vhost, &["--timeout", "10"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("no gRPC answer at") && stderr.contains("vhost-user socket"),
        "{stderr}"
    );
    d.wait_disk("d", "serving after the stray connection", |j| {
        j.get("state").str() == "ready"
    });

    // A socket that accepts and never answers.
    let silent = dir.join("silent.sock");
    let listener = std::os::unix::net::UnixListener::bind(&silent).unwrap();
    let holder = std::thread::spawn(move || {
        let held: Vec<_> = listener.incoming().take(1).collect();
        std::thread::sleep(Duration::from_secs(5));
        drop(held);
    });
    let (code, stderr, took) = ctl_at(&silent, &["--timeout", "1"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("DEADLINE_EXCEEDED"), "{stderr}");
    assert!(stderr.contains("--timeout"), "{stderr}");
    assert!(took < Duration::from_secs(4), "took {took:?}");
    holder.join().unwrap();
}

/// Every binary's --version names the commit it was built from (the checkout's HEAD), and
/// `blkplanectl version` shows blkplaned's beside its own.
#[test]
fn every_binary_names_its_commit() {
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let bins = binaries();
    let mut commits = Vec::new();
    for bin in [
        &bins.frontend,
        &bins.iothread,
        &bins.blkplaned,
        &bins.blkplanectl,
    ] {
        let out = Command::new(bin).arg("--version").output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{}: {text}", bin.display());
        let commit = text
            .split("(commit ")
            .nth(1)
            .and_then(|rest| rest.split(')').next())
            .unwrap_or_else(|| panic!("{}: no commit in {text:?}", bin.display()))
            .to_string();
        match &head {
            Some(head) => assert!(commit.starts_with(head.as_str()), "{text} vs HEAD {head}"),
            None => assert_eq!(commit, "unknown", "{text}"),
        }
        commits.push(commit);
    }
    assert!(commits.windows(2).all(|w| w[0] == w[1]), "{commits:?}");
    let d = Daemon::start("cpver", &[]);
    let v = d.ctl_json(&["version"]);
    assert_eq!(v.get("blkplaned").get("commit").str(), commits[0], "{v:?}");
    assert_eq!(
        v.get("blkplanectl").get("commit").str(),
        commits[0],
        "{v:?}"
    );
    assert_eq!(
        v.get("blkplaned").get("version").str(),
        env!("CARGO_PKG_VERSION"),
        "{v:?}"
    );
    let text = d.ctl_ok(&["version"]);
    assert!(text.starts_with("blkplanectl "), "{text}");
    assert!(text.contains("\nblkplaned   "), "{text}");
}

/// `blkplaned --log-format json`: every line it writes is one JSON object with the time, the
/// level, the target and the message.
#[test]
fn blkplaned_logs_json_lines_for_collectors() {
    let d = Daemon::start("cpjson", &["--log-format", "json"]);
    let dir = TempDir::new("cpjson-img");
    let img = create_image(&dir.join("j.img"), 8 * MIB);
    add_disk(&d, "j", &img, &[]);
    d.ctl_ok(&["disk", "remove", "j"]);
    let text = d.log_text();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() >= 3, "{text}");
    for line in &lines {
        assert!(
            line.starts_with('{') && line.ends_with('}'),
            "not JSON: {line}"
        );
        let j = Json::parse(line);
        assert!(j.get("time").str().ends_with('Z'), "{line}");
        assert!(
            ["ERROR", "WARN", "INFO", "DEBUG", "TRACE"].contains(&j.get("level").str()),
            "{line}"
        );
        assert!(!j.get("target").str().is_empty(), "{line}");
    }
    assert!(
        lines
            .iter()
            .any(|l| Json::parse(l).get("message").str().contains("AddDisk")),
        "{text}"
    );
}

/// Two blkplaned on one runtime directory: the second refuses to start and disturbs nothing.
#[test]
fn second_daemon_on_the_same_dirs_is_refused() {
    let d = Daemon::start("cptwo", &[]);
    let out = Command::new(&binaries().blkplaned)
        .args(&d.args)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in use") || err.contains("locked"), "{err}");
    // The first one still answers.
    assert!(d.ctl_json(&["disk", "list"]).arr().is_empty());
    let _ = d.pid();
}

/// A restart of blkplaned with leftovers: a pid file that names an unrelated live process
/// (the pid was recycled) and a frontend of a disk that is not in the state (blkplaned died
/// between starting it and persisting it). The unrelated process is left alone and a new
/// frontend serves the disk; the orphan is stopped and its files removed, with the rotated
/// logs of ids not in the state (the disk's own are kept).
#[test]
fn restart_with_stale_pid_file_and_orphan() {
    let d = Daemon::start("cpstale", &[]);
    let dir = TempDir::new("cpstaleimg");
    let img = create_image(&dir.join("a.img"), 8 * MIB);
    let ghost_img = create_image(&dir.join("ghost.img"), 8 * MIB);
    let a = add_disk(&d, "a", &img, &[]);
    let old = a.get("frontend_pid").u64() as u32;
    d.kill9();
    kill(old, libc::SIGKILL);
    wait_for(TIMEOUT, || (!alive(old)).then_some(())).expect("frontend a did not die");

    // The recycled pid: some other program now.
    let mut sleeper = Command::new("sleep").arg("60").spawn().unwrap();
    std::fs::write(d.disks_dir().join("a.pid"), format!("{}\n", sleeper.id())).unwrap();
    // The orphan: a frontend with an admin socket in the runtime directory, for an id that
    // is not in the state.
    let disks = d.disks_dir();
    let mut ghost = Command::new(&binaries().frontend)
        .arg(format!("--socket={}", disks.join("ghost.sock").display()))
        .arg(format!(
            "--admin-socket={}",
            disks.join("ghost.admin").display()
        ))
        .arg(format!("--image={}", ghost_img.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::fs::write(disks.join("ghost.pid"), format!("{}\n", ghost.id())).unwrap();
    wait_for(TIMEOUT, || disks.join("ghost.admin").exists().then_some(()))
        .expect("the orphan frontend did not start");
    // Rotated logs: the wanted disk's is kept, those of ids not in the state go, also when
    // nothing else of the disk is left.
    for copy in ["a.log.1", "ghost.log.1", "gone.log.1", "gone.log.2"] {
        std::fs::write(disks.join(copy), "--- an old log\n").unwrap();
    }

    d.spawn();
    let j = d.wait_disk("a", "restarted", |j| {
        j.get("state").str() == "ready" && j.get("frontend_pid").u64() != 0
    });
    let new = j.get("frontend_pid").u64() as u32;
    assert!(new != old && new != sleeper.id(), "{j:?}");
    assert!(alive(sleeper.id()), "blkplaned killed an unrelated process");
    check_fresh_connection(&socket_of(&j), 0, 3);
    // The orphan is gone, with its files.
    let status = ghost.wait().unwrap();
    assert!(!status.success(), "the orphan exited by itself: {status}");
    assert_eq!(
        d.runtime_files(),
        ["a.admin", "a.log", "a.log.1", "a.pid", "a.sock"],
        "leftovers of the orphans"
    );
    let _ = sleeper.kill();
    let _ = sleeper.wait();
}

// ---------------------------------------------------------------------------------------------
// Drain and resume, migration blockers.

/// Bytes per write of the drain test's writers.
const QD_BLOCK: usize = 16 * 1024;
/// Requests each writer keeps in flight.
const QD: usize = 8;
/// Blocks each writer cycles over (its own 8 MiB region of the disk).
const QD_BLOCKS: u64 = 512;

/// The seed of write `seq` of writer `writer`.
fn qd_seed(writer: u64, seq: u64) -> u64 {
    0xd4a1_0000_0000_0000 | (writer << 40) | seq
}

/// Progress of one writer, shared with the test's main thread.
#[derive(Default)]
struct QdProgress {
    completed: AtomicU64,
    submitted: AtomicU64,
    stop: AtomicBool,
}

/// Tells the writers to stop when dropped, so that a failing assertion in the main thread
/// ends the scope instead of waiting for writers that would go on forever.
struct StopOnDrop<'a>(&'a [QdProgress]);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        for p in self.0 {
            p.stop.store(true, Ordering::SeqCst);
        }
    }
}

/// Writes at queue depth [`QD`] on `q` (writer `writer`: blocks `writer` × 8 MiB onwards),
/// each write a fresh pattern, until told to stop; returns the sequence number of the last
/// completed write of each block (0: never written). Writes to one block are [`QD_BLOCKS`]
/// apart, so with [`QD`] in flight the later one was always submitted after the earlier one
/// completed: the last completed is what the block holds.
fn qd_writer(q: &mut IoQueue, writer: u64, p: &QdProgress) -> Result<Vec<u64>, String> {
    let base = writer * QD_BLOCKS * QD_BLOCK as u64;
    let mut last = vec![0u64; QD_BLOCKS as usize];
    let mut free: Vec<usize> = (0..QD).collect();
    let mut slot_of = std::collections::HashMap::new();
    let mut seq = 0u64;
    loop {
        while !p.stop.load(Ordering::SeqCst) {
            let Some(slot) = free.pop() else { break };
            seq += 1;
            let data = pattern(qd_seed(writer, seq), QD_BLOCK);
            q.buf()[slot * QD_BLOCK..(slot + 1) * QD_BLOCK].copy_from_slice(&data);
            let op = Op::Write {
                offset: base + (seq % QD_BLOCKS) * QD_BLOCK as u64,
                buf: slot * QD_BLOCK,
                len: QD_BLOCK,
            };
            q.submit(&op, seq as usize);
            slot_of.insert(seq, slot);
            p.submitted.fetch_add(1, Ordering::SeqCst);
        }
        if slot_of.is_empty() {
            return Ok(last);
        }
        for (done, ret) in q.wait(1) {
            let done = done as u64;
            if ret != 0 {
                return Err(format!("write {done}: {}", errno_name(-ret)));
            }
            let slot = slot_of
                .remove(&done)
                .ok_or("completion of an unknown write")?;
            free.push(slot);
            last[(done % QD_BLOCKS) as usize] = done;
            p.completed.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Checks that writer `writer`'s region holds, block by block, its last completed write.
#[track_caller]
fn verify_qd_region(q: &mut IoQueue, writer: u64, last: &[u64]) {
    let base = writer * QD_BLOCKS * QD_BLOCK as u64;
    for (block, &seq) in last.iter().enumerate() {
        let offset = base + block as u64 * QD_BLOCK as u64;
        let back = q
            .read_at(offset, QD_BLOCK)
            .unwrap_or_else(|e| panic!("read at {offset}: {}", errno_name(e)));
        let want = if seq == 0 {
            vec![0; QD_BLOCK]
        } else {
            pattern(qd_seed(writer, seq), QD_BLOCK)
        };
        assert_same_data(&format!("writer {writer} block {block}"), &back, &want);
    }
}

/// Sums a counter over a disk's queues, from `stats -o json`.
fn total_stat(d: &Daemon, id: &str, field: &str) -> u64 {
    d.ctl_json(&["stats", id]).arr()[0]
        .get("total")
        .get(field)
        .u64()
}

/// One write through a fresh libblkio connection, in a thread: it is expected to wait while
/// the disk is drained. Sets `done` when it completed, and returns the result.
fn write_in_background(
    socket: PathBuf,
    offset: u64,
    seed: u64,
    done: Arc<AtomicBool>,
) -> JoinHandle<Result<(), String>> {
    std::thread::spawn(move || {
        let mut c = Client::connect(&socket).map_err(|e| format!("connect: {e}"))?;
        let r = c
            .queue(0)
            .write_at(offset, &pattern(seed, 4096))
            .map_err(|e| format!("write: {}", errno_name(e)));
        done.store(true, Ordering::SeqCst);
        r
    })
}

/// Drain and resume under load, through blkplanectl: two libblkio writers at QD 8 on a disk
/// with two queues and two iothreads. Drain with flush returns the number of requests it
/// waited for; while drained no request completes (the writers' next requests wait in the
/// rings), the image does not change, not across an iothread SIGKILL either; Resume lets
/// every waiting request complete without an error, and the data is verified. A VMM that
/// connects while the disk is drained is not served until Resume (a frontend serves one VMM
/// at a time, so this comes after the writers' client left). The drained state survives a
/// frontend SIGKILL: the restarted frontend is drained too, until Resume.
#[test]
fn drain_and_resume_under_io() {
    let t0 = Instant::now();
    let d = Daemon::start("cpdrain", &[]);
    let images = TempDir::new("cpdrainimg");
    let img = create_image(&images.join("d.img"), 32 * MIB);
    let watcher = Watcher::start(&d);
    let disk = add_disk(&d, "d", &img, &["--num-queues", "2", "--iothreads", "2"]);
    let socket = socket_of(&disk);
    let opts = ClientOptions {
        num_queues: 2,
        ..Default::default()
    };
    let mut client =
        Client::connect_with(&socket, &opts).unwrap_or_else(|e| panic!("connect: {e}"));
    let progress = [QdProgress::default(), QdProgress::default()];
    let completed = || -> u64 {
        progress
            .iter()
            .map(|p| p.completed.load(Ordering::SeqCst))
            .sum()
    };
    let submitted = || -> u64 {
        progress
            .iter()
            .map(|p| p.submitted.load(Ordering::SeqCst))
            .sum()
    };
    let lasts: Vec<Vec<u64>> = std::thread::scope(|s| {
        let _stop = StopOnDrop(&progress);
        let writers: Vec<_> = client
            .queues_mut()
            .iter_mut()
            .zip(&progress)
            .enumerate()
            .map(|(i, (q, p))| s.spawn(move || qd_writer(q, i as u64, p)))
            .collect();
        let wait_completed = |n: u64, what: &str| {
            let target = completed() + n;
            wait_for(TIMEOUT, || (completed() >= target).then_some(()))
                .unwrap_or_else(|| panic!("no progress ({what}): {} completed", completed()));
        };
        wait_completed(300, "before the drain");
        d.wait_disk("d", "connected", |j| j.get("state").str() == "connected");

        // Drain with flush while 2 × QD writes are in flight.
        let started = Instant::now();
        let out = d.ctl_json(&["disk", "drain", "d", "--flush"]);
        let drain_time = started.elapsed();
        let waited = out.get("waited_requests").u64();
        assert!(waited <= 2 * QD as u64, "{out:?}");
        assert!(out.get("flushed").bool(), "{out:?}");
        eprintln!("drain with flush: waited for {waited} requests in {drain_time:?}");
        let j = d.disk("d");
        assert_eq!(j.get("state").str(), "drained", "{j:?}");
        assert!(j.get("drained").bool() && j.get("vmm_connected").bool());
        assert!(!j.get("migratable").bool());
        let reasons = blocker_reasons(&j);
        assert!(reasons.contains(&"draining".to_string()), "{reasons:?}");
        watcher.wait("drained", "d");

        // Held: the writers refill their QD and wait; nothing completes, nothing is written.
        let settled = wait_for(TIMEOUT, || {
            (submitted() - completed() == 2 * QD as u64).then_some(())
        });
        assert!(settled.is_some(), "the writers did not refill their queues");
        let c0 = completed();
        let image0 = read_file(&img);
        std::thread::sleep(Duration::from_secs(1));
        assert_eq!(completed(), c0, "requests completed while drained");
        assert!(read_file(&img) == image0, "the image changed while drained");
        assert_eq!(total_stat(&d, "d", "in_flight"), 0);
        // Growing the image would touch it.
        d.ctl_refused(
            &["disk", "resize", "d", "48M"],
            "FAILED_PRECONDITION",
            "drained",
        );

        // An iothread killed while drained is replaced, and nothing moves either.
        let iothreads: Vec<u64> = j.get("iothread_pids").arr().iter().map(Json::u64).collect();
        let fe_pid = j.get("frontend_pid").u64() as u32;
        assert!(blkplane_tests::frontend::kill_iothread(
            fe_pid,
            iothreads[0] as u32
        ));
        let j = d.wait_disk("d", "iothread replaced", |j| {
            j.get("iothread_restarts").u64() >= 1
        });
        assert_eq!(j.get("state").str(), "drained", "{j:?}");
        assert!(
            blocker_reasons(&j).contains(&"iothread_restarted".to_string()),
            "{j:?}"
        );
        std::thread::sleep(Duration::from_secs(1));
        assert_eq!(completed(), c0, "requests completed while drained");
        assert!(read_file(&img) == image0, "the image changed while drained");
        // Draining a drained disk waits for nothing.
        let again = d.ctl_json(&["disk", "drain", "d"]);
        assert_eq!(again.get("waited_requests").u64(), 0, "{again:?}");
        assert!(!again.get("flushed").bool());

        // Resume: everything that waited completes, and the I/O goes on.
        let resumed = d.ctl_json(&["disk", "resume", "d"]);
        assert!(resumed.get("was_drained").bool(), "{resumed:?}");
        watcher.wait("resumed", "d");
        wait_completed(300, "after resume");
        let j = d.wait_disk("d", "resumed", |j| j.get("state").str() == "connected");
        assert!(!j.get("drained").bool());
        assert!(!blocker_reasons(&j).contains(&"draining".to_string()));
        // Resuming a disk that serves changes nothing, and says so.
        let again = d.ctl_json(&["disk", "resume", "d"]);
        assert!(!again.get("was_drained").bool(), "{again:?}");
        let text = d.ctl_ok(&["disk", "resume", "d"]);
        assert!(text.contains("was not drained; nothing changed"), "{text}");
        for p in &progress {
            p.stop.store(true, Ordering::SeqCst);
        }
        writers
            .into_iter()
            .map(|w| w.join().expect("writer panicked").expect("writer"))
            .collect()
    });
    for (writer, last) in lasts.iter().enumerate() {
        verify_qd_region(client.queue(writer), writer as u64, last);
    }
    drop(client);
    assert_eq!(total_stat(&d, "d", "errors"), 0);

    // A VMM that connects while the disk is drained: its ring starts, but is not served.
    d.wait_disk("d", "disconnected", |j| !j.get("vmm_connected").bool());
    d.ctl_ok(&["disk", "drain", "d"]);
    let late = Arc::new(AtomicBool::new(false));
    let late_writer = write_in_background(socket.clone(), 20 * MIB, 4242, Arc::clone(&late));
    d.wait_disk("d", "connected while drained", |j| {
        j.get("vmm_connected").bool() && j.get("state").str() == "drained"
    });
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        !late.load(Ordering::SeqCst),
        "a new VMM was served while drained"
    );
    d.ctl_ok(&["disk", "resume", "d"]);
    late_writer
        .join()
        .unwrap()
        .expect("the write of the late VMM");
    let mut c = Client::connect(&socket).unwrap();
    assert_same_data(
        "the late VMM's write",
        &c.queue(0).read_at(20 * MIB, 4096).unwrap(),
        &pattern(4242, 4096),
    );
    drop(c);
    let events = watcher.events.lock().unwrap().clone();
    let has = |kind: &str, prefix: &str| {
        events.iter().any(|e| {
            e.get("kind").str() == kind
                && e.get("disk_id").str() == "d"
                && e.get("message").str().starts_with(prefix)
        })
    };
    assert!(has("blocker_added", "draining: "), "{events:?}");
    assert!(has("blocker_removed", "draining"), "{events:?}");

    // Drained is persisted and survives a frontend crash: the restarted frontend serves
    // nothing until Resume.
    d.wait_disk("d", "disconnected", |j| !j.get("vmm_connected").bool());
    d.ctl_ok(&["disk", "drain", "d"]);
    let text = std::fs::read_to_string(d.state_dir.join("state.json")).unwrap();
    assert!(text.contains("\"drained\": true"), "{text}");
    let old = d.disk("d").get("frontend_pid").u64() as u32;
    kill(old, libc::SIGKILL);
    let j = d.wait_disk("d", "restarted drained", |j| {
        j.get("frontend_pid").u64() as u32 != old && j.get("state").str() == "drained"
    });
    assert!(j.get("drained").bool());
    let reasons = blocker_reasons(&j);
    assert!(
        reasons.contains(&"draining".to_string())
            && reasons.contains(&"frontend_restarting".to_string()),
        "{reasons:?}"
    );
    let after_crash = Arc::new(AtomicBool::new(false));
    let writer = write_in_background(socket.clone(), 24 * MIB, 77, Arc::clone(&after_crash));
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        !after_crash.load(Ordering::SeqCst),
        "the restarted frontend served a request while drained"
    );
    d.ctl_ok(&["disk", "resume", "d"]);
    writer.join().unwrap().expect("write after resume");
    let text = std::fs::read_to_string(d.state_dir.join("state.json")).unwrap();
    assert!(!text.contains("\"drained\""), "{text}");
    check_fresh_connection(&socket, 28 * MIB, 78);
    eprintln!("drain_and_resume_under_io took {:.1?}", t0.elapsed());
}

/// Migration blockers through blkplanectl: an idle disk is migratable; operator blockers are
/// added, replaced, listed, persisted across a blkplaned restart and removed; every bad input
/// is refused naming its field; a connected VMM that did not negotiate dirty logging
/// (VHOST_USER_PROTOCOL_F_LOG_SHMFD, which the frontend offers) brings the
/// unsupported_feature blocker saying so; the frontend is sent the list and refuses
/// VHOST_F_LOG_ALL with a REPLY_ACK error and the reasons in its log, and the session goes
/// on (the rings still serve).
#[test]
fn migration_blockers() {
    let d = Daemon::start("cpblock", &[]);
    let images = TempDir::new("cpblockimg");
    let img = create_image(&images.join("m.img"), 8 * MIB);
    let watcher = Watcher::start(&d);
    let disk = add_disk(&d, "m", &img, &[]);
    let socket = socket_of(&disk);
    let log = PathBuf::from(disk.get("log_path").str());
    assert!(disk.get("migratable").bool(), "{disk:?}");
    assert!(disk.get("migration_blockers").arr().is_empty());
    let list = d.ctl_json(&["disk", "blocker", "list", "m"]);
    assert!(list.get("migratable").bool() && list.get("blockers").arr().is_empty());

    // Add, replace, add another.
    let m = d.ctl_json(&["disk", "blocker", "add", "m", "backup", "nightly backup"]);
    assert!(!m.get("migratable").bool());
    let b = &m.get("blockers").arr()[0];
    assert_eq!(b.get("reason").str(), "operator_backup");
    assert_eq!(b.get("message").str(), "nightly backup");
    assert!(!b.get("automatic").bool());
    watcher.wait("blocker_added", "m");
    let m = d.ctl_json(&["disk", "blocker", "add", "m", "backup", "weekly backup"]);
    assert_eq!(m.get("blockers").arr().len(), 1, "{m:?}");
    assert_eq!(
        m.get("blockers").arr()[0].get("message").str(),
        "weekly backup"
    );
    let m = d.ctl_json(&["disk", "blocker", "add", "m", "maintenance", "shelf swap"]);
    let reasons: Vec<&str> = m
        .get("blockers")
        .arr()
        .iter()
        .map(|b| b.get("reason").str())
        .collect();
    assert_eq!(reasons, ["operator_backup", "operator_maintenance"]);
    let table = d.ctl_ok(&["disk", "blocker", "list", "m"]);
    assert!(table.starts_with("m: not migratable\nREASON"), "{table}");
    assert!(table.contains("weekly backup"), "{table}");

    // Bad input: every refusal names its field.
    d.ctl_refused(
        &["disk", "blocker", "add", "m", "99", "x"],
        "INVALID_ARGUMENT",
        "reason",
    );
    d.ctl_refused(
        &["disk", "blocker", "add", "m", "0", "x"],
        "INVALID_ARGUMENT",
        "reason",
    );
    d.ctl_refused(
        &["disk", "blocker", "add", "m", "draining", "x"],
        "INVALID_ARGUMENT",
        "reason",
    );
    d.ctl_refused(
        &["disk", "blocker", "add", "m", "other", ""],
        "INVALID_ARGUMENT",
        "message",
    );
    d.ctl_refused(
        &["disk", "blocker", "add", "m", "other", "two\nlines"],
        "INVALID_ARGUMENT",
        "message",
    );
    d.ctl_refused(
        &["disk", "blocker", "add", "nope", "other", "x"],
        "NOT_FOUND",
        "id",
    );
    d.ctl_refused(&["disk", "blocker", "list", "nope"], "NOT_FOUND", "id");
    d.ctl_refused(
        &["disk", "blocker", "remove", "m", "other"],
        "NOT_FOUND",
        "reason",
    );
    d.ctl_refused(
        &["disk", "blocker", "remove", "nope", "backup"],
        "NOT_FOUND",
        "id",
    );
    d.ctl_refused(&["disk", "drain", "nope"], "NOT_FOUND", "id");
    d.ctl_refused(&["disk", "resume", "nope"], "NOT_FOUND", "id");
    assert_eq!(
        d.ctl(&["disk", "blocker", "add", "m", "bogus", "x"]).code,
        Some(2)
    );
    assert_eq!(d.disk("m").get("migration_blockers").arr().len(), 2);

    // The frontend was told, and refuses dirty logging with the reasons in its log.
    let told = wait_for(TIMEOUT, || {
        std::fs::read_to_string(&log)
            .ok()
            .filter(|t| t.contains("operator_maintenance: shelf swap"))
    });
    assert!(told.is_some(), "the frontend was not sent the blockers");
    {
        use vhost::vhost_user::VhostUserVirtioFeatures;
        use vhost::VhostBackend;
        // A VMM that negotiates REPLY_ACK (asking for a status on every message) but not
        // LOG_SHMFD, with a running ring.
        let mut dev = RawDevice::connect(&socket, 1, 256).expect("raw vhost-user connect");
        assert!(dev
            .protocol_features
            .contains(VhostUserProtocolFeatures::REPLY_ACK));
        assert!(!dev
            .protocol_features
            .contains(VhostUserProtocolFeatures::LOG_SHMFD));
        let j = d.wait_disk("m", "blocked for dirty logging", |j| {
            blocker_reasons(j).contains(&"unsupported_feature".to_string())
        });
        // VHOST_USER_PROTOCOL_F_LOG_SHMFD is bit 1.
        assert_eq!(
            j.get("acked_protocol_features").u64() & (1 << 1),
            0,
            "{j:?}"
        );
        let unsupported = j
            .get("migration_blockers")
            .arr()
            .iter()
            .find(|b| b.get("reason").str() == "unsupported_feature")
            .cloned()
            .unwrap();
        assert!(
            unsupported
                .get("message")
                .str()
                .starts_with("the VMM did not negotiate dirty logging"),
            "{unsupported:?}"
        );
        // Every attempt to start dirty logging is refused with an error status, and the
        // session goes on: the ring still serves. Once the frontend has blkplaned's list with
        // the new blocker (the next poll), the refusal names it too.
        let log_all = VhostUserVirtioFeatures::LOG_ALL.bits();
        let refused = wait_for(TIMEOUT, || {
            let r = dev.fe.set_features(dev.features | log_all);
            assert!(
                matches!(
                    r,
                    Err(vhost::Error::VhostUserProtocol(
                        vhost::vhost_user::Error::BackendInternalError
                    ))
                ),
                "SET_FEATURES with LOG_ALL: expected an error status, got {r:?}"
            );
            dev.assert_alive(0, "a refused VHOST_F_LOG_ALL");
            let line = std::fs::read_to_string(&log).ok().and_then(|t| {
                t.lines()
                    .filter(|l| l.contains("VHOST_F_LOG_ALL refused"))
                    .find(|l| l.contains("did not negotiate"))
                    .map(str::to_string)
            });
            if line.is_none() {
                std::thread::sleep(Duration::from_millis(50));
            }
            line
        })
        .expect("no refusal of VHOST_F_LOG_ALL naming the missing LOG_SHMFD in the log");
        assert!(
            refused.contains("operator_backup: weekly backup")
                && refused.contains("unsupported_feature: the VMM did not negotiate dirty logging"),
            "{refused}"
        );
        assert!(!refused.contains("does not offer"), "{refused}");
    }

    // Persisted: a restarted blkplaned (the frontend adopted) still has them.
    let text = std::fs::read_to_string(d.state_dir.join("state.json")).unwrap();
    assert!(
        text.contains("\"maintenance\"") && text.contains("weekly backup"),
        "{text}"
    );
    drop(watcher);
    d.stop();
    d.spawn();
    let watcher = Watcher::start(&d);
    let j = d.wait_disk("m", "adopted", |j| j.get("state").str() == "ready");
    assert_eq!(
        blocker_reasons(&j),
        ["operator_backup", "operator_maintenance"]
    );

    // A VMM connected (libblkio, which does not negotiate LOG_SHMFD): the dirty-logging
    // blocker, honest about why; removing the operator blockers leaves it; the VMM gone, the
    // disk is migratable again.
    let mut client = Client::connect(&socket).unwrap();
    client.queue(0).write_at(0, &pattern(1, 4096)).unwrap();
    let j = d.wait_disk("m", "connected", |j| j.get("vmm_connected").bool());
    let unsupported = j
        .get("migration_blockers")
        .arr()
        .iter()
        .find(|b| b.get("reason").str() == "unsupported_feature")
        .cloned()
        .unwrap_or_else(|| panic!("no unsupported_feature blocker: {j:?}"));
    assert!(unsupported.get("automatic").bool());
    let message = unsupported.get("message").str();
    assert!(
        message.starts_with("the VMM did not negotiate dirty logging")
            && message.contains("VHOST_USER_PROTOCOL_F_LOG_SHMFD")
            && !message.contains("does not offer"),
        "{unsupported:?}"
    );
    d.ctl_json(&["disk", "blocker", "remove", "m", "backup"]);
    let m = d.ctl_json(&["disk", "blocker", "remove", "m", "maintenance"]);
    assert!(!m.get("migratable").bool());
    let reasons: Vec<&str> = m
        .get("blockers")
        .arr()
        .iter()
        .map(|b| b.get("reason").str())
        .collect();
    assert_eq!(reasons, ["unsupported_feature"]);
    watcher.wait("blocker_removed", "m");
    drop(client);
    let j = d.wait_disk("m", "migratable", |j| j.get("migratable").bool());
    assert!(j.get("migration_blockers").arr().is_empty());
    let listed = d.ctl_json(&["disk", "list"]);
    assert!(listed.arr()[0].get("migratable").bool());
    let text = std::fs::read_to_string(d.state_dir.join("state.json")).unwrap();
    assert!(!text.contains("migration_blockers"), "{text}");
}

// ---------------------------------------------------------------------------------------------
// Live migration on one node.

/// A live migration between two libblkio "VMMs" on one node, as blkplaned sees it. Disk `a`
/// serves the source VMM, which wrote a verified pattern and keeps its rings running; disk
/// `b` is added with `--incoming-for a` (image and device taken from `a`) and shows it, with
/// the INCOMING blocker. The destination VMM connects to `b` and starts its rings while the
/// source's still run: `a` must not be retired — a both_serving event (once) and an error in
/// blkplaned's log, `a` still listed and serving. The source VMM disconnects: within seconds
/// `a` is retired (not listed, its frontend gone, its socket and files removed, a removed
/// event), `b` is no longer incoming (no INCOMING blocker, a migrated event naming both) and
/// the destination VMM reads what the source VMM wrote.
#[test]
fn incoming_disk_takes_over_and_retires_the_source() {
    let t0 = Instant::now();
    let d = Daemon::start("cpmig", &[]);
    let images = TempDir::new("cpmigimg");
    let img = create_image(&images.join("a.img"), 32 * MIB);
    let watcher = Watcher::start(&d);
    let a = add_disk(&d, "a", &img, &["--num-queues", "2", "--serial", "MIG-A"]);
    let a_pid = a.get("frontend_pid").u64() as u32;
    let a_socket = socket_of(&a);
    let two_queues = ClientOptions {
        num_queues: 2,
        ..Default::default()
    };

    // The source VM: a verified pattern on both queues, and the connection kept. A raw
    // front-end that negotiates dirty logging as QEMU does (a VMM without it could not be
    // migrated: blkplaned would refuse the incoming disk).
    let mut source_vmm =
        RawDevice::connect_negotiating(&a_socket, 2, 128, VhostUserProtocolFeatures::LOG_SHMFD)
            .unwrap_or_else(|e| panic!("connect a: {e}"));
    for chunk in 0..CHUNKS {
        let q = (chunk % 2) as usize;
        let sector = chunk * CHUNK as u64 / 512;
        let data = pattern(seed(7, 1, chunk), CHUNK);
        let w = source_vmm.write(q, sector, &data);
        assert_eq!(
            w.status_u32(),
            Some(VIRTIO_BLK_S_OK),
            "write through a: {w:?}"
        );
        let r = source_vmm.read(q, sector, CHUNK as u32);
        assert_eq!(
            r.status_u32(),
            Some(VIRTIO_BLK_S_OK),
            "read through a: {r:?}"
        );
        assert_same_data(&format!("chunk {chunk} through a"), &r.data[0], &data);
    }
    d.wait_disk("a", "running its rings", |j| {
        j.get("vmm_connected").bool() && any_ring_running(j)
    });

    // The destination disk: everything but its own socket comes from a.
    let b = d.ctl_json(&["disk", "add", "b", "--incoming-for", "a"]);
    let b_pid = b.get("frontend_pid").u64() as u32;
    let b_socket = socket_of(&b);
    let config = b.get("config");
    assert_eq!(config.get("incoming_for").str(), "a");
    assert_eq!(config.get("image").str(), img.to_str().unwrap());
    assert_eq!(config.get("serial").str(), "MIG-A");
    assert_eq!(config.get("num_queues").u64(), 2);
    assert_eq!(b_socket, d.disks_dir().join("b.sock"));
    assert!(!b.get("migratable").bool(), "{b:?}");
    assert_eq!(blocker_reasons(&b), ["incoming"]);
    let added = watcher.wait("added", "b");
    assert!(added.get("message").str().contains("incoming"), "{added:?}");
    let shown = d.ctl_ok(&["disk", "show", "b"]);
    assert!(shown.contains("incoming for:"), "{shown}");
    let listed = d.ctl_ok(&["disk", "list"]);
    assert!(
        listed.lines().next().unwrap().contains("INCOMING"),
        "{listed}"
    );

    // The destination VMM starts its rings while the source's still run: both would serve
    // the image. a stays, and blkplaned says so, once.
    let mut dest_vmm =
        Client::connect_with(&b_socket, &two_queues).unwrap_or_else(|e| panic!("connect b: {e}"));
    let both = watcher.wait("both_serving", "b");
    let message = both.get("message").str();
    assert!(
        message.contains("disk a") && message.contains("both at once"),
        "{both:?}"
    );
    // Several polls later: still there, still serving, b still incoming, said once.
    std::thread::sleep(Duration::from_secs(1));
    assert!(alive(a_pid), "a's frontend was stopped while its rings ran");
    assert_eq!(
        d.ctl_json(&["disk", "list"])
            .arr()
            .iter()
            .map(|j| j.get("id").str().to_string())
            .collect::<Vec<_>>(),
        ["a", "b"]
    );
    assert_eq!(d.state_ids(), ["a", "b"]);
    assert_eq!(d.disk("b").get("config").get("incoming_for").str(), "a");
    let data = pattern(seed(7, 2, 0), CHUNK);
    let w = source_vmm.write(0, 0, &data);
    assert_eq!(
        w.status_u32(),
        Some(VIRTIO_BLK_S_OK),
        "write through a while both serve: {w:?}"
    );
    assert_eq!(events_of(&watcher, "both_serving", "b").len(), 1);
    let errors = d
        .log_text()
        .lines()
        .filter(|l| l.contains(" ERROR ") && l.contains("still serves a running ring"))
        .count();
    assert_eq!(errors, 1, "the error is logged once");
    assert!(events_of(&watcher, "removed", "a").is_empty());
    assert!(events_of(&watcher, "migrated", "b").is_empty());

    // The source VMM goes (its rings stop): a is retired within seconds.
    drop(source_vmm);
    let stopped = Instant::now();
    let migrated = watcher.wait("migrated", "b");
    let took = stopped.elapsed();
    eprintln!("takeover {took:?} after the source VMM disconnected");
    assert!(took < Duration::from_secs(5), "takeover took {took:?}");
    assert_eq!(
        migrated.get("message").str(),
        "disk b took over from a; a retired"
    );
    let removed = watcher.wait("removed", "a");
    assert!(
        removed.get("message").str().contains("disk b took over"),
        "{removed:?}"
    );
    let removed_blocker = watcher.wait("blocker_removed", "b");
    assert_eq!(removed_blocker.get("message").str(), "incoming");
    assert!(
        wait_for(TIMEOUT, || (!alive(a_pid)).then_some(())).is_some(),
        "a's frontend {a_pid} survived its retirement"
    );
    assert!(!a_socket.exists(), "a's socket was left behind");
    d.ctl_refused(&["disk", "show", "a"], "NOT_FOUND", "a");
    assert_eq!(d.state_ids(), ["b"]);
    let state = std::fs::read_to_string(d.state_dir.join("state.json")).unwrap();
    assert!(!state.contains("incoming_for"), "{state}");
    assert_eq!(d.runtime_files(), ["b.admin", "b.log", "b.pid", "b.sock"]);
    assert_eq!(d.frontends(), [b_pid]);
    let j = d.disk("b");
    assert_eq!(j.get("config").get("incoming_for").str(), "");
    assert!(
        !blocker_reasons(&j).contains(&"incoming".to_string()),
        "{j:?}"
    );
    assert_eq!(j.get("frontend_pid").u64() as u32, b_pid);
    assert!(
        j.get("vmm_connected").bool() && any_ring_running(&j),
        "{j:?}"
    );

    // The destination VMM, connected throughout, reads what the source VMM wrote, and goes
    // on writing.
    for chunk in 0..CHUNKS {
        let q = dest_vmm.queue((chunk % 2) as usize);
        let offset = chunk * CHUNK as u64;
        let want = if chunk == 0 {
            data.clone()
        } else {
            pattern(seed(7, 1, chunk), CHUNK)
        };
        let back = q
            .read_at(offset, CHUNK)
            .unwrap_or_else(|e| panic!("read through b at {offset}: {}", errno_name(e)));
        assert_same_data(&format!("chunk {chunk} through b"), &back, &want);
    }
    let after = pattern(seed(7, 3, 0), CHUNK);
    dest_vmm
        .queue(1)
        .write_at(CHUNKS * CHUNK as u64, &after)
        .unwrap_or_else(|e| panic!("write through b: {}", errno_name(e)));
    drop(dest_vmm);
    assert_same_data(
        "b's write in the image",
        &read_file_at(&img, CHUNKS * CHUNK as u64, CHUNK),
        &after,
    );
    assert_eq!(total_stat(&d, "b", "errors"), 0);
    drop(watcher);
    eprintln!(
        "incoming_disk_takes_over_and_retires_the_source took {:.1?}",
        t0.elapsed()
    );
}
