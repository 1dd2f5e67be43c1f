"""Garbage collection on a schedule: what snapshots, pauses and kills leave behind goes away.

Killed sandboxes, deleted snapshots and superseded pauses leave sealed disk layers, spliced
restore streams and repository blobs that nothing refers to any more; without collection they
accumulate until the disk is full. The node collects once at start (after it recovered its
sandboxes, so it knows what they use) and then every `interval` seconds, in a worker thread,
and reports what it removed as Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from ..snapshot.engine import SnapshotEngine
from ..tasks import cancel

log = logging.getLogger(__name__)


@dataclass
class GcTotals:
    """What collection removed since the node started."""

    runs: int = 0
    failures: int = 0
    removed_layers: int = 0
    removed_blobs: int = 0
    freed_bytes: int = 0
    last_run_seconds: float = 0.0  # how long the last pass took


class Housekeeper:
    """Runs the engine's garbage collection at start and every `interval` seconds (0: at start only)."""

    def __init__(self, engine: SnapshotEngine, interval: float):
        self.engine = engine
        self.interval = interval
        self.totals = GcTotals()
        self._task: asyncio.Task[None] | None = None

    async def collect(self) -> None:
        """One pass; a failure is logged and counted, and the next pass tries again."""
        started = time.monotonic()
        try:
            report = await asyncio.to_thread(self.engine.collect_garbage)
        except Exception:  # a background task's boundary: the node keeps serving either way
            self.totals.failures += 1
            log.exception("garbage collection failed")
            return
        totals = self.totals
        totals.runs += 1
        totals.removed_layers += len(report.removed_layers)
        totals.removed_blobs += len(report.blobs.removed_blobs)
        totals.freed_bytes += report.blobs.freed_bytes
        totals.last_run_seconds = time.monotonic() - started
        if report.removed_layers or report.blobs.removed_blobs:
            log.info(
                "garbage collection removed %d disk layers and %d blobs (%d MiB) in %.1f s",
                len(report.removed_layers), len(report.blobs.removed_blobs),
                report.blobs.freed_bytes >> 20, totals.last_run_seconds,
            )  # fmt: skip

    async def start(self) -> None:
        await self.collect()
        if self.interval > 0:
            self._task = asyncio.create_task(self._collect_forever())

    async def _collect_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.collect()

    async def close(self) -> None:
        await cancel(self._task)
