"""The local runtime resolver: committed snapshot parts as files used in place, one spliced stream each."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from aenv.repository.manifest import MachineShape, RuntimeContext, SnapshotManifest, new_snapshot_id, utc_now
from aenv.repository.posix import SnapshotRepository
from aenv.runtime.layers import LayerStore
from aenv.runtime.resolvers import LocalRuntime
from aenv.vmm import devstate

HEADER = b"QEVM\x00\x00\x00\x03"
PREFIX = HEADER + b"configuration and RAM section headers"
DEVICES = HEADER + b"\x04\x00\x00\x00\x01\x03cpu" + b"device sections"


@pytest.fixture
def repo(tmp_path: Path) -> SnapshotRepository:
    return SnapshotRepository(tmp_path / "repository", grace_seconds=0)


@pytest.fixture
def runtime(repo: SnapshotRepository, tmp_path: Path) -> LocalRuntime:
    return LocalRuntime(repo, LayerStore(tmp_path / "layers"), tmp_path / "runtime")


def committed(repo: SnapshotRepository) -> SnapshotManifest:
    boot = [repo.put_bytes(part) for part in (b"kernel", b"initramfs", b"tools")]
    machine = MachineShape(
        qemu_version="10.0.2", machine_type="microvm", vcpus=1, memory_mib=512, accel="tcg",
        kernel_digest=boot[0], initramfs_digest=boot[1], tools_digest=boot[2], cmdline="console=ttyS0",
    )  # fmt: skip
    manifest = SnapshotManifest(
        id=new_snapshot_id(), kind="snapshot", alias=None, created_at=utc_now(), source={},
        machine=machine, memory_image=repo.put_bytes(b"image"), memory_deltas=(repo.put_bytes(b"delta"),),
        device_state=repo.put_bytes(DEVICES), vmstate_prefix=repo.put_bytes(PREFIX),
        disk_layers=("lbase", "ltop"), runtime=RuntimeContext(), metadata={}, sizes={},
    )  # fmt: skip
    repo.commit(manifest)
    return manifest


def test_parts_resolve_to_the_committed_bytes(
    repo: SnapshotRepository, runtime: LocalRuntime, tmp_path: Path
):
    manifest = committed(repo)
    assert runtime.memory_image(manifest).read_bytes() == b"image"
    assert [p.read_bytes() for p in runtime.memory_deltas(manifest)] == [b"delta"]
    assert runtime.vmstate_prefix(manifest) == PREFIX
    boot = runtime.boot_files(manifest.machine)
    assert (boot.kernel.read_bytes(), boot.initramfs.read_bytes(), boot.tools_image.read_bytes()) == (
        b"kernel",
        b"initramfs",
        b"tools",
    )
    assert boot.cmdline == "console=ttyS0"
    assert runtime.layer_path("ltop") == tmp_path / "layers" / "ltop.qcow2"


def test_template_stream_is_spliced_once_and_pruned_with_its_snapshot(
    repo: SnapshotRepository, runtime: LocalRuntime, tmp_path: Path
):
    manifest = committed(repo)
    stream = runtime.template_stream(manifest)
    assert stream.parent == tmp_path / "runtime"
    assert stream.read_bytes() == devstate.splice(PREFIX, DEVICES)
    mtime = stream.stat().st_mtime_ns
    assert runtime.template_stream(manifest) == stream and stream.stat().st_mtime_ns == mtime

    assert runtime.prune(repo.is_live) == 0 and stream.exists()
    repo.delete(manifest.id)
    assert runtime.prune(repo.is_live) == 1 and not stream.exists()


def test_a_damaged_device_state_makes_no_stream(
    repo: SnapshotRepository, runtime: LocalRuntime, tmp_path: Path
):
    manifest = dataclasses.replace(committed(repo), device_state=repo.put_bytes(b"not a stream"))
    with pytest.raises(devstate.DeviceStateError):
        runtime.template_stream(manifest)
    assert not list((tmp_path / "runtime").iterdir())
