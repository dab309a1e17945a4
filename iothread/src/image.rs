//! The disk image: the buffered fd every request may use, the optional O_DIRECT fd for aligned
//! transfers, and the size every request is checked against; or a null image, which has only a
//! size (reads return zeros, writes are dropped: see [`crate::slot::SlotState::run_null`]).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::time::{Duration, Instant};

use crate::qcow2::{LayerFormat, Qcow2Image};

/// `BLKGETSIZE64`, `_IOR(0x12, 114, size_t)` in the asm-generic encoding used by x86_64 and
/// aarch64 (the architectures the ring layout is defined for); libc does not export it.
const BLKGETSIZE64: libc::c_ulong = (2 << 30) | (8 << 16) | (0x12 << 8) | 114;

/// The slowest a probing read may be for an image to be served inline (see
/// [`Image::transfers_inline`]): a copy from memory takes a few microseconds, a read from a
/// device tens to thousands.
const INLINE_PROBE_MAX: Duration = Duration::from_micros(20);
/// How many probing reads are timed; the median decides.
const INLINE_PROBES: usize = 9;

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
    /// A null image of zero bytes.
    #[error("a null image must not be empty")]
    EmptyNullImage,
    /// The qcow2 chain could not be opened.
    #[error("qcow2: {0}")]
    Qcow2(#[from] crate::qcow2::Qcow2Error),
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
            Self::Qcow2(e) => e.errno(),
            _ => libc::EINVAL,
        }
    }
}

/// The image fds and geometry, fixed for the iothread's lifetime.
#[derive(Debug)]
pub struct Image {
    /// `None` for a null image.
    files: Option<Files>,
    /// A qcow2 image's metadata and backing chain; `None` for a raw one.
    qcow2: Option<Qcow2Image>,
    /// The disk's size: the file's for a raw image, the virtual size for qcow2.
    size: u64,
    block_size: u32,
}

#[derive(Debug)]
struct Files {
    buffered: File,
    direct: Option<File>,
    /// Transfers run as plain preadv/pwritev on the iothread (see `Image::transfers_inline`).
    inline: bool,
}

impl Image {
    /// A null image of `size` bytes: no fd, nothing to validate but the size.
    pub fn null(size: u64, logical_block_size: u32) -> Result<Self, ImageError> {
        if size == 0 {
            return Err(ImageError::EmptyNullImage);
        }
        Ok(Self {
            files: None,
            qcow2: None,
            size,
            block_size: logical_block_size,
        })
    }

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
        let inline = probe_inline(&buffered, size);
        Ok(Self {
            files: Some(Files {
                buffered,
                direct,
                inline,
            }),
            qcow2: None,
            size,
            block_size: logical_block_size,
        })
    }

    /// A qcow2 image: `buffered` and `direct` as for [`Image::new`] (the image file, whose data
    /// clusters the engine reads and writes), `data_file` its external data file if its header
    /// names one, `backing` its backing chain, the image's backing file first, each with its
    /// format. imago gets a duplicate of the buffered fd for the
    /// metadata.
    pub fn qcow2(
        buffered: File,
        direct: Option<File>,
        logical_block_size: u32,
        data_file: Option<File>,
        backing: Vec<(File, LayerFormat)>,
    ) -> Result<Self, ImageError> {
        let metadata = buffered.try_clone().map_err(|source| ImageError::Os {
            op: "dup image fd",
            source,
        })?;
        let mut image = Self::new(buffered, direct, logical_block_size)?;
        let chain = Qcow2Image::open(metadata, data_file, backing)?;
        image.size = chain.size();
        image.qcow2 = Some(chain);
        Ok(image)
    }

    /// The qcow2 chain, for a qcow2 image.
    pub fn qcow2_chain(&self) -> Option<&Qcow2Image> {
        self.qcow2.as_ref()
    }

    /// Takes a qcow2 image's new virtual size (after [`Qcow2Image::grow`]).
    pub fn set_qcow2_size(&mut self, size: u64) {
        if self.qcow2.is_some() {
            self.size = size;
        }
    }

    /// The qcow2 chain, mutably (discards change mappings).
    pub fn qcow2_chain_mut(&mut self) -> Option<&mut Qcow2Image> {
        self.qcow2.as_mut()
    }

    /// Whether reads and writes of this image run inline, as a plain `preadv`/`pwritev` on the
    /// iothread, instead of through io_uring. Decided at set-up by probing the file: io_uring
    /// first tries every read and write without blocking, and where the file cannot be asked
    /// that (`RWF_NOWAIT` is refused with EOPNOTSUPP — tmpfs, for one) it hands each request
    /// to an io-wq worker thread, one more sleep and wake-up per request for data that is
    /// already in memory. Such a file is served inline when timed reads of it are
    /// memory-fast; a file whose reads may wait for a device stays on io_uring.
    pub fn transfers_inline(&self) -> bool {
        self.files.as_ref().is_some_and(|files| files.inline)
    }

    /// Whether this is a null image (no fd: requests are completed without I/O).
    pub fn is_null(&self) -> bool {
        self.files.is_none()
    }

    /// The fd that works for any request; `None` for a null image.
    pub fn buffered(&self) -> Option<&File> {
        self.files.as_ref().map(|files| &files.buffered)
    }

    /// The O_DIRECT fd, if the frontend sent one.
    pub fn direct(&self) -> Option<&File> {
        self.files.as_ref().and_then(|files| files.direct.as_ref())
    }

    /// Image size in bytes, as found at setup or at the last [`Image::refresh_size`].
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Measures the image again; returns whether it grew. Called only when a request reaches
    /// past the known size, because a disk resized while running (blkplaned's ResizeDisk)
    /// grows the file under us. A shrinking image is ignored: the frontend never shrinks one.
    pub fn refresh_size(&mut self) -> bool {
        // A qcow2 image file grows with every allocation; its virtual size is in its header.
        if self.qcow2.is_some() {
            return false;
        }
        let Some(files) = &self.files else {
            return false;
        };
        let measured = match files.buffered.metadata() {
            Ok(meta) if meta.file_type().is_file() => Some(meta.len()),
            Ok(meta) if meta.file_type().is_block_device() => {
                block_device_size(&files.buffered).ok()
            }
            _ => None,
        };
        match measured {
            Some(size) if size > self.size => {
                self.size = size;
                true
            }
            _ => false,
        }
    }

    /// The alignment a transfer needs to go through the O_DIRECT fd.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }
}

/// See [`Image::transfers_inline`]. Reads (never writes) the start of the image.
fn probe_inline(file: &File, size: u64) -> bool {
    let mut buf = [0u8; 4096];
    let len = buf.len().min(usize::try_from(size).unwrap_or(usize::MAX));
    if len == 0 {
        return false;
    }
    let mut read = |flags: libc::c_int| -> io::Result<usize> {
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: len,
        };
        // SAFETY: one iovec describing `len` bytes of the local buffer, which outlives the
        // call; the kernel writes at most that.
        let rc = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, 0, flags) };
        usize::try_from(rc).map_err(|_| io::Error::last_os_error())
    };
    match read(libc::RWF_NOWAIT) {
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
        // The file takes non-blocking attempts, so io_uring completes what is cached inline
        // itself and queues only what would block.
        _ => return false,
    }
    let mut times = [Duration::MAX; INLINE_PROBES];
    for time in &mut times {
        let start = Instant::now();
        if read(0).is_err() {
            return false;
        }
        *time = start.elapsed();
    }
    times.sort_unstable();
    let median = times
        .get(INLINE_PROBES / 2)
        .copied()
        .unwrap_or(Duration::MAX);
    median <= INLINE_PROBE_MAX
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
    fn null_image_has_a_size_and_no_fd() {
        let image = Image::null(8 << 30, 512).unwrap();
        assert!(image.is_null());
        assert_eq!(image.size(), 8 << 30);
        assert!(image.buffered().is_none());
        assert!(image.direct().is_none());
        assert!(matches!(
            Image::null(0, 512),
            Err(ImageError::EmptyNullImage)
        ));
        assert!(!Image::new(memfd(4096), None, 512).unwrap().is_null());
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
