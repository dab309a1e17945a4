#!/usr/bin/env bash
# Builds blkplane's OCI image without a container registry, from Debian's packages and the
# workspace's own release build (packaging/README.md):
#
#   1. the four binaries: `cargo build --release --locked -p blkplane-daemon -p blkplane-cli
#      -p blkplane-frontend -p blkplane-iothread` (or --bin-dir DIR: binaries built elsewhere);
#   2. the runtime base: a Debian rootfs made by mmdebstrap (essential variant plus
#      packaging/runtime-packages, no documentation), kept as target/image/rootfs-KEY.tar and
#      imported as localhost/blkplane-rootfs:KEY, where KEY is a hash of the package list and
#      of how the rootfs is made, so that it is rebuilt only when one of them changes (or with
#      --refresh, to pick up Debian's updates);
#   3. the image: the Containerfile's last stage, unchanged, built by `podman build` on that
#      base with those binaries as its `build` stage, offline (--pull=never, no network);
#   4. an OCI archive of it, target/image/blkplane-VERSION.oci.tar (unless --no-archive).
#
# Usage: packaging/build-image.sh [--tag NAME] [--bin-dir DIR] [--out DIR] [--refresh]
#                                 [--no-archive]
# Defaults: --tag localhost/blkplane:VERSION (VERSION from Cargo.toml, as the chart's
# appVersion), --out target/image. Needs podman, mmdebstrap and cargo (tests/setup-container.sh
# installs the first two); as root, or rootless where podman and mmdebstrap's unshare mode work.
# Extra `podman build` options (say --ulimit, where the default limits are refused) can be given
# in BLKPLANE_PODMAN_BUILD_OPTS; the Debian mirror in BLKPLANE_DEBIAN_MIRROR (mmdebstrap's
# default otherwise).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

die() {
    echo "build-image.sh: $*" >&2
    exit 1
}

# The ID of the image NAME (empty if there is none).
image_id() {
    podman image inspect --format '{{.Id}}' "$1" 2>/dev/null || true
}

# Removes image ID once NAME names another one: it is garbage then, unless a container, a child
# image or another tag still uses it (then podman refuses, which is fine).
drop_if_replaced() {
    if [ -n "$1" ] && [ "$1" != "$(image_id "$2")" ]; then
        podman image rm "$1" >/dev/null 2>&1 || true
    fi
}

# The workspace version: [workspace.package] version in Cargo.toml.
version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)
[ -n "$version" ] || die "no [workspace.package] version in Cargo.toml"

tag="localhost/blkplane:$version"
bin_dir=""
out="${CARGO_TARGET_DIR:-$root/target}/image"
refresh=0
archive=1
while [ $# -gt 0 ]; do
    case "$1" in
        --tag) tag=${2:?--tag needs a name}; shift 2 ;;
        --bin-dir) bin_dir=${2:?--bin-dir needs a directory}; shift 2 ;;
        --out) out=${2:?--out needs a directory}; shift 2 ;;
        --refresh) refresh=1; shift ;;
        --no-archive) archive=0; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done
for tool in podman mmdebstrap sha256sum; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool is not installed (tests/setup-container.sh installs what this needs)"
done

# The Containerfile's last stage is what both builds share; it must start from the runtime base
# this script replaces.
last_from=$(grep -n '^FROM ' Containerfile | tail -n 1)
[ "${last_from#*:}" = "FROM runtime-base" ] \
    || die "the Containerfile's last stage must start with 'FROM runtime-base', not '${last_from#*:}'"

# ---- 1. the binaries
binaries=(blkplaned blkplanectl blkplane-frontend blkplane-iothread)
if [ -z "$bin_dir" ]; then
    echo "build-image.sh: cargo build --release"
    cargo build --release --locked -p blkplane-daemon -p blkplane-cli -p blkplane-frontend -p blkplane-iothread
    bin_dir="${CARGO_TARGET_DIR:-$root/target}/release"
fi
for b in "${binaries[@]}"; do
    [ -x "$bin_dir/$b" ] || die "$bin_dir/$b is missing"
done

# ---- 2. the runtime base
mkdir -p "$out"
mapfile -t packages < <(sed 's/#.*//' packaging/runtime-packages | tr -s ' \t' '\n' | sed '/^$/d')
[ "${#packages[@]}" -gt 0 ] || die "packaging/runtime-packages names no package"
suite=bookworm
# As in Debian's slim images: no manual pages, documentation (but the copyright files) or
# translations. Device nodes are left out too: the runtime provides /dev.
mm_opts=(
    --variant=essential
    "--include=$(IFS=,; echo "${packages[*]}")"
    # Merged /usr as in bookworm, with usr-is-merged instead of the usrmerge package (perl).
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
    --dpkgopt='path-exclude=/usr/share/man/*'
    --dpkgopt='path-exclude=/usr/share/doc/*'
    --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/locale/*'
    --dpkgopt='path-exclude=/usr/share/info/*'
    --skip=output/dev
)
mirror=()
[ -n "${BLKPLANE_DEBIAN_MIRROR:-}" ] && mirror=("$BLKPLANE_DEBIAN_MIRROR")
key=$(printf '%s\n' "$suite" "${mm_opts[@]}" "${mirror[@]}" | sha256sum | cut -c1-16)
rootfs="$out/rootfs-$key.tar"
base="localhost/blkplane-rootfs:$key"
[ "$refresh" = 1 ] && rm -f "$rootfs"
made=0
if [ ! -f "$rootfs" ]; then
    echo "build-image.sh: mmdebstrap $suite (${packages[*]}) -> $rootfs"
    # Its hooks are chatty: the log is shown only when it fails.
    if ! mmdebstrap --format=tar "${mm_opts[@]}" "$suite" "$rootfs.partial" "${mirror[@]}" \
        >"$out/mmdebstrap.log" 2>&1; then
        cat "$out/mmdebstrap.log" >&2
        rm -f "$rootfs.partial"
        die "mmdebstrap failed"
    fi
    mv "$rootfs.partial" "$rootfs"
    made=1
fi
if [ "$made" = 1 ] || ! podman image exists "$base"; then
    echo "build-image.sh: podman import $rootfs $base"
    previous=$(image_id "$base")
    podman import --quiet "$rootfs" "$base" >/dev/null
    drop_if_replaced "$previous" "$base"
fi

# ---- 3. the image
context="$out/context"
rm -rf "$context"
mkdir -p "$context/out"
for b in "${binaries[@]}"; do
    # A hard link where possible: the debug binaries are large.
    ln "$bin_dir/$b" "$context/out/$b" 2>/dev/null || cp "$bin_dir/$b" "$context/out/$b"
done
{
    echo "# Generated by packaging/build-image.sh: the Containerfile's last stage on the mmdebstrap"
    echo "# rootfs instead of runtime-base, with the workspace's binaries as its build stage."
    echo "FROM scratch AS build"
    echo "COPY out/ /out/"
    echo "FROM $base"
    sed -n "$((${last_from%%:*} + 1)),\$p" Containerfile
} >"$context/Containerfile"
echo "build-image.sh: podman build $tag"
previous=$(image_id "$tag")
# shellcheck disable=SC2086 # BLKPLANE_PODMAN_BUILD_OPTS is a list of options
podman build --quiet --pull=never --network=none --layers=false ${BLKPLANE_PODMAN_BUILD_OPTS:-} \
    --tag "$tag" --file "$context/Containerfile" "$context" >/dev/null
rm -rf "$context"
drop_if_replaced "$previous" "$tag"

# ---- 4. the OCI archive
if [ "$archive" = 1 ]; then
    name=${tag##*/}
    file="$out/${name//:/-}.oci.tar"
    rm -f "$file"
    podman save --quiet --format oci-archive --output "$file" "$tag"
    echo "build-image.sh: $tag, $file"
else
    echo "build-image.sh: $tag"
fi
