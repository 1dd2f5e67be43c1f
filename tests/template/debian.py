"""A Debian image with python3 (what envd needs in an image today), built once per cache.

mmdebstrap writes the tree as one tar, which is the image's only layer; the OCI layout around
it is written per test session. Built from the same suite and mirror as the base template.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from aenv.guest.cache import cached_build, file_digest, inputs_key
from aenv.guest.rootfs import MIRROR, SUITE
from tests.template.oci import directory, layer, single_image

PACKAGES = ("python3", "procps", "iproute2")
CONFIG = {
    "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "IMAGE_VAR=from-image"]
}
PRODUCT = "debian.tar"


def debian_tar() -> Path:
    key = inputs_key(builder=file_digest(Path(__file__)), suite=SUITE, mirror=MIRROR, packages=PACKAGES)
    return cached_build("template-test-images", key, _build, PRODUCT) / PRODUCT


def _build(out: Path) -> None:
    subprocess.run(
        ["mmdebstrap", "--variant=minbase", "--mode=root", "--format=tar",
         f"--include={','.join(PACKAGES)}", "--dpkgopt=path-exclude=/usr/share/doc/*",
         "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/locale/*",
         SUITE, str(out / PRODUCT), MIRROR],
        check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
    )  # fmt: skip


def debian_layout(path: Path) -> Path:
    """An OCI layout of the Debian image, tagged ``12``.

    mmdebstrap's tar leaves out the API filesystems' mount points; Docker's Debian images have
    them, so a second layer adds them.
    """
    mount_points = layer(*(directory(d) for d in ("proc", "sys", "dev", "run")), directory("tmp", 0o1777))
    return single_image(path, [debian_tar().read_bytes(), mount_points], CONFIG, tag="12")
