"""Root filesystem of the ``base`` template: Debian bookworm as a read-only qcow2 lower layer.

mmdebstrap builds the tree without loop mounts, ``mkfs.ext4 -d`` turns it into a filesystem
labelled ``aenv-root`` (the label the initramfs looks for) and ``qemu-img convert`` makes the
qcow2 base every sandbox's writable upper layer points at.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

from aenv.guest.cache import cached_build, file_digest, inputs_key

log = logging.getLogger(__name__)

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
ROOT_LABEL = "aenv-root"
IMAGE_SIZE = "4G"
PRODUCT = "base.qcow2"

# What an E2B-style base template offers; init and envd need nothing beyond python3 and iproute2.
PACKAGES = (
    "bash",
    "coreutils",
    "procps",
    "iproute2",
    "ca-certificates",
    "curl",
    "git",
    "sudo",
    "python3",
    "python3-pip",
    "python3-venv",
    "python-is-python3",
    "util-linux",
    "less",
    "netbase",
)

# Documentation and translations are dead weight in a sandbox; copyright files stay.
DPKG_OPTIONS = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
)

# Run inside mmdebstrap after all packages are installed; "$1" is the new root.
CUSTOMIZE_HOOKS = (
    'chroot "$1" groupadd --gid 1000 user',
    'chroot "$1" useradd --uid 1000 --gid 1000 --create-home --home-dir /home/user --shell /bin/bash user',
    'echo "user ALL=(ALL:ALL) NOPASSWD: ALL" > "$1/etc/sudoers.d/user" && chmod 0440 "$1/etc/sudoers.d/user"',
    'echo aenv > "$1/etc/hostname"',
    'printf "127.0.0.1\\tlocalhost\\n127.0.1.1\\taenv\\n::1\\tlocalhost ip6-localhost ip6-loopback\\n"'
    ' > "$1/etc/hosts"',
    'printf "nameserver 8.8.8.8\\n" > "$1/etc/resolv.conf"',
    'mkdir -p "$1/opt/aenv"',
    'rm -f "$1/etc/machine-id" && touch "$1/etc/machine-id"',
)


def rootfs_key() -> str:
    """Hash of everything that decides the image's content."""
    return inputs_key(
        builder=file_digest(Path(__file__)),
        suite=SUITE,
        mirror=MIRROR,
        packages=sorted(PACKAGES),
        dpkg=DPKG_OPTIONS,
        hooks=CUSTOMIZE_HOOKS,
        size=IMAGE_SIZE,
    )


def _build(out: Path) -> None:
    tree = out / "tree"
    cmd = [
        "mmdebstrap",
        "--variant=minbase",
        "--mode=root",
        "--format=directory",
        f"--include={','.join(PACKAGES)}",
        *(f"--dpkgopt={opt}" for opt in DPKG_OPTIONS),
        *(f"--customize-hook={hook}" for hook in CUSTOMIZE_HOOKS),
        SUITE,
        str(tree),
        MIRROR,
    ]
    subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)
    raw = out / "base.ext4"
    # Inode tables and journal are zeroed now, so the guest never runs ext4lazyinit into
    # its upper layer; qemu-img drops the zero clusters again.
    subprocess.run(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-L",
            ROOT_LABEL,
            "-m",
            "0",
            "-E",
            "lazy_itable_init=0,lazy_journal_init=0",
            "-d",
            str(tree),
            str(raw),
            IMAGE_SIZE,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    shutil.rmtree(tree)
    subprocess.run(
        ["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(out / PRODUCT)], check=True
    )
    raw.unlink()


def ensure_rootfs() -> tuple[Path, str]:
    """Path of the cached base qcow2 (built if missing) and its digest."""
    key = rootfs_key()
    return cached_build("rootfs", key, _build, PRODUCT) / PRODUCT, key
