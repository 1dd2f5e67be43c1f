"""In-memory stand-ins for the cluster's parts, for tests that need no VM and no Redis: a
scheduler keeping the protocol's promises in a dict, and nodes whose sandboxes are records."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from aenv.cluster.model import Binding, NodeCapacity, NodeInfo, NodeState, NodeUsage, Placement
from aenv.cluster.protocols import SandboxKilled
from aenv.orchestrator.errors import NOT_SHARED, PAUSE_GONE, Conflict, NotFound, Unavailable
from aenv.orchestrator.housekeeping import GcTotals
from aenv.orchestrator.interface import BuildTicket, CreateRequest, FileLink, ListQuery, NodeStatus
from aenv.orchestrator.local import matches
from aenv.orchestrator.states import State
from aenv.orchestrator.store import SandboxRecord
from aenv.snapshot.manifest import MachineShape, SnapshotManifest
from aenv.template.steps import BuildRequest
from tests.orchestrator.conftest import record

_ids = itertools.count(1)


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
            raise Unavailable("no node has room")
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


MACHINE = MachineShape(
    qemu_version="10.0.2", machine_type="microvm", vcpus=1, memory_mib=512, accel="tcg",
    kernel_digest="k1", initramfs_digest="i1", tools_digest="t1", cmdline="console=ttyS0",
)  # fmt: skip


def manifest(snapshot_id: str, created_at: str, alias: str | None = None) -> SnapshotManifest:
    digest = "sha256:" + "0" * 64
    return SnapshotManifest(
        id=snapshot_id, kind="template", alias=alias, created_at=created_at, source={}, machine=MACHINE,
        memory_image=digest, memory_deltas=(), device_state=digest, vmstate_prefix=digest, disk_layers=(),
    )  # fmt: skip


class FakeNode:
    """The sandbox-keeping part of `NodeService`, on records; `full` refuses creates."""

    def __init__(self, node_id: str, templates: list[SnapshotManifest]):
        self.node_id = node_id
        self.templates = {m.id: m for m in templates}
        self.sandboxes: dict[str, SandboxRecord] = {}
        self.full = False
        self.builds: dict[str, bytes] = {}
        self.uploads: dict[str, list[bytes]] = {}
        # Durable pauses by sandbox id: the shared repository, when nodes are given the same dict.
        self.repository: dict[str, SandboxRecord] = {}
        self.shared = True  # False: a node-local repository, without other nodes' pauses

    def _get(self, sandbox_id: str) -> SandboxRecord:
        if sandbox_id not in self.sandboxes:
            raise NotFound(f"sandbox {sandbox_id} not found")
        return self.sandboxes[sandbox_id]

    async def create(self, request: CreateRequest) -> SandboxRecord:
        if self.full:
            raise Unavailable(f"node {self.node_id} is full")
        if request.template not in self.templates:
            raise NotFound(f"template '{request.template}' not found")
        started = f"2026-01-01T00:00:{next(_ids) % 60:02d}+00:00"
        sandbox = record(
            sandbox_id=request.sandbox_id or f"s{self.node_id}{next(_ids)}", started_at=started,
            template_id=request.template, metadata=request.metadata, env_vars=request.env_vars,
            envd_token="envd-token", generation=1,
        )  # fmt: skip
        self.sandboxes[sandbox.sandbox_id] = sandbox
        return sandbox

    async def get(self, sandbox_id: str) -> SandboxRecord:
        return self._get(sandbox_id)

    async def list(self, query: ListQuery) -> list[SandboxRecord]:
        """In a node's order (start time, newest first unless asc, then id), which paging needs."""
        found = sorted((r for r in self.sandboxes.values() if matches(r, query)), key=lambda r: r.sandbox_id)
        return query.page(sorted(found, key=lambda r: r.started_at, reverse=query.order == "desc"))

    async def kill(self, sandbox_id: str) -> None:
        self.sandboxes.pop(self._get(sandbox_id).sandbox_id)

    async def pause(self, sandbox_id: str, *, memory: bool = True) -> SandboxRecord:
        sandbox = self._get(sandbox_id)
        if sandbox.state != State.RUNNING:
            raise Conflict(f"sandbox {sandbox_id} is not running")
        sandbox.state = State.PAUSED
        sandbox.generation += 1
        return sandbox

    async def take_over(self, sandbox_id: str, timeout: int | None) -> SandboxRecord:
        if sandbox_id not in self.repository:
            raise NotFound(f"sandbox {sandbox_id} has no durable pause", PAUSE_GONE)
        sandbox = dataclasses.replace(self.repository.pop(sandbox_id), state=State.RUNNING)
        self.sandboxes[sandbox_id] = sandbox
        return sandbox

    async def discard_pause(self, sandbox_id: str) -> None:
        if sandbox_id in self.sandboxes:
            raise Conflict(f"sandbox {sandbox_id} is on this node: kill it instead")
        if not self.shared:
            raise Conflict(f"node {self.node_id}'s repository is not shared", NOT_SHARED)
        if self.repository.pop(sandbox_id, None) is None:
            raise NotFound(f"sandbox {sandbox_id} has no durable pause")

    async def connect(
        self, sandbox_id: str, timeout: int | None, *, memory: bool = True
    ) -> tuple[SandboxRecord, bool]:
        sandbox = self._get(sandbox_id)
        resumed = sandbox.state == State.PAUSED
        sandbox.state = State.RUNNING
        sandbox.generation += resumed
        return sandbox, resumed

    async def fork(self, sandbox_id: str, count: int, timeout: int | None) -> list[SandboxRecord]:
        source = self._get(sandbox_id)
        children = [dataclasses.replace(source, sandbox_id=f"{sandbox_id}f{i}") for i in range(count)]
        self.sandboxes |= {c.sandbox_id: c for c in children}
        return children

    async def catalog(self, kind: str | None = None) -> list[SnapshotManifest]:
        return list(self.templates.values())

    async def find(self, reference: str, kind: str | None = None) -> SnapshotManifest:
        for manifest in self.templates.values():
            if reference in (manifest.id, manifest.alias):
                return manifest
        raise NotFound(f"'{reference}' not found")

    async def request_template_build(self, request: BuildRequest) -> BuildTicket:
        name = request.name.partition(":")[0]
        self.builds[name] = b"".join(self.uploads.get(name, []))
        return BuildTicket(name, f"build-{self.node_id}", ["default"])

    async def template_build_status(
        self, template_id: str, build_id: str, offset: int, limit: int
    ) -> dict[str, Any]:
        if template_id not in self.builds or build_id != f"build-{self.node_id}":
            raise NotFound(f"build {build_id} of {template_id} not found")
        return {"templateID": template_id, "buildID": build_id, "status": "building", "logs": []}

    async def template_file(self, template_id: str, files_hash: str) -> FileLink:
        if template_id not in self.builds:
            raise NotFound(f"template {template_id} not found")
        return FileLink(present=False, expires=1 << 40, signature="sig")

    async def receive_template_file(
        self, template_id: str, files_hash: str, expires: str, signature: str,
        chunks: AsyncIterator[bytes], size: int | None,
    ) -> None:  # fmt: skip
        if template_id not in self.builds:
            raise NotFound(f"template {template_id} not found")
        self.uploads.setdefault(template_id, []).extend([chunk async for chunk in chunks])

    async def status(self) -> NodeStatus:
        return NodeStatus(self.node_id, list(self.sandboxes.values()), 1, 0, 0, 0, GcTotals(runs=1))
