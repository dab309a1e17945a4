//! The README's first command, `target/release/blkplaned` with no arguments, as a new user runs
//! it: in an empty working directory it makes its state and runtime directories there, creates
//! the 1 GiB `disk0`, and prints how to attach it. The printed QEMU line must be the one the
//! README documents (with `reconnect-ms`, or a copied line loses the crash-safe reconnect), the
//! printed socket must serve libblkio, and the printed `blkplanectl` command must work. A
//! second start on the same directory adopts the disk instead of creating another, and its
//! data is still there.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use blkplane_tests::daemon::{alive, cmdline, kill};
use blkplane_tests::{binaries, pattern, Client, TempDir};

/// How long blkplaned may take to print its banner or to exit.
const TIMEOUT: Duration = Duration::from_secs(60);

/// A blkplaned started the README's way, with every process of its directory killed on drop
/// (disks keep serving after blkplaned exits, by design, so its frontends are stopped here).
struct FirstRun {
    child: Option<Child>,
    lines: mpsc::Receiver<String>,
    dir: PathBuf,
}

impl FirstRun {
    /// `blkplaned` with no arguments in `dir`.
    fn start(dir: &Path) -> FirstRun {
        let mut child = Command::new(&binaries().blkplaned)
            .current_dir(dir)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawning blkplaned");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        FirstRun {
            child: Some(child),
            lines,
            dir: dir.to_path_buf(),
        }
    }

    /// The banner: every line up to and including the `blkplanectl … disk show` line.
    fn banner(&self) -> Vec<String> {
        let deadline = Instant::now() + TIMEOUT;
        let mut banner = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let done = line.contains(" disk show ");
                    banner.push(line);
                    if done {
                        return banner;
                    }
                }
                Err(e) => panic!("no complete banner from blkplaned ({e}); got {banner:#?}"),
            }
        }
    }

    /// SIGTERM, then the exit status must be success.
    fn stop(&mut self) {
        let mut child = self.child.take().unwrap();
        kill(child.id(), libc::SIGTERM);
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                assert!(status.success(), "blkplaned exited with {status}");
                return;
            }
            assert!(
                Instant::now() < deadline,
                "blkplaned did not stop on SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for FirstRun {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // Frontends and their spawners name the directory inside `--socket=…` and the like.
        let dir = self.dir.to_str().unwrap();
        for pid in processes_naming(dir) {
            kill(pid, libc::SIGKILL);
        }
    }
}

/// Live processes with an argument that contains `text`.
fn processes_naming(text: &str) -> Vec<u32> {
    blkplane_procfs::pids()
        .into_iter()
        .filter(|&pid| alive(pid) && cmdline(pid).iter().any(|a| a.contains(text)))
        .collect()
}

/// The options of the README's QEMU example (its "Attach QEMU" block) that a banner must
/// repeat: the memory backend, and the chardev's options after its own id and path.
fn readme_qemu_options() -> Vec<String> {
    let readme = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap()
            .join("README.md"),
    )
    .unwrap();
    let mut options = Vec::new();
    for line in readme.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("-chardev socket,") {
            let rest = rest.trim_end_matches('\\').trim();
            options.extend(
                rest.split(',')
                    .filter(|o| !o.starts_with("id=") && !o.starts_with("path="))
                    .map(str::to_string),
            );
        }
        if line.starts_with("-object memory-backend-memfd") {
            options.push(line.trim_end_matches('\\').trim().to_string());
        }
    }
    assert!(
        options.iter().any(|o| o.starts_with("reconnect-ms=")),
        "the README's QEMU example has no reconnect-ms: {options:?}"
    );
    options
}

#[test]
fn the_readme_first_command_serves_disk0_and_prints_how_to_attach_it() {
    let dir = TempDir::new("first-run");
    let mut daemon = FirstRun::start(dir.path());
    let banner = daemon.banner();
    let text = banner.join("\n");

    // The disk and where it is served.
    let served = banner
        .iter()
        .find_map(|l| l.strip_prefix("Disk disk0 "))
        .unwrap_or_else(|| panic!("no disk0 in the banner:\n{text}"));
    assert!(
        served.contains(&format!("{} bytes", 1u64 << 30)),
        "disk0 is not 1 GiB: {served}"
    );
    let socket = PathBuf::from(
        served
            .rsplit_once(" is served on ")
            .unwrap_or_else(|| panic!("no socket in {served:?}"))
            .1,
    );
    assert!(
        socket.starts_with(dir.path().join("blkplane-run")),
        "{} is not under the working directory's blkplane-run",
        socket.display()
    );
    assert!(dir.join("blkplane-state").is_dir());

    // The QEMU line: the README's options, on this disk's socket.
    let chardev = banner
        .iter()
        .find(|l| l.trim_start().starts_with("-chardev socket,"))
        .unwrap_or_else(|| panic!("no -chardev in the banner:\n{text}"));
    assert!(
        chardev.contains(&format!("path={}", socket.display())),
        "{chardev}"
    );
    for option in readme_qemu_options() {
        assert!(
            text.contains(&option),
            "the banner lacks the README's `{option}`:\n{text}"
        );
    }

    // The printed blkplanectl command works as printed (relative to the working directory).
    let show = banner
        .iter()
        .map(|l| l.trim())
        .find(|l| l.ends_with(" disk show disk0"))
        .unwrap_or_else(|| panic!("no blkplanectl line in the banner:\n{text}"));
    let mut words = show.split_whitespace();
    let out = Command::new(words.next().unwrap())
        .args(words)
        .current_dir(dir.path())
        .output()
        .expect("running the printed blkplanectl command");
    assert!(
        out.status.success(),
        "`{show}`: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("disk0"));

    // The socket serves a VMM.
    let data = pattern(0xf1257, 64 << 10);
    {
        let mut vmm = Client::connect(&socket).expect("libblkio on the printed socket");
        assert_eq!(vmm.capacity(), 1 << 30);
        vmm.queue(0).write_at(3 << 20, &data).unwrap();
        vmm.queue(0).flush().unwrap();
        assert_eq!(vmm.queue(0).read_at(3 << 20, data.len()).unwrap(), data);
    }
    daemon.stop();
    drop(daemon);

    // The second run adopts disk0 (no second disk, the data kept).
    let daemon = FirstRun::start(dir.path());
    let banner = daemon.banner();
    assert!(
        banner
            .iter()
            .any(|l| l.starts_with("blkplaned: serving 1 disk(s)")),
        "{banner:#?}"
    );
    let mut vmm = Client::connect(&socket).expect("libblkio after the second start");
    assert_eq!(vmm.queue(0).read_at(3 << 20, data.len()).unwrap(), data);
    drop(vmm);
    let path = dir.path().to_str().unwrap().to_string();
    drop(daemon);
    let left =
        blkplane_tests::wait_for(TIMEOUT, || processes_naming(&path).is_empty().then_some(()));
    assert!(left.is_some(), "processes of {path} outlived the test");
}
