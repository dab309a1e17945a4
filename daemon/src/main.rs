//! `blkplaned`: the per-node control plane. Serves the gRPC API of
//! `proto/blkplane/v1/control.proto`, runs one `blkplane-frontend` per disk, supervises it and
//! persists the set of disks. See `blkplaned --help`.
//!
//! Without `--state-dir` and `--runtime-dir` it runs on an embedded default: both directories
//! under the working directory (`blkplane-state`, `blkplane-run`), and on the first run one
//! sparse 1 GiB disk `disk0`. It prints how to attach its disks to QEMU and how to look at them.

use std::net::SocketAddr;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use blkplane_daemon::daemon::{Config, Daemon};
use blkplane_daemon::disk_log::{self, DiskLogLimit};
use blkplane_daemon::metrics;
use blkplane_daemon::pb::{AddDiskRequest, Disk};
use blkplane_daemon::peer::{PeerTls, Peers};
use blkplane_daemon::server::{self, ApiHealth, Listen};
use blkplane_daemon::settings::RestartPolicy;
use blkplane_daemon::state::{RunAsSpec, StateStore};
use blkplane_daemon::validate;
use clap::Parser;
use log::{error, info, warn};

/// State directory of the embedded default.
const DEFAULT_STATE_DIR: &str = "blkplane-state";
/// Runtime directory of the embedded default.
const DEFAULT_RUNTIME_DIR: &str = "blkplane-run";
/// The disk created on the first run of the embedded default.
const DEFAULT_DISK: &str = "disk0";
/// Its size.
const DEFAULT_DISK_SIZE: u64 = 1 << 30;

/// blkplane's control plane: owns this node's vhost-user-blk disks, serves a gRPC API
/// (blkplane.v1.Control, grpc.health.v1, reflection) and supervises one blkplane-frontend per
/// disk. Disks keep serving while blkplaned is stopped; a restarted blkplaned adopts them.
///
/// Without --state-dir and --runtime-dir: ./blkplane-state and ./blkplane-run, and on the
/// first run a sparse 1 GiB disk "disk0" (image in the state directory).
#[derive(Debug, Parser)]
#[command(name = "blkplaned", version = blkplane_build_info::VERSION)]
struct Args {
    /// Where the desired state (state.json) is persisted [default: ./blkplane-state].
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Where sockets, pid files and frontend logs live [default: ./blkplane-run].
    #[arg(long)]
    runtime_dir: Option<PathBuf>,
    /// Where the API listens: unix:PATH (mode 0600; default RUNTIME_DIR/control.sock) or
    /// tcp:ADDR:PORT (needs --tls-cert, --tls-key and --tls-client-ca).
    #[arg(long, value_name = "unix:PATH|tcp:ADDR")]
    listen: Option<String>,
    /// PEM certificate chain of the server (TCP only).
    #[arg(long, value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of the server (TCP only).
    #[arg(long, value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// PEM CA that client certificates must be signed by (TCP only; required).
    #[arg(long, value_name = "FILE")]
    tls_client_ca: Option<PathBuf>,
    /// This node's name, as other nodes' blkplaned record it when a disk migrates here (1 to
    /// 64 characters of [A-Za-z0-9._-]) [default: the host name].
    #[arg(long, value_name = "NAME")]
    node_name: Option<String>,
    /// PEM CA that other nodes' blkplaned certificates must be signed by, to reach them for a
    /// live migration across nodes (with --peer-tls-cert and --peer-tls-key).
    #[arg(long, value_name = "FILE", requires_all = ["peer_tls_cert", "peer_tls_key"])]
    peer_tls_ca: Option<PathBuf>,
    /// PEM client certificate (chain) this blkplaned shows other nodes' blkplaned, signed by
    /// the CA of their --tls-client-ca.
    #[arg(long, value_name = "FILE", requires_all = ["peer_tls_ca", "peer_tls_key"])]
    peer_tls_cert: Option<PathBuf>,
    /// PEM private key of --peer-tls-cert.
    #[arg(long, value_name = "FILE", requires_all = ["peer_tls_ca", "peer_tls_cert"])]
    peer_tls_key: Option<PathBuf>,
    /// The blkplane-frontend binary [default: next to this executable].
    #[arg(long, value_name = "PATH")]
    frontend_binary: Option<PathBuf>,
    /// Restrict vhost-user sockets to this directory (repeatable; RUNTIME_DIR/disks is always
    /// allowed). Without it any absolute path without '..' is accepted.
    #[arg(long = "socket-dir", value_name = "DIR")]
    socket_dirs: Vec<PathBuf>,
    /// Restrict images, and the backing files of qcow2 images, to this directory (repeatable;
    /// symlinks are resolved; passed to every frontend). Without it any regular file or block
    /// device is accepted, and backing files anywhere.
    #[arg(long = "image-dir", value_name = "DIR")]
    image_dirs: Vec<PathBuf>,
    /// The user, group and supplementary groups (numeric) of every disk whose configuration
    /// names none (DiskSettings `run_as`), including disks added before. Needs CAP_SETUID,
    /// CAP_SETGID, CAP_CHOWN, CAP_DAC_OVERRIDE and CAP_KILL (root). Without it such disks run
    /// as blkplaned's own user.
    #[arg(long, value_name = "UID:GID[:GROUP,...]")]
    disk_user: Option<blkplane_sandbox::RunAs>,
    /// A disk whose frontend exits this many times within --restart-window is marked failed.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    restart_max: u32,
    /// The window for --restart-max, in seconds.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    restart_window: u64,
    /// Longest wait for a frontend to serve, in seconds.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
    start_timeout: u64,
    /// How often frontends are polled for VMM connects and disconnects, in milliseconds.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(10..))]
    poll_interval_ms: u64,
    /// Rotate a disk's log (RUNTIME_DIR/disks/ID.log) once it is larger than this many bytes,
    /// checked at every poll: copied to ID.log.1 (older copies shifted up) and emptied. 0: no
    /// cap.
    #[arg(long, value_name = "BYTES", default_value_t = disk_log::DEFAULT_MAX_BYTES)]
    disk_log_max_bytes: u64,
    /// How many rotated copies of a disk's log are kept (ID.log.1 the newest; 0: none).
    #[arg(long, value_name = "N", default_value_t = disk_log::DEFAULT_KEEP,
          value_parser = clap::value_parser!(u32).range(0..=100))]
    disk_log_keep: u32,
    /// Serve Prometheus metrics (GET /metrics), liveness (GET /healthz) and readiness
    /// (GET /readyz) over plain HTTP on this address, e.g. 0.0.0.0:9090 (port 0: any free
    /// port, logged at start). Off by default.
    #[arg(long, value_name = "ADDR:PORT")]
    metrics_listen: Option<SocketAddr>,
    /// How log lines are written to stderr: text for people, or json (one object per line:
    /// time, level, target, message) for log collectors. RUST_LOG sets the level (default info).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// The forms of blkplaned's log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// env_logger's lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Sets up the logger: RUST_LOG's filter (default info), lines in `format`.
fn init_logging(format: LogFormat) {
    let mut builder =
        env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"));
    if format == LogFormat::Json {
        builder.format(|buf, record| {
            use std::io::Write as _;
            let line = serde_json::json!({
                "time": blkplane_api::time::format_time(blkplane_api::time::unix_time_ms()),
                "level": record.level().as_str(),
                "target": record.target(),
                "message": record.args().to_string(),
            });
            writeln!(buf, "{line}")
        });
    }
    builder.init();
}

fn main() -> ExitCode {
    let args = Args::parse();
    init_logging(args.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            error!("cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// Makes `p` absolute against the working directory (without resolving symlinks).
fn absolute(p: &Path) -> Result<PathBuf, String> {
    std::path::absolute(p).map_err(|e| format!("{}: {e}", p.display()))
}

async fn run(args: Args) -> Result<(), String> {
    let embedded = args.state_dir.is_none() && args.runtime_dir.is_none();
    let state_dir = absolute(
        args.state_dir
            .as_deref()
            .unwrap_or(Path::new(DEFAULT_STATE_DIR)),
    )?;
    let runtime_dir = absolute(
        args.runtime_dir
            .as_deref()
            .unwrap_or(Path::new(DEFAULT_RUNTIME_DIR)),
    )?;
    let frontend_binary = match args.frontend_binary {
        Some(p) => absolute(&p)?,
        None => std::env::current_exe()
            .map_err(|e| format!("cannot find own executable: {e}"))?
            .with_file_name("blkplane-frontend"),
    };
    if !frontend_binary.is_file() {
        return Err(format!(
            "{} does not exist: build it (cargo build --release builds every binary) or pass \
             --frontend-binary",
            frontend_binary.display()
        ));
    }
    let listen = server::parse_listen(
        args.listen.as_deref(),
        &runtime_dir.join("control.sock"),
        args.tls_cert,
        args.tls_key,
        args.tls_client_ca,
    )
    .map_err(|e| e.to_string())?;

    // Bind the control socket before anything runs: a second blkplaned on the same runtime
    // directory fails here without touching a disk, and no frontend is spawned while the
    // private umask of the bind is in force.
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(&runtime_dir)
        .map_err(|e| format!("creating {}: {e}", runtime_dir.display()))?;
    let unix_listener = match &listen {
        Listen::Unix(path) => Some(server::bind_unix(path).map_err(|e| e.to_string())?),
        Listen::Tcp { .. } => None,
    };
    // The metrics port too: one in use stops blkplaned here, before any disk is touched.
    let metrics_listener = match args.metrics_listen {
        Some(addr) => Some(metrics::bind(addr).await.map_err(|e| e.to_string())?),
        None => None,
    };
    let health = ApiHealth::new().await;

    if args.disk_user.is_some() && !validate::can_run_disks_as_other_users() {
        return Err(
            "--disk-user: blkplaned lacks CAP_SETUID, CAP_SETGID, CAP_CHOWN, \
                    CAP_DAC_OVERRIDE or CAP_KILL (run it as root)"
                .into(),
        );
    }
    let node_name = match args.node_name {
        Some(name) => name,
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .map_err(|e| format!("reading the host name for --node-name: {e}"))?,
    };
    validate::check_id_in("--node-name", &node_name).map_err(|e| {
        format!("{e} (the host name, unless --node-name gives another: name this node with it)")
    })?;
    let peers = match (args.peer_tls_ca, args.peer_tls_cert, args.peer_tls_key) {
        (Some(ca), Some(cert), Some(key)) => Peers::new(Some(PeerTls::read(&ca, &cert, &key)?)),
        // clap requires all three together.
        _ => Peers::new(None),
    };
    let first_run = !StateStore::new(&state_dir).exists();
    let daemon = Daemon::open(Config {
        state_dir,
        runtime_dir,
        frontend_binary,
        socket_dirs: args.socket_dirs,
        // Absolute: the frontends are passed them too, and check backing files against them.
        image_dirs: args
            .image_dirs
            .iter()
            .map(|d| absolute(d))
            .collect::<Result<_, _>>()?,
        disk_user: args.disk_user.map(|r| RunAsSpec {
            uid: r.uid,
            gid: r.gid,
            groups: r.groups,
        }),
        policy: RestartPolicy {
            max_crashes: args.restart_max as usize,
            window: Duration::from_secs(args.restart_window),
            ..RestartPolicy::default()
        },
        start_timeout: Duration::from_secs(args.start_timeout),
        poll_interval: Duration::from_millis(args.poll_interval_ms),
        disk_log: DiskLogLimit {
            max_bytes: args.disk_log_max_bytes,
            keep: args.disk_log_keep,
        },
        node_name,
        peers,
    })
    .await
    .map_err(|e| e.to_string())?;

    if embedded && first_run {
        let image = daemon.state_dir().join(format!("{DEFAULT_DISK}.img"));
        create_sparse(&image, DEFAULT_DISK_SIZE)?;
        let image = image
            .to_str()
            .ok_or_else(|| format!("{} is not UTF-8", image.display()))?
            .to_string();
        info!("first run: adding {DEFAULT_DISK} ({image})");
        daemon
            .add_disk(AddDiskRequest::with_image(DEFAULT_DISK, image))
            .await
            .map_err(|e| format!("adding the default disk: {e}"))?;
    }

    if let Some(listener) = metrics_listener {
        let addr = listener
            .local_addr()
            .map_err(|e| format!("--metrics-listen: the bound address: {e}"))?;
        tokio::spawn(metrics::serve(listener, daemon.clone(), health.clone()));
        // Tests and operators that asked for port 0 read the port from this line.
        info!("metrics on http://{addr} (/metrics, /healthz, /readyz)");
    }

    let api = match &listen {
        Listen::Unix(p) => format!("unix:{}", p.display()),
        Listen::Tcp { addr, .. } => format!("tcp:{addr}"),
    };
    let banner_daemon = daemon.clone();
    let banner_listen = listen.clone();
    let log_format = args.log_format;
    tokio::spawn(async move {
        let disks = banner_daemon.settle(Duration::from_secs(30)).await;
        let text = banner(&api, &banner_listen, &disks);
        match log_format {
            LogFormat::Text => {
                use std::io::Write;
                print!("{text}");
                let _ = std::io::stdout().flush();
            }
            // A collector wants nothing but records: the banner is one.
            LogFormat::Json => info!("{}", text.trim_end()),
        }
    });

    let shutdown = async {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    warn!("cannot watch SIGTERM: {e}");
                    std::future::pending::<()>().await;
                    return;
                }
            };
        tokio::select! {
            _ = term.recv() => info!("SIGTERM"),
            _ = tokio::signal::ctrl_c() => info!("SIGINT"),
        }
        info!("stopping; the disks keep serving and the next blkplaned adopts them");
    };
    server::serve(daemon, listen, unix_listener, health, shutdown)
        .await
        .map_err(|e| e.to_string())
}

/// Creates a sparse image of `size` bytes unless the file exists.
fn create_sparse(path: &Path, size: u64) -> Result<(), String> {
    if path.exists() {
        return Ok(());
    }
    let f = std::fs::File::create(path).map_err(|e| format!("creating {}: {e}", path.display()))?;
    f.set_len(size)
        .map_err(|e| format!("sizing {}: {e}", path.display()))
}

/// How to run blkplanectl from here: relative to the working directory when it is below it.
fn ctl_command() -> String {
    let exe = std::env::current_exe()
        .map(|p| p.with_file_name("blkplanectl"))
        .unwrap_or_else(|_| PathBuf::from("blkplanectl"));
    match std::env::current_dir() {
        // Relative to / is no shorter, and would read as relative to wherever it is pasted.
        Ok(cwd) if cwd == Path::new("/") => exe.display().to_string(),
        Ok(cwd) => match exe.strip_prefix(&cwd) {
            Ok(rel) => rel.display().to_string(),
            Err(_) => exe.display().to_string(),
        },
        Err(_) => exe.display().to_string(),
    }
}

/// How to attach each disk to QEMU and how to look at it with blkplanectl (printed on stdout,
/// or logged as one record with `--log-format json`).
///
/// The QEMU line is the README's: with `reconnect-ms`, QEMU reconnects to a restarted
/// frontend and resubmits what was in flight, which is what makes a frontend crash invisible
/// to the guest; a line without it would silently lose that.
fn banner(api: &str, listen: &Listen, disks: &[Disk]) -> String {
    let ctl = match listen {
        Listen::Unix(p) => format!("{} --socket {}", ctl_command(), p.display()),
        // The client's certificate is not blkplaned's to name: placeholders.
        Listen::Tcp { addr, .. } => format!(
            "{} --endpoint tcp:{addr} --tls-ca CA.pem --tls-cert CLIENT.pem --tls-key CLIENT.key",
            ctl_command()
        ),
    };
    let mut out = format!("blkplaned: serving {} disk(s); API on {api}\n", disks.len());
    if disks.is_empty() {
        out.push_str(&format!(
            "\nAdd a disk with:\n  {ctl} disk add ID --image PATH\n"
        ));
    }
    for d in disks {
        let c = d.config.clone().unwrap_or_default();
        let settings = c.settings.unwrap_or_default();
        out.push_str(&format!(
            "\nDisk {} ({}, {} bytes) is served on {}\nAttach it to QEMU with:\n  \
             qemu-system-x86_64 -machine q35,memory-backend=mem -m 2G \\\n    \
             -object memory-backend-memfd,id=mem,size=2G,share=on \\\n    \
             -chardev socket,id=blk-{id},path={sock},reconnect-ms=1000 \\\n    \
             -device vhost-user-blk-pci,chardev=blk-{id},num-queues={q} ...\n\
             Show it with:\n  {ctl} disk show {id}\n",
            c.id,
            blkplane_api::names::state_name(
                blkplane_daemon::pb::DiskState::try_from(d.state)
                    .unwrap_or(blkplane_daemon::pb::DiskState::Unspecified)
            ),
            d.capacity_bytes,
            settings.vhost_socket,
            id = c.id,
            sock = settings.vhost_socket,
            q = settings.num_queues,
        ));
    }
    out
}
