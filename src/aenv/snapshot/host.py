"""What every part of the snapshot engine runs on: this node's storage, machine and directories.

Template building, the sandbox lifecycle and recovery each get one `Host` instead of reaching
into each other: the repository (durable truth), the runtime resolver (local files for QEMU),
the node's disk layers, accelerator and network pool, and the `sandboxes/` directory where
every sandbox keeps its saved state and serial log.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from ..network.egress import EgressPolicy
from ..network.netns import SandboxNetwork
from ..network.pool import NetworkPool
from ..storage.layers import LayerStore
from ..storage.protocols import Repository, RuntimeResolver
from ..vmm import serial
from ..vmm.accel import Accelerator
from ..vmm.machine import MACHINE_TYPE, QEMU_BINARY
from .manifest import MachineShape, SnapshotManifest
from .model import STATE_FILE, EngineError, SandboxState


@dataclass
class Host:
    """This node's side of every snapshot operation."""

    repository: Repository
    runtime: RuntimeResolver
    layers: LayerStore
    accel: Accelerator
    sandboxes_dir: Path
    runtime_dir: Path
    networks: NetworkPool | None = None
    incoming_timeout: float = 60.0
    _qemu_version: str | None = field(default=None, init=False, repr=False)

    # -- machine identity ------------------------------------------------------------------

    async def qemu_version(self) -> str:
        """The version of the QEMU binary the VMs run (what manifests record and restores check)."""
        if self._qemu_version is None:
            process = await asyncio.create_subprocess_exec(
                QEMU_BINARY, "--version", stdout=asyncio.subprocess.PIPE
            )
            out, _ = await process.communicate()
            self._qemu_version = out.decode().splitlines()[0].removeprefix("QEMU emulator version ").strip()
        return self._qemu_version

    async def incompatibility(self, manifest: SnapshotManifest) -> str | None:
        """Why the snapshot cannot be restored here (another QEMU build, machine or accelerator)."""
        here = MachineShape(
            **{
                **manifest.machine.to_dict(),
                "qemu_version": await self.qemu_version(),
                "machine_type": MACHINE_TYPE,
                "accel": self.accel,
            }
        )
        try:
            manifest.machine.check_compatible(here)
        except ValueError as exc:
            return str(exc)
        return None

    async def check_runnable(self, manifest: SnapshotManifest) -> None:
        if (problem := await self.incompatibility(manifest)) is not None:
            raise EngineError(f"snapshot {manifest.id} cannot run on this node: {problem}")

    async def new_top_layer(self, manifest: SnapshotManifest) -> str:
        """A writable disk layer over the snapshot's chain, its files made local first."""
        await asyncio.to_thread(self.runtime.prepare, manifest)
        return await self.layers.create_upper_over(self.runtime.top_layer(manifest))

    async def network(self, name: str, policy: EgressPolicy | None) -> SandboxNetwork:
        """A network from the node's pool (with egress), or a private one without any way out."""
        if self.networks is not None:
            return await self.networks.acquire(policy)
        return await SandboxNetwork.create(name)

    # -- the sandboxes directory -----------------------------------------------------------

    def workdir(self, sandbox_id: str) -> Path:
        return self.sandboxes_dir / sandbox_id

    def load_state(self, sandbox_id: str) -> SandboxState:
        return SandboxState.load(self.workdir(sandbox_id))

    def sandbox_states(self) -> list[SandboxState]:
        """Every sandbox this node has (running or paused), as last saved."""
        states = []
        for state_file in self.sandboxes_dir.glob(f"*/{STATE_FILE}"):
            with contextlib.suppress(OSError, ValueError, TypeError):
                states.append(SandboxState.load(state_file.parent))
        return states

    def serial_lines(self, sandbox_id: str, start: int, limit: int) -> tuple[int, list[str]]:
        """A page of the sandbox's serial console, across its pauses and resumes: `limit` lines
        from line `start`, and the number of the first (`aenv.vmm.serial.read_lines`)."""
        return serial.read_lines(self.workdir(sandbox_id), start, limit)
