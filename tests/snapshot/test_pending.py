"""Snapshots committed in the background: visible only whole, cancellable, finished after a restart.

A real posix repository; the rest of the node is reduced to what `PendingSnapshots` uses (the
runtime's `publish_layers`, here keeping layer ids as they are, as a posix node does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from aenv.events import SnapshotFailed
from aenv.repository.errors import SnapshotNotFound
from aenv.repository.manifest import MachineShape, SnapshotManifest, new_snapshot_id, utc_now
from aenv.repository.posix import SnapshotRepository
from aenv.snapshot.host import StopDeadline
from aenv.snapshot.pending import DELTA, DEVICES, PENDING_MARK, PendingSnapshots, SnapshotPending


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def repo(tmp_path: Path) -> SnapshotRepository:
    return SnapshotRepository(tmp_path / "repo", grace_seconds=0)


def pending_of(repo: SnapshotRepository) -> PendingSnapshots:
    runtime = SimpleNamespace(publish_layers=tuple)
    return PendingSnapshots(repo, runtime, StopDeadline(), repo.pending_dir())  # type: ignore[arg-type]


def captured(repo: SnapshotRepository, pending: PendingSnapshots, *, alias: str | None = None):
    """A capture as a snapshot leaves it: device state and pages in its directory, the rest stored;
    its manifest without their digests (the background commit hashes them)."""
    snapshot_id = new_snapshot_id()
    directory = pending.directory(snapshot_id)
    (directory / DEVICES).write_bytes(b"devices " + snapshot_id.encode())
    (directory / DELTA).write_bytes(b"pages " + snapshot_id.encode())
    origin_devices, image, prefix = (repo.put_bytes(part) for part in (b"origin", b"image", b"prefix"))
    machine = MachineShape(
        qemu_version="10.0.2", machine_type="microvm", vcpus=1, memory_mib=256, accel="tcg",
        kernel_digest="k", initramfs_digest="i", tools_digest="t", cmdline="console=ttyS0",
    )  # fmt: skip
    draft = SnapshotManifest(
        id=snapshot_id, kind="snapshot", alias=alias, created_at=utc_now(), source={}, machine=machine,
        memory_image=image, memory_deltas=(), device_state=origin_devices, vmstate_prefix=prefix,
        disk_layers=("lbase",),
    )  # fmt: skip
    return draft, directory


def completed(draft: SnapshotManifest, directory: Path) -> SnapshotManifest:
    """What a node process had written once it hashed and flushed the capture."""
    pages = digest((directory / DELTA).read_bytes())
    manifest = dataclasses.replace(
        draft, memory_deltas=(pages,), device_state=digest((directory / DEVICES).read_bytes())
    )
    (directory / "manifest.json").write_text(manifest.to_json())
    return manifest


def test_committed_in_the_background_then_visible_whole(repo: SnapshotRepository):
    async def main() -> None:
        pending = pending_of(repo)
        manifest, directory = captured(repo, pending, alias="named")
        pending.add(manifest, directory)
        shown = pending.get("named")
        assert shown is not None and shown.metadata[PENDING_MARK] == "true"
        assert "lbase" in pending.layers()  # the collector keeps its disk layers meanwhile
        await pending.committed(manifest.id)
        committed = repo.get("named")
        assert committed.id == manifest.id and pending.get(manifest.id) is None
        assert committed.memory_deltas == (digest(b"pages " + manifest.id.encode()),)
        assert committed.device_state == digest(b"devices " + manifest.id.encode())
        assert not directory.exists()
        repo.verify_blob(committed.memory_deltas[0])

    asyncio.run(main())


def test_a_cancelled_snapshot_never_appears(repo: SnapshotRepository):
    pending = pending_of(repo)
    manifest, directory = captured(repo, pending)

    async def main() -> None:
        pending.add(manifest, directory)
        assert await pending.cancel(manifest.id)  # before the worker thread reached the commit
        assert pending.get(manifest.id) is None and not directory.exists()

    asyncio.run(main())
    with pytest.raises(SnapshotNotFound):
        repo.get(manifest.id)


def test_a_restart_finishes_the_commit_or_rolls_back(repo: SnapshotRepository):
    left = pending_of(repo)  # a node process that answered three snapshots and ended before committing
    whole = completed(*captured(repo, left))
    damaged_draft, damaged_dir = captured(repo, left)
    damaged = completed(damaged_draft, damaged_dir)
    (damaged_dir / DELTA).write_bytes(b"not what was hashed")
    unhashed, _ = captured(repo, left)  # ended before the pages were hashed and flushed

    async def main() -> None:
        pending = pending_of(repo)
        assert pending.recover() == 2
        await pending.close()

    asyncio.run(main())
    assert repo.get(whole.id).memory_deltas == whole.memory_deltas
    for gone in (damaged, unhashed):
        with pytest.raises(SnapshotNotFound):
            repo.get(gone.id)
    assert list(repo.pending_dir().iterdir()) == []


def test_a_failed_commit_is_rolled_back_and_explained(repo: SnapshotRepository, monkeypatch):
    pending = pending_of(repo)
    manifest, directory = captured(repo, pending, alias="doomed")
    failed: list[SnapshotManifest] = []
    pending.events.subscribe(SnapshotFailed, lambda event: failed.append(event.manifest))

    def unwritable(_: SnapshotManifest) -> None:
        raise PermissionError("repository read-only")

    monkeypatch.setattr(repo, "commit", unwritable)

    async def main() -> None:
        pending.add(manifest, directory)
        with pytest.raises(PermissionError):
            await pending.committed(manifest.id)

    asyncio.run(main())
    assert [m.id for m in failed] == [manifest.id] and failed[0].disk_layers == ("lbase",)  # to unseal
    assert not directory.exists() and pending.get(manifest.id) is None
    for name in (manifest.id, "doomed"):
        reason = pending.failure(name)
        assert reason is not None and "rolled back" in reason and "repository read-only" in reason
    with pytest.raises(SnapshotNotFound):
        repo.get(manifest.id)


def test_another_node_waits_for_an_announced_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Node B finds node A's mark: it waits for A's commit and gets the snapshot; a mark whose
    commit does not come in time is a `SnapshotPending` naming A; a failed commit says why."""
    a_repo = SnapshotRepository(tmp_path / "repo", node="node-a")
    b_repo = SnapshotRepository(tmp_path / "repo", node="node-b")
    a, b = pending_of(a_repo), pending_of(b_repo)
    a_repo.heartbeat()

    async def main() -> None:
        draft, directory = captured(a_repo, a, alias="shared")
        await a.announce(draft)
        with pytest.raises(SnapshotPending, match="node-a"):
            await b.elsewhere(draft.id, wait=0.3)
        a.add(draft, directory)
        found = await b.elsewhere("shared", wait=30)
        assert found is not None and found.id == draft.id
        await asyncio.sleep(0.1)  # the mark goes right after the commit
        assert b_repo.pending_mark(draft.id) is None and await b.elsewhere(new_snapshot_id(), 1) is None

        failing, directory = captured(a_repo, a)
        await a.announce(failing)
        monkeypatch.setattr(a_repo, "commit", lambda manifest: (_ for _ in ()).throw(OSError("disk full")))
        a.add(failing, directory)
        with pytest.raises(SnapshotNotFound, match="disk full"):
            await b.elsewhere(failing.id, wait=30)

    asyncio.run(main())
