//! qcow2 images made by `qemu-img`, served to libblkio: the layout options qemu-img has that
//! change how data is found (cluster sizes of 4 KiB, 64 KiB and 2 MiB, lazy refcounts,
//! version 2, compressed clusters), a backing chain of three with relative names, and the
//! images a frontend must refuse (extended L2 entries among them: imago 0.2 lacks them). Each writes through blkplane what it also
//! writes into a raw mirror, then `qemu-img check` must find no corruption and `qemu-img
//! compare` no difference between the qcow2 image's guest view and the mirror.

use std::path::{Path, PathBuf};
use std::process::Command;

use blkplane_tests::client::errno_name;
use blkplane_tests::qemu_img::{assert_check_clean, create_overlay, create_qcow2, qemu_img};
use blkplane_tests::tools::{output_within, run_tool, text};
use blkplane_tests::*;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const DISK: u64 = 64 * MIB;

#[track_caller]
fn ok<T>(what: &str, r: Result<T, i32>) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {}", errno_name(e)))
}

/// `qemu-img compare` of the qcow2 image's guest view with a raw mirror: identical.
fn assert_same_as(image: &Path, mirror: &Path) {
    let out = output_within(
        Command::new("qemu-img").args([
            "compare",
            "-f",
            "qcow2",
            "-F",
            "raw",
            image.to_str().unwrap(),
            mirror.to_str().unwrap(),
        ]),
        std::time::Duration::from_secs(60),
    );
    assert!(
        out.status.success(),
        "qemu-img compare {} {}: {}",
        image.display(),
        mirror.display(),
        text(&out)
    );
}

/// Writes the same data through blkplane and into the mirror file.
struct Mirrored<'a> {
    queue: &'a mut IoQueue,
    mirror: std::fs::File,
    /// Discarded clusters read back as zeros (qcow2 v3's zero clusters); a v2 image keeps
    /// their data (discard is advisory), and the mirror takes what the device reads.
    discard_zeroes: bool,
}

impl<'a> Mirrored<'a> {
    /// `queue`'s writes mirrored into the raw file `mirror`.
    fn new(queue: &'a mut IoQueue, mirror: &Path, discard_zeroes: bool) -> Self {
        let mirror = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(mirror)
            .unwrap();
        Self {
            queue,
            mirror,
            discard_zeroes,
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        use std::os::unix::fs::FileExt;
        ok(
            &format!("write {} at {offset}", data.len()),
            self.queue.write_at(offset, data),
        );
        self.mirror.write_all_at(data, offset).unwrap();
    }

    fn zero(&mut self, offset: u64, len: u64, unmap: bool, discard: bool) {
        use std::os::unix::fs::FileExt;
        let op = if discard {
            Op::Discard { offset, len }
        } else {
            Op::WriteZeroes { offset, len, unmap }
        };
        ok(&format!("{op:?}"), self.queue.run(&op));
        let now = if discard && !self.discard_zeroes {
            ok("read", self.queue.read_at(offset, len as usize))
        } else {
            vec![0; len as usize]
        };
        self.mirror.write_all_at(&now, offset).unwrap();
    }

    fn check(&mut self, offset: u64, len: usize, what: &str) {
        let got = ok(
            &format!("read {len} at {offset}"),
            self.queue.read_at(offset, len),
        );
        let want = read_file_at_mirror(&self.mirror, offset, len);
        assert_same_data(what, &got, &want);
    }
}

/// Reads the whole disk, a MiB at a time, and compares it with the raw file `want`.
fn assert_disk_reads_as(queue: &mut IoQueue, want: &Path, what: &str) {
    let want = read_file(want);
    for offset in (0..DISK).step_by(MIB as usize) {
        let got = ok("read", queue.read_at(offset, MIB as usize));
        assert_same_data(
            &format!("{what}: the MiB at {offset}"),
            &got,
            &want[offset as usize..(offset + MIB) as usize],
        );
    }
}

fn read_file_at_mirror(file: &std::fs::File, offset: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0; len];
    file.read_exact_at(&mut buf, offset).unwrap();
    buf
}

/// Writes that meet every path: a fresh cluster (allocating, with copy-on-write of the rest),
/// the same cluster again (allocated), sub-cluster and unaligned pieces, writes across cluster
/// boundaries, a large write over many clusters; zeroes and discards of whole and partial
/// clusters; every piece read back against the mirror, and the whole disk at the end.
fn exercise(queue: &mut IoQueue, mirror: &Path, cluster: u64, seed: u64, discard_zeroes: bool) {
    let mut m = Mirrored::new(queue, mirror, discard_zeroes);
    let mut rng = Rng::new(seed);
    let at = |n: u64| (n * cluster + 3 * MIB).min(DISK - 4 * MIB);
    m.write(at(0), &pattern(seed, 4096));
    m.write(at(0) + 8192, &pattern(seed + 1, 4096));
    m.write(at(0), &pattern(seed + 2, 512));
    m.write(at(1) + 512, &pattern(seed + 3, 1536));
    // Across a cluster boundary.
    m.write(at(3) - 2048, &pattern(seed + 4, 8192));
    // Many clusters at once.
    m.write(5 * MIB + 4096, &pattern(seed + 5, (MIB + 8192) as usize));
    m.write(DISK - 4096, &pattern(seed + 6, 4096));
    for i in 0..64 {
        let offset = rng.below(DISK / 512 - 64) * 512;
        let len = (1 + rng.below(32)) as usize * 512;
        m.write(offset, &pattern(seed + 100 + i, len));
    }
    m.check(at(0), 16384, "writes into one cluster");
    m.check(at(3) - 8192, 16384, "a write across a cluster boundary");
    // Zeroing: whole clusters (zero clusters), partial ones (written zeros), with and
    // without unmap, and a discard of whole clusters.
    let whole = 16 * MIB;
    // libblkio's buffer holds 4 MiB: two 2 MiB clusters.
    let span = (4 * cluster.max(64 * KIB)).min(4 * MIB);
    m.write(whole, &pattern(seed + 7, span as usize));
    m.zero(whole, 2 * cluster, true, false);
    m.zero(whole + span / 2 + 512, 1024, false, false);
    m.write(whole + 8 * MIB, &pattern(seed + 8, (2 * cluster) as usize));
    m.zero(whole + 8 * MIB, cluster, false, false);
    m.zero(whole + 8 * MIB + cluster, cluster, false, true);
    m.check(whole, span as usize, "zeroed clusters");
    m.check(
        whole + 8 * MIB,
        (2 * cluster) as usize,
        "zeroed and discarded clusters",
    );
    ok("flush", m.queue.flush());
    for offset in (0..DISK).step_by(MIB as usize) {
        m.check(offset, MIB as usize, &format!("the MiB at {offset}"));
    }
}

#[test]
fn qemu_img_layouts_read_write_check_and_compare() {
    let dir = TempDir::new("qcow2");
    for (name, options, cluster) in [
        ("c4k", "cluster_size=4096", 4 * KIB),
        ("c64k", "cluster_size=65536", 64 * KIB),
        ("c2m", "cluster_size=2097152", 2 * MIB),
        ("lazy", "lazy_refcounts=on", 64 * KIB),
        ("v2", "compat=0.10", 64 * KIB),
    ] {
        let image = create_qcow2(&dir.join(&format!("{name}.qcow2")), options, DISK);
        let mirror = create_image(&dir.join(&format!("{name}.raw")), DISK);
        let fe = Frontend::start(&image, &[]);
        let mut c = Client::connect(fe.socket()).unwrap();
        assert_eq!(c.capacity(), DISK, "{name}: capacity is the virtual size");
        exercise(c.queue(0), &mirror, cluster, 17, name != "v2");
        drop(c);
        fe.finish();
        assert_check_clean(&image, false);
        assert_same_as(&image, &mirror);
        println!("{name} ({options}): writes, zeroes and discards read back; check clean, compare identical");
    }
}

/// qcow2 images that keep their data clusters in an external data file (`data_file`, and
/// `data_file_raw=on`, where the data file is a raw image of the disk): the data moves to and
/// from the data file at the mapped offsets, the metadata stays in the image.
#[test]
fn external_data_files_hold_the_data() {
    let dir = TempDir::new("qcow2df");
    for (name, raw) in [("df", ""), ("dfraw", ",data_file_raw=on")] {
        // qemu-img creates the data file relative to its own directory: name it absolutely.
        let data = dir.join(&format!("{name}.data"));
        let options = format!("data_file={}{raw}", data.display());
        let image = create_qcow2(&dir.join(&format!("{name}.qcow2")), &options, DISK);
        let mirror = create_image(&dir.join(&format!("{name}.raw")), DISK);
        let fe = Frontend::start(&image, &[]);
        let mut c = Client::connect(fe.socket()).unwrap();
        assert_eq!(c.capacity(), DISK);
        exercise(c.queue(0), &mirror, 64 * KIB, 41, true);
        drop(c);
        fe.finish();
        assert_check_clean(&image, false);
        assert_same_as(&image, &mirror);
        if name == "dfraw" {
            // The raw data file is the disk itself.
            let data = read_file(&dir.join("dfraw.data"));
            assert!(
                data == read_file(&mirror),
                "the raw data file is not the guest's view"
            );
        }
        println!("{name} ({options}): the data in the external data file; check clean, compare identical");
    }
}

/// An external data file holds each cluster at its guest offset, wherever the file ends: one
/// shorter than the disk (an empty file handed to `qemu-img create` with `data_file` kept, or
/// made by another tool) takes writes anywhere in the disk, however far past its end — up to
/// the disk's last cluster, which the disk ends 4 KiB into (imago fills the rest of it with
/// zeros, past the disk's size).
#[test]
fn a_data_file_shorter_than_the_disk_takes_writes_anywhere_in_it() {
    const SIZE: u64 = (3 << 30) + 4096;
    let dir = TempDir::new("qcow2-short-data");
    let data = dir.join("short.data");
    let options = format!("data_file={}", data.display());
    let image = create_qcow2(&dir.join("short.qcow2"), &options, SIZE);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&data)
        .unwrap()
        .set_len(0)
        .unwrap();
    let fe = Frontend::start(&image, &[]);
    let mut c = Client::connect(fe.socket()).unwrap();
    let q = c.queue(0);
    // Part of a cluster 2.5 GiB into an empty file: imago fills the rest of the cluster
    // with zeros there, then the guest's data goes in.
    let at = (5u64 << 29) + 4096;
    let written = pattern(3, 4096);
    ok(
        "write far into the short data file",
        q.write_at(at, &written),
    );
    ok("flush", q.flush());
    assert_same_data("read back", &ok("read", q.read_at(at, 4096)), &written);
    assert_same_data(
        "the rest of its cluster",
        &ok("read", q.read_at(at - 4096, 4096)),
        &vec![0; 4096],
    );
    // The last cluster: the disk's 4 KiB of it written, then zeroed.
    let last = pattern(4, 4096);
    ok(
        "write the disk's last 4 KiB",
        q.write_at(SIZE - 4096, &last),
    );
    assert_same_data(
        "the last 4 KiB",
        &ok("read", q.read_at(SIZE - 4096, 4096)),
        &last,
    );
    ok(
        "write-zeroes over them",
        q.run(&Op::WriteZeroes {
            offset: SIZE - 4096,
            len: 4096,
            unmap: false,
        }),
    );
    assert_same_data(
        "the last 4 KiB zeroed",
        &ok("read", q.read_at(SIZE - 4096, 4096)),
        &vec![0; 4096],
    );
    // Now a zero cluster that keeps its allocation: part of it written in place, the rest
    // of the cluster zero-filled by imago from the disk's end on.
    let part = pattern(5, 1024);
    ok(
        "write into the zeroed last cluster",
        q.write_at(SIZE - 2048, &part),
    );
    let mut want = vec![0; 4096];
    want[2048..3072].copy_from_slice(&part);
    assert_same_data(
        "the last 4 KiB after it",
        &ok("read", q.read_at(SIZE - 4096, 4096)),
        &want,
    );
    ok("flush", q.flush());
    drop(c);
    fe.finish();
    assert_check_clean(&image, false);
    println!(
        "a data file of 0 bytes under a 3 GiB + 4 KiB disk: a write 2.5 GiB in and the last \
         4 KiB read back, check clean"
    );
}

#[test]
fn compressed_clusters_are_read_and_rewritten() {
    let dir = TempDir::new("qcow2c");
    let raw = create_random_image(&dir.join("data.raw"), DISK, 5);
    let image = dir.join("compressed.qcow2");
    qemu_img(&[
        "convert",
        "-q",
        "-c",
        "-f",
        "raw",
        "-O",
        "qcow2",
        raw.to_str().unwrap(),
        image.to_str().unwrap(),
    ]);
    let fe = Frontend::start(&image, &[]);
    let mut c = Client::connect(fe.socket()).unwrap();
    let q = c.queue(0);
    assert_disk_reads_as(q, &raw, "compressed");
    // Writes into compressed clusters copy the rest of the cluster out of its compressed form.
    exercise(q, &raw, 64 * KIB, 23, true);
    drop(c);
    fe.finish();
    assert_check_clean(&image, false);
    assert_same_as(&image, &raw);
    println!("compressed image: read back, rewritten, check clean, compare identical");
}

#[test]
fn a_chain_of_three_serves_the_merged_view_and_writes_only_the_top() {
    let dir = TempDir::new("chain");
    let base = create_random_image(&dir.join("base.raw"), DISK, 9);
    let mid = dir.join("mid.qcow2");
    let top = dir.join("top.qcow2");
    // Relative names, as operators keep thin clones next to their golden image.
    create_overlay(&mid, "base.raw", "raw", "");
    let io = |image: &Path, cmd: &str| {
        run_tool(
            Command::new("qemu-io").args(["-f", "qcow2", "-c", cmd, image.to_str().unwrap()]),
            &format!("qemu-io {cmd}"),
        );
    };
    io(&mid, "write -P 0x5a 1M 3M");
    io(&mid, "write -z 8M 1M");
    create_overlay(&top, "mid.qcow2", "qcow2", "cluster_size=4096");
    io(&top, "write -P 0xc3 2M 64k");
    let merged = dir.join("merged.raw");
    qemu_img(&[
        "convert",
        "-q",
        "-O",
        "raw",
        top.to_str().unwrap(),
        merged.to_str().unwrap(),
    ]);
    let base_before = read_file(&base);
    let mid_before = read_file(&mid);

    let fe = Frontend::start(&top, &[]);
    let mut c = Client::connect(fe.socket()).unwrap();
    let q = c.queue(0);
    assert_disk_reads_as(q, &merged, "merged view");
    // Writes over every layer: base data, mid's data, mid's zeros, top's data.
    exercise(q, &merged, 4 * KIB, 31, true);
    drop(c);
    fe.finish();
    assert_check_clean(&top, false);
    assert_same_as(&top, &merged);
    assert!(read_file(&base) == base_before, "the raw base was written");
    assert!(
        read_file(&mid) == mid_before,
        "the middle layer was written"
    );
    println!("chain base.raw <- mid.qcow2 <- top.qcow2: merged view served, writes only in top");
}

#[test]
fn images_and_chains_that_cannot_be_served_are_refused_at_start() {
    let dir = TempDir::new("qcow2bad");
    let refuse = |image: &Path, args: &[&str], why: &str, says: &str| {
        let err = match Frontend::try_start(image, args) {
            Ok(_) => panic!("{} ({why}) was served", image.display()),
            Err(e) => e,
        };
        assert!(
            err.contains(says),
            "{why}: the error does not say {says:?}:\n{err}"
        );
        println!("{why}: refused: {}", err.lines().last().unwrap_or_default());
    };
    // A loop: a -> b -> a.
    let a = dir.join("a.qcow2");
    let b = dir.join("b.qcow2");
    create_qcow2(&b, "", DISK);
    create_overlay(&a, "b.qcow2", "qcow2", "");
    qemu_img(&[
        "rebase",
        "-q",
        "-u",
        "-f",
        "qcow2",
        "-b",
        "a.qcow2",
        "-F",
        "qcow2",
        b.to_str().unwrap(),
    ]);
    refuse(&a, &[], "a backing chain loop", "loops");
    // A missing backing file.
    let orphan = dir.join("orphan.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-u",
        "-b",
        "gone.raw",
        "-F",
        "raw",
        "-o",
        "size=64M",
        orphan.to_str().unwrap(),
    ]);
    refuse(&orphan, &[], "a missing backing file", "gone.raw");
    // A header with an absurd L1 table (l1_size at byte 36) and a truncated image.
    let absurd = create_qcow2(&dir.join("absurd.qcow2"), "", DISK);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&absurd)
            .unwrap();
        f.write_all_at(&u32::MAX.to_be_bytes(), 36).unwrap();
    }
    refuse(&absurd, &[], "an absurd L1 size", "absurd.qcow2");
    let truncated = create_qcow2(&dir.join("truncated.qcow2"), "", DISK);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&truncated)
        .unwrap()
        .set_len(100)
        .unwrap();
    refuse(&truncated, &[], "a truncated image", "truncated.qcow2");
    // Extended L2 entries (subclusters): imago 0.2 does not implement them, so such an image
    // is refused with imago's reason rather than served wrong.
    let extl2 = create_qcow2(
        &dir.join("extl2.qcow2"),
        "cluster_size=65536,extended_l2=on",
        DISK,
    );
    refuse(&extl2, &[], "extended L2 entries", "extended L2");
    // A backing file outside the allowed image directories (blkplaned's --image-dir), named
    // by '..' or reached through a symlink inside them.
    let allowed = dir.join("allowed");
    std::fs::create_dir(&allowed).unwrap();
    create_image(&dir.join("secret.raw"), DISK);
    let climbing = allowed.join("climbing.qcow2");
    create_overlay(&climbing, "../secret.raw", "raw", "");
    std::os::unix::fs::symlink(dir.join("secret.raw"), allowed.join("link.raw")).unwrap();
    let linked = allowed.join("linked.qcow2");
    create_overlay(&linked, "link.raw", "raw", "");
    let dir_arg = ["--image-dir", allowed.to_str().unwrap()];
    refuse(
        &climbing,
        &dir_arg,
        "a backing file named with '..'",
        "outside the allowed image directories",
    );
    refuse(
        &linked,
        &dir_arg,
        "a backing file behind a symlink",
        "outside the allowed image directories",
    );
    let inside = allowed.join("inside.qcow2");
    create_image(&allowed.join("base.raw"), DISK);
    create_overlay(&inside, "base.raw", "raw", "");
    Frontend::start(&inside, &dir_arg).finish();
    // A chain deeper than 16 backing files.
    let mut below = create_image(&dir.join("deep0.raw"), MIB);
    let mut format = "raw";
    for i in 1..=17 {
        let next = dir.join(&format!("deep{i}.qcow2"));
        create_overlay(
            &next,
            below.file_name().unwrap().to_str().unwrap(),
            format,
            "",
        );
        below = next;
        format = "qcow2";
    }
    refuse(&below, &[], "a chain of 17 backing files", "deeper than 16");
}

#[test]
fn a_raw_image_with_qcow2_magic_is_served_raw_only_when_told() {
    let dir = TempDir::new("magic");
    let disguised = dir.join("disguised.img");
    // A raw disk whose guest wrote a qcow2 header (naming a backing file) into sector 0.
    let header = create_qcow2(&dir.join("header.qcow2"), "", DISK);
    let mut bytes = read_file(&header);
    bytes.resize(8 * MIB as usize, 0);
    std::fs::write(&disguised, &bytes).unwrap();
    let fe = Frontend::start(&disguised, &["--format", "raw"]);
    let mut c = Client::connect(fe.socket()).unwrap();
    assert_eq!(c.capacity(), 8 * MIB, "served raw: the file's size");
    let first = ok("read", c.queue(0).read_at(0, 4096));
    assert_same_data("the header, as data", &first, &bytes[..4096]);
    drop(c);
    fe.finish();
    // Probed, it is qcow2 (as QEMU probes it); the operator says raw to keep it raw.
    let fe = Frontend::start(&disguised, &[]);
    let c = Client::connect(fe.socket()).unwrap();
    assert_eq!(c.capacity(), DISK, "probed: qcow2's virtual size");
    drop(c);
    fe.finish();
    println!("a raw image starting with qcow2's magic: raw with --format raw, qcow2 when probed");
}

/// An image whose metadata breaks only where a request meets it: an L2 entry that points far
/// past the end of the file (or, with an external data file, past the disk). The requests that
/// read or write through it fail with IOERR, naming the entry in the log, and the file keeps
/// its size; the rest of the disk reads and writes as before, and the frontend and its
/// iothread stay up.
#[test]
fn a_broken_l2_entry_fails_only_the_request_that_meets_it() {
    use std::os::unix::fs::FileExt;
    let dir = TempDir::new("qcow2l2");
    let data_file = dir.join("broken.data");
    for (name, options, data_path, past) in [
        (
            "own file",
            "cluster_size=65536".to_string(),
            None,
            "the file's end",
        ),
        (
            "external data file",
            format!("cluster_size=65536,data_file={}", data_file.display()),
            Some(&data_file),
            "the disk's size",
        ),
    ] {
        let image = create_qcow2(&dir.join("broken.qcow2"), &options, DISK);
        run_tool(
            Command::new("qemu-io").args([
                "-f",
                "qcow2",
                "-c",
                "write -P 0x11 0 128k",
                image.to_str().unwrap(),
            ]),
            "qemu-io write",
        );
        // Header: the L1 table's offset at byte 40; L1[0] names the first L2 table (bits
        // 9..=55).
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&image)
            .unwrap();
        let be64 = |at: u64| {
            let mut b = [0u8; 8];
            file.read_exact_at(&mut b, at).unwrap();
            u64::from_be_bytes(b)
        };
        let offsets = 0x00ff_ffff_ffff_fe00u64;
        let l2 = be64(be64(40)) & offsets;
        assert_ne!(l2, 0, "{name}: qemu-io allocated no L2 table");
        // The second cluster's entry: "copied" (bit 63) and 1 TiB into a file of a few hundred
        // KiB (a data file of the disk's size); the third's the same as a zero cluster (bit 0)
        // preallocated there, which reads as zeros and is written in place.
        let far = (1u64 << 63) | (1u64 << 40);
        file.write_all_at(&far.to_be_bytes(), l2 + 8).unwrap();
        file.write_all_at(&(far | 1).to_be_bytes(), l2 + 16)
            .unwrap();
        drop(file);
        let data_path = data_path.unwrap_or(&image);

        let mut fe = Frontend::start(&image, &[]);
        let iothreads = fe.iothread_pids();
        let mut c = Client::connect(fe.socket()).unwrap();
        let q = c.queue(0);
        assert_same_data(
            &format!("{name}: the intact first cluster"),
            &ok("read", q.read_at(0, 65536)),
            &vec![0x11; 65536],
        );
        let err = q
            .read_at(65536, 4096)
            .expect_err("a read through the broken entry succeeded");
        assert_eq!(err, libc::EIO, "{name}: {}", errno_name(err));
        // Writes through it fail too, rather than grow the file to 1 TiB: a write, a
        // write-zeroes of part of the cluster (imago writes zeros there), and a part or the
        // whole of the preallocated zero cluster, which reads as zeros meanwhile.
        let size = std::fs::metadata(data_path).unwrap().len();
        assert_same_data(
            &format!("{name}: the preallocated zero cluster"),
            &ok("read", q.read_at(2 * 65536, 65536)),
            &vec![0; 65536],
        );
        for op in [
            Op::Write {
                offset: 65536 + 4096,
                buf: 0,
                len: 4096,
            },
            Op::WriteZeroes {
                offset: 65536 + 8192,
                len: 4096,
                unmap: false,
            },
            Op::Write {
                offset: 2 * 65536 + 4096,
                buf: 0,
                len: 4096,
            },
            Op::Write {
                offset: 2 * 65536,
                buf: 0,
                len: 65536,
            },
        ] {
            let err = q
                .run(&op)
                .expect_err(&format!("{name}: {op:?} through a broken entry succeeded"));
            assert_eq!(err, libc::EIO, "{name}: {op:?}: {}", errno_name(err));
            assert_eq!(
                std::fs::metadata(data_path).unwrap().len(),
                size,
                "{name}: {op:?} through the broken entry grew the file"
            );
        }
        // The disk goes on: other clusters read and write, the first one still reads.
        let data = pattern(77, 8192);
        ok("write elsewhere", q.write_at(4 * MIB, &data));
        assert_same_data(
            &format!("{name}: written elsewhere"),
            &ok("read", q.read_at(4 * MIB, 8192)),
            &data,
        );
        assert_same_data(
            &format!("{name}: the first cluster again"),
            &ok("read", q.read_at(0, 4096)),
            &vec![0x11; 4096],
        );
        drop(c);
        fe.assert_running("a request through a broken L2 entry");
        assert_eq!(
            fe.iothread_pids(),
            iothreads,
            "{name}: the iothread was replaced"
        );
        let log = fe.stderr();
        assert!(
            log.contains(&format!(
                "to byte {} of its file, in a cluster past {past}",
                1u64 << 40
            )),
            "{name}: no log line names the broken entry:\n{log}"
        );
        fe.finish();
        println!("{name}: an L2 entry 1 TiB past {past}: a read and a write through it fail with EIO (the file keeps its size), the disk serves on");
    }
}

/// A guest that discards a range while its own write into that range is still at the device
/// (one batch: the write, the discard, then a write that allocates) must not have the freed
/// clusters handed out under the first write: the allocating write would get them, and the
/// first write, landing later at the host offset it was mapped to, would overwrite its data
/// (or an L2 or refcount table put there). The iothread holds such a discard back until the
/// writes into its range are done. The image is on the real disk, so the first write goes
/// through io_uring and is still in flight when the discard is taken.
#[test]
fn a_discard_waits_for_the_writes_at_the_device_in_its_range() {
    use blkplane_tests::raw::{blk_header, dwz_segment, Desc, RawDevice, F_NEXT, F_WRITE};
    use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_OK, VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_OUT};

    const LEN: u32 = 256 * KIB as u32;
    let dir = TempDir::new("qcow2-discard-race");
    let image = create_qcow2(&dir.join("disk.qcow2"), "cluster_size=65536", DISK);
    let fe = Frontend::start(&image, &[]);
    let mut dev = RawDevice::connect(fe.socket(), 1, 256).unwrap();
    // Buffers that outlive the rounds: two data buffers, a discard segment, three headers
    // and status bytes.
    let first = dev.alloc_static(u64::from(LEN));
    let second = dev.alloc_static(u64::from(LEN));
    let segment = dev.alloc_static(16);
    let headers: Vec<u64> = (0..3).map(|_| dev.alloc_static(16)).collect();
    let statuses: Vec<u64> = (0..3).map(|_| dev.alloc_static(1)).collect();
    for round in 0..20u64 {
        // Each round on clusters of its own: `a` allocated first, `b` not yet.
        let a = round * 2 * MIB / 512;
        let b = a + MIB / 512;
        let old = pattern(round, LEN as usize);
        assert_eq!(
            dev.write(0, a, &old).status_u32(),
            Some(VIRTIO_BLK_S_OK),
            "round {round}: allocating {a}"
        );
        dev.mem.write(first, &pattern(round + 100, LEN as usize));
        let allocating = pattern(round + 200, LEN as usize);
        dev.mem.write(second, &allocating);
        dev.mem.write(segment, &dwz_segment(a, LEN / 512, 0));
        let requests = [
            (VIRTIO_BLK_T_OUT, a, first, LEN),
            (VIRTIO_BLK_T_DISCARD, 0, segment, 16),
            (VIRTIO_BLK_T_OUT, b, second, LEN),
        ];
        let mut descs = Vec::new();
        let mut heads = Vec::new();
        for (i, (type_, sector, data, len)) in requests.into_iter().enumerate() {
            let head = 3 * i as u16;
            dev.mem.write(headers[i], &blk_header(type_, sector));
            dev.mem.write(statuses[i], &[0xee]);
            descs.push((
                head,
                Desc {
                    addr: headers[i],
                    len: 16,
                    flags: F_NEXT,
                    next: head + 1,
                },
            ));
            descs.push((
                head + 1,
                Desc {
                    addr: data,
                    len,
                    flags: F_NEXT,
                    next: head + 2,
                },
            ));
            descs.push((
                head + 2,
                Desc {
                    addr: statuses[i],
                    len: 1,
                    flags: F_WRITE,
                    next: 0,
                },
            ));
            heads.push(head);
        }
        dev.post_batch(0, &descs, &heads);
        for _ in 0..3 {
            dev.wait_used(0, std::time::Duration::from_secs(20))
                .unwrap_or_else(|| panic!("round {round}: a request of the batch never completed"));
        }
        for (i, status) in statuses.iter().enumerate() {
            assert_eq!(
                dev.mem.read(*status, 1)[0],
                VIRTIO_BLK_S_OK as u8,
                "round {round}: request {i} of the batch"
            );
        }
        // The allocating write keeps its data, whatever became of the racing pair.
        let got = dev.read(0, b, LEN);
        assert_eq!(got.status_u32(), Some(VIRTIO_BLK_S_OK));
        assert_same_data(
            &format!("round {round}: the allocating write after the discard"),
            &got.data[0],
            &allocating,
        );
    }
    drop(dev);
    fe.finish();
    assert_check_clean(&image, false);
}

/// Allocating writes in flight together, on the real disk (so their data goes through
/// io_uring and their clusters are committed when it has landed): 32 at a time into fresh
/// clusters of an overlay — several into one cluster, many into one L2 table (they wait for
/// each other's allocation) — with reads of the blocks around them and zeroings among them.
/// Every read sees the base's data (a cluster being allocated reads as before; its new copy
/// holds the base's data around the writes), everything written reads back, and the image
/// is clean and identical to a raw mirror.
#[test]
fn allocating_writes_in_flight_together_keep_their_data() {
    const REGION: u64 = 8 * MIB;
    const BLOCK: u64 = 4096;
    let dir = TempDir::new("qcow2-inflight");
    let base = create_random_image(&dir.join("base.raw"), DISK, 5);
    let base_bytes = read_file(&base);
    for (name, options) in [("c4k", "cluster_size=4096"), ("c64k", "cluster_size=65536")] {
        let image = create_overlay(
            &dir.join(&format!("{name}.qcow2")),
            base.to_str().unwrap(),
            "raw",
            options,
        );
        let mirror = dir.join(&format!("{name}.raw"));
        std::fs::copy(&base, &mirror).unwrap();
        // Each block of the region is written, zeroed or read, once, in a random order.
        let mut rng = Rng::new(11);
        let mut blocks: Vec<u64> = (0..REGION / BLOCK).collect();
        for i in (1..blocks.len()).rev() {
            blocks.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let fe = Frontend::start(&image, &[]);
        let mut c = Client::connect(fe.socket()).unwrap();
        let queue = c.queue(0);
        let mut expected = base_bytes[..REGION as usize].to_vec();
        let mut ops = Vec::new();
        for (i, &block) in blocks.iter().enumerate() {
            let offset = block * BLOCK;
            let range = offset as usize..(offset + BLOCK) as usize;
            match i % 8 {
                // Read: the base's data, whatever happens around it.
                0 | 1 => ops.push((offset, None)),
                7 => {
                    expected[range].fill(0);
                    ops.push((offset, Some(None)));
                }
                _ => {
                    let data = pattern(block, BLOCK as usize);
                    expected[range].copy_from_slice(&data);
                    ops.push((offset, Some(Some(data))));
                }
            }
        }
        let mut failures = Vec::new();
        queue.pipeline(
            ops.len(),
            32,
            |i, buf| match &ops[i] {
                (offset, None) => Op::Read {
                    offset: *offset,
                    buf: 0,
                    len: BLOCK as usize,
                },
                (offset, Some(None)) => Op::WriteZeroes {
                    offset: *offset,
                    len: BLOCK,
                    unmap: true,
                },
                (offset, Some(Some(data))) => {
                    buf[..data.len()].copy_from_slice(data);
                    Op::Write {
                        offset: *offset,
                        buf: 0,
                        len: data.len(),
                    }
                }
            },
            |i, buf, ret| {
                let (offset, op) = &ops[i];
                if ret != 0 {
                    failures.push(format!("{op:?} at {offset}: {}", errno_name(-ret)));
                } else if op.is_none() {
                    let want = &base_bytes[*offset as usize..(*offset + BLOCK) as usize];
                    if &buf[..BLOCK as usize] != want {
                        failures.push(format!("the read at {offset} is not the base's data"));
                    }
                }
            },
        );
        assert!(failures.is_empty(), "{name}: {failures:?}");
        ok("flush", queue.flush());
        {
            use std::os::unix::fs::FileExt;
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(&mirror)
                .unwrap();
            file.write_all_at(&expected, 0).unwrap();
        }
        assert_disk_reads_as(queue, &mirror, name);
        drop(c);
        fe.finish();
        assert_check_clean(&image, false);
        assert_same_as(&image, &mirror);
        println!("{name}: {} requests 32 at a time: reads saw the base, writes and zeroes read back; check clean, compare identical", ops.len());
    }
}

/// A thin clone with 64 KiB clusters of a random raw base in `dir`, and a raw copy of the base
/// to mirror its writes in; `None` (saying why) where the directory refuses O_DIRECT, so that
/// no cluster would be written through it.
fn thin_clone_on_disk(dir: &TempDir, seed: u64) -> Option<(PathBuf, PathBuf)> {
    let base = create_random_image(&dir.join("base.raw"), DISK, seed);
    if !supports_o_direct(&base) {
        println!(
            "skipped: {} refuses O_DIRECT, so no cluster is written through it",
            dir.path().display()
        );
        return None;
    }
    let image = create_overlay(
        &dir.join("clone.qcow2"),
        base.to_str().unwrap(),
        "raw",
        "cluster_size=65536",
    );
    let mirror = dir.join("mirror.raw");
    std::fs::copy(&base, &mirror).unwrap();
    Some((image, mirror))
}

/// A thin clone's clusters written through O_DIRECT grow the file behind imago's back (and the
/// file is extended ahead of them, as a hole): a cluster freed by a discard and handed out again
/// to an in-place allocation, whose zero fill imago runs past the size it knows, must neither
/// cut off the clusters beyond it nor keep its old data where the guest sees zeros.
#[test]
fn a_freed_cluster_allocated_again_in_place_keeps_the_clusters_beyond() {
    const CLUSTER: u64 = 64 * KIB;
    let dir = TempDir::new("qcow2-freed");
    let Some((image, mirror)) = thin_clone_on_disk(&dir, 9) else {
        return;
    };
    let fe = Frontend::start(&image, &[]);
    let mut c = Client::connect(fe.socket()).unwrap();
    let mut m = Mirrored::new(c.queue(0), &mirror, true);
    // Four clusters, each a 4 KiB write into the base's data: whole-cluster writes through
    // O_DIRECT, at host clusters past the size imago knows.
    for i in 0..4u64 {
        m.write(i * CLUSTER + 4 * KIB, &pattern(i, 4096));
    }
    ok("flush", m.queue.flush());
    // The first one freed (a zero cluster now), then written in part: allocated in place on
    // the freed host cluster, the rest of it zero-filled by imago.
    m.zero(0, CLUSTER, true, true);
    m.write(8 * KIB, &pattern(9, 4096));
    ok("flush", m.queue.flush());
    for i in 0..4u64 {
        m.check(i * CLUSTER, CLUSTER as usize, &format!("cluster {i}"));
    }
    drop(c);
    fe.finish();
    let check = assert_check_clean(&image, false);
    assert_same_as(&image, &mirror);
    // The extension ahead is a hole: blocks allocated ahead and written later made overwrites
    // slower (BENCHMARKS.md).
    use std::os::unix::fs::MetadataExt;
    let end: u64 = check
        .lines()
        .find_map(|l| l.strip_prefix("Image end offset: "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no image end offset in qemu-img check:\n{check}"));
    let meta = std::fs::metadata(&image).unwrap();
    let allocated = meta.blocks() * 512;
    assert!(
        meta.len() >= end + 4 * MIB,
        "the file ({} bytes) was not extended well past its last cluster ({end})",
        meta.len()
    );
    assert!(
        allocated <= end + CLUSTER,
        "{allocated} bytes allocated for an image that ends at {end} (file size {}): the extension is not a hole",
        meta.len()
    );
    println!("a freed cluster allocated again in place: every cluster reads back, check clean, compare identical; file {} bytes, {allocated} allocated, image end {end}", meta.len());
}

/// A thin clone whose file cannot be extended ahead of its O_DIRECT cluster writes (a file-size
/// limit, `RLIMIT_FSIZE`, set on the iothread below the extension): the first cluster write is
/// undone and it and every allocation after it run in place. Every write under the limit reads
/// back; the first allocation past it fails with IOERR alone (a write meeting the limit must not
/// kill the iothread with `SIGXFSZ`: the frontend would hand the request to the next one), the
/// disk serves on, and the image is clean and identical to a raw mirror.
#[test]
fn a_file_that_cannot_be_extended_ahead_allocates_in_place() {
    const CLUSTER: u64 = 64 * KIB;
    let dir = TempDir::new("qcow2-fsize");
    let Some((image, mirror)) = thin_clone_on_disk(&dir, 13) else {
        return;
    };
    let mut fe = Frontend::start(&image, &[]);
    let iothreads = fe.iothread_pids();
    assert!(!iothreads.is_empty(), "no iothread");
    // Room for a few clusters beyond the metadata, far less than the extension ahead.
    let limit = std::fs::metadata(&image).unwrap().len() + MIB;
    for &pid in &iothreads {
        let rlimit = libc::rlimit {
            rlim_cur: limit,
            rlim_max: limit,
        };
        // SAFETY: prlimit reads `rlimit` and, with a null old-limit pointer, writes nothing.
        let rc = unsafe {
            libc::prlimit(
                pid as libc::pid_t,
                libc::RLIMIT_FSIZE,
                &rlimit,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    }
    let mut c = Client::connect(fe.socket()).unwrap();
    let mut m = Mirrored::new(c.queue(0), &mirror, true);
    // Partial writes into the base's data, one cluster after another, until one meets the
    // limit: every one before it succeeds.
    let mut written = 0u64;
    let refused = loop {
        assert!(
            written < 32,
            "32 clusters written past a limit of 1 MiB more"
        );
        let offset = written * CLUSTER + 4 * KIB;
        let data = pattern(written, 4096);
        match m.queue.write_at(offset, &data) {
            Ok(()) => {
                use std::os::unix::fs::FileExt;
                m.mirror.write_all_at(&data, offset).unwrap();
                written += 1;
            }
            Err(errno) => break errno,
        }
    };
    assert_eq!(refused, libc::EIO, "{}", errno_name(refused));
    assert!(
        written >= 4,
        "only {written} clusters fitted under the limit"
    );
    // The disk serves on: the written clusters overwritten and read, the refused one reads as
    // the base.
    m.write(2 * KIB, &pattern(99, 2048));
    ok("flush", m.queue.flush());
    for i in 0..=written {
        m.check(i * CLUSTER, CLUSTER as usize, &format!("cluster {i}"));
    }
    drop(c);
    fe.assert_running("writes against a file-size limit");
    assert_eq!(fe.iothread_pids(), iothreads, "the iothread was replaced");
    let log = fe.stderr();
    assert!(
        log.contains("cannot be extended ahead of its allocations"),
        "no cluster write met the limit (the image was not served through O_DIRECT?):\n{log}"
    );
    fe.finish();
    let size = std::fs::metadata(&image).unwrap().len();
    assert!(
        size <= limit,
        "the file ({size} bytes) grew past the limit ({limit})"
    );
    assert_check_clean(&image, false);
    assert_same_as(&image, &mirror);
    println!("a file-size limit 1 MiB past the image: {written} clusters allocated in place, the next write failed with EIO alone; check clean, compare identical");
}

/// A corrupt image whose first write sent imago 0.2.6's allocator into endless recursion (found
/// by the `qcow2_allocation` fuzz target; the input is its seed
/// `regression_allocator_recursion.qcow2`: a refcount table of no clusters, 1-bit refcounts):
/// its refcounts cannot say how its header is used, so it is refused for writing at start,
/// naming the problem, and served read-only when asked.
#[test]
fn an_image_the_allocator_recursed_on_is_refused_for_writing() {
    let dir = TempDir::new("qcow2-crasher");
    let image = dir.join("corrupt.qcow2");
    std::fs::write(
        &image,
        include_bytes!("../../fuzz/seeds/qcow2_image/regression_allocator_recursion.qcow2"),
    )
    .unwrap();
    let refused = Frontend::try_start(&image, &[]).err().unwrap_or_default();
    assert!(
        refused.contains("refcounts do not cover its header") && refused.contains("corrupt.qcow2"),
        "{refused}"
    );
    let fe = Frontend::start(&image, &["--read-only"]);
    let options = blkplane_tests::client::ClientOptions {
        read_only: true,
        ..Default::default()
    };
    let mut c = Client::connect_with(fe.socket(), &options).unwrap();
    let zeros = ok("a read", c.queue(0).read_at(0, 4096));
    assert!(zeros.iter().all(|&b| b == 0));
    drop(c);
    fe.finish();
}

/// An image that goes bad while it is served — its refcounts no longer cover its header, as
/// imago's allocator leaves some corrupt images it crashed in — is served read-only by the
/// iothread that replaces the one before, as QEMU serves an image it found corrupt: writes
/// fail with IOERR, reads go on, the disk stays up.
#[test]
fn an_image_that_goes_bad_while_served_is_served_read_only() {
    let dir = TempDir::new("qcow2-gone-bad");
    let image = create_qcow2(&dir.join("disk.qcow2"), "cluster_size=65536", DISK);
    let fe = Frontend::start(&image, &[]);
    let mut c = Client::connect(fe.socket()).unwrap();
    let queue = c.queue(0);
    let data = pattern(3, 8192);
    ok("a write", queue.write_at(MIB, &data));
    ok("flush", queue.flush());
    {
        // Refcount table entry 0 cleared behind the iothread's back.
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&image)
            .unwrap();
        let mut rt_offset = [0u8; 8];
        file.read_exact_at(&mut rt_offset, 48).unwrap();
        file.write_all_at(&[0; 8], u64::from_be_bytes(rt_offset))
            .unwrap();
    }
    let old = fe.iothread_pids();
    assert_eq!(old.len(), 1, "one iothread for a qcow2 disk");
    assert!(blkplane_tests::frontend::kill_iothread(fe.pid(), old[0]));
    fe.wait_iothreads(1, &old, std::time::Duration::from_secs(20));
    for round in 0..2u64 {
        assert_eq!(
            queue.write_at(round * 4 * MIB, &pattern(round, 4096)),
            Err(libc::EIO),
            "round {round}: a write to the image gone bad"
        );
    }
    let got = ok("a read", queue.read_at(MIB, 8192));
    assert_same_data("the data written before", &got, &data);
    let log = fe.stderr();
    assert!(log.contains("serving the image read-only"), "{log}");
    drop(c);
    fe.finish();
}
