//! A real Linux guest under QEMU with two blkplane disks attached as `vhost-user-blk-pci`.
//!
//! The guest is Debian's kernel with a small initramfs built from Debian packages by
//! `tests/guest/build-initramfs.py` (cached under `<target>/guest/`); its `/init` is
//! `tests/guest/init.sh`, which runs the checks and reports them on the second serial port as
//! `BLKPLANE-CHECK ok|fail <name> <detail>` lines, ending with `BLKPLANE-DONE`. The disks:
//!
//! - read-write: `--num-queues 2 --iothreads 2`, QEMU `num-queues=2`, 2 vCPUs: capacity, serial,
//!   blk-mq queue count and read-only flag as configured; fio write+verify (4k random, 128k
//!   sequential, time-based mixed) on both queues, a verify-only re-read; fio write+verify while
//!   the host kills the frontend with SIGKILL and restarts it on the same socket (QEMU
//!   reconnects, `reconnect-ms`, and the requests in flight are resubmitted from the inflight
//!   region), then while it kills an iothread, then while it drains the disk (with flush)
//!   for a moment — nothing completes or reaches the image, the guest's requests wait and
//!   fio verifies every block after the resume; mkfs.ext4, files checksummed, `e2fsck -fn`;
//!   discard, write-zeroes and flush; then `reboot -f` inside the same QEMU process and
//!   everything verified again from the disk.
//! - read-only: `--read-only`: the kernel reports it read-only, its data is the image's, and
//!   writes and discards fail.
//!
//! After QEMU powers off, the images are checked from the host too: the boot-2 marker the guest
//! wrote, the read-only image untouched, `e2fsck -fn` on the image's file system.
//!
//! The same boot runs a second time on qcow2 images: each disk a qcow2 overlay (made by
//! `qemu-img`) over a raw base, so the guest reads the merged view and every write of fio, of
//! the crash phases and of ext4 allocates in the overlay; afterwards `qemu-img check` finds no
//! corruption, the host's checks read the overlay's guest view (`qemu-img convert`), and the
//! bases are unchanged.
//!
//! Needs `qemu-system-x86_64` and the apt sources `tests/setup.sh` sets up; if they are missing
//! the test fails and says to run `tests/setup.sh`. See `tests/guest/README.md`.

use std::fmt::Write as _;
use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use blkplane_tests::guest::*;
use blkplane_tests::qemu_img::{assert_check_clean, convert_to_raw, create_overlay};
use blkplane_tests::*;

const MIB: u64 = 1 << 20;
/// Read-write disk: 256 MiB and a bit, so that the capacity is not a round number.
const RW_SIZE: u64 = 256 * MIB + 64 * 1024;
const RO_SIZE: u64 = 8 * MIB;
const RO_SEED: u64 = 0xb1c_9ea5;
const RW_SERIAL: &str = "blkplane-guest-rw";
const RO_SERIAL: &str = "blkplane-guest-ro";
const QUEUES: u16 = 2;
/// Where init.sh writes its boot marker (sector 200 MiB / 512).
const MARKER_OFFSET: u64 = 200 * MIB;
/// Regions init.sh discards or zeroes (MiB offset, MiB length).
const ZEROED_REGIONS: [(u64, u64); 3] = [(160, 4), (164, 4), (168, 4)];

/// Upper bound for the guest, both boots (TCG; about 3 minutes on 2 cores).
const GUEST_TIMEOUT: Duration = Duration::from_secs(420);
/// How long QEMU may take to exit after the guest said it is done.
const POWEROFF_TIMEOUT: Duration = Duration::from_secs(60);
/// QEMU's reconnect interval for the read-write disk's socket (`reconnect-ms`).
const RECONNECT_MS: u32 = 1000;
/// How long the iothreads are stopped before a kill, so that the guest's requests pile up in
/// flight (the host otherwise completes each within microseconds, and a kill would rarely
/// find one to resubmit).
const PILE_UP: Duration = Duration::from_millis(300);
/// How long the frontend may take to serve again after a kill (QEMU reconnects every
/// RECONNECT_MS).
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the drain phase holds the read-write disk drained (besides the two checksums of
/// its image, which take about as long) while the guest's fio writes.
const DRAIN_HOLD: Duration = Duration::from_secs(1);

/// Every check init.sh must report as ok, in boot 1 and boot 2 (after `reboot -f`).
const BOOT1_CHECKS: &[&str] = &[
    "disks",
    "capacity",
    "serial",
    "queues",
    "ro-flag",
    "ro-disk-capacity",
    "ro-disk-serial",
    "ro-disk-queues",
    "ro-disk-ro-flag",
    "ro-disk-read",
    "ro-disk-write-refused",
    "ro-disk-discard-refused",
    "ro-disk-unchanged",
    "fio-rand4k",
    "fio-seq128k",
    "mq-both-queues",
    "fio-mixed",
    "verify-rand4k",
    "verify-seq128k",
    "crash-frontend",
    "crash-iothread",
    "drain",
    "ext4-mkfs-mount",
    "ext4-write",
    "e2fsck",
    "ext4-remount",
    "discard",
    "write-zeroes-unmap",
    "write-zeroes",
    "flush",
    "marker",
];
const BOOT2_CHECKS: &[&str] = &[
    "reboot-disks",
    "reboot-capacity",
    "reboot-serial",
    "reboot-queues",
    "reboot-ro-flag",
    "reboot-ro-disk-capacity",
    "reboot-ro-disk-serial",
    "reboot-ro-disk-queues",
    "reboot-ro-disk-ro-flag",
    "reboot-ro-disk-read",
    "reboot-marker",
    "reboot-verify-rand4k",
    "reboot-verify-seq128k",
    "reboot-e2fsck",
    "reboot-ext4-files",
    "reboot-zeros",
    "reboot-marker-written",
];

/// Everything wrong with the report: failed, missing, unexpected or repeated checks.
fn report_problems(report: &Report) -> Vec<String> {
    let mut out = Vec::new();
    let expected: Vec<&str> = BOOT1_CHECKS.iter().chain(BOOT2_CHECKS).copied().collect();
    for c in &report.checks {
        if !c.ok {
            out.push(format!("failed: {} {}", c.name, c.detail));
        }
        if !expected.contains(&c.name.as_str()) {
            out.push(format!(
                "unexpected check {} (not in this test's list)",
                c.name
            ));
        }
    }
    let mut missing = Vec::new();
    for name in &expected {
        match report.checks.iter().filter(|c| c.name == *name).count() {
            0 => missing.push(*name),
            1 => {}
            n => out.push(format!("reported {n} times: {name}")),
        }
    }
    if !missing.is_empty() {
        out.push(format!(
            "{} of {} checks never reported: {}",
            missing.len(),
            expected.len(),
            missing.join(" ")
        ));
    }
    if report.boots != [1, 2] {
        out.push(format!("boots reported: {:?}, want [1, 2]", report.boots));
    }
    if !report.rebooted {
        out.push("boot 1 never said BLKPLANE-REBOOT".into());
    }
    match &report.done {
        None => out.push("no BLKPLANE-DONE".into()),
        Some(d) if !d.starts_with("failed=0 boot=2") => out.push(format!("BLKPLANE-DONE {d}")),
        Some(_) => {}
    }
    out
}

/// The sum of the counts in the lines of `log` that contain `marker`, each count being the
/// number right after it (e.g. `resubmitting 12 requests`).
fn counts_after(log: &str, marker: &str) -> Vec<u64> {
    log.lines()
        .filter_map(|line| {
            let rest = &line[line.find(marker)? + marker.len()..];
            rest.split_whitespace().next()?.parse().ok()
        })
        .collect()
}

/// Does what the guest asked for with a `BLKPLANE-HOST` line, to the read-write disk's
/// frontend `fe` (admin socket `rw_admin`, image `rw_image`), while the guest's fio writes;
/// returns what happened for the summary.
fn host_action(
    action: &str,
    fe: &mut Frontend,
    rw_admin: &Path,
    rw_image: &Path,
) -> Result<String, String> {
    let iothreads = fe.iothread_pids();
    let log_before = fe.stderr().len();
    match action {
        // kill -9 of the frontend with requests in flight, then a restart on the same socket:
        // QEMU reconnects and hands the inflight region to the new process, which must
        // resubmit what was in flight.
        "crash-frontend" => {
            for &pid in &iothreads {
                send_signal(pid, libc::SIGSTOP);
            }
            std::thread::sleep(PILE_UP);
            let started = Instant::now();
            let old = fe.kill9_and_restart()?;
            let listening = started.elapsed();
            // "queue Q: resubmitting N requests in flight before the reconnect", per queue
            // that had some.
            let counts = wait_for(RECOVERY_TIMEOUT, || {
                let log = fe.stderr();
                let counts = counts_after(log.get(log_before..).unwrap_or(""), "resubmitting ");
                (!counts.is_empty()).then_some(counts)
            })
            .ok_or_else(|| {
                format!(
                    "the restarted frontend resubmitted nothing within {RECOVERY_TIMEOUT:?} of \
                     the kill (with its iothreads stopped for {PILE_UP:?} requests were in \
                     flight); its log:\n{}",
                    fe.stderr().get(log_before..).unwrap_or("")
                )
            })?;
            Ok(format!(
                "crash-frontend: frontend {old} (iothreads {iothreads:?} stopped {PILE_UP:?}) \
                 killed with SIGKILL; pid {} listening after {listening:.1?}; QEMU reconnected \
                 and {} requests in flight were resubmitted (per queue {counts:?}) after \
                 {:.1?}",
                fe.pid(),
                counts.iter().sum::<u64>(),
                started.elapsed()
            ))
        }
        // kill -9 of one iothread with requests in flight: the frontend replaces it and
        // resubmits them.
        "crash-iothread" => {
            let victim = *iothreads
                .first()
                .ok_or("the read-write frontend has no iothread")?;
            send_signal(victim, libc::SIGSTOP);
            std::thread::sleep(PILE_UP);
            let started = Instant::now();
            send_signal(victim, libc::SIGKILL);
            // "iothread Some(P) replaced by Some(Q); resubmitted N requests"
            let counts = wait_for(RECOVERY_TIMEOUT, || {
                let counts = counts_after(
                    fe.stderr().get(log_before..).unwrap_or(""),
                    "; resubmitted ",
                );
                (!counts.is_empty()).then_some(counts)
            })
            .ok_or_else(|| format!("iothread {victim} was not replaced"))?;
            if counts.iter().sum::<u64>() == 0 {
                return Err(format!(
                    "iothread {victim} was replaced but nothing was resubmitted (requests should \
                     have been in flight after {PILE_UP:?} stopped)"
                ));
            }
            Ok(format!(
                "crash-iothread: iothread {victim} (stopped {PILE_UP:?}) killed with SIGKILL; \
                 replaced and {} requests resubmitted after {:.1?}",
                counts.iter().sum::<u64>(),
                started.elapsed()
            ))
        }
        // Drain with flush while the guest's fio writes, as for a snapshot: the guest's
        // requests wait in the rings (fio must still finish and verify every block, without
        // a kernel I/O error), no request completes and nothing reaches the image until the
        // resume.
        "drain" => {
            let started = Instant::now();
            let drained = blkplane_tests::admin::drain(rw_admin, true)?;
            let drain_time = started.elapsed();
            let ops = blkplane_tests::admin::completed(&blkplane_tests::admin::stats(rw_admin)?);
            let before = sha256_of(rw_image);
            std::thread::sleep(DRAIN_HOLD);
            let after = sha256_of(rw_image);
            let ops_after =
                blkplane_tests::admin::completed(&blkplane_tests::admin::stats(rw_admin)?);
            let held = started.elapsed();
            // Resumed before judging, so that a failure does not also hang the guest.
            blkplane_tests::admin::resume(rw_admin)?;
            if ops_after != ops {
                return Err(format!(
                    "{} requests completed while drained",
                    ops_after.saturating_sub(ops)
                ));
            }
            if before != after {
                return Err("the image changed while drained".into());
            }
            if !drained.flushed {
                return Err("the drain did not sync the image".into());
            }
            Ok(format!(
                "drain: waited for {} requests in flight and synced the image in \
                 {drain_time:.1?}; drained {held:.1?} with the guest writing: no request \
                 completed, image sha256 unchanged; resumed",
                drained.waited_requests
            ))
        }
        other => Err(format!("unknown action {other:?}")),
    }
}

/// Boots the guest once (two boots, one QEMU), then checks the images from the host.
/// One guest at a time: two TCG guests on two cores would each take twice as long.
static ONE_GUEST: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn linux_guest_on_blkplane_disks() {
    let _one = ONE_GUEST.lock().unwrap_or_else(|e| e.into_inner());
    boot_guest(false);
}

#[test]
fn linux_guest_on_qcow2_overlays() {
    let _one = ONE_GUEST.lock().unwrap_or_else(|e| e.into_inner());
    boot_guest(true);
}

/// The guest's view of `image` as a raw file: itself, or a qcow2 image converted by qemu-img.
fn guest_view(image: &Path, qcow2: bool) -> std::path::PathBuf {
    if qcow2 {
        convert_to_raw(image, &image.with_extension("view"))
    } else {
        image.to_owned()
    }
}

/// Boots the guest on raw images, or (`qcow2`) on qcow2 overlays of raw bases, and checks.
fn boot_guest(qcow2: bool) {
    let t0 = Instant::now();
    let (qemu_bin, qemu_version) = qemu_binary();
    progress(&qemu_version);

    let dir = TempDir::new("guest");
    let guest = build_guest(dir.path());
    progress(&guest.info);

    let (rw_image, ro_image, bases) = if qcow2 {
        let rw_base = create_image(&dir.join("rw-base.raw"), RW_SIZE);
        let ro_base = create_random_image(&dir.join("ro-base.raw"), RO_SIZE, RO_SEED);
        let bases = vec![
            (rw_base.clone(), sha256_of(&rw_base)),
            (ro_base.clone(), sha256_of(&ro_base)),
        ];
        (
            create_overlay(&dir.join("rw.qcow2"), "rw-base.raw", "raw", ""),
            create_overlay(&dir.join("ro.qcow2"), "ro-base.raw", "raw", ""),
            bases,
        )
    } else {
        (
            create_image(&dir.join("rw.img"), RW_SIZE),
            create_random_image(&dir.join("ro.img"), RO_SIZE, RO_SEED),
            Vec::new(),
        )
    };
    // What the guest must read from the read-only disk.
    let ro_sha = sha256_of(&guest_view(&ro_image, qcow2));
    // Build the binaries (when needed) now, not while the frontends start.
    binaries();
    // The admin channel, for the drain phase.
    let rw_admin = dir.join("rw.admin");
    let rw_fe = Frontend::start(
        &rw_image,
        &[
            "--num-queues",
            &QUEUES.to_string(),
            "--iothreads",
            "2",
            "--serial",
            RW_SERIAL,
            "--admin-socket",
            rw_admin.to_str().expect("temp dir path is not UTF-8"),
        ],
    );
    let ro_fe = Frontend::start(&ro_image, &["--read-only", "--serial", RO_SERIAL]);
    let mut frontends = [("read-write", rw_fe), ("read-only", ro_fe)];

    let console = dir.join("console.log");
    let results = dir.join("results.log");
    let qemu_log = dir.join("qemu.log");
    let nonce = format!(
        "{:x}{:x}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
            & 0xffff_ffff
    );
    let append = format!(
        "console=ttyS0 panic=-1 bp.nonce={nonce} bp.size={RW_SIZE} bp.serial={RW_SERIAL} \
         bp.queues={QUEUES} bp.lbs=512 bp.ro_size={RO_SIZE} bp.ro_serial={RO_SERIAL} \
         bp.ro_sha256={ro_sha}"
    );
    let mut cmd = qemu_command(&qemu_bin, &guest, &append, &console, &results);
    // The read-write disk keeps QEMU's default ring size (128, smaller than the frontend's
    // --queue-size 256), as in the README's example; the read-only one uses 256.
    // QEMU reconnects to the read-write disk's socket when its frontend is killed and
    // restarted (the crash phases).
    for (id, (_, fe), extra, reconnect) in [
        (
            "rw",
            &frontends[0],
            format!("num-queues={QUEUES}"),
            format!(",reconnect-ms={RECONNECT_MS}"),
        ),
        (
            "ro",
            &frontends[1],
            "num-queues=1,queue-size=256".to_string(),
            String::new(),
        ),
    ] {
        cmd.arg("-chardev")
            .arg(format!(
                "socket,id={id},path={}{reconnect}",
                fe.socket().display()
            ))
            .arg("-device")
            .arg(format!("vhost-user-blk-pci,chardev={id},{extra}"));
    }
    let qemu_out = File::create(&qemu_log).unwrap();
    cmd.stdin(Stdio::null())
        .stdout(qemu_out.try_clone().unwrap())
        .stderr(qemu_out);
    progress(&format!("starting QEMU (TCG, 2 vCPUs): {cmd:?}"));
    let boot_started = Instant::now();
    let mut qemu = Qemu::spawn(cmd);

    // Follow the results port until the guest is done, QEMU or a frontend exits, the kernel
    // panics or the time is up.
    let deadline = boot_started + GUEST_TIMEOUT;
    let mut shown = 0;
    let mut reboot_at = None;
    let mut host_actions: Vec<String> = Vec::new();
    let outcome: Result<(), String> = loop {
        std::thread::sleep(Duration::from_millis(250));
        let text = read_lossy(&results);
        let report = Report::parse(&text);
        let mut requested = Vec::new();
        for line in &report.lines[shown..] {
            progress(&format!("[{:>5.1?}] {line}", boot_started.elapsed()));
            if line.starts_with("BLKPLANE-REBOOT") {
                reboot_at = Some(boot_started.elapsed());
            }
            if let Some(action) = line.strip_prefix("BLKPLANE-HOST ") {
                requested.push(action.trim().to_string());
            }
        }
        shown = report.lines.len();
        let mut failed_action = None;
        for action in requested {
            match host_action(&action, &mut frontends[0].1, &rw_admin, &rw_image) {
                Ok(done) => {
                    progress(&format!("[{:>5.1?}] host: {done}", boot_started.elapsed()));
                    host_actions.push(done);
                }
                Err(e) => {
                    failed_action = Some(format!("host action {action}: {e}"));
                    break;
                }
            }
        }
        if let Some(e) = failed_action {
            break Err(e);
        }
        if report.done.is_some() {
            break Ok(());
        }
        if let Some(status) = qemu.exited() {
            break Err(format!(
                "QEMU exited with {status} before the guest was done"
            ));
        }
        if let Some((role, status)) = frontends
            .iter_mut()
            .find_map(|(role, fe)| fe.exit_status().map(|s| (*role, s)))
        {
            break Err(format!(
                "the {role} frontend exited with {status} while the guest ran"
            ));
        }
        // QEMU stays connected for the whole run, reboot included.
        if let Some((role, line)) = frontends.iter().find_map(|(role, fe)| {
            fe.stderr()
                .lines()
                .find(|l| l.contains("VMM disconnected"))
                .map(|l| (*role, l.to_string()))
        }) {
            break Err(format!(
                "the {role} frontend dropped QEMU while the guest ran: {line}"
            ));
        }
        let console_text = read_lossy(&console);
        if console_text.contains("Kernel panic") {
            break Err("the guest kernel panicked".into());
        }
        if console_text.matches("Linux version").count() > 2 {
            break Err("the guest booted more than twice".into());
        }
        if Instant::now() >= deadline {
            break Err(format!("the guest did not finish within {GUEST_TIMEOUT:?}"));
        }
    };
    let guest_time = boot_started.elapsed();

    // The guest powers off after BLKPLANE-DONE: QEMU exits by itself.
    let qemu_status = if outcome.is_ok() {
        wait_for(POWEROFF_TIMEOUT, || qemu.exited())
    } else {
        None
    };
    drop(qemu);

    let report = Report::parse(&read_lossy(&results));
    let mut problems: Vec<String> = Vec::new();
    if let Err(e) = &outcome {
        problems.push(e.clone());
    }
    if outcome.is_ok() {
        match qemu_status {
            None => problems.push(format!(
                "QEMU did not exit within {POWEROFF_TIMEOUT:?} of the guest's poweroff"
            )),
            Some(s) if !s.success() => problems.push(format!("QEMU exited with {s}")),
            Some(_) => {}
        }
    }
    problems.extend(report_problems(&report));
    // A Linux guest is a well-behaved driver: the frontend must not have refused anything.
    for (role, fe) in &frontends {
        let stderr = fe.stderr();
        let refused: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains("rejected request") || l.contains("refused vhost-user"))
            .collect();
        if !refused.is_empty() {
            problems.push(format!(
                "the {role} frontend refused {} requests or messages from QEMU and the Linux \
                 guest, first: {}",
                refused.len(),
                refused[0]
            ));
        }
    }

    // From the host: what the guest wrote is in the image, the read-only image is untouched.
    let mut host_checks: Vec<String> = Vec::new();
    if outcome.is_ok() && qcow2 {
        // The crash phases may leak clusters (as QEMU's crashes do); nothing worse.
        let report = assert_check_clean(&rw_image, true);
        host_checks.push(format!(
            "qemu-img check on the rw overlay: {}",
            report.trim().replace('\n', "; ")
        ));
        for (base, sha) in &bases {
            if sha256_of(base) == *sha {
                host_checks.push(format!("base {} unchanged", base.display()));
            } else {
                problems.push(format!("host: the base {} changed", base.display()));
            }
        }
    }
    // The raw images themselves, or the guest's view of the overlays.
    let (rw_image, ro_image) = if outcome.is_ok() {
        (guest_view(&rw_image, qcow2), guest_view(&ro_image, qcow2))
    } else {
        (rw_image, ro_image)
    };
    if outcome.is_ok() {
        let marker = read_file_at(&rw_image, MARKER_OFFSET, 512);
        let want = format!("BLKPLANE-MARK stage2 {nonce}\n");
        if marker.starts_with(want.as_bytes()) {
            host_checks.push(format!(
                "rw image holds the boot-2 marker at {MARKER_OFFSET}"
            ));
        } else {
            problems.push(format!(
                "host: the rw image has no boot-2 marker at {MARKER_OFFSET}: {:?}",
                String::from_utf8_lossy(&marker[..64])
            ));
        }
        for (off, len) in ZEROED_REGIONS {
            let data = read_file_at(&rw_image, off * MIB, (len * MIB) as usize);
            if data.iter().any(|&b| b != 0) {
                problems.push(format!(
                    "host: rw image region {off}M+{len}M (discarded/zeroed) is not zero"
                ));
            }
        }
        host_checks.push("discarded and zeroed regions are zero in the rw image".into());
        if read_file(&ro_image) == pattern(RO_SEED, RO_SIZE as usize) {
            host_checks.push("ro image unchanged".into());
        } else {
            problems.push("host: the read-only image changed".into());
        }
        match Command::new("e2fsck").arg("-fn").arg(&rw_image).output() {
            Ok(out) if out.status.success() => host_checks.push(format!(
                "e2fsck -fn on the rw image: {}",
                String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .last()
                    .unwrap_or("")
            )),
            Ok(out) => problems.push(format!(
                "host: e2fsck -fn on the rw image failed ({}):\n{}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )),
            Err(e) => problems.push(format!("host: e2fsck: {e}; {SETUP_HINT}")),
        }
    }

    // Keep the last run's logs for a look after the fact.
    let keep = target_dir()
        .join("guest")
        .join(if qcow2 { "last-run-qcow2" } else { "last-run" });
    let _ = std::fs::remove_dir_all(&keep);
    if std::fs::create_dir_all(&keep).is_ok() {
        for f in [&console, &results, &qemu_log] {
            let _ = std::fs::copy(f, keep.join(f.file_name().unwrap()));
        }
        for (role, fe) in &frontends {
            let _ = std::fs::write(
                keep.join(format!("frontend-{role}.log")),
                fe.stderr().as_bytes(),
            );
        }
    }

    if !problems.is_empty() {
        let mut msg = String::new();
        let _ = writeln!(
            msg,
            "---- guest console ({}) ----\n{}\n---- end of guest console ----",
            console.display(),
            tail(&read_lossy(&console), 256 * 1024)
        );
        let _ = writeln!(
            msg,
            "---- guest results port ----\n{}\n---- QEMU output ----\n{}\n---- end ----",
            read_lossy(&results),
            read_lossy(&qemu_log)
        );
        eprintln!("{msg}");
        eprintln!("logs kept in {}", keep.display());
        // The frontends' stderr is printed when their guards drop during the panic.
        panic!(
            "guest test failed after {guest_time:.1?}:\n  {}",
            problems.join("\n  ")
        );
    }

    for (role, fe) in &mut frontends {
        fe.assert_running(&format!("the guest ({role} disk)"));
    }
    let mut summary = format!(
        "all {} guest checks passed in {:.1?} (boot 1 {:.1?}, boot 2 {:.1?}); total {:.1?}:\n",
        report.checks.len(),
        guest_time,
        reboot_at.unwrap_or_default(),
        guest_time.saturating_sub(reboot_at.unwrap_or_default()),
        t0.elapsed()
    );
    for c in &report.checks {
        let _ = writeln!(summary, "  ok {:<24} {}", c.name, c.detail);
    }
    for h in host_actions.iter().chain(&host_checks) {
        let _ = writeln!(summary, "  ok host: {h}");
    }
    progress(summary.trim_end());
    for (_, fe) in frontends {
        fe.finish();
    }
}
