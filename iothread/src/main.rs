//! `blkplane-iothread`: executes the requests of one frontend's shared-memory ring with
//! io_uring, straight into guest memory.
//!
//! The frontend spawns it with one end of a `SOCK_SEQPACKET` socket pair as `--control-fd`
//! (default 3), sends `Setup` (ring, eventfds, image fds — or none for a null image) and then
//! `SetMemoryTable`. See [`engine`] for the loop itself.
//!
//! Exit status: 0 after `Shutdown` or when the frontend closes the control socket (it exited
//! or died); 1 on any error (bad setup, control protocol violation, broken ring); 2 for a bad
//! command line.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::time::Duration;

use blkplane_proto::control::{
    self, ControlError, ControlReply, ControlRequest, SetupSpec, MAX_BACKING_FILES,
    MAX_POLL_MAX_US, SETUP_FLAG_DATA_FILE, SETUP_FLAG_DIRECT_FD, SETUP_FLAG_NULL_IMAGE,
};
use blkplane_proto::ring::{RingError, SharedRing};
use clap::Parser;
use log::{error, info, warn};

use blkplane_iothread::engine::{Engine, EngineError, Exit};
use blkplane_iothread::image::{Image, ImageError};
use blkplane_iothread::qcow2::LayerFormat;

/// blkplane's I/O process: serves one frontend's request ring with io_uring.
///
/// Spawned by a frontend, never by hand. Logs to stderr; set RUST_LOG (e.g. RUST_LOG=debug)
/// to change the level.
#[derive(Debug, Parser)]
#[command(version = blkplane_build_info::VERSION, about)]
struct Args {
    /// The inherited control socket: a connected SOCK_SEQPACKET UNIX socket whose peer is the
    /// frontend. The iothread exits when the peer closes it.
    #[arg(long, value_name = "FD", default_value_t = 3)]
    control_fd: RawFd,
}

/// Why the iothread exits with status 1.
#[derive(Debug, thiserror::Error)]
enum Error {
    /// `--control-fd` is not a usable socket.
    #[error("--control-fd {fd}: {reason}")]
    ControlFd {
        /// The fd number.
        fd: RawFd,
        /// What is wrong with it.
        reason: String,
    },
    /// The setup handshake failed.
    #[error("setup: {0}")]
    Setup(#[from] SetupError),
    /// The engine stopped on an error.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The process could not be locked down (it does not serve unsandboxed).
    #[error("sandbox: {0}")]
    Sandbox(io::Error),
}

/// Why a `Setup` was refused; answered with [`SetupError::errno`] before exiting.
#[derive(Debug, thiserror::Error)]
enum SetupError {
    /// The control channel failed.
    #[error("{0}")]
    Control(#[from] ControlError),
    /// The first message was not `Setup`.
    #[error("expected Setup, got {0}")]
    NotSetup(&'static str),
    /// `Setup` carried flags this iothread does not know.
    #[error("unknown Setup flags {0:#x}")]
    UnknownFlags(u32),
    /// `Setup` asked for a null image with an O_DIRECT fd, which a null image cannot have.
    #[error(
        "Setup flags {0:#x}: a null image has no O_DIRECT fd or data file, a raw one no data file"
    )]
    ConflictingFlags(u32),
    /// `Setup` carried an image size for a file image, whose size comes from its fd.
    #[error("Setup gives image size {0} for a file image")]
    UnexpectedImageSize(u64),
    /// `Setup` asked for a polling bound beyond [`MAX_POLL_MAX_US`].
    #[error("Setup gives a polling bound of {0} µs, more than {MAX_POLL_MAX_US}")]
    PollBound(u32),
    /// The ring memfd is not a valid ring.
    /// `Setup` names a backing chain deeper than [`MAX_BACKING_FILES`].
    #[error("Setup hands over {0} backing files, more than {MAX_BACKING_FILES}")]
    BackingFiles(u32),
    /// `Setup`'s format bits name layers the chain does not have, or a raw image with backing
    /// files.
    #[error("Setup's qcow2 layers {qcow2_layers:#x} do not fit a chain of {backing_files} backing files")]
    Layers {
        backing_files: u32,
        qcow2_layers: u32,
    },
    #[error("ring: {0}")]
    Ring(#[from] RingError),
    /// The ring memfd could be shrunk under our mapping (reading a slot would raise SIGBUS).
    #[error("ring memfd is not sealed against shrinking")]
    RingNotSealed,
    /// The image fds are unusable.
    #[error("image: {0}")]
    Image(#[from] ImageError),
    /// The engine could not be created.
    #[error("{0}")]
    Engine(#[from] EngineError),
}

impl SetupError {
    fn errno(&self) -> i32 {
        match self {
            Self::Control(_) | Self::NotSetup(_) => libc::EPROTO,
            Self::UnknownFlags(_)
            | Self::ConflictingFlags(_)
            | Self::UnexpectedImageSize(_)
            | Self::PollBound(_)
            | Self::BackingFiles(_)
            | Self::Layers { .. }
            | Self::RingNotSealed => libc::EINVAL,
            Self::Ring(RingError::Os { source, .. }) => {
                source.raw_os_error().unwrap_or(libc::EINVAL)
            }
            Self::Ring(_) => libc::EINVAL,
            Self::Image(e) => e.errno(),
            Self::Engine(e) => e.errno(),
        }
    }
}

fn main() -> ExitCode {
    init_logging();
    // Inherited empty from a sandboxed spawner already; dropped again for an iothread started
    // by hand.
    if let Err(e) = blkplane_sandbox::drop_capabilities() {
        error!("{e}");
        return ExitCode::FAILURE;
    }
    ignore_file_size_signal();
    let args = Args::parse();
    match run(&args) {
        Ok(Exit::Shutdown) => {
            info!("shut down by the frontend");
            ExitCode::SUCCESS
        }
        Ok(Exit::PeerClosed) => {
            info!("the frontend closed the control socket; exiting");
            ExitCode::SUCCESS
        }
        Err(e) => {
            error!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// Has a write that meets a file-size limit (`RLIMIT_FSIZE`: systemd's `LimitFSIZE`, a
/// container's ulimit) fail with `EFBIG` — IOERR for that request — instead of killing the
/// iothread with `SIGXFSZ`: the frontend would resubmit the request to the next iothread, which
/// the same limit kills again, and every other request of the disk would wait through it.
fn ignore_file_size_signal() {
    // SAFETY: SIG_IGN installs no handler; nothing runs on the signal.
    if unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) } == libc::SIG_ERR {
        warn!("SIGXFSZ cannot be ignored: {}", io::Error::last_os_error());
    }
}

/// Logs to stderr with the pid, since a frontend's iothreads share its stderr.
fn init_logging() {
    let pid = std::process::id();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format(move |buf, record| {
            writeln!(
                buf,
                "[{} {:5} blkplane-iothread[{pid}]] {}",
                buf.timestamp_millis(),
                record.level(),
                record.args()
            )
        })
        .init();
}

fn run(args: &Args) -> Result<Exit, Error> {
    let control = take_control_socket(args.control_fd)?;
    let engine = match setup(&control) {
        Ok(Some(engine)) => engine,
        // The frontend went away before sending anything: nothing to serve.
        Ok(None) => return Ok(Exit::PeerClosed),
        Err(e) => {
            // Logged before the refusal is sent: the frontend may exit on it at once, and the
            // reason must already be in the log it leaves.
            error!("setup: {e}");
            // Best effort: the frontend may be gone already, and we exit either way.
            let _ = ControlReply(e.errno()).send(&control);
            return Err(e.into());
        }
    };
    // From here on the iothread only serves: its io_uring is restricted, its fds are open.
    #[cfg(debug_assertions)]
    blkplane_sandbox::arm_forbidden_syscall_hook().map_err(Error::Sandbox)?;
    blkplane_sandbox::lock_down(
        blkplane_sandbox::Profile::Iothread,
        blkplane_sandbox::Enforcement::from_env(),
    )
    .map_err(|e| Error::Sandbox(io::Error::other(e)))?;
    ControlReply::OK
        .send(&control)
        .map_err(|e| Error::Setup(e.into()))?;
    Ok(engine.run(&control)?)
}

/// Takes ownership of the inherited control socket after checking it is one.
fn take_control_socket(fd: RawFd) -> Result<UnixStream, Error> {
    let bad = |reason: String| Error::ControlFd { fd, reason };
    if fd < 0 {
        return Err(bad("not a file descriptor".into()));
    }
    // SAFETY: F_GETFD only inspects the fd table; an fd that is not open fails with EBADF.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(bad(io::Error::last_os_error().to_string()));
    }
    // Keep it out of anything this process might ever execute.
    // SAFETY: setting FD_CLOEXEC on an fd checked open above.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    // SAFETY: the spawner hands this fd to us alone (that is the command-line contract), it is
    // open (checked above), and nothing else in this process wraps it.
    let file = unsafe { File::from_raw_fd(fd) };
    let is_socket = file
        .metadata()
        .map(|meta| meta.file_type().is_socket())
        .map_err(|e| bad(e.to_string()))?;
    if !is_socket || socket_type(&file) != Some(libc::SOCK_SEQPACKET) {
        return Err(bad("not a SOCK_SEQPACKET socket".into()));
    }
    Ok(UnixStream::from(std::os::fd::OwnedFd::from(file)))
}

/// The socket type (`SOCK_STREAM`, `SOCK_SEQPACKET`...) of `socket`, if it is a socket.
fn socket_type(socket: &File) -> Option<libc::c_int> {
    let mut kind: libc::c_int = 0;
    let mut len: libc::socklen_t = libc::c_int::BITS / 8;
    // SAFETY: SO_TYPE writes one c_int into `kind`, whose size is passed in `len`.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_TYPE,
            (&mut kind as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(kind)
}

/// Receives `Setup`, validates everything it carries and builds the engine. `Ok(None)` when the
/// frontend closed the socket first.
fn setup(control: &UnixStream) -> Result<Option<Engine>, SetupError> {
    let (request, files) = match control::recv_request(control) {
        Ok(message) => message,
        Err(ControlError::Closed) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let SetupSpec {
        flags,
        logical_block_size,
        image_size,
        poll_max_us,
        backing_files,
        qcow2_layers,
    } = match request {
        ControlRequest::Setup(spec) => spec,
        ControlRequest::SetMemoryTable(_) => return Err(SetupError::NotSetup("SetMemoryTable")),
        ControlRequest::Shutdown => return Err(SetupError::NotSetup("Shutdown")),
        ControlRequest::StartQueue(_) => return Err(SetupError::NotSetup("StartQueue")),
        ControlRequest::StopQueue { .. } => return Err(SetupError::NotSetup("StopQueue")),
        ControlRequest::SetCall { .. } => return Err(SetupError::NotSetup("SetCall")),
        ControlRequest::SetDirtyLog(_) => return Err(SetupError::NotSetup("SetDirtyLog")),
        ControlRequest::GrowImage { .. } => return Err(SetupError::NotSetup("GrowImage")),
    };
    if flags & !(SETUP_FLAG_DIRECT_FD | SETUP_FLAG_NULL_IMAGE | SETUP_FLAG_DATA_FILE) != 0 {
        return Err(SetupError::UnknownFlags(flags));
    }
    let null = flags & SETUP_FLAG_NULL_IMAGE != 0;
    if null && flags & (SETUP_FLAG_DIRECT_FD | SETUP_FLAG_DATA_FILE) != 0 {
        return Err(SetupError::ConflictingFlags(flags));
    }
    // A file's size comes from its fd; a second source could only disagree with it.
    if !null && image_size != 0 {
        return Err(SetupError::UnexpectedImageSize(image_size));
    }
    if poll_max_us > MAX_POLL_MAX_US {
        return Err(SetupError::PollBound(poll_max_us));
    }
    if backing_files > MAX_BACKING_FILES {
        return Err(SetupError::BackingFiles(backing_files));
    }
    // Bit 0 is the image, bit i its i-th backing file; nothing past the chain.
    let layer_bits = 1u64 << (backing_files.saturating_add(1));
    if u64::from(qcow2_layers) >= layer_bits
        || (qcow2_layers & 1 == 0 && backing_files > 0)
        || (null && qcow2_layers != 0)
    {
        return Err(SetupError::Layers {
            backing_files,
            qcow2_layers,
        });
    }
    let got = files.len();
    let fd_count_error = |expected| SetupError::Control(ControlError::FdCount { got, expected });
    let mut files = files.into_iter();
    let (Some(ring), Some(submit_eventfd), Some(complete_eventfd)) =
        (files.next(), files.next(), files.next())
    else {
        return Err(fd_count_error(3));
    };
    check_ring_sealed(&ring)?;
    let ring = SharedRing::open(ring)?;
    let image = if null {
        Image::null(image_size, logical_block_size)?
    } else {
        let Some(buffered) = files.next() else {
            return Err(fd_count_error(4));
        };
        // recv_request checked the fd count against the flags and the backing-file count.
        let direct = if flags & SETUP_FLAG_DIRECT_FD != 0 {
            files.next()
        } else {
            None
        };
        let data_file = if flags & SETUP_FLAG_DATA_FILE != 0 {
            files.next()
        } else {
            None
        };
        if qcow2_layers & 1 == 0 {
            if data_file.is_some() {
                return Err(SetupError::ConflictingFlags(flags));
            }
            Image::new(buffered, direct, logical_block_size)?
        } else {
            let backing = files
                .enumerate()
                .map(|(index, file)| {
                    let qcow2 = u64::from(qcow2_layers) >> index.saturating_add(1) & 1 == 1;
                    let format = if qcow2 {
                        LayerFormat::Qcow2
                    } else {
                        LayerFormat::Raw
                    };
                    (file, format)
                })
                .collect();
            Image::qcow2(buffered, direct, logical_block_size, data_file, backing)?
        }
    };
    let engine = Engine::new(&ring, submit_eventfd, complete_eventfd, image)?
        .with_poll_max(Duration::from_micros(u64::from(poll_max_us)));
    Ok(Some(engine))
}

/// The iothread reads slots straight from the ring mapping, so the file must not be able to
/// shrink under it; `SharedRing::create` seals it that way.
fn check_ring_sealed(ring: &File) -> Result<(), SetupError> {
    if blkplane_proto::shm::is_sealed_against_shrinking(ring) {
        Ok(())
    } else {
        Err(SetupError::RingNotSealed)
    }
}
