"""Resource samples of the guest: one now (`GET /metrics`) and a bounded history (`/metrics/history`).

The history is sampled here, inside the guest, at a fixed interval and kept in a ring in envd's
memory: the node never polls hundreds of idle sandboxes, it fetches a sandbox's samples when a
client asks for them. Being guest memory, the ring survives pause and resume and is inherited by
forks and snapshots for free (their samples from before they existed are filtered out by the node).

A sample is taken often, and read rarely, so taking one is kept cheap (an idle guest under TCG
pays for every instruction): `/proc/uptime` for CPU time rather than `/proc/stat` (whose
generation walks every interrupt counter), one C-level regex over `/proc/meminfo`, and a tuple of
numbers kept; the JSON is made only when the samples are read.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import time
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

INTERVAL_SECONDS = 5.0
KEPT_SAMPLES = 720  # one hour
_MEMINFO = re.compile(rb"^(MemTotal|MemFree|MemAvailable|Cached):\s+(\d+)", re.M)
_KIB = 1024


class Sample(NamedTuple):
    ts: int  # Unix seconds
    uptime: float  # seconds since boot
    idle: float  # seconds all CPUs together spent idle since boot
    mem_total: int
    mem_available: int
    mem_cache: int
    disk_total: int
    disk_used: int


def _read(path: str, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)


def take() -> Sample:
    """The guest's CPU times, memory and root-disk use now."""
    up, idle = _read("/proc/uptime", 128).split()[:2]
    mem = {key: int(value) * _KIB for key, value in _MEMINFO.findall(_read("/proc/meminfo", 16384))}
    total = mem.get(b"MemTotal", 0)
    try:
        disk = os.statvfs("/")
        disk_total, disk_used = disk.f_blocks * disk.f_frsize, (disk.f_blocks - disk.f_bfree) * disk.f_frsize
    except OSError:
        disk_total = disk_used = 0
    return Sample(
        int(time.time()), float(up), float(idle), total,
        mem.get(b"MemAvailable", mem.get(b"MemFree", 0)), mem.get(b"Cached", 0), disk_total, disk_used,
    )  # fmt: skip


def render(sample: Sample, previous: Sample | None) -> dict[str, Any]:
    """A sample as envd's metrics JSON; CPU use is the average since `previous` (None: since boot)."""
    cpus = os.cpu_count() or 1
    elapsed = (sample.uptime - (previous.uptime if previous else 0.0)) * cpus
    idle = sample.idle - (previous.idle if previous else 0.0)
    busy = round(min(max(100.0 * (1 - idle / elapsed), 0.0), 100.0), 2) if elapsed > 0 else 0.0
    used = sample.mem_total - sample.mem_available
    return {
        "ts": sample.ts,
        "cpu_count": cpus,
        "cpu_used_pct": busy,
        "mem_total": sample.mem_total,
        "mem_used": used,
        "mem_cache": sample.mem_cache,
        "mem_total_mib": sample.mem_total // (1024 * 1024),
        "mem_used_mib": used // (1024 * 1024),
        "disk_used": sample.disk_used,
        "disk_total": sample.disk_total,
    }


class MetricsHistory:
    """A sample every `interval` seconds, the newest `kept` of them; CPU is each interval's average."""

    def __init__(self, interval: float = INTERVAL_SECONDS, kept: int = KEPT_SAMPLES) -> None:
        self.interval = interval
        self.samples: collections.deque[Sample] = collections.deque(maxlen=kept)
        self._before_oldest: Sample | None = None  # the predecessor of the oldest kept sample
        self._next_at: float | None = None  # monotonic time of the next sample
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
                self.add(take())
            except Exception:  # a sampler bug must not end the history
                log.exception("taking a metrics sample failed")
            self._next_at = time.monotonic() + self.interval
            await asyncio.sleep(self.interval)

    def add(self, sample: Sample) -> None:
        if len(self.samples) == self.samples.maxlen:
            self._before_oldest = self.samples[0]
        self.samples.append(sample)

    def answer(self, start: int | None, end: int | None) -> dict[str, Any]:
        """The body of `/metrics/history`: the samples `between` the bounds, the interval, and
        `next_in`, the seconds of running time until the next sample.

        The guest's monotonic clock stands still while the VM is stopped, so `next_in` tells the
        node exactly how long the guest may run before it holds a sample the node has not seen:
        until then, a pause need not ask again (`aenv.orchestrator.metrics.SampleWatch`).
        """
        body: dict[str, Any] = {"interval": self.interval, "samples": self.between(start, end)}
        if self._next_at is not None:
            body["next_in"] = round(max(self._next_at - time.monotonic(), 0.0), 3)
        return body

    def between(self, start: int | None, end: int | None) -> list[dict[str, Any]]:
        """The kept samples with `start <= ts <= end` (Unix seconds; None: unbounded), oldest first."""
        found = []
        previous = self._before_oldest
        for sample in self.samples:
            if (start is None or sample.ts >= start) and (end is None or sample.ts <= end):
                found.append(render(sample, previous))
            previous = sample
        return found
