"""The catalog and status of a cluster: what its live nodes answer, merged (`CatalogService`,
`StatusService` of the gateway's `ClusterNode`)."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import fields
from typing import Any, TypeVar

from ..orchestrator.errors import NotFound
from ..orchestrator.housekeeping import GcTotals
from ..orchestrator.interface import NodeStatus
from ..repository.manifest import SnapshotManifest
from .fleet import NodeFleet

T = TypeVar("T")
CLUSTER_ID = "cluster"  # the node id `status` reports for the whole cluster


class ClusterCatalog(NodeFleet):
    """Templates and snapshots of every live node, once each, and the nodes' status added up."""

    async def catalog(self, kind: str | None = None) -> list[SnapshotManifest]:
        """What any live node has, once each, newest first then by id (as a node lists them)."""
        unique: dict[str, SnapshotManifest] = {}
        for _, manifests in await self._each_node(lambda n: n.catalog(kind)):
            for manifest in manifests:
                unique.setdefault(manifest.id, manifest)
        merged = sorted(unique.values(), key=lambda m: m.id)
        merged.sort(key=lambda m: m.created_at, reverse=True)
        return merged

    async def find(self, reference: str, kind: str | None = None) -> SnapshotManifest:
        for _, manifest in await self._each_node(lambda n: _found(n.find(reference, kind))):
            if manifest is not None:
                return manifest
        raise NotFound(f"{kind or 'template'} '{reference}' not found")

    async def delete_template(self, reference: str) -> None:
        """Deleted on every node that has it; NotFound only if none has."""
        deleted = await self._each_node(lambda n: _found(n.delete_template(reference), True))
        if not any(done for _, done in deleted):
            raise NotFound(f"'{reference}' not found")

    async def status(self) -> NodeStatus:
        """The live nodes' status added up (the cluster's `/metrics`)."""
        statuses = [status for _, status in await self._each_node(lambda n: n.status())]
        gc = GcTotals()
        for status in statuses:
            for field in fields(GcTotals):
                combine = max if field.name == "last_run_seconds" else sum
                setattr(gc, field.name, combine((getattr(gc, field.name), getattr(status.gc, field.name))))
        return NodeStatus(
            node_id=CLUSTER_ID,
            records=[record for status in statuses for record in status.records],
            create_successes=sum(s.create_successes for s in statuses),
            create_failures=sum(s.create_failures for s in statuses),
            lost=sum(s.lost for s in statuses),
            parked=sum(s.parked for s in statuses),
            gc=gc,
            merged_bytes=sum(s.merged_bytes for s in statuses),
        )


async def _found(call: Awaitable[T], done: Any = None) -> T | Any | None:
    """`call`'s answer (or `done` for a call that answers nothing); None when it is NotFound."""
    try:
        answer = await call
    except NotFound:
        return None
    return done if done is not None else answer
