//! An image's format and, for qcow2, its backing chain, opened before the frontend locks
//! down (and checked by blkplaned before it starts one): the iothreads get every file of the chain as an fd and never open a path.
//!
//! The format comes from `--format`, or from the image's first bytes (qcow2's magic), as QEMU
//! probes; an image given as `raw` is served raw even when it starts with qcow2's magic (a
//! guest can write that header into a raw disk, and probing it later would hand the guest
//! whatever file its "backing file" names). A backing file's format comes from the overlay's
//! header (its backing format extension), else from probing it, as QEMU does.
//!
//! Backing file names are resolved as QEMU resolves them: an absolute name as it is, a
//! relative one against the directory of the overlay's path (as given, not canonicalized).
//! The chain is at most [`MAX_BACKING_FILES`] deep and may not come back to a file it already
//! holds (compared by device and inode); either is refused with the whole chain in the
//! message. With allowed directories (blkplaned's `--image-dir`), every backing file must
//! resolve (symlinks and `..` followed) inside one of them, as the image itself must: a header
//! is the image owner's to write, and must not reach other files. Every backing file is opened
//! read-only.
//!
//! Each qcow2 layer is opened with `imago` once here as well, read-only: a header or table
//! that imago refuses fails the disk at its start, with the layer's path in the message.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use imago::file::File as ImagoFile;
use imago::qcow2::Qcow2;
use imago::{FormatAccess, StorageOpenOptions};

pub use blkplane_proto::control::MAX_BACKING_FILES;

pub mod integrity;
pub use integrity::header_is_refcounted;
pub mod merge;
pub use merge::{merge_into_backing, MergeError, Merged, Readers};

/// The first four bytes of a qcow2 image.
const QCOW2_MAGIC: [u8; 4] = *b"QFI\xfb";

/// An image format blkplane serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ImageFormat {
    /// The file's bytes are the disk's.
    Raw,
    /// QEMU's qcow2 (versions 2 and 3), possibly with a backing chain.
    Qcow2,
}

impl ImageFormat {
    /// The name QEMU uses (`qemu-img info`'s "file format").
    pub fn name(self) -> &'static str {
        match self {
            Self::Raw => "raw",
            Self::Qcow2 => "qcow2",
        }
    }
}

/// One backing file of a qcow2 chain, opened read-only.
#[derive(Debug)]
pub struct BackingFile {
    /// The file.
    pub file: File,
    /// Its format.
    pub format: ImageFormat,
    /// The path it was opened at.
    pub path: PathBuf,
}

/// A qcow2 image's geometry and chain.
#[derive(Debug)]
pub struct Chain {
    /// The virtual disk size.
    pub size: u64,
    /// The image's external data file (where its data clusters are), if its header names one;
    /// opened as the image is (read-write unless read-only).
    pub data_file: Option<BackingFile>,
    /// The backing files, the image's own first.
    pub backing: Vec<BackingFile>,
}

/// Why an image or its chain cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    /// Reading a file's first bytes failed.
    #[error("reading {path}: {source}")]
    Probe {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// imago refused a qcow2 layer.
    #[error("{path} is not a qcow2 image blkplane can serve: {source}")]
    Qcow2 {
        /// The layer.
        path: PathBuf,
        /// imago's reason.
        source: io::Error,
    },
    /// A backing file keeps its data in an external data file.
    #[error("{0}: an external data file in a backing file is not supported")]
    ExternalDataFile(PathBuf),
    /// The image's external data file cannot be opened or is outside the image directories.
    #[error("the external data file {data_file} of {path}: {reason}")]
    DataFile {
        /// The image.
        path: PathBuf,
        /// The data file.
        data_file: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A backing file's name in a header is not UTF-8 or is empty.
    #[error("{path}: unusable backing file name {name:?}")]
    BackingName {
        /// The overlay.
        path: PathBuf,
        /// The name in its header.
        name: String,
    },
    /// A backing format blkplane does not serve.
    #[error("{path}: backing file {backing} has format {format:?}; only raw and qcow2 are served")]
    BackingFormat {
        /// The overlay.
        path: PathBuf,
        /// The backing file.
        backing: PathBuf,
        /// The format its header names.
        format: String,
    },
    /// A backing file cannot be opened.
    #[error("cannot open backing file {backing} of {path}: {source}")]
    OpenBacking {
        /// The overlay.
        path: PathBuf,
        /// The backing file.
        backing: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// The chain is deeper than [`MAX_BACKING_FILES`].
    #[error("backing chain {chain} is deeper than {MAX_BACKING_FILES} backing files")]
    TooDeep {
        /// The chain, top first.
        chain: String,
    },
    /// A backing file resolves outside every allowed directory.
    #[error("backing file {backing} of {path} is outside the allowed image directories ({dirs})")]
    OutsideImageDirs {
        /// The overlay.
        path: PathBuf,
        /// The backing file.
        backing: PathBuf,
        /// The allowed directories.
        dirs: String,
    },
    /// The chain comes back to a file it holds already.
    #[error("backing chain {chain} loops")]
    Loop {
        /// The chain, top first, ending with the file seen twice.
        chain: String,
    },
}

/// The format of `file` from its first bytes: qcow2's magic, or raw.
pub fn probe(file: &File, path: &Path) -> Result<ImageFormat, ChainError> {
    let mut magic = [0u8; 4];
    let mut filled = 0usize;
    while let Some(rest) = magic.get_mut(filled..).filter(|rest| !rest.is_empty()) {
        match file.read_at(rest, filled as u64) {
            Ok(0) => break,
            Ok(n) => filled = filled.saturating_add(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(ChainError::Probe {
                    path: path.to_owned(),
                    source,
                })
            }
        }
    }
    Ok(if filled == magic.len() && magic == QCOW2_MAGIC {
        ImageFormat::Qcow2
    } else {
        ImageFormat::Raw
    })
}

/// The header extension type of qcow2's feature name table.
const FEATURE_NAME_TABLE: u64 = 0x6803_f857;
/// Bytes of one feature name table entry.
const FEATURE_NAME_ENTRY: u64 = 48;

/// Reads a big-endian integer of `N` bytes at `offset` of `bytes`.
pub(crate) fn be<const N: usize>(bytes: &[u8], offset: usize) -> Option<u64> {
    let field: [u8; N] = bytes.get(offset..offset.checked_add(N)?)?.try_into().ok()?;
    Some(field.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
}

/// Checks what imago 0.2.6 would panic on when it opens the qcow2 image in `file`, walking the
/// header extensions as it does: a feature name table whose length leaves a last entry of one
/// byte (it indexes past it; the `qcow2_image` fuzz target found it). A panic aborts the
/// process (blkplaned's, the frontend's or the iothread's), so such an image is refused
/// before imago sees it. Everything else about the header is imago's to judge.
pub fn check_header(file: &File) -> Result<(), String> {
    let mut header = [0u8; 104];
    let read = file.read_at(&mut header, 0).map_err(|e| e.to_string())?;
    let header = header.get(..read).unwrap_or_default();
    let (Some(version), Some(cluster_bits)) = (be::<4>(header, 4), be::<4>(header, 20)) else {
        return Ok(());
    };
    if version < 3 || !(9..=21).contains(&cluster_bits) {
        return Ok(());
    }
    let cluster = 1u64 << cluster_bits;
    let mut offset = be::<4>(header, 100).unwrap_or(cluster);
    // Each extension takes at least its 8-byte header: the walk ends within the cluster.
    while offset.saturating_add(8) <= cluster {
        let mut ext = [0u8; 8];
        if file.read_exact_at(&mut ext, offset).is_err() {
            return Ok(());
        }
        let (Some(kind), Some(len)) = (be::<4>(&ext, 0), be::<4>(&ext, 4)) else {
            return Ok(());
        };
        if kind == 0 {
            return Ok(());
        }
        if kind == FEATURE_NAME_TABLE && len % FEATURE_NAME_ENTRY == 1 {
            return Err(format!(
                "its feature name table is {len} bytes long, not whole {FEATURE_NAME_ENTRY}-byte \
                 entries"
            ));
        }
        offset = offset
            .saturating_add(8)
            .saturating_add(len.div_ceil(8).saturating_mul(8));
    }
    Ok(())
}

/// What a qcow2 header says about the layer below: the backing file's name and, if the header
/// names it, its format.
type BackingRef = (String, Option<String>);

/// What a qcow2 header says: the virtual size, the backing file, the external data file's name.
struct HeaderRefs {
    size: u64,
    backing: Option<BackingRef>,
    data_file: Option<String>,
}

/// Opens a qcow2 layer with imago, read-only: its virtual size, its backing file's name and
/// format, and its external data file's name, if it has them.
fn read_header(file: &File, path: &Path) -> Result<HeaderRefs, ChainError> {
    let qcow2_error = |source| ChainError::Qcow2 {
        path: path.to_owned(),
        source,
    };
    check_header(file).map_err(|e| qcow2_error(io::Error::new(io::ErrorKind::InvalidData, e)))?;
    let dup = file.try_clone().map_err(qcow2_error)?;
    let storage = ImagoFile::from_open_file(dup, StorageOpenOptions::new().write(false))
        .map_err(qcow2_error)?;
    let qcow2 = Qcow2::<ImagoFile>::open_image(storage, false).map_err(qcow2_error)?;
    let data_file = if qcow2.requires_external_data_file() {
        Some(
            qcow2
                .implicit_external_data_file()
                .cloned()
                .ok_or_else(|| ChainError::DataFile {
                    path: path.to_owned(),
                    data_file: PathBuf::new(),
                    reason: "the header names none".into(),
                })?,
        )
    } else {
        None
    };
    let backing = qcow2
        .implicit_backing_file()
        .map(|name| (name.clone(), qcow2.implicit_backing_format().cloned()));
    let size = FormatAccess::new(qcow2).size();
    Ok(HeaderRefs {
        size,
        backing,
        data_file,
    })
}

/// Where QEMU looks for an overlay's backing file `name`.
pub fn resolve(overlay: &Path, name: &str) -> PathBuf {
    let name = Path::new(name);
    if name.is_absolute() {
        return name.to_owned();
    }
    match overlay.parent() {
        Some(dir) => dir.join(name),
        None => name.to_owned(),
    }
}

/// The directories, as an error message lists them.
pub fn describe_dirs(dirs: &[PathBuf]) -> String {
    dirs.iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn describe(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(" -> ")
}

/// Whether `path` resolves (symlinks and `..` followed) inside one of `dirs` (no restriction
/// without any): the rule for images, backing files, data files and overlays alike.
pub fn inside(path: &Path, dirs: &[PathBuf]) -> bool {
    if dirs.is_empty() {
        return true;
    }
    let Ok(real) = std::fs::canonicalize(path) else {
        return false;
    };
    dirs.iter()
        .any(|dir| std::fs::canonicalize(dir).is_ok_and(|dir| real.starts_with(dir)))
}

/// Opens the backing chain of the qcow2 image `file` at `path`; with `image_dirs`, every
/// backing file must be inside one of them. An external data file is opened read-only.
pub fn open(file: &File, path: &Path, image_dirs: &[PathBuf]) -> Result<Chain, ChainError> {
    open_for(file, path, image_dirs, false)
}

/// [`open`], with the image's external data file (if it has one, resolved as a backing file
/// is and held to the same directories) opened read-write when `writable`.
pub fn open_for(
    file: &File,
    path: &Path,
    image_dirs: &[PathBuf],
    writable: bool,
) -> Result<Chain, ChainError> {
    let identity = |file: &File, at: &Path| {
        file.metadata()
            .map(|m| (m.dev(), m.ino()))
            .map_err(|source| ChainError::Probe {
                path: at.to_owned(),
                source,
            })
    };
    let mut seen = vec![identity(file, path)?];
    let mut paths = vec![path.to_owned()];
    let top = read_header(file, path)?;
    if let Some(problem) = writable.then(|| integrity::unwritable(file)).flatten() {
        return Err(ChainError::Qcow2 {
            path: path.to_owned(),
            source: io::Error::new(io::ErrorKind::InvalidData, problem),
        });
    }
    let (size, mut next) = (top.size, top.backing);
    let data_file = match top.data_file {
        None => None,
        Some(name) => {
            let data_path = resolve(path, &name);
            let fail = |reason: String| ChainError::DataFile {
                path: path.to_owned(),
                data_file: data_path.clone(),
                reason,
            };
            if name.is_empty() || name.contains('\0') {
                return Err(fail("an unusable name".into()));
            }
            if !inside(&data_path, image_dirs) {
                return Err(fail(format!(
                    "outside the allowed image directories ({})",
                    describe_dirs(image_dirs)
                )));
            }
            let file = OpenOptions::new()
                .read(true)
                .write(writable)
                .custom_flags(libc::O_CLOEXEC)
                .open(&data_path)
                .map_err(|e| fail(e.to_string()))?;
            seen.push(identity(&file, &data_path)?);
            Some(BackingFile {
                file,
                format: ImageFormat::Raw,
                path: data_path,
            })
        }
    };
    let mut backing = Vec::new();
    while let Some((name, format_name)) = next.take() {
        let overlay = paths.last().cloned().unwrap_or_default();
        if name.is_empty() || name.contains('\0') {
            return Err(ChainError::BackingName {
                path: overlay,
                name,
            });
        }
        let backing_path = resolve(&overlay, &name);
        paths.push(backing_path.clone());
        if backing.len() >= MAX_BACKING_FILES as usize {
            return Err(ChainError::TooDeep {
                chain: describe(&paths),
            });
        }
        if !inside(&backing_path, image_dirs) {
            return Err(ChainError::OutsideImageDirs {
                path: overlay,
                backing: backing_path,
                dirs: describe_dirs(image_dirs),
            });
        }
        let backing_file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&backing_path)
            .map_err(|source| ChainError::OpenBacking {
                path: overlay.clone(),
                backing: backing_path.clone(),
                source,
            })?;
        let id = identity(&backing_file, &backing_path)?;
        if seen.contains(&id) {
            return Err(ChainError::Loop {
                chain: describe(&paths),
            });
        }
        seen.push(id);
        let format = match format_name.as_deref() {
            Some("qcow2") => ImageFormat::Qcow2,
            Some("raw") => ImageFormat::Raw,
            Some(other) => {
                return Err(ChainError::BackingFormat {
                    path: overlay,
                    backing: backing_path,
                    format: other.to_owned(),
                })
            }
            None => probe(&backing_file, &backing_path)?,
        };
        if format == ImageFormat::Qcow2 {
            let refs = read_header(&backing_file, &backing_path)?;
            if refs.data_file.is_some() {
                return Err(ChainError::ExternalDataFile(backing_path));
            }
            next = refs.backing;
        }
        backing.push(BackingFile {
            file: backing_file,
            format,
            path: backing_path,
        });
    }
    Ok(Chain {
        size,
        data_file,
        backing,
    })
}

/// Why an overlay could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// The file could not be created (it exists, the directory is missing...).
    #[error("creating {path}: {source}")]
    Create {
        /// The overlay.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// imago could not format it.
    #[error("formatting {path} as qcow2: {source}")]
    Format {
        /// The overlay.
        path: PathBuf,
        /// imago's reason.
        source: io::Error,
    },
}

/// Creates a new qcow2 image at `path` (which must not exist; 0600, the caller hands it to the
/// disk's owner) of virtual size `size`, whose backing file is `backing` (stored as given, so an
/// absolute path stays valid wherever the overlay moves) in `backing_format`: an external
/// snapshot's overlay. Nothing is left at `path` if formatting fails.
pub fn create_overlay(
    path: &Path,
    backing: &Path,
    backing_format: ImageFormat,
    size: u64,
) -> Result<(), CreateError> {
    use imago::FormatCreateBuilder;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|source| CreateError::Create {
            path: path.to_owned(),
            source,
        })?;
    let format_error = |source| CreateError::Format {
        path: path.to_owned(),
        source,
    };
    let formatted = ImagoFile::from_open_file(file, StorageOpenOptions::new().write(true))
        .and_then(|storage| {
            Qcow2::<ImagoFile>::create_builder(storage)
                .size(size)
                .backing(
                    backing.to_string_lossy().into_owned(),
                    backing_format.name().to_owned(),
                )
                .create()
        });
    if let Err(e) = formatted {
        let _ = std::fs::remove_file(path);
        return Err(format_error(e));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn relative_names_resolve_against_the_overlay_directory() {
        assert_eq!(
            resolve(Path::new("/images/vm/top.qcow2"), "base.qcow2"),
            PathBuf::from("/images/vm/base.qcow2")
        );
        assert_eq!(
            resolve(Path::new("/images/vm/top.qcow2"), "../golden/base.raw"),
            PathBuf::from("/images/vm/../golden/base.raw")
        );
        assert_eq!(
            resolve(Path::new("/images/vm/top.qcow2"), "/srv/base.qcow2"),
            PathBuf::from("/srv/base.qcow2")
        );
        assert_eq!(
            resolve(Path::new("top.qcow2"), "base.qcow2"),
            PathBuf::from("base.qcow2")
        );
    }

    #[test]
    fn probing_finds_the_magic_only_at_the_start() {
        let dir = std::env::temp_dir().join(format!("blkplane-chain-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("probe");
        for (bytes, format) in [
            (&b"QFI\xfb\0\0\0\x03"[..], ImageFormat::Qcow2),
            (&b"QFI"[..], ImageFormat::Raw),
            (&b""[..], ImageFormat::Raw),
            (&b"\0QFI\xfb"[..], ImageFormat::Raw),
        ] {
            std::fs::write(&path, bytes).unwrap();
            let file = File::open(&path).unwrap();
            assert_eq!(probe(&file, &path).unwrap(), format, "{bytes:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_feature_name_table_imago_would_index_past_is_refused() {
        let dir = std::env::temp_dir().join(format!("blkplane-fnt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("fnt");
        // A v3 header of 112 bytes (64 KiB clusters), then one extension.
        let with_table = |len: u32| {
            let mut bytes = vec![0u8; 4096];
            bytes[..4].copy_from_slice(b"QFI\xfb");
            bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
            bytes[20..24].copy_from_slice(&16u32.to_be_bytes());
            bytes[100..104].copy_from_slice(&112u32.to_be_bytes());
            bytes[112..116].copy_from_slice(&0x6803_f857u32.to_be_bytes());
            bytes[116..120].copy_from_slice(&len.to_be_bytes());
            std::fs::write(&path, &bytes).unwrap();
            File::open(&path).unwrap()
        };
        assert!(check_header(&with_table(48)).is_ok());
        assert!(check_header(&with_table(96 + 2)).is_ok());
        assert!(check_header(&with_table(49)).is_err());
        assert!(check_header(&with_table(1)).is_err());
        // And the chain open refuses it before imago parses it.
        let file = with_table(97);
        assert!(matches!(
            open(&file, &path, &[]),
            Err(ChainError::Qcow2 { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_overlay_names_its_backing_file_and_takes_its_size() {
        let dir = std::env::temp_dir().join(format!("blkplane-overlay-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let base = dir.join("base.raw");
        std::fs::write(&base, vec![7u8; 1 << 20]).unwrap();
        let overlay = dir.join("snap.qcow2");
        create_overlay(&overlay, &base, ImageFormat::Raw, 1 << 20).unwrap();
        let file = File::open(&overlay).unwrap();
        assert_eq!(probe(&file, &overlay).unwrap(), ImageFormat::Qcow2);
        let chain = open(&file, &overlay, &[]).unwrap();
        assert_eq!(chain.size, 1 << 20);
        assert_eq!(chain.backing.len(), 1);
        assert_eq!(chain.backing[0].path, base);
        assert_eq!(chain.backing[0].format, ImageFormat::Raw);
        // It exists now: a second one is refused, and the first is left alone.
        assert!(matches!(
            create_overlay(&overlay, &base, ImageFormat::Raw, 1 << 20),
            Err(CreateError::Create { .. })
        ));
        assert!(File::open(&overlay).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
