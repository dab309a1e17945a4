//! The destination's side of a copy: each message of the stream checked (the other node is
//! trusted as a node, not its every byte: a range outside the disk is refused, never
//! written) and applied to the new image.

use thiserror::Error;

use super::image::DestinationImage;
use crate::pb::MigrationData;

/// The largest `data` a message may carry: twice what the source sends (a 1 MiB chunk), well
/// within the gRPC server's 4 MiB message limit.
pub const MAX_DATA: usize = 2 << 20;

/// Why a message of the stream is refused (the stream ends with this error).
#[derive(Debug, Error)]
pub enum SinkError {
    /// `data` and `zero_length` both set, or a range with either and a marker.
    #[error("a message carries {0}: one thing per message")]
    Mixed(&'static str),
    /// More data than a message may carry.
    #[error("{0} bytes of data in one message: at most {MAX_DATA}")]
    TooLarge(usize),
    /// The range lies (partly) outside the disk.
    #[error("bytes {offset}..+{len} lie outside the disk")]
    OutOfRange {
        /// Its offset.
        offset: u64,
        /// Its length.
        len: u64,
    },
    /// Writing the image failed.
    #[error("writing the image: {0}")]
    Io(#[from] std::io::Error),
}

/// What a message did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Bytes written (or zeroed).
    Wrote(u64),
    /// The image is complete and durable (its fdatasync took this long): serve.
    Complete(std::time::Duration),
    /// The source serves again: stop serving.
    Reopened,
    /// Nothing (an empty message).
    Nothing,
}

/// The destination image a stream writes.
#[derive(Debug)]
pub struct Sink {
    image: DestinationImage,
    written: u64,
}

impl Sink {
    /// Writes into `image`.
    pub fn new(image: DestinationImage) -> Sink {
        Sink { image, written: 0 }
    }

    /// Bytes written (and zeroed) so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Checks and applies one message (its `disk` and `source_disk` were checked by the
    /// caller).
    pub fn apply(&mut self, m: &MigrationData) -> Result<Step, SinkError> {
        let has_data = !m.data.is_empty();
        let has_zero = m.zero_length != 0;
        let markers = usize::from(m.complete) + usize::from(m.reopened);
        if has_data && has_zero {
            return Err(SinkError::Mixed("both data and a zero range"));
        }
        if markers > 1 {
            return Err(SinkError::Mixed("both complete and reopened"));
        }
        if markers == 1 && (has_data || has_zero) {
            return Err(SinkError::Mixed("a range and a marker"));
        }
        if m.complete {
            let started = std::time::Instant::now();
            self.image.sync()?;
            return Ok(Step::Complete(started.elapsed()));
        }
        if m.reopened {
            return Ok(Step::Reopened);
        }
        if has_data {
            if m.data.len() > MAX_DATA {
                return Err(SinkError::TooLarge(m.data.len()));
            }
            let len = m.data.len() as u64;
            self.check(m.offset, len)?;
            self.image.write(m.offset, &m.data)?;
            self.written = self.written.saturating_add(len);
            return Ok(Step::Wrote(len));
        }
        if has_zero {
            self.check(m.offset, m.zero_length)?;
            self.image.zero(m.offset, m.zero_length)?;
            self.written = self.written.saturating_add(m.zero_length);
            return Ok(Step::Wrote(m.zero_length));
        }
        Ok(Step::Nothing)
    }

    /// [`DestinationImage::discard`]: the part of a copy that failed is not kept.
    pub fn discard(&mut self) -> std::io::Result<()> {
        self.written = 0;
        self.image.discard()
    }

    /// fdatasync of the image.
    pub fn sync(&self) -> std::io::Result<()> {
        self.image.sync()
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), SinkError> {
        if self.image.within(offset, len) {
            Ok(())
        } else {
            Err(SinkError::OutOfRange { offset, len })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mirror::image::create_destination;

    #[test]
    fn messages_are_checked_before_anything_is_written() {
        let path = std::env::temp_dir().join(format!("blkplane-sink-{}.img", std::process::id()));
        let _ = std::fs::remove_file(&path);
        create_destination(&path, 1 << 20).unwrap();
        let mut sink = Sink::new(DestinationImage::open(&path, 1 << 20).unwrap());
        let data = |offset, data: Vec<u8>| MigrationData {
            offset,
            data,
            ..MigrationData::default()
        };
        assert_eq!(
            sink.apply(&data(4096, vec![9; 4096])).unwrap(),
            Step::Wrote(4096)
        );
        for bad in [
            data((1 << 20) - 10, vec![1; 11]),
            data(u64::MAX, vec![1; 2]),
            MigrationData {
                offset: 0,
                zero_length: (1 << 20) + 1,
                ..MigrationData::default()
            },
            MigrationData {
                zero_length: 1,
                ..data(0, vec![1])
            },
            MigrationData {
                complete: true,
                ..data(0, vec![1])
            },
            MigrationData {
                complete: true,
                reopened: true,
                ..MigrationData::default()
            },
        ] {
            assert!(sink.apply(&bad).is_err(), "{bad:?}");
        }
        assert_eq!(sink.written(), 4096);
        assert!(matches!(
            sink.apply(&MigrationData {
                complete: true,
                ..MigrationData::default()
            })
            .unwrap(),
            Step::Complete(_)
        ));
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes[4096..8192].iter().all(|&b| b == 9));
        assert!(bytes[..4096].iter().all(|&b| b == 0));
        assert!(bytes[1 << 19..].iter().all(|&b| b == 0));
        std::fs::remove_file(&path).unwrap();
    }
}
