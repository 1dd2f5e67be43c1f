"""The test images every registry and disk test uses, written as one OCI layout per session."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from aenv.template import Image, ImageConfig, unpack
from tests.template.oci import Layout, directory, file, hardlink, layer, symlink

CONFIG = {
    "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=hello world"],
    "User": "1000:1000",
    "WorkingDir": "/home/user",
    "Entrypoint": ["/bin/hello"],
    "Cmd": ["--loud"],
}
EXPECTED = ImageConfig(
    env=("PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=hello world"),
    user="1000:1000",
    working_dir="/home/user",
    entrypoint=("/bin/hello",),
    cmd=("--loud",),
)


def layers(arch: str) -> list[bytes]:
    return [
        layer(
            directory("etc"),
            file("etc/os-release", b"ID=aenv-test\n"),
            file("usr/bin/hello", b"#!/bin/sh\necho hello\n", 0o4755),
            hardlink("usr/bin/hello-again", "usr/bin/hello"),
            symlink("bin", "usr/bin"),
            directory("home/user", 0o750, uid=1000, gid=1000),
            file("home/user/notes", b"first", uid=1000, gid=1000),
            file("tmp/scratch", b"gone later"),
        ),
        layer(
            file("arch", arch.encode()), file("tmp/.wh.scratch"), file("home/user/notes", b"second", uid=1000)
        ),
    ]


def write_test_layout(path: Path) -> Path:
    """Tags: ``multi`` (index of amd64 and arm64), ``single`` (amd64 only), ``armonly``."""
    layout = Layout(path)
    amd64 = layout.image(layers("amd64"), CONFIG)
    arm64 = layout.image(layers("arm64"), CONFIG, arch="arm64")
    layout.tag(layout.multi_platform([arm64, amd64]), "multi")
    layout.tag(amd64, "single")
    layout.tag(arm64, "armonly")
    return path


def unpacked(image: Image, scratch: Path) -> Path:
    scratch.mkdir(mode=0o700)
    unpack(image, scratch / "rootfs")
    return scratch / "rootfs"


def check_tree(root: Path) -> None:
    """The amd64 test image, unpacked."""
    assert (root / "arch").read_text() == "amd64"
    assert (root / "home/user/notes").read_text() == "second"
    assert not (root / "tmp/scratch").exists()
    assert os.readlink(root / "bin") == "usr/bin"
    hello = (root / "usr/bin/hello").stat()
    assert stat.S_IMODE(hello.st_mode) == 0o4755 and hello.st_nlink == 2
    assert (root / "home/user").stat().st_uid == 1000
