"""`ClusterNode`: the `NodeService` a gateway serves, made of the cluster's nodes.

The HTTP layer (`aenv.api.server.NodeAPI`) does not know it talks to a cluster. A create asks
the scheduler for a node, which records the binding of the sandbox the create names, and creates
there; when the node cannot take it (full, unreachable, or without the template) the next node
is asked, the failed ones excluded.
Every sandbox-scoped call goes to the node the sandbox is bound to; a fork stays on its
source's node and binds its children there. Lists and the template/snapshot catalog merge what
the live nodes answer, in the order a single node gives, so the API's paging (`nextToken` is a
start time and an id, not a position) runs across nodes and across gateways unchanged.

Nothing is kept here between calls: the bindings are the scheduler's (in Redis), the records the
nodes'. So any number of gateways can run, and losing one loses nothing.

A sandbox whose node is down is reported, not guessed at: a running one as lost (404, as a node
reports a lost VM). A paused one whose pause is durable (committed to the shared repository) is
resumed by another node with room, which takes it over (`NodeService.take_over`); one that the
repository no longer has, or that its own node claimed back, was resumed or ended there after
the node's last report, and is lost as a running one; a node-local pause is unavailable until
its node is back. Either can be killed all the same: its binding gives way to a tombstone
(`Scheduler.tombstone`), so it is gone for the cluster at once, can no longer be taken over,
and its node kills it when it is back. A durable pause killed so is also deleted from the
shared repository by a live node (`NodeService.discard_pause`), since its node may never come
back to delete it; if no node can, the kill stands all the same.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeVar

from ..orchestrator import fanout
from ..orchestrator.errors import NOT_SHARED, PAUSE_GONE, Conflict, NotFound, SandboxError, Unavailable
from ..orchestrator.ids import new_sandbox_id
from ..orchestrator.interface import CreateRequest, FanOutRequest, FanOutResult, ListQuery
from ..orchestrator.store import SandboxRecord
from ..repository.manifest import SnapshotManifest
from ..snapshot.checkpoints import Checkpoint
from .builds import ClusterBuilds
from .catalog import ClusterCatalog
from .fleet import rendezvous
from .model import Binding, NodeInfo, NodeState, Placement
from .protocols import SandboxKilled
from .remote import RemoteNode

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_PLACEMENTS = 8  # nodes one create tries at most before it gives up
SHARE_MARGIN = 1.5  # a paged list first asks each of n nodes for this many times 1/n of the page
# Seconds a kill on a down node waits for a live node to discard its durable pause (a few requests
# to the repository): a node that accepts the call and hangs must not hold the kill's answer.
DISCARD_TIMEOUT = 30.0
# Creates a fan-out through a gateway has under way at once, over all nodes (each node bounds its own).
FAN_OUT_CONCURRENCY = 64


def _started(record: SandboxRecord) -> datetime:
    return datetime.fromisoformat(record.started_at)


def _ordered(query: ListQuery, records: list[SandboxRecord]) -> list[SandboxRecord]:
    """`records` of several nodes in a single node's order (start time, then id), paged by `query`."""
    records.sort(key=lambda r: r.sandbox_id)
    records.sort(key=_started, reverse=query.order == "desc")
    return query.page(records)


def _rest(
    query: ListQuery, limit: int, page: list[SandboxRecord], lasts: dict[str, SandboxRecord]
) -> dict[str, ListQuery]:
    """What to ask of nodes that may hold more (`lasts`: the last record each sent) for `page` to be
    certain: a node whose last record is in it before its end, for the records after that one
    that could still fall in it."""
    position = {id(record): i for i, record in enumerate(page)}
    rest = {}
    for node_id, last in lasts.items():
        if (at := position.get(id(last), limit)) < limit - 1:
            rest[node_id] = replace(query, after=(last.started_at, last.sandbox_id), limit=limit - at - 1)
    return rest


class ClusterNode(ClusterCatalog, ClusterBuilds):
    """`NodeService` over the scheduler's nodes; `client` reaches them (`remote.cluster_client`).

    The sandbox-scoped services are here (each call on the node that holds the sandbox); the
    catalog and status, and template builds, are the cluster-wide parts it is made of, over the
    same fleet of nodes (`aenv.cluster.fleet`).
    """

    # The nodes a create must not go to, by its request (a gateway's: `aenv.cluster.volumes`).
    excluded: Callable[[CreateRequest], Awaitable[list[str]]] | None = None

    # -- sandbox to node ----------------------------------------------------------------------

    async def locate(self, sandbox_id: str) -> tuple[Binding, NodeInfo]:
        """The sandbox's binding and its node, which is reachable; else why it cannot be had."""
        binding, info, unreachable = await self._where(sandbox_id)
        if unreachable is not None:
            raise unreachable
        return binding, info

    async def _where(self, sandbox_id: str) -> tuple[Binding, NodeInfo, SandboxError | None]:
        """The sandbox's binding, its node, and why that node cannot be had (None: it can).

        A node the scheduler has down (no heartbeat for a while) is asked all the same: it may
        only have been unable to reach the scheduler (one that restarted, say), and while it
        answers its sandboxes are neither lost nor to be taken over.
        """
        try:
            binding, info = await self.scheduler.locate(sandbox_id)
        except NotFound:
            raise NotFound(f"sandbox {sandbox_id} not found") from None
        if info.status != NodeState.DOWN or await self.remote(info).answers():
            return binding, info, None
        if binding.state == "running":
            why: SandboxError = NotFound(f"sandbox {sandbox_id} was lost: its node {info.node_id} is down")
        else:
            why = Unavailable(
                f"sandbox {sandbox_id} is paused on node {info.node_id}, which is down: it can be "
                "resumed when the node is back"
                + ("" if binding.durable else " (its pause is not in a shared repository)")
            )
        return binding, info, why

    async def _on_holder(
        self,
        sandbox_id: str,
        call: Callable[[RemoteNode, Binding], Awaitable[T]],
        away: Callable[[Binding, NodeInfo], Awaitable[T]] | None = None,
    ) -> T:
        """`call` on the sandbox's node; a node that no longer knows the sandbox (its timeout
        ended it, say) has its binding dropped, so no binding outlives its sandbox. A node that
        cannot be had is `away`'s to answer for, if given; else why it cannot be had."""
        binding, info, unreachable = await self._where(sandbox_id)
        if unreachable is not None:
            if away is None:
                raise unreachable
            return await away(binding, info)
        try:
            return await call(self.remote(info), binding)
        except NotFound:
            if await self._gone(sandbox_id, info):
                await self.scheduler.unbind(sandbox_id, info.node_id)
            raise

    async def _gone(self, sandbox_id: str, info: NodeInfo) -> bool:
        try:
            await self.remote(info).get(sandbox_id)
        except NotFound:
            return True
        return False

    async def _bind(self, record: SandboxRecord, node_id: str) -> None:
        """What an operation on the node made of the sandbox, as the node answered it (an observed
        bind, `Scheduler.bind`): with its generation, so that neither this bind nor the node's
        own report of the same sandbox undoes a later one."""
        await self.scheduler.bind(Binding.of(record, node_id), observed=True)

    # -- sandboxes ---------------------------------------------------------------------------

    async def create(self, request: CreateRequest) -> SandboxRecord:
        """On the scheduler's choice; on a node that is full, unreachable or lacks the template,
        again on the next choice. The last refusal is the answer when no node is left.

        Each attempt names its sandbox (a new id), so the placement records the binding with the
        reservation and the create costs one scheduler call; an attempt that fails unbinds it,
        which frees the reservation too. A new id per attempt: a node that failed to answer may
        have created its sandbox."""
        refused = [] if self.excluded is None else await self.excluded(request)
        failure: SandboxError | None = None
        # An id the caller chose (a fan-out's) is tried once: a node that failed to answer may
        # have made it, and the caller's retry finds it there by that id.
        for _ in range(MAX_PLACEMENTS if request.sandbox_id is None else 1):
            attempt = replace(request, sandbox_id=request.sandbox_id or new_sandbox_id())
            placement = Placement(template=request.template, sandbox_id=attempt.sandbox_id, exclude=refused)
            try:
                info = await self.scheduler.place(placement)
            except Unavailable:
                if failure is None:
                    raise
                raise failure from None
            try:
                record = await self.remote(info).create(attempt)
            except (Unavailable, NotFound) as exc:
                log.info("node %s did not create from %s: %s", info.node_id, request.template, exc.message)
                refused.append(info.node_id)
                failure = exc
                await self._release(placement, info)
            except BaseException:
                await asyncio.shield(self._release(placement, info))
                raise
            else:
                if record.sandbox_id != attempt.sandbox_id:  # a node of a version that names its own
                    await self._release(placement, info)
                    await self._bind(record, info.node_id)
                return record
        assert failure is not None
        raise failure

    async def _release(self, placement: Placement, info: NodeInfo) -> None:
        """Free a failed create's binding and room; if the scheduler cannot be told, its
        reservation expires and the node's reconciliation drops the binding."""
        assert placement.sandbox_id is not None
        try:
            await self.scheduler.unbind(placement.sandbox_id, info.node_id)
        except SandboxError as exc:
            log.warning("releasing the placement of %s on %s failed: %s", placement.sandbox_id, info.node_id,
                        exc.message)  # fmt: skip

    async def get(self, sandbox_id: str) -> SandboxRecord:
        return await self._on_holder(sandbox_id, lambda node, _: node.get(sandbox_id))

    async def node_of(self, sandbox_id: str) -> str:
        """The id of the node that holds the sandbox (as `GET /sandboxes/{id}` reports it)."""
        return (await self.locate(sandbox_id))[1].node_id

    async def list(self, query: ListQuery) -> list[SandboxRecord]:
        return [record for record, _ in await self.list_placed(query)]

    async def list_placed(self, query: ListQuery) -> list[tuple[SandboxRecord, str]]:
        """Every live node's matches, in a single node's order: start time, then id; each with
        the id of the node that holds it.

        A paged query's page is the nodes' pages merged, cut to the page again. Each node is first
        asked for its even share of the page with a margin (`SHARE_MARGIN`), not a whole page:
        decoding what the nodes send is most of what a page through a gateway costs. A node that
        may hold more, and whose last record is inside the merged page before its end, is then
        asked for the rest after that record, until the page is certain.
        """
        nodes = {n.node_id: n for n in await self.live_nodes()}
        limit = query.limit
        share = limit and min(limit, math.ceil(limit * SHARE_MARGIN / max(len(nodes), 1)))
        asks = {node_id: replace(query, limit=share) for node_id in nodes}
        found: dict[str, list[SandboxRecord]] = {}
        more: set[str] = set()  # nodes that sent all they were asked for, so may hold more
        while True:
            answers = await self._each_node(lambda n: n.list(asks[n.node_id]), [nodes[i] for i in asks])
            for node_id in asks.keys() - {info.node_id for info, _ in answers}:
                found.pop(node_id, None)  # a node that failed is left out, also what it sent before
                more.discard(node_id)
            for info, records in answers:
                ask = asks[info.node_id]
                records = ask.page(records)  # as the node should have (it may ignore paging)
                found.setdefault(info.node_id, []).extend(records)
                if records and len(records) == ask.limit:
                    more.add(info.node_id)
                else:
                    more.discard(info.node_id)
            page = _ordered(query, [r for records in found.values() for r in records])
            if limit is None or not (asks := _rest(query, limit, page, {i: found[i][-1] for i in more})):
                holder = {id(r): node_id for node_id, records in found.items() for r in records}
                return [(record, holder[id(record)]) for record in page]

    async def kill(self, sandbox_id: str) -> None:
        """On its node; while that node is down and does not answer, in the cluster's records
        (`Scheduler.tombstone`), and the node kills it when it is back, while a live node
        discards its durable pause, if it had one, from the shared repository now."""

        async def bury(binding: Binding, info: NodeInfo) -> None:
            try:
                binding = await self.scheduler.tombstone(sandbox_id, info.node_id)
            except NotFound:
                raise NotFound(f"sandbox {sandbox_id} not found") from None
            except Conflict:  # taken over meanwhile: killed where it went
                await self._on_holder(sandbox_id, self._kill)
                return
            log.info("sandbox %s killed while its node %s is down: the node kills it when back",
                     sandbox_id, info.node_id)  # fmt: skip
            if binding.state == "paused" and binding.durable:
                await self._discard_killed(sandbox_id)

        await self._on_holder(sandbox_id, self._kill, away=bury)

    async def _discard_killed(self, sandbox_id: str) -> None:
        """Best effort, after a kill on a down node: its durable pause is deleted from the shared
        repository now, as that node may never come back to. A pause that stays is no harm to
        the kill: the tombstone is the truth, and the node's own kill removes it when back."""
        try:
            async with asyncio.timeout(DISCARD_TIMEOUT):
                node_id = await self._discard(sandbox_id)
        except TimeoutError:
            why = f"no node discarded it within {DISCARD_TIMEOUT:.0f} s"
        except SandboxError as exc:
            why = exc.message
        else:
            log.info("the pause of sandbox %s was discarded by node %s", sandbox_id, node_id)
            return
        log.warning("the pause of killed sandbox %s stays in the repository: %s", sandbox_id, why)

    async def discard_pause(self, sandbox_id: str) -> None:
        """Of a sandbox that is no longer bound (killed while its node was down): by a live node
        (`_discard`). A bound sandbox is killed instead, which ends its pause on its own node."""
        try:
            _, info = await self.scheduler.locate(sandbox_id)
        except NotFound:
            await self._discard(sandbox_id)
            return
        raise Conflict(f"sandbox {sandbox_id} is on node {info.node_id}: kill it instead")

    async def _discard(self, sandbox_id: str) -> str:
        """`NodeService.discard_pause` on the live nodes in the sandbox's order of them, passing
        over those that cannot help: unreachable (or unavailable), or without a shared repository
        (`NOT_SHARED`). Returns the node that discarded it; the node's refusal of any other kind
        (no such pause, claimed by another node) is the answer."""
        passed: list[str] = []
        for info in rendezvous(sandbox_id, await self.live_nodes()):
            try:
                await self.remote(info).discard_pause(sandbox_id)
            except SandboxError as exc:
                if not isinstance(exc, Unavailable) and exc.error_code != NOT_SHARED:
                    raise
                passed.append(f"node {info.node_id}: {exc.message}")
                continue
            return info.node_id
        why = "; ".join(passed) or "no node is up"
        raise Unavailable(f"no live node can discard the pause of sandbox {sandbox_id} ({why})")

    async def _kill(self, node: RemoteNode, binding: Binding) -> None:
        await node.kill(binding.sandbox_id)
        await self._after(binding.sandbox_id, self.scheduler.unbind(binding.sandbox_id, node.node_id))

    async def pause(self, sandbox_id: str, *, memory: bool = True) -> SandboxRecord:
        async def pause(node: RemoteNode, binding: Binding) -> SandboxRecord:
            record = await node.pause(sandbox_id, memory=memory)
            await self._after(sandbox_id, self._bind(record, node.node_id))
            return record

        return await self._on_holder(sandbox_id, pause)

    async def connect(
        self, sandbox_id: str, timeout: int | None, *, memory: bool = True
    ) -> tuple[SandboxRecord, bool]:

        async def connect(node: RemoteNode, binding: Binding) -> tuple[SandboxRecord, bool]:
            record, resumed = await node.connect(sandbox_id, timeout, memory=memory)
            await self._rebind(binding, record)
            return record, resumed

        try:
            return await self._on_holder(sandbox_id, connect)
        except Unavailable:
            if not memory or (moved := await self._elsewhere(sandbox_id, timeout)) is None:
                raise
            return moved, True

    async def resume(self, sandbox_id: str, timeout: int | None, *, memory: bool = True) -> SandboxRecord:
        async def resume(node: RemoteNode, binding: Binding) -> SandboxRecord:
            record = await node.resume(sandbox_id, timeout, memory=memory)
            await self._rebind(binding, record)
            return record

        try:
            return await self._on_holder(sandbox_id, resume)
        except Unavailable:
            if not memory or (moved := await self._elsewhere(sandbox_id, timeout)) is None:
                raise
            return moved

    async def take_over(self, sandbox_id: str, timeout: int | None) -> SandboxRecord:
        """Resume a durably paused sandbox on another node than the one holding it."""
        try:
            binding, _ = await self.scheduler.locate(sandbox_id)
        except NotFound:
            raise NotFound(f"sandbox {sandbox_id} not found") from None
        return await self._take_over(binding, timeout)

    async def _elsewhere(self, sandbox_id: str, timeout: int | None) -> SandboxRecord | None:
        """When the holder was unavailable: a durable pause whose node is down, resumed on another
        node; None for any other case (the holder's refusal is then the answer). Looked up only
        on that path, so a resume on a live node costs one lookup, as any other call."""
        try:
            binding, info = await self.scheduler.locate(sandbox_id)
        except NotFound:
            return None
        if info.status != NodeState.DOWN or binding.state != "paused" or not binding.durable:
            return None
        try:
            return await self._take_over(binding, timeout)
        except NotFound as exc:
            if exc.error_code != PAUSE_GONE:
                raise
            # The node resumed or ended the sandbox after its last report, then went down.
            raise NotFound(
                f"sandbox {sandbox_id} was lost: its node {info.node_id} is down (it had resumed or "
                "ended the sandbox after its last report)"
            ) from None

    async def _take_over(self, binding: Binding, timeout: int | None) -> SandboxRecord:
        """On the scheduler's choice of node (not the holder), which claims the pause in the
        repository; a refused claim (409: taken by another) is the answer. A node's refusal
        frees the room the placement reserved there; an unreachable node's room expires."""
        placement = Placement(
            kind="resume", sandbox_id=binding.sandbox_id, template=binding.template_id,
            exclude=[binding.node_id],
        )  # fmt: skip
        info = await self.scheduler.place(placement)
        try:
            record = await self.remote(info).take_over(binding.sandbox_id, timeout)
        except SandboxError as exc:
            if not isinstance(exc, Unavailable):  # refused, so nothing runs there: free its room
                await self._after(binding.sandbox_id, self.scheduler.release(placement, info.node_id))
            raise
        try:
            await self._after(record.sandbox_id, self._bind(record, info.node_id))
        except SandboxKilled:  # killed while the take-over ran: its new node's report kills it
            raise NotFound(f"sandbox {binding.sandbox_id} not found") from None
        return record

    async def _rebind(self, binding: Binding, record: SandboxRecord) -> None:
        """After a connect or resume on the sandbox's node: bound as running, if it was not."""
        if binding.state != "running":
            await self._after(record.sandbox_id, self._bind(record, binding.node_id))

    async def _after(self, sandbox_id: str, change: Awaitable[object]) -> None:
        """A binding change that follows what a node did. The node's membership reports the same
        change itself, so a scheduler that cannot take it now (restarting) must not turn the
        done operation into a failure: the client would retry a kill or pause that was done."""
        try:
            await change
        except Unavailable as exc:
            log.warning("the scheduler learns of sandbox %s from its node: %s", sandbox_id, exc.message)

    async def set_timeout(self, sandbox_id: str, timeout: int) -> None:
        await self._on_holder(sandbox_id, lambda node, _: node.set_timeout(sandbox_id, timeout))

    async def refresh(self, sandbox_id: str, duration: int | None) -> None:
        await self._on_holder(sandbox_id, lambda node, _: node.refresh(sandbox_id, duration))

    async def snapshot(self, sandbox_id: str, name: str | None, *, memory: bool = True) -> SnapshotManifest:
        return await self._on_holder(
            sandbox_id, lambda node, _: node.snapshot(sandbox_id, name, memory=memory)
        )

    async def fork(self, sandbox_id: str, count: int, timeout: int | None) -> list[SandboxRecord]:
        """On the source's node, which holds its state; the children are bound there too."""

        async def fork(node: RemoteNode, binding: Binding) -> list[SandboxRecord]:
            children = await node.fork(sandbox_id, count, timeout)
            await asyncio.gather(*(self._after(c.sandbox_id, self._bind(c, node.node_id)) for c in children))
            return children

        return await self._on_holder(sandbox_id, fork)

    async def fan_out(self, request: FanOutRequest) -> list[FanOutResult]:
        """Each sandbox placed by the scheduler as a create is (nodes that hold the template
        first, then by room; each placement reserves room, so they spread), many at once."""
        return await fanout.fan_out(request, self.create, self.get, FAN_OUT_CONCURRENCY)

    async def checkpoint(self, sandbox_id: str, name: str | None) -> Checkpoint:
        return await self._on_holder(sandbox_id, lambda node, _: node.checkpoint(sandbox_id, name))

    async def checkpoints(self, sandbox_id: str) -> list[Checkpoint]:
        return await self._on_holder(sandbox_id, lambda node, _: node.checkpoints(sandbox_id))

    async def delete_checkpoint(self, sandbox_id: str, checkpoint: str) -> None:
        await self._on_holder(sandbox_id, lambda node, _: node.delete_checkpoint(sandbox_id, checkpoint))

    async def promote_checkpoint(
        self, sandbox_id: str, checkpoint: str, name: str | None
    ) -> SnapshotManifest:
        return await self._on_holder(
            sandbox_id, lambda node, _: node.promote_checkpoint(sandbox_id, checkpoint, name)
        )

    async def reset(self, sandbox_id: str, checkpoint: str) -> SandboxRecord:
        return await self._on_holder(sandbox_id, lambda node, _: node.reset(sandbox_id, checkpoint))

    async def update_network(
        self, sandbox_id: str, allow_internet: bool | None, network: dict[str, Any]
    ) -> None:
        await self._on_holder(
            sandbox_id, lambda node, _: node.update_network(sandbox_id, allow_internet, network)
        )

    async def metrics(self, sandbox_id: str, start: int | None, end: int | None) -> list[dict[str, Any]]:
        return await self._on_holder(sandbox_id, lambda node, _: node.metrics(sandbox_id, start, end))

    async def latest_metrics(self, sandbox_ids: list[str]) -> dict[str, dict[str, Any]]:
        """Asked of each node for its own sandboxes; unknown and unreachable ones are left out."""
        located = await asyncio.gather(*(self.locate(i) for i in sandbox_ids), return_exceptions=True)
        by_node: dict[str, tuple[NodeInfo, list[str]]] = {}
        for sandbox_id, place in zip(sandbox_ids, located, strict=True):
            if isinstance(place, SandboxError):
                continue
            if isinstance(place, BaseException):
                raise place
            by_node.setdefault(place[1].node_id, (place[1], []))[1].append(sandbox_id)
        answers = await asyncio.gather(
            *(self.remote(info).latest_metrics(ids) for info, ids in by_node.values()), return_exceptions=True
        )
        merged: dict[str, dict[str, Any]] = {}
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, SandboxError):
                raise answer
            if isinstance(answer, dict):
                merged |= answer
        return merged

    async def logs(self, sandbox_id: str, start: int, limit: int) -> tuple[int, list[str]]:
        return await self._on_holder(sandbox_id, lambda node, _: node.logs(sandbox_id, start, limit))
