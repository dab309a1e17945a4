#!/usr/bin/env bash
# Installs what the container image test (tests/tests/container.rs) and packaging/build-image.sh
# need on a Debian machine, as root, all from Debian's packages:
#
#   - podman, and runc as its runtime: the test passes `--runtime runc` (crun 1.8, bookworm's,
#     refuses hybrid cgroup layouts). podman brings containers-common, whose
#     /usr/share/containers/seccomp.json is the base of helm/blkplane/seccomp/blkplane.json.
#   - catatonit: podman's --init and the pause process of its pods (PID 1, which reaps the
#     iothreads orphaned by a killed frontend, as the chart's shared process namespace does).
#   - mmdebstrap: the image's Debian rootfs.
#   - python3 with PyYAML (python3-yaml): the test reads `helm template`'s YAML with it, and
#     packaging/seccomp-profile.py runs with python3.
#
# helm comes from tests/setup.sh, which runs this script. Idempotent: a second run installs
# nothing and does not touch the network; apt-get update runs only when a package is missing
# and apt does not know it. Usage: sudo tests/setup-container.sh
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive

if [ "$(id -u)" != 0 ]; then
    echo "tests/setup-container.sh: run as root (it installs Debian packages)" >&2
    exit 1
fi

installed() {
    [ "$(dpkg-query -W -f '${db:Status-Status}' "$1" 2>/dev/null || true)" = installed ]
}

need=()
for p in podman runc catatonit mmdebstrap python3 python3-yaml; do
    installed "$p" || need+=("$p")
done

if [ "${#need[@]}" -gt 0 ]; then
    if ! apt-cache show "${need[@]}" >/dev/null 2>&1; then
        echo "setup-container: apt-get update"
        apt-get update -qq
    fi
    echo "setup-container: installing ${need[*]}"
    apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

for f in /usr/share/containers/seccomp.json /usr/libexec/podman/catatonit; do
    if [ ! -e "$f" ]; then
        echo "setup-container: $f is missing after the installation" >&2
        exit 1
    fi
done
echo "setup-container: $(podman --version), $(runc --version | head -n1), mmdebstrap $(dpkg-query -W -f '${Version}' mmdebstrap), containers-common $(dpkg-query -W -f '${Version}' golang-github-containers-common)"
