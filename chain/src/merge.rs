//! Merging a qcow2 overlay's own data into its backing file: the copy of a commit (blkplaned's
//! Commit), as `qemu-img commit -d` does it.
//!
//! Only what the overlay itself holds is copied: its data clusters (compressed ones through
//! imago) and its zero clusters (written as zeroes, which a qcow2 backing file keeps as zero
//! clusters); what it leaves to its backing file is not read. The overlay is opened read-only,
//! without its backing chain (so that what it does not hold reads as "not here" rather than
//! through the chain); the backing file read-write, over its own chain, through imago, so a
//! write into part of one of its clusters copies the rest from below it.
//!
//! Nobody may write the overlay meanwhile: a live commit first puts a new overlay over it. The
//! backing file may still be read, through the overlay ([`Readers::ThroughTop`]): every range
//! written here is one the overlay holds, so nobody reading through it reads that range from
//! the backing file, and the backing file's metadata that a reader holds in its caches stays
//! true for the ranges it reads — as long as no cluster the reader still reads part of moves:
//! imago moves a compressed cluster (or one an internal snapshot shares) when part of it is
//! written, and hands the old place out again. Such a part is left for a merge nobody reads
//! during ([`Merged::deferred`]).
//! A backing file smaller than the overlay is grown to its size first (as QEMU's commit does);
//! a larger one is refused, since serving it would change the disk's size.

use std::fs::{File, OpenOptions};
use std::io;
use std::ops::Range;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use imago::file::File as ImagoFile;
use imago::format::PreallocateMode;
use imago::qcow2::Qcow2;
use imago::raw::Raw;
use imago::{FormatAccess, ShallowMapping, StorageOpenOptions};

use crate::{be, open, probe, BackingFile, ChainError, ImageFormat};

/// The most bytes read or written at once.
const CHUNK: u64 = 1 << 20;

/// What a merge copied into the backing file.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Merged {
    /// Bytes of data written.
    pub data_bytes: u64,
    /// Bytes written as zeroes (the overlay's zero clusters).
    pub zero_bytes: u64,
    /// Ranges the overlay holds that were not copied, with [`Readers::ThroughTop`]: each is
    /// part of a cluster of the target that a reader still reads the rest of, and that a write
    /// would move. A merge of only these ranges ([`merge_into_backing`]'s `only`) with
    /// [`Readers::None`] completes the copy.
    pub deferred: Vec<Range<u64>>,
}

/// Whether anybody reads the target while a merge writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readers {
    /// Nobody: its disk is drained, or serves something else.
    None,
    /// A running disk reads it through the overlay, with its own caches of its metadata.
    ThroughTop,
}

/// Why a merge failed. The overlay is never written; the backing file may hold part of the
/// overlay's data, in ranges the overlay holds too.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    /// The overlay or its chain cannot be opened.
    #[error(transparent)]
    Chain(#[from] ChainError),
    /// The image has no backing file to merge into.
    #[error("{0} has no backing file to commit into")]
    NoBacking(PathBuf),
    /// A file of the chain cannot be opened with imago, or reopened for writing.
    #[error("opening {path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// The backing file reopened for writing is not the one the chain opened.
    #[error("{0} was replaced while it was opened")]
    Replaced(PathBuf),
    /// The backing file is corrupt in a way imago's allocator breaks on.
    #[error("{path}: {problem}")]
    Unwritable {
        /// The backing file.
        path: PathBuf,
        /// What is wrong.
        problem: &'static str,
    },
    /// The backing file is larger than the overlay.
    #[error(
        "the backing file {path} ({backing_size} bytes) is larger than the overlay \
         ({size} bytes): serving it would grow the disk"
    )]
    LargerBacking {
        /// The backing file.
        path: PathBuf,
        /// Its virtual size.
        backing_size: u64,
        /// The overlay's virtual size.
        size: u64,
    },
    /// The backing file must grow, its last cluster is only partly inside it, and growing it
    /// would move that cluster (compressed, or shared with an internal snapshot) while a
    /// running disk reads its head ([`Readers::ThroughTop`]).
    #[error(
        "{0}: its last cluster, only partly inside its virtual size, is compressed (or shared \
         with an internal snapshot) and would move when the file grows to the overlay's size \
         while the disk reads it; `qemu-img convert` it (uncompressed) first"
    )]
    MovingTail(PathBuf),
    /// Reading, writing, growing or flushing failed.
    #[error("{what} {path} at {offset}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The guest offset.
        offset: u64,
        /// What failed.
        source: io::Error,
    },
}

/// Copies what the qcow2 image at `top` holds itself into a file of its backing chain (opened
/// as [`open`] opens it, within `image_dirs`): its backing file with `depth` 0, that file's
/// backing file with 1, and so on. Then flushes and syncs that file. `top` is not written.
///
/// With `depth` above 0 the layers in between are not read: the caller knows that the target
/// holds what they hold (a live commit merged them into it already). With `only`, only what
/// the overlay holds within those ranges is copied (the target is still grown).
pub fn merge_into_backing(
    top: &Path,
    depth: usize,
    image_dirs: &[PathBuf],
    readers: Readers,
    only: Option<&[Range<u64>]>,
) -> Result<Merged, MergeError> {
    let file = File::open(top).map_err(|source| ChainError::Probe {
        path: top.to_owned(),
        source,
    })?;
    if probe(&file, top)? != ImageFormat::Qcow2 {
        return Err(MergeError::NoBacking(top.to_owned()));
    }
    let chain = open(&file, top, image_dirs)?;
    let mut backing = chain.backing.into_iter().skip(depth);
    let base = backing
        .next()
        .ok_or_else(|| MergeError::NoBacking(top.to_owned()))?;
    let below = open_read_only(backing.collect())?;
    let top_access = open_top(file, top, chain.data_file)?;
    let base_path = base.path.clone();
    let backing_below = below.is_some();
    let (base_access, base_cluster) = open_base(base, below)?;
    let target = Target {
        access: &base_access,
        path: &base_path,
        backing_below,
        // Only a qcow2 target has clusters that can move.
        moving_clusters: base_cluster.filter(|_| readers == Readers::ThroughTop),
    };
    copy(&top_access, top, &target, only)
}

/// The file a merge writes.
struct Target<'a> {
    access: &'a FormatAccess<ImagoFile>,
    path: &'a Path,
    /// Its cluster size, if a cluster that a write moves must be kept for a later merge.
    moving_clusters: Option<u64>,
    /// Whether it has a backing file (which would show through where it grows).
    backing_below: bool,
}

/// The overlay alone, read-only, with its external data file if it has one.
fn open_top(
    file: File,
    path: &Path,
    data_file: Option<BackingFile>,
) -> Result<FormatAccess<ImagoFile>, MergeError> {
    let open_error = |source| MergeError::Open {
        path: path.to_owned(),
        source,
    };
    let storage = ImagoFile::from_open_file(file, StorageOpenOptions::new()).map_err(open_error)?;
    let mut qcow2 = Qcow2::<ImagoFile>::open_image(storage, false).map_err(open_error)?;
    if let Some(data) = data_file {
        let data =
            ImagoFile::from_open_file(data.file, StorageOpenOptions::new()).map_err(|source| {
                MergeError::Open {
                    path: data.path,
                    source,
                }
            })?;
        qcow2.set_data_file(Some(data));
    }
    qcow2.set_backing(None);
    Ok(FormatAccess::new(qcow2))
}

/// One layer of a chain through imago: `file` in `format`, over `below`.
fn open_layer(
    file: File,
    path: &Path,
    format: ImageFormat,
    writable: bool,
    below: Option<FormatAccess<ImagoFile>>,
) -> Result<FormatAccess<ImagoFile>, MergeError> {
    let open_error = |source| MergeError::Open {
        path: path.to_owned(),
        source,
    };
    let storage = ImagoFile::from_open_file(file, StorageOpenOptions::new().write(writable))
        .map_err(open_error)?;
    match format {
        ImageFormat::Raw => Ok(FormatAccess::new(
            Raw::open_image(storage, writable).map_err(open_error)?,
        )),
        ImageFormat::Qcow2 => {
            let mut qcow2 =
                Qcow2::<ImagoFile>::open_image(storage, writable).map_err(open_error)?;
            // The chain was opened from these headers: a qcow2 layer has a layer below it
            // exactly when it names a backing file.
            qcow2.set_backing(below);
            Ok(FormatAccess::new(qcow2))
        }
    }
}

/// The backing files below the merge's target, read-only, built from the bottom up; the
/// target's backing, if any.
fn open_read_only(files: Vec<BackingFile>) -> Result<Option<FormatAccess<ImagoFile>>, MergeError> {
    let mut below = None;
    for layer in files.into_iter().rev() {
        below = Some(open_layer(
            layer.file,
            &layer.path,
            layer.format,
            false,
            below,
        )?);
    }
    Ok(below)
}

/// The backing file, reopened read-write (the same file the chain opened), over `below`, with
/// its cluster size if it is qcow2.
fn open_base(
    base: BackingFile,
    below: Option<FormatAccess<ImagoFile>>,
) -> Result<(FormatAccess<ImagoFile>, Option<u64>), MergeError> {
    let open_error = |source| MergeError::Open {
        path: base.path.clone(),
        source,
    };
    let writable = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&base.path)
        .map_err(open_error)?;
    let identity = |f: &File| f.metadata().map(|m| (m.dev(), m.ino()));
    if identity(&writable).map_err(open_error)? != identity(&base.file).map_err(open_error)? {
        return Err(MergeError::Replaced(base.path));
    }
    let mut cluster = None;
    if base.format == ImageFormat::Qcow2 {
        if let Some(problem) = crate::integrity::unwritable(&writable) {
            return Err(MergeError::Unwritable {
                path: base.path,
                problem,
            });
        }
        let mut header = [0u8; 24];
        writable.read_exact_at(&mut header, 0).map_err(open_error)?;
        // imago checked the bits (9 to 21) when the chain was opened, and checks them again.
        cluster = be::<4>(&header, 20)
            .filter(|bits| (9..=21).contains(bits))
            .map(|bits| 1u64 << bits);
    }
    let access = open_layer(writable, &base.path, base.format, true, below)?;
    Ok((access, cluster))
}

/// Which file an I/O error of [`copy_data`] came from.
enum Side {
    Read,
    Write,
}

/// Copies `range` from `top` to `target`, at most [`CHUNK`] bytes at a time through `buf`.
fn copy_data(
    top: &FormatAccess<ImagoFile>,
    target: &FormatAccess<ImagoFile>,
    range: Range<u64>,
    buf: &mut Vec<u8>,
) -> Result<(), (Side, u64, io::Error)> {
    let mut at = range.start;
    while at < range.end {
        let len = CHUNK.min(range.end.saturating_sub(at));
        // At most CHUNK, so the length fits usize.
        buf.resize(usize::try_from(len).unwrap_or(0), 0);
        top.read(&mut *buf, at).map_err(|e| (Side::Read, at, e))?;
        target.write(&*buf, at).map_err(|e| (Side::Write, at, e))?;
        at = at.saturating_add(len);
    }
    Ok(())
}

/// Writes zeroes over `range` of `target`: as zero clusters where its format has them, else
/// (a qcow2 v2 image has none) as data, at most [`CHUNK`] bytes at a time through `buf`.
fn zero(target: &FormatAccess<ImagoFile>, range: Range<u64>, buf: &mut Vec<u8>) -> io::Result<()> {
    let len = range.end.saturating_sub(range.start);
    match target.write_zeroes(range.start, len) {
        Err(e) if e.kind() == io::ErrorKind::Unsupported => {}
        done => return done,
    }
    let mut at = range.start;
    while at < range.end {
        let len = CHUNK.min(range.end.saturating_sub(at));
        buf.clear();
        buf.resize(usize::try_from(len).unwrap_or(0), 0);
        target.write(&*buf, at)?;
        at = at.saturating_add(len);
    }
    Ok(())
}

/// `range` cut at the clusters (of `cluster` bytes) it covers only in part: its first and its
/// last part when partial, the whole clusters between; each with whether it is partial.
fn cut(range: Range<u64>, cluster: u64) -> Vec<(Range<u64>, bool)> {
    let rem = |x: u64| x.checked_rem(cluster).unwrap_or(0);
    let up = |x: u64| match rem(x) {
        0 => x,
        r => x.saturating_add(cluster.saturating_sub(r)),
    };
    let head_end = up(range.start).min(range.end);
    let tail_start = range.end.saturating_sub(rem(range.end)).max(head_end);
    [
        (range.start..head_end, true),
        (head_end..tail_start, false),
        (tail_start..range.end, true),
    ]
    .into_iter()
    .filter(|(part, _)| !part.is_empty())
    .collect()
}

/// Whether writing part of the target's cluster at `offset` would move it (imago copies a
/// compressed cluster, or one shared with an internal snapshot, to a new place and frees the
/// old one).
fn would_move(target: &FormatAccess<ImagoFile>, offset: u64) -> io::Result<bool> {
    let (mapping, _) = target.get_shallow_mapping(offset, 1)?;
    Ok(matches!(
        mapping,
        ShallowMapping::Special { .. }
            | ShallowMapping::Raw {
                writable: false,
                ..
            }
    ))
}

/// Copies `top`'s own ranges (within `only`, if given) into the target, grown to `top`'s size
/// first; flushes and syncs the target.
fn copy(
    top: &FormatAccess<ImagoFile>,
    top_path: &Path,
    target: &Target<'_>,
    only: Option<&[Range<u64>]>,
) -> Result<Merged, MergeError> {
    let size = top.size();
    let base = target.access;
    let io_error = |what, path: &Path, offset| {
        let path = path.to_owned();
        move |source| MergeError::Io {
            what,
            path,
            offset,
            source,
        }
    };
    if base.size() > size {
        return Err(MergeError::LargerBacking {
            path: target.path.to_owned(),
            backing_size: base.size(),
            size,
        });
    }
    let old_size = base.size();
    if let Some(cluster) = target.moving_clusters {
        let tail = old_size.checked_rem(cluster).unwrap_or(0);
        let last = old_size.saturating_sub(tail);
        if old_size < size
            && tail != 0
            && would_move(base, last).map_err(io_error("mapping", target.path, last))?
        {
            return Err(MergeError::MovingTail(target.path.to_owned()));
        }
    }
    base.resize_grow(size, PreallocateMode::None)
        .map_err(io_error("growing", target.path, size))?;
    let mut merged = Merged::default();
    let mut buf = Vec::new();
    if target.backing_below && old_size < size {
        // What the overlay showed past the target's end is zeroes (a backing file reads as
        // zeroes past its end), not what the target's own backing file holds there. Nobody
        // reads the target past its old end.
        zero(base, old_size..size, &mut buf).map_err(io_error(
            "zeroing what it grew by",
            target.path,
            old_size,
        ))?;
    }
    let whole = 0..size;
    for window in only.unwrap_or(std::slice::from_ref(&whole)) {
        let end = window.end.min(size);
        let mut offset = window.start;
        while offset < end {
            let (mapping, len) = top
                .get_shallow_mapping(offset, end.saturating_sub(offset))
                .map_err(io_error("mapping", top_path, offset))?;
            if len == 0 {
                break;
            }
            let zeroes = match mapping {
                ShallowMapping::Raw { .. } | ShallowMapping::Special { .. } => false,
                ShallowMapping::Zero { explicit: true, .. } => true,
                // Not held by the overlay (without a backing chain, that reads as "zero, not
                // explicit").
                ShallowMapping::Zero {
                    explicit: false, ..
                }
                | ShallowMapping::Indirect { .. } => {
                    offset = offset.saturating_add(len);
                    continue;
                }
                ShallowMapping::Eof { .. } => break,
                // A mapping imago added later: refused rather than skipped.
                _ => {
                    return Err(MergeError::Io {
                        what: "mapping",
                        path: top_path.to_owned(),
                        offset,
                        source: io::Error::other("a mapping of a kind blkplane does not know"),
                    })
                }
            };
            let held = offset..offset.saturating_add(len);
            let parts = match target.moving_clusters {
                Some(cluster) => cut(held, cluster),
                None => vec![(held, false)],
            };
            for (part, partial) in parts {
                let at = part.start;
                let part_len = part.end.saturating_sub(part.start);
                if partial && would_move(base, at).map_err(io_error("mapping", target.path, at))? {
                    merged.deferred.push(part);
                } else if zeroes {
                    zero(base, part, &mut buf).map_err(io_error("zeroing", target.path, at))?;
                    merged.zero_bytes = merged.zero_bytes.saturating_add(part_len);
                } else {
                    copy_data(top, base, part, &mut buf).map_err(|(copying, at, source)| {
                        let (what, path) = match copying {
                            Side::Read => ("reading", top_path),
                            Side::Write => ("writing", target.path),
                        };
                        io_error(what, path, at)(source)
                    })?;
                    merged.data_bytes = merged.data_bytes.saturating_add(part_len);
                }
            }
            offset = offset.saturating_add(len);
        }
    }
    base.flush()
        .map_err(io_error("flushing", target.path, size))?;
    base.sync()
        .map_err(io_error("syncing", target.path, size))?;
    Ok(merged)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use std::process::Command;

    fn qemu_img(args: &[&str]) -> std::process::Output {
        let out = Command::new("qemu-img").args(args).output().unwrap();
        assert!(out.status.success(), "qemu-img {args:?}: {out:?}");
        out
    }

    fn qemu_io(image: &str, format: &str, commands: &[&str]) {
        let mut cmd = Command::new("qemu-io");
        cmd.args(["-f", format]);
        for c in commands {
            cmd.args(["-c", c]);
        }
        let out = cmd.arg(image).output().unwrap();
        assert!(out.status.success(), "qemu-io {commands:?}: {out:?}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(!stdout.contains("failed"), "qemu-io {commands:?}: {stdout}");
    }

    /// `qemu-img check` finds the qcow2 image `image` clean, and `qemu-img compare` finds it
    /// showing the raw file `view`.
    fn assert_shows(image: &Path, view: &Path) {
        let image = image.to_str().unwrap();
        qemu_img(&["check", "-q", image]);
        qemu_img(&[
            "compare",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "raw",
            image,
            view.to_str().unwrap(),
        ]);
    }

    /// A qcow2 overlay `name` in `dir` over `backing` (a name in `dir`) of `format`, with `-o
    /// options` (none if empty), of `size`.
    fn overlay(dir: &Path, name: &str, backing: &str, format: &str, options: &str, size: &str) {
        let path = dir.join(name);
        let mut args = vec!["create", "-q", "-f", "qcow2", "-b", backing, "-F", format];
        if !options.is_empty() {
            args.extend(["-o", options]);
        }
        args.extend([path.to_str().unwrap(), size]);
        qemu_img(&args);
    }

    /// A raw `base.raw` in `dir` of `size`, every byte `pattern`.
    fn raw_base(dir: &Path, size: &str, pattern: &str) {
        let path = dir.join("base.raw");
        let path = path.to_str().unwrap();
        qemu_img(&["create", "-q", "-f", "raw", path, size]);
        qemu_io(path, "raw", &[&format!("write -P {pattern} 0 {size}")]);
    }

    fn dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("blkplane-merge-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A three-layer chain (raw, qcow2 of 64 KiB clusters, qcow2 of 4 KiB clusters, larger):
    /// after the top is merged into the middle, the middle alone (over the raw base) shows what
    /// the top showed — data, a zero range over base data, a compressed cluster, the base where
    /// the top held nothing — and `qemu-img check` finds it clean; the top is unchanged.
    #[test]
    fn the_backing_file_shows_what_the_overlay_showed() {
        let d = dir("chain");
        let p = |n: &str| d.join(n).to_str().unwrap().to_owned();
        raw_base(&d, "4M", "0x11");
        overlay(
            &d,
            "mid.qcow2",
            "base.raw",
            "raw",
            "cluster_size=65536",
            "4M",
        );
        qemu_io(&p("mid.qcow2"), "qcow2", &["write -P 0x22 1M 256k"]);
        // A compressed cluster in the top: made by a compressed write.
        overlay(
            &d,
            "top.qcow2",
            "mid.qcow2",
            "qcow2",
            "cluster_size=4096",
            "6M",
        );
        qemu_io(
            &p("top.qcow2"),
            "qcow2",
            &[
                "write -P 0x33 8k 12k",
                "write -P 0x44 1040k 4k",
                "write -z 2M 64k",
                "write -c -P 0x55 3M 4k",
                "write -P 0x66 5M 8k",
            ],
        );
        let top_before = std::fs::read(p("top.qcow2")).unwrap();
        let view = d.join("view.raw");
        qemu_img(&[
            "convert",
            "-O",
            "raw",
            &p("top.qcow2"),
            view.to_str().unwrap(),
        ]);

        let merged = merge_into_backing(&d.join("top.qcow2"), 0, &[], Readers::None, None).unwrap();
        assert_eq!(merged.zero_bytes, 64 << 10);
        assert_eq!(merged.data_bytes, (12 + 4 + 4 + 8) << 10);
        assert_eq!(std::fs::read(p("top.qcow2")).unwrap(), top_before);
        assert_shows(&d.join("mid.qcow2"), &view);
        let info = qemu_img(&["info", "--output=json", &p("mid.qcow2")]);
        let info = String::from_utf8_lossy(&info.stdout);
        assert!(info.contains("\"virtual-size\": 6291456"), "{info}");

        // A later overlay merged past the top (depth 1), whose data the middle now holds:
        // the middle then shows what the later overlay shows.
        overlay(&d, "top2.qcow2", "top.qcow2", "qcow2", "", "6M");
        qemu_io(
            &p("top2.qcow2"),
            "qcow2",
            &[
                "write -P 0x77 8k 4k",
                "write -z 1M 4k",
                "write -P 0x88 4M 64k",
            ],
        );
        qemu_img(&[
            "convert",
            "-O",
            "raw",
            &p("top2.qcow2"),
            view.to_str().unwrap(),
        ]);
        let merged =
            merge_into_backing(&d.join("top2.qcow2"), 1, &[], Readers::None, None).unwrap();
        // Three 64 KiB clusters: each part-cluster write allocated its whole cluster.
        assert_eq!(merged.data_bytes, 3 << 16);
        assert_shows(&d.join("mid.qcow2"), &view);
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A raw backing file takes the data and the zeroes; a backing file larger than the overlay
    /// is refused before anything is written; an image without a backing file has nothing to
    /// merge into.
    #[test]
    fn raw_backing_files_and_refusals() {
        let d = dir("raw");
        let p = |n: &str| d.join(n).to_str().unwrap().to_owned();
        raw_base(&d, "1M", "0x11");
        overlay(&d, "top.qcow2", "base.raw", "raw", "", "1M");
        qemu_io(
            &p("top.qcow2"),
            "qcow2",
            &["write -P 0x22 4k 4k", "write -z 64k 64k"],
        );
        merge_into_backing(&d.join("top.qcow2"), 0, &[], Readers::None, None).unwrap();
        qemu_io(
            &p("base.raw"),
            "raw",
            &[
                "read -P 0x11 0 4k",
                "read -P 0x22 4k 4k",
                "read -P 0x11 8k 56k",
                "read -P 0 64k 64k",
                "read -P 0x11 128k 896k",
            ],
        );

        qemu_img(&["create", "-q", "-f", "raw", &p("big.raw"), "2M"]);
        overlay(&d, "small.qcow2", "big.raw", "raw", "", "1M");
        qemu_io(&p("small.qcow2"), "qcow2", &["write -P 0x22 0 4k"]);
        let err =
            merge_into_backing(&d.join("small.qcow2"), 0, &[], Readers::None, None).unwrap_err();
        assert!(matches!(err, MergeError::LargerBacking { .. }), "{err}");
        assert!(std::fs::read(p("big.raw")).unwrap().iter().all(|&b| b == 0));

        qemu_img(&["create", "-q", "-f", "qcow2", &p("alone.qcow2"), "1M"]);
        let err =
            merge_into_backing(&d.join("alone.qcow2"), 0, &[], Readers::None, None).unwrap_err();
        assert!(matches!(err, MergeError::NoBacking(_)), "{err}");
        let err = merge_into_backing(&d.join("base.raw"), 0, &[], Readers::None, None).unwrap_err();
        assert!(matches!(err, MergeError::NoBacking(_)), "{err}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn ranges_are_cut_at_partly_covered_clusters() {
        assert_eq!(cut(0..8192, 4096), vec![(0..8192, false)]);
        assert_eq!(
            cut(1000..10000, 4096),
            vec![(1000..4096, true), (4096..8192, false), (8192..10000, true)]
        );
        assert_eq!(cut(5000..6000, 4096), vec![(5000..6000, true)]);
        assert_eq!(cut(4096..6000, 4096), vec![(4096..6000, true)]);
        assert_eq!(cut(5000..8192, 4096), vec![(5000..8192, true)]);
    }

    /// A compressed backing file (64 KiB clusters, each half random so that it stays about half
    /// a cluster compressed) under an overlay of 4 KiB clusters that writes part of its first 32
    /// clusters and the whole of its last 16, merged while a reader with warm caches reads
    /// through the overlay: the reader still reads the guest view everywhere — no compressed
    /// cluster it reads the rest of was moved and its place handed to the whole clusters
    /// allocated after it. Those parts are deferred, and a second merge of only them, with no
    /// reader, completes the backing file.
    #[test]
    fn a_live_merge_leaves_moving_clusters_to_a_later_one() {
        let d = dir("live");
        let p = |n: &str| d.join(n).to_str().unwrap().to_owned();
        let mut data = vec![0x3cu8; 4 << 20];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for cluster in data.chunks_mut(65536) {
            for byte in &mut cluster[..32768] {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *byte = x.to_le_bytes()[0];
            }
        }
        std::fs::write(d.join("data.raw"), &data).unwrap();
        qemu_img(&[
            "convert",
            "-q",
            "-c",
            "-f",
            "raw",
            "-O",
            "qcow2",
            "-o",
            "cluster_size=65536",
            &p("data.raw"),
            &p("golden.qcow2"),
        ]);
        overlay(
            &d,
            "top.qcow2",
            "golden.qcow2",
            "qcow2",
            "cluster_size=4096",
            "4M",
        );
        let mut writes: Vec<String> = (0..32u64)
            .map(|i| format!("write -P 0xe1 {}k 4k", i * 64 + 40))
            .collect();
        writes.push("write -P 0xd2 3M 1M".into());
        let writes: Vec<&str> = writes.iter().map(String::as_str).collect();
        qemu_io(&p("top.qcow2"), "qcow2", &writes);
        let view = d.join("view.raw");
        qemu_img(&[
            "convert",
            "-O",
            "raw",
            &p("top.qcow2"),
            view.to_str().unwrap(),
        ]);
        let want = std::fs::read(&view).unwrap();

        let top_file = File::open(d.join("top.qcow2")).unwrap();
        let chain = open(&top_file, &d.join("top.qcow2"), &[]).unwrap();
        let mut files = vec![BackingFile {
            file: top_file,
            format: ImageFormat::Qcow2,
            path: d.join("top.qcow2"),
        }];
        files.extend(chain.backing);
        let reader = open_read_only(files).unwrap().unwrap();
        let mut got = vec![0u8; want.len()];
        reader.read(&mut got, 0).unwrap();
        assert!(got == want, "the reader before the merge");

        let merged =
            merge_into_backing(&d.join("top.qcow2"), 0, &[], Readers::ThroughTop, None).unwrap();
        assert_eq!(merged.deferred.len(), 32, "{:?}", merged.deferred);
        assert_eq!(merged.data_bytes, 1 << 20);
        let mut got = vec![0u8; want.len()];
        reader.read(&mut got, 0).unwrap();
        assert!(
            got == want,
            "the reader with its caches from before the merge"
        );

        let rest = merge_into_backing(
            &d.join("top.qcow2"),
            0,
            &[],
            Readers::None,
            Some(&merged.deferred),
        )
        .unwrap();
        assert!(rest.deferred.is_empty());
        assert_eq!(rest.data_bytes, 32 * 4096);
        assert_shows(&d.join("golden.qcow2"), &view);
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A backing file smaller than the overlay, over a larger base of non-zero data, grows to
    /// the overlay's size with zeroes where the overlay showed zeroes (past the backing file's
    /// end), not the base's data; as a qcow2 v2 image (no zero clusters) the overlay's zero
    /// clusters and the grown range are written as zero data.
    #[test]
    fn a_grown_backing_file_shows_zeroes_past_its_old_end() {
        for compat in ["1.1", "0.10"] {
            let d = dir(&format!("grow-{compat}"));
            let p = |n: &str| d.join(n).to_str().unwrap().to_owned();
            raw_base(&d, "16M", "0x77");
            overlay(
                &d,
                "mid.qcow2",
                "base.raw",
                "raw",
                &format!("compat={compat}"),
                "8M",
            );
            overlay(&d, "top.qcow2", "mid.qcow2", "qcow2", "", "16M");
            qemu_io(
                &p("top.qcow2"),
                "qcow2",
                &[
                    "write -P 0x22 1M 64k",
                    "write -z 2M 128k",
                    "write -P 0x33 12M 64k",
                ],
            );
            let view = d.join("view.raw");
            qemu_img(&[
                "convert",
                "-O",
                "raw",
                &p("top.qcow2"),
                view.to_str().unwrap(),
            ]);
            merge_into_backing(&d.join("top.qcow2"), 0, &[], Readers::None, None).unwrap();
            assert_shows(&d.join("mid.qcow2"), &view);
            let _ = std::fs::remove_dir_all(&d);
        }
    }
}
