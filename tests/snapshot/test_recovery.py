"""Start-up recovery on real processes (no VM): a QEMU the previous node process was still
starting when it died is ended; one a sandbox claims, and one on another node's layers, are not."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.runtime.layers import LayerStore
from aenv.snapshot.recovery import kill_unclaimed_vms, layers_of_running_vms


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
