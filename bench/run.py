"""One harness run: the node, the floors, the selected figures in order, the table and the JSON file.

A figure that fails is reported (stderr and the JSON's `errors`) and the run goes on with the
next one; the exit status says whether any failed. Missed targets are results, not failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import cluster, dataplane, density, figures, fusion, loaded, rollouts, scale, soak, storage, templates
from .client import NodeClient
from .context import Context
from .divergence import divergence
from .floors import FloorLab
from .merging import ksm_scanning
from .node import LocalNode, Node, remote_node
from .plan import MODES, Plan
from .profile import FORMATS, recording
from .report import Row, table, write_json
from .stats import summarize
from .targets import FIGURES

Measure = Callable[[Context], Awaitable[list[Row]]]

MEASURES: dict[str, Measure] = {
    "create": figures.create,
    "pause": figures.pause_resume,
    "resume": figures.pause_resume,
    "resume-released": figures.resume_released,
    "snapshot": figures.snapshot,
    "fork": figures.fork,
    "concurrent-resume": figures.concurrent_resume,
    "loaded": loaded.loaded,
    "proxy-rtt": dataplane.proxy_rtt,
    "proxy-throughput": dataplane.proxy_throughput,
    "density": density.density,
    "soak": soak.soak,
    "template-build": templates.template_build,
    "storage": storage.storage,
    "cluster": cluster.cluster,
    "fusion": fusion.fusion,
    "rollout": rollouts.rollouts,
    "cluster-scale": scale.cluster_scale,
    "divergence": divergence,
}
# Figures whose floor is the bare restore or the bare save: measured first, on a quiet host.
_BASE_FLOORED = {"create", "pause", "resume", "resume-released", "snapshot"}


@dataclass(frozen=True)
class Options:
    mode: str
    only: tuple[str, ...]
    json_path: Path
    profile: str | None = None
    profile_format: str = "speedscope"
    seed: Path | None = None  # a node home whose `base` template the harness's node starts with
    soak_cycles: int | None = None  # instead of the mode's
    memory_merge: bool = False  # the harness's node merges equal pages, with KSM on for the run
    memory_pressed: bool = False  # the harness's node reclaims as under host pressure throughout
    scale_full: bool = False  # cluster-scale at its full size
    rollout_counts: tuple[int, ...] | None = None  # instead of the mode's
    rollout_parts: tuple[str, ...] | None = None  # instead of all
    divergence: int | None = None  # sandboxes of the divergence figure, instead of the mode's

    @property
    def plan(self) -> Plan:
        plan = replace(MODES[self.mode], scale_full=self.scale_full)
        if self.rollout_counts is not None:
            plan = replace(plan, rollout_counts=self.rollout_counts)
        if self.rollout_parts is not None:
            plan = replace(plan, rollout_parts=self.rollout_parts)
        if self.divergence is not None:
            plan = replace(plan, divergence=self.divergence)
        return plan if self.soak_cycles is None else replace(plan, soak=self.soak_cycles)

    @property
    def selected(self) -> tuple[str, ...]:
        return self.only or self.plan.figures


def _wanted(key: str, selected: tuple[str, ...]) -> bool:
    """Rows of a selected figure, including its companions (`density-overcommit` with `density`)."""
    return key in selected or any(key.startswith(f"{name}-") for name in selected) or key.startswith("floor-")


async def _floor_rows(ctx: Context) -> list[Row]:
    floors = await ctx.base_floors()
    if floors is None:
        return []
    restores, saves = floors
    return [
        Row("floor-restore", summarize("floor: bare QEMU spawn + restore", restores),
            note="the node's `base` template restored on bare QEMU (migrate-incoming, x-ignore-shared)"),
        Row("floor-save", summarize("floor: bare QMP stop + device-state save", saves)),
    ]  # fmt: skip


async def measure(node: Node, options: Options) -> tuple[list[Row], list[dict[str, str]], dict[str, Any]]:
    """Every selected figure against `node`; rows, errors, and facts about the run."""
    rows: list[Row] = []
    errors: list[dict[str, str]] = []
    extra: dict[str, Any] = {}
    client = NodeClient(node)
    lab: FloorLab | None = None
    try:
        lab = FloorLab(node.home) if node.home is not None else None
        ctx = Context(node, client, options.plan, lab, (await client.template("base"))["templateID"])
        if lab is not None:
            extra["accel"] = lab.manifest.machine.accel
            extra["guest"] = {
                "vcpus": lab.manifest.machine.vcpus,
                "memory_mib": lab.manifest.machine.memory_mib,
            }
        if lab is not None and _BASE_FLOORED & set(options.selected):
            rows += await _floor_rows(ctx)
        done: set[Measure] = set()
        for key in FIGURES:
            measure_figure = MEASURES[key]
            if key not in options.selected or measure_figure in done:
                continue
            done.add(measure_figure)
            started = time.monotonic()
            print(f"bench: measuring {key} …", file=sys.stderr, flush=True)
            try:
                async with contextlib.AsyncExitStack() as stack:
                    if options.profile == key and node.pid is not None:
                        suffix = FORMATS[options.profile_format]
                        output = options.json_path.with_name(f"{options.json_path.stem}-{key}{suffix}")
                        extra["profile"] = str(await stack.enter_async_context(
                            recording(node.pid, output, options.profile_format)))  # fmt: skip
                    rows += [r for r in await measure_figure(ctx) if _wanted(r.key, options.selected)]
            except Exception as exc:
                traceback.print_exc()
                errors.append({"figure": key, "error": f"{type(exc).__name__}: {exc}"})
            print(f"bench: {key} took {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    finally:
        await client.aclose()
        if lab is not None:
            await lab.close()
    return rows, errors, extra


def run(options: Options) -> int:
    """Start (or find) the node, measure, print the table, write the JSON; the exit status."""
    if options.profile and options.profile not in options.selected:
        raise SystemExit(
            f"--profile {options.profile}: not among the figures measured ({', '.join(options.selected)})"
        )
    options.json_path.parent.mkdir(parents=True, exist_ok=True)  # the profile goes there too
    started = time.monotonic()
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    remote = remote_node()
    if remote is not None and (options.memory_merge or options.memory_pressed):
        raise SystemExit(
            "--memory-merge, --memory-pressed: only for the harness's own node (AENV_URL names another)"
        )
    merging = ksm_scanning() if options.memory_merge else contextlib.nullcontext()
    harness = (
        contextlib.nullcontext(remote)
        if remote
        else LocalNode(options.seed, options.memory_merge, options.memory_pressed)
    )
    with merging, harness as node:
        if options.profile and node.pid is None:
            print("bench: --profile needs a node on this host; not profiling", file=sys.stderr)
        rows, errors, extra = asyncio.run(measure(node, options))
    meta = {
        "mode": options.mode,
        "started_at": started_at,
        "duration_s": round(time.monotonic() - started, 1),
        "node": {
            "url": node.url,
            "local": node.local,
            "memory_merge": options.memory_merge,
            "memory_pressed": options.memory_pressed,
        },
        "host": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "load_average_at_end": os.getloadavg(),
        },
        **extra,
        "selected": list(options.selected),
        "errors": errors,
    }
    print(
        f"\naenv node benchmark, mode {options.mode}"
        + (f", accelerator {extra['accel']}" if "accel" in extra else "")
    )
    print(table(rows))
    for error in errors:
        print(f"FAILED {error['figure']}: {error['error']}")
    write_json(options.json_path, rows, meta)
    print(
        f"\nwritten: {options.json_path}" + (f", profile: {extra['profile']}" if "profile" in extra else "")
    )
    return 1 if errors else 0
