"""SandboxFusion's `/run_code` against `commands.run` in a running sandbox, `CONCURRENCY` at a time.

A node of its own (seeded with the harness node's `base`, `AENV_FUSION_TOKEN` set, a warm pool of
`WARM_POOL`) serves both. Each round sends `CONCURRENCY` requests at once: `POST /fusion/<token>/
run_code` of a trivial Python program (each a fresh sandbox: create from the warm pool, write the
code, run, kill), or, the floor, the same program run with the official SDK's `commands.run`
in `CONCURRENCY` sandboxes created beforehand, one request per sandbox. Rounds alternate between
the two so drift hits both alike; before each round the warm pool is full again. A sample is one
request's wall clock, from sending to its answer.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from aenv.devnode import DevNode

from .client import NodeClient
from .context import SETTLE, Context, Sandboxes
from .node import DEFAULT_TIMEOUT, BenchError, Node
from .report import Row
from .stats import ms_since, summarize

SLOT_FIRST = 13440  # after the cluster figure's node (13312 + 64), before the test suites' 14848
SLOT_COUNT = 128
CONCURRENCY = 32  # requests in flight, as issue 35 states the target
WARM_POOL = 8  # warm VMs of `base` the node keeps (its default is 2)
PROGRAM = "print(sum(range(10)))"
EXPECTED = "45\n"
REFILL_TIMEOUT = 300.0
# SandboxFusion's default run timeout is 10 s; 32 freshly restored guests starting Python at once
# on a 2-core TCG host took longer (TCG translates each new QEMU's code afresh), and the figure is
# the latency, so the bench allows more.
RUN_TIMEOUT = 300


async def fusion(ctx: Context) -> list[Row]:
    if ctx.node.home is None:
        raise BenchError("the fusion figure starts a node on this host (AENV_URL names a node elsewhere)")
    workdir = Path(tempfile.mkdtemp(prefix="aenv-bench-fusion-"))
    token = secrets.token_urlsafe(16)
    dev = DevNode(
        workdir / "home", slot_first=SLOT_FIRST, slot_count=SLOT_COUNT, seed=ctx.node.home,
        log_path=workdir / "node.log", shutdown_action="kill", default_timeout=DEFAULT_TIMEOUT,
        warm_pool_size=WARM_POOL, fusion_token=token,
    )  # fmt: skip
    try:
        with dev:
            node = Node(dev.url, dev.key, home=dev.home, pid=dev.pid, warm_pool=WARM_POOL)
            client = NodeClient(node)
            try:
                samples = await _rounds(ctx, node, client, f"{dev.url}/fusion/{token}/run_code")
            finally:
                await client.aclose()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    floor = statistics.median(samples["commands.run"])
    note = (
        f"{ctx.plan.fusion} rounds of {CONCURRENCY} requests at once, alternating; /run_code: a fresh "
        f"sandbox per request from a warm pool of {WARM_POOL}, full before each round; floor: the "
        f"median of the same program run by commands.run (official e2b AsyncSandbox) in {CONCURRENCY} "
        "running sandboxes"
    )
    details = {"commands_run": summarize("commands.run", samples["commands.run"]).as_dict()}
    figure = summarize(f"/run_code of a trivial program, {CONCURRENCY} at once", samples["run_code"])
    return [Row("fusion", figure, floor, "commands.run", note=note, details=details)]


async def _rounds(ctx: Context, node: Node, client: NodeClient, endpoint: str) -> dict[str, list[float]]:
    from e2b import AsyncSandbox

    samples: dict[str, list[float]] = {"run_code": [], "commands.run": []}
    params: dict[str, Any] = {"api_key": node.api_key, "api_url": node.url, "sandbox_url": node.url}
    async with Sandboxes(client) as sandboxes, httpx.AsyncClient(timeout=600) as http:
        created = [await sandboxes.create() for _ in range(CONCURRENCY)]
        sdks = [await AsyncSandbox.connect(s["sandboxID"], **params) for s in created]
        await asyncio.gather(*(sdk.commands.run("true") for sdk in sdks))  # connections open, code warm
        await _run_code(http, endpoint)  # the first request of the node's fusion client, unmeasured
        batches = {
            "run_code": lambda: asyncio.gather(*(_run_code(http, endpoint) for _ in sdks)),
            "commands.run": lambda: asyncio.gather(*(_command(sdk) for sdk in sdks)),
        }
        for i in range(ctx.plan.fusion):
            for name, batch in batches.items() if i % 2 == 0 else reversed(batches.items()):
                await _refilled(ctx, node)
                samples[name] += await batch()
    return samples


async def _refilled(ctx: Context, node: Node) -> None:
    deadline = time.monotonic() + REFILL_TIMEOUT
    while node.warm_ready(ctx.template_id) < WARM_POOL and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await asyncio.sleep(SETTLE)


async def _command(sdk: Any) -> float:
    started = time.perf_counter()
    result = await sdk.commands.run(f"python3 -c '{PROGRAM}'")
    elapsed = ms_since(started)
    if result.stdout != EXPECTED:
        raise BenchError(f"commands.run printed {result.stdout!r}")
    return elapsed


async def _run_code(http: httpx.AsyncClient, endpoint: str) -> float:
    started = time.perf_counter()
    request = {"code": PROGRAM, "language": "python", "run_timeout": RUN_TIMEOUT}
    answer = await http.post(endpoint, json=request)
    elapsed = ms_since(started)
    body = answer.json() if answer.status_code == 200 else {}
    if body.get("status") != "Success" or body["run_result"]["stdout"] != EXPECTED:
        raise BenchError(f"/run_code answered {answer.status_code}: {answer.text[:300]}")
    return elapsed
