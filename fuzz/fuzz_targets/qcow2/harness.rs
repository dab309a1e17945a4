// The qcow2 image harness shared by the `qcow2_image` and `qcow2_allocation` targets (their
// doc comments say what it does); `ALLOCATE` is the including target's.

use std::fs::File;
use std::os::fd::RawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use blkplane_iothread::qcow2::{Extent, LayerFormat, Qcow2Error, Qcow2Image};
use libfuzzer_sys::fuzz_target;

/// The most bytes one request moves (the engine's requests are this size or smaller in practice;
/// its own limit per extent is 1 GiB).
const MAX_REQUEST: u64 = 256 << 10;
/// The most extents one request is mapped into before the harness gives up on it.
const MAX_EXTENTS: usize = 256;
/// How much of the image the reads walk from offset 0.
const WALK: u64 = 1 << 20;

/// The raw backing file: its size is no multiple of any cluster size.
const RAW_BACKING_LEN: usize = (48 << 10) + 100;
/// The qcow2 backing file (16 KiB virtual, 512-byte clusters: plain, zero and compressed).
static QCOW2_BACKING: &[u8] = include_bytes!("../../seeds/qcow2_image/compressed_512.qcow2");

/// An empty directory: the frontend's only image directory.
fn empty_dir() -> PathBuf {
    let dir = std::env::temp_dir().join("blkplane-fuzz-qcow2-empty");
    std::fs::create_dir_all(&dir).expect("creating the empty image directory");
    let mut entries = std::fs::read_dir(&dir).expect("reading the empty image directory");
    assert!(
        entries.next().is_none(),
        "{} must be empty: backing files of fuzzed images resolve inside it",
        dir.display()
    );
    dir
}

thread_local! {
    static EMPTY_DIR: PathBuf = empty_dir();
    /// Buffers of the requests (guest memory, as far as the harness has any).
    static BUFFERS: std::cell::RefCell<(Vec<u8>, Vec<u8>)> =
        std::cell::RefCell::new((vec![0; WALK as usize], pattern(MAX_REQUEST as usize, 0x5a)));
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn memfd_with(name: &std::ffi::CStr, bytes: &[u8]) -> File {
    let file = blkplane_fuzz::memfd(name, bytes.len() as u64).expect("memfd");
    file.write_all_at(bytes, 0).expect("filling a memfd");
    file
}

fuzz_target!(|data: &[u8]| {
    let image = memfd_with(c"fuzz-qcow2", data);
    frontend(&image);
    let qcow2_backing = data.len() % 2 == 1;
    let Some(mut chain) = open(&image, qcow2_backing) else {
        return;
    };
    let size = chain.size();
    if let Some(frontend_size) = FRONTEND_SIZE.with(|s| s.take()) {
        assert_eq!(
            frontend_size, size,
            "the frontend and the iothread disagree on the virtual size"
        );
    }
    let cluster = cluster_size(data);
    BUFFERS.with(|buffers| {
        let (buf, pat) = &mut *buffers.borrow_mut();
        requests(&mut chain, size, cluster, buf, pat);
        // The iothread exits (its metadata written back) and the next one opens the image.
        let _ = chain.flush_metadata();
        drop(chain);
        if let Some(mut chain) = open(&image, qcow2_backing) {
            read(&mut chain, 0, size.min(WALK), buf);
        }
    });
});

thread_local! {
    /// The virtual size the frontend found, for the iothread's open to compare.
    static FRONTEND_SIZE: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// What the frontend (and blkplaned at AddDisk) does with an image file: probe its format and,
/// for qcow2, open its chain read-only.
fn frontend(image: &File) {
    FRONTEND_SIZE.with(|s| s.set(None));
    EMPTY_DIR.with(|dir| {
        // A path inside the empty directory that names no file: relative backing names resolve
        // next to it, and nothing but the directory itself is inside it.
        let path = dir.join("image.qcow2");
        let Ok(blkplane_chain::ImageFormat::Qcow2) = blkplane_chain::probe(image, &path) else {
            return;
        };
        if let Ok(chain) = blkplane_chain::open(image, &path, std::slice::from_ref(dir)) {
            for backing in &chain.backing {
                assert!(
                    backing
                        .path
                        .canonicalize()
                        .is_ok_and(|p| p.starts_with(dir)),
                    "backing file {} outside the image directory",
                    backing.path.display()
                );
            }
            FRONTEND_SIZE.with(|s| s.set(Some(chain.size)));
        }
    });
}

/// `Qcow2Image::open` of the image read-write, as the iothread's `Setup` does; an image that
/// names a backing file gets one.
fn open(image: &File, qcow2_backing: bool) -> Option<Qcow2Image> {
    let top = || image.try_clone().expect("dup");
    match Qcow2Image::open(top(), None, vec![]) {
        Ok(chain) => Some(chain),
        Err(Qcow2Error::ChainMismatch { layer: 0, .. }) => {
            let backing = if qcow2_backing {
                (
                    memfd_with(c"fuzz-backing", QCOW2_BACKING),
                    LayerFormat::Qcow2,
                )
            } else {
                let bytes = pattern(RAW_BACKING_LEN, 0xb0);
                (memfd_with(c"fuzz-backing", &bytes), LayerFormat::Raw)
            };
            Qcow2Image::open(top(), None, vec![backing]).ok()
        }
        Err(_) => None,
    }
}

/// The cluster size the header claims, for placing requests at boundaries (any value will do).
fn cluster_size(data: &[u8]) -> u64 {
    let bits = data
        .get(20..24)
        .map_or(16, |b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
    1 << bits.clamp(9, 21)
}

/// The fixed set of requests, in the engine's order of handling them one at a time.
fn requests(chain: &mut Qcow2Image, size: u64, cluster: u64, buf: &mut [u8], pat: &[u8]) {
    // Past the end: refused (the request parser keeps requests inside the image).
    assert!(chain.map(size, 1).is_err(), "a mapping past the end");
    if size == 0 {
        return;
    }
    let last = size - 1;
    let mid = (size / 2) & !(cluster - 1);
    // Offsets inside the image: its start, cluster boundaries and either side, the middle, the
    // last cluster and byte.
    let offsets = [
        0,
        cluster - 1,
        cluster,
        cluster + 1,
        2 * cluster - 512,
        3 * cluster,
        mid,
        last & !(cluster - 1),
        last.saturating_sub(511),
        last,
    ];
    let inside = |offset: u64, len: u64| {
        (offset < size).then(|| (offset, len.min(size - offset).min(MAX_REQUEST)))
    };

    read(chain, 0, size.min(WALK), buf);
    for &offset in &offsets {
        if let Some((offset, len)) = inside(offset, 2 * cluster) {
            read(chain, offset, len, buf);
        }
    }
    // A mapping of everything from a point on, as a request of the largest size would ask.
    for &offset in &offsets {
        if offset < size {
            let _ = map(chain, offset, size - offset);
        }
    }

    let writes = [
        (0, 4096),
        (cluster - 256, 512),
        (3 * cluster, cluster),
        (mid, 1024),
        (last.saturating_sub(511), 512),
    ];
    for (offset, len) in writes {
        if let Some((offset, len)) = inside(offset, len) {
            write(chain, offset, len, pat);
        }
    }
    if !ALLOCATE {
        // Zeroing and discarding change L2 tables, which may have to be allocated.
        let _ = chain.flush_metadata();
        read(chain, 0, size.min(WALK), buf);
        return;
    }
    // An online grow (ResizeDisk) moves imago's L1 table; the writes after it allocate where
    // the old table was, and the new range is mapped like any other.
    if chain.grow(size.saturating_add(cluster)).is_ok() {
        assert_eq!(chain.size(), size.saturating_add(cluster), "the grown size");
        for offset in [2 * cluster + 512, size] {
            if offset < chain.size() {
                let len = 1024.min(chain.size() - offset);
                write(chain, offset, len, pat);
            }
        }
    }
    if let Some((offset, len)) = inside(cluster, 2 * cluster) {
        let _ = chain.zero(offset, len, false);
    }
    if let Some((offset, len)) = inside(3 * cluster - 100, 2 * cluster) {
        let _ = chain.zero(offset, len, true);
    }
    if let Some((offset, len)) = inside(0, 4 * cluster) {
        let _ = chain.discard(offset, len);
    }
    if let Some((offset, len)) = inside(last.saturating_sub(cluster), cluster + 1) {
        let _ = chain.zero(offset, len, true);
    }
    let _ = chain.flush_metadata();
    read(chain, 0, size.min(WALK), buf);
}

/// `map` with the checks the engine relies on.
fn map(chain: &Qcow2Image, offset: u64, max_len: u64) -> Option<Extent> {
    let extent = chain.map(offset, max_len).ok()?;
    assert!(
        extent.len() <= max_len,
        "{extent:?} is longer than the {max_len} bytes asked at {offset}"
    );
    if let Extent::Data {
        host_offset, len, ..
    } = extent
    {
        assert!(
            host_offset.checked_add(len).is_some(),
            "{extent:?} at {offset} ends past u64"
        );
    }
    // An empty extent inside the image fails the request (EIO) in the engine.
    (!extent.is_empty()).then_some(extent)
}

/// A read request of `len` bytes at `offset` into `buf`, extent by extent as the engine's
/// `next_extent` runs it.
fn read(chain: &mut Qcow2Image, mut offset: u64, len: u64, buf: &mut [u8]) {
    let mut done = 0u64;
    for _ in 0..MAX_EXTENTS {
        let remaining = len - done;
        if remaining == 0 {
            return;
        }
        let Some(extent) = map(chain, offset, remaining) else {
            return;
        };
        let n = extent.len();
        let dst = &mut buf[done as usize..(done + n) as usize];
        match extent {
            Extent::Data {
                layer, host_offset, ..
            } => {
                let Some(fd) = chain.layer_fd(layer) else {
                    panic!("{extent:?} at {offset} names a layer the chain does not have");
                };
                // The engine's readv at the mapped offset; a short read fails the request.
                if !pread_all(fd, dst, host_offset) {
                    return;
                }
            }
            Extent::Zero { .. } => dst.fill(0),
            Extent::Compressed { .. } => {
                let iov = libc::iovec {
                    iov_base: dst.as_mut_ptr().cast(),
                    iov_len: dst.len(),
                };
                // SAFETY: the iovec describes `dst`, writable and borrowed for the whole call.
                if unsafe { chain.read_through(offset, n, &[iov]) }.is_err() {
                    return;
                }
            }
        }
        offset += n;
        done += n;
    }
}

/// A write request of `len` bytes of `pat` at `offset`, extent by extent as `next_extent`
/// runs it: straight into a cluster the image owns, else an allocating write.
fn write(chain: &mut Qcow2Image, mut offset: u64, len: u64, pat: &[u8]) {
    let mut done = 0u64;
    for _ in 0..MAX_EXTENTS {
        let remaining = len - done;
        if remaining == 0 {
            return;
        }
        let Some(extent) = map(chain, offset, remaining) else {
            return;
        };
        let src = &pat[done as usize..];
        let written = match extent {
            Extent::Data {
                layer,
                host_offset,
                len,
                writable: true,
            } => {
                assert_eq!(layer, 0, "{extent:?}: writable in a backing file");
                let fd = chain.layer_fd(0).expect("the image's fd");
                if !pwrite_all(fd, &src[..len as usize], host_offset) {
                    return;
                }
                len
            }
            // The CI target leaves allocation out: see ALLOCATE.
            _ if !ALLOCATE => return,
            _ => {
                let asked = extent.len();
                let mut handed = None;
                let result = chain.allocating_write(offset, asked, |fd, host_offset, len| {
                    assert!(
                        len <= asked,
                        "allocating_write hands {len} of {asked} bytes"
                    );
                    handed = Some(len);
                    if pwrite_all(fd, &src[..len as usize], host_offset) {
                        Ok(())
                    } else {
                        Err(std::io::Error::from_raw_os_error(libc::EIO))
                    }
                });
                match result {
                    Ok(written) => {
                        assert_eq!(
                            Some(written),
                            handed,
                            "allocating_write at {offset} reports what it did not write"
                        );
                        written
                    }
                    Err(_) => return,
                }
            }
        };
        // A write that made no progress fails the request (EIO).
        if written == 0 {
            return;
        }
        offset += written;
        done += written;
    }
}

/// The fd as a `File` for one call, not closed afterwards (the chain owns it).
fn borrowed(fd: RawFd) -> std::mem::ManuallyDrop<File> {
    use std::os::fd::FromRawFd;
    // SAFETY: `fd` is open for as long as the chain that handed it out, which outlives the
    // call; ManuallyDrop keeps it from being closed here.
    std::mem::ManuallyDrop::new(unsafe { File::from_raw_fd(fd) })
}

/// `pread` until `buf` is full; false at an error or the end of the file.
fn pread_all(fd: RawFd, buf: &mut [u8], offset: u64) -> bool {
    borrowed(fd).read_exact_at(buf, offset).is_ok()
}

/// `pwrite` all of `buf`; false at an error.
fn pwrite_all(fd: RawFd, buf: &[u8], offset: u64) -> bool {
    borrowed(fd).write_all_at(buf, offset).is_ok()
}
