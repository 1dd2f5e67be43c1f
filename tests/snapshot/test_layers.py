"""A writable layer whose creation fails or is cancelled leaves no file and no qemu-img behind.

A kill cancels its sandbox's standby while the standby may be creating its layer: the layer's
name was lost with the cancelled call, so the file stayed under the node's home (CI saw one more
file after a rollout's kill). A stand-in `qemu-img` on PATH writes the file, then fails or hangs.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from aenv.runtime.layers import LayerError, LayerStore

FAKE = """#!/bin/sh
for target; do :; done
echo $$ > "{pids}/$$"
touch "$target"
{then}
"""


def fake_qemu_img(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: str) -> Path:
    """A `qemu-img` that creates its last argument, records its pid in the returned directory,
    then runs `then`."""
    bin_dir, pids = tmp_path / "bin", tmp_path / "pids"
    bin_dir.mkdir()
    pids.mkdir()
    script = bin_dir / "qemu-img"
    script.write_text(FAKE.format(pids=pids, then=then))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return pids


def store_with_base(tmp_path: Path) -> LayerStore:
    layers = LayerStore(tmp_path / "layers")
    (layers.root / "base.qcow2").write_bytes(b"")
    return layers


def test_failed_create_leaves_no_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layers = store_with_base(tmp_path)
    fake_qemu_img(tmp_path, monkeypatch, "echo refused >&2; exit 1")
    with pytest.raises(LayerError, match="refused"):
        asyncio.run(layers.create_upper("base"))
    assert layers.all_ids() == {"base"}


def test_cancelled_create_leaves_no_layer_nor_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layers = store_with_base(tmp_path)
    pids = fake_qemu_img(tmp_path, monkeypatch, "exec sleep 60")

    async def cancel_once_written() -> None:
        task = asyncio.create_task(layers.create_upper("base"))
        while len(layers.all_ids()) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(cancel_once_written(), 30))
    assert layers.all_ids() == {"base"}
    (pid,) = (int(p.name) for p in pids.iterdir())
    assert not Path(f"/proc/{pid}").exists(), "qemu-img outlived the cancelled call"
