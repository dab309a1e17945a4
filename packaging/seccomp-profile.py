#!/usr/bin/env python3
"""Writes blkplane's seccomp profile: the container runtime's default plus io_uring.

The base is the default profile of podman and CRI-O as Debian ships it (containers-common's
/usr/share/containers/seccomp.json, the RuntimeDefault of those runtimes; moby's and
containerd's defaults are its siblings). blkplane needs exactly three calls beyond it, the
io_uring system calls of blkplane-iothread (measured: packaging/README.md), which recent
defaults no longer allow.

The base uses Docker's extended format (archMap, and rules that apply only with a capability or
on an architecture). containerd reads a Localhost profile as an OCI runtime-spec LinuxSeccomp and
would ignore those conditions, so the output is resolved for the pod the chart runs: it holds
none of the capabilities the conditions name (checked, for both of the chart's capability sets),
and it runs on amd64 or arm64 (their conditional rules are kept, each call exists only on its own
architecture). What remains is plain runtime-spec JSON that containerd, CRI-O and podman read
alike.

    packaging/seccomp-profile.py > helm/blkplane/seccomp/blkplane.json

--without-io-uring writes the base alone (resolved the same way), to see the failure the
profile prevents; --default-action log makes every call outside the profile succeed and be
logged by the kernel (audit type 1326, in dmesg or audit.log), to find a call a new kernel or C
library needs. tests/tests/container.rs checks that the shipped profile is this script's output
for the installed base.
"""

import argparse
import json
import sys

BASE = "/usr/share/containers/seccomp.json"

# The capabilities blkplaned's container may hold: none by default, these five with
# diskUsers.enabled (helm/blkplane/templates/daemonset.yaml). A rule conditional on any of them
# would make the two differ, so none may be.
CHART_CAPABILITIES = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_KILL", "CAP_SETGID", "CAP_SETUID"]

# The node architectures served, as Docker's profile names them in `includes.arches`, and the
# seccomp architectures of each (the native one and its compat ABIs).
ARCHES = {
    "amd64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "arm64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
}
# Docker's arch names of those ABIs, for `includes.arches`.
ARCH_NAMES = {"amd64", "x86", "x32", "arm64", "arm"}

IO_URING = {
    "names": ["io_uring_enter", "io_uring_register", "io_uring_setup"],
    "action": "SCMP_ACT_ALLOW",
    "comment": "blkplane-iothread does its I/O with io_uring (the calls blkplane adds to the "
    "runtime's default)",
}


def fail(msg):
    print(f"seccomp-profile.py: {msg}", file=sys.stderr)
    sys.exit(1)


def resolve(base):
    """The base's rules that apply to the chart's pod, without conditions."""
    rules = []
    for rule in base["syscalls"]:
        inc = rule.get("includes") or {}
        exc = rule.get("excludes") or {}
        unknown = (set(inc) | set(exc)) - {"caps", "arches"}
        if unknown:
            fail(f"rule {rule['names']} has conditions this script does not resolve: {unknown}")
        caps = set(inc.get("caps") or []) | set(exc.get("caps") or [])
        if caps & set(CHART_CAPABILITIES):
            fail(f"rule {rule['names']} depends on {caps}, which the chart may grant")
        if inc.get("caps"):
            continue  # needs a capability the pod never has
        if exc.get("arches"):
            fail(f"rule {rule['names']} excludes architectures: not resolved by this script")
        arches = inc.get("arches")
        if arches and not set(arches) & ARCH_NAMES:
            continue  # another architecture's calls
        out = {"names": sorted(rule["names"]), "action": rule["action"]}
        if rule.get("args"):
            out["args"] = rule["args"]
        if "errnoRet" in rule:
            out["errnoRet"] = rule["errnoRet"]
        if rule.get("comment"):
            out["comment"] = rule["comment"]
        rules.append(out)
    return rules


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=BASE, help=f"the default profile (default {BASE})")
    p.add_argument("--without-io-uring", action="store_true", help="leave out the io_uring rule")
    p.add_argument(
        "--default-action",
        choices=["errno", "log"],
        default="errno",
        help="errno: the base's default action; log: allow and log every other call",
    )
    args = p.parse_args()
    with open(args.base) as f:
        base = json.load(f)
    if base.get("architectures"):
        fail("the base lists `architectures`; expected Docker's archMap")
    if args.default_action == "log":
        profile = {"defaultAction": "SCMP_ACT_LOG"}
    else:
        profile = {"defaultAction": base["defaultAction"]}
        if "defaultErrnoRet" in base:
            profile["defaultErrnoRet"] = base["defaultErrnoRet"]
    profile["architectures"] = [a for arch in ARCHES.values() for a in arch]
    rules = resolve(base)
    named = {n for r in rules for n in r["names"]}
    if named & set(IO_URING["names"]):
        fail("the base mentions io_uring already; the profile would not be base + io_uring")
    if not args.without_io_uring:
        rules.append(IO_URING)
    profile["syscalls"] = rules
    json.dump(profile, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
