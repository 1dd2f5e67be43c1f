"""ensure_guest_artifacts(): the contract the launcher relies on, and no rebuild when cached."""

import time

import pytest

from aenv.guest import artifacts, initramfs, kernel, rootfs, runtime, tools


def _fail(*args: object) -> None:
    raise AssertionError("a cached artifact was rebuilt")


def test_second_call_rebuilds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    first = artifacts.ensure_guest_artifacts()  # builds whatever the cache lacks
    for module, name in (
        (kernel, "extract_vmlinux"),
        (initramfs, "_build"),
        (rootfs, "_build"),
        (tools, "_build"),
        (runtime, "_build"),
    ):
        monkeypatch.setattr(module, name, _fail)
    started = time.monotonic()
    second = artifacts.ensure_guest_artifacts()
    assert second == first
    assert time.monotonic() - started < 5


def test_contract() -> None:
    a = artifacts.ensure_guest_artifacts()
    with open(a.kernel, "rb") as f:
        assert f.read(4) == b"\x7fELF"
    assert a.initramfs.is_file() and a.tools_image.is_file()
    with open(a.base_image, "rb") as f:
        assert f.read(4) == b"QFI\xfb"  # qcow2
    assert "console=ttyS0" in a.kernel_cmdline and "panic=-1" in a.kernel_cmdline
    digests = {a.kernel_digest, a.initramfs_digest, a.base_image_digest, a.tools_image_digest}
    assert len(digests) == 4 and all(digests)
