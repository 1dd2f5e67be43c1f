"""Create and resume with the memory reclaimer on against off (issue 36: within 10 % of today's).

The harness's node runs the reclaimer as shipped (`reclaim_interval` 2 s); a second node, seeded
with its `base` template and otherwise set alike, runs without it (`reclaim_interval=0`). Samples
(`loaded`'s create, then pause and resume of the parked sandbox) alternate between the two, each
after both warm pools refilled, so both nodes see the same host at the same time; a row's floor
is the same figure's median on the node without the reclaimer. Each node is otherwise empty: this
is the mechanism's cost on the lifecycle (a pass every 2 s, the scan of a sandbox that grew),
not the cost of other sandboxes' workloads.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from aenv.config import Settings
from aenv.devnode import DevNode

from .client import NodeClient
from .context import Context, Sandboxes
from .loaded import create_resume_samples
from .node import DEFAULT_TIMEOUT, PARK_SECONDS, BenchError, Node
from .report import Row
from .stats import summarize

SLOT_FIRST = 13568  # after the fusion figure's node (13440 + 128), before the test suites' 14848
SLOT_COUNT = 16
OFF = "same, reclaimer off"


async def reclaim_on_against_off(ctx: Context) -> list[Row]:
    if ctx.node.home is None:
        raise BenchError(
            "the reclaimer's cost starts a second node on this host (AENV_URL names a remote one)"
        )
    workdir = Path(tempfile.mkdtemp(prefix="aenv-bench-reclaimoff-"))
    dev = DevNode(
        workdir / "home", slot_first=SLOT_FIRST, slot_count=SLOT_COUNT, seed=ctx.node.home,
        log_path=workdir / "node.log", shutdown_action="kill", default_timeout=DEFAULT_TIMEOUT,
        park_seconds=PARK_SECONDS, memory_merge=ctx.node.memory_merge, reclaim_interval=0,
    )  # fmt: skip
    try:
        with dev:
            node = Node(
                dev.url, dev.key, home=dev.home, pid=dev.pid, warm_pool=Settings.warm_pool_size,
                park_seconds=PARK_SECONDS, memory_merge=ctx.node.memory_merge,
            )  # fmt: skip
            client = NodeClient(node)
            try:
                template_id = (await client.template("base"))["templateID"]
                off = replace(ctx, node=node, client=client, lab=None, template_id=template_id)
                on_samples, off_samples = await _alternating(ctx, off)
            finally:
                await client.aclose()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    note = (
        f"{ctx.plan.reclaim_off} samples per node, alternating with a second node that runs without the "
        "reclaimer (reclaim_interval=0), each after both warm pools refilled; floor: the same figure's "
        "median there"
    )
    return [
        Row("divergence-create", summarize("create, reclaimer on (warm pool)", on_samples[0]),
            statistics.median(off_samples[0]), OFF, note=note, details={"off_ms": off_samples[0]}),
        Row("divergence-resume", summarize("resume (parked), reclaimer on", on_samples[1]),
            statistics.median(off_samples[1]), OFF, details={"off_ms": off_samples[1]}),
    ]  # fmt: skip


async def _alternating(on: Context, off: Context) -> tuple[tuple[list[float], ...], tuple[list[float], ...]]:
    """`loaded` create and resume samples on each node in turn: (creates, resumes) of each."""
    samples: dict[str, tuple[list[float], list[float]]] = {"on": ([], []), "off": ([], [])}
    async with Sandboxes(on.client) as on_boxes, Sandboxes(off.client) as off_boxes:
        for _ in range(on.plan.reclaim_off):
            for name, ctx, other, boxes in (("on", on, off, on_boxes), ("off", off, on, off_boxes)):
                await other.quiet()
                creates, resumes = await create_resume_samples(ctx, boxes, 1)
                samples[name][0].extend(creates)
                samples[name][1].extend(resumes)
    return samples["on"], samples["off"]
