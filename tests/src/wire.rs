//! Raw vhost-user messages on a plain `UnixStream`, for malformed messages that the `vhost`
//! crate's front-end refuses to produce (bad sizes, stray fds, out-of-range fields).
//!
//! A message is a 12-byte header (request u32, flags u32, size u32, native endian) followed by
//! `size` bytes of body; fds travel as SCM_RIGHTS with the header.

use std::io::{ErrorKind, Read, Write};
use std::os::fd::RawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use vhost::vhost_user::message::{FrontendReq, VhostUserHeaderFlag};
use vhost::vhost_user::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// The version value of the header flags (bits 0..2); vhost-user only has version 1.
pub const FLAGS_VERSION_1: u32 = 0x1;
/// Header size.
pub const HEADER_LEN: usize = 12;
/// How long to wait for the reply to one message.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// Encodes a message header.
pub fn header(request: u32, flags: u32, size: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(HEADER_LEN);
    b.extend_from_slice(&request.to_ne_bytes());
    b.extend_from_slice(&flags.to_ne_bytes());
    b.extend_from_slice(&size.to_ne_bytes());
    b
}

/// Concatenates native-endian u32s and u64s into a message body.
#[derive(Debug, Default, Clone)]
pub struct Body(pub Vec<u8>);

impl Body {
    /// An empty body.
    pub fn new() -> Body {
        Body(Vec::new())
    }

    /// Appends a u32.
    pub fn u32(mut self, v: u32) -> Body {
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }

    /// Appends a u64.
    pub fn u64(mut self, v: u64) -> Body {
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }
}

/// One memory region as SET_MEM_TABLE / ADD_MEM_REG carry it.
#[derive(Debug, Clone, Copy)]
pub struct Region {
    /// Guest-physical address.
    pub gpa: u64,
    /// Size.
    pub size: u64,
    /// Front-end virtual address.
    pub user_addr: u64,
    /// Offset in the fd.
    pub mmap_offset: u64,
}

impl Region {
    fn append(&self, b: Body) -> Body {
        b.u64(self.gpa)
            .u64(self.size)
            .u64(self.user_addr)
            .u64(self.mmap_offset)
    }
}

/// The body of SET_MEM_TABLE with `num_regions` (which tests may set to disagree with
/// `regions.len()`) and the given regions.
pub fn mem_table_body(num_regions: u32, regions: &[Region]) -> Vec<u8> {
    let b = Body::new().u32(num_regions).u32(0);
    regions.iter().fold(b, |b, r| r.append(b)).0
}

/// The body of ADD_MEM_REG / REM_MEM_REG.
pub fn single_region_body(r: &Region) -> Vec<u8> {
    r.append(Body::new().u64(0)).0
}

/// The body of SET_VRING_NUM / SET_VRING_BASE / SET_VRING_ENABLE.
pub fn vring_state_body(index: u32, num: u32) -> Vec<u8> {
    Body::new().u32(index).u32(num).0
}

/// What the back-end did after a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// It sent a message.
    Message {
        /// Request code of the reply.
        request: u32,
        /// Header flags.
        flags: u32,
        /// Body.
        body: Vec<u8>,
    },
    /// It closed the connection.
    Closed,
    /// Nothing within the timeout.
    Silent,
}

impl Reply {
    /// The u64 body of a reply (the ack value for REPLY_ACK: 0 = success).
    pub fn u64_body(&self) -> Option<u64> {
        match self {
            Reply::Message { body, .. } if body.len() == 8 => {
                Some(u64::from_ne_bytes(body[..].try_into().unwrap()))
            }
            _ => None,
        }
    }

    /// Whether this is what a back-end must answer to a message it refuses: a non-zero ack or
    /// closing the connection.
    pub fn is_rejection(&self) -> bool {
        *self == Reply::Closed || self.u64_body().is_some_and(|v| v != 0)
    }
}

/// A vhost-user connection driven byte by byte.
pub struct RawConn {
    stream: UnixStream,
}

/// Whether an I/O error means the peer has gone away.
fn is_disconnect(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::BrokenPipe | ErrorKind::ConnectionReset | ErrorKind::UnexpectedEof
    )
}

impl RawConn {
    /// Connects to `socket`.
    pub fn connect(socket: &Path) -> RawConn {
        let stream = UnixStream::connect(socket)
            .unwrap_or_else(|e| panic!("connecting to {}: {e}", socket.display()));
        RawConn { stream }
    }

    /// Sends `request` with `body` and `fds`, asking for a reply (NEED_REPLY). A back-end that
    /// already closed the connection shows up as `Err` of a disconnect kind.
    pub fn send(&mut self, request: u32, body: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
        let flags = FLAGS_VERSION_1 | VhostUserHeaderFlag::NEED_REPLY.bits();
        let mut msg = header(request, flags, body.len() as u32);
        msg.extend_from_slice(body);
        self.send_bytes(&msg, fds)
    }

    /// Sends exactly `bytes` (header included) with `fds` attached.
    pub fn send_bytes(&mut self, bytes: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
        if fds.is_empty() {
            return self.stream.write_all(bytes);
        }
        let n = self
            .stream
            .send_with_fds(&[bytes], fds)
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))?;
        self.stream.write_all(&bytes[n..])
    }

    /// Closes our sending side, so a back-end waiting for more bytes sees EOF.
    pub fn shutdown_write(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
    }

    /// Waits up to `timeout` for one message from the back-end.
    pub fn recv(&mut self, timeout: Duration) -> Reply {
        self.stream.set_read_timeout(Some(timeout)).unwrap();
        let mut hdr = [0u8; HEADER_LEN];
        match self.stream.read_exact(&mut hdr) {
            Ok(()) => {}
            Err(e) if is_disconnect(&e) => return Reply::Closed,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Reply::Silent
            }
            Err(e) => panic!("reading a reply header: {e}"),
        }
        let field = |i: usize| u32::from_ne_bytes(hdr[4 * i..4 * i + 4].try_into().unwrap());
        let (request, flags, size) = (field(0), field(1), field(2));
        assert!(size <= 4096, "reply claims a {size}-byte body");
        let mut body = vec![0; size as usize];
        match self.stream.read_exact(&mut body) {
            Ok(()) => Reply::Message {
                request,
                flags,
                body,
            },
            Err(e) if is_disconnect(&e) => Reply::Closed,
            Err(e) => panic!("reading a {size}-byte reply body: {e}"),
        }
    }

    /// Sends a body-less query (GET_FEATURES, ...) and returns its u64 answer.
    pub fn query_u64(&mut self, request: FrontendReq) -> u64 {
        let msg = header(request as u32, FLAGS_VERSION_1, 0);
        self.send_bytes(&msg, &[]).expect("sending a query");
        let reply = self.recv(REPLY_TIMEOUT);
        match &reply {
            Reply::Message { request: r, .. } if *r == request as u32 => {}
            _ => panic!("no proper reply to {request:?}: {reply:?}"),
        }
        reply.u64_body().expect("u64 reply")
    }

    /// Sends a message that gets no reply before REPLY_ACK is negotiated.
    fn send_no_reply(&mut self, request: FrontendReq, body: &[u8]) {
        let mut msg = header(request as u32, FLAGS_VERSION_1, body.len() as u32);
        msg.extend_from_slice(body);
        self.send_bytes(&msg, &[]).expect("sending");
    }

    /// SET_OWNER and feature negotiation with REPLY_ACK, so that every later message sent with
    /// [`RawConn::send`] is answered (an ack is how a refusal becomes visible). Returns the
    /// negotiated protocol features.
    pub fn handshake(&mut self) -> VhostUserProtocolFeatures {
        self.send_no_reply(FrontendReq::SET_OWNER, &[]);
        let features = self.query_u64(FrontendReq::GET_FEATURES);
        let protocol = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        assert!(features & protocol != 0, "PROTOCOL_FEATURES not offered");
        // Everything offered but LOG_ALL, which starts dirty logging (a migration) and is
        // refused without a log.
        let features = features & !VhostUserVirtioFeatures::LOG_ALL.bits();
        self.send_no_reply(FrontendReq::SET_FEATURES, &features.to_ne_bytes());
        let pf = self.query_u64(FrontendReq::GET_PROTOCOL_FEATURES);
        let pf = VhostUserProtocolFeatures::from_bits_truncate(pf)
            & (VhostUserProtocolFeatures::REPLY_ACK
                | VhostUserProtocolFeatures::CONFIG
                | VhostUserProtocolFeatures::MQ
                | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS);
        assert!(
            pf.contains(VhostUserProtocolFeatures::REPLY_ACK),
            "REPLY_ACK not offered"
        );
        self.send_no_reply(FrontendReq::SET_PROTOCOL_FEATURES, &pf.bits().to_ne_bytes());
        // A round trip proves the back-end digested everything above.
        self.query_u64(FrontendReq::GET_FEATURES);
        pf
    }

    /// Sends `request` with `body` and `fds` and asserts that the back-end refuses it: a
    /// non-zero ack or a closed connection, within [`REPLY_TIMEOUT`]. Returns what happened.
    #[track_caller]
    pub fn expect_rejected(
        &mut self,
        what: &str,
        request: u32,
        body: &[u8],
        fds: &[RawFd],
    ) -> Reply {
        match self.send(request, body, fds) {
            Ok(()) => {}
            Err(e) if is_disconnect(&e) => return Reply::Closed,
            Err(e) => panic!("{what}: sending: {e}"),
        }
        self.expect_rejection(what)
    }

    /// Asserts that the next thing the back-end does is a refusal (see
    /// [`RawConn::expect_rejected`]).
    #[track_caller]
    pub fn expect_rejection(&mut self, what: &str) -> Reply {
        let reply = self.recv(REPLY_TIMEOUT);
        assert!(
            reply.is_rejection(),
            "{what}: expected an error reply or a closed connection, got {reply:?}"
        );
        reply
    }

    /// Sends `request` with `body` and `fds` and asserts a zero (success) ack.
    #[track_caller]
    pub fn expect_ok(&mut self, what: &str, request: u32, body: &[u8], fds: &[RawFd]) {
        self.send(request, body, fds)
            .unwrap_or_else(|e| panic!("{what}: sending: {e}"));
        let reply = self.recv(REPLY_TIMEOUT);
        assert_eq!(
            reply.u64_body(),
            Some(0),
            "{what}: expected a success ack, got {reply:?}"
        );
    }
}
