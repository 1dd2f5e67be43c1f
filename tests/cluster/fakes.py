"""In-memory stand-ins for the cluster's parts, for tests that need no VM and no Redis: a
scheduler keeping the protocol's promises in a dict, and nodes whose sandboxes are records (the
light nodes' `FakeNode`, re-exported)."""

from __future__ import annotations

import time

from aenv.cluster.model import Binding, NodeCapacity, NodeInfo, NodeState, NodeUsage, Placement
from aenv.cluster.protocols import SandboxKilled
from aenv.orchestrator.errors import Conflict, NotFound, Overloaded
from bench.fakenode import FakeNode, manifest

__all__ = ["FakeNode", "FakeScheduler", "manifest", "node_info"]


def node_info(node_id: str, address: str, status: NodeState = NodeState.UP) -> NodeInfo:
    capacity = NodeCapacity(memory_mib=4096, vcpus=4, disk_free_mib=10_000)
    return NodeInfo(node_id=node_id, address=address, version="test", status=status, capacity=capacity)


class FakeScheduler:
    """The `Scheduler` protocol in memory: places on the up node with the fewest bindings."""

    def __init__(self) -> None:
        self.infos: dict[str, NodeInfo] = {}
        self.bound: dict[str, Binding] = {}
        self.tombstones: dict[str, str] = {}  # sandbox id -> the node it was killed on (no expiry)
        self.placements: list[str] = []
        self.released: list[tuple[str | None, str]] = []  # (sandbox id, node id) of each release

    async def register(self, node: NodeInfo) -> NodeInfo:
        self.infos[node.node_id] = node
        return node

    async def heartbeat(
        self, node_id: str, usage: NodeUsage, capacity: NodeCapacity, cached: list[str]
    ) -> NodeInfo:
        info = await self.node(node_id)
        info = self.infos[node_id] = info.model_copy(update={"usage": usage, "heartbeat_at": time.time()})
        return info

    async def nodes(self) -> list[NodeInfo]:
        return list(self.infos.values())

    async def node(self, node_id: str) -> NodeInfo:
        if node_id not in self.infos:
            raise NotFound(f"node {node_id} not found")
        return self.infos[node_id]

    async def drain(self, node_id: str) -> NodeInfo:
        info = self.infos[node_id] = (await self.node(node_id)).model_copy(
            update={"status": NodeState.DRAINING}
        )
        return info

    def set_status(self, node_id: str, status: NodeState) -> None:
        self.infos[node_id] = self.infos[node_id].model_copy(update={"status": status})

    async def place(self, request: Placement) -> NodeInfo:
        candidates = [
            n for n in self.infos.values() if n.status == NodeState.UP and n.node_id not in request.exclude
        ]
        if not candidates:
            raise Overloaded("no node has room")
        load = {n.node_id: 0 for n in candidates}
        for binding in self.bound.values():
            if binding.node_id in load:
                load[binding.node_id] += 1
        chosen = min(candidates, key=lambda n: (load[n.node_id], n.node_id))
        self.placements.append(chosen.node_id)
        if request.kind == "resume" and request.sandbox_id not in self.bound:
            raise NotFound(f"sandbox {request.sandbox_id} is not bound to any node")
        if request.kind == "create" and request.sandbox_id:
            if request.sandbox_id in self.bound or request.sandbox_id in self.tombstones:
                raise Conflict(f"sandbox {request.sandbox_id} is bound already")
            await self.bind(Binding(sandbox_id=request.sandbox_id, node_id=chosen.node_id))
        return chosen

    async def bind(self, binding: Binding, *, observed: bool = False) -> None:
        if binding.sandbox_id in self.tombstones:
            raise SandboxKilled(f"sandbox {binding.sandbox_id} was killed: it is not bound again")
        was = self.bound.get(binding.sandbox_id)
        if (
            was is not None
            and was.node_id == binding.node_id
            and (was.generation > binding.generation or (observed and was.state == binding.state))
        ):
            return  # late, or an observed bind of the state the node reported already
        if observed:
            binding = binding.model_copy(update={"durable": False})
        self.bound[binding.sandbox_id] = binding

    async def release(self, request: Placement, node_id: str) -> None:
        self.released.append((request.sandbox_id, node_id))

    async def tombstone(self, sandbox_id: str, node_id: str) -> Binding:
        binding = (await self.locate(sandbox_id))[0]
        if binding.node_id != node_id:
            raise Conflict(f"sandbox {sandbox_id} is on node {binding.node_id} now")
        self.tombstones[sandbox_id] = node_id
        return self.bound.pop(sandbox_id)

    async def unbind(self, sandbox_id: str, node_id: str) -> None:
        if (binding := self.bound.get(sandbox_id)) is not None and binding.node_id == node_id:
            del self.bound[sandbox_id]

    async def locate(self, sandbox_id: str) -> tuple[Binding, NodeInfo]:
        if sandbox_id not in self.bound:
            raise NotFound(f"sandbox {sandbox_id} is not bound")
        binding = self.bound[sandbox_id]
        return binding, await self.node(binding.node_id)

    async def bindings(self, node_id: str | None = None) -> list[Binding]:
        return [b for b in self.bound.values() if node_id is None or b.node_id == node_id]
