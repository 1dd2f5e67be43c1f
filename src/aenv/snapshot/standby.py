"""A restored standby per sandbox, so that a reset to its checkpoint is a `cont`.

A reset (`aenv.snapshot.checkpoints`) restores the checkpoint into a new QEMU: the spawn, the
checkpoint's pages written back and its device state loaded. A standby is that VM made ahead of
time and kept stopped: QEMU is told to stay stopped once its incoming state is loaded (QMP
`stop` while it waits for the state clears its autostart), so nothing of the checkpoint's state
changes until a reset continues it. It has its own disk layer over the checkpoint's sealed one,
its own network namespace from the pool (as a reset's new VM always had) and its own directory
(`standby-<random>/`, whose sockets a reset moves into the sandbox's: a restarted node adopts the VM
through them). A reset that finds one for its checkpoint continues it, gives envd the sandbox's
identity, ends the old VM in the background, and starts the next standby for the same
checkpoint: a GRPO-style loop resets to one checkpoint again and again.

Bounds: at most one per sandbox, for the checkpoint last taken or last reset to; made only while
the node admits a VM of the sandbox's size (`Captures`), and counted in its committed memory
(`memory_mib`). It is dropped when the sandbox pauses (and made again once it runs again), is
killed or its checkpoint deleted, and when the node stops; a node that did not stop cleanly kills
it at its next start as a QEMU no sandbox claims (`kill_unclaimed_vms`), and collects its layer
as one nothing uses. It is never a sandbox: no API lists it, and its process is not the sandbox's
until a reset takes it.

What it cannot remove under TCG: a standby that has not run has translated no code, so the
guest's first answers after the `cont` (envd's `/init`, the first command) still translate it
afresh, as in any new QEMU process; a process that ran (a parked resume) has it already.
Warming the standby would change the state the checkpoint promises.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..network.netns import SandboxNetwork
from ..repository.manifest import SnapshotManifest
from ..runtime.contract import RuntimeResolver
from ..runtime.layers import LayerStore
from ..vmm import devstate, migration
from ..vmm.launcher import GuestVM
from ..vmm.machine import VirtualMachine
from .clones import Clones
from .host import Host
from .model import GuestInit, SandboxState, SandboxVM

log = logging.getLogger(__name__)

# Its directory in the sandbox's: one per standby, as one may still be ending when the next starts.
STANDBY_PREFIX = "standby-"


@dataclass
class Standby:
    """A QEMU restored from a checkpoint of a sandbox, stopped, with its disk layer and network."""

    checkpoint_id: str
    policy: dict[str, Any]  # the sandbox's egress policy its network was given
    memory_mib: int
    directory: Path
    top_layer: str = ""
    vm: VirtualMachine | None = None
    network: SandboxNetwork | None = None


class Standbys:
    """The standbys of this node's sandboxes: built in the background, taken by a reset."""

    def __init__(
        self,
        host: Host,
        runtime: RuntimeResolver,
        layers: LayerStore,
        clones: Clones,
        *,
        enabled: bool = False,
    ):
        self.host = host
        self.runtime, self.layers = runtime, layers
        self.clones = clones
        self.enabled = enabled
        self._building: dict[str, tuple[Standby, asyncio.Task[bool]]] = {}
        self._ending: set[asyncio.Task[None]] = set()

    def memory_mib(self) -> int:
        """Guest RAM of the standbys held or being built (admission counts them as VMs)."""
        return sum(standby.memory_mib for standby, _ in self._building.values())

    def pids(self) -> set[int]:
        return {standby.vm.pid for standby, _ in self._building.values() if standby.vm is not None}

    def prepare(
        self, sandbox: SandboxVM, checkpoint_id: str, devices: Path, delta: Path, sealed: str
    ) -> None:
        """Build a standby of the sandbox's checkpoint in the background, instead of any other."""
        if not self.enabled:
            return
        held = self._building.get(sandbox.sandbox_id)
        if held is not None and self._serves(*held, checkpoint_id, sandbox.state.policy):
            return
        self.drop(sandbox.sandbox_id)
        directory = self.host.workdir(sandbox.sandbox_id) / f"{STANDBY_PREFIX}{secrets.token_hex(4)}"
        memory_mib = sandbox.manifest.machine.memory_mib
        standby = Standby(checkpoint_id, dict(sandbox.state.policy), memory_mib, directory)
        build = self._build(standby, sandbox.state, sandbox.manifest, devices, delta, sealed)
        task = asyncio.create_task(build, name=f"standby-{sandbox.sandbox_id}")
        self._building[sandbox.sandbox_id] = (standby, task)

    @staticmethod
    def _serves(
        standby: Standby, task: asyncio.Task[bool], checkpoint_id: str, policy: dict[str, Any]
    ) -> bool:
        """Whether it is (or is becoming) a standby of this checkpoint, under this egress policy."""
        failed = task.done() and (task.cancelled() or not task.result())
        return not failed and standby.checkpoint_id == checkpoint_id and standby.policy == policy

    async def _build(
        self,
        standby: Standby,
        state: SandboxState,
        manifest: SnapshotManifest,
        devices: Path,
        delta: Path,
        sealed: str,
    ) -> bool:
        """Restore the checkpoint into a QEMU that stays stopped; False if it could not be made."""
        directory = standby.directory
        try:
            standby.top_layer = await self.layers.create_upper(sealed)
            directory.mkdir(exist_ok=True)
            stream = directory / "standby.vmstate"
            prefix = self.runtime.vmstate_prefix(manifest)
            stream.write_bytes(devstate.splice(prefix, devices.read_bytes()))
            # Its own namespace: one from the pool, or without one a new name beside the sandbox's.
            standby.network = await self.host.network(f"aenv-{directory.name}", state.egress)
            standby.vm = await self.clones.spawn(manifest, standby.top_layer, directory, standby.network)
            await migration.stop(standby.vm)  # while incoming: stay stopped once the state is loaded
            await self.clones.load(standby.vm, manifest, [delta], stream, run=False)
            stream.unlink()
            return True
        except asyncio.CancelledError:
            await asyncio.shield(self._end(standby))
            raise
        except Exception:
            log.exception("sandbox %s: no standby of checkpoint %s", state.sandbox_id, standby.checkpoint_id)
            await self._end(standby)
            return False

    async def take(self, sandbox_id: str, checkpoint_id: str, policy: dict[str, Any]) -> Standby | None:
        """The sandbox's standby of this checkpoint, no longer held (waited for if being built);
        None if there is none for it (another checkpoint's, or an older policy's, is dropped)."""
        held = self._building.pop(sandbox_id, None)
        if held is None:
            return None
        if not self._serves(*held, checkpoint_id, policy):
            self._end_later(*held)
            return None
        standby, task = held
        try:
            made = await asyncio.shield(task)
        except asyncio.CancelledError:
            self._end_later(standby, task)
            raise
        return standby if made else None

    async def activate(
        self, standby: Standby, state: SandboxState, manifest: SnapshotManifest, init: GuestInit
    ) -> SandboxVM:
        """Continue the standby as the sandbox (its state's disk is the standby's layer): its
        sockets and console move into the sandbox's directory, the guest runs, envd takes `/init`."""
        assert standby.vm is not None and standby.network is not None
        state.network_name = standby.network.name
        try:
            standby.vm.move(self.host.workdir(state.sandbox_id))
            await migration.cont(standby.vm)
            sandbox = await self.clones.identify(state, manifest, standby.vm, standby.network, init)
        except BaseException:
            standby.top_layer = ""  # the caller removes it
            await asyncio.shield(self._end(standby))
            raise
        shutil.rmtree(standby.directory, ignore_errors=True)
        self.runtime.restored(manifest)
        return sandbox

    def drop(self, sandbox_id: str, checkpoint_id: str | None = None) -> None:
        """End the sandbox's standby (only if of `checkpoint_id`, when given) in the background
        (`settle` waits for it)."""
        held = self._building.get(sandbox_id)
        if held is not None and checkpoint_id in (None, held[0].checkpoint_id):
            del self._building[sandbox_id]
            self._end_later(*held)

    def retire(self, guest: GuestVM, top_layer: str) -> None:
        """End a VM a reset replaced, and remove its writable layer, off the reset's path."""
        self._track(self._retire(guest, top_layer))

    async def _retire(self, guest: GuestVM, top_layer: str) -> None:
        await guest.destroy(keep_files=True)
        await asyncio.to_thread(self.layers.remove, top_layer)

    async def settle(self, sandbox_id: str | None = None) -> None:
        """Drop the sandbox's standby (without `sandbox_id`: every one's, and make no more, as the
        node stops) and wait until every standby and replaced VM being ended is gone (a kill must
        leave nothing behind)."""
        if sandbox_id is None:
            self.enabled = False
        for held in [sandbox_id] if sandbox_id is not None else list(self._building):
            self.drop(held)
        while self._ending:
            await asyncio.gather(*self._ending, return_exceptions=True)

    def _end_later(self, standby: Standby, task: asyncio.Task[bool]) -> None:
        async def end() -> None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            await self._end(standby)

        self._track(end())

    def _track(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def _end(self, standby: Standby) -> None:
        """Kill its QEMU, give its network back, remove its layer and directory. Idempotent."""
        vm, network, standby.vm, standby.network = standby.vm, standby.network, None, None
        try:
            if vm is not None:
                await vm.kill()
            if network is not None:
                await network.aclose()
            if standby.top_layer:
                await asyncio.to_thread(self.layers.remove, standby.top_layer)
        except Exception:
            log.exception("ending the standby of checkpoint %s failed", standby.checkpoint_id)
        shutil.rmtree(standby.directory, ignore_errors=True)
