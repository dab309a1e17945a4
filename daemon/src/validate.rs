//! Validation of API input: every rule says which field broke it, so that a caller (or a
//! person reading `blkplanectl`'s error) knows what to fix.
//!
//! Checks here look at the request and the file system only; the checks against other disks
//! (duplicate id, image or socket) are done by the service, which sees the disk table and
//! hands [`resolve_incoming`] the source disk of an incoming one.

use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

use blkplane_proto::v1::ThrottleLimits;
use thiserror::Error;

use crate::migration;
use crate::pb::{AddDiskRequest, CacheMode, MigrationBlockerReason, RunAs};
use crate::state::{Cache, DiskSpec, OperatorReason, RunAsSpec};
use blkplane_api::names::reason_name;
use blkplane_procfs as proc;

/// Longest disk id.
pub const MAX_ID_LEN: usize = 64;
/// Longest serial number (virtio-blk GET_ID answers 20 bytes).
pub const MAX_SERIAL_LEN: usize = 20;
/// The largest AddDiskRequest `poll_max_us` (the frontend's `--poll-max-us` bound).
pub const MAX_POLL_MAX_US: u32 = 1000;
/// Most request queues.
pub const MAX_QUEUES: u32 = 256;
/// Largest queue size.
pub const MAX_QUEUE_SIZE: u32 = 32768;
/// Most iothreads of one disk (the frontend's limit).
pub const MAX_IOTHREADS: u32 = 64;
/// Longest UNIX socket path: `sun_path` holds 108 bytes including the terminating NUL.
pub const MAX_SOCKET_PATH: usize = 107;
/// Default number of request queues.
pub const DEFAULT_QUEUES: u16 = 1;
/// Default queue size.
pub const DEFAULT_QUEUE_SIZE: u16 = 256;
/// Default logical block size.
pub const DEFAULT_BLOCK_SIZE: u32 = 512;
/// Default number of iothreads.
pub const DEFAULT_IOTHREADS: u16 = 1;
/// Longest operator migration-blocker message, in bytes.
pub const MAX_BLOCKER_MESSAGE: usize = 256;

/// A rejected input. The message always starts with the field's name (as in the .proto).
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ValidationError {
    /// The field is malformed or out of range (INVALID_ARGUMENT).
    #[error("{field}: {reason}")]
    Invalid {
        /// The request field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The field names something that does not exist (NOT_FOUND).
    #[error("{field}: {reason}")]
    NotFound {
        /// The request field.
        field: &'static str,
        /// What was not found.
        reason: String,
    },
    /// The field names something another disk (or process) already has (ALREADY_EXISTS).
    #[error("{field}: {reason}")]
    AlreadyExists {
        /// The request field.
        field: &'static str,
        /// Who has it.
        reason: String,
    },
    /// The field names a disk whose state forbids the request (FAILED_PRECONDITION).
    #[error("{field}: {reason}")]
    FailedPrecondition {
        /// The request field.
        field: &'static str,
        /// What about that disk forbids it.
        reason: String,
    },
    /// The field names something that is full (RESOURCE_EXHAUSTED): a throttle group with
    /// the most members it can have.
    #[error("{field}: {reason}")]
    ResourceExhausted {
        /// The request field.
        field: &'static str,
        /// What is full.
        reason: String,
    },
}

impl ValidationError {
    /// The request field that was rejected.
    pub fn field(&self) -> &'static str {
        match self {
            ValidationError::Invalid { field, .. }
            | ValidationError::NotFound { field, .. }
            | ValidationError::AlreadyExists { field, .. }
            | ValidationError::FailedPrecondition { field, .. }
            | ValidationError::ResourceExhausted { field, .. } => field,
        }
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ValidationError {
    ValidationError::Invalid {
        field,
        reason: reason.into(),
    }
}

/// What validation needs to know about the daemon.
#[derive(Debug, Clone)]
pub struct Context {
    /// `RUNTIME_DIR/disks`: default home of vhost-user sockets, and of every disk's admin
    /// socket, pid file and log.
    pub disks_dir: PathBuf,
    /// If not empty, vhost-user sockets must be inside one of these directories.
    pub socket_dirs: Vec<PathBuf>,
    /// If not empty, images must be inside one of these directories (after resolving
    /// symlinks).
    pub image_dirs: Vec<PathBuf>,
    /// Whether blkplaned may run disks as other users (AddDiskRequest `run_as`): it has the
    /// capabilities a frontend needs for that (see [`can_run_disks_as_other_users`]).
    pub can_run_as: bool,
}

/// The capabilities blkplaned needs to run a disk as another user, as a CapEff mask of
/// <linux/capability.h> numbers: the four a frontend started with `--run-as` inherits and
/// uses before it switches — CAP_CHOWN (0), CAP_DAC_OVERRIDE (1), CAP_SETGID (6),
/// CAP_SETUID (7) — and CAP_KILL (5), without which blkplaned could not stop a frontend that
/// runs as another user.
const RUN_AS_CAPABILITIES: u64 = 1 << 0 | 1 << 1 | 1 << 5 | 1 << 6 | 1 << 7;

/// Whether this process has every capability it needs to run disks as other users
/// ([`RUN_AS_CAPABILITIES`]), read from /proc/self/status.
pub fn can_run_disks_as_other_users() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
            u64::from_str_radix(hex.trim(), 16).ok()
        })
        .is_some_and(|effective| effective & RUN_AS_CAPABILITIES == RUN_AS_CAPABILITIES)
}

/// Checks AddDiskRequest `run_as`.
fn check_run_as(run_as: &RunAs, ctx: &Context) -> Result<RunAsSpec, ValidationError> {
    use blkplane_sandbox::RunAsError;
    blkplane_sandbox::RunAs::new(run_as.uid, run_as.gid, run_as.groups.clone()).map_err(|e| {
        let field = match e {
            RunAsError::Root | RunAsError::Unchanged("uid") => "run_as.uid",
            RunAsError::Unchanged("gid") => "run_as.gid",
            _ => "run_as.groups",
        };
        invalid(field, e.to_string())
    })?;
    if !ctx.can_run_as {
        return Err(ValidationError::FailedPrecondition {
            field: "run_as",
            reason: "blkplaned lacks CAP_SETUID, CAP_SETGID, CAP_CHOWN, CAP_DAC_OVERRIDE or \
                     CAP_KILL, so its disks run as its own user; run it as root to give disks \
                     users of their own"
                .into(),
        });
    }
    Ok(RunAsSpec {
        uid: run_as.uid,
        gid: run_as.gid,
        groups: run_as.groups.clone(),
    })
}

/// Checks a disk id: 1..=64 characters of `[A-Za-z0-9._-]`, not starting with '.' (so that it
/// can name files: no separators, no `.`/`..`, no hidden files).
pub fn check_id(id: &str) -> Result<(), ValidationError> {
    check_id_in("id", id)
}

/// [`check_id`] for a disk id in request field `field`.
fn check_id_in(field: &'static str, id: &str) -> Result<(), ValidationError> {
    if id.is_empty() {
        return Err(invalid(field, "must not be empty"));
    }
    if id.len() > MAX_ID_LEN {
        return Err(invalid(
            field,
            format!("{} characters; at most {MAX_ID_LEN} are allowed", id.len()),
        ));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(invalid(
            field,
            format!("{id:?} contains {c:?}; only A-Z, a-z, 0-9, '.', '_' and '-' are allowed"),
        ));
    }
    if id.starts_with('.') {
        return Err(invalid(field, format!("{id:?} must not start with '.'")));
    }
    Ok(())
}

/// Checks a throttle group's name: the rules of a disk id (it names the group's file in the
/// runtime directory).
pub fn check_group(group: &str) -> Result<(), ValidationError> {
    check_id_in("group", group)
}

/// Checks I/O limits with QEMU's rules (the `blkplane-throttle` crate's, which the frontend
/// applies too). The error names the request field, `limits.NAME` with QEMU's name of the
/// field to fix (`limits.iops_total_max: requires iops_total to be set`).
pub fn check_limits(limits: &ThrottleLimits) -> Result<(), ValidationError> {
    blkplane_throttle::ThrottleLimits::from(limits)
        .validate()
        .map_err(|e| {
            let text = e.to_string();
            // The crate's message starts with the field's bare name; ours with the request's.
            let reason = text
                .strip_prefix(&format!("{}: ", e.field()))
                .unwrap_or(&text)
                .to_string();
            invalid(blkplane_api::limits::api_field(e.field()), reason)
        })
}

/// The source disk of an incoming disk, as [`resolve_incoming`] needs to see it.
#[derive(Debug, Clone, Copy)]
pub struct MigrationSource<'a> {
    /// Its configuration now; its `incoming_for` says whether it is itself still incoming.
    pub spec: &'a DiskSpec,
    /// The id of the disk that already is its incoming destination, if there is one.
    pub incoming: Option<&'a str>,
    /// Its migration blockers now, one `reason: message` line each.
    pub blockers: &'a [String],
}

/// Checks `incoming_for` of an AddDisk request against the disk it names (`source`: `None`
/// when no disk has that id) and returns the request with the fields the guest sees taken
/// from the source where the request leaves them zero or empty: the image, `read_only`,
/// `serial`, `num_queues`, `queue_size`, `block_size`. A value the request does set must be
/// the source's, because the migrated guest must find the same device; the image may be
/// named by another path, but must be the same file. A request without `incoming_for` is
/// returned as it is. [`check_add`] then checks the result like any request.
pub fn resolve_incoming(
    req: &AddDiskRequest,
    source: Option<MigrationSource<'_>>,
) -> Result<AddDiskRequest, ValidationError> {
    const F: &str = "incoming_for";
    if req.incoming_for.is_empty() {
        return Ok(req.clone());
    }
    check_id_in(F, &req.incoming_for)?;
    if req.incoming_for == req.id {
        return Err(invalid(
            F,
            format!(
                "{:?} is this disk's own id; name the disk it takes over from",
                req.id
            ),
        ));
    }
    let Some(source) = source else {
        return Err(ValidationError::NotFound {
            field: F,
            reason: format!("no disk named {:?}", req.incoming_for),
        });
    };
    let src = source.spec;
    let name = &src.id;
    if let Some(its_source) = &src.incoming_for {
        return Err(ValidationError::FailedPrecondition {
            field: F,
            reason: format!(
                "disk {name} is itself the incoming destination of a migration of disk \
                 {its_source}; it has to take over before it can be migrated on"
            ),
        });
    }
    if let Some(other) = source.incoming {
        return Err(ValidationError::FailedPrecondition {
            field: F,
            reason: format!(
                "disk {name} already has an incoming disk, {other}; remove {other} to start \
                 another migration"
            ),
        });
    }
    // The destination's frontend is what a migration needs first (its VMM connects to it):
    // refusing it is how a blocked migration fails before any VMM is involved, with every
    // QEMU (10.0 aborts when a back-end refuses to start dirty logging).
    if !source.blockers.is_empty() {
        return Err(ValidationError::FailedPrecondition {
            field: F,
            reason: format!(
                "disk {name} must not be migrated now: {}",
                source.blockers.join("; ")
            ),
        });
    }
    let mut out = req.clone();
    let src_image = src.image.to_string_lossy();
    if req.image.is_empty() {
        out.image = src_image.into_owned();
    } else if Path::new(&req.image).is_absolute() {
        // Only a file that exists can be compared; check_add reports any other problem with
        // the path in its own words.
        if let Some(identity) = image_identity(Path::new(&req.image)) {
            if image_identity(&src.image) != Some(identity) {
                return Err(invalid(
                    "image",
                    format!(
                        "{} is not the image of disk {name} ({src_image}); an incoming disk \
                         serves its source's image (leave it empty to take it)",
                        req.image
                    ),
                ));
            }
        }
    }
    // A value set in the request must be the source's; zero or empty takes the source's.
    let differs = |field: &'static str, requested: String, source: String| {
        invalid(
            field,
            format!(
                "{requested} differs from {source} of disk {name}, the migration source; the \
                 migrated guest must find the same device (leave it unset to take the \
                 source's)"
            ),
        )
    };
    if req.read_only && !src.read_only {
        return Err(invalid(
            "read_only",
            format!(
                "set, but disk {name}, the migration source, is writable; the migrated guest \
                 must find the same device (leave it unset to take the source's)"
            ),
        ));
    }
    out.read_only = src.read_only;
    if !req.serial.is_empty() && req.serial != src.serial {
        return Err(differs(
            "serial",
            format!("{:?}", req.serial),
            format!("{:?}", src.serial),
        ));
    }
    out.serial = src.serial.clone();
    for (field, requested, source, slot) in [
        (
            "num_queues",
            req.num_queues,
            u32::from(src.num_queues),
            &mut out.num_queues,
        ),
        (
            "queue_size",
            req.queue_size,
            u32::from(src.queue_size),
            &mut out.queue_size,
        ),
        (
            "block_size",
            req.block_size,
            src.block_size,
            &mut out.block_size,
        ),
    ] {
        if requested != 0 && requested != source {
            return Err(differs(field, requested.to_string(), source.to_string()));
        }
        *slot = source;
    }
    Ok(out)
}

/// Who an image is, to find two disks on one image whatever path names it: (device, inode)
/// of a regular file, the device number of a block device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageIdentity {
    /// A regular file.
    File {
        /// `st_dev`.
        dev: u64,
        /// `st_ino`.
        ino: u64,
    },
    /// A block device.
    Block {
        /// `st_rdev`.
        rdev: u64,
    },
}

/// The identity of the image at `path`, following symlinks; `None` if it cannot be stat'ed
/// or is neither a regular file nor a block device.
pub fn image_identity(path: &Path) -> Option<ImageIdentity> {
    let md = std::fs::metadata(path).ok()?;
    if md.file_type().is_file() {
        Some(ImageIdentity::File {
            dev: md.dev(),
            ino: md.ino(),
        })
    } else if md.file_type().is_block_device() {
        Some(ImageIdentity::Block { rdev: md.rdev() })
    } else {
        None
    }
}

/// Checks `image` (absolute, exists, a regular file or block device, at least one block,
/// inside an allowed directory if any are configured) and returns its identity.
pub fn check_image(
    image: &str,
    block_size: u32,
    image_dirs: &[PathBuf],
) -> Result<ImageIdentity, ValidationError> {
    if image.is_empty() {
        return Err(invalid("image", "must not be empty"));
    }
    let path = Path::new(image);
    if !path.is_absolute() {
        return Err(invalid(
            "image",
            format!("{image:?} is not an absolute path"),
        ));
    }
    let md = match std::fs::metadata(path) {
        Ok(md) => md,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ValidationError::NotFound {
                field: "image",
                reason: format!("{image} does not exist"),
            })
        }
        Err(e) => return Err(invalid("image", format!("{image}: {e}"))),
    };
    let ft = md.file_type();
    let size = if ft.is_file() {
        md.len()
    } else if ft.is_block_device() {
        proc::block_device_size(path).map_err(|e| invalid("image", format!("{image}: {e}")))?
    } else {
        return Err(invalid(
            "image",
            format!("{image} is not a regular file or a block device"),
        ));
    };
    if size < u64::from(block_size) {
        return Err(invalid(
            "image",
            format!("{image} has {size} bytes, less than one {block_size}-byte block"),
        ));
    }
    if !image_dirs.is_empty() {
        // Resolved, so that neither a symlink nor a '..' leads out of the allowed directories.
        let real =
            std::fs::canonicalize(path).map_err(|e| invalid("image", format!("{image}: {e}")))?;
        let inside = image_dirs
            .iter()
            .any(|dir| std::fs::canonicalize(dir).is_ok_and(|dir| real.starts_with(dir)));
        if !inside {
            return Err(invalid(
                "image",
                format!(
                    "{image} is outside the allowed image directories ({})",
                    image_dirs
                        .iter()
                        .map(|d| d.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
    }
    image_identity(path).ok_or_else(|| invalid("image", format!("{image} changed while checked")))
}

/// Checks a CPU list: well-formed, and every CPU present on this machine.
pub fn check_cpu_list(list: &str) -> Result<(), ValidationError> {
    let cpus = proc::parse_cpu_list(list).map_err(|e| invalid("iothread_cpus", e))?;
    if let Some(possible) = proc::possible_cpus() {
        if let Some(cpu) = cpus.iter().find(|c| !possible.contains(c)) {
            return Err(invalid(
                "iothread_cpus",
                format!("CPU {cpu} does not exist on this machine"),
            ));
        }
    }
    Ok(())
}

/// Whether `path` has a `..` component (or is not normalized in a way that could hide one).
fn has_parent_component(path: &Path) -> bool {
    path.components().any(|c| matches!(c, Component::ParentDir))
}

/// Resolves and checks the vhost-user socket path: empty → `DISKS_DIR/ID.sock`; relative →
/// under `DISKS_DIR`; no `..` anywhere; short enough for `sun_path`; its directory exists;
/// inside one of the allowed directories if any are configured; an existing file there must
/// be a socket nobody listens on (the frontend replaces it, so anything else would be lost).
pub fn resolve_vhost_socket(
    requested: &str,
    id: &str,
    ctx: &Context,
) -> Result<PathBuf, ValidationError> {
    const F: &str = "vhost_socket";
    let path = if requested.is_empty() {
        ctx.disks_dir.join(format!("{id}.sock"))
    } else {
        let p = Path::new(requested);
        if has_parent_component(p) {
            return Err(invalid(
                F,
                format!("{requested:?} contains a '..' component"),
            ));
        }
        if requested.ends_with('/') {
            return Err(invalid(F, format!("{requested:?} names a directory")));
        }
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            ctx.disks_dir.join(p)
        }
    };
    // Drop `.` components and doubled slashes, so that one socket has one spelling and the
    // duplicate check compares like with like.
    let path: PathBuf = path.components().collect();
    let len = path.as_os_str().as_bytes().len();
    if len > MAX_SOCKET_PATH {
        return Err(invalid(
            F,
            format!(
                "{} is {len} bytes long; a UNIX socket path has at most {MAX_SOCKET_PATH}",
                path.display()
            ),
        ));
    }
    let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) else {
        return Err(invalid(F, format!("{} has no directory", path.display())));
    };
    let canonical_parent = match std::fs::canonicalize(parent) {
        Ok(p) if p.is_dir() => p,
        Ok(_) => {
            return Err(invalid(
                F,
                format!("{} is not a directory", parent.display()),
            ))
        }
        Err(e) => {
            return Err(ValidationError::NotFound {
                field: F,
                reason: format!("directory {}: {e}", parent.display()),
            })
        }
    };
    if !ctx.socket_dirs.is_empty() {
        let allowed = ctx.socket_dirs.iter().any(|dir| {
            std::fs::canonicalize(dir).is_ok_and(|dir| canonical_parent.starts_with(dir))
        });
        // The disks dir is always allowed: it is where the default socket lives.
        let in_disks_dir = std::fs::canonicalize(&ctx.disks_dir)
            .is_ok_and(|dir| canonical_parent.starts_with(dir));
        if !allowed && !in_disks_dir {
            return Err(invalid(
                F,
                format!(
                    "{} is outside the allowed socket directories ({})",
                    path.display(),
                    ctx.socket_dirs
                        .iter()
                        .map(|d| d.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
    }
    match std::fs::symlink_metadata(&path) {
        Ok(md) if md.file_type().is_socket() => {
            if proc::is_listening(&path) {
                return Err(ValidationError::AlreadyExists {
                    field: F,
                    reason: format!("another process listens on {}", path.display()),
                });
            }
        }
        Ok(_) => {
            return Err(invalid(
                F,
                format!("{} exists and is not a socket", path.display()),
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(invalid(F, format!("{}: {e}", path.display()))),
    }
    Ok(path)
}

/// Checks an AddDisk request and turns it into the disk's stored configuration (defaults
/// filled in, socket path resolved). Returns the image's identity too, for the duplicate
/// check. `incoming_for` is taken as it is: [`resolve_incoming`] checks it (against the
/// source disk, which only the caller can look up) and fills in the source's values first.
pub fn check_add(
    req: &AddDiskRequest,
    ctx: &Context,
) -> Result<(DiskSpec, ImageIdentity), ValidationError> {
    check_id(&req.id)?;
    let admin = ctx
        .disks_dir
        .join(format!("{}{}", req.id, crate::paths::ADMIN_SUFFIX));
    if admin.as_os_str().as_bytes().len() > MAX_SOCKET_PATH {
        return Err(invalid(
            "id",
            format!(
                "too long for this runtime directory: the admin socket {} would exceed the \
                 {MAX_SOCKET_PATH}-byte limit of a UNIX socket path",
                admin.display()
            ),
        ));
    }

    let num_queues = if req.num_queues == 0 {
        u32::from(DEFAULT_QUEUES)
    } else {
        req.num_queues
    };
    if !(1..=MAX_QUEUES).contains(&num_queues) {
        return Err(invalid(
            "num_queues",
            format!("{num_queues} is not in 1..={MAX_QUEUES}"),
        ));
    }
    let queue_size = if req.queue_size == 0 {
        u32::from(DEFAULT_QUEUE_SIZE)
    } else {
        req.queue_size
    };
    if !(2..=MAX_QUEUE_SIZE).contains(&queue_size) || !queue_size.is_power_of_two() {
        return Err(invalid(
            "queue_size",
            format!("{queue_size} is not a power of two in 2..={MAX_QUEUE_SIZE}"),
        ));
    }
    let block_size = if req.block_size == 0 {
        DEFAULT_BLOCK_SIZE
    } else {
        req.block_size
    };
    if block_size != 512 && block_size != 4096 {
        return Err(invalid(
            "block_size",
            format!("{block_size} is neither 512 nor 4096"),
        ));
    }
    let iothreads = if req.iothreads == 0 {
        u32::from(DEFAULT_IOTHREADS)
    } else {
        req.iothreads
    };
    let max_iothreads = num_queues.min(MAX_IOTHREADS);
    if !(1..=max_iothreads).contains(&iothreads) {
        return Err(invalid(
            "iothreads",
            format!(
                "{iothreads} is not in 1..={max_iothreads} (at most num_queues, at most \
                 {MAX_IOTHREADS})"
            ),
        ));
    }
    let cache = match CacheMode::try_from(req.cache) {
        Ok(CacheMode::Unspecified | CacheMode::Direct) => Cache::Direct,
        Ok(CacheMode::Writeback) => Cache::Writeback,
        Ok(CacheMode::Writethrough) => Cache::Writethrough,
        Err(_) => {
            return Err(invalid(
                "cache",
                format!("{} is not a CacheMode value", req.cache),
            ))
        }
    };
    if req.serial.len() > MAX_SERIAL_LEN {
        return Err(invalid(
            "serial",
            format!(
                "{} bytes; at most {MAX_SERIAL_LEN} are allowed",
                req.serial.len()
            ),
        ));
    }
    if let Some(c) = req.serial.chars().find(|c| !(' '..='~').contains(c)) {
        return Err(invalid(
            "serial",
            format!("contains {c:?}; only printable ASCII is allowed"),
        ));
    }
    let iothread_cpus = req.iothread_cpus.trim().to_string();
    if !iothread_cpus.is_empty() {
        check_cpu_list(&iothread_cpus)?;
    }
    let run_as = req
        .run_as
        .as_ref()
        .map(|r| check_run_as(r, ctx))
        .transpose()?;
    if let Some(us) = req.poll_max_us.filter(|&us| us > MAX_POLL_MAX_US) {
        return Err(invalid(
            "poll_max_us",
            format!("{us} µs; at most {MAX_POLL_MAX_US} µs are allowed (0 disables polling)"),
        ));
    }
    let identity = check_image(&req.image, block_size, &ctx.image_dirs)?;
    let vhost_socket = resolve_vhost_socket(&req.vhost_socket, &req.id, ctx)?;

    // The casts cannot truncate: every value was range-checked above.
    let spec = DiskSpec {
        id: req.id.clone(),
        image: PathBuf::from(&req.image),
        read_only: req.read_only,
        serial: req.serial.clone(),
        num_queues: num_queues as u16,
        queue_size: queue_size as u16,
        block_size,
        iothreads: iothreads as u16,
        cache,
        iothread_cpus,
        vhost_socket,
        incoming_for: (!req.incoming_for.is_empty()).then(|| req.incoming_for.clone()),
        run_as,
        poll_max_us: req.poll_max_us,
    };
    Ok((spec, identity))
}

/// Checks a ResizeDisk size against the disk's block size (the current capacity is checked
/// by the service, which asks the frontend).
pub fn check_new_size(new_size: u64, block_size: u32) -> Result<(), ValidationError> {
    if new_size == 0 {
        return Err(invalid("new_size_bytes", "must not be 0"));
    }
    if !new_size.is_multiple_of(u64::from(block_size)) {
        return Err(invalid(
            "new_size_bytes",
            format!("{new_size} is not a multiple of the block size {block_size}"),
        ));
    }
    Ok(())
}

/// Checks the reason of an operator migration blocker: a MigrationBlockerReason value, and
/// one of the operator's (the others are blkplaned's own).
pub fn check_operator_reason(reason: i32) -> Result<OperatorReason, ValidationError> {
    const F: &str = "reason";
    let r = MigrationBlockerReason::try_from(reason)
        .map_err(|_| invalid(F, format!("{reason} is not a MigrationBlockerReason value")))?;
    if r == MigrationBlockerReason::Unspecified {
        return Err(invalid(
            F,
            "must be set: operator_backup, operator_maintenance or operator_other",
        ));
    }
    migration::to_operator(r).ok_or_else(|| {
        invalid(
            F,
            format!(
                "{} is set and cleared by blkplaned itself; operators use operator_backup, \
                 operator_maintenance or operator_other",
                reason_name(r)
            ),
        )
    })
}

/// Checks an operator migration-blocker message: 1 to 256 bytes, no control characters (it
/// ends up in logs and one-line event messages).
pub fn check_blocker_message(message: &str) -> Result<(), ValidationError> {
    const F: &str = "message";
    if message.trim().is_empty() {
        return Err(invalid(
            F,
            "must not be empty: say why the disk must not migrate",
        ));
    }
    if message.len() > MAX_BLOCKER_MESSAGE {
        return Err(invalid(
            F,
            format!(
                "{} bytes; at most {MAX_BLOCKER_MESSAGE} are allowed",
                message.len()
            ),
        ));
    }
    if let Some(c) = message.chars().find(|c| c.is_control()) {
        return Err(invalid(F, format!("contains the control character {c:?}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    use blkplane_tests::TempDir as Tmp;

    fn ctx(tmp: &Tmp) -> Context {
        let disks_dir = tmp.path().join("disks");
        std::fs::create_dir_all(&disks_dir).unwrap();
        Context {
            disks_dir,
            socket_dirs: Vec::new(),
            image_dirs: Vec::new(),
            can_run_as: true,
        }
    }

    fn request(tmp: &Tmp) -> AddDiskRequest {
        let image = tmp.path().join("disk.img");
        std::fs::File::create(&image)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        AddDiskRequest {
            id: "disk0".into(),
            image: image.to_str().unwrap().into(),
            ..Default::default()
        }
    }

    fn field_of(r: Result<(DiskSpec, ImageIdentity), ValidationError>) -> &'static str {
        r.expect_err("expected an error").field()
    }

    #[test]
    fn run_as() {
        let tmp = Tmp::new("run-as");
        let mut c = ctx(&tmp);
        let base = request(&tmp);
        let with = |run_as: RunAs, c: &Context| {
            let mut r = base.clone();
            r.run_as = Some(run_as);
            check_add(&r, c)
        };
        let user = |uid, gid, groups: &[u32]| RunAs {
            uid,
            gid,
            groups: groups.to_vec(),
        };
        let spec = with(user(107, 107, &[36]), &c).unwrap().0;
        assert_eq!(
            spec.run_as,
            Some(RunAsSpec {
                uid: 107,
                gid: 107,
                groups: vec![36]
            })
        );
        assert_eq!(spec.run_as.unwrap().to_arg(), "107:107:36");
        assert_eq!(check_add(&base, &c).unwrap().0.run_as, None);
        assert_eq!(field_of(with(user(0, 107, &[]), &c)), "run_as.uid");
        assert_eq!(field_of(with(user(u32::MAX, 107, &[]), &c)), "run_as.uid");
        assert_eq!(field_of(with(user(107, u32::MAX, &[]), &c)), "run_as.gid");
        assert_eq!(
            field_of(with(user(107, 107, &[u32::MAX]), &c)),
            "run_as.groups"
        );
        assert_eq!(
            field_of(with(user(107, 107, &[1; 33]), &c)),
            "run_as.groups"
        );
        c.can_run_as = false;
        let refused = with(user(107, 107, &[]), &c).unwrap_err();
        assert!(
            matches!(
                refused,
                ValidationError::FailedPrecondition {
                    field: "run_as",
                    ..
                }
            ),
            "{refused:?}"
        );
    }

    #[test]
    fn ids() {
        for good in ["a", "disk0", "A.b_c-9", &"x".repeat(64)] {
            assert_eq!(check_id(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            ".hidden",
            "..",
            "a/b",
            "../etc",
            "a b",
            "é",
            "a\0",
            &"x".repeat(65),
        ] {
            let e = check_id(bad).expect_err(bad);
            assert_eq!(e.field(), "id");
            assert!(e.to_string().starts_with("id: "), "{e}");
        }
    }

    #[test]
    fn defaults_are_filled_in() {
        let tmp = Tmp::new("defaults");
        let (spec, _) = check_add(&request(&tmp), &ctx(&tmp)).unwrap();
        assert_eq!(spec.num_queues, 1);
        assert_eq!(spec.queue_size, 256);
        assert_eq!(spec.block_size, 512);
        assert_eq!(spec.iothreads, 1);
        assert_eq!(spec.cache, Cache::Direct);
        assert_eq!(spec.vhost_socket, tmp.path().join("disks/disk0.sock"));
    }

    #[test]
    fn ranges() {
        let tmp = Tmp::new("ranges");
        let c = ctx(&tmp);
        let base = request(&tmp);
        let with = |f: &dyn Fn(&mut AddDiskRequest)| {
            let mut r = base.clone();
            f(&mut r);
            check_add(&r, &c)
        };
        assert_eq!(field_of(with(&|r| r.num_queues = 257)), "num_queues");
        assert_eq!(field_of(with(&|r| r.queue_size = 3)), "queue_size");
        assert_eq!(field_of(with(&|r| r.queue_size = 65536)), "queue_size");
        assert_eq!(field_of(with(&|r| r.queue_size = 1)), "queue_size");
        assert_eq!(field_of(with(&|r| r.block_size = 1024)), "block_size");
        assert_eq!(field_of(with(&|r| r.iothreads = 2)), "iothreads");
        assert_eq!(
            field_of(with(&|r| {
                r.num_queues = 128;
                r.iothreads = 65
            })),
            "iothreads"
        );
        assert_eq!(field_of(with(&|r| r.cache = 17)), "cache");
        assert_eq!(field_of(with(&|r| r.serial = "x".repeat(21))), "serial");
        assert_eq!(field_of(with(&|r| r.serial = "a\nb".into())), "serial");
        assert_eq!(
            field_of(with(&|r| r.poll_max_us = Some(1001))),
            "poll_max_us"
        );
        assert_eq!(
            field_of(with(&|r| r.iothread_cpus = "x".into())),
            "iothread_cpus"
        );
        assert_eq!(
            field_of(with(&|r| r.iothread_cpus = "3-1".into())),
            "iothread_cpus"
        );
        assert_eq!(
            field_of(with(&|r| r.iothread_cpus = "100000".into())),
            "iothread_cpus"
        );
        let ok = with(&|r| {
            r.num_queues = 256;
            r.queue_size = 32768;
            r.block_size = 4096;
            r.iothreads = 64;
            r.cache = CacheMode::Writethrough as i32;
            r.serial = "S".repeat(20);
            r.iothread_cpus = "0".into();
        })
        .unwrap()
        .0;
        assert_eq!(
            (ok.num_queues, ok.queue_size, ok.iothreads),
            (256, 32768, 64)
        );
    }

    #[test]
    fn images() {
        let tmp = Tmp::new("images");
        let c = ctx(&tmp);
        let base = request(&tmp);
        let mut r = base.clone();
        r.image = tmp.path().join("missing.img").to_str().unwrap().into();
        assert!(matches!(
            check_add(&r, &c),
            Err(ValidationError::NotFound { field: "image", .. })
        ));
        r.image = tmp.path().to_str().unwrap().into();
        assert_eq!(field_of(check_add(&r, &c)), "image");
        r.image = "disk.img".into();
        assert_eq!(field_of(check_add(&r, &c)), "image");
        r.image = String::new();
        assert_eq!(field_of(check_add(&r, &c)), "image");
        let tiny = tmp.path().join("tiny.img");
        std::fs::File::create(&tiny).unwrap().set_len(100).unwrap();
        r.image = tiny.to_str().unwrap().into();
        assert_eq!(field_of(check_add(&r, &c)), "image");
        // A symlink reaches the same identity as the file itself.
        let link = tmp.path().join("link.img");
        std::os::unix::fs::symlink(&base.image, &link).unwrap();
        assert_eq!(
            image_identity(&link),
            image_identity(Path::new(&base.image))
        );
    }

    #[test]
    fn sockets() {
        let tmp = Tmp::new("sockets");
        let c = ctx(&tmp);
        let base = request(&tmp);
        let with_socket = |s: &str| {
            let mut r = base.clone();
            r.vhost_socket = s.into();
            check_add(&r, &c)
        };
        let root = tmp.path().to_str().unwrap().to_string();
        assert_eq!(
            field_of(with_socket(&format!("{root}/disks/../x.sock"))),
            "vhost_socket"
        );
        assert_eq!(field_of(with_socket("../x.sock")), "vhost_socket");
        assert_eq!(field_of(with_socket("sub/../../x.sock")), "vhost_socket");
        assert_eq!(
            field_of(with_socket(&format!("{root}/nodir/x.sock"))),
            "vhost_socket"
        );
        assert_eq!(
            field_of(with_socket(&format!("{root}/{}", "s".repeat(120)))),
            "vhost_socket"
        );
        // An existing regular file would be unlinked by the frontend.
        assert_eq!(field_of(with_socket(&base.image)), "vhost_socket");
        // A live listener belongs to someone else.
        let live = tmp.path().join("live.sock");
        let _listener = UnixListener::bind(&live).unwrap();
        assert!(matches!(
            with_socket(live.to_str().unwrap()),
            Err(ValidationError::AlreadyExists {
                field: "vhost_socket",
                ..
            })
        ));
        // A stale socket is fine (the frontend replaces it).
        let stale = tmp.path().join("stale.sock");
        drop(UnixListener::bind(&stale).unwrap());
        assert_eq!(
            with_socket(stale.to_str().unwrap()).unwrap().0.vhost_socket,
            stale
        );
        // Relative: under the disks dir; `.` components are dropped.
        assert_eq!(
            with_socket("./vm1.sock").unwrap().0.vhost_socket,
            tmp.path().join("disks/vm1.sock")
        );
        assert_eq!(
            with_socket(&format!("{root}//./x.sock"))
                .unwrap()
                .0
                .vhost_socket,
            tmp.path().join("x.sock")
        );
    }

    #[test]
    fn allowed_socket_dirs() {
        let tmp = Tmp::new("allowed");
        let mut c = ctx(&tmp);
        let allowed = tmp.path().join("vms");
        let other = tmp.path().join("other");
        std::fs::create_dir_all(&allowed).unwrap();
        std::fs::create_dir_all(&other).unwrap();
        c.socket_dirs = vec![allowed.clone()];
        let mut r = request(&tmp);
        r.vhost_socket = other.join("x.sock").to_str().unwrap().into();
        assert_eq!(field_of(check_add(&r, &c)), "vhost_socket");
        // A symlink inside the allowed dir that points outside does not get out.
        std::os::unix::fs::symlink(&other, allowed.join("escape")).unwrap();
        r.vhost_socket = allowed.join("escape/x.sock").to_str().unwrap().into();
        assert_eq!(field_of(check_add(&r, &c)), "vhost_socket");
        r.vhost_socket = allowed.join("x.sock").to_str().unwrap().into();
        assert!(check_add(&r, &c).is_ok());
        r.vhost_socket = String::new();
        assert!(check_add(&r, &c).is_ok());
    }

    #[test]
    fn allowed_image_dirs() {
        let tmp = Tmp::new("imgdirs");
        let mut c = ctx(&tmp);
        let allowed = tmp.path().join("images");
        std::fs::create_dir_all(&allowed).unwrap();
        c.image_dirs = vec![allowed.clone()];
        let mut r = request(&tmp);
        // disk.img is in the temp dir itself, outside images/.
        assert_eq!(field_of(check_add(&r, &c)), "image");
        let inside = allowed.join("a.img");
        std::fs::File::create(&inside)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        r.image = inside.to_str().unwrap().into();
        assert!(check_add(&r, &c).is_ok());
        // Neither '..' nor a symlink leads out.
        r.image = format!("{}/../disk.img", allowed.display());
        assert_eq!(field_of(check_add(&r, &c)), "image");
        std::os::unix::fs::symlink(tmp.path().join("disk.img"), allowed.join("link.img")).unwrap();
        r.image = allowed.join("link.img").to_str().unwrap().into();
        assert_eq!(field_of(check_add(&r, &c)), "image");
    }

    #[test]
    fn long_id_for_runtime_dir() {
        let tmp = Tmp::new("longid");
        let mut c = ctx(&tmp);
        c.disks_dir = PathBuf::from(format!("/{}", "d".repeat(60)));
        let mut r = request(&tmp);
        r.id = "x".repeat(60);
        assert_eq!(field_of(check_add(&r, &c)), "id");
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(proc::parse_cpu_list("0-1,3"), Ok(vec![0, 1, 3]));
        assert_eq!(proc::parse_cpu_list("3, 1-2 ,1"), Ok(vec![1, 2, 3]));
        assert!(proc::parse_cpu_list("").is_err());
        assert!(proc::parse_cpu_list("1-").is_err());
        assert!(proc::parse_cpu_list("-1").is_err());
        assert!(proc::parse_cpu_list("2-1").is_err());
        assert!(proc::parse_cpu_list("1,,2").is_err());
    }

    #[test]
    fn throttle_input() {
        let ok = ThrottleLimits {
            iops_total: 100,
            iops_total_max: 200,
            iops_total_max_length: 10,
            bps_read: 1 << 20,
            iops_size: 4096,
            ..Default::default()
        };
        assert_eq!(check_limits(&ok), Ok(()));
        assert_eq!(check_limits(&ThrottleLimits::default()), Ok(()));
        let cases: [(ThrottleLimits, &str); 5] = [
            (
                ThrottleLimits {
                    iops_total_max: 5,
                    ..Default::default()
                },
                "limits.iops_total_max",
            ),
            (
                ThrottleLimits {
                    bps_total: 1,
                    bps_write: 1,
                    ..Default::default()
                },
                "limits.bps_write",
            ),
            (
                ThrottleLimits {
                    iops_size: 512,
                    ..Default::default()
                },
                "limits.iops_size",
            ),
            (
                ThrottleLimits {
                    bps_read: 10,
                    bps_read_max: 5,
                    ..Default::default()
                },
                "limits.bps_read_max",
            ),
            (
                ThrottleLimits {
                    iops_write: 1,
                    iops_write_max_length: 3,
                    ..Default::default()
                },
                "limits.iops_write_max_length",
            ),
        ];
        for (limits, field) in cases {
            let e = check_limits(&limits).unwrap_err();
            assert_eq!(e.field(), field, "{e}");
            let text = e.to_string();
            assert!(text.starts_with(&format!("{field}: ")), "{text}");
            // The field is named once, not twice ("limits.x: x: ...").
            assert!(!text[field.len() + 2..].starts_with(&field[7..]), "{text}");
            assert!(matches!(e, ValidationError::Invalid { .. }));
        }
        assert_eq!(check_group("tenant-A_1.x"), Ok(()));
        for bad in ["", ".g", "a/b", "a b", &"g".repeat(65)] {
            assert_eq!(check_group(bad).unwrap_err().field(), "group", "{bad:?}");
        }
    }

    #[test]
    fn blocker_input() {
        assert_eq!(
            check_operator_reason(MigrationBlockerReason::OperatorBackup as i32),
            Ok(OperatorReason::Backup)
        );
        for bad in [0, 99, -1, MigrationBlockerReason::Draining as i32] {
            assert_eq!(check_operator_reason(bad).unwrap_err().field(), "reason");
        }
        assert!(check_operator_reason(1)
            .unwrap_err()
            .to_string()
            .contains("draining is set and cleared by blkplaned"));
        assert_eq!(check_blocker_message("nightly backup of vd1"), Ok(()));
        for bad in ["", "  ", "a\nb", &"x".repeat(257)] {
            assert_eq!(check_blocker_message(bad).unwrap_err().field(), "message");
        }
    }

    /// The source disk of the incoming tests: added from `request(tmp)` with non-default
    /// device fields.
    fn source_spec(tmp: &Tmp) -> DiskSpec {
        let mut r = request(tmp);
        r.id = "src".into();
        r.read_only = true;
        r.serial = "SER-1".into();
        r.num_queues = 4;
        r.queue_size = 128;
        r.block_size = 4096;
        check_add(&r, &ctx(tmp)).unwrap().0
    }

    #[test]
    fn incoming_takes_the_source_device() {
        let tmp = Tmp::new("incoming");
        let c = ctx(&tmp);
        let src = source_spec(&tmp);
        let source = Some(MigrationSource {
            spec: &src,
            incoming: None,
            blockers: &[],
        });
        let req = AddDiskRequest {
            id: "dst".into(),
            incoming_for: "src".into(),
            iothreads: 2,
            ..Default::default()
        };
        // Empty and zero: everything the guest sees comes from the source; the iothreads
        // (not seen by the guest) are the request's own.
        let resolved = resolve_incoming(&req, source).unwrap();
        let (spec, identity) = check_add(&resolved, &c).unwrap();
        assert_eq!(spec.image, src.image);
        assert_eq!((spec.read_only, spec.serial.as_str()), (true, "SER-1"));
        assert_eq!(
            (
                spec.num_queues,
                spec.queue_size,
                spec.block_size,
                spec.iothreads
            ),
            (4, 128, 4096, 2)
        );
        assert_eq!(spec.incoming_for.as_deref(), Some("src"));
        assert_eq!(spec.vhost_socket, tmp.path().join("disks/dst.sock"));
        assert_eq!(image_identity(&src.image), Some(identity));
        // The same values spelled out, and the image by another path, are fine too.
        let link = tmp.path().join("link.img");
        std::os::unix::fs::symlink(&src.image, &link).unwrap();
        let same = AddDiskRequest {
            image: link.to_str().unwrap().into(),
            read_only: true,
            serial: "SER-1".into(),
            num_queues: 4,
            queue_size: 128,
            block_size: 4096,
            ..req.clone()
        };
        let (spec, _) = check_add(&resolve_incoming(&same, source).unwrap(), &c).unwrap();
        assert_eq!(spec.image, link);
        // An ordinary request passes through untouched.
        let plain = request(&tmp);
        assert_eq!(resolve_incoming(&plain, None).unwrap(), plain);
        assert_eq!(check_add(&plain, &c).unwrap().0.incoming_for, None);
    }

    #[test]
    fn incoming_rules() {
        let tmp = Tmp::new("incrules");
        let src = source_spec(&tmp);
        let source = Some(MigrationSource {
            spec: &src,
            incoming: None,
            blockers: &[],
        });
        let base = AddDiskRequest {
            id: "dst".into(),
            incoming_for: "src".into(),
            ..Default::default()
        };
        let with = |f: &dyn Fn(&mut AddDiskRequest)| {
            let mut r = base.clone();
            f(&mut r);
            resolve_incoming(&r, source)
        };
        let other = tmp.path().join("other.img");
        std::fs::File::create(&other)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let invalid_field = |r: Result<AddDiskRequest, ValidationError>| match r {
            Err(ValidationError::Invalid { field, reason }) => {
                assert!(!reason.is_empty());
                field
            }
            other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
        };
        assert_eq!(
            invalid_field(with(&|r| r.image = other.to_str().unwrap().into())),
            "image"
        );
        assert_eq!(
            invalid_field(with(&|r| r.serial = "SER-2".into())),
            "serial"
        );
        assert_eq!(invalid_field(with(&|r| r.num_queues = 2)), "num_queues");
        assert_eq!(invalid_field(with(&|r| r.queue_size = 256)), "queue_size");
        assert_eq!(invalid_field(with(&|r| r.block_size = 512)), "block_size");
        assert_eq!(
            invalid_field(with(&|r| r.incoming_for = "a/b".into())),
            "incoming_for"
        );
        assert_eq!(
            invalid_field(with(&|r| r.incoming_for = "dst".into())),
            "incoming_for"
        );
        let e = with(&|r| r.num_queues = 2).unwrap_err().to_string();
        assert!(
            e.starts_with("num_queues: 2 differs from 4 of disk src"),
            "{e}"
        );
        // read_only unset takes the source's; set on a writable source is refused.
        let mut writable = src.clone();
        writable.read_only = false;
        let ws = Some(MigrationSource {
            spec: &writable,
            incoming: None,
            blockers: &[],
        });
        let mut ro = base.clone();
        ro.read_only = true;
        assert_eq!(invalid_field(resolve_incoming(&ro, ws)), "read_only");
        // A missing image is check_add's to report (NOT_FOUND), not a mismatch.
        let missing = with(&|r| r.image = tmp.path().join("gone.img").to_str().unwrap().into());
        assert!(missing.is_ok(), "{missing:?}");
        // No such disk; a source that is incoming itself, or already has an incoming disk.
        assert!(matches!(
            resolve_incoming(&base, None),
            Err(ValidationError::NotFound {
                field: "incoming_for",
                ..
            })
        ));
        let mut incoming_src = src.clone();
        incoming_src.incoming_for = Some("older".into());
        let e = resolve_incoming(
            &base,
            Some(MigrationSource {
                spec: &incoming_src,
                incoming: None,
                blockers: &[],
            }),
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                ValidationError::FailedPrecondition {
                    field: "incoming_for",
                    ..
                }
            ),
            "{e:?}"
        );
        let e = resolve_incoming(
            &base,
            Some(MigrationSource {
                spec: &src,
                incoming: Some("dst0"),
                blockers: &[],
            }),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("already has an incoming disk, dst0"),
            "{e}"
        );
        assert_eq!(e.field(), "incoming_for");
        // A source that must not be migrated now gets no destination; the reasons are named.
        let blockers = ["operator_backup: nightly".to_string()];
        let e = resolve_incoming(
            &base,
            Some(MigrationSource {
                spec: &src,
                incoming: None,
                blockers: &blockers,
            }),
        )
        .unwrap_err();
        assert!(
            matches!(e, ValidationError::FailedPrecondition { .. }),
            "{e:?}"
        );
        assert_eq!(e.field(), "incoming_for");
        assert!(e.to_string().contains("operator_backup: nightly"), "{e}");
    }

    #[test]
    fn new_sizes() {
        assert_eq!(check_new_size(4096, 512), Ok(()));
        assert_eq!(
            check_new_size(0, 512).unwrap_err().field(),
            "new_size_bytes"
        );
        assert_eq!(
            check_new_size(4096 + 512, 4096).unwrap_err().field(),
            "new_size_bytes"
        );
    }
}
