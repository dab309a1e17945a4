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
use blkplane_chain::ImageFormat;

/// Resizes the disk served by this frontend.
pub struct DiskResizer {
    disk: Arc<DiskConfig>,
    image: Arc<Image>,
    channel: Arc<BackendChannel>,
}

impl DiskResizer {
    /// A resizer for `disk` backed by `image`, notifying through `channel`.
    pub fn new(disk: Arc<DiskConfig>, image: Arc<Image>, channel: Arc<BackendChannel>) -> Self {
        Self {
            disk,
            image,
            channel,
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
            Image::File(file) if file.format == ImageFormat::Qcow2 => {
                return Err("resizing a qcow2 image is not supported yet".into())
            }
            Image::File(file) => &file.buffered,
            Image::Null { .. } => return Err("a null image cannot be resized".into()),
        };
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
        self.disk.set_capacity_bytes(new_size);
        let guest_notified = match self.channel.config_changed() {
            Ok(sent) => sent,
            Err(e) => {
                warn!("resize: CONFIG_CHANGE_MSG: {e}");
                false
            }
        };
        info!("resized to {new_size} bytes (guest notified: {guest_notified})");
        Ok(ResizeDone {
            capacity_bytes: self.disk.capacity_bytes(),
            guest_notified,
        })
    }

    fn capacity_bytes(&self) -> u64 {
        self.disk.capacity_bytes()
    }
}
