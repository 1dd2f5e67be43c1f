"""`FakeNode`: the sandbox-keeping part of a node's `NodeService` on in-memory records, for the
light nodes of the cluster figures (`bench.lightnode`) and the cluster's tests without VMs."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import AsyncIterator
from typing import Any

from aenv.agent.envd import ENVD_VERSION
from aenv.orchestrator.errors import NOT_SHARED, PAUSE_GONE, Conflict, NotFound, Overloaded
from aenv.orchestrator.housekeeping import GcTotals
from aenv.orchestrator.interface import BuildTicket, CreateRequest, FileLink, ListQuery, NodeStatus
from aenv.orchestrator.local import matches
from aenv.orchestrator.states import State
from aenv.orchestrator.store import SandboxRecord
from aenv.repository.manifest import MachineShape, SnapshotManifest
from aenv.template.steps import BuildRequest

_ids = itertools.count(1)
LIGHT_TEMPLATE = "base1"  # the light nodes' one template (`bench.lightnode`)


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
            raise Overloaded(f"node {self.node_id} is full")
        if request.template not in self.templates:
            raise NotFound(f"template '{request.template}' not found")
        started = f"2026-01-01T00:00:{next(_ids) % 60:02d}+00:00"
        sandbox = SandboxRecord(
            sandbox_id=request.sandbox_id or f"s{self.node_id}{next(_ids)}", template_id=request.template,
            alias="base", state=State.RUNNING, created_at=started, started_at=started, end_at=started,
            timeout=1, auto_pause=False, auto_resume=False, cpu_count=1, memory_mb=512, disk_size_mb=1024,
            envd_version=ENVD_VERSION, metadata=request.metadata, env_vars=request.env_vars,
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
