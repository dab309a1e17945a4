//! `blkplane-frontend`: serves one disk image to a VMM over vhost-user-blk, one process per
//! disk. It validates the virtqueues itself and hands batches of requests to its
//! `blkplane-iothread` processes over shared-memory rings.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use clap::builder::TypedValueParser;
use clap::Parser;
use log::{error, info};
use vhost::vhost_user::Listener;

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;

use blkplane_chain::ImageFormat;
use blkplane_frontend::backend_channel::BackendChannel;
use blkplane_frontend::config::{CacheMode, DiskConfig, MAX_QUEUE_SIZE};
use blkplane_frontend::image::{Image, ImageSpec};
use blkplane_frontend::iothread::IothreadLink;
use blkplane_frontend::lifecycle::Quiescer;
use blkplane_frontend::resize::DiskResizer;
use blkplane_frontend::spawner::Spawner;
use blkplane_frontend::stats::DeviceStatus;
use blkplane_frontend::throttle_control::ThrottleControl;
use blkplane_frontend::vhost_user::BlkBackend;
use blkplane_frontend::worker::{WorkerHandle, WorkerStatistics, Workers};
use blkplane_frontend::write_tracking::WriteTracking;
use blkplane_frontend::{admin, config, session, socket_lock};

/// Serve a disk image to a VMM (QEMU, cloud-hypervisor, libblkio) as a vhost-user-blk device.
#[derive(Debug, Parser)]
#[command(version = blkplane_build_info::VERSION, about)]
struct Args {
    /// UNIX socket to listen on for the VMM (created; a stale file is replaced).
    #[arg(long)]
    socket: PathBuf,
    /// Disk image: a regular file or a block device. Its size is the disk's capacity.
    /// `null:SIZE` (bytes, or with a K/M/G/T suffix, e.g. null:8G) serves a null image instead,
    /// a benchmarking aid: reads return zeros, writes are dropped, nothing touches a disk.
    #[arg(long, value_name = "PATH|null:SIZE",
          value_parser = clap::builder::OsStringValueParser::new().try_map(ImageSpec::parse))]
    image: ImageSpec,
    /// Image format: raw or qcow2 (with its backing chain). Without it the format is probed
    /// from the image's first bytes; an image that must be served raw although it starts with
    /// qcow2's magic (a guest may have written one) needs `--format raw`.
    #[arg(long, value_enum)]
    format: Option<ImageFormat>,
    /// Restrict a qcow2 image's backing files to this directory (repeatable; symlinks and
    /// `..` are resolved). Without it a backing file may be anywhere the header names.
    #[arg(long = "image-dir", value_name = "DIR")]
    image_dirs: Vec<PathBuf>,
    /// Offer the disk read-only (VIRTIO_BLK_F_RO); writes, discards and write-zeroes fail.
    #[arg(long)]
    read_only: bool,
    /// Serial number reported to the guest (GET_ID), at most 20 bytes.
    #[arg(long, default_value = "")]
    serial: String,
    /// Number of request queues (virtio-blk multiqueue).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
    num_queues: u16,
    /// Largest ring size the VMM may choose (a power of two up to 32768).
    #[arg(long, default_value_t = 256, value_parser = parse_queue_size)]
    queue_size: u16,
    /// Number of iothread processes; queue q is served by iothread q mod N.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    iothreads: u16,
    /// Logical block size reported to the guest, in bytes.
    #[arg(long, default_value_t = 512, value_parser = parse_block_size)]
    block_size: u32,
    /// CPUs the iothreads may run on, e.g. `0-1,3` (default: all).
    #[arg(long, value_parser = config::parse_cpu_list)]
    iothread_cpus: Option<config::CpuList>,
    /// UNIX socket for blkplaned's admin channel (status, statistics, resize); none if unset.
    #[arg(long)]
    admin_socket: Option<PathBuf>,
    /// Host cache mode: direct (O_DIRECT), writeback or writethrough.
    #[arg(long, value_enum, default_value_t = CacheMode::Direct)]
    cache: CacheMode,
    /// The blkplane-iothread binary (default: next to this executable).
    #[arg(long)]
    iothread_binary: Option<PathBuf>,
    /// Start drained, as after an admin Drain without flush, before any VMM can connect: no
    /// ring is served until a Resume on the admin channel. blkplaned restarts the frontend of
    /// a drained disk this way, and starts the destination of a copy of a local disk from
    /// another node this way until its image is complete.
    #[arg(long, requires = "admin_socket")]
    drained: bool,
    /// A live-migration destination on storage another node wrote (blkplaned's
    /// `incoming_from` with shared storage): before the first ring starts, and so before any
    /// request is served, drop what this node's page cache holds of the image, which may
    /// predate the source node's last writes.
    #[arg(long)]
    incoming_shared: bool,
    /// Bound of the adaptive polling, in microseconds: a worker with requests in flight
    /// watches its avail rings for the driver's next request, and an iothread with nothing at
    /// the device its submission queue for the worker's next slot, up to this long before
    /// they sleep (the windows adapt, as QEMU's poll-max-ns; an idle disk never polls). 0
    /// disables both.
    #[arg(long, default_value_t = DEFAULT_POLL_MAX_US, value_parser = clap::value_parser!(u32).range(0..=MAX_POLL_MAX_US))]
    poll_max_us: u32,
    /// Serve as this user, group and supplementary groups (numeric, `UID:GID[:GROUP,...]`;
    /// needs root). The image is opened with this user's permissions; the sockets are bound
    /// and the iothread spawner forked as root; then every process of the disk switches to
    /// the user, and the vhost-user socket is handed to it, so a VMM of that user connects.
    #[arg(long, value_name = "UID:GID[:GROUP,...]")]
    run_as: Option<blkplane_sandbox::RunAs>,
}

/// `--poll-max-us` by default (see BENCHMARKS.md for how it was chosen).
const DEFAULT_POLL_MAX_US: u32 = 400;
/// The largest `--poll-max-us`: the largest an iothread's `Setup` may carry.
const MAX_POLL_MAX_US: i64 = blkplane_proto::control::MAX_POLL_MAX_US as i64;

/// How long a starting frontend waits for the processes of a previous one on the same socket.
const SOCKET_LOCK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

fn parse_queue_size(s: &str) -> Result<u16, String> {
    let n: u16 = s.parse().map_err(|e| format!("{e}"))?;
    if n >= 2 && n.is_power_of_two() && n <= MAX_QUEUE_SIZE {
        Ok(n)
    } else {
        Err(format!("{n} is not a power of two in 2..={MAX_QUEUE_SIZE}"))
    }
}

fn parse_block_size(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(n @ (512 | 4096)) => Ok(n),
        _ => Err(format!("{s}: the block size must be 512 or 4096")),
    }
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    // First, while this is the only thread (capabilities are per thread) and before anything
    // is opened: only what this process opens itself stays open.
    if let Err(e) = blkplane_sandbox::close_inherited_fds() {
        error!("closing inherited descriptors: {e}");
        return ExitCode::FAILURE;
    }
    // Parsing opens nothing and starts no thread.
    let args = Args::parse();
    let dropped = match args.run_as {
        None => blkplane_sandbox::drop_capabilities(),
        Some(_) => blkplane_sandbox::keep_only_identity_capabilities(),
    };
    if let Err(e) = dropped {
        error!("{e}");
        return ExitCode::FAILURE;
    }
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), String> {
    if let Some(size) = args.image.null_size() {
        // A file's partial last block is simply not exposed; a null image has no reason to
        // have one.
        if size.checked_rem(u64::from(args.block_size)) != Some(0) {
            return Err(format!(
                "the null image size {size} is not a multiple of the block size {}",
                args.block_size
            ));
        }
    }
    let image = match &args.run_as {
        None => Image::open_in(
            &args.image,
            args.read_only,
            args.cache,
            args.format,
            &args.image_dirs,
        ),
        // With the disk user's permissions, as its VMM would open it.
        Some(run_as) => blkplane_sandbox::open_as(run_as, || {
            Image::open_in(
                &args.image,
                args.read_only,
                args.cache,
                args.format,
                &args.image_dirs,
            )
        })
        .map_err(|e| e.to_string())?,
    }
    .map_err(|e| e.to_string())?;
    if image.size() < u64::from(args.block_size) {
        return Err(format!("image {} is smaller than one block", args.image));
    }
    let mut disk = DiskConfig::new(
        image.size(),
        args.read_only,
        &args.serial,
        args.num_queues,
        args.queue_size,
        args.block_size,
        args.cache,
    );
    disk.poll_max = std::time::Duration::from_micros(u64::from(args.poll_max_us));
    let disk = Arc::new(disk);
    let iothread_binary = match args.iothread_binary {
        Some(path) => path,
        None => std::env::current_exe()
            .map_err(|e| format!("cannot find own executable: {e}"))?
            .with_file_name("blkplane-iothread"),
    };
    let image = Arc::new(image);
    // Before any iothread exists (they inherit it) and before the socket listens: a crashed
    // predecessor's iothreads must be gone before its requests are resubmitted.
    let socket_lock =
        socket_lock::acquire(&args.socket, SOCKET_LOCK_TIMEOUT).map_err(|e| e.to_string())?;
    // Forked while this process still has one thread; it keeps the lock for the iothreads.
    let spawner = Arc::new(
        Spawner::start(
            &iothread_binary,
            &[socket_lock.as_raw_fd()],
            args.run_as.as_ref(),
        )
        .map_err(|e| e.to_string())?,
    );
    // More iothreads than queues would idle. A qcow2 image's metadata has one owner: its
    // queues share one iothread.
    let iothreads = match &*image {
        Image::File(file) if file.format == ImageFormat::Qcow2 => {
            if args.iothreads > 1 {
                log::info!(
                    "a qcow2 image is served by one iothread (its metadata has one owner); \
                     --iothreads {} ignored",
                    args.iothreads
                );
            }
            1
        }
        _ => args.iothreads.min(args.num_queues),
    };
    let status = Arc::new(DeviceStatus::new(args.num_queues, iothreads));
    let backend_channel = Arc::new(BackendChannel::default());
    let mut workers = Vec::with_capacity(usize::from(iothreads));
    for index in 0..iothreads {
        let queue_ids: Vec<u16> = (index..args.num_queues)
            .step_by(usize::from(iothreads))
            .collect();
        let slot_count = u32::try_from(queue_ids.len())
            .unwrap_or(u32::MAX)
            .saturating_mul(u32::from(args.queue_size));
        let mut link = IothreadLink::new(
            usize::from(index),
            Arc::clone(&spawner),
            Arc::clone(&image),
            args.block_size,
            slot_count,
            disk.segments_per_slot(),
        )
        .map_err(|e| e.to_string())?;
        if let Some(cpus) = &args.iothread_cpus {
            link.set_cpus(&cpus.0);
        }
        link.set_poll_max(disk.poll_max);
        let worker = WorkerHandle::spawn(
            usize::from(index),
            Arc::clone(&disk),
            Arc::clone(&status),
            link,
            queue_ids,
        )
        .map_err(|e| format!("starting iothread {index}: {e}"))?;
        workers.push(worker);
    }
    let workers = Workers::new(workers);
    let backend = Arc::new(Mutex::new(
        BlkBackend::new(
            Arc::clone(&disk),
            Arc::clone(&status),
            Arc::clone(&backend_channel),
            Arc::clone(&image),
            workers.clone(),
        )
        .with_stale_cache(args.incoming_shared),
    ));
    let quiescer = Arc::new(Quiescer::new(
        workers.clone(),
        Arc::clone(&image),
        Arc::clone(&status),
    ));
    if args.drained {
        // Before the socket listens: no VMM can have had a request served.
        quiescer
            .drain(false)
            .map_err(|e| format!("starting drained: {e}"))?;
    }
    if let Some(path) = &args.admin_socket {
        let resizer = DiskResizer::new(
            Arc::clone(&disk),
            Arc::clone(&image),
            Arc::clone(&backend_channel),
            workers.clone(),
        );
        let services = admin::Services {
            status: Arc::clone(&status),
            resize: Arc::new(resizer),
            lifecycle: quiescer,
            limits: Arc::new(ThrottleControl::new(workers.clone())),
            writes: Arc::new(WriteTracking::new(workers.clone(), Arc::clone(&status))),
            statistics: Arc::new(WorkerStatistics(workers)),
        };
        admin::serve(path, services).map_err(|e| e.to_string())?;
    }
    let listener = Listener::new(&args.socket, true)
        .map_err(|e| format!("cannot listen on {}: {e}", args.socket.display()))?;
    if let Some(run_as) = &args.run_as {
        // The VMM runs as the disk's user, and connect() needs write permission. lchown: a
        // symlink put in place of the socket must not hand its target to the user.
        std::os::unix::fs::lchown(&args.socket, Some(run_as.uid), Some(run_as.gid))
            .map_err(|e| format!("cannot hand {} to {run_as}: {e}", args.socket.display()))?;
        blkplane_sandbox::switch_identity(run_as).map_err(|e| e.to_string())?;
        info!("running as {run_as}");
    }
    // Everything that needs a path or a new process is done: from here on the frontend only
    // serves (see blkplane-sandbox for what its filter allows).
    #[cfg(debug_assertions)]
    blkplane_sandbox::arm_forbidden_syscall_hook().map_err(|e| format!("test hook: {e}"))?;
    blkplane_sandbox::lock_down(
        blkplane_sandbox::Profile::Frontend,
        blkplane_sandbox::Enforcement::from_env(),
    )
    .map_err(|e| e.to_string())?;
    info!(
        "serving {} ({} sectors{}) on {}",
        args.image,
        disk.capacity(),
        if args.read_only { ", read-only" } else { "" },
        args.socket.display()
    );
    loop {
        let stream = match listener.accept() {
            Ok(Some(stream)) => stream,
            Ok(None) => continue,
            Err(e) => {
                error!("accept: {e}");
                std::thread::sleep(std::time::Duration::from_millis(100));
                continue;
            }
        };
        info!("VMM connected");
        status.vmm_connected.store(true, Ordering::Relaxed);
        let reason = session::serve(stream, &backend, &backend_channel);
        info!("VMM disconnected: {reason}");
        status.vmm_connected.store(false, Ordering::Relaxed);
    }
}
