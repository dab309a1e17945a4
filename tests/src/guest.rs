//! Running a Linux guest under QEMU for the end-to-end tests (`tests/tests/guest.rs`,
//! `tests/tests/migration.rs`): building the guest, starting QEMU, reading what the guest's
//! `/init` (`tests/guest/init.sh`) reports on its results port.

use std::fs::File;
use std::io::Write as _;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::wait_for;

/// Upper bound for building (or finding in the cache) the kernel and initramfs.
pub const BUILD_TIMEOUT: Duration = Duration::from_secs(300);

/// `qemu-system-x86_64` on PATH and its version line; panics with [`SETUP_HINT`] without it.
pub fn qemu_binary() -> (PathBuf, String) {
    let Some(qemu_bin) = find_in_path("qemu-system-x86_64") else {
        panic!("qemu-system-x86_64 not found on PATH; {SETUP_HINT}");
    };
    let version = Command::new(&qemu_bin)
        .arg("--version")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .to_string()
        })
        .unwrap_or_else(|e| panic!("{} --version: {e}; {SETUP_HINT}", qemu_bin.display()));
    (qemu_bin, version)
}

/// The QEMU command line both guest tests share: q35 with 512 MiB of memfd guest memory
/// shared with the vhost-user back-ends (`share=on`), single-threaded TCG with 2 vCPUs (a QEMU
/// 10.0 multi-threaded TCG race in its memory map once aborted QEMU during PCI enumeration),
/// the guest kernel and initramfs with `append`, the console on the first serial port and
/// the results on the second, both into files. The caller adds the disks.
pub fn qemu_command(
    qemu_bin: &Path,
    guest: &GuestImage,
    append: &str,
    console: &Path,
    results: &Path,
) -> Command {
    let mut cmd = Command::new(qemu_bin);
    cmd.args(["-no-user-config", "-nodefaults", "-nographic"])
        .args(["-machine", "q35,memory-backend=mem"])
        .args(["-accel", "tcg,thread=single"])
        .args(["-cpu", "max", "-smp", "2", "-m", "512"])
        .args(["-object", "memory-backend-memfd,id=mem,size=512M,share=on"])
        .arg("-kernel")
        .arg(&guest.kernel)
        .arg("-initrd")
        .arg(&guest.initrd)
        .args(["-append", append])
        .arg("-serial")
        .arg(format!("file:{}", console.display()))
        .arg("-serial")
        .arg(format!("file:{}", results.display()));
    cmd
}

/// What to do when QEMU or the guest build is missing.
pub const SETUP_HINT: &str = "run tests/setup.sh as root (it installs qemu-system-x86 from \
                          bookworm-backports and sets up the apt sources the guest is built from)";

/// Writes straight to the test process's stderr, past libtest's output capture, so that the
/// progress and the summary show in a passing CI log too.
pub fn progress(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "guest: {msg}");
}

/// The cargo target directory (the nearest ancestor of the test binary with CACHEDIR.TAG).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.ancestors()
        .find(|d| d.join("CACHEDIR.TAG").is_file())
        .unwrap_or_else(|| panic!("{} is not inside a cargo target directory", exe.display()))
        .to_path_buf()
}

/// The first `name` on PATH.
pub fn find_in_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// Runs `cmd` with stdout and stderr into files under `dir`, killing it after `timeout`.
/// Returns (status, stdout, stderr); status None means it timed out.
pub fn run_bounded(
    mut cmd: Command,
    dir: &Path,
    tag: &str,
    timeout: Duration,
) -> (Option<ExitStatus>, String, String) {
    let out_path = dir.join(format!("{tag}.stdout"));
    let err_path = dir.join(format!("{tag}.stderr"));
    cmd.stdin(Stdio::null())
        .stdout(File::create(&out_path).unwrap())
        .stderr(File::create(&err_path).unwrap());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}; {SETUP_HINT}"));
    let status = wait_for(timeout, || child.try_wait().unwrap());
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let read =
        |p: &Path| String::from_utf8_lossy(&std::fs::read(p).unwrap_or_default()).into_owned();
    (status, read(&out_path), read(&err_path))
}

/// The kernel and initramfs to boot.
/// The kernel and initramfs to boot (see `tests/guest/build-initramfs.py`).
pub struct GuestImage {
    /// The kernel image.
    pub kernel: PathBuf,
    /// The initramfs.
    pub initrd: PathBuf,
    /// What was built or taken from the cache, for the log.
    pub info: String,
}

/// Builds (or takes from the cache) the guest kernel and initramfs.
pub fn build_guest(scratch: &Path) -> GuestImage {
    let guest_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("guest");
    let cache = std::env::var_os("BLKPLANE_GUEST_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("guest"));
    let Some(python) = find_in_path("python3") else {
        panic!("python3 not found on PATH; {SETUP_HINT}");
    };
    let mut cmd = Command::new(python);
    cmd.arg(guest_dir.join("build-initramfs.py"))
        .arg("--cache")
        .arg(&cache);
    let started = Instant::now();
    let (status, stdout, stderr) = run_bounded(cmd, scratch, "build", BUILD_TIMEOUT);
    match status {
        None => panic!(
            "building the guest initramfs took longer than {BUILD_TIMEOUT:?}:\n{stderr}\n{SETUP_HINT}"
        ),
        Some(s) if !s.success() => panic!(
            "building the guest initramfs failed ({s}):\n{stderr}\n{SETUP_HINT} (exit status 3 \
             means apt does not know the packages or a tool is missing)"
        ),
        Some(_) => {}
    }
    let field = |k: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(k).and_then(|r| r.strip_prefix('=')))
            .unwrap_or_else(|| panic!("build-initramfs.py printed no {k}=:\n{stdout}\n{stderr}"))
            .to_string()
    };
    let info = format!(
        "kernel {} initramfs {} ({}, {:.1?}); {}",
        field("kernel_release"),
        field("key"),
        if field("cached") == "yes" {
            "cached"
        } else {
            "built"
        },
        started.elapsed(),
        field("packages")
    );
    GuestImage {
        kernel: field("kernel").into(),
        initrd: field("initrd").into(),
        info,
    }
}

/// A running QEMU, killed and reaped on drop (and by the kernel if this process dies).
pub struct Qemu {
    /// The QEMU process.
    pub child: Child,
}

impl Qemu {
    /// Starts QEMU; it dies with this process.
    pub fn spawn(mut cmd: Command) -> Qemu {
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawning QEMU {cmd:?}: {e}; {SETUP_HINT}"));
        Qemu { child }
    }

    /// The exit status, once QEMU has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().unwrap()
    }
}

impl Drop for Qemu {
    fn drop(&mut self) {
        if self.exited().is_none() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// One `BLKPLANE-CHECK` line.
#[derive(Debug)]
pub struct Check {
    /// It passed.
    pub ok: bool,
    /// Its name.
    pub name: String,
    /// What the guest said about it.
    pub detail: String,
}

/// What the guest reported on its results port.
#[derive(Debug, Default)]
pub struct Report {
    /// Every `BLKPLANE-` line, in order.
    pub lines: Vec<String>,
    /// The checks.
    pub checks: Vec<Check>,
    /// The boots announced (`BLKPLANE-BOOT n`).
    pub boots: Vec<u32>,
    /// Boot 1 said it reboots.
    pub rebooted: bool,
    /// What followed `BLKPLANE-DONE`, once it came.
    pub done: Option<String>,
}

impl Report {
    /// Parses the results port's text.
    pub fn parse(text: &str) -> Report {
        let mut r = Report::default();
        for line in text.lines() {
            let line = line.trim_end_matches('\r');
            let Some(start) = line.find("BLKPLANE-") else {
                continue;
            };
            let line = &line[start..];
            r.lines.push(line.to_string());
            let mut words = line.splitn(4, ' ');
            match words.next() {
                Some("BLKPLANE-CHECK") => {
                    let verdict = words.next().unwrap_or("");
                    r.checks.push(Check {
                        ok: verdict == "ok",
                        name: words.next().unwrap_or("").to_string(),
                        detail: words.next().unwrap_or("").to_string(),
                    });
                }
                Some("BLKPLANE-BOOT") => {
                    if let Some(n) = words.next().and_then(|n| n.parse().ok()) {
                        r.boots.push(n);
                    }
                }
                Some("BLKPLANE-REBOOT") => r.rebooted = true,
                Some("BLKPLANE-DONE") => {
                    r.done = Some(line["BLKPLANE-DONE".len()..].trim().to_string());
                }
                _ => {}
            }
        }
        r
    }
}

/// A file's text (lossy UTF-8; empty when missing).
pub fn read_lossy(path: &Path) -> String {
    String::from_utf8_lossy(&std::fs::read(path).unwrap_or_default()).into_owned()
}

/// The last `max` bytes of `text`, cut at a line start.
pub fn tail(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    let start = text[start..].find('\n').map_or(start, |i| start + i + 1);
    &text[start..]
}

/// The sha256 of a file, by sha256sum.
pub fn sha256_of(path: &Path) -> String {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .unwrap_or_else(|e| panic!("sha256sum: {e}"));
    assert!(out.status.success(), "sha256sum {} failed", path.display());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// Sends `signal` to `pid` (a process of the frontend under test).
pub fn send_signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) on a pid of a process this test started (directly or through the
    // frontend); no memory is involved.
    unsafe { libc::kill(pid as libc::pid_t, signal) };
}
