"""Guests restored ahead of time from a snapshot, waiting to become sandboxes.

Spawning QEMU and the guest's first steps after a restore are most of what creating a sandbox
costs (under TCG, every new QEMU also translates the guest's code afresh), and none of it
depends on the sandbox: a guest restored from the snapshot on a fresh disk layer and network
namespace becomes a sandbox with one `/init`. The pool keeps a target number of them per
snapshot and refills in the background after each one is taken. It only keeps count: making
and undoing a warm VM is its `WarmSource`'s business (`aenv.snapshot.warm`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..network.netns import SandboxNetwork
from ..vmm.envd_link import EnvdLink
from ..vmm.machine import VirtualMachine

log = logging.getLogger(__name__)


@dataclass
class WarmVM:
    """A guest restored from `snapshot_id` with its own disk layer and namespace, no identity yet."""

    entry_id: str
    snapshot_id: str
    vm: VirtualMachine
    network: SandboxNetwork
    envd: EnvdLink  # has answered once; its kept-alive connection is handed on to the sandbox
    top_layer: str
    workdir: Path


class WarmSource(Protocol):
    """What the pool needs from the engine: make a warm VM for a snapshot, and undo one."""

    async def spawn(self, snapshot_id: str) -> WarmVM: ...
    async def discard(self, warm: WarmVM) -> None: ...


class WarmPool:
    """Per-snapshot sets of warm VMs, made and undone by `source`."""

    def __init__(self, source: WarmSource):
        self._source = source
        self._targets: dict[str, int] = {}
        self._ready: dict[str, list[WarmVM]] = {}
        self._refills: dict[str, asyncio.Task[None]] = {}

    def target(self, snapshot_id: str) -> int:
        return self._targets.get(snapshot_id, 0)

    def ready(self, snapshot_id: str) -> int:
        return len(self._ready.get(snapshot_id, ()))

    async def set_target(self, snapshot_id: str, size: int) -> None:
        """Keep `size` warm VMs for the snapshot (0 drains it)."""
        self._targets[snapshot_id] = max(0, size)
        ready = self._ready.setdefault(snapshot_id, [])
        while len(ready) > self._targets[snapshot_id]:
            await self._source.discard(ready.pop())
        self.refill(snapshot_id)

    def take(self, snapshot_id: str) -> WarmVM | None:
        """A warm VM for the snapshot, if one is ready; the caller calls `refill` once it is done.

        Refilling right away would make the new QEMU compete for the CPU with the guest that was
        just taken, which is on the path of the create that took it.
        """
        ready = self._ready.get(snapshot_id)
        return ready.pop() if ready else None

    async def wait_filled(self, snapshot_id: str) -> None:
        """Until the snapshot's refill (if any) has finished."""
        task = self._refills.get(snapshot_id)
        if task is not None:
            await asyncio.shield(task)

    def refill(self, snapshot_id: str) -> None:
        """Start refilling the snapshot's warm VMs up to its target in the background."""
        running = self._refills.get(snapshot_id)
        if self.target(snapshot_id) > self.ready(snapshot_id) and (running is None or running.done()):
            self._refills[snapshot_id] = asyncio.create_task(self._refill(snapshot_id))

    async def _refill(self, snapshot_id: str) -> None:
        ready = self._ready.setdefault(snapshot_id, [])
        while len(ready) < self.target(snapshot_id):
            try:
                warm = await self._source.spawn(snapshot_id)
            except Exception as exc:  # a broken snapshot must not take the node down
                log.warning("warm pool for %s stopped refilling: %s", snapshot_id, exc)
                return
            if len(ready) < self.target(snapshot_id):
                ready.append(warm)
            else:
                await self._source.discard(warm)

    async def drain(self, snapshot_id: str) -> None:
        """Stop keeping VMs for the snapshot and discard the ones ready."""
        await self.set_target(snapshot_id, 0)
        task = self._refills.pop(snapshot_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for warm in self._ready.pop(snapshot_id, []):
            await self._source.discard(warm)

    async def close(self) -> None:
        for snapshot_id in list({*self._targets, *self._ready}):
            await self.drain(snapshot_id)
