//! The settings of a disk (AddDiskRequest `settings`): ranges and defaults, the image, the
//! vhost-user socket, the CPU list and the user its processes run as. Every error names the
//! request field (`settings.num_queues`).

use std::fs::OpenOptions;
use std::io::{Seek, SeekFrom};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

use blkplane_chain::{self as chain, ChainError};
use blkplane_procfs as proc;

use super::{check_id, invalid, Context, ValidationError};

use crate::pb::{AddDiskRequest, CacheMode, ImageFormat, RunAs};
use crate::state::{Cache, DiskSpec, Format, RunAsSpec};

/// Longest serial number (virtio-blk GET_ID answers 20 bytes).
pub const MAX_SERIAL_LEN: usize = 20;
/// The largest DiskSettings `poll_max_us` (the frontend's `--poll-max-us` bound).
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

/// Checks DiskSettings `run_as`.
fn check_run_as(run_as: &RunAs, ctx: &Context) -> Result<RunAsSpec, ValidationError> {
    use blkplane_sandbox::RunAsError;
    blkplane_sandbox::RunAs::new(run_as.uid, run_as.gid, run_as.groups.clone()).map_err(|e| {
        let field = match e {
            RunAsError::Root | RunAsError::Unchanged("uid") => "settings.run_as.uid",
            RunAsError::Unchanged("gid") => "settings.run_as.gid",
            _ => "settings.run_as.groups",
        };
        invalid(field, e.to_string())
    })?;
    if !ctx.can_run_as {
        return Err(ValidationError::FailedPrecondition {
            field: "settings.run_as",
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

/// Checks `image` (absolute, exists, a regular file or block device, inside an allowed
/// directory if any are configured) in `format` (`None`: probed from its first bytes, as the
/// frontend would): a qcow2 image's backing chain is opened as the frontend will open it
/// (depth, loops, the allowed directories, what imago serves; for a `writable` disk, refcounts
/// that imago can allocate with), and the disk (a qcow2 image's virtual size) is at least one
/// block. Returns the image's identity and its format.
pub fn check_image(
    image: &str,
    block_size: u32,
    format: Option<Format>,
    image_dirs: &[PathBuf],
    writable: bool,
) -> Result<(ImageIdentity, Format), ValidationError> {
    const F: &str = "settings.image";
    if image.is_empty() {
        return Err(invalid(F, "must not be empty"));
    }
    let path = Path::new(image);
    if !path.is_absolute() {
        return Err(invalid(F, format!("{image:?} is not an absolute path")));
    }
    let not_found = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
    let md = match std::fs::metadata(path) {
        Ok(md) => md,
        Err(e) if not_found(&e) => {
            return Err(ValidationError::NotFound {
                field: F,
                reason: format!("{image} does not exist"),
            })
        }
        Err(e) => return Err(invalid(F, format!("{image}: {e}"))),
    };
    let is_image = |ft: std::fs::FileType| ft.is_file() || ft.is_block_device();
    if !is_image(md.file_type()) {
        return Err(invalid(
            F,
            format!("{image} is not a regular file or a block device"),
        ));
    }
    if !image_dirs.is_empty() {
        // Resolved, so that neither a symlink nor a '..' leads out of the allowed directories.
        std::fs::canonicalize(path).map_err(|e| invalid(F, format!("{image}: {e}")))?;
        if !chain::inside(path, image_dirs) {
            return Err(invalid(
                F,
                format!(
                    "{image} is outside the allowed image directories ({})",
                    chain::describe_dirs(image_dirs)
                ),
            ));
        }
    }
    // Read-only, and non-blocking in case the path was replaced by a FIFO since the stat: the
    // type is checked again on what was opened.
    let mut file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| invalid(F, format!("{image}: cannot open it: {e}")))?;
    let md = file
        .metadata()
        .map_err(|e| invalid(F, format!("{image}: {e}")))?;
    let identity = if md.file_type().is_file() {
        ImageIdentity::File {
            dev: md.dev(),
            ino: md.ino(),
        }
    } else if md.file_type().is_block_device() {
        ImageIdentity::Block { rdev: md.rdev() }
    } else {
        return Err(invalid(F, format!("{image} changed while checked")));
    };
    let format = match format {
        Some(format) => format,
        None => {
            Format::from_chain(chain::probe(&file, path).map_err(|e| invalid(F, e.to_string()))?)
        }
    };
    // SEEK_END gives the size of regular files and block devices alike, as in the frontend.
    let (size, what) = match format {
        Format::Raw => (
            file.seek(SeekFrom::End(0))
                .map_err(|e| invalid(F, format!("{image}: {e}")))?,
            "bytes",
        ),
        Format::Qcow2 => (
            chain::open_for(&file, path, image_dirs, writable)
                .map_err(chain_error)?
                .size,
            "bytes of virtual size",
        ),
    };
    if size < u64::from(block_size) {
        return Err(invalid(
            F,
            format!("{image} has {size} {what}, less than one {block_size}-byte block"),
        ));
    }
    Ok((identity, format))
}

/// A qcow2 chain the frontend would refuse, as `settings.image`'s error: NOT_FOUND for a
/// backing file that does not exist, INVALID_ARGUMENT for the rest; the message has the chain
/// problem with its paths.
fn chain_error(e: ChainError) -> ValidationError {
    const F: &str = "settings.image";
    match &e {
        ChainError::OpenBacking { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            ValidationError::NotFound {
                field: F,
                reason: e.to_string(),
            }
        }
        _ => invalid(F, e.to_string()),
    }
}

/// Checks a Snapshot's `overlay` as [`check_new_image`] does.
pub fn check_overlay(overlay: &str, image_dirs: &[PathBuf]) -> Result<PathBuf, ValidationError> {
    check_new_image("overlay", overlay, image_dirs)
}

/// Checks `field`, `path_text`, the path of an image blkplaned is to create (a Snapshot's overlay, the
/// new image of a copy from another node): absolute, no `..`, not a directory name, in an
/// existing directory that is inside one of the allowed image directories (if any are
/// configured), and nothing there yet. Returns the path.
pub fn check_new_image(
    field: &'static str,
    path_text: &str,
    image_dirs: &[PathBuf],
) -> Result<PathBuf, ValidationError> {
    if path_text.is_empty() {
        return Err(invalid(field, "must not be empty"));
    }
    let path = Path::new(path_text);
    if !path.is_absolute() {
        return Err(invalid(
            field,
            format!("{path_text:?} is not an absolute path"),
        ));
    }
    if has_parent_component(path) || path_text.ends_with('/') {
        return Err(invalid(
            field,
            format!("{path_text:?} has a '..' component or names a directory"),
        ));
    }
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(invalid(field, format!("{path_text:?} names no file")));
    };
    let real_dir = std::fs::canonicalize(dir)
        .map_err(|e| invalid(field, format!("the directory of {path_text}: {e}")))?;
    if !chain::inside(&real_dir, image_dirs) {
        return Err(invalid(
            field,
            format!(
                "{path_text} is outside the allowed image directories ({})",
                chain::describe_dirs(image_dirs)
            ),
        ));
    }
    if std::fs::symlink_metadata(path).is_ok() {
        return Err(ValidationError::AlreadyExists {
            field,
            reason: format!("{path_text} exists"),
        });
    }
    Ok(real_dir.join(name))
}

/// Checks a CPU list: well-formed, and every CPU present on this machine.
pub fn check_cpu_list(list: &str) -> Result<(), ValidationError> {
    let cpus = proc::parse_cpu_list(list).map_err(|e| invalid("settings.iothread_cpus", e))?;
    if let Some(possible) = proc::possible_cpus() {
        if let Some(cpu) = cpus.iter().find(|c| !possible.contains(c)) {
            return Err(invalid(
                "settings.iothread_cpus",
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
    const F: &str = "settings.vhost_socket";
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
    let s = req.settings.clone().unwrap_or_default();
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

    let num_queues = if s.num_queues == 0 {
        u32::from(DEFAULT_QUEUES)
    } else {
        s.num_queues
    };
    if !(1..=MAX_QUEUES).contains(&num_queues) {
        return Err(invalid(
            "settings.num_queues",
            format!("{num_queues} is not in 1..={MAX_QUEUES}"),
        ));
    }
    let queue_size = if s.queue_size == 0 {
        u32::from(DEFAULT_QUEUE_SIZE)
    } else {
        s.queue_size
    };
    if !(2..=MAX_QUEUE_SIZE).contains(&queue_size) || !queue_size.is_power_of_two() {
        return Err(invalid(
            "settings.queue_size",
            format!("{queue_size} is not a power of two in 2..={MAX_QUEUE_SIZE}"),
        ));
    }
    let block_size = if s.block_size == 0 {
        DEFAULT_BLOCK_SIZE
    } else {
        s.block_size
    };
    if block_size != 512 && block_size != 4096 {
        return Err(invalid(
            "settings.block_size",
            format!("{block_size} is neither 512 nor 4096"),
        ));
    }
    let iothreads = if s.iothreads == 0 {
        u32::from(DEFAULT_IOTHREADS)
    } else {
        s.iothreads
    };
    let max_iothreads = num_queues.min(MAX_IOTHREADS);
    if !(1..=max_iothreads).contains(&iothreads) {
        return Err(invalid(
            "settings.iothreads",
            format!(
                "{iothreads} is not in 1..={max_iothreads} (at most num_queues, at most \
                 {MAX_IOTHREADS})"
            ),
        ));
    }
    let cache = match CacheMode::try_from(s.cache) {
        Ok(CacheMode::Unspecified | CacheMode::Direct) => Cache::Direct,
        Ok(CacheMode::Writeback) => Cache::Writeback,
        Ok(CacheMode::Writethrough) => Cache::Writethrough,
        Err(_) => {
            return Err(invalid(
                "settings.cache",
                format!("{} is not a CacheMode value", s.cache),
            ))
        }
    };
    if s.serial.len() > MAX_SERIAL_LEN {
        return Err(invalid(
            "settings.serial",
            format!(
                "{} bytes; at most {MAX_SERIAL_LEN} are allowed",
                s.serial.len()
            ),
        ));
    }
    if let Some(c) = s.serial.chars().find(|c| !(' '..='~').contains(c)) {
        return Err(invalid(
            "settings.serial",
            format!("contains {c:?}; only printable ASCII is allowed"),
        ));
    }
    let iothread_cpus = s.iothread_cpus.trim().to_string();
    if !iothread_cpus.is_empty() {
        check_cpu_list(&iothread_cpus)?;
    }
    let run_as = s
        .run_as
        .as_ref()
        .map(|r| check_run_as(r, ctx))
        .transpose()?;
    if let Some(us) = s.poll_max_us.filter(|&us| us > MAX_POLL_MAX_US) {
        return Err(invalid(
            "settings.poll_max_us",
            format!("{us} µs; at most {MAX_POLL_MAX_US} µs are allowed (0 disables polling)"),
        ));
    }
    let format = match ImageFormat::try_from(s.format) {
        Ok(ImageFormat::Unspecified) => None,
        Ok(ImageFormat::Raw) => Some(Format::Raw),
        Ok(ImageFormat::Qcow2) => Some(Format::Qcow2),
        Err(_) => {
            return Err(invalid(
                "settings.format",
                format!("{} is not an ImageFormat value", s.format),
            ))
        }
    };
    let (identity, format) =
        check_image(&s.image, block_size, format, &ctx.image_dirs, !s.read_only)?;
    // The node name the caller resolved it with (check_add itself knows no node name).
    let incoming_from = req
        .incoming_from
        .as_ref()
        .map(|_| super::check_incoming_from(req, &ctx.node_name))
        .transpose()?
        .flatten()
        .map(|(from, _)| from);
    if format == Format::Qcow2 && (!req.incoming_for.is_empty() || incoming_from.is_some()) {
        // Each frontend keeps the image's metadata (L2 tables, refcounts) in its iothread and
        // writes it back from there: two frontends on one qcow2 image would allocate the same
        // clusters.
        let (field, source) = match &incoming_from {
            Some(from) => ("incoming_from", from.to_string()),
            None => ("incoming_for", format!("disk {}", req.incoming_for)),
        };
        return Err(ValidationError::FailedPrecondition {
            field,
            reason: format!(
                "the image {} of {source} is qcow2, and live migration of a qcow2 disk is not \
                 supported yet (both frontends would cache and write its metadata)",
                s.image
            ),
        });
    }
    let vhost_socket = resolve_vhost_socket(&s.vhost_socket, &req.id, ctx)?;

    // The casts cannot truncate: every value was range-checked above.
    let spec = DiskSpec {
        id: req.id.clone(),
        image: PathBuf::from(&s.image),
        // Kept, probed or not: see DiskSpec::format.
        format: Some(format),
        read_only: s.read_only,
        serial: s.serial.clone(),
        num_queues: num_queues as u16,
        queue_size: queue_size as u16,
        block_size,
        iothreads: iothreads as u16,
        cache,
        iothread_cpus,
        vhost_socket,
        incoming_for: (!req.incoming_for.is_empty()).then(|| req.incoming_for.clone()),
        incoming_from,
        run_as,
        poll_max_us: s.poll_max_us,
    };
    Ok((spec, identity))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use std::os::unix::net::{UnixDatagram, UnixListener};

    pub(in crate::validate) use blkplane_tests::TempDir as Tmp;

    pub(in crate::validate) fn ctx(tmp: &Tmp) -> Context {
        let disks_dir = tmp.path().join("disks");
        std::fs::create_dir_all(&disks_dir).unwrap();
        Context {
            disks_dir,
            socket_dirs: Vec::new(),
            image_dirs: Vec::new(),
            can_run_as: true,
            node_name: "node-b".into(),
        }
    }

    pub(in crate::validate) fn request(tmp: &Tmp) -> AddDiskRequest {
        let image = tmp.path().join("disk.img");
        std::fs::File::create(&image)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        AddDiskRequest::with_image("disk0", image.to_str().unwrap())
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
            r.settings_mut().run_as = Some(run_as);
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
        assert_eq!(field_of(with(user(0, 107, &[]), &c)), "settings.run_as.uid");
        assert_eq!(
            field_of(with(user(u32::MAX, 107, &[]), &c)),
            "settings.run_as.uid"
        );
        assert_eq!(
            field_of(with(user(107, u32::MAX, &[]), &c)),
            "settings.run_as.gid"
        );
        assert_eq!(
            field_of(with(user(107, 107, &[u32::MAX]), &c)),
            "settings.run_as.groups"
        );
        assert_eq!(
            field_of(with(user(107, 107, &[1; 33]), &c)),
            "settings.run_as.groups"
        );
        c.can_run_as = false;
        let refused = with(user(107, 107, &[]), &c).unwrap_err();
        assert!(
            matches!(
                refused,
                ValidationError::FailedPrecondition {
                    field: "settings.run_as",
                    ..
                }
            ),
            "{refused:?}"
        );
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
        assert_eq!(
            field_of(with(&|r| r.settings_mut().num_queues = 257)),
            "settings.num_queues"
        );
        assert_eq!(
            field_of(with(&|r| r.settings_mut().queue_size = 3)),
            "settings.queue_size"
        );
        assert_eq!(
            field_of(with(&|r| r.settings_mut().queue_size = 65536)),
            "settings.queue_size"
        );
        assert_eq!(
            field_of(with(&|r| r.settings_mut().queue_size = 1)),
            "settings.queue_size"
        );
        assert_eq!(
            field_of(with(&|r| r.settings_mut().block_size = 1024)),
            "settings.block_size"
        );
        assert_eq!(
            field_of(with(&|r| r.settings_mut().iothreads = 2)),
            "settings.iothreads"
        );
        assert_eq!(
            field_of(with(&|r| {
                r.settings_mut().num_queues = 128;
                r.settings_mut().iothreads = 65
            })),
            "settings.iothreads"
        );
        assert_eq!(
            field_of(with(&|r| r.settings_mut().cache = 17)),
            "settings.cache"
        );
        assert_eq!(
            field_of(with(&|r| r.settings_mut().serial = "x".repeat(21))),
            "settings.serial"
        );
        assert_eq!(
            field_of(with(&|r| r.settings_mut().serial = "a\nb".into())),
            "settings.serial"
        );
        assert_eq!(
            field_of(with(&|r| r.settings_mut().poll_max_us = Some(1001))),
            "settings.poll_max_us"
        );
        assert_eq!(
            field_of(with(&|r| r.settings_mut().iothread_cpus = "x".into())),
            "settings.iothread_cpus"
        );
        assert_eq!(
            field_of(with(&|r| r.settings_mut().iothread_cpus = "3-1".into())),
            "settings.iothread_cpus"
        );
        assert_eq!(
            field_of(with(&|r| r.settings_mut().iothread_cpus = "100000".into())),
            "settings.iothread_cpus"
        );
        let ok = with(&|r| {
            r.settings_mut().num_queues = 256;
            r.settings_mut().queue_size = 32768;
            r.settings_mut().block_size = 4096;
            r.settings_mut().iothreads = 64;
            r.settings_mut().cache = CacheMode::Writethrough as i32;
            r.settings_mut().serial = "S".repeat(20);
            r.settings_mut().iothread_cpus = "0".into();
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
        r.settings_mut().image = tmp.path().join("missing.img").to_str().unwrap().into();
        assert!(matches!(
            check_add(&r, &c),
            Err(ValidationError::NotFound {
                field: "settings.image",
                ..
            })
        ));
        r.settings_mut().image = tmp.path().to_str().unwrap().into();
        assert_eq!(field_of(check_add(&r, &c)), "settings.image");
        r.settings_mut().image = "disk.img".into();
        assert_eq!(field_of(check_add(&r, &c)), "settings.image");
        r.settings_mut().image = String::new();
        assert_eq!(field_of(check_add(&r, &c)), "settings.image");
        let tiny = tmp.path().join("tiny.img");
        std::fs::File::create(&tiny).unwrap().set_len(100).unwrap();
        r.settings_mut().image = tiny.to_str().unwrap().into();
        assert_eq!(field_of(check_add(&r, &c)), "settings.image");
        // A symlink reaches the same identity as the file itself.
        let link = tmp.path().join("link.img");
        std::os::unix::fs::symlink(&base.settings_or_default().image, &link).unwrap();
        assert_eq!(
            image_identity(&link),
            image_identity(Path::new(&base.settings_or_default().image))
        );
    }

    #[test]
    fn sockets() {
        let tmp = Tmp::new("sockets");
        let c = ctx(&tmp);
        let base = request(&tmp);
        let with_socket = |s: &str| {
            let mut r = base.clone();
            r.settings_mut().vhost_socket = s.into();
            check_add(&r, &c)
        };
        let root = tmp.path().to_str().unwrap().to_string();
        assert_eq!(
            field_of(with_socket(&format!("{root}/disks/../x.sock"))),
            "settings.vhost_socket"
        );
        assert_eq!(field_of(with_socket("../x.sock")), "settings.vhost_socket");
        assert_eq!(
            field_of(with_socket("sub/../../x.sock")),
            "settings.vhost_socket"
        );
        assert_eq!(
            field_of(with_socket(&format!("{root}/nodir/x.sock"))),
            "settings.vhost_socket"
        );
        assert_eq!(
            field_of(with_socket(&format!("{root}/{}", "s".repeat(120)))),
            "settings.vhost_socket"
        );
        // An existing regular file would be unlinked by the frontend.
        assert_eq!(
            field_of(with_socket(&base.settings_or_default().image)),
            "settings.vhost_socket"
        );
        // A live listener belongs to someone else.
        let live = tmp.path().join("live.sock");
        let _listener = UnixListener::bind(&live).unwrap();
        assert!(matches!(
            with_socket(live.to_str().unwrap()),
            Err(ValidationError::AlreadyExists {
                field: "settings.vhost_socket",
                ..
            })
        ));
        // A stale socket is fine (the frontend replaces it). Made by a socket that never
        // listens: a closed listener can stay listening for a moment in a child another test
        // forks meanwhile (the fd lives until the child's exec).
        let stale = tmp.path().join("stale.sock");
        drop(UnixDatagram::bind(&stale).unwrap());
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
        r.settings_mut().vhost_socket = other.join("x.sock").to_str().unwrap().into();
        assert_eq!(field_of(check_add(&r, &c)), "settings.vhost_socket");
        // A symlink inside the allowed dir that points outside does not get out.
        std::os::unix::fs::symlink(&other, allowed.join("escape")).unwrap();
        r.settings_mut().vhost_socket = allowed.join("escape/x.sock").to_str().unwrap().into();
        assert_eq!(field_of(check_add(&r, &c)), "settings.vhost_socket");
        r.settings_mut().vhost_socket = allowed.join("x.sock").to_str().unwrap().into();
        assert!(check_add(&r, &c).is_ok());
        r.settings_mut().vhost_socket = String::new();
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
        assert_eq!(field_of(check_add(&r, &c)), "settings.image");
        let inside = allowed.join("a.img");
        std::fs::File::create(&inside)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        r.settings_mut().image = inside.to_str().unwrap().into();
        assert!(check_add(&r, &c).is_ok());
        // Neither '..' nor a symlink leads out.
        r.settings_mut().image = format!("{}/../disk.img", allowed.display());
        assert_eq!(field_of(check_add(&r, &c)), "settings.image");
        std::os::unix::fs::symlink(tmp.path().join("disk.img"), allowed.join("link.img")).unwrap();
        r.settings_mut().image = allowed.join("link.img").to_str().unwrap().into();
        assert_eq!(field_of(check_add(&r, &c)), "settings.image");
    }

    /// `qemu-img ARGS` (qemu-img makes the qcow2 images, as an operator would).
    fn qemu_img(args: &[&str]) {
        let out = std::process::Command::new("qemu-img")
            .args(args)
            .output()
            .expect("running qemu-img");
        assert!(out.status.success(), "qemu-img {args:?}: {out:?}");
    }

    /// A qcow2 image at `path` of `size` bytes, over `backing` (a name as the header keeps
    /// it, with its format) if given.
    fn qcow2(path: &Path, size: u64, backing: Option<(&str, &str)>) -> String {
        let size = size.to_string();
        let mut args = vec!["create", "-q", "-f", "qcow2"];
        if let Some((name, format)) = backing {
            args.extend(["-u", "-b", name, "-F", format]);
        }
        args.extend([path.to_str().unwrap(), size.as_str()]);
        qemu_img(&args);
        path.to_str().unwrap().to_string()
    }

    fn with_image(base: &AddDiskRequest, image: &str, format: ImageFormat) -> AddDiskRequest {
        let mut r = base.clone();
        r.settings_mut().image = image.into();
        r.settings_mut().format = format as i32;
        r
    }

    /// The format is kept as given or as probed; the size rule takes a qcow2 image's virtual
    /// size; a raw image starting with qcow2's magic is raw only when said so.
    #[test]
    fn formats_given_and_probed() {
        let tmp = Tmp::new("formats");
        let c = ctx(&tmp);
        let base = request(&tmp);
        let raw = base.settings_or_default().image;
        let format_of = |r: &AddDiskRequest| check_add(r, &c).unwrap().0.format;
        assert_eq!(format_of(&base), Some(Format::Raw));
        assert_eq!(
            format_of(&with_image(&base, &raw, ImageFormat::Raw)),
            Some(Format::Raw)
        );
        // A qcow2 file of a few hundred KiB with a 1 GiB disk: probed, and its virtual size
        // counts.
        let q = qcow2(&tmp.path().join("q.qcow2"), 1 << 30, None);
        assert!(std::fs::metadata(&q).unwrap().len() < 1 << 20);
        let probed = with_image(&base, &q, ImageFormat::Unspecified);
        assert_eq!(format_of(&probed), Some(Format::Qcow2));
        assert_eq!(
            format_of(&with_image(&base, &q, ImageFormat::Qcow2)),
            Some(Format::Qcow2)
        );
        // Served raw when asked: its file is the disk.
        assert_eq!(
            format_of(&with_image(&base, &q, ImageFormat::Raw)),
            Some(Format::Raw)
        );
        // A qcow2 of less than a block of virtual size, whatever its file's size.
        let tiny = qcow2(&tmp.path().join("tiny.qcow2"), 0, None);
        let e = check_add(&with_image(&base, &tiny, ImageFormat::Unspecified), &c).unwrap_err();
        assert_eq!(e.field(), "settings.image");
        assert!(e.to_string().contains("virtual size"), "{e}");
        // A raw file is not checked as qcow2 when it is not one.
        let e = check_add(&with_image(&base, &raw, ImageFormat::Qcow2), &c).unwrap_err();
        assert_eq!(e.field(), "settings.image");
        assert!(e.to_string().contains("not a qcow2 image"), "{e}");
        let mut unknown = base.clone();
        unknown.settings_mut().format = 7;
        assert_eq!(field_of(check_add(&unknown, &c)), "settings.format");
        // An incoming disk of a qcow2 image is refused: two frontends would cache its
        // metadata.
        let mut incoming = with_image(&base, &q, ImageFormat::Unspecified);
        incoming.incoming_for = "src".into();
        assert!(matches!(
            check_add(&incoming, &c),
            Err(ValidationError::FailedPrecondition {
                field: "incoming_for",
                ..
            })
        ));
    }

    /// A backing chain the frontend would refuse is refused at AddDisk, naming
    /// `settings.image` and the chain: a loop, a missing backing file (NOT_FOUND), a backing
    /// file outside the --image-dir directories.
    #[test]
    fn backing_chains() {
        let tmp = Tmp::new("chains");
        let mut c = ctx(&tmp);
        let base = request(&tmp);
        let dir = tmp.path().join("images");
        std::fs::create_dir(&dir).unwrap();
        // A chain that is fine: top -> mid -> base.raw, relative names.
        let raw = dir.join("base.raw");
        std::fs::File::create(&raw)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        qcow2(&dir.join("mid.qcow2"), 1 << 20, Some(("base.raw", "raw")));
        let top = qcow2(
            &dir.join("top.qcow2"),
            1 << 20,
            Some(("mid.qcow2", "qcow2")),
        );
        let probed = with_image(&base, &top, ImageFormat::Unspecified);
        assert_eq!(
            check_add(&probed, &c).unwrap().0.format,
            Some(Format::Qcow2)
        );

        // a -> b -> a.
        let b = qcow2(&dir.join("b.qcow2"), 1 << 20, None);
        let a = qcow2(&dir.join("a.qcow2"), 1 << 20, Some(("b.qcow2", "qcow2")));
        qemu_img(&[
            "rebase", "-q", "-u", "-f", "qcow2", "-b", "a.qcow2", "-F", "qcow2", &b,
        ]);
        for format in [ImageFormat::Unspecified, ImageFormat::Qcow2] {
            let e = check_add(&with_image(&base, &a, format), &c).unwrap_err();
            assert!(matches!(e, ValidationError::Invalid { .. }), "{e:?}");
            let text = e.to_string();
            assert!(text.starts_with("settings.image: "), "{text}");
            assert!(text.contains("loops") && text.contains("b.qcow2"), "{text}");
        }

        // A backing file that does not exist.
        let orphan = qcow2(
            &dir.join("orphan.qcow2"),
            1 << 20,
            Some(("gone.raw", "raw")),
        );
        let e = check_add(&with_image(&base, &orphan, ImageFormat::Unspecified), &c).unwrap_err();
        assert!(
            matches!(
                e,
                ValidationError::NotFound {
                    field: "settings.image",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("gone.raw"), "{e}");

        // With --image-dir: a backing file outside it, by '..' or by an absolute name, is
        // refused; the chain inside it is fine.
        c.image_dirs = vec![dir.clone()];
        let secret = tmp.path().join("secret.raw");
        std::fs::File::create(&secret)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let climbing = qcow2(
            &dir.join("climbing.qcow2"),
            1 << 20,
            Some(("../secret.raw", "raw")),
        );
        let absolute = qcow2(
            &dir.join("absolute.qcow2"),
            1 << 20,
            Some((secret.to_str().unwrap(), "raw")),
        );
        for image in [&climbing, &absolute] {
            let e = check_add(&with_image(&base, image, ImageFormat::Unspecified), &c).unwrap_err();
            assert_eq!(e.field(), "settings.image", "{e}");
            let text = e.to_string();
            assert!(
                text.contains("outside the allowed image directories"),
                "{text}"
            );
            assert!(text.contains("secret.raw"), "{text}");
        }
        assert!(check_add(&probed, &c).is_ok());
        // Served raw, its header names nothing.
        assert_eq!(
            check_add(&with_image(&base, &climbing, ImageFormat::Raw), &c)
                .unwrap()
                .0
                .format,
            Some(Format::Raw)
        );
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
}
