"""Paused sandboxes whose stopped QEMU process is kept for a while, so resuming them is `cont`.

A resume from disk spawns a new QEMU process, and under TCG a new process translates the
guest's code afresh: the guest spends about half a second of CPU before envd answers. A kept
process resumes in milliseconds. Pausing still makes the sandbox durable (its device state and
changed pages right after the pause returns, in the background), so ending a kept process loses
nothing; the lot ends them by age, by count and when the host runs short of memory, which is
what keeps parked sandboxes cheap in the long run.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import SandboxVM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParkingPolicy:
    """How long, and how many, paused sandboxes keep their QEMU process."""

    max_seconds: float = 300.0
    max_count: int = 128
    min_available: float = 0.2  # share of host RAM that must stay available, else the oldest goes

    @property
    def enabled(self) -> bool:
        return self.max_seconds > 0 and self.max_count > 0


@dataclass
class ParkedVM:
    """A paused sandbox with its stopped QEMU process.

    `capture` saves the guest's device state and reads the pages it changed, then flushes them
    to the disk. `read` is set once it no longer reads the guest's state, whatever the outcome.
    `stop` (set by `end_capture`) ends it early, for a resume, kill or memory drop that no longer
    needs the pause on disk.
    """

    sandbox: SandboxVM
    capture: asyncio.Task[None]
    stop: threading.Event
    read: asyncio.Event

    async def end_capture(self) -> None:
        """Stop the capture and wait until it no longer reads the guest's state: the guest must
        not run, nor its process end, while its devices or pages are being read. A flush already
        under way is not waited for: the capture discards its files after it (the lot's `close`
        waits)."""
        self.stop.set()
        await self.read.wait()


def host_memory_available() -> float:
    """MemAvailable ÷ MemTotal of the host."""
    values: dict[str, int] = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                values[key] = int(rest.split()[0])
    return values["MemAvailable"] / values["MemTotal"]


class ParkingLot:
    """The parked sandboxes of one engine, oldest first; `release` ends one's process."""

    def __init__(self, policy: ParkingPolicy, release: Callable[[ParkedVM], Awaitable[None]]):
        self.policy = policy
        self._release = release
        self._parked: dict[str, ParkedVM] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._releasing: set[asyncio.Task[None]] = set()
        self._captures: set[asyncio.Task[None]] = set()  # also of sandboxes taken from the lot
        self.closed = False

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, sandbox_id: str) -> bool:
        return sandbox_id in self._parked

    def pids(self) -> set[int]:
        """The kept QEMU processes."""
        return {parked.sandbox.vm.pid for parked in self._parked.values()}

    def accepts(self) -> bool:
        return self.policy.enabled and not self.closed

    def park(self, sandbox_id: str, parked: ParkedVM) -> None:
        """Keep the sandbox's process; make room if the lot is over its count or memory bound."""
        self._parked[sandbox_id] = parked
        self._captures.add(parked.capture)
        parked.capture.add_done_callback(self._captures.discard)
        loop = asyncio.get_running_loop()
        self._timers[sandbox_id] = loop.call_later(self.policy.max_seconds, self._evict, sandbox_id)
        if self.closed:  # the pause began before the lot closed: no keeping it now
            self._evict(sandbox_id)
        while len(self._parked) > self.policy.max_count:
            self._evict(next(iter(self._parked)))
        if self._parked and host_memory_available() < self.policy.min_available:
            self._evict(next(iter(self._parked)))

    def take(self, sandbox_id: str) -> ParkedVM | None:
        """The parked sandbox, no longer in the lot (to resume or kill it), or None."""
        timer = self._timers.pop(sandbox_id, None)
        if timer is not None:
            timer.cancel()
        return self._parked.pop(sandbox_id, None)

    def _evict(self, sandbox_id: str) -> None:
        parked = self.take(sandbox_id)
        if parked is not None:
            task = asyncio.get_running_loop().create_task(self._release(parked))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def close(self) -> None:
        """End every kept process and keep no more; wait for every capture to end."""
        self.closed = True
        await self.release_all()
        while self._captures:
            await asyncio.gather(*self._captures, return_exceptions=True)

    async def release_all(self) -> None:
        """End every kept process (each pause is on disk first)."""
        for sandbox_id in list(self._parked):
            self._evict(sandbox_id)
        while self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)
