//! A client of a frontend's admin channel (`--admin-socket`, `proto/blkplane/v1/frontend.proto`):
//! what blkplaned does, for tests that run a frontend without it.
//!
//! Each call opens its own connection; every read is bounded by [`TIMEOUT`].

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use blkplane_proto::v1::{
    frontend_request, frontend_response, DiskStats, DrainRequest, Drained, FrontendRequest,
    FrontendResponse, ResumeRequest, StatsRequest,
};
use prost::Message;

/// The longest a call may take (a drain waits for the requests in flight).
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// Sends one request and returns the answer; an `error` answer is `Err` with its text.
pub fn call(
    socket: &Path,
    request: frontend_request::Request,
) -> Result<frontend_response::Response, String> {
    call_with_file(socket, request, None)
}

/// Like [`call`], with `attached` sent along with the request (SCM_RIGHTS), as blkplaned sends
/// a throttle group's state file.
pub fn call_with_file(
    socket: &Path,
    request: frontend_request::Request,
    attached: Option<&File>,
) -> Result<frontend_response::Response, String> {
    let io = |e: std::io::Error| format!("admin socket {}: {e}", socket.display());
    let mut stream = UnixStream::connect(socket).map_err(io)?;
    stream.set_read_timeout(Some(TIMEOUT)).map_err(io)?;
    let body = FrontendRequest {
        request: Some(request),
    }
    .encode_to_vec();
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    let sent = match attached {
        Some(file) => blkplane_proto::control::send_with_fd(stream.as_fd(), &frame, file.as_fd())
            .map_err(io)?,
        None => 0,
    };
    stream.write_all(&frame[sent..]).map_err(io)?;
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).map_err(io)?;
    let mut buf = vec![0u8; u32::from_le_bytes(len) as usize];
    stream.read_exact(&mut buf).map_err(io)?;
    let response = FrontendResponse::decode(buf.as_slice())
        .map_err(|e| format!("undecodable admin answer: {e}"))?;
    match response.response {
        Some(frontend_response::Response::Error(e)) => Err(e),
        Some(r) => Ok(r),
        None => Err("empty admin answer".into()),
    }
}

/// Drains the disk (and syncs the image with `flush`).
pub fn drain(socket: &Path, flush: bool) -> Result<Drained, String> {
    match call(
        socket,
        frontend_request::Request::Drain(DrainRequest { flush }),
    )? {
        frontend_response::Response::Drained(d) => Ok(d),
        other => Err(format!("unexpected answer to drain: {other:?}")),
    }
}

/// Resumes a drained disk.
pub fn resume(socket: &Path) -> Result<(), String> {
    match call(socket, frontend_request::Request::Resume(ResumeRequest {}))? {
        frontend_response::Response::Resumed(_) => Ok(()),
        other => Err(format!("unexpected answer to resume: {other:?}")),
    }
}

/// The per-queue counters.
pub fn stats(socket: &Path) -> Result<DiskStats, String> {
    match call(socket, frontend_request::Request::Stats(StatsRequest {}))? {
        frontend_response::Response::Stats(s) => Ok(s),
        other => Err(format!("unexpected answer to stats: {other:?}")),
    }
}

/// Requests completed on every queue so far (reads, writes, flushes, discards, write-zeroes,
/// GET_ID, errors).
pub fn completed(stats: &DiskStats) -> u64 {
    stats
        .queues
        .iter()
        .map(|q| {
            q.read_ops
                + q.write_ops
                + q.flush_ops
                + q.discard_ops
                + q.write_zeroes_ops
                + q.other_ops
                + q.errors
        })
        .sum()
}
