//! Shared helpers for the end-to-end tests.
//!
//! The tests drive the real `blkplane-frontend` and `blkplane-iothread` binaries:
//!
//! - [`binaries`] builds them once per test process (integration tests of this package cannot
//!   use `CARGO_BIN_EXE_*` of other packages), so a plain `cargo test --workspace` works on a
//!   clean checkout.
//! - [`frontend::Frontend`] runs one frontend process and cleans it up.
//! - [`client`] is a libblkio client (the "well-behaved VMM").
//! - [`raw`] is a minimal hand-written vhost-user front-end with its own split virtqueue, for
//!   requests libblkio would never send.
//! - [`wire`] writes raw vhost-user messages, for messages the `vhost` crate would never send.
//! - [`admin`] talks to a frontend's admin channel (drain, resume, statistics) as blkplaned
//!   does.
//!
//! Every wait in these helpers is bounded, so a hung frontend fails a test instead of hanging CI.

#![warn(missing_docs)]

pub mod admin;
pub mod client;
pub mod daemon;
pub mod frontend;
pub mod guest;
pub mod json;
pub mod netns;
pub mod qemu_img;
pub mod qmp;
pub mod raw;
pub mod soak;
pub mod tls;
pub mod tools;
pub mod wire;

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub use client::{Client, ClientOptions, IoQueue, Op};
pub use frontend::Frontend;

/// Paths of the binaries under test.
#[derive(Debug)]
pub struct Binaries {
    /// `blkplane-frontend`.
    pub frontend: PathBuf,
    /// `blkplane-iothread` (the frontend finds it next to itself; kept here for diagnostics).
    pub iothread: PathBuf,
    /// `blkplaned`, the control plane (finds the frontend next to itself).
    pub blkplaned: PathBuf,
    /// `blkplanectl`, its command-line client.
    pub blkplanectl: PathBuf,
}

/// Returns the binaries under test, building them on first use.
///
/// `BLKPLANE_BIN_DIR` overrides the build (for CI jobs that build separately). Otherwise this runs
/// `$CARGO build --workspace --all-targets` (which builds `blkplaned` of blkplane-daemon and
/// `blkplanectl` of blkplane-cli too) with the profile (and target triple,
/// if any) of the running test binary, into the same target directory, so the binaries match the
/// tested tree even when only this package was rebuilt.
pub fn binaries() -> &'static Binaries {
    static BINARIES: OnceLock<Binaries> = OnceLock::new();
    BINARIES.get_or_init(|| {
        let dir = match std::env::var_os("BLKPLANE_BIN_DIR") {
            Some(dir) => PathBuf::from(dir),
            None => build_binaries(),
        };
        let bins = Binaries {
            frontend: dir.join("blkplane-frontend"),
            iothread: dir.join("blkplane-iothread"),
            blkplaned: dir.join("blkplaned"),
            blkplanectl: dir.join("blkplanectl"),
        };
        for bin in [
            &bins.frontend,
            &bins.iothread,
            &bins.blkplaned,
            &bins.blkplanectl,
        ] {
            assert!(bin.is_file(), "{} does not exist", bin.display());
        }
        bins
    })
}

/// Builds the binaries and returns the directory they are in.
fn build_binaries() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // The test binary is target/[<triple>/]<profile>/deps/<name>-<hash>.
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binary is not in <target>/<profile>/deps")
        .to_path_buf();
    let profile_name = profile_dir
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let above = profile_dir.parent().unwrap();
    // Cargo marks the root of a target directory with CACHEDIR.TAG; anything between it and the
    // profile directory is a `--target` triple that the build must repeat.
    let (target_dir, triple) = if above.join("CACHEDIR.TAG").exists() {
        (above.to_path_buf(), None)
    } else {
        let triple = above.file_name().unwrap().to_string_lossy().into_owned();
        (above.parent().unwrap().to_path_buf(), Some(triple))
    };
    // The "dev" and "test" profiles share the "debug" directory.
    let profile = match profile_name.as_str() {
        "debug" => "dev",
        other => other,
    };
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.arg("build")
        .arg("--manifest-path")
        .arg(workspace.join("Cargo.toml"))
        // Every target of the workspace: the same feature unification as `cargo test
        // --workspace`, so nothing is compiled twice with different features.
        .args(["--workspace", "--all-targets"])
        .args(["--profile", profile])
        .env("CARGO_TARGET_DIR", &target_dir);
    if let Some(triple) = &triple {
        cmd.args(["--target", triple]);
    }
    let started = Instant::now();
    let out = cmd.output().expect("failed to run cargo build");
    assert!(
        out.status.success(),
        "building the blkplane binaries failed ({:?}):\n{}",
        cmd,
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "built blkplane-frontend, blkplane-iothread, blkplaned and blkplanectl ({profile}) in \
         {:.1?}",
        started.elapsed()
    );
    profile_dir
}

/// A directory under [`std::env::temp_dir`] (or another base) that is removed on drop.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// Creates a fresh directory under the system temp dir; `tag` only makes it recognizable.
    pub fn new(tag: &str) -> TempDir {
        Self::new_in(&std::env::temp_dir(), tag)
    }

    /// Creates a fresh directory under `base` (e.g. `/dev/shm` for a tmpfs image).
    pub fn new_in(base: &Path, tag: &str) -> TempDir {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        // Keep it short: the frontend's UNIX socket lives in such a directory and sun_path has
        // only 108 bytes.
        let path = base.join(format!("bp-{tag}-{}-{n}-{nanos:x}", std::process::id()));
        std::fs::create_dir(&path).unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
        TempDir { path }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A path inside the directory.
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// The names of the files in `dir`, sorted (none if it does not exist): what a test compares
/// a runtime directory's listing with.
pub fn file_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// A tiny xorshift64* PRNG: reproducible test data from a seed without pulling in `rand`.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`; equal seeds give equal streams.
    pub fn new(seed: u64) -> Rng {
        // Scramble so that small consecutive seeds give unrelated streams, and avoid the all-zero
        // state xorshift cannot leave.
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
        if s == 0 {
            s = 1;
        }
        Rng(s)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A random value in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Fills `buf` with random bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        // Only draw for a tail, so that filling in pieces that are multiples of 8 gives the
        // same stream as one big fill.
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let last = self.next_u64().to_le_bytes();
            let n = rest.len();
            rest.copy_from_slice(&last[..n]);
        }
    }
}

/// `len` pseudo-random bytes determined by `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    Rng::new(seed).fill(&mut v);
    v
}

/// Creates (or truncates) a sparse image file of `size` bytes, which reads as zeros.
pub fn create_image(path: &Path, size: u64) -> PathBuf {
    let f = File::create(path).unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
    f.set_len(size).unwrap();
    path.to_path_buf()
}

/// Creates an image of `size` bytes filled with [`pattern`]-style data from `seed`.
pub fn create_random_image(path: &Path, size: u64, seed: u64) -> PathBuf {
    let mut f = File::create(path).unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
    let mut rng = Rng::new(seed);
    let mut chunk = vec![0u8; 1 << 20];
    let mut left = size;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        rng.fill(&mut chunk[..n]);
        f.write_all(&chunk[..n]).unwrap();
        left -= n as u64;
    }
    path.to_path_buf()
}

/// Reads `len` bytes at `offset` of a file directly (bypassing the frontend).
pub fn read_file_at(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let f = File::open(path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    let mut buf = vec![0; len];
    f.read_exact_at(&mut buf, offset)
        .unwrap_or_else(|e| panic!("reading {} at {offset}: {e}", path.display()));
    buf
}

/// Reads a whole file.
pub fn read_file(path: &Path) -> Vec<u8> {
    let mut v = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut v))
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    v
}

/// Panics with a readable message at the first differing byte instead of dumping two buffers.
#[track_caller]
pub fn assert_same_data(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length differs");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        let end = (i + 16).min(got.len());
        panic!(
            "{what}: data differs at byte {i} (of {}): got {:02x?}, want {:02x?}",
            got.len(),
            &got[i..end],
            &want[i..end]
        );
    }
}

/// Polls `f` every few milliseconds until it returns `Some`, or gives up after `timeout`.
pub fn wait_for<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Whether `path` is on a filesystem that accepts O_DIRECT opens (tmpfs does not).
pub fn supports_o_direct(path: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .is_ok()
}
