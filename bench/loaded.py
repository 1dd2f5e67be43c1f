"""Create and resume on a node that already runs many idle sandboxes, over the same on the empty node.

Idle sandboxes still cost the host: their guests' timers run under emulation, their QEMU
processes hold memory, and the node keeps more state. This figure measures `loaded` samples of
create (warm pool) and of pause-then-resume (parked process) on the node as the harness finds
it, then creates `loaded_idle` sandboxes, lets them settle, and measures the same again. Each
loaded figure's floor is its own median on the empty node, measured minutes before.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from .context import SETTLE, Context, Sandboxes, bounded
from .report import Row
from .stats import summarize

CREATE_CONCURRENCY = 4
IDLE_SETTLE = 5.0  # seconds for the new sandboxes' restores and the warm pool's refill to end


async def create_resume_samples(
    ctx: Context, sandboxes: Sandboxes, count: int
) -> tuple[list[float], list[float]]:
    """`count` creates and `count` resumes of a parked sandbox (ms), each sandbox killed after."""
    creates, resumes = [], []
    for _ in range(count):
        await ctx.quiet()
        started = time.perf_counter()
        sandbox = await sandboxes.create()
        creates.append((time.perf_counter() - started) * 1000)
        sandbox_id = sandbox["sandboxID"]
        await ctx.client.pause(sandbox_id)
        await asyncio.sleep(SETTLE)
        started = time.perf_counter()
        await ctx.client.resume(sandbox_id)
        resumes.append((time.perf_counter() - started) * 1000)
        await sandboxes.kill(sandbox_id)
    return creates, resumes


async def loaded(ctx: Context) -> list[Row]:
    idle = ctx.plan.loaded_idle
    async with Sandboxes(ctx.client) as sandboxes:
        empty_creates, empty_resumes = await create_resume_samples(ctx, sandboxes, ctx.plan.loaded)
        created = await bounded(CREATE_CONCURRENCY, [sandboxes.create] * idle)
        failures = [c for c in created if isinstance(c, BaseException)]
        if failures:
            raise failures[0]
        await asyncio.sleep(IDLE_SETTLE)
        creates, resumes = await create_resume_samples(ctx, sandboxes, ctx.plan.loaded)
    note = f"floor: the same figure on the node before the {idle} idle sandboxes were created"
    empty = "same, empty node"
    return [
        Row("loaded-create", summarize(f"create with {idle} idle sandboxes", creates),
            statistics.median(empty_creates), empty, note=note, details={"empty_ms": empty_creates}),
        Row("loaded-resume", summarize(f"resume (parked) with {idle} idle sandboxes", resumes),
            statistics.median(empty_resumes), empty, details={"empty_ms": empty_resumes}),
    ]  # fmt: skip
