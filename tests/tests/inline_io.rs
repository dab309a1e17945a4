//! How the iothread executes reads and writes, decided per image by probing it: an image in
//! memory that io_uring would hand to a kernel worker thread per request (tmpfs: it refuses
//! non-blocking reads) is served inline with plain preadv/pwritev; a file on a real disk
//! (which takes non-blocking attempts) stays on io_uring. Both serve verified data through
//! libblkio, and the admin channel's statistics say which way each transfer went.

use std::path::Path;

use blkplane_tests::{
    admin, create_random_image, pattern, read_file_at, Client, Frontend, TempDir,
};

const MIB: u64 = 1 << 20;

/// The file system type of `dir` (statfs f_type).
fn fs_type(dir: &Path) -> i64 {
    let path = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
    // SAFETY: statfs fills the zeroed struct it is given; the path is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statfs(path.as_ptr(), &mut st) }, 0);
    st.f_type
}

/// A directory on a disk-backed file system (not tmpfs): the temp dir, or /var/tmp.
fn disk_dir() -> TempDir {
    for base in [std::env::temp_dir(), "/var/tmp".into()] {
        if fs_type(&base) != libc::TMPFS_MAGIC {
            return TempDir::new_in(&base, "inline-disk");
        }
    }
    panic!("no disk-backed directory: both the temp dir and /var/tmp are tmpfs");
}

/// Serves `image` with `args`, writes and reads back through libblkio (and checks the image
/// file), and returns the iothread's (inline, queued) transfer counts.
fn run(image: &Path, args: &[&str], admin_socket: &Path) -> (u64, u64) {
    let mut all = vec!["--admin-socket", admin_socket.to_str().unwrap()];
    all.extend_from_slice(args);
    let fe = Frontend::start(image, &all);
    let data = pattern(0x1a11e, 256 << 10);
    {
        let mut vmm = Client::connect(fe.socket()).expect("libblkio connect");
        let q = vmm.queue(0);
        for (i, chunk) in data.chunks(64 << 10).enumerate() {
            q.write_at((i as u64) * (64 << 10) + MIB, chunk).unwrap();
        }
        q.flush().unwrap();
        assert_eq!(q.read_at(MIB, data.len()).unwrap(), data);
        // Data written before the frontend started reads back too.
        let before = read_file_at(image, 4 * MIB, 4096);
        assert_eq!(q.read_at(4 * MIB, 4096).unwrap(), before);
    }
    assert_eq!(read_file_at(image, MIB, data.len()), data);
    let stats = admin::stats(admin_socket).expect("admin stats");
    let t = stats
        .iothreads
        .first()
        .expect("an iothread in the statistics");
    (t.inline_transfers, t.queued_transfers)
}

#[test]
fn a_tmpfs_image_is_served_inline() {
    let dir = TempDir::new_in(Path::new("/dev/shm"), "inline-shm");
    assert_eq!(
        fs_type(dir.path()),
        libc::TMPFS_MAGIC,
        "/dev/shm is not tmpfs"
    );
    let image = create_random_image(&dir.join("disk.img"), 8 * MIB, 7);
    for cache in ["direct", "writeback"] {
        let (inline, queued) = run(&image, &["--cache", cache], &dir.join("admin.sock"));
        println!("tmpfs, --cache {cache}: {inline} inline, {queued} queued transfers");
        assert!(
            inline >= 6,
            "--cache {cache}: only {inline} inline transfers"
        );
        assert_eq!(
            queued, 0,
            "--cache {cache}: transfers went through io_uring"
        );
    }
}

#[test]
fn a_file_on_a_real_disk_stays_on_io_uring() {
    let dir = disk_dir();
    let image = create_random_image(&dir.join("disk.img"), 8 * MIB, 8);
    for cache in ["direct", "writeback"] {
        let (inline, queued) = run(&image, &["--cache", cache], &dir.join("admin.sock"));
        println!("disk, --cache {cache}: {inline} inline, {queued} queued transfers");
        assert_eq!(inline, 0, "--cache {cache}: transfers ran inline");
        assert!(
            queued >= 6,
            "--cache {cache}: only {queued} queued transfers"
        );
    }
}
