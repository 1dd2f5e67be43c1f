"""A light node for the cluster figures: a node's real API (and, in a cluster, its real
membership: register, heartbeat, bind) over in-memory sandboxes, without VMs.

    python -m bench.lightnode NODE_ID PORT API_KEY CLUSTER_SECRET [SCHEDULER_URL]

Why: listing 1,000 sandboxes spread over three nodes needs 1,000 sandboxes, which a 2-core TCG
host cannot boot; and what the list and placement figures measure is the control plane (the
gateway, the scheduler, Redis, the nodes' API and internal route), not the guests. The
sandboxes are those of the gateway tests' `FakeNode`, which creates a record at once; the
node serves them through the same `NodeAPI` and `Membership` as `aenv server`.
"""

from __future__ import annotations

import asyncio
import sys

from aenv.api import schemas
from aenv.api.server import NodeAPI
from aenv.cluster.client import SchedulerClient
from aenv.cluster.membership import Membership, NodeReport
from aenv.cluster.model import Binding, NodeCapacity, NodeUsage
from aenv.cluster.serving import listen_until_stopped
from aenv.config import Settings
from aenv.orchestrator.states import State
from tests.cluster.fakes import FakeNode, manifest

from .cluster import LIGHT_TEMPLATE

TEMPLATE = manifest(LIGHT_TEMPLATE, "2026-01-01T00:00:00+00:00", alias="base")
HEARTBEAT = 1.0  # seconds between the node's heartbeats, when it is in a cluster
# Room enough that placement never runs out: the figures measure the control plane, not admission.
CAPACITY = NodeCapacity(memory_mib=1 << 30, vcpus=1 << 20, disk_free_mib=1 << 30)


class LightSource:
    """`NodeSource` of a light node: its records, each sandbox 512 MiB and one vCPU."""

    def __init__(self, node: FakeNode):
        self.node = node

    def report(self) -> NodeReport:
        records = list(self.node.sandboxes.values())
        running = sum(r.state == State.RUNNING for r in records)
        usage = NodeUsage(
            running=running, paused=len(records) - running, memory_mib=512 * running, vcpus=running
        )
        bindings = {r.sandbox_id: Binding.of(r, self.node.node_id) for r in records}
        return NodeReport(usage=usage, capacity=CAPACITY, bindings=bindings)

    def cached(self) -> list[str]:
        return [TEMPLATE.id, TEMPLATE.alias or ""]


async def serve(node_id: str, port: int, api_key: str, secret: str, scheduler_url: str | None) -> None:
    node = FakeNode(node_id, [TEMPLATE])
    api = NodeAPI(node, domain=f"localhost:{port}", limits=schemas.limits(Settings()))  # type: ignore[arg-type]
    membership = None
    if scheduler_url:
        address = f"http://127.0.0.1:{port}"
        scheduler = SchedulerClient(scheduler_url, secret)
        membership = Membership(scheduler, LightSource(node), node_id, address, interval=HEARTBEAT)
        await membership.start()
    try:
        await listen_until_stopped(api.app(api_key, secret), f"127.0.0.1:{port}", f"light node {node_id}")
    finally:
        if membership is not None:
            await membership.close()


def main(argv: list[str]) -> None:
    node_id, port, api_key, secret, *scheduler = argv
    asyncio.run(serve(node_id, int(port), api_key, secret, scheduler[0] if scheduler else None))


if __name__ == "__main__":
    main(sys.argv[1:])
