//! `blkplane-bench`: runs the same fio-style workloads against blkplane, qemu-storage-daemon
//! and cloud-hypervisor's vhost_user_block (and against the image with plain io_uring, the
//! ceiling), alternating them, and writes BENCHMARKS.md and docs/bench.svg.
//!
//! Every run starts a fresh back-end, connects libblkio's `virtio-blk-vhost-user` driver (or,
//! for the ceiling, its `io_uring` driver on the image file), keeps the queues full for a ramp,
//! then measures: requests completed, per-request latency (submission to completion), and the
//! CPU time the back-end's processes and the client spent. See `--help` for the knobs; a smoke
//! run takes seconds: `blkplane-bench --runtime 1 --ramp 0.5 --reps 1 --out-dir /tmp/b`.

mod client;
mod error;
mod hist;
mod procfs;
mod report;
mod svg;
mod target;
mod wakeup;
mod workload;

use std::ffi::CString;
use std::fmt::Write as _;
use std::fs::File;
use std::io::Write as _;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::OnceLock;
use std::time::Duration;

use clap::Parser;

use crate::client::{Connection, Timing};
use crate::error::BenchError;
use crate::report::{Results, RunStats, NOTES_BEGIN, NOTES_END};
use crate::target::{Backend, BackendConfig, CpuList};
use crate::workload::{select, ImageKind, Target, Workload, WORKLOADS};

/// A 1-minute load average above this before or after the run means something else was
/// running on the machine; the report says so.
const BUSY_LOAD: f64 = 0.5;

/// Benchmark blkplane against qemu-storage-daemon, cloud-hypervisor's vhost_user_block and the
/// io_uring ceiling.
///
/// Runs every selected workload on every selected target and image, REPS times, alternating
/// the targets; prints the results and writes BENCHMARKS.md and docs/bench.svg under
/// --out-dir. Needs blkplane-frontend and blkplane-iothread (release build; found next to this
/// binary or in --bin-dir), qemu-storage-daemon, and for the ch target a vhost_user_block
/// binary (--ch-binary).
#[derive(Debug, Parser)]
#[command(version = blkplane_build_info::VERSION, about, long_about)]
struct Args {
    /// Measured seconds per run.
    #[arg(long, default_value_t = 10.0, value_parser = parse_seconds)]
    runtime: f64,
    /// Seconds each run runs before it is measured.
    #[arg(long, default_value_t = 2.0, value_parser = parse_seconds)]
    ramp: f64,
    /// Repetitions of every (workload, target, image); the report gives median and min–max.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    reps: u32,
    /// Comma-separated workloads, or "all": randread-4k-qd1, randwrite-4k-qd1, randread-4k-qd4,
    /// randread-4k-qd32, randread-4k-qd32-2q, randwrite-4k-qd32, read-128k-qd8, write-128k-qd8.
    #[arg(long, default_value = "all")]
    workloads: String,
    /// Comma-separated targets, or "all": blkplane, qsd, ch (needs --ch-binary), ceiling.
    #[arg(long, default_value = "all")]
    targets: String,
    /// Comma-separated images, or "all": shm (a raw file in --shm-dir), null, disk (a raw file
    /// in --disk-dir, opened with O_DIRECT), qcow2 and qcow2-fresh (in --shm-dir), qcow2-disk
    /// and qcow2-disk-fresh (in --disk-dir, opened with O_DIRECT), qcow2-overlay (a qcow2
    /// overlay on the disk image).
    #[arg(long, default_value = "all")]
    images: String,
    /// Disk size (of the shm and disk image files and of the null images), bytes or with a
    /// K/M/G suffix.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    size: u64,
    /// Where the raw image is created (tmpfs, so that the disk is not what is measured).
    #[arg(long, default_value = "/dev/shm")]
    shm_dir: PathBuf,
    /// Where the disk image is created: a directory on a real device (refused if it is tmpfs
    /// or ramfs). Every target opens it with O_DIRECT, so that the page cache is bypassed.
    #[arg(long, default_value = "/var/tmp")]
    disk_dir: PathBuf,
    /// O_DIRECT on the shm image for every target: auto (if the file system takes it), on, off
    /// (blkplane --cache direct or writeback, qsd cache.direct, the ceiling's direct).
    #[arg(long, value_enum, default_value_t = Direct::Auto)]
    direct: Direct,
    /// Directory of blkplane-frontend and blkplane-iothread (default: next to this binary).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// The qemu-storage-daemon binary.
    #[arg(long, default_value = "qemu-storage-daemon")]
    qsd: PathBuf,
    /// cloud-hypervisor's vhost_user_block binary, for the ch target (no default: build it
    /// from cloud-hypervisor's source, e.g. with build-ch-block.sh from the shared tools).
    #[arg(long)]
    ch_binary: Option<PathBuf>,
    /// Pin the client to these CPUs (a taskset -c list, e.g. 0); default: not pinned.
    #[arg(long, value_parser = CpuList::parse)]
    client_cpu: Option<CpuList>,
    /// Pin the back-end to these CPUs (a taskset -c list, e.g. 1); default: not pinned.
    #[arg(long, value_parser = CpuList::parse)]
    backend_cpu: Option<CpuList>,
    /// Where BENCHMARKS.md and docs/bench.svg are written (default: the workspace root).
    #[arg(long)]
    out_dir: Option<PathBuf>,
    /// Print the results only; write no files.
    #[arg(long)]
    no_report: bool,
    /// Seed of the random offsets and data.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// Whether the shm image is opened with O_DIRECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Direct {
    /// If the file system accepts it (tmpfs does since Linux 6.6).
    Auto,
    /// Always (fails where the file system refuses).
    On,
    /// Never: buffered I/O.
    Off,
}

fn parse_seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if s.is_finite() && (0.0..=3600.0).contains(&s) => Ok(s),
        _ => Err(format!("{text:?} is not a number of seconds in 0..=3600")),
    }
}

fn parse_size(text: &str) -> Result<u64, String> {
    let (digits, shift) = match text.as_bytes().last() {
        Some(b'k' | b'K') => (&text[..text.len() - 1], 10),
        Some(b'm' | b'M') => (&text[..text.len() - 1], 20),
        Some(b'g' | b'G') => (&text[..text.len() - 1], 30),
        _ => (text, 0),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .filter(|&n| n >= 1 << 20 && n % 4096 == 0)
        .ok_or_else(|| format!("{text:?}: a size of at least 1M, a multiple of 4K"))
}

/// The workspace this binary was built from: where BENCHMARKS.md lives.
fn workspace_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The image paths (shm, disk), for the signal handler to remove them.
static IMAGES_TO_REMOVE: [OnceLock<CString>; 2] = [OnceLock::new(), OnceLock::new()];

extern "C" fn on_signal(signal: libc::c_int) {
    for path in IMAGES_TO_REMOVE.iter().filter_map(OnceLock::get) {
        // SAFETY: unlink and _exit are async-signal-safe; the CString lives forever.
        unsafe { libc::unlink(path.as_ptr()) };
    }
    // The back-ends get SIGTERM from PR_SET_PDEATHSIG when this process dies.
    // SAFETY: as above.
    unsafe { libc::_exit(128 + signal) };
}

/// A raw image file filled with pseudo-random data (a sparse tmpfs file would be read from
/// the shared zero page, cheaper than real data; a sparse file on a disk would not touch the
/// device on reads), removed on drop.
struct ImageFile {
    path: PathBuf,
}

impl ImageFile {
    /// Creates `blkplane-bench-PID[-disk].img` in `dir`. `on_device`: the file is on a real
    /// disk, so it is synced and dropped from the page cache afterwards (the targets open it
    /// with O_DIRECT and must find nothing cached, nor should it crowd the cache).
    fn create(dir: &Path, size: u64, seed: u64, on_device: bool) -> Result<Self, BenchError> {
        let suffix = if on_device { "-disk" } else { "" };
        let path = dir.join(format!("blkplane-bench-{}{suffix}.img", std::process::id()));
        let mut file = File::options()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(BenchError::io(format!("creating {}", path.display())))?;
        let image = Self { path };
        if let Ok(c_path) = CString::new(image.path.as_os_str().as_bytes()) {
            let _ = IMAGES_TO_REMOVE[usize::from(on_device)].set(c_path);
        }
        let mut state = seed | 1;
        let mut chunk = vec![0u8; 1 << 20];
        let mut left = size;
        while left > 0 {
            for word in chunk.chunks_exact_mut(8) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                word.copy_from_slice(&state.to_le_bytes());
            }
            let n = left.min(chunk.len() as u64) as usize;
            file.write_all(&chunk[..n])
                .map_err(BenchError::io(format!("filling {}", image.path.display())))?;
            left -= n as u64;
        }
        if on_device {
            file.sync_all()
                .map_err(BenchError::io(format!("syncing {}", image.path.display())))?;
            // SAFETY: plain posix_fadvise on a descriptor we own; the whole file.
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
        Ok(image)
    }

    /// Whether the file system takes O_DIRECT (tmpfs does since Linux 6.6).
    fn supports_direct(&self) -> bool {
        File::options()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&self.path)
            .is_ok()
    }
}

impl Drop for ImageFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A qcow2 image made by `qemu-img` (64 KiB clusters), removed on drop.
struct Qcow2File {
    path: PathBuf,
}

impl Qcow2File {
    /// `blkplane-bench-PID-NAME.qcow2` in `dir`, not made yet.
    fn at(dir: &Path, name: &str) -> Self {
        Self {
            path: dir.join(format!(
                "blkplane-bench-{}-{name}.qcow2",
                std::process::id()
            )),
        }
    }

    /// (Re)creates the image with 64 KiB clusters, every one allocated (`preallocation=falloc`:
    /// the metadata maps all of them, the data is allocated in the file).
    fn create_allocated(&self, size: u64) -> Result<(), BenchError> {
        make_qcow2(&self.path, size, 65536, "falloc")
    }

    /// Creates the image with 64 KiB clusters from `size` bytes of pseudo-random raw data made
    /// in `dir` (every cluster allocated and written, so reads meet the device), then syncs it
    /// and drops it from the page cache, as the raw disk image is.
    fn create_converted(&self, dir: &Path, size: u64, seed: u64) -> Result<(), BenchError> {
        let raw = ImageFile::create(dir, size, seed, false)?;
        let (from, to) = (raw.path.to_string_lossy(), self.path.to_string_lossy());
        first_line(
            Path::new("qemu-img"),
            &[
                "convert",
                "-q",
                "-f",
                "raw",
                "-O",
                "qcow2",
                "-o",
                "cluster_size=65536",
                &from,
                &to,
            ],
            None,
        )
        .map_err(|e| BenchError::Missing(format!("qemu-img convert {from} {to}: {e}")))?;
        drop(raw);
        let file = File::open(&self.path)
            .map_err(BenchError::io(format!("opening {}", self.path.display())))?;
        file.sync_all()
            .map_err(BenchError::io(format!("syncing {}", self.path.display())))?;
        // SAFETY: plain posix_fadvise on a descriptor we own; the whole file.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        Ok(())
    }
}

/// (Re)creates the qcow2 image at `path` with `cluster_size` and `preallocation`.
fn make_qcow2(
    path: &Path,
    size: u64,
    cluster_size: u32,
    preallocation: &str,
) -> Result<(), BenchError> {
    let options = format!("cluster_size={cluster_size},preallocation={preallocation}");
    qemu_img_create(path, &options, &[&size.to_string()])
}

/// (Re)creates the qcow2 image at `path` with `qemu-img create -o OPTIONS PATH EXTRA...`.
fn qemu_img_create(path: &Path, options: &str, extra: &[&str]) -> Result<(), BenchError> {
    let _ = std::fs::remove_file(path);
    let path = path.to_string_lossy().into_owned();
    let mut args = vec!["create", "-q", "-f", "qcow2", "-o", options];
    // The options that name a backing file go before the path, its size after.
    let (before, after): (Vec<&str>, Vec<&str>) = extra.iter().partition(|a| a.starts_with('-'));
    args.extend(before);
    args.push(&path);
    args.extend(after);
    first_line(Path::new("qemu-img"), &args, None)
        .map(|_| ())
        .map_err(|e| BenchError::Missing(format!("qemu-img create {path}: {e}")))
}

/// (Re)creates the qcow2 overlay at `path` (64 KiB clusters) on the raw image `base`, and drops
/// the base from the page cache.
fn make_overlay(path: &Path, base: &Path) -> Result<(), BenchError> {
    let backing = format!("-b{}", base.display());
    qemu_img_create(path, "cluster_size=65536", &[&backing, "-Fraw"])?;
    let file = File::open(base).map_err(BenchError::io(format!("opening {}", base.display())))?;
    // SAFETY: plain posix_fadvise on a descriptor we own; the whole file.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    Ok(())
}

impl Drop for Qcow2File {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Refuses a --disk-dir whose files would live in memory: the disk image must be on a device.
fn check_disk_dir(dir: &Path) -> Result<(), BenchError> {
    let fs = procfs::fs_type(dir).map_err(BenchError::io(format!(
        "statfs of --disk-dir {}",
        dir.display()
    )))?;
    if fs.in_memory() {
        return Err(BenchError::Missing(format!(
            "--disk-dir {} is on tmpfs or ramfs (statfs f_type {:#x}); the disk image must be \
             on a real device: pass a directory on one (e.g. /var/tmp) or leave disk out of \
             --images",
            dir.display(),
            fs.0
        )));
    }
    Ok(())
}

/// The error for the ch target without a binary.
fn ch_binary_missing() -> BenchError {
    BenchError::Missing(
        "the ch target needs --ch-binary PATH: cloud-hypervisor's vhost_user_block, built \
         from its source, e.g. `/work/shared/tools/build-ch-block.sh CH_GIT MICRO_HTTP_GIT \
         /work/ch-build` (it prints the binary's path); or leave ch out of --targets"
            .into(),
    )
}

/// A private directory for sockets and logs (short, as socket paths must be), removed on drop.
struct WorkDir(PathBuf);

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The first line a command prints, or why it could not run.
fn first_line(program: &Path, args: &[&str], dir: Option<&Path>) -> Result<String, String> {
    let mut command = Command::new(program);
    command.args(args);
    if let Some(dir) = dir {
        command.current_dir(dir);
    }
    let out = command
        .output()
        .map_err(|e| format!("{}: {e}", program.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} {args:?}: {}",
            program.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned())
}

/// The git revision of the workspace, marked when the tree differs from it.
fn git_revision() -> String {
    let dir = workspace_dir();
    let git = Path::new("git");
    let Ok(rev) = first_line(git, &["rev-parse", "--short", "HEAD"], Some(&dir)) else {
        return "unknown (not built from a git checkout)".into();
    };
    let changed = Command::new(git)
        .args(["status", "--porcelain", "--untracked-files=no"])
        .current_dir(&dir)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().count())
        .unwrap_or(0);
    if changed > 0 {
        format!("{rev} with uncommitted changes in {changed} tracked files")
    } else {
        rev
    }
}

/// Facts printed in the report.
struct Context {
    args: Vec<String>,
    qsd_version: String,
    ch_version: String,
    disk_fs: String,
    blkplane_rev: String,
    bin_dir: PathBuf,
    load_before: String,
    load_after: String,
    busy: bool,
    client_cpu: Option<CpuList>,
    backend_cpu: Option<CpuList>,
    direct: bool,
    size: u64,
    shm_dir: PathBuf,
    disk_dir: PathBuf,
    timing: Timing,
    reps: u32,
    workloads: Vec<Workload>,
    images: Vec<ImageKind>,
    backend_lines: Vec<String>,
    skipped: Vec<String>,
    date: String,
    hops_before: String,
    hops_after: String,
}

/// Round trips of the wake-up measurement.
const HOP_ROUND_TRIPS: u32 = 10_000;

/// The cost of an eventfd wake-up across two CPUs and on one, for the report.
fn hop_costs() -> String {
    let describe = |first, second| match wakeup::measure(first, second, HOP_ROUND_TRIPS) {
        Ok(cost) => format!(
            "{} µs latency, {} µs CPU",
            report::num(cost.latency_us),
            report::num(cost.cpu_us)
        ),
        Err(e) => format!("not measured ({e})"),
    };
    let same = describe(0, 0);
    if procfs::online_cpus() >= 2 {
        format!("across vCPUs 0→1: {}; on one vCPU: {same}", describe(0, 1))
    } else {
        format!("on one vCPU: {same}")
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("blkplane-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), BenchError> {
    let all = |list: &str| {
        if list == "all" {
            None
        } else {
            Some(list.to_owned())
        }
    };
    let bad = |e: String| BenchError::Missing(e);
    let workloads = match all(&args.workloads) {
        Some(list) => select(&list, &WORKLOADS, |w| w.name).map_err(bad)?,
        None => WORKLOADS.to_vec(),
    };
    let targets = match all(&args.targets) {
        Some(list) => select(&list, &Target::ALL, |t| t.name()).map_err(bad)?,
        None => Target::ALL.to_vec(),
    };
    let images = match all(&args.images) {
        Some(list) => select(&list, &ImageKind::ALL, |i| i.name()).map_err(bad)?,
        None => ImageKind::ALL.to_vec(),
    };
    let timing = Timing {
        ramp: Duration::from_secs_f64(args.ramp),
        runtime: Duration::from_secs_f64(args.runtime),
    };
    if timing.runtime.is_zero() {
        return Err(BenchError::Missing("--runtime must be more than 0".into()));
    }

    let bin_dir = match &args.bin_dir {
        Some(dir) => dir.clone(),
        None => std::env::current_exe()
            .map_err(BenchError::io("finding this executable"))?
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default(),
    };
    if targets.contains(&Target::Blkplane) {
        for bin in ["blkplane-frontend", "blkplane-iothread"] {
            if !bin_dir.join(bin).is_file() {
                return Err(BenchError::Missing(format!(
                    "{} not found; build it with `cargo build --release -p blkplane-frontend \
                     -p blkplane-iothread` or pass --bin-dir",
                    bin_dir.join(bin).display()
                )));
            }
        }
    }
    let qsd_version = if targets.contains(&Target::Qsd) {
        first_line(&args.qsd, &["--version"], None).map_err(BenchError::Missing)?
    } else {
        "not run".into()
    };
    let ch_version = if targets.contains(&Target::Ch) {
        let Some(ch) = &args.ch_binary else {
            return Err(ch_binary_missing());
        };
        let version = first_line(ch, &["--version"], None).map_err(BenchError::Missing)?;
        // Built in a cloud-hypervisor checkout (target/release/): name its commit.
        let commit = ch
            .parent()
            .and_then(|dir| {
                first_line(
                    Path::new("git"),
                    &["log", "-1", "--format=%h %cs"],
                    Some(dir),
                )
                .ok()
            })
            .filter(|c| !c.is_empty())
            .map_or_else(String::new, |c| format!(", cloud-hypervisor git {c}"));
        format!("{version}{commit} (`{}`)", ch.display())
    } else {
        "not run".into()
    };
    if images.iter().any(|kind| kind.on_disk()) {
        check_disk_dir(&args.disk_dir)?;
    }

    // SAFETY: installing a handler that only calls async-signal-safe functions.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    if let Some(cpus) = &args.client_cpu {
        // Before any client thread exists: they inherit it. Back-ends get their own set.
        cpus.pin_current_thread().map_err(BenchError::io(format!(
            "pinning the client to {}",
            cpus.text()
        )))?;
    }

    let work_dir = WorkDir(std::env::temp_dir().join(format!("bpb-{}", std::process::id())));
    std::fs::create_dir_all(&work_dir.0)
        .map_err(BenchError::io(format!("creating {}", work_dir.0.display())))?;
    let shm_image = if images.contains(&ImageKind::Shm) {
        eprintln!(
            "creating a {} MiB image in {}",
            args.size >> 20,
            args.shm_dir.display()
        );
        Some(ImageFile::create(
            &args.shm_dir,
            args.size,
            args.seed,
            false,
        )?)
    } else {
        None
    };
    let disk_image =
        if images.contains(&ImageKind::Disk) || images.contains(&ImageKind::Qcow2Overlay) {
            eprintln!(
                "creating a {} MiB image in {} (on the disk)",
                args.size >> 20,
                args.disk_dir.display()
            );
            let image = ImageFile::create(&args.disk_dir, args.size, args.seed, true)?;
            if !image.supports_direct() {
                return Err(BenchError::Missing(format!(
                    "{} cannot be opened with O_DIRECT; pass a --disk-dir on a file system that \
                 takes it",
                    image.path.display()
                )));
            }
            Some(image)
        } else {
            None
        };
    let qcow2_image = Qcow2File::at(&args.shm_dir, "allocated");
    if images.contains(&ImageKind::Qcow2) {
        eprintln!(
            "creating a {} MiB qcow2 image, every cluster allocated, in {}",
            args.size >> 20,
            args.shm_dir.display()
        );
        qcow2_image.create_allocated(args.size)?;
    }
    let qcow2_fresh_image = Qcow2File::at(&args.shm_dir, "fresh");
    let qcow2_disk_image = Qcow2File::at(&args.disk_dir, "allocated");
    if images.contains(&ImageKind::Qcow2Disk) {
        eprintln!(
            "creating a {} MiB qcow2 image of pseudo-random data in {} (on the disk)",
            args.size >> 20,
            args.disk_dir.display()
        );
        qcow2_disk_image.create_converted(&args.disk_dir, args.size, args.seed)?;
    }
    let qcow2_disk_fresh_image = Qcow2File::at(&args.disk_dir, "fresh");
    let qcow2_overlay_image = Qcow2File::at(&args.disk_dir, "overlay");
    let disk_fs = if images.iter().any(|kind| kind.on_disk()) {
        disk_fs_description(&args.disk_dir)
    } else {
        "not run".into()
    };
    let direct = match args.direct {
        Direct::Auto => shm_image.as_ref().is_some_and(ImageFile::supports_direct),
        Direct::On => true,
        Direct::Off => false,
    };
    let config = BackendConfig {
        bin_dir: bin_dir.clone(),
        qsd: args.qsd.clone(),
        ch: args.ch_binary.clone(),
        shm_image: shm_image
            .as_ref()
            .map(|i| i.path.clone())
            .unwrap_or_else(|| args.shm_dir.join("unused.img")),
        disk_image: disk_image
            .as_ref()
            .map(|i| i.path.clone())
            .unwrap_or_else(|| args.disk_dir.join("unused.img")),
        qcow2_image: qcow2_image.path.clone(),
        qcow2_fresh_image: qcow2_fresh_image.path.clone(),
        qcow2_disk_image: qcow2_disk_image.path.clone(),
        qcow2_disk_fresh_image: qcow2_disk_fresh_image.path.clone(),
        qcow2_overlay_image: qcow2_overlay_image.path.clone(),
        size: args.size,
        shm_direct: direct,
        cpus: args.backend_cpu.clone(),
        work_dir: work_dir.0.clone(),
    };

    let load_before = procfs::loadavg();
    let busy_before = procfs::load1() > BUSY_LOAD;
    let hops_before = hop_costs();
    eprintln!("wake-up hop: {hops_before}");
    let mut results = Results::default();
    let total = args.reps as usize
        * images
            .iter()
            .map(|&i| targets.iter().filter(|&&t| i.has(t)).count())
            .sum::<usize>()
        * workloads.len();
    let mut done = 0;
    for rep in 0..args.reps as usize {
        for &kind in &images {
            for (index, workload) in workloads.iter().enumerate() {
                // Alternate the order, so that no target always runs first (or right after a
                // write workload, or with the caches of the same one).
                let mut order: Vec<Target> =
                    targets.iter().copied().filter(|&t| kind.has(t)).collect();
                let len = order.len().max(1);
                order.rotate_left((rep + index) % len);
                for target in order {
                    done += 1;
                    let stats = run_one(
                        target,
                        kind,
                        workload,
                        &config,
                        timing,
                        args.seed.wrapping_add(rep as u64),
                    )?;
                    eprintln!(
                        "[{done}/{total}] rep {} {kind} {} {target}: {} IOPS, p50 {} p99 {} \
                         p99.9 {} µs, CPU µs/I/O back-end {} client {}, back-end wake-ups/I/O {}",
                        rep + 1,
                        workload.name,
                        report::si(stats.iops),
                        report::num(stats.p50),
                        report::num(stats.p99),
                        report::num(stats.p999),
                        stats.backend_cpu.map_or("—".into(), report::num),
                        report::num(stats.client_cpu),
                        stats.backend_wakeups.map_or("—".into(), report::num),
                    );
                    results.add(kind, workload, target, stats);
                }
            }
        }
    }
    let load_after = procfs::loadavg();
    let hops_after = hop_costs();
    eprintln!("wake-up hop: {hops_after}");
    results.sort(&workloads);

    let mut backend_lines = Vec::new();
    let socket = Path::new("SOCK");
    for &kind in &images {
        for &target in &targets {
            let queues = 1;
            if let Some((program, args)) = target::command(target, kind, queues, &config, socket) {
                let more = match target {
                    Target::Blkplane => "--num-queues N --iothreads N",
                    Target::Qsd => "num-queues=N",
                    Target::Ch => "num_queues=N",
                    Target::Ceiling => "num-queues=N",
                };
                backend_lines.push(format!(
                    "# {target}, {kind} image ({queues} queue; N queues: {more})\n{}",
                    target::shell_line(&program, &args)
                ));
            }
        }
    }
    let mut skipped = Vec::new();
    for &kind in &images {
        for &target in &targets {
            if let Some(reason) = kind.skip_reason(target) {
                skipped.push(format!("{target} on {kind}: {reason}"));
            } else if let (Target::Ceiling, Some(path)) = (target, config.image(kind)) {
                backend_lines.push(format!(
                    "# ceiling, {kind} image: no back-end; libblkio driver io_uring, path={}, \
                     direct={}",
                    path.display(),
                    config.direct(kind)
                ));
            }
        }
    }
    let context = Context {
        args: std::env::args().collect(),
        qsd_version,
        ch_version,
        disk_fs,
        blkplane_rev: git_revision(),
        bin_dir,
        busy: busy_before || procfs::load1() > BUSY_LOAD + 2.0,
        load_before,
        load_after,
        client_cpu: args.client_cpu.clone(),
        backend_cpu: args.backend_cpu.clone(),
        direct,
        size: args.size,
        shm_dir: args.shm_dir.clone(),
        disk_dir: args.disk_dir.clone(),
        timing,
        reps: args.reps,
        workloads,
        images,
        backend_lines,
        skipped,
        date: first_line(Path::new("date"), &["-u", "+%Y-%m-%d %H:%M UTC"], None)
            .unwrap_or_default(),
        hops_before,
        hops_after,
    };
    println!("{}", report::figures_table(&results));
    println!("{}", report::best_peer_table(&results));
    println!("{}", report::ratios_table(&results));
    drop(shm_image);
    drop(disk_image);
    if args.no_report {
        return Ok(());
    }
    let out_dir = args.out_dir.clone().unwrap_or_else(workspace_dir);
    write_report(&out_dir, &context, &results)
}

/// One measurement: a fresh back-end, the workload, the back-end stopped again.
fn run_one(
    target: Target,
    kind: ImageKind,
    workload: &Workload,
    config: &BackendConfig,
    timing: Timing,
    seed: u64,
) -> Result<RunStats, BenchError> {
    if kind == ImageKind::Qcow2Fresh {
        // Every target starts from an empty image, so its writes allocate.
        // 4 KiB clusters: a random 4 KiB write finds its cluster unallocated for most of a
        // run (a 1 GiB image has 262144 of them), so allocating writes dominate.
        make_qcow2(&config.qcow2_fresh_image, config.size, 4096, "off")?;
    }
    if kind == ImageKind::Qcow2DiskFresh {
        // 4 KiB clusters too, so that allocating writes dominate on the device as well.
        make_qcow2(&config.qcow2_disk_fresh_image, config.size, 4096, "off")?;
    }
    if kind == ImageKind::Qcow2Overlay {
        // Every target starts from an empty overlay and a base the page cache does not hold,
        // so the copy-on-write of a run's first writes reads the device.
        make_overlay(&config.qcow2_overlay_image, &config.disk_image)?;
    }
    let mut backend = Backend::start(target, kind, workload.queues, config)?;
    let image = config.image(kind);
    let direct = config.direct(kind);
    let measurement = match (&backend, image) {
        (Some(backend), _) => {
            // At the window's start, with the front-end connected: how the back-end's
            // processes hold the image.
            let flags = std::cell::RefCell::new(Vec::new());
            let pids = || {
                let pids = backend.pids();
                if let Some(path) = image {
                    *flags.borrow_mut() = pids
                        .iter()
                        .flat_map(|&pid| procfs::open_flags(pid, path))
                        .collect();
                }
                pids
            };
            let m = client::run(
                Connection::VhostUser(backend.socket()),
                workload,
                config.size,
                timing,
                seed,
                Some(&pids),
            )?;
            if image.is_some() {
                check_direct(target, kind, direct, &flags.borrow())?;
            }
            m
        }
        (None, Some(path)) => client::run(
            Connection::IoUring { path, direct },
            workload,
            config.size,
            timing,
            seed,
            None,
        )?,
        (None, None) => {
            return Err(BenchError::Missing(format!(
                "{target} needs an image file, not {kind}"
            )))
        }
    };
    if let Some(backend) = &mut backend {
        if target == Target::Ch {
            // vhost_user_block exits by itself once its one front-end has gone: fine, if it
            // exits cleanly.
            backend.wait_exit(Duration::from_secs(2))?;
        } else {
            // A back-end that died during the run would have stalled it; check anyway.
            backend.check_alive()?;
        }
        backend.stop();
    }
    RunStats::new(&measurement).ok_or_else(|| {
        BenchError::Missing(format!(
            "{} on {target}: nothing completed in the window",
            workload.name
        ))
    })
}

/// Whether the back-end holds the image the way it was told to: with O_DIRECT on at least one
/// descriptor (blkplane's frontend keeps a buffered one besides), or on none.
fn check_direct(
    target: Target,
    kind: ImageKind,
    direct: bool,
    flags: &[u32],
) -> Result<(), BenchError> {
    let o_direct = libc::O_DIRECT as u32;
    let with = flags.iter().filter(|&&f| f & o_direct != 0).count();
    let ok = !flags.is_empty() && if direct { with > 0 } else { with == 0 };
    if ok {
        Ok(())
    } else {
        Err(BenchError::Missing(format!(
            "{target} on the {kind} image: expected it open {}, found {} descriptor(s) on \
             it, {with} with O_DIRECT",
            if direct { "with O_DIRECT" } else { "buffered" },
            flags.len()
        )))
    }
}

/// The file system of --disk-dir and its device, for the report (from /proc/self/mountinfo's
/// longest matching mount point).
fn disk_fs_description(dir: &Path) -> String {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return "unknown".into();
    };
    info.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mount = left.split_whitespace().nth(4)?;
            let mut right = right.split_whitespace();
            let fs = right.next()?;
            let source = right.next()?;
            dir.starts_with(mount)
                .then(|| (mount.len(), format!("{fs} on {source}, mounted at {mount}")))
        })
        .max_by_key(|(len, _)| *len)
        .map_or_else(|| "unknown".into(), |(_, d)| d)
}

fn write_report(out_dir: &Path, context: &Context, results: &Results) -> Result<(), BenchError> {
    let report_path = out_dir.join("BENCHMARKS.md");
    let svg_path = out_dir.join("docs").join("bench.svg");
    let notes = std::fs::read_to_string(&report_path)
        .ok()
        .and_then(|old| report::existing_notes(&old))
        .unwrap_or_else(|| "(No notes yet.)".into());
    let subtitle = format!(
        "{} image{}, {} s measured after {} s ramp, median of {} run{}; {} vCPUs shared by client \
         and back-end{}",
        context
            .images
            .iter()
            .map(|i| i.name())
            .collect::<Vec<_>>()
            .join(" and "),
        if context.images.len() > 1 { "s" } else { "" },
        context.timing.runtime.as_secs_f64(),
        context.timing.ramp.as_secs_f64(),
        context.reps,
        if context.reps > 1 { "s" } else { "" },
        procfs::online_cpus(),
        if context.client_cpu.is_some() || context.backend_cpu.is_some() {
            " (pinned)"
        } else {
            ""
        }
    );
    std::fs::create_dir_all(out_dir.join("docs")).map_err(BenchError::io(format!(
        "creating {}/docs",
        out_dir.display()
    )))?;
    std::fs::write(&svg_path, svg::chart(results, &subtitle))
        .map_err(BenchError::io(format!("writing {}", svg_path.display())))?;
    let markdown = markdown(context, results, &notes);
    std::fs::write(&report_path, markdown)
        .map_err(BenchError::io(format!("writing {}", report_path.display())))?;
    eprintln!("wrote {} and {}", report_path.display(), svg_path.display());
    Ok(())
}

fn markdown(c: &Context, results: &Results, notes: &str) -> String {
    let mut out = String::new();
    let command_line = c
        .args
        .iter()
        .enumerate()
        .map(|(i, a)| {
            if i == 0 {
                "target/release/blkplane-bench".to_string()
            } else {
                target::shell_line(Path::new(a), &[])
            }
        })
        .collect::<Vec<_>>()
        .join(" ");
    let pinning = match (&c.client_cpu, &c.backend_cpu) {
        (None, None) => {
            "none: client and back-end threads float over all vCPUs (the default)".to_string()
        }
        (client, backend) => format!(
            "client: {}; back-end: {} (sched_setaffinity, as taskset -c does)",
            client
                .as_ref()
                .map_or("not pinned".into(), |c| format!("taskset -c {}", c.text())),
            backend
                .as_ref()
                .map_or("not pinned".into(), |c| format!("taskset -c {}", c.text())),
        ),
    };
    let _ = write!(
        out,
        "# Benchmarks\n\n\
         blkplane against qemu-storage-daemon and cloud-hypervisor's vhost_user_block (`ch`) on \
         the same images with the same libblkio client, and the io_uring ceiling (the image \
         driven directly, no virtio). Written by \
         `blkplane-bench` ([bench/](bench/)), which reruns it all; only the Notes section at the \
         end is hand-written (and kept when the file is rewritten).\n\n\
         ![IOPS and CPU per I/O per workload and target](docs/bench.svg)\n\n\
         ## Reproduce\n\n\
         ```sh\n\
         cargo build --release -p blkplane-frontend -p blkplane-iothread -p blkplane-bench\n\
         {command_line}\n\
         ```\n\n\
         A smoke run takes seconds: `target/release/blkplane-bench --runtime 1 --ramp 0.5 \
         --reps 1 --workloads randread-4k-qd1 --targets blkplane,qsd,ceiling --out-dir \
         /tmp/bench-smoke` (add `ch` to --targets with `--ch-binary PATH`: cloud-hypervisor's \
         vhost_user_block, built from its source outside this repository; see the Notes).\n\n\
         ## Machine and versions\n\n\
         | | |\n|---|---|\n\
         | date | {} |\n\
         | CPUs | {} online, {} |\n\
         | memory | {:.1} GiB |\n\
         | kernel | {} |\n\
         | qemu-storage-daemon | {} |\n\
         | cloud-hypervisor vhost_user_block (ch) | {} |\n\
         | disk image's file system (--disk-dir {}) | {} |\n\
         | blkplane | git {} (binaries from `{}`) |\n\
         | load average before / after | `{}` / `{}` |\n\
         | one eventfd wake-up (thread to thread), before the runs | {} |\n\
         | the same after the runs | {} |\n\
         | CPU pinning | {} |\n\n",
        c.date,
        procfs::online_cpus(),
        procfs::cpu_model(),
        procfs::memory_gib(),
        procfs::kernel(),
        c.qsd_version,
        c.ch_version,
        c.disk_dir.display(),
        c.disk_fs,
        c.blkplane_rev,
        c.bin_dir.display(),
        c.load_before,
        c.load_after,
        c.hops_before,
        c.hops_after,
        pinning,
    );
    let _ = writeln!(
        out,
        "The machine has {} vCPUs and the client shares them with the back-end: libblkio \
         runs one client thread per queue in the same box, so every figure is \"client plus \
         back-end on {} vCPUs\", not a back-end with cores to itself. The client's CPU is \
         reported separately from the back-end's. Use `--client-cpu` / `--backend-cpu` to pin \
         them apart.\n",
        procfs::online_cpus(),
        procfs::online_cpus()
    );
    if c.busy {
        let _ = writeln!(
            out,
            "**Another workload may have been running**: the 1-minute load average was `{}` \
             before and `{}` after the run (an idle machine shows about 0 before; the \
             benchmark itself keeps about 1–2 runnable).\n",
            c.load_before, c.load_after
        );
    }
    let _ = writeln!(out, "## Method\n");
    let _ = writeln!(
        out,
        "- Workloads (fio-style, one libblkio queue and client thread per queue, each keeping \
         `iodepth` requests in flight; a completed slot is resubmitted at once):"
    );
    for w in &c.workloads {
        let _ = writeln!(out, "  - `{}`: {}", w.name, w.describe());
    }
    let _ = writeln!(
        out,
        "- Images: {}.\n\
         - Every run starts a fresh back-end with as many queues (and, for blkplane, \
         iothreads) as the workload has; runs {:.1} s to fill the queues, then measures {:.1} \
         s. {} repetition{} per (image, workload, target); the order of the targets rotates \
         from one workload and repetition to the next. Tables give the median and, in \
         parentheses, the min–max over the repetitions.\n\
         - Latency: per request, from queueing it in libblkio to seeing its completion, in a \
         fixed log-linear histogram (64 buckets per power of two, ±0.8 %). Requests complete \
         in batches, and a batch is stamped once when `do_io` returns.\n\
         - Back-end CPU: utime + stime from `/proc/<pid>/stat` of every back-end process \
         (blkplane-frontend and all its descendants: the iothread spawner and the \
         blkplane-iothread processes under it; qemu-storage-daemon; vhost_user_block), \
         sampled at the start and end of the measured window, divided by the requests \
         completed in it: µs per I/O equals CPU seconds per million I/Os. Client CPU: \
         getrusage of the benchmark process (all its threads; for the ceiling that includes \
         the io_uring work in the kernel). Wake-ups: voluntary context switches (a thread \
         went to sleep and had to be woken) per I/O, of all back-end threads and of the client \
         threads, compared thread by thread between the window's edges; threads that exit \
         inside the window (io_uring's io-wq workers come and go) are lost, so these are lower \
         bounds.\n\
         - The client waits like a VMM: before each blocking `do_io` it consumes the queue's \
         completion eventfd, which libblkio's `do_io` polls but never reads (a stale eventfd \
         would turn every wait into a spin).\n\
         - blkplane runs with its defaults otherwise (`--cache direct`, queue size 256); qsd \
         10.0's vhost-user-blk export serves all its queues from the one iothread it can be \
         given (it refuses a list), so on 2 queues blkplane has 2 iothreads and qsd 1. ch \
         (cloud-hypervisor's vhost_user_block) runs one worker thread per queue that does \
         each request with a synchronous read or write on the image (no io_uring, so it keeps \
         at most one request per queue at the device whatever the depth), with \
         `poll_queue=false` (it does not poll: between kicks it waits in epoll, as the others \
         wait on their eventfds) and queue size 256; it \
         serves one front-end connection and exits, and a fresh one is started per run like \
         every back-end. Back-end CPU and wake-ups of ch are counted like the others': its \
         process, all threads.\n\
         - Per row the report compares blkplane with the best peer of that image and workload: \
         qsd or ch, whichever has the higher median IOPS.\n\
         - Skipped cells: {}.\n\
         - Every run checks, from /proc/<pid>/fdinfo at the window's start, that the back-end \
         holds a file image the way it was told (O_DIRECT on at least one descriptor for \
         direct; blkplane's frontend keeps a buffered one besides), and fails otherwise.\n",
        c.images
            .iter()
            .map(|i| match i {
                ImageKind::Shm => format!(
                    "`shm`: a {} MiB raw file in tmpfs ({}) filled with pseudo-random data, \
                     opened {} by every target",
                    c.size >> 20,
                    c.shm_dir.display(),
                    if c.direct {
                        "with O_DIRECT (tmpfs accepts it since Linux 6.6 and copies as usual)"
                    } else {
                        "buffered (the file system refuses O_DIRECT)"
                    }
                ),
                ImageKind::Null => format!(
                    "`null`: blkplane's `--image null:{}` against qsd's \
                     `null-co,read-zeroes=on,size={}`: reads return zeros, writes are \
                     dropped, so only the data path is measured (no ceiling: there is \
                     nothing to drive directly; no ch: vhost_user_block serves files only)",
                    c.size, c.size
                ),
                ImageKind::Qcow2 => format!(
                    "`qcow2`: a {} MiB qcow2 image (64 KiB clusters, `preallocation=falloc`: \
                     every cluster mapped and allocated) in {}, served by blkplane \
                     (`--format qcow2`) and qsd (`driver=qcow2` over `driver=file`), opened as \
                     the shm image is",
                    c.size >> 20,
                    c.shm_dir.display()
                ),
                ImageKind::Qcow2Fresh => format!(
                    "`qcow2-fresh`: an empty qcow2 image with 4 KiB clusters in {}, made anew \
                     before every run, so that most random writes of a run allocate a cluster",
                    c.shm_dir.display()
                ),
                ImageKind::Qcow2Disk => format!(
                    "`qcow2-disk`: a {} MiB qcow2 image (64 KiB clusters) converted by \
                     qemu-img from pseudo-random raw data, in {} on the machine's disk, synced \
                     and dropped from the page cache, opened with O_DIRECT by both targets",
                    c.size >> 20,
                    c.disk_dir.display()
                ),
                ImageKind::Qcow2DiskFresh => format!(
                    "`qcow2-disk-fresh`: an empty qcow2 image with 4 KiB clusters in {} on the \
                     machine's disk, made anew before every run, opened with O_DIRECT by both \
                     targets: allocating writes on a device",
                    c.disk_dir.display()
                ),
                ImageKind::Qcow2Overlay => "`qcow2-overlay`: a qcow2 overlay (64 KiB clusters) \
                     on the `disk` image, made anew before every run with the base dropped from \
                     the page cache, opened with O_DIRECT by both targets: a thin clone of a \
                     golden image, whose first write into a cluster copies the rest of it from \
                     the base"
                    .to_string(),
                ImageKind::Disk => format!(
                    "`disk`: a {} MiB raw file in {} on the machine's disk ({}), filled with \
                     pseudo-random data, synced and dropped from the page cache before the \
                     runs, opened with O_DIRECT by every target (blkplane `--cache direct`, qsd \
                     `cache.direct=on`, ch `direct=true`, the ceiling `direct=true`): a real \
                     device's latency, the page cache bypassed",
                    c.size >> 20,
                    c.disk_dir.display(),
                    c.disk_fs
                ),
            })
            .collect::<Vec<_>>()
            .join("; "),
        c.timing.ramp.as_secs_f64(),
        c.timing.runtime.as_secs_f64(),
        c.reps,
        if c.reps > 1 { "s" } else { "" },
        if c.skipped.is_empty() {
            "none".to_string()
        } else {
            c.skipped.join("; ")
        },
    );
    let _ = writeln!(
        out,
        "Back-end command lines (`SOCK` is a fresh socket per run):\n\n```sh\n{}\n```\n",
        c.backend_lines.join("\n")
    );
    let _ = writeln!(out, "## Results\n");
    out.push_str(&report::figures_table(results));
    let _ = writeln!(
        out,
        "\n### blkplane against the best peer\n\nOf the medians above, per image and \
         workload: blkplane and the best peer back-end (qsd or ch, whichever has more IOPS), \
         side by side, and blkplane's figure divided by the peer's. Above 1× is more IOPS, but \
         also more latency and more CPU per I/O. The last column gives the other peer, where \
         it ran.\n"
    );
    out.push_str(&report::best_peer_table(results));
    let _ = writeln!(
        out,
        "\n### Ratios\n\nOf the medians above: blkplane's figure divided by the best peer's \
         (named in the first ratio column), and every back-end's divided by the ceiling's for \
         the same image and workload (MiB/s ratios equal the IOPS ratios). The ceiling \
         comparison uses the whole path's CPU (back-end + client) against the ceiling's \
         client, which does all of its I/O.\n"
    );
    out.push_str(&report::ratios_table(results));
    let _ = writeln!(out, "\n## Notes\n\n{NOTES_BEGIN}\n{notes}\n{NOTES_END}");
    out
}
