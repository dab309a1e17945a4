//! `vhost_user_messages`: a byte stream from a hostile VMM on the vhost-user socket, with
//! descriptors attached.
//!
//! The input is a sequence of messages until it ends:
//!
//! ```text
//! u8  fds: bits 0-1 how many descriptors go with the message (0..=3)
//! u8  × that many: what each descriptor is (FdKind, mod 5)
//! u32 request, u32 flags, u32 size: the vhost-user header, sent as is
//! `size` bytes of body (fewer when the input ends first), sent as is
//! ```
//!
//! Descriptors are created by the harness for each message: eventfds, a memfd holding guest
//! memory, a sealed memfd (as GET_INFLIGHT_FD hands out), a small memfd (a dirty log), the
//! VMM's end of a back-end request channel.

use crate::{Reader, Writer};

/// Bytes of guest memory a [`FdKind::GuestMemory`] memfd holds.
pub const GUEST_MEMORY: u64 = 1 << 20;
/// Bytes of a [`FdKind::Sealed`] memfd: a 2-queue, 64-entry inflight region and then some.
pub const SEALED: u64 = 1 << 16;
/// Bytes of a [`FdKind::Small`] memfd.
pub const SMALL: u64 = 4096;
/// The device's queue count.
pub const NUM_QUEUES: u16 = 2;
/// The device's largest ring.
pub const QUEUE_SIZE: u16 = 64;

/// What a descriptor attached to a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FdKind {
    /// An eventfd (kick, call, err).
    EventFd = 0,
    /// A memfd of [`GUEST_MEMORY`] bytes.
    GuestMemory = 1,
    /// A memfd of [`SEALED`] bytes sealed against shrinking and growing.
    Sealed = 2,
    /// A memfd of [`SMALL`] bytes.
    Small = 3,
    /// One end of a fresh UNIX socket pair.
    Socket = 4,
}

impl FdKind {
    fn from_raw(raw: u8) -> Self {
        match raw % 5 {
            0 => Self::EventFd,
            1 => Self::GuestMemory,
            2 => Self::Sealed,
            3 => Self::Small,
            _ => Self::Socket,
        }
    }
}

/// One message of the stream.
#[derive(Debug, Clone)]
pub struct Message<'a> {
    /// Descriptors sent with it.
    pub fds: Vec<FdKind>,
    /// Header and body, as sent.
    pub bytes: &'a [u8],
}

/// Splits `data` into messages.
pub fn decode(data: &[u8]) -> Vec<Message<'_>> {
    let mut r = Reader::new(data);
    let mut messages = Vec::new();
    while !r.is_empty() {
        let count = r.u8() & 3;
        let fds = (0..count).map(|_| FdKind::from_raw(r.u8())).collect();
        let start = data.len() - r.rest_len();
        let header = r.bytes(12);
        let size = header
            .get(8..12)
            .and_then(|s| s.try_into().ok())
            .map_or(0, u32::from_le_bytes);
        let body = r.bytes(usize::try_from(size).unwrap_or(usize::MAX));
        let end = start + header.len() + body.len();
        messages.push(Message {
            fds,
            bytes: &data[start..end],
        });
    }
    messages
}

/// Builds a message stream (for seeds).
#[derive(Debug, Default, Clone)]
pub struct Builder(Writer);

/// vhost-user header flags: version 1.
pub const VERSION_1: u32 = 1;
/// vhost-user header flags: NEED_REPLY.
pub const NEED_REPLY: u32 = 1 << 3;

impl Builder {
    /// Appends a message with `fds` attached.
    pub fn msg(mut self, request: u32, flags: u32, fds: &[FdKind], body: &[u8]) -> Self {
        self.0.u8(fds.len() as u8);
        for &fd in fds {
            self.0.u8(fd as u8);
        }
        self.0
            .u32(request)
            .u32(flags)
            .u32(body.len() as u32)
            .bytes(body);
        self
    }

    /// The encoded stream.
    pub fn finish(self) -> Vec<u8> {
        self.0 .0
    }
}

/// Request codes (vhost-user spec, front-end requests).
pub mod req {
    #![allow(missing_docs)]
    pub const GET_FEATURES: u32 = 1;
    pub const SET_FEATURES: u32 = 2;
    pub const SET_OWNER: u32 = 3;
    pub const RESET_OWNER: u32 = 4;
    pub const SET_MEM_TABLE: u32 = 5;
    pub const SET_LOG_BASE: u32 = 6;
    pub const SET_VRING_NUM: u32 = 8;
    pub const SET_VRING_ADDR: u32 = 9;
    pub const SET_VRING_BASE: u32 = 10;
    pub const GET_VRING_BASE: u32 = 11;
    pub const SET_VRING_KICK: u32 = 12;
    pub const SET_VRING_CALL: u32 = 13;
    pub const SET_VRING_ERR: u32 = 14;
    pub const GET_PROTOCOL_FEATURES: u32 = 15;
    pub const SET_PROTOCOL_FEATURES: u32 = 16;
    pub const GET_QUEUE_NUM: u32 = 17;
    pub const SET_VRING_ENABLE: u32 = 18;
    pub const SET_BACKEND_REQ_FD: u32 = 21;
    pub const GET_CONFIG: u32 = 24;
    pub const SET_CONFIG: u32 = 25;
    pub const GET_INFLIGHT_FD: u32 = 31;
    pub const SET_INFLIGHT_FD: u32 = 32;
    pub const RESET_DEVICE: u32 = 34;
    pub const GET_MAX_MEM_SLOTS: u32 = 36;
    pub const ADD_MEM_REG: u32 = 37;
    pub const REM_MEM_REG: u32 = 38;
}

/// `VhostUserInflight`: mmap_size, mmap_offset 0, num_queues, queue_size.
fn inflight_body(mmap_size: u64, num_queues: u16, queue_size: u16) -> Vec<u8> {
    let mut w = Writer::default();
    w.u64(mmap_size).u64(0).u16(num_queues).u16(queue_size);
    w.0
}

/// The 32-bit fields, then the 64-bit ones.
fn body(words: &[u64], halves: &[u32]) -> Vec<u8> {
    let mut w = Writer::default();
    for &h in halves {
        w.u32(h);
    }
    for &v in words {
        w.u64(v);
    }
    w.0
}

/// The seeds: the session tests/src/raw.rs's `RawDevice::connect_negotiating` runs (as QEMU
/// does), with and without REPLY_ACK, a back-end channel, inflight tracking and dirty
/// logging, memory slots added and removed, resets, and tests/tests/bad_messages.rs's kinds
/// of malformed message.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    use FdKind::*;
    const USER: u64 = 0x7f00_0000_0000;
    let f = VERSION_1;
    let ack = VERSION_1 | NEED_REPLY;
    // VERSION_1 | RING_INDIRECT_DESC | EVENT_IDX | PROTOCOL_FEATURES, plus the blk features
    // the device offers (seg_max, blk_size, flush, mq, discard, write zeroes, config_wce).
    let features: u64 = (1 << 32)
        | (1 << 28)
        | (1 << 29)
        | (1 << 30)
        | (1 << 2)
        | (1 << 6)
        | (1 << 9)
        | (1 << 11)
        | (1 << 12)
        | (1 << 13)
        | (1 << 14);
    // MQ | REPLY_ACK | BACKEND_REQ | CONFIG | INFLIGHT_SHMFD | RESET_DEVICE |
    // CONFIGURE_MEM_SLOTS | LOG_SHMFD.
    let protocol: u64 =
        1 | (1 << 3) | (1 << 5) | (1 << 9) | (1 << 12) | (1 << 13) | (1 << 15) | (1 << 1);
    let negotiate = |b: Builder, protocol: u64, flags: u32| {
        b.msg(req::SET_OWNER, f, &[], &[])
            .msg(req::GET_FEATURES, f, &[], &[])
            .msg(req::SET_FEATURES, f, &[], &body(&[features], &[]))
            .msg(req::GET_PROTOCOL_FEATURES, f, &[], &[])
            .msg(req::SET_PROTOCOL_FEATURES, f, &[], &body(&[protocol], &[]))
            .msg(req::GET_QUEUE_NUM, flags, &[], &[])
            .msg(
                req::GET_CONFIG,
                flags,
                &[],
                &body(&[], &[0, 60, 0])
                    .into_iter()
                    .chain([0u8; 60])
                    .collect::<Vec<u8>>(),
            )
    };
    let mem_table = |b: Builder, flags: u32| {
        b.msg(
            req::SET_MEM_TABLE,
            flags,
            &[GuestMemory],
            &body(&[0, GUEST_MEMORY, USER, 0], &[1, 0]),
        )
    };
    // Queue q's rings at 64 KiB × (q + 1): descriptors, then avail, then used.
    let start_queue = |b: Builder, q: u32, flags: u32| {
        let base = 0x10000 * (u64::from(q) + 1);
        b.msg(req::SET_VRING_NUM, flags, &[], &body(&[], &[q, 64]))
            .msg(
                req::SET_VRING_ADDR,
                flags,
                &[],
                &body(
                    &[USER + base, USER + base + 0x2000, USER + base + 0x1000, 0],
                    &[q, 0],
                ),
            )
            .msg(req::SET_VRING_BASE, flags, &[], &body(&[], &[q, 0]))
            .msg(
                req::SET_VRING_CALL,
                flags,
                &[EventFd],
                &body(&[u64::from(q)], &[]),
            )
            .msg(
                req::SET_VRING_KICK,
                flags,
                &[EventFd],
                &body(&[u64::from(q)], &[]),
            )
            .msg(req::SET_VRING_ENABLE, flags, &[], &body(&[], &[q, 1]))
    };
    let stop_queue = |b: Builder, q: u32| b.msg(req::GET_VRING_BASE, f, &[], &body(&[], &[q, 0]));
    let qemu = |protocol: u64, flags: u32| {
        let b = negotiate(Builder::default(), protocol, flags);
        let b = mem_table(b, flags);
        let b = start_queue(b, 0, flags);
        let b = start_queue(b, 1, flags);
        stop_queue(stop_queue(b, 0), 1)
    };
    let inflight = {
        let b = negotiate(Builder::default(), protocol, ack);
        let b = b
            .msg(req::GET_INFLIGHT_FD, f, &[], &inflight_body(0, 2, 64))
            .msg(
                req::SET_INFLIGHT_FD,
                ack,
                &[Sealed],
                &inflight_body(2176, 2, 64),
            );
        let b = mem_table(b, ack);
        let b = start_queue(b, 0, ack);
        stop_queue(b, 0)
            .msg(req::RESET_DEVICE, ack, &[], &[])
            .finish()
    };
    let backend_channel = negotiate(Builder::default(), protocol, ack)
        .msg(req::SET_BACKEND_REQ_FD, ack, &[Socket], &[])
        .msg(
            req::SET_CONFIG,
            ack,
            &[],
            &body(&[], &[32, 1, 0])
                .into_iter()
                .chain([1u8])
                .collect::<Vec<u8>>(),
        )
        .finish();
    let logging = {
        let b = negotiate(Builder::default(), protocol, ack);
        let b = mem_table(b, ack);
        let b = b.msg(req::SET_LOG_BASE, ack, &[Small], &body(&[SMALL, 0], &[]));
        let b = b.msg(
            req::SET_FEATURES,
            ack,
            &[],
            &body(&[features | (1 << 26)], &[]),
        );
        let b = start_queue(b, 0, ack);
        stop_queue(b, 0).finish()
    };
    let mem_slots = negotiate(Builder::default(), protocol, ack)
        .msg(req::GET_MAX_MEM_SLOTS, f, &[], &[])
        .msg(
            req::ADD_MEM_REG,
            ack,
            &[GuestMemory],
            &body(&[0, 0, 0x10000, USER, 0], &[]),
        )
        .msg(
            req::ADD_MEM_REG,
            ack,
            &[GuestMemory],
            &body(&[0, 0x10000, 0x10000, USER + 0x10000, 0x10000], &[]),
        )
        .msg(
            req::REM_MEM_REG,
            ack,
            &[],
            &body(&[0, 0, 0x10000, USER, 0], &[]),
        )
        .msg(req::RESET_OWNER, f, &[], &[])
        .finish();
    // bad_messages.rs: a short header, a body larger than declared, stray fds, a ring size
    // that is no power of two, a queue index past the device's.
    let bad = Builder::default()
        .msg(req::SET_VRING_NUM, ack, &[], &body(&[], &[0, 3]))
        .msg(req::SET_VRING_NUM, ack, &[], &body(&[], &[99, 64]))
        .msg(req::SET_OWNER, f, &[EventFd, EventFd], &[])
        .msg(
            req::SET_MEM_TABLE,
            ack,
            &[GuestMemory],
            &body(&[0, GUEST_MEMORY * 2, USER, 0], &[1, 0]),
        )
        .msg(req::GET_FEATURES, f, &[], &[1, 2, 3])
        .finish();
    let mut short = Builder::default().msg(req::SET_OWNER, f, &[], &[]).finish();
    short.extend_from_slice(&[0, 1, 0, 0]);
    vec![
        (
            "qemu_no_reply_ack".into(),
            qemu(protocol & !(1 << 3), f).finish(),
        ),
        ("qemu_reply_ack".into(), qemu(protocol, ack).finish()),
        ("no_protocol_features".into(), {
            let b = Builder::default().msg(req::SET_OWNER, f, &[], &[]).msg(
                req::SET_FEATURES,
                f,
                &[],
                &body(&[features & !(1 << 30)], &[]),
            );
            let b = mem_table(b, f);
            stop_queue(start_queue(b, 0, f), 0).finish()
        }),
        ("inflight".into(), inflight),
        ("backend_channel".into(), backend_channel),
        ("dirty_logging".into(), logging),
        ("mem_slots".into(), mem_slots),
        ("bad_messages".into(), bad),
        ("short_header".into(), short),
    ]
}
