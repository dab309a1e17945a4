//! The vhost-user back-end request channel (back-end → VMM), used to tell the guest that the
//! config space changed (the disk was resized).
//!
//! The `vhost` crate turns SET_BACKEND_REQ_FD into a `Backend` that has no sender for
//! CONFIG_CHANGE_MSG and no way to reach its socket. So before each message is dispatched the
//! vhost-user thread peeks at its header; when it is SET_BACKEND_REQ_FD it peeks once more with
//! room for the attached descriptor — the kernel installs a duplicate of every descriptor of a
//! peeked message — and keeps that duplicate. The message itself is then read and validated by
//! the crate as usual; [`BackendChannel::adopt`] only accepts the duplicate once the crate has
//! accepted the message.

use std::io::{self, Write};
use std::mem::size_of;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;

use vhost::vhost_user::message::{BackendReq, FrontendReq, VhostUserHeaderFlag};

/// Size of a vhost-user message header: request, flags, size (u32 each, little-endian).
const HEADER_LEN: usize = 12;
/// The size of one descriptor in an SCM_RIGHTS message, as the CMSG macros take it.
const RAW_FD_SIZE: u32 = RawFd::BITS / 8;
/// Header flags of a message we send: protocol version 1, no reply wanted.
const FLAGS_VERSION_1: u32 = 0x1;

/// Encodes a message header with no body.
fn header(request: u32) -> [u8; HEADER_LEN] {
    let mut bytes = [0u8; HEADER_LEN];
    for (dst, src) in bytes.iter_mut().zip(
        request
            .to_le_bytes()
            .into_iter()
            .chain(FLAGS_VERSION_1.to_le_bytes())
            .chain(0u32.to_le_bytes()),
    ) {
        *dst = src;
    }
    bytes
}

/// The request code and flags of a message not yet read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeekedHeader {
    /// The request code (`u32::MAX` for a partial header, which the dispatcher then rejects).
    pub code: u32,
    /// The header flags.
    pub flags: u32,
}

impl PeekedHeader {
    /// The VMM asked for a REPLY_ACK status (VHOST_USER_NEED_REPLY).
    pub fn needs_reply(&self) -> bool {
        self.flags & VhostUserHeaderFlag::NEED_REPLY.bits() != 0
    }
}

/// Reads the header of the next message on `socket` without consuming it. Blocks until a
/// header is available; `Ok(None)` at end of stream.
pub fn peek_header(socket: RawFd) -> io::Result<Option<PeekedHeader>> {
    let mut header = [0u8; HEADER_LEN];
    loop {
        // SAFETY: receives at most HEADER_LEN bytes into a local buffer; MSG_PEEK leaves them
        // (and any attached descriptors, which are not installed without a control buffer)
        // in the socket.
        let n = unsafe {
            libc::recv(
                socket,
                header.as_mut_ptr().cast(),
                header.len(),
                libc::MSG_PEEK | libc::MSG_WAITALL,
            )
        };
        match n {
            0 => return Ok(None),
            n if n < 0 => {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            n if (n as usize) < HEADER_LEN => {
                // A partial header: let the dispatcher read it and report the error.
                return Ok(Some(PeekedHeader {
                    code: u32::MAX,
                    flags: 0,
                }));
            }
            _ => {
                let [a, b, c, d, e, f, g, h, ..] = header;
                return Ok(Some(PeekedHeader {
                    code: u32::from_le_bytes([a, b, c, d]),
                    flags: u32::from_le_bytes([e, f, g, h]),
                }));
            }
        }
    }
}

/// Whether a request code is SET_BACKEND_REQ_FD.
pub fn is_set_backend_req_fd(code: u32) -> bool {
    code == u32::from(FrontendReq::SET_BACKEND_REQ_FD)
}

/// Peeks at the next message (known to be SET_BACKEND_REQ_FD) with room for one descriptor and
/// returns the duplicate the kernel installs for the peek, if one is attached.
pub fn peek_attached_fd(socket: RawFd) -> io::Result<Option<OwnedFd>> {
    let mut header = [0u8; HEADER_LEN];
    let mut iov = libc::iovec {
        iov_base: header.as_mut_ptr().cast(),
        iov_len: header.len(),
    };
    // Room for exactly one descriptor, aligned for cmsghdr.
    let mut control = [0u64; 8];
    // SAFETY: zeroed msghdr is a valid "empty" value; the fields are filled below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is a pure computation.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(RAW_FD_SIZE) } as usize;
    // SAFETY: msg points at live local buffers of the sizes it states.
    let n = unsafe { libc::recvmsg(socket, &mut msg, libc::MSG_PEEK | libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut found = None;
    // SAFETY: walking the control buffer the kernel just filled, with the libc macros that
    // bound every step by msg_controllen.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                let count = ((*cmsg).cmsg_len as usize)
                    .saturating_sub(libc::CMSG_LEN(0) as usize)
                    .checked_div(size_of::<RawFd>())
                    .unwrap_or(0);
                for i in 0..count {
                    let fd = std::ptr::read_unaligned(data.add(i));
                    // Every installed duplicate is owned here, so none leaks.
                    let owned = OwnedFd::from_raw_fd(fd);
                    if found.is_none() {
                        found = Some(owned);
                    }
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok(found)
}

/// The back-end request channel of the current connection.
#[derive(Default)]
pub struct BackendChannel {
    /// Duplicate taken by the peek, waiting for the crate to accept the message.
    pending: Mutex<Option<OwnedFd>>,
    /// The adopted channel.
    socket: Mutex<Option<UnixStream>>,
}

impl BackendChannel {
    /// Remembers the duplicate of a SET_BACKEND_REQ_FD descriptor seen by a peek.
    pub fn set_pending(&self, fd: OwnedFd) {
        if let Ok(mut pending) = self.pending.lock() {
            *pending = Some(fd);
        }
    }

    /// The crate accepted SET_BACKEND_REQ_FD: the peeked duplicate becomes the channel.
    pub fn adopt(&self) {
        let fd = self.pending.lock().ok().and_then(|mut p| p.take());
        if let (Some(fd), Ok(mut socket)) = (fd, self.socket.lock()) {
            *socket = Some(UnixStream::from(fd));
        }
    }

    /// Forgets the channel (disconnect, reset).
    pub fn clear(&self) {
        if let Ok(mut pending) = self.pending.lock() {
            *pending = None;
        }
        if let Ok(mut socket) = self.socket.lock() {
            *socket = None;
        }
    }

    /// Whether a channel is open.
    #[cfg(test)]
    pub fn is_open(&self) -> bool {
        self.socket.lock().map(|s| s.is_some()).unwrap_or(false)
    }

    /// Sends CONFIG_CHANGE_MSG. No reply is requested: the VMM may be blocked waiting for
    /// our answer on the main channel, and waiting for its ack here could deadlock.
    pub fn config_changed(&self) -> io::Result<bool> {
        let mut socket = self
            .socket
            .lock()
            .map_err(|_| io::Error::other("backend channel lock poisoned"))?;
        let Some(stream) = socket.as_mut() else {
            return Ok(false);
        };
        stream.write_all(&header(u32::from(BackendReq::CONFIG_CHANGE_MSG)))?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use vmm_sys_util::sock_ctrl_msg::ScmSocket;

    #[test]
    fn peeks_the_code_and_a_duplicate_of_the_fd_without_consuming_the_message() {
        let (vmm, backend) = UnixStream::pair().unwrap();
        let (channel_vmm, channel_backend) = UnixStream::pair().unwrap();
        let message = header(u32::from(FrontendReq::SET_BACKEND_REQ_FD));
        vmm.send_with_fds(&[&message[..]], &[channel_backend.as_raw_fd()])
            .unwrap();
        drop(channel_backend);

        let code = peek_header(backend.as_raw_fd()).unwrap().unwrap().code;
        assert!(is_set_backend_req_fd(code));
        let dup = peek_attached_fd(backend.as_raw_fd()).unwrap().unwrap();
        let channel = BackendChannel::default();
        channel.set_pending(dup);
        channel.adopt();
        assert!(channel.is_open());

        // The message is still there for the dispatcher, with its fd.
        let mut buf = [0u8; HEADER_LEN];
        let (n, fd) = backend.recv_with_fd(&mut buf).unwrap();
        assert_eq!(n, HEADER_LEN);
        assert!(fd.is_some());

        assert!(channel.config_changed().unwrap());
        let mut got = [0u8; HEADER_LEN];
        let mut channel_vmm = channel_vmm;
        channel_vmm.read_exact(&mut got).unwrap();
        assert_eq!(
            u32::from_le_bytes([got[0], got[1], got[2], got[3]]),
            u32::from(BackendReq::CONFIG_CHANGE_MSG)
        );
        channel.clear();
        assert!(!channel.config_changed().unwrap());
    }

    #[test]
    fn end_of_stream_is_none() {
        let (vmm, backend) = UnixStream::pair().unwrap();
        drop(vmm);
        assert_eq!(peek_header(backend.as_raw_fd()).unwrap(), None);
    }
}
