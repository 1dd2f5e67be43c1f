"""Template build figures: a small build from `base`, cold and then cached, against an empty build;
and creates from the built template against creates from `base` (they must cost the same).

Each sample is wall clock from ``POST /v3/templates`` to the build's status ``ready``, through the
E2B template build API as the SDK drives it. The floor is a build with no steps: one boot of the
build VM from `base`'s disk, ``/init``, and the snapshot of memory and disk that every build ends
with, so the ratios are what the steps cost (cold) and what the step cache leaves of them (cached,
where every step is found in the cache and none runs). Templates are removed afterwards.
"""

from __future__ import annotations

import secrets
import statistics
import time
from typing import Any

from .context import Context, Sandboxes
from .report import Row
from .stats import ms_since, summarize


def steps(token: str) -> list[dict[str, Any]]:
    """Three steps whose cache keys are new in every run (``token``): ENV, RUN and WORKDIR."""
    return [
        {"type": "ENV", "args": ["BENCH_TOKEN", token]},
        {"type": "RUN", "args": ["echo $BENCH_TOKEN > /tmp/bench-token && sync"]},
        {"type": "WORKDIR", "args": [f"/opt/bench-{token}"]},
    ]


async def _timed_build(ctx: Context, name: str, build_steps: list[dict[str, Any]]) -> float:
    started = time.perf_counter()
    await ctx.client.build_template(name, {"fromTemplate": "base", "steps": build_steps})
    return time.perf_counter() - started


async def _creates(ctx: Context, name: str) -> tuple[list[float], list[float]]:
    """Creates (ms) from the built template `name` and from `base`, alternating, each once its
    warm pool is full again."""
    built: list[float] = []
    base: list[float] = []
    async with Sandboxes(ctx.client) as sandboxes:
        first = await sandboxes.create(name)
        snapshot_id = first["templateID"]
        await sandboxes.kill(first["sandboxID"])
        for _ in range(ctx.plan.create):
            for template, pool, samples in ((name, snapshot_id, built), ("base", None, base)):
                await ctx.quiet(pool)
                started = time.perf_counter()
                sandbox = await sandboxes.create(template)
                samples.append(ms_since(started))
                await sandboxes.kill(sandbox["sandboxID"])
    return built, base


async def template_build(ctx: Context) -> list[Row]:
    rounds = ctx.plan.template_build
    floor, cold, cached = [], [], []
    names: list[str] = []
    try:
        for index in range(rounds):
            token = secrets.token_hex(6)
            names += [f"bench-empty-{token}", f"bench-build-{token}"]
            floor.append(await _timed_build(ctx, names[-2], []))
            cold.append(await _timed_build(ctx, names[-1], steps(token)))
            cached.append(await _timed_build(ctx, names[-1], steps(token)))
            print(f"bench: template build round {index + 1}: empty {floor[-1]:.1f} s, "
                  f"cold {cold[-1]:.1f} s, cached {cached[-1]:.1f} s")  # fmt: skip
        built, base = await _creates(ctx, names[-1])
    finally:
        for name in names:
            await ctx.client.delete_template(name)
    floor_median = statistics.median(floor)
    note = f"from `base`: ENV, RUN, WORKDIR; floor: a build without steps (boot, snapshot), {rounds} round(s)"
    return [
        Row("template-build", summarize("template build, 3 steps, cold", cold, unit="s"), floor_median,
            "empty build", note=note, details={"floor_s": floor}),
        Row("template-build-cached", summarize("template rebuild, all steps cached", cached, unit="s"),
            floor_median, "empty build"),
        Row("template-build-create", summarize("create from the built template", built),
            statistics.median(base), "create from base",
            note="alternating with creates from `base`, each once its pool refilled"),
    ]  # fmt: skip
