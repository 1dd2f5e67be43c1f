"""A node's membership in a cluster: it registers with the scheduler, heartbeats, and keeps the
scheduler's bindings of its sandboxes true.

`aenv server` runs a `Membership` when `AENV_SCHEDULER_URL` is set. At start the node registers
(address, version, capacity); every `heartbeat_interval` it reports its usage and the templates
and snapshots it caches, and learns its status (draining) from the answer. Each sandbox it holds
is bound with its state (running or paused) and each one it no longer holds is unbound: at once
when the orchestrator reports a change (`SandboxChanged` wakes the loop), and in full
every `RECONCILE_EVERY` heartbeats, when the node compares its sandboxes with the scheduler's
bindings of it, so an event missed while the scheduler was unreachable heals.

A scheduler that answers NotFound has forgotten the node (it lost Redis, or dropped the node):
the node registers again and rebinds everything. A scheduler that cannot be reached changes
nothing on the node: it keeps serving its sandboxes and retries every heartbeat interval, and
compares everything again once the scheduler answers.

A sandbox killed through a gateway while this node was down (or cut off) has a tombstone instead
of a binding (`aenv.cluster.state`): its bind is refused (`SandboxKilled`), and the node kills
it then, as a client's kill would (its VM, network, files and repository claims go), in the
background so that the heartbeats go on. It is never bound again. A durable pause of it was
usually deleted from the shared repository meanwhile, by the node the killing gateway asked
(`NodeService.discard_pause`): the kill then finds nothing there to delete, or, while that
node's claim on it stands, finds the sandbox moved, and only this node's files of it go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Protocol

from .. import __version__
from ..config import Settings
from ..events import EventBus, SandboxChanged
from ..orchestrator.admission import Admission, free_disk_mib
from ..orchestrator.errors import Conflict, NotFound, SandboxError
from ..orchestrator.sandboxes import SandboxTable
from ..orchestrator.service import Orchestrator
from ..orchestrator.states import State
from ..repository.contract import Repository
from ..tasks import cancel
from .client import SchedulerClient
from .model import Binding, NodeCapacity, NodeInfo, NodeState, NodeUsage
from .protocols import SandboxKilled, Scheduler

log = logging.getLogger(__name__)

RECONCILE_EVERY = 10  # heartbeats between full comparisons of the node's sandboxes and bindings
CLOSE_TIMEOUT = 5.0  # seconds the last report at shutdown may take
# States whose sandbox is not bound: it does not exist yet, or no longer does.
UNBOUND = (State.CREATING, State.KILLING)


@dataclass(frozen=True)
class NodeReport:
    """What the node holds now: its load, its room and where each of its sandboxes stands."""

    usage: NodeUsage
    capacity: NodeCapacity
    bindings: dict[str, Binding]


class NodeSource(Protocol):
    def report(self) -> NodeReport:
        """The node's current figures; cheap (in memory, one statvfs)."""
        ...

    def cached(self) -> list[str]:
        """Ids and aliases of the templates and snapshots materialized on the node (may do I/O)."""
        ...

    async def forget_moved(self) -> None:
        """Drop the paused sandboxes that other nodes took over meanwhile (may do I/O)."""
        ...

    async def kill(self, sandbox_id: str) -> None:
        """Kill a sandbox the cluster killed while the node was away (as a client's kill would)."""
        ...


class OrchestratorSource:
    """`NodeSource` of this node process: its sandboxes (`table`), their room (`admission`), its
    repository, and the orchestrator for the operations it asks for."""

    def __init__(
        self,
        settings: Settings,
        orchestrator: Orchestrator,
        table: SandboxTable,
        admission: Admission,
        repository: Repository,
        node_id: str,
    ):
        self.settings = settings
        self.orchestrator = orchestrator
        self.table = table
        self.admission = admission
        self.repository = repository
        self.node_id = node_id

    def report(self) -> NodeReport:
        sandboxes = self.table.held()
        running = [s.record for s in sandboxes if s.vm is not None]
        admission = self.admission
        free = free_disk_mib(self.settings.home_path) - self.settings.disk_reserve_mib
        return NodeReport(
            usage=NodeUsage(
                running=len(running),
                paused=sum(s.record.state == State.PAUSED for s in sandboxes),
                memory_mib=admission.committed_mib(),
                vcpus=sum(r.cpu_count for r in running),
            ),
            capacity=NodeCapacity(
                memory_mib=admission.memory_budget_mib, vcpus=os.cpu_count() or 1, disk_free_mib=max(0, free)
            ),
            # A durable one is committed to a shared repository: any node can take it over
            # (NodeService.take_over).
            bindings={
                s.id: Binding.of(s.record, self.node_id) for s in sandboxes if s.record.state not in UNBOUND
            },
        )

    def cached(self) -> list[str]:
        """With a node-local repository, all of it; with a shared one, the snapshots this node
        holds leases on (their files are in its cache, pinned)."""
        repository = self.repository
        manifests = repository.list()
        if repository.shared:
            leased = repository.local_leases()
            manifests = [m for m in manifests if m.id in leased]
        return sorted({name for m in manifests for name in (m.id, m.alias) if name})

    async def forget_moved(self) -> None:
        try:
            await self.orchestrator.forget_moved()
        except Exception:  # the repository is away: the scheduler refuses those binds anyway
            log.warning("could not check for paused sandboxes taken over elsewhere", exc_info=True)

    async def kill(self, sandbox_id: str) -> None:
        if (sandbox := self.table.find(sandbox_id)) is None:
            return
        with contextlib.suppress(NotFound):  # gone meanwhile
            await self.orchestrator.kill(sandbox)


class Membership:
    """The node's side of the cluster: one task that registers, heartbeats and binds."""

    def __init__(
        self, scheduler: Scheduler, source: NodeSource, node_id: str, address: str, *, interval: float
    ):
        self.scheduler = scheduler
        self.source = source
        self.node_id = node_id
        self.address = address
        self.interval = interval
        self.status: NodeState | None = None  # as the scheduler last answered; None: not registered
        self._sent: dict[str, Binding] = {}  # what the scheduler holds for this node, as far as we know
        self._cached: list[str] = []
        self._beats = 0
        self._next_beat = 0.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self._closing = False
        self._compare = False  # compare everything at the next heartbeat (the scheduler was away)
        self._kills: dict[str, asyncio.Task[None]] = {}  # sandboxes killed while the node was away

    @classmethod
    def for_node(
        cls,
        settings: Settings,
        orchestrator: Orchestrator,
        repository: Repository,
        node_id: str,
        events: EventBus,
    ) -> Membership:
        """This node process's membership: the scheduler of the settings, the node's address; it
        reports at once when a sandbox changes (`SandboxChanged`)."""
        address = settings.node_addr or f"http://{settings.api_addr}"
        if not settings.node_addr and settings.host in ("0.0.0.0", "::", "[::]"):
            log.warning("the node advertises %s, which other hosts cannot reach: set AENV_NODE_ADDR", address)
        client = SchedulerClient(settings.scheduler_url, settings.cluster_secret)
        source = OrchestratorSource(
            settings, orchestrator, orchestrator.table, orchestrator.admission, repository, node_id
        )
        membership = cls(client, source, node_id, address, interval=settings.heartbeat_interval)
        events.subscribe(SandboxChanged, lambda changed: membership.changed(changed.sandbox_id))
        return membership

    def changed(self, sandbox_id: str) -> None:
        """A sandbox's state settled or it is gone: report it now."""
        self._wake.set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cluster-membership")

    async def close(self) -> None:
        """Stop, after one last report (the node's shutdown paused or killed its sandboxes).

        The loop also ends by itself once it sees `_closing`: on Python 3.11 a cancellation can
        be lost (its `asyncio.wait_for`, which redis-py uses to send a command, returns the
        result of an operation that ends as the cancellation arrives)."""
        self._closing = True
        self._wake.set()
        await cancel(self._task)
        for kill in list(self._kills.values()):
            kill.cancel()
        await asyncio.gather(*self._kills.values(), return_exceptions=True)
        if self.status is not None:
            with contextlib.suppress(SandboxError, TimeoutError):
                await asyncio.wait_for(self._push(), CLOSE_TIMEOUT)
        if isinstance(self.scheduler, SchedulerClient):
            await self.scheduler.close()

    async def _run(self) -> None:
        while not self._closing:
            try:
                await self.step()
                if self._failing:
                    log.info("the scheduler answers again")
                self._failing = False
            except NotFound as exc:
                log.warning("the scheduler does not know this node (%s): registering again", exc.message)
                self.status = None
                continue
            except SandboxError as exc:  # unreachable, or failing: keep serving, retry later
                if not self._failing:
                    log.warning("cluster membership: %s; retrying every %.1f s", exc.message, self.interval)
                await self._retry_later()
                continue
            except Exception:  # a bug must not end the node's membership silently: log it, go on
                log.exception("cluster membership failed; retrying every %.1f s", self.interval)
                await self._retry_later()
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, self._next_beat - time.monotonic())):
                    await self._wake.wait()

    async def _retry_later(self) -> None:
        self._failing = True
        self._next_beat = 0.0  # heartbeat as soon as the scheduler answers again
        self._compare = True  # and learn what changed meanwhile (sandboxes killed while away)
        await asyncio.sleep(self.interval)

    async def step(self) -> None:
        """One round: register if needed, report changed bindings, heartbeat when it is time."""
        if self.status is None:
            await self._register()
        self._wake.clear()
        await self._push()
        if time.monotonic() >= self._next_beat:
            await self._heartbeat()

    async def _register(self) -> None:
        self._cached = await asyncio.to_thread(self.source.cached)
        report = self.source.report()
        node = NodeInfo(node_id=self.node_id, address=self.address, version=__version__,
                        capacity=report.capacity, usage=report.usage, cached=self._cached)  # fmt: skip
        self.status = (await self.scheduler.register(node)).status
        log.info("joined the cluster as node %s (%s)", self.node_id, self.address)
        self._next_beat = time.monotonic() + self.interval
        await self._reconcile()

    async def _heartbeat(self) -> None:
        self._beats += 1
        if self._compare or self._beats % RECONCILE_EVERY == 0:
            self._compare = False
            self._cached = await asyncio.to_thread(self.source.cached)
            await self._reconcile()
        report = self.source.report()
        info = await self.scheduler.heartbeat(self.node_id, report.usage, report.capacity, self._cached)
        if info.status != self.status:
            log.info("the scheduler has this node %s", info.status.value)
        self.status = info.status
        self._next_beat = time.monotonic() + self.interval

    async def _reconcile(self) -> None:
        """Take the scheduler's bindings of this node as the truth to correct, then correct it.

        Paused sandboxes another node took over (while this one was down, or its process
        restarting) are dropped first: they are not this node's to bind any more, and one that
        has ended over there would come back as paused here.
        """
        await self.source.forget_moved()
        self._sent = {b.sandbox_id: b for b in await self.scheduler.bindings(self.node_id)}
        await self._push()

    async def _push(self) -> None:
        """Bind what changed since it was last sent, unbind what the node no longer holds."""
        held = self.source.report().bindings
        for sandbox_id, binding in held.items():
            if self._sent.get(sandbox_id) == binding:
                continue
            try:
                await self.scheduler.bind(binding)
            except SandboxKilled as exc:  # not sent: each push tries again until it is gone
                self._kill(sandbox_id, exc.message)
                continue
            except Conflict as exc:  # it runs on another node now: that node's word wins
                log.warning("not binding sandbox %s here: %s", sandbox_id, exc.message)
            self._sent[sandbox_id] = binding
        for sandbox_id in [s for s in self._sent if s not in held]:
            await self.scheduler.unbind(sandbox_id, self.node_id)
            del self._sent[sandbox_id]

    def _kill(self, sandbox_id: str, reason: str) -> None:
        """Kill the sandbox in the background, unless its kill runs already."""
        if sandbox_id in self._kills or self._closing:
            return
        log.info("killing sandbox %s: %s", sandbox_id, reason)
        task = asyncio.create_task(self._killed(sandbox_id), name=f"cluster-kill-{sandbox_id}")
        self._kills[sandbox_id] = task
        task.add_done_callback(lambda _: self._kills.pop(sandbox_id, None))

    async def _killed(self, sandbox_id: str) -> None:
        try:
            await self.source.kill(sandbox_id)  # gone: the orchestrator's change wakes the loop
        except Exception:  # still held: the next push is refused and tries again
            log.exception("killing sandbox %s, killed while this node was away, failed", sandbox_id)
