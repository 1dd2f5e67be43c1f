"""The machine every part of the snapshot engine runs sandboxes on, and its directories.

`Host` is this node's accelerator, QEMU build and network pool (what a restore checks a snapshot
against and takes a network from), and the `sandboxes/` directory where every sandbox keeps its
saved state and serial log. The repository (durable truth), the runtime resolver (local files for
QEMU) and the disk layers are not the host's: each part of the engine receives those it uses.

A stopping node waits for its object store only until its stop deadline (`StopDeadline`): with the
store unreachable, boto's retries made one stop outlast its supervisor's 30 s (issue 32), whose
SIGKILL then left the node's QEMUs running. What is not committed by the deadline stays on this
node's disk and is committed at its next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..network.egress import EgressPolicy
from ..network.netns import SandboxNetwork
from ..network.pool import NetworkPool
from ..repository.contract import Repository
from ..repository.manifest import MachineShape, SnapshotManifest
from ..vmm import serial
from ..vmm.accel import Accelerator
from ..vmm.machine import MACHINE_TYPE, QEMU_BINARY
from .model import STATE_FILE, EngineError, SandboxState

log = logging.getLogger(__name__)


class StopDeadline:
    """How long a stopping node still waits for its object store (forever until it stops)."""

    def __init__(self) -> None:
        self.deadline: float | None = None  # time.monotonic(), once stopping
        self.abandoned = 0  # store operations the stop did not wait for (their threads may run)

    def start(self, seconds: float) -> None:
        """The node stops: waits for the store from now on end `seconds` from now."""
        self.deadline = time.monotonic() + seconds

    def _remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    async def settle(self, tasks: Iterable[asyncio.Task[None] | None]) -> int:
        """Wait for background work on the store (commits); once stopping, only until the
        deadline. Returns how many are still running (left to the next start)."""
        running = [task for task in tasks if task is not None and not task.done()]
        if not running:
            return 0
        _, left = await asyncio.wait(running, timeout=self._remaining())
        self.abandoned += len(left)
        return len(left)

    async def release(self, repository: Repository, snapshot_id: str, holder: str) -> None:
        """Release a lease; once stopping, given up at the deadline or on failure (the lease then
        expires with this node's heartbeat)."""
        call = asyncio.to_thread(repository.release, snapshot_id, holder)
        if self.deadline is None:
            return await call
        try:
            await asyncio.wait_for(call, self._remaining())
        except Exception as exc:  # TimeoutError too: the thread goes on, the process does not wait
            self.abandoned += 1
            log.warning("lease of %s on %s not released while stopping: %r", holder, snapshot_id, exc)


@dataclass
class Host:
    """This node's machine and sandboxes directory."""

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
