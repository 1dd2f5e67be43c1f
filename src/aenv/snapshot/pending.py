"""Snapshots answered before they are durable: captured on this node, committed in the background.

A snapshot's capture (device state and changed pages, into this pending tier) and the seal of
its disk happen with the guest stopped; what follows does not need the guest and used to keep
the caller waiting: hashing and flushing the pages, storing them as blobs (an upload on s3),
publishing the sealed disk layers (s3) and committing the manifest. Here that runs in the
background, and the manifest is committed last, only when everything it names is stored.
Until then:

- the API shows it with `"durable": false` (its `POST` answer, `GET /snapshots`,
  `GET /snapshots/{id}`) and a create from it on this node waits for the commit;
- other nodes sharing the repository find its *pending mark* (`announce`, written before the
  snapshot is answered: E2B's contract is that the id `create_snapshot` returns is usable):
  a lookup there waits for the commit, up to `pending_wait` seconds, then answers 503
  `snapshot_pending` naming this node (retry later), never a 404 (`elsewhere`). The mark goes
  when the commit ends; a failed commit leaves it saying why (their 404 then says so too); a
  mark whose node is gone, or older than the collector's grace period, is stale: removed by
  whoever finds it, and by the collector;
- a delete cancels it: a commit not yet made never happens (else the snapshot is deleted after);
- its files wait in the repository's `pending_dir()/<id>/`, its disk layers sealed in the layer
  store (the collector keeps them). Once the pages are hashed and flushed, the manifest to
  commit is written beside them (`manifest.json`): a node process that ends after that point
  finishes the commit at its next start (`recover`, checking every file against its digest);
  one that ends before it rolls the snapshot back. Nobody ever sees half a snapshot.

A commit that fails (the repository unwritable, say) rolls the snapshot back: its pending
files go, blobs it stored already stay unnamed until the collector's grace period ends (a blob
may be another snapshot's too), and `SnapshotFailed` is published, so that the disk layer its capture
sealed is unsealed (`Lifecycle.unseal`) and the sandbox's chain is as it was. The API then
answers for the snapshot with why it failed (`failure`) instead of a bare 404.

On posix_fs the files become blobs by rename (the pending directory is beside the repository's
staging), so the background part costs the hash and the flush.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from ..events import EventBus, SnapshotFailed
from ..repository.contract import Repository
from ..repository.errors import SnapshotNotFound
from ..repository.files import file_digest
from ..repository.manifest import SnapshotManifest
from ..runtime.contract import RuntimeResolver
from .host import StopDeadline

log = logging.getLogger(__name__)

PENDING_MARK = "aenv.pending"  # metadata of a snapshot answered but not committed yet (never stored)
MANIFEST = "manifest.json"
CAPTURE = "snapshot"  # the capture's file stem: <stem>.devices and <stem>.delta
DEVICES = f"{CAPTURE}.devices"
DELTA = f"{CAPTURE}.delta"
FAILURES_KEPT = 1024  # failed snapshots the API still explains (the oldest are forgotten)
POLL_FIRST, POLL_MAX = 0.1, 2.0  # seconds between looks at another node's commit (doubling)


class SnapshotPending(Exception):
    """Another node answered the snapshot and has not committed it yet: retry later."""

    def __init__(self, snapshot_id: str, node: str):
        super().__init__(f"snapshot {snapshot_id} is still being committed by node {node}: retry shortly")
        self.node = node


@dataclass
class _Entry:
    # As it will be committed (disk layers: this node's layer ids), but for the digests of the
    # captured files until they are hashed (`_complete`).
    manifest: SnapshotManifest
    directory: Path
    complete: bool  # the digests are in, and manifest.json is written: a restart finishes it
    cancelled: bool = False
    committed: bool = False
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    task: asyncio.Task[None] | None = None


class PendingSnapshots:
    """This node's snapshots between their capture and their commit."""

    def __init__(
        self,
        repository: Repository,
        runtime: RuntimeResolver,
        stop: StopDeadline,
        root: Path,
        events: EventBus | None = None,
    ):
        self.repository, self.runtime, self.stop = repository, runtime, stop
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._entries: dict[str, _Entry] = {}
        self._failures: OrderedDict[str, str] = OrderedDict()  # id and alias -> why it failed
        # Told `SnapshotFailed` after a commit's rollback: the sandbox's disk layer sealed for it
        # is to be unsealed.
        self.events = events or EventBus()

    def directory(self, snapshot_id: str) -> Path:
        """Where a snapshot's capture goes before it is committed (made here, empty)."""
        path = self.root / snapshot_id
        path.mkdir()
        return path

    def add(self, draft: SnapshotManifest, directory: Path) -> None:
        """Commit the snapshot captured into `directory` in the background (`draft`: its manifest,
        without the captured files' digests, unless it is disk-only)."""
        self._start(_Entry(draft, directory, complete=False))

    def _start(self, entry: _Entry) -> None:
        self._entries[entry.manifest.id] = entry
        entry.task = asyncio.create_task(self._run(entry))

    async def announce(self, manifest: SnapshotManifest) -> None:
        """Before the snapshot is answered: mark it pending in the repository, so the nodes
        sharing it wait for its commit (`elsewhere`) instead of answering 404."""
        await asyncio.to_thread(self.repository.mark_pending, manifest.id, manifest.alias)

    async def _run(self, entry: _Entry) -> None:
        try:
            await asyncio.to_thread(self._commit, entry)
        except Exception as exc:  # rolled back: the snapshot never becomes visible
            log.exception("committing snapshot %s failed; it is rolled back", entry.manifest.id)
            shutil.rmtree(entry.directory, ignore_errors=True)
            entry.error = exc
            self._failed(entry.manifest, exc)
        finally:
            self._entries.pop(entry.manifest.id, None)
        manifest = entry.manifest
        await asyncio.to_thread(
            self._settle_mark, manifest.id, manifest.alias, self._failures.get(manifest.id)
        )

    def _settle_mark(self, snapshot_id: str, alias: str | None, failure: str | None) -> None:
        """The commit ended: its pending mark goes, or says why it failed (blocking)."""
        repository = self.repository
        try:
            if failure is None:
                repository.unmark_pending(snapshot_id, alias)
            else:
                repository.mark_pending(snapshot_id, alias, failure)
        except Exception:  # the store is away: the mark goes stale, and then goes
            log.warning("could not settle the pending mark of snapshot %s", snapshot_id, exc_info=True)

    def _failed(self, manifest: SnapshotManifest, error: Exception) -> None:
        reason = f"snapshot {manifest.id} failed and was rolled back: committing it failed ({error})"
        for name in filter(None, (manifest.id, manifest.alias)):
            self._failures[name] = reason
            self._failures.move_to_end(name)
        while len(self._failures) > FAILURES_KEPT:
            self._failures.popitem(last=False)
        try:
            self.events.publish(SnapshotFailed(manifest))
        except Exception:  # the rollback of the snapshot itself is done; the layer stays sealed
            log.exception("unsealing the disk layer of failed snapshot %s failed", manifest.id)

    def failure(self, id_or_alias: str) -> str | None:
        """Why a snapshot this node answered failed later (None: no such failure known)."""
        return self._failures.get(id_or_alias)

    def _complete(self, entry: _Entry) -> None:
        """Hash and flush the captured files, then write the manifest beside them (the point
        from which a restart finishes the commit instead of rolling it back)."""
        directory, manifest = entry.directory, entry.manifest
        delta, devices = directory / DELTA, directory / DEVICES
        if devices.exists():
            for path in (delta, devices):
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
            pages, state = file_digest(delta), file_digest(devices)
            manifest = dataclasses.replace(
                manifest, memory_deltas=(pages,), device_state=state, sizes={pages: delta.stat().st_size}
            )
        tmp = directory / f".{MANIFEST}.tmp"
        with open(tmp, "w") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / MANIFEST)
        entry.manifest, entry.complete = manifest, True

    def _commit(self, entry: _Entry) -> None:
        """Store the files, publish the disk layers, commit the manifest (blocking: a worker thread)."""
        if not entry.complete:
            self._complete(entry)
            verify = False  # hashed just now
        else:
            verify = True  # written by a previous node process: check before trusting
        repository, manifest, directory = self.repository, entry.manifest, entry.directory
        if manifest.memory_deltas:
            repository.put_blob(directory / DELTA, digest=manifest.memory_deltas[0], move=True, verify=verify)
            repository.put_blob(directory / DEVICES, digest=manifest.device_state, move=True, verify=verify)
        layers = self.runtime.publish_layers(list(manifest.disk_layers))
        with entry.lock:
            if entry.cancelled:
                shutil.rmtree(directory, ignore_errors=True)
                return
            repository.commit(dataclasses.replace(manifest, disk_layers=layers))
            entry.committed = True
        shutil.rmtree(directory, ignore_errors=True)

    # -- what the node asks about pending snapshots ------------------------------------------

    def get(self, id_or_alias: str) -> SnapshotManifest | None:
        """A pending snapshot by id or alias, marked with `PENDING_MARK`; None if there is none."""
        for entry in self._entries.values():
            manifest = entry.manifest
            if id_or_alias in (manifest.id, manifest.alias) and not entry.cancelled:
                return dataclasses.replace(manifest, metadata={**manifest.metadata, PENDING_MARK: "true"})
        return None

    def list(self) -> list[SnapshotManifest]:
        found = (self.get(snapshot_id) for snapshot_id in list(self._entries))
        return [manifest for manifest in found if manifest is not None]

    def aliases(self) -> set[str]:
        return {e.manifest.alias for e in self._entries.values() if e.manifest.alias and not e.cancelled}

    def layers(self) -> set[str]:
        """Disk layers pending snapshots name (garbage collection, in a worker thread, keeps them)."""
        return {layer for entry in list(self._entries.values()) for layer in entry.manifest.disk_layers}

    async def elsewhere(self, id_or_alias: str, wait: float) -> SnapshotManifest | None:
        """A snapshot another node answered, once that node commits it: waited for up to `wait`
        seconds (polling, the interval doubling). None if no node is committing it (no mark, or
        a stale one, removed now); `SnapshotNotFound` saying why if its commit failed;
        `SnapshotPending` if it is still being committed after `wait`."""
        repository = self.repository
        deadline, delay = time.monotonic() + wait, POLL_FIRST
        while True:
            mark = await asyncio.to_thread(repository.pending_mark, id_or_alias)  # first: then get
            with contextlib.suppress(SnapshotNotFound):
                return await asyncio.to_thread(repository.get, id_or_alias)
            if mark is None:
                return None
            if mark.failure is not None:
                raise SnapshotNotFound(mark.failure)
            if mark.stale:
                log.warning("snapshot %s was never committed by node %s: removing its mark", mark.snapshot_id,
                            mark.node)  # fmt: skip
                await asyncio.to_thread(repository.unmark_pending, mark.snapshot_id, id_or_alias)
                return None
            if (left := deadline - time.monotonic()) <= 0:
                raise SnapshotPending(mark.snapshot_id, mark.node)
            await asyncio.sleep(min(delay, left))
            delay = min(2 * delay, POLL_MAX)

    async def settle(self, id_or_alias: str) -> None:
        """Wait until the pending snapshot (if it is one) is committed or rolled back."""
        for entry in list(self._entries.values()):
            if id_or_alias in (entry.manifest.id, entry.manifest.alias) and entry.task is not None:
                await asyncio.shield(entry.task)

    async def committed(self, snapshot_id: str) -> None:
        """Wait for the pending snapshot's commit; its error if it was rolled back."""
        entry = self._entries.get(snapshot_id)
        if entry is not None and entry.task is not None:
            await asyncio.shield(entry.task)
            if entry.error is not None:
                raise entry.error

    async def cancel(self, snapshot_id: str) -> bool:
        """Delete a pending snapshot; False if its commit was made already (delete it as any)."""
        entry = self._entries.get(snapshot_id)
        if entry is None:
            return False
        with entry.lock:
            entry.cancelled = not entry.committed
        if entry.task is not None:
            await asyncio.shield(entry.task)
        return not entry.committed

    async def close(self) -> None:
        """Let the commits in progress finish, until the stop deadline (`StopDeadline.settle`): those
        left are finished at the next start (`recover`) if their pages were flushed."""
        if left := await self.stop.settle(e.task for e in list(self._entries.values())):
            log.warning("%d snapshots not committed by the stop deadline: left to the next start", left)

    def recover(self) -> int:
        """At start: finish the commits a previous node process left; returns how many."""
        resumed = 0
        for directory in sorted(self.root.iterdir()):
            try:
                manifest = SnapshotManifest.from_json((directory / MANIFEST).read_text())
            except (OSError, ValueError):  # not hashed and flushed yet: rolled back
                shutil.rmtree(directory, ignore_errors=True)
                self._settle_mark(directory.name, None, None)
                continue
            if self.repository.is_live(manifest.id):
                shutil.rmtree(directory, ignore_errors=True)
                self._settle_mark(manifest.id, manifest.alias, None)
                continue
            self._start(_Entry(manifest, directory, complete=True))
            resumed += 1
        return resumed
