//! A qcow2 chain under verified I/O while everything that changes its metadata happens at
//! once: online grows (`Resize` on the frontend's admin socket, every 250 ms), iothreads
//! killed under load (every ~850 ms), and between phases a new overlay on the current top
//! (an offline snapshot), so that the image being written has a backing chain that grows.
//!
//! Two libblkio queues run [`Worker`]s (16 requests in flight each) that write stamped blocks
//! and check every read against what was acknowledged, so a write lost or read stale (the
//! old data of a cluster showing through, a copy-on-write landing on newer data) fails the
//! phase it happened in. At the end every block is read once more and `qemu-img check` must
//! find no corruption in any layer: leaked clusters only (what a killed iothread leaves, and
//! an online grow: imago 0.2.6 moves the L1 table on every grow and its old cluster is kept,
//! see iothread/src/metadata_file.rs).
//!
//! `BLKPLANE_QCOW2_LOAD_PHASES` (3) and `BLKPLANE_QCOW2_LOAD_SECS` (4 per phase) make it
//! longer.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use blkplane_proto::v1::{frontend_request, frontend_response, ResizeRequest};
use blkplane_tests::frontend::kill_iothread;
use blkplane_tests::qemu_img::{assert_check_clean, create_overlay, qemu_img, virtual_size};
use blkplane_tests::soak::{ClientStats, Worker, SLOT};
use blkplane_tests::*;

const MIB: u64 = 1 << 20;
/// Requests each queue keeps in flight.
const DEPTH: usize = 16;
/// What each online grow adds: one cluster.
const GROW_STEP: u64 = 64 * 1024;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

#[test]
fn verified_io_survives_grows_new_overlays_and_iothread_kills() {
    let dir = TempDir::new("qcow2-load");
    let size = 32 * MIB;
    let _base = create_image(&dir.join("base.img"), size);
    let mut top = create_overlay(&dir.join("top0.qcow2"), "base.img", "raw", "");
    let mut layers = vec![top.clone()];
    let blocks_per_queue = (size / 4096) as usize / 2;
    let mut workers: Vec<Worker> = (0..2)
        .map(|i| {
            let mut worker = Worker::new(
                7,
                (i * blocks_per_queue) as u64,
                blocks_per_queue,
                99 + i as u64,
            );
            // qcow2 keeps the data of the partial clusters a discard covers.
            worker.advisory_discard = true;
            worker
        })
        .collect();
    let phases = env("BLKPLANE_QCOW2_LOAD_PHASES", 3).max(1);
    let secs = env("BLKPLANE_QCOW2_LOAD_SECS", 4).max(2);
    let mut capacity = size;
    for phase in 0..phases {
        let admin = dir.join(&format!("admin{phase}.sock"));
        let admin_arg = admin.to_str().unwrap().to_owned();
        let fe = Frontend::start(&top, &["--admin-socket", &admin_arg, "--num-queues", "2"]);
        let mut client = Client::connect_with(
            fe.socket(),
            &ClientOptions {
                num_queues: 2,
                buf_size: DEPTH * SLOT,
                ..Default::default()
            },
        )
        .expect("libblkio connects");
        let stats = ClientStats::default();
        let stop = AtomicBool::new(false);
        let last = phase + 1 == phases;
        let (grows, kills) = (AtomicU64::new(0), AtomicU64::new(0));
        std::thread::scope(|s| {
            let (stats, stop) = (&stats, &stop);
            for (queue, worker) in client.queues_mut().iter_mut().zip(workers.iter_mut()) {
                s.spawn(move || {
                    let ran = worker.run(queue, DEPTH, stats, u64::MAX, &|| {
                        stop.load(Ordering::Relaxed)
                    });
                    if ran && last {
                        worker.verify_all(queue, DEPTH, stats);
                    }
                });
            }
            let start = Instant::now();
            let mut tick = 0u64;
            while start.elapsed() < Duration::from_secs(secs) {
                std::thread::sleep(Duration::from_millis(50));
                tick += 1;
                if tick.is_multiple_of(5) {
                    capacity += GROW_STEP;
                    // A grow that meets a dying iothread is retried on its successor.
                    match admin::call(
                        &admin,
                        frontend_request::Request::Resize(ResizeRequest {
                            new_size_bytes: capacity,
                        }),
                    ) {
                        Ok(frontend_response::Response::Resized(done)) => {
                            assert_eq!(done.capacity_bytes, capacity);
                            grows.fetch_add(1, Ordering::Relaxed);
                        }
                        other => panic!("phase {phase}: resize to {capacity}: {other:?}"),
                    }
                }
                if tick.is_multiple_of(17) {
                    if let Some(victim) = fe.iothread_pids().first() {
                        if kill_iothread(fe.pid(), *victim) {
                            kills.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
            stop.store(true, Ordering::Relaxed);
        });
        let (grows, kills) = (grows.into_inner(), kills.into_inner());
        println!(
            "phase {phase} on {} ({} backing files; {grows} grows, {kills} iothreads killed): {}",
            top.file_name().unwrap().to_string_lossy(),
            layers.len(),
            stats.line()
        );
        if stats.failures() != 0 {
            for message in stats.messages.lock().unwrap().iter() {
                println!("  {message}");
            }
            println!("frontend stderr:\n{}", fe.stderr());
        }
        assert_eq!(stats.failures(), 0, "phase {phase}: {}", stats.line());
        assert!(
            grows > 0 && kills > 0,
            "phase {phase}: {grows} grows, {kills} kills"
        );
        drop(client);
        fe.finish();
        assert_eq!(
            virtual_size(&top),
            Some(capacity),
            "phase {phase}: the grown size"
        );
        if !last {
            // An offline snapshot: a new overlay on the current top, as large as it is.
            let name = format!("top{}.qcow2", phase + 1);
            let backing = top.file_name().unwrap().to_str().unwrap().to_owned();
            top = create_overlay(&dir.join(&name), &backing, "qcow2", "");
            qemu_img(&["resize", top.to_str().unwrap(), &capacity.to_string()]);
            layers.push(top.clone());
        }
    }
    for layer in &layers {
        assert_check_clean(layer, true);
    }
}
