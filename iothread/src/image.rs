//! The disk image: the buffered fd every request may use, the optional O_DIRECT fd for aligned
//! transfers, and the size every request is checked against.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};

/// `BLKGETSIZE64`, `_IOR(0x12, 114, size_t)` in the asm-generic encoding used by x86_64 and
/// aarch64 (the architectures the ring layout is defined for); libc does not export it.
const BLKGETSIZE64: libc::c_ulong = (2 << 30) | (8 << 16) | (0x12 << 8) | 114;

/// The smallest and largest logical block sizes accepted along with an O_DIRECT fd.
const BLOCK_SIZE_RANGE: std::ops::RangeInclusive<u32> = 512..=65536;

/// Why the image fds of a `Setup` were refused.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The fd is neither a regular file nor a block device.
    #[error("the {which} image fd is neither a regular file nor a block device")]
    NotAnImage {
        /// `buffered` or `O_DIRECT`.
        which: &'static str,
    },
    /// The O_DIRECT fd refers to another file than the buffered one.
    #[error("the O_DIRECT image fd refers to another file than the buffered one")]
    DifferentFiles,
    /// The logical block size cannot be used to decide O_DIRECT alignment.
    #[error("logical block size {0} is not a power of two in 512..=65536")]
    BadBlockSize(u32),
    /// A system call failed.
    #[error("{op}: {source}")]
    Os {
        /// The operation that failed.
        op: &'static str,
        /// Its error.
        source: io::Error,
    },
}

impl ImageError {
    /// The errno to answer the frontend with.
    pub fn errno(&self) -> i32 {
        match self {
            Self::Os { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            _ => libc::EINVAL,
        }
    }
}

/// The image fds and geometry, fixed for the iothread's lifetime.
#[derive(Debug)]
pub struct Image {
    buffered: File,
    direct: Option<File>,
    size: u64,
    block_size: u32,
}

impl Image {
    /// Validates the fds of a `Setup`: both must be the same regular file or block device, and
    /// with an O_DIRECT fd the logical block size must be a usable alignment.
    pub fn new(
        buffered: File,
        direct: Option<File>,
        logical_block_size: u32,
    ) -> Result<Self, ImageError> {
        let meta = buffered.metadata().map_err(|source| ImageError::Os {
            op: "fstat image",
            source,
        })?;
        let size = if meta.file_type().is_file() {
            meta.len()
        } else if meta.file_type().is_block_device() {
            block_device_size(&buffered)?
        } else {
            return Err(ImageError::NotAnImage { which: "buffered" });
        };
        if let Some(direct) = &direct {
            let direct_meta = direct.metadata().map_err(|source| ImageError::Os {
                op: "fstat O_DIRECT image",
                source,
            })?;
            let ty = direct_meta.file_type();
            if !ty.is_file() && !ty.is_block_device() {
                return Err(ImageError::NotAnImage { which: "O_DIRECT" });
            }
            let same = if ty.is_block_device() {
                meta.file_type().is_block_device() && direct_meta.rdev() == meta.rdev()
            } else {
                meta.file_type().is_file()
                    && direct_meta.dev() == meta.dev()
                    && direct_meta.ino() == meta.ino()
            };
            if !same {
                return Err(ImageError::DifferentFiles);
            }
            if !logical_block_size.is_power_of_two()
                || !BLOCK_SIZE_RANGE.contains(&logical_block_size)
            {
                return Err(ImageError::BadBlockSize(logical_block_size));
            }
        }
        Ok(Self {
            buffered,
            direct,
            size,
            block_size: logical_block_size,
        })
    }

    /// The fd that works for any request.
    pub fn buffered(&self) -> &File {
        &self.buffered
    }

    /// The O_DIRECT fd, if the frontend sent one.
    pub fn direct(&self) -> Option<&File> {
        self.direct.as_ref()
    }

    /// Image size in bytes, as found at setup.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The alignment a transfer needs to go through the O_DIRECT fd.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }
}

fn block_device_size(file: &File) -> Result<u64, ImageError> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points at `size`.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64 as _, &mut size as *mut u64) };
    if rc < 0 {
        return Err(ImageError::Os {
            op: "BLKGETSIZE64",
            source: io::Error::last_os_error(),
        });
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::tests::memfd;

    #[test]
    fn regular_file_size_and_direct_checks() {
        let file = memfd(1 << 20);
        let image = Image::new(file.try_clone().unwrap(), None, 0).unwrap();
        assert_eq!(image.size(), 1 << 20);
        assert!(image.direct().is_none());

        let same = Image::new(
            file.try_clone().unwrap(),
            Some(file.try_clone().unwrap()),
            512,
        );
        assert!(same.unwrap().direct().is_some());
        assert!(matches!(
            Image::new(file.try_clone().unwrap(), Some(memfd(4096)), 512),
            Err(ImageError::DifferentFiles)
        ));
        for bad in [0, 100, 256, 1 << 20] {
            assert!(matches!(
                Image::new(
                    file.try_clone().unwrap(),
                    Some(file.try_clone().unwrap()),
                    bad
                ),
                Err(ImageError::BadBlockSize(_))
            ));
        }
    }

    #[test]
    fn refuses_non_images() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let socket = File::from(std::os::fd::OwnedFd::from(a));
        assert!(matches!(
            Image::new(socket, None, 512),
            Err(ImageError::NotAnImage { .. })
        ));
    }
}
