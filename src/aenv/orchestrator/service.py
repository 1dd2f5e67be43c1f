"""The orchestrator: every sandbox on this node, its jobs composed behind one stable surface.

Each job owns a module with a narrow interface, over one table of sandboxes (`sandboxes`):
`lifecycle` (create, pause, resume, kill, fork, TTL changes), `captures` (snapshots,
checkpoints, resets), `recovery` (what a previous node process left), `handover` (durable
pauses moving between nodes), `history` (metrics history), `mounting` (volumes) and `eviction`
(TTLs). What a sandbox starts with is one `launch.LaunchPlan`. The jobs receive the engine's
parts they use at construction; this class only wires them and keeps the methods the node
service and the cluster call.

Running sandboxes are paused (or killed, by configuration) when the node stops; after a crash,
VMs that outlived the node are adopted and paused, so a restart loses nothing silently.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..config import Settings
from ..events import SandboxLost
from ..network.netns import SandboxNetwork
from ..repository.manifest import SnapshotManifest
from ..snapshot.checkpoints import Checkpoint
from ..snapshot.engine import SnapshotEngine
from .admission import Admission, meminfo_mib
from .captures import Captures
from .catalog import Catalog
from .errors import SandboxError
from .eviction import Eviction
from .handover import PauseHandover
from .history import MetricsHistory
from .interface import CreateRequest
from .lifecycle import Lifecycle
from .mounting import VolumeMounts
from .reclaim import MemoryReclaimer
from .recovery import Recovery
from .sandboxes import Sandbox, SandboxTable
from .store import SandboxStore

if TYPE_CHECKING:
    from ..volumes.mounts import SandboxVolumes

log = logging.getLogger(__name__)


class Orchestrator:
    """Owns every sandbox on this node; publishes their changes on the engine's event bus."""

    def __init__(
        self,
        settings: Settings,
        engine: SnapshotEngine,
        store: SandboxStore,
        volumes: SandboxVolumes | None = None,
    ):
        self.settings = settings
        self.engine = engine
        self.store = store
        self.events = engine.events
        self.table = table = SandboxTable(store, self.events)
        self.sandboxes = table.sandboxes
        networks, standbys = engine.networks, engine.standbys
        self.reclaimer = MemoryReclaimer(
            table.sandboxes.values, settings.reclaim_interval, settings.reclaim_growth_mib,
            settings.reclaim_pressure_mib,
        )  # fmt: skip
        self.admission = Admission(
            home=settings.home_path,
            disk_reserve_mib=settings.disk_reserve_mib,
            memory_budget_mib=int(meminfo_mib() * settings.memory_overcommit),
            committed_mib=lambda: (
                sum(s.record.memory_mb for s in table.sandboxes.values() if s.vm) + standbys.memory_mib()
            ),
            free_slots=lambda: None if networks is None else networks.available,
            held_mib=self.reclaimer.held_mib,
            memory_reserve_mib=settings.memory_reserve_mib,
        )
        self.mounts = VolumeMounts(volumes)
        self.history = MetricsHistory(engine.workdir)
        self.catalog = Catalog(
            engine.repository, engine.pending, engine.pool, engine.runtime, settings.pending_wait
        )
        self.lifecycle = Lifecycle(
            settings, engine, table, catalog=self.catalog,
            mounts=self.mounts, history=self.history, admission=self.admission,
        )  # fmt: skip
        self.counters = self.lifecycle.counters  # the node's figures (`NodeStatus`)
        self.events.subscribe(SandboxLost, self._count_lost)
        self.captures = Captures(
            engine, engine.checkpoints, table, self.lifecycle, self.mounts, self.admission, self.events
        )
        self.handover = PauseHandover(
            engine, engine.handover, table, self.lifecycle, self.admission, self.events
        )
        self._parked = engine.parked
        self.recovery = Recovery(engine, engine.handover, engine.parked, table, self.lifecycle)
        self.eviction = Eviction(settings.evict_interval, table, self.lifecycle, self.handover)
        self._durable_uploads = engine.handover  # their commits, waited for at close

    def _count_lost(self, lost: SandboxLost) -> None:
        self.counters["lost"] += 1

    # -- startup and shutdown --------------------------------------------------------------

    def surviving_networks(self) -> list[str]:
        """Namespaces of sandboxes a previous node process may have left running."""
        return self.recovery.surviving_networks()

    async def start(self, networks: dict[str, SandboxNetwork] | None = None) -> None:
        """Load sandboxes from the store, recover what a crash left running, start the evictor.

        `networks` are the namespaces the network pool kept for `surviving_networks()`.
        """
        await self.recovery.start(networks or {})
        self.eviction.start()
        self.reclaimer.start()

    def vm_pids(self) -> set[int]:
        """The QEMU processes of the sandboxes whose VM this node holds (running or parked)."""
        return self.recovery.vm_pids()

    async def close(self) -> None:
        """Pause (or kill, by configuration) every running sandbox, then stop."""
        await self.eviction.close()
        await self.reclaimer.stop()
        await self.engine.close()
        self.lifecycle.stop_watching()
        for sandbox in list(self.sandboxes.values()):
            async with sandbox.lock:
                if sandbox.vm is None:
                    continue
                try:
                    if self.settings.shutdown_action == "pause":
                        await self.lifecycle.pause_locked(sandbox)
                    else:
                        await self.lifecycle.kill_locked(sandbox)
                except SandboxError as exc:
                    log.error("stopping sandbox %s failed: %s", sandbox.id, exc.message)
        await self.mounts.close()
        await self._durable_uploads.close()  # the pauses just made become durable before the exit
        self.store.close()

    # -- lookups ---------------------------------------------------------------------------

    def get(self, sandbox_id: str) -> Sandbox:
        return self.table.get(sandbox_id)

    @property
    def lost(self) -> dict[str, str]:
        return self.table.lost

    def volume_users(self, name: str) -> list[str]:
        """The sandboxes (running or paused) that mount the volume named `name`."""
        return self.mounts.users((s.record for s in self.sandboxes.values()), name)

    async def resolve_template(self, reference: str) -> SnapshotManifest:
        return await self.catalog.resolve(reference)

    async def committed_elsewhere(self, name: str) -> SnapshotManifest | None:
        return await self.catalog.committed_elsewhere(name)

    def serial_lines(self, sandbox_id: str, start: int, limit: int) -> tuple[int, list[str]]:
        """The sandbox's serial console from line `start` (blocking: it reads the log)."""
        return self.engine.serial_lines(sandbox_id, start, limit)

    def parked(self) -> int:
        """Paused sandboxes whose QEMU process is kept (`aenv.snapshot.parking`)."""
        return len(self._parked)

    async def running_vm(self, sandbox_id: str, *, resume: bool) -> Sandbox | None:
        return await self.lifecycle.running_vm(sandbox_id, resume=resume)

    # -- lifecycle (`lifecycle`) -------------------------------------------------------------

    async def create(self, request: CreateRequest) -> Sandbox:
        return await self.lifecycle.create(request)

    async def pause(self, sandbox: Sandbox, *, memory: bool = True) -> None:
        await self.lifecycle.pause(sandbox, memory=memory)

    async def connect(self, sandbox: Sandbox, timeout: int | None, *, memory: bool = True) -> bool:
        return await self.lifecycle.connect(sandbox, timeout, memory=memory)

    async def resume(self, sandbox: Sandbox, timeout: int | None, *, memory: bool = True) -> None:
        await self.lifecycle.resume(sandbox, timeout, memory=memory)

    async def set_timeout(self, sandbox: Sandbox, timeout: int) -> None:
        await self.lifecycle.set_timeout(sandbox, timeout)

    async def refresh(self, sandbox: Sandbox, duration: int | None) -> None:
        await self.lifecycle.refresh(sandbox, duration)

    async def kill(self, sandbox: Sandbox) -> None:
        await self.lifecycle.kill(sandbox)

    async def fork(self, sandbox: Sandbox, count: int, timeout: int | None) -> list[Sandbox]:
        return await self.lifecycle.fork(sandbox, count, timeout)

    async def update_network(
        self, sandbox: Sandbox, allow_internet: bool | None, network: dict[str, Any]
    ) -> None:
        await self.lifecycle.update_network(sandbox, allow_internet, network)

    # -- snapshots and checkpoints (`captures`) -----------------------------------------------

    async def snapshot(self, sandbox: Sandbox, name: str | None, *, memory: bool = True) -> SnapshotManifest:
        return await self.captures.snapshot(sandbox, name, memory=memory)

    async def checkpoint(self, sandbox: Sandbox, name: str | None) -> Checkpoint:
        return await self.captures.checkpoint(sandbox, name)

    def checkpoints(self, sandbox: Sandbox) -> list[Checkpoint]:
        return self.captures.checkpoints(sandbox)

    async def delete_checkpoint(self, sandbox: Sandbox, checkpoint: str) -> None:
        await self.captures.delete_checkpoint(sandbox, checkpoint)

    async def promote_checkpoint(
        self, sandbox: Sandbox, checkpoint: str, name: str | None
    ) -> SnapshotManifest:
        return await self.captures.promote_checkpoint(sandbox, checkpoint, name)

    async def reset(self, sandbox: Sandbox, checkpoint: str) -> None:
        await self.captures.reset(sandbox, checkpoint)

    # -- durable pauses (`handover`) ---------------------------------------------------------

    async def forget_moved(self) -> None:
        await self.handover.forget_moved()

    async def take_over(self, sandbox_id: str, timeout: int | None) -> Sandbox:
        return await self.handover.take_over(sandbox_id, timeout)

    async def discard_pause(self, sandbox_id: str) -> None:
        await self.handover.discard_pause(sandbox_id)

    # -- metrics history (`history`) and TTLs (`eviction`) -----------------------------------

    async def metrics(self, sandbox: Sandbox, start: int | None, end: int | None) -> list[dict[str, Any]]:
        return await self.history.metrics(sandbox, start, end)

    async def latest_metrics(self, sandboxes: list[Sandbox]) -> dict[str, dict[str, Any]]:
        return await self.history.latest(sandboxes)

    async def evict_expired(self) -> None:
        await self.eviction.evict_expired()
