"""Floors: the same restore and save on bare QEMU, from the node's own `base` template, without the node.

A figure's floor is what QEMU itself needs for the work the node does, measured on the same host
in the same run: `restore` is spawn → `migrate-incoming` of the template's spliced stream (with
`x-ignore-shared`, the memory image mapped copy-on-write) → guest running; `save` is QMP `stop`
+ `xen-save-devices-state` on such a running clone. The figure's ratio to its floor is the node's
overhead (API, orchestration, warm-pool bookkeeping, envd `/init`, page capture).

The clones are built from the lower-level pieces the engine uses (repository manifest, runtime
resolver, machine configuration, the QMP steps of `aenv.vmm.migration`), never from the engine
or the node. The template's vmstate
has a virtio-net device, so each clone gets a tap in a throwaway namespace (no uplink, no way
out), and its own qcow2 layer over the template's disk; both are prepared before the clock
starts, as the node prepares them ahead of time too. Everything lives under a scratch directory
and namespaces named `aenv-floor-…`, removed on exit, also on failure or Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from aenv.network.netns import SandboxNetwork
from aenv.repository.posix import SnapshotRepository
from aenv.runtime.layers import LayerStore
from aenv.runtime.resolvers import LocalRuntime
from aenv.vmm import migration
from aenv.vmm.envd_link import EnvdLink
from aenv.vmm.launcher import create_upper_layer, guest_machine
from aenv.vmm.machine import MachineConfig, MemoryMode, VirtualMachine

from .node import BenchError

INCOMING_TIMEOUT = 120.0


@dataclass
class Clone:
    """One bare QEMU restored from the template, with what it owns."""

    vm: VirtualMachine
    network: SandboxNetwork
    workdir: Path
    restore_ms: float = 0.0


class FloorLab:
    """Restores the node's `base` template on bare QEMU; owns every clone until `close`."""

    def __init__(self, home: Path, template: str = "base"):
        repository = SnapshotRepository(home / "repository")
        self.manifest = repository.get(template)
        self.workdir = Path(tempfile.mkdtemp(prefix="aenv-bench-floor-"))
        # The node's resolver, with its spliced stream written to this scratch directory.
        runtime = LocalRuntime(repository, LayerStore(home / "layers"), self.workdir)
        self.lower = runtime.layer_path(self.manifest.disk_layers[-1])
        self._boot = runtime.boot_files(self.manifest.machine)
        self._image = runtime.memory_image(self.manifest)
        self.stream = runtime.template_stream(self.manifest)
        self._clones: list[Clone] = []
        self._networks: list[SandboxNetwork] = []

    def _config(self, disk: Path) -> MachineConfig:
        shape = self.manifest.machine
        return guest_machine(
            self._boot, disk, accel=shape.accel, vcpus=shape.vcpus, memory_mib=shape.memory_mib,
            memory_mode=MemoryMode.PRIVATE_IMAGE, memory_path=self._image,
        )  # fmt: skip

    async def _prepare(self) -> tuple[Path, SandboxNetwork, Path]:
        """A clone's disk layer, namespace with a tap, and directory: made before the clock starts."""
        name = secrets.token_hex(5)
        workdir = self.workdir / name
        workdir.mkdir()
        disk = workdir / "disk.qcow2"
        await create_upper_layer(self.lower, disk)
        network = await SandboxNetwork.create(f"aenv-floor-{name}")
        self._networks.append(network)
        return disk, network, workdir

    async def _restore(self, disk: Path, network: SandboxNetwork, workdir: Path) -> Clone:
        """Spawn → x-ignore-shared → migrate-incoming → running, timed from the spawn."""
        tap = network.open_tap()
        started = time.perf_counter()
        try:
            vm = await VirtualMachine.spawn(self._config(disk), workdir, tap_fd=tap, incoming=True)
        finally:
            os.close(tap)
        clone = Clone(vm, network, workdir)
        self._clones.append(clone)
        await migration.prepare_incoming(vm)
        try:
            await migration.load(vm, self.stream, INCOMING_TIMEOUT)
        except migration.MigrationError as exc:
            raise BenchError(f"bare restore failed: {exc}") from exc
        clone.restore_ms = (time.perf_counter() - started) * 1000
        return clone

    async def restore(self) -> Clone:
        return await self._restore(*await self._prepare())

    async def restore_many(self, count: int) -> tuple[list[Clone], float]:
        """`count` clones restored at once; also the wall clock until the last one runs (ms)."""
        prepared = [await self._prepare() for _ in range(count)]
        started = time.perf_counter()
        clones = await asyncio.gather(*(self._restore(*p) for p in prepared))
        return list(clones), (time.perf_counter() - started) * 1000

    async def restore_and_run_many(self, count: int) -> float:
        """`count` clones restored at once, each then running `true` through its envd (from its
        namespace, as the node reaches a guest): wall clock until the last command ended (ms).
        Under TCG this is mostly each new process translating the guest's code; the clones are
        discarded after."""
        prepared = [await self._prepare() for _ in range(count)]
        started = time.perf_counter()

        async def restore_and_run(disk: Path, network: SandboxNetwork, workdir: Path) -> Clone:
            clone = await self._restore(disk, network, workdir)
            envd = EnvdLink(network)
            try:
                if await envd.run("true", timeout=INCOMING_TIMEOUT) != 0:
                    raise BenchError("`true` failed in a bare clone")
            finally:
                envd.close()
            return clone

        clones = await asyncio.gather(*(restore_and_run(*p) for p in prepared), return_exceptions=True)
        wall = (time.perf_counter() - started) * 1000
        for clone in clones:
            if isinstance(clone, Clone):
                await self.discard(clone)
        if failed := [c for c in clones if isinstance(c, BaseException)]:
            raise BenchError(f"{len(failed)} of {count} bare clones did not run a command: {failed[0]}")
        return wall

    async def save(self, clone: Clone) -> float:
        """QMP `stop` + `xen-save-devices-state` of a running clone (ms)."""
        target = clone.workdir / "devices"
        started = time.perf_counter()
        await migration.stop(clone.vm)
        await migration.capture_devices(clone.vm, target)
        return (time.perf_counter() - started) * 1000

    async def discard(self, clone: Clone) -> None:
        await clone.vm.kill()
        clone.network.destroy()
        with contextlib.suppress(ValueError):
            self._clones.remove(clone)
            self._networks.remove(clone.network)
        shutil.rmtree(clone.workdir, ignore_errors=True)

    async def close(self) -> None:
        for clone in list(self._clones):
            await clone.vm.kill()
        for network in self._networks:
            network.destroy()
        self._clones.clear()
        self._networks.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)
