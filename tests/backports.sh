# Sourced by tests/setup.sh and tests/setup-libvirt.sh: the bookworm-backports apt source, from
# which both take what must match QEMU 10.0 (QEMU itself, libvirt 11.3).
#
# ensure_bookworm_backports TAG: adds the suite to the apt sources if no source names it yet
# (saying so, prefixed with TAG) and sets sources_changed=1 then; does nothing elsewhere.
ensure_bookworm_backports() {
    if grep -rqsE '^[^#]*bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
        return 0
    fi
    echo "$1: adding bookworm-backports to the apt sources"
    cat >/etc/apt/sources.list.d/bookworm-backports.sources <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    sources_changed=1
}
