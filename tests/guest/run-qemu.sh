#!/usr/bin/env bash
# Runs the guest of tests/tests/guest.rs by hand, with its console on this terminal (Ctrl-A X
# quits QEMU). The disks, frontends and QEMU command line are those of the test.
#
#   tests/guest/run-qemu.sh            the checks run as in the test; results in WORK/results.log
#   tests/guest/run-qemu.sh --shell    a busybox shell in the guest instead of the checks
#   options: --bin DIR (prebuilt blkplane-frontend/-iothread; default: cargo build, debug)
#            --keep (leave the work directory with images and logs behind)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
shell=0
bin=""
keep=0
while [ $# -gt 0 ]; do
    case "$1" in
        --shell) shell=1 ;;
        --bin) bin=$2; shift ;;
        --keep) keep=1 ;;
        *) echo "usage: $0 [--shell] [--bin DIR] [--keep]" >&2; exit 2 ;;
    esac
    shift
done
command -v qemu-system-x86_64 >/dev/null || { echo "no qemu-system-x86_64: run tests/setup.sh" >&2; exit 1; }

target=${CARGO_TARGET_DIR:-$repo/target}
if [ -z "$bin" ]; then
    (cd "$repo" && cargo build -p blkplane-frontend -p blkplane-iothread)
    bin=$target/debug
fi
out=$(python3 "$here/build-initramfs.py" --cache "$target/guest")
kernel=$(sed -n 's/^kernel=//p' <<<"$out")
initrd=$(sed -n 's/^initrd=//p' <<<"$out")

work=$(mktemp -d /tmp/bp-guest-manual.XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    if [ "$keep" = 1 ]; then echo "kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

rw_size=$((256 * 1048576 + 65536))
ro_size=$((8 * 1048576))
truncate -s "$rw_size" "$work/rw.img"
head -c "$ro_size" /dev/urandom >"$work/ro.img"
ro_sha=$(sha256sum "$work/ro.img" | cut -d' ' -f1)

export RUST_LOG=${RUST_LOG:-info}
"$bin/blkplane-frontend" --socket "$work/rw.sock" --image "$work/rw.img" --num-queues 2 \
    --iothreads 2 --serial blkplane-guest-rw 2>"$work/frontend-rw.log" &
pids+=($!)
"$bin/blkplane-frontend" --socket "$work/ro.sock" --image "$work/ro.img" --read-only \
    --serial blkplane-guest-ro 2>"$work/frontend-ro.log" &
pids+=($!)
for s in rw ro; do
    for _ in $(seq 100); do [ -S "$work/$s.sock" ] && break; sleep 0.1; done
done

append="console=ttyS0 panic=-1 bp.nonce=manual$$ bp.size=$rw_size bp.serial=blkplane-guest-rw"
append+=" bp.queues=2 bp.lbs=512 bp.ro_size=$ro_size bp.ro_serial=blkplane-guest-ro"
append+=" bp.ro_sha256=$ro_sha"
[ "$shell" = 1 ] && append+=" bp.shell=1"
echo "work dir $work (frontend logs frontend-*.log, results results.log)"
qemu-system-x86_64 -no-user-config -nodefaults -nographic \
    -machine q35,memory-backend=mem -accel tcg,thread=single -cpu max -smp 2 -m 512 \
    -object memory-backend-memfd,id=mem,size=512M,share=on \
    -kernel "$kernel" -initrd "$initrd" -append "$append" \
    -serial mon:stdio -serial "file:$work/results.log" \
    -chardev "socket,id=rw,path=$work/rw.sock" -device vhost-user-blk-pci,chardev=rw,num-queues=2 \
    -chardev "socket,id=ro,path=$work/ro.sock" \
    -device vhost-user-blk-pci,chardev=ro,num-queues=1,queue-size=256 || true
echo "---- results ----"
cat "$work/results.log"
