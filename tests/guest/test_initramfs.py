"""The initramfs carries busybox, an /init, and every module it needs with dependencies."""

import subprocess
from pathlib import Path

import pytest

from aenv.guest import initramfs, kernel


@pytest.fixture(scope="module")
def built() -> tuple[kernel.Kernel, Path]:
    k = kernel.ensure_kernel()
    path, _ = initramfs.ensure_initramfs(k)
    return k, path


def _members(archive: Path) -> list[str]:
    with open(archive, "rb") as f:
        out = subprocess.run(["cpio", "-it", "--quiet"], stdin=f, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_dependencies_resolved_from_modules_dep(built: tuple[kernel.Kernel, Path]) -> None:
    k, _ = built
    names = [initramfs._module_name(p) for p in initramfs.module_paths(k.release)]
    for module in ("virtio_mmio", "virtio_blk", "virtio_net", "virtio_balloon", "ext4"):
        assert module in names
    # dependencies come before what needs them, including ext4's soft dependency on crc32c
    assert names.index("virtio_ring") < names.index("virtio_blk")
    assert names.index("jbd2") < names.index("ext4")
    assert names.index("mbcache") < names.index("ext4")
    assert any(n.startswith("crc32c") for n in names[: names.index("ext4")])
    # volumes: 9P over TCP, after the netfs/fscache layers 9p needs
    assert names.index("9pnet") < names.index("9pnet_fd") and names.index("netfs") < names.index("9p")


def test_archive_contents(built: tuple[kernel.Kernel, Path]) -> None:
    k, archive = built
    members = set(_members(archive))
    assert {"init", "bin/busybox", "dev/console", "lib/modules/load-order"} <= members
    for path in initramfs.module_paths(k.release):
        assert f"lib/modules/{initramfs._module_name(path)}.ko" in members


def test_init_script_finds_disks_by_label() -> None:
    script = initramfs.INIT_SCRIPT
    assert 'findfs "LABEL=$1"' in script
    assert "find_label aenv-root" in script and "find_label aenv-tools" in script
    # init runs on the tools drive's runtime, through its own loader: nothing of the image's
    assert "switch_root /newroot /opt/aenv/runtime/lib/ld-linux-x86-64.so.2 --library-path" in script
    assert "export PYTHONHOME=/opt/aenv/runtime/python" in script
    assert "/dev/vda" not in script and "/dev/vdb" not in script


def test_configured_initramfs_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    own = tmp_path / "initrd"
    own.write_bytes(b"mine")
    monkeypatch.setenv("AENV_INITRAMFS", str(own))
    path, digest = initramfs.ensure_initramfs(kernel.ensure_kernel())
    assert path == own and len(digest) == 64
