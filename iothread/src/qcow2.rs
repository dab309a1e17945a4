//! A qcow2 image and its backing chain, as the iothread serves it: the `imago` crate owns the
//! metadata (header, L1/L2 tables, refcounts, its L2 cache) and answers where each guest range
//! lives; the data itself moves between guest memory and the files with the engine's own
//! io_uring operations and iovecs, never through imago's buffers (compressed clusters, which
//! only imago can decode, excepted).
//!
//! imago is used in its `sync` mode (no async runtime, plain `pread`/`pwrite` for metadata):
//! a lookup that hits its L2 cache makes no system call; a miss, an allocation or a zeroing
//! costs the loop exactly the metadata I/O it needs (an allocation also copies what its write
//! leaves of the old data into the new cluster, through imago: the engine reads that data into
//! the page cache through io_uring first, [`Qcow2Image::copy_on_write_source`]). Every call
//! into imago runs to its end before the loop goes on, so no imago lock is ever held across
//! the loop and no other request can find one taken (its locks are not reentrant: a prepared
//! allocation kept open across the loop would deadlock the next allocation in its L2 table).
//!
//! Crash consistency: an allocating write writes its data into the prepared cluster first and
//! only then commits the mapping, and every metadata change is written back to the file (the
//! page cache; fdatasync at the guest's flush) before a request that relies on it is
//! acknowledged (the engine writes back once per pass of its loop, before it publishes
//! anything: `engine/chain.rs`). So an iothread
//! killed at any point leaves either the old mapping (the write was not acknowledged, and the
//! frontend resubmits it) or the new one with its data; at worst a cluster is leaked, which
//! `qemu-img check` reports as a leak, not as corruption.

use std::cell::Cell;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};

use std::sync::Arc;

use imago::qcow2::Qcow2;
use imago::raw::Raw;
use imago::{FormatAccess, Mapping, ShallowMapping};
use log::{error, info};

use crate::metadata_file::{file_end, zero_range, Barrier, MetadataFile};

/// The storage type of every layer.
type ImagoFile = MetadataFile;

/// How many zero bytes one write of a qcow2 v2 image's write-zeroes carries.
const ZERO_CHUNK: usize = 1 << 20;

/// The format of one layer of the chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerFormat {
    /// Raw data.
    Raw,
    /// qcow2 (v2 or v3).
    Qcow2,
}

/// Why a chain could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum Qcow2Error {
    /// imago refused a layer (a bad header, an absurd table size, ...).
    #[error("opening layer {layer} ({format:?}): {source}")]
    Open {
        /// 0 for the image, *i* for its *i*-th backing file.
        layer: usize,
        /// The layer's format.
        format: LayerFormat,
        /// imago's reason.
        source: io::Error,
    },
    /// The top layer must be qcow2 (a raw image is served without imago).
    #[error("the image of a qcow2 chain is raw")]
    RawTop,
    /// A layer names a backing file but none was handed over, or one was handed over for a
    /// layer without one.
    #[error("layer {layer} {problem}")]
    ChainMismatch {
        /// The layer.
        layer: usize,
        /// What does not match.
        problem: &'static str,
    },
    /// A backing file with an external data file is not served (yet; the image's own is).
    #[error("layer {0} keeps its data in an external data file, which is not supported")]
    ExternalDataFile(usize),
}

impl Qcow2Error {
    /// The errno to answer a `Setup` with.
    pub fn errno(&self) -> i32 {
        match self {
            Self::Open { source, .. } => source.raw_os_error().unwrap_or(libc::EINVAL),
            Self::ExternalDataFile(_) => libc::EOPNOTSUPP,
            Self::RawTop | Self::ChainMismatch { .. } => libc::EINVAL,
        }
    }
}

/// Where a guest range's data is, as far as it is contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extent {
    /// In a file: `layer` (0 the image, *i* its *i*-th backing file), at `host_offset`.
    /// `writable`: a write may go there directly (an allocated cluster of the image itself).
    Data {
        /// The layer whose file holds the data.
        layer: usize,
        /// Offset in that file.
        host_offset: u64,
        /// Contiguous bytes.
        len: u64,
        /// Writes may go straight there.
        writable: bool,
    },
    /// Reads as zeros (unallocated all the way down the chain, or a zero cluster); `len` bytes.
    Zero {
        /// Contiguous bytes.
        len: u64,
    },
    /// Encoded (compressed): only imago can read it; `len` bytes.
    Compressed {
        /// Contiguous bytes.
        len: u64,
    },
}

impl Extent {
    /// The bytes this extent covers.
    pub fn len(&self) -> u64 {
        match *self {
            Self::Data { len, .. } | Self::Zero { len } | Self::Compressed { len } => len,
        }
    }

    /// Whether it covers nothing (only at the end of the image).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An allocating write prepared by [`Qcow2Image::prepare_allocation`]: where its data goes.
/// Dropping it without [`Qcow2Image::commit_allocation`] releases the clusters it allocated
/// (the old mapping stays).
pub struct Allocation {
    /// The layer whose file gets the data (the image's own, or its external data file).
    pub layer: usize,
    /// Offset in that file of the write's first byte.
    pub host_offset: u64,
    /// Bytes mapped there, contiguous (at most what was asked).
    pub len: u64,
    /// imago's state of the prepared mapping (it holds the L2 table's write lock); `None`
    /// when the range was mapped already.
    state: Option<Box<dyn std::any::Any>>,
}

impl std::fmt::Debug for Allocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocation")
            .field("layer", &self.layer)
            .field("host_offset", &self.host_offset)
            .field("len", &self.len)
            .field("prepared", &self.state.is_some())
            .finish()
    }
}

/// A cluster allocated by [`Qcow2Image::allocate_cluster_ahead`], whose data the caller
/// writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClusterAllocation {
    /// Where in the image file the cluster's data goes.
    pub host_offset: u64,
    /// Where its L2 entry is in the image file.
    entry: u64,
    /// The guest offset of the cluster.
    cluster_offset: u64,
}

impl ClusterAllocation {
    /// The guest offset of the cluster.
    pub fn cluster_offset(&self) -> u64 {
        self.cluster_offset
    }
}

/// One file of the chain: what the engine's own operations on it use.
#[derive(Debug)]
struct Layer {
    /// imago's storage object of this file, to recognize it in a mapping (compared by address,
    /// never dereferenced through this pointer). The storage lives in a boxed format driver
    /// that is never moved or dropped before the chain.
    storage: *const ImagoFile,
    /// The buffered fd (owned by imago's storage object).
    fd: RawFd,
    /// A file of the image itself (its own file or its external data file), which writes
    /// may go to; backing files are only read.
    top: bool,
    /// Where the layer's data clusters may lie.
    bound: ClusterBound,
    /// Below this host offset every cluster is known to start inside the file (the end of its
    /// last cluster when last looked; 0 before that, or for an external data file, which the
    /// disk's size bounds; `u64::MAX` where nothing is checked, or the file is not a regular
    /// one, whose size never changes under a mapping).
    cluster_limit: Cell<u64>,
}

/// Where a layer's data clusters may lie: what a mapping into the layer is checked against, so
/// that a corrupt L2 entry fails the request that meets it instead of sending a write to
/// wherever it points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClusterBound {
    /// Wherever the guest's offset is (a raw backing file: a read past its end comes back
    /// short and fails).
    Unchecked,
    /// In clusters of `1 << cluster_bits` bytes that start inside the file: a qcow2 file's own
    /// clusters (its last one may be written only in part, as QEMU's `qemu-img check`
    /// accepts).
    InsideFile {
        /// log2 of the layer's cluster size.
        cluster_bits: u32,
    },
    /// Below the disk's virtual size: an external data file, where every cluster sits at its
    /// guest offset (as QEMU and imago allocate them).
    InsideDisk,
}

impl Layer {
    /// How many bytes from `host_offset` on lie in clusters the layer may hold data in (0:
    /// none). A file only grows while served, so only an offset past what was last seen
    /// looks again (one `statx`); the disk's size bounds an external data file's clusters
    /// (see [`ClusterBound`]).
    fn servable(&self, host_offset: u64, disk_size: impl FnOnce() -> u64) -> io::Result<u64> {
        let limit = self.cluster_limit.get();
        if host_offset < limit {
            return Ok(limit.saturating_sub(host_offset));
        }
        match self.bound {
            ClusterBound::Unchecked => Ok(u64::MAX),
            ClusterBound::InsideDisk => Ok(disk_size().saturating_sub(host_offset)),
            ClusterBound::InsideFile { cluster_bits } => {
                self.cluster_limit
                    .set(clusters_end(file_end(self.fd)?, cluster_bits));
                Ok(self.cluster_limit.get().saturating_sub(host_offset))
            }
        }
    }

    /// Records that the file reaches at least `end` (a write that ended there succeeded).
    fn reached(&self, end: u64) {
        if let ClusterBound::InsideFile { cluster_bits } = self.bound {
            let limit = clusters_end(end, cluster_bits);
            if limit > self.cluster_limit.get() {
                self.cluster_limit.set(limit);
            }
        }
    }
}

/// The end of the last cluster of `1 << cluster_bits` bytes that starts before `end`.
fn clusters_end(end: u64, cluster_bits: u32) -> u64 {
    let mask = (1u64 << cluster_bits.min(63)).saturating_sub(1);
    end.checked_add(mask).map_or(u64::MAX, |e| e & !mask)
}

/// A qcow2 image with its backing chain, opened on fds the frontend sent.
pub struct Qcow2Image {
    top: FormatAccess<ImagoFile>,
    /// A raw external data file (`data_file_raw`): it must read as the disk does, so what
    /// imago zeroes in the metadata is zeroed in it too (QEMU writes those zeros as well).
    raw_data_file: Option<RawFd>,
    /// The image file's held pointer writes, applied after each write-back of the caches.
    barrier: Arc<Barrier>,
    /// The external data file's, which holds writes below the end of the disk's last cluster
    /// (imago fills a last cluster the disk ends inside with zeros past the disk's size).
    data_barrier: Option<Arc<Barrier>>,
    layers: Vec<Layer>,
    writable: bool,
    /// Bounce buffer of compressed reads, grown to the largest one seen.
    bounce: Vec<u8>,
    /// log2 of the cluster size.
    cluster_bits: u32,
}

impl std::fmt::Debug for Qcow2Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qcow2Image")
            .field("size", &self.top.size())
            .field("layers", &self.layers.len())
            .field("writable", &self.writable)
            .finish()
    }
}

// SAFETY: `Layer::storage` is only compared, never dereferenced; everything else is Send.
unsafe impl Send for Qcow2Image {}

/// Whether the qcow2 header in `file` sets the "raw external data" autoclear bit (bit 1 of the
/// autoclear features, a big-endian u64 at byte 88 of a version 3 header).
fn has_raw_external_data(file: &File) -> bool {
    use std::os::unix::fs::FileExt;
    let mut field = [0u8; 8];
    file.read_exact_at(&mut field, 88).is_ok() && u64::from_be_bytes(field) & 0b10 != 0
}

/// Whether `file` was opened for writing.
fn opened_writable(file: &File) -> bool {
    // SAFETY: F_GETFL only reads the status flags of an open fd.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    flags >= 0 && flags & libc::O_ACCMODE == libc::O_RDWR
}

impl Qcow2Image {
    /// Opens the chain: `top` (qcow2, read-write if its fd is), its external data file (exactly
    /// when its header names one; opened as `top` is) and `backing`, the image's backing file
    /// first, each with its format, all read-only. Every layer that names a backing file gets
    /// the next one; the last must name none. Layer 0 is the image's own file, then its data
    /// file (if any), then the backing files.
    pub fn open(
        top: File,
        mut data_file: Option<File>,
        backing: Vec<(File, LayerFormat)>,
    ) -> Result<Self, Qcow2Error> {
        let mut writable = opened_writable(&top);
        if let Some(problem) = writable
            .then(|| blkplane_chain::integrity::unwritable(&top))
            .flatten()
        {
            // The frontend refuses to start on such an image (`blkplane_chain::open_for`), so
            // it went bad while served — as imago's allocator leaves some corrupt images it
            // recursed in until the iothread crashed. Served read-only from here on, as QEMU
            // serves an image it found corrupt: writes fail with IOERR, reads go on.
            error!("{problem}; serving the image read-only: writes fail until it is repaired");
            writable = false;
        }
        let depth = backing.len();
        let mut layers: Vec<Layer> = Vec::with_capacity(depth.saturating_add(1));
        // Built from the bottom up: each layer becomes the next one's backing.
        let mut below: Option<FormatAccess<ImagoFile>> = None;
        let mut top_barrier = None;
        let mut data_barrier: Option<Arc<Barrier>> = None;
        let mut files: Vec<(usize, File, LayerFormat, bool)> = backing
            .into_iter()
            .enumerate()
            .map(|(index, (file, format))| (index.saturating_add(1), file, format, false))
            .collect();
        files.insert(0, (0, top, LayerFormat::Qcow2, writable));
        while let Some((layer, file, format, layer_writable)) = files.pop() {
            // The fds of this layer's files, in the order imago lists its storages: its own
            // file, then its external data file.
            let mut fds = vec![file.as_raw_fd()];
            let open_error = |source| Qcow2Error::Open {
                layer,
                format,
                source,
            };
            let (storage, barrier) =
                MetadataFile::open(file, layer_writable, format == LayerFormat::Qcow2)
                    .map_err(open_error)?;
            // imago opens the header after this: a size it refuses never maps anything.
            let qcow2_cluster_bits = (format == LayerFormat::Qcow2)
                .then(|| crate::metadata_file::cluster_bits(storage.file()))
                .flatten();
            if layer == 0 {
                top_barrier = Some(barrier);
            }
            let access = match format {
                LayerFormat::Raw => {
                    if layer == 0 {
                        return Err(Qcow2Error::RawTop);
                    }
                    if below.is_some() {
                        return Err(Qcow2Error::ChainMismatch {
                            layer,
                            problem: "is raw but was handed a backing file",
                        });
                    }
                    FormatAccess::new(Raw::open_image(storage, false).map_err(open_error)?)
                }
                LayerFormat::Qcow2 => {
                    // What imago would panic on is refused before it reads the header.
                    blkplane_chain::check_header(storage.file())
                        .map_err(|e| open_error(io::Error::new(io::ErrorKind::InvalidData, e)))?;
                    let mut qcow2 = Qcow2::<ImagoFile>::open_image(storage, layer_writable)
                        .map_err(open_error)?;
                    match (qcow2.requires_external_data_file(), layer, data_file.take()) {
                        (true, 0, Some(data)) => {
                            fds.push(data.as_raw_fd());
                            let (data, barrier) = MetadataFile::open(data, layer_writable, false)
                                .map_err(open_error)?;
                            data_barrier = Some(barrier);
                            qcow2.set_data_file(Some(data));
                        }
                        (true, 0, None) => {
                            return Err(Qcow2Error::ChainMismatch {
                                layer,
                                problem: "names an external data file, but none was handed over",
                            })
                        }
                        (true, _, _) => return Err(Qcow2Error::ExternalDataFile(layer)),
                        (false, _, Some(_)) => {
                            return Err(Qcow2Error::ChainMismatch {
                                layer,
                                problem: "names no external data file, but one was handed over",
                            })
                        }
                        (false, _, None) => {}
                    }
                    match (qcow2.implicit_backing_file().is_some(), below.take()) {
                        (true, Some(backing)) => qcow2.set_backing(Some(backing)),
                        (false, None) => {}
                        (true, None) => {
                            return Err(Qcow2Error::ChainMismatch {
                                layer,
                                problem: "names a backing file, but none was handed over",
                            })
                        }
                        (false, Some(_)) => {
                            return Err(Qcow2Error::ChainMismatch {
                                layer,
                                problem: "names no backing file, but one was handed over",
                            })
                        }
                    }
                    FormatAccess::new(qcow2)
                }
            };
            // The storages this layer added to those below it are its own files; they go in
            // front of the layers below, so that the image's own file ends up first.
            let new: Vec<*const ImagoFile> = access
                .inner()
                .collect_storage_dependencies()
                .into_iter()
                .map(|storage| storage as *const ImagoFile)
                .filter(|ptr| !layers.iter().any(|l| std::ptr::eq(l.storage, *ptr)))
                .collect();
            if new.len() != fds.len() {
                return Err(Qcow2Error::ChainMismatch {
                    layer,
                    problem: "does not have the files it was handed",
                });
            }
            let group = new
                .into_iter()
                .zip(fds)
                .enumerate()
                .map(|(index, (storage, fd))| {
                    let bound = match (format, index, qcow2_cluster_bits) {
                        (LayerFormat::Qcow2, 0, Some(cluster_bits)) => {
                            ClusterBound::InsideFile { cluster_bits }
                        }
                        // imago refuses a header without a cluster size it allows.
                        (LayerFormat::Qcow2, 0, None) => ClusterBound::Unchecked,
                        (LayerFormat::Qcow2, _, _) => ClusterBound::InsideDisk,
                        (LayerFormat::Raw, _, _) => ClusterBound::Unchecked,
                    };
                    let unchecked = bound == ClusterBound::Unchecked;
                    Layer {
                        storage,
                        fd,
                        top: layer == 0,
                        bound,
                        cluster_limit: Cell::new(if unchecked { u64::MAX } else { 0 }),
                    }
                });
            layers.splice(0..0, group);
            below = Some(access);
        }
        if data_file.is_some() {
            return Err(Qcow2Error::ChainMismatch {
                layer: 0,
                problem: "is handed an external data file it does not name",
            });
        }
        let (Some(top), Some(barrier)) = (below, top_barrier) else {
            return Err(Qcow2Error::RawTop);
        };
        // imago opened the header, so its cluster size is one qcow2 allows (9..=21 bits).
        let cluster_bits = crate::metadata_file::cluster_bits(barrier.file_ref()).ok_or(
            Qcow2Error::ChainMismatch {
                layer: 0,
                problem: "has no cluster size in its header",
            },
        )?;
        let raw_data_file = layers
            .get(1)
            .filter(|l| l.top && has_raw_external_data(barrier.file_ref()))
            .map(|l| l.fd);
        if let Some(data) = &data_barrier {
            data.hold_below_disk_end(clusters_end(top.size(), cluster_bits));
        }
        info!(
            "qcow2 image of {} bytes, {} backing file(s), {}",
            top.size(),
            depth,
            if writable { "read-write" } else { "read-only" }
        );
        Ok(Self {
            top,
            raw_data_file,
            barrier,
            data_barrier,
            layers,
            writable,
            bounce: Vec::new(),
            cluster_bits,
        })
    }

    /// The virtual disk size.
    pub fn size(&self) -> u64 {
        self.top.size()
    }

    /// The cluster size of the image.
    pub fn cluster_size(&self) -> u64 {
        1u64 << self.cluster_bits
    }

    /// The buffered fd of `layer` (0 the image).
    pub fn layer_fd(&self, layer: usize) -> Option<RawFd> {
        self.layers.get(layer).map(|l| l.fd)
    }

    /// Where the `max_len` bytes from guest offset `offset` are, as far as contiguous (at most
    /// `max_len`). An `L2` cache hit makes no system call. Past the end of the image: `EINVAL`
    /// (the request parser keeps requests inside it). A data cluster a qcow2 file maps past its
    /// own end (a corrupt or truncated image), or an external data file past the disk's size,
    /// is an error of the image (`InvalidData`), for a write as for a read: a write there
    /// would grow the file to wherever the entry points; an extent stops at the last cluster
    /// that does not. So a cluster allocated ahead maps only once the file reaches it. (What
    /// imago writes itself — zeros into part of a cluster, a preallocated zero cluster written
    /// in place — is bounded by the metadata file instead: [`Barrier::check_write_at`].)
    pub fn map(&self, offset: u64, max_len: u64) -> io::Result<Extent> {
        let (mapping, len) = self.top.get_mapping(offset, max_len)?;
        let len = len.min(max_len);
        Ok(match mapping {
            Mapping::Raw {
                storage,
                offset: host_offset,
                writable,
                ..
            } => {
                let ptr: *const ImagoFile = storage;
                let (layer, file) = self
                    .layers
                    .iter()
                    .enumerate()
                    .find(|(_, l)| std::ptr::eq(l.storage, ptr))
                    .ok_or_else(|| io::Error::other("mapping into a file outside the chain"))?;
                let servable = file.servable(host_offset, || self.top.size())?;
                if servable == 0 {
                    let end = match file.bound {
                        ClusterBound::InsideDisk => format!("the disk's size, {}", self.top.size()),
                        _ => format!(
                            "the file's end (its clusters end at {})",
                            file.cluster_limit.get()
                        ),
                    };
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!(
                            "layer {layer} maps guest offset {offset} to byte {host_offset} of \
                             its file, in a cluster past {end}: a corrupt L2 entry"
                        ),
                    ));
                }
                Extent::Data {
                    layer,
                    host_offset,
                    len: len.min(servable),
                    writable: writable && self.writable && file.top,
                }
            }
            Mapping::Zero { .. } => Extent::Zero { len },
            Mapping::Special { .. } => Extent::Compressed { len },
            Mapping::Eof { .. } => return Err(io::Error::from_raw_os_error(libc::EINVAL)),
            // A mapping kind a newer imago may add: not servable.
            _ => return Err(io::Error::from(io::ErrorKind::Unsupported)),
        })
    }

    /// Reads `len` bytes at guest offset `offset` through imago (compressed clusters) into
    /// `iovecs`, which describe at least `len` bytes of guest memory.
    ///
    /// # Safety
    /// Every iovec must describe memory mapped writable for the whole call.
    pub unsafe fn read_through(
        &mut self,
        offset: u64,
        len: u64,
        iovecs: &[libc::iovec],
    ) -> io::Result<()> {
        let len = usize::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        if self.bounce.len() < len {
            self.bounce.resize(len, 0);
        }
        let buffer = self
            .bounce
            .get_mut(..len)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOMEM))?;
        self.top.read(&mut *buffer, offset)?;
        let mut copied = 0usize;
        for iov in iovecs {
            let Some(rest) = buffer.get(copied..) else {
                break;
            };
            let n = iov.iov_len.min(rest.len());
            // SAFETY: the caller guarantees the iovec is mapped writable; `rest` has at least
            // `n` bytes; guest memory is never a Rust reference, so nothing aliases.
            unsafe { std::ptr::copy_nonoverlapping(rest.as_ptr(), iov.iov_base.cast::<u8>(), n) };
            copied = copied.saturating_add(n);
        }
        Ok(())
    }

    /// An allocating write of the `len` bytes at guest offset `offset` done at once: the
    /// allocation is prepared ([`Qcow2Image::prepare_allocation`]), `write` writes the data to
    /// it (`write(fd, host_offset, bytes)`, all of them or an error), and only then is it
    /// committed ([`Qcow2Image::commit_allocation`]) and the metadata written back. Returns how
    /// many of the `len` bytes were mapped and written (the rest takes another call).
    pub fn allocating_write(
        &self,
        offset: u64,
        len: u64,
        write: impl FnOnce(RawFd, u64, u64) -> io::Result<()>,
    ) -> io::Result<u64> {
        let written = self.allocating_write_in_memory(offset, len, write)?;
        self.write_back()?;
        Ok(written)
    }

    /// [`Qcow2Image::allocating_write`], with the new mapping committed in imago's caches only:
    /// the caller writes it back ([`Qcow2Image::flush_metadata`]) before it acknowledges the
    /// write, so that one write-back serves every allocation of a batch.
    pub fn allocating_write_in_memory(
        &self,
        offset: u64,
        len: u64,
        write: impl FnOnce(RawFd, u64, u64) -> io::Result<()>,
    ) -> io::Result<u64> {
        let allocation = self.prepare_allocation(offset, len)?;
        let fd = self
            .layer_fd(allocation.layer)
            .ok_or_else(|| io::Error::other("allocation outside the image's files"))?;
        // Dropping `allocation` on an error releases the prepared cluster: the old mapping
        // stays.
        self.check_allocation(&allocation)?;
        write(fd, allocation.host_offset, allocation.len)?;
        let end = allocation.host_offset.saturating_add(allocation.len);
        if let Some(file) = self.layers.get(allocation.layer) {
            file.reached(end);
        }
        if allocation.layer == 0 {
            self.barrier.reached(end);
        }
        let len = allocation.len;
        self.commit_allocation(allocation)?;
        Ok(len)
    }

    /// Refuses an allocation whose data would land where no cluster of the image can be: a
    /// zero cluster's preallocated offset that a corrupt entry put far past the file's end
    /// (imago writes into it in place), or past the disk's size in an external data file.
    fn check_allocation(&self, allocation: &Allocation) -> io::Result<()> {
        let bound = self.layers.get(allocation.layer).map(|l| l.bound);
        match bound {
            Some(ClusterBound::InsideFile { .. }) => {
                self.barrier.check_write_at(allocation.host_offset)
            }
            Some(ClusterBound::InsideDisk) if allocation.host_offset >= self.top.size() => {
                Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "an allocation at byte {} of the data file, past the disk's size: a \
                         corrupt entry",
                        allocation.host_offset
                    ),
                ))
            }
            _ => Ok(()),
        }
    }

    /// Prepares an allocating write of (at most) the `len` bytes at guest offset `offset`, a
    /// range of one L2 table that the image does not own yet (unallocated, in a backing file,
    /// a zero or compressed cluster): imago allocates new clusters and copies into them what
    /// the write leaves of the old data (from the backing file). The range keeps reading as
    /// before until [`Qcow2Image::commit_allocation`]; dropping the allocation instead
    /// releases its clusters.
    ///
    /// While it is prepared, imago holds the write lock of its L2 table, and its locks are not
    /// reentrant: nothing may prepare another allocation, zero or discard clusters, or read a
    /// compressed cluster in that table until the allocation is committed or dropped — the
    /// calling thread would wait for itself.
    pub fn prepare_allocation(&self, offset: u64, len: u64) -> io::Result<Allocation> {
        if !self.writable {
            return Err(io::Error::from_raw_os_error(libc::EROFS));
        }
        let prepared = self.top.prepare_data_mapping(offset, len, true)?;
        let ptr: *const ImagoFile = prepared.storage();
        let layer = self
            .layers
            .iter()
            .position(|l| l.top && std::ptr::eq(l.storage, ptr))
            .ok_or_else(|| io::Error::other("allocation outside the image's files"))?;
        Ok(Allocation {
            layer,
            host_offset: prepared.offset(),
            len: prepared.length().min(len),
            state: prepared.into_state(),
        })
    }

    /// Makes a prepared allocation visible once its data is in the file, in imago's caches: the
    /// metadata reaches the file (the page cache; fdatasync at the guest's flush) with the next
    /// [`Qcow2Image::flush_metadata`].
    pub fn commit_allocation(&self, allocation: Allocation) -> io::Result<()> {
        let Some(state) = allocation.state else {
            // The range was mapped already: nothing to commit.
            return Ok(());
        };
        // imago's qcow2 driver commits from the state alone; the storage and offsets of the
        // handle it is carried in are not looked at again.
        let storages = self.top.inner().collect_storage_dependencies();
        let storage = storages
            .first()
            .ok_or_else(|| io::Error::other("the image has no file"))?;
        let prepared = imago::format::drivers::PreparedDataMapping::to_commit(
            *storage,
            allocation.host_offset,
            allocation.len,
            state,
        );
        self.top.commit_data_mapping(prepared)
    }

    /// Where the data an allocating write of the `len` guest bytes at `offset` leaves of its
    /// cluster is now, when it is in a file: the layer, the offset in it and the contiguous
    /// bytes of that cluster there (of the first cluster if the write starts inside one, else of
    /// the last if it ends inside one). `None` when the write covers whole clusters or that
    /// data is zeros or compressed. Reading it first into the page cache (through io_uring)
    /// lets imago's copy-on-write run at memory speed.
    pub fn copy_on_write_source(&self, offset: u64, len: u64) -> Option<(usize, u64, u64)> {
        let cluster = 1u64.checked_shl(self.cluster_bits)?;
        let mask = cluster.checked_sub(1)?;
        let end = offset.checked_add(len)?;
        let start = if offset & mask != 0 {
            offset & !mask
        } else if end & mask != 0 {
            end & !mask
        } else {
            return None;
        };
        match self.map(start, cluster).ok()? {
            Extent::Data {
                layer,
                host_offset,
                len,
                ..
            } => Some((layer, host_offset, len.min(cluster))),
            Extent::Zero { .. } | Extent::Compressed { .. } => None,
        }
    }

    /// Allocates the cluster at guest offset `cluster_offset` for a write of all of it that
    /// the caller makes itself, after this returns (the engine's O_DIRECT allocating writes,
    /// which write the old data and the guest's as one cluster through io_uring). The mapping
    /// is visible to lookups at once, so the caller must keep every other request away from
    /// the cluster until its data is written; the file keeps the old mapping until
    /// [`Qcow2Image::cluster_written`] (or [`Qcow2Image::cluster_not_written`] undoes it).
    ///
    /// `None` (nothing changed) where this does not apply: a cluster the image maps itself
    /// (a zero cluster, a compressed or shared one: [`Qcow2Image::allocating_write`] handles
    /// those), one that reaches past the end of the disk, one that would land in an external
    /// data file, or one whose L2 entry cannot be found in the file.
    pub fn allocate_cluster_ahead(
        &self,
        cluster_offset: u64,
    ) -> io::Result<Option<ClusterAllocation>> {
        if !self.writable {
            return Err(io::Error::from_raw_os_error(libc::EROFS));
        }
        let cluster = self.cluster_size();
        if cluster_offset & cluster.saturating_sub(1) != 0
            || !self.leaves_unallocated(cluster_offset)
        {
            return Ok(None);
        }
        // The whole cluster is overwritten: imago copies nothing.
        let prepared = self.prepare_allocation(cluster_offset, cluster)?;
        if prepared.layer != 0 || prepared.len != cluster || prepared.state.is_none() {
            // Dropped: released.
            return Ok(None);
        }
        // imago has written the L1 entry of a new L2 table while preparing (held or not, the
        // barrier sees it).
        let Some(entry) = self.barrier.l2_entry_offset(cluster_offset) else {
            return Ok(None);
        };
        let host_offset = prepared.host_offset;
        self.barrier.hold_entry(entry, 0);
        if let Err(e) = self.commit_allocation(prepared) {
            self.barrier.forget(entry);
            return Err(e);
        }
        Ok(Some(ClusterAllocation {
            host_offset,
            entry,
            cluster_offset,
        }))
    }

    /// Whether the image leaves the cluster holding guest offset `offset` unallocated (it
    /// reads from the backing chain, or as zeros without one) and the whole cluster is inside
    /// the disk: what [`Qcow2Image::allocate_cluster_ahead`] allocates. Only such a cluster
    /// has the L2 entry 0, the one the file keeps until the data lands (and the one undoing
    /// goes back to). A lookup: an L2 cache hit makes no system call.
    pub fn leaves_unallocated(&self, offset: u64) -> bool {
        self.unallocated_cluster(offset).is_some()
    }

    /// Whether the cluster holding guest offset `offset` is one
    /// [`Qcow2Image::leaves_unallocated`] accepts and reads from the backing chain (the image
    /// has a backing file): what an allocation must copy from it.
    pub fn backing_shows_through(&self, offset: u64) -> bool {
        self.unallocated_cluster(offset) == Some(true)
    }

    /// For a cluster [`Qcow2Image::leaves_unallocated`] accepts, whether it reads from the
    /// backing chain (else as zeros); `None` for any other. One lookup.
    fn unallocated_cluster(&self, offset: u64) -> Option<bool> {
        let cluster = self.cluster_size();
        let start = offset & !cluster.saturating_sub(1);
        // With an external data file, imago puts the data there, not in the image file.
        let data_file = self.layers.iter().filter(|l| l.top).count() > 1;
        if !self.writable
            || data_file
            || start
                .checked_add(cluster)
                .is_none_or(|end| end > self.size())
        {
            return None;
        }
        match self.top.get_shallow_mapping(start, cluster) {
            Ok((ShallowMapping::Indirect { .. }, _)) => Some(true),
            Ok((
                ShallowMapping::Zero {
                    explicit: false, ..
                },
                _,
            )) => Some(false),
            _ => None,
        }
    }

    /// The data of a [`Qcow2Image::allocate_cluster_ahead`] cluster is in the file: its
    /// mapping may follow (with the next write-back).
    pub fn cluster_written(&self, allocation: &ClusterAllocation) {
        self.barrier.land(allocation.entry);
    }

    /// Writing the data of a [`Qcow2Image::allocate_cluster_ahead`] cluster failed: the cluster
    /// is unallocated again (its data cluster freed) and reads as before.
    pub fn cluster_not_written(&mut self, allocation: &ClusterAllocation) -> io::Result<()> {
        let undone = self
            .top
            .discard_to_backing(allocation.cluster_offset, self.cluster_size());
        if undone.is_ok() {
            self.barrier.forget(allocation.entry);
            return self.write_back();
        }
        // The mapping stays in imago's caches, pointing at a cluster without its data; the
        // file keeps the old one (the entry stays held). Nothing more is written to the image.
        error!(
            "undoing the allocation of the cluster at guest offset {} failed; serving the \
             image read-only",
            allocation.cluster_offset
        );
        self.writable = false;
        undone
    }

    /// Zeroes the range (write-zeroes): with `unmap`, whole clusters become zero clusters
    /// whose data clusters are freed (nothing of a backing file shows through); without it
    /// they become zero clusters that keep their allocation; partial clusters at the ends are
    /// written with zeros. A qcow2 v2 image, which has no zero clusters, gets written zeros.
    /// Then the metadata is written back.
    pub fn zero(&mut self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        if !self.writable {
            return Err(io::Error::from_raw_os_error(libc::EROFS));
        }
        let deallocated = if unmap {
            match self.top.discard_to_zero(offset, len) {
                Err(e) if e.kind() == io::ErrorKind::Unsupported => false,
                result => result.map(|()| true)?,
            }
        } else {
            false
        };
        if let Some(fd) = self.raw_data_file {
            zero_range(fd, offset, len)?;
        }
        if !deallocated {
            match self.top.write_zeroes(offset, len) {
                // qcow2 v2 has no zero clusters: write zeros as data.
                Err(e) if e.kind() == io::ErrorKind::Unsupported => {
                    self.write_zeros_as_data(offset, len)?
                }
                result => result?,
            }
        }
        self.write_back()
    }

    /// Writes `len` zero bytes at `offset` through imago (allocating as needed), a chunk of
    /// [`ZERO_CHUNK`] at a time.
    fn write_zeros_as_data(&mut self, mut offset: u64, len: u64) -> io::Result<()> {
        let end = offset
            .checked_add(len)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        if self.bounce.len() < ZERO_CHUNK {
            self.bounce.resize(ZERO_CHUNK, 0);
        }
        let zeros = self
            .bounce
            .get_mut(..ZERO_CHUNK)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOMEM))?;
        // The bounce buffer also serves compressed reads: clear it.
        zeros.fill(0);
        while offset < end {
            // At most ZERO_CHUNK, which fits a usize.
            let n = usize::try_from(end.saturating_sub(offset))
                .unwrap_or(ZERO_CHUNK)
                .min(ZERO_CHUNK);
            let chunk = zeros
                .get(..n)
                .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOMEM))?;
            self.top.write(chunk, offset)?;
            offset = offset.saturating_add(n as u64);
        }
        Ok(())
    }

    /// Discards the range: the whole clusters in it become zero clusters and their data
    /// clusters are freed (the partial ones at its ends keep their data, and nothing of a
    /// backing file shows through); then the metadata is written back. Discard is advisory, so
    /// an image that cannot (qcow2 v2, without zero clusters) keeps its data.
    pub fn discard(&mut self, offset: u64, len: u64) -> io::Result<()> {
        if !self.writable {
            return Err(io::Error::from_raw_os_error(libc::EROFS));
        }
        match self.top.discard_to_any(offset, len) {
            Err(e) if e.kind() == io::ErrorKind::Unsupported => return Ok(()),
            result => result?,
        }
        // The whole clusters became zero clusters: the raw data file reads so too.
        if let Some(fd) = self.raw_data_file {
            zero_range(fd, offset, len)?;
        }
        self.write_back()
    }

    /// Grows the virtual size to `size` (the new range reads as zeros; nothing is
    /// preallocated), then writes the metadata back. Shrinking is refused.
    pub fn grow(&mut self, size: u64) -> io::Result<()> {
        if !self.writable {
            return Err(io::Error::from_raw_os_error(libc::EROFS));
        }
        if size < self.top.size() {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        self.top
            .resize_grow(size, imago::format::PreallocateMode::None)?;
        if let Some(data) = &self.data_barrier {
            data.hold_below_disk_end(clusters_end(self.top.size(), self.cluster_bits));
        }
        self.write_back()
    }

    /// Writes every cached metadata change back to the image file (not synced).
    pub fn flush_metadata(&self) -> io::Result<()> {
        self.write_back()
    }

    /// fdatasyncs the image's external data file, if it has one (the guest's flush syncs the
    /// image file itself through io_uring; imago's own flush of a file syncs nothing). On this
    /// thread: only images with an external data file pay it.
    pub fn sync_data_file(&self) -> io::Result<()> {
        for layer in self.layers.iter().skip(1).filter(|l| l.top) {
            // SAFETY: fdatasync on an fd of the chain; no memory is involved.
            if unsafe { libc::fdatasync(layer.fd) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }

    /// imago's caches first (refcount blocks before the L2 tables that need them), then the
    /// pointer structures held until now ([`crate::metadata_file`]).
    fn write_back(&self) -> io::Result<()> {
        self.top.flush()?;
        self.barrier.apply()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    const CLUSTER: u64 = 64 * 1024;
    const MIB: u64 = 1024 * 1024;

    /// A directory of its own under the system's temporary directory, removed on drop.
    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Self {
            let path = std::env::temp_dir().join(format!("bp-qcow2-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).unwrap();
            Self(path)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn qemu_img(args: &[&str]) -> (i32, String) {
        let out = Command::new("qemu-img")
            .args(args)
            .output()
            .expect("qemu-img (tests/setup.sh installs it)");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code().unwrap_or(-1), text)
    }

    fn path(p: &Path) -> &str {
        p.to_str().unwrap()
    }

    /// A raw base of `len` bytes of a pattern and a qcow2 overlay on it with `cluster` bytes
    /// per cluster.
    fn overlay_on_pattern(dir: &Path, len: u64, cluster: u64) -> (PathBuf, PathBuf) {
        let base = dir.join("base.raw");
        let bytes: Vec<u8> = (0..len).map(|i| (i / 512 % 251) as u8 | 1).collect();
        std::fs::write(&base, bytes).unwrap();
        let top = dir.join("top.qcow2");
        let (code, out) = qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            &format!("cluster_size={cluster}"),
            "-F",
            "raw",
            "-b",
            path(&base),
            path(&top),
        ]);
        assert_eq!(code, 0, "{out}");
        (base, top)
    }

    fn open(top: &Path, base: &Path) -> Qcow2Image {
        let rw = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(top)
            .unwrap();
        let ro = File::open(base).unwrap();
        Qcow2Image::open(rw, None, vec![(ro, LayerFormat::Raw)]).unwrap()
    }

    /// What `len` bytes at guest `offset` read as, the way the engine reads them: mapped,
    /// then read from the layer's file.
    fn read_as_engine(image: &Qcow2Image, offset: u64, len: u64) -> Vec<u8> {
        match image.map(offset, len).unwrap() {
            Extent::Data {
                layer, host_offset, ..
            } => {
                let fd = image.layer_fd(layer).unwrap();
                let mut buf = vec![0u8; len as usize];
                // SAFETY: `buf` is a private buffer of `len` bytes; `fd` is open.
                let n = unsafe {
                    libc::pread(fd, buf.as_mut_ptr().cast(), buf.len(), host_offset as i64)
                };
                assert_eq!(n, len as isize);
                buf
            }
            other => panic!("guest {offset:#x} is {other:?}"),
        }
    }

    /// Asserts `got == want`, naming the first byte that differs (not both buffers).
    fn assert_bytes(got: &[u8], want: &[u8], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        if let Some(at) = got.iter().zip(want).position(|(g, w)| g != w) {
            panic!(
                "{what}: byte {at} is {:#x}, wanted {:#x}",
                got[at], want[at]
            );
        }
    }

    fn pwrite(fd: RawFd, host_offset: u64, data: &[u8]) -> io::Result<()> {
        // SAFETY: `data` is a live slice; `fd` is open.
        let n = unsafe { libc::pwrite(fd, data.as_ptr().cast(), data.len(), host_offset as i64) };
        if n == data.len() as isize {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// A cluster allocated ahead is mapped in imago at once, but the file keeps the old
    /// mapping through every write-back until its data is written; written, it follows; one
    /// whose write failed is unmapped again and reads as before. Only clusters the image
    /// leaves unallocated, wholly inside the disk, are allocated so.
    #[test]
    fn clusters_allocated_ahead_reach_the_file_only_once_written() {
        let dir = Dir::new("ahead");
        let (base, top) = overlay_on_pattern(&dir.0, 8 * MIB, CLUSTER);
        let base_bytes = std::fs::read(&base).unwrap();
        // What another process opening the file now would see at guest `at`.
        let from_file = |at: u64| {
            let again = open(&top, &base);
            match again.map(at, 4096).unwrap() {
                Extent::Data { layer, .. } => layer,
                other => panic!("{other:?}"),
            }
        };
        let mut image = open(&top, &base);
        assert!(image.leaves_unallocated(CLUSTER + 512));
        assert_eq!(image.allocate_cluster_ahead(CLUSTER + 512).unwrap(), None);
        let kept = image.allocate_cluster_ahead(CLUSTER).unwrap().unwrap();
        let undone = image.allocate_cluster_ahead(3 * MIB).unwrap().unwrap();
        assert_eq!(kept.cluster_offset(), CLUSTER);
        // The engine extends the file ahead of the clusters before anything can map them
        // (a mapping past the file's end is a corrupt entry).
        let end = kept.host_offset.max(undone.host_offset) + CLUSTER;
        assert!(
            image.map(CLUSTER, 4096).is_err(),
            "a cluster past the file's end mapped"
        );
        File::options()
            .write(true)
            .open(&top)
            .unwrap()
            .set_len(end)
            .unwrap();
        // Mapped already: a write there goes straight to the new cluster.
        let Extent::Data {
            layer: 0,
            host_offset,
            writable: true,
            ..
        } = image.map(CLUSTER, 4096).unwrap()
        else {
            panic!("not mapped in imago's caches");
        };
        assert_eq!(host_offset, kept.host_offset);
        assert!(!image.leaves_unallocated(CLUSTER));
        image.flush_metadata().unwrap();
        assert_eq!(from_file(CLUSTER), 1, "the mapping reached the file early");
        assert_eq!(from_file(3 * MIB), 1, "the mapping reached the file early");
        let fd = image.layer_fd(0).unwrap();
        pwrite(fd, kept.host_offset, &[0x61; CLUSTER as usize]).unwrap();
        image.cluster_written(&kept);
        image.flush_metadata().unwrap();
        assert_eq!(
            from_file(CLUSTER),
            0,
            "the written cluster is not in the file"
        );
        assert_bytes(
            &read_as_engine(&image, CLUSTER, CLUSTER),
            &[0x61; CLUSTER as usize],
            "the written cluster",
        );
        image.cluster_not_written(&undone).unwrap();
        assert!(image.leaves_unallocated(3 * MIB));
        let at = (3 * MIB) as usize;
        assert_bytes(
            &read_as_engine(&image, 3 * MIB, CLUSTER),
            &base_bytes[at..at + CLUSTER as usize],
            "the undone cluster",
        );
        // Past the end of the disk, or a cluster the image maps itself: not so.
        assert!(!image.leaves_unallocated(8 * MIB));
        assert!(!image.leaves_unallocated(CLUSTER));
        drop(image);
        assert_eq!(from_file(3 * MIB), 1);
        let (code, out) = qemu_img(&["check", path(&top)]);
        assert_eq!(code, 0, "{out}");
    }

    /// A mapping into the image's own file stops at the last cluster that starts inside it:
    /// a cluster only partly inside (a last cluster written short) is served, one wholly past
    /// the end (a corrupt entry, a truncated image) is an error for reads and writes alike.
    #[test]
    fn mappings_stop_at_the_last_cluster_that_starts_inside_the_file() {
        let dir = Dir::new("past-end");
        let (base, top) = overlay_on_pattern(&dir.0, 8 * MIB, CLUSTER);
        let image = open(&top, &base);
        let written = image
            .allocating_write(0, 4 * CLUSTER, |fd, host, len| {
                pwrite(fd, host, &vec![0x5a; len as usize])
            })
            .unwrap();
        assert_eq!(written, 4 * CLUSTER, "four clusters in one allocation");
        let Extent::Data {
            layer: 0,
            host_offset: first,
            len,
            ..
        } = image.map(0, 4 * CLUSTER).unwrap()
        else {
            panic!("not mapped");
        };
        assert_eq!(len, 4 * CLUSTER, "the clusters are contiguous in the file");
        drop(image);
        // The third cluster cut in half, the fourth gone.
        let cut = first + 2 * CLUSTER + CLUSTER / 2;
        File::options()
            .write(true)
            .open(&top)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let image = open(&top, &base);
        let Extent::Data { len, .. } = image.map(0, 4 * CLUSTER).unwrap() else {
            panic!("not mapped");
        };
        assert_eq!(
            len,
            3 * CLUSTER,
            "the extent runs on past the last cluster inside"
        );
        let partial = image.map(2 * CLUSTER + CLUSTER / 2 + 512, 512).unwrap();
        assert!(
            matches!(partial, Extent::Data { host_offset, .. } if host_offset >= cut),
            "the part of the cut cluster past the end is not served: {partial:?}"
        );
        let error = image.map(3 * CLUSTER, 4096).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData, "{error}");
        assert!(error.to_string().contains("a corrupt L2 entry"), "{error}");
    }

    /// Allocations prepared in different L2 tables stay open together while their data is
    /// written, read as before until each is committed, commit in any order, and one dropped
    /// instead leaves its range as it was.
    #[test]
    fn prepared_allocations_are_invisible_until_committed() {
        let dir = Dir::new("prepare");
        // 4 KiB clusters: an L2 table maps 512 of them, 2 MiB.
        let (base, top) = overlay_on_pattern(&dir.0, 8 * MIB, 4096);
        let base_bytes = std::fs::read(&base).unwrap();
        let image = open(&top, &base);
        // The data a write leaves of its cluster: in the base (layer 1), from the cluster's
        // start; none for whole clusters.
        assert_eq!(
            image.copy_on_write_source(4096 + 512, 1024),
            Some((1, 4096, 4096))
        );
        assert_eq!(
            image.copy_on_write_source(8192, 1024),
            Some((1, 8192, 4096))
        );
        assert_eq!(
            image.copy_on_write_source(8192, 8192 + 512),
            Some((1, 16384, 4096))
        );
        assert_eq!(image.copy_on_write_source(8192, 8192), None);
        let first_at = 4096 + 512;
        let second_at = 2 * MIB + 8192;
        let dropped_at = 6 * MIB;
        // Each 1 KiB into its cluster: the rest is copied from the base when it is prepared.
        let first = image.prepare_allocation(first_at, 1024).unwrap();
        let second = image.prepare_allocation(second_at, 1024).unwrap();
        let dropped = image.prepare_allocation(dropped_at, 4096).unwrap();
        assert_eq!((first.len, second.len, dropped.len), (1024, 1024, 4096));
        let fd = image.layer_fd(first.layer).unwrap();
        pwrite(fd, first.host_offset, &[0x51; 1024]).unwrap();
        pwrite(fd, second.host_offset, &[0x52; 1024]).unwrap();
        pwrite(fd, dropped.host_offset, &[0x53; 4096]).unwrap();
        for at in [first_at, second_at, dropped_at] {
            let Extent::Data { layer: 1, .. } = image.map(at, 1024).unwrap() else {
                panic!("{at}: not the base's data before the commit");
            };
        }
        image.commit_allocation(second).unwrap();
        image.commit_allocation(first).unwrap();
        drop(dropped);
        image.flush_metadata().unwrap();
        for (at, byte) in [(first_at, 0x51u8), (second_at, 0x52)] {
            assert_bytes(
                &read_as_engine(&image, at, 1024),
                &[byte; 1024],
                &format!("the write at {at}"),
            );
            let cluster = at & !4095;
            let head = (at - cluster) as usize;
            assert_bytes(
                &read_as_engine(&image, cluster, head as u64),
                &base_bytes[cluster as usize..at as usize],
                &format!("the head of the cluster at {cluster}, copied from the base"),
            );
        }
        let Extent::Data { layer: 1, .. } = image.map(dropped_at, 4096).unwrap() else {
            panic!("the dropped allocation became visible");
        };
        drop(image);
        let (code, out) = qemu_img(&["check", path(&top)]);
        assert_eq!(code, 0, "qemu-img check: {out}");
    }

    /// A grow moves imago's L1 table (it always does) and frees the old one. Allocating writes
    /// after it copy the rest of their cluster from the backing file through imago; that copy
    /// must reach the file before the write's own data, and never after data written to the
    /// cluster directly, whichever cluster imago picks.
    #[test]
    fn writes_after_a_grow_keep_their_data() {
        let dir = Dir::new("grow");
        let (base, top) = overlay_on_pattern(&dir.0, 4 * MIB, CLUSTER);
        let base_bytes = std::fs::read(&base).unwrap();
        let mut image = open(&top, &base);
        // The L2 table exists before the grow, so the next allocation after it is a data
        // cluster (the first free one: where the old L1 table was).
        let first = image
            .allocating_write(0, CLUSTER, |fd, host, len| {
                pwrite(fd, host, &vec![0x11; len as usize])
            })
            .unwrap();
        assert_eq!(first, CLUSTER);
        image.grow(6 * MIB + CLUSTER).unwrap();
        assert_eq!(image.size(), 6 * MIB + CLUSTER);
        // Partial writes into the middle of fresh clusters: imago copies the whole cluster from
        // the base, then the data goes in.
        for (i, cluster) in [3u64, 17, 40].into_iter().enumerate() {
            let offset = cluster * CLUSTER + 8192;
            let data = vec![0xa0 + i as u8; 4096];
            let written = image
                .allocating_write(offset, 4096, |fd, host, len| {
                    assert_eq!(len, 4096);
                    pwrite(fd, host, &data)
                })
                .unwrap();
            assert_eq!(written, 4096);
            let what = format!("cluster {cluster} after its allocating write");
            assert_bytes(&read_as_engine(&image, offset, 4096), &data, &what);
            // A later write straight to the allocated cluster (the O_DIRECT path), then more
            // metadata work: the cluster keeps the newest data.
            let Extent::Data { host_offset, .. } = image.map(offset, 4096).unwrap() else {
                panic!("cluster {cluster} is not allocated");
            };
            let newer = vec![0xb0 + i as u8; 4096];
            pwrite(image.layer_fd(0).unwrap(), host_offset, &newer).unwrap();
            image.grow(image.size() + CLUSTER).unwrap();
            image.flush_metadata().unwrap();
            let what = format!("cluster {cluster} after a direct write and a grow");
            assert_bytes(&read_as_engine(&image, offset, 4096), &newer, &what);
            let start = (cluster * CLUSTER) as usize;
            assert_bytes(
                &read_as_engine(&image, cluster * CLUSTER, 8192),
                &base_bytes[start..start + 8192],
                &format!("the head of cluster {cluster}, copied from the base"),
            );
        }
        drop(image);
        // The file agrees: no corruption (a grow leaks the old L1 table's cluster).
        let (code, out) = qemu_img(&["check", path(&top)]);
        assert!(code == 0 || code == 3, "qemu-img check: {out}");
        let (code, out) = qemu_img(&["info", "--output=json", path(&top)]);
        assert_eq!(code, 0, "{out}");
        assert!(
            out.contains(&format!("\"virtual-size\": {}", 6 * MIB + 4 * CLUSTER)),
            "{out}"
        );
        let raw = dir.0.join("out.raw");
        let (code, out) = qemu_img(&["convert", "-O", "raw", path(&top), path(&raw)]);
        assert_eq!(code, 0, "{out}");
        let file = File::open(&raw).unwrap();
        for (i, cluster) in [3u64, 17, 40].into_iter().enumerate() {
            let mut got = vec![0u8; 4096];
            file.read_exact_at(&mut got, cluster * CLUSTER + 8192)
                .unwrap();
            let what = format!("cluster {cluster} in the file");
            assert_bytes(&got, &[0xb0 + i as u8; 4096], &what);
        }
    }
}
