//! Opening the disk image: a regular file or a block device, buffered and (for
//! `--cache direct`) O_DIRECT; or a null image (`--image null:SIZE`), a benchmarking aid whose
//! reads return zeros and whose writes are dropped, with no file behind it at all.

use std::ffi::OsString;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::config::CacheMode;
use blkplane_chain::{self as chain, BackingFile, ChainError, ImageFormat};

/// The `--image` prefix that selects a null image; a file whose name starts with it is given
/// as `./null:...`.
const NULL_PREFIX: &[u8] = b"null:";

/// What `--image` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageSpec {
    /// A regular file or block device.
    Path(PathBuf),
    /// A null image of `size` bytes: reads return zeros, writes are dropped, flush, discard and
    /// write-zeroes succeed. Requests still travel through the ring and an iothread, so that
    /// the data path can be measured without any I/O.
    Null {
        /// Capacity in bytes.
        size: u64,
    },
}

/// Why an `--image` argument was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageSpecError {
    /// `null:` with a size that is not a number with an optional K/M/G/T suffix.
    #[error("{0:?}: the null image size must be bytes, or a number with a K, M, G or T suffix")]
    BadSize(String),
    /// `null:0`.
    #[error("the null image size must not be zero")]
    ZeroSize,
    /// A size that does not fit 64 bits.
    #[error("{0:?}: the null image size is too large")]
    TooLarge(String),
}

impl ImageSpec {
    /// Parses an `--image` argument: `null:SIZE` (SIZE in bytes, or with a binary K/M/G/T
    /// suffix, e.g. `null:8G`) or a path. Paths need not be UTF-8.
    pub fn parse(arg: OsString) -> Result<Self, ImageSpecError> {
        match arg.as_bytes().strip_prefix(NULL_PREFIX) {
            Some(size) => Ok(Self::Null {
                size: parse_size(&String::from_utf8_lossy(size))?,
            }),
            None => Ok(Self::Path(PathBuf::from(arg))),
        }
    }

    /// The size of a null image, `None` for a path.
    pub fn null_size(&self) -> Option<u64> {
        match self {
            Self::Null { size } => Some(*size),
            Self::Path(_) => None,
        }
    }
}

impl fmt::Display for ImageSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Path(path) => write!(f, "{}", path.display()),
            Self::Null { size } => write!(f, "null:{size}"),
        }
    }
}

/// Parses `SIZE` of `null:SIZE`: decimal digits and an optional K, M, G or T (either case,
/// powers of 1024, as QEMU reads sizes).
fn parse_size(text: &str) -> Result<u64, ImageSpecError> {
    let bad = || ImageSpecError::BadSize(text.to_owned());
    let shift = match text.as_bytes().last() {
        Some(b'k' | b'K') => 10,
        Some(b'm' | b'M') => 20,
        Some(b'g' | b'G') => 30,
        Some(b't' | b'T') => 40,
        _ => 0,
    };
    // The suffix is one ASCII byte, so cutting it off stays on a character boundary.
    let digits = match shift {
        0 => text,
        _ => text.get(..text.len().saturating_sub(1)).unwrap_or_default(),
    };
    // u64::from_str would also take a leading '+'; only plain digits are a size.
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let value: u64 = digits
        .parse()
        .map_err(|_| ImageSpecError::TooLarge(text.to_owned()))?;
    let size = value
        .checked_mul(1 << shift)
        .ok_or_else(|| ImageSpecError::TooLarge(text.to_owned()))?;
    if size == 0 {
        return Err(ImageSpecError::ZeroSize);
    }
    Ok(size)
}

/// Why the image could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// open() failed.
    #[error("cannot open image {path}: {source}")]
    Open {
        /// The image path.
        path: PathBuf,
        /// What open returned.
        source: io::Error,
    },
    /// Neither a regular file nor a block device.
    #[error("image {0} is neither a regular file nor a block device")]
    NotAFileOrBlockDevice(PathBuf),
    /// The image's format or its backing chain cannot be served.
    #[error("image {path}: {source}")]
    Chain {
        /// The image.
        path: PathBuf,
        /// What is wrong.
        source: ChainError,
    },
    /// The size could not be read.
    #[error("cannot read the size of image {path}: {source}")]
    Size {
        /// The image path.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
}

/// The image the iothreads serve.
#[derive(Debug)]
pub enum Image {
    /// A regular file or block device.
    File(FileImage),
    /// A null image of `size` bytes; the iothreads get no fd for it.
    Null {
        /// Capacity in bytes.
        size: u64,
    },
}

impl Image {
    /// Opens what `spec` names for `cache`, read-only when `read_only` (a null image needs no
    /// opening; `read_only` still makes the frontend refuse writes), in `format` (`None`:
    /// probed, see [`crate::chain`]).
    pub fn open(
        spec: &ImageSpec,
        read_only: bool,
        cache: CacheMode,
        format: Option<ImageFormat>,
    ) -> Result<Self, ImageError> {
        Self::open_in(spec, read_only, cache, format, &[])
    }

    /// [`Image::open`], with a qcow2 image's backing files restricted to `image_dirs` (none:
    /// anywhere).
    pub fn open_in(
        spec: &ImageSpec,
        read_only: bool,
        cache: CacheMode,
        format: Option<ImageFormat>,
        image_dirs: &[PathBuf],
    ) -> Result<Self, ImageError> {
        match spec {
            ImageSpec::Path(path) => {
                FileImage::open_as(path, read_only, cache, format, image_dirs).map(Self::File)
            }
            ImageSpec::Null { size } => Ok(Self::Null { size: *size }),
        }
    }

    /// Drops the clean pages of the image (and of a qcow2 image's external data file) from
    /// this node's page cache (`POSIX_FADV_DONTNEED`), so that the next reads come from the
    /// storage. Returns whether there was a file (a null image has none).
    pub fn drop_cached_pages(&self) -> io::Result<bool> {
        let Self::File(file) = self else {
            return Ok(false);
        };
        for f in std::iter::once(&file.buffered).chain(file.data_file.as_ref()) {
            // SAFETY: fadvise on a descriptor this image owns; no memory is passed.
            let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            if rc != 0 {
                return Err(io::Error::from_raw_os_error(rc));
            }
        }
        Ok(true)
    }

    /// Size in bytes: the disk's capacity.
    pub fn size(&self) -> u64 {
        match self {
            Self::File(file) => file.size,
            Self::Null { size } => *size,
        }
    }
}

/// An open image file: a buffered descriptor (always) and an O_DIRECT one when asked for and
/// the file system allows it. Each iothread receives duplicates of both.
#[derive(Debug)]
pub struct FileImage {
    /// Opened without O_DIRECT: flushes and buffers O_DIRECT cannot take.
    pub buffered: File,
    /// Opened with O_DIRECT, for `--cache direct`.
    pub direct: Option<File>,
    /// Size in bytes: the file's for a raw image, the virtual size of a qcow2 one.
    pub size: u64,
    /// The image's format.
    pub format: ImageFormat,
    /// A qcow2 image's external data file, opened as the image is (`None` for most images).
    pub data_file: Option<File>,
    /// A qcow2 image's backing files, its own first (read-only; empty for raw).
    pub backing: Vec<BackingFile>,
}

impl FileImage {
    /// Opens `path` as a raw image for `cache`, read-only when `read_only`.
    pub fn open(path: &Path, read_only: bool, cache: CacheMode) -> Result<Self, ImageError> {
        Self::open_as(path, read_only, cache, Some(ImageFormat::Raw), &[])
    }

    /// Opens `path` in `format` (`None`: probed) for `cache`, read-only when `read_only`,
    /// with a qcow2 image's backing chain (its files inside `image_dirs`, if any).
    pub fn open_as(
        path: &Path,
        read_only: bool,
        cache: CacheMode,
        format: Option<ImageFormat>,
        image_dirs: &[PathBuf],
    ) -> Result<Self, ImageError> {
        let open = |flags: i32| {
            OpenOptions::new()
                .read(true)
                .write(!read_only)
                .custom_flags(flags | libc::O_CLOEXEC)
                .open(path)
        };
        let open_error = |source| ImageError::Open {
            path: path.to_owned(),
            source,
        };
        let mut buffered = open(0).map_err(open_error)?;
        let file_type = buffered.metadata().map_err(open_error)?.file_type();
        use std::os::unix::fs::FileTypeExt;
        if !file_type.is_file() && !file_type.is_block_device() {
            return Err(ImageError::NotAFileOrBlockDevice(path.to_owned()));
        }
        // SEEK_END gives the size of regular files and block devices alike.
        let chain_error = |source| ImageError::Chain {
            path: path.to_owned(),
            source,
        };
        let format = match format {
            Some(format) => format,
            None => chain::probe(&buffered, path).map_err(chain_error)?,
        };
        let (size, data_file, backing) = match format {
            ImageFormat::Raw => {
                let size = buffered
                    .seek(SeekFrom::End(0))
                    .map_err(|source| ImageError::Size {
                        path: path.to_owned(),
                        source,
                    })?;
                (size, None, Vec::new())
            }
            ImageFormat::Qcow2 => {
                let chain = chain::open_for(&buffered, path, image_dirs, !read_only)
                    .map_err(chain_error)?;
                (chain.size, chain.data_file.map(|d| d.file), chain.backing)
            }
        };
        let direct = match cache {
            CacheMode::Direct => match open(libc::O_DIRECT) {
                Ok(file) => Some(file),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    eprintln!(
                        "blkplane-frontend: {} does not support O_DIRECT (tmpfs?); \
                         using buffered I/O for --cache direct",
                        path.display()
                    );
                    None
                }
                Err(e) => return Err(open_error(e)),
            },
            CacheMode::Writeback | CacheMode::Writethrough => None,
        };
        Ok(Self {
            buffered,
            direct,
            size,
            format,
            data_file,
            backing,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn opens_files_and_refuses_directories() {
        let dir = std::env::temp_dir().join(format!("blkplane-image-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("disk.img");
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let image = FileImage::open(&path, false, CacheMode::Writeback).unwrap();
        assert_eq!(image.size, 8192);
        assert!(image.direct.is_none());
        let ro = Image::open(&ImageSpec::Path(path), true, CacheMode::Direct, None).unwrap();
        assert!(matches!(ro, Image::File(_)));
        assert_eq!(ro.size(), 8192);
        assert!(matches!(
            FileImage::open(&dir, true, CacheMode::Writeback),
            Err(ImageError::NotAFileOrBlockDevice(_))
        ));
        assert!(matches!(
            FileImage::open(&dir.join("missing"), false, CacheMode::Writeback),
            Err(ImageError::Open { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn parse(arg: &str) -> Result<ImageSpec, ImageSpecError> {
        ImageSpec::parse(arg.into())
    }

    fn null(size: u64) -> Result<ImageSpec, ImageSpecError> {
        Ok(ImageSpec::Null { size })
    }

    #[test]
    fn null_sizes_in_bytes_and_with_suffixes() {
        assert_eq!(parse("null:512"), null(512));
        assert_eq!(parse("null:1048576"), null(1 << 20));
        assert_eq!(parse("null:4K"), null(4 << 10));
        assert_eq!(parse("null:4k"), null(4 << 10));
        assert_eq!(parse("null:64M"), null(64 << 20));
        assert_eq!(parse("null:8G"), null(8 << 30));
        assert_eq!(parse("null:8g"), null(8 << 30));
        assert_eq!(parse("null:2T"), null(2 << 40));
        assert_eq!(parse("null:007"), null(7), "leading zeros are digits");
        assert_eq!(parse("null:16777215T"), null(16_777_215 << 40));
    }

    #[test]
    fn bad_null_sizes_are_refused() {
        for bad in [
            "null:",
            "null:G",
            "null:8X",
            "null:8GB",
            "null:8 G",
            "null: 8",
            "null:+8",
            "null:-8",
            "null:1.5G",
            "null:0x10",
            "null:8Gi",
        ] {
            assert!(
                matches!(parse(bad), Err(ImageSpecError::BadSize(_))),
                "{bad}: {:?}",
                parse(bad)
            );
        }
        assert_eq!(parse("null:0"), Err(ImageSpecError::ZeroSize));
        assert_eq!(parse("null:0G"), Err(ImageSpecError::ZeroSize));
        for huge in ["null:16777216T", "null:18446744073709551616"] {
            assert!(
                matches!(parse(huge), Err(ImageSpecError::TooLarge(_))),
                "{huge}"
            );
        }
    }

    #[test]
    fn everything_else_is_a_path() {
        for path in [
            "/dev/shm/disk.img",
            "./null:8G",
            "nul:8G",
            "NULL:8G",
            "disk",
        ] {
            assert_eq!(parse(path), Ok(ImageSpec::Path(PathBuf::from(path))));
        }
        // Not UTF-8: still a path.
        let raw = OsStr::from_bytes(b"/tmp/\xff.img").to_owned();
        assert_eq!(
            ImageSpec::parse(raw.clone()),
            Ok(ImageSpec::Path(PathBuf::from(raw)))
        );
    }

    #[test]
    fn null_image_needs_no_file() {
        let spec = parse("null:8G").unwrap();
        assert_eq!(spec.null_size(), Some(8 << 30));
        assert_eq!(spec.to_string(), format!("null:{}", 8u64 << 30));
        let image = Image::open(&spec, false, CacheMode::Direct, None).unwrap();
        assert!(matches!(image, Image::Null { size } if size == 8 << 30));
        assert_eq!(image.size(), 8 << 30);
        assert_eq!(ImageSpec::Path("/x".into()).null_size(), None);
    }
}
