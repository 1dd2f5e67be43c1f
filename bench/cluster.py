"""Cluster figures: a create through a gateway against one directly on its node, a list over 1,000
sandboxes on three nodes through the gateway, and the rate at which the scheduler places creates.

The harness starts the cluster itself, on this host, in two parts that share one Redis:

- a real node (`aenv server`, seeded with the harness node's `base`, warm pool on) that joins a
  scheduler, with a gateway in front. Creates alternate between the gateway and the node's own
  API (with the cluster secret, as the gateway would call it), each after the node's warm pool
  refilled, so drift hits both alike; the floor is the median direct create.
- three light nodes (`bench.lightnode`: the node's API and membership over in-memory sandboxes)
  behind a fresh scheduler and gateway, and a fourth outside the cluster as the floor. 1,000
  sandboxes are more than this host can boot, and what these figures measure is the control plane,
  not the guests. The placement figure creates the sandboxes through the gateway, `CONCURRENCY`
  at a time, in batches, each batch a sample of creates per second; the floor is the same creates
  sent straight to the floor node. The list figure walks `GET /v2/sandboxes` a page of `PAGE` at
  a time, following `nextToken`, over all of them; the floor is the same walk on the floor node,
  which holds as many.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from aenv.cluster.auth import CLUSTER_SECRET_HEADER
from aenv.cluster.client import SchedulerClient
from aenv.cluster.model import Placement
from aenv.config import Settings
from aenv.devcluster import (
    ClusterProcess,
    RedisServer,
    gateway,
    redis_server,
    scheduler_process,
)
from aenv.devnode import DevNode
from aenv.orchestrator.ids import new_sandbox_id

from .client import NodeClient
from .context import SETTLE, Context, bounded
from .fakenode import LIGHT_TEMPLATE
from .lightnode import light_nodes
from .node import DEFAULT_TIMEOUT, BenchError, Node
from .report import Row
from .stats import ms_since, summarize

SLOT_FIRST = 13312  # after the harness node's range (12288 + 1024), before the test suites' 14848
SLOT_COUNT = 64
HEARTBEAT = 1.0  # seconds between the real node's heartbeats
LIGHT_NODES = 3
CONCURRENCY = 16  # creates in flight in the placement figure
BATCHES = 10  # placement samples: the sandboxes are created in this many batches
PAGE = 100  # the list figure's page size (E2B's largest)
JOIN_TIMEOUT = 60.0


async def cluster(ctx: Context) -> list[Row]:
    if ctx.node.home is None:
        raise BenchError("the cluster figures start a cluster on this host (AENV_URL names a node elsewhere)")
    workdir = Path(tempfile.mkdtemp(prefix="aenv-bench-cluster-"))
    try:
        with redis_server(workdir / "redis") as redis:
            rows = await _create_rows(ctx, redis, workdir)
            redis.flush()
            rows += await _light_rows(ctx, redis, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


@contextlib.contextmanager
def _control_plane(redis: RedisServer, workdir: Path, name: str) -> Iterator[tuple[str, ClusterProcess, str]]:
    """A scheduler and a gateway in front of it: the scheduler's URL, the gateway, the secret."""
    secret = secrets.token_hex(16)
    with scheduler_process(redis.url, workdir / f"{name}-scheduler.log", secret) as scheduler:
        key = "e2b_" + secrets.token_hex(20)
        with gateway(scheduler, workdir / f"{name}-gateway.log", secret, key) as front:
            yield scheduler, front, secret


async def _joined(scheduler: SchedulerClient, count: int) -> None:
    """Until `count` nodes are up in the scheduler's registry."""
    deadline = time.monotonic() + JOIN_TIMEOUT
    while sum(n.status == "up" for n in await scheduler.nodes()) < count:
        if time.monotonic() > deadline:
            raise BenchError(f"fewer than {count} nodes joined the scheduler in {JOIN_TIMEOUT:g} s")
        await asyncio.sleep(0.2)


# -- create through the gateway ----------------------------------------------------------------


async def _create_rows(ctx: Context, redis: RedisServer, workdir: Path) -> list[Row]:
    assert ctx.node.home is not None
    with _control_plane(redis, workdir, "real") as (scheduler_url, front, secret):
        dev = DevNode(
            workdir / "node", slot_first=SLOT_FIRST, slot_count=SLOT_COUNT, seed=ctx.node.home,
            log_path=workdir / "node.log", shutdown_action="kill", default_timeout=DEFAULT_TIMEOUT,
            scheduler_url=scheduler_url, cluster_secret=secret, heartbeat_interval=HEARTBEAT,
        )  # fmt: skip
        with dev:
            scheduler = SchedulerClient(scheduler_url, secret)
            node = Node(dev.url, dev.key, home=dev.home, pid=dev.pid, warm_pool=Settings.warm_pool_size)
            direct = NodeClient(node, headers={CLUSTER_SECRET_HEADER: secret})
            through = NodeClient(Node(front.url, front.key))
            try:
                await _joined(scheduler, 1)
                samples = await _alternating_creates(ctx, node, {"direct": direct, "gateway": through})
                places = [await _place(scheduler, ctx.template_id) for _ in range(ctx.plan.cluster_create)]
            finally:
                await scheduler.close()
                await direct.aclose()
                await through.aclose()
    floor = statistics.median(samples["direct"])
    note = (
        f"samples alternate with creates on the node's own API, after one unmeasured create each; before "
        f"each, the node's {node.warm_pool} warm VMs were ready and {SETTLE:g} s passed; floor: the median "
        "direct create; place_ms: the gateway's placement round trip alone (scheduler and Redis), "
        "the one hop a create through the gateway adds besides its own"
    )
    details = {"direct_ms": samples["direct"], "place_ms": places}
    figure = summarize("create through the gateway (warm pool)", samples["gateway"])
    return [Row("cluster-create", figure, floor, "direct on the node", note=note, details=details)]


async def _alternating_creates(
    ctx: Context, node: Node, clients: dict[str, NodeClient]
) -> dict[str, list[float]]:
    """`cluster_create` samples per path, after one create each that is not measured: the first
    opens the connections of each hop (client, gateway, scheduler, node), which later ones reuse."""
    for client in clients.values():
        await _refilled(node, ctx.template_id)
        await client.kill((await client.create())["sandboxID"])
    samples: dict[str, list[float]] = {path: [] for path in clients}
    for _ in range(ctx.plan.cluster_create):
        for path, client in clients.items():
            await _refilled(node, ctx.template_id)
            started = time.perf_counter()
            sandbox = await client.create()
            samples[path].append(ms_since(started))
            await client.kill(sandbox["sandboxID"])
    return samples


async def _place(scheduler: SchedulerClient, template_id: str) -> float:
    """One placement as a gateway's create makes it (naming its sandbox), in ms; then unbound."""
    sandbox_id = new_sandbox_id()
    started = time.perf_counter()
    node = await scheduler.place(Placement(template=template_id, sandbox_id=sandbox_id))
    elapsed = ms_since(started)
    await scheduler.unbind(sandbox_id, node.node_id)
    return elapsed


async def _refilled(node: Node, template_id: str) -> None:
    deadline = time.monotonic() + 120
    while node.warm_pool and node.warm_ready(template_id) < node.warm_pool and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(SETTLE)


# -- list and placement over light nodes -------------------------------------------------------


async def _light_rows(ctx: Context, redis: RedisServer, workdir: Path) -> list[Row]:
    count = ctx.plan.cluster_sandboxes
    with contextlib.ExitStack() as stack:
        scheduler_url, front, secret = stack.enter_context(_control_plane(redis, workdir, "light"))
        node_key = "e2b_" + secrets.token_hex(20)
        log = workdir / "light.log"
        stack.enter_context(light_nodes(log, node_key, secret, scheduler=scheduler_url, count=LIGHT_NODES))
        floor_url = stack.enter_context(light_nodes(log, node_key, secret, prefix="floor")).urls["floor"]
        scheduler = SchedulerClient(scheduler_url, secret)
        through = NodeClient(Node(front.url, front.key), max_connections=CONCURRENCY)
        floor = NodeClient(
            Node(floor_url, node_key), max_connections=CONCURRENCY, headers={CLUSTER_SECRET_HEADER: secret}
        )
        try:
            await _joined(scheduler, LIGHT_NODES)
            placed = await _placement_rates(through, count)
            direct = await _placement_rates(floor, count)
            holders = {b.node_id for b in await scheduler.bindings()}
            walks, floor_walks = [], []
            for _ in range(ctx.plan.cluster_list):
                walks.append(await _walk(through, count))
                floor_walks.append(await _walk(floor, count))
        finally:
            await scheduler.close()
            await through.aclose()
            await floor.aclose()
    pages = -(-count // PAGE)
    placement_note = (
        f"{count} creates in {BATCHES} batches, {CONCURRENCY} in flight, onto {LIGHT_NODES} light nodes "
        f"(bound on {len(holders)}); floor: the same creates straight to one light node"
    )
    list_note = (
        f"{count} sandboxes on {LIGHT_NODES} light nodes, {pages} pages of {PAGE} per walk; floor: the same "
        "walk on one light node holding as many"
    )
    placement = summarize(f"creates placed through the gateway ({CONCURRENCY} at once)", placed, unit="/s")
    listing = summarize(f"list {count} sandboxes on {LIGHT_NODES} nodes (all pages)", walks)
    return [
        Row("cluster-placement", placement, statistics.median(direct), "direct creates", note=placement_note,
            details={"direct_per_s": direct}),
        Row("cluster-list", listing, statistics.median(floor_walks), "one node", note=list_note,
            details={"floor_ms": floor_walks}),
    ]  # fmt: skip


async def _placement_rates(client: NodeClient, count: int) -> list[float]:
    """Create `count` sandboxes, `CONCURRENCY` at a time, in `BATCHES` batches: creates per second of each."""
    rates = []
    for batch in range(BATCHES):
        size = count // BATCHES + (batch < count % BATCHES)
        started = time.perf_counter()
        results = await bounded(CONCURRENCY, [functools.partial(client.create, LIGHT_TEMPLATE)] * size)
        elapsed = time.perf_counter() - started
        if failed := [r for r in results if isinstance(r, BaseException)]:
            raise BenchError(f"{len(failed)} of {size} creates failed: {failed[0]}")
        rates.append(size / elapsed)
    return rates


async def _walk(client: NodeClient, count: int) -> float:
    """Every page of `GET /v2/sandboxes`, following `nextToken`; the milliseconds it took."""
    seen: set[str] = set()
    token = None
    started = time.perf_counter()
    while True:
        params = {"limit": str(PAGE), **({"nextToken": token} if token else {})}
        status, headers, content = await client.request("GET", "/v2/sandboxes", params=params)
        if status != 200:
            raise BenchError(f"listing answered {status}: {content[:400].decode(errors='replace')}")
        seen.update(s["sandboxID"] for s in json.loads(content))
        if (token := headers.get("X-Next-Token")) is None:
            break
    elapsed = ms_since(started)
    if len(seen) != count:
        raise BenchError(f"the pages listed {len(seen)} distinct sandboxes of {count}")
    return elapsed
