"""A guest restored from a committed snapshot into a fresh QEMU, and a sandbox's state captured back.

Restore (docs/design.md, Memory snapshots): QEMU maps the snapshot's memory image copy-on-write
and waits for incoming state; the snapshot's (or the sandbox's) changed pages are written into its RAM from
`/proc`, then a stream of the snapshot's vmstate prefix and device sections is loaded and the
guest runs. Capture is the reverse with the guest stopped: device sections over QMP, then the
private pages of the mapping as a delta layer. The QMP steps are `aenv.vmm.migration`'s; the
pages are `aenv.snapshot.memory`'s; this module joins them for starts, resumes and warm VMs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path

from ..agent.envd.system_api import CLOCK_TOLERANCE_NS
from ..network.netns import SandboxNetwork
from ..repository.manifest import SnapshotManifest
from ..runtime.contract import RuntimeResolver
from ..runtime.layers import LayerStore
from ..vmm import migration
from ..vmm.envd_link import EnvdLink
from ..vmm.launcher import GuestVM, boot_guest, guest_machine
from ..vmm.machine import MachineConfig, MemoryMode, VirtualMachine
from . import memory
from .host import Host
from .model import EngineError, GuestInit, SandboxState, SandboxVM, clock_payload

log = logging.getLogger(__name__)

CLOCK_FIX_TIMEOUT = 10.0  # a second /init took up to 0.7 s in a fork of 16 on 2 cores
CLOCK_FIX_ATTEMPTS = 5


class Clones:
    """Restores guests from snapshots on this node and captures their state."""

    def __init__(self, host: Host, runtime: RuntimeResolver, layers: LayerStore):
        self.host = host
        self.runtime = runtime
        self.layers = layers
        self._clock_fixes: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """Stop setting clocks again (`identify`)."""
        for task in list(self._clock_fixes):
            task.cancel()
        await asyncio.gather(*self._clock_fixes, return_exceptions=True)

    async def new_top_layer(self, manifest: SnapshotManifest) -> str:
        """A writable disk layer over the snapshot's chain, its files made local first."""
        await asyncio.to_thread(self.runtime.prepare, manifest)
        return await self.layers.create_upper_over(self.runtime.top_layer(manifest))

    def config(self, manifest: SnapshotManifest, top_layer: str) -> MachineConfig:
        """The machine of a sandbox restored from `manifest` whose disk chain ends in `top_layer`."""
        runtime = self.runtime
        return guest_machine(
            runtime.boot_files(manifest.machine), runtime.layer_path(top_layer), accel=self.host.accel,
            vcpus=manifest.machine.vcpus, memory_mib=manifest.machine.memory_mib,
            memory_mode=MemoryMode.PRIVATE_IMAGE, memory_path=runtime.memory_image(manifest),
        )  # fmt: skip

    async def spawn(
        self, manifest: SnapshotManifest, top_layer: str, workdir: Path, network: SandboxNetwork
    ) -> VirtualMachine:
        """QEMU on the snapshot's memory image and this disk layer, waiting for incoming state."""
        tap_fd = network.open_tap()
        try:
            vm = await VirtualMachine.spawn(
                self.config(manifest, top_layer), workdir, tap_fd=tap_fd, incoming=True
            )
        finally:
            os.close(tap_fd)
        try:
            await migration.prepare_incoming(vm)
        except BaseException:
            await vm.kill()
            raise
        return vm

    async def load(
        self,
        vm: VirtualMachine,
        manifest: SnapshotManifest,
        deltas: list[Path],
        stream: Path,
        *,
        run: bool = True,
    ) -> None:
        """Write the changed pages into the waiting QEMU, load the device state, let the guest run
        (unless `run` is off: `migration.load`)."""
        if deltas:
            start, end = memory.find_mapping(vm.pid, self.runtime.memory_image(manifest))
            await asyncio.to_thread(memory.apply_deltas, vm.pid, start, end, deltas)
        try:
            await migration.load(vm, stream, self.host.incoming_timeout, run=run)
        except migration.MigrationError as exc:
            raise EngineError(str(exc)) from exc

    async def launch(
        self,
        state: SandboxState,
        manifest: SnapshotManifest,
        deltas: list[Path],
        stream: Path,
        init: GuestInit,
    ) -> SandboxVM:
        """Spawn QEMU for the sandbox, restore it and give it its identity (the path without a warm VM)."""
        network = await self.host.network(state.network_name, state.egress)
        state.network_name = network.name
        try:
            vm = await self.spawn(
                manifest, state.disk_layers[-1], self.host.workdir(state.sandbox_id), network
            )
        except BaseException:
            network.destroy()
            raise
        try:
            await self.load(vm, manifest, deltas, stream)
        except BaseException:
            await vm.kill()
            network.destroy()
            raise
        sandbox = await self.identify(state, manifest, vm, network, init)
        self.runtime.restored(manifest)
        return sandbox

    async def boot(
        self, state: SandboxState, manifest: SnapshotManifest, init: GuestInit, ready_timeout: float
    ) -> SandboxVM:
        """Boot the sandbox's guest afresh from its disk (a filesystem-only pause's resume).

        The machine is a clone's (RAM a private mapping of the snapshot's memory image), so later
        pauses, snapshots and forks of the sandbox capture it like any other.
        """
        network = await self.host.network(state.network_name, state.egress)
        state.network_name = network.name
        config = self.config(manifest, state.disk_layers[-1])
        workdir = self.host.workdir(state.sandbox_id)
        guest = await boot_guest(config, workdir, network=network, ready_timeout=ready_timeout)
        return await self.identify(state, manifest, guest.vm, network, init, guest.envd)

    async def identify(
        self,
        state: SandboxState,
        manifest: SnapshotManifest,
        vm: VirtualMachine,
        network: SandboxNetwork,
        init: GuestInit,
        envd: EnvdLink | None = None,
        *,
        reseed: bool = True,
    ) -> SandboxVM:
        """`/init` a running guest as this sandbox (token, variables, clock, entropy unless
        `reseed` is off: see `GuestInit.payload`) and record it.

        `envd` is the guest's existing link, whose kept-alive connection makes `/init` cheaper.
        The clock the guest is given is the node's when the request left: a guest restored in a
        new QEMU process answers its first request late under TCG (0.2-0.3 s alone, 1.3-2.7 s
        for each of a fork's 16 children), and would keep a clock that late. So after an
        `/init` slower than envd's clock tolerance, the clock is set once more, in the background
        (`set_clock_later`).
        """
        envd = envd or EnvdLink(network)
        envd.access_token = init.access_token
        try:
            sent = time.monotonic()
            await envd.init(init.payload(reseed=reseed), timeout=30)
        except BaseException:
            await vm.kill()
            network.destroy()
            raise
        if time.monotonic() - sent > CLOCK_TOLERANCE_NS / 1e9:
            self.set_clock_later(envd)
        return self.record(state, manifest, vm, network, envd)

    def set_clock_later(self, envd: EnvdLink) -> None:
        """Set the guest's clock again, without waiting for it.

        Not on the way to the sandbox being ready: the guest writes its new settings first (under
        TCG its first write costs ~40 ms of emulated CPU), and a fork's children share the host's
        cores, so a second `/init` took 0.1-0.7 s each, made the fork 0.2-0.5 s slower, and set a
        clock that late again (`_set_clock` tries until one is quick). The body sets nothing but
        the clock, so one that arrives after a later `/init` (a resume's new token) undoes
        nothing; one that cannot (the sandbox paused or ended meanwhile) is dropped.
        """
        task = asyncio.create_task(self._set_clock(envd))
        self._clock_fixes.add(task)
        task.add_done_callback(self._clock_fixes.discard)

    @staticmethod
    async def _set_clock(envd: EnvdLink) -> None:
        """Until an `/init` took less than envd's clock tolerance (a busy guest may take longer
        for the next one too): the clock it set is then off by less than that."""
        try:
            for _ in range(CLOCK_FIX_ATTEMPTS):
                sent = time.monotonic()
                await envd.init(clock_payload(), timeout=CLOCK_FIX_TIMEOUT)
                if time.monotonic() - sent <= CLOCK_TOLERANCE_NS / 1e9:
                    return
        except Exception as exc:  # best effort: the guest keeps the clock it has
            log.debug("could not set the clock of the guest behind %s again: %s", envd.network.name, exc)

    def record(
        self,
        state: SandboxState,
        manifest: SnapshotManifest,
        vm: VirtualMachine,
        network: SandboxNetwork,
        envd: EnvdLink,
    ) -> SandboxVM:
        """The running guest, whose envd is already this sandbox's, recorded as the sandbox."""
        state.paused, state.pid = False, vm.pid
        state.save(vm.workdir)
        guest = GuestVM(vm=vm, network=network, envd=envd, workdir=vm.workdir)
        return SandboxVM(state=state, guest=guest, manifest=manifest)

    async def capture(
        self, sandbox: SandboxVM, directory: Path, stem: str, *, sync: bool = True
    ) -> tuple[Path, memory.DeltaInfo]:
        """With the guest stopped: its device state and changed pages, written under `directory`
        (flushed to disk unless `sync` is off: a background commit flushes them later)."""
        devices = directory / f"{stem}.devices"
        await migration.capture_devices(sandbox.vm, devices)
        delta_path = directory / f"{stem}.delta"
        delta = await self.capture_memory(sandbox.vm.pid, sandbox.manifest, delta_path, sync=sync)
        return devices, delta

    async def capture_memory(
        self,
        pid: int,
        manifest: SnapshotManifest,
        delta: Path,
        *,
        sync: bool = True,
        stop: threading.Event | None = None,
    ) -> memory.DeltaInfo:
        """With the guest stopped: the pages it changed since `manifest`'s image, as a delta layer
        (`memory.capture_delta`, which `stop` ends early)."""
        start, end = memory.find_mapping(pid, self.runtime.memory_image(manifest))
        return await asyncio.to_thread(memory.capture_delta, pid, start, end, delta, sync=sync, stop=stop)
