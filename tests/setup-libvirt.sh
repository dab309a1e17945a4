#!/usr/bin/env bash
# Installs what the libvirt test (tests/tests/libvirt.rs) needs on a Debian machine, as root:
# libvirtd with its QEMU driver, virsh, and virtlogd (a dependency: libvirt's default keeper of
# QEMU's output; the test has QEMU's output written to a file instead).
#
# On bookworm they come from bookworm-backports (libvirt 11.3, which knows QEMU 10.0; bookworm's
# own 9.0 predates it), named one by one with /bookworm-backports so that nothing else is
# pulled from there: the QEMU 10.0 tests/setup.sh installed from backports stays, and the rest
# of the dependencies come from bookworm. The backports suite is added to the apt sources if no
# source names it yet (tests/setup.sh does the same). No daemon is started or enabled: the test
# starts its own, by hand, on private directories.
#
# Idempotent: a second run installs nothing and does not touch the network. Usage: sudo
# tests/setup-libvirt.sh (tests/setup.sh runs it).
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive

if [ "$(id -u)" != 0 ]; then
    echo "tests/setup-libvirt.sh: run as root (it installs Debian packages)" >&2
    exit 1
fi

# Debian packages the monolithic libvirtd (libvirt-daemon), not the modular virtqemud; its QEMU
# driver is libvirt-daemon-driver-qemu, which depends on libvirt-daemon-log (virtlogd); virsh is
# in libvirt-clients. libvirt-common, libvirt0 and libvirt-daemon-common are named too: they
# must be the same version, from the same suite. No libvirt-daemon-system: its init scripts and
# default network are not wanted.
PACKAGES=(libvirt-daemon libvirt-daemon-driver-qemu libvirt-daemon-log libvirt-daemon-common
    libvirt-clients libvirt-common libvirt0)
# The oldest libvirt the test is written against (the version in bookworm-backports).
MIN_MAJOR=11

# shellcheck source=tests/backports.sh
. "$(dirname "$0")/backports.sh"
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
suffix=""
sources_changed=0
if [ "$codename" = bookworm ]; then
    ensure_bookworm_backports setup-libvirt
    suffix=/bookworm-backports
fi

version_of() { dpkg-query -W -f '${Version}' "$1" 2>/dev/null || true; }
installed() {
    [ "$(dpkg-query -W -f '${db:Status-Status}' "$1" 2>/dev/null || true)" = installed ]
}
# The major version of an installed package's upstream version ("11.3.0-2~bpo12+1" -> 11).
major_of() { version_of "$1" | sed -E 's/^[0-9]+://; s/\..*//'; }

need=()
for p in "${PACKAGES[@]}"; do
    if ! installed "$p" || [ "$(major_of "$p")" -lt "$MIN_MAJOR" ]; then
        need+=("$p$suffix")
    fi
done

if [ "${#need[@]}" -gt 0 ]; then
    qemu_before=$(version_of qemu-system-x86)
    # apt-get update only when the lists offer no libvirt new enough (or the sources changed).
    offered=0
    for v in $(apt-cache madison libvirt-daemon-driver-qemu 2>/dev/null | awk -F'|' '{print $2}'); do
        major=$(echo "$v" | sed -E 's/^[0-9]+://; s/\..*//')
        if [ "$major" -ge "$MIN_MAJOR" ] 2>/dev/null; then offered=1; fi
    done
    if [ "$sources_changed" = 1 ] || [ "$offered" = 0 ]; then
        echo "setup-libvirt: apt-get update"
        apt-get update -qq
    fi
    echo "setup-libvirt: installing ${need[*]}"
    apt-get install -y -qq --no-install-recommends "${need[@]}"
    qemu_after=$(version_of qemu-system-x86)
    if [ "$qemu_before" != "$qemu_after" ]; then
        echo "setup-libvirt: qemu-system-x86 changed from '$qemu_before' to '$qemu_after'" >&2
        exit 1
    fi
fi

for p in "${PACKAGES[@]}"; do
    if ! installed "$p"; then
        echo "setup-libvirt: $p is not installed" >&2
        exit 1
    fi
done
for bin in libvirtd virtlogd virsh; do
    if ! command -v "$bin" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$bin" ]; then
        echo "setup-libvirt: $bin not found after installing ${PACKAGES[*]}" >&2
        exit 1
    fi
done
echo "setup-libvirt: libvirt $(version_of libvirt-daemon-driver-qemu)," \
    "$(virsh --version 2>/dev/null | sed 's/^/virsh /'), qemu-system-x86 $(version_of qemu-system-x86)"
