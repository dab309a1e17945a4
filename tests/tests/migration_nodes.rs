//! Live migration across nodes with shared storage, as two blkplaned see it: two daemons, each
//! serving its API over TCP with mutual TLS and reaching the other with its `--peer-tls-*`
//! files, on one image both "nodes" reach, with a raw vhost-user VMM on each side.
//!
//! - refusals at the destination, each leaving nothing on either node: a source disk the other
//!   node does not have (NOT_FOUND from there), a blocked source (FAILED_PRECONDITION naming
//!   the blocker), local storage without the new image's path (INVALID_ARGUMENT), an image of another size (INVALID_ARGUMENT,
//!   the source's record undone), a node nobody listens at (UNAVAILABLE), a destination
//!   blkplaned without peer certificates (FAILED_PRECONDITION);
//! - the migration: the destination disk takes the source's device, both disks show the
//!   migration (and refuse resizing), the destination's VMM starting its rings while the
//!   source's still run is reported once and retires nothing; once the source VMM has gone,
//!   the source node retires its disk and the destination takes over within seconds, reads
//!   what the source VMM wrote, and had dropped this node's stale page cache of the image
//!   before its first ring started;
//! - cancelling: removing the incoming disk cancels the migration on the source node (and
//!   `disk migrate --cancel` there, when the destination cannot); a destination whose VM runs
//!   after the source node cancelled is told that the source was not retired;
//! - a source node that accepts the connection and never answers is given up after the peer
//!   deadline, with UNAVAILABLE and nothing left behind;
//! - both blkplaned SIGKILLed and restarted during a migration: it is still recorded on both
//!   sides, the frontends are adopted, and the takeover still happens — also after the source
//!   node's blkplaned was frozen (SIGSTOP) through the handover, during which the
//!   destination's own API kept answering.

use std::path::Path;
use std::time::{Duration, Instant};

use blkplane_tests::daemon::*;
use blkplane_tests::guest::read_lossy;
use blkplane_tests::raw::RawDevice;
use blkplane_tests::tls::{free_port, make_test_certs, node_options};
use blkplane_tests::*;
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK;

const MIB: u64 = 1 << 20;
const CHUNK: usize = 64 * 1024;
const CHUNKS: u64 = 16;

/// Starts node `name` with the test certificates in `certs`; `peers` gives it the files to
/// reach the other node.
fn node(name: &str, certs: &Path, peers: bool) -> Node {
    Node::start("mn", name, certs, peers)
}

/// How many of `path`'s pages this machine's page cache holds.
fn cached_pages(path: &Path) -> usize {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).unwrap();
    let len = usize::try_from(file.metadata().unwrap().len()).unwrap();
    let page = 4096;
    let mut resident = vec![0u8; len.div_ceil(page)];
    // SAFETY: a private read-only mapping of a file this function holds open, unmapped below;
    // `resident` has a byte for each of its pages.
    unsafe {
        let map = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        );
        assert_ne!(map, libc::MAP_FAILED, "mmap {}", path.display());
        let rc = libc::mincore(map, len, resident.as_mut_ptr());
        libc::munmap(map, len);
        assert_eq!(rc, 0, "mincore {}", path.display());
    }
    resident.iter().filter(|&&b| b & 1 == 1).count()
}

/// Reads all of `path` through the page cache.
fn read_through_cache(path: &Path) {
    let _ = std::fs::read(path).unwrap();
}

#[test]
fn shared_storage_migration_between_two_blkplaned() {
    let t0 = Instant::now();
    let certs = TempDir::new("mn-certs");
    make_test_certs(certs.path());
    let a = node("node-a", certs.path(), true);
    let b = node("node-b", certs.path(), true);
    let images = TempDir::new("mn-img");
    let img = create_image(&images.join("shared.img"), 32 * MIB);
    let watch_a = Watcher::start(&a.daemon);
    let watch_b = Watcher::start(&b.daemon);
    let src = add_disk(
        &a.daemon,
        "src",
        &img,
        &["--num-queues", "2", "--serial", "MN-1"],
    );
    let src_socket = socket_of(&src);
    let src_pid = src.get("frontend_pid").u64() as u32;
    let from = |disk: &str| format!("{}/{disk}", a.endpoint);

    // The source VM: a verified pattern on both queues, its rings kept running. It negotiates
    // dirty logging as QEMU does (without it blkplaned would block the migration).
    let mut source_vmm =
        RawDevice::connect_negotiating(&src_socket, 2, 128, VhostUserProtocolFeatures::LOG_SHMFD)
            .unwrap_or_else(|e| panic!("connect src: {e}"));
    for chunk in 0..CHUNKS {
        let data = pattern(chunk + 1, CHUNK);
        let w = source_vmm.write((chunk % 2) as usize, chunk * CHUNK as u64 / 512, &data);
        assert_eq!(
            w.status_u32(),
            Some(VIRTIO_BLK_S_OK),
            "write through src: {w:?}"
        );
    }
    a.daemon.wait_disk("src", "running its rings", |j| {
        j.get("vmm_connected").bool() && any_ring_running(j)
    });

    // Refusals, each leaving nothing behind on either node.
    let nothing_left = |what: &str| {
        assert!(
            b.daemon.ctl_json(&["disk", "list"]).arr().is_empty(),
            "{what}: node-b kept a disk"
        );
        assert!(
            b.daemon.state_ids().is_empty(),
            "{what}: node-b persisted a disk"
        );
        assert!(
            b.daemon.runtime_files().is_empty(),
            "{what}: node-b left {:?}",
            b.daemon.runtime_files()
        );
        let src = a.daemon.disk("src");
        assert_eq!(
            src.get("config").get("outgoing"),
            &Json::Null,
            "{what}: node-a still records a migration: {src:?}"
        );
    };
    fn add_b<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        let mut args = vec!["disk", "add", "dst"];
        args.extend_from_slice(extra);
        args
    }
    let msg = b.daemon.ctl_refused(
        &add_b(&["--incoming-from", &from("nosuch"), "--shared"]),
        "NOT_FOUND",
        "incoming_from",
    );
    assert!(msg.contains("nosuch"), "{msg}");
    nothing_left("unknown source");
    a.daemon
        .ctl_ok(&["disk", "blocker", "add", "src", "backup", "nightly backup"]);
    let msg = b.daemon.ctl_refused(
        &add_b(&["--incoming-from", &from("src"), "--shared"]),
        "FAILED_PRECONDITION",
        "incoming_from",
    );
    assert!(msg.contains("operator_backup: nightly backup"), "{msg}");
    nothing_left("blocked source");
    a.daemon
        .ctl_ok(&["disk", "blocker", "remove", "src", "backup"]);
    let msg = b.daemon.ctl_refused(
        &add_b(&["--incoming-from", &from("src")]),
        "INVALID_ARGUMENT",
        "settings.image",
    );
    assert!(msg.contains("local storage"), "{msg}");
    nothing_left("local storage without a new image");
    let other = create_image(&images.join("other.img"), 16 * MIB);
    let msg = b.daemon.ctl_refused(
        &add_b(&[
            "--incoming-from",
            &from("src"),
            "--shared",
            "--image",
            other.to_str().unwrap(),
        ]),
        "INVALID_ARGUMENT",
        "settings.image",
    );
    assert!(msg.contains("not the same image"), "{msg}");
    nothing_left("image of another size");
    let nobody = format!("127.0.0.1:{}/src", free_port());
    b.daemon.ctl_refused(
        &add_b(&["--incoming-from", &nobody, "--shared"]),
        "UNAVAILABLE",
        "incoming_from",
    );
    nothing_left("nobody listening");
    // A node that accepts the connection and then says nothing: refused once the peer
    // deadline (10 s) has passed, not held forever (blkplanectl's own deadline is longer).
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_at = format!("{}/src", silent.local_addr().unwrap());
    let asked = Instant::now();
    let out = b.daemon.ctl(&[
        "--timeout",
        "60",
        "disk",
        "add",
        "dst",
        "--incoming-from",
        &silent_at,
        "--shared",
    ]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stderr.contains("UNAVAILABLE") && out.stderr.contains("incoming_from"),
        "{}",
        out.stderr
    );
    let took = asked.elapsed();
    assert!(
        took >= Duration::from_secs(9) && took < Duration::from_secs(30),
        "a silent peer was given up after {took:?}"
    );
    drop(silent);
    nothing_left("a silent node");
    {
        let lonely = node("node-c", certs.path(), false);
        let msg = lonely.daemon.ctl_refused(
            &add_b(&["--incoming-from", &from("src"), "--shared"]),
            "FAILED_PRECONDITION",
            "incoming_from",
        );
        assert!(msg.contains("--peer-tls-ca"), "{msg}");
        assert!(lonely.daemon.state_ids().is_empty());
    }
    nothing_left("no peer certificates");
    {
        // A client certificate node-a does not trust: a TLS refusal, which no retry mends.
        let endpoint = format!("127.0.0.1:{}", free_port());
        let (mut args, reach) = node_options(certs.path(), &endpoint, "node-d", true);
        for a in &mut args {
            for (ours, stranger) in [
                ("client.pem", "stranger.pem"),
                ("client.key", "stranger.key"),
            ] {
                if a.ends_with(ours) {
                    *a = certs.path().join(stranger).to_str().unwrap().to_string();
                }
            }
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let reach: Vec<&str> = reach.iter().map(String::as_str).collect();
        let stranger = Daemon::start_reached_by("mn-node-d", &args, Some(&reach));
        let msg = stranger.ctl_refused(
            &add_b(&["--incoming-from", &from("src"), "--shared"]),
            "FAILED_PRECONDITION",
            "incoming_from",
        );
        assert!(
            msg.contains("certificate") || msg.contains("alert"),
            "{msg}"
        );
        assert!(stranger.state_ids().is_empty());
    }
    nothing_left("an untrusted peer certificate");
    let prepared = events_of(&watch_a, "migration_outgoing", "src").len();
    let cancelled = events_of(&watch_a, "migration_cancelled", "src").len();
    // The size check came after node-a agreed: it was told to forget, each time.
    assert_eq!(prepared, 1, "{:?}", watch_a.events.lock().unwrap());
    assert_eq!(cancelled, 1, "{:?}", watch_a.events.lock().unwrap());

    // The migration. The destination's page cache of the image may predate the source's
    // writes: fill it now, the frontend must drop it before serving. (One machine has one
    // page cache: what the source wrote through it must be written back first, or those
    // dirty pages, the source's own data, would stay. Across nodes the source fdatasyncs
    // when its rings stop, before the destination's start.)
    std::fs::File::open(&img).unwrap().sync_data().unwrap();
    read_through_cache(&img);
    assert!(cached_pages(&img) > 0, "the image is not in the page cache");
    let dst = b.daemon.ctl_json(&[
        "disk",
        "add",
        "dst",
        "--incoming-from",
        &from("src"),
        "--shared",
    ]);
    let dst_pid = dst.get("frontend_pid").u64() as u32;
    let dst_socket = socket_of(&dst);
    let config = dst.get("config");
    assert_eq!(config.get("image").str(), img.to_str().unwrap());
    assert_eq!(config.get("serial").str(), "MN-1");
    assert_eq!(config.get("num_queues").u64(), 2);
    let incoming = config.get("incoming_from");
    assert_eq!(incoming.get("endpoint").str(), a.endpoint);
    assert_eq!(incoming.get("disk").str(), "src");
    assert_eq!(incoming.get("storage").str(), "shared");
    assert_eq!(blocker_reasons(&dst), ["incoming"]);
    let added = watch_b.wait("added", "dst");
    assert!(
        added.get("message").str().contains("disk src on 127.0.0.1"),
        "{added:?}"
    );
    let src = a.daemon.disk("src");
    let outgoing = src.get("config").get("outgoing");
    assert_eq!(outgoing.get("node").str(), "node-b");
    assert_eq!(outgoing.get("disk").str(), "dst");
    let shown = a.daemon.ctl_ok(&["disk", "show", "src"]);
    assert!(shown.contains("migrating to:"), "{shown}");
    let shown = b.daemon.ctl_ok(&["disk", "show", "dst"]);
    assert!(shown.contains("incoming from:"), "{shown}");
    let listed = b.daemon.ctl_ok(&["disk", "list"]);
    assert!(listed.contains(&format!("src@{}", a.endpoint)), "{listed}");
    // Both sides refuse what would make the two frontends disagree.
    a.daemon.ctl_refused(
        &["disk", "resize", "src", "64M"],
        "FAILED_PRECONDITION",
        "node-b",
    );
    b.daemon.ctl_refused(
        &["disk", "resize", "dst", "64M"],
        "FAILED_PRECONDITION",
        "src",
    );
    // Asked again by the destination (a retried AddDisk): the same answer, not a refusal;
    // a second destination: refused.
    let msg = b.daemon.ctl_refused(
        &[
            "disk",
            "add",
            "dst2",
            "--incoming-from",
            &from("src"),
            "--shared",
        ],
        "FAILED_PRECONDITION",
        "incoming_from",
    );
    assert!(
        msg.contains("already being migrated to disk dst on node node-b"),
        "{msg}"
    );

    // The destination VMM starts its rings while the source's still run: reported once,
    // nothing retired.
    let mut dest_vmm = Client::connect_with(
        &dst_socket,
        &ClientOptions {
            num_queues: 2,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("connect dst: {e}"));
    let both = watch_b.wait("both_serving", "dst");
    assert!(
        both.get("message").str().contains("disk src on 127.0.0.1"),
        "{both:?}"
    );
    // The frontend dropped this node's cached pages before its first ring started.
    assert!(
        wait_for(TIMEOUT, || read_lossy(
            &b.daemon.disks_dir().join("dst.log")
        )
        .contains("dropped this node's cached pages")
        .then_some(()))
        .is_some(),
        "{}",
        read_lossy(&b.daemon.disks_dir().join("dst.log"))
    );
    let left = cached_pages(&img);
    assert!(
        left < 8,
        "{left} pages of the image stayed cached after the destination's first ring start"
    );
    std::thread::sleep(Duration::from_secs(1));
    assert!(alive(src_pid), "src was retired while its rings ran");
    assert_eq!(a.daemon.state_ids(), ["src"]);
    assert_eq!(events_of(&watch_b, "both_serving", "dst").len(), 1);
    assert!(events_of(&watch_b, "migrated", "dst").is_empty());

    // The source VMM hands over (its rings stop): node-a retires src, node-b takes over.
    drop(source_vmm);
    let stopped = Instant::now();
    let migrated = watch_b.wait("migrated", "dst");
    eprintln!("takeover {:?} after the source VMM went", stopped.elapsed());
    assert!(stopped.elapsed() < Duration::from_secs(5));
    assert!(
        migrated.get("message").str().contains("retired there"),
        "{migrated:?}"
    );
    let removed = watch_a.wait("removed", "src");
    assert!(
        removed
            .get("message")
            .str()
            .contains("disk dst on node node-b took over"),
        "{removed:?}"
    );
    assert!(
        wait_for(TIMEOUT, || (!alive(src_pid)).then_some(())).is_some(),
        "src's frontend survived its retirement"
    );
    assert!(a.daemon.state_ids().is_empty());
    assert!(!src_socket.exists());
    let dst = b.daemon.disk("dst");
    assert_eq!(dst.get("config").get("incoming_from"), &Json::Null);
    // (libblkio negotiates no dirty logging: that blocker stays while it is connected.)
    assert!(
        !blocker_reasons(&dst).contains(&"incoming".to_string()),
        "{dst:?}"
    );
    assert_eq!(dst.get("frontend_pid").u64() as u32, dst_pid);
    let state = std::fs::read_to_string(b.daemon.state_dir.join("state.json")).unwrap();
    assert!(!state.contains("incoming_from"), "{state}");
    // The destination VMM reads what the source VMM wrote, and writes on.
    for chunk in 0..CHUNKS {
        let q = dest_vmm.queue((chunk % 2) as usize);
        let back = q
            .read_at(chunk * CHUNK as u64, CHUNK)
            .unwrap_or_else(|e| panic!("read through dst: {e}"));
        assert_same_data(
            &format!("chunk {chunk} through dst"),
            &back,
            &pattern(chunk + 1, CHUNK),
        );
    }
    let after = pattern(99, CHUNK);
    dest_vmm
        .queue(1)
        .write_at(CHUNKS * CHUNK as u64, &after)
        .unwrap_or_else(|e| panic!("write through dst: {e}"));
    drop(dest_vmm);
    assert_same_data(
        "dst's write in the image",
        &read_file_at(&img, CHUNKS * CHUNK as u64, CHUNK),
        &after,
    );

    // Cancelling: a second migration, back from node-b to node-a this time, given up on the
    // destination: the source forgets it; `disk migrate --cancel` on a disk without one says so.
    let back = a.daemon.ctl_json(&[
        "disk",
        "add",
        "back",
        "--incoming-from",
        &format!("{}/dst", b.endpoint),
        "--shared",
    ]);
    assert_eq!(
        back.get("config").get("incoming_from").get("disk").str(),
        "dst"
    );
    assert_eq!(
        b.daemon
            .disk("dst")
            .get("config")
            .get("outgoing")
            .get("node")
            .str(),
        "node-a"
    );
    a.daemon.ctl_ok(&["disk", "remove", "back"]);
    let cancelled = watch_b.wait("migration_cancelled", "dst");
    assert!(
        cancelled
            .get("message")
            .str()
            .contains("disk back on node node-a"),
        "{cancelled:?}"
    );
    let told = watch_a.wait("migration_cancelled", "back");
    assert!(
        told.get("message").str().contains("cancelled there too"),
        "{told:?}"
    );
    assert_eq!(
        b.daemon.disk("dst").get("config").get("outgoing"),
        &Json::Null
    );
    let out = b.daemon.ctl_ok(&["disk", "migrate", "dst", "--cancel"]);
    assert!(out.contains("had no live migration"), "{out}");
    // The source side's own cancel, for a destination that cannot tell it; a destination
    // whose VM then runs is told the source was not retired (both may serve).
    a.daemon.ctl_json(&[
        "disk",
        "add",
        "back",
        "--incoming-from",
        &format!("{}/dst", b.endpoint),
        "--shared",
    ]);
    let out = b.daemon.ctl_ok(&["disk", "migrate", "dst", "--cancel"]);
    assert!(
        out.contains("disk back on node node-a was cancelled"),
        "{out}"
    );
    assert_eq!(
        b.daemon.disk("dst").get("config").get("outgoing"),
        &Json::Null
    );
    let back_socket = socket_of(&a.daemon.disk("back"));
    let back_vmm = Client::connect_with(&back_socket, &ClientOptions::default())
        .unwrap_or_else(|e| panic!("connect back: {e}"));
    let forgot = watch_a.wait("both_serving", "back");
    assert!(
        forgot
            .get("message")
            .str()
            .contains("no longer records a migration"),
        "{forgot:?}"
    );
    assert!(b.daemon.state_ids().contains(&"dst".to_string()));
    assert_eq!(
        a.daemon
            .disk("back")
            .get("config")
            .get("incoming_from")
            .get("disk")
            .str(),
        "dst"
    );
    drop(back_vmm);
    drop(watch_a);
    drop(watch_b);
    eprintln!(
        "shared_storage_migration_between_two_blkplaned took {:.1?}",
        t0.elapsed()
    );
}

/// Both sides of a migration are persisted: each node's blkplaned SIGKILLed and restarted
/// while the migration is under way finds it again (the source disk still records it, the
/// destination is still incoming, both frontends adopted, not restarted), and the takeover
/// still happens once the source VMM goes.
#[test]
fn a_migration_across_nodes_survives_restarts_of_both_blkplaned() {
    let certs = TempDir::new("mn-restart-certs");
    make_test_certs(certs.path());
    let a = node("node-a", certs.path(), true);
    let b = node("node-b", certs.path(), true);
    let images = TempDir::new("mn-restart-img");
    let img = create_image(&images.join("shared.img"), 8 * MIB);
    let src = add_disk(&a.daemon, "src", &img, &[]);
    let src_pid = src.get("frontend_pid").u64() as u32;
    let mut source_vmm = RawDevice::connect_negotiating(
        &socket_of(&src),
        1,
        128,
        VhostUserProtocolFeatures::LOG_SHMFD,
    )
    .unwrap_or_else(|e| panic!("connect src: {e}"));
    let data = pattern(7, CHUNK);
    let w = source_vmm.write(0, 0, &data);
    assert_eq!(w.status_u32(), Some(VIRTIO_BLK_S_OK), "{w:?}");
    a.daemon.wait_disk("src", "running its rings", |j| {
        j.get("vmm_connected").bool() && any_ring_running(j)
    });
    let dst = b.daemon.ctl_json(&[
        "disk",
        "add",
        "dst",
        "--incoming-from",
        &format!("{}/src", a.endpoint),
        "--shared",
    ]);
    let dst_pid = dst.get("frontend_pid").u64() as u32;

    a.daemon.kill9();
    a.daemon.spawn();
    let src = a.daemon.wait_disk("src", "adopted", |j| {
        j.get("frontend_pid").u64() as u32 == src_pid && j.get("vmm_connected").bool()
    });
    assert_eq!(src.get("config").get("outgoing").get("disk").str(), "dst");
    b.daemon.kill9();
    b.daemon.spawn();
    let dst = b.daemon.wait_disk("dst", "adopted", |j| {
        j.get("frontend_pid").u64() as u32 == dst_pid
    });
    assert_eq!(
        dst.get("config").get("incoming_from").get("disk").str(),
        "src"
    );

    // The VM moves: the destination VMM runs, the source VMM goes — while node-a's
    // blkplaned is frozen (SIGSTOP: its kernel still accepts connections, nothing answers),
    // as a node that hangs or a network that drops everything. node-b's takeover attempts
    // wait for their deadline; its own API goes on meanwhile.
    let mut dest_vmm = Client::connect_with(&socket_of(&dst), &ClientOptions::default())
        .unwrap_or_else(|e| panic!("connect dst: {e}"));
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(a.daemon.state_ids(), ["src"], "retired while its rings ran");
    kill(a.daemon.pid(), libc::SIGSTOP);
    drop(source_vmm);
    std::thread::sleep(Duration::from_secs(1));
    let other = create_image(&images.join("other.img"), MIB);
    let asked = Instant::now();
    add_disk(&b.daemon, "other", &other, &[]);
    b.daemon.ctl_ok(&["disk", "remove", "other"]);
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "node-b's API waited {:?} for a frozen node-a",
        asked.elapsed()
    );
    assert_ne!(
        b.daemon.disk("dst").get("config").get("incoming_from"),
        &Json::Null,
        "taken over while the source node could not answer"
    );
    kill(a.daemon.pid(), libc::SIGCONT);
    assert!(
        wait_for(Duration::from_secs(40), || a
            .daemon
            .state_ids()
            .is_empty()
            .then_some(()))
        .is_some(),
        "src was not retired after the restarts and the freeze"
    );
    b.daemon.wait_disk("dst", "taken over", |j| {
        j.get("config").get("incoming_from") == &Json::Null
    });
    let back = dest_vmm
        .queue(0)
        .read_at(0, CHUNK)
        .unwrap_or_else(|e| panic!("read through dst: {e}"));
    assert_same_data("src's write through dst", &back, &data);
    assert!(alive(dst_pid));
}
