//! A block device as the image: a loop device over a random file. Capacity comes from the
//! device size, O_DIRECT is used, and discard / write-zeroes go to the block layer.
//!
//! Needs root and `losetup` (CI runs as root); elsewhere the test says why it did not run.

use std::path::{Path, PathBuf};
use std::process::Command;

use blkplane_tests::client::errno_name;
use blkplane_tests::*;

const MIB: u64 = 1 << 20;
const CHUNK: usize = 64 * 1024;

/// A loop device, detached on drop.
struct LoopDevice(PathBuf);

impl LoopDevice {
    fn attach(file: &Path) -> Result<LoopDevice, String> {
        let out = Command::new("losetup")
            .args(["--find", "--show"])
            .arg(file)
            .output()
            .map_err(|e| format!("losetup: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "losetup failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        Ok(LoopDevice(PathBuf::from(dev)))
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
    }
}

#[test]
fn loop_device_image() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("not run: attaching a loop device needs root");
        return;
    }
    let dir = TempDir::new("blockdev");
    let size = 16 * MIB;
    let file = create_random_image(&dir.join("backing.img"), size, 77);
    let original = read_file(&file);
    let dev = match LoopDevice::attach(&file) {
        Ok(dev) => dev,
        // A machine without loop devices (a container without /dev/loop-control) cannot run
        // this; as root with losetup present it must work.
        Err(e) if !Path::new("/dev/loop-control").exists() => {
            println!("not run: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let fe = Frontend::start(&dev.0, &["--cache", "direct"]);
    let mut c = Client::connect(fe.socket()).unwrap_or_else(|e| panic!("connect: {e}"));
    assert_eq!(c.capacity(), size, "capacity of the block device");
    let q = c.queue(0);
    let head = ok(q.read_at(0, CHUNK));
    assert_same_data("existing data", &head, &original[..CHUNK]);
    let chunks = 64;
    q.pipeline(
        chunks,
        8,
        |i, slot| {
            slot[..CHUNK].copy_from_slice(&pattern(i as u64, CHUNK));
            Op::Write {
                offset: (i * CHUNK) as u64,
                buf: 0,
                len: CHUNK,
            }
        },
        |i, _, ret| assert_eq!(ret, 0, "write {i}: {}", errno_name(-ret)),
    );
    ok(q.run(&Op::Discard {
        offset: 8 * MIB,
        len: MIB,
    }));
    ok(q.run(&Op::WriteZeroes {
        offset: 10 * MIB,
        len: MIB,
        unmap: false,
    }));
    ok(q.flush());
    for i in [0, chunks / 2, chunks - 1] {
        let got = ok(q.read_at((i * CHUNK) as u64, CHUNK));
        assert_same_data(&format!("chunk {i}"), &got, &pattern(i as u64, CHUNK));
    }
    let zeros = ok(q.read_at(10 * MIB, MIB as usize));
    assert!(
        zeros.iter().all(|&b| b == 0),
        "write-zeroes on a block device"
    );
    drop(c);
    fe.finish();
    drop(dev);
    // What the guest wrote reached the backing file through the block device.
    let after = read_file(&file);
    for i in 0..chunks {
        let at = i * CHUNK;
        assert_same_data(
            &format!("backing file chunk {i}"),
            &after[at..at + CHUNK],
            &pattern(i as u64, CHUNK),
        );
    }
    assert!(after[(10 * MIB) as usize..(11 * MIB) as usize]
        .iter()
        .all(|&b| b == 0));
    println!("loop device: capacity {size}, O_DIRECT writes/reads verified, discard and write-zeroes ok, backing file matches");
}

fn ok<T>(r: Result<T, i32>) -> T {
    r.unwrap_or_else(|e| panic!("I/O failed: {}", errno_name(e)))
}
