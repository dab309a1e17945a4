//! One VMM connection: the vhost-user message loop the accept loop in main.rs runs for each
//! connection (the fuzz target `vhost_user_messages` runs the same function).

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, MutexGuard};

use vhost::vhost_user::BackendReqHandler;

use crate::backend_channel::{self, BackendChannel, PeekedHeader};
use crate::vhost_user::BlkBackend;

/// Serves the vhost-user messages of `stream` on `backend` until the connection ends or a
/// message fails, then resets the device for the next connection (`disconnect`). Returns
/// why the session ended.
///
/// A refusal the VMM asked to be told about (REPLY_ACK) was answered with an error status:
/// the VMM fails what it tried (a migration) and goes on, so the session does too. Any other
/// error ends it: a GET_* request that failed has no reply to send, and the VMM would wait
/// forever on a connection kept open.
pub fn serve(
    stream: UnixStream,
    backend: &Arc<Mutex<BlkBackend>>,
    channel: &BackendChannel,
) -> String {
    let mut connection = BackendReqHandler::from_stream(stream, Arc::clone(backend));
    let reason = loop {
        let header = match peek_backend_channel(connection.as_raw_fd(), channel) {
            Ok(header) => header,
            Err(e) => break e,
        };
        if let Err(e) = connection.handle_request() {
            let acked = header.needs_reply() && lock(backend).take_acked_refusal();
            if !acked {
                break e.to_string();
            }
        }
    };
    drop(connection);
    lock(backend).disconnect();
    reason
}

/// Waits for the next vhost-user message and returns its header; when it is
/// SET_BACKEND_REQ_FD keeps a duplicate of its descriptor (see backend_channel.rs). Errors
/// end the session.
fn peek_backend_channel(socket: RawFd, channel: &BackendChannel) -> Result<PeekedHeader, String> {
    match backend_channel::peek_header(socket) {
        Ok(None) => Err("connection closed".into()),
        Err(e) => Err(e.to_string()),
        Ok(Some(header)) => {
            if backend_channel::is_set_backend_req_fd(header.code) {
                match backend_channel::peek_attached_fd(socket) {
                    Ok(Some(fd)) => channel.set_pending(fd),
                    Ok(None) => {}
                    Err(e) => return Err(e.to_string()),
                }
            }
            Ok(header)
        }
    }
}

/// The device, also after a thread panicked while holding it (its state is still the last
/// one a handler left, which the next message or the disconnect reset deals with).
pub fn lock(backend: &Mutex<BlkBackend>) -> MutexGuard<'_, BlkBackend> {
    blkplane_lock::lock(backend)
}
