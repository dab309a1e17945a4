//! The rules a request can break, one name each: the frontend counts rejections by rule (as
//! Firecracker's block device keeps a named counter per failure), logs the name, and
//! blkplaned exports it as the `reason` label of `blkplane_queue_rejected_total`. Which error
//! maps to which rule is the parser's (`request.rs`); this module only names and numbers the
//! rules, so that the counters (`stats.rs`) need not know the parser.

macro_rules! reasons {
    ($($(#[doc = $doc:literal])* $variant:ident => $name:literal,)*) => {
        /// A validation rule a request broke.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum RejectReason {
            $($(#[doc = $doc])* $variant,)*
        }

        impl RejectReason {
            /// Every rule, in the order the counters and the admin channel list them.
            pub const ALL: [RejectReason; [$(RejectReason::$variant),*].len()] =
                [$(RejectReason::$variant),*];

            /// The rule's name in snake_case, as logs and metrics show it.
            pub const fn name(self) -> &'static str {
                match self {
                    $(RejectReason::$variant => $name,)*
                }
            }
        }
    };
}

reasons! {
    /// The avail ring names a head outside the descriptor table (this breaks the ring rather
    /// than rejecting one request, but is named all the same).
    HeadOutOfRange => "head_out_of_range",
    /// A `next` field points outside its descriptor table.
    NextOutOfRange => "next_out_of_range",
    /// A descriptor table entry lies outside guest memory.
    TableOutsideMemory => "table_outside_memory",
    /// A chain longer than the queue (a loop, most likely).
    ChainTooLong => "chain_too_long",
    /// An indirect table with too many entries, or a loop in it.
    IndirectTooLong => "indirect_too_long",
    /// An indirect descriptor inside an indirect table.
    NestedIndirect => "nested_indirect",
    /// An indirect descriptor that also has NEXT set.
    IndirectWithNext => "indirect_with_next",
    /// An indirect table whose length is 0 or not a multiple of 16.
    IndirectTableLength => "indirect_table_length",
    /// No device-writable descriptor for the status byte.
    StatusMissing => "status_missing",
    /// The last descriptor, where the status goes, is device-readable.
    StatusReadOnly => "status_read_only",
    /// The status descriptor has length 0.
    StatusEmpty => "status_empty",
    /// A descriptor's address plus length wraps around.
    AddressOverflow => "address_overflow",
    /// A descriptor lies (partly) outside guest memory.
    OutsideMemory => "outside_memory",
    /// A device-readable descriptor after a device-writable one.
    ReadableAfterWritable => "readable_after_writable",
    /// Fewer than 16 bytes of request header.
    HeaderTooShort => "header_too_short",
    /// Data buffers in the wrong direction for the request type.
    WrongDirection => "wrong_direction",
    /// A request type the device does not implement.
    UnsupportedType => "unsupported_type",
    /// A data length that is not a multiple of the block size.
    MisalignedLength => "misaligned_length",
    /// A sector that is not aligned to the block size.
    MisalignedSector => "misaligned_sector",
    /// A sector or length whose byte offset overflows.
    SectorOverflow => "sector_overflow",
    /// A request reaching past the end of the disk.
    BeyondCapacity => "beyond_capacity",
    /// A write, discard or write-zeroes on a read-only disk.
    ReadOnly => "read_only",
    /// A GET_ID buffer smaller than 20 bytes.
    GetIdTooSmall => "get_id_too_small",
    /// A discard or write-zeroes payload that is empty or not whole 16-byte ranges.
    RangeListLength => "range_list_length",
    /// More discard or write-zeroes ranges than advertised.
    TooManyRanges => "too_many_ranges",
    /// A discard or write-zeroes range of zero sectors.
    EmptyRange => "empty_range",
    /// A discard or write-zeroes range larger than advertised.
    RangeTooLarge => "range_too_large",
    /// Discard or write-zeroes flags the device does not support.
    UnsupportedFlags => "unsupported_flags",
    /// More data segments than a ring slot holds.
    TooManySegments => "too_many_segments",
}

impl RejectReason {
    /// How many rules there are (the length of the counter array).
    pub const COUNT: usize = Self::ALL.len();

    /// The rule's place in [`RejectReason::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn every_rule_has_its_own_name_and_place() {
        let names: HashSet<_> = RejectReason::ALL.iter().map(|r| r.name()).collect();
        assert_eq!(names.len(), RejectReason::COUNT);
        for (i, r) in RejectReason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
            let name = r.name();
            assert!(
                name.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
                "{name}"
            );
        }
    }
}
