//! Growing a disk while it runs: the image grows, the capacity the guest reads grows, and the
//! VMM is told through CONFIG_CHANGE_MSG so that a running guest sees it at once.

use std::io::{Seek, SeekFrom};
use std::os::unix::fs::FileTypeExt;
use std::sync::Arc;

use blkplane_proto::v1::ResizeDone;
use log::{info, warn};

use crate::admin::Resize;
use crate::backend_channel::BackendChannel;
use crate::config::DiskConfig;
use crate::image::Image;
use crate::worker::{Command, Workers};
use blkplane_chain::ImageFormat;

/// Resizes the disk served by this frontend.
pub struct DiskResizer {
    disk: Arc<DiskConfig>,
    image: Arc<Image>,
    channel: Arc<BackendChannel>,
    /// The workers, whose iothread grows a qcow2 image (it owns the metadata).
    workers: Workers,
}

impl DiskResizer {
    /// A resizer for `disk` backed by `image`, notifying through `channel`; a qcow2 image is
    /// grown by the iothread behind `workers`.
    pub fn new(
        disk: Arc<DiskConfig>,
        image: Arc<Image>,
        channel: Arc<BackendChannel>,
        workers: Workers,
    ) -> Self {
        Self {
            disk,
            image,
            channel,
            workers,
        }
    }

    /// Has every iothread grow the qcow2 image (a qcow2 disk has one).
    fn grow_qcow2(&self, new_size: u64) -> Result<(), String> {
        for worker in self.workers.iter() {
            worker
                .call(|reply| Command::GrowImage {
                    size: new_size,
                    reply,
                })
                .map_err(|e| format!("growing the qcow2 image: {e}"))?
                .map_err(|e| format!("growing the qcow2 image to {new_size} bytes: {e}"))?;
        }
        Ok(())
    }
}

impl DiskResizer {
    /// Raises the capacity the guest reads and tells the VMM.
    fn announce(&self, new_size: u64) -> ResizeDone {
        self.disk.set_capacity_bytes(new_size);
        let guest_notified = match self.channel.config_changed() {
            Ok(sent) => sent,
            Err(e) => {
                warn!("resize: CONFIG_CHANGE_MSG: {e}");
                false
            }
        };
        info!("resized to {new_size} bytes (guest notified: {guest_notified})");
        ResizeDone {
            capacity_bytes: self.disk.capacity_bytes(),
            guest_notified,
        }
    }
}

impl Resize for DiskResizer {
    fn resize(&self, new_size: u64) -> Result<ResizeDone, String> {
        let block = u64::from(self.disk.block_size);
        if !new_size.is_multiple_of(block) {
            return Err(format!(
                "new_size {new_size} is not a multiple of the block size {block}"
            ));
        }
        let current = self.disk.capacity_bytes();
        if new_size < current {
            return Err(format!(
                "new_size {new_size} is smaller than the current size {current}: shrinking is refused"
            ));
        }
        let file = match self.image.as_ref() {
            Image::File(file) => file,
            Image::Null { .. } => return Err("a null image cannot be resized".into()),
        };
        if file.format == ImageFormat::Qcow2 {
            // The virtual size is in the header: the file grows with allocations.
            if new_size > current {
                self.grow_qcow2(new_size)?;
            }
            return Ok(self.announce(new_size));
        }
        let file = &file.buffered;
        let metadata = file.metadata().map_err(|e| format!("image: {e}"))?;
        if metadata.file_type().is_block_device() {
            // A block device cannot be grown from here; it must already be large enough.
            let size = (&*file)
                .seek(SeekFrom::End(0))
                .map_err(|e| format!("image size: {e}"))?;
            if size < new_size {
                return Err(format!(
                    "the block device holds {size} bytes, less than new_size {new_size}"
                ));
            }
        } else if metadata.len() < new_size {
            file.set_len(new_size)
                .map_err(|e| format!("growing the image to {new_size} bytes: {e}"))?;
        }
        Ok(self.announce(new_size))
    }

    fn capacity_bytes(&self) -> u64 {
        self.disk.capacity_bytes()
    }
}
