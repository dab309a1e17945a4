//! Shared memory between blkplane's processes and the VMM: sealed memfds and `MAP_SHARED`
//! mappings. The batch ring and the inflight region are both built on these.

use std::ffi::CStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::ptr::NonNull;

/// Creates a memfd of `len` zero bytes (pages are allocated on first touch) sealed against
/// shrinking, growing and further seals, so that no process holding it can truncate it under
/// a mapping (which would turn accesses into SIGBUS).
pub fn sealed_memfd(name: &CStr, len: u64) -> io::Result<File> {
    // SAFETY: `name` is NUL-terminated; the result is checked.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned to us and is owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len)?;
    // SAFETY: plain fcntl on our own descriptor.
    let sealed = unsafe {
        libc::fcntl(
            file.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )
    };
    if sealed < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

/// Whether `file` is sealed against shrinking (a peer cannot make our mapping SIGBUS).
pub fn is_sealed_against_shrinking(file: &File) -> bool {
    // SAFETY: plain fcntl on a descriptor we hold; fails (EINVAL) for files without seals.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    seals >= 0 && seals & libc::F_SEAL_SHRINK != 0
}

/// A read-write `MAP_SHARED` mapping of part of a file; unmapped on drop.
#[derive(Debug)]
pub struct SharedMapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; its users synchronise every access (atomics or
// ownership handed over through the ring protocol).
unsafe impl Send for SharedMapping {}
// SAFETY: as above; the type itself hands out only a raw pointer.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// Maps `len` bytes of `file` from `offset` (page aligned). The caller checks that the
    /// range lies inside the file.
    pub fn new(file: &File, len: u64, offset: u64) -> io::Result<Self> {
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l > 0)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "bad mapping length"))?;
        let offset = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "bad mapping offset"))?;
        // SAFETY: maps a file we hold a descriptor for at an address the kernel chooses; the
        // result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                offset,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| io::Error::other("mmap returned a null mapping"))?;
        Ok(Self { base, len })
    }

    /// The first byte (page aligned).
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: an empty mapping cannot be made.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `new` mapped; its owner guarantees nothing still points
        // into it (every user holds the owning value or an `Arc` of it).
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_memfd_cannot_shrink_and_maps() {
        let file = sealed_memfd(c"test", 8192).unwrap();
        assert!(is_sealed_against_shrinking(&file));
        assert!(file.set_len(4096).is_err());
        let map = SharedMapping::new(&file, 8192, 0).unwrap();
        assert_eq!(map.len(), 8192);
        // SAFETY: in bounds of the mapping.
        unsafe { map.as_ptr().add(8191).write(7) };
        let again = SharedMapping::new(&file, 4096, 4096).unwrap();
        // SAFETY: in bounds; the same page seen through a second mapping.
        assert_eq!(unsafe { again.as_ptr().add(4095).read() }, 7);
        assert!(SharedMapping::new(&file, 0, 0).is_err());
        let plain = File::open("/dev/null").unwrap();
        assert!(!is_sealed_against_shrinking(&plain));
    }
}
