"""Images the guest agent must run in, built by the tests themselves (once, then cached).

- ``bullseye``: Debian 11 minbase with its own, older Python (3.9) and glibc (2.31).
- ``busybox``: Debian's busybox-static alone, no libc and no Python, laid out like Docker's
  ``busybox`` image (``/bin/sh`` → busybox, root and nobody in ``/etc/passwd``, ``/tmp``).
- ``musl``: the same plus Debian's ``musl``, so that the only libc in the image is musl's.

Each is a qcow2 base layer made like every image's (``aenv.template.disk.tree_to_qcow2``), or
a layer tar for an image pushed to a test registry (``image_tar``), kept in the
content-addressed build cache, keyed by its recipe and the code that builds it.
"""

from __future__ import annotations

import shutil
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path

import aenv.template.disk
from aenv.guest import rootfs
from aenv.guest.cache import cached_build, file_digest, inputs_key
from aenv.template.disk import tree_to_qcow2

PRODUCT = "rootfs.qcow2"
LAYER = "layer.tar"
DISK_MIB = 1024

PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/home:/bin/false\n"
GROUP = "root:x:0:\nnogroup:x:65534:\n"


@dataclass(frozen=True)
class Recipe:
    suite: str
    variant: str
    packages: tuple[str, ...]
    busybox_layout: bool = False


RECIPES = {
    "bullseye": Recipe("bullseye", "minbase", ("python3",)),
    "busybox": Recipe("bookworm", "extract", ("busybox-static",), busybox_layout=True),
    "musl": Recipe("bookworm", "extract", ("busybox-static", "musl"), busybox_layout=True),
}


def busybox_layout(tree: Path) -> None:
    """What Docker's busybox image has besides the binary: /bin/sh, two users, /root and /tmp."""
    (tree / "bin/sh").symlink_to("busybox")
    for directory, mode in (("etc", 0o755), ("root", 0o700), ("tmp", 0o1777)):
        (tree / directory).mkdir(exist_ok=True)
        (tree / directory).chmod(mode)
    (tree / "etc/passwd").write_text(PASSWD)
    (tree / "etc/group").write_text(GROUP)


def _key(name: str) -> str:
    return inputs_key(
        name=name,
        recipe=[f"{k}={v}" for k, v in asdict(RECIPES[name]).items()],
        code=[file_digest(Path(m.__file__)) for m in (rootfs, aenv.template.disk)]
        + [file_digest(Path(__file__))],
    )


def _tree(name: str, tree: Path) -> None:
    recipe = RECIPES[name]
    rootfs.debian_tree(recipe.suite, tree, packages=recipe.packages, variant=recipe.variant)
    if recipe.busybox_layout:
        busybox_layout(tree)


def image_disk(name: str) -> Path:
    """The cached qcow2 of the test image ``name`` (built first if missing)."""

    def build(out: Path) -> None:
        _tree(name, out / "tree")
        tree_to_qcow2(out / "tree", out / PRODUCT, size_mib=DISK_MIB, inodes=65536)
        shutil.rmtree(out / "tree")

    return cached_build("agent-test-images", _key(name), build, PRODUCT) / PRODUCT


def image_tar(name: str) -> Path:
    """The cached tree of the test image ``name`` as one uncompressed layer tar (built first if
    missing), owners and modes as in the tree."""

    def build(out: Path) -> None:
        _tree(name, out / "tree")
        with tarfile.open(out / LAYER, "w", format=tarfile.PAX_FORMAT) as layer:
            for entry in sorted((out / "tree").iterdir()):
                layer.add(entry, arcname=entry.name)
        shutil.rmtree(out / "tree")

    return cached_build("agent-test-layers", _key(name), build, LAYER) / LAYER
