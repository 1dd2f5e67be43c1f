"""An image's root filesystem as a qcow2 base disk layer, built once per image.

The recipe is the base template's (``aenv.guest.rootfs``): ``mkfs.ext4 -d`` turns the unpacked
tree into an ext4 filesystem labelled the way the initramfs looks for the root, and ``qemu-img
convert`` makes the qcow2 that build and sandbox overlays point at. The result lives in the
content-addressed build cache keyed by the image's config digest (the image ID: the same for the
image from a registry, an OCI layout or ``docker save``) and by this converter's code, so it is
derived once per image however many templates build on it, and concurrent builds wait for one.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

from aenv.guest.cache import cached_build, file_digest, inputs_key
from aenv.template import unpack as unpack_module
from aenv.template.image import Image
from aenv.template.unpack import DEFAULT_MAX_BYTES, unpack

# The label the initramfs mounts the root by: `aenv.guest.rootfs.ROOT_LABEL`, whose module cannot be
# imported here (it builds the base image with `tree_to_qcow2`, and its bytes key that image's
# cache, so it stays as it is); tests/template/test_disk.py checks the two agree.
ROOT_LABEL = "aenv-root"
PRODUCT = "base.qcow2"
CACHE_KIND = "images"
MIN_DISK_MIB = 4096  # as the base template: room for build steps and a sandbox's own writes
_MIB = 1 << 20
_BYTES_PER_INODE = 16384  # mkfs.ext4's default ratio for filesystems of this size


def base_layer(image: Image, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Path of the cached qcow2 holding ``image``'s root filesystem (built first if missing)."""
    return (
        cached_build(CACHE_KIND, base_layer_key(image), functools.partial(_build, image, max_bytes), PRODUCT)
        / PRODUCT
    )


def base_layer_key(image: Image) -> str:
    """Cache key of an image's base layer: its config digest and the code that converts it."""
    return inputs_key(
        image=image.config_digest,
        converter=[file_digest(Path(unpack_module.__file__)), file_digest(Path(__file__))],
    )


def _build(image: Image, max_bytes: int, out: Path) -> None:
    tree = out / "tree"  # ``out`` is private to root until complete, as ``unpack`` requires
    unpack(image, tree, max_bytes=max_bytes)
    used, inodes = tree_usage(tree)
    size_mib = max(MIN_DISK_MIB, 2 * used // _MIB + 1024)
    tree_to_qcow2(
        tree, out / PRODUCT, size_mib=size_mib, inodes=max(2 * inodes, size_mib * _MIB // _BYTES_PER_INODE)
    )
    shutil.rmtree(tree)


def tree_usage(tree: Path) -> tuple[int, int]:
    """Bytes allocated and inodes used by a tree (hardlinked files counted once)."""
    seen: set[int] = set()
    used = 0
    for directory, dirs, files in os.walk(tree):
        for name in (*dirs, *files):
            st = os.lstat(os.path.join(directory, name))
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                used += st.st_blocks * 512
    return used, len(seen) + 1


def tree_to_qcow2(tree: Path, product: Path, *, size_mib: int, inodes: int) -> None:
    """Make ``product``, a qcow2 of an ext4 filesystem (label ``aenv-root``) holding ``tree``."""
    raw = product.with_suffix(".ext4")
    # Inode tables and journal are zeroed now, so the guest never runs ext4lazyinit into its
    # upper layer; qemu-img drops the zero clusters again.
    subprocess.run(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-L",
            ROOT_LABEL,
            "-m",
            "0",
            "-N",
            str(inodes),
            "-E",
            "lazy_itable_init=0,lazy_journal_init=0",
            "-d",
            str(tree),
            str(raw),
            f"{size_mib}M",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    try:
        subprocess.run(
            ["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(product)], check=True
        )
    finally:
        raw.unlink()
