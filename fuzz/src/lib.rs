//! The input formats of blkplane's fuzz targets: how a fuzzer's byte string becomes guest
//! memory, ring contents, vhost-user messages, an inflight region or the steps of the
//! iothread's used-ring writer, and back (the seed corpora in `seeds/` are encoded from the
//! unit tests' fixtures with the same code, see `examples/make_seeds.rs`).
//!
//! Decoding never fails: a short input reads as zeros, so every byte string is a valid input
//! and the fuzzer spends its time in the code under test rather than in the harness.

#![warn(missing_docs)]

pub mod blk;
pub mod inflight;
pub mod ring;
pub mod vhost;
pub mod vring;

/// Reads little-endian integers off the front of the input; zeros once it is used up.
pub struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    /// Reads `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Self { data }
    }

    /// Whether every byte was read.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Up to `n` bytes (fewer at the end of the input).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (head, tail) = self.data.split_at(n.min(self.data.len()));
        self.data = tail;
        head
    }

    /// Bytes not read yet.
    pub fn rest_len(&self) -> usize {
        self.data.len()
    }

    /// Everything left.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }

    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        for (dst, src) in out.iter_mut().zip(self.bytes(N)) {
            *dst = *src;
        }
        out
    }

    /// A `u8`.
    pub fn u8(&mut self) -> u8 {
        u8::from_le_bytes(self.array())
    }

    /// A `u16`.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }

    /// A `u32`.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }

    /// A `u64`.
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
}

/// Builds an input the way [`Reader`] takes it apart (for seeds).
#[derive(Debug, Default, Clone)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    /// Appends a `u8`.
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }

    /// Appends a `u16`.
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends a `u32`.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends a `u64`.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends raw bytes.
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.0.extend_from_slice(v);
        self
    }
}

/// A memfd of `len` bytes (guest RAM, an image, a region the VMM hands over).
pub fn memfd(name: &std::ffi::CStr, len: u64) -> std::io::Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    // SAFETY: a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor owned by nobody else.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.set_len(len)?;
    Ok(file)
}
