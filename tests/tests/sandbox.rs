//! Every blkplane process that touches guest memory runs locked down (blkplane-sandbox):
//! frontend, its iothread spawner and its iothreads have no capabilities, `no_new_privs`,
//! seccomp filters, and only their image, sockets and anonymous files open. Each does its
//! I/O under its filter, and a forbidden system call — made on demand through the test hook
//! that debug builds compile in (`SIGUSR2` → `socket(AF_INET)`) — kills the process, which
//! its supervisor replaces: the frontend replaces an iothread without the client noticing,
//! blkplaned restarts a frontend; blkplaned's events say how each ended.

use std::path::Path;
use std::time::Duration;

use blkplane_tests::daemon::{kill, Daemon, Watcher};
use blkplane_tests::frontend::{children_of, SPAWNER_COMM};
use blkplane_tests::json::Json;
use blkplane_tests::*;

const MIB: u64 = 1 << 20;

/// A field of /proc/PID/status.
fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/status: {e}"));
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
        .trim()
        .to_string()
}

/// Asserts `pid` runs (or, within a few seconds, once it has finished starting runs) under at
/// least `filters` seccomp filters, with `no_new_privs` and no capability in any set.
#[track_caller]
fn assert_locked_down(pid: u32, what: &str, filters: u32) {
    let filters_of = || -> u32 { status_field(pid, "Seccomp_filters").parse().unwrap() };
    wait_for(Duration::from_secs(10), || {
        (filters_of() >= filters).then_some(())
    });
    assert_eq!(
        status_field(pid, "Seccomp"),
        "2",
        "{what} {pid}: not in filter mode"
    );
    assert_eq!(status_field(pid, "NoNewPrivs"), "1", "{what} {pid}");
    let count = filters_of();
    assert!(count >= filters, "{what} {pid}: {count} seccomp filters");
    for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(
            status_field(pid, set),
            "0000000000000000",
            "{what} {pid}: {set} not empty"
        );
    }
}

/// Asserts that every descriptor of `pid` from 3 up is `image`, a socket, a memfd or an
/// anonymous inode (eventfd, epoll, timerfd, pidfd, io_uring): no other file, no directory.
#[track_caller]
fn assert_only_own_files(pid: u32, what: &str, image: &Path) {
    let dir = format!("/proc/{pid}/fd");
    let image = image.canonicalize().unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let entry = entry.unwrap();
        let fd: u32 = entry.file_name().to_str().unwrap().parse().unwrap();
        if fd < 3 {
            continue;
        }
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue; // closed meanwhile
        };
        let text = target.to_string_lossy();
        let ok = target == image
            || text.starts_with("socket:[")
            || text.starts_with("anon_inode:")
            || text.starts_with("/memfd:");
        assert!(ok, "{what} {pid}: fd {fd} is {text}");
    }
}

/// The frontend's spawner.
fn spawner_of(frontend: u32) -> u32 {
    let spawners: Vec<u32> = children_of(frontend)
        .into_iter()
        .filter(|(_, comm, _)| comm == SPAWNER_COMM)
        .map(|(pid, _, _)| pid)
        .collect();
    assert_eq!(spawners.len(), 1, "spawners of frontend {frontend}");
    spawners[0]
}

/// Writes a pattern through `socket` at `offset` and reads it back.
fn write_and_verify(client: &mut Client, offset: u64, seed: u64) {
    let data = pattern(seed, 256 * 1024);
    client.queue(0).write_at(offset, &data).unwrap();
    client.queue(0).flush().unwrap();
    assert_eq!(client.queue(0).read_at(offset, data.len()).unwrap(), data);
}

#[test]
fn frontend_spawner_and_iothreads_serve_locked_down() {
    let dir = TempDir::new("sandbox");
    let img = create_image(&dir.join("disk.img"), 16 * MIB);
    let fe = Frontend::start(&img, &["--num-queues", "2", "--iothreads", "2"]);
    let mut client = Client::connect_with(
        fe.socket(),
        &ClientOptions {
            num_queues: 2,
            ..Default::default()
        },
    )
    .unwrap();
    // I/O on both queues, so both iothreads serve under their filters.
    for q in 0..2 {
        let data = pattern(q as u64, 64 * 1024);
        client.queue(q).write_at(q as u64 * MIB, &data).unwrap();
        client.queue(q).flush().unwrap();
        assert_eq!(
            client.queue(q).read_at(q as u64 * MIB, data.len()).unwrap(),
            data
        );
    }
    let iothreads = fe.wait_iothreads(2, &[], Duration::from_secs(10));
    let spawner = spawner_of(fe.pid());
    // The frontend: the no-clone3 filter and its own; the spawner likewise; an iothread
    // inherits the spawner's two and adds its own two.
    assert_locked_down(fe.pid(), "frontend", 2);
    assert_locked_down(spawner, "spawner", 2);
    for &pid in &iothreads {
        assert_locked_down(pid, "iothread", 4);
    }
    assert_only_own_files(fe.pid(), "frontend", &img);
    assert_only_own_files(spawner, "spawner", &img);
    for &pid in &iothreads {
        assert_only_own_files(pid, "iothread", &img);
    }
    drop(client);
    fe.finish();
}

#[test]
fn a_forbidden_call_kills_an_iothread_which_is_replaced_unnoticed() {
    let dir = TempDir::new("sandbox");
    let img = create_image(&dir.join("disk.img"), 16 * MIB);
    let mut fe = Frontend::start(&img, &[]);
    let mut client = Client::connect(fe.socket()).unwrap();
    write_and_verify(&mut client, 0, 1);
    let old = fe.wait_iothreads(1, &[], Duration::from_secs(10))[0];
    kill(old, libc::SIGUSR2);
    let new = fe.wait_iothreads(1, &[old], Duration::from_secs(10))[0];
    assert_locked_down(new, "replacement iothread", 4);
    // The spawner reaped it and says how it died.
    let said = format!("iothread pid {old} killed by signal 31 (SIGSYS");
    wait_for(Duration::from_secs(10), || {
        fe.stderr().contains(&said).then_some(())
    })
    .unwrap_or_else(|| panic!("no {said:?} in:\n{}", fe.stderr()));
    // The same connection goes on, and what was written before is there.
    assert_eq!(
        client.queue(0).read_at(0, 256 * 1024).unwrap(),
        pattern(1, 256 * 1024)
    );
    write_and_verify(&mut client, 4 * MIB, 2);
    fe.assert_running("an iothread's forbidden call");
    drop(client);
    fe.finish();
}

#[test]
fn a_forbidden_call_kills_a_frontend_which_blkplaned_restarts_saying_why() {
    // Declared first, dropped last: after blkplaned and its frontends.
    let images = TempDir::new("sandbox-img");
    let img = create_image(&images.join("disk.img"), 16 * MIB);
    let d = Daemon::start("sandbox", &[]);
    let watcher = Watcher::start(&d);
    let added = Json::parse(&d.ctl_ok(&[
        "-o",
        "json",
        "disk",
        "add",
        "d0",
        "--image",
        img.to_str().unwrap(),
    ]));
    let socket = added.get("config").get("vhost_socket").str().to_string();
    let old = added.get("frontend_pid").u64() as u32;
    assert_locked_down(old, "frontend under blkplaned", 2);
    {
        let mut client = Client::connect(Path::new(&socket)).unwrap();
        write_and_verify(&mut client, 0, 3);
    }
    kill(old, libc::SIGUSR2);
    let exited = watcher.wait("exited", "d0");
    let message = exited.get("message").str();
    assert!(message.contains("SIGSYS"), "{exited:?}");
    let j = d.wait_disk("d0", "restarted", |j| {
        j.get("state").str() == "ready" && j.get("frontend_pid").u64() as u32 != old
    });
    assert_locked_down(j.get("frontend_pid").u64() as u32, "restarted frontend", 2);
    let mut client = Client::connect(Path::new(&socket)).unwrap();
    assert_eq!(
        client.queue(0).read_at(0, 256 * 1024).unwrap(),
        pattern(3, 256 * 1024)
    );

    // Its iothread makes a forbidden call: the frontend replaces it, the client goes on, and
    // blkplaned's event says how the old one ended.
    let iothread = j.get("iothread_pids").arr()[0].u64() as u32;
    assert_locked_down(iothread, "iothread under blkplaned", 4);
    kill(iothread, libc::SIGUSR2);
    let replaced = watcher.wait("iothread_restarted", "d0");
    let message = replaced.get("message").str();
    assert!(
        message.contains(&format!("pid {iothread} killed by signal 31 (SIGSYS")),
        "{replaced:?}"
    );
    write_and_verify(&mut client, 2 * MIB, 4);
}

/// The user, group and supplementary group the disk of
/// [`a_disk_runs_as_its_configured_user`] is given (107 is `qemu` in KubeVirt).
const DISK_USER: (u32, u32, u32) = (107, 107, 36);

/// Asserts that `pid` runs as [`DISK_USER`]: every uid and gid, and only that group.
#[track_caller]
fn assert_runs_as_disk_user(pid: u32, what: &str) {
    let (uid, gid, group) = DISK_USER;
    assert_eq!(
        status_field(pid, "Uid"),
        format!("{uid}\t{uid}\t{uid}\t{uid}"),
        "{what} {pid}"
    );
    assert_eq!(
        status_field(pid, "Gid"),
        format!("{gid}\t{gid}\t{gid}\t{gid}"),
        "{what} {pid}"
    );
    assert_eq!(
        status_field(pid, "Groups"),
        group.to_string(),
        "{what} {pid}"
    );
}

#[test]
fn a_disk_runs_as_its_configured_user() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let images = TempDir::new("sandbox-img");
    std::fs::set_permissions(images.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let img = create_image(&images.join("disk.img"), 16 * MIB);
    // The disk's user's image, as its VMM's would be; a root-only one is refused below.
    std::fs::set_permissions(&img, std::fs::Permissions::from_mode(0o600)).unwrap();
    let root_only = create_image(&images.join("root.img"), 16 * MIB);
    std::fs::set_permissions(&root_only, std::fs::Permissions::from_mode(0o600)).unwrap();
    let d = Daemon::start("sandbox-user", &[]);
    let (uid, gid, group) = DISK_USER;
    let run_as = format!("{uid}:{gid}:{group}");
    let add = [
        "-o",
        "json",
        "disk",
        "add",
        "d0",
        "--image",
        img.to_str().unwrap(),
        "--num-queues",
        "2",
        "--iothreads",
        "2",
        "--run-as",
        &run_as,
    ];
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        // Without root, blkplaned cannot give a disk another user, and says so.
        d.ctl_refused(&add, "FAILED_PRECONDITION", "run_as");
        return;
    }
    std::os::unix::fs::chown(&img, Some(uid), Some(gid)).unwrap();

    // The image is opened with the disk user's permissions, not root's: one only root may
    // open is refused, and nothing of the disk is left.
    let refused = d.ctl(&[
        "disk",
        "add",
        "r0",
        "--image",
        root_only.to_str().unwrap(),
        "--run-as",
        &run_as,
    ]);
    assert_ne!(refused.code, Some(0), "{}", refused.stdout);
    assert!(
        refused.stderr.contains("Permission denied"),
        "{}",
        refused.stderr
    );
    assert_eq!(d.ctl_json(&["disk", "list"]).arr().len(), 0);
    assert!(d.frontends().is_empty(), "{:?}", d.frontends());

    let added = Json::parse(&d.ctl_ok(&add));
    let config = added.get("config").get("run_as");
    assert_eq!(
        (config.get("uid").u64(), config.get("gid").u64()),
        (u64::from(uid), u64::from(gid)),
        "{added:?}"
    );
    let socket = added.get("config").get("vhost_socket").str().to_string();
    // A VMM running as the disk's user can connect: the socket is its.
    let meta = std::fs::metadata(&socket).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (uid, gid), "{socket}");

    let frontend = added.get("frontend_pid").u64() as u32;
    let mut client = Client::connect_with(
        Path::new(&socket),
        &ClientOptions {
            num_queues: 2,
            ..Default::default()
        },
    )
    .unwrap();
    for q in 0..2 {
        let data = pattern(10 + q as u64, 64 * 1024);
        client.queue(q).write_at(q as u64 * MIB, &data).unwrap();
        client.queue(q).flush().unwrap();
        assert_eq!(
            client.queue(q).read_at(q as u64 * MIB, data.len()).unwrap(),
            data
        );
    }
    let j = d.wait_disk("d0", "two iothreads", |j| {
        j.get("iothread_pids").arr().len() == 2
    });
    let iothreads: Vec<u32> = j
        .get("iothread_pids")
        .arr()
        .iter()
        .map(|p| p.u64() as u32)
        .collect();
    let spawner = spawner_of(frontend);
    // Switching users left no capability behind, and the filters are in place.
    for (pid, what, filters) in [(frontend, "frontend", 2), (spawner, "spawner", 2)]
        .into_iter()
        .chain(iothreads.iter().map(|&p| (p, "iothread", 4)))
    {
        assert_runs_as_disk_user(pid, what);
        assert_locked_down(pid, what, filters);
        assert_only_own_files(pid, what, &img);
    }

    // An iothread replaced after a crash starts as the disk's user too.
    kill(iothreads[0], libc::SIGKILL);
    let j = d.wait_disk("d0", "iothread replaced", |j| {
        let pids = j.get("iothread_pids").arr();
        pids.len() == 2 && !pids.iter().any(|p| p.u64() as u32 == iothreads[0])
    });
    for p in j.get("iothread_pids").arr() {
        assert_runs_as_disk_user(p.u64() as u32, "replacement iothread");
    }
    write_and_verify(&mut client, 4 * MIB, 11);
    drop(client);

    // So does a frontend blkplaned restarts (the user is part of the stored configuration),
    // and it reads back what its predecessor wrote.
    kill(frontend, libc::SIGKILL);
    let j = d.wait_disk("d0", "restarted", |j| {
        j.get("state").str() == "ready" && j.get("frontend_pid").u64() as u32 != frontend
    });
    let restarted = j.get("frontend_pid").u64() as u32;
    assert_runs_as_disk_user(restarted, "restarted frontend");
    assert_locked_down(restarted, "restarted frontend", 2);
    let mut client = Client::connect(Path::new(&socket)).unwrap();
    assert_eq!(
        client.queue(0).read_at(4 * MIB, 256 * 1024).unwrap(),
        pattern(11, 256 * 1024)
    );
    write_and_verify(&mut client, 8 * MIB, 12);
}
