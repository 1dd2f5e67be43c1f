"""An image becomes a qcow2 base layer once: ext4 labelled for the initramfs, content intact."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from aenv.guest.rootfs import ROOT_LABEL
from aenv.template import ImageStore, base_layer, disk
from aenv.template.disk import MIN_DISK_MIB
from tests.template.images import write_test_layout


def debugfs(image: Path, request: str) -> str:
    return subprocess.run(
        ["debugfs", "-R", request, str(image)], check=True, capture_output=True, text=True
    ).stdout


def test_base_layer_is_a_cached_qcow2_of_the_rootfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AENV_CACHE_DIR", str(tmp_path / "cache"))
    image = ImageStore(tmp_path / "store").import_oci_layout(write_test_layout(tmp_path / "layout"), "single")
    disk = base_layer(image)

    info = json.loads(
        subprocess.run(
            ["qemu-img", "info", "--output=json", str(disk)], check=True, capture_output=True
        ).stdout
    )
    assert info["format"] == "qcow2"
    assert info["virtual-size"] == MIN_DISK_MIB << 20
    assert "backing-filename" not in info
    assert info["actual-size"] < 64 << 20  # zero clusters dropped

    raw = tmp_path / "root.ext4"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(disk), str(raw)], check=True)
    header = subprocess.run(["dumpe2fs", "-h", str(raw)], check=True, capture_output=True, text=True).stdout
    assert f"Filesystem volume name:   {ROOT_LABEL}" in header
    assert debugfs(raw, "cat /arch") == "amd64"
    assert debugfs(raw, "cat /home/user/notes") == "second"
    hello = debugfs(raw, "stat /usr/bin/hello")
    assert "Mode:  04755" in hello and "Links: 2" in hello
    assert "User:  1000   Group:  1000" in debugfs(raw, "stat /home/user")
    assert "tmp/scratch" not in debugfs(raw, "ls -l /tmp")
    assert 'Fast link dest: "usr/bin"' in debugfs(raw, "stat /bin")

    again = ImageStore(tmp_path / "store").import_oci_layout(tmp_path / "layout", "single")
    assert base_layer(again) == disk
    assert not any(p.name.endswith(".tmp") for p in disk.parent.parent.iterdir())
    assert sorted(p.name for p in disk.parent.iterdir()) == ["base.qcow2"]


def test_images_take_the_label_the_initramfs_mounts() -> None:
    assert disk.ROOT_LABEL == ROOT_LABEL
