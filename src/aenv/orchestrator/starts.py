"""How many sandboxes a node starts at once, and who waits or is told to come back later.

Every create restores a VM whose guest must answer `/init` within its deadline (30 s). Started
all at once, a burst starves them all: 128 creates at once on one node of a 2-core TCG host had
every guest miss that deadline (503 "the node is overloaded" after 30-100 s), while the same
host took 100 at once over two nodes in about 17 s each. So at most `concurrency` starts run at
once (`STARTS_PER_CPU` per host CPU) and the others wait their turn in order. A wait is bounded:
a create that would wait longer than `MAX_WAIT` (estimated from how long recent starts took) is
refused at once with E2B's 429 and a Retry-After of about the excess, which the E2B SDKs honour
and retry, instead of waiting past the SDK's own 60 s request timeout and leaving behind a
sandbox nobody knows of.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import AsyncIterator

from .errors import Overloaded

STARTS_PER_CPU = 4  # a start is mostly the guest's CPU under TCG; under KVM each is ~30 ms anyway
MAX_WAIT = 40.0  # seconds a create may wait for its turn: below the E2B SDK's 60 s request timeout
MAX_RETRY_AFTER = 10  # seconds: the E2B SDK retries 3 times by default, each within its deadline
FIRST_ESTIMATE = 1.0  # seconds a start is assumed to take until one has been measured
SMOOTHING = 0.2  # weight of the latest start in the running estimate


class StartGate:
    """At most `concurrency` starts at once; the rest wait in order, as long as `MAX_WAIT` allows."""

    def __init__(self, concurrency: int | None = None):
        self.concurrency = concurrency or STARTS_PER_CPU * (os.cpu_count() or 1)
        self._slots = asyncio.Semaphore(self.concurrency)
        self.running = 0
        self.waiting = 0
        self.estimate = FIRST_ESTIMATE  # seconds one start takes, smoothed

    def expected_wait(self) -> float:
        """Seconds a start asked for now would wait for its turn."""
        ahead = self.running + self.waiting - self.concurrency + 1
        return max(0.0, ahead * self.estimate / self.concurrency)

    def check(self, operation: str) -> None:
        """`Overloaded` (429) if a start asked for now would wait longer than `MAX_WAIT`."""
        wait = self.expected_wait()
        if wait > MAX_WAIT:
            refused = Overloaded(
                f"cannot {operation} now: the node is starting {self.running} sandboxes with "
                f"{self.waiting} more waiting (about {wait:.0f} s), retry later"
            )
            refused.retry_after = min(MAX_RETRY_AFTER, math.ceil(wait - MAX_WAIT))
            raise refused

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Wait for a slot, then hold it while the start runs (call `check` first)."""
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        started = time.monotonic()
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()
            took = time.monotonic() - started
            self.estimate += SMOOTHING * (took - self.estimate)
