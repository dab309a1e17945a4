//! An iothread killed with SIGKILL in the middle of I/O: the frontend starts a new one and
//! resubmits what was in flight, so the client sees neither an error nor wrong data — on a raw
//! image, on a fresh qcow2 image whose clusters the killed iothreads were allocating, and on a
//! thin clone whose clusters they were filling from the base and writing whole through
//! O_DIRECT (then `qemu-img check` must find nothing worse than leaked clusters, and what the
//! writes left of each cluster must still be the base's).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use blkplane_tests::client::errno_name;
use blkplane_tests::frontend::{iothread_pids, kill_iothread};
use blkplane_tests::qemu_img::{assert_check_clean, convert_to_raw, create_overlay, create_qcow2};
use blkplane_tests::*;

const MIB: u64 = 1 << 20;
const CHUNK: usize = 64 * 1024;
const DEPTH: usize = 8;
/// Requests that must complete between two kills (and before the first), so every kill lands
/// in the middle of busy queues rather than after the I/O is over.
const OPS_BETWEEN_KILLS: usize = 300;
/// Upper bound on the whole I/O phase.
const IO_DEADLINE: Duration = Duration::from_secs(90);
/// At most this many client errors are recorded (the first ones tell the story).
const MAX_ERRORS: usize = 10;

/// Sets the flag when dropped, also while unwinding, so the killer thread never waits for I/O
/// loops that have died.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// The image the I/O runs on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// A raw file.
    Raw,
    /// A fresh qcow2 image of 4 KiB clusters: every write allocates sixteen whole clusters.
    FreshQcow2,
    /// A qcow2 overlay of 128 KiB clusters on a raw base of random data, written every other
    /// chunk: every write allocates a cluster half of which is the base's.
    ThinClone,
}

fn seed(queue: usize, round: u64, chunk: usize) -> u64 {
    ((queue as u64) << 56) | (round << 32) | chunk as u64
}

/// Runs write+verify rounds on every queue (one thread each, QD [`DEPTH`], each queue on its
/// own part of the image) while another thread SIGKILLs `kills` iothreads, one at a time, each
/// after [`OPS_BETWEEN_KILLS`] more completions. The I/O goes on until every queue has done
/// one whole round after the last kill. Then nothing may have failed, every byte must be
/// right, and the iothreads that were not killed must be the same processes.
fn sigkill_during_io(queues: usize, iothreads: usize, kills: usize, layout: Layout) {
    let dir = TempDir::new("crash");
    // A qcow2 image large enough that every kill lands in the first round, while each write
    // allocates.
    let size = if layout == Layout::Raw {
        16 * MIB
    } else {
        64 * MIB
    };
    let per_queue = size / queues as u64;
    // The distance between two writes' offsets.
    let stride = if layout == Layout::ThinClone {
        2 * CHUNK
    } else {
        CHUNK
    };
    let chunks = (per_queue / stride as u64) as usize;
    let base = dir.join("base.raw");
    let img = match layout {
        Layout::Raw => create_image(&dir.join("disk.img"), size),
        Layout::FreshQcow2 => create_qcow2(&dir.join("disk.qcow2"), "cluster_size=4096", size),
        Layout::ThinClone => {
            create_random_image(&base, size, 29);
            create_overlay(
                &dir.join("clone.qcow2"),
                base.to_str().unwrap(),
                "raw",
                "cluster_size=131072",
            )
        }
    };
    let (q_arg, t_arg) = (queues.to_string(), iothreads.to_string());
    let mut fe = Frontend::start(&img, &["--num-queues", &q_arg, "--iothreads", &t_arg]);
    let fe_pid = fe.pid();
    let mut c = Client::connect_with(
        fe.socket(),
        &ClientOptions {
            num_queues: queues as i32,
            buf_size: DEPTH * CHUNK,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("connect: {e}"));
    let first = fe.wait_iothreads(iothreads, &[], Duration::from_secs(10));

    let progress = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let killer_done = AtomicBool::new(false);
    let killed = Mutex::new(Vec::<u32>::new());
    let errors = Mutex::new(Vec::<String>::new());
    let error = |e: String| {
        let mut errors = errors.lock().unwrap();
        if errors.len() < MAX_ERRORS {
            errors.push(e);
        }
    };

    let (killer_result, last_rounds) = std::thread::scope(|s| {
        let killer = s.spawn(|| -> Result<(), String> {
            let _done = SetOnDrop(&killer_done);
            for k in 0..kills {
                let target = progress.load(Ordering::SeqCst) + OPS_BETWEEN_KILLS;
                wait_for(Duration::from_secs(60), || {
                    (stop.load(Ordering::SeqCst) || progress.load(Ordering::SeqCst) >= target)
                        .then_some(())
                })
                .ok_or(format!("kill {k}: no I/O progress for 60 s"))?;
                if stop.load(Ordering::SeqCst) {
                    return Err(format!("kill {k}: the I/O stopped first"));
                }
                let dead = killed.lock().unwrap().clone();
                let victim = iothread_pids(fe_pid)
                    .into_iter()
                    .find(|p| !dead.contains(p))
                    .ok_or(format!("kill {k}: no iothread to kill"))?;
                if !kill_iothread(fe_pid, victim) {
                    return Err(format!("kill {k}: could not kill iothread {victim}"));
                }
                let at = progress.load(Ordering::SeqCst);
                killed.lock().unwrap().push(victim);
                let dead = killed.lock().unwrap().clone();
                let all = wait_for(Duration::from_secs(10), || {
                    let now = iothread_pids(fe_pid);
                    (now.len() == iothreads && now.iter().all(|p| !dead.contains(p))).then_some(now)
                })
                .ok_or(format!(
                    "kill {k}: iothreads not complete 10 s after killing {victim}"
                ))?;
                println!("killed iothread {victim} after {at} requests; iothreads now {all:?}");
            }
            Ok(())
        });

        let _stop = SetOnDrop(&stop);
        let deadline = Instant::now() + IO_DEADLINE;
        let workers: Vec<_> = c
            .queues_mut()
            .iter_mut()
            .enumerate()
            .map(|(qi, q)| {
                let (progress, killer_done, error) = (&progress, &killer_done, &error);
                s.spawn(move || {
                    let start = qi as u64 * per_queue;
                    let mut round = 0u64;
                    loop {
                        let clean_round = killer_done.load(Ordering::SeqCst);
                        q.pipeline(
                            chunks,
                            DEPTH,
                            |i, slot| {
                                slot[..CHUNK].copy_from_slice(&pattern(seed(qi, round, i), CHUNK));
                                Op::Write {
                                    offset: start + (i * stride) as u64,
                                    buf: 0,
                                    len: CHUNK,
                                }
                            },
                            |i, _, ret| {
                                progress.fetch_add(1, Ordering::SeqCst);
                                if ret != 0 {
                                    error(format!(
                                        "queue {qi} round {round}: write {i}: {}",
                                        errno_name(-ret)
                                    ));
                                }
                            },
                        );
                        q.pipeline(
                            chunks,
                            DEPTH,
                            |i, _| Op::Read {
                                offset: start + (i * stride) as u64,
                                buf: 0,
                                len: CHUNK,
                            },
                            |i, slot, ret| {
                                progress.fetch_add(1, Ordering::SeqCst);
                                if ret != 0 {
                                    error(format!(
                                        "queue {qi} round {round}: read {i}: {}",
                                        errno_name(-ret)
                                    ));
                                } else if slot[..CHUNK] != pattern(seed(qi, round, i), CHUNK)[..] {
                                    error(format!(
                                        "queue {qi} round {round}: chunk {i} reads back wrong data"
                                    ));
                                }
                            },
                        );
                        if clean_round || Instant::now() >= deadline {
                            return round;
                        }
                        round += 1;
                    }
                })
            })
            .collect();
        let last_rounds: Vec<u64> = workers
            .into_iter()
            .map(|w| w.join().expect("I/O thread panicked"))
            .collect();
        stop.store(true, Ordering::SeqCst);
        (killer.join().expect("killer thread panicked"), last_rounds)
    });

    let errors = errors.into_inner().unwrap();
    assert!(
        errors.is_empty(),
        "the client saw errors around the iothread kills: {errors:#?}"
    );
    killer_result.unwrap_or_else(|e| panic!("{e}"));
    for q in c.queues_mut() {
        q.flush()
            .unwrap_or_else(|e| panic!("flush: {}", errno_name(e)));
    }
    drop(c);
    let file = if layout != Layout::Raw {
        // Leaked clusters (allocated by a killed iothread, never mapped) are what QEMU accepts
        // after a crash too; anything else is corruption.
        let report = assert_check_clean(&img, true);
        println!("qemu-img check after the kills: {}", report.trim());
        read_file(&convert_to_raw(&img, &dir.join("guest-view.raw")))
    } else {
        read_file(&img)
    };
    let base_bytes = if layout == Layout::ThinClone {
        read_file(&base)
    } else {
        Vec::new()
    };
    for (qi, &round) in last_rounds.iter().enumerate() {
        for i in 0..chunks {
            let at = (qi as u64 * per_queue) as usize + i * stride;
            assert_same_data(
                &format!("image file, queue {qi} chunk {i}"),
                &file[at..at + CHUNK],
                &pattern(seed(qi, round, i), CHUNK),
            );
            if stride > CHUNK {
                // The half of the cluster no write touched: the base's, copied by the fill.
                let rest = at + CHUNK..at + stride;
                assert_same_data(
                    &format!("image file, queue {qi} after chunk {i} (the base's)"),
                    &file[rest.clone()],
                    &base_bytes[rest],
                );
            }
        }
    }
    fe.assert_running("iothread kills");
    let killed = killed.into_inner().unwrap();
    let now = fe.wait_iothreads(iothreads, &killed, Duration::from_secs(10));
    for p in &first {
        assert_eq!(
            killed.contains(p),
            !now.contains(p),
            "iothread {p}: only the killed iothreads may change (before {first:?}, killed \
             {killed:?}, now {now:?})"
        );
    }
    let stderr = fe.stderr();
    for line in stderr.lines().filter(|l| l.contains("resubmitted")) {
        println!("frontend: {line}");
    }
    println!(
        "{kills} SIGKILL(s) among {iothreads} iothread(s) during QD {DEPTH} I/O on {queues} \
         queue(s): {} requests, rounds per queue {:?}, zero client errors, image file verified; \
         iothreads {first:?} -> {now:?}",
        progress.load(Ordering::SeqCst),
        last_rounds.iter().map(|r| r + 1).collect::<Vec<_>>()
    );
    fe.finish();
}

#[test]
fn iothread_sigkill_during_io() {
    sigkill_during_io(1, 1, 2, Layout::Raw);
}

#[test]
fn iothread_sigkill_during_allocating_qcow2_writes() {
    sigkill_during_io(1, 1, 3, Layout::FreshQcow2);
}

#[test]
fn iothread_sigkill_during_thin_clone_cluster_writes() {
    sigkill_during_io(1, 1, 3, Layout::ThinClone);
}

#[test]
fn one_of_two_iothreads_sigkilled_during_io() {
    sigkill_during_io(2, 2, 1, Layout::Raw);
}
