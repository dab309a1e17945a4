//! What a qcow2 image must satisfy before it is written to, beyond what imago checks when it
//! opens it: the refcounts imago 0.2.6 allocates against must describe the structures already
//! in the file. Each check is a guard against a way a corrupt image breaks imago's allocator
//! (found by the fuzz targets and by review, docs/fuzzing.md); QEMU calls such images corrupt
//! and `qemu-img check -r all` repairs them. [`crate::open_for`] refuses to open one for
//! writing; an iothread that finds one serves it read-only.

use std::fs::File;
use std::os::unix::fs::FileExt;

use crate::be;

/// The most bytes of an L1 or refcount table read (QEMU's limit on an L1 table, imago's on
/// both: 32 MiB).
const MAX_L1_BYTES: u64 = 32 << 20;

/// The offset bits of an L1 table entry (the low 9 bits are reserved, the top ones flags).
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;

/// The offset bits of a refcount table entry (the low 9 bits are reserved; no flags).
const REFCOUNT_TABLE_OFFSET_MASK: u64 = !0x1ff;

/// Why the qcow2 image in `file` must not be written to, if it must not: its refcounts miss
/// its header ([`header_is_refcounted`]), its L2 tables are not each named once and counted
/// ([`l2_tables_are_counted_once`]), or its tables name clusters past the end of the file
/// ([`tables_lie_inside_the_file`]).
pub fn unwritable(file: &File) -> Option<&'static str> {
    if !tables_lie_inside_the_file(file) {
        Some(
            "an L1 or refcount table entry of the image names a table past the end of the file \
             (a truncated or corrupt image: `qemu-img check -r all` repairs a refcount block \
             there; an L2 table there needs the file grown back or the image converted with \
             `qemu-img convert`); refusing to write to it",
        )
    } else if !header_is_refcounted(file) {
        Some(
            "the image's refcounts do not cover its header (a corrupt refcount table: \
             `qemu-img check -r all` repairs it); refusing to write to it",
        )
    } else if !l2_tables_are_counted_once(file) {
        Some(
            "an L2 table of the image is named twice by its L1 table, or not counted in its \
             refcounts (a corrupt image: `qemu-img check -r all` repairs it); refusing to write \
             to it",
        )
    } else {
        None
    }
}

/// Whether the qcow2 image in `file` counts a reference to its own header cluster: refcount
/// table entry 0 names a refcount block, and that block's first entry is not 0.
///
/// imago 0.2.6 cannot allocate in an image where it is not (found by the `qcow2_image` fuzz
/// target): with no block for cluster 0 it puts a new one there, which entry 0 cannot name
/// (0 means "none"), looks again and recurses until the stack overflows; with a block that
/// counts cluster 0 as free it would hand out the header as a data cluster.
pub fn header_is_refcounted(file: &File) -> bool {
    Refcounts::new(file).is_some_and(|mut refcounts| refcounts.of(0).is_some_and(|n| n != 0))
}

/// Whether every L2 table the L1 table of the qcow2 image in `file` names is named once, and
/// counted (refcount not 0).
///
/// Two L1 entries naming one table make a write into one guest range change another; a table
/// whose refcount says free is handed out again by imago's allocator — as a data cluster or a
/// second table — and the guest's data and the mappings overwrite each other. imago keeps one
/// lock per table object, so such an image also lets one thread take a table's lock twice.
pub fn l2_tables_are_counted_once(file: &File) -> bool {
    let Some(mut refcounts) = Refcounts::new(file) else {
        return false;
    };
    let Some(mut tables) = l2_tables(file) else {
        return false;
    };
    let named = tables.len();
    tables.sort_unstable();
    tables.dedup();
    if tables.len() != named {
        return false;
    }
    let cluster_bits = refcounts.cluster_bits;
    // In ascending order, so that the refcount blocks are read once each.
    tables
        .iter()
        .all(|&offset| refcounts.of(offset >> cluster_bits).is_some_and(|n| n != 0))
}

/// Whether every L2 table the L1 table of the qcow2 image in `file` names, and every refcount
/// block its refcount table names, starts inside the file (always so for a block device, whose
/// size is not the file's).
///
/// imago reads what lies past the end as zeros, but writes such a table back where the entry
/// points: the iothread refuses a write that far out (a corrupt entry's), so a table there
/// would stay unwritable and fail every later write-back of the disk; and before it did, the
/// write grew the file to wherever the entry pointed.
///
/// A table it cannot read (a header that does not say, a table larger than imago allows) is
/// left to the other checks and to imago, which refuse it; the other table is still checked.
pub fn tables_lie_inside_the_file(file: &File) -> bool {
    let Ok(meta) = file.metadata() else {
        return true;
    };
    if !meta.file_type().is_file() {
        return true;
    }
    let end = meta.len();
    let l2 = l2_tables(file).unwrap_or_default();
    let blocks = refcount_blocks(file).unwrap_or_default();
    l2.iter().chain(&blocks).all(|&offset| offset < end)
}

/// The offsets of the L2 tables the L1 table of the qcow2 image in `file` names (0 entries
/// left out); `None` if the header cannot say or the table is larger than QEMU allows.
fn l2_tables(file: &File) -> Option<Vec<u64>> {
    let mut header = [0u8; 48];
    file.read_exact_at(&mut header, 0).ok()?;
    let l1_size = be::<4>(&header, 36)?;
    let l1_offset = be::<8>(&header, 40)?;
    let l1_bytes = l1_size.checked_mul(8).filter(|&n| n <= MAX_L1_BYTES)?;
    table_entries(file, l1_offset, l1_bytes, OFFSET_MASK)
}

/// The offsets of the refcount blocks the refcount table of the qcow2 image in `file` names (0
/// entries left out); `None` if the header cannot say or the table is larger than imago allows.
fn refcount_blocks(file: &File) -> Option<Vec<u64>> {
    let mut header = [0u8; 64];
    file.read_exact_at(&mut header, 0).ok()?;
    let cluster_bits = be::<4>(&header, 20).filter(|bits| (9..=21).contains(bits))?;
    let table_offset = be::<8>(&header, 48)?;
    let table_bytes = be::<4>(&header, 56)?
        .checked_mul(1u64 << cluster_bits)
        .filter(|&n| n <= MAX_L1_BYTES)?;
    table_entries(file, table_offset, table_bytes, REFCOUNT_TABLE_OFFSET_MASK)
}

/// The nonzero offsets (`mask`ed) of the `bytes / 8` big-endian entries of a table at `offset`
/// of `file` (what lies past the end of the file reads as zeros: no entry).
fn table_entries(file: &File, offset: u64, bytes: u64, mask: u64) -> Option<Vec<u64>> {
    let mut table = vec![0u8; blkplane_proto::usize_from(bytes)];
    let mut read = 0usize;
    while let Some(rest) = table.get_mut(read..).filter(|rest| !rest.is_empty()) {
        match file.read_at(rest, offset.saturating_add(read as u64)) {
            Ok(0) => break,
            Ok(n) => read = read.saturating_add(n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    Some(
        table
            .chunks_exact(8)
            .filter_map(|entry| be::<8>(entry, 0))
            .map(|entry| entry & mask)
            .filter(|&offset| offset != 0)
            .collect(),
    )
}

/// Reads refcounts of the image's clusters, keeping the refcount block it read last.
struct Refcounts<'a> {
    file: &'a File,
    cluster_bits: u32,
    /// log2 of the bits of one refcount.
    order: u32,
    table_offset: u64,
    /// Entries of the refcount table.
    table_entries: u64,
    /// The block read last: its offset and bytes.
    block: Option<(u64, Vec<u8>)>,
}

impl<'a> Refcounts<'a> {
    /// The refcount structures the header of `file` names; `None` if it cannot say.
    fn new(file: &'a File) -> Option<Self> {
        let mut header = [0u8; 104];
        let read = file.read_at(&mut header, 0).ok()?;
        let header = header.get(..read)?;
        let version = be::<4>(header, 4)?;
        let cluster_bits = u32::try_from(be::<4>(header, 20)?)
            .ok()
            .filter(|bits| (9..=21).contains(bits))?;
        // Version 2 has 16-bit refcounts; version 3 says (refcount_order, at byte 96).
        let order = if version >= 3 {
            be::<4>(header, 96)?
        } else {
            4
        };
        let order = u32::try_from(order).ok().filter(|&order| order <= 6)?;
        let table_offset = be::<8>(header, 48)?;
        let table_clusters = be::<4>(header, 56)?;
        let table_entries = table_clusters.checked_mul(1u64 << cluster_bits)? / 8;
        Some(Self {
            file,
            cluster_bits,
            order,
            table_offset,
            table_entries,
            block: None,
        })
    }

    /// The refcount of host cluster `cluster`; `None` if the structures cannot say (no block,
    /// or one outside the file).
    fn of(&mut self, cluster: u64) -> Option<u64> {
        // A block holds cluster size * 8 / refcount bits entries.
        let per_block_bits = self.cluster_bits.checked_add(3)?.checked_sub(self.order)?;
        let table_index = cluster >> per_block_bits;
        let index = cluster & (1u64 << per_block_bits).wrapping_sub(1);
        if table_index >= self.table_entries {
            return None;
        }
        let at = self.table_offset.checked_add(table_index.checked_mul(8)?)?;
        let mut entry = [0u8; 8];
        self.file.read_exact_at(&mut entry, at).ok()?;
        let block_offset = u64::from_be_bytes(entry) & !0x1ff;
        if block_offset == 0 {
            return None;
        }
        if self
            .block
            .as_ref()
            .is_none_or(|(at, _)| *at != block_offset)
        {
            let mut block = vec![0u8; 1usize << self.cluster_bits];
            self.file.read_exact_at(&mut block, block_offset).ok()?;
            self.block = Some((block_offset, block));
        }
        let (_, block) = self.block.as_ref()?;
        let bits = 1u64 << self.order;
        let first_bit = index.checked_mul(bits)?;
        let byte = blkplane_proto::usize_from(first_bit / 8);
        Some(if bits >= 8 {
            // A big-endian entry of bits / 8 bytes.
            block
                .get(byte..byte.checked_add(blkplane_proto::usize_from(bits / 8))?)?
                .iter()
                .fold(0u64, |acc, b| (acc << 8) | u64::from(*b))
        } else {
            // Entries narrower than a byte are packed from its lowest bit (as QEMU reads them).
            let shift = first_bit % 8;
            (u64::from(*block.get(byte)?) >> shift) & (1u64 << bits).wrapping_sub(1)
        })
    }
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    fn run(program: &str, args: &[&str]) {
        let out = Command::new(program)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{program} (tests/setup.sh installs qemu-utils): {e}"));
        assert!(out.status.success(), "{program} {args:?}: {out:?}");
    }

    /// A 4 GiB qcow2 image (64 KiB clusters) with data at 0 and at 1 GiB: two L2 tables.
    fn image(dir: &Path) -> PathBuf {
        let path = dir.join("two-tables.qcow2");
        let name = path.to_str().unwrap();
        run("qemu-img", &["create", "-q", "-f", "qcow2", name, "4G"]);
        run(
            "qemu-io",
            &[
                "-f",
                "qcow2",
                "-c",
                "write 0 64k",
                "-c",
                "write 1G 64k",
                name,
            ],
        );
        path
    }

    fn read_u64(file: &File, at: u64) -> u64 {
        let mut field = [0u8; 8];
        file.read_exact_at(&mut field, at).unwrap();
        u64::from_be_bytes(field)
    }

    #[test]
    fn l2_tables_named_twice_or_uncounted_make_an_image_unwritable() {
        let dir = std::env::temp_dir().join(format!("bp-integrity-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = image(&dir);
        let open = || {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap()
        };
        let file = open();
        assert_eq!(unwritable(&file), None);
        let l1 = read_u64(&file, 40);
        let (first, second) = (read_u64(&file, l1), read_u64(&file, l1 + 16));
        assert!(
            first & OFFSET_MASK != 0 && second & OFFSET_MASK != 0,
            "two L2 tables"
        );
        // The table of 1 GiB named for 2 GiB as well.
        file.write_all_at(&second.to_be_bytes(), l1 + 32).unwrap();
        assert!(!l2_tables_are_counted_once(&file));
        assert!(unwritable(&file).is_some_and(|why| why.contains("named twice")));
        file.write_all_at(&0u64.to_be_bytes(), l1 + 32).unwrap();
        assert_eq!(unwritable(&file), None);
        // The first table's refcount cleared (16-bit refcounts, one block for the file).
        let table = read_u64(&file, 48);
        let block = read_u64(&file, table) & !0x1ff;
        let cluster = (first & OFFSET_MASK) >> 16;
        file.write_all_at(&[0, 0], block + 2 * cluster).unwrap();
        assert!(!l2_tables_are_counted_once(&file));
        assert!(header_is_refcounted(&file));
        // A fresh image names no L2 table.
        let empty = dir.join("empty.qcow2");
        run(
            "qemu-img",
            &["create", "-q", "-f", "qcow2", empty.to_str().unwrap(), "1G"],
        );
        assert_eq!(unwritable(&File::open(&empty).unwrap()), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn tables_named_past_the_end_of_the_file_make_an_image_unwritable() {
        let dir = std::env::temp_dir().join(format!("bp-past-end-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = image(&dir);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        assert!(tables_lie_inside_the_file(&file));
        // The first cluster past the file's end (64 KiB clusters), with the flags an entry in
        // use carries.
        let past = file.metadata().unwrap().len().next_multiple_of(1 << 16);
        let l1 = read_u64(&file, 40);
        let flags = read_u64(&file, l1) & !OFFSET_MASK;
        // An L2 table there for 2 GiB, then a refcount block there for the second 2 GiB of
        // clusters the first block does not cover (its entries carry no flags).
        // A refcount table entry has no flags: its top bits are offset bits too.
        let reftable = read_u64(&file, 48);
        for (at, entry) in [
            (l1 + 32, flags | past),
            (reftable + 8, past),
            (reftable + 8, 1 << 60),
        ] {
            file.write_all_at(&entry.to_be_bytes(), at).unwrap();
            assert!(!tables_lie_inside_the_file(&file), "entry at {at}");
            assert!(
                unwritable(&file).is_some_and(|why| why.contains("past the end of the file")),
                "entry at {at}: {:?}",
                unwritable(&file)
            );
            file.write_all_at(&0u64.to_be_bytes(), at).unwrap();
            assert_eq!(unwritable(&file), None);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
