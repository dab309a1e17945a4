//! Figures, not a test (ignored; it asserts nothing about time): a 1 GiB disk, all of it
//! data, copied to another node while a raw vhost-user VMM writes at random at a steady rate,
//! then the switch-over when the VMM goes. Prints the time to converge, the switch-over time
//! and the bytes sent (BENCHMARKS.md, "Live migration with local storage").
//!
//! `FIG_RATE` MiB/s of guest writes (20), `FIG_BS` bytes per write (4096), `FIG_BW` the copy's
//! `--bandwidth` (0: none):
//! `FIG_BS=65536 FIG_BW=200M cargo test -p blkplane-tests --test migration_copy_figures --
//! --ignored --nocapture`.
use std::time::{Duration, Instant};

use blkplane_tests::daemon::*;
use blkplane_tests::raw::RawDevice;
use blkplane_tests::tls::make_test_certs;
use blkplane_tests::*;
use vhost::vhost_user::message::VhostUserProtocolFeatures;

const GIB: u64 = 1 << 30;

#[test]
#[ignore = "prints figures: run it by hand (see the module documentation)"]
fn figures() {
    let bw = std::env::var("FIG_BW").unwrap_or("0".into());
    let rate: u64 = std::env::var("FIG_RATE")
        .map(|r| r.parse().unwrap())
        .unwrap_or(20);
    let certs = TempDir::new("fig-certs");
    make_test_certs(certs.path());
    let Node {
        daemon: a,
        endpoint: ae,
    } = Node::start("fig", "a", certs.path(), true);
    let Node {
        daemon: b,
        endpoint: be,
    } = Node::start("fig", "b", certs.path(), true);
    let dir_a = TempDir::new("fig-a");
    let dir_b = TempDir::new("fig-b");
    let src = create_image(&dir_a.join("src.img"), GIB);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&src).unwrap();
        let chunk = pattern(1, 1 << 20);
        for n in 0..1024u64 {
            f.write_all_at(&chunk, n << 20).unwrap();
        }
        f.sync_all().unwrap();
    }
    let disk = add_disk(&a, "src", &src, &[]);
    let mut vmm = RawDevice::connect_negotiating(
        &socket_of(&disk),
        1,
        128,
        VhostUserProtocolFeatures::LOG_SHMFD,
    )
    .unwrap();
    let bs: u64 = std::env::var("FIG_BS")
        .map(|r| r.parse().unwrap())
        .unwrap_or(4096);
    let data = pattern(2, bs as usize);
    vmm.write(0, 0, &data);
    let watch = Watcher::start(&a);
    b.ctl_ok(&[
        "disk",
        "add",
        "dst",
        "--incoming-from",
        &format!("{ae}/src"),
        "--image",
        dir_b.join("dst.img").to_str().unwrap(),
    ]);
    let started = Instant::now();
    a.ctl_ok(&[
        "disk",
        "migrate",
        "src",
        "--to",
        &format!("{be}/dst"),
        "--bandwidth",
        &bw,
    ]);
    // 4 KiB writes at random offsets, paced to `rate` MiB/s, until converged and 5 s more.
    let per_sec = rate * (1 << 20) / bs;
    let mut rng = 0x1234_5678u64;
    let mut written = 0u64;
    let mut converged_at = None;
    loop {
        let due = started + Duration::from_secs_f64(written as f64 / per_sec as f64);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let block = rng % (GIB / bs);
        vmm.write(0, block * bs / 512, &data);
        written += 1;
        if converged_at.is_none() && !events_of(&watch, "migration_converged", "src").is_empty() {
            converged_at = Some(started.elapsed());
        }
        if let Some(c) = converged_at {
            if started.elapsed() > c + Duration::from_secs(5) {
                break;
            }
        }
        assert!(started.elapsed() < Duration::from_secs(600));
    }
    let achieved = written as f64 * bs as f64 / started.elapsed().as_secs_f64() / (1 << 20) as f64;
    let before = a.disk("src").get("migration_copy").clone();
    let stop = Instant::now();
    drop(vmm);
    let copied = watch.wait("migration_copied", "src");
    eprintln!("FIGURES bw={bw} guest {achieved:.1} MiB/s of {bs}-byte random writes; converged after {converged_at:?}; switch-over event {:?} after the VMM went; total {:?}; before: {before:?}; {}", stop.elapsed(), started.elapsed(), copied.get("message").str());
}
