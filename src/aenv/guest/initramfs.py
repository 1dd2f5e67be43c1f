"""Initramfs: busybox plus the virtio and ext4 modules Debian's kernel builds as modules.

Its ``/init`` loads the modules, finds the root and tools disks by their ext4 labels (never by
probe order), mounts them and switch_roots into the guest's Python init, which runs on the tools drive's own
runtime (loader, libraries, interpreter), never on anything of the root disk's image. Modules and their
dependencies (soft dependencies too, e.g. ext4 needs crc32c) come from ``modprobe
--show-depends`` against modules.dep of the kernel's own release, stored decompressed so the
busybox ``insmod`` needs no decompressor.
"""

from __future__ import annotations

import gzip
import lzma
import os
import shutil
import stat
import subprocess
from pathlib import Path

from aenv.agent.init import PYTHON_HOME, shipped
from aenv.guest.cache import cached_build, file_digest, inputs_key
from aenv.guest.kernel import Kernel
from aenv.guest.rootfs import ROOT_LABEL
from aenv.guest.tools import TOOLS_LABEL, TOOLS_MOUNT

MODULES = (
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "failover",
    "net_failover",
    "virtio_net",
    "virtio_blk",
    "virtio_balloon",
    "ext4",
    # Volumes: 9P over TCP from the node's server in the sandbox's namespace (aenv.volumes.server).
    "9p",
    "9pnet_fd",
)
BUSYBOX = Path("/bin/busybox")
PRODUCT = "initramfs.cpio"
# -S: init needs no site-packages, and skipping site saves boot time under TCG.
GUEST_INIT = (*shipped("python3", "-S", "-u"), f"{TOOLS_MOUNT}/init.py")

INIT_SCRIPT = f"""#!/bin/busybox sh
# aenv initramfs: load drivers, mount root + tools by label, hand over to the Python init.
/bin/busybox --install -s /bin
export PATH=/bin
log() {{ echo "aenv-initramfs: $*" > /dev/console; }}
fail() {{
    log "FATAL: $*"
    log "cannot boot this sandbox; rebooting (QEMU runs with -no-reboot, so the VM exits)"
    sleep 1
    reboot -f
}}
mount -t devtmpfs devtmpfs /dev || fail "cannot mount devtmpfs"
mount -t proc proc /proc
mount -t sysfs sysfs /sys
while read -r module; do
    insmod "/lib/modules/$module.ko" || log "warning: insmod $module failed"
done < /lib/modules/load-order
find_label() {{
    i=0
    while [ $i -lt 200 ]; do
        dev=$(findfs "LABEL=$1" 2>/dev/null) && {{ echo "$dev"; return 0; }}
        i=$((i + 1))
        usleep 25000
    done
    return 1
}}
disks() {{ ls /sys/block | tr '\\n' ' '; }}
root=$(find_label {ROOT_LABEL}) || fail "no disk labelled {ROOT_LABEL} (disks: $(disks))"
tools=$(find_label {TOOLS_LABEL}) || fail "no disk labelled {TOOLS_LABEL} (disks: $(disks))"
log "root $root, tools $tools"
mount -t ext4 -o rw,noatime "$root" /newroot || fail "cannot mount root $root"
mkdir -p /newroot{TOOLS_MOUNT} || fail "cannot create {TOOLS_MOUNT} on root"
mount -t ext4 -o ro,noatime "$tools" /newroot{TOOLS_MOUNT} || fail "cannot mount tools $tools"
[ -x /newroot{GUEST_INIT[0]} ] || fail "tools disk has no {GUEST_INIT[0]}"
[ -f /newroot{GUEST_INIT[-1]} ] || fail "tools disk has no {GUEST_INIT[-1]}"
mount --move /dev /newroot/dev || umount /dev
umount /proc /sys
export PYTHONHOME={PYTHON_HOME}
exec switch_root /newroot {" ".join(GUEST_INIT)}
"""


def module_paths(release: str) -> list[Path]:
    """The .ko files for MODULES and all their dependencies, in load order."""
    out = subprocess.run(
        ["modprobe", "--all", "--show-depends", "--set-version", release, *MODULES],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    paths: list[Path] = []
    for line in out.splitlines():
        words = line.split()
        if words and words[0] == "insmod" and Path(words[1]) not in paths:
            paths.append(Path(words[1]))
    return paths


def _module_name(path: Path) -> str:
    return path.name.split(".ko")[0]


def _decompressed(path: Path) -> bytes:
    data = path.read_bytes()
    if path.name.endswith(".ko.xz"):
        return lzma.decompress(data)
    if path.name.endswith(".ko.gz"):
        return gzip.decompress(data)
    if path.name.endswith(".ko.zst"):
        return subprocess.run(["zstd", "-dcq"], input=data, capture_output=True, check=True).stdout
    return data


def initramfs_key(kernel: Kernel) -> str:
    modules = module_paths(kernel.release)
    return inputs_key(
        kernel=kernel.digest,
        release=kernel.release,
        modules=[f"{p}:{file_digest(p)}" for p in modules],
        busybox=file_digest(BUSYBOX),
        builder=file_digest(Path(__file__)),
    )


def _build(release: str, out: Path) -> None:
    tree = out / "tree"
    for directory in ("bin", "dev", "proc", "sys", "newroot", "lib/modules"):
        (tree / directory).mkdir(parents=True)
    # The kernel opens /dev/console before /init runs; without the node early output is lost.
    os.mknod(tree / "dev/console", 0o600 | stat.S_IFCHR, os.makedev(5, 1))
    shutil.copy2(BUSYBOX, tree / "bin/busybox")
    order = []
    for path in module_paths(release):
        name = _module_name(path)
        (tree / "lib/modules" / f"{name}.ko").write_bytes(_decompressed(path))
        order.append(name)
    (tree / "lib/modules/load-order").write_text("\n".join(order) + "\n")
    (tree / "init").write_text(INIT_SCRIPT)
    (tree / "init").chmod(0o755)
    files = subprocess.run(["find", ".", "-mindepth", "1"], cwd=tree, capture_output=True, check=True).stdout
    with open(out / PRODUCT, "wb") as archive:
        subprocess.run(
            ["cpio", "--quiet", "-o", "-H", "newc", "-R", "0:0", "--reproducible"],
            cwd=tree,
            input=b"\n".join(sorted(files.splitlines())) + b"\n",
            stdout=archive,
            check=True,
        )
    shutil.rmtree(tree)


def ensure_initramfs(kernel: Kernel) -> tuple[Path, str]:
    """Path of the cached initramfs for ``kernel`` (or ``AENV_INITRAMFS``) and its digest."""
    configured = os.environ.get("AENV_INITRAMFS")
    if configured:
        return Path(configured), file_digest(Path(configured))
    key = initramfs_key(kernel)
    return cached_build("initramfs", key, lambda tmp: _build(kernel.release, tmp), PRODUCT) / PRODUCT, key
