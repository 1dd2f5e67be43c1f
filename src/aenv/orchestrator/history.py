"""Metrics history: a sandbox's samples, from its guest's ring while it runs and from the archive
kept beside it across pauses (`aenv.orchestrator.metrics`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from http.client import HTTPException
from pathlib import Path
from typing import Any

from ..vmm.envd_link import GuestAnswerError, SampleBatch
from .errors import BadGuest
from .metrics import MetricsArchive, between, merge, sandbox_metric
from .sandboxes import Sandbox, parse_time
from .states import State

log = logging.getLogger(__name__)

# The cluster-wide metrics view asks each guest for this much of its history, not all of it.
RECENT_SECONDS = 60


class MetricsHistory:
    """Samples of the sandboxes whose directories `workdir` names."""

    def __init__(self, workdir: Callable[[str], Path]):
        self.workdir = workdir

    def _archive(self, sandbox: Sandbox) -> MetricsArchive:
        return MetricsArchive(self.workdir(sandbox.id))

    async def _live_samples(self, sandbox: Sandbox, start: int | None) -> SampleBatch:
        """The samples in the guest's ring since `start`; none without a VM or if envd does not
        answer; `BadGuest` if the guest broke a bound (`aenv.vmm.envd_link`)."""
        if sandbox.vm is None:
            return SampleBatch([], None)
        try:
            return await sandbox.vm.envd.metrics_history(start)
        except GuestAnswerError as exc:
            raise BadGuest(
                f"the guest of sandbox {sandbox.id} answered its metrics wrongly: {exc}", exc.code
            ) from exc
        except (OSError, RuntimeError, ValueError, KeyError, HTTPException) as exc:
            log.warning("metrics of sandbox %s: envd did not answer: %s", sandbox.id, exc)
            return SampleBatch([], None)

    async def save(self, sandbox: Sandbox) -> None:
        """Before a pause: keep the guest's samples with the sandbox, for while it is paused and
        for a resume that boots a new guest (a filesystem-only pause)."""
        if not sandbox.samples.due(time.monotonic()):
            return  # the guest has no sample the archive lacks
        archive = self._archive(sandbox)
        previous = newest = archive.newest()
        try:
            batch = await self._live_samples(sandbox, None if newest is None else newest + 1)
        except BadGuest as exc:  # its own history is what the guest loses, not its pause
            log.warning("%s", exc.message)
            return
        if batch.samples:
            with contextlib.suppress(OSError):
                archive.add(batch.samples)
            newest = max(newest or 0, batch.samples[-1]["ts"])
        sandbox.samples.saved(newest, previous, time.time(), batch.next_in)

    async def metrics(self, sandbox: Sandbox, start: int | None, end: int | None) -> list[dict[str, Any]]:
        """The sandbox's samples with `start <= time <= end` (Unix seconds), oldest first.

        A guest's ring may hold samples from before the sandbox existed (its template's or fork
        source's): only the sandbox's own lifetime counts.
        """
        born = int(parse_time(sandbox.record.created_at).timestamp())
        start = born if start is None else max(start, born)
        running = sandbox.record.state == State.RUNNING
        live = (await self._live_samples(sandbox, start)).samples if running else []
        samples = merge(self._archive(sandbox).load(), live)
        return [sandbox_metric(s, sandbox.record.cpu_count) for s in between(samples, start, end)]

    async def latest(self, sandboxes: list[Sandbox]) -> dict[str, dict[str, Any]]:
        """Each sandbox's newest sample (the cluster-wide view); sandboxes without one are left out."""
        recent = int(time.time()) - RECENT_SECONDS

        async def newest(sandbox: Sandbox) -> dict[str, Any] | None:
            try:
                samples = await self.metrics(sandbox, recent, None) or await self.metrics(sandbox, None, None)
            except BadGuest:  # that guest's failure, not the others' view
                return None
            return samples[-1] if samples else None

        found = await asyncio.gather(*(newest(s) for s in sandboxes))
        return {s.id: metric for s, metric in zip(sandboxes, found, strict=True) if metric is not None}
