"""Template builds through a gateway (`BuildService` of its `ClusterNode`).

A build runs on one node, chosen by its template name (the same node whichever gateway is asked,
without state of its own); a template's later calls try nodes in that same order, moving on only
when a node does not know the template.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from ..orchestrator.errors import NotFound, Unavailable
from ..orchestrator.interface import BuildTicket, FileLink
from ..template.builds import TagInfo
from ..template.steps import BuildRequest, BuildStart, split_name
from .fleet import NodeFleet, rendezvous
from .model import NodeState
from .remote import RemoteNode

T = TypeVar("T")


class ClusterBuilds(NodeFleet):
    """The template build API, each template's calls on the node its name prefers."""

    async def _by_template(self, name: str, call: Callable[[RemoteNode], Awaitable[T]]) -> T:
        nodes = rendezvous(name, await self.live_nodes())
        missing: NotFound | None = None
        for info in nodes:
            try:
                return await call(self.remote(info))
            except NotFound as exc:
                missing = exc
        raise missing or Unavailable("no node is up")

    async def _build_node(self, name: str) -> RemoteNode:
        nodes = [n for n in await self.live_nodes() if n.status == NodeState.UP]
        if not nodes:
            raise Unavailable("no node is up to build on")
        return self.remote(rendezvous(name, nodes)[0])

    async def request_template_build(self, request: BuildRequest) -> BuildTicket:
        name, _ = split_name(request.name)
        return await (await self._build_node(name)).request_template_build(request)

    async def template_file(self, template_id: str, files_hash: str) -> FileLink:
        return await self._by_template(template_id, lambda n: n.template_file(template_id, files_hash))

    async def receive_template_file(
        self,
        template_id: str,
        files_hash: str,
        expires: str,
        signature: str,
        chunks: AsyncIterator[bytes],
        size: int | None,
    ) -> None:
        """To the node that handed out the upload URL (a stream is sent once, not tried around)."""
        node = await self._build_node(template_id)
        await node.receive_template_file(template_id, files_hash, expires, signature, chunks, size)

    async def start_template_build(self, template_id: str, build_id: str, start: BuildStart) -> None:
        await self._by_template(template_id, lambda n: n.start_template_build(template_id, build_id, start))

    async def template_build_status(
        self, template_id: str, build_id: str, offset: int, limit: int
    ) -> dict[str, Any]:
        return await self._by_template(
            template_id, lambda n: n.template_build_status(template_id, build_id, offset, limit)
        )

    async def assign_template_tags(self, target: str, tags: list[str]) -> tuple[str, list[str]]:
        name, _ = split_name(target)
        return await self._by_template(name, lambda n: n.assign_template_tags(target, tags))

    async def remove_template_tags(self, name: str, tags: list[str]) -> None:
        template, _ = split_name(name)
        await self._by_template(template, lambda n: n.remove_template_tags(name, tags))

    async def template_tags(self, reference: str) -> list[TagInfo]:
        name, _ = split_name(reference)
        return await self._by_template(name, lambda n: n.template_tags(reference))
