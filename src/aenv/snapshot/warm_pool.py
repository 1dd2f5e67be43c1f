"""Guests restored ahead of time from a snapshot, waiting to become sandboxes.

Spawning QEMU and the guest's first steps after a restore are most of what creating a sandbox
costs (under TCG, every new QEMU also translates the guest's code afresh), and none of it
depends on the sandbox: a guest restored from the snapshot on a fresh disk layer and network
namespace becomes a sandbox with one `/init`. The pool keeps a target number of them per
snapshot and refills in the background after each one is taken, and has each one that waits
brought up to date (its clock) every `REFRESH_INTERVAL`, so that taking it needs no `/init` at
all when the sandbox asks for nothing the warm VM lacks. It only keeps count and time: making,
refreshing and undoing a warm VM is its `WarmSource`'s business (`aenv.snapshot.warm`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..events import EventBus, TemplateBuilt
from ..network.netns import SandboxNetwork
from ..tasks import cancel
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
    envd: EnvdLink  # has answered; its kept-alive connection is handed on to the sandbox
    top_layer: str
    workdir: Path
    token: str | None = None  # the access token its envd holds, issued when it was made
    refreshed: float = field(default_factory=time.monotonic)  # when it was last brought up to date


# How often a waiting warm VM is brought up to date. Its guest clock was set to the node's when
# it was; a guest's clock keeps time to a few ms a minute (measured under TCG: no visible drift
# over 4 minutes), well within what envd tolerates before it steps the clock (50 ms).
REFRESH_INTERVAL = 30.0


class WarmSource(Protocol):
    """What the pool needs from the engine: make a warm VM for a snapshot, bring one that has
    waited up to date, and undo one."""

    async def spawn(self, snapshot_id: str) -> WarmVM: ...
    async def refresh(self, warm: WarmVM) -> None: ...
    async def discard(self, warm: WarmVM) -> None: ...


class WarmPool:
    """Per-snapshot sets of warm VMs, made and undone by `source`."""

    def __init__(
        self,
        source: WarmSource,
        refresh_interval: float = REFRESH_INTERVAL,
        *,
        events: EventBus | None = None,
        size: int = 0,
    ):
        self._source = source
        self.size = size  # how many warm VMs a newly built template keeps (the node's setting)
        if events is not None:
            events.subscribe(TemplateBuilt, self.built)
        self._interval = refresh_interval
        self._targets: dict[str, int] = {}
        self._ready: dict[str, list[WarmVM]] = {}
        self._refills: dict[str, asyncio.Task[None]] = {}
        self._keeper: asyncio.Task[None] | None = None

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

    async def built(self, event: TemplateBuilt) -> None:
        """Creates from a new build start from warm VMs, as from `base` (the node sets the pools
        of the templates it has at start; a build's would otherwise wait for a restart); the
        builds it replaced keep none."""
        for old in event.replaced:
            await self.drain(old)
        await self.set_target(event.snapshot_id, self.size)

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
        if self.target(snapshot_id) and (self._keeper is None or self._keeper.done()):
            self._keeper = asyncio.create_task(self._keep())

    async def _keep(self) -> None:
        """Refresh each waiting VM once it has waited `REFRESH_INTERVAL`, while the pool keeps any
        (`refill` starts this again when it does)."""
        while any(self._targets.values()):
            now = time.monotonic()
            due = [
                (snapshot_id, warm)
                for snapshot_id, ready in self._ready.items()
                for warm in ready
                if now - warm.refreshed >= self._interval
            ]
            for snapshot_id, warm in due:
                await self._refresh(snapshot_id, warm)
            oldest = min((w.refreshed for ready in self._ready.values() for w in ready), default=now)
            await asyncio.sleep(max(oldest + self._interval - time.monotonic(), self._interval / 10))

    async def _refresh(self, snapshot_id: str, warm: WarmVM) -> None:
        """Refresh `warm` out of the ready list, so that nobody takes it meanwhile; then return it
        there, or discard it if the pool no longer wants it or it failed."""
        ready = self._ready.get(snapshot_id)
        if ready is None or warm not in ready:  # taken or discarded since
            return
        ready.remove(warm)
        try:
            await self._source.refresh(warm)
        except asyncio.CancelledError:
            await self._source.discard(warm)
            raise
        except Exception as exc:  # a guest that stopped answering is not handed out
            log.warning("warm VM %s failed its refresh and is discarded: %s", warm.entry_id, exc)
            await self._source.discard(warm)
            self.refill(snapshot_id)
            return
        warm.refreshed = time.monotonic()
        if self._ready.get(snapshot_id) is ready and len(ready) < self.target(snapshot_id):
            ready.append(warm)
        else:
            await self._source.discard(warm)

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
        await cancel(self._refills.pop(snapshot_id, None))
        for warm in self._ready.pop(snapshot_id, []):
            await self._source.discard(warm)

    async def close(self) -> None:
        await cancel(self._keeper)
        self._keeper = None
        for snapshot_id in list({*self._targets, *self._ready}):
            await self.drain(snapshot_id)
