"""Cluster figures at scale: many light nodes, many sandboxes, several gateways and two schedulers
over one Redis, all on this host (no VMs).

    python -m bench.scale [--full] [--json PATH]      (or `python -m bench --only cluster-scale`)

Smoke-sized by default (`SMOKE`: 50 nodes, 5,000 sandboxes); `--full` is the size issue 37 asks
for (`FULL`: 1,000 nodes, 100,000 sandboxes, 4 gateways, 2 schedulers). Light nodes
(`bench.lightnode`) are `PER_PROCESS` to a process, each on its own port, registering,
heartbeating every `HEARTBEAT` s (the node's default) and binding like a node; each has room for
all it will be given, so the figures measure the control plane, not admission.

Figures, in order:
- Redis memory per node: `used_memory` (INFO memory) after the nodes joined less before;
- placement: the sandboxes created through all gateways, `CONCURRENCY` in flight per gateway, in
  `BATCHES` batches (each a sample of placements per second), each create's latency too;
- Redis memory per sandbox: `used_memory` once the heartbeats counted them, less after the join;
- heartbeat load: Redis's `total_commands_processed` per second over `IDLE` s with no client
  (heartbeats, and the nodes' binds and reconciliation: all a quiet cluster costs Redis);
- connect and kill latency through a gateway, `SAMPLED` sandboxes each;
- a paged list (100 a page, following `nextToken`) through one gateway, each page a sample, for
  at most `LIST_BUDGET` s (a walk over 100,000 on 1,000 nodes is 1,000 pages, each asking every
  node): the whole walk's time is pages x the median page;
- node death: one process of light nodes is killed (-9); the time until the scheduler has its
  nodes `down`, and until a durable pause bound to one of them is placed on another node.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import redis

from aenv.cluster.auth import CLUSTER_SECRET_HEADER
from aenv.cluster.model import Binding, Placement
from aenv.devcluster import ClusterProcess, RedisServer, gateway, redis_server, scheduler

from .client import NodeClient
from .context import Context, bounded
from .fakenode import LIGHT_TEMPLATE
from .lightnode import LightNodes, light_nodes
from .node import BenchError, Node
from .report import Row, table, write_json
from .stats import ms_since, summarize


@dataclass(frozen=True)
class Size:
    nodes: int
    sandboxes: int
    gateways: int = 4
    schedulers: int = 2


SMOKE = Size(nodes=50, sandboxes=5_000)
FULL = Size(nodes=1_000, sandboxes=100_000)
PER_PROCESS = 25  # light nodes a process hosts (one process is killed: the others take over)
HEARTBEAT = 2.0  # seconds between a light node's heartbeats (`Settings.heartbeat_interval`)
DOWN_AFTER = 10.0  # the scheduler's `node_down_after` (its default)
CONCURRENCY = 16  # creates in flight per gateway
BATCHES = 10
SAMPLED = 200  # sandboxes connected to, and killed, one at a time
IDLE = 10.0  # seconds the heartbeat load is counted over
LIST_BUDGET = 60.0  # seconds the paged list may take
PAGE = 100
JOIN_TIMEOUT = 600.0
RETRIES = 5  # a create answered 429 or 503 is retried this often, RETRY_PAUSE s apart
RETRY_PAUSE = 0.5


@dataclass
class ScaleCluster:
    redis: RedisServer
    schedulers: list[ClusterProcess]
    gateways: list[ClusterProcess]
    processes: list[LightNodes]
    secret: str

    def scheduler_get(self, path: str) -> Any:
        response = httpx.get(
            self.schedulers[0].url + path, headers={CLUSTER_SECRET_HEADER: self.secret}, timeout=60
        )
        response.raise_for_status()
        return response.json()

    def info(self, section: str) -> dict[str, Any]:
        with redis.Redis.from_url(self.redis.url) as client:
            return client.info(section)


@contextlib.contextmanager
def _control_plane(workdir: Path, size: Size) -> Iterator[tuple[ScaleCluster, str]]:
    """Redis, the schedulers and the gateways (each naming every scheduler, its own first); no
    nodes yet. The gateways' API key too."""
    secret, key = secrets.token_hex(16), "e2b_" + secrets.token_hex(20)
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(redis_server(workdir / "redis"))
        schedulers = [
            stack.enter_context(
                scheduler(store.url, workdir / f"scheduler{i}.log", secret, log_level="WARNING")
            )
            for i in range(size.schedulers)
        ]
        urls = [s.url for s in schedulers]
        gateways = [
            stack.enter_context(gateway(",".join(urls[i % len(urls) :] + urls[: i % len(urls)]),
                                        workdir / f"gateway{i}.log", secret, key))
            for i in range(size.gateways)
        ]  # fmt: skip
        yield ScaleCluster(store, schedulers, gateways, [], secret), key


def _join(stack: contextlib.ExitStack, cluster: ScaleCluster, workdir: Path, size: Size) -> None:
    """Start the light nodes, and wait until the scheduler has every one up."""
    urls = ",".join(s.url for s in cluster.schedulers)
    node_key = "e2b_" + secrets.token_hex(20)
    for first in range(0, size.nodes, PER_PROCESS):
        count = min(PER_PROCESS, size.nodes - first)
        cluster.processes.append(stack.enter_context(light_nodes(
            workdir / f"nodes{first // PER_PROCESS}.log", node_key, cluster.secret, scheduler=urls,
            count=count, prefix=f"n{first // PER_PROCESS:03d}-", heartbeat=HEARTBEAT,
        )))  # fmt: skip
    deadline = time.monotonic() + JOIN_TIMEOUT
    while sum(n["status"] == "up" for n in cluster.scheduler_get("/nodes")) < size.nodes:
        if time.monotonic() > deadline:
            raise BenchError(f"fewer than {size.nodes} nodes joined in {JOIN_TIMEOUT:g} s")
        time.sleep(1.0)


async def _place(
    clients: list[NodeClient], count: int
) -> tuple[list[float], list[float], list[str], list[str]]:
    """`count` creates over the gateways in `BATCHES` batches: placements per second of each
    batch, each create's milliseconds (its retries included), the sandbox ids, the 429s and 503s retried."""
    rates: list[float] = []
    latencies: list[float] = []
    ids: list[str] = []
    retried: list[str] = []

    async def create(client: NodeClient) -> None:
        """One create, retried after a 429 (no room now) or 503 (the scheduler overloaded), as a
        client would."""
        started = time.perf_counter()
        for attempt in range(RETRIES + 1):
            try:
                sandbox = await client.create(LIGHT_TEMPLATE)
                break
            except BenchError as exc:
                if exc.status not in (429, 503) or attempt == RETRIES:
                    raise
                retried.append(str(exc))
                await asyncio.sleep(RETRY_PAUSE)
        latencies.append(ms_since(started))
        ids.append(sandbox["sandboxID"])

    for batch in range(BATCHES):
        size = count // BATCHES + (batch < count % BATCHES)
        jobs = [functools.partial(create, clients[i % len(clients)]) for i in range(size)]
        started = time.perf_counter()
        results = await bounded(CONCURRENCY * len(clients), jobs)
        elapsed = time.perf_counter() - started
        if failed := [r for r in results if isinstance(r, BaseException)]:
            raise BenchError(f"{len(failed)} of {size} creates failed: {failed[0]}")
        rates.append(size / elapsed)
    return rates, latencies, ids, retried


async def _timed(calls: list[Any]) -> list[float]:
    """Each call (a coroutine function) one after the other: its milliseconds."""
    samples = []
    for call in calls:
        started = time.perf_counter()
        await call()
        samples.append(ms_since(started))
    return samples


async def _connect(client: NodeClient, sandbox_id: str) -> None:
    status, _, content = await client.request(
        "POST", f"/sandboxes/{sandbox_id}/connect", json={"timeout": 300}
    )
    if status not in (200, 201):
        raise BenchError(f"connect answered {status}: {content[:200].decode(errors='replace')}")


async def _pages(client: NodeClient) -> tuple[list[float], bool]:
    """Milliseconds of each page of the list, for at most `LIST_BUDGET` s; whether it reached the end."""
    samples: list[float] = []
    token = None
    deadline = time.monotonic() + LIST_BUDGET
    while time.monotonic() < deadline:
        params = {"limit": str(PAGE), **({"nextToken": token} if token else {})}
        started = time.perf_counter()
        status, headers, content = await client.request("GET", "/v2/sandboxes", params=params)
        samples.append(ms_since(started))
        if status != 200:
            raise BenchError(f"listing answered {status}: {content[:400].decode(errors='replace')}")
        if (token := headers.get("X-Next-Token")) is None:
            return samples, True
    return samples, False


def _commands_per_second(cluster: ScaleCluster) -> float:
    before, started = cluster.info("stats")["total_commands_processed"], time.monotonic()
    time.sleep(IDLE)
    return (cluster.info("stats")["total_commands_processed"] - before) / (time.monotonic() - started)


def _death(cluster: ScaleCluster) -> tuple[list[float], float]:
    """Kill the last process of light nodes with a durable pause bound to its first node: the
    seconds until the scheduler has each of its nodes down, and until the pause is placed elsewhere."""
    if len(cluster.processes) < 2:
        raise BenchError(f"the node death figures need more than {PER_PROCESS} nodes (two processes)")
    victim = cluster.processes[-1]
    dead = set(victim.urls)
    home = sorted(dead)[0]
    headers = {CLUSTER_SECRET_HEADER: cluster.secret}
    pause = Binding(sandbox_id="scale-durable-pause", node_id=home, state="paused", durable=True)
    with httpx.Client(base_url=cluster.schedulers[0].url, headers=headers, timeout=30) as http:
        http.put(f"/bindings/{pause.sandbox_id}", content=pause.model_dump_json()).raise_for_status()
        victim.sigkill()
        killed = time.monotonic()
        downs: dict[str, float] = {}
        placed = None
        resume = Placement(kind="resume", sandbox_id=pause.sandbox_id).model_dump_json()
        while len(downs) < len(dead) or placed is None:
            if time.monotonic() - killed > DOWN_AFTER * 6:
                raise BenchError(f"after {DOWN_AFTER * 6:g} s, {len(dead) - len(downs)} dead nodes not down, "
                                 f"the pause {'placed' if placed else 'not placed'} elsewhere")  # fmt: skip
            now = time.monotonic() - killed
            for node in http.get("/nodes").json():
                if node["node_id"] in dead and node["status"] == "down":
                    downs.setdefault(node["node_id"], now)
            answer = http.post("/placements", content=resume)
            if placed is None and answer.status_code == 200 and answer.json()["node_id"] != home:
                placed = now
                http.post("/placements/release", content=resume, params={"node_id": answer.json()["node_id"]})
            time.sleep(0.1)
    return list(downs.values()), placed


async def measure(workdir: Path, size: Size) -> list[Row]:
    with contextlib.ExitStack() as stack:
        cluster, key = stack.enter_context(_control_plane(workdir, size))
        empty = cluster.info("memory")["used_memory"]
        _join(stack, cluster, workdir, size)
        joined = cluster.info("memory")["used_memory"]
        clients = [NodeClient(Node(g.url, key), max_connections=CONCURRENCY) for g in cluster.gateways]
        try:
            rates, creates, ids, retried = await _place(clients, size.sandboxes)
            await asyncio.sleep(HEARTBEAT * 2)  # the heartbeats count them: no pending room left
            filled = cluster.info("memory")["used_memory"]
            heartbeat_load = _commands_per_second(cluster)
            sampled = ids[:SAMPLED]
            connects = await _timed([lambda s=s: _connect(clients[0], s) for s in sampled])
            pages, complete = await _pages(clients[0])
            kills = await _timed([lambda s=s: clients[0].kill(s) for s in sampled])
        finally:
            for client in clients:
                await client.aclose()
        downs, takeover = _death(cluster)
    memory = ((joined - empty) / size.nodes, (filled - joined) / size.sandboxes)
    latencies = (creates, connects, kills)
    return _rows(
        size, (rates, len(retried)), latencies, pages, complete, heartbeat_load, memory, downs, takeover
    )


def _rows(
    size: Size, placed: tuple[list[float], int], latencies: tuple[list[float], list[float], list[float]],
    pages: list[float], complete: bool, heartbeat_load: float, memory: tuple[float, float],
    downs: list[float], takeover: float,
) -> list[Row]:  # fmt: skip
    shape = (
        f"{size.nodes} light nodes ({PER_PROCESS} a process, heartbeat {HEARTBEAT:g} s), {size.sandboxes} "
        f"sandboxes, {size.gateways} gateways, {size.schedulers} schedulers, one Redis"
    )
    per_node, per_sandbox = memory
    rates, retried = placed
    creates, connects, kills = latencies
    walk = len(pages) if complete else -(-size.sandboxes // PAGE)
    list_note = f"{len(pages)} pages of {PAGE} through one gateway" + (
        "" if complete else f" in {LIST_BUDGET:g} s (of {walk}); a whole walk: {walk} x the median page"
    )
    placement = summarize(f"creates placed through {size.gateways} gateways", rates, unit="/s")
    heartbeats = summarize("Redis commands/s of a quiet cluster", [heartbeat_load], unit="/s")
    quiet = f"over {IDLE:g} s with no client: heartbeats, binds and reconciliation of {size.nodes} nodes"
    down = summarize(f"a dead node's time to down (down_after {DOWN_AFTER:g} s)", [d * 1000 for d in downs])
    return [
        Row("cluster-scale-placement", placement,
            note=f"{shape}; {CONCURRENCY} in flight per gateway; {retried} creates refused and retried"),
        Row("cluster-scale-create", summarize("create through a gateway, under that load", creates)),
        Row("cluster-scale-connect", summarize("connect through a gateway (one at a time)", connects)),
        Row("cluster-scale-kill", summarize("kill through a gateway (one at a time)", kills)),
        Row("cluster-scale-list", summarize(f"a page of the list over {size.sandboxes}", pages),
            note=list_note, details={"whole_walk_ms": walk * statistics.median(pages)}),
        Row("cluster-scale-heartbeat", heartbeats, note=quiet),
        Row("cluster-scale-redis-node", summarize("Redis memory per node", [per_node], unit="B")),
        Row("cluster-scale-redis-sandbox", summarize("Redis memory per sandbox", [per_sandbox], unit="B")),
        Row("cluster-scale-down", down, note=f"{len(downs)} nodes of one process killed -9"),
        Row("cluster-scale-takeover", summarize("a dead node's durable pause placed elsewhere",
            [takeover * 1000])),
    ]  # fmt: skip


async def cluster_scale(ctx: Context) -> list[Row]:
    """The figures at the plan's size (`SMOKE` unless the run asked for `--scale-full`)."""
    return await _run(FULL if ctx.plan.scale_full else SMOKE)


async def _run(size: Size) -> list[Row]:
    workdir = Path(tempfile.mkdtemp(prefix="aenv-bench-scale-"))
    try:
        return await measure(workdir, size)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="1,000 nodes, 100,000 sandboxes")
    parser.add_argument("--nodes", type=int, help="instead of the size's")
    parser.add_argument("--sandboxes", type=int, help="instead of the size's")
    parser.add_argument("--json", type=Path, default=Path("bench/results/cluster-scale.json"))
    args = parser.parse_args(argv)
    size = FULL if args.full else SMOKE
    size = replace(size, nodes=args.nodes or size.nodes, sandboxes=args.sandboxes or size.sandboxes)
    started, load = time.monotonic(), _load()
    rows = asyncio.run(_run(size))
    print(table(rows))
    meta = {"size": size.__dict__, "duration_s": round(time.monotonic() - started, 1),
            "load_average": {"start": load, "end": _load()}}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.json, rows, meta)
    print(json.dumps(meta))


def _load() -> tuple[float, float, float]:
    return os.getloadavg()


if __name__ == "__main__":
    main(sys.argv[1:])
