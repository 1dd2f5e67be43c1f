"""Light nodes for the cluster figures and fault tests: each a node's real API (and, in a cluster,
its real membership: register, heartbeat, bind) over in-memory sandboxes, without VMs. One
process hosts any number of them, each on its own port, so a thousand fit on this host.

    python -m bench.lightnode --key KEY --secret SECRET [--count N] [--prefix light]
                              [--scheduler URL[,URL...]] [--sandboxes N] [--heartbeat S]

Once every node listens, the process prints one line of JSON, `{"node id": "http://..."}`, and
serves until SIGTERM or SIGINT.

Why: listing 1,000 sandboxes spread over three nodes needs 1,000 sandboxes, which a 2-core TCG
host cannot boot; and what the list and placement figures measure is the control plane (the
gateway, the scheduler, Redis, the nodes' API and internal route), not the guests. The
sandboxes are `FakeNode`'s (`bench.fakenode`), which creates a record at once; each node serves
them through the same `NodeAPI` and `Membership` as `aenv server`. The nodes of one process share
one client to the scheduler (its keep-alive connections), as they would share a network.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import uvloop
from aiohttp import web

from aenv.api import schemas
from aenv.api.runner import APIRunner
from aenv.api.server import NodeAPI
from aenv.cluster.client import SchedulerClient
from aenv.cluster.membership import Membership, NodeReport
from aenv.cluster.model import Binding, NodeCapacity, NodeUsage
from aenv.config import Settings
from aenv.devcluster import START_TIMEOUT, stop
from aenv.orchestrator.states import State

from .fakenode import LIGHT_TEMPLATE, FakeNode, manifest

TEMPLATE = manifest(LIGHT_TEMPLATE, "2026-01-01T00:00:00+00:00", alias="base")
HEARTBEAT = 1.0  # seconds between a node's heartbeats, when it is in a cluster
SANDBOX_MIB = 512  # each sandbox's memory, as a placement's default request
# Room enough that placement never runs out: the figures measure the control plane, not admission.
ROOMY = 1 << 20  # sandboxes a node has room for unless told otherwise


class LightSource:
    """`NodeSource` of a light node: its records, each sandbox 512 MiB and one vCPU, with room
    for `sandboxes` of them."""

    def __init__(self, node: FakeNode, sandboxes: int = ROOMY):
        self.node = node
        self.capacity = NodeCapacity(memory_mib=SANDBOX_MIB * sandboxes, vcpus=1 << 20, disk_free_mib=1 << 30)

    def report(self) -> NodeReport:
        records = list(self.node.sandboxes.values())
        running = sum(r.state == State.RUNNING for r in records)
        usage = NodeUsage(
            running=running, paused=len(records) - running, memory_mib=SANDBOX_MIB * running, vcpus=running
        )
        bindings = {r.sandbox_id: Binding.of(r, self.node.node_id) for r in records}
        return NodeReport(usage=usage, capacity=self.capacity, bindings=bindings)

    def cached(self) -> list[str]:
        return [TEMPLATE.id, TEMPLATE.alias or ""]

    async def forget_moved(self) -> None:
        """Nothing moves away from a light node: its pauses are in no shared repository."""

    async def kill(self, sandbox_id: str) -> None:
        await self.node.kill(sandbox_id)


async def start_node(
    node_id: str, api_key: str, secret: str, scheduler: SchedulerClient | None, *, sandboxes: int,
    heartbeat: float,
) -> tuple[str, APIRunner, Membership | None]:  # fmt: skip
    """One light node listening on a free loopback port (and joining the cluster if `scheduler`
    is given): its URL, its runner and its membership."""
    node = FakeNode(node_id, [TEMPLATE])
    api = NodeAPI(node, domain="localhost:1", limits=schemas.limits(Settings()))  # type: ignore[arg-type]
    runner = APIRunner(api.app(api_key, secret), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    url = f"http://127.0.0.1:{port}"
    api.domain = f"localhost:{port}"
    membership = None
    if scheduler is not None:
        membership = Membership(scheduler, LightSource(node, sandboxes), node_id, url, interval=heartbeat)
        await membership.start()
    return url, runner, membership


async def serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    scheduler = SchedulerClient(args.scheduler, args.secret) if args.scheduler else None
    started: list[tuple[APIRunner, Membership | None]] = []
    urls: dict[str, str] = {}
    try:
        for i in range(args.count):
            node_id = f"{args.prefix}{i}" if args.count > 1 else args.prefix
            url, runner, membership = await start_node(
                node_id, args.key, args.secret, scheduler, sandboxes=args.sandboxes, heartbeat=args.heartbeat
            )
            started.append((runner, membership))
            urls[node_id] = url
        print(json.dumps(urls), flush=True)
        await stop.wait()
    finally:
        for runner, membership in started:
            if membership is not None:
                await membership.close()
            await runner.cleanup()
        if scheduler is not None:
            await scheduler.close()


@dataclass
class LightNodes:
    """A process of light nodes: their URLs by node id, and the process (to crash it)."""

    urls: dict[str, str]
    process: subprocess.Popen[bytes]

    def sigkill(self) -> None:
        """Every node of the process dies at once, as a host would."""
        self.process.kill()
        self.process.wait()


@contextlib.contextmanager
def light_nodes(
    log: Path, key: str, secret: str, *, scheduler: str = "", count: int = 1, prefix: str = "light",
    sandboxes: int = ROOMY, heartbeat: float = HEARTBEAT,
) -> Iterator[LightNodes]:  # fmt: skip
    """`count` light nodes in one process until the block ends, once all listen."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "src")])}
    args = [sys.executable, "-m", "bench.lightnode", "--key", key, "--secret", secret, "--count", str(count),
            "--prefix", prefix, "--scheduler", scheduler, "--sandboxes", str(sandboxes),
            "--heartbeat", str(heartbeat)]  # fmt: skip
    with log.open("ab") as sink:
        process = subprocess.Popen(
            ["setpriv", "--pdeathsig", "TERM", "--", *args], cwd=repo, env=env, stdout=subprocess.PIPE,
            stderr=sink, start_new_session=True,
        )  # fmt: skip
    try:
        yield LightNodes(_announced(process, log, START_TIMEOUT + count / 10), process)
    finally:
        stop(process)


def _announced(process: subprocess.Popen[bytes], log: Path, timeout: float) -> dict[str, str]:
    """The nodes' URLs, from the line the process prints once all of them listen (killed if it
    has not within `timeout` seconds)."""
    assert process.stdout is not None
    timer = threading.Timer(timeout, process.kill)
    timer.start()
    try:
        line = process.stdout.readline()
    finally:
        timer.cancel()
    if not line:
        raise RuntimeError(f"the light nodes exited ({process.poll()}) before listening: see {log}")
    return json.loads(line)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lightnode", description=__doc__.split("\n")[0])
    parser.add_argument("--key", required=True, help="the nodes' API key")
    parser.add_argument("--secret", required=True, help="the cluster secret")
    parser.add_argument("--count", type=int, default=1, help="light nodes in this process")
    parser.add_argument("--prefix", default="light", help="node ids: PREFIX0, PREFIX1... (PREFIX if one)")
    parser.add_argument("--scheduler", default="", help="join the cluster of these schedulers")
    parser.add_argument("--sandboxes", type=int, default=ROOMY, help="sandboxes each node has room for")
    parser.add_argument("--heartbeat", type=float, default=HEARTBEAT, help="seconds between heartbeats")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main(sys.argv[1:])
