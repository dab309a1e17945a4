//! Images made, checked and read by `qemu-img` 10 (tests/setup.sh installs it), the tool an
//! operator makes qcow2 images and chains with.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::tools::{output_within, run_tool, text};

/// Runs `qemu-img ARGS`, panicking with its output if it fails; returns its stdout.
pub fn qemu_img(args: &[&str]) -> String {
    run_tool(
        Command::new("qemu-img").args(args),
        &format!("qemu-img {args:?}"),
    )
}

/// A qcow2 image of `size` bytes at `path`, with `-o options` (none if empty).
pub fn create_qcow2(path: &Path, options: &str, size: u64) -> PathBuf {
    let size = size.to_string();
    let mut args = vec!["create", "-q", "-f", "qcow2"];
    if !options.is_empty() {
        args.extend(["-o", options]);
    }
    args.extend([path.to_str().expect("UTF-8 path"), size.as_str()]);
    qemu_img(&args);
    path.to_owned()
}

/// A qcow2 overlay at `path` over `backing` (as the header will name it: relative names are
/// resolved against `path`'s directory) of format `backing_format`, with `-o options`.
pub fn create_overlay(path: &Path, backing: &str, backing_format: &str, options: &str) -> PathBuf {
    let mut args = vec![
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        backing,
        "-F",
        backing_format,
    ];
    if !options.is_empty() {
        args.extend(["-o", options]);
    }
    args.push(path.to_str().expect("UTF-8 path"));
    qemu_img(&args);
    path.to_owned()
}

/// `qemu-img check` of a qcow2 image: panics on corruption; with `allow_leaks`, leaked
/// clusters (exit status 3, what QEMU accepts after a crash) pass. Returns its report.
pub fn assert_check_clean(image: &Path, allow_leaks: bool) -> String {
    let out = output_within(
        Command::new("qemu-img").args(["check", image.to_str().expect("UTF-8 path")]),
        Duration::from_secs(60),
    );
    let code = out.status.code();
    assert!(
        code == Some(0) || (allow_leaks && code == Some(3)),
        "qemu-img check {}: {:?}\n{}",
        image.display(),
        code,
        text(&out)
    );
    text(&out)
}

/// The guest view of the qcow2 image `image` as a raw file at `raw` (`qemu-img convert`).
pub fn convert_to_raw(image: &Path, raw: &Path) -> PathBuf {
    qemu_img(&[
        "convert",
        "-f",
        "qcow2",
        "-O",
        "raw",
        image.to_str().expect("UTF-8 path"),
        raw.to_str().expect("UTF-8 path"),
    ]);
    raw.to_owned()
}

/// The virtual size `qemu-img info -U` reports for `image` (shared: the image may be in use).
pub fn virtual_size(image: &Path) -> Option<u64> {
    let out = qemu_img(&["info", "-U", "--output=json", image.to_str()?]);
    let key = "\"virtual-size\":";
    // The image's own, after its children's (the file underneath has one too).
    let rest = &out[out.rfind(key)? + key.len()..];
    let digits: String = rest
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}
