//! Starting and stopping the back-ends: `blkplane-frontend` (with its iothreads),
//! `qemu-storage-daemon` and cloud-hypervisor's `vhost_user_block`, each listening on a
//! vhost-user socket of its own.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::BenchError;
use crate::procfs;
use crate::workload::{ImageKind, Target};

/// How long a back-end may take to listen on its socket.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a back-end may take to exit after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// A set of CPUs, from a list like `0`, `0,1` or `0-1`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuList {
    cpus: Vec<usize>,
    text: String,
}

impl CpuList {
    /// Parses a CPU list as taskset -c takes it.
    pub fn parse(text: &str) -> Result<Self, String> {
        Ok(Self {
            cpus: blkplane_proto::cpus::parse_cpu_list(text)?,
            text: text.to_owned(),
        })
    }

    /// Every online CPU (to undo an inherited pinning).
    pub fn all_online() -> Self {
        let n = procfs::online_cpus();
        Self {
            cpus: (0..n).collect(),
            text: format!("0-{}", n - 1),
        }
    }

    /// As given on the command line.
    pub fn text(&self) -> &str {
        &self.text
    }

    fn set(&self) -> libc::cpu_set_t {
        // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for &cpu in &self.cpus {
            // SAFETY: `cpu` < CPU_SETSIZE, checked in `parse`.
            unsafe { libc::CPU_SET(cpu, &mut set) };
        }
        set
    }

    /// Pins the calling thread (and whatever it spawns afterwards) to these CPUs, as
    /// `taskset -c` does for a command.
    pub fn pin_current_thread(&self) -> io::Result<()> {
        pin(&self.set())
    }
}

fn pin(set: &libc::cpu_set_t) -> io::Result<()> {
    // SAFETY: the set is a valid cpu_set_t of the size we pass; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Everything the back-ends need besides the workload.
#[derive(Debug, Clone)]
pub struct BackendConfig {
    /// Where blkplane-frontend and blkplane-iothread are.
    pub bin_dir: PathBuf,
    /// The qemu-storage-daemon binary.
    pub qsd: PathBuf,
    /// cloud-hypervisor's vhost_user_block binary (needed only if ch is a target).
    pub ch: Option<PathBuf>,
    /// The raw image in tmpfs.
    pub shm_image: PathBuf,
    /// The raw image on the real disk.
    pub disk_image: PathBuf,
    /// Disk size in bytes (the null images get the same).
    pub size: u64,
    /// Whether the shm image is opened with O_DIRECT (tmpfs can since Linux 6.6); the disk
    /// image always is.
    pub shm_direct: bool,
    /// The allocated qcow2 image (tmpfs).
    pub qcow2_image: PathBuf,
    /// The fresh qcow2 image (tmpfs), made anew before every run.
    pub qcow2_fresh_image: PathBuf,
    /// The allocated qcow2 image on the real disk.
    pub qcow2_disk_image: PathBuf,
    /// The fresh qcow2 image on the real disk, made anew before every run.
    pub qcow2_disk_fresh_image: PathBuf,
    /// The qcow2 overlay on the raw disk image, made anew before every run.
    pub qcow2_overlay_image: PathBuf,
    /// CPUs for the back-end; `None` leaves it unpinned.
    pub cpus: Option<CpuList>,
    /// Where the sockets and logs go.
    pub work_dir: PathBuf,
}

impl BackendConfig {
    /// The image file behind `kind`; `None` for the null image.
    pub fn image(&self, kind: ImageKind) -> Option<&Path> {
        match kind {
            ImageKind::Shm => Some(&self.shm_image),
            ImageKind::Disk => Some(&self.disk_image),
            ImageKind::Qcow2 => Some(&self.qcow2_image),
            ImageKind::Qcow2Fresh => Some(&self.qcow2_fresh_image),
            ImageKind::Qcow2Disk => Some(&self.qcow2_disk_image),
            ImageKind::Qcow2DiskFresh => Some(&self.qcow2_disk_fresh_image),
            ImageKind::Qcow2Overlay => Some(&self.qcow2_overlay_image),
            ImageKind::Null => None,
        }
    }

    /// Whether every target opens the image of `kind` with O_DIRECT.
    pub fn direct(&self, kind: ImageKind) -> bool {
        match kind {
            ImageKind::Shm | ImageKind::Qcow2 | ImageKind::Qcow2Fresh => self.shm_direct,
            ImageKind::Null => false,
            ImageKind::Disk
            | ImageKind::Qcow2Disk
            | ImageKind::Qcow2DiskFresh
            | ImageKind::Qcow2Overlay => true,
        }
    }
}

/// The command line that serves `kind` with `queues` queues on `socket`; `None` for the
/// ceiling, which has no back-end, and where the target cannot serve the kind (see
/// [`ImageKind::has`]).
pub fn command(
    target: Target,
    kind: ImageKind,
    queues: usize,
    config: &BackendConfig,
    socket: &Path,
) -> Option<(PathBuf, Vec<String>)> {
    if !kind.has(target) {
        return None;
    }
    let socket = socket.display();
    let image = config.image(kind).map(|p| p.display().to_string());
    let direct = config.direct(kind);
    let size = config.size;
    match target {
        Target::Blkplane => {
            let mut args = vec![
                "--socket".to_string(),
                socket.to_string(),
                "--image".into(),
                image.unwrap_or_else(|| format!("null:{size}")),
                "--num-queues".into(),
                queues.to_string(),
                "--iothreads".into(),
                queues.to_string(),
            ];
            // The default, --cache direct, falls back to buffered I/O by itself where the
            // file system refuses O_DIRECT; buffered on purpose is writeback. The disk image
            // says direct explicitly (and the run checks the back-end's descriptors).
            if kind.is_qcow2() {
                args.extend(["--format".into(), "qcow2".into()]);
            }
            match kind {
                ImageKind::Shm | ImageKind::Qcow2 | ImageKind::Qcow2Fresh if !direct => {
                    args.extend(["--cache".into(), "writeback".into()]);
                }
                kind if kind.on_disk() => args.extend(["--cache".into(), "direct".into()]),
                _ => {}
            }
            Some((config.bin_dir.join("blkplane-frontend"), args))
        }
        Target::Qsd => {
            let mut args = vec!["--object".to_string(), "iothread,id=iot0".into()];
            match image {
                Some(image) => {
                    let direct = if direct { "on" } else { "off" };
                    args.extend([
                        "--blockdev".into(),
                        format!(
                            "driver=file,node-name=file0,filename={image},aio=io_uring,\
                             cache.direct={direct}"
                        ),
                        "--blockdev".into(),
                        format!(
                            "driver={},node-name=disk0,file=file0",
                            if kind.is_qcow2() { "qcow2" } else { "raw" }
                        ),
                    ]);
                }
                None => args.extend([
                    "--blockdev".into(),
                    format!("driver=null-co,node-name=disk0,read-zeroes=on,size={size}"),
                ]),
            }
            // qsd 10.0's vhost-user-blk export takes one iothread for all its queues (a list of
            // iothreads is refused: "Parameters 'iothread.*' are unexpected").
            args.extend([
                "--export".into(),
                format!(
                    "type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,\
                     addr.path={socket},writable=on,num-queues={queues},iothread=iot0"
                ),
            ]);
            Some((config.qsd.clone(), args))
        }
        Target::Ch => {
            // One worker thread per queue, synchronous preadv/pwritev on the image; no polling
            // (poll_queue=false), so that it sleeps between kicks as the others do.
            let program = config
                .ch
                .clone()
                .unwrap_or_else(|| PathBuf::from("vhost_user_block"));
            let args = vec![
                "--block-backend".to_string(),
                format!(
                    "path={},socket={socket},num_queues={queues},queue_size=256,direct={direct},\
                     poll_queue=false",
                    image?
                ),
            ];
            Some((program, args))
        }
        Target::Ceiling => None,
    }
}

/// Quotes `args` for a shell, for the report.
pub fn shell_line(program: &Path, args: &[String]) -> String {
    std::iter::once(program.display().to_string())
        .chain(args.iter().cloned())
        .map(|arg| {
            let plain = arg
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_=,./:@%+".contains(&b));
            if plain && !arg.is_empty() {
                arg
            } else {
                format!("'{}'", arg.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A running back-end; stopped (and its children with it) on drop.
pub struct Backend {
    target: Target,
    child: Option<Child>,
    socket: PathBuf,
    log: PathBuf,
}

impl Backend {
    /// Starts the back-end for `target` and waits until it listens.
    pub fn start(
        target: Target,
        kind: ImageKind,
        queues: usize,
        config: &BackendConfig,
    ) -> Result<Option<Backend>, BenchError> {
        let socket = config.work_dir.join(format!("{target}.sock"));
        if let Some(reason) = kind.skip_reason(target) {
            return Err(BenchError::Missing(format!(
                "{target} cannot serve the {kind} image: {reason}"
            )));
        }
        let Some((program, args)) = command(target, kind, queues, config, &socket) else {
            return Ok(None);
        };
        let _ = std::fs::remove_file(&socket);
        let log = config.work_dir.join(format!("{target}.log"));
        let stderr =
            File::create(&log).map_err(BenchError::io(format!("creating {}", log.display())))?;
        // An explicit back-end set, or undo the client's pinning that would be inherited.
        let cpus = config.cpus.clone().map(|c| c.set());
        let unpin = CpuList::all_online().set();
        let mut command = Command::new(&program);
        command
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            // Warnings only: info lines would be noise, and a chatty back-end costs CPU.
            .env("RUST_LOG", "warn");
        // SAFETY: the closure runs between fork and exec and only makes async-signal-safe
        // system calls (prctl, sched_setaffinity) on values prepared before the fork.
        unsafe {
            command.pre_exec(move || {
                // Never outlive the benchmark, even if it is killed.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) < 0 {
                    return Err(io::Error::last_os_error());
                }
                pin(cpus.as_ref().unwrap_or(&unpin))
            });
        }
        let child = command.spawn().map_err(BenchError::io(format!(
            "starting {} (build it with cargo build --release, or pass --bin-dir / --qsd / \
             --ch-binary)",
            program.display()
        )))?;
        let mut backend = Backend {
            target,
            child: Some(child),
            socket,
            log,
        };
        backend.wait_listening()?;
        Ok(Some(backend))
    }

    fn wait_listening(&mut self) -> Result<(), BenchError> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            self.check_alive()?;
            if blkplane_procfs::is_listening(&self.socket) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(self.failure(format!("not listening after {START_TIMEOUT:?}")));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// An error if the back-end has exited.
    pub fn check_alive(&mut self) -> Result<(), BenchError> {
        let status = match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(None)) => return Ok(()),
            Some(Ok(Some(status))) => format!("exited with {status}"),
            Some(Err(e)) => format!("cannot be waited for: {e}"),
            None => "already stopped".into(),
        };
        Err(self.failure(status))
    }

    fn failure(&self, reason: String) -> BenchError {
        BenchError::Backend {
            name: self.target.to_string(),
            reason,
            log: self.log.clone(),
            tail: log_tail(&self.log),
        }
    }

    /// The vhost-user socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The back-end's processes: the main one and all its descendants (blkplane's iothread
    /// spawner and, under it, the iothreads).
    pub fn pids(&self) -> Vec<u32> {
        let Some(child) = &self.child else {
            return Vec::new();
        };
        procfs::descendants(child.id())
    }

    /// Whether the back-end has exited successfully (cloud-hypervisor's vhost_user_block
    /// exits once its one front-end has disconnected); an error if it failed or still runs
    /// after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<(), BenchError> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.as_mut().map(Child::try_wait) {
                Some(Ok(Some(status))) if status.success() => return Ok(()),
                Some(Ok(Some(status))) => return Err(self.failure(format!("exited with {status}"))),
                Some(Ok(None)) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Some(Ok(None)) => return Ok(()),
                Some(Err(e)) => return Err(self.failure(format!("cannot be waited for: {e}"))),
                None => return Ok(()),
            }
        }
    }

    /// SIGTERM, then SIGKILL if it does not exit in time; waits until its children are gone
    /// too, so that the next run starts on an idle machine.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let children = procfs::descendants(child.id());
        // SAFETY: plain kill(2) on a child we spawned and have not reaped yet.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + STOP_TIMEOUT;
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
        // blkplane's iothreads die with their frontend (PR_SET_PDEATHSIG); wait until they have.
        let deadline = Instant::now() + STOP_TIMEOUT;
        while children
            .iter()
            .any(|&pid| procfs::cpu_seconds(pid).is_some())
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The last few lines of a log, for error messages.
fn log_tail(path: &Path) -> String {
    let Ok(mut file) = File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(4096)));
    let mut tail = String::new();
    let _ = file.read_to_string(&mut tail);
    tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(CpuList::parse("1").unwrap().cpus, [1]);
        assert_eq!(CpuList::parse("0-1").unwrap().cpus, [0, 1]);
        assert_eq!(CpuList::parse("3,0-1,1").unwrap().cpus, [0, 1, 3]);
        for bad in ["", "a", "1-0", "0-", "99999"] {
            assert!(CpuList::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn command_lines() {
        let config = BackendConfig {
            bin_dir: "/b".into(),
            qsd: "qemu-storage-daemon".into(),
            ch: Some("/ch/vhost_user_block".into()),
            shm_image: "/dev/shm/x.img".into(),
            disk_image: "/var/tmp/x.img".into(),
            qcow2_image: "/dev/shm/x.qcow2".into(),
            qcow2_fresh_image: "/dev/shm/fresh.qcow2".into(),
            qcow2_disk_image: "/var/tmp/x.qcow2".into(),
            qcow2_disk_fresh_image: "/var/tmp/fresh.qcow2".into(),
            qcow2_overlay_image: "/var/tmp/overlay.qcow2".into(),
            size: 1 << 30,
            shm_direct: true,
            cpus: None,
            work_dir: "/w".into(),
        };
        let socket = Path::new("/w/s.sock");
        let line = |target, kind| {
            let (program, args) = command(target, kind, 2, &config, socket).unwrap();
            shell_line(&program, &args)
        };
        assert_eq!(
            line(Target::Blkplane, ImageKind::Null),
            "/b/blkplane-frontend --socket /w/s.sock --image null:1073741824 --num-queues 2 \
             --iothreads 2"
        );
        let qsd = line(Target::Qsd, ImageKind::Shm);
        assert!(
            qsd.contains("filename=/dev/shm/x.img,aio=io_uring,cache.direct=on"),
            "{qsd}"
        );
        assert!(qsd.contains("num-queues=2,iothread=iot0"), "{qsd}");
        let null = line(Target::Qsd, ImageKind::Null);
        assert!(null.contains("driver=null-co,node-name=disk0,read-zeroes=on,size=1073741824"));
        assert!(command(Target::Ceiling, ImageKind::Shm, 1, &config, socket).is_none());

        // The disk image: O_DIRECT everywhere, said explicitly.
        assert_eq!(
            line(Target::Blkplane, ImageKind::Disk),
            "/b/blkplane-frontend --socket /w/s.sock --image /var/tmp/x.img --num-queues 2 \
             --iothreads 2 --cache direct"
        );
        let qsd = line(Target::Qsd, ImageKind::Disk);
        assert!(
            qsd.contains("filename=/var/tmp/x.img,aio=io_uring,cache.direct=on"),
            "{qsd}"
        );
        // qcow2: blkplane told the format, qsd a qcow2 node over the file; no ceiling, no ch.
        assert_eq!(
            line(Target::Blkplane, ImageKind::Qcow2),
            "/b/blkplane-frontend --socket /w/s.sock --image /dev/shm/x.qcow2 --num-queues 2 \
             --iothreads 2 --format qcow2"
        );
        let qsd = line(Target::Qsd, ImageKind::Qcow2Fresh);
        assert!(
            qsd.contains("filename=/dev/shm/fresh.qcow2,aio=io_uring,cache.direct=on")
                && qsd.contains("driver=qcow2,node-name=disk0,file=file0"),
            "{qsd}"
        );
        assert!(command(Target::Ceiling, ImageKind::Qcow2, 1, &config, socket).is_none());
        assert!(command(Target::Ch, ImageKind::Qcow2Fresh, 1, &config, socket).is_none());
        // qcow2 on the disk: O_DIRECT for both, whatever --direct says for tmpfs.
        assert_eq!(
            line(Target::Blkplane, ImageKind::Qcow2DiskFresh),
            "/b/blkplane-frontend --socket /w/s.sock --image /var/tmp/fresh.qcow2 --num-queues 2 \
             --iothreads 2 --format qcow2 --cache direct"
        );
        let qsd = line(Target::Qsd, ImageKind::Qcow2Disk);
        assert!(
            qsd.contains("filename=/var/tmp/x.qcow2,aio=io_uring,cache.direct=on")
                && qsd.contains("driver=qcow2,node-name=disk0,file=file0"),
            "{qsd}"
        );
        assert!(command(Target::Ch, ImageKind::Qcow2Disk, 1, &config, socket).is_none());
        // cloud-hypervisor: its one option, a fresh process per run; no null image.
        assert_eq!(
            line(Target::Ch, ImageKind::Disk),
            "/ch/vhost_user_block --block-backend path=/var/tmp/x.img,socket=/w/s.sock,\
             num_queues=2,queue_size=256,direct=true,poll_queue=false"
        );
        let shm_buffered = BackendConfig {
            shm_direct: false,
            ..config.clone()
        };
        let (program, args) =
            command(Target::Ch, ImageKind::Shm, 1, &shm_buffered, socket).unwrap();
        assert!(
            shell_line(&program, &args).contains(
                "path=/dev/shm/x.img,socket=/w/s.sock,\
                 num_queues=1,queue_size=256,direct=false,poll_queue=false"
            ),
            "{args:?}"
        );
        let (_, args) =
            command(Target::Blkplane, ImageKind::Shm, 1, &shm_buffered, socket).unwrap();
        assert!(args.ends_with(&["--cache".into(), "writeback".into()]));
        assert!(command(Target::Ch, ImageKind::Null, 1, &config, socket).is_none());
        assert!(command(Target::Ceiling, ImageKind::Disk, 1, &config, socket).is_none());
        assert_eq!(
            shell_line(Path::new("a"), &["b c".into(), "it's".into()]),
            "a 'b c' 'it'\\''s'"
        );
    }
}
