"""Snapshots answered before they are durable: captured on this node, committed in the background.

A snapshot's capture (device state and changed pages, into the staging tier) and the seal of its
disk happen with the guest stopped; what follows does not need the guest and used to keep the
caller waiting: flushing the pages to disk, storing them as blobs (an upload on s3), publishing
the sealed disk layers (s3) and committing the manifest. Here that runs in the background, and
the manifest is committed last, only when everything it names is stored. Until then:

- the snapshot is this node's alone: the API shows it with `"durable": false` (its `POST` answer,
  `GET /snapshots`, `GET /snapshots/{id}`), a create from it on this node waits for the commit,
  and other nodes do not know it yet (404);
- a delete cancels it: a commit not yet made never happens (else the snapshot is deleted after);
- its files wait in `<home>/pending/<id>/` with the manifest to commit (device state, pages,
  `manifest.json`, its disk layers sealed in the layer store, which the collector keeps): a node
  process that ends first finishes the commit at its next start (`recover`), verifying every
  file against the digest captured, and rolls it back if one does not match (a host crash that
  lost unflushed pages). Nobody ever sees half a snapshot.

On posix_fs the files become blobs by rename (the pending directory is in the node's home, on the
repository's filesystem by default), so the background part costs little more than the flush.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .host import Host
from .manifest import SnapshotManifest

log = logging.getLogger(__name__)

PENDING_MARK = "aenv.pending"  # metadata of a snapshot answered but not committed yet (never stored)
MANIFEST = "manifest.json"
CAPTURE = "snapshot"  # the capture's file stem: <stem>.devices and <stem>.delta
DEVICES = f"{CAPTURE}.devices"
DELTA = f"{CAPTURE}.delta"


@dataclass
class _Entry:
    manifest: SnapshotManifest  # as it will be committed (disk layers: this node's layer ids)
    directory: Path
    verify: bool  # the files' digests are checked (after a restart), not trusted from the capture
    cancelled: bool = False
    committed: bool = False
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    task: asyncio.Task[None] | None = None


class PendingSnapshots:
    """This node's snapshots between their capture and their commit."""

    def __init__(self, host: Host, root: Path):
        self.host = host
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._entries: dict[str, _Entry] = {}

    def directory(self, snapshot_id: str) -> Path:
        """Where a snapshot's capture goes before it is committed (made here, empty)."""
        path = self.root / snapshot_id
        path.mkdir()
        return path

    def add(self, manifest: SnapshotManifest, directory: Path, *, verify: bool = False) -> None:
        """Commit the captured snapshot in the background; `manifest` names its files' digests."""
        tmp = directory / f".{MANIFEST}.tmp"
        tmp.write_text(manifest.to_json())
        os.replace(tmp, directory / MANIFEST)
        entry = _Entry(manifest, directory, verify)
        self._entries[manifest.id] = entry
        entry.task = asyncio.create_task(self._run(entry))

    async def _run(self, entry: _Entry) -> None:
        try:
            await asyncio.to_thread(self._commit, entry)
        except Exception as exc:  # rolled back: the snapshot never becomes visible
            log.exception("committing snapshot %s failed; it is rolled back", entry.manifest.id)
            shutil.rmtree(entry.directory, ignore_errors=True)
            entry.error = exc
        finally:
            self._entries.pop(entry.manifest.id, None)

    def _commit(self, entry: _Entry) -> None:
        """Store the files, publish the disk layers, commit the manifest (blocking: a worker thread)."""
        repository, manifest, directory = self.host.repository, entry.manifest, entry.directory
        delta = directory / DELTA
        if manifest.memory_deltas and delta.exists():
            with open(delta, "rb") as f:
                os.fsync(f.fileno())
            repository.put_blob(delta, digest=manifest.memory_deltas[0], move=True, verify=entry.verify)
        devices = directory / DEVICES
        if devices.exists():
            repository.put_blob(devices, digest=manifest.device_state, move=True, verify=entry.verify)
        layers = self.host.runtime.publish_layers(list(manifest.disk_layers))
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
        """Disk layers pending snapshots name (garbage collection must keep them)."""
        layers = set()
        for directory in self.root.iterdir():
            with contextlib.suppress(OSError, ValueError):
                layers.update(SnapshotManifest.from_json((directory / MANIFEST).read_text()).disk_layers)
        return layers

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
        """Let the commits in progress finish (a node stopping cleanly leaves nothing pending)."""
        await asyncio.gather(*(e.task for e in self._entries.values() if e.task), return_exceptions=True)

    def recover(self) -> int:
        """At start: finish the commits a previous node process left; returns how many."""
        resumed = 0
        for directory in sorted(self.root.iterdir()):
            try:
                manifest = SnapshotManifest.from_json((directory / MANIFEST).read_text())
            except (OSError, ValueError):  # captured, never answered: nobody knows this snapshot
                shutil.rmtree(directory, ignore_errors=True)
                continue
            if self.host.repository.is_live(manifest.id):
                shutil.rmtree(directory, ignore_errors=True)
                continue
            self.add(manifest, directory, verify=True)
            resumed += 1
        return resumed
