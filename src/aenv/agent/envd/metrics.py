"""Resource samples of the guest: one now (`GET /metrics`) and a bounded history (`/metrics/history`).

The history is sampled here, inside the guest, at a fixed interval and kept in a ring in envd's
memory: the node never polls hundreds of idle sandboxes, it fetches a sandbox's samples when a
client asks for them. Being guest memory, the ring survives pause and resume and is inherited by
forks and snapshots for free (their samples from before they existed are filtered out by the node).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

INTERVAL_SECONDS = 5.0
KEPT_SAMPLES = 720  # one hour


class CPUSampler:
    """cpu_used_pct since the previous sample (first call: since boot), from /proc/stat."""

    def __init__(self) -> None:
        self.last: tuple[int, int] | None = None

    def percent(self) -> float:
        try:
            with open("/proc/stat") as f:
                values = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return 0.0
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        total = sum(values[:8])
        prev_total, prev_idle = self.last or (0, 0)
        self.last = (total, idle)
        dt = total - prev_total
        return round(100.0 * (dt - (idle - prev_idle)) / dt, 2) if dt > 0 else 0.0


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def sample(cpu: CPUSampler) -> dict[str, Any]:
    """The guest's CPU (since `cpu`'s previous sample), memory and root-disk use now."""
    mem = _meminfo()
    total = mem.get("MemTotal", 0)
    used = total - mem.get("MemAvailable", mem.get("MemFree", 0))
    try:
        disk = os.statvfs("/")
        disk_total = disk.f_blocks * disk.f_frsize
        disk_used = (disk.f_blocks - disk.f_bfree) * disk.f_frsize
    except OSError:
        disk_total = disk_used = 0
    return {
        "ts": int(time.time()),
        "cpu_count": os.cpu_count() or 1,
        "cpu_used_pct": cpu.percent(),
        "mem_total": total,
        "mem_used": used,
        "mem_cache": mem.get("Cached", 0),
        "mem_total_mib": total // (1024 * 1024),
        "mem_used_mib": used // (1024 * 1024),
        "disk_used": disk_used,
        "disk_total": disk_total,
    }


class MetricsHistory:
    """A sample every `interval` seconds, the newest `kept` of them; CPU is the interval's average."""

    def __init__(self, interval: float = INTERVAL_SECONDS, kept: int = KEPT_SAMPLES) -> None:
        self.interval = interval
        self.samples: collections.deque[dict[str, Any]] = collections.deque(maxlen=kept)
        self._cpu = CPUSampler()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="metrics-history")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                self.samples.append(sample(self._cpu))
            except Exception:  # a sampler bug must not end the history
                log.exception("taking a metrics sample failed")
            await asyncio.sleep(self.interval)

    def between(self, start: int | None, end: int | None) -> list[dict[str, Any]]:
        """The kept samples with `start <= ts <= end` (Unix seconds; None: unbounded), oldest first."""
        return [
            s for s in self.samples if (start is None or s["ts"] >= start) and (end is None or s["ts"] <= end)
        ]
