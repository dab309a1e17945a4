//! Live migration across nodes with local storage: node-a's blkplaned copies a running disk to
//! a new image on node-b while a vhost-user VMM writes to it (two blkplaned on one machine,
//! TCP with mutual TLS between them, each with its own image directory).
//!
//! - refusals: a copy to a destination that was not added (FAILED_PRECONDITION `to_disk`), a
//!   destination image that exists (ALREADY_EXISTS `settings.image`);
//! - the copy: the destination image is created sparse with the source's capacity and serves
//!   nothing; the bulk pass and the passes over written blocks follow the VMM's writes; the
//!   copy converges; the source VMM stopping its rings is the switch-over: the rest is sent,
//!   the destination serves (`migration_copied` on both nodes, the switch-over time shown);
//!   the source VMM coming back (its rings run again) reopens the copy (the destination stops
//!   serving) and a second switch-over completes it again; the images are then byte-identical,
//!   the new one sparse; with the destination's VMM running, the source's coming back makes
//!   node A say `reopened`, which node B refuses (`both_serving`, it serves on) and node A
//!   does not retire a source whose rings run; the destination VMM reads what the source VMM
//!   wrote; its rings running (the source's stopped) retire the source;
//! - cancelling mid-copy: the source serves on untouched (`migration_failed`), the
//!   destination says its copy ended incomplete and discards its partial image, and removing
//!   it deletes the image file;
//! - auto-converge: a VMM writing faster than the copy is limited step by step until the copy
//!   converges, and the limit is lifted when the copy ends;
//! - failures mid-copy, each leaving the source serving with its data: the destination's
//!   blkplaned SIGKILLed (its disk comes back incomplete and drained; a new copy starts over
//!   and completes; cancelled after that, before the destination's VMM ran the VM, the
//!   destination is incomplete again), frozen (SIGSTOP: the copy gives up after the stall timeout), the source's
//!   blkplaned SIGKILLed (the destination says its copy ended; after the restart a new copy
//!   completes), the source's frontend SIGKILLed (its writes since would be unmarked: the copy
//!   fails), the destination's frontend SIGKILLed (the copy goes on: it does not pass through
//!   that frontend, which comes back drained and serves once the image is complete). A
//!   destination whose copy failed keeps nothing of the disk: its partial image is discarded
//!   (deallocated) when the stream ends, or by its blkplaned's restart.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

use blkplane_tests::daemon::*;
use blkplane_tests::guest::read_lossy;
use blkplane_tests::raw::RawDevice;
use blkplane_tests::tls::make_test_certs;
use blkplane_tests::*;
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK;

const MIB: u64 = 1 << 20;
const CAPACITY: u64 = 64 * MIB;
const CHUNK: usize = 64 * 1024;

/// Starts node `name`, able to reach the other.
fn node(name: &str, certs: &Path) -> Node {
    Node::start("ml", name, certs, true)
}

/// Writes chunk `n` (64 KiB at `n` × 64 KiB) with the pattern of `seed` through `vmm`, on
/// queue `n % 2` (a one-queue device: even chunks only).
#[track_caller]
fn write_chunk(vmm: &mut RawDevice, n: u64, seed: u64) {
    let w = vmm.write(
        (n % 2) as usize,
        n * CHUNK as u64 / 512,
        &pattern(seed, CHUNK),
    );
    assert_eq!(
        w.status_u32(),
        Some(VIRTIO_BLK_S_OK),
        "write chunk {n}: {w:?}"
    );
}

/// A VMM on `socket` with `queues` rings running, dirty logging negotiated (without it the
/// disk would carry a migration blocker); `what` names it in a failure.
fn connect(socket: &Path, queues: usize, what: &str) -> RawDevice {
    RawDevice::connect_negotiating(socket, queues, 128, VhostUserProtocolFeatures::LOG_SHMFD)
        .unwrap_or_else(|e| panic!("connect {what}: {e}"))
}

/// Adds disk `src` with `queues` queues on `a` on image `image`, and a VMM that has written
/// chunk 0 and runs its rings.
fn serve(a: &Node, src: &str, image: &Path, queues: usize) -> (Json, RawDevice) {
    let disk = add_disk(
        &a.daemon,
        src,
        image,
        &["--num-queues", &queues.to_string()],
    );
    let mut vmm = connect(&socket_of(&disk), queues, src);
    write_chunk(&mut vmm, 0, 1);
    a.daemon
        .wait_disk(src, "running its rings", any_ring_running);
    (disk, vmm)
}

/// Adds `dst` on `b` as the destination of a copy of `src` on `a`, into the new image `image`.
fn add_destination(b: &Node, dst: &str, a: &Node, src: &str, image: &Path) -> Json {
    b.daemon.ctl_json(&[
        "disk",
        "add",
        dst,
        "--incoming-from",
        &format!("{}/{src}", a.endpoint),
        "--image",
        image.to_str().unwrap(),
    ])
}

/// Starts the copy of `src` on `a` to `dst` on `b` at `bandwidth`.
fn migrate(a: &Node, src: &str, b: &Node, dst: &str, bandwidth: &str) {
    a.daemon.ctl_ok(&[
        "disk",
        "migrate",
        src,
        "--to",
        &format!("{}/{dst}", b.endpoint),
        "--bandwidth",
        bandwidth,
    ]);
}

/// Bytes of `path` allocated on disk.
fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

/// Asserts two images are byte-identical, naming the first 64 KiB chunk that is not.
#[track_caller]
fn assert_same_image(a: &Path, b: &Path) {
    let (x, y) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    assert_eq!(x.len(), y.len(), "sizes differ");
    if let Some(chunk) = x
        .chunks(CHUNK)
        .zip(y.chunks(CHUNK))
        .position(|(p, q)| p != q)
    {
        panic!(
            "{} and {} differ in chunk {chunk} (at {} bytes)",
            a.display(),
            b.display(),
            chunk * CHUNK
        );
    }
}

#[test]
fn a_local_disk_is_copied_to_another_node_while_its_vmm_writes() {
    let t0 = Instant::now();
    let certs = TempDir::new("ml-certs");
    make_test_certs(certs.path());
    let a = node("node-a", certs.path());
    let b = node("node-b", certs.path());
    let images_a = TempDir::new("ml-img-a");
    let images_b = TempDir::new("ml-img-b");
    let watch_a = Watcher::start(&a.daemon);
    let watch_b = Watcher::start(&b.daemon);

    // The source: 64 MiB, 4 MiB of data at 0 and 1 MiB at 32 MiB, the rest a hole.
    let src_img = create_image(&images_a.join("src.img"), CAPACITY);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&src_img)
            .unwrap();
        for n in 0..64u64 {
            f.write_all_at(&pattern(1000 + n, CHUNK), n * CHUNK as u64)
                .unwrap();
        }
        for n in 512..528u64 {
            f.write_all_at(&pattern(1000 + n, CHUNK), n * CHUNK as u64)
                .unwrap();
        }
    }
    let (src, mut source_vmm) = serve(&a, "src", &src_img, 2);
    let src_socket = socket_of(&src);
    let src_pid = src.get("frontend_pid").u64() as u32;
    let to = format!("{}/dst", b.endpoint);
    let from = format!("{}/src", a.endpoint);

    // Refusals.
    a.daemon.ctl_refused(
        &["disk", "migrate", "src", "--to", &to],
        "FAILED_PRECONDITION",
        "to_disk",
    );
    let taken = create_image(&images_b.join("taken.img"), CAPACITY);
    b.daemon.ctl_refused(
        &[
            "disk",
            "add",
            "dst",
            "--incoming-from",
            &from,
            "--image",
            taken.to_str().unwrap(),
        ],
        "ALREADY_EXISTS",
        "settings.image",
    );
    assert!(b.daemon.state_ids().is_empty());
    assert_eq!(
        a.daemon.disk("src").get("config").get("outgoing"),
        &Json::Null
    );

    // The destination: a new sparse image that serves nothing yet.
    let dst_img = images_b.join("dst.img");
    let dst = add_destination(&b, "dst", &a, "src", &dst_img);
    assert_eq!(dst.get("state").str(), "drained", "{dst:?}");
    assert_eq!(
        dst.get("config").get("incoming_from").get("storage").str(),
        "local"
    );
    assert_eq!(std::fs::metadata(&dst_img).unwrap().len(), CAPACITY);
    assert!(allocated(&dst_img) < MIB, "the new image is not sparse");
    let dst_socket = socket_of(&dst);

    // The copy, at 20 MiB/s, while the source VMM writes.
    migrate(&a, "src", &b, "dst", "20M");
    watch_a.wait("migration_copying", "src");
    let mut seed = 10;
    let writing = Instant::now();
    while writing.elapsed() < Duration::from_secs(2) {
        for n in [0, 3, 100, 515, 700, 1023] {
            seed += 1;
            write_chunk(&mut source_vmm, n, seed);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let converged = watch_a.wait("migration_converged", "src");
    eprintln!("{converged:?}");
    let shown = a.daemon.disk("src");
    let copy = shown.get("migration_copy");
    assert!(copy.get("bytes_sent").u64() >= 5 * MIB, "{copy:?}");
    assert!(copy.get("passes").u64() >= 1, "{copy:?}");
    assert_eq!(b.daemon.disk("dst").get("state").str(), "drained");

    // The switch-over: the source VMM stops its rings.
    drop(source_vmm);
    let copied = watch_a.wait("migration_copied", "src");
    eprintln!("switch-over: {}", copied.get("message").str());
    watch_b.wait("migration_copied", "dst");
    let dst = b
        .daemon
        .wait_disk("dst", "serving", |j| j.get("state").str() == "ready");
    assert_eq!(dst.get("state").str(), "ready");
    let copy = a.daemon.disk("src").get("migration_copy").clone();
    assert_eq!(copy.get("phase").str(), "complete", "{copy:?}");
    assert!(copy.get("switch_over_us").u64() > 0);
    assert_same_image(&src_img, &dst_img);

    // The source VM goes on after all (the VMM's migration failed): the destination stops
    // serving, and the writes since reach it at the next switch-over.
    let mut source_vmm = connect(&src_socket, 2, "src again");
    write_chunk(&mut source_vmm, 900, 5000);
    b.daemon.wait_disk("dst", "drained again", |j| {
        j.get("state").str() == "drained"
    });
    assert!(
        a.daemon
            .disk("src")
            .get("migration_copy")
            .get("phase")
            .str()
            != "complete",
        "the copy stayed complete while the source served again"
    );
    write_chunk(&mut source_vmm, 901, 5001);
    drop(source_vmm);
    let dst = b
        .daemon
        .wait_disk("dst", "serving again", |j| j.get("state").str() == "ready");
    assert_eq!(dst.get("state").str(), "ready");
    assert_same_image(&src_img, &dst_img);
    assert!(
        allocated(&dst_img) < 16 * MIB,
        "the copy is not sparse: {} bytes allocated",
        allocated(&dst_img)
    );

    // Both VMs run: the destination's VMM runs its rings, then the source's VMM comes back
    // too while node A's blkplaned is frozen (so that it retires nothing first). Node A's copy
    // sees the source's rings running and says `reopened`; node B refuses, its VMM runs the
    // VM (`both_serving`), and serves on; node A does not retire a source whose rings run.
    kill(a.daemon.pid(), libc::SIGSTOP);
    let mut dest_vmm = connect(&dst_socket, 2, "dst");
    let source_again = connect(&src_socket, 2, "src while dst runs");
    kill(a.daemon.pid(), libc::SIGCONT);
    let refused = wait_for(TIMEOUT, || {
        events_of(&watch_b, "both_serving", "dst")
            .into_iter()
            .find(|e| e.get("message").str().contains("runs the VM already"))
    })
    .expect("node B did not refuse the reopen");
    eprintln!("reopen refused: {}", refused.get("message").str());
    assert!(
        wait_for(TIMEOUT, || a
            .daemon
            .log_text()
            .contains("but the VM runs there already: not copied")
            .then_some(()))
        .is_some(),
        "node A did not see the refusal:\n{}",
        a.daemon.log_text()
    );
    assert_eq!(b.daemon.disk("dst").get("state").str(), "connected");
    assert!(a.daemon.state_ids().contains(&"src".to_string()));
    drop(source_again);

    // The destination VMM reads what the source wrote; its rings running (and the source's
    // stopped) retire the source.
    let r = dest_vmm.read(0, 901 * CHUNK as u64 / 512, CHUNK as u32);
    assert_eq!(r.status_u32(), Some(VIRTIO_BLK_S_OK), "{r:?}");
    assert_same_data("chunk 901 through dst", &r.data[0], &pattern(5001, CHUNK));
    watch_b.wait("migrated", "dst");
    watch_a.wait("removed", "src");
    assert!(
        wait_for(TIMEOUT, || (!alive(src_pid)).then_some(())).is_some(),
        "src's frontend survived its retirement"
    );
    assert!(a.daemon.state_ids().is_empty());
    let dst = b.daemon.disk("dst");
    assert_eq!(dst.get("config").get("incoming_from"), &Json::Null);
    drop(dest_vmm);
    eprintln!(
        "copied, switched over twice and retired in {:?}",
        t0.elapsed()
    );

    // Cancelled mid-copy: the source serves on, the partial image goes with its disk.
    let (_, dst2_img, _, mut vmm2) = source_and_destination(
        (&a, images_a.path(), "src2"),
        (&b, images_b.path(), "dst2"),
        256,
        7000,
    );
    migrate(&a, "src2", &b, "dst2", "2M");
    wait_copying(&a, "src2");
    a.daemon.ctl_ok(&["disk", "migrate", "src2", "--cancel"]);
    let failed = watch_a.wait("migration_failed", "src2");
    assert!(
        failed.get("message").str().contains("cancelled"),
        "{failed:?}"
    );
    let ended = watch_b.wait("migration_failed", "dst2");
    let message = ended.get("message").str();
    assert!(
        message.contains("before the image was complete")
            && message.contains("its partial image was discarded"),
        "{ended:?}"
    );
    // Nothing of the disk stays on node B: the part copied so far is deallocated.
    assert!(dst2_img.exists());
    assert_eq!(allocated(&dst2_img), 0, "the partial image was kept");
    // The source serves on.
    write_chunk(&mut vmm2, 4, 2);
    let r = vmm2.read(0, 4 * CHUNK as u64 / 512, CHUNK as u32);
    assert_same_data("src2 after the cancel", &r.data[0], &pattern(2, CHUNK));
    assert_eq!(b.daemon.disk("dst2").get("state").str(), "drained");
    b.daemon.ctl_ok(&["disk", "remove", "dst2"]);
    assert!(!dst2_img.exists(), "the image file was kept");
    drop(vmm2);
}

/// A VMM writing faster than the copy sends: the copy limits its writes, step by step, until
/// it converges (`migration_auto_converge` events), completes at the switch-over, and lifts
/// the limit when it ends.
#[test]
fn a_guest_writing_faster_than_the_copy_is_slowed_until_it_converges() {
    let certs = TempDir::new("mla-certs");
    make_test_certs(certs.path());
    let a = node("node-a2", certs.path());
    let b = node("node-b2", certs.path());
    let images_a = TempDir::new("mla-img-a");
    let images_b = TempDir::new("mla-img-b");
    let watch_a = Watcher::start(&a.daemon);
    let src_img = create_image(&images_a.join("src.img"), CAPACITY);
    let (_, mut vmm) = serve(&a, "src", &src_img, 2);
    let dst_img = images_b.join("dst.img");
    add_destination(&b, "dst", &a, "src", &dst_img);
    migrate(&a, "src", &b, "dst", "8M");
    // 8 MiB of the disk rewritten over and over, as fast as the VMM can (far above 8 MiB/s
    // until it is limited).
    let started = Instant::now();
    let mut seed = 100;
    let mut n = 0;
    let converged = loop {
        seed += 1;
        write_chunk(&mut vmm, n, seed);
        n = (n + 1) % 128;
        if let Some(e) = events_of(&watch_a, "migration_converged", "src").pop() {
            break e;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no convergence: {:?}",
            a.daemon.disk("src").get("migration_copy")
        );
    };
    let steps = events_of(&watch_a, "migration_auto_converge", "src");
    assert!(!steps.is_empty(), "converged without limiting the writes");
    for step in &steps {
        assert!(step.get("message").str().contains("limited to"), "{step:?}");
    }
    let copy = a.daemon.disk("src").get("migration_copy").clone();
    assert!(
        copy.get("throttle_write_bytes_per_second").u64() > 0,
        "{copy:?}"
    );
    eprintln!(
        "converged after {:?} and {} limit steps: {converged:?}; {copy:?}",
        started.elapsed(),
        steps.len()
    );
    drop(vmm);
    watch_a.wait("migration_copied", "src");
    assert_same_image(&src_img, &dst_img);
    // The copy ends (cancelled on node A): the disk's own limits (none) apply again.
    a.daemon.ctl_ok(&["disk", "migrate", "src", "--cancel"]);
    let lifted = wait_for(TIMEOUT, || {
        events_of(&watch_a, "migration_auto_converge", "src")
            .into_iter()
            .find(|e| e.get("message").str().contains("apply again"))
    });
    assert!(lifted.is_some(), "the limit was not lifted");
}

/// Writes `chunks` 64 KiB chunks of data into `image` past any frontend (seeded by `seed`).
fn fill(image: &Path, chunks: u64, seed: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(image).unwrap();
    for n in 0..chunks {
        f.write_all_at(&pattern(seed + n, CHUNK), n * CHUNK as u64)
            .unwrap();
    }
}

/// Source `src` on `a` (an image in `images_a` with `chunks` chunks of data seeded `seed`, one
/// queue, a VMM running its ring) and its destination `dst` on `b` (a new image in
/// `images_b`); returns the two images, the source disk and its VMM.
fn source_and_destination(
    (a, images_a, src): (&Node, &Path, &str),
    (b, images_b, dst): (&Node, &Path, &str),
    chunks: u64,
    seed: u64,
) -> (std::path::PathBuf, std::path::PathBuf, Json, RawDevice) {
    let src_img = create_image(&images_a.join(format!("{src}.img")), CAPACITY);
    fill(&src_img, chunks, seed);
    let (disk, vmm) = serve(a, src, &src_img, 1);
    let dst_img = images_b.join(format!("{dst}.img"));
    add_destination(b, dst, a, src, &dst_img);
    (src_img, dst_img, disk, vmm)
}

/// Waits until `src`'s copy on `a` has sent something (the copy may not have started yet:
/// `disk migrate --watch` runs beside the test).
fn wait_copying(a: &Node, src: &str) {
    a.daemon.wait_disk(src, "copying", |j| {
        let copy = j.get("migration_copy");
        copy != &Json::Null && copy.get("bytes_sent").u64() > 0
    });
}

/// Checks that the VMM still writes and reads back on `src` (chunk `n`, even).
#[track_caller]
fn still_serves(vmm: &mut RawDevice, n: u64, seed: u64, what: &str) {
    write_chunk(vmm, n, seed);
    let r = vmm.read(0, n * CHUNK as u64 / 512, CHUNK as u32);
    assert_eq!(r.status_u32(), Some(VIRTIO_BLK_S_OK), "{what}: {r:?}");
    assert_same_data(what, &r.data[0], &pattern(seed, CHUNK));
}

#[test]
fn a_failed_copy_leaves_the_source_serving_and_a_new_one_completes() {
    let certs = TempDir::new("mlf-certs");
    make_test_certs(certs.path());
    let a = node("node-a3", certs.path());
    let b = node("node-b3", certs.path());
    let images_a = TempDir::new("mlf-img-a");
    let images_b = TempDir::new("mlf-img-b");
    let watch_a = Watcher::start(&a.daemon);

    // The destination's blkplaned is killed mid-copy: the source serves on; the destination
    // comes back incomplete and drained; a new copy starts over and completes.
    let (src_img, dst_img, _, mut vmm) = source_and_destination(
        (&a, images_a.path(), "s1"),
        (&b, images_b.path(), "d1"),
        256,
        100,
    );
    migrate(&a, "s1", &b, "d1", "2M");
    wait_copying(&a, "s1");
    b.daemon.kill9();
    let failed = watch_a.wait("migration_failed", "s1");
    eprintln!("destination killed: {}", failed.get("message").str());
    // Told apart from the destination's own refusal.
    assert!(
        failed
            .get("message")
            .str()
            .contains("the connection to the destination"),
        "{failed:?}"
    );
    still_serves(&mut vmm, 2, 7, "s1 after the destination's blkplaned died");
    b.daemon.spawn();
    let d1 = b
        .daemon
        .wait_disk("d1", "back", |j| j.get("state").str() == "drained");
    assert_eq!(
        d1.get("config").get("incoming_from").get("disk").str(),
        "s1"
    );
    // The restarted blkplaned discarded what the dead one had received.
    assert_eq!(allocated(&dst_img), 0, "the partial image was kept");
    assert!(
        b.daemon
            .log_text()
            .contains("disk d1: discarded the partial image of the copy from"),
        "{}",
        b.daemon.log_text()
    );
    migrate(&a, "s1", &b, "d1", "0");
    still_serves(&mut vmm, 4, 8, "s1 during the second copy");
    drop(vmm);
    b.daemon
        .wait_disk("d1", "complete", |j| j.get("state").str() == "ready");
    assert_same_image(&src_img, &dst_img);
    // Cancelled on node A after it was complete, before d1's VMM ran the VM: node A can no
    // longer say when s1 is written, so d1 is incomplete again.
    let watch_b = Watcher::start(&b.daemon);
    a.daemon.ctl_ok(&["disk", "migrate", "s1", "--cancel"]);
    let reverted = watch_b.wait("migration_failed", "d1");
    assert!(
        reverted
            .get("message")
            .str()
            .contains("after it was complete"),
        "{reverted:?}"
    );
    b.daemon.wait_disk("d1", "incomplete again", |j| {
        j.get("state").str() == "drained"
    });
    drop(watch_b);

    // The destination's blkplaned freezes: the copy gives up after its stall timeout.
    let watch_b = Watcher::start(&b.daemon);
    let (_, d2_img, _, mut vmm) = source_and_destination(
        (&a, images_a.path(), "s2"),
        (&b, images_b.path(), "d2"),
        512,
        200,
    );
    migrate(&a, "s2", &b, "d2", "4M");
    wait_copying(&a, "s2");
    let frozen = Instant::now();
    kill(b.daemon.pid(), libc::SIGSTOP);
    let failed = wait_for(Duration::from_secs(90), || {
        events_of(&watch_a, "migration_failed", "s2").pop()
    });
    kill(b.daemon.pid(), libc::SIGCONT);
    let failed = failed.expect("the copy to a frozen node never failed");
    eprintln!(
        "destination frozen: failed after {:?}: {}",
        frozen.elapsed(),
        failed.get("message").str()
    );
    still_serves(&mut vmm, 2, 9, "s2 after the destination froze");
    drop(vmm);
    // Thawed, node B finds its stream gone and discards the part it had received.
    let ended = watch_b.wait("migration_failed", "d2");
    assert!(
        ended
            .get("message")
            .str()
            .contains("its partial image was discarded"),
        "{ended:?}"
    );
    assert_eq!(allocated(&d2_img), 0, "the partial image was kept");
    drop(watch_b);

    // The source's blkplaned is killed mid-copy: its frontend serves on; the destination says
    // its copy ended; after the restart a new copy completes.
    let watch_b = Watcher::start(&b.daemon);
    let (src_img, dst_img, _, mut vmm) = source_and_destination(
        (&a, images_a.path(), "s3"),
        (&b, images_b.path(), "d3"),
        256,
        300,
    );
    migrate(&a, "s3", &b, "d3", "2M");
    wait_copying(&a, "s3");
    drop(watch_a);
    a.daemon.kill9();
    let ended = watch_b.wait("migration_failed", "d3");
    assert!(
        ended
            .get("message")
            .str()
            .contains("before the image was complete"),
        "{ended:?}"
    );
    still_serves(&mut vmm, 2, 10, "s3 while its blkplaned is down");
    a.daemon.spawn();
    // The restarted blkplaned stops the tracking the dead one's copy left on.
    let s3_log = a.daemon.disks_dir().join("s3.log");
    assert!(
        wait_for(TIMEOUT, || read_lossy(&s3_log)
            .contains("no longer tracking")
            .then_some(()))
        .is_some(),
        "the leftover tracking was not stopped:\n{}",
        read_lossy(&s3_log)
    );
    let watch_a = Watcher::start(&a.daemon);
    migrate(&a, "s3", &b, "d3", "0");
    still_serves(&mut vmm, 4, 11, "s3 during the second copy");
    drop(vmm);
    watch_a.wait("migration_copied", "s3");
    assert_same_image(&src_img, &dst_img);

    // The source's frontend is killed mid-copy: writes after it would not be marked, so the
    // copy fails; blkplaned restarts the frontend.
    let (_, _, s4, vmm) = source_and_destination(
        (&a, images_a.path(), "s4"),
        (&b, images_b.path(), "d4"),
        256,
        400,
    );
    // Watched the way an operator would: a progress line a second until it fails.
    let watching = a
        .daemon
        .ctl_command()
        .args([
            "disk",
            "migrate",
            "s4",
            "--to",
            &format!("{}/d4", b.endpoint),
            "--bandwidth",
            "2M",
            "--watch",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_copying(&a, "s4");
    std::thread::sleep(Duration::from_millis(1500));
    kill(s4.get("frontend_pid").u64() as u32, libc::SIGKILL);
    let failed = watch_a.wait("migration_failed", "s4");
    assert!(
        failed.get("message").str().contains("restarted"),
        "{failed:?}"
    );
    let watched = watching.wait_with_output().unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&watched.stdout),
        String::from_utf8_lossy(&watched.stderr),
    );
    assert_eq!(watched.status.code(), Some(1), "{out}{err}");
    assert!(out.lines().count() >= 2, "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("bulk") && l.contains("limit 2.0 MiB/s")),
        "{out}"
    );
    assert!(err.contains("the copy of disk s4 failed"), "{err}");
    drop(vmm);
    assert_eq!(b.daemon.disk("d4").get("state").str(), "drained");

    // The destination's frontend is killed mid-copy: the copy does not pass through it (node
    // B's blkplaned writes the image), so it goes on; blkplaned restarts the frontend, which
    // serves nothing until the image is complete, and then serves it.
    let (src_img, dst_img, _, mut vmm) = source_and_destination(
        (&a, images_a.path(), "s5"),
        (&b, images_b.path(), "d5"),
        256,
        500,
    );
    migrate(&a, "s5", &b, "d5", "4M");
    wait_copying(&a, "s5");
    let old_pid = b.daemon.disk("d5").get("frontend_pid").u64();
    kill(old_pid as u32, libc::SIGKILL);
    let d5 = b.daemon.wait_disk("d5", "restarted", |j| {
        let pid = j.get("frontend_pid").u64();
        pid != 0 && pid != old_pid && j.get("state").str() == "drained"
    });
    assert!(d5.get("restarts").u64() >= 1, "{d5:?}");
    still_serves(&mut vmm, 2, 12, "s5 after the destination's frontend died");
    // The switch-over: the source's VMM goes away, the rest is sent, d5 serves.
    a.daemon.wait_disk("s5", "converged", |j| {
        j.get("migration_copy").get("phase").str() == "converged"
    });
    drop(vmm);
    watch_a.wait("migration_copied", "s5");
    b.daemon
        .wait_disk("d5", "serving", |j| j.get("state").str() == "ready");
    assert_same_image(&src_img, &dst_img);
}
