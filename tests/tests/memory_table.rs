//! Memory-table changes while I/O runs: every ADD_MEM_REG / REM_MEM_REG makes the frontend
//! quiesce its iothreads, hand them the new table and resume. No request may be lost or fail,
//! and a region added mid-run must be usable by the iothreads straight away.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use blkplane_tests::client::errno_name;
use blkplane_tests::*;

const MIB: u64 = 1 << 20;
const CHUNK: usize = 64 * 1024;

#[test]
fn regions_added_and_removed_during_io() {
    let dir = TempDir::new("memtable");
    let size = 16 * MIB;
    let img = create_image(&dir.join("disk.img"), size);
    let fe = Frontend::start(&img, &[]);
    let iothreads = fe.wait_iothreads(1, &[], Duration::from_secs(10));
    let mut c = Client::connect_with(
        fe.socket(),
        &ClientOptions {
            buf_size: 8 * CHUNK,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("connect: {e}"));
    let chunks = (size / CHUNK as u64) as usize;
    let io_done = AtomicBool::new(false);
    let mut changes = 0usize;
    {
        let (blkio, queues) = c.split_mut();
        let q = &mut queues[0];
        std::thread::scope(|s| {
            let io_done = &io_done;
            s.spawn(move || {
                // Two full write+verify passes at queue depth 8.
                for round in 0..2u64 {
                    q.pipeline(
                        chunks,
                        8,
                        |i, slot| {
                            slot[..CHUNK]
                                .copy_from_slice(&pattern((round << 32) | i as u64, CHUNK));
                            Op::Write {
                                offset: (i * CHUNK) as u64,
                                buf: 0,
                                len: CHUNK,
                            }
                        },
                        |i, _, ret| assert_eq!(ret, 0, "write {i}: {}", errno_name(-ret)),
                    );
                    q.pipeline(
                        chunks,
                        8,
                        |i, _| Op::Read {
                            offset: (i * CHUNK) as u64,
                            buf: 0,
                            len: CHUNK,
                        },
                        |i, slot, ret| {
                            assert_eq!(ret, 0, "read {i}: {}", errno_name(-ret));
                            assert_same_data(
                                &format!("round {round} chunk {i}"),
                                &slot[..CHUNK],
                                &pattern((round << 32) | i as u64, CHUNK),
                            );
                        },
                    );
                }
                io_done.store(true, Ordering::SeqCst);
            });
            // Meanwhile: add and remove regions as fast as the frontend accepts them.
            while !io_done.load(Ordering::SeqCst) {
                let region = blkio.alloc_mem_region(MIB as usize).expect("alloc region");
                blkio
                    .map_mem_region(&region)
                    .expect("ADD_MEM_REG during I/O");
                blkio.unmap_mem_region(&region);
                blkio.free_mem_region(&region);
                changes += 1;
            }
        });
        // A region added now is in every iothread's table: read into it.
        let region = blkio.alloc_mem_region(MIB as usize).expect("alloc region");
        blkio.map_mem_region(&region).expect("ADD_MEM_REG");
        // SAFETY: the region is mapped for MIB bytes until unmapped below.
        let buf = region.addr as *mut u8;
        unsafe { queues[0].read_into(0, buf, CHUNK) }
            .unwrap_or_else(|e| panic!("read into a new region: {}", errno_name(e)));
        // SAFETY: CHUNK bytes were just filled by the read.
        let got = unsafe { std::slice::from_raw_parts(buf, CHUNK) };
        assert_same_data("read into a new region", got, &pattern(1 << 32, CHUNK));
        blkio.unmap_mem_region(&region);
        blkio.free_mem_region(&region);
    }
    assert!(
        changes > 0,
        "no memory-table change happened during the I/O"
    );
    assert_eq!(fe.iothread_pids(), iothreads, "an iothread died");
    drop(c);
    println!(
        "{changes} ADD_MEM_REG+REM_MEM_REG pairs during 2 x {chunks} x 64 KiB write+verify at QD 8: \
         no error, data verified; a region added afterwards is usable by the iothread"
    );
    fe.finish();
}
