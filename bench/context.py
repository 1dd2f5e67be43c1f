"""What every figure works with: the node, its client, the mode's plan, the floors, and sandbox cleanup."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .client import NodeClient
from .floors import FloorLab
from .node import BenchError, Node
from .plan import Plan

T = TypeVar("T")
REFILL_WAIT = 5.0  # seconds to let the warm pool refill when it cannot be watched (a remote node)
SETTLE = 0.5  # seconds for the host to quiet down after a refill or a resume, before the next sample
HOST_QUIET_WINDOW = 0.5  # seconds over which the host's CPU use is judged
HOST_QUIET_BUSY = 0.25  # share of all the host's CPU time in use that still counts as quiet
HOST_QUIET_LIMIT = 60.0  # seconds to wait at most for a quiet host (it may never be, if shared)


def host_busy_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole host since boot, from /proc/stat."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return sum(ticks) - idle, sum(ticks)


async def bounded(limit: int, jobs: Iterable[Callable[[], Awaitable[T]]]) -> list[T | BaseException]:
    """Run the jobs with at most `limit` at a time; results (or exceptions) in job order."""
    gate = asyncio.Semaphore(limit)

    async def one(job: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            return await job()

    return await asyncio.gather(*(one(job) for job in jobs), return_exceptions=True)


class Sandboxes:
    """Sandboxes a figure creates; whatever is still there at the end is killed, also on failure."""

    def __init__(self, client: NodeClient):
        self.client = client
        self.live: dict[str, dict[str, Any]] = {}

    async def __aenter__(self) -> Sandboxes:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill_all()

    def track(self, sandbox: dict[str, Any]) -> dict[str, Any]:
        self.live[sandbox["sandboxID"]] = sandbox
        return sandbox

    async def create(self, template: str = "base") -> dict[str, Any]:
        return self.track(await self.client.create(template))

    async def kill(self, sandbox_id: str) -> None:
        self.live.pop(sandbox_id, None)
        await self.client.kill(sandbox_id)

    async def kill_all(self) -> None:
        ids, self.live = list(self.live), {}
        results = await bounded(8, [lambda i=i: self.client.kill(i, missing_ok=True) for i in ids])
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise BenchError(f"killing {len(failed)} sandboxes failed: {failed[0]}")


@dataclass
class Context:
    node: Node
    client: NodeClient
    plan: Plan
    lab: FloorLab | None  # None when the node is not on this host
    template_id: str  # of `base`
    _base: tuple[list[float], list[float]] | None = field(default=None, init=False)

    async def quiet(self, snapshot_id: str | None = None) -> str:
        """Until the node's warm pool for `base` (or `snapshot_id`) is full again, then a moment;
        says how this was decided."""
        node = self.node
        if not node.local or not node.warm_pool:
            await asyncio.sleep(REFILL_WAIT)
            return f"waited a fixed {REFILL_WAIT:g} s before each sample for the warm pool to refill"
        deadline = time.monotonic() + 120
        pool = snapshot_id or self.template_id
        while node.warm_ready(pool) < node.warm_pool and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(SETTLE)
        return (
            f"before each sample: waited until all {node.warm_pool} warm VMs of `base` were ready "
            f"(their record under the node's runtime/warm), then {SETTLE:g} s"
        )

    async def host_quiet(self) -> float:
        """Until the host's CPUs were mostly idle over a short window, at most `HOST_QUIET_LIMIT`
        seconds; returns the seconds waited. A sample that creates many sandboxes leaves work
        behind once they are killed (the node making their networks again, QEMU processes
        exiting): the next sample must not pay for it."""
        started = time.monotonic()
        if not self.node.local:
            return 0.0
        while time.monotonic() - started < HOST_QUIET_LIMIT:
            busy, total = host_busy_ticks()
            await asyncio.sleep(HOST_QUIET_WINDOW)
            busy_now, total_now = host_busy_ticks()
            if busy_now - busy <= HOST_QUIET_BUSY * max(total_now - total, 1):
                break
        return round(time.monotonic() - started, 1)

    async def base_floors(self) -> tuple[list[float], list[float]] | None:
        """Samples of the bare restore and the bare device save, measured once per run."""
        if self.lab is None:
            return None
        if self._base is None:
            restores, saves = [], []
            for _ in range(self.plan.floor_samples):
                await self.quiet()
                clone = await self.lab.restore()
                try:
                    restores.append(clone.restore_ms)
                    saves.append(await self.lab.save(clone))
                finally:
                    await self.lab.discard(clone)
            self._base = restores, saves
        return self._base

    async def restore_floor(self) -> float | None:
        floors = await self.base_floors()
        return statistics.median(floors[0]) if floors else None

    async def save_floor(self) -> float | None:
        floors = await self.base_floors()
        return statistics.median(floors[1]) if floors else None

    async def concurrent_restores(self, count: int) -> tuple[list[float], float] | None:
        """Bare restores of `count` clones at once: each clone's time and the wall clock until the last."""
        if self.lab is None:
            return None
        clones, wall = await self.lab.restore_many(count)
        try:
            return [c.restore_ms for c in clones], wall
        finally:
            for clone in clones:
                with contextlib.suppress(Exception):
                    await self.lab.discard(clone)
