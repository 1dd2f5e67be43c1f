"""Restart recovery: the sandboxes a previous node process left, brought back to a state the API
can report truthfully.

Paused sandboxes stay paused (a pause still held by a parked process is saved and that process
ended); VMs that outlived the node are adopted and paused; VMs of creates it never finished are
ended. A sandbox whose saved state is unreadable, or whose pause another node took over, is
forgotten, with the reason kept for lookups.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ..network.netns import SandboxNetwork
from ..snapshot.handover import Handover, SandboxMoved
from ..snapshot.model import EngineError
from ..snapshot.parking import ParkingLot
from .backend import SandboxBackend
from .errors import SandboxError
from .failures import ENGINE_FAILURES
from .lifecycle import Lifecycle
from .sandboxes import Sandbox, SandboxTable
from .states import Op, State

log = logging.getLogger(__name__)


class Recovery:
    """Loads the sandboxes of `table`'s store at start and settles each one."""

    def __init__(
        self,
        engine: SandboxBackend,
        handover: Handover,
        parked: ParkingLot,
        table: SandboxTable,
        lifecycle: Lifecycle,
    ):
        self.engine = engine
        self.handover = handover
        self.parked = parked
        self.table = table
        self.lifecycle = lifecycle

    def surviving_networks(self) -> list[str]:
        """Namespaces of sandboxes a previous node process may have left running."""
        names = []
        for record in self.table.store.all():
            if record.state != State.PAUSED:
                with contextlib.suppress(OSError, ValueError):
                    names.append(self.engine.load_state(record.sandbox_id).network_name)
        return names

    async def start(self, networks: dict[str, SandboxNetwork]) -> None:
        """Load sandboxes from the store and recover what a crash left running.

        `networks` are the namespaces the network pool kept for `surviving_networks()`.
        """
        for record in self.table.store.all():
            sandbox = Sandbox(record)
            self.table.sandboxes[record.sandbox_id] = sandbox
            async with sandbox.lock:
                if record.state != State.PAUSED:
                    await self._recover(sandbox, networks)
                else:
                    await self._settle(sandbox)
        if killed := self.engine.kill_unclaimed_vms(self._claimed_pids()):
            log.warning("ended the VMs of creates the previous node process did not finish: pids %s", killed)

    def vm_pids(self) -> set[int]:
        """The QEMU processes of the sandboxes whose VM this node holds: running, or kept while
        paused (parked)."""
        running = {s.vm.guest.vm.pid for s in self.table.sandboxes.values() if s.vm is not None}
        return running | self.parked.pids()

    def _claimed_pids(self) -> set[int]:
        """The QEMU processes the recovered sandboxes own (running, or parked while paused)."""
        claimed = self.vm_pids()
        for sandbox_id in self.table.sandboxes:
            with contextlib.suppress(OSError, ValueError):
                if (pid := self.engine.load_state(sandbox_id).pid) is not None:
                    claimed.add(pid)
        return claimed

    async def _recover(self, sandbox: Sandbox, networks: dict[str, SandboxNetwork]) -> None:
        """A sandbox the previous node process left in a running or transitional state."""
        record = sandbox.record
        try:
            state = self.engine.load_state(record.sandbox_id)
        except OSError:
            log.error(
                "sandbox %s was %s but has no saved state: removing it", record.sandbox_id, record.state
            )
            self.table.forget(sandbox)
            return
        if state.paused:
            with self.table.transition(sandbox, Op.RECOVER_PAUSED):
                self.table.stopped(sandbox)
            await self._settle(sandbox)
            return
        try:
            with self.table.transition(sandbox, Op.ADOPT):
                network = networks.get(state.network_name)
                self.lifecycle.attach(sandbox, await self.engine.adopt(state, record.envd_token, network))
            await self.lifecycle.pause_locked(sandbox)
            log.info("sandbox %s outlived the node process and was paused", record.sandbox_id)
        except (*ENGINE_FAILURES, SandboxError) as exc:
            log.error("sandbox %s was lost with the previous node process: %s", record.sandbox_id, exc)
            network = networks.get(state.network_name)
            if network is not None:
                network.destroy()  # the pool's own object, so its slot is freed
            # Best effort on a VM that is already lost: whatever fails here, the record goes.
            with contextlib.suppress(Exception):
                await self.engine.kill(state)
            self.table.forget(sandbox)

    async def _settle(self, sandbox: Sandbox) -> None:
        """A paused sandbox whose process the previous node process kept: save it, end the process."""
        try:
            state = self.engine.load_state(sandbox.id)
            await self.engine.settle_paused(state)
            if moved_to := await asyncio.to_thread(self.handover.moved, state):
                raise SandboxMoved(sandbox.id, moved_to)
            sandbox.record.durable = state.durable is not None
            self.handover.recover(state)  # a pause not yet committed is committed now
        except SandboxMoved as exc:
            log.info("paused sandbox %s is gone: %s", sandbox.id, exc)
            self.table.lose(sandbox.id, f"it was taken over by node {exc.node}")
            with contextlib.suppress(Exception):
                await self.engine.kill(self.engine.load_state(sandbox.id))
            self.table.forget(sandbox)
        except (EngineError, OSError, LookupError) as exc:
            log.error("paused sandbox %s was lost with the previous node process: %s", sandbox.id, exc)
            # Best effort on a sandbox that is already lost: whatever fails here, the record goes.
            with contextlib.suppress(Exception):
                await self.engine.kill(self.engine.load_state(sandbox.id))
            self.table.forget(sandbox)
