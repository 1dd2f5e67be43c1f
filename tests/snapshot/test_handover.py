"""A pause's upload to the repository against a resume or kill on the same node (no VM).

A real posix repository; the node is reduced to what `Handover` uses. The VM-level check (a
resume that does not wait, on a new layer) is tests/vm/test_snapshot_engine.py's.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from aenv.snapshot.handover import Handover, pause_alias
from aenv.snapshot.model import SandboxState
from aenv.snapshot.repository import SnapshotNotFound, SnapshotRepository
from tests.snapshot.test_pending import captured, pending_of


def test_a_resume_supersedes_the_upload_which_then_never_commits(tmp_path: Path, monkeypatch) -> None:
    repo = SnapshotRepository(tmp_path / "repo", grace_seconds=0)
    work = tmp_path / "sandbox"
    work.mkdir()
    for name in ("delta", "devices"):
        (work / name).write_bytes(name.encode())
    host = SimpleNamespace(
        repository=repo, runtime=SimpleNamespace(publish_layers=tuple), workdir=lambda _: work,
        load_state=lambda _: SandboxState.load(work),
    )  # fmt: skip
    handover = Handover(host, enabled=True)  # type: ignore[arg-type]
    origin, _ = captured(repo, pending_of(repo))
    state = SandboxState(
        sandbox_id="s1", snapshot_id=origin.id, disk_layers=["lbase", "ltop"], network_name="n",
        delta=str(work / "delta"), devices=str(work / "devices"), paused=True,
    )  # fmt: skip
    state.save(work)
    entered, gate = threading.Event(), threading.Event()
    put_blob = repo.put_blob

    def held(*args, **kwargs):  # the upload's first store waits for the test
        entered.set()
        gate.wait(30)
        return put_blob(*args, **kwargs)

    monkeypatch.setattr(repo, "put_blob", held)

    async def main() -> None:
        handover.paused(state, origin)
        assert await asyncio.to_thread(entered.wait, 30)
        assert await handover.supersede("s1")  # at once, the upload still held
        assert await handover.claim(state) is None  # nothing durable to claim
        gate.set()
        await handover.close()
        with pytest.raises(SnapshotNotFound):
            repo.get(pause_alias("s1"))
        assert state.durable is None
        handover.paused(state, origin)  # the next pause, left alone, becomes durable
        await handover.close()
        assert state.durable == repo.get(pause_alias("s1")).id
        assert not await handover.supersede("s1") and await handover.claim(state) == state.durable

    asyncio.run(main())
