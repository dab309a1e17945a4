#!/usr/bin/env bash
# Builds blkplane's fuzz targets and runs each for a bounded time; any crash, panic, leak,
# sanitizer report or hang (10 s for one input) fails the script.
#
#   bash fuzz/run.sh [seconds-per-target]     (default 20)
#
# Installs what it needs on a fresh machine: cargo-fuzz (pinned), a C++ compiler for
# libFuzzer. See docs/fuzzing.md for longer runs and why RUSTC_BOOTSTRAP is set.
set -euo pipefail

seconds=${1:-20}
fuzz=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$fuzz")
cargo_fuzz_version=0.13.1
targets=(virtio_blk_request ring_consumer vhost_user_messages inflight_recovery used_rings qcow2_image)

if ! cargo fuzz --version 2>/dev/null | grep -qx "cargo-fuzz $cargo_fuzz_version"; then
    cargo install cargo-fuzz --version "$cargo_fuzz_version" --locked
fi
# libfuzzer-sys builds libFuzzer from its C++ sources.
if ! command -v c++ >/dev/null; then
    apt-get update
    apt-get install -y --no-install-recommends g++
fi

# The vhost-user target drives a real worker, which spawns real iothread processes.
cargo build --locked --manifest-path "$root/Cargo.toml" -p blkplane-iothread
export BLKPLANE_IOTHREAD="$root/target/debug/blkplane-iothread"

# cargo-fuzz passes -Zsanitizer=address; this is a stable toolchain (docs/fuzzing.md).
export RUSTC_BOOTSTRAP=1
cd "$fuzz"
# cargo fuzz has no --locked: check the committed lock file is complete first.
cargo metadata --locked --format-version 1 >/dev/null
cargo fuzz build

for target in "${targets[@]}"; do
    echo "=== $target: ${seconds}s"
    mkdir -p "corpus/$target"
    # New inputs go to corpus/ (not committed); seeds/ holds the committed seed corpus.
    cargo fuzz run "$target" "corpus/$target" "seeds/$target" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1
done
echo "fuzzing: every target ran clean for ${seconds}s"
