//! Client of a frontend's admin channel (`proto/blkplane/v1/frontend.proto`): a UNIX stream
//! socket on which each request is a little-endian u32 byte length followed by a protobuf
//! `FrontendRequest`, answered in order by a `FrontendResponse` framed the same way.
//!
//! Each call uses its own short connection and is bounded by a timeout, so that a hung
//! frontend never hangs a gRPC call or the supervisor.

use std::fs::File;
use std::os::fd::AsFd;
use std::path::Path;
use std::time::Duration;

use blkplane_proto::v1::{
    frontend_request, frontend_response, DiskStats, DrainRequest, Drained, FrontendRequest,
    FrontendResponse, FrontendStatus, ResizeDone, ResizeRequest, ResumeRequest,
    SetMigrationBlockers, SetThrottle, StatsRequest, StatusRequest, TrackWrites,
};
use blkplane_proto::write_bitmap::WriteBitmap;
use prost::Message;
use thiserror::Error;
use tokio::io::Interest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// Largest frame either side accepts.
pub const MAX_FRAME: usize = 1 << 20;
/// How long a status or stats call may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a resize may take (it grows a file and may wait for the guest notification).
pub const RESIZE_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a drain may take: the requests in flight must complete (through an iothread
/// restart, if one dies meanwhile) and the image may be synced.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(60);

/// How long setting I/O limits may take: the frontend hands them to every queue worker
/// (which may be busy with a batch) before it answers.
pub const THROTTLE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long TrackWrites may take: every queue worker installs the bitmap before the frontend
/// answers, and one may be busy waiting for a ring's requests (a ring stop).
pub const TRACK_WRITES_TIMEOUT: Duration = DRAIN_TIMEOUT;

/// Admin-channel failures.
#[derive(Debug, Error)]
pub enum AdminError {
    /// Could not connect (the frontend is not running, or not listening yet).
    #[error("cannot connect to the admin socket {path}: {source}")]
    Connect {
        /// The socket.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The connection broke mid-call.
    #[error("admin channel I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The frontend did not answer in time.
    #[error("the frontend did not answer within {0:?}")]
    Timeout(Duration),
    /// A frame longer than [`MAX_FRAME`].
    #[error("admin frame of {0} bytes is larger than {MAX_FRAME}")]
    FrameTooLarge(usize),
    /// The answer is not valid protobuf.
    #[error("undecodable admin answer: {0}")]
    Decode(#[from] prost::DecodeError),
    /// The frontend refused the request; its reason.
    #[error("{0}")]
    Refused(String),
    /// A throttle group's state file could not be opened to be sent.
    #[error("throttle group file {path}: {source}")]
    GroupFile {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The answer does not match the request.
    #[error("unexpected admin answer: {0}")]
    Unexpected(String),
}

/// Sends one request on `socket` and returns the answer (an `error` answer becomes
/// [`AdminError::Refused`]).
pub async fn call(
    socket: &Path,
    request: frontend_request::Request,
    timeout: Duration,
) -> Result<frontend_response::Response, AdminError> {
    call_with_file(socket, request, None, timeout).await
}

/// Like [`call`], with `attached` sent along with the request (SCM_RIGHTS).
pub async fn call_with_file(
    socket: &Path,
    request: frontend_request::Request,
    attached: Option<&File>,
    timeout: Duration,
) -> Result<frontend_response::Response, AdminError> {
    let work = async {
        let mut stream =
            UnixStream::connect(socket)
                .await
                .map_err(|source| AdminError::Connect {
                    path: socket.display().to_string(),
                    source,
                })?;
        let body = FrontendRequest {
            request: Some(request),
        }
        .encode_to_vec();
        let mut frame = Vec::with_capacity(4 + body.len());
        // Our own requests are tiny; the cast cannot truncate.
        frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
        frame.extend_from_slice(&body);
        send_frame(&mut stream, &frame, attached).await?;
        let mut len = [0u8; 4];
        stream.read_exact(&mut len).await?;
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_FRAME {
            return Err(AdminError::FrameTooLarge(len));
        }
        let mut buf = vec![0u8; len];
        stream.read_exact(&mut buf).await?;
        let response = FrontendResponse::decode(buf.as_slice())?;
        match response.response {
            Some(frontend_response::Response::Error(e)) => Err(AdminError::Refused(e)),
            Some(r) => Ok(r),
            None => Err(AdminError::Unexpected("empty response".into())),
        }
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| AdminError::Timeout(timeout))?
}

/// Writes `frame`, with `attached` travelling with its first byte.
async fn send_frame(
    stream: &mut UnixStream,
    frame: &[u8],
    attached: Option<&File>,
) -> Result<(), AdminError> {
    let Some(file) = attached else {
        stream.write_all(frame).await?;
        return Ok(());
    };
    let sent = loop {
        stream.writable().await?;
        match stream.try_io(Interest::WRITABLE, || {
            blkplane_proto::control::send_with_fd(stream.as_fd(), frame, file.as_fd())
        }) {
            Ok(sent) => break sent,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e.into()),
        }
    };
    stream
        .write_all(frame.get(sent..).unwrap_or_default())
        .await?;
    Ok(())
}

/// Asks for the device status.
pub async fn status(socket: &Path) -> Result<FrontendStatus, AdminError> {
    match call(
        socket,
        frontend_request::Request::Status(StatusRequest {}),
        CALL_TIMEOUT,
    )
    .await?
    {
        frontend_response::Response::Status(s) => Ok(s),
        other => Err(AdminError::Unexpected(format!("{other:?}"))),
    }
}

/// Asks for the per-queue statistics.
pub async fn stats(socket: &Path) -> Result<DiskStats, AdminError> {
    stats_within(socket, CALL_TIMEOUT).await
}

/// Asks for the per-queue statistics, waiting at most `timeout` (the metrics endpoint asks
/// with a shorter one than the API, so that one stuck frontend does not stall a scrape).
pub async fn stats_within(socket: &Path, timeout: Duration) -> Result<DiskStats, AdminError> {
    match call(
        socket,
        frontend_request::Request::Stats(StatsRequest {}),
        timeout,
    )
    .await?
    {
        frontend_response::Response::Stats(s) => Ok(s),
        other => Err(AdminError::Unexpected(format!("{other:?}"))),
    }
}

/// Asks the frontend to grow the disk to `new_size_bytes`.
pub async fn resize(socket: &Path, new_size_bytes: u64) -> Result<ResizeDone, AdminError> {
    match call(
        socket,
        frontend_request::Request::Resize(ResizeRequest { new_size_bytes }),
        RESIZE_TIMEOUT,
    )
    .await?
    {
        frontend_response::Response::Resized(r) => Ok(r),
        other => Err(AdminError::Unexpected(format!("{other:?}"))),
    }
}

/// Drains the disk (fdatasync of the image with `flush`); answers once nothing is in flight.
pub async fn drain(socket: &Path, flush: bool) -> Result<Drained, AdminError> {
    match call(
        socket,
        frontend_request::Request::Drain(DrainRequest { flush }),
        DRAIN_TIMEOUT,
    )
    .await?
    {
        frontend_response::Response::Drained(d) => Ok(d),
        other => Err(AdminError::Unexpected(format!("{other:?}"))),
    }
}

/// Resumes a drained disk.
pub async fn resume(socket: &Path) -> Result<(), AdminError> {
    match call(
        socket,
        frontend_request::Request::Resume(ResumeRequest {}),
        // The workers are reached through the device lock, which a vhost-user message being
        // handled may hold for a while.
        DRAIN_TIMEOUT,
    )
    .await?
    {
        frontend_response::Response::Resumed(_) => Ok(()),
        other => Err(AdminError::Unexpected(format!("{other:?}"))),
    }
}

/// Replaces the frontend's list of migration blockers.
pub async fn set_migration_blockers(socket: &Path, reasons: Vec<String>) -> Result<(), AdminError> {
    match call(
        socket,
        frontend_request::Request::SetMigrationBlockers(SetMigrationBlockers { reasons }),
        CALL_TIMEOUT,
    )
    .await?
    {
        frontend_response::Response::MigrationBlockersSet(_) => Ok(()),
        other => Err(AdminError::Unexpected(format!("{other:?}"))),
    }
}

/// Replaces the frontend's I/O limits, throttle group file and member index.
pub async fn set_throttle(socket: &Path, request: SetThrottle) -> Result<(), AdminError> {
    // The frontend opens no file once it serves: blkplaned opens the group's and sends it.
    let group_file = if request.group_state_path.is_empty() {
        None
    } else {
        let path = &request.group_state_path;
        let file = File::options()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| AdminError::GroupFile {
                path: path.clone(),
                source,
            })?;
        Some(file)
    };
    match call_with_file(
        socket,
        frontend_request::Request::SetThrottle(request),
        group_file.as_ref(),
        THROTTLE_TIMEOUT,
    )
    .await?
    {
        frontend_response::Response::ThrottleSet(_) => Ok(()),
        other => Err(AdminError::Unexpected(format!("{other:?}"))),
    }
}

/// Starts marking the image blocks the guest writes in `bitmap` (its memfd is sent along;
/// the request carries its granularity and the capacity it was made for), or stops with `None`
/// (granularity 0, no file). Answers once every queue worker marks in it, the writes then in
/// flight included.
pub async fn track_writes(socket: &Path, bitmap: Option<&WriteBitmap>) -> Result<(), AdminError> {
    let request = bitmap.map_or(
        TrackWrites {
            granularity_bytes: 0,
            capacity_bytes: 0,
        },
        |b| TrackWrites {
            granularity_bytes: b.granularity(),
            capacity_bytes: b.capacity_bytes(),
        },
    );
    match call_with_file(
        socket,
        frontend_request::Request::TrackWrites(request),
        bitmap.map(WriteBitmap::file),
        TRACK_WRITES_TIMEOUT,
    )
    .await?
    {
        frontend_response::Response::WritesTracked(_) => Ok(()),
        other => Err(AdminError::Unexpected(format!("{other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    /// A one-connection fake frontend that answers each request with `answer(request)`, or
    /// with raw bytes when `raw` is set.
    async fn serve_once(
        listener: UnixListener,
        answer: impl Fn(FrontendRequest) -> Vec<u8> + Send + 'static,
    ) {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut len = [0u8; 4];
        s.read_exact(&mut len).await.unwrap();
        let mut buf = vec![0; u32::from_le_bytes(len) as usize];
        s.read_exact(&mut buf).await.unwrap();
        let req = FrontendRequest::decode(buf.as_slice()).unwrap();
        s.write_all(&answer(req)).await.unwrap();
    }

    fn framed(r: frontend_response::Response) -> Vec<u8> {
        let body = FrontendResponse { response: Some(r) }.encode_to_vec();
        let mut v = (body.len() as u32).to_le_bytes().to_vec();
        v.extend(body);
        v
    }

    fn socket_path(tag: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("bpa-{tag}-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&p);
        p
    }

    #[tokio::test]
    async fn status_round_trip() {
        let path = socket_path("status");
        let listener = UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(serve_once(listener, |req| {
            assert!(matches!(
                req.request,
                Some(frontend_request::Request::Status(_))
            ));
            framed(frontend_response::Response::Status(FrontendStatus {
                vmm_connected: true,
                capacity_bytes: 1 << 30,
                pid: 42,
                ..Default::default()
            }))
        }));
        let s = status(&path).await.unwrap();
        assert!(s.vmm_connected);
        assert_eq!((s.capacity_bytes, s.pid), (1 << 30, 42));
        server.await.unwrap();
        let _ = std::fs::remove_file(&path);
    }

    #[tokio::test]
    async fn refusal_and_mismatch() {
        let path = socket_path("refuse");
        let listener = UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(serve_once(listener, |req| {
            let Some(frontend_request::Request::Resize(r)) = req.request else {
                panic!("not a resize")
            };
            assert_eq!(r.new_size_bytes, 4096);
            framed(frontend_response::Response::Error("shrinking".into()))
        }));
        match resize(&path, 4096).await {
            Err(AdminError::Refused(m)) => assert_eq!(m, "shrinking"),
            other => panic!("{other:?}"),
        }
        server.await.unwrap();

        let listener = UnixListener::bind(&path).unwrap_or_else(|_| {
            std::fs::remove_file(&path).unwrap();
            UnixListener::bind(&path).unwrap()
        });
        let server = tokio::spawn(serve_once(listener, |_| {
            framed(frontend_response::Response::Stats(DiskStats::default()))
        }));
        assert!(matches!(
            status(&path).await,
            Err(AdminError::Unexpected(_))
        ));
        server.await.unwrap();
        let _ = std::fs::remove_file(&path);
    }

    #[tokio::test]
    async fn set_throttle_round_trip() {
        use blkplane_proto::v1::ThrottleSet;
        let path = socket_path("throttle");
        let listener = UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(serve_once(listener, |req| {
            let Some(frontend_request::Request::SetThrottle(t)) = req.request else {
                panic!("not a SetThrottle")
            };
            assert_eq!(
                blkplane_api::limits::limit(&t.limits.unwrap(), "iops_total"),
                Some(100)
            );
            assert!(t.group_state_path.ends_with(".state"));
            assert_eq!(t.member_index, 2);
            framed(frontend_response::Response::ThrottleSet(ThrottleSet {}))
        }));
        // The group's file is opened and sent along (tests/tests/throttle.rs shows a frontend
        // using it); a missing one fails before anything is sent.
        let group = socket_path("throttle-group").with_extension("state");
        File::create(&group).unwrap();
        let request = |path: &Path| SetThrottle {
            limits: Some(blkplane_api::limits::named(&[("iops_total", 100)]).unwrap()),
            group_state_path: path.to_string_lossy().into_owned(),
            member_index: 2,
        };
        assert!(matches!(
            set_throttle(&path, request(Path::new("/nonexistent/g.state"))).await,
            Err(AdminError::GroupFile { .. })
        ));
        set_throttle(&path, request(&group)).await.unwrap();
        server.await.unwrap();
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_file(&group);
    }

    #[tokio::test]
    async fn track_writes_round_trip() {
        use blkplane_proto::v1::WritesTracked;
        use blkplane_proto::write_bitmap::DEFAULT_GRANULARITY;
        let path = socket_path("track");
        let expect = |granularity: u64, capacity: u64| {
            move |req: FrontendRequest| {
                let Some(frontend_request::Request::TrackWrites(t)) = req.request else {
                    panic!("not a TrackWrites")
                };
                assert_eq!(
                    (t.granularity_bytes, t.capacity_bytes),
                    (granularity, capacity)
                );
                framed(frontend_response::Response::WritesTracked(WritesTracked {}))
            }
        };
        let bitmap = WriteBitmap::create(3 << 20, DEFAULT_GRANULARITY).unwrap();
        let listener = UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(serve_once(listener, expect(DEFAULT_GRANULARITY, 3 << 20)));
        track_writes(&path, Some(&bitmap)).await.unwrap();
        server.await.unwrap();
        std::fs::remove_file(&path).unwrap();
        let listener = UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(serve_once(listener, expect(0, 0)));
        track_writes(&path, None).await.unwrap();
        server.await.unwrap();
        let _ = std::fs::remove_file(&path);
    }

    #[tokio::test]
    async fn oversized_frame_and_silence() {
        let path = socket_path("big");
        let listener = UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(serve_once(listener, |_| {
            ((MAX_FRAME as u32) + 1).to_le_bytes().to_vec()
        }));
        assert!(matches!(
            stats(&path).await,
            Err(AdminError::FrameTooLarge(_))
        ));
        server.await.unwrap();
        let _ = std::fs::remove_file(&path);

        // Nobody listening.
        assert!(matches!(
            status(&path).await,
            Err(AdminError::Connect { .. })
        ));

        // Listening but never answering: bounded by the timeout.
        let listener = UnixListener::bind(&path).unwrap();
        let r = call(
            &path,
            frontend_request::Request::Status(StatusRequest {}),
            Duration::from_millis(100),
        )
        .await;
        assert!(matches!(r, Err(AdminError::Timeout(_))));
        drop(listener);
        let _ = std::fs::remove_file(&path);
    }
}
