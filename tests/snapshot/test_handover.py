"""A pause's upload to the repository against a resume or kill on the same node, and a take-over
against the claims of the pausing node and of others (no VM).

A real posix repository; the node is reduced to what `Handover` uses. The VM-level check (a
resume that does not wait, on a new layer) is tests/vm/test_snapshot_engine.py's.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from aenv.repository.errors import SnapshotNotFound
from aenv.repository.manifest import SnapshotManifest
from aenv.repository.posix import SnapshotRepository
from aenv.snapshot.handover import Handover, PauseReclaimed, SandboxMoved, pause_alias
from aenv.snapshot.host import StopDeadline
from aenv.snapshot.model import SandboxState
from tests.snapshot.test_pending import captured, pending_of


def paused_on(repo: SnapshotRepository, work: Path) -> tuple[Handover, SandboxState, SnapshotManifest]:
    """A node's handover on `repo`, and a sandbox paused on it (its state saved in `work`)."""
    work.mkdir()
    for name in ("delta", "devices"):
        (work / name).write_bytes(name.encode())
    host = SimpleNamespace(workdir=lambda _: work, load_state=lambda _: SandboxState.load(work))
    origin, _ = captured(repo, pending_of(repo))
    state = SandboxState(
        sandbox_id="s1", snapshot_id=origin.id, disk_layers=["lbase", "ltop"], network_name="n",
        delta=str(work / "delta"), devices=str(work / "devices"), paused=True,
    )  # fmt: skip
    state.save(work)
    runtime = SimpleNamespace(publish_layers=tuple)
    return Handover(host, repo, runtime, StopDeadline(), enabled=True), state, origin  # type: ignore[arg-type]


def test_a_resume_supersedes_the_upload_which_then_never_commits(tmp_path: Path, monkeypatch) -> None:
    repo = SnapshotRepository(tmp_path / "repo", grace_seconds=0)
    handover, state, origin = paused_on(repo, tmp_path / "sandbox")
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


def test_a_take_over_tells_a_pause_its_own_node_took_back_from_one_another_node_took(tmp_path: Path) -> None:
    """A gateway that finds a durable pause's node down asks another node to take it over; when
    the pausing node had claimed it back (resumed or ended the sandbox before it could report
    that), the sandbox is not another node's: it was lost with its node."""
    repo = SnapshotRepository(tmp_path / "repo", grace_seconds=0, node="node-a")
    handover, state, origin = paused_on(repo, tmp_path / "sandbox")
    node_b = Handover(
        SimpleNamespace(),
        SnapshotRepository(repo.root, node="node-b"),
        SimpleNamespace(),
        StopDeadline(),
        enabled=True,
    )  # type: ignore[arg-type]

    async def main() -> None:
        handover.paused(state, origin)
        await handover.close()
        pause = repo.get(pause_alias("s1"))
        assert await handover.claim(state) == pause.id  # node-a resumes it
        with pytest.raises(PauseReclaimed, match="node node-a, where it was paused"):
            await node_b.take_over(None, pause, None, None)  # type: ignore[arg-type]
        await handover.unclaim(pause.id)  # node-a's resume failed: the pause is free again
        SnapshotRepository(repo.root, node="node-c").claim(pause.id)  # and node-c took it over
        with pytest.raises(SandboxMoved, match="node node-c"):
            await node_b.take_over(None, pause, None, None)  # type: ignore[arg-type]

    asyncio.run(main())
