"""Start-up recovery on real processes (no VM): a QEMU the previous node process was still
starting when it died is ended; one a sandbox claims, and one on another node's layers, are not.
And what a kill removes of the disk layers a sandbox sealed."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from aenv.repository.errors import SnapshotNotFound
from aenv.runtime.layers import LayerStore
from aenv.snapshot.model import SandboxState
from aenv.snapshot.recovery import Recovery, kill_unclaimed_vms, layers_of_running_vms


@pytest.fixture
def fake_qemu(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes whose command line looks like QEMU's (a copy of `tail` named like it)."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        process.kill()
        process.wait()


def start(binary: Path, layer: Path, started: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    # `tail -f` follows /dev/null for ever; the layer argument is a file it cannot open.
    process = subprocess.Popen(
        [str(binary), "-f", "/dev/null", f"file.filename={layer}"], stderr=subprocess.DEVNULL
    )
    started.append(process)
    return process


def test_vms_nothing_claims_are_ended_and_only_those(
    tmp_path: Path, fake_qemu: list[subprocess.Popen[bytes]]
) -> None:
    binary = tmp_path / "qemu-system-x86_64"
    shutil.copy(shutil.which("tail") or "/usr/bin/tail", binary)
    ours, theirs = LayerStore(tmp_path / "node/layers"), LayerStore(tmp_path / "other/layers")
    claimed = start(binary, ours.path("lclaimed"), fake_qemu)
    stray = start(binary, ours.path("lstray"), fake_qemu)
    other = start(binary, theirs.path("lother"), fake_qemu)
    assert {"lclaimed", "lstray"} <= layers_of_running_vms(ours)

    assert kill_unclaimed_vms(ours, {claimed.pid}) == [stray.pid]
    assert stray.wait(10) == -9
    assert claimed.poll() is None and other.poll() is None


def test_a_killed_sandbox_takes_the_layers_it_sealed_and_only_those(tmp_path: Path) -> None:
    """Its snapshot's layers, one a snapshot of it names, one another sandbox's chain names and
    one a snapshot being committed names stay; the rest of what it sealed goes."""
    layers = LayerStore(tmp_path / "layers")
    names = ("base", "pause", "checkpoint", "snapped", "forked", "pending", "top")
    for name in names:
        layers.path(name).parent.mkdir(parents=True, exist_ok=True)
        layers.path(name).write_bytes(b"qcow2")
    manifests = {"s": SimpleNamespace(disk_layers=("base",)), "m": SimpleNamespace(disk_layers=("snapped",))}

    def get(snapshot_id: str) -> SimpleNamespace:
        if snapshot_id not in manifests:
            raise SnapshotNotFound(snapshot_id)
        return manifests[snapshot_id]

    repository = SimpleNamespace(get=get, list=lambda: list(manifests.values()))
    fork = SandboxState("child", "s", ["base", "forked", "ctop"], "n2")
    host = SimpleNamespace(sandbox_states=lambda: [fork])
    recovery = Recovery(host, repository, None, layers, None, tmp_path / "warm")  # type: ignore[arg-type]
    ended = SandboxState("gone", "s", ["base", "pause", "snapped", "forked", "pending", "top"], "n1")
    ended.kept_layers = ["checkpoint"]

    assert recovery.remove_sealed_layers(ended, keep={"pending"}) == ("checkpoint", "pause")
    assert {name for name in names if layers.exists(name)} == {"base", "snapped", "forked", "pending", "top"}
    unknown = SandboxState("gone", "deleted", ["base", "forked"], "n1")
    assert recovery.remove_sealed_layers(unknown, keep=set()) == ()  # its snapshot's layers unknown
