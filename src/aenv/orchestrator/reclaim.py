"""The node's memory policy: give the host back what guests freed, idlest sandboxes first.

Every `reclaim_interval` seconds (2) the node looks at each running sandbox's QEMU: its private
memory (`RssAnon`, read from `/proc`, a few microseconds) and its CPU time. A sandbox at rest
(under 5 % of a core since the last look) whose private memory grew by `reclaim_growth_mib`, or
that used half a CPU second, since its last scan is scanned, and the pages its guest freed go
back to the host (`aenv.vmm.reclaim`: a guest of 228 MiB private memory after
allocating and freeing 200 MiB and deleting 100 MiB of files got 209 MiB back in 0.25 s, its
vCPUs stopped 0.14 s of that). While the host has less than `reclaim_pressure_mib` available,
every running sandbox whose private memory grew at all since its last scan is scanned, idlest
(least CPU since the last pass) first, until it has that much again; and before its scan each
guest at rest that used half a CPU second since it last dropped its clean page cache (or was first
seen) is asked to drop it (`drop_caches`): the pages it frees are zeroed, and those that held the
image's data go back remapped (`aenv.vmm.reclaim`). A guest at work keeps its cache (it would
fill it again), and so does every guest while the host is not pressed: what it reads again costs
it a read from its disk, pages of the cache still equal to the image cost the host nothing, and
under TCG the command itself grows its QEMU's translation cache (a fresh guest asked to drop its
cache: 32.5 MiB of translations instead of 13.7). Measured after
the divergence workload (`bench --memory-pressed`, 48 sandboxes, 30 s idle): the guest RAM a
QEMU held privately went from 19.5 to 12.0 MiB (median).

The scan reads the guest's memory while it runs, without the sandbox's lock; only the drop takes
the lock and stops the guest, so a pause or fork of the sandbox waits for no scan, and a sandbox
in the middle of one is left for the next pass. Nothing is taken that a guest cannot have back
unasked, so there is nothing to deflate: a dropped page reads as before and is copied again only
when the guest writes it, and a dropped cache page is read again from the guest's disk.

What the sandboxes hold (`held_mib`) is what admission measures new ones by.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..tasks import cancel
from ..vmm import reclaim
from ..vmm.envd_link import EnvdUnavailable, GuestAnswerError
from .admission import meminfo_mib
from .states import State

if TYPE_CHECKING:
    from .sandboxes import Sandbox

log = logging.getLogger(__name__)
PRESSED_GROWTH_MIB = 1  # under host pressure: what a sandbox must have grown since its last scan
# A guest frees memory by running (its private memory does not shrink, the pages are zeroed), so
# one that used this much CPU since its last scan is scanned again once it rests; and one using
# more than IDLE_SHARE of a core is at work, left until it rests (unless the host is pressed).
ACTIVE_CPU_S = 0.5
IDLE_SHARE = 0.05
# Clean page cache only: no `sync` first, whose writeback a guest at work made wait up to the
# timeout, each pass, every other sandbox behind it (bench --memory-pressed: return p95 60 s).
DROP_CACHE = ["/bin/sh", "-c", "echo 1 > /proc/sys/vm/drop_caches"]
DROP_CACHE_TIMEOUT_S = 5.0


def private_mib(pid: int) -> float:
    """The process's private memory in MiB (`RssAnon`: a clone's guest-written pages and QEMU's own)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise OSError(f"no RssAnon for process {pid}")


@dataclass
class _Watch:
    """What the policy remembers of one sandbox's QEMU between passes."""

    pid: int
    cpu: float = 0.0  # CPU seconds at the last pass
    baseline_mib: float = 0.0  # private memory after its last scan
    scanned_cpu: float = 0.0  # CPU seconds at its last scan (first sight: as then)
    returned_bytes: int = 0
    busy: float = 0.0  # share of a core it used between the last two passes
    cache_dropped_cpu: float = 0.0  # CPU seconds when its guest last dropped its page cache (first sight)


@dataclass(eq=False)  # hashable by identity: a Prometheus registry keys its collectors by them
class MemoryReclaimer:
    """Runs the policy over the sandboxes `sandboxes()` yields, and reports it on /metrics."""

    sandboxes: Callable[[], Iterable[Sandbox]]
    interval: float
    growth_mib: int
    pressure_mib: int
    available_mib: Callable[[], int] = lambda: meminfo_mib("MemAvailable")
    idle_share: float = IDLE_SHARE
    returned_bytes: int = 0
    passes: int = 0
    stopped_seconds: float = 0.0
    _watches: dict[str, _Watch] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None
    _last_pass: float = field(default_factory=time.monotonic)

    def start(self) -> None:
        if self.interval > 0:
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        await cancel(self._task)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.sweep()
            except Exception:  # a pass that failed is retried at the next; the node goes on
                log.exception("a memory reclaim pass failed")

    def _running(self) -> list[tuple[Sandbox, _Watch]]:
        """Running sandboxes with their watches, idlest first (the watches of the gone dropped)."""
        found: dict[str, tuple[Sandbox, _Watch]] = {}
        now = time.monotonic()
        elapsed, self._last_pass = max(now - self._last_pass, 1e-3), now
        for sandbox in self.sandboxes():
            if sandbox.vm is None or sandbox.record.state != State.RUNNING:
                continue
            vm = sandbox.vm.vm
            watch = self._watches.get(sandbox.id)
            with contextlib.suppress(OSError):  # its QEMU ended meanwhile
                if watch is None or watch.pid != vm.pid:
                    cpu = vm.cpu_seconds()
                    watch = _Watch(vm.pid, cpu=cpu, baseline_mib=private_mib(vm.pid), scanned_cpu=cpu,
                                   cache_dropped_cpu=cpu)  # fmt: skip
                else:
                    cpu = vm.cpu_seconds()
                    watch.busy, watch.cpu = (cpu - watch.cpu) / elapsed, cpu
                found[sandbox.id] = (sandbox, watch)
        self._watches = {sandbox_id: watch for sandbox_id, (_, watch) in found.items()}
        return sorted(found.values(), key=lambda pair: pair[1].busy)

    async def sweep(self) -> int:
        """One pass; returns the bytes given back to the host."""
        self.passes += 1
        returned = 0
        for sandbox, watch in self._running():
            pressed = self.available_mib() < self.pressure_mib
            if watch.busy > self.idle_share and not pressed:
                continue  # at work: it is scanned once it rests, when what it freed stays freed
            # Under pressure any growth will do; a sandbox that neither grew nor ran since its
            # last scan has nothing new to give, and scanning it again would only burn CPU.
            growth = PRESSED_GROWTH_MIB if pressed else self.growth_mib
            with contextlib.suppress(OSError):  # its QEMU ended meanwhile
                if pressed and watch.busy <= self.idle_share:
                    await self._drop_page_cache(sandbox, watch)
                grown = private_mib(watch.pid) - watch.baseline_mib >= growth
                if grown or watch.cpu - watch.scanned_cpu >= ACTIVE_CPU_S:
                    returned += await self._reclaim(sandbox, watch)
        return returned

    async def _drop_page_cache(self, sandbox: Sandbox, watch: _Watch) -> None:
        """Have the guest drop its clean page cache if it ran since it last did (or was first seen)."""
        if watch.cpu - watch.cache_dropped_cpu < ACTIVE_CPU_S:
            return
        if sandbox.vm is None or sandbox.lock.locked():
            return  # an operation is under way; the next pass looks again
        try:
            await sandbox.vm.envd.execute(DROP_CACHE, timeout=DROP_CACHE_TIMEOUT_S)
        except (EnvdUnavailable, GuestAnswerError, OSError, TimeoutError) as exc:
            log.debug("sandbox %s did not drop its page cache: %s", sandbox.id, exc)
        watch.cache_dropped_cpu = watch.cpu = sandbox.vm.vm.cpu_seconds()

    async def _reclaim(self, sandbox: Sandbox, watch: _Watch) -> int:
        """Scan one sandbox's guest running, then drop under its lock with the guest stopped, so no
        operation waits for the scan and no pause or fork finds its guest stopped or restarted."""
        if sandbox.lock.locked():
            return 0  # an operation is under way; the next pass looks again
        vm = sandbox.vm.vm if sandbox.vm is not None else None
        try:
            if vm is None or vm.pid != watch.pid:
                return 0
            started = time.monotonic()
            found = await reclaim.find(vm)
            if found.candidates:
                if sandbox.lock.locked():
                    return 0  # an operation started during the scan
                async with sandbox.lock:
                    if sandbox.vm is None or sandbox.vm.vm is not vm or sandbox.record.state != State.RUNNING:
                        return 0
                    result = reclaim.Reclaimed.of(found, *await reclaim.release(vm, found),
                                                  time.monotonic() - started)  # fmt: skip
            else:
                result = reclaim.Reclaimed.of(found, 0, 0.0, time.monotonic() - started)
        except (reclaim.ReclaimError, OSError, LookupError) as exc:
            log.warning("reclaiming the memory of sandbox %s failed: %s", sandbox.id, exc)
            return 0
        watch.baseline_mib, watch.scanned_cpu = private_mib(watch.pid), watch.cpu
        returned = int(result.returned_mib * 2**20)
        watch.returned_bytes += returned
        self.returned_bytes += returned
        self.stopped_seconds += result.stopped_seconds
        if returned:
            log.debug("sandbox %s: %.1f MiB back to the host, stopped %.3f s", sandbox.id,
                      result.returned_mib, result.stopped_seconds)  # fmt: skip
        return returned

    def held_mib(self) -> int:
        """Private memory the running sandboxes' QEMUs hold now, in MiB (what admission measures)."""
        held = 0.0
        for sandbox in self.sandboxes():
            if sandbox.vm is not None:
                with contextlib.suppress(OSError):
                    held += private_mib(sandbox.vm.vm.pid)
        return int(held)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """Prometheus series (a collector for the node's registry)."""
        per_sandbox = CounterMetricFamily(
            "aenv_memory_returned_bytes",
            "Bytes of freed guest memory given back to the host, by running sandbox",
            labels=["sandbox_id"],
        )
        for sandbox_id, watch in self._watches.items():
            per_sandbox.add_metric([sandbox_id], watch.returned_bytes)
        yield per_sandbox
        yield CounterMetricFamily(
            "aenv_node_memory_returned_bytes", "Bytes of freed guest memory this node gave back to the host",
            value=self.returned_bytes,
        )  # fmt: skip
        yield CounterMetricFamily("aenv_memory_reclaim_passes", "Memory reclaim passes", value=self.passes)
        yield CounterMetricFamily(
            "aenv_memory_reclaim_stopped_seconds", "Seconds guests were stopped to drop freed pages",
            value=self.stopped_seconds,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "aenv_memory_held_bytes", "Private memory the running sandboxes' VMMs hold",
            value=self.held_mib() * 2**20,
        )  # fmt: skip
