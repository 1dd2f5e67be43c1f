"""TTL eviction: sandboxes whose end time has passed are paused (autoPause) or killed, and, with
a shared repository, durably paused sandboxes another node took over are forgotten."""

from __future__ import annotations

import asyncio
import logging
import time

from .. import logs
from ..tasks import cancel
from .errors import SandboxError
from .handover import MOVED_CHECK_SECONDS, PauseHandover
from .lifecycle import Lifecycle
from .sandboxes import Sandbox, SandboxTable

log = logging.getLogger(__name__)


class Eviction:
    """A background task that checks every `interval` seconds."""

    def __init__(self, interval: float, table: SandboxTable, lifecycle: Lifecycle, handover: PauseHandover):
        self.interval = interval
        self.table = table
        self.lifecycle = lifecycle
        self.handover = handover
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._evict_forever())

    async def close(self) -> None:
        await cancel(self._task)

    async def _evict_forever(self) -> None:
        checked = time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            await self.evict_expired()
            if self.handover.enabled and time.monotonic() - checked > MOVED_CHECK_SECONDS:
                checked = time.monotonic()
                await self.handover.forget_moved()

    async def evict_expired(self) -> None:
        """Pause (autoPause) or kill every running sandbox whose end time has passed."""
        for sandbox in self.table.held():
            if sandbox.lock.locked() or not self.lifecycle.expired(sandbox):
                continue
            with logs.sandbox_context(sandbox.id):
                await self._expire(sandbox)

    async def _expire(self, sandbox: Sandbox) -> None:
        """Pause or kill one sandbox whose end time has passed, unless a call changed it since."""
        record = sandbox.record
        started = time.monotonic()
        try:
            async with sandbox.lock:
                if not self.lifecycle.expired(sandbox):
                    return
                if record.auto_pause:
                    await self.lifecycle.pause_locked(sandbox, memory=record.auto_pause_memory)
                else:
                    await self.lifecycle.kill_locked(sandbox)
            log.info(
                "sandbox %s expired: %s in %.0f ms",
                record.sandbox_id,
                "paused" if record.auto_pause else "killed",
                1000 * (time.monotonic() - started),
            )
        except SandboxError as exc:
            log.error("expiring sandbox %s failed: %s", record.sandbox_id, exc.message)
