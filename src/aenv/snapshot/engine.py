"""The snapshot engine: one object the orchestrator, node, tests and bench drive, made of parts.

Mechanism (docs/design.md, Memory snapshots): a template boots with its RAM in a shared file,
which becomes the immutable memory image; every sandbox maps that image privately, so the pages it changes are
its own anonymous pages. Pause and snapshot save device state without RAM plus those pages (a
delta layer); restore spawns QEMU on the image, writes the delta back, and loads the template's
stream prefix spliced with the sandbox's device sections. Disks are qcow2 chains
(`aenv.runtime.layers`): a snapshot seals the sandbox's writable layer, so it costs no copy.

Each concern lives in its own module and this class only wires them together and keeps the
public surface callers use: `templates` (template VMs: the node's own template, and the VM a
user build runs its steps in, `aenv.template.stages`), `lifecycle` (start, resume, snapshot, fork,
kill), `pausing` (pause and parked processes), `recovery` (adoption after a restart, leftovers,
garbage), `warm` (warm VMs for `warm_pool`), `clones` (restore and capture). Each part receives
what it uses of the repository, the runtime resolver, the disk layers, the stop deadline and the
`Host` (accelerator, networks, directories). QMP sequences are `aenv.vmm.migration`'s.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from ..events import EventBus
from ..guest.artifacts import GuestArtifacts
from ..network.egress import EgressPolicy
from ..network.netns import SandboxNetwork
from ..network.pool import NetworkPool
from ..repository.contract import Repository
from ..repository.manifest import SnapshotManifest
from ..repository.posix import SnapshotRepository
from ..runtime.contract import RuntimeResolver
from ..runtime.layers import LayerStore
from ..runtime.resolvers import LocalRuntime
from ..vmm.accel import Accelerator
from .checkpoints import Checkpoint, Checkpoints
from .clones import Clones
from .handover import Describe, Handover
from .host import Host, StopDeadline
from .lifecycle import Lifecycle
from .model import EngineError, GarbageReport, GuestInit, SandboxState, SandboxVM
from .parking import ParkingPolicy
from .pausing import Pauses
from .pending import PendingSnapshots
from .recovery import Recovery, kill_unclaimed_vms
from .standby import Standbys
from .templates import TemplateBuilder
from .warm import WarmVMs
from .warm_pool import WarmPool

__all__ = ["EngineError", "GarbageReport", "GuestInit", "SandboxState", "SandboxVM", "SnapshotEngine"]

log = logging.getLogger(__name__)


class SnapshotEngine:
    """Builds templates and runs sandboxes from committed snapshots on this node.

    `runtime` resolves snapshots to local files; by default the files of a repository on this
    host's filesystem are used in place. With `durable_pauses` (a repository other nodes share),
    every pause is also committed to the repository in the background, so another node can
    take the paused sandbox over (`aenv.snapshot.handover`), carrying what `describe` says of it.
    Its parts publish on `events` (pauses saved and durable, snapshots failed) and the warm pools
    follow template builds there, keeping `warm_size` VMs of each new one.
    """

    def __init__(
        self,
        home: Path,
        repository: Repository,
        artifacts: GuestArtifacts,
        accel: Accelerator,
        *,
        networks: NetworkPool | None = None,
        incoming_timeout: float = 60.0,
        parking: ParkingPolicy | None = None,
        runtime: RuntimeResolver | None = None,
        durable_pauses: bool = False,
        events: EventBus | None = None,
        describe: Describe | None = None,
        warm_size: int = 0,
        reset_standby: bool = False,
    ):
        self.layers = LayerStore(home / "layers")
        self.sandboxes_dir = home / "sandboxes"
        self.runtime_dir = home / "runtime"
        for directory in (self.sandboxes_dir, self.runtime_dir):
            directory.mkdir(parents=True, exist_ok=True)
        if runtime is None:
            if not isinstance(repository, SnapshotRepository):
                raise TypeError("a repository that is not a local directory needs a runtime resolver")
            runtime = LocalRuntime(repository, self.layers, self.runtime_dir)
        self.host = host = Host(
            accel, self.sandboxes_dir, self.runtime_dir, networks=networks, incoming_timeout=incoming_timeout
        )
        self.stop = stop = StopDeadline()
        self.repository, self.runtime, self.artifacts, self.accel = repository, runtime, artifacts, accel
        self.networks = networks
        self.events = events = events or EventBus()
        layers = self.layers
        self.clones = clones = Clones(host, runtime, layers)
        self.templates = TemplateBuilder(host, repository, runtime, layers, artifacts)
        self.warm = WarmVMs(host, repository, runtime, layers, stop, clones)
        self.pool = WarmPool(self.warm, events=events, size=warm_size)
        # Off unless asked for: without it, every pause ends the QEMU process at once.
        self.pauses = Pauses(host, clones, parking or ParkingPolicy(max_seconds=0), events)
        self.parked = self.pauses.lot
        self.standbys = Standbys(host, runtime, layers, clones, enabled=reset_standby)
        self.checkpoints = Checkpoints(host, runtime, layers, clones, self.standbys)
        self.handover = Handover(
            host, repository, runtime, stop, durable_pauses, events, describe, self.checkpoints.carried
        )
        self.pending = PendingSnapshots(repository, runtime, stop, repository.pending_dir(), events)
        self.lifecycle = Lifecycle(
            host, repository, runtime, layers, stop, clones, self.warm, self.pool, self.pauses, self.handover,
            self.pending,
        )  # fmt: skip
        self.recovery = Recovery(host, repository, runtime, layers, clones, self.warm.directory)

    def stop_within(self, seconds: float) -> None:
        """The node stops: from now on its waits for the store end `seconds` from now (`StopDeadline`)."""
        self.stop.start(seconds)

    @property
    def abandoned(self) -> int:
        """Store operations a stop gave up waiting for (their threads may still run)."""
        return self.stop.abandoned

    async def close(self) -> None:
        """End the warm VMs and parked processes; running sandboxes are left to the caller.

        Pauses after this end the QEMU process at once.
        """
        await self.parked.close()
        await self.standbys.settle()
        await self.pool.close()
        await self.handover.close()
        await self.pending.close()
        await self.clones.close()

    # -- machine and sandboxes directory ---------------------------------------------------

    async def qemu_version(self) -> str:
        return await self.host.qemu_version()

    async def incompatibility(self, manifest: SnapshotManifest) -> str | None:
        """Why the snapshot cannot be restored here (another QEMU build, machine or accelerator)."""
        return await self.host.incompatibility(manifest)

    def workdir(self, sandbox_id: str) -> Path:
        return self.host.workdir(sandbox_id)

    def load_state(self, sandbox_id: str) -> SandboxState:
        return self.host.load_state(sandbox_id)

    def sandbox_states(self) -> list[SandboxState]:
        return self.host.sandbox_states()

    def serial_lines(self, sandbox_id: str, start: int, limit: int) -> tuple[int, list[str]]:
        return self.host.serial_lines(sandbox_id, start, limit)

    # -- templates -------------------------------------------------------------------------

    async def build_template(self, alias: str | None, **options: Any) -> SnapshotManifest:
        """Build and commit a template; `options` are `TemplateBuilder.build`'s."""
        return await self.templates.build(alias, **options)

    async def keep_warm(self, snapshot_id: str) -> None:
        """Keep the node's number of warm VMs of a template (`warm_size`)."""
        await self.pool.set_target(snapshot_id, self.pool.size)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(
        self, snapshot: str, sandbox_id: str, init: GuestInit, policy: EgressPolicy | None = None
    ) -> SandboxVM:
        return await self.lifecycle.start(snapshot, sandbox_id, init, policy)

    async def pause(self, sandbox: SandboxVM, *, memory: bool = True) -> SandboxState:
        self.standbys.drop(sandbox.sandbox_id)  # made again once it runs (`Captures`)
        return await self.pauses.pause(sandbox, memory=memory)

    async def drop_memory(self, sandbox_id: str) -> None:
        """Make a paused sandbox's next resume boot from its disk, whatever its pause kept."""
        await self.pauses.drop_memory(sandbox_id)

    async def resume(self, state: SandboxState, init: GuestInit) -> SandboxVM:
        return await self.lifecycle.resume(state, init)

    async def snapshot(
        self,
        sandbox: SandboxVM,
        *,
        alias: str | None = None,
        metadata: dict[str, str] | None = None,
        memory: bool = True,
        wait: bool = True,
    ) -> SnapshotManifest:
        """Snapshot a running sandbox; without `wait`, answered before it is committed (`pending`)."""
        return await self.lifecycle.snapshot(
            sandbox, alias=alias, metadata=metadata, memory=memory, wait=wait
        )

    async def unseal(self, sandbox: SandboxVM, layer: str) -> bool:
        """Undo the seal of a snapshot that failed after its answer (`Lifecycle.unseal`)."""
        return await self.lifecycle.unseal(sandbox, layer)

    async def take_over(self, pause: SnapshotManifest, init: GuestInit, policy: EgressPolicy) -> SandboxVM:
        """Continue here a sandbox paused on another node, from its pause snapshot (`handover.find`)."""
        sandbox = await self.handover.take_over(self.lifecycle.start, pause, init, policy)
        self.checkpoints.left_behind(sandbox.sandbox_id, pause.metadata)
        return sandbox

    async def fork(self, sandbox: SandboxVM, children: list[tuple[str, GuestInit]]) -> list[SandboxVM]:
        return await self.lifecycle.fork(sandbox, children)

    async def kill(self, sandbox: SandboxVM | SandboxState) -> None:
        ended = sandbox.state if isinstance(sandbox, SandboxVM) else sandbox
        await self.standbys.settle(ended.sandbox_id)  # its standby, and a VM a reset replaced
        await self.lifecycle.kill(sandbox)
        try:
            await asyncio.to_thread(self.recovery.remove_sealed_layers, ended, self.pending.layers())
        except Exception:  # the sandbox is gone either way; the collector removes them later
            log.exception("removing the sealed disk layers of sandbox %s failed", ended.sandbox_id)

    async def checkpoint(self, sandbox: SandboxVM, name: str | None) -> Checkpoint:
        return await self.checkpoints.create(sandbox, name)

    async def promote(
        self, sandbox: SandboxVM, checkpoint: str, alias: str | None, metadata: dict[str, str]
    ) -> SnapshotManifest:
        """A checkpoint of the running sandbox as a snapshot (answered pending, committed after)."""
        found = self.checkpoints.get(sandbox.sandbox_id, checkpoint)
        files = self.checkpoints.files(sandbox.sandbox_id, found)
        return await self.lifecycle.promote(sandbox, found, files, alias, metadata)

    async def reset(self, sandbox: SandboxVM, checkpoint: str, init: GuestInit) -> SandboxVM:
        """The sandbox restored from its checkpoint in a new VM, its old one ended."""
        return await self.checkpoints.reset(sandbox, checkpoint, init)

    async def set_policy(self, sandbox: SandboxVM, policy: EgressPolicy) -> None:
        await self.lifecycle.set_policy(sandbox, policy)

    # -- recovery --------------------------------------------------------------------------

    async def adopt(
        self, state: SandboxState, access_token: str | None, network: SandboxNetwork | None = None
    ) -> SandboxVM:
        return await self.recovery.adopt(state, access_token, network)

    async def settle_paused(self, state: SandboxState) -> None:
        await self.recovery.settle_paused(state)

    def cleanup_warm_leftovers(self) -> int:
        return self.recovery.cleanup_warm_leftovers()

    def kill_unclaimed_vms(self, claimed: set[int]) -> list[int]:
        return kill_unclaimed_vms(self.layers, claimed)

    def collect_garbage(self, *, grace_seconds: float | None = None) -> GarbageReport:
        return self.recovery.collect_garbage(grace_seconds=grace_seconds, keep=self.pending.layers())

    def recover_pending(self) -> int:
        """At start: commit, in the background, the snapshots a previous node process answered."""
        return self.pending.recover()
