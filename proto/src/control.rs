//! Control messages from a frontend to one of its iothreads, over a `SOCK_SEQPACKET` UNIX
//! socket pair (one datagram per message, file descriptors as `SCM_RIGHTS`).
//!
//! Every request is answered by one [`ControlReply`]. Message layout (little-endian):
//!
//! | message | bytes | fds |
//! |---|---|---|
//! | `Setup` | tag 1: u32, flags: u32, logical_block_size: u32, image_size: u64, poll_max_us: u32, backing_files: u32, qcow2_layers: u32 | ring memfd, submit eventfd, complete eventfd, then (without `SETUP_FLAG_NULL_IMAGE`) image fd, [O_DIRECT image fd], [external data file fd], one read-only fd per backing file (the image's backing file first) |
//! | `SetMemoryTable` | tag 2: u32, count: u32, count × (size: u64, mmap_offset: u64, guest_addr: u64) | one per region, in index order |
//! | `Shutdown` | tag 3: u32 | — |
//! | `StartQueue` | tag 4: u32, queue: u16, size: u16, flags: u32, avail_addr: u64, used_addr: u64, next_used: u16, inflight_queue: u16, inflight_queues: u16, inflight_size: u16, inflight_offset: u64 | inflight region, then (with [`QUEUE_FLAG_CALL`]) the call eventfd |
//! | `StopQueue` | tag 5: u32, queue: u32 | — |
//! | `SetCall` | tag 6: u32, queue: u32, has_call: u32 | the call eventfd when has_call is 1 |
//! | `SetDirtyLog` | tag 7: u32, present: u32, size: u64, offset: u64 | the log's memfd when present is 1 |
//! | `GrowImage` | tag 8: u32, size: u64 | — |
//! | reply | tag 0x80: u32, errno: i32 (0 = success) | — |
//!
//! `Setup` byte by byte (32 bytes):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | tag = 1 |
//! | 4 | 4 | flags: [`SETUP_FLAG_DIRECT_FD`], [`SETUP_FLAG_NULL_IMAGE`], [`SETUP_FLAG_DATA_FILE`]; other bits are refused |
//! | 8 | 4 | logical_block_size: the alignment O_DIRECT transfers need |
//! | 12 | 8 | image_size: the null image's size in bytes; 0 for a file image, whose size the iothread reads from the fd itself |
//! | 20 | 4 | poll_max_us: the bound of the iothread's adaptive polling of its submission queue, in µs (the disk's `--poll-max-us`); 0: it never polls |
//! | 24 | 4 | backing_files: how many backing-file fds follow the image's (at most [`MAX_BACKING_FILES`]; 0 for a raw image) |
//! | 28 | 4 | qcow2_layers: bit 0 set: the image is qcow2; bit *i*: the *i*-th backing file is qcow2 (clear: raw); bits past `backing_files` are refused |
//!
//! With [`SETUP_FLAG_NULL_IMAGE`] no image fd travels (three fds in all) and
//! [`SETUP_FLAG_DIRECT_FD`] must be clear: the iothread completes reads by zero-filling the
//! guest buffers and every other request at once, without any I/O.
//!
//! The frontend only sends `SetMemoryTable` while no request of that iothread is in flight, so
//! the iothread can swap its mappings without any lock on the I/O path (and the iothread holds
//! it, and `Shutdown`, until its requests are done, should a frontend break that promise).
//! The other messages are handled as soon as they arrive.
//!
//! `StartQueue` hands the iothread a virtqueue it completes requests of: where its avail ring
//! (for the driver's interrupt suppression: flags and `used_event`) and used ring are in
//! guest-physical memory, the used index to go on from, whether `VIRTIO_RING_F_EVENT_IDX` was
//! negotiated, the inflight region it clears requests in as it uses them
//! ([`crate::inflight`]; the region's geometry, the queue's index in it and the mapping offset
//! of the file), and the call eventfd. `queue` is the index slots name
//! ([`crate::ring::SlotHeader::queue`]). `StopQueue` forgets one (the frontend sends it only
//! once the queue's requests are done), `SetCall` replaces or removes its call eventfd, and
//! `SetDirtyLog` starts (a memfd, the bitmap's `size` bytes at `offset`) or stops marking
//! what the iothread writes into guest memory in a live migration's dirty log.
//!
//! `GrowImage` grows a qcow2 image's virtual size (ResizeDisk): the iothread owns the image's
//! metadata, so it is the one to write the larger L1 table and header; the frontend raises
//! the capacity the guest sees only once it is answered. A raw image is grown by the
//! frontend itself, and its iothreads refuse the message.

use std::fs::File;
use std::io;
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// The most memory regions a table may have (the frontend advertises this many mem slots).
pub const MAX_MEMORY_REGIONS: usize = 32;
/// The largest polling bound, in µs, a `Setup` may carry (the frontend's `--poll-max-us`
/// range): long enough for a driver's next request, short enough that no setting makes an
/// iothread spin for long.
pub const MAX_POLL_MAX_US: u32 = 1000;
/// The most backing files a `Setup` may hand over: the depth bound of a qcow2 backing chain.
pub const MAX_BACKING_FILES: u32 = 16;
/// The most file descriptors one message carries.
pub const MAX_FDS: usize = MAX_MEMORY_REGIONS;
/// The largest encoded message.
pub const MAX_MESSAGE_SIZE: usize = 8 + 24 * MAX_MEMORY_REGIONS;

const TAG_SETUP: u32 = 1;
const TAG_SET_MEMORY_TABLE: u32 = 2;
const TAG_SHUTDOWN: u32 = 3;
const TAG_START_QUEUE: u32 = 4;
const TAG_STOP_QUEUE: u32 = 5;
const TAG_SET_CALL: u32 = 6;
const TAG_SET_DIRTY_LOG: u32 = 7;
const TAG_GROW_IMAGE: u32 = 8;

/// `StartQueue` flag: `VIRTIO_RING_F_EVENT_IDX` was negotiated (interrupts are suppressed
/// through `used_event`, not the avail ring's flags).
pub const QUEUE_FLAG_EVENT_IDX: u32 = 1;
/// `StartQueue` flag: the call eventfd follows the inflight region's fd.
pub const QUEUE_FLAG_CALL: u32 = 2;
const TAG_REPLY: u32 = 0x80;

/// `Setup` flag: a fifth fd, the image opened with O_DIRECT, follows.
pub const SETUP_FLAG_DIRECT_FD: u32 = 1;
/// `Setup` flag: a qcow2 image's external data file follows the image's fds (before the
/// backing files'), opened as the image is.
pub const SETUP_FLAG_DATA_FILE: u32 = 4;
/// `Setup` flag: serve a null image of `image_size` bytes (reads return zeros, writes are
/// dropped); no image fd follows.
pub const SETUP_FLAG_NULL_IMAGE: u32 = 2;

/// Errors of the control channel.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The socket failed.
    #[error("control socket: {0}")]
    Io(#[from] io::Error),
    /// The peer closed the socket (it exited or died).
    #[error("control peer closed the connection")]
    Closed,
    /// A message that does not decode.
    #[error("malformed control message: {0}")]
    Malformed(&'static str),
    /// A message with the wrong number of file descriptors.
    #[error("control message carries {got} fds, expected {expected}")]
    FdCount {
        /// Received.
        got: usize,
        /// Expected.
        expected: usize,
    },
    /// The peer answered with an error.
    #[error("iothread refused the request: {0}")]
    Refused(io::Error),
}

type Result<T> = std::result::Result<T, ControlError>;

/// One guest memory region as the iothread maps it: the whole `size` bytes from `mmap_offset`
/// of the region's fd. Segments refer to regions by their index in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryRegionSpec {
    /// Bytes to map.
    pub size: u64,
    /// Offset of the mapping in the fd.
    pub mmap_offset: u64,
    /// The guest-physical address of the region's first byte (for rings and the dirty log).
    pub guest_addr: u64,
}

/// A virtqueue the iothread completes requests of (`StartQueue`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QueueSpec {
    /// The index slots name the queue by.
    pub queue: u16,
    /// Ring size.
    pub size: u16,
    /// `QUEUE_FLAG_*` bits.
    pub flags: u32,
    /// Guest-physical address of the avail ring.
    pub avail_addr: u64,
    /// Guest-physical address of the used ring.
    pub used_addr: u64,
    /// The used index the first completion goes to.
    pub next_used: u16,
    /// The queue's index in the inflight region.
    pub inflight_queue: u16,
    /// Queues the inflight region holds.
    pub inflight_queues: u16,
    /// Entries per queue in the inflight region.
    pub inflight_size: u16,
    /// Offset of the inflight region in its file (page aligned).
    pub inflight_offset: u64,
}

/// A live migration's dirty log as the iothread maps it (`SetDirtyLog`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirtyLogSpec {
    /// Bytes of bitmap.
    pub size: u64,
    /// Offset of the bitmap in the file.
    pub offset: u64,
}

/// What a `Setup` carries besides its fds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetupSpec {
    /// `SETUP_FLAG_*` bits.
    pub flags: u32,
    /// The image's logical block size; O_DIRECT is used only for buffers aligned to it.
    pub logical_block_size: u32,
    /// With [`SETUP_FLAG_NULL_IMAGE`], the null image's size in bytes; otherwise 0.
    pub image_size: u64,
    /// How long, in µs, the iothread may poll its submission queue before it sleeps with
    /// nothing at the device (the window adapts below it); 0: never.
    pub poll_max_us: u32,
    /// How many backing-file fds follow the image's (a qcow2 image's chain, top first).
    pub backing_files: u32,
    /// Bit 0: the image is qcow2; bit *i*: the *i*-th backing file is qcow2 (else raw).
    pub qcow2_layers: u32,
}

/// A request from the frontend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlRequest {
    /// First message after spawn: the ring, eventfds and image.
    Setup(SetupSpec),
    /// Replaces the whole memory table.
    SetMemoryTable(Vec<MemoryRegionSpec>),
    /// Exit cleanly.
    Shutdown,
    /// Complete the requests of a virtqueue from now on.
    StartQueue(QueueSpec),
    /// Forget a virtqueue (none of its requests is in flight).
    StopQueue {
        /// The index slots name it by.
        queue: u16,
    },
    /// Replace (`has_call`: the eventfd travels with the message) or remove a queue's call
    /// eventfd.
    SetCall {
        /// The index slots name it by.
        queue: u16,
        /// Whether an eventfd is attached.
        has_call: bool,
    },
    /// Start (`Some`: the log's memfd travels with the message) or stop marking the dirty log.
    SetDirtyLog(Option<DirtyLogSpec>),
    /// Grow a qcow2 image's virtual size to `size` bytes.
    GrowImage {
        /// The new virtual size.
        size: u64,
    },
}

impl ControlRequest {
    /// How many fds must travel with this request.
    pub fn expected_fds(&self) -> usize {
        match self {
            // A null image has no fds; the iothread refuses DIRECT_FD along with it.
            Self::Setup(SetupSpec { flags, .. }) if flags & SETUP_FLAG_NULL_IMAGE != 0 => 3,
            Self::Setup(SetupSpec {
                flags,
                backing_files,
                ..
            }) => {
                let image_fds: usize = if flags & SETUP_FLAG_DIRECT_FD != 0 {
                    5
                } else {
                    4
                };
                let image_fds =
                    image_fds.saturating_add(usize::from(flags & SETUP_FLAG_DATA_FILE != 0));
                // More than MAX_FDS cannot travel; the count saturates and the message is
                // refused for it.
                usize::try_from(*backing_files)
                    .unwrap_or(usize::MAX)
                    .saturating_add(image_fds)
            }
            Self::SetMemoryTable(regions) => regions.len(),
            Self::Shutdown | Self::StopQueue { .. } | Self::GrowImage { .. } => 0,
            Self::StartQueue(spec) if spec.flags & QUEUE_FLAG_CALL != 0 => 2,
            Self::StartQueue(_) => 1,
            Self::SetCall { has_call, .. } => usize::from(*has_call),
            Self::SetDirtyLog(log) => usize::from(log.is_some()),
        }
    }

    /// Encodes the message body.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(MAX_MESSAGE_SIZE);
        match self {
            Self::Setup(SetupSpec {
                flags,
                logical_block_size,
                image_size,
                poll_max_us,
                backing_files,
                qcow2_layers,
            }) => {
                out.extend_from_slice(&TAG_SETUP.to_le_bytes());
                out.extend_from_slice(&flags.to_le_bytes());
                out.extend_from_slice(&logical_block_size.to_le_bytes());
                out.extend_from_slice(&image_size.to_le_bytes());
                out.extend_from_slice(&poll_max_us.to_le_bytes());
                out.extend_from_slice(&backing_files.to_le_bytes());
                out.extend_from_slice(&qcow2_layers.to_le_bytes());
            }
            Self::SetMemoryTable(regions) => {
                out.extend_from_slice(&TAG_SET_MEMORY_TABLE.to_le_bytes());
                // More regions than a u32 counts cannot be sent (nor fds for them): the count saturates
                // and the receiver refuses the message for its fd count.
                let count = u32::try_from(regions.len()).unwrap_or(u32::MAX);
                out.extend_from_slice(&count.to_le_bytes());
                for region in regions {
                    out.extend_from_slice(&region.size.to_le_bytes());
                    out.extend_from_slice(&region.mmap_offset.to_le_bytes());
                    out.extend_from_slice(&region.guest_addr.to_le_bytes());
                }
            }
            Self::Shutdown => out.extend_from_slice(&TAG_SHUTDOWN.to_le_bytes()),
            Self::StartQueue(spec) => {
                out.extend_from_slice(&TAG_START_QUEUE.to_le_bytes());
                out.extend_from_slice(&spec.queue.to_le_bytes());
                out.extend_from_slice(&spec.size.to_le_bytes());
                out.extend_from_slice(&spec.flags.to_le_bytes());
                out.extend_from_slice(&spec.avail_addr.to_le_bytes());
                out.extend_from_slice(&spec.used_addr.to_le_bytes());
                out.extend_from_slice(&spec.next_used.to_le_bytes());
                out.extend_from_slice(&spec.inflight_queue.to_le_bytes());
                out.extend_from_slice(&spec.inflight_queues.to_le_bytes());
                out.extend_from_slice(&spec.inflight_size.to_le_bytes());
                out.extend_from_slice(&spec.inflight_offset.to_le_bytes());
            }
            Self::StopQueue { queue } => {
                out.extend_from_slice(&TAG_STOP_QUEUE.to_le_bytes());
                out.extend_from_slice(&u32::from(*queue).to_le_bytes());
            }
            Self::SetCall { queue, has_call } => {
                out.extend_from_slice(&TAG_SET_CALL.to_le_bytes());
                out.extend_from_slice(&u32::from(*queue).to_le_bytes());
                out.extend_from_slice(&u32::from(*has_call).to_le_bytes());
            }
            Self::SetDirtyLog(log) => {
                out.extend_from_slice(&TAG_SET_DIRTY_LOG.to_le_bytes());
                out.extend_from_slice(&u32::from(log.is_some()).to_le_bytes());
                let (size, offset) = log.map_or((0, 0), |l| (l.size, l.offset));
                out.extend_from_slice(&size.to_le_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
            }
            Self::GrowImage { size } => {
                out.extend_from_slice(&TAG_GROW_IMAGE.to_le_bytes());
                out.extend_from_slice(&size.to_le_bytes());
            }
        }
        out
    }

    /// Decodes a message body.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let mut reader = Reader(bytes);
        let message = match reader.u32()? {
            TAG_SETUP => Self::Setup(SetupSpec {
                flags: reader.u32()?,
                logical_block_size: reader.u32()?,
                image_size: reader.u64()?,
                poll_max_us: reader.u32()?,
                backing_files: reader.u32()?,
                qcow2_layers: reader.u32()?,
            }),
            TAG_SET_MEMORY_TABLE => {
                let count = reader.u32()? as usize;
                if count > MAX_MEMORY_REGIONS {
                    return Err(ControlError::Malformed("too many memory regions"));
                }
                let mut regions = Vec::with_capacity(count);
                for _ in 0..count {
                    regions.push(MemoryRegionSpec {
                        size: reader.u64()?,
                        mmap_offset: reader.u64()?,
                        guest_addr: reader.u64()?,
                    });
                }
                Self::SetMemoryTable(regions)
            }
            TAG_SHUTDOWN => Self::Shutdown,
            TAG_START_QUEUE => Self::StartQueue(QueueSpec {
                queue: reader.u16()?,
                size: reader.u16()?,
                flags: reader.u32()?,
                avail_addr: reader.u64()?,
                used_addr: reader.u64()?,
                next_used: reader.u16()?,
                inflight_queue: reader.u16()?,
                inflight_queues: reader.u16()?,
                inflight_size: reader.u16()?,
                inflight_offset: reader.u64()?,
            }),
            TAG_STOP_QUEUE => Self::StopQueue {
                queue: reader.queue()?,
            },
            TAG_SET_CALL => Self::SetCall {
                queue: reader.queue()?,
                has_call: reader.flag()?,
            },
            TAG_SET_DIRTY_LOG => {
                let present = reader.flag()?;
                let spec = DirtyLogSpec {
                    size: reader.u64()?,
                    offset: reader.u64()?,
                };
                Self::SetDirtyLog(present.then_some(spec))
            }
            TAG_GROW_IMAGE => Self::GrowImage {
                size: reader.u64()?,
            },
            _ => return Err(ControlError::Malformed("unknown tag")),
        };
        if !reader.0.is_empty() {
            return Err(ControlError::Malformed("trailing bytes"));
        }
        Ok(message)
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N]> {
        let (head, rest) = self
            .0
            .split_first_chunk::<N>()
            .ok_or(ControlError::Malformed("message too short"))?;
        self.0 = rest;
        Ok(*head)
    }

    fn u16(&mut self) -> Result<u16> {
        self.take::<2>().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Result<u32> {
        self.take::<4>().map(u32::from_le_bytes)
    }

    fn queue(&mut self) -> Result<u16> {
        u16::try_from(self.u32()?).map_err(|_| ControlError::Malformed("queue index too large"))
    }

    fn flag(&mut self) -> Result<bool> {
        match self.u32()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(ControlError::Malformed("a flag that is neither 0 nor 1")),
        }
    }

    fn u64(&mut self) -> Result<u64> {
        self.take::<8>().map(u64::from_le_bytes)
    }
}

/// Sends `request` with `fds` (which must number [`ControlRequest::expected_fds`]).
pub fn send_request(socket: &UnixStream, request: &ControlRequest, fds: &[RawFd]) -> Result<()> {
    if fds.len() != request.expected_fds() {
        return Err(ControlError::FdCount {
            got: fds.len(),
            expected: request.expected_fds(),
        });
    }
    let body = request.encode();
    socket
        .send_with_fds(&[body.as_slice()], fds)
        .map_err(|e| ControlError::Io(io::Error::from_raw_os_error(e.errno())))?;
    Ok(())
}

/// Receives one request and the fds that came with it. Every received fd is owned by the
/// returned `File`s, so none leaks when the message is rejected.
pub fn recv_request(socket: &UnixStream) -> Result<(ControlRequest, Vec<File>)> {
    let mut buf = [0u8; MAX_MESSAGE_SIZE];
    let mut raw_fds = [-1 as RawFd; MAX_FDS];
    let mut iov = [libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    }];
    // SAFETY: the iovec points at `buf`, which outlives the call.
    let (len, fd_count) = unsafe { socket.recv_with_fds(&mut iov, &mut raw_fds) }
        .map_err(|e| ControlError::Io(io::Error::from_raw_os_error(e.errno())))?;
    let files: Vec<File> = raw_fds
        .iter()
        .take(fd_count)
        // SAFETY: the kernel just installed these fds for us; each is wrapped exactly once.
        .map(|&fd| unsafe { File::from_raw_fd(fd) })
        .collect();
    if len == 0 {
        return Err(ControlError::Closed);
    }
    let request = ControlRequest::decode(buf.get(..len).unwrap_or_default())?;
    if files.len() != request.expected_fds() {
        return Err(ControlError::FdCount {
            got: files.len(),
            expected: request.expected_fds(),
        });
    }
    Ok((request, files))
}

/// The answer to every request: `Ok(())` or the errno of what failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlReply(pub i32);

impl ControlReply {
    /// Success.
    pub const OK: Self = Self(0);

    /// Sends the reply.
    pub fn send(self, socket: &UnixStream) -> Result<()> {
        let mut body = [0u8; 8];
        body[..4].copy_from_slice(&TAG_REPLY.to_le_bytes());
        body[4..].copy_from_slice(&self.0.to_le_bytes());
        socket
            .send_with_fds(&[&body[..]], &[])
            .map_err(|e| ControlError::Io(io::Error::from_raw_os_error(e.errno())))?;
        Ok(())
    }

    /// Waits for a reply; an errno other than 0 becomes [`ControlError::Refused`].
    pub fn recv(socket: &UnixStream) -> Result<()> {
        let mut buf = [0u8; 16];
        let mut raw_fds = [-1 as RawFd; 1];
        let mut iov = [libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        }];
        // SAFETY: the iovec points at `buf`, which outlives the call.
        let (len, fd_count) = unsafe { socket.recv_with_fds(&mut iov, &mut raw_fds) }
            .map_err(|e| ControlError::Io(io::Error::from_raw_os_error(e.errno())))?;
        for &fd in raw_fds.iter().take(fd_count) {
            // SAFETY: an fd the peer should not have sent; close it so it does not leak.
            drop(unsafe { File::from_raw_fd(fd) });
        }
        if len == 0 {
            return Err(ControlError::Closed);
        }
        let mut reader = Reader(buf.get(..len).unwrap_or_default());
        if reader.u32()? != TAG_REPLY {
            return Err(ControlError::Malformed("not a reply"));
        }
        match reader.u32()? as i32 {
            0 => Ok(()),
            errno => Err(ControlError::Refused(io::Error::from_raw_os_error(errno))),
        }
    }
}

/// Creates the connected `SOCK_SEQPACKET` pair for a new iothread (both ends close-on-exec;
/// the spawner clears the flag on the child's end).
pub fn socket_pair() -> io::Result<(UnixStream, UnixStream)> {
    let mut fds = [-1; 2];
    // SAFETY: socketpair writes two fds into the array we pass.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    Ok(unsafe {
        (
            UnixStream::from_raw_fd(fds[0]),
            UnixStream::from_raw_fd(fds[1]),
        )
    })
}

/// Sends `bytes` on the stream socket `socket` with `attached` as an SCM_RIGHTS descriptor
/// (it travels with the first byte); returns how many bytes were sent. This is how blkplaned
/// hands a frontend a file the frontend may not open itself, on the admin channel
/// (`proto/blkplane/v1/frontend.proto`); the socket may be non-blocking (WouldBlock).
pub fn send_with_fd(
    socket: BorrowedFd<'_>,
    bytes: &[u8],
    attached: BorrowedFd<'_>,
) -> io::Result<usize> {
    // SAFETY: the UnixStream only borrows the descriptor for this call: ManuallyDrop keeps
    // it from being closed, and nothing else is done with it.
    let stream = ManuallyDrop::new(unsafe { UnixStream::from_raw_fd(socket.as_raw_fd()) });
    stream
        .send_with_fds(&[bytes], &[attached.as_raw_fd()])
        .map_err(|e| io::Error::from_raw_os_error(e.errno()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn requests_round_trip() {
        for request in [
            ControlRequest::Setup(SetupSpec {
                flags: SETUP_FLAG_DIRECT_FD,
                logical_block_size: 512,
                image_size: 0,
                poll_max_us: 200,
                backing_files: 2,
                qcow2_layers: 0b011,
            }),
            ControlRequest::Setup(SetupSpec {
                flags: SETUP_FLAG_NULL_IMAGE,
                logical_block_size: 4096,
                image_size: 8 << 30,
                poll_max_us: 0,
                backing_files: 0,
                qcow2_layers: 0,
            }),
            ControlRequest::SetMemoryTable(vec![
                MemoryRegionSpec {
                    size: 1 << 30,
                    mmap_offset: 0,
                    guest_addr: 0,
                },
                MemoryRegionSpec {
                    size: 4096,
                    mmap_offset: 8192,
                    guest_addr: 1 << 32,
                },
            ]),
            ControlRequest::Shutdown,
            ControlRequest::StartQueue(QueueSpec {
                queue: 3,
                size: 256,
                flags: QUEUE_FLAG_EVENT_IDX | QUEUE_FLAG_CALL,
                avail_addr: 0x1000,
                used_addr: 0x2000,
                next_used: 65535,
                inflight_queue: 7,
                inflight_queues: 8,
                inflight_size: 256,
                inflight_offset: 4096,
            }),
            ControlRequest::StopQueue { queue: 2 },
            ControlRequest::GrowImage { size: 3 << 40 },
            ControlRequest::SetCall {
                queue: 1,
                has_call: true,
            },
            ControlRequest::SetCall {
                queue: 1,
                has_call: false,
            },
            ControlRequest::SetDirtyLog(Some(DirtyLogSpec {
                size: 4096,
                offset: 100,
            })),
            ControlRequest::SetDirtyLog(None),
        ] {
            assert_eq!(ControlRequest::decode(&request.encode()).unwrap(), request);
        }
    }

    #[test]
    fn malformed_requests_are_errors() {
        assert!(ControlRequest::decode(&[]).is_err());
        assert!(ControlRequest::decode(&99u32.to_le_bytes()).is_err());
        let mut too_many = TAG_SET_MEMORY_TABLE.to_le_bytes().to_vec();
        too_many.extend_from_slice(&1000u32.to_le_bytes());
        assert!(ControlRequest::decode(&too_many).is_err());
        let mut truncated = ControlRequest::SetMemoryTable(vec![MemoryRegionSpec {
            size: 1,
            mmap_offset: 2,
            guest_addr: 3,
        }])
        .encode();
        truncated.pop();
        assert!(ControlRequest::decode(&truncated).is_err());
        let mut bad_flag = ControlRequest::SetCall {
            queue: 0,
            has_call: true,
        }
        .encode();
        bad_flag[8] = 2;
        assert!(ControlRequest::decode(&bad_flag).is_err());
        let mut trailing = ControlRequest::Shutdown.encode();
        trailing.push(0);
        assert!(ControlRequest::decode(&trailing).is_err());
    }

    #[test]
    fn fds_travel_with_the_message() {
        let (a, b) = socket_pair().unwrap();
        let file = File::open("/dev/null").unwrap();
        let request = ControlRequest::SetMemoryTable(vec![MemoryRegionSpec {
            size: 4096,
            mmap_offset: 0,
            guest_addr: 0,
        }]);
        send_request(&a, &request, &[file.as_raw_fd()]).unwrap();
        let (got, files) = recv_request(&b).unwrap();
        assert_eq!(got, request);
        assert_eq!(files.len(), 1);
        ControlReply(libc::EINVAL).send(&b).unwrap();
        assert!(matches!(
            ControlReply::recv(&a),
            Err(ControlError::Refused(_))
        ));
        ControlReply::OK.send(&b).unwrap();
        ControlReply::recv(&a).unwrap();
        drop(b);
        assert!(matches!(ControlReply::recv(&a), Err(ControlError::Closed)));
    }

    #[test]
    fn wrong_fd_count_is_refused() {
        let (a, b) = socket_pair().unwrap();
        let file = File::open("/dev/null").unwrap();
        a.send_with_fds(
            &[ControlRequest::Shutdown.encode().as_slice()],
            &[file.as_raw_fd()],
        )
        .unwrap();
        assert!(matches!(
            recv_request(&b),
            Err(ControlError::FdCount {
                got: 1,
                expected: 0
            })
        ));
    }

    #[test]
    fn setup_is_encoded_byte_by_byte_as_documented() {
        let setup = ControlRequest::Setup(SetupSpec {
            flags: SETUP_FLAG_NULL_IMAGE,
            logical_block_size: 512,
            image_size: 0x0102_0304_0506_0708,
            poll_max_us: 0x0a0b_0c0d,
            backing_files: 0x1112_1314,
            qcow2_layers: 0x2122_2324,
        });
        let bytes = setup.encode();
        assert_eq!(bytes.len(), 32);
        assert_eq!(bytes[0..4], 1u32.to_le_bytes());
        assert_eq!(bytes[4..8], SETUP_FLAG_NULL_IMAGE.to_le_bytes());
        assert_eq!(bytes[8..12], 512u32.to_le_bytes());
        assert_eq!(bytes[12..20], 0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(bytes[20..24], 0x0a0b_0c0du32.to_le_bytes());
        assert_eq!(bytes[24..28], 0x1112_1314u32.to_le_bytes());
        assert_eq!(bytes[28..32], 0x2122_2324u32.to_le_bytes());
        assert_eq!(ControlRequest::decode(&bytes).unwrap(), setup);
        // The 12-byte Setup of the file-only protocol and the 20-byte one of the iothread
        // that did not poll are now too short.
        assert!(ControlRequest::decode(&bytes[..12]).is_err());
        assert!(ControlRequest::decode(&bytes[..20]).is_err());
        // So is the 24-byte one of the raw-only iothread.
        assert!(ControlRequest::decode(&bytes[..24]).is_err());
    }

    #[test]
    fn setup_fd_counts() {
        let setup = |flags| {
            ControlRequest::Setup(SetupSpec {
                flags,
                logical_block_size: 512,
                image_size: 0,
                poll_max_us: 0,
                backing_files: 0,
                qcow2_layers: 0,
            })
        };
        assert_eq!(setup(0).expected_fds(), 4);
        assert_eq!(setup(SETUP_FLAG_DIRECT_FD).expected_fds(), 5);
        assert_eq!(setup(SETUP_FLAG_NULL_IMAGE).expected_fds(), 3);
        assert_eq!(
            setup(SETUP_FLAG_NULL_IMAGE | SETUP_FLAG_DIRECT_FD).expected_fds(),
            3
        );
        let chain = ControlRequest::Setup(SetupSpec {
            flags: SETUP_FLAG_DIRECT_FD,
            logical_block_size: 512,
            image_size: 0,
            poll_max_us: 0,
            backing_files: 2,
            qcow2_layers: 0b11,
        });
        assert_eq!(chain.expected_fds(), 7);
        let with_data_file = ControlRequest::Setup(SetupSpec {
            flags: SETUP_FLAG_DATA_FILE,
            logical_block_size: 512,
            image_size: 0,
            poll_max_us: 0,
            backing_files: 1,
            qcow2_layers: 0b11,
        });
        assert_eq!(with_data_file.expected_fds(), 6);
    }
}
