"""Root filesystem of the ``base`` template: Debian bookworm as a read-only qcow2 lower layer.

mmdebstrap builds the tree without loop mounts; ``aenv.template.disk.tree_to_qcow2`` (the recipe
every image's base layer uses) turns it into an ext4 filesystem labelled ``aenv-root`` (the label
the initramfs looks for) inside the qcow2 every sandbox's writable upper layer points at.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from aenv.guest.cache import cached_build, file_digest, inputs_key

log = logging.getLogger(__name__)

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
ROOT_LABEL = "aenv-root"
IMAGE_MIB = 4096
BYTES_PER_INODE = 16384  # mkfs.ext4's default ratio at this size
PRODUCT = "base.qcow2"

# What an E2B-style base template offers; init and envd need none of it (they bring their own
# runtime on the tools drive, see aenv.guest.runtime).
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
    # Every SDK command runs in a login shell (`bash -l -c`), and each process the profiles start
    # costs ~10 ms under TCG: take the user id from bash's $EUID where set (dash still runs `id`),
    # and run root's `mesg n` only on a terminal, the one place it does anything.
    'sed -i \'s/"$(id -u)"/"${EUID:-$(id -u)}"/\' "$1/etc/profile"',
    "grep -qF '${EUID:-' \"$1/etc/profile\"",
    "sed -i 's/^mesg n /[ -t 0 ] \\&\\& mesg n /' \"$1/root/.profile\"",
    "grep -q '^\\[ -t 0 \\] && mesg n ' \"$1/root/.profile\"",
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
        size=IMAGE_MIB,
    )


def debian_tree(
    suite: str,
    tree: Path,
    *,
    packages: Sequence[str] = (),
    hooks: Sequence[str] = (),
    variant: str = "minbase",
    dpkg: Sequence[str] = DPKG_OPTIONS,
) -> None:
    """A Debian ``suite`` root filesystem in the directory ``tree``, built by mmdebstrap without
    loop mounts. ``variant="extract"`` only unpacks ``packages`` (no libc unless asked for), which
    is how tests make images with no Python and no glibc."""
    cmd = [
        "mmdebstrap",
        f"--variant={variant}",
        "--mode=root",
        "--format=directory",
        *([f"--include={','.join(packages)}"] if packages else []),
        *(f"--dpkgopt={opt}" for opt in dpkg),
        *(f"--customize-hook={hook}" for hook in hooks),
        suite,
        str(tree),
        MIRROR,
    ]
    subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)


def _build(out: Path) -> None:
    # Imported here: aenv.template.disk imports this module's ROOT_LABEL at its top.
    from aenv.template.disk import tree_to_qcow2

    tree = out / "tree"
    debian_tree(SUITE, tree, packages=PACKAGES, hooks=CUSTOMIZE_HOOKS)
    tree_to_qcow2(tree, out / PRODUCT, size_mib=IMAGE_MIB, inodes=IMAGE_MIB * (1 << 20) // BYTES_PER_INODE)
    shutil.rmtree(tree)


def ensure_rootfs() -> tuple[Path, str]:
    """Path of the cached base qcow2 (built if missing) and its digest."""
    key = rootfs_key()
    return cached_build("rootfs", key, _build, PRODUCT) / PRODUCT, key
