//! Finds the git commit the workspace is built from and hands it to the crate as
//! `BLKPLANE_GIT_COMMIT`: `BLKPLANE_GIT_COMMIT` from the environment if set (a build from a
//! tarball or a container context without `.git` can name its commit), else
//! `git rev-parse --short=12 HEAD` with `-dirty` when tracked files differ from it, else
//! `unknown`.
//!
//! Cargo is asked to run this again when HEAD moves: the files it watches are HEAD itself, the
//! branch HEAD points to, packed-refs and the index (which changes with the working tree's
//! state).

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(std::env::var_os("CARGO_MANIFEST_DIR")?)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    println!("cargo:rerun-if-env-changed=BLKPLANE_GIT_COMMIT");
    if let Ok(commit) = std::env::var("BLKPLANE_GIT_COMMIT") {
        println!("cargo:rustc-env=BLKPLANE_GIT_COMMIT={commit}");
        return;
    }
    if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        let dir = PathBuf::from(dir);
        let mut watched = vec![dir.join("HEAD"), dir.join("packed-refs"), dir.join("index")];
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watched.push(dir.join(branch));
        }
        for path in watched.iter().filter(|p| p.exists()) {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
    let commit = match git(&["rev-parse", "--short=12", "HEAD"]) {
        Some(head) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{head}-dirty")
            } else {
                head
            }
        }
        None => "unknown".to_string(),
    };
    println!("cargo:rustc-env=BLKPLANE_GIT_COMMIT={commit}");
}
