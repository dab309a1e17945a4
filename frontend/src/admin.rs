//! The admin channel: blkplaned's view into this frontend (status, statistics, resize, drain
//! and resume, migration blockers, I/O limits, write tracking), on the UNIX socket given by
//! `--admin-socket`. Protocol in `proto/blkplane/v1/frontend.proto`.
//!
//! It runs on its own threads and only reads counters the workers keep, so nothing on this
//! channel can slow down or block a request — except a drain, whose purpose that is.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use blkplane_proto::v1::{
    frontend_request, frontend_response, DiskStats, Drained, FrontendRequest, FrontendResponse,
    FrontendStatus, IothreadStats, LatencyHistogram, MigrationBlockersSet, QueueStats, QueueStatus,
    RejectionCount, ResizeDone, Resumed, SetThrottle, ThrottleSet,
    TrackWrites as TrackWritesRequest, WritesTracked,
};
use blkplane_proto::write_bitmap::WriteBitmap;
use log::{info, warn};
use prost::Message;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::config::DiskConfig;
use crate::rejection::RejectReason;
use crate::stats::{bucket_upper_bound_us, DeviceStatus};

/// Largest frame accepted, in bytes.
const MAX_FRAME: u32 = 1 << 20;
/// A client that sends nothing for this long is dropped.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Grows the disk; implemented by the device (which owns the image and the VMM connection).
pub trait Resize: Send + Sync {
    /// Grows the disk to `new_size` bytes and tells the guest; returns what was done.
    fn resize(&self, new_size: u64) -> Result<ResizeDone, String>;
    /// The current capacity in bytes.
    fn capacity_bytes(&self) -> u64;
}

/// Drains and resumes the disk; implemented by the device (which owns the workers).
pub trait Lifecycle: Send + Sync {
    /// Stops popping requests, waits for those in flight, syncs the image if `flush`.
    fn drain(&self, flush: bool) -> Result<Drained, String>;
    /// Serves the rings again.
    fn resume(&self) -> Result<(), String>;
}

/// Applying I/O limits (SetThrottle) to the disk's workers.
pub trait SetLimits: Send + Sync {
    /// Replaces the limits; `group_file` is the throttle group's state file, attached to the
    /// request (a frontend opens no file once it serves). An error names the field that is
    /// wrong.
    fn set_limits(&self, request: &SetThrottle, group_file: Option<File>) -> Result<(), String>;
}

/// Bringing the counters up to date before they are read (the workers read the iothreads'
/// completions only when they wake anyway).
pub trait SettleStatistics: Send + Sync {
    /// Returns once every worker has read what its iothread completed (or a short timeout
    /// passed).
    fn settle(&self);
}

/// Marking the image blocks the guest writes (TrackWrites), for blkplaned's copy of the disk to
/// another node.
pub trait TrackWrites: Send + Sync {
    /// Installs `bitmap` in every queue worker (`None`: removes it) and returns once each
    /// marks in it — the writes it has in flight included — or in none.
    fn track_writes(&self, bitmap: Option<Arc<WriteBitmap>>) -> Result<(), String>;
}

/// What the admin channel answers from: the shared status and the operations it can run.
#[derive(Clone)]
pub struct Services {
    /// Status and counters.
    pub status: Arc<DeviceStatus>,
    /// Resizing.
    pub resize: Arc<dyn Resize>,
    /// Drain and resume.
    pub lifecycle: Arc<dyn Lifecycle>,
    /// I/O limits.
    pub limits: Arc<dyn SetLimits>,
    /// Current statistics.
    pub statistics: Arc<dyn SettleStatistics>,
    /// Write tracking.
    pub writes: Arc<dyn TrackWrites>,
}

/// Why the admin socket could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("admin socket {path}: {source}")]
pub struct AdminError {
    path: PathBuf,
    source: io::Error,
}

/// Starts serving the admin channel on `path` (a stale socket file is replaced; mode 0600).
pub fn serve(path: &Path, services: Services) -> Result<(), AdminError> {
    let error = |source| AdminError {
        path: path.to_owned(),
        source,
    };
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(error(e)),
    }
    let listener = UnixListener::bind(path).map_err(error)?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600)).map_err(error)?;
    std::thread::Builder::new()
        .name("admin".into())
        .spawn(move || {
            for stream in listener.incoming() {
                match stream {
                    Ok(stream) => {
                        let services = services.clone();
                        let spawned = std::thread::Builder::new()
                            .name("admin-conn".into())
                            .spawn(move || serve_connection(stream, &services));
                        if let Err(e) = spawned {
                            warn!("admin: cannot start a connection thread: {e}");
                        }
                    }
                    Err(e) => warn!("admin: accept: {e}"),
                }
            }
        })
        .map_err(error)?;
    info!("admin channel on {}", path.display());
    Ok(())
}

fn serve_connection(mut stream: UnixStream, services: &Services) {
    let _ = stream.set_read_timeout(Some(IDLE_TIMEOUT));
    loop {
        let (request, attached) = match read_frame(&mut stream) {
            Ok(Some((bytes, attached))) => (FrontendRequest::decode(bytes.as_slice()), attached),
            Ok(None) => return,
            Err(e) => {
                warn!("admin: {e}");
                return;
            }
        };
        let response = match request {
            Ok(request) => answer(request, attached, services),
            Err(e) => frontend_response::Response::Error(format!("undecodable request: {e}")),
        };
        let frame = FrontendResponse {
            response: Some(response),
        }
        .encode_to_vec();
        if let Err(e) = write_frame(&mut stream, &frame) {
            warn!("admin: {e}");
            return;
        }
    }
}

/// Reads one length-prefixed frame and the descriptor attached to it, if any; `None` at a
/// clean end of stream. The first bytes are received with `recvmsg`, which is where a
/// descriptor sent with the frame arrives (it travels with the frame's first byte).
pub fn read_frame(stream: &mut UnixStream) -> io::Result<Option<(Vec<u8>, Option<File>)>> {
    let mut len = [0u8; 4];
    let (got, attached) = stream
        .recv_with_fd(&mut len)
        .map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
    if got == 0 {
        return Ok(None);
    }
    if let Some(rest) = len.get_mut(got..) {
        stream.read_exact(rest)?;
    }
    let len = u32::from_le_bytes(len);
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds {MAX_FRAME}"),
        ));
    }
    let mut buf = vec![0u8; len as usize];
    stream.read_exact(&mut buf)?;
    Ok(Some((buf, attached)))
}

/// Writes one length-prefixed frame.
pub fn write_frame(stream: &mut impl Write, frame: &[u8]) -> io::Result<()> {
    let len = u32::try_from(frame.len())
        .ok()
        .filter(|&l| l <= MAX_FRAME)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "frame too large"))?;
    stream.write_all(&len.to_le_bytes())?;
    stream.write_all(frame)?;
    stream.flush()
}

/// Answers `request`; `attached` is the descriptor that came with it (only SetThrottle and
/// TrackWrites take one; any other is closed).
fn answer(
    request: FrontendRequest,
    attached: Option<File>,
    services: &Services,
) -> frontend_response::Response {
    use frontend_request::Request;
    use frontend_response::Response;
    let status = &services.status;
    match request.request {
        Some(Request::Status(_)) => {
            Response::Status(device_status(status, services.resize.capacity_bytes()))
        }
        Some(Request::Stats(_)) => {
            services.statistics.settle();
            Response::Stats(disk_stats(status))
        }
        // Growing the image is touching it, which a drain promises not to do.
        Some(Request::Resize(_)) if status.drained.load(Ordering::Relaxed) => {
            Response::Error("the disk is drained: resume it before resizing".into())
        }
        // The bitmap covers the capacity it was made for: blocks past it would go unmarked.
        Some(Request::Resize(_)) if status.tracking_writes.load(Ordering::Relaxed) => {
            Response::Error(
                "the disk's writes are tracked (blkplaned copies it to another node): stop \
                 tracking before resizing"
                    .into(),
            )
        }
        Some(Request::Resize(r)) => match services.resize.resize(r.new_size_bytes) {
            Ok(done) => Response::Resized(done),
            Err(e) => Response::Error(e),
        },
        Some(Request::Drain(d)) => match services.lifecycle.drain(d.flush) {
            Ok(done) => Response::Drained(done),
            Err(e) => Response::Error(e),
        },
        Some(Request::Resume(_)) => match services.lifecycle.resume() {
            Ok(()) => Response::Resumed(Resumed {}),
            Err(e) => Response::Error(e),
        },
        Some(Request::SetMigrationBlockers(b)) => {
            info!(
                "migration blockers from blkplaned: {}",
                if b.reasons.is_empty() {
                    "none".to_string()
                } else {
                    b.reasons.join("; ")
                }
            );
            status.set_migration_blockers(b.reasons);
            Response::MigrationBlockersSet(MigrationBlockersSet {})
        }
        Some(Request::SetThrottle(t)) => match services.limits.set_limits(&t, attached) {
            Ok(()) => Response::ThrottleSet(ThrottleSet {}),
            Err(e) => Response::Error(e),
        },
        Some(Request::TrackWrites(t)) => match track_writes(&t, attached, services) {
            Ok(()) => Response::WritesTracked(WritesTracked {}),
            Err(e) => Response::Error(e),
        },
        None => Response::Error("empty request".into()),
    }
}

/// TrackWrites with a file but no granularity.
const TRACK_WRITES_FILE_WITHOUT_GRANULARITY: &str =
    "TrackWrites: a file is attached but granularity_bytes is 0 (0 without a file stops tracking)";
/// TrackWrites with a granularity but no file.
const TRACK_WRITES_NO_FILE: &str = "TrackWrites: no bitmap file attached (the memfd travels with \
     the frame's first byte, SCM_RIGHTS)";

/// TrackWrites: the bitmap attached to the request, checked against the request and the
/// disk, handed to every worker; granularity 0 without a file stops tracking.
fn track_writes(
    request: &TrackWritesRequest,
    attached: Option<File>,
    services: &Services,
) -> Result<(), String> {
    let bitmap = match (request.granularity_bytes, attached) {
        (0, None) => None,
        (0, Some(_)) => return Err(TRACK_WRITES_FILE_WITHOUT_GRANULARITY.into()),
        (_, None) => return Err(TRACK_WRITES_NO_FILE.into()),
        (granularity, Some(file)) => {
            let capacity = services.resize.capacity_bytes();
            if request.capacity_bytes != capacity {
                return Err(format!(
                    "TrackWrites: the bitmap was made for a disk of {} bytes, but this disk has \
                     {capacity}",
                    request.capacity_bytes
                ));
            }
            let bitmap = WriteBitmap::open(file, capacity, granularity)
                .map_err(|e| format!("TrackWrites: {e}"))?;
            Some(Arc::new(bitmap))
        }
    };
    services.writes.track_writes(bitmap)
}

/// The status as reported on the admin channel.
pub fn device_status(status: &DeviceStatus, capacity_bytes: u64) -> FrontendStatus {
    FrontendStatus {
        vmm_connected: status.vmm_connected.load(Ordering::Relaxed),
        acked_features: status.acked_features.load(Ordering::Relaxed),
        acked_protocol_features: status.acked_protocol_features.load(Ordering::Relaxed),
        capacity_bytes,
        iothread_pids: status
            .iothreads
            .iter()
            .map(|t| t.pid.load(Ordering::Relaxed))
            .collect(),
        iothread_restarts: status
            .iothreads
            .iter()
            .map(|t| t.restarts.load(Ordering::Relaxed))
            .sum(),
        queues: status
            .queues
            .iter()
            .enumerate()
            .map(|(index, q)| QueueStatus {
                index: u32::try_from(index).unwrap_or(u32::MAX),
                running: q.running.load(Ordering::Relaxed),
                broken: q.broken.load(Ordering::Relaxed),
            })
            .collect(),
        pid: std::process::id(),
        drained: status.drained.load(Ordering::Relaxed),
        migration_blockers: status.migration_blockers(),
        last_iothread_exit: status.last_iothread_exit(),
        last_iothread_restart_unix_ms: status
            .iothreads
            .iter()
            .map(|t| t.last_restart_unix_ms.load(Ordering::Relaxed))
            .max()
            .unwrap_or(0),
        offered_protocol_features: DiskConfig::protocol_features().bits(),
        tracking_writes: status.tracking_writes.load(Ordering::Relaxed),
    }
}

/// The counters as reported on the admin channel.
pub fn disk_stats(status: &DeviceStatus) -> DiskStats {
    let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    DiskStats {
        queues: status
            .queues
            .iter()
            .enumerate()
            .map(|(index, q)| QueueStats {
                index: u32::try_from(index).unwrap_or(u32::MAX),
                read_ops: get(&q.read_ops),
                read_bytes: get(&q.read_bytes),
                write_ops: get(&q.write_ops),
                write_bytes: get(&q.write_bytes),
                flush_ops: get(&q.flush_ops),
                discard_ops: get(&q.discard_ops),
                discard_bytes: get(&q.discard_bytes),
                write_zeroes_ops: get(&q.write_zeroes_ops),
                write_zeroes_bytes: get(&q.write_zeroes_bytes),
                other_ops: get(&q.other_ops),
                errors: get(&q.errors),
                rejected: get(&q.rejected),
                rejections: RejectReason::ALL
                    .iter()
                    .zip(&q.rejected_by_reason)
                    .map(|(reason, count)| RejectionCount {
                        reason: reason.name().into(),
                        count: get(count),
                    })
                    .collect(),
                in_flight: get(&q.in_flight),
                throttled_ns: get(&q.throttled_ns),
                throttled_ops: get(&q.throttled_ops),
                latency: Some(LatencyHistogram {
                    upper_bounds_us: (0..q.latency.len()).map(bucket_upper_bound_us).collect(),
                    counts: q.latency.iter().map(get).collect(),
                }),
            })
            .collect(),
        iothreads: (0u32..)
            .zip(&status.iothreads)
            .map(|(index, t)| {
                let counters = t.ring_counters.get();
                IothreadStats {
                    index,
                    inline_transfers: counters.map_or(0, |c| c.inline_transfers()),
                    queued_transfers: counters.map_or(0, |c| c.queued_transfers()),
                }
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blkplane_proto::v1::{
        DrainRequest, ResizeRequest, ResumeRequest, SetMigrationBlockers, StatsRequest,
        StatusRequest,
    };
    use std::sync::atomic::AtomicBool;

    /// Limits that are accepted and ignored (the admin tests do not throttle).
    struct NoLimits;

    struct Settled;

    impl SettleStatistics for Settled {
        fn settle(&self) {}
    }

    impl SetLimits for NoLimits {
        fn set_limits(&self, _request: &SetThrottle, _file: Option<File>) -> Result<(), String> {
            Ok(())
        }
    }

    /// Records what it was handed, and says so in the status as the workers' control does.
    struct FakeTracking {
        status: Arc<DeviceStatus>,
        installed: std::sync::Mutex<Option<(u64, u64)>>,
    }

    impl TrackWrites for FakeTracking {
        fn track_writes(&self, bitmap: Option<Arc<WriteBitmap>>) -> Result<(), String> {
            self.status
                .tracking_writes
                .store(bitmap.is_some(), Ordering::Relaxed);
            if let Some(bitmap) = &bitmap {
                // The frontend's mapping of blkplaned's memfd.
                bitmap.mark(0, 1);
            }
            *self.installed.lock().unwrap() = bitmap.map(|b| (b.blocks(), b.granularity()));
            Ok(())
        }
    }

    fn fake_tracking(status: &Arc<DeviceStatus>) -> Arc<FakeTracking> {
        Arc::new(FakeTracking {
            status: Arc::clone(status),
            installed: std::sync::Mutex::new(None),
        })
    }

    struct FixedSize;

    impl Resize for FixedSize {
        fn resize(&self, new_size: u64) -> Result<ResizeDone, String> {
            if new_size < 4096 {
                return Err("shrinking is refused".into());
            }
            Ok(ResizeDone {
                capacity_bytes: new_size,
                guest_notified: false,
            })
        }

        fn capacity_bytes(&self) -> u64 {
            4096
        }
    }

    /// Marks the shared status drained, as the device's quiescer does.
    struct FakeLifecycle {
        status: Arc<DeviceStatus>,
        broken: AtomicBool,
    }

    impl Lifecycle for FakeLifecycle {
        fn drain(&self, flush: bool) -> Result<Drained, String> {
            if self.broken.load(Ordering::Relaxed) {
                return Err("queue worker 0 is gone".into());
            }
            self.status.drained.store(true, Ordering::Relaxed);
            Ok(Drained {
                waited_requests: 3,
                flushed: flush,
            })
        }

        fn resume(&self) -> Result<(), String> {
            self.status.drained.store(false, Ordering::Relaxed);
            Ok(())
        }
    }

    fn call(
        stream: &mut UnixStream,
        request: frontend_request::Request,
    ) -> frontend_response::Response {
        call_with(stream, request, None)
    }

    /// [`call`] with `attached` sent along with the frame's first byte, as blkplaned does.
    fn call_with(
        stream: &mut UnixStream,
        request: frontend_request::Request,
        attached: Option<&File>,
    ) -> frontend_response::Response {
        use std::os::fd::AsFd;
        let body = FrontendRequest {
            request: Some(request),
        }
        .encode_to_vec();
        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(&body);
        let sent = match attached {
            Some(file) => {
                blkplane_proto::control::send_with_fd(stream.as_fd(), &frame, file.as_fd()).unwrap()
            }
            None => 0,
        };
        stream.write_all(&frame[sent..]).unwrap();
        let (reply, attached) = read_frame(stream).unwrap().unwrap();
        assert!(attached.is_none());
        FrontendResponse::decode(reply.as_slice())
            .unwrap()
            .response
            .unwrap()
    }

    #[test]
    fn answers_status_stats_and_resize_over_a_real_socket() {
        let dir = std::env::temp_dir().join(format!("blkplane-admin-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("admin.sock");
        let status = Arc::new(DeviceStatus::new(2, 1));
        status.vmm_connected.store(true, Ordering::Relaxed);
        status.queues[1].read_ops.store(7, Ordering::Relaxed);
        let lifecycle = Arc::new(FakeLifecycle {
            status: Arc::clone(&status),
            broken: AtomicBool::new(false),
        });
        let services = Services {
            status: Arc::clone(&status),
            resize: Arc::new(FixedSize),
            lifecycle: Arc::clone(&lifecycle) as Arc<dyn Lifecycle>,
            limits: Arc::new(NoLimits),
            statistics: Arc::new(Settled),
            writes: fake_tracking(&status),
        };
        serve(&path, services).unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let mut stream = UnixStream::connect(&path).unwrap();
        match call(
            &mut stream,
            frontend_request::Request::Status(StatusRequest {}),
        ) {
            frontend_response::Response::Status(s) => {
                assert!(s.vmm_connected);
                assert_eq!(s.capacity_bytes, 4096);
                assert_eq!(s.queues.len(), 2);
                assert_eq!(s.pid, std::process::id());
            }
            other => panic!("unexpected {other:?}"),
        }
        match call(
            &mut stream,
            frontend_request::Request::Stats(StatsRequest {}),
        ) {
            frontend_response::Response::Stats(s) => {
                assert_eq!(s.queues[1].read_ops, 7);
                let latency = s.queues[0].latency.clone().unwrap();
                assert_eq!(latency.counts.len(), latency.upper_bounds_us.len());
            }
            other => panic!("unexpected {other:?}"),
        }
        let shrink = ResizeRequest {
            new_size_bytes: 512,
        };
        assert!(matches!(
            call(&mut stream, frontend_request::Request::Resize(shrink)),
            frontend_response::Response::Error(_)
        ));
        // Drain, status while drained, blockers, resume.
        match call(
            &mut stream,
            frontend_request::Request::Drain(DrainRequest { flush: true }),
        ) {
            frontend_response::Response::Drained(d) => {
                assert_eq!((d.waited_requests, d.flushed), (3, true));
            }
            other => panic!("unexpected {other:?}"),
        }
        let grow = ResizeRequest {
            new_size_bytes: 8192,
        };
        match call(&mut stream, frontend_request::Request::Resize(grow)) {
            frontend_response::Response::Error(e) => assert!(e.contains("drained"), "{e}"),
            other => panic!("a drained disk was resized: {other:?}"),
        }
        let blockers = SetMigrationBlockers {
            reasons: vec!["operator_maintenance: disk shelf swap".into()],
        };
        assert!(matches!(
            call(
                &mut stream,
                frontend_request::Request::SetMigrationBlockers(blockers)
            ),
            frontend_response::Response::MigrationBlockersSet(_)
        ));
        match call(
            &mut stream,
            frontend_request::Request::Status(StatusRequest {}),
        ) {
            frontend_response::Response::Status(s) => {
                assert!(s.drained);
                assert_eq!(
                    s.migration_blockers[0],
                    "operator_maintenance: disk shelf swap"
                );
                assert!(s.migration_blockers[1].starts_with("draining: "));
                assert_eq!(s.last_iothread_restart_unix_ms, 0);
                assert_ne!(s.offered_protocol_features, 0);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(
            call(
                &mut stream,
                frontend_request::Request::Resume(ResumeRequest {})
            ),
            frontend_response::Response::Resumed(_)
        ));
        assert!(!status.drained.load(Ordering::Relaxed));
        lifecycle.broken.store(true, Ordering::Relaxed);
        match call(
            &mut stream,
            frontend_request::Request::Drain(DrainRequest { flush: false }),
        ) {
            frontend_response::Response::Error(e) => assert!(e.contains("gone"), "{e}"),
            other => panic!("unexpected {other:?}"),
        }
        // A frame over the limit closes the connection instead of allocating it.
        stream.write_all(&(MAX_FRAME + 1).to_le_bytes()).unwrap();
        let mut rest = Vec::new();
        assert_eq!(stream.read_to_end(&mut rest).unwrap(), 0);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn track_writes_checks_the_bitmap_and_holds_resizes_back() {
        use blkplane_proto::v1::StatusRequest;
        use blkplane_proto::write_bitmap::{WriteBitmap, DEFAULT_GRANULARITY};
        use frontend_request::Request;
        use frontend_response::Response;
        let dir = std::env::temp_dir().join(format!("blkplane-admin-tw-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("admin.sock");
        let status = Arc::new(DeviceStatus::new(1, 1));
        let tracking = fake_tracking(&status);
        let services = Services {
            status: Arc::clone(&status),
            resize: Arc::new(FixedSize),
            lifecycle: Arc::new(FakeLifecycle {
                status: Arc::clone(&status),
                broken: AtomicBool::new(false),
            }),
            limits: Arc::new(NoLimits),
            statistics: Arc::new(Settled),
            writes: Arc::clone(&tracking) as Arc<dyn TrackWrites>,
        };
        serve(&path, services).unwrap();
        let mut stream = UnixStream::connect(&path).unwrap();
        let track = |granularity_bytes, capacity_bytes| {
            Request::TrackWrites(TrackWritesRequest {
                granularity_bytes,
                capacity_bytes,
            })
        };
        let refused = |response: Response, what: &str| match response {
            Response::Error(e) => assert!(e.contains(what), "{what}: {e}"),
            other => panic!("{what}: accepted, {other:?}"),
        };
        let bitmap = WriteBitmap::create(4096, DEFAULT_GRANULARITY).unwrap();
        let file = || Some(bitmap.file().try_clone().unwrap());
        refused(
            call(&mut stream, track(DEFAULT_GRANULARITY, 4096)),
            "no bitmap file attached",
        );
        refused(
            call_with(&mut stream, track(0, 4096), file().as_ref()),
            "granularity_bytes is 0",
        );
        refused(
            call_with(
                &mut stream,
                track(DEFAULT_GRANULARITY, 8192),
                file().as_ref(),
            ),
            "disk of 8192 bytes, but this disk has 4096",
        );
        refused(
            call_with(&mut stream, track(3000, 4096), file().as_ref()),
            "granularity 3000",
        );
        // A regular file is not sealed: whoever holds it could shrink it under the mapping.
        let plain = File::create(dir.join("plain")).unwrap();
        plain.set_len(8).unwrap();
        refused(
            call_with(&mut stream, track(DEFAULT_GRANULARITY, 4096), Some(&plain)),
            "not sealed",
        );
        assert!(tracking.installed.lock().unwrap().is_none());
        assert!(!status.tracking_writes.load(Ordering::Relaxed));

        let installed = call_with(
            &mut stream,
            track(DEFAULT_GRANULARITY, 4096),
            file().as_ref(),
        );
        assert!(
            matches!(installed, Response::WritesTracked(_)),
            "{installed:?}"
        );
        assert_eq!(
            *tracking.installed.lock().unwrap(),
            Some((1, DEFAULT_GRANULARITY))
        );
        assert_eq!(
            bitmap.take_word(0),
            1,
            "the frontend's mapping is blkplaned's memfd"
        );
        match call(&mut stream, Request::Status(StatusRequest {})) {
            Response::Status(s) => assert!(s.tracking_writes),
            other => panic!("unexpected {other:?}"),
        }
        let grow = ResizeRequest {
            new_size_bytes: 8192,
        };
        refused(call(&mut stream, Request::Resize(grow)), "stop tracking");
        // Stopping: granularity 0, no file.
        assert!(matches!(
            call(&mut stream, track(0, 0)),
            Response::WritesTracked(_)
        ));
        assert!(tracking.installed.lock().unwrap().is_none());
        match call(&mut stream, Request::Status(StatusRequest {})) {
            Response::Status(s) => assert!(!s.tracking_writes),
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(
            call(&mut stream, Request::Resize(grow)),
            Response::Resized(_)
        ));
        fs::remove_dir_all(&dir).unwrap();
    }
}
