#!/usr/bin/env bash
# Installs what the guest test (tests/tests/guest.rs) needs on a Debian machine, as root:
#
#   - qemu-system-x86 (qemu-system-x86_64). On bookworm it comes from bookworm-backports so that
#     it matches qemu-utils 10.0 (also from backports) instead of replacing it with 7.2; the
#     backports suite is added to the apt sources if no source names it yet.
#   - python3 and dpkg-deb / apt-get, which tests/guest/build-initramfs.py uses to build the
#     guest's initramfs from Debian packages (it downloads those itself, into the cargo target
#     dir, with `apt-get download`; the package lists this script refreshes are what it reads).
#     No cpio is needed: the script writes the archive itself.
#   - e2fsck and sha256sum for the test's host-side checks (normally present).
#
# Idempotent: a second run installs nothing and does not touch the network unless the apt lists
# lack a package the guest needs. Usage: sudo tests/setup.sh
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive

if [ "$(id -u)" != 0 ]; then
    echo "tests/setup.sh: run as root (it installs Debian packages)" >&2
    exit 1
fi

# Packages the guest image is built from (must be known to apt; see build-initramfs.py).
GUEST_PACKAGES=(linux-image-amd64 busybox-static fio e2fsprogs util-linux)

codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
release_opts=()
sources_changed=0
if [ "$codename" = bookworm ]; then
    if ! grep -rqsE '^[^#]*bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
        echo "setup: adding bookworm-backports to the apt sources"
        cat >/etc/apt/sources.list.d/bookworm-backports.sources <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
        sources_changed=1
    fi
    release_opts=(-t bookworm-backports)
fi

installed() {
    [ "$(dpkg-query -W -f '${db:Status-Status}' "$1" 2>/dev/null || true)" = installed ]
}

need=()
if ! installed qemu-system-x86; then
    need+=(qemu-system-x86)
elif [ "$codename" = bookworm ] && ! dpkg-query -W -f '${Version}' qemu-system-x86 | grep -q '~bpo'; then
    # bookworm's own 7.2: replace it with the backports build that matches qemu-utils.
    need+=(qemu-system-x86)
fi
command -v python3 >/dev/null 2>&1 || need+=(python3)
command -v dpkg-deb >/dev/null 2>&1 || need+=(dpkg)
# The host-side checks after the guest: e2fsck on the image, sha256sum of the read-only image.
command -v e2fsck >/dev/null 2>&1 || need+=(e2fsprogs)
command -v sha256sum >/dev/null 2>&1 || need+=(coreutils)

# apt-get update exactly once, and only when something is missing.
lists_ok=1
apt-cache show "${GUEST_PACKAGES[@]}" >/dev/null 2>&1 || lists_ok=0
if [ "$codename" = bookworm ] && ! apt-cache policy 2>/dev/null | grep -q 'bookworm-backports'; then
    lists_ok=0
fi
if [ "$sources_changed" = 1 ] || [ "$lists_ok" = 0 ] || [ "${#need[@]}" -gt 0 ]; then
    echo "setup: apt-get update"
    apt-get update -qq
fi

if [ "${#need[@]}" -gt 0 ]; then
    echo "setup: installing ${need[*]}"
    apt-get install -y -qq --no-install-recommends "${release_opts[@]}" "${need[@]}"
fi

if ! apt-cache show "${GUEST_PACKAGES[@]}" >/dev/null 2>&1; then
    echo "setup: apt does not know all of ${GUEST_PACKAGES[*]}" >&2
    exit 1
fi

echo "setup: $(qemu-system-x86_64 --version | head -n1)"
for p in qemu-system-x86 qemu-utils; do
    if installed "$p"; then
        echo "setup: $p $(dpkg-query -W -f '${Version}' "$p")"
    fi
done
# qemu-system-x86 and qemu-utils of different upstream versions is what pulling qemu-system-x86
# from the wrong suite looks like (qemu-utils would have been replaced by 7.2 on bookworm).
if installed qemu-utils; then
    sys_v=$(dpkg-query -W -f '${Version}' qemu-system-x86)
    utils_v=$(dpkg-query -W -f '${Version}' qemu-utils)
    if [ "$sys_v" != "$utils_v" ]; then
        echo "setup: warning: qemu-system-x86 $sys_v and qemu-utils $utils_v differ" >&2
    fi
fi
echo "setup: done"
