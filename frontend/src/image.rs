//! Opening the disk image: a regular file or a block device, buffered and (for
//! `--cache direct`) O_DIRECT.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::config::CacheMode;

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
    /// The size could not be read.
    #[error("cannot read the size of image {path}: {source}")]
    Size {
        /// The image path.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
}

/// The open image: a buffered descriptor (always) and an O_DIRECT one when asked for and
/// the file system allows it. Each iothread receives duplicates of both.
#[derive(Debug)]
pub struct Image {
    /// Opened without O_DIRECT: flushes and buffers O_DIRECT cannot take.
    pub buffered: File,
    /// Opened with O_DIRECT, for `--cache direct`.
    pub direct: Option<File>,
    /// Size in bytes.
    pub size: u64,
}

impl Image {
    /// Opens `path` for `cache`, read-only when `read_only`.
    pub fn open(path: &Path, read_only: bool, cache: CacheMode) -> Result<Self, ImageError> {
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
        let size = buffered
            .seek(SeekFrom::End(0))
            .map_err(|source| ImageError::Size {
                path: path.to_owned(),
                source,
            })?;
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
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_files_and_refuses_directories() {
        let dir = std::env::temp_dir().join(format!("blkplane-image-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("disk.img");
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let image = Image::open(&path, false, CacheMode::Writeback).unwrap();
        assert_eq!(image.size, 8192);
        assert!(image.direct.is_none());
        let ro = Image::open(&path, true, CacheMode::Direct).unwrap();
        assert_eq!(ro.size, 8192);
        assert!(matches!(
            Image::open(&dir, true, CacheMode::Writeback),
            Err(ImageError::NotAFileOrBlockDevice(_))
        ));
        assert!(matches!(
            Image::open(&dir.join("missing"), false, CacheMode::Writeback),
            Err(ImageError::Open { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
