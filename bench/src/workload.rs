//! The fio-style workloads, the targets they run against, and the images those targets serve.

use std::fmt;

/// One fio-style job: what every client thread does, and how many threads (one per queue).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    /// Name used on the command line and in the report.
    pub name: &'static str,
    /// Writes (true) or reads.
    pub write: bool,
    /// Random offsets (true) or sequential.
    pub random: bool,
    /// Bytes per request.
    pub block_size: usize,
    /// Requests in flight per queue (fio's iodepth).
    pub depth: usize,
    /// Queues, each driven by its own client thread and served by its own back-end queue
    /// (fio's numjobs).
    pub queues: usize,
}

/// Every workload, in report order.
pub const WORKLOADS: [Workload; 8] = [
    Workload {
        name: "randread-4k-qd1",
        write: false,
        random: true,
        block_size: 4096,
        depth: 1,
        queues: 1,
    },
    Workload {
        name: "randwrite-4k-qd1",
        write: true,
        random: true,
        block_size: 4096,
        depth: 1,
        queues: 1,
    },
    Workload {
        name: "randread-4k-qd4",
        write: false,
        random: true,
        block_size: 4096,
        depth: 4,
        queues: 1,
    },
    Workload {
        name: "randread-4k-qd32",
        write: false,
        random: true,
        block_size: 4096,
        depth: 32,
        queues: 1,
    },
    Workload {
        name: "randread-4k-qd32-2q",
        write: false,
        random: true,
        block_size: 4096,
        depth: 32,
        queues: 2,
    },
    Workload {
        name: "randwrite-4k-qd32",
        write: true,
        random: true,
        block_size: 4096,
        depth: 32,
        queues: 1,
    },
    Workload {
        name: "read-128k-qd8",
        write: false,
        random: false,
        block_size: 128 << 10,
        depth: 8,
        queues: 1,
    },
    Workload {
        name: "write-128k-qd8",
        write: true,
        random: false,
        block_size: 128 << 10,
        depth: 8,
        queues: 1,
    },
];

impl Workload {
    /// One line for the report: what fio would call it.
    pub fn describe(&self) -> String {
        let rw = match (self.random, self.write) {
            (true, false) => "randread",
            (true, true) => "randwrite",
            (false, false) => "read",
            (false, true) => "write",
        };
        let jobs = if self.queues > 1 {
            format!(
                ", {} client threads on {} queues (QD {} each)",
                self.queues, self.queues, self.depth
            )
        } else {
            String::new()
        };
        format!(
            "rw={rw} bs={}k iodepth={}{jobs}",
            self.block_size >> 10,
            self.depth
        )
    }
}

/// What serves the workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    /// blkplane-frontend and its iothreads, over vhost-user.
    Blkplane,
    /// qemu-storage-daemon's vhost-user-blk export.
    Qsd,
    /// cloud-hypervisor's `vhost_user_block` (built from its source; `--ch-binary`).
    Ch,
    /// No back-end: libblkio's io_uring driver on the image itself (the ceiling).
    Ceiling,
}

impl Target {
    /// Every target, in report order.
    pub const ALL: [Target; 4] = [Target::Blkplane, Target::Qsd, Target::Ch, Target::Ceiling];

    /// The other back-ends blkplane is compared with, row by row against the best of them.
    pub const PEERS: [Target; 2] = [Target::Qsd, Target::Ch];

    /// The name used on the command line and in the report.
    pub fn name(self) -> &'static str {
        match self {
            Self::Blkplane => "blkplane",
            Self::Qsd => "qsd",
            Self::Ch => "ch",
            Self::Ceiling => "ceiling",
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What is behind the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ImageKind {
    /// A raw image file in tmpfs (/dev/shm by default): the data path plus a memory copy.
    Shm,
    /// blkplane's `null:SIZE`, qsd's `null-co,read-zeroes=on`: the data path alone.
    Null,
    /// A raw image file on the machine's real disk (/var/tmp by default, never tmpfs), opened
    /// with O_DIRECT by every target: a real device's latency.
    Disk,
    /// A qcow2 image in tmpfs with every cluster allocated (converted from pseudo-random raw
    /// data, 64 KiB clusters), served by blkplane and qsd: the metadata lookup on top of shm.
    Qcow2,
    /// A fresh (empty) qcow2 image in tmpfs with 4 KiB clusters, made anew for every run:
    /// writes allocate.
    Qcow2Fresh,
    /// A qcow2 image on the real disk (64 KiB clusters, every one allocated, converted from
    /// pseudo-random raw data), opened with O_DIRECT: the metadata lookup on top of a device.
    Qcow2Disk,
    /// A fresh (empty) qcow2 image on the real disk with 4 KiB clusters, made anew for every
    /// run and opened with O_DIRECT: allocating writes on a device.
    Qcow2DiskFresh,
    /// A fresh qcow2 overlay (64 KiB clusters) on the disk's raw image, made anew for every run
    /// (the base dropped from the page cache) and opened with O_DIRECT: a thin clone of a
    /// golden image, whose first write into each cluster copies the rest of it from the base.
    Qcow2Overlay,
}

impl ImageKind {
    /// Every image kind, in report order.
    pub const ALL: [ImageKind; 8] = [
        ImageKind::Shm,
        ImageKind::Null,
        ImageKind::Disk,
        ImageKind::Qcow2,
        ImageKind::Qcow2Fresh,
        ImageKind::Qcow2Disk,
        ImageKind::Qcow2DiskFresh,
        ImageKind::Qcow2Overlay,
    ];

    /// Whether this is a qcow2 image.
    pub fn is_qcow2(self) -> bool {
        matches!(
            self,
            Self::Qcow2
                | Self::Qcow2Fresh
                | Self::Qcow2Disk
                | Self::Qcow2DiskFresh
                | Self::Qcow2Overlay
        )
    }

    /// Whether the image is a file on the machine's real disk (`--disk-dir`), opened with
    /// O_DIRECT by every target.
    pub fn on_disk(self) -> bool {
        matches!(
            self,
            Self::Disk | Self::Qcow2Disk | Self::Qcow2DiskFresh | Self::Qcow2Overlay
        )
    }

    /// The name used on the command line and in the report.
    pub fn name(self) -> &'static str {
        match self {
            Self::Shm => "shm",
            Self::Null => "null",
            Self::Disk => "disk",
            Self::Qcow2 => "qcow2",
            Self::Qcow2Fresh => "qcow2-fresh",
            Self::Qcow2Disk => "qcow2-disk",
            Self::Qcow2DiskFresh => "qcow2-disk-fresh",
            Self::Qcow2Overlay => "qcow2-overlay",
        }
    }

    /// Whether `target` can serve this kind: a null image has no io_uring ceiling (there is no
    /// file to drive) and no ch (`vhost_user_block` serves files only).
    pub fn has(self, target: Target) -> bool {
        self.skip_reason(target).is_none()
    }

    /// Why `target` does not run on this kind, for the report; `None` if it does.
    pub fn skip_reason(self, target: Target) -> Option<&'static str> {
        match (self, target) {
            (Self::Null, Target::Ceiling) => Some("no file to drive directly"),
            (Self::Null, Target::Ch) => {
                Some("cloud-hypervisor's vhost_user_block serves image files only")
            }
            (kind, Target::Ceiling) if kind.is_qcow2() => {
                Some("io_uring on the file cannot read qcow2")
            }
            // Its vhost_user_block opens the image file as a raw disk (no format detection:
            // qcow2 is only in cloud-hypervisor's own virtio-blk), so it has no qcow2 row.
            (kind, Target::Ch) if kind.is_qcow2() => {
                Some("cloud-hypervisor's vhost_user_block serves every file raw, not qcow2")
            }
            _ => None,
        }
    }
}

impl fmt::Display for ImageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Parses a comma-separated list of names into the items `all` has, in the order of `all`.
pub fn select<T: Copy>(
    list: &str,
    all: &[T],
    name: impl Fn(&T) -> &'static str,
) -> Result<Vec<T>, String> {
    let mut wanted: Vec<&str> = list
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if wanted.is_empty() {
        return Err("empty list".into());
    }
    let known: Vec<&str> = all.iter().map(&name).collect();
    if let Some(bad) = wanted.iter().find(|w| !known.contains(w)) {
        return Err(format!("unknown name {bad:?}; known: {}", known.join(", ")));
    }
    wanted.dedup();
    Ok(all
        .iter()
        .filter(|item| wanted.contains(&name(item)))
        .copied()
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_select_in_canonical_order() {
        let got = select("qsd,blkplane", &Target::ALL, |t| t.name()).unwrap();
        assert_eq!(got, [Target::Blkplane, Target::Qsd]);
        assert!(select("qsd,nope", &Target::ALL, |t| t.name()).is_err());
        assert!(select(",", &Target::ALL, |t| t.name()).is_err());
        let all = select("write-128k-qd8,randread-4k-qd1", &WORKLOADS, |w| w.name).unwrap();
        assert_eq!(all.len(), 2);
        assert_eq!(all[0].name, "randread-4k-qd1");
    }

    #[test]
    fn null_images_have_no_ceiling_and_no_ch() {
        assert!(!ImageKind::Null.has(Target::Ceiling));
        assert!(!ImageKind::Null.has(Target::Ch));
        assert!(ImageKind::Null.skip_reason(Target::Ch).is_some());
        assert!(ImageKind::Shm.has(Target::Ceiling));
        assert!(ImageKind::Null.has(Target::Qsd));
        for target in Target::ALL {
            assert!(ImageKind::Disk.has(target), "{target}");
            assert!(ImageKind::Shm.has(target), "{target}");
        }
    }

    #[test]
    fn new_targets_images_and_workloads_parse() {
        let got = select("ch,qsd", &Target::ALL, |t| t.name()).unwrap();
        assert_eq!(got, [Target::Qsd, Target::Ch]);
        let got = select("disk,shm", &ImageKind::ALL, |i| i.name()).unwrap();
        assert_eq!(got, [ImageKind::Shm, ImageKind::Disk]);
        let got = select(
            "randread-4k-qd32,randread-4k-qd4,randwrite-4k-qd1,randread-4k-qd1",
            &WORKLOADS,
            |w| w.name,
        )
        .unwrap();
        let names: Vec<_> = got.iter().map(|w| w.name).collect();
        // Report order: QD1 read, QD1 write, QD4, QD32.
        assert_eq!(
            names,
            [
                "randread-4k-qd1",
                "randwrite-4k-qd1",
                "randread-4k-qd4",
                "randread-4k-qd32"
            ]
        );
        let qd1w = got[1];
        assert!(qd1w.write && qd1w.random && qd1w.depth == 1 && qd1w.block_size == 4096);
        assert_eq!(got[2].describe(), "rw=randread bs=4k iodepth=4");
        // Names are unique.
        for (i, w) in WORKLOADS.iter().enumerate() {
            assert!(
                WORKLOADS[i + 1..].iter().all(|x| x.name != w.name),
                "{}",
                w.name
            );
        }
    }
}
