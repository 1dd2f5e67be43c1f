"""The node service of this process: `NodeService` over the orchestrator and the snapshot engine.

It translates ids into sandboxes and sandboxes into records, so callers never hold a VM handle,
and it owns the catalog operations that span the engine's parts (deleting a template drains its
warm pool before the repository lets it go).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from typing import Any

from ..repository.errors import RepositoryError, SnapshotNotFound
from ..repository.manifest import SnapshotManifest
from ..snapshot.checkpoints import Checkpoint
from ..snapshot.handover import PAUSE_MARK
from ..snapshot.pending import PENDING_MARK
from ..telemetry import Observe
from ..template.builds import BUILT_MARK, TagInfo, TemplateBuilds
from ..template.image import ImageError
from ..template.stages import StepBuilder
from ..template.steps import BuildRequest, BuildStart
from ..vmm import merge
from . import fanout
from .errors import Conflict, Forbidden, InvalidRequest, NotFound, SandboxError
from .housekeeping import Housekeeper
from .ids import catalog_name
from .interface import (
    BuildTicket,
    CreateRequest,
    FanOutRequest,
    FanOutResult,
    FileLink,
    ListQuery,
    NodeStatus,
    Route,
)
from .sandboxes import Sandbox
from .service import Orchestrator
from .states import api_state
from .store import SandboxRecord

log = logging.getLogger(__name__)

FORK_MARK = "aenv.fork-of"  # metadata of the hidden snapshot a fork's children start from
HIDDEN_MARKS = (FORK_MARK, PAUSE_MARK)  # internal snapshots: a fork's, a durable pause's


ERROR_KINDS: dict[int, type[SandboxError]] = {403: Forbidden, 404: NotFound, 409: Conflict}


@contextlib.contextmanager
def template_errors() -> Iterator[None]:
    """Template and image errors as the node service's kinds (by the status they carry)."""
    try:
        yield
    except ImageError as exc:
        raise ERROR_KINDS.get(exc.status, InvalidRequest)(str(exc)) from exc


def _started(record: SandboxRecord) -> datetime:
    return datetime.fromisoformat(record.started_at)


def matches(record: SandboxRecord, query: ListQuery) -> bool:
    """Whether a sandbox passes every filter of the query (E2B's list semantics)."""
    if query.states and api_state(record.state) not in query.states:
        return False
    if any(record.metadata.get(k) != v for k, v in query.metadata.items()):
        return False
    if query.template is not None:
        wanted = catalog_name(query.template)
        if wanted not in (record.template_id, record.alias):
            return False
    if query.started_after is not None and _started(record) < query.started_after:
        return False
    return query.started_before is None or _started(record) <= query.started_before


def _hidden(manifest: SnapshotManifest) -> bool:
    return any(mark in manifest.metadata for mark in HIDDEN_MARKS)


def _template_builds(orchestrator: Orchestrator, observe: Observe | None) -> TemplateBuilds:
    """The node's template builds: their records under its home, their VMs its engine's."""
    settings, engine = orchestrator.settings, orchestrator.engine
    steps = StepBuilder(engine.templates, engine.layers)
    return TemplateBuilds(
        settings.home_path / "templates", engine.repository, steps, engine.layers,
        max_concurrent=settings.template_builds, events=orchestrator.events, observe=observe,
    )  # fmt: skip


class LocalNode:
    """`NodeService` and `RouteService` for the sandboxes and catalog of this node process."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        housekeeper: Housekeeper,
        node_id: str,
        observe: Observe | None = None,
        builds: TemplateBuilds | None = None,
    ):
        """`builds`: the template builds it serves; by default this node's, on its engine."""
        self.orchestrator = orchestrator
        self.housekeeper = housekeeper
        self.node_id = node_id
        self._catalog = orchestrator.catalog
        self._table = orchestrator.table
        self.builds = builds or _template_builds(orchestrator, observe)
        self._uploads = self.builds.uploads  # the build files users send (`template_file`)

    def _sandbox(self, sandbox_id: str) -> Sandbox:
        return self.orchestrator.get(sandbox_id)

    # -- sandboxes -------------------------------------------------------------------------

    async def create(self, request: CreateRequest) -> SandboxRecord:
        with template_errors():
            built = self.builds.resolve(request.template)  # `name:tag` of a user-built template
        if built is not None:
            request = dataclasses.replace(request, template=built)
        return (await self.orchestrator.create(request)).record

    async def get(self, sandbox_id: str) -> SandboxRecord:
        return self._sandbox(sandbox_id).record

    async def list(self, query: ListQuery) -> list[SandboxRecord]:
        """Matching sandboxes by start time (newest first unless `order` is asc), then by id."""
        found = [s.record for s in self._table.held() if matches(s.record, query)]
        found.sort(key=lambda r: r.sandbox_id)
        found.sort(key=_started, reverse=query.order == "desc")
        return query.page(found)

    async def kill(self, sandbox_id: str) -> None:
        await self.orchestrator.kill(self._sandbox(sandbox_id))

    async def pause(self, sandbox_id: str, *, memory: bool = True) -> SandboxRecord:
        sandbox = self._sandbox(sandbox_id)
        await self.orchestrator.pause(sandbox, memory=memory)
        return sandbox.record

    async def connect(
        self, sandbox_id: str, timeout: int | None, *, memory: bool = True
    ) -> tuple[SandboxRecord, bool]:
        sandbox = self._sandbox(sandbox_id)
        resumed = await self.orchestrator.connect(sandbox, timeout, memory=memory)
        return sandbox.record, resumed

    async def resume(self, sandbox_id: str, timeout: int | None, *, memory: bool = True) -> SandboxRecord:
        sandbox = self._sandbox(sandbox_id)
        await self.orchestrator.resume(sandbox, timeout, memory=memory)
        return sandbox.record

    async def take_over(self, sandbox_id: str, timeout: int | None) -> SandboxRecord:
        return (await self.orchestrator.take_over(sandbox_id, timeout)).record

    async def discard_pause(self, sandbox_id: str) -> None:
        await self.orchestrator.discard_pause(sandbox_id)

    async def set_timeout(self, sandbox_id: str, timeout: int) -> None:
        await self.orchestrator.set_timeout(self._sandbox(sandbox_id), timeout)

    async def refresh(self, sandbox_id: str, duration: int | None) -> None:
        await self.orchestrator.refresh(self._sandbox(sandbox_id), duration)

    async def snapshot(self, sandbox_id: str, name: str | None, *, memory: bool = True) -> SnapshotManifest:
        return await self.orchestrator.snapshot(self._sandbox(sandbox_id), name, memory=memory)

    async def fork(self, sandbox_id: str, count: int, timeout: int | None) -> list[SandboxRecord]:
        children = await self.orchestrator.fork(self._sandbox(sandbox_id), count, timeout)
        return [child.record for child in children]

    async def update_network(
        self, sandbox_id: str, allow_internet: bool | None, network: dict[str, Any]
    ) -> None:
        await self.orchestrator.update_network(self._sandbox(sandbox_id), allow_internet, network)

    async def fan_out(self, request: FanOutRequest) -> list[FanOutResult]:
        return await fanout.fan_out(request, self.create, self.get)

    async def checkpoint(self, sandbox_id: str, name: str | None) -> Checkpoint:
        return await self.orchestrator.checkpoint(self._sandbox(sandbox_id), name)

    async def checkpoints(self, sandbox_id: str) -> list[Checkpoint]:
        return self.orchestrator.checkpoints(self._sandbox(sandbox_id))

    async def delete_checkpoint(self, sandbox_id: str, checkpoint: str) -> None:
        await self.orchestrator.delete_checkpoint(self._sandbox(sandbox_id), checkpoint)

    async def promote_checkpoint(
        self, sandbox_id: str, checkpoint: str, name: str | None
    ) -> SnapshotManifest:
        return await self.orchestrator.promote_checkpoint(self._sandbox(sandbox_id), checkpoint, name)

    async def reset(self, sandbox_id: str, checkpoint: str) -> SandboxRecord:
        sandbox = self._sandbox(sandbox_id)
        await self.orchestrator.reset(sandbox, checkpoint)
        return sandbox.record

    async def metrics(self, sandbox_id: str, start: int | None, end: int | None) -> list[dict[str, Any]]:
        return await self.orchestrator.metrics(self._sandbox(sandbox_id), start, end)

    async def latest_metrics(self, sandbox_ids: list[str]) -> dict[str, dict[str, Any]]:
        known = []
        for sandbox_id in dict.fromkeys(sandbox_ids):
            with contextlib.suppress(NotFound):
                known.append(self._sandbox(sandbox_id))
        return await self.orchestrator.latest_metrics(known)

    async def logs(self, sandbox_id: str, start: int, limit: int) -> tuple[int, list[str]]:
        """The guest's serial console (kernel, init and envd messages), oldest first."""
        sandbox = self._sandbox(sandbox_id)
        return await asyncio.to_thread(self.orchestrator.serial_lines, sandbox.id, start, limit)

    # -- catalog ---------------------------------------------------------------------------

    async def catalog(self, kind: str | None = None) -> list[SnapshotManifest]:
        committed, pending = self._catalog.listing(kind)
        committed = [m for m in committed if not _hidden(m)]
        known = {m.id for m in committed}
        pending = [m for m in pending if m.id not in known] if kind != "template" else []
        return [*reversed(pending), *committed]  # newest first: those being committed are newer

    async def find(self, reference: str, kind: str | None = None) -> SnapshotManifest:
        manifest = await self._catalog.find(reference)
        if manifest is None:
            failure = self._catalog.failure(reference)  # answered, then failed
            raise NotFound(failure or f"'{reference}' not found")
        if PAUSE_MARK in manifest.metadata:
            raise NotFound(f"'{reference}' not found")
        if kind is not None and manifest.kind != kind:
            raise NotFound(f"{kind} '{reference}' not found")
        return manifest

    async def delete_template(self, reference: str) -> None:
        """Delete a snapshot or a user-built template; one still used by sandboxes goes when the
        last one does.

        The node's own templates (`base`, built at its first start) are refused: creates and a
        warm pool rely on them. A user-built template's warm guests are ended first.
        """
        manifest = await self.find(reference)
        if BUILT_MARK in manifest.metadata and manifest.alias in self.builds.templates:
            await self._delete_built(manifest.alias)
            return
        if manifest.kind == "template" or self._catalog.warm(manifest.id)[0] > 0:
            name = manifest.alias or manifest.id
            raise Conflict(
                f"'{name}' is built into this node: creates and a warm pool use it, so it cannot be deleted"
            )
        try:
            await self._catalog.delete(manifest.id, pending=PENDING_MARK in manifest.metadata)
        except RepositoryError as exc:
            raise Conflict(str(exc)) from exc
        log.info("deleted %s %s (alias %s) at the API's request", manifest.kind, manifest.id, manifest.alias)

    async def _delete_built(self, name: str) -> None:
        if self.builds.building(name):
            raise Conflict(f"template '{name}' has a build in progress; delete it when the build ends")
        for snapshot_id in self.builds.forget(name):
            with contextlib.suppress(SnapshotNotFound):
                await self._catalog.delete(snapshot_id)
        log.info("deleted user-built template %s at the API's request", name)

    # -- template builds -------------------------------------------------------------------

    async def request_template_build(self, request: BuildRequest) -> BuildTicket:
        with template_errors():
            record, build, tags = self.builds.request(request)
        return BuildTicket(record.template_id, build.build_id, tags)

    async def template_file(self, template_id: str, files_hash: str) -> FileLink:
        with template_errors():
            self.builds.template(template_id)
            if self._uploads.present(files_hash):
                return FileLink(present=True)
            expires, signature = self._uploads.sign(template_id, files_hash)
        return FileLink(present=False, expires=expires, signature=signature)

    async def receive_template_file(
        self,
        template_id: str,
        files_hash: str,
        expires: str,
        signature: str,
        chunks: AsyncIterator[bytes],
        size: int | None,
    ) -> None:
        with template_errors():
            self._uploads.authorize(template_id, files_hash, expires, signature)
            await self._uploads.receive(files_hash, chunks, size)

    async def start_template_build(self, template_id: str, build_id: str, start: BuildStart) -> None:
        with template_errors():
            self.builds.start(template_id, build_id, start)

    async def template_build_status(
        self, template_id: str, build_id: str, offset: int, limit: int
    ) -> dict[str, Any]:
        with template_errors():
            return self.builds.status(template_id, build_id, offset, limit)

    async def assign_template_tags(self, target: str, tags: list[str]) -> tuple[str, list[str]]:
        with template_errors():
            return self.builds.assign_tags(target, tags)

    async def remove_template_tags(self, name: str, tags: list[str]) -> None:
        with template_errors():
            pruned = self.builds.remove_tags(name, tags)
        for snapshot_id in pruned:  # no tag names the build any more: no warm VMs for it
            await self._catalog.drain(snapshot_id)

    async def template_tags(self, reference: str) -> list[TagInfo]:
        with template_errors():
            return self.builds.tags(reference)

    # -- node ------------------------------------------------------------------------------

    async def status(self) -> NodeStatus:
        merged = 0
        if merge.enabled():
            merged = await asyncio.to_thread(merge.saved_bytes, self.orchestrator.vm_pids())
        return NodeStatus(
            node_id=self.node_id,
            records=[s.record for s in self._table.held()],
            create_successes=self.orchestrator.counters["create_successes"],
            create_failures=self.orchestrator.counters["create_failures"],
            lost=self.orchestrator.counters["lost"],
            parked=self.orchestrator.parked(),
            gc=self.housekeeper.totals,
            cache=self._catalog.cache_stats(),
            merged_bytes=merged,
        )

    async def route(self, sandbox_id: str, *, resume: bool) -> Route | None:
        sandbox = await self.orchestrator.running_vm(sandbox_id, resume=resume)
        if sandbox is None or sandbox.vm is None:
            return None
        return Route(record=sandbox.record, network=sandbox.vm.guest.network)
