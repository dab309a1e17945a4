//! Live migration of a Linux guest between two QEMU processes on this machine (TCG), each
//! attached to its own blkplane frontend for the same image, with blkplaned doing what a
//! KubeVirt-style operator asks of it.
//!
//! blkplaned serves disk `src` to the source QEMU. The guest (`tests/guest/init.sh` with
//! `bp.mode=migrate`) runs fio write+verify and asks the host to act:
//!
//! - `migrate-blocked`: an operator blocker is added to `src`; blkplaned refuses the
//!   destination disk a migration needs (FAILED_PRECONDITION naming the blocker), nothing is
//!   left behind, the VM keeps running with its disk connected; fio verifies.
//! - `migrate`: `blkplanectl disk add dst --incoming-for src` starts a second frontend on the
//!   same image; a destination QEMU (`-incoming`) connects to it; QEMU migrates with fio
//!   writing in rounds. The first pass is throttled and cannot converge; once it has copied
//!   every page, the host writes a "freeze" marker and the guest reads a 48 MiB file into its
//!   page cache — the device writes those pages after the migration copied them (as zeros),
//!   so only the source frontend's dirty log makes QEMU copy them again; then the migration
//!   is let finish. On the destination the guest hashes the file from its page cache (no
//!   device read) and compares. (With read data left unmarked this check fails: tried.) The
//!   destination starts its rings when the VM runs there, blkplaned sees it and retires
//!   `src`. The host then writes a marker the guest waits for, and the guest does one more
//!   fio round and a full re-read on the destination.
//!
//! `live_migration_across_nodes_with_shared_storage` runs the same guest and steps across two
//! "nodes" (network namespaces joined by a veth pair, a blkplaned in each, mutual TLS between
//! them, one image both reach): the destination disk is `--incoming-from` node A, the QEMUs
//! run in their nodes and migrate over TCP, and node A retires `src` when node B asks.
//! `live_migration_across_nodes_with_local_storage` does it with node A's own image: node B's
//! disk gets a new image, node A copies the disk there while fio writes (`disk migrate --to`)
//! — after four copies that fail mid-copy (the network between the nodes cut, node B's
//! blkplaned killed, node A's blkplaned killed, the migration cancelled), the VM running on
//! and node B keeping nothing of the disk after each — QEMU migrates once the copy has
//! converged (limited to 3 MiB/s, slower than the guest's fio writes, it converges only once
//! auto-converge has limited the guest's writes; node B's frontend is killed during it, which
//! the copy outlives), the source QEMU's switch-over sends the
//! rest, and the guest verifies every block on node B's copy.
//!
//! Needs what `tests/setup.sh` installs (QEMU 10.0, the guest's packages, iproute2), and root.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write as _};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use blkplane_tests::daemon::{blocker_reasons, Daemon, Json};
use blkplane_tests::guest::*;
use blkplane_tests::netns::{in_netns, TwoNodes, ADDRESSES};
use blkplane_tests::qmp::Qmp;
use blkplane_tests::tls::{make_certs, node_options};
use blkplane_tests::*;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 256 * MIB + 64 * 1024;
const SERIAL: &str = "blkplane-migration";
const QUEUES: u16 = 2;
/// Where the host writes "BLKPLANE-MIGRATED <nonce>" once the VM runs on the destination
/// (init.sh's MIGRATED_SECTOR).
const MIGRATED_OFFSET: u64 = 201 * MIB;
/// Where the host writes "BLKPLANE-FREEZE <nonce>" during the first pass (FREEZE_SECTOR).
const FREEZE_OFFSET: u64 = 202 * MIB;
const GUEST_TIMEOUT: Duration = Duration::from_secs(600);
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(240);
const POWEROFF_TIMEOUT: Duration = Duration::from_secs(60);
const QMP_TIMEOUT: Duration = Duration::from_secs(30);
/// blkplaned notices connects, ring starts and retirements within a few polls.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(20);

/// What the guest must report, each once.
const CHECKS: &[&str] = &[
    "disks",
    "capacity",
    "serial",
    "queues",
    "ro-flag",
    "migrate-blocked",
    "migrate-read-pages",
    "migrate",
    "migrate-reverify",
];

/// One QEMU process of the test and its files.
struct Vm {
    qemu: Qemu,
    qmp: Qmp,
    console: PathBuf,
    results: PathBuf,
    output: PathBuf,
}

/// What both QEMU processes share: the same machine, kernel, initramfs and command line.
struct Machine {
    qemu_bin: PathBuf,
    guest: GuestImage,
    append: String,
    dir: PathBuf,
}

impl Machine {
    /// Starts QEMU `tag` on the vhost-user socket `socket`, in network namespace `netns` if
    /// given; `incoming` (a migration URI) makes it a migration destination listening there.
    fn start(&self, tag: &str, socket: &Path, incoming: Option<&str>, netns: Option<&str>) -> Vm {
        let console = self.dir.join(format!("{tag}-console.log"));
        let results = self.dir.join(format!("{tag}-results.log"));
        let output = self.dir.join(format!("{tag}-qemu.log"));
        let qmp = self.dir.join(format!("{tag}.qmp"));
        let mut cmd = qemu_command(
            &self.qemu_bin,
            &self.guest,
            &self.append,
            &console,
            &results,
        );
        cmd.arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", qmp.display()))
            .arg("-chardev")
            .arg(format!("socket,id=disk,path={}", socket.display()))
            .arg("-device")
            .arg(format!(
                "vhost-user-blk-pci,chardev=disk,num-queues={QUEUES}"
            ));
        if let Some(uri) = incoming {
            cmd.arg("-incoming").arg(uri);
        }
        if let Some(ns) = netns {
            let mut wrapped = in_netns(ns, cmd.get_program());
            wrapped.args(cmd.get_args());
            cmd = wrapped;
        }
        let out = File::create(&output).unwrap();
        cmd.stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        progress(&format!("starting QEMU {tag}: {cmd:?}"));
        let mut qemu = Qemu::spawn(cmd);
        let qmp = Qmp::connect(&qmp, QMP_TIMEOUT).unwrap_or_else(|e| {
            let _ = qemu.child.kill();
            panic!("QEMU {tag}: {e}\n{}", read_lossy(&output))
        });
        Vm {
            qemu,
            qmp,
            console,
            results,
            output,
        }
    }
}

/// Polls query-migrate until the migration ends; returns its last answer.
fn wait_migration(vm: &mut Vm, mut each: impl FnMut()) -> Result<Json, String> {
    let deadline = Instant::now() + MIGRATION_TIMEOUT;
    loop {
        let info = vm.qmp.execute("query-migrate", "{}")?;
        let status = info.field("status").and_then(Json::as_str).unwrap_or("");
        if matches!(status, "completed" | "failed" | "cancelled") {
            return Ok(info);
        }
        each();
        if Instant::now() >= deadline {
            return Err(format!(
                "migration not done within {MIGRATION_TIMEOUT:?}: {info:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn number(j: &Json, path: &[&str]) -> u64 {
    let mut v = j;
    for key in path {
        match v.field(key) {
            Some(x) => v = x,
            None => return 0,
        }
    }
    v.as_u64().unwrap_or(0)
}

fn disk_ids(d: &Daemon) -> Vec<String> {
    d.ctl_json(&["disk", "list"])
        .arr()
        .iter()
        .map(|x| x.get("id").str().to_string())
        .collect()
}

/// The number of µs in `line` right after `marker` (`… MARKER 123 µs …`).
fn micros_after(line: &str, marker: &str) -> Option<u64> {
    let (_, rest) = line.split_once(marker)?;
    rest.split_whitespace().next()?.parse().ok()
}

/// Where the two sides of the migration are.
enum Sides<'a> {
    /// One blkplaned serves both disks (`--incoming-for`); the QEMUs migrate over a UNIX
    /// socket.
    OneNode(&'a Daemon),
    /// A blkplaned per node, each in its network namespace, on one image both reach
    /// (`--incoming-from … --shared`), or with `local` the destination's own image at that
    /// path, which node A copies there (`--incoming-from`, `disk migrate --to`); the QEMUs run
    /// in the nodes and migrate over TCP between them.
    TwoNodes {
        src: &'a Daemon,
        dst: &'a Daemon,
        nodes: &'a TwoNodes,
        local: Option<PathBuf>,
    },
}

/// The port the nodes' blkplaned listen at, on their node's address.
const API_PORT: u16 = 7070;
/// The bandwidth of the copy the VM migrates after (local storage): below the guest's write
/// rate, so that auto-converge must slow the guest for the copy to converge.
const COPY_BANDWIDTH: &str = "3M";
/// The port the destination QEMU listens at for the migration stream.
const MIGRATION_PORT: u16 = 4444;

impl Sides<'_> {
    fn src(&self) -> &Daemon {
        match self {
            Sides::OneNode(d) => d,
            Sides::TwoNodes { src, .. } => src,
        }
    }

    fn dst(&self) -> &Daemon {
        match self {
            Sides::OneNode(d) => d,
            Sides::TwoNodes { dst, .. } => dst,
        }
    }

    /// The network namespace of the source (0) or destination (1) side.
    fn netns(&self, side: usize) -> Option<&str> {
        match self {
            Sides::OneNode(_) => None,
            Sides::TwoNodes { nodes, .. } => Some(nodes.name(side)),
        }
    }

    /// What makes `disk add dst` the incoming disk of `src` (and, but for a local copy, whose
    /// new image it names, the image is the source's), and the field that names it.
    fn incoming(&self) -> (Vec<String>, &'static str) {
        match self {
            Sides::OneNode(_) => (vec!["--incoming-for".into(), "src".into()], "incoming_for"),
            Sides::TwoNodes { local, .. } => {
                let mut args = vec![
                    "--incoming-from".into(),
                    format!("{}:{API_PORT}/src", ADDRESSES[0]),
                ];
                match local {
                    Some(image) => {
                        args.extend(["--image".into(), image.to_str().unwrap().to_string()])
                    }
                    None => args.push("--shared".into()),
                }
                (args, "incoming_from")
            }
        }
    }

    /// The destination's own image, when node A copies the disk there.
    fn local(&self) -> Option<&Path> {
        match self {
            Sides::TwoNodes {
                local: Some(image), ..
            } => Some(image),
            _ => None,
        }
    }

    /// The migration URI the destination QEMU listens at and the source connects to.
    fn migration_uri(&self, dir: &Path) -> String {
        match self {
            Sides::OneNode(_) => format!("unix:{}", dir.join("migration.sock").display()),
            Sides::TwoNodes { .. } => format!("tcp:{}:{MIGRATION_PORT}", ADDRESSES[1]),
        }
    }
}

/// Starts copying `src` on node A (`src_daemon`) to `dst` on node B at `bandwidth` (`0`: no
/// limit).
fn start_copy(src_daemon: &Daemon, bandwidth: &str) {
    src_daemon.ctl_ok(&[
        "disk",
        "migrate",
        "src",
        "--to",
        &format!("{}:{API_PORT}/dst", ADDRESSES[1]),
        "--bandwidth",
        bandwidth,
    ]);
}

/// Waits until the copy of `src` on node A (`src_daemon`) is in its bulk pass and has sent
/// something.
fn wait_sending(src_daemon: &Daemon) -> Result<(), String> {
    wait_for(CONTROL_TIMEOUT, || {
        let copy = src_daemon.disk("src").get("migration_copy").clone();
        (copy.get("phase").str() == "bulk" && copy.get("bytes_sent").u64() > 0).then_some(())
    })
    .ok_or_else(|| "the copy sent nothing".to_string())
}

/// Everything the host does for the guest's `BLKPLANE-HOST` lines.
struct Host<'a> {
    sides: &'a Sides<'a>,
    machine: &'a Machine,
    image: PathBuf,
    nonce: String,
    /// The source frontend's log as last read (blkplaned deletes it with the disk).
    src_log: String,
}

impl Host<'_> {
    fn src_log_path(&self) -> PathBuf {
        self.sides.src().disks_dir().join("src.log")
    }

    fn read_src_log(&mut self) {
        let text = read_lossy(&self.src_log_path());
        if !text.is_empty() {
            self.src_log = text;
        }
    }

    /// A migration while the source disk must not be migrated: blkplaned refuses the
    /// destination's disk (the first thing a migration needs), so no destination QEMU can be
    /// started, and the VM runs on untouched. (The frontend's own refusal of LOG_ALL, the
    /// last line for a VMM that migrates without asking blkplaned, is not driven here: QEMU
    /// 10.0 aborts when a back-end refuses to start dirty logging — fixed upstream by
    /// "vhost: Do not abort on log-start error" — see tests/tests/dirty_log.rs for it.)
    fn migrate_blocked(&mut self, src: &mut Vm) -> Result<String, String> {
        let m = self.sides.src().ctl_json(&[
            "disk",
            "blocker",
            "add",
            "src",
            "maintenance",
            "migration test: blocked attempt",
        ]);
        if m.get("migratable").bool() {
            return Err(format!("src still migratable with a blocker: {m:?}"));
        }
        let (incoming, field) = self.sides.incoming();
        let mut add = vec!["disk", "add", "dst"];
        add.extend(incoming.iter().map(String::as_str));
        let refused = self.sides.dst().ctl(&add);
        let mut listed = disk_ids(self.sides.src());
        if let Sides::TwoNodes { dst, .. } = self.sides {
            listed.extend(disk_ids(dst));
        }
        let run_state = src.qmp.status()?;
        self.sides
            .src()
            .ctl_ok(&["disk", "blocker", "remove", "src", "maintenance"]);
        if refused.code == Some(0) {
            return Err(format!(
                "the incoming disk was added while src is blocked: {}",
                refused.stdout
            ));
        }
        let message = refused.stderr.trim().to_string();
        if !message.contains("FAILED_PRECONDITION")
            || !message.contains(field)
            || !message.contains("migration test: blocked attempt")
        {
            return Err(format!("refused with the wrong words: {message}"));
        }
        if listed != ["src"] {
            return Err(format!(
                "the refused disk left something behind: {listed:?}"
            ));
        }
        if run_state != "running" {
            return Err(format!(
                "the VM is {run_state:?} after the refused migration"
            ));
        }
        self.read_src_log();
        if self.src_log.contains("VMM disconnected") {
            return Err("QEMU's vhost-user session ended".into());
        }
        Ok(format!(
            "migrate-blocked: blkplaned refused the destination disk ({message}); the VM is \
             {run_state}, its disk still connected"
        ))
    }

    /// Writes "`what` <nonce>" to the image at `offset`, past the frontends (the guest reads
    /// it with O_DIRECT): to the source's image and, for a local copy, to the destination's
    /// too (written past the source frontend, it is not marked for the copy).
    fn write_marker(&self, offset: u64, what: &str) -> Result<(), String> {
        let marker = format!("{what} {}\n", self.nonce);
        for image in std::iter::once(self.image.as_path()).chain(self.sides.local()) {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .open(image)
                .map_err(|e| e.to_string())?;
            f.seek(SeekFrom::Start(offset))
                .and_then(|_| f.write_all(marker.as_bytes()))
                .and_then(|_| f.sync_data())
                .map_err(|e| format!("writing {what} to {}: {e}", image.display()))?;
        }
        Ok(())
    }

    /// Copies that fail while the guest writes and verifies, one per way a copy can fail
    /// mid-copy: the network between the nodes cut (node B's end of the veth pair down),
    /// node B's blkplaned killed (SIGKILL, then restarted), node A's blkplaned killed (its
    /// frontend serves on; restarted), the migration cancelled on node A (the operator gives
    /// up: node A forgets it, node B's disk is removed — its image file with it — and added
    /// again with `add` for the next attempt). After each, the VM runs on, its disk on node
    /// A; node A says the copy failed (but when it was the one killed: then node B says the
    /// stream ended); node B keeps nothing of the disk (its partial image discarded) and its
    /// disk waits, drained, for the next copy. The guest's fio rounds verify across all of
    /// them.
    fn failed_copies(&self, src: &mut Vm, nodes: &TwoNodes, add: &[&str]) -> Result<(), String> {
        let (src_daemon, dst_daemon) = (self.sides.src(), self.sides.dst());
        let dst_image = self.sides.local().ok_or("not a local copy")?;
        let failed = || {
            let copy = src_daemon.disk("src").get("migration_copy").clone();
            (copy.get("phase").str() == "failed").then_some(copy)
        };
        // Node B's word that a stream ended with its image incomplete (and discarded).
        let ended = || {
            dst_daemon
                .log_text()
                .matches("ended before the image was complete")
                .count()
        };
        for case in [
            "network cut",
            "node B's blkplaned killed",
            "node A's blkplaned killed",
            "cancelled",
        ] {
            let ended_before = ended();
            start_copy(src_daemon, "1M");
            wait_sending(src_daemon).map_err(|e| format!("{case}: {e}"))?;
            let started = Instant::now();
            let why = match case {
                "network cut" => {
                    nodes.connect(1, false)?;
                    let failure = wait_for(MIGRATION_TIMEOUT, failed);
                    nodes.connect(1, true)?;
                    // The next case's copy must not meet the cable still out.
                    nodes.wait_reachable(0, ADDRESSES[1], API_PORT, CONTROL_TIMEOUT)?;
                    let failure = failure.ok_or("the copy across a cut network never failed")?;
                    wait_for(MIGRATION_TIMEOUT, || (ended() > ended_before).then_some(()))
                        .ok_or("node B never said its copy ended")?;
                    failure.get("failure").str().to_string()
                }
                "node B's blkplaned killed" => {
                    dst_daemon.kill9();
                    let failure = wait_for(MIGRATION_TIMEOUT, failed);
                    dst_daemon.spawn();
                    let failure = failure.ok_or("the copy to a dead node never failed")?;
                    wait_for(CONTROL_TIMEOUT, || {
                        (dst_daemon.disk("dst").get("state").str() == "drained").then_some(())
                    })
                    .ok_or("node B's disk did not come back drained")?;
                    failure.get("failure").str().to_string()
                }
                "cancelled" => {
                    src_daemon.ctl_ok(&["disk", "migrate", "src", "--cancel"]);
                    let failure = wait_for(CONTROL_TIMEOUT, failed)
                        .ok_or("the cancelled copy did not say it failed")?;
                    wait_for(CONTROL_TIMEOUT, || (ended() > ended_before).then_some(()))
                        .ok_or("node B never said its copy ended")?;
                    failure.get("failure").str().to_string()
                }
                _ => {
                    src_daemon.kill9();
                    let seen = wait_for(CONTROL_TIMEOUT, || (ended() > ended_before).then_some(()));
                    src_daemon.spawn();
                    seen.ok_or("node B never said its copy ended")?;
                    // Adopted, and the dead one's write tracking stopped.
                    wait_for(CONTROL_TIMEOUT, || {
                        (src_daemon.disk("src").get("state").str() == "connected"
                            && src_daemon
                                .log_text()
                                .contains("disk src: stopped the write tracking of a copy"))
                        .then_some(())
                    })
                    .ok_or_else(|| {
                        format!(
                            "node A's restarted blkplaned did not adopt src: {:?}",
                            src_daemon.disk("src")
                        )
                    })?;
                    "node A's blkplaned restarted without the copy".to_string()
                }
            };
            let run_state = src.qmp.status()?;
            if run_state != "running" {
                return Err(format!(
                    "{case}: the VM is {run_state:?} after the failed copy"
                ));
            }
            let kept = std::fs::metadata(dst_image)
                .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
                .map_err(|e| format!("{}: {e}", dst_image.display()))?;
            if kept != 0 {
                return Err(format!(
                    "{case}: node B kept {kept} bytes of its partial image"
                ));
            }
            if case == "cancelled" {
                dst_daemon.ctl_ok(&["disk", "remove", "dst"]);
                if dst_image.exists() {
                    return Err(format!("{case}: removing dst kept {}", dst_image.display()));
                }
                dst_daemon.ctl_ok(add);
            }
            progress(&format!(
                "copy failed, {case}: {:.1?} from the failure to its end ({why}); the VM runs on, \
                 node B kept nothing",
                started.elapsed()
            ));
        }
        Ok(())
    }

    /// Node B's frontend killed mid-copy: the copy does not pass through it (node B's
    /// blkplaned writes the image), so it goes on; blkplaned restarts the frontend, drained
    /// until the image is complete.
    fn destination_frontend_killed(
        &self,
        src_daemon: &Daemon,
        dst_daemon: &Daemon,
    ) -> Result<(), String> {
        wait_sending(src_daemon)?;
        let old = dst_daemon.disk("dst").get("frontend_pid").u64();
        blkplane_tests::daemon::kill(old as u32, libc::SIGKILL);
        let restarted = wait_for(CONTROL_TIMEOUT, || {
            let dst = dst_daemon.disk("dst");
            let pid = dst.get("frontend_pid").u64();
            (pid != 0 && pid != old && dst.get("state").str() == "drained").then_some(pid)
        })
        .ok_or("node B's frontend did not come back drained")?;
        let copy = src_daemon.disk("src").get("migration_copy").clone();
        if copy.get("phase").str() == "failed" {
            return Err(format!("the copy failed with node B's frontend: {copy:?}"));
        }
        progress(&format!(
            "node B's frontend killed mid-copy (pid {old} → {restarted}, drained): the copy \
             goes on ({})",
            copy.get("phase").str()
        ));
        Ok(())
    }

    fn migrate(&mut self, src: &mut Vm) -> Result<(Vm, String), String> {
        // The blocker of the previous phase is gone once blkplaned says so.
        let wait_migratable = Instant::now() + CONTROL_TIMEOUT;
        let (src_daemon, dst_daemon) = (self.sides.src(), self.sides.dst());
        while !src_daemon.disk("src").get("migratable").bool() {
            if Instant::now() >= wait_migratable {
                return Err(format!(
                    "src never became migratable: {:?}",
                    src_daemon.disk("src")
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let image = self.image.to_str().unwrap().to_string();
        let (incoming, _) = self.sides.incoming();
        let mut add = vec!["disk", "add", "dst", "--iothreads", "2"];
        if self.sides.local().is_none() {
            add.extend(["--image", &image]);
        }
        add.extend(incoming.iter().map(String::as_str));
        let mut dst = dst_daemon.ctl_json(&add);
        // A local disk: node A copies it to node B's new image while the guest writes, and
        // the VM migrates once the copy has converged.
        let mut converged_after = None;
        if self.sides.local().is_some() {
            let Sides::TwoNodes { nodes, .. } = self.sides else {
                return Err("a local copy on one node".into());
            };
            self.failed_copies(src, nodes, &add)?;
            // Added again after the cancelled attempt.
            dst = dst_daemon.disk("dst");
            // Slower than the guest writes (fio rewrites its 16 MiB every round of ~3.5 s):
            // the copy cannot converge until auto-converge limits the guest's writes.
            let copy_started = Instant::now();
            start_copy(src_daemon, COPY_BANDWIDTH);
            self.destination_frontend_killed(src_daemon, dst_daemon)?;
            let deadline = Instant::now() + MIGRATION_TIMEOUT;
            loop {
                let copy = src_daemon.disk("src").get("migration_copy").clone();
                match copy.get("phase").str() {
                    "converged" => break,
                    "failed" => return Err(format!("the copy failed: {copy:?}")),
                    _ if Instant::now() >= deadline => {
                        return Err(format!("the copy did not converge: {copy:?}"))
                    }
                    _ => std::thread::sleep(Duration::from_millis(100)),
                }
            }
            converged_after = Some(copy_started.elapsed());
            let limits: Vec<String> = src_daemon
                .log_text()
                .lines()
                .filter(|l| l.contains("event migration_auto_converge: disk src"))
                .filter_map(|l| l.split_once("limited to ").map(|(_, r)| r.to_string()))
                .collect();
            if limits.is_empty() {
                return Err(format!(
                    "the copy converged at {COPY_BANDWIDTH}B/s without auto-converge: the guest \
                     wrote slower than the test needs"
                ));
            }
            progress(&format!(
                "copy at {COPY_BANDWIDTH}B/s: auto-converge limited the guest's writes {} times \
                 (to {})",
                limits.len(),
                limits.join(", then ")
            ));
        }
        let reasons = blocker_reasons(&dst);
        if !reasons.iter().any(|r| r == "incoming") {
            return Err(format!(
                "the incoming disk has no incoming blocker: {dst:?}"
            ));
        }
        let dst_socket = PathBuf::from(dst.get("config").get("vhost_socket").str());
        let uri = self.sides.migration_uri(&self.machine.dir);
        let mut vm = self
            .machine
            .start("dst", &dst_socket, Some(&uri), self.sides.netns(1));
        let deadline = Instant::now() + QMP_TIMEOUT;
        while vm.qmp.status()? != "inmigrate" {
            if Instant::now() >= deadline {
                return Err("the destination QEMU never got to inmigrate".into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // First a slow pass that cannot converge — 1 ms of downtime at 32 MiB/s is 32 KiB,
        // and the guest keeps megabytes dirty (init.sh's dirtier; 0 ms would not do: QEMU
        // switches over whenever its estimate of what is left is 0, at the end of a pass,
        // without looking at the downtime) — so the guest's reads land in pages the
        // migration has already copied; then, once the guest has filled its page cache
        // (cache_filler in init.sh), enough bandwidth and downtime to finish.
        src.qmp.execute(
            "migrate-set-parameters",
            r#"{"max-bandwidth": 33554432, "downtime-limit": 1}"#,
        )?;
        let started = Instant::now();
        src.qmp
            .execute("migrate", &format!("{{\"uri\": \"{uri}\"}}"))?;
        let first_pass = Instant::now() + MIGRATION_TIMEOUT;
        loop {
            let info = src.qmp.execute("query-migrate", "{}")?;
            // A second sync means the first pass has sent every page once.
            if number(&info, &["ram", "dirty-sync-count"]) >= 2 {
                break;
            }
            if info.field("status").and_then(Json::as_str) != Some("active")
                && number(&info, &["ram", "transferred"]) > 0
                || Instant::now() >= first_pass
            {
                return Err(format!("the first pass did not get going: {info:?}"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.write_marker(FREEZE_OFFSET, "BLKPLANE-FREEZE")?;
        let mut early = None;
        let filled = wait_for(MIGRATION_TIMEOUT, || {
            let line = read_lossy(&src.results)
                .lines()
                .find(|l| l.contains("BLKPLANE-INFO cache-filled"))
                .map(str::to_string);
            if line.is_none() {
                // The switch-over must not come first: the check would prove nothing.
                let status = src.qmp.execute("query-migrate", "{}").ok()?;
                if status.field("status").and_then(Json::as_str) != Some("active") {
                    early = Some(status);
                    return Some(String::new());
                }
            }
            line
        })
        .ok_or("the guest never said cache-filled")?;
        if let Some(status) = early {
            return Err(format!(
                "the migration ended before the guest filled its page cache: {status:?}"
            ));
        }
        let before_finish = src.qmp.execute("query-migrate", "{}")?;
        src.qmp.execute(
            "migrate-set-parameters",
            r#"{"max-bandwidth": 4294967296, "downtime-limit": 2000}"#,
        )?;
        let info = wait_migration(src, || self.read_src_log())?;
        let took = started.elapsed();
        self.read_src_log();
        let status = info.field("status").and_then(Json::as_str).unwrap_or("");
        if status != "completed" {
            return Err(format!(
                "migration ended {status:?}: {info:?}\n---- destination QEMU ----\n{}",
                read_lossy(&vm.output)
            ));
        }
        let deadline = Instant::now() + QMP_TIMEOUT;
        loop {
            // The source's log goes with the disk at its retirement: keep reading it.
            self.read_src_log();
            let s = vm.qmp.status()?;
            if s == "running" {
                break;
            }
            if Instant::now() >= deadline {
                return Err(format!("the destination is {s:?} after the migration"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let src_state = src.qmp.status()?;
        // blkplaned sees the destination's rings running and retires the source (across
        // nodes: the destination's blkplaned asks the source's to).
        let running = Instant::now();
        let deadline = Instant::now() + CONTROL_TIMEOUT;
        while disk_ids(src_daemon).iter().any(|id| id == "src") {
            self.read_src_log();
            if Instant::now() >= deadline {
                return Err(format!(
                    "src was not retired: {:?}\n{}\n{}",
                    src_daemon.disk("src"),
                    src_daemon.log_text(),
                    dst_daemon.log_text()
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let retired = running.elapsed();
        let deadline = Instant::now() + CONTROL_TIMEOUT;
        let mut dst = dst_daemon.disk("dst");
        while (!dst.get("config").get("incoming_for").str().is_empty()
            || dst.get("config").get("incoming_from") != &Json::Null
            || blocker_reasons(&dst).iter().any(|r| r == "incoming"))
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(100));
            dst = dst_daemon.disk("dst");
        }
        if !dst.get("config").get("incoming_for").str().is_empty()
            || dst.get("config").get("incoming_from") != &Json::Null
            || blocker_reasons(&dst).iter().any(|r| r == "incoming")
        {
            return Err(format!("dst is still incoming after the takeover: {dst:?}"));
        }
        let _ = src.qmp.execute("quit", "{}");
        if !self.src_log.contains("dirty logging started") {
            return Err(format!(
                "the source frontend never started dirty logging:\n{}",
                self.src_log
            ));
        }
        // Tell the guest: its next fio round runs on the destination alone.
        self.write_marker(MIGRATED_OFFSET, "BLKPLANE-MIGRATED")?;
        // The disk's share of the downtime: the source's ring stops (each waits for its
        // requests in flight and fdatasyncs the image) and the destination's cache drop.
        // (The last ones: the guest's boot resets the device too.)
        let mut stops: Vec<u64> = self
            .src_log
            .lines()
            .filter(|l| l.contains("blkplane_frontend::vhost_user] queue "))
            .filter_map(|l| micros_after(l, " in "))
            .collect();
        stops.drain(..stops.len().saturating_sub(usize::from(QUEUES)));
        let dst_log = read_lossy(&dst_daemon.disks_dir().join("dst.log"));
        let drop = match converged_after {
            // The copy's switch-over, as node A logged it: the rest sent, node B's image
            // durable, its frontend serving.
            Some(converged) => {
                let log = src_daemon.log_text();
                let line = log
                    .lines()
                    .rfind(|l| l.contains("is complete: the source's rings stopped"))
                    .ok_or("node A logged no complete copy")?;
                format!(
                    "copy converged {converged:.1?} after it started; its switch-over: {}",
                    line.split_once("the destination serves (")
                        .map_or(line, |(_, r)| r.trim_end_matches(')'))
                )
            }
            None => dst_log
                .lines()
                .find_map(|l| micros_after(l, "before serving, in "))
                .map_or_else(
                    || "no cache drop (one node)".to_string(),
                    |us| format!("cache drop {us} µs"),
                ),
        };
        // Dirty logging must not cost the source its iothreads (a reply owed on the control
        // socket was once taken for an iothread's death, and every migration start replaced
        // them all).
        if let Some(l) = self
            .src_log
            .lines()
            .find(|l| l.contains("replaced iothread"))
        {
            return Err(format!(
                "the source frontend replaced an iothread during the migration: {l}"
            ));
        }
        // A figure, not a check: the source's log may be gone (retired) before the last
        // stops were read.
        let stops = if stops.len() == usize::from(QUEUES) {
            format!("{stops:?} µs")
        } else {
            format!("not all read before the source's log went ({stops:?} µs)")
        };
        let summary = format!(
            "migrate: completed in {took:.1?}; after the first pass (32 MiB/s) had sent every \
             page, the guest {} while {} MiB had been sent; QEMU: total {} ms, downtime {} ms, {} MiB of RAM \
             sent, {} dirty syncs; disk switch-over: source ring stops {stops} (in flight and \
             fdatasync), destination {drop}; source {src_state}, destination running; src \
             retired {retired:.1?} after the destination ran (dst serves alone, migratable: {})",
            filled
                .split_once("BLKPLANE-INFO ")
                .map_or(filled.as_str(), |(_, f)| f),
            number(&before_finish, &["ram", "transferred"]) >> 20,
            number(&info, &["total-time"]),
            number(&info, &["downtime"]),
            number(&info, &["ram", "transferred"]) >> 20,
            number(&info, &["ram", "dirty-sync-count"]),
            dst.get("migratable").bool()
        );
        Ok((vm, summary))
    }
}

#[test]
fn live_migration_with_fio_and_a_blocked_attempt() {
    let dir = TempDir::new("migration");
    binaries();
    let daemon = Daemon::start("migration-daemon", &[]);
    run_migration(&dir, &Sides::OneNode(&daemon));
}

/// The same guest and steps across two "nodes": two network namespaces joined by a veth pair,
/// a blkplaned in each (API on TCP with mutual TLS, `--peer-tls-*` to reach the other), one
/// image both reach (shared storage), the source QEMU in node A and the destination QEMU in
/// node B, the migration stream over the veth. The blocked attempt is refused by node A
/// through node B's AddDisk; the takeover retires `src` on node A.
#[test]
fn live_migration_across_nodes_with_shared_storage() {
    let dir = TempDir::new("migration-nodes");
    let (nodes, src, dst) = two_nodes(&dir, "mig", "migration");
    run_migration(
        &dir,
        &Sides::TwoNodes {
            src: &src,
            dst: &dst,
            nodes: &nodes,
            local: None,
        },
    );
}

/// Two "nodes" (network namespaces named after `tag`) with a blkplaned each (logs tagged
/// `daemon_tag`), their API on TCP with mutual TLS (certificates in `dir`), each able to
/// reach the other.
fn two_nodes(dir: &TempDir, tag: &str, daemon_tag: &str) -> (TwoNodes, Daemon, Daemon) {
    let nodes = TwoNodes::new(tag).unwrap_or_else(|e| panic!("two network namespaces: {e}"));
    let certs = dir.join("certs");
    std::fs::create_dir(&certs).unwrap();
    let san = format!(
        "DNS:localhost,IP:127.0.0.1,IP:{},IP:{}",
        ADDRESSES[0], ADDRESSES[1]
    );
    make_certs(&certs, "server-ca", "server", &san);
    make_certs(&certs, "client-ca", "client", "DNS:blkplanectl");
    binaries();
    let daemon_in = |i: usize, name: &str| {
        let endpoint = format!("{}:{API_PORT}", ADDRESSES[i]);
        let (args, reach) = node_options(&certs, &endpoint, name, true);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let reach: Vec<&str> = reach.iter().map(String::as_str).collect();
        Daemon::start_in(
            &format!("{daemon_tag}-{name}"),
            &args,
            Some(&reach),
            Some(nodes.name(i)),
        )
    };
    let src = daemon_in(0, "node-a");
    let dst = daemon_in(1, "node-b");
    (nodes, src, dst)
}

/// As `live_migration_across_nodes_with_shared_storage`, but the image is node A's own: node B
/// gets a new image (`--incoming-from` without `--shared`), node A copies the disk there while
/// fio writes (`disk migrate --to`), the VM migrates once the copy has converged, and the
/// guest verifies everything on node B's copy.
#[test]
fn live_migration_across_nodes_with_local_storage() {
    let dir = TempDir::new("migration-local");
    let (nodes, src, dst) = two_nodes(&dir, "mgl", "migration-local");
    let node_b_images = dir.join("node-b-images");
    std::fs::create_dir(&node_b_images).unwrap();
    run_migration(
        &dir,
        &Sides::TwoNodes {
            src: &src,
            dst: &dst,
            nodes: &nodes,
            local: Some(node_b_images.join("disk.img")),
        },
    );
}

/// One guest migration at a time: the steps are timed against the guest's own pace (a
/// throttled first pass that must not converge), which a second TCG guest on these two vCPUs
/// would upset.
static ONE_GUEST: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Boots the guest on `src` of `sides`, does what it asks, checks what it reports.
fn run_migration(dir: &TempDir, sides: &Sides) {
    let _one = ONE_GUEST.lock().unwrap_or_else(|e| e.into_inner());
    let t0 = Instant::now();
    let (qemu_bin, qemu_version) = qemu_binary();
    progress(&qemu_version);
    let guest = build_guest(dir.path());
    progress(&guest.info);
    let image = create_image(&dir.join("disk.img"), SIZE);
    let src_disk = sides.src().ctl_json(&[
        "disk",
        "add",
        "src",
        "--image",
        image.to_str().unwrap(),
        "--num-queues",
        &QUEUES.to_string(),
        "--iothreads",
        "2",
        "--serial",
        SERIAL,
    ]);
    let src_socket = PathBuf::from(src_disk.get("config").get("vhost_socket").str());
    let nonce = format!("{:x}", std::process::id() ^ 0x5eed);
    let machine = Machine {
        qemu_bin,
        guest,
        append: format!(
            "console=ttyS0 panic=-1 bp.mode=migrate bp.nonce={nonce} bp.size={SIZE} \
             bp.serial={SERIAL} bp.queues={QUEUES} bp.lbs=512"
        ),
        dir: dir.path().to_path_buf(),
    };
    let mut host = Host {
        sides,
        machine: &machine,
        image: image.clone(),
        nonce,
        src_log: String::new(),
    };
    let boot = Instant::now();
    let mut src = Some(machine.start("src", &src_socket, None, sides.netns(0)));
    let mut dst: Option<Vm> = None;
    let mut shown = 0;
    let mut actions: Vec<String> = Vec::new();
    let results_text = |dst: &Option<Vm>| {
        let mut t = read_lossy(&dir.join("src-results.log"));
        // After the switch-over the guest writes to the destination's port.
        if let Some(d) = dst {
            t.push_str(&read_lossy(&d.results));
        }
        t
    };
    let outcome: Result<(), String> = loop {
        std::thread::sleep(Duration::from_millis(250));
        let report = Report::parse(&results_text(&dst));
        let new: Vec<String> = report.lines[shown..].to_vec();
        shown = report.lines.len();
        let mut failed = None;
        for line in new {
            progress(&format!("[{:>5.1?}] {line}", boot.elapsed()));
            let Some(action) = line.strip_prefix("BLKPLANE-HOST ") else {
                continue;
            };
            let Some(vm) = src.as_mut() else {
                failed = Some(format!("host action {action} after the migration"));
                break;
            };
            let done = match action.trim() {
                "migrate-blocked" => host.migrate_blocked(vm),
                "migrate" => host.migrate(vm).map(|(vm, summary)| {
                    dst = Some(vm);
                    summary
                }),
                other => Err(format!("unknown action {other:?}")),
            };
            match done {
                Ok(done) => {
                    progress(&format!("[{:>5.1?}] host: {done}", boot.elapsed()));
                    actions.push(done);
                    if dst.is_some() {
                        // The source QEMU was told to quit.
                        if let Some(mut old) = src.take() {
                            let _ = wait_for(POWEROFF_TIMEOUT, || old.qemu.exited());
                        }
                    }
                }
                Err(e) => {
                    failed = Some(format!("host action {action}: {e}"));
                    break;
                }
            }
        }
        if let Some(e) = failed {
            break Err(e);
        }
        if report.done.is_some() {
            break Ok(());
        }
        let current = dst.as_mut().or(src.as_mut());
        if let Some(vm) = current {
            if let Some(status) = vm.qemu.exited() {
                break Err(format!(
                    "QEMU exited with {status} before the guest was done"
                ));
            }
            if read_lossy(&vm.console).contains("Kernel panic") {
                break Err("the guest kernel panicked".into());
            }
        }
        if boot.elapsed() >= GUEST_TIMEOUT {
            break Err(format!("the guest did not finish within {GUEST_TIMEOUT:?}"));
        }
    };
    let guest_time = boot.elapsed();
    let exit = match (&outcome, dst.as_mut()) {
        (Ok(()), Some(vm)) => wait_for(POWEROFF_TIMEOUT, || vm.qemu.exited()),
        _ => None,
    };

    let report = Report::parse(&results_text(&dst));
    let mut problems = Vec::new();
    if let Err(e) = &outcome {
        problems.push(e.clone());
    }
    if outcome.is_ok() && !exit.is_some_and(|s| s.success()) {
        problems.push(format!(
            "the destination QEMU did not power off cleanly: {exit:?}"
        ));
    }
    for c in &report.checks {
        if !c.ok {
            problems.push(format!("failed: {} {}", c.name, c.detail));
        }
    }
    for name in CHECKS {
        let n = report.checks.iter().filter(|c| c.name == *name).count();
        if n != 1 {
            problems.push(format!("check {name} reported {n} times"));
        }
    }
    if !report
        .done
        .as_deref()
        .is_some_and(|d| d.starts_with("failed=0"))
    {
        problems.push(format!("BLKPLANE-DONE: {:?}", report.done));
    }
    let dst_log = read_lossy(&sides.dst().disks_dir().join("dst.log"));
    let blkplaned_log = match sides {
        Sides::OneNode(d) => d.log_text(),
        Sides::TwoNodes { src, dst, .. } => format!(
            "---- node A ----\n{}\n---- node B ----\n{}",
            src.log_text(),
            dst.log_text()
        ),
    };
    for (side, log) in [("source", &host.src_log), ("destination", &dst_log)] {
        if let Some(l) = log
            .lines()
            .find(|l| l.contains("rejected request") || l.contains("refused vhost-user"))
        {
            problems.push(format!(
                "the {side} frontend refused QEMU or the guest: {l}"
            ));
        }
    }
    // Keep the run's logs for a look after the fact.
    let keep = target_dir().join("guest").join(match sides {
        Sides::OneNode(_) => "last-migration",
        Sides::TwoNodes { local: None, .. } => "last-migration-nodes",
        Sides::TwoNodes { local: Some(_), .. } => "last-migration-nodes-local",
    });
    let _ = std::fs::remove_dir_all(&keep);
    if std::fs::create_dir_all(&keep).is_ok() {
        for tag in ["src", "dst"] {
            for file in ["console", "results", "qemu"] {
                let name = format!("{tag}-{file}.log");
                let _ = std::fs::copy(dir.join(&name), keep.join(&name));
            }
        }
        let _ = std::fs::write(keep.join("frontend-src.log"), host.src_log.as_bytes());
        let _ = std::fs::write(keep.join("frontend-dst.log"), dst_log.as_bytes());
        let _ = std::fs::write(keep.join("blkplaned.log"), blkplaned_log.as_bytes());
    }
    if !problems.is_empty() {
        let mut msg = String::new();
        let _ = writeln!(msg, "logs kept in {}", keep.display());
        for vm in [src.as_ref(), dst.as_ref()].into_iter().flatten() {
            let _ = writeln!(
                msg,
                "---- {} ----\n{}\n---- {} ----\n{}",
                vm.console.display(),
                tail(&read_lossy(&vm.console), 128 * 1024),
                vm.output.display(),
                read_lossy(&vm.output)
            );
        }
        let _ = writeln!(
            msg,
            "---- results ----\n{}\n---- source frontend ----\n{}\n---- destination frontend \
             ----\n{}\n---- blkplaned ----\n{}",
            results_text(&dst),
            tail(&host.src_log, 64 * 1024),
            tail(&dst_log, 64 * 1024),
            tail(&blkplaned_log, 64 * 1024)
        );
        eprintln!("{msg}");
        panic!(
            "migration test failed after {guest_time:.1?}:\n  {}",
            problems.join("\n  ")
        );
    }
    let mut summary = format!(
        "all {} checks passed in {guest_time:.1?}; total {:.1?}:\n",
        report.checks.len(),
        t0.elapsed()
    );
    for c in &report.checks {
        let _ = writeln!(summary, "  ok {:<18} {}", c.name, c.detail);
    }
    for a in &actions {
        let _ = writeln!(summary, "  ok host: {a}");
    }
    progress(summary.trim_end());
}
