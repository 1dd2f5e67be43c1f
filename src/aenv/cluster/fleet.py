"""`NodeFleet`: the cluster's live nodes as a gateway reaches them, under its cluster-wide services.

The gateway's `NodeService` (`aenv.cluster.clusternode.ClusterNode`) is made of parts that each
serve one of its protocols over the same nodes: the sandboxes (to the node that holds each), the
catalog and status (`aenv.cluster.catalog`, merged from every live node) and template builds
(`aenv.cluster.builds`, on the node a template's name picks). This is what they share: the
scheduler's live nodes, a client to each, a call on all of them at once, and the order a key
prefers them in.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import aiohttp

from ..orchestrator.errors import SandboxError
from .model import NodeInfo, NodeState
from .protocols import Scheduler
from .remote import RemoteNode

log = logging.getLogger(__name__)

T = TypeVar("T")
LIVE = (NodeState.UP, NodeState.DRAINING)  # nodes whose sandboxes can be reached
# Seconds a gateway reuses the scheduler's list of live nodes: every page of a list asks all of
# them, and the scheduler's answer cost as much as a node's page. A joining node is asked within
# this; a dead one is asked (and left out) until the scheduler has it down, 10 s by default, anyway.
LIVE_FOR = 1.0


def rendezvous(key: str, nodes: Iterable[NodeInfo]) -> list[NodeInfo]:
    """`nodes` in the order `key` prefers them: the same everywhere, whichever gateway asks, and
    mostly unchanged when a node comes or goes (highest random weight hashing)."""
    return sorted(nodes, key=lambda n: hashlib.sha256(f"{n.node_id}/{key}".encode()).digest(), reverse=True)


class NodeFleet:
    """The scheduler's nodes, reached with `client` (`remote.cluster_client`)."""

    def __init__(self, scheduler: Scheduler, client: aiohttp.ClientSession):
        self.scheduler = scheduler
        self.client = client
        self._live: tuple[float, list[NodeInfo]] | None = None  # when asked, and the answer

    def remote(self, info: NodeInfo) -> RemoteNode:
        return RemoteNode(info.node_id, info.address, self.client)

    async def live_nodes(self) -> list[NodeInfo]:
        """The nodes whose sandboxes can be reached, as the scheduler had them at most `LIVE_FOR` ago."""
        asked = time.monotonic()
        if self._live is not None and asked - self._live[0] < LIVE_FOR:
            return self._live[1]
        live = [n for n in await self.scheduler.nodes() if n.status in LIVE]
        self._live = (asked, live)
        return live

    async def _each_node(
        self, call: Callable[[RemoteNode], Awaitable[T]], nodes: Iterable[NodeInfo] | None = None
    ) -> list[tuple[NodeInfo, T]]:
        """`call` on every live node (or on `nodes`) at once; a node that fails is left out (and
        logged): the others' answers are still the truth about their sandboxes."""
        nodes = list(await self.live_nodes() if nodes is None else nodes)
        answers = await asyncio.gather(*(call(self.remote(n)) for n in nodes), return_exceptions=True)
        results = []
        for info, answer in zip(nodes, answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, SandboxError):
                    raise answer
                log.warning("node %s left out: %s", info.node_id, answer.message)
                continue
            results.append((info, answer))
        return results
