"""Snapshots and checkpoints of running sandboxes, and resets to a checkpoint.

A snapshot is answered once captured on this node and committed in the background
(`aenv.snapshot.pending`); one whose commit fails is told here (`SnapshotFailed`), and the disk
layer its capture sealed is unsealed as soon as nothing else runs on its sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ..events import EventBus, SandboxChanged, SandboxStopped, SnapshotFailed
from ..repository.manifest import SnapshotManifest
from ..snapshot.checkpoints import Checkpoint, CheckpointNotFound, Checkpoints
from .admission import Admission
from .backend import SandboxBackend
from .errors import InsufficientStorage, OperationFailed, Overloaded
from .failures import ENGINE_FAILURES, engine_errors
from .launch import guest_init
from .lifecycle import Lifecycle
from .mounting import VolumeMounts
from .sandboxes import Sandbox, SandboxTable
from .states import Op, State

log = logging.getLogger(__name__)


class Captures:
    """Snapshots, checkpoints and resets of the sandboxes of `table`."""

    def __init__(
        self,
        engine: SandboxBackend,
        checkpoints: Checkpoints,
        table: SandboxTable,
        lifecycle: Lifecycle,
        mounts: VolumeMounts,
        admission: Admission,
        events: EventBus,
    ):
        self.engine = engine
        self._checkpoints = checkpoints
        self.table = table
        self.lifecycle = lifecycle
        self.mounts = mounts
        self.admission = admission
        self._unseals: set[asyncio.Task[None]] = set()
        events.subscribe(SnapshotFailed, lambda failed: self._snapshot_failed(failed.manifest))
        events.subscribe(SandboxChanged, lambda changed: self._standby_again(changed.sandbox_id))

    async def snapshot(self, sandbox: Sandbox, name: str | None, *, memory: bool = True) -> SnapshotManifest:
        """Snapshot the running sandbox; without `memory` only its disk (sandboxes from it boot)."""
        self.admission.check_disk(f"snapshot sandbox {sandbox.id}")
        async with self.table.operation(sandbox, Op.SNAPSHOT):
            assert sandbox.vm is not None
            metadata = self.mounts.snapshot_metadata(sandbox)
            with engine_errors(f"snapshot of sandbox {sandbox.id}"):
                # Answered once captured on this node; committed in the background (`snapshot.pending`).
                return await self.engine.snapshot(
                    sandbox.vm, alias=name, metadata=metadata, memory=memory, wait=False
                )

    async def checkpoint(self, sandbox: Sandbox, name: str | None) -> Checkpoint:
        """Checkpoint the running sandbox; 409 while it is paused (resume it first)."""
        self.admission.check_disk(f"checkpoint sandbox {sandbox.id}")
        async with self.table.operation(sandbox, Op.CHECKPOINT):
            assert sandbox.vm is not None
            with engine_errors(f"checkpoint of sandbox {sandbox.id}"):
                checkpoint = await self.engine.checkpoint(sandbox.vm, name)
            self._prepare_standby(sandbox, checkpoint.checkpoint_id)
            return checkpoint

    def checkpoints(self, sandbox: Sandbox) -> list[Checkpoint]:
        return self._checkpoints.list(sandbox.id)

    async def delete_checkpoint(self, sandbox: Sandbox, checkpoint: str) -> None:
        async with sandbox.lock:
            with engine_errors(f"deleting a checkpoint of sandbox {sandbox.id}"):
                state = sandbox.vm.state if sandbox.vm is not None else None
                self._checkpoints.delete(sandbox.id, checkpoint, state)

    async def promote_checkpoint(
        self, sandbox: Sandbox, checkpoint: str, name: str | None
    ) -> SnapshotManifest:
        """A checkpoint of the running sandbox as a snapshot (as `snapshot` answers one)."""
        self.admission.check_disk(f"snapshot a checkpoint of sandbox {sandbox.id}")
        async with self.table.operation(sandbox, Op.SNAPSHOT):
            assert sandbox.vm is not None
            with engine_errors(f"snapshot of a checkpoint of sandbox {sandbox.id}"):
                metadata = self.mounts.snapshot_metadata(sandbox)
                return await self.engine.promote(sandbox.vm, checkpoint, name, metadata)

    async def reset(self, sandbox: Sandbox, checkpoint: str) -> None:
        """Restore the running sandbox to a checkpoint in a new VM; a reset that fails leaves it
        running as it was."""
        async with self.table.operation(sandbox, Op.RESET):
            assert sandbox.vm is not None
            with engine_errors(f"resetting sandbox {sandbox.id}"):
                vm = await self.engine.reset(sandbox.vm, checkpoint, guest_init(sandbox.record))
            self.table.publish(SandboxStopped(sandbox.id))  # its connections went to the old VM
            await self.mounts.unmount(sandbox)
            self.lifecycle.attach(sandbox, vm)
            try:
                await self.mounts.mount(sandbox)
            except ENGINE_FAILURES as exc:
                failed = f"sandbox {sandbox.id} was reset, but its volumes were not mounted: {exc}"
                raise OperationFailed(failed) from exc
            if vm.state.checkpoint is not None:
                self._prepare_standby(sandbox, vm.state.checkpoint)  # for the next reset to it

    def _standby_again(self, sandbox_id: str) -> None:
        """A sandbox running again after a pause gets its standby back (a pause drops it)."""
        sandbox = self.table.find(sandbox_id)
        if sandbox is None or sandbox.vm is None or sandbox.record.state != State.RUNNING:
            return
        if sandbox.vm.state.checkpoint is not None:
            self._prepare_standby(sandbox, sandbox.vm.state.checkpoint)

    def _prepare_standby(self, sandbox: Sandbox, checkpoint_id: str) -> None:
        """A standby of the checkpoint for the sandbox's next reset, if the node has room for one
        more VM of its size (a standby is counted as one: `Standbys.memory_mib`)."""
        try:
            self.admission.check_start(f"keep a standby of sandbox {sandbox.id}", sandbox.record.memory_mb)
        except (Overloaded, InsufficientStorage):
            return
        assert sandbox.vm is not None
        with contextlib.suppress(CheckpointNotFound):  # deleted meanwhile
            self._checkpoints.prepare_standby(sandbox.vm, checkpoint_id)

    def _snapshot_failed(self, manifest: SnapshotManifest) -> None:
        """A snapshot answered earlier failed to commit: unseal the disk layer it sealed, as soon as
        nothing else runs on its sandbox (a fork waiting for that very commit holds the lock now)."""
        sandbox = self.table.find(manifest.source.get("sandbox_id", ""))
        if sandbox is None or not manifest.disk_layers:
            return
        task = asyncio.create_task(self._unseal(sandbox, manifest.disk_layers[-1]))
        self._unseals.add(task)
        task.add_done_callback(self._unseals.discard)

    async def _unseal(self, sandbox: Sandbox, layer: str) -> None:
        async with sandbox.lock:
            if sandbox.vm is None or sandbox.record.state != State.RUNNING:
                return  # paused or gone: the sealed layer stays under the top (or goes with it)
            try:
                if await self.engine.unseal(sandbox.vm, layer):
                    log.info("sandbox %s: layer %s unsealed after its snapshot failed", sandbox.id, layer)
            except ENGINE_FAILURES:
                log.exception("sandbox %s: unsealing layer %s failed; it stays sealed", sandbox.id, layer)
