#!/usr/bin/env python3
"""Builds the guest for tests/tests/guest.rs: a Debian kernel and a small initramfs.

Everything comes from Debian packages known to this machine's apt (tests/setup.sh makes sure
apt knows them): the kernel image, busybox-static, fio, e2fsprogs and util-linux, plus every
package they depend on. The packages are downloaded with `apt-get download` (apt checks their
hashes; this script checks them again against the index when it reuses a cached file), unpacked
with `dpkg-deb -x` into a scratch root, and only what the guest runs is put into the initramfs:

- /init (tests/guest/init.sh) and the fio job file,
- busybox (static), fio, mke2fs/mkfs.ext4, e2fsck, blkdiscard, fallocate, and the shared
  libraries they need (their DT_NEEDED closure, read from the ELF files, flattened into
  /lib/x86_64-linux-gnu),
- the kernel modules the guest loads (virtio_pci, virtio_blk, ext4, crc32c_generic) with their
  dependencies, read from each module's .modinfo `depends=` (the information depmod puts into
  modules.dep; the Debian package ships no modules.dep, depmod makes it at install time). A
  subset modules.dep is written too, and the load order to /etc/blkplane/modules. Modules the
  kernel has built in (modules.builtin) are skipped.

Output (cached): CACHE/<key>/vmlinuz and CACHE/<key>/initramfs.cpio (uncompressed newc: under
TCG, decompressing costs more than copying). The key hashes the resolved package versions and
the guest assets (this script, init.sh, the fio job file), so a new package version or an
edited init script gives a new build and anything else is reused. The .debs are kept in
CACHE/debs/. A lock file serializes concurrent builders.

Prints `key=value` lines on stdout (kernel, initrd, key, cached, kernel_release, packages);
progress goes to stderr. Exit status 3 means apt does not know the packages or a tool is
missing: run tests/setup.sh.
"""

import argparse
import fcntl
import hashlib
import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# What the guest is built from. linux-image-amd64 is the metapackage of the current kernel.
ROOT_PACKAGES = ["linux-image-amd64", "busybox-static", "fio", "e2fsprogs", "util-linux"]
# Programs to put into the initramfs: the variable init.sh knows them by, and the name looked
# up in the unpacked packages' bin and sbin directories.
PROGRAMS = {
    "BUSYBOX": "busybox",
    "FIO": "fio",
    "MKE2FS": "mke2fs",
    "E2FSCK": "e2fsck",
    "BLKDISCARD": "blkdiscard",
    "FALLOCATE": "fallocate",
}
# Extra names that are symlinks to one of the programs.
LINKS = {"mkfs.ext4": "mke2fs"}
# Libraries glibc may dlopen (e.g. for thread cancellation); added if present.
EXTRA_LIBS = ["libgcc_s.so.1"]
# Kernel modules the guest loads; their dependencies are added.
MODULES = ["virtio_pci", "virtio_blk", "crc32c_generic", "ext4"]
# Files copied verbatim from the packages.
DATA_FILES = ["etc/mke2fs.conf"]
# Guest assets that go into the initramfs (and into the cache key).
ASSETS = {"init.sh": "init", "verify.fio": "etc/blkplane/verify.fio"}

LIB_DIR = "lib/x86_64-linux-gnu"
EXIT_SETUP = 3


class SetupError(Exception):
    """Something only tests/setup.sh (or a network) can fix."""


def log(msg):
    print(f"build-initramfs: {msg}", file=sys.stderr, flush=True)


def run(cmd, **kw):
    try:
        return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw).stdout
    except FileNotFoundError as e:
        raise SetupError(f"{cmd[0]} not found ({e})") from e
    except subprocess.CalledProcessError as e:
        raise RuntimeError(
            f"{' '.join(cmd[:6])}{' ...' if len(cmd) > 6 else ''} failed with {e.returncode}:\n"
            f"{e.stderr.strip()}"
        ) from e


# ---------------------------------------------------------------------------------------------
# Packages


def resolve_packages():
    """The full dependency closure of ROOT_PACKAGES as [(name, version, arch)], as apt would
    install it on an empty system (the host's dpkg status is replaced by /dev/null)."""
    cmd = [
        "apt-get", "-s", "-q",
        "-o", "Dir::State::status=/dev/null",
        "-o", "APT::Install-Recommends=false",
        "-o", "APT::Install-Suggests=false",
        "-o", "Debug::NoLocking=true",
        "install", *ROOT_PACKAGES,
    ]
    try:
        out = run(cmd)
    except RuntimeError as e:
        raise SetupError(f"apt cannot resolve {' '.join(ROOT_PACKAGES)}: {e}") from e
    pkgs = []
    for line in out.splitlines():
        # Inst libc6 (2.36-9+deb12u14 Debian:12.13/stable [amd64])
        if not line.startswith("Inst "):
            continue
        rest = line[5:]
        name = rest.split()[0].split(":")[0]
        inner = rest[rest.index("(") + 1 : rest.rindex(")")]
        version = inner.split()[0]
        arch = inner[inner.rindex("[") + 1 : inner.rindex("]")] if "[" in inner else "amd64"
        pkgs.append((name, version, arch))
    names = {p[0] for p in pkgs}
    missing = [p for p in ROOT_PACKAGES if p not in names]
    if missing:
        raise SetupError(f"apt did not resolve {missing}:\n{out}")
    return sorted(set(pkgs))


def deb_name(name, version, arch):
    return f"{name}_{version.replace(':', '%3a')}_{arch}.deb"


def index_hashes(pkgs):
    """SHA256 of each package version from apt's index."""
    out = run(["apt-cache", "show", "--no-all-versions", *[f"{n}={v}" for n, v, _ in pkgs]])
    hashes = {}
    for record in out.split("\n\n"):
        fields = {}
        for line in record.splitlines():
            if ":" in line and not line.startswith(" "):
                k, v = line.split(":", 1)
                fields[k] = v.strip()
        if "Package" in fields and "SHA256" in fields:
            hashes.setdefault((fields["Package"], fields["Version"]), fields["SHA256"])
    return hashes


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_debs(pkgs, deb_dir):
    """Makes sure every package's .deb is in deb_dir (downloading what is missing or corrupt),
    and returns their paths."""
    os.makedirs(deb_dir, exist_ok=True)
    hashes = index_hashes(pkgs)
    paths, todo = [], []
    for n, v, a in pkgs:
        path = os.path.join(deb_dir, deb_name(n, v, a))
        paths.append(path)
        want = hashes.get((n, v))
        if want is None:
            raise SetupError(f"apt-cache has no SHA256 for {n}={v}")
        if os.path.exists(path) and sha256_file(path) == want:
            continue
        todo.append((n, v, a, path, want))
    if todo:
        log(f"downloading {len(todo)} of {len(pkgs)} packages")
        tmp = tempfile.mkdtemp(prefix=".download-", dir=deb_dir)
        try:
            try:
                run(["apt-get", "download", "-q", *[f"{n}={v}" for n, v, _, _, _ in todo]], cwd=tmp)
            except RuntimeError as e:
                raise SetupError(f"apt-get download failed: {e}") from e
            for n, v, a, path, want in todo:
                got = os.path.join(tmp, deb_name(n, v, a))
                if not os.path.exists(got):
                    raise RuntimeError(f"apt-get download did not produce {os.path.basename(got)}")
                if sha256_file(got) != want:
                    raise RuntimeError(f"{os.path.basename(got)}: SHA256 differs from apt's index")
                os.replace(got, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return paths


def prune_debs(deb_dir, keep):
    keep = {os.path.basename(p) for p in keep}
    for f in os.listdir(deb_dir):
        if f.endswith(".deb") and f not in keep:
            os.unlink(os.path.join(deb_dir, f))


# ---------------------------------------------------------------------------------------------
# Files inside the unpacked root


def resolve_in_root(root, rel, hops=0):
    """Follows symlinks of root/rel as if root were '/', and returns the final relative path."""
    if hops > 40:
        raise RuntimeError(f"symlink loop at {rel}")
    parts = [p for p in rel.split("/") if p and p != "."]
    done = []
    for i, part in enumerate(parts):
        if part == "..":
            if done:
                done.pop()
            continue
        cur = "/".join(done + [part])
        full = os.path.join(root, cur)
        if os.path.islink(full):
            target = os.readlink(full)
            base = "" if target.startswith("/") else "/".join(done)
            rest = "/".join(parts[i + 1 :])
            return resolve_in_root(root, "/".join(x for x in (base, target.lstrip("/"), rest) if x), hops + 1)
        done.append(part)
    return "/".join(done)


def find_program(root, name):
    for d in ("sbin", "bin", "usr/sbin", "usr/bin"):
        rel = f"{d}/{name}"
        if os.path.lexists(os.path.join(root, rel)):
            return rel
    raise RuntimeError(f"{name} is in none of the unpacked packages")


def elf_info(path):
    """(interpreter, [DT_NEEDED]) of a 64-bit little-endian ELF file, or None if not ELF."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF":
        return None
    if data[4] != 2 or data[5] != 1:
        raise RuntimeError(f"{path}: not a 64-bit little-endian ELF file")
    phoff = struct.unpack_from("<Q", data, 0x20)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dyn, interp = [], None, None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack_from(
            "<IIQQQQQQ", data, phoff + i * phentsize
        )
        if p_type == 1:  # PT_LOAD
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:  # PT_DYNAMIC
            dyn = (p_offset, p_filesz)
        elif p_type == 3:  # PT_INTERP
            interp = data[p_offset : p_offset + p_filesz].rstrip(b"\0").decode()
    needed = []
    if dyn:
        strtab, names = None, []
        for off in range(dyn[0], dyn[0] + dyn[1], 16):
            tag, val = struct.unpack_from("<qQ", data, off)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                names.append(val)
            elif tag == 5:  # DT_STRTAB
                strtab = val
        if names:
            for vaddr, offset, filesz in loads:
                if vaddr <= strtab < vaddr + filesz:
                    base = strtab - vaddr + offset
                    break
            else:
                raise RuntimeError(f"{path}: DT_STRTAB outside every PT_LOAD")
            for n in names:
                end = data.index(b"\0", base + n)
                needed.append(data[base + n : end].decode())
    return interp, needed


def library_index(root):
    """Every shared-library name (file or symlink) in the unpacked root -> relative paths,
    standard directories first."""
    index = {}
    preferred = ("lib/x86_64-linux-gnu/", "usr/lib/x86_64-linux-gnu/", "lib64/", "lib/", "usr/lib/")
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir.startswith(("lib/modules", "usr/share", "boot")):
            dirnames[:] = []
            continue
        for f in filenames:
            if ".so" in f:
                index.setdefault(f, []).append(os.path.normpath(os.path.join(rel_dir, f)))
    for paths in index.values():
        paths.sort(key=lambda p: next((i for i, d in enumerate(preferred) if p.startswith(d)), 99))
    return index


def library_closure(root, programs):
    """{soname: relative path of the real file} for everything the programs need, and the
    interpreter's (path in the guest, relative real file)."""
    index = library_index(root)
    libs, interp_seen = {}, {}
    todo = list(programs)
    todo_names = list(EXTRA_LIBS)
    while todo or todo_names:
        while todo_names:
            soname = todo_names.pop()
            if soname in libs:
                continue
            if soname not in index:
                if soname in EXTRA_LIBS:
                    continue
                raise RuntimeError(f"no unpacked package has {soname}")
            real = resolve_in_root(root, index[soname][0])
            libs[soname] = real
            todo.append(real)
        if todo:
            rel = todo.pop()
            info = elf_info(os.path.join(root, rel))
            if info is None:
                continue
            interp, needed = info
            if interp:
                interp_seen[interp.lstrip("/")] = resolve_in_root(root, interp)
            todo_names.extend(n for n in needed if n not in libs)
    return libs, interp_seen


# ---------------------------------------------------------------------------------------------
# Kernel modules


def modinfo(path):
    """The .modinfo key=value pairs of a kernel module (list of (key, value))."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise RuntimeError(f"{path}: not a 64-bit ELF module (compressed modules are not handled)")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i):
        # name, type, flags, addr, offset, size
        name, _, _, _, off, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, off, size

    _, stroff, _ = section(shstrndx)
    for i in range(shnum):
        name, off, size = section(i)
        end = data.index(b"\0", stroff + name)
        if data[stroff + name : end] == b".modinfo":
            out = []
            for item in data[off : off + size].split(b"\0"):
                if b"=" in item:
                    k, v = item.decode(errors="replace").split("=", 1)
                    out.append((k, v))
            return out
    return []


def module_closure(root, release):
    """(load order [relative .ko paths, dependencies first], modules.dep lines, built-in names)."""
    moddir = f"lib/modules/{release}"
    norm = lambda n: n.replace("-", "_")  # noqa: E731
    builtin = set()
    with open(os.path.join(root, moddir, "modules.builtin")) as f:
        for line in f:
            builtin.add(norm(os.path.basename(line.strip()).split(".ko")[0]))
    by_name = {}
    for dirpath, _, filenames in os.walk(os.path.join(root, moddir, "kernel")):
        for f in filenames:
            if f.endswith(".ko"):
                by_name[norm(f[:-3])] = os.path.relpath(os.path.join(dirpath, f), os.path.join(root, moddir))
            elif ".ko." in f:
                raise RuntimeError(f"compressed module {f}: not handled")
    order, deps_of, skipped = [], {}, []

    def visit(name, chain):
        name = norm(name)
        if name in deps_of or name in skipped:
            return
        if name in chain:
            raise RuntimeError(f"module dependency loop: {chain + [name]}")
        if name in builtin:
            skipped.append(name)
            return
        if name not in by_name:
            raise RuntimeError(f"kernel {release} has module {name} neither built in nor as a .ko")
        info = modinfo(os.path.join(root, moddir, by_name[name]))
        deps = [d for k, v in info if k == "depends" for d in v.split(",") if d]
        for d in deps:
            visit(d, chain + [name])
        deps_of[name] = [norm(d) for d in deps if norm(d) in by_name and norm(d) not in builtin]
        order.append(name)

    for m in MODULES:
        visit(m, [])

    def all_deps(name, acc):
        for d in deps_of[name]:
            if d not in acc:
                acc.append(d)
                all_deps(d, acc)
        return acc

    dep_lines = [
        f"{by_name[n]}: {' '.join(by_name[d] for d in all_deps(n, []))}".rstrip() for n in order
    ]
    return [f"{moddir}/{by_name[n]}" for n in order], dep_lines, skipped


# ---------------------------------------------------------------------------------------------
# cpio (newc)


class Cpio:
    def __init__(self, path):
        self.f = open(path, "wb")
        self.ino = 1
        self.dirs = set()

    def _entry(self, name, mode, data=b"", rdev=(0, 0), nlink=1):
        name_b = name.encode() + b"\0"
        fields = [self.ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rdev[0], rdev[1], len(name_b), 0]
        self.ino += 1
        hdr = b"070701" + b"".join(b"%08X" % x for x in fields)
        self.f.write(hdr + name_b)
        self.f.write(b"\0" * ((4 - (len(hdr) + len(name_b)) % 4) % 4))
        self.f.write(data)
        self.f.write(b"\0" * ((4 - len(data) % 4) % 4))

    def dir(self, path):
        path = path.strip("/")
        if not path or path in self.dirs:
            return
        self.dir(os.path.dirname(path))
        self.dirs.add(path)
        self._entry(path, stat.S_IFDIR | 0o755, nlink=2)

    def file(self, path, data, mode=0o644):
        path = path.strip("/")
        self.dir(os.path.dirname(path))
        self._entry(path, stat.S_IFREG | mode, data)

    def symlink(self, path, target):
        path = path.strip("/")
        self.dir(os.path.dirname(path))
        self._entry(path, stat.S_IFLNK | 0o777, target.encode())

    def chardev(self, path, major, minor, mode=0o600):
        path = path.strip("/")
        self.dir(os.path.dirname(path))
        self._entry(path, stat.S_IFCHR | mode, rdev=(major, minor))

    def close(self):
        self._entry("TRAILER!!!", 0)
        self.f.close()


def read(root, rel):
    with open(os.path.join(root, rel), "rb") as f:
        return f.read()


# ---------------------------------------------------------------------------------------------


def cache_key(pkgs):
    h = hashlib.sha256()
    for n, v, a in pkgs:
        h.update(f"{n}={v}:{a}\n".encode())
    for asset in sorted(list(ASSETS) + [os.path.basename(__file__)]):
        h.update(asset.encode() + b"\0")
        with open(os.path.join(HERE, asset), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:20]


def build(pkgs, debs, out_dir):
    started = time.monotonic()
    work = tempfile.mkdtemp(prefix=".build-", dir=os.path.dirname(out_dir))
    try:
        root = os.path.join(work, "root")
        os.makedirs(root)
        for deb in debs:
            run(["dpkg-deb", "-x", deb, root])
        releases = sorted(os.listdir(os.path.join(root, "lib/modules")))
        if len(releases) != 1:
            raise RuntimeError(f"expected one kernel in the packages, found {releases}")
        release = releases[0]
        kernel = f"boot/vmlinuz-{release}"

        programs = {var: find_program(root, name) for var, name in PROGRAMS.items()}
        real_programs = {var: resolve_in_root(root, rel) for var, rel in programs.items()}
        libs, interps = library_closure(root, list(real_programs.values()))
        modules, dep_lines, builtin = module_closure(root, release)

        tmp_out = os.path.join(work, "out")
        os.makedirs(tmp_out)
        shutil.copyfile(os.path.join(root, kernel), os.path.join(tmp_out, "vmlinuz"))
        cpio = Cpio(os.path.join(tmp_out, "initramfs.cpio"))
        for d in ("dev", "proc", "sys", "tmp", "mnt", "run", "root", "bin", "sbin", "usr/bin", "usr/sbin"):
            cpio.dir(d)
        cpio.chardev("dev/console", 5, 1)
        cpio.chardev("dev/null", 1, 3, 0o666)
        cpio.symlink("etc/mtab", "/proc/self/mounts")
        for asset, dest in ASSETS.items():
            cpio.file(dest, read(HERE, asset), 0o755 if dest == "init" else 0o644)
        tools = []
        for var, rel in programs.items():
            cpio.file(rel, read(root, real_programs[var]), 0o755)
            tools.append(f"{var}=/{rel}")
        for link, target in LINKS.items():
            rel = programs[next(v for v, n in PROGRAMS.items() if n == target)]
            cpio.symlink(f"{os.path.dirname(rel)}/{link}", target)
        for soname, real in sorted(libs.items()):
            cpio.file(f"{LIB_DIR}/{soname}", read(root, real), 0o755)
        for guest_path, real in interps.items():
            name = os.path.basename(guest_path)
            if guest_path == f"{LIB_DIR}/{name}":
                continue
            if name in libs:
                cpio.symlink(guest_path, f"/{LIB_DIR}/{name}")
            else:
                cpio.file(guest_path, read(root, real), 0o755)
        for rel in DATA_FILES:
            cpio.file(rel, read(root, resolve_in_root(root, rel)))
        for mod in modules:
            cpio.file(mod, read(root, mod))
        cpio.file(f"lib/modules/{release}/modules.dep", ("\n".join(dep_lines) + "\n").encode())
        cpio.file("etc/blkplane/modules", ("\n".join("/" + m for m in modules) + "\n").encode())
        cpio.file("etc/blkplane/tools.env", ("\n".join(tools) + "\n").encode())
        versions = "".join(f"{n}={v}\n" for n, v, _ in pkgs if n in ROOT_PACKAGES)
        versions += f"kernel={release}\n"
        cpio.file("etc/blkplane/versions", versions.encode())
        cpio.close()
        with open(os.path.join(tmp_out, "packages.txt"), "w") as f:
            f.write("".join(f"{n}={v} {a}\n" for n, v, a in pkgs))
        with open(os.path.join(tmp_out, "release"), "w") as f:
            f.write(release + "\n")
        size = os.path.getsize(os.path.join(tmp_out, "initramfs.cpio"))
        log(
            f"built initramfs for {release}: {size >> 20} MiB, {len(libs)} libraries, modules "
            f"{[os.path.basename(m) for m in modules]} (built in: {builtin or 'none'}) in "
            f"{time.monotonic() - started:.1f}s"
        )
        os.replace(tmp_out, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", required=True, help="cache directory (e.g. target/guest)")
    args = ap.parse_args()
    cache = os.path.abspath(args.cache)
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for tool in ("apt-get", "apt-cache", "dpkg-deb"):
            if shutil.which(tool) is None:
                raise SetupError(f"{tool} not found")
        pkgs = resolve_packages()
        key = cache_key(pkgs)
        out_dir = os.path.join(cache, key)
        cached = os.path.exists(os.path.join(out_dir, "initramfs.cpio"))
        if not cached:
            debs = fetch_debs(pkgs, os.path.join(cache, "debs"))
            build(pkgs, debs, out_dir)
            prune_debs(os.path.join(cache, "debs"), debs)
            # Older builds are of no further use.
            for d in os.listdir(cache):
                full = os.path.join(cache, d)
                is_key = len(d) == len(key) and all(c in "0123456789abcdef" for c in d)
                if is_key and d != key and os.path.isdir(full):
                    shutil.rmtree(full, ignore_errors=True)
        with open(os.path.join(out_dir, "release")) as f:
            release = f.read().strip()
        print(f"kernel={os.path.join(out_dir, 'vmlinuz')}")
        print(f"initrd={os.path.join(out_dir, 'initramfs.cpio')}")
        print(f"key={key}")
        print(f"cached={'yes' if cached else 'no'}")
        print(f"kernel_release={release}")
        print("packages=" + " ".join(f"{n}={v}" for n, v, _ in pkgs if n in ROOT_PACKAGES))


if __name__ == "__main__":
    try:
        main()
    except SetupError as e:
        print(f"build-initramfs: {e}\nbuild-initramfs: run tests/setup.sh (as root) first", file=sys.stderr)
        sys.exit(EXIT_SETUP)
    except Exception as e:  # noqa: BLE001 - a readable message for the test's failure output
        print(f"build-initramfs: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
