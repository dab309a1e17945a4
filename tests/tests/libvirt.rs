//! A libvirt domain on blkplane disks, run by a real libvirtd (Debian's libvirt 11.3 from
//! bookworm-backports, QEMU 10.0, TCG): the domain and hotplug XML of docs/kubevirt.md
//! (`docs/examples/libvirt-domain.xml`, `docs/examples/libvirt-hotplug-disk.xml`), with only
//! the paths, the name, the kernel command line and `type='qemu'` replaced, so the docs cannot
//! drift from what runs.
//!
//! - blkplaned serves the disks as libvirt's QEMU user (`--disk-user`, the uid of Debian's
//!   `libvirt-qemu`), as the docs say it must;
//! - `virsh create` starts the domain (memfd shared memory, a `<disk type='vhostuser'>` with
//!   `<reconnect>`); the guest (`tests/guest/init.sh`, `bp.mode=libvirt`) checks the disk's
//!   capacity, serial and queues and runs fio write+verify on it;
//! - when the guest asks, the test adds a second disk to blkplaned and hot-plugs it with
//!   `virsh attach-device --live`; the guest finds it by serial and runs fio write+verify on it;
//!   then `virsh detach-device --live`, the guest must let it go, libvirt must drop it from the
//!   domain and close its socket (blkplaned's RemoveDisk without `--force` must succeed);
//! - during fio write+verify on the first disk, with its iothreads stopped until requests are
//!   in flight, the test kills its frontend with SIGKILL: blkplaned restarts it, QEMU
//!   reconnects as `<reconnect>` tells it, the new frontend resubmits what was in flight, and
//!   fio must verify every block with no I/O error in the guest's kernel log.
//!
//! libvirtd runs as root in a private mount namespace (`unshare`), on the test's own
//! `/etc/libvirt`, `/run/libvirt`, `/var/lib/libvirt`, `/var/cache/libvirt` and
//! `/var/log/libvirt`, and listens in the test's directory: the machine's libvirt
//! configuration and any libvirtd already running are left alone. Needs root, `libvirtd` and
//! `virsh` (tests/setup.sh runs tests/setup-libvirt.sh); without them the test fails and says
//! so.

use std::fmt::Write as _;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use blkplane_tests::daemon::{alive, cmdline, kill, Daemon, Json};
use blkplane_tests::frontend::iothread_pids;
use blkplane_tests::guest::*;
use blkplane_tests::*;

/// The docs' domain and hotplug disk, read when the test is built.
const DOMAIN_XML: &str = include_str!("../../docs/examples/libvirt-domain.xml");
const HOTPLUG_XML: &str = include_str!("../../docs/examples/libvirt-hotplug-disk.xml");

const MIB: u64 = 1 << 20;
/// The domain's disk: fio's rand4k region ends at 128 MiB, the crash region at 192 MiB.
const VD1_SIZE: u64 = 256 * MIB;
/// The hot-plugged disk: the crash region and a bit, so its size tells it apart.
const VD2_SIZE: u64 = 200 * MIB;
const VD1_SERIAL: &str = "bp-libvirt-vd1";
const VD2_SERIAL: &str = "bp-libvirt-vd2";

/// What tells the user how to get libvirt.
const LIBVIRT_HINT: &str = "run tests/setup.sh as root (it runs tests/setup-libvirt.sh, which \
                            installs libvirtd and virsh 11.3 from bookworm-backports)";

/// Upper bound for the guest from `virsh create` to its poweroff (TCG; about a minute here).
const GUEST_TIMEOUT: Duration = Duration::from_secs(300);
/// How long libvirtd may take to answer after it started.
const LIBVIRTD_TIMEOUT: Duration = Duration::from_secs(30);
/// Upper bound for one virsh command.
const VIRSH_TIMEOUT: Duration = Duration::from_secs(60);
/// How long libvirt may take to remove the domain after the guest powered off, and to drop a
/// detached disk (the guest has to let it go first).
const GONE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the first disk may take to serve QEMU again after its frontend was killed
/// (blkplaned restarts it after 200 ms; QEMU reconnects every second).
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the stopped iothreads may take to have requests in flight (the guest's fio is
/// writing when it asks for the kill).
const IN_FLIGHT_TIMEOUT: Duration = Duration::from_secs(10);

/// Every check init.sh reports in bp.mode=libvirt.
const CHECKS: &[&str] = &[
    "disks",
    "capacity",
    "serial",
    "queues",
    "ro-flag",
    "fio-rand4k",
    "hotplug",
    "hotplug-fio",
    "hotplug-detach",
    "crash-frontend",
];

/// `text` with each `(from, to)` replaced; each `from` must occur exactly once, so that an
/// edit of the docs' XML that the test no longer matches fails here instead of testing
/// something else.
fn substitute(what: &str, text: &str, pairs: &[(&str, &str)]) -> String {
    let mut out = text.to_string();
    for (from, to) in pairs {
        let n = out.matches(from).count();
        assert_eq!(
            n, 1,
            "{what} contains {from:?} {n} times; tests/tests/libvirt.rs replaces it and needs \
             it exactly once"
        );
        out = out.replace(from, to);
    }
    out
}

/// The uid or gid of `name` in /etc/passwd or /etc/group.
fn id_of(file: &str, name: &str) -> u32 {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            let mut f = l.split(':');
            (f.next() == Some(name)).then(|| f.nth(1)?.parse().ok())?
        })
        .unwrap_or_else(|| panic!("no {name} in {file}; {LIBVIRT_HINT}"))
}

/// The first of `candidates` that is an executable file, else the name found on PATH.
fn program(name: &str, candidates: &[&str]) -> PathBuf {
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .or_else(|| find_in_path(name))
        .unwrap_or_else(|| panic!("{name} not found; {LIBVIRT_HINT}"))
}

/// The programs the test runs libvirt with; found first, so that a machine without libvirt
/// fails at once and says what to do.
struct Tools {
    libvirtd: PathBuf,
    virsh: PathBuf,
    unshare: PathBuf,
}

impl Tools {
    fn find() -> Tools {
        Tools {
            libvirtd: program("libvirtd", &["/usr/sbin/libvirtd"]),
            virsh: program("virsh", &["/usr/bin/virsh"]),
            unshare: program("unshare", &["/usr/bin/unshare"]),
        }
    }
}

/// A libvirtd in a private mount namespace on the test's directories, stopped on drop.
struct Libvirtd {
    child: Child,
    uri: String,
    virsh: PathBuf,
    dir: PathBuf,
    log: PathBuf,
    calls: AtomicUsize,
}

impl Libvirtd {
    /// Starts libvirtd with its state under `dir` and QEMU running as `user`:`group`, and
    /// waits until it answers.
    fn start(tools: Tools, dir: &Path, user: &str, group: &str) -> Libvirtd {
        let Tools {
            libvirtd,
            virsh,
            unshare,
        } = tools;
        for sub in ["etc", "run", "lib", "cache", "log", "sock"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        let log = dir.join("libvirtd.log");
        std::fs::write(
            dir.join("libvirtd.conf"),
            format!(
                "unix_sock_dir = \"{}\"\nunix_sock_rw_perms = \"0700\"\nauth_unix_rw = \
                 \"none\"\nauth_unix_ro = \"none\"\nlog_outputs = \"3:file:{}\"\n",
                dir.join("sock").display(),
                log.display()
            ),
        )
        .unwrap();
        // The defaults but for two settings: QEMU's output goes to a file in the private log
        // directory instead of through virtlogd (one daemon fewer to run by hand), and no
        // mount namespace per domain, which would try to move the /dev/kvm bind mount below
        // into the domain's /dev and fail.
        std::fs::write(
            dir.join("etc/qemu.conf"),
            format!(
                "user = \"{user}\"\ngroup = \"{group}\"\nstdio_handler = \"file\"\nnamespaces \
                 = [ ]\n"
            ),
        )
        .unwrap();
        // Where /dev/kvm exists but the QEMU user may not open it (root-only, as here),
        // libvirt finds KVM when it probes QEMU's capabilities and then takes them for stale
        // at every lookup, "KVM was enabled when probing ..., but it is not available now",
        // and probes QEMU again: 17 times, about a minute, for one `virsh create`. The domain
        // is TCG, so /dev/kvm is hidden from this libvirtd behind an empty root-only file.
        let nokvm = dir.join("nokvm");
        std::fs::write(&nokvm, b"").unwrap();
        std::fs::set_permissions(&nokvm, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let script = r#"set -e
D=$1
mkdir -p /run/libvirt /var/lib/libvirt /var/cache/libvirt /var/log/libvirt
if [ -e /dev/kvm ]; then mount --bind "$D/nokvm" /dev/kvm; fi
mount --bind "$D/etc" /etc/libvirt
mount --bind "$D/run" /run/libvirt
mount --bind "$D/lib" /var/lib/libvirt
mount --bind "$D/cache" /var/cache/libvirt
mount --bind "$D/log" /var/log/libvirt
exec "$2" -f "$D/libvirtd.conf" -p "$D/libvirtd.pid"
"#;
        let out = std::fs::File::create(dir.join("libvirtd.out")).unwrap();
        let mut cmd = Command::new(unshare);
        cmd.args([
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            script,
            "sh",
        ])
        .arg(dir)
        .arg(&libvirtd)
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out);
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawning libvirtd: {e}; {LIBVIRT_HINT}"));
        let mut lv = Libvirtd {
            child,
            uri: format!(
                "qemu+unix:///system?socket={}",
                dir.join("sock/libvirt-sock").display()
            ),
            virsh,
            dir: dir.to_path_buf(),
            log,
            calls: AtomicUsize::new(0),
        };
        let started = Instant::now();
        loop {
            if let Some(status) = lv.child.try_wait().unwrap() {
                panic!(
                    "libvirtd exited at start with {status}:\n{}\n{}",
                    read_lossy(&dir.join("libvirtd.out")),
                    read_lossy(&lv.log)
                );
            }
            if dir.join("sock/libvirt-sock").exists() && lv.virsh(&["version"]).is_ok() {
                break;
            }
            assert!(
                started.elapsed() < LIBVIRTD_TIMEOUT,
                "libvirtd did not answer within {LIBVIRTD_TIMEOUT:?}:\n{}\n{}",
                read_lossy(&dir.join("libvirtd.out")),
                read_lossy(&lv.log)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        lv
    }

    /// Runs `virsh -c URI args`; its stdout, or what went wrong.
    fn virsh(&self, args: &[&str]) -> Result<String, String> {
        let n = self.calls.fetch_add(1, Ordering::Relaxed);
        let mut cmd = Command::new(&self.virsh);
        cmd.arg("-c").arg(&self.uri).args(args);
        let (status, stdout, stderr) =
            run_bounded(cmd, &self.dir, &format!("virsh-{n}"), VIRSH_TIMEOUT);
        match status {
            Some(s) if s.success() => Ok(stdout),
            Some(s) => Err(format!("virsh {args:?}: {s}: {stderr}{stdout}")),
            None => Err(format!("virsh {args:?} took longer than {VIRSH_TIMEOUT:?}")),
        }
    }

    /// QEMU's log of domain `name` (libvirt writes the command line and QEMU's output there).
    fn qemu_log(&self, name: &str) -> PathBuf {
        self.dir.join(format!("log/qemu/{name}.log"))
    }
}

impl Drop for Libvirtd {
    fn drop(&mut self) {
        // SIGTERM is a clean shutdown; the domains, if any were left, keep running (Domain's
        // guard destroys the test's first).
        kill(self.child.id(), libc::SIGTERM);
        if wait_for(Duration::from_secs(10), || self.child.try_wait().unwrap()).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            eprintln!(
                "---- libvirtd log ----\n{}{}\n---- end of libvirtd log ----",
                read_lossy(&self.dir.join("libvirtd.out")),
                read_lossy(&self.log)
            );
        }
    }
}

/// A running domain, destroyed on drop (and its QEMU killed if libvirt cannot).
struct Domain<'a> {
    lv: &'a Libvirtd,
    name: String,
}

impl Domain<'_> {
    /// Whether libvirt still has the domain (a transient domain is gone once it shut off).
    fn exists(&self) -> bool {
        self.lv.virsh(&["domstate", &self.name]).is_ok()
    }
}

impl Drop for Domain<'_> {
    fn drop(&mut self) {
        if !self.exists() {
            return;
        }
        if let Err(e) = self.lv.virsh(&["destroy", &self.name]) {
            eprintln!("libvirt test: {e}");
            let pidfile = self.lv.dir.join(format!("run/qemu/{}.pid", self.name));
            if let Some(pid) = std::fs::read_to_string(pidfile)
                .ok()
                .and_then(|p| p.trim().parse().ok())
            {
                kill(pid, libc::SIGKILL);
            }
        }
    }
}

/// What the host did for the guest's `BLKPLANE-HOST` requests.
struct Host<'a> {
    d: &'a Daemon,
    lv: &'a Libvirtd,
    domain: &'a str,
    vhost_dir: &'a Path,
    vm_dir: &'a Path,
    vd2_image: &'a Path,
}

impl Host<'_> {
    /// `disk show ID`.
    fn disk(&self, id: &str) -> Json {
        self.d.disk(id)
    }

    /// Waits until `pred` holds for disk `id` (at most `timeout`).
    fn wait_disk(
        &self,
        id: &str,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Json) -> bool,
    ) -> Result<Json, String> {
        let mut last = None;
        wait_for(timeout, || {
            let j = self.disk(id);
            let ok = pred(&j);
            last = Some(j.clone());
            ok.then_some(j)
        })
        .ok_or_else(|| format!("disk {id} not {what} within {timeout:?}: {last:?}"))
    }

    fn act(&self, action: &str) -> Result<String, String> {
        match action {
            "hotplug" => self.hotplug(),
            "unplug" => self.unplug(),
            "crash-frontend" => self.crash_frontend(),
            other => Err(format!("unknown action {other:?}")),
        }
    }

    /// The docs' hotplug file with this test's socket.
    fn hotplug_file(&self) -> PathBuf {
        let path = self.vm_dir.join("hotplug-disk.xml");
        let sock = self.vhost_dir.join("vd2.sock");
        let xml = substitute(
            "docs/examples/libvirt-hotplug-disk.xml",
            HOTPLUG_XML,
            &[("/run/blkplane-vhost/vd2.sock", sock.to_str().unwrap())],
        );
        std::fs::write(&path, xml).unwrap();
        path
    }

    /// Adds vd2 to blkplaned and attaches it to the running domain, as docs/kubevirt.md's
    /// "Hotplug" says.
    fn hotplug(&self) -> Result<String, String> {
        let started = Instant::now();
        let sock = self.vhost_dir.join("vd2.sock");
        let out = self.d.ctl(&[
            "disk",
            "add",
            "vd2",
            "--image",
            self.vd2_image.to_str().unwrap(),
            "--vhost-socket",
            sock.to_str().unwrap(),
            "--serial",
            VD2_SERIAL,
        ]);
        if out.code != Some(0) {
            return Err(format!("disk add vd2: {}{}", out.stderr, out.stdout));
        }
        let added = started.elapsed();
        let file = self.hotplug_file();
        let said = self.lv.virsh(&[
            "attach-device",
            self.domain,
            file.to_str().unwrap(),
            "--live",
        ])?;
        let attached = started.elapsed();
        self.wait_disk("vd2", "connected", RECOVERY_TIMEOUT, |j| {
            j.get("vmm_connected").bool()
        })?;
        let blk = self.lv.virsh(&["domblklist", self.domain])?;
        if !blk.contains(sock.to_str().unwrap()) {
            return Err(format!(
                "virsh domblklist does not list vd2's socket:\n{blk}"
            ));
        }
        Ok(format!(
            "hotplug: blkplanectl disk add vd2 in {added:.1?}; virsh attach-device --live \
             ({}) after {attached:.1?}; QEMU connected to vd2 after {:.1?}",
            said.trim(),
            started.elapsed()
        ))
    }

    /// Detaches vd2: libvirt must drop it from the domain and close its socket, so that
    /// blkplaned removes the disk without `--force`.
    fn unplug(&self) -> Result<String, String> {
        let started = Instant::now();
        let file = self.hotplug_file();
        let said = self.lv.virsh(&[
            "detach-device",
            self.domain,
            file.to_str().unwrap(),
            "--live",
        ])?;
        let requested = started.elapsed();
        let sock = self.vhost_dir.join("vd2.sock");
        let mut xml = String::new();
        wait_for(GONE_TIMEOUT, || {
            xml = self.lv.virsh(&["dumpxml", self.domain]).ok()?;
            (!xml.contains(sock.to_str().unwrap())).then_some(())
        })
        .ok_or_else(|| {
            format!("vd2 still in the domain {GONE_TIMEOUT:?} after detach-device:\n{xml}")
        })?;
        let dropped = started.elapsed();
        self.wait_disk("vd2", "disconnected", RECOVERY_TIMEOUT, |j| {
            !j.get("vmm_connected").bool()
        })?;
        let out = self.d.ctl(&["disk", "remove", "vd2"]);
        if out.code != Some(0) {
            return Err(format!(
                "disk remove vd2 (without --force) after the detach: {}{}",
                out.stderr, out.stdout
            ));
        }
        Ok(format!(
            "unplug: virsh detach-device --live ({}) in {requested:.1?}; gone from the domain \
             after {dropped:.1?}; QEMU closed the socket and blkplanectl disk remove vd2 \
             (no --force) succeeded after {:.1?}",
            said.trim(),
            started.elapsed()
        ))
    }

    /// kill -9 of vd1's frontend with requests in flight; blkplaned restarts it, QEMU
    /// reconnects and the new frontend resubmits them.
    fn crash_frontend(&self) -> Result<String, String> {
        let before = self.disk("vd1");
        let old = before.get("frontend_pid").u64() as u32;
        let restarts = before.get("restarts").u64();
        let admin = format!(
            "--admin-socket={}",
            self.d.disks_dir().join("vd1.admin").display()
        );
        if !cmdline(old).contains(&admin) {
            return Err(format!(
                "pid {old} is not vd1's frontend: {:?}",
                cmdline(old)
            ));
        }
        let log_path = self.d.disks_dir().join("vd1.log");
        let log_before = read_lossy(&log_path).len();
        // The iothreads complete each request within microseconds: stopped, they let the
        // guest's requests pile up, so that the kill finds some in flight.
        let iothreads = iothread_pids(old);
        if iothreads.is_empty() {
            return Err(format!("vd1's frontend {old} has no iothread"));
        }
        for &pid in &iothreads {
            kill(pid, libc::SIGSTOP);
        }
        let in_flight = wait_for(IN_FLIGHT_TIMEOUT, || {
            let s = self.d.ctl_json(&["stats", "vd1"]);
            let n = s.arr().first()?.get("total").get("in_flight").u64();
            (n > 0).then_some(n)
        });
        let started = Instant::now();
        kill(old, libc::SIGKILL);
        // Stopped processes take a SIGKILL (their parent-death signal, frontend → spawner →
        // iothread) all the same. Continued before it arrives, an iothread would run what it
        // had been handed and exit cleanly, leaving nothing in flight to resubmit: wait for
        // them to be gone, and only then continue any that survived, so none is left stopped.
        let _ = wait_for(Duration::from_secs(10), || {
            iothreads.iter().all(|&pid| !alive(pid)).then_some(())
        });
        for &pid in &iothreads {
            kill(pid, libc::SIGCONT);
        }
        let in_flight = in_flight.ok_or(format!(
            "no request in flight on vd1 within {IN_FLIGHT_TIMEOUT:?}"
        ))?;
        let after = self.wait_disk("vd1", "restarted and connected", RECOVERY_TIMEOUT, |j| {
            j.get("restarts").u64() == restarts + 1
                && j.get("frontend_pid").u64() as u32 != old
                && j.get("vmm_connected").bool()
        })?;
        let connected = started.elapsed();
        // "queue Q: resubmitting N requests in flight before the reconnect"
        let resubmitted: u64 = wait_for(RECOVERY_TIMEOUT, || {
            let log = read_lossy(&log_path);
            let n: u64 = log
                .get(log_before..)
                .unwrap_or("")
                .lines()
                .filter_map(|l| {
                    let rest = &l[l.find("resubmitting ")? + "resubmitting ".len()..];
                    rest.split_whitespace().next()?.parse::<u64>().ok()
                })
                .sum();
            (n > 0).then_some(n)
        })
        .ok_or_else(|| {
            format!(
                "the restarted frontend resubmitted nothing ({in_flight} requests were in \
                 flight at the kill); its log:\n{}",
                read_lossy(&log_path).get(log_before..).unwrap_or("")
            )
        })?;
        Ok(format!(
            "crash-frontend: frontend {old} killed with SIGKILL with {in_flight} requests in \
             flight (iothreads {iothreads:?} stopped); blkplaned restarted it as {}, QEMU \
             reconnected after {connected:.1?} and {resubmitted} requests were resubmitted",
            after.get("frontend_pid").u64()
        ))
    }
}

/// Everything wrong with the report: failed, missing, unexpected or repeated checks.
fn report_problems(report: &Report) -> Vec<String> {
    let mut out = Vec::new();
    for c in &report.checks {
        if !c.ok {
            out.push(format!("failed: {} {}", c.name, c.detail));
        }
        if !CHECKS.contains(&c.name.as_str()) {
            out.push(format!("unexpected check {} {}", c.name, c.detail));
        }
    }
    for name in CHECKS {
        match report.checks.iter().filter(|c| c.name == *name).count() {
            0 => out.push(format!("never reported: {name}")),
            1 => {}
            n => out.push(format!("reported {n} times: {name}")),
        }
    }
    match &report.done {
        None => out.push("no BLKPLANE-DONE".into()),
        Some(d) if !d.starts_with("failed=0 ") => out.push(format!("BLKPLANE-DONE {d}")),
        Some(_) => {}
    }
    out
}

#[test]
fn libvirt_domain_with_hotplug_and_reconnect() {
    let t0 = Instant::now();
    // SAFETY: geteuid has no arguments and cannot fail.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "the libvirt test runs libvirtd and blkplaned's per-disk users as root; {LIBVIRT_HINT}"
    );
    let tools = Tools::find();
    let (_, qemu_version) = qemu_binary();
    progress(&qemu_version);
    let uid = id_of("/etc/passwd", "libvirt-qemu");
    let gid = id_of("/etc/group", "libvirt-qemu");

    let scratch = TempDir::new("lv");
    let guest = build_guest(scratch.path());
    progress(&guest.info);
    binaries();

    // Directories QEMU (uid libvirt-qemu) reaches: the vhost-user sockets, and the domain's
    // kernel, initramfs and serial files. The kernel and initramfs are copies because libvirt
    // hands the files it boots to the QEMU user (chown) for the domain's lifetime.
    let vhost_dir = TempDir::new("lv-vhost");
    let vm_dir = TempDir::new("lv-vm");
    let kernel = vm_dir.join("vmlinuz");
    let initrd = vm_dir.join("initrd.img");
    std::fs::copy(&guest.kernel, &kernel).unwrap();
    std::fs::copy(&guest.initrd, &initrd).unwrap();
    // The images belong to the disks' user, as a VM's images belong to its QEMU.
    let vd1_image = create_image(&scratch.join("vd1.img"), VD1_SIZE);
    let vd2_image = create_image(&scratch.join("vd2.img"), VD2_SIZE);
    for img in [&vd1_image, &vd2_image] {
        std::os::unix::fs::chown(img, Some(uid), Some(gid)).unwrap();
    }

    let d = Daemon::start("lv-daemon", &["--disk-user", &format!("{uid}:{gid}")]);
    let vd1_sock = vhost_dir.join("vd1.sock");
    d.ctl_ok(&[
        "disk",
        "add",
        "vd1",
        "--image",
        vd1_image.to_str().unwrap(),
        "--vhost-socket",
        vd1_sock.to_str().unwrap(),
        "--serial",
        VD1_SERIAL,
    ]);

    let lv_started = Instant::now();
    let lv = Libvirtd::start(
        tools,
        &scratch.join("libvirt"),
        "libvirt-qemu",
        "libvirt-qemu",
    );
    let version = lv.virsh(&["version"]).unwrap();
    progress(&format!(
        "libvirtd answered after {:.1?}: {}",
        lv_started.elapsed(),
        version.split_whitespace().collect::<Vec<_>>().join(" ")
    ));

    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let nonce = format!("{:x}{:x}", std::process::id(), nanos & 0xffff_ffff);
    let name = format!("bp-libvirt-{nonce}");
    let console = vm_dir.join("console.log");
    let results = vm_dir.join("results.log");
    let append = format!(
        "console=ttyS0 panic=-1 bp.mode=libvirt bp.nonce={nonce} bp.size={VD1_SIZE} \
         bp.serial={VD1_SERIAL} bp.queues=1 bp.lbs=512 bp.hp_serial={VD2_SERIAL} \
         bp.hp_size={VD2_SIZE}"
    );
    let results_port = format!(
        "<serial type='file'>\n      <source path='{}'/>\n      <target port='1'/>\n    \
         </serial>\n  </devices>",
        results.display()
    );
    let domain_xml = substitute(
        "docs/examples/libvirt-domain.xml",
        DOMAIN_XML,
        &[
            ("<domain type='kvm'>", "<domain type='qemu'>"),
            ("<name>vm1</name>", &format!("<name>{name}</name>")),
            (
                "/var/lib/libvirt/boot/vm1-vmlinuz",
                kernel.to_str().unwrap(),
            ),
            (
                "/var/lib/libvirt/boot/vm1-initrd.img",
                initrd.to_str().unwrap(),
            ),
            (
                "<cmdline>console=ttyS0</cmdline>",
                &format!("<cmdline>{append}</cmdline>"),
            ),
            ("/run/blkplane-vhost/vd1.sock", vd1_sock.to_str().unwrap()),
            (
                "/var/log/libvirt/qemu/vm1-console.log",
                console.to_str().unwrap(),
            ),
            ("  </devices>", &results_port),
        ],
    );
    let domain_file = vm_dir.join("domain.xml");
    std::fs::write(&domain_file, &domain_xml).unwrap();

    let boot_started = Instant::now();
    let created = lv.virsh(&["create", domain_file.to_str().unwrap()]);
    let domain = Domain {
        lv: &lv,
        name: name.clone(),
    };
    let created = created.unwrap_or_else(|e| {
        panic!(
            "{e}\n---- QEMU log ----\n{}",
            read_lossy(&lv.qemu_log(&name))
        )
    });
    progress(&format!(
        "virsh create in {:.1?}: {}",
        boot_started.elapsed(),
        created.trim()
    ));

    let host = Host {
        d: &d,
        lv: &lv,
        domain: &name,
        vhost_dir: vhost_dir.path(),
        vm_dir: vm_dir.path(),
        vd2_image: &vd2_image,
    };
    let vd1_log = d.disks_dir().join("vd1.log");
    let deadline = boot_started + GUEST_TIMEOUT;
    let mut shown = 0;
    let mut host_actions: Vec<String> = Vec::new();
    let mut last_domain_check = Instant::now();
    let outcome: Result<(), String> = loop {
        std::thread::sleep(Duration::from_millis(250));
        let report = Report::parse(&read_lossy(&results));
        let mut requested = Vec::new();
        for line in &report.lines[shown..] {
            progress(&format!("[{:>5.1?}] {line}", boot_started.elapsed()));
            if let Some(action) = line.strip_prefix("BLKPLANE-HOST ") {
                requested.push(action.trim().to_string());
            }
        }
        shown = report.lines.len();
        let mut failed_action = None;
        for action in requested {
            match host.act(&action) {
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
        // Until the guest is done, QEMU stays connected to vd1 but for the one kill.
        if let Some(line) = read_lossy(&vd1_log)
            .lines()
            .find(|l| l.contains("VMM disconnected"))
        {
            break Err(format!(
                "vd1's frontend lost QEMU while the guest ran: {line}"
            ));
        }
        let console_text = read_lossy(&console);
        if console_text.contains("Kernel panic") {
            break Err("the guest kernel panicked".into());
        }
        if last_domain_check.elapsed() >= Duration::from_secs(2) {
            last_domain_check = Instant::now();
            if !domain.exists() {
                break Err("the domain went away before the guest was done".into());
            }
        }
        if Instant::now() >= deadline {
            break Err(format!("the guest did not finish within {GUEST_TIMEOUT:?}"));
        }
    };
    let guest_time = boot_started.elapsed();

    let mut problems: Vec<String> = Vec::new();
    if let Err(e) = &outcome {
        problems.push(e.clone());
    }
    // The guest powers off after BLKPLANE-DONE; on_poweroff destroy, and a transient domain
    // is gone then.
    if outcome.is_ok() && wait_for(GONE_TIMEOUT, || (!domain.exists()).then_some(())).is_none() {
        problems.push(format!(
            "the domain was still there {GONE_TIMEOUT:?} after the guest's poweroff"
        ));
    }
    let report = Report::parse(&read_lossy(&results));
    problems.extend(report_problems(&report));
    if outcome.is_ok() {
        let want = ["hotplug:", "unplug:", "crash-frontend:"];
        for w in want {
            if !host_actions.iter().any(|a| a.starts_with(w)) {
                problems.push(format!("the guest never asked for {w}"));
            }
        }
        let vd1 = d.disk("vd1");
        if vd1.get("restarts").u64() != 1 {
            problems.push(format!(
                "vd1's frontend restarted {} times, want 1 (the kill)",
                vd1.get("restarts").u64()
            ));
        }
        let ids: Vec<String> = d
            .ctl_json(&["disk", "list"])
            .arr()
            .iter()
            .map(|j| j.get("id").str().to_string())
            .collect();
        if ids != ["vd1"] {
            problems.push(format!(
                "blkplaned's disks after the run: {ids:?}, want [vd1]"
            ));
        }
    }
    // A Linux guest behind QEMU is a well-behaved driver: nothing may have been refused.
    let log = read_lossy(&vd1_log);
    if let Some(l) = log
        .lines()
        .find(|l| l.contains("rejected request") || l.contains("refused vhost-user"))
    {
        problems.push(format!("vd1's frontend refused something: {l}"));
    }

    // Keep the last run's files for a look after the fact.
    let keep = target_dir().join("libvirt").join("last-run");
    let _ = std::fs::remove_dir_all(&keep);
    if std::fs::create_dir_all(&keep).is_ok() {
        for (f, n) in [
            (console.clone(), "console.log"),
            (results.clone(), "results.log"),
            (domain_file.clone(), "domain.xml"),
            (lv.qemu_log(&name), "qemu.log"),
            (lv.log.clone(), "libvirtd.log"),
            (vd1_log.clone(), "frontend-vd1.log"),
        ] {
            let _ = std::fs::copy(f, keep.join(n));
        }
    }

    if !problems.is_empty() {
        let mut msg = String::new();
        let _ = writeln!(
            msg,
            "---- guest console ----\n{}\n---- guest results port ----\n{}\n---- QEMU log \
             ----\n{}\n---- end ----",
            tail(&read_lossy(&console), 128 * 1024),
            read_lossy(&results),
            read_lossy(&lv.qemu_log(&name))
        );
        eprintln!("{msg}");
        eprintln!("logs kept in {}", keep.display());
        panic!(
            "libvirt test failed after {guest_time:.1?}:\n  {}",
            problems.join("\n  ")
        );
    }

    let mut summary = format!(
        "libvirt domain {name}: all {} guest checks passed in {guest_time:.1?}; total \
         {:.1?}:\n",
        report.checks.len(),
        t0.elapsed()
    );
    for c in &report.checks {
        let _ = writeln!(summary, "  ok {:<16} {}", c.name, c.detail);
    }
    for h in &host_actions {
        let _ = writeln!(summary, "  ok host: {h}");
    }
    progress(summary.trim_end());
    drop(domain);
}
