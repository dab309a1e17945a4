//! The ranges of the image a pass sends: the marked blocks of a bitmap word by word, or an
//! allocated extent, cut into chunks of at most [`CHUNK`](super::CHUNK) bytes that end
//! within the image.

/// A byte range of the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// First byte.
    pub offset: u64,
    /// Length in bytes (not zero).
    pub len: u64,
}

impl Range {
    /// The first byte after the range.
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(self.len)
    }
}

/// Cuts `[offset, end)` (clamped to `capacity`) into ranges of at most `chunk` bytes, each
/// but the first starting at a multiple of `chunk`.
pub fn chunks(offset: u64, end: u64, capacity: u64, chunk: u64) -> impl Iterator<Item = Range> {
    let end = end.min(capacity);
    let chunk = chunk.max(1);
    let mut at = offset;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let boundary = (at / chunk).saturating_add(1).saturating_mul(chunk);
        let next = boundary.min(end);
        let range = Range {
            offset: at,
            len: next - at,
        };
        at = next;
        Some(range)
    })
}

/// Merges the blocks of one bitmap word (`word`, the `index`th, `granularity` bytes per bit)
/// into runs of set bits, appended to `out` as byte ranges clamped to `capacity`; a run that
/// continues the last range of `out` extends it (up to `max_len` bytes).
pub fn runs_of_word(
    index: u64,
    word: u64,
    granularity: u64,
    capacity: u64,
    max_len: u64,
    out: &mut Vec<Range>,
) {
    let mut rest = word;
    while rest != 0 {
        let first = u64::from(rest.trailing_zeros());
        let ones = u64::from((rest >> first).trailing_ones());
        rest = if first + ones >= 64 {
            0
        } else {
            rest & !(((1u64 << ones) - 1) << first)
        };
        let block = index.saturating_mul(64).saturating_add(first);
        let offset = block.saturating_mul(granularity);
        if offset >= capacity {
            return;
        }
        let end = offset
            .saturating_add(ones.saturating_mul(granularity))
            .min(capacity);
        match out.last_mut() {
            Some(last) if last.end() == offset && end - last.offset <= max_len => {
                last.len = end - last.offset;
            }
            _ => out.push(Range {
                offset,
                len: end - offset,
            }),
        }
    }
}

/// Whether every byte of `buf` is zero.
pub fn is_zero(buf: &[u8]) -> bool {
    // Compared in 8-byte words: a 1 MiB chunk is read every pass.
    let (head, words, tail) = {
        // SAFETY: u64 has no invalid bit patterns; align_to only reinterprets the aligned
        // middle of the byte slice, which it borrows for no longer than `buf`.
        unsafe { buf.align_to::<u64>() }
    };
    head.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 64 * 1024;

    #[test]
    fn chunks_cut_at_multiples_and_stop_at_the_capacity() {
        let got: Vec<_> = chunks(100, 3 << 20, (2 << 20) + 512, 1 << 20).collect();
        assert_eq!(
            got,
            vec![
                Range {
                    offset: 100,
                    len: (1 << 20) - 100
                },
                Range {
                    offset: 1 << 20,
                    len: 1 << 20
                },
                Range {
                    offset: 2 << 20,
                    len: 512
                },
            ]
        );
        assert_eq!(chunks(10, 10, 100, 4).count(), 0);
        assert_eq!(chunks(200, 300, 100, 4).count(), 0);
    }

    #[test]
    fn runs_merge_neighbours_within_a_word_and_across_words() {
        let mut out = Vec::new();
        // Bits 0-1 and 5, then bit 63 of word 0 continuing into bit 0 of word 1.
        runs_of_word(0, 0b10_0011 | 1 << 63, G, u64::MAX, 1 << 20, &mut out);
        runs_of_word(1, 1, G, u64::MAX, 1 << 20, &mut out);
        assert_eq!(
            out,
            vec![
                Range {
                    offset: 0,
                    len: 2 * G
                },
                Range {
                    offset: 5 * G,
                    len: G
                },
                Range {
                    offset: 63 * G,
                    len: 2 * G
                },
            ]
        );
    }

    #[test]
    fn runs_stop_at_the_capacity_and_respect_the_length_cap() {
        let mut out = Vec::new();
        runs_of_word(0, u64::MAX, G, 3 * G + 512, u64::MAX, &mut out);
        assert_eq!(
            out,
            vec![Range {
                offset: 0,
                len: 3 * G + 512
            }]
        );
        let mut out = Vec::new();
        runs_of_word(0, u64::MAX, G, u64::MAX, 16 * G, &mut out);
        runs_of_word(1, 0b1, G, u64::MAX, 16 * G, &mut out);
        // One word is one run of 64 blocks, longer than the cap: kept whole (the reader cuts
        // it into chunks); the next word's run does not extend it.
        assert_eq!(out.len(), 2);
        assert_eq!(out[1].offset, 64 * G);
    }

    #[test]
    fn zero_detection_sees_a_single_byte_anywhere() {
        let mut buf = vec![0u8; 4099];
        assert!(is_zero(&buf));
        assert!(is_zero(&buf[1..]));
        for at in [0, 1, 7, 8, 2048, 4098] {
            buf[at] = 1;
            assert!(!is_zero(&buf), "byte {at}");
            assert!(!is_zero(&buf[1..]) || at == 0, "byte {at}, unaligned");
            buf[at] = 0;
        }
    }
}
