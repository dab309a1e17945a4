//! `blkplanectl`: the command-line client of blkplaned. See `blkplanectl --help`.
//!
//! Exit status: 0 on success, 1 when blkplaned refused the call or could not be reached (the
//! message, with the gRPC status code, goes to stderr), 2 for a command-line error. `health`
//! exits 1 also when blkplaned answers with any status but SERVING.

mod connect;
mod limits;
mod output;
mod text;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use blkplane_api::endpoint::HostPort;
use blkplane_api::pb::control_client::ControlClient;
use blkplane_api::pb::{
    AddDiskRequest, AddMigrationBlockerRequest, CacheMode, CommitRequest, DiskSettings,
    DrainDiskRequest, GetDiskRequest, GetStatsRequest, GetThrottleRequest, GetVersionRequest,
    ImageFormat, IncomingFrom, ListDisksRequest, MigrationCopyPhase, MigrationSourceRequest,
    MigrationStatus, MigrationStorage, RemoveDiskRequest, RemoveMigrationBlockerRequest,
    ResizeDiskRequest, ResumeDiskRequest, SnapshotRequest, StartMigrationRequest, ThrottleConfig,
    WatchEventsRequest,
};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use connect::{ConnectArgs, ConnectError, Target};
use serde_json::{json, Value};
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// Command-line client of blkplaned, blkplane's control plane.
#[derive(Debug, Parser)]
#[command(name = "blkplanectl", version = blkplane_build_info::VERSION)]
struct Args {
    #[command(flatten)]
    connect: ConnectArgs,
    /// Output format.
    #[arg(short = 'o', long = "output", global = true, value_enum, default_value_t = Format::Table)]
    output: Format,
    /// Seconds to wait for blkplaned to connect and to answer each call (streams: their start).
    /// The default outlasts the longest wait blkplaned itself has (a drain, 60 s).
    #[arg(long, global = true, value_name = "SECS", default_value_t = 90.0, value_parser = parse_timeout)]
    timeout: f64,
    #[command(subcommand)]
    command: Cmd,
}

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    /// Aligned columns for people.
    Table,
    /// JSON for scripts (one document per line for streams).
    Json,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Manage disks.
    #[command(subcommand)]
    Disk(DiskCmd),
    /// Show I/O statistics of one disk or of all.
    Stats {
        /// The disk (all running disks if omitted).
        id: Option<String>,
        /// Refresh every --interval seconds, showing rates, until interrupted.
        #[arg(long)]
        watch: bool,
        /// Seconds between refreshes with --watch.
        #[arg(long, default_value_t = 1.0, value_parser = parse_interval)]
        interval: f64,
        /// Show the rejected requests by queue and by the rule they broke (reasons that
        /// happened only) instead of the I/O counters.
        #[arg(long, conflicts_with = "watch")]
        rejections: bool,
    },
    /// Stream disk and process events until interrupted.
    Events {
        /// Only this disk's events.
        id: Option<String>,
    },
    /// Ask blkplaned's grpc.health.v1.Health/Check and print the status (SERVING,
    /// NOT_SERVING, ...). Exit status 0 if SERVING, else 1: a Kubernetes exec liveness or
    /// readiness probe.
    Health {
        /// The service to ask about: "" (the default) is blkplaned as a whole;
        /// blkplane.v1.Control is its API.
        #[arg(long, default_value = "", value_name = "NAME")]
        service: String,
    },
    /// Print blkplanectl's version and commit, and blkplaned's (asked over the API).
    Version,
    /// Print a shell completion script.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

#[derive(Debug, Subcommand)]
enum DiskCmd {
    /// Add a disk: start its frontend and wait until its vhost-user socket accepts VMMs.
    // Boxed: its many options would make every other command as large.
    Add(Box<AddArgs>),
    /// Remove a disk (refused while a VMM is connected, unless --force).
    Remove {
        /// The disk.
        id: String,
        /// Remove it even while a VMM is connected.
        #[arg(long)]
        force: bool,
    },
    /// List the disks.
    List,
    /// Show one disk.
    Show {
        /// The disk.
        id: String,
    },
    /// Grow a disk to SIZE (bytes, or with a unit: 2G, 512MiB…); shrinking is refused.
    Resize {
        /// The disk.
        id: String,
        /// The new size.
        #[arg(value_parser = text::parse_size)]
        size: u64,
    },
    /// Take a live external snapshot: the disk is drained and flushed, a new qcow2 image is
    /// created at OVERLAY with the current image as its backing file, the disk switches to it
    /// (its frontend restarts; a VMM with reconnect carries on) and resumes. The previous
    /// image is only read from then on: copy it as a point-in-time backup.
    Snapshot {
        /// The disk.
        id: String,
        /// Absolute path of the qcow2 overlay to create (must not exist).
        overlay: String,
    },
    /// Commit the disk's image into its backing file while the disk runs, then serve the
    /// backing file (QEMU's active block-commit with pivot): the image is frozen under a
    /// temporary overlay beside it, copied into the backing file while the guest writes, and
    /// the guest's writes meanwhile copied during a second short drain. The committed image is
    /// left in place, unused. Returns when the disk serves the backing file.
    Commit {
        /// The disk.
        id: String,
    },
    /// Quiesce a disk for a snapshot or backup: the guest's requests wait (none fails), the
    /// requests in flight complete; prints how many it waited for. Lasts until `disk resume`,
    /// also across frontend restarts.
    Drain {
        /// The disk.
        id: String,
        /// fdatasync the image once nothing is in flight.
        #[arg(long)]
        flush: bool,
    },
    /// End a drain: the disk serves the guest's requests again.
    Resume {
        /// The disk.
        id: String,
    },
    /// A live migration of a disk to another node, on the source node. --to copies the disk
    /// to its incoming disk DST there (added first on that node with --incoming-from and
    /// local storage) while the guest runs: every allocated block, then the blocks written
    /// meanwhile, until the rest fits the switch-over (the `migration_converged` event: migrate
    /// the VM now); a guest that writes faster than the copy sends is slowed down step by step
    /// (auto-converge); once the VMM stops the disk's rings the rest is sent and DST serves.
    /// --cancel forgets the disk's outgoing migration and stops its copy (blkplaned on the
    /// destination node does this itself when its incoming disk is removed; this is for when
    /// it cannot). The disk serves on untouched.
    Migrate {
        /// The disk.
        id: String,
        /// Copy the disk to disk DST on the node whose blkplaned serves HOST:PORT.
        #[arg(long, value_name = "HOST:PORT/DST", value_parser = parse_incoming_from,
              required_unless_present = "cancel", conflicts_with = "cancel")]
        to: Option<IncomingFrom>,
        /// With --to: the most the copy sends per second (bytes, or with a unit: 200M, 1GiB)
        /// [default: no limit].
        #[arg(long, value_name = "SIZE", value_parser = text::parse_size, requires = "to")]
        bandwidth: Option<u64>,
        /// With --to: show the copy's progress every second until it is complete or fails
        /// (exit status 1 when it fails).
        #[arg(long, requires = "to")]
        watch: bool,
        /// Cancel its migration to another node.
        #[arg(long)]
        cancel: bool,
    },
    /// Migration blockers: why a disk must not be live-migrated.
    #[command(subcommand)]
    Blocker(BlockerCmd),
    /// Show or set a disk's I/O limits and throttle group (QEMU's limits and semantics).
    /// Without options: show them. With limit options: set them (the ones not given are 0);
    /// for a disk in a group they are the group's, for every member. --clear removes them.
    #[command(
        after_help = "Examples:\n  blkplanectl disk throttle vm1 --iops-total 500 --bps-total 100M\n  \
                      blkplanectl disk throttle vm1 --iops-total 2000 --group tenant-a\n  \
                      blkplanectl disk throttle vm2 --group tenant-a   (joins with the group's limits)\n  \
                      blkplanectl disk throttle vm1 --clear"
    )]
    Throttle {
        /// The disk.
        id: String,
        // Boxed: its 21 options would make every other command as large.
        #[command(flatten)]
        args: Box<limits::ThrottleArgs>,
    },
}

#[derive(Debug, Subcommand)]
enum BlockerCmd {
    /// Show whether a disk may be migrated, and every blocker (automatic and operator).
    List {
        /// The disk.
        id: String,
    },
    /// Add an operator blocker (or replace the message of the disk's blocker with REASON).
    Add {
        /// The disk.
        id: String,
        /// backup, maintenance or other (or a MigrationBlockerReason number).
        #[arg(value_parser = parse_reason)]
        reason: i32,
        /// Why, for people (1 to 256 bytes).
        message: String,
    },
    /// Remove an operator blocker.
    Remove {
        /// The disk.
        id: String,
        /// backup, maintenance or other (or a MigrationBlockerReason number).
        #[arg(value_parser = parse_reason)]
        reason: i32,
    },
}

/// `--incoming-from HOST:PORT/SRC`.
fn parse_incoming_from(s: &str) -> Result<IncomingFrom, String> {
    let bad = || {
        format!(
            "{s:?} is not HOST:PORT/SRC: the source node's blkplaned (HOST a name, an IPv4 \
             address or [IPv6]) and the disk's id there"
        )
    };
    let (endpoint, disk) = s.rsplit_once('/').ok_or_else(bad)?;
    let endpoint = HostPort::parse(endpoint).ok_or_else(bad)?;
    if disk.is_empty() {
        return Err(bad());
    }
    Ok(IncomingFrom {
        endpoint: endpoint.to_string(),
        disk: disk.to_string(),
        storage: MigrationStorage::Unspecified as i32,
    })
}

fn parse_reason(s: &str) -> Result<i32, String> {
    blkplane_api::names::parse_reason(s).ok_or_else(|| {
        format!("{s:?} is not a reason: use backup, maintenance or other (or a number)")
    })
}

#[derive(Debug, clap::Args)]
struct AddArgs {
    /// The disk's name: [A-Za-z0-9._-], at most 64 characters, not starting with '.'.
    id: String,
    /// The image: a regular file or a block device [with --incoming-for or --incoming-from:
    /// the source's].
    #[arg(long, value_name = "PATH", required_unless_present_any = ["incoming_for", "incoming_from"])]
    image: Option<PathBuf>,
    /// Request queues (1..=256) [default: 1].
    #[arg(long, value_name = "N")]
    num_queues: Option<u32>,
    /// Largest ring size, a power of two (2..=32768) [default: 256].
    #[arg(long, value_name = "N")]
    queue_size: Option<u32>,
    /// Iothread processes (1..=num-queues) [default: 1].
    #[arg(long, value_name = "N")]
    iothreads: Option<u32>,
    /// Logical block size: 512 or 4096 [default: 512].
    #[arg(long, value_name = "BYTES")]
    block_size: Option<u32>,
    /// Offer the disk read-only.
    #[arg(long)]
    read_only: bool,
    /// Serial number for the guest (at most 20 bytes).
    #[arg(long, value_name = "S")]
    serial: Option<String>,
    /// Host cache mode [default: direct].
    #[arg(long, value_enum)]
    cache: Option<CacheArg>,
    /// The image's format; qcow2 may have backing files (inside blkplaned's --image-dir
    /// directories, if it has any) [default: probed from the image's first bytes when the disk
    /// is added, and kept]. An image to serve raw that starts with qcow2's magic needs raw.
    #[arg(long, value_enum)]
    format: Option<FormatArg>,
    /// Pin the iothreads to these CPUs, e.g. 0-1,3.
    #[arg(long, value_name = "LIST")]
    iothread_cpus: Option<String>,
    /// Bound of the adaptive polling of the avail rings in µs, 0 to 1000 (0: never poll)
    /// [default: the frontend's].
    #[arg(long, value_name = "US")]
    poll_max_us: Option<u32>,
    /// The vhost-user socket [default: RUNTIME_DIR/disks/ID.sock].
    #[arg(long, value_name = "PATH")]
    vhost_socket: Option<PathBuf>,
    /// Add the disk as the destination of a live migration of disk SRC on this node: start
    /// the destination VMM (QEMU with -incoming) on this disk's socket; once it runs the VM,
    /// this disk takes over and SRC is retired. The image and what the guest sees (read-only,
    /// serial, queues, queue size, block size) default to SRC's and must match them.
    #[arg(long, value_name = "SRC")]
    incoming_for: Option<String>,
    /// Add the disk as the destination of a live migration of disk SRC on another node,
    /// whose blkplaned serves its API at HOST:PORT (its --listen tcp:); this node's blkplaned
    /// reaches it with its --peer-tls-* files, and refuses the disk if that node refuses the
    /// migration. What the guest sees defaults to SRC's and must match it; once the VMM runs
    /// the VM here, that node retires SRC. With --shared the image is on storage both nodes
    /// reach: --image names it as this node sees it [default: SRC's path].
    #[arg(long, value_name = "HOST:PORT/SRC", conflicts_with = "incoming_for",
          value_parser = parse_incoming_from)]
    incoming_from: Option<IncomingFrom>,
    /// With --incoming-from: the image is on shared storage (nothing is copied). Without it
    /// the source node copies the disk here (`blkplanectl disk migrate SRC --to` there):
    /// --image is the new image, which blkplaned creates (it must not exist), and the disk
    /// serves nothing until the copy is complete.
    #[arg(long, requires = "incoming_from")]
    shared: bool,
    /// Run the disk's processes as this user, group and supplementary groups (numeric ids;
    /// blkplaned must run as root) [default: blkplaned's user].
    #[arg(long, value_name = "UID:GID[:GROUP,...]")]
    run_as: Option<blkplane_sandbox::RunAs>,
}

/// Cache modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CacheArg {
    /// O_DIRECT.
    Direct,
    /// Host page cache.
    Writeback,
    /// Every write durable before it completes.
    Writethrough,
}

/// Image formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum FormatArg {
    /// The file's bytes are the disk's.
    Raw,
    /// QEMU's qcow2, with its backing chain.
    Qcow2,
}

/// Parses a number of seconds that `allowed` (said as `allowed_text`) accepts.
fn parse_seconds(
    s: &str,
    allowed: impl Fn(f64) -> bool,
    allowed_text: &str,
) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if allowed(v) => Ok(v),
        _ => Err(format!("{s:?} is not a number of seconds {allowed_text}")),
    }
}

/// Parses `stats --interval`.
fn parse_interval(s: &str) -> Result<f64, String> {
    parse_seconds(s, |v| (0.05..=3600.0).contains(&v), "in 0.05..=3600")
}

/// A failed command: the message for stderr.
#[derive(Debug)]
enum Failure {
    /// Said as it is.
    Message(String),
    /// blkplaned's answer, or what the transport made of none ([`Failure::describe`]).
    Status(tonic::Status),
}

impl From<tonic::Status> for Failure {
    fn from(s: tonic::Status) -> Self {
        Failure::Status(s)
    }
}

impl From<ConnectError> for Failure {
    fn from(e: ConnectError) -> Self {
        Failure::Message(e.to_string())
    }
}

impl Failure {
    /// The line for stderr. A call that outlived `--timeout` and a call that got no gRPC answer
    /// (tonic's "Timeout expired", and statuses its transport made from an error) are said as
    /// what they are, with the endpoint named, instead of `CANCELLED` or `UNKNOWN: transport
    /// error`; so is a TLS handshake that failed at the first call (TLS 1.3 tells a client
    /// that its certificate was refused only then).
    /// `refusal` is what [`Target::refusal`] found, if it was asked.
    fn describe(self, target: &Target, timeout: Duration, refusal: Option<String>) -> String {
        let status = match self {
            Failure::Message(m) => return m,
            Failure::Status(s) => s,
        };
        let endpoint = &target.address;
        if status.code() == tonic::Code::Cancelled && status.message() == "Timeout expired" {
            return format!(
                "DEADLINE_EXCEEDED: nothing answered at {endpoint} within {timeout:?} \
                 (--timeout); a change asked for may still happen: check with `blkplanectl \
                 disk list`"
            );
        }
        // A status with a source was made by this side's transport from an I/O or HTTP/2
        // error: no gRPC answer came at all.
        if std::error::Error::source(&status).is_some() {
            let source = std::error::Error::source(&status);
            if let Some(why) = source.and_then(connect::tls_refusal).or(refusal) {
                return format!("{endpoint}: {why}");
            }
            return format!(
                "no gRPC answer at {endpoint} ({}): {}",
                status.message(),
                target.not_blkplaned_hint()
            );
        }
        format!("{}: {}", output::code_name(status.code()), status.message())
    }
}

/// Parses `--timeout`: more than 0 seconds, at most a day.
fn parse_timeout(s: &str) -> Result<f64, String> {
    parse_seconds(
        s,
        |v| v > 0.0 && v <= 86_400.0,
        "more than 0 and at most 86400",
    )
}

/// The command line's definition: the derived one, with the global options (where blkplaned
/// is, `--timeout`, `-o`) kept away from `completions`, which connects to nothing and prints
/// no table. Clap copies a global option into every subcommand, so they are global only within
/// each other command's subtree; the root keeps them too, for `blkplanectl --socket S COMMAND`
/// (clap hands a value given at any level to the root's matches, which the derive reads).
fn command() -> clap::Command {
    let cmd = Args::command();
    // Under a heading of their own, or they interleave with the command's options.
    let globals: Vec<clap::Arg> = cmd
        .get_arguments()
        .filter(|a| a.is_global_set())
        .map(|a| a.clone().help_heading("Global options"))
        .collect();
    let connected: Vec<String> = cmd
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .filter(|name| name != "completions")
        .collect();
    let mut cmd = cmd.mut_args(|a| a.global(false));
    for name in connected {
        cmd = cmd.mut_subcommand(name, |c| c.args(globals.clone()));
    }
    cmd
}

/// Refuses, as a usage error, a global option given before `completions` (after it, clap
/// refuses it as an unexpected argument).
fn refuse_global_options(matches: &clap::ArgMatches) {
    if !matches!(matches.subcommand(), Some(("completions", _))) {
        return;
    }
    let mut cmd = command();
    let given = cmd.get_arguments().find(|a| {
        matches.value_source(a.get_id().as_str()) == Some(clap::parser::ValueSource::CommandLine)
    });
    if let Some(long) = given.and_then(|a| a.get_long()).map(str::to_string) {
        cmd.error(
            clap::error::ErrorKind::ArgumentConflict,
            format!("--{long} means nothing to `completions`, which connects to nothing"),
        )
        .exit();
    }
}

fn main() -> ExitCode {
    let matches = command().get_matches();
    refuse_global_options(&matches);
    let args = Args::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Cmd::Completions { shell } = args.command {
        // Into a buffer: clap_complete panics on a failed write (a closed pipe), which is not
        // worth more than the closed pipe itself.
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut command(), "blkplanectl", &mut script);
        let _ = std::io::stdout().write_all(&script);
        return ExitCode::SUCCESS;
    }
    let target = match args.connect.target() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("blkplanectl: {e}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("blkplanectl: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let timeout = Duration::from_secs_f64(args.timeout);
    match runtime.block_on(run(args, &target, timeout)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            let refusal = match &failure {
                Failure::Status(s) if std::error::Error::source(s).is_some() => {
                    runtime.block_on(target.refusal(REFUSAL_TIMEOUT.min(timeout)))
                }
                _ => None,
            };
            eprintln!(
                "blkplanectl: {}",
                failure.describe(&target, timeout, refusal)
            );
            ExitCode::FAILURE
        }
    }
}

/// How long a failed call's TLS connection is looked into ([`Target::refusal`]): a refusal
/// comes within a round trip, and a healthy blkplaned never answers the probe.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(2);

/// How long `health` waits for blkplaned's answer (a probe must not hang on a hung daemon;
/// Kubernetes bounds it too, but a person running it by hand has no such bound).
const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);

/// `disk migrate --to --watch`: the copy's progress every second (a line each, JSON with
/// `-o json`) until it is complete (success) or fails (exit status 1).
async fn watch_copy(
    client: &mut ControlClient<Channel>,
    id: &str,
    format: Format,
) -> Result<(), Failure> {
    loop {
        let disk = client
            .get_disk(GetDiskRequest { id: id.to_string() })
            .await?
            .into_inner();
        let Some(copy) = disk.migration_copy else {
            return Err(Failure::Message(format!(
                "disk {id} has no copy to another node"
            )));
        };
        let shown = match format {
            Format::Json => print_json_line(&output::copy_json(&copy)),
            Format::Table => {
                let mut out = std::io::stdout();
                writeln!(out, "{}", output::copy_line(&copy))
                    .and_then(|_| out.flush())
                    .is_ok()
            }
        };
        if !shown {
            return Ok(());
        }
        match MigrationCopyPhase::try_from(copy.phase) {
            Ok(MigrationCopyPhase::Complete) => return Ok(()),
            Ok(MigrationCopyPhase::Failed) => {
                return Err(Failure::Message(format!(
                    "the copy of disk {id} failed: {}",
                    copy.failure
                )))
            }
            _ => tokio::time::sleep(Duration::from_secs(1)).await,
        }
    }
}

/// `blkplanectl health`: prints the status of `service`; SERVING is success, anything else
/// a failure (exit status 1).
async fn health(channel: Channel, service: String, format: Format) -> Result<(), Failure> {
    let mut client = HealthClient::new(channel);
    let call = client.check(HealthCheckRequest {
        service: service.clone(),
    });
    let answer = tokio::time::timeout(HEALTH_TIMEOUT, call)
        .await
        .map_err(|_| {
            Failure::Message(format!(
                "DEADLINE_EXCEEDED: blkplaned did not answer the health check within \
                 {HEALTH_TIMEOUT:?}"
            ))
        })??
        .into_inner();
    let status = ServingStatus::try_from(answer.status)
        .map(|s| s.as_str_name())
        .unwrap_or("UNKNOWN");
    match format {
        Format::Json => print_json(&json!({ "service": service, "status": status })),
        Format::Table => println!("{status}"),
    }
    if answer.status == ServingStatus::Serving as i32 {
        Ok(())
    } else {
        Err(Failure::Message(format!("service {service:?} is {status}")))
    }
}

/// Makes a path absolute against this process's working directory: blkplaned resolves paths
/// in its own, which is not ours.
fn absolute(p: &Path) -> Result<String, Failure> {
    let abs =
        std::path::absolute(p).map_err(|e| Failure::Message(format!("{}: {e}", p.display())))?;
    abs.into_os_string()
        .into_string()
        .map_err(|p| Failure::Message(format!("{} is not UTF-8", PathBuf::from(p).display())))
}

fn print_json(v: &Value) {
    // Pretty for one-shot answers; a failed write (closed pipe) is not worth an error.
    let _ = writeln!(
        std::io::stdout(),
        "{}",
        serde_json::to_string_pretty(v).unwrap_or_default()
    );
}

fn print_migration(format: Format, m: &MigrationStatus) {
    match format {
        Format::Json => print_json(&output::migration_json(m)),
        Format::Table => print!("{}", output::migration_table(m)),
    }
}

fn print_throttle(format: Format, t: &ThrottleConfig) {
    match format {
        Format::Json => print_json(&limits::throttle_json(t)),
        Format::Table => print!("{}", limits::throttle_detail(t)),
    }
}

fn print_json_line(v: &Value) -> bool {
    let mut out = std::io::stdout();
    writeln!(out, "{v}").and_then(|_| out.flush()).is_ok()
}

async fn run(args: Args, target: &Target, timeout: Duration) -> Result<(), Failure> {
    let format = args.output;
    let channel = target.connect(timeout).await?;
    if let Cmd::Health { service } = args.command {
        return health(channel, service, format).await;
    }
    let mut client = ControlClient::new(channel);
    match args.command {
        Cmd::Disk(DiskCmd::Add(a)) => {
            let settings = DiskSettings {
                image: match a.image {
                    Some(p) => absolute(&p)?,
                    None => String::new(),
                },
                read_only: a.read_only,
                serial: a.serial.unwrap_or_default(),
                num_queues: a.num_queues.unwrap_or(0),
                queue_size: a.queue_size.unwrap_or(0),
                block_size: a.block_size.unwrap_or(0),
                iothreads: a.iothreads.unwrap_or(0),
                cache: match a.cache {
                    None => CacheMode::Unspecified,
                    Some(CacheArg::Direct) => CacheMode::Direct,
                    Some(CacheArg::Writeback) => CacheMode::Writeback,
                    Some(CacheArg::Writethrough) => CacheMode::Writethrough,
                } as i32,
                format: match a.format {
                    None => ImageFormat::Unspecified,
                    Some(FormatArg::Raw) => ImageFormat::Raw,
                    Some(FormatArg::Qcow2) => ImageFormat::Qcow2,
                } as i32,
                iothread_cpus: a.iothread_cpus.unwrap_or_default(),
                vhost_socket: match a.vhost_socket {
                    Some(p) => absolute(&p)?,
                    None => String::new(),
                },
                run_as: a.run_as.map(|r| blkplane_api::pb::RunAs {
                    uid: r.uid,
                    gid: r.gid,
                    groups: r.groups,
                }),
                poll_max_us: a.poll_max_us,
            };
            let req = AddDiskRequest {
                id: a.id,
                settings: Some(settings),
                incoming_for: a.incoming_for.unwrap_or_default(),
                incoming_from: a.incoming_from.map(|from| IncomingFrom {
                    storage: if a.shared {
                        MigrationStorage::Shared
                    } else {
                        MigrationStorage::Local
                    } as i32,
                    ..from
                }),
            };
            let disk = client.add_disk(req).await?.into_inner();
            match format {
                Format::Json => print_json(&output::disk_json(&disk)),
                Format::Table => print!("{}", output::disk_detail(&disk)),
            }
        }
        Cmd::Disk(DiskCmd::Remove { id, force }) => {
            client
                .remove_disk(RemoveDiskRequest {
                    id: id.clone(),
                    force,
                })
                .await?;
            match format {
                Format::Json => print_json(&json!({ "removed": id })),
                Format::Table => println!("removed {id}"),
            }
        }
        Cmd::Disk(DiskCmd::Migrate {
            id,
            to: Some(to),
            bandwidth,
            watch,
            cancel: _,
        }) => {
            let disk = client
                .start_migration(StartMigrationRequest {
                    id: id.clone(),
                    to_endpoint: to.endpoint,
                    to_disk: to.disk,
                    bandwidth_bytes_per_second: bandwidth.unwrap_or(0),
                })
                .await?
                .into_inner();
            if !watch {
                match format {
                    Format::Json => print_json(&output::disk_json(&disk)),
                    Format::Table => print!("{}", output::disk_detail(&disk)),
                }
                return Ok(());
            }
            return watch_copy(&mut client, &id, format).await;
        }
        Cmd::Disk(DiskCmd::Migrate { id, .. }) => {
            let cancelled = client
                .cancel_migration_source(MigrationSourceRequest {
                    id: id.clone(),
                    destination: None,
                })
                .await?
                .into_inner()
                .cancelled;
            match format {
                Format::Json => print_json(&json!({
                    "id": id,
                    "cancelled": cancelled.as_ref().map(|c| json!({
                        "node": c.node,
                        "disk": c.disk,
                    })),
                })),
                Format::Table => match cancelled {
                    Some(c) => println!(
                        "disk {id}: the live migration to disk {} on node {} was cancelled",
                        c.disk, c.node
                    ),
                    None => println!("disk {id} had no live migration to another node"),
                },
            }
        }
        Cmd::Disk(DiskCmd::List) => {
            let disks = client
                .list_disks(ListDisksRequest {})
                .await?
                .into_inner()
                .disks;
            match format {
                Format::Json => {
                    print_json(&Value::Array(disks.iter().map(output::disk_json).collect()))
                }
                Format::Table => print!("{}", output::disks_table(&disks)),
            }
        }
        Cmd::Disk(DiskCmd::Show { id }) => {
            let disk = client.get_disk(GetDiskRequest { id }).await?.into_inner();
            match format {
                Format::Json => print_json(&output::disk_json(&disk)),
                Format::Table => print!("{}", output::disk_detail(&disk)),
            }
        }
        Cmd::Disk(DiskCmd::Resize { id, size }) => {
            let done = client
                .resize_disk(ResizeDiskRequest {
                    id: id.clone(),
                    new_size_bytes: size,
                })
                .await?
                .into_inner();
            match format {
                Format::Json => print_json(&output::resize_json(&id, &done)),
                Format::Table => println!(
                    "{id}: capacity {} bytes ({}); guest notified: {}",
                    done.capacity_bytes,
                    text::format_bytes(done.capacity_bytes),
                    if done.guest_notified { "yes" } else { "no" }
                ),
            }
        }
        Cmd::Disk(DiskCmd::Snapshot { id, overlay }) => {
            let disk = client
                .snapshot(SnapshotRequest { id, overlay })
                .await?
                .into_inner();
            match format {
                Format::Json => print_json(&output::disk_json(&disk)),
                Format::Table => print!("{}", output::disk_detail(&disk)),
            }
        }
        Cmd::Disk(DiskCmd::Commit { id }) => {
            let disk = client.commit(CommitRequest { id }).await?.into_inner();
            match format {
                Format::Json => print_json(&output::disk_json(&disk)),
                Format::Table => print!("{}", output::disk_detail(&disk)),
            }
        }
        Cmd::Disk(DiskCmd::Drain { id, flush }) => {
            let done = client
                .drain(DrainDiskRequest {
                    id: id.clone(),
                    flush,
                })
                .await?
                .into_inner();
            match format {
                Format::Json => print_json(&output::drain_json(&id, &done)),
                Format::Table => println!(
                    "{id}: drained; waited for {} requests in flight{}",
                    done.waited_requests,
                    if done.flushed { "; image synced" } else { "" }
                ),
            }
        }
        Cmd::Disk(DiskCmd::Resume { id }) => {
            let answer = client
                .resume(ResumeDiskRequest { id: id.clone() })
                .await?
                .into_inner();
            match format {
                Format::Json => print_json(&json!({
                    "id": id,
                    "drained": false,
                    "was_drained": answer.was_drained,
                })),
                Format::Table if answer.was_drained => println!("{id}: resumed"),
                Format::Table => println!("{id}: was not drained; nothing changed"),
            }
        }
        Cmd::Disk(DiskCmd::Blocker(BlockerCmd::List { id })) => {
            let disk = client.get_disk(GetDiskRequest { id }).await?.into_inner();
            let m = MigrationStatus {
                id: disk.config.map(|c| c.id).unwrap_or_default(),
                migratable: disk.migratable,
                blockers: disk.migration_blockers,
            };
            print_migration(format, &m);
        }
        Cmd::Disk(DiskCmd::Blocker(BlockerCmd::Add {
            id,
            reason,
            message,
        })) => {
            let m = client
                .add_migration_blocker(AddMigrationBlockerRequest {
                    id,
                    reason,
                    message,
                })
                .await?
                .into_inner();
            print_migration(format, &m);
        }
        Cmd::Disk(DiskCmd::Blocker(BlockerCmd::Remove { id, reason })) => {
            let m = client
                .remove_migration_blocker(RemoveMigrationBlockerRequest { id, reason })
                .await?
                .into_inner();
            print_migration(format, &m);
        }
        Cmd::Disk(DiskCmd::Throttle { id, args }) => {
            let current = client
                .get_throttle(GetThrottleRequest { id })
                .await?
                .into_inner();
            if args.is_show() {
                print_throttle(format, &current);
                return Ok(());
            }
            // Joining a group without naming limits keeps the group's: read them from a
            // member (a SetThrottle always sets the group's limits).
            let group_limits = match args.needs_group_limits() {
                Some(group) => {
                    let disks = client
                        .list_disks(ListDisksRequest {})
                        .await?
                        .into_inner()
                        .disks;
                    limits::group_limits(&disks, group)
                }
                None => None,
            };
            let config = client
                .set_throttle(args.request(&current, group_limits))
                .await?
                .into_inner();
            print_throttle(format, &config);
        }
        Cmd::Stats {
            id,
            watch,
            interval,
            rejections,
        } => {
            let req = GetStatsRequest {
                id: id.unwrap_or_default(),
            };
            if !watch {
                let disks = client.get_stats(req).await?.into_inner().disks;
                match (format, rejections) {
                    (Format::Json, _) => print_json(&output::stats_json(&disks)),
                    (Format::Table, false) => print!("{}", output::stats_table(&disks, None)),
                    (Format::Table, true) => print!("{}", output::rejections_table(&disks)),
                }
                return Ok(());
            }
            let interval = Duration::from_secs_f64(interval);
            let mut prev: Option<(Vec<_>, Instant)> = None;
            loop {
                let disks = client.get_stats(req.clone()).await?.into_inner().disks;
                let now = Instant::now();
                let ok = match format {
                    Format::Json => print_json_line(&json!({
                        "unix_time_ms": blkplane_api::time::unix_time_ms(),
                        "disks": output::stats_json(&disks),
                    })),
                    Format::Table => {
                        let table = output::stats_table(
                            &disks,
                            prev.as_ref()
                                .map(|(p, t)| (p.as_slice(), now.duration_since(*t))),
                        );
                        let mut out = std::io::stdout();
                        // On a terminal each sample replaces the last; in a pipe they follow.
                        let clear = if out.is_terminal() {
                            "\x1b[H\x1b[2J"
                        } else {
                            ""
                        };
                        writeln!(out, "{clear}{table}")
                            .and_then(|_| out.flush())
                            .is_ok()
                    }
                };
                if !ok {
                    return Ok(());
                }
                prev = Some((disks, now));
                tokio::time::sleep(interval).await;
            }
        }
        Cmd::Events { id } => {
            let mut stream = client
                .watch_events(WatchEventsRequest {
                    id: id.unwrap_or_default(),
                })
                .await?
                .into_inner();
            while let Some(event) = stream.message().await? {
                let ok = match format {
                    Format::Json => print_json_line(&output::event_json(&event)),
                    Format::Table => {
                        let mut out = std::io::stdout();
                        writeln!(out, "{}", output::event_line(&event))
                            .and_then(|_| out.flush())
                            .is_ok()
                    }
                };
                if !ok {
                    return Ok(());
                }
            }
        }
        Cmd::Version => {
            let daemon = client.get_version(GetVersionRequest {}).await?.into_inner();
            match format {
                Format::Json => print_json(&json!({
                    "blkplanectl": {
                        "version": blkplane_build_info::PACKAGE_VERSION,
                        "commit": blkplane_build_info::COMMIT,
                    },
                    "blkplaned": { "version": daemon.version, "commit": daemon.commit },
                })),
                Format::Table => {
                    println!("blkplanectl {}", blkplane_build_info::VERSION);
                    println!("blkplaned   {} (commit {})", daemon.version, daemon.commit);
                }
            }
        }
        Cmd::Completions { .. } | Cmd::Health { .. } => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(argv: &[&str]) -> Result<Args, clap::Error> {
        let matches = command().try_get_matches_from(argv)?;
        Args::from_arg_matches(&matches)
    }

    #[test]
    fn global_options_everywhere_but_completions() {
        let mut cmd = command();
        cmd.build();
        let longs = |c: &clap::Command| -> Vec<String> {
            c.get_arguments()
                .filter_map(|a| a.get_long().map(str::to_string))
                .collect()
        };
        let completions = cmd.find_subcommand("completions").unwrap();
        assert_eq!(longs(completions), ["help"]);
        let list = cmd
            .find_subcommand("disk")
            .and_then(|d| d.find_subcommand("list"))
            .unwrap();
        let globals = [
            "socket", "endpoint", "tls-ca", "tls-cert", "tls-key", "output",
        ];
        for long in globals.iter().chain(&["timeout"]) {
            assert!(
                longs(list).iter().any(|l| l == long),
                "disk list lacks --{long}"
            );
        }
        // Before the command or after it, the derive reads them.
        let a = parse(&[
            "blkplanectl",
            "disk",
            "list",
            "-o",
            "json",
            "--timeout",
            "3",
        ])
        .unwrap();
        assert_eq!((a.output, a.timeout), (Format::Json, 3.0));
        let a = parse(&["blkplanectl", "--socket", "/s", "-o", "json", "version"]).unwrap();
        assert_eq!(a.connect.socket, Some(PathBuf::from("/s")));
        assert_eq!(a.output, Format::Json);
        let a = parse(&["blkplanectl", "stats"]).unwrap();
        assert_eq!((a.output, a.timeout), (Format::Table, 90.0));
        let e = parse(&["blkplanectl", "completions", "bash", "--socket", "/s"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::UnknownArgument);
    }
}
