//! The soak test (issue 8; `docs/soak.md` explains the design): blkplaned with four disks under
//! verified I/O — two driven by libblkio clients in this process, two by a Linux guest under
//! QEMU running fio write+verify rounds on both — while a fault loop injects, every few
//! seconds, one of: kill -9 of a frontend (of a guest disk, or of the idle hot-plugged disk),
//! kill -9 of an iothread (any disk), kill -9 of blkplaned (restarted; it must re-adopt every
//! frontend), drain and resume (d0), a throttle change (d1, including a group and clearing),
//! a live grow (g1, which the guest must see), a live external snapshot of g1 (at most
//! [`MAX_SNAPSHOTS`]: blkplanectl `disk snapshot`, the frontend restarted on the new overlay,
//! QEMU reconnecting), a live commit of g1's latest snapshot into the image below it
//! (blkplanectl `disk commit`: frozen under a temporary overlay, merged while fio writes, the
//! frontend restarted twice), and a step of a fifth disk's hot-plug life (add with verified I/O,
//! re-verify, remove). g1 is a qcow2 overlay of a raw base: every fault above also meets its
//! allocating writes, and at the end `qemu-img check` must find its chain free of corruption.
//!
//! Passes with zero I/O errors and zero verify mismatches on every client, every injected
//! fault recovered from (and no process replaced that was not killed), the expected processes
//! and runtime files at every quiet point between faults, and fd counts and RSS flat within
//! the bounds below; it prints a summary of what was injected and the resource figures.
//!
//! 300 s of faults by default (the CI run, about 6–7 minutes with the guest's boot);
//! `BLKPLANE_SOAK_SECS=3600 cargo test -p blkplane-tests --test soak -- --nocapture` for the
//! hour-long run; `BLKPLANE_SOAK_SEED` repeats a run's choices (the seed is printed).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use blkplane_tests::daemon::{alive, cmdline, kill, Daemon, Json};
use blkplane_tests::frontend::{iothread_pids, kill_iothread, SPAWNER_COMM};
use blkplane_tests::guest::{
    build_guest, qemu_binary, qemu_command, read_lossy, tail, target_dir, Qemu, Report,
};
use blkplane_tests::qemu_img::{assert_check_clean, create_overlay, virtual_size};
use blkplane_tests::soak::{
    become_subreaper, cloexec_all, fd_count, fd_diff, fd_kinds, fd_summary, reap_zombies,
    status_kib, ClientStats, Worker, BLOCK, SLOT,
};
use blkplane_tests::{binaries, create_image, wait_for, Client, ClientOptions, Rng, TempDir};

const MIB: u64 = 1 << 20;
/// Seconds of fault injection without BLKPLANE_SOAK_SECS.
const DEFAULT_SECS: u64 = 300;
/// The libblkio disks' size.
const LB_SIZE: u64 = 64 * MIB;
/// The guest disks' size (init.sh's layout: fio at 176–192 MiB, the stop marker at 203 MiB).
const GUEST_SIZE: u64 = 256 * MIB;
/// The hot-plugged disk's size.
const HOT_SIZE: u64 = 32 * MIB;
/// Requests in flight per libblkio queue.
const DEPTH: usize = 8;
/// Requests per queue in one session of verified I/O on the hot-plugged disk.
const HOT_OPS: u64 = 300;
/// QEMU's reconnect interval for the guest disks.
const RECONNECT_MS: u32 = 1000;
/// Where the host writes the stop marker on g0 (init.sh's STOP_SECTOR).
const STOP_OFFSET: u64 = 203 * MIB;
/// Pause between two injections (uniform in this range, milliseconds).
const PAUSE_MS: (u64, u64) = (1000, 3000);

/// Liveness bounds, generous for a loaded 2-core machine; hitting one means something hangs.
/// Building the guest (or taking it from the cache) and booting it until fio writes.
const BOOT_TIMEOUT: Duration = Duration::from_secs(420);
/// Every disk back to its expected state (processes, state, VMM connected) after a fault.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(90);
/// A libblkio client completing nothing for this long (drains hold for 2 s at most).
const CLIENT_STALL: Duration = Duration::from_secs(120);
/// The guest finishing no fio round for this long (a round takes 5–20 s).
const GUEST_STALL: Duration = Duration::from_secs(240);
/// The guest finishing its last round and powering off after the stop marker.
const DONE_TIMEOUT: Duration = Duration::from_secs(300);

/// Leak bounds (docs/soak.md, "Leak checks"). Samples are taken at quiet points (every fault
/// recovered from, a pause since), where a process's fd count is a function of its
/// configuration; the slack covers what may legitimately be open at that moment besides.
/// blkplaned: a gRPC connection and admin-channel polls in progress (one per disk at most).
const FD_SLACK_BLKPLANED: usize = 8;
/// A frontend: an admin connection from blkplaned's poll in progress.
const FD_SLACK_FRONTEND: usize = 2;
/// An iothread or the frontend's iothread spawner: nothing varies.
const FD_SLACK_IOTHREAD: usize = 1;
/// Descriptors per queue a guest disk's frontend that QEMU reconnected to may hold beyond
/// one QEMU first connected to (docs/soak.md): allowed across replacements, not within one
/// process.
const RECONNECT_FDS_PER_QUEUE: usize = 2;
/// Looks at each quiet point's fd counts, and the time between two.
const SAMPLE_LOOKS: usize = 3;
const SAMPLE_GAP: Duration = Duration::from_millis(150);
/// Sockets bound under the runtime dir (listening and accepted): polls in progress.
const SOCKET_SLACK: usize = 8;
/// RSS (RssAnon: the heap and stacks, not the guest memory a frontend maps) may grow by a
/// quarter of its warm-up maximum or 8 MiB, whichever is more: allocator caches settle, a
/// leak of a few hundred bytes per request (hundreds of thousands of them) does not fit.
const RSS_SLACK_MIN_KIB: u64 = 8 * 1024;

/// Writes past libtest's capture, so that progress and the summary show in CI logs.
fn progress(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "soak: {msg}");
}

// ---------------------------------------------------------------------------------------------
// The disks.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Driven by a libblkio client of this process (which does not reconnect).
    Libblkio,
    /// Attached to the QEMU guest with reconnect.
    Guest,
    /// The hot-plugged fifth disk: libblkio sessions, idle in between.
    Hot,
}

struct Spec {
    id: &'static str,
    role: Role,
    queues: u16,
    iothreads: usize,
    block_size: u32,
    serial: &'static str,
    /// Runs as [`DISK_USER`] (AddDiskRequest `run_as`) when the test runs as root.
    own_user: bool,
}

/// The user the disks with `own_user` run as (107 is `qemu` in KubeVirt).
const DISK_USER: &str = "107:107";

/// The real, effective, saved and file-system uids of `pid`; `None` once it is gone.
fn uids_of(pid: u32) -> Option<[u32; 4]> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    let ids: Vec<u32> = line
        .split_whitespace()
        .filter_map(|u| u.parse().ok())
        .collect();
    ids.try_into().ok()
}

/// Whether this test can give disks a user of their own: blkplaned inherits its uid.
fn can_run_as() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

const SPECS: [Spec; 4] = [
    Spec {
        id: "d0",
        role: Role::Libblkio,
        queues: 2,
        iothreads: 2,
        block_size: 512,
        serial: "SOAK-D0",
        own_user: false,
    },
    Spec {
        id: "d1",
        role: Role::Libblkio,
        queues: 1,
        iothreads: 1,
        block_size: 4096,
        serial: "SOAK-D1",
        own_user: true,
    },
    Spec {
        id: "g0",
        role: Role::Guest,
        queues: 2,
        iothreads: 2,
        block_size: 512,
        serial: "SOAK-G0",
        own_user: false,
    },
    Spec {
        id: "g1",
        role: Role::Guest,
        queues: 1,
        iothreads: 1,
        block_size: 512,
        serial: "SOAK-G1",
        own_user: true,
    },
];
const HOT: Spec = Spec {
    id: "hot",
    role: Role::Hot,
    queues: 2,
    iothreads: 2,
    block_size: 512,
    serial: "SOAK-HOT",
    own_user: true,
};

fn spec(id: &str) -> &'static Spec {
    SPECS
        .iter()
        .chain(std::iter::once(&HOT))
        .find(|s| s.id == id)
        .unwrap()
}

/// blkplanectl `-o json ARGS`, as a Result for the fault loop.
fn ctl(d: &Daemon, args: &[&str]) -> Result<Json, String> {
    let mut all = vec!["-o", "json"];
    all.extend_from_slice(args);
    let out = d.ctl(&all);
    if out.code != Some(0) {
        return Err(format!(
            "blkplanectl {args:?}: exit {:?}: {}{}",
            out.code, out.stderr, out.stdout
        ));
    }
    Ok(Json::parse(&out.stdout))
}

fn add_disk(d: &Daemon, s: &Spec, image: &Path, block_size: u32) -> Result<Json, String> {
    let queues = s.queues.to_string();
    let iothreads = s.iothreads.to_string();
    let block_size = block_size.to_string();
    let mut args = vec![
        "disk",
        "add",
        s.id,
        "--image",
        image.to_str().unwrap(),
        "--num-queues",
        &queues,
        "--iothreads",
        &iothreads,
        "--block-size",
        &block_size,
        "--serial",
        s.serial,
    ];
    if s.own_user && can_run_as() {
        args.extend(["--run-as", DISK_USER]);
        // The frontend opens the image as the disk's user, as its VMM would.
        let (uid, gid) = DISK_USER.split_once(':').unwrap();
        let (uid, gid) = (uid.parse().unwrap(), gid.parse().unwrap());
        std::os::unix::fs::chown(image, Some(uid), Some(gid)).map_err(|e| e.to_string())?;
        if let Some(dir) = image.parent() {
            std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .map_err(|e| e.to_string())?;
        }
    }
    ctl(d, &args)
}

/// The iothread pids blkplaned reports for a disk (its `disk show`/`disk list` JSON), sorted.
fn reported_iothreads(disk: &Json) -> Vec<u32> {
    let mut pids: Vec<u32> = disk
        .get("iothread_pids")
        .arr()
        .iter()
        .map(|p| p.u64() as u32)
        .collect();
    pids.sort_unstable();
    pids
}

/// Requests completed by a disk's frontend (its statistics, through blkplaned).
fn completed(d: &Daemon, id: &str) -> Result<u64, String> {
    let s = ctl(d, &["stats", id])?;
    let t = s.arr()[0].get("total");
    Ok([
        "read_ops",
        "write_ops",
        "flush_ops",
        "discard_ops",
        "write_zeroes_ops",
        "other_ops",
        "errors",
    ]
    .iter()
    .map(|f| t.get(f).u64())
    .sum())
}

// ---------------------------------------------------------------------------------------------
// The libblkio clients of d0 and d1.

/// One libblkio connection with a thread per queue, each running verified I/O on its own
/// range of the disk until stopped, then reading its whole range back.
struct LbClient {
    id: &'static str,
    stats: Arc<ClientStats>,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl LbClient {
    fn start(id: &'static str, socket: PathBuf, tag: u32, queues: u16, seed: u64) -> LbClient {
        let stats = Arc::new(ClientStats::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (Arc::clone(&stats), Arc::clone(&stop));
        let (connected_tx, connected) = std::sync::mpsc::channel();
        let handle = std::thread::spawn(move || {
            let opts = ClientOptions {
                num_queues: i32::from(queues),
                buf_size: DEPTH * SLOT,
                ..Default::default()
            };
            let client = Client::connect_with(&socket, &opts);
            let _ = connected_tx.send(());
            let mut client = match client {
                Ok(c) => c,
                Err(e) => {
                    st.error(format!("connect: {e}"));
                    return;
                }
            };
            let per_queue = (LB_SIZE / BLOCK as u64) as usize / usize::from(queues);
            let mut workers: Vec<Worker> = (0..usize::from(queues))
                .map(|i| {
                    Worker::new(
                        tag,
                        (i * per_queue) as u64,
                        per_queue,
                        seed ^ (i as u64) << 32,
                    )
                })
                .collect();
            let (st, sp) = (&*st, &*sp);
            std::thread::scope(|s| {
                for (q, w) in client.queues_mut().iter_mut().zip(&mut workers) {
                    s.spawn(move || {
                        if w.run(q, DEPTH, st, u64::MAX, &|| sp.load(Ordering::Relaxed)) {
                            w.verify_all(q, DEPTH, st);
                        }
                    });
                }
            });
        });
        // Connected (or failed) before the test goes on: the descriptors libblkio opened are
        // then there for cloexec_all.
        let _ = connected.recv();
        LbClient {
            id,
            stats,
            stop,
            handle: Some(handle),
        }
    }

    /// Stops, waits for the final read-back.
    fn finish(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            if h.join().is_err() {
                self.stats.error("the client thread panicked".into());
            }
        }
    }
}

impl Drop for LbClient {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

// ---------------------------------------------------------------------------------------------
// The guest.

struct Guest {
    qemu: Qemu,
    results: PathBuf,
    console: PathBuf,
    qemu_log: PathBuf,
    shown: usize,
    rounds: u64,
    last_round: Instant,
    started: bool,
    report: Report,
    t0: Instant,
}

impl Guest {
    /// Reads what the guest reported since the last call; an error for a failed check, a
    /// guest that is done too early, QEMU gone or a kernel panic.
    fn poll(&mut self, stopping: bool) -> Result<(), String> {
        let r = Report::parse(&read_lossy(&self.results));
        for line in &r.lines[self.shown..] {
            progress(&format!("[guest {:>6.1?}] {line}", self.t0.elapsed()));
            if line.starts_with("BLKPLANE-INFO soak-round ") {
                self.rounds += 1;
                self.last_round = Instant::now();
            }
            if line.trim_end() == "BLKPLANE-HOST soak-start" {
                self.started = true;
                self.last_round = Instant::now();
            }
        }
        self.shown = r.lines.len();
        self.report = r;
        if let Some(c) = self.report.checks.iter().find(|c| !c.ok) {
            return Err(format!("guest check failed: {} {}", c.name, c.detail));
        }
        if self.report.done.is_some() {
            return if stopping {
                Ok(())
            } else {
                Err(format!(
                    "the guest finished before the host said stop: {:?}",
                    self.report.done
                ))
            };
        }
        if let Some(status) = self.qemu.exited() {
            return Err(format!("QEMU exited with {status} while the guest ran"));
        }
        if read_lossy(&self.console).contains("Kernel panic") {
            return Err("the guest kernel panicked".into());
        }
        if self.started && self.last_round.elapsed() > GUEST_STALL {
            return Err(format!(
                "the guest finished no fio round for {GUEST_STALL:?} (round {})",
                self.rounds
            ));
        }
        Ok(())
    }

    /// The guest's console, results port and QEMU's output, for a failure.
    fn logs(&self) -> String {
        format!(
            "---- guest console ----\n{}\n---- guest results port ----\n{}\n---- QEMU output \
             ----\n{}\n---- end of guest logs ----",
            tail(&read_lossy(&self.console), 64 * 1024),
            read_lossy(&self.results),
            read_lossy(&self.qemu_log)
        )
    }
}

// ---------------------------------------------------------------------------------------------
// The hot-plugged disk.

struct HotDisk {
    image: PathBuf,
    workers: Vec<Worker>,
    block_size: u32,
}

// ---------------------------------------------------------------------------------------------
// Processes and resources.

/// A disk's processes.
#[derive(Debug, Clone, PartialEq)]
struct Procs {
    frontend: u32,
    iothreads: Vec<u32>,
}

/// What an injection changed in a disk's processes.
#[derive(Debug, Clone, Copy)]
enum Expect {
    Same,
    NewFrontend,
    NewIothread(u32),
}

/// One resource figure of one process (or the socket count) at a quiet point.
struct Sample {
    /// Seconds since the faults started.
    t: f64,
    key: String,
    pid: u32,
    fds: usize,
    rss_kib: u64,
    /// What the fds are, for a leak report.
    detail: BTreeMap<String, usize>,
}

/// (pid → (ppid, comm, state)) of every process.
fn process_table() -> BTreeMap<u32, (u32, String, char)> {
    let mut out = BTreeMap::new();
    for pid in blkplane_procfs::pids() {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = stat[open + 1..close].to_string();
        let mut rest = stat[close + 1..].split_whitespace();
        let state = rest.next().and_then(|s| s.chars().next()).unwrap_or('?');
        let ppid = rest.next().and_then(|s| s.parse().ok()).unwrap_or(0);
        out.insert(pid, (ppid, comm, state));
    }
    out
}

/// The live processes named `comm` below this process, and the zombies among them.
fn descendants(comm: &str) -> (BTreeSet<u32>, usize) {
    let table = process_table();
    let me = std::process::id();
    let below_me = |mut pid: u32| {
        for _ in 0..64 {
            match table.get(&pid) {
                Some(&(ppid, _, _)) if ppid == me => return true,
                Some(&(ppid, _, _)) if ppid > 1 => pid = ppid,
                _ => return false,
            }
        }
        false
    };
    let mut live = BTreeSet::new();
    let mut zombies = 0;
    for (&pid, (_, c, state)) in &table {
        if c == comm && below_me(pid) {
            if matches!(state, 'Z' | 'X' | 'x') {
                zombies += 1;
            } else {
                live.insert(pid);
            }
        }
    }
    (live, zombies)
}

/// UNIX sockets bound under `dir` (listening and accepted ones), from /proc/net/unix.
fn unix_sockets_under(dir: &Path) -> usize {
    let prefix = format!("{}/", dir.display());
    std::fs::read_to_string("/proc/net/unix")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .filter(|l| {
            l.split_whitespace()
                .nth(7)
                .is_some_and(|p| p.starts_with(&prefix))
        })
        .count()
}

// ---------------------------------------------------------------------------------------------
// The soak.

/// The fault kinds, their weight in the random choice.
const FAULTS: &[(&str, u64)] = &[
    ("kill-frontend", 3),
    ("kill-iothread", 4),
    ("kill-blkplaned", 2),
    ("drain-resume", 2),
    ("throttle", 2),
    ("resize", 1),
    ("snapshot", 1),
    ("commit", 1),
    ("hot-plug", 3),
];

/// The most live snapshots of g1 in one run (its chain grows by one each; 16 is the bound).
const MAX_SNAPSHOTS: u32 = 6;

/// The throttle settings d1 goes through, in turn (blkplanectl `disk throttle d1 ARGS`).
const THROTTLE_STEPS: &[&[&str]] = &[
    &["--iops-total", "300"],
    &["--bps-total", "4194304"],
    &[
        "--iops-total",
        "200",
        "--iops-total-max",
        "1000",
        "--iops-total-max-length",
        "2",
    ],
    &["--iops-read", "300", "--iops-write", "150"],
    &["--iops-total", "500", "--group", "soak"],
    &["--clear"],
];

struct Soak {
    d: Daemon,
    images: TempDir,
    rng: Rng,
    /// When the faults started.
    t0: Instant,
    /// The processes of every disk present, as last settled.
    procs: BTreeMap<String, Procs>,
    /// Injections by kind and target.
    counts: BTreeMap<String, u64>,
    /// The injection under way (for a failure's message).
    current: &'static str,
    /// Every injection, described.
    log: Vec<String>,
    samples: Vec<Sample>,
    quiet_points: u64,
    reaped: usize,
    clients: Vec<LbClient>,
    /// Per client: ops at the last progress, and when.
    progress: Vec<(u64, Instant)>,
    guest: Guest,
    hot: Option<HotDisk>,
    hot_stats: Arc<ClientStats>,
    hot_incarnations: u32,
    throttle_step: usize,
    group_active: bool,
    g1_capacity: u64,
    /// g1's image now: its first overlay, then the latest snapshot's.
    g1_image: PathBuf,
    /// Snapshots of g1 taken so far.
    snapshots: u32,
    /// The images g1 served before its snapshots still in its chain, the latest last: what a
    /// commit merges g1's image into.
    g1_below: Vec<PathBuf>,
    /// Commits of g1 so far.
    commits: u32,
    g0_image: PathBuf,
    nonce: String,
}

impl Soak {
    /// Fails the test with the recent injections and the figures so far.
    fn fail(&self, msg: &str) -> ! {
        let recent: Vec<&String> = self.log.iter().rev().take(15).rev().collect();
        let mut text = format!(
            "soak failed after {:.1?} of faults{}: {msg}\n",
            self.t0.elapsed(),
            if self.current.is_empty() {
                String::new()
            } else {
                format!(" (during {})", self.current)
            }
        );
        let _ = writeln!(text, "last injections (of {}):", self.log.len());
        for l in recent {
            let _ = writeln!(text, "  {l}");
        }
        text.push_str(&self.summary());
        eprintln!("{}", self.guest.logs());
        self.keep_logs();
        panic!("{text}");
    }

    /// Copies the guest's logs to target/guest/last-soak/.
    fn keep_logs(&self) {
        let keep = target_dir().join("guest").join("last-soak");
        let _ = std::fs::remove_dir_all(&keep);
        if std::fs::create_dir_all(&keep).is_ok() {
            for f in [
                &self.guest.console,
                &self.guest.results,
                &self.guest.qemu_log,
            ] {
                let _ = std::fs::copy(f, keep.join(f.file_name().unwrap()));
            }
            for e in std::fs::read_dir(self.d.disks_dir())
                .into_iter()
                .flatten()
                .flatten()
            {
                if e.path().extension().is_some_and(|x| x == "log") {
                    let _ = std::fs::copy(e.path(), keep.join(e.file_name()));
                }
            }
            let _ = std::fs::write(keep.join("blkplaned.log"), self.d.log_text());
        }
    }

    fn count(&mut self, what: String) {
        *self.counts.entry(what).or_default() += 1;
    }

    /// Client errors and mismatches, client and guest progress, the guest's reports.
    fn health(&mut self, stopping: bool) {
        for (i, c) in self.clients.iter().enumerate() {
            if c.stats.failures() > 0 {
                self.fail(&format!(
                    "libblkio client of {}: {}; first: {:?}",
                    c.id,
                    c.stats.line(),
                    c.stats.messages.lock().unwrap()
                ));
            }
            let ops = c.stats.ops();
            if ops != self.progress[i].0 {
                self.progress[i] = (ops, Instant::now());
            } else if self.progress[i].1.elapsed() > CLIENT_STALL {
                self.fail(&format!(
                    "libblkio client of {} completed nothing for {CLIENT_STALL:?}",
                    c.id
                ));
            }
        }
        if self.hot_stats.failures() > 0 {
            self.fail(&format!(
                "libblkio sessions on hot: {}; first: {:?}",
                self.hot_stats.line(),
                self.hot_stats.messages.lock().unwrap()
            ));
        }
        if let Err(e) = self.guest.poll(stopping) {
            self.fail(&e);
        }
    }

    /// Sleeps `dur`, watching health.
    fn pause(&mut self, dur: Duration) {
        let end = Instant::now() + dur;
        while Instant::now() < end {
            std::thread::sleep(Duration::from_millis(250).min(end - Instant::now()));
            self.health(false);
        }
    }

    /// The disk state blkplaned must report for `id` at rest.
    fn rest_state(id: &str) -> &'static str {
        if spec(id).role == Role::Hot {
            "ready"
        } else {
            "connected"
        }
    }

    /// One look at whether every disk is back at rest with the processes `expect` says:
    /// Ok(Some) when settled, Ok(None) with the reason in `why` while not yet, Err for a
    /// process that died without being killed.
    fn settled(
        &self,
        expect: &BTreeMap<String, Expect>,
        why: &mut String,
    ) -> Result<Option<BTreeMap<String, Procs>>, String> {
        // Processes that must be alive, whatever blkplaned says.
        for (id, old) in &self.procs {
            let e = expect.get(id).copied().unwrap_or(Expect::Same);
            let must_live: Vec<u32> = match e {
                Expect::Same => std::iter::once(old.frontend)
                    .chain(old.iothreads.iter().copied())
                    .collect(),
                Expect::NewIothread(victim) => std::iter::once(old.frontend)
                    .chain(old.iothreads.iter().copied().filter(|&p| p != victim))
                    .collect(),
                Expect::NewFrontend => Vec::new(),
            };
            if let Some(dead) = must_live.iter().find(|&&p| !alive(p)) {
                let what = if *dead == old.frontend {
                    "frontend"
                } else {
                    "iothread"
                };
                let show = ctl(&self.d, &["disk", "show", id])
                    .map(|j| format!("{} ({})", j.get("state").str(), j.get("state_reason").str()))
                    .unwrap_or_else(|e| e);
                let log = read_lossy(&self.d.disks_dir().join(format!("{id}.log")));
                return Err(format!(
                    "the {what} {dead} of {id} died without being killed (expected {e:?}); \
                     disk: {show}; end of its log:\n{}",
                    tail(&log, 4096)
                ));
            }
        }
        let list = match ctl(&self.d, &["disk", "list"]) {
            Ok(l) => l,
            Err(e) => {
                *why = e;
                return Ok(None);
            }
        };
        let listed: BTreeMap<String, &Json> = list
            .arr()
            .iter()
            .map(|j| (j.get("id").str().to_string(), j))
            .collect();
        let ids: BTreeSet<&String> = self.procs.keys().collect();
        if listed.keys().collect::<BTreeSet<_>>() != ids {
            return Err(format!(
                "blkplaned lists {:?}, expected {ids:?}",
                listed.keys()
            ));
        }
        let mut new = BTreeMap::new();
        for (id, old) in &self.procs {
            let e = expect.get(id).copied().unwrap_or(Expect::Same);
            let j = listed[id];
            let state = j.get("state").str();
            if state != Self::rest_state(id) {
                *why = format!("{id} is {state} ({})", j.get("state_reason").str());
                return Ok(None);
            }
            let fe = j.get("frontend_pid").u64() as u32;
            let fe_ok = match e {
                Expect::NewFrontend => fe != old.frontend,
                _ => fe == old.frontend,
            };
            if fe == 0 || !alive(fe) || !fe_ok {
                *why = format!(
                    "{id}: blkplaned reports frontend {fe}, had {} ({e:?})",
                    old.frontend
                );
                return Ok(None);
            }
            let mut its = iothread_pids(fe);
            its.sort_unstable();
            let reported = reported_iothreads(j);
            let its_ok = its.len() == spec(id).iothreads
                && reported == its
                && match e {
                    Expect::Same => its == old.iothreads,
                    Expect::NewIothread(v) => !its.contains(&v),
                    Expect::NewFrontend => !its.iter().any(|p| old.iothreads.contains(p)),
                };
            if !its_ok {
                *why = format!(
                    "{id}: iothreads {its:?} (blkplaned: {reported:?}), had {:?} ({e:?})",
                    old.iothreads
                );
                return Ok(None);
            }
            new.insert(
                id.clone(),
                Procs {
                    frontend: fe,
                    iothreads: its,
                },
            );
        }
        Ok(Some(new))
    }

    /// Waits until every disk is back at rest with the processes `expect` says; returns how
    /// long that took.
    fn settle(&mut self, expect: &[(&str, Expect)]) -> Duration {
        let expect: BTreeMap<String, Expect> =
            expect.iter().map(|(id, e)| (id.to_string(), *e)).collect();
        let t = Instant::now();
        let mut why = String::new();
        loop {
            match self.settled(&expect, &mut why) {
                Ok(Some(new)) => {
                    self.procs = new;
                    return t.elapsed();
                }
                Ok(None) => {}
                Err(e) => self.fail(&e),
            }
            if t.elapsed() > SETTLE_TIMEOUT {
                self.fail(&format!(
                    "not back at rest within {SETTLE_TIMEOUT:?} of the injection: {why}"
                ));
            }
            self.health(false);
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Between two injections, all recovered: the processes and files are exactly what the
    /// disks need, and the resource figures are sampled.
    fn quiet_point(&mut self) {
        self.reaped += reap_zombies(&["blkplane-fronte", SPAWNER_COMM, "blkplane-iothre"]);
        self.health(false);
        self.quiet_points += 1;
        let want_fe: BTreeSet<u32> = self.procs.values().map(|p| p.frontend).collect();
        let want_it: BTreeSet<u32> = self
            .procs
            .values()
            .flat_map(|p| p.iothreads.iter().copied())
            .collect();
        let (fes, _) = descendants("blkplane-fronte");
        let (its, _) = descendants("blkplane-iothre");
        let listed: BTreeSet<u32> = self.d.frontends().into_iter().collect();
        if fes != want_fe || listed != want_fe {
            self.fail(&format!(
                "frontend processes: {fes:?} (with our admin sockets: {listed:?}), want \
                 {want_fe:?} for {:?}",
                self.procs.keys()
            ));
        }
        // One iothread spawner per frontend, its child.
        let (spawners, _) = descendants(SPAWNER_COMM);
        let table = process_table();
        let mut spawner_of: BTreeMap<u32, u32> = BTreeMap::new();
        for &sp in &spawners {
            let parent = table.get(&sp).map_or(0, |t| t.0);
            if !want_fe.contains(&parent) || spawner_of.insert(parent, sp).is_some() {
                self.fail(&format!(
                    "iothread spawner {sp} (parent {parent}) is not the one spawner of a \
                     frontend {want_fe:?}: spawners {spawners:?}"
                ));
            }
        }
        if spawner_of.len() != want_fe.len() {
            self.fail(&format!(
                "iothread spawners {spawner_of:?} (frontend -> spawner), want one for each of \
                 {want_fe:?}"
            ));
        }
        if its != want_it {
            self.fail(&format!(
                "iothread processes: {its:?}, want {want_it:?} ({:?})",
                self.procs
            ));
        }
        // Every process of a disk runs as the disk's user, restarted ones included.
        for (id, p) in &self.procs {
            let want = if spec(id).own_user && can_run_as() {
                DISK_USER.split(':').next().unwrap().parse().unwrap()
            } else {
                // SAFETY: geteuid has no preconditions.
                unsafe { libc::geteuid() }
            };
            let pids = [p.frontend]
                .into_iter()
                .chain(spawner_of.get(&p.frontend).copied())
                .chain(p.iothreads.iter().copied());
            for pid in pids {
                if let Some(uids) = uids_of(pid) {
                    if uids != [want; 4] {
                        self.fail(&format!(
                            "{id}: process {pid} runs as uids {uids:?}, want {want}"
                        ));
                    }
                }
            }
        }
        let mut want_files: Vec<String> = self
            .procs
            .keys()
            .flat_map(|id| ["admin", "log", "pid", "sock"].map(|x| format!("{id}.{x}")))
            .collect();
        want_files.sort();
        let files = self.d.runtime_files();
        if files != want_files {
            self.fail(&format!("runtime files: {files:?}, want {want_files:?}"));
        }
        let throttle_dir = self.d.disks_dir().parent().unwrap().join("throttle");
        let mut group_files: Vec<String> = std::fs::read_dir(&throttle_dir)
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        group_files.sort();
        let want_group: Vec<String> = if self.group_active {
            vec!["soak.state".into()]
        } else {
            Vec::new()
        };
        if group_files != want_group {
            self.fail(&format!(
                "throttle group files: {group_files:?}, want {want_group:?}"
            ));
        }

        let t = self.t0.elapsed().as_secs_f64();
        let hot = if self.hot.is_some() { " (+hot)" } else { "" };
        let mut procs: Vec<(String, u32)> = vec![(format!("blkplaned{hot}"), self.d.pid())];
        for (id, p) in &self.procs {
            // Each snapshot adds a backing file to g1's chain: one more fd in its frontend and
            // two in its iothread, a new baseline rather than a leak (and a commit takes one
            // away again: the baseline of that depth).
            let chain = if id == "g1" && !self.g1_below.is_empty() {
                format!(" over {} snapshot(s)", self.g1_below.len())
            } else {
                String::new()
            };
            procs.push((format!("frontend {id}{chain}"), p.frontend));
            procs.push((format!("spawner {id}"), spawner_of[&p.frontend]));
            for &it in &p.iothreads {
                procs.push((format!("iothread {id}{chain}"), it));
            }
        }
        // Three looks 150 ms apart, the smallest count kept: a leak stays, an admin poll or a
        // gRPC call in progress does not.
        let run_dir = self.d.disks_dir().parent().unwrap().to_path_buf();
        let mut fds: Vec<Option<usize>> = vec![None; procs.len()];
        let mut sockets = usize::MAX;
        for look in 0..SAMPLE_LOOKS {
            if look > 0 {
                std::thread::sleep(SAMPLE_GAP);
            }
            for (i, (_, pid)) in procs.iter().enumerate() {
                if let Some(n) = fd_count(*pid) {
                    fds[i] = Some(fds[i].map_or(n, |m| m.min(n)));
                }
            }
            sockets = sockets.min(unix_sockets_under(&run_dir));
        }
        for ((key, pid), fds) in procs.into_iter().zip(fds) {
            let (Some(fds), Some(rss)) = (fds, status_kib(pid, "RssAnon")) else {
                self.fail(&format!("{key} {pid} vanished at a quiet point"));
            };
            self.samples.push(Sample {
                t,
                key,
                pid,
                fds,
                rss_kib: rss,
                detail: fd_kinds(pid),
            });
        }
        self.samples.push(Sample {
            t,
            key: format!("unix sockets in the runtime dir{hot}"),
            pid: 0,
            fds: sockets,
            rss_kib: 0,
            detail: BTreeMap::new(),
        });
    }

    /// Picks and injects one fault; returns its description.
    fn inject(&mut self) -> String {
        let total: u64 = FAULTS.iter().map(|f| f.1).sum();
        let mut roll = self.rng.below(total);
        let kind = FAULTS
            .iter()
            .find(|f| {
                if roll < f.1 {
                    true
                } else {
                    roll -= f.1;
                    false
                }
            })
            .unwrap()
            .0;
        self.current = kind;
        let r = match kind {
            "kill-frontend" => self.kill_frontend(),
            "kill-iothread" => self.kill_iothread(),
            "kill-blkplaned" => self.kill_blkplaned(),
            "drain-resume" => self.drain_resume(),
            "throttle" => self.throttle(),
            "resize" => self.resize(),
            "snapshot" if self.snapshots < MAX_SNAPSHOTS => self.snapshot(),
            // Enough of them: the chain stays short.
            "snapshot" => self.resize(),
            "commit" if !self.g1_below.is_empty() => self.commit(),
            // Nothing to commit yet: a snapshot makes something.
            "commit" if self.snapshots < MAX_SNAPSHOTS => self.snapshot(),
            "commit" => self.resize(),
            "hot-plug" => self.hot_plug(),
            _ => unreachable!(),
        };
        let desc = r.unwrap_or_else(|e| self.fail(&e));
        self.current = "";
        desc
    }

    /// kill -9 of the frontend of a guest disk (QEMU reconnects) or of the idle hot disk.
    fn kill_frontend(&mut self) -> Result<String, String> {
        let mut targets = vec!["g0", "g1"];
        if self.hot.is_some() {
            targets.push("hot");
        }
        let id = targets[self.rng.below(targets.len() as u64) as usize];
        let old = self.procs[id].clone();
        let admin = format!(
            "--admin-socket={}",
            self.d.disks_dir().join(format!("{id}.admin")).display()
        );
        if !cmdline(old.frontend).contains(&admin) {
            return Err(format!("pid {} is not {id}'s frontend", old.frontend));
        }
        kill(old.frontend, libc::SIGKILL);
        let took = self.settle(&[(id, Expect::NewFrontend)]);
        self.count(format!("kill -9 frontend {id}"));
        let new = self.procs[id].frontend;
        let mut desc = format!(
            "kill -9 frontend of {id} (pid {}, iothreads {:?}): restarted as {new}, {} in {took:.1?}",
            old.frontend,
            old.iothreads,
            if id == "hot" {
                "ready"
            } else {
                "QEMU reconnected"
            }
        );
        if id == "hot" {
            desc += &format!("; {}", self.hot_session(true, 0)?);
        }
        Ok(desc)
    }

    /// kill -9 of one iothread of any disk: its frontend replaces it and resubmits.
    fn kill_iothread(&mut self) -> Result<String, String> {
        let ids: Vec<String> = self.procs.keys().cloned().collect();
        let id = ids[self.rng.below(ids.len() as u64) as usize].clone();
        let p = self.procs[&id].clone();
        let victim = p.iothreads[self.rng.below(p.iothreads.len() as u64) as usize];
        if !kill_iothread(p.frontend, victim) {
            return Err(format!(
                "{victim} is not an iothread of {id}'s frontend {}",
                p.frontend
            ));
        }
        let took = self.settle(&[(&id, Expect::NewIothread(victim))]);
        self.count(format!("kill -9 iothread {id}"));
        Ok(format!(
            "kill -9 iothread {victim} of {id}: replaced by {:?} in {took:.1?}",
            self.procs[&id]
                .iothreads
                .iter()
                .filter(|x| !p.iothreads.contains(x))
                .collect::<Vec<_>>()
        ))
    }

    /// kill -9 of blkplaned, a pause with the disks on their own, a restart: every frontend
    /// must be adopted (same pids).
    fn kill_blkplaned(&mut self) -> Result<String, String> {
        let old = self.d.pid();
        self.d.kill9();
        let away = Duration::from_millis(self.rng.below(2000));
        self.pause(away);
        let t = Instant::now();
        cloexec_all();
        self.d.spawn();
        let took = self.settle(&[]);
        self.count("kill -9 blkplaned".into());
        Ok(format!(
            "kill -9 blkplaned {old}, away {away:.1?}: {} answering after {:.1?}, all {} \
             frontends adopted after {took:.1?}",
            self.d.pid(),
            t.elapsed() - took,
            self.procs.len()
        ))
    }

    /// Drain (with or without flush) of d0 under its client's I/O, a hold during which its
    /// frontend completes nothing, resume.
    fn drain_resume(&mut self) -> Result<String, String> {
        let flush = self.rng.below(2) == 0;
        let mut args = vec!["disk", "drain", "d0"];
        if flush {
            args.push("--flush");
        }
        let t = Instant::now();
        let out = ctl(&self.d, &args)?;
        let drain_time = t.elapsed();
        let state = ctl(&self.d, &["disk", "show", "d0"])?;
        if state.get("state").str() != "drained" || !state.get("drained").bool() {
            return Err(format!("d0 is not drained after Drain: {state:?}"));
        }
        let c0 = completed(&self.d, "d0")?;
        let hold = Duration::from_millis(500 + self.rng.below(1500));
        self.pause(hold);
        let c1 = completed(&self.d, "d0")?;
        ctl(&self.d, &["disk", "resume", "d0"])?;
        if c1 != c0 {
            return Err(format!(
                "d0's frontend completed {} requests while drained",
                c1 - c0
            ));
        }
        if flush && !out.get("flushed").bool() {
            return Err(format!("the drain with flush did not flush: {out:?}"));
        }
        let took = self.settle(&[]);
        self.count("drain+resume d0".into());
        Ok(format!(
            "drain{} d0: waited for {} requests in {drain_time:.1?}; held {hold:.1?}, nothing \
             completed; resumed, connected after {took:.1?}",
            if flush { " --flush" } else { "" },
            out.get("waited_requests").u64()
        ))
    }

    /// The next throttle setting of d1, checked through GetThrottle; the group's file exists
    /// exactly while d1 is in the group.
    fn throttle(&mut self) -> Result<String, String> {
        let step = THROTTLE_STEPS[self.throttle_step % THROTTLE_STEPS.len()];
        self.throttle_step += 1;
        let mut args = vec!["disk", "throttle", "d1"];
        args.extend_from_slice(step);
        ctl(&self.d, &args)?;
        let group = step
            .iter()
            .position(|a| *a == "--group")
            .map(|i| step[i + 1]);
        let shown = wait_for(SETTLE_TIMEOUT, || {
            ctl(&self.d, &["disk", "throttle", "d1"])
                .ok()
                .filter(|j| j.get("pending").arr().is_empty())
        })
        .ok_or("GetThrottle of d1 still lists pending deliveries")?;
        let limits = shown.get("limits");
        for pair in step.chunks(2).filter(|p| p.len() == 2 && p[0] != "--group") {
            let field = pair[0].trim_start_matches("--").replace('-', "_");
            let want: u64 = pair[1].parse().unwrap();
            if limits.get(&field).u64() != want {
                return Err(format!(
                    "{field}: GetThrottle says {:?}, set {want}",
                    limits.get(&field)
                ));
            }
        }
        if step == ["--clear"] {
            if let Json::Obj(m) = limits {
                if let Some((k, _)) = m.iter().find(|(_, v)| v.as_u64() != Some(0)) {
                    return Err(format!("{k} still set after --clear: {limits:?}"));
                }
            }
        }
        if shown.get("group").str() != group.unwrap_or("") {
            return Err(format!("group: {:?}, set {group:?}", shown.get("group")));
        }
        self.group_active = group.is_some();
        let took = self.settle(&[]);
        self.count("throttle d1".into());
        Ok(format!(
            "throttle d1 {}: in force{}, settled after {took:.1?}",
            step.join(" "),
            if self.group_active {
                ", group file present"
            } else {
                ""
            }
        ))
    }

    /// Grows g1 by 1–4 MiB while the guest's fio writes to it.
    fn resize(&mut self) -> Result<String, String> {
        let new = self.g1_capacity + (1 + self.rng.below(4)) * MIB;
        let out = ctl(&self.d, &["disk", "resize", "g1", &new.to_string()])?;
        if out.get("capacity_bytes").u64() != new {
            return Err(format!("resize to {new}: {out:?}"));
        }
        if !out.get("guest_notified").bool() {
            return Err(format!(
                "QEMU was not notified of the new capacity: {out:?}"
            ));
        }
        // g1 is qcow2: its virtual size, written by its iothread.
        let size = virtual_size(&self.g1_image);
        if size != Some(new) {
            return Err(format!(
                "g1's image has a virtual size of {size:?} after a resize to {new}"
            ));
        }
        let old = self.g1_capacity;
        self.g1_capacity = new;
        let took = self.settle(&[]);
        self.count("resize g1".into());
        Ok(format!(
            "resize g1 {old} -> {new}: image grown, QEMU notified; settled after {took:.1?}"
        ))
    }

    /// A live external snapshot of g1 while the guest's fio writes to it: a new overlay over
    /// its current image, the frontend restarted on it (QEMU reconnects), the chain one longer.
    fn snapshot(&mut self) -> Result<String, String> {
        self.snapshots += 1;
        let overlay = self
            .images
            .join(&format!("g1-snap{}.qcow2", self.snapshots));
        let out = ctl(
            &self.d,
            &["disk", "snapshot", "g1", overlay.to_str().unwrap()],
        )?;
        let previous = self.g1_image.to_str().unwrap().to_string();
        if out.get("config").get("image").str() != overlay.to_str().unwrap()
            || out.get("backing_chain").arr().first().map(|j| j.str()) != Some(previous.as_str())
        {
            return Err(format!("snapshot of g1 to {}: {out:?}", overlay.display()));
        }
        let took = self.settle(&[("g1", Expect::NewFrontend)]);
        self.g1_below
            .push(std::mem::replace(&mut self.g1_image, overlay));
        self.count("snapshot g1".into());
        Ok(format!(
            "snapshot g1 onto {}: frontend restarted on the overlay, QEMU reconnected; \
             chain of {} backing files; settled after {took:.1?}",
            self.g1_image.display(),
            out.get("backing_chain").arr().len()
        ))
    }

    /// A live commit of g1's image into the image below it while the guest's fio writes to it:
    /// the disk then serves that image (its chain one shorter); the committed image is left.
    fn commit(&mut self) -> Result<String, String> {
        let below = self.g1_below.last().cloned().ok_or("nothing to commit")?;
        let started = Instant::now();
        let out = ctl(&self.d, &["disk", "commit", "g1"])?;
        let took_commit = started.elapsed();
        if out.get("config").get("image").str() != below.to_str().unwrap() {
            return Err(format!(
                "commit of g1 ({}) into {}: {out:?}",
                self.g1_image.display(),
                below.display()
            ));
        }
        let took = self.settle(&[("g1", Expect::NewFrontend)]);
        let committed = std::mem::replace(&mut self.g1_image, below);
        self.g1_below.pop();
        self.commits += 1;
        self.count("commit g1".into());
        Ok(format!(
            "commit g1: {} merged into {} in {took_commit:.1?}, frontend restarted on it, QEMU \
             reconnected; chain of {} backing files; settled after {took:.1?}",
            committed.display(),
            self.g1_image.display(),
            out.get("backing_chain").arr().len()
        ))
    }

    /// The next step of the hot-plugged disk's life: added (with a session of verified I/O)
    /// when absent; else a session that re-verifies and writes more, or its removal.
    fn hot_plug(&mut self) -> Result<String, String> {
        if self.hot.is_none() {
            return self.hot_add();
        }
        if self.rng.below(2) == 0 {
            let s = self.hot_session(true, HOT_OPS)?;
            self.count("hot session".into());
            Ok(format!("hot session: {s}"))
        } else {
            self.hot_remove()
        }
    }

    fn hot_add(&mut self) -> Result<String, String> {
        self.hot_incarnations += 1;
        let n = self.hot_incarnations;
        let block_size = if n % 2 == 1 { 512 } else { 4096 };
        let image = create_image(&self.images.join(&format!("hot{n}.img")), HOT_SIZE);
        let j = add_disk(&self.d, &HOT, &image, block_size)?;
        if j.get("state").str() != "ready" {
            return Err(format!("hot added but not ready: {j:?}"));
        }
        let iothreads = reported_iothreads(&j);
        self.procs.insert(
            "hot".into(),
            Procs {
                frontend: j.get("frontend_pid").u64() as u32,
                iothreads,
            },
        );
        let blocks = (HOT_SIZE / BLOCK as u64) as usize / usize::from(HOT.queues);
        let seed = self.rng.next_u64();
        self.hot = Some(HotDisk {
            image,
            workers: (0..usize::from(HOT.queues))
                .map(|i| Worker::new(100 + n, (i * blocks) as u64, blocks, seed ^ i as u64))
                .collect(),
            block_size,
        });
        self.settle(&[]);
        let s = self.hot_session(false, HOT_OPS)?;
        self.count("hot add".into());
        Ok(format!(
            "hot add #{n} ({} MiB, {block_size}-byte blocks, frontend {}): {s}",
            HOT_SIZE / MIB,
            self.procs["hot"].frontend
        ))
    }

    fn hot_remove(&mut self) -> Result<String, String> {
        let s = self.hot_session(true, 0)?;
        let p = self.procs["hot"].clone();
        let t = Instant::now();
        ctl(&self.d, &["disk", "remove", "hot"])?;
        self.procs.remove("hot");
        let hot = self.hot.take().unwrap();
        let gone = wait_for(SETTLE_TIMEOUT, || {
            (!alive(p.frontend) && !p.iothreads.iter().any(|&i| alive(i))).then_some(())
        });
        if gone.is_none() {
            return Err(format!("hot's processes {p:?} outlived its removal"));
        }
        if self.d.state_ids().iter().any(|i| i == "hot") {
            return Err("hot is still in state.json".into());
        }
        let _ = std::fs::remove_file(&hot.image);
        let took = self.settle(&[]);
        self.count("hot remove".into());
        Ok(format!(
            "hot remove ({}-byte blocks): {s}; removed, processes gone after {:.1?}, settled \
             after {took:.1?}",
            hot.block_size,
            t.elapsed()
        ))
    }

    /// A libblkio session on the hot disk: with `verify_first` every block read back first,
    /// then `ops` requests of mixed verified I/O per queue, every block read back again,
    /// disconnect; waits until blkplaned sees the VMM gone.
    fn hot_session(&mut self, verify_first: bool, ops: u64) -> Result<String, String> {
        let socket = self.d.disks_dir().join("hot.sock");
        let stats = Arc::clone(&self.hot_stats);
        let before = (stats.ops(), stats.verified_blocks.load(Ordering::Relaxed));
        let hot = self.hot.as_mut().unwrap();
        let opts = ClientOptions {
            num_queues: i32::from(HOT.queues),
            buf_size: DEPTH * SLOT,
            ..Default::default()
        };
        let mut client =
            Client::connect_with(&socket, &opts).map_err(|e| format!("connecting to hot: {e}"))?;
        if client.capacity() != HOT_SIZE {
            return Err(format!("hot's capacity is {}", client.capacity()));
        }
        let st = &*stats;
        std::thread::scope(|s| {
            for (q, w) in client.queues_mut().iter_mut().zip(&mut hot.workers) {
                s.spawn(move || {
                    if verify_first && !w.verify_all(q, DEPTH, st) {
                        return;
                    }
                    if ops > 0 && w.run(q, DEPTH, st, ops, &|| false) {
                        w.verify_all(q, DEPTH, st);
                    }
                });
            }
        });
        drop(client);
        if stats.failures() > 0 {
            return Err(format!(
                "hot: {}; first: {:?}",
                stats.line(),
                stats.messages.lock().unwrap()
            ));
        }
        let left = wait_for(SETTLE_TIMEOUT, || {
            ctl(&self.d, &["disk", "show", "hot"])
                .ok()
                .filter(|j| !j.get("vmm_connected").bool())
        });
        if left.is_none() {
            return Err("blkplaned still sees a VMM on hot after the session".into());
        }
        Ok(format!(
            "{} requests, {} blocks verified",
            stats.ops() - before.0,
            stats.verified_blocks.load(Ordering::Relaxed) - before.1
        ))
    }

    /// The leak verdicts (docs/soak.md, "Leak checks"): within each process, every sample
    /// against its first; across the processes of a kind (replaced by faults), every sample
    /// after the warm-up against the warm-up's maximum. Returns (report lines, problems).
    fn leaks(&self, warmup: f64) -> (Vec<String>, Vec<String>) {
        let mut keys: Vec<&str> = self.samples.iter().map(|s| s.key.as_str()).collect();
        keys.sort();
        keys.dedup();
        let mut lines = Vec::new();
        let mut problems = Vec::new();
        for key in keys {
            let all: Vec<&Sample> = self.samples.iter().filter(|s| s.key == key).collect();
            let mut base: Vec<&Sample> = all.iter().copied().filter(|s| s.t < warmup).collect();
            if base.len() < 3 {
                base = all.iter().copied().take(3).collect();
            }
            let later: Vec<&Sample> = all
                .iter()
                .copied()
                .filter(|s| !base.iter().any(|b| std::ptr::eq(*b, *s)))
                .collect();
            let sockets = key.starts_with("unix");
            let slack = if key.starts_with("blkplaned") {
                FD_SLACK_BLKPLANED
            } else if key.starts_with("frontend") {
                FD_SLACK_FRONTEND
            } else if key.starts_with("iothread") || key.starts_with("spawner") {
                FD_SLACK_IOTHREAD
            } else {
                SOCKET_SLACK
            };
            // A frontend QEMU reconnected to holds more descriptors per queue than the one it
            // first connected to (see docs/soak.md); across replacements that is allowed.
            let cross_slack = match key.strip_prefix("frontend g") {
                Some(_) => {
                    let id = key["frontend ".len()..]
                        .split(' ')
                        .next()
                        .unwrap_or_default();
                    slack + RECONNECT_FDS_PER_QUEUE * usize::from(spec(id).queues)
                }
                None => slack,
            };
            let rss_slack = |base: u64| (base / 4).max(RSS_SLACK_MIN_KIB);
            let base_fds = base.iter().map(|s| s.fds).max().unwrap();
            let base_rss = base.iter().map(|s| s.rss_kib).max().unwrap();
            let last = all.last().unwrap();
            let max_fds = later.iter().map(|s| s.fds).max();
            let max_rss = later.iter().map(|s| s.rss_kib).max();
            // Within each process: growth over its first sample.
            let mut firsts: BTreeMap<u32, &Sample> = BTreeMap::new();
            // The last sample of each process over its bound (the largest growth shows).
            let mut over_fds: BTreeMap<u32, &Sample> = BTreeMap::new();
            let mut over_rss: BTreeMap<u32, &Sample> = BTreeMap::new();
            let (mut grow_fds, mut grow_rss) = (0i64, 0i64);
            for s in &all {
                let first = *firsts.entry(s.pid).or_insert(s);
                grow_fds = grow_fds.max(s.fds as i64 - first.fds as i64);
                grow_rss = grow_rss.max(s.rss_kib as i64 - first.rss_kib as i64);
                if !sockets && s.fds > first.fds + slack {
                    over_fds.insert(s.pid, s);
                }
                if !sockets && s.rss_kib > first.rss_kib + rss_slack(first.rss_kib) {
                    over_rss.insert(s.pid, s);
                }
            }
            for (pid, s) in over_fds {
                let first = firsts[&pid];
                problems.push(format!(
                    "{key} {pid}: {} fds at {:.0} s, {} at its first sample ({:.0} s), slack \
                     {slack}; more than then: {}",
                    s.fds,
                    s.t,
                    first.fds,
                    first.t,
                    fd_diff(&first.detail, &s.detail)
                ));
            }
            for (pid, s) in over_rss {
                let first = firsts[&pid];
                problems.push(format!(
                    "{key} {pid}: RssAnon {} KiB at {:.0} s, {} KiB at its first sample ({:.0} \
                     s) + {} KiB",
                    s.rss_kib,
                    s.t,
                    first.rss_kib,
                    first.t,
                    rss_slack(first.rss_kib)
                ));
            }
            let opt = |v: Option<usize>| v.map_or("-".into(), |v| v.to_string());
            let line = if sockets {
                format!(
                    "{key:<40} {} samples: warm-up max {base_fds}, later max {} (bound {}), \
                     last {}",
                    all.len(),
                    opt(max_fds),
                    base_fds + cross_slack,
                    last.fds
                )
            } else {
                format!(
                    "{key:<40} {} samples of {} processes: fds warm-up max {base_fds}, later \
                     max {} (bound {}), last {}, growth in a process {grow_fds:+}; RssAnon KiB \
                     warm-up max {base_rss}, later max {} (bound {}), last {}, growth in a \
                     process {grow_rss:+}",
                    all.len(),
                    firsts.len(),
                    opt(max_fds),
                    base_fds + cross_slack,
                    last.fds,
                    max_rss.map_or("-".into(), |v| v.to_string()),
                    base_rss + rss_slack(base_rss),
                    last.rss_kib
                )
            };
            lines.push(line);
            if std::env::var_os("BLKPLANE_SOAK_VERBOSE").is_some() {
                // Every distinct set of descriptors seen, with when and in which process.
                let mut seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
                for s in &all {
                    seen.entry(fd_summary(&s.detail))
                        .or_default()
                        .push(format!("{:.0}s/{}:{}", s.t, s.pid, s.fds));
                }
                for (detail, at) in seen.iter().filter(|(d, _)| !d.is_empty()) {
                    lines.push(format!("    {detail}: {}", at.join(" ")));
                }
            }
            if let Some(s) = later.iter().find(|s| s.fds > base_fds + cross_slack) {
                let at_max = base.iter().max_by_key(|b| b.fds).unwrap();
                problems.push(format!(
                    "{key}: {} fds at {:.0} s (pid {}), warm-up max {base_fds} + slack \
                     {cross_slack}; more than at the warm-up's maximum: {}",
                    s.fds,
                    s.t,
                    s.pid,
                    fd_diff(&at_max.detail, &s.detail)
                ));
            }
            if let Some(s) = later
                .iter()
                .find(|s| !sockets && s.rss_kib > base_rss + rss_slack(base_rss))
            {
                problems.push(format!(
                    "{key}: RssAnon {} KiB at {:.0} s (pid {}), warm-up max {base_rss} KiB + \
                     {} KiB",
                    s.rss_kib,
                    s.t,
                    s.pid,
                    rss_slack(base_rss)
                ));
            }
        }
        (lines, problems)
    }

    /// What was injected, what the clients did, and the resource figures.
    fn summary(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "injections ({} in {:.0?}, {} quiet points):",
            self.log.len(),
            self.t0.elapsed(),
            self.quiet_points
        );
        for (what, n) in &self.counts {
            let _ = writeln!(s, "  {what:<28} {n}");
        }
        let _ = writeln!(s, "clients:");
        for c in &self.clients {
            let _ = writeln!(s, "  libblkio {}: {}", c.id, c.stats.line());
        }
        let _ = writeln!(
            s,
            "  libblkio hot ({} incarnations): {}",
            self.hot_incarnations,
            self.hot_stats.line()
        );
        let _ = writeln!(
            s,
            "  guest (fio on g0 and g1): {} rounds, {} failed checks",
            self.guest.rounds,
            self.guest.report.checks.iter().filter(|c| !c.ok).count()
        );
        let _ = writeln!(s, "  g1 capacity {} bytes", self.g1_capacity);
        s
    }
}

/// The whole soak; see the top of the file.
#[test]
fn soak() {
    let secs: u64 = std::env::var("BLKPLANE_SOAK_SECS")
        .ok()
        .map(|v| v.parse().expect("BLKPLANE_SOAK_SECS: a number of seconds"))
        .unwrap_or(DEFAULT_SECS);
    let seed: u64 = std::env::var("BLKPLANE_SOAK_SEED")
        .ok()
        .map(|v| v.parse().expect("BLKPLANE_SOAK_SEED: a number"))
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    progress(&format!(
        "{secs} s of faults, seed {seed} (BLKPLANE_SOAK_SECS, BLKPLANE_SOAK_SEED)"
    ));
    let t_start = Instant::now();
    become_subreaper();
    cloexec_all();
    let (qemu_bin, qemu_version) = qemu_binary();
    progress(&qemu_version);
    let scratch = TempDir::new("soak");
    let guest_image = build_guest(scratch.path());
    progress(&guest_image.info);
    binaries();

    let d = Daemon::start("soak", &["--restart-max", "1000"]);
    let images = TempDir::new("soakimg");
    let mut image_of = BTreeMap::new();
    for s in &SPECS {
        let size = if s.role == Role::Guest {
            GUEST_SIZE
        } else {
            LB_SIZE
        };
        let img = if s.id == "g1" {
            // A qcow2 overlay (named relatively) of a raw base, owned alike.
            let base = create_image(&images.join("g1-base.img"), size);
            if s.own_user && can_run_as() {
                let (uid, gid) = DISK_USER.split_once(':').unwrap();
                std::os::unix::fs::chown(&base, uid.parse().ok(), gid.parse().ok()).unwrap();
            }
            create_overlay(&images.join("g1.qcow2"), "g1-base.img", "raw", "")
        } else {
            create_image(&images.join(&format!("{}.img", s.id)), size)
        };
        add_disk(&d, s, &img, s.block_size).unwrap_or_else(|e| panic!("{e}"));
        image_of.insert(s.id, img);
    }
    let socket = |id: &str| d.disks_dir().join(format!("{id}.sock"));

    // The libblkio clients.
    let clients: Vec<LbClient> = SPECS
        .iter()
        .filter(|s| s.role == Role::Libblkio)
        .enumerate()
        .map(|(i, s)| LbClient::start(s.id, socket(s.id), i as u32 + 1, s.queues, seed ^ i as u64))
        .collect();

    cloexec_all();

    // The guest.
    let console = scratch.join("console.log");
    let results = scratch.join("results.log");
    let qemu_log = scratch.join("qemu.log");
    let nonce = format!("{:x}", seed & 0xffff_ffff_ffff);
    let append = format!(
        "console=ttyS0 panic=-1 bp.mode=soak bp.nonce={nonce} bp.size={GUEST_SIZE} \
         bp.serial=SOAK-G0 bp.queues=2 bp.lbs=512 bp.serial2=SOAK-G1"
    );
    let mut cmd = qemu_command(&qemu_bin, &guest_image, &append, &console, &results);
    for s in SPECS.iter().filter(|s| s.role == Role::Guest) {
        cmd.arg("-chardev")
            .arg(format!(
                "socket,id={},path={},reconnect-ms={RECONNECT_MS}",
                s.id,
                socket(s.id).display()
            ))
            .arg("-device")
            .arg(format!(
                "vhost-user-blk-pci,chardev={},num-queues={}",
                s.id, s.queues
            ));
    }
    let out = File::create(&qemu_log).unwrap();
    cmd.stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out);
    let boot = Instant::now();
    let guest = Guest {
        qemu: Qemu::spawn(cmd),
        results,
        console,
        qemu_log,
        shown: 0,
        rounds: 0,
        last_round: Instant::now(),
        started: false,
        report: Report::default(),
        t0: boot,
    };

    let n_clients = clients.len();
    let mut soak = Soak {
        d,
        images,
        rng: Rng::new(seed),
        t0: Instant::now(),
        procs: BTreeMap::new(),
        counts: BTreeMap::new(),
        current: "",
        log: Vec::new(),
        samples: Vec::new(),
        quiet_points: 0,
        reaped: 0,
        clients,
        progress: vec![(0, Instant::now()); n_clients],
        guest,
        hot: None,
        hot_stats: Arc::new(ClientStats::default()),
        hot_incarnations: 0,
        throttle_step: 0,
        group_active: false,
        g1_capacity: GUEST_SIZE,
        g1_image: image_of["g1"].clone(),
        snapshots: 0,
        g1_below: Vec::new(),
        commits: 0,
        g0_image: image_of["g0"].clone(),
        nonce,
    };

    // Wait for the guest's fio to write on both disks, then take the processes as they are.
    while !soak.guest.started {
        if boot.elapsed() > BOOT_TIMEOUT {
            soak.fail(&format!(
                "the guest did not start its soak within {BOOT_TIMEOUT:?}"
            ));
        }
        soak.pause(Duration::from_millis(500));
    }
    progress(&format!(
        "guest booted and writing after {:.1?}; faults start",
        boot.elapsed()
    ));
    let list = ctl(&soak.d, &["disk", "list"]).unwrap_or_else(|e| panic!("{e}"));
    for j in list.arr() {
        let iothreads = reported_iothreads(j);
        soak.procs.insert(
            j.get("id").str().to_string(),
            Procs {
                frontend: j.get("frontend_pid").u64() as u32,
                iothreads,
            },
        );
    }
    soak.settle(&[]);
    soak.t0 = Instant::now();

    // The fault loop.
    let deadline = soak.t0 + Duration::from_secs(secs);
    while Instant::now() < deadline {
        let pause = Duration::from_millis(PAUSE_MS.0 + soak.rng.below(PAUSE_MS.1 - PAUSE_MS.0));
        soak.pause(pause);
        soak.quiet_point();
        let desc = soak.inject();
        let line = format!("[{:>6.1}s] {desc}", soak.t0.elapsed().as_secs_f64());
        progress(&line);
        soak.log.push(line);
    }
    let fault_time = soak.t0.elapsed();

    // Wind down: the hot disk removed, d1 unthrottled, a last quiet point.
    if soak.hot.is_some() {
        let desc = soak.hot_remove().unwrap_or_else(|e| soak.fail(&e));
        progress(&format!("[end] {desc}"));
    }
    if soak.group_active || !soak.throttle_step.is_multiple_of(THROTTLE_STEPS.len()) {
        ctl(&soak.d, &["disk", "throttle", "d1", "--clear"]).unwrap_or_else(|e| soak.fail(&e));
        soak.group_active = false;
    }
    soak.pause(Duration::from_secs(2));
    soak.quiet_point();

    // The guest: stop marker (with g1's capacity), its last round, its verdicts.
    {
        use std::os::unix::fs::FileExt;
        let marker = format!("BLKPLANE-STOP {} {}\n", soak.nonce, soak.g1_capacity);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&soak.g0_image)
            .unwrap();
        f.write_all_at(marker.as_bytes(), STOP_OFFSET).unwrap();
        f.sync_data().unwrap();
    }
    let stop_at = Instant::now();
    while soak.guest.report.done.is_none() {
        if stop_at.elapsed() > DONE_TIMEOUT {
            soak.fail(&format!(
                "the guest did not finish within {DONE_TIMEOUT:?} of the stop marker"
            ));
        }
        std::thread::sleep(Duration::from_millis(250));
        soak.health(true);
    }
    let expected_checks = [
        "disks",
        "capacity",
        "serial",
        "queues",
        "ro-flag",
        "soak-disks",
        "soak-io",
        "soak-kernel-errors",
        "soak-resize",
    ];
    let mut problems: Vec<String> = Vec::new();
    for name in expected_checks {
        let n = soak
            .guest
            .report
            .checks
            .iter()
            .filter(|c| c.name == name && c.ok)
            .count();
        if n != 1 {
            problems.push(format!("guest check {name}: {n} ok reports, want 1"));
        }
    }
    if let Some(c) = soak.guest.report.checks.iter().find(|c| !c.ok) {
        problems.push(format!("guest check failed: {} {}", c.name, c.detail));
    }
    let done = soak.guest.report.done.clone().unwrap_or_default();
    if !done.starts_with("failed=0") {
        problems.push(format!("guest: BLKPLANE-DONE {done}"));
    }
    let qemu_status = wait_for(Duration::from_secs(60), || soak.guest.qemu.exited());
    if !qemu_status.is_some_and(|s| s.success()) {
        problems.push(format!("QEMU did not power off cleanly: {qemu_status:?}"));
    }

    // The libblkio clients: stop, final read-back of every block.
    for c in &mut soak.clients {
        c.finish();
    }
    for c in &soak.clients {
        if c.stats.failures() > 0 || c.stats.ops() == 0 {
            problems.push(format!(
                "libblkio {}: {}; first: {:?}",
                c.id,
                c.stats.line(),
                c.stats.messages.lock().unwrap()
            ));
        }
    }
    if soak.hot_stats.failures() > 0 {
        problems.push(format!("libblkio hot: {}", soak.hot_stats.line()));
    }
    // The device side: no request failed or was refused.
    let stats = ctl(&soak.d, &["stats"]).unwrap_or_else(|e| soak.fail(&e));
    let mut device = Vec::new();
    for s in stats.arr() {
        let t = s.get("total");
        let (errors, rejected) = (t.get("errors").u64(), t.get("rejected").u64());
        device.push(format!(
            "{} errors {errors} rejected {rejected}",
            s.get("id").str()
        ));
        if errors + rejected > 0 {
            problems.push(format!(
                "{}'s frontend counted {errors} errors, {rejected} rejected requests",
                s.get("id").str()
            ));
        }
    }
    // Nothing crashed by itself (a killed process's exit is by signal 9).
    for e in std::fs::read_dir(soak.d.disks_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        if e.path().extension().is_none_or(|x| x != "log") {
            continue;
        }
        for line in read_lossy(&e.path()).lines() {
            if line.contains("panicked at") || line.contains("SIGSYS") {
                problems.push(format!("{}: {line}", e.path().display()));
            }
        }
    }
    let daemon_log = soak.d.log_text();
    for line in daemon_log.lines() {
        if line.contains("panicked at")
            || (line.contains("killed by signal")
                && !line.contains("killed by signal 9 ")
                && !line.contains("killed by signal 15 "))
        {
            problems.push(format!("blkplaned log: {line}"));
        }
    }

    // g1's qcow2 chain after every fault: leaked clusters at most (a killed process's), no
    // corruption.
    let g1_check = std::panic::catch_unwind(|| assert_check_clean(&soak.g1_image, true));
    match &g1_check {
        Ok(report) => progress(&format!(
            "qemu-img check of g1's image {} after {} snapshots and {} commits: {}",
            soak.g1_image.display(),
            soak.snapshots,
            soak.commits,
            report.trim().replace('\n', "; ")
        )),
        Err(_) => problems.push(format!(
            "qemu-img check of {} failed",
            soak.g1_image.display()
        )),
    }

    // Leaks.
    let warmup = (secs as f64 / 5.0).clamp(20.0, 60.0);
    let (resource_lines, leak_problems) = soak.leaks(warmup);
    problems.extend(leak_problems);
    let (_, zombies) = descendants("blkplane-fronte");
    let (_, iothread_zombies) = descendants("blkplane-iothre");

    let mut summary = format!(
        "soak summary: {fault_time:.0?} of faults (seed {seed}), {:.0?} in all\n",
        t_start.elapsed()
    );
    summary += &soak.summary();
    let _ = writeln!(summary, "  device statistics: {}", device.join("; "));
    let _ = writeln!(
        summary,
        "processes and files: at all {} quiet points exactly one frontend per disk, its \
         configured iothreads, no stray process, 4 runtime files per disk and the group file \
         only while d1 was in the group; {} exited frontends/iothreads reaped by the test, {} \
         zombies left",
        soak.quiet_points,
        soak.reaped,
        zombies + iothread_zombies
    );
    let _ = writeln!(
        summary,
        "resources (warm-up: the first {warmup:.0} s; fd slack: blkplaned {FD_SLACK_BLKPLANED}, \
         frontend {FD_SLACK_FRONTEND}, iothread {FD_SLACK_IOTHREAD}, sockets {SOCKET_SLACK}; \
         across guest-disk frontends +{RECONNECT_FDS_PER_QUEUE} per queue; RssAnon slack \
         max(25 %, {} MiB)):",
        RSS_SLACK_MIN_KIB / 1024
    );
    for l in &resource_lines {
        let _ = writeln!(summary, "  {l}");
    }
    progress(summary.trim_end());
    if !problems.is_empty() {
        soak.fail(&format!("\n  {}", problems.join("\n  ")));
    }
    soak.keep_logs();
    progress(&format!("passed in {:.0?}", t_start.elapsed()));
}
