"""What a node process finds at start-up, and what nothing refers to any more.

QEMU processes outlive the node process that started them (each runs in its own session), so a
node restarted after a crash finds running sandboxes to adopt, parked ones whose pages may not
be on disk yet, and warm VMs nobody will claim. A stray VM is identified by its command line
naming one of its disk layers (random ids), never guessed by name. Garbage collection removes
disk layers, runtime files and repository blobs that no snapshot or sandbox needs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from ..network.netns import SandboxNetwork
from ..repository.contract import Repository
from ..repository.errors import RepositoryError
from ..repository.manifest import SnapshotManifest
from ..runtime.contract import RuntimeResolver
from ..runtime.layers import LayerStore
from ..vmm import migration
from ..vmm.envd_link import EnvdLink
from ..vmm.launcher import GuestVM
from ..vmm.machine import VirtualMachine
from .clones import Clones
from .host import Host
from .model import EngineError, GarbageReport, SandboxState, SandboxVM
from .warm import WarmRecord

QEMU_BINARY_NAME = b"qemu-system"
# A layer nothing names yet may belong to an operation in progress (a create before its state is
# saved, the new top of a snapshot, a template build): it is collected only this long after its
# last write (unless a collection names another grace period).
LAYER_GRACE_SECONDS = 3600.0


def is_our_vm(layers: LayerStore, pid: int | None, layer_ids: list[str]) -> bool:
    """Whether `pid` is a QEMU started on one of these disk layers: a VM's identity after a crash.

    Layer ids are random, and QEMU's command line names the top layer it was started on.
    """
    if pid is None:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return QEMU_BINARY_NAME in cmdline and any(str(layers.path(i)).encode() in cmdline for i in layer_ids)


def kill_stray(layers: LayerStore, pid: int | None, layer_ids: list[str]) -> None:
    """Kill a VM a previous node process left behind (identified, not guessed by name)."""
    if pid is not None and is_our_vm(layers, pid, layer_ids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _vms_on(layers: LayerStore) -> Iterator[tuple[int, list[str]]]:
    """Each live QEMU process with the layers of `layers` its command line names (maybe none)."""
    pattern = re.compile(re.escape(str(layers.root)).encode() + rb"/([a-z0-9]+)\.qcow2")
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if QEMU_BINARY_NAME in cmdline.split(b"\0", 1)[0]:
                yield int(entry), [match.decode() for match in pattern.findall(cmdline)]


def layers_of_running_vms(layers: LayerStore) -> set[str]:
    """Layers named on the command line of a live QEMU process: whatever they are, they are in use."""
    return {layer for _, named in _vms_on(layers) for layer in named}


def kill_unclaimed_vms(layers: LayerStore, claimed: set[int]) -> list[int]:
    """Kill the QEMU processes on this node's layers that no sandbox claims; their pids.

    At start-up, after the sandboxes were adopted and the warm VMs' records ended theirs: what is
    left was being started when the previous node process died (a create before its state was
    saved, a warm VM being handed over, a template build), and nothing will ever end it.
    """
    killed = []
    for pid, named in _vms_on(layers):
        if named and pid not in claimed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


class Recovery:
    """Adopts, settles and cleans up what earlier node processes left; collects garbage."""

    def __init__(
        self,
        host: Host,
        repository: Repository,
        runtime: RuntimeResolver,
        layers: LayerStore,
        clones: Clones,
        warm_dir: Path,
    ):
        self.host = host
        self.repository, self.runtime, self.layers = repository, runtime, layers
        self.clones = clones
        self.warm_dir = warm_dir

    async def adopt(
        self, state: SandboxState, access_token: str | None, network: SandboxNetwork | None = None
    ) -> SandboxVM:
        """Take over a sandbox whose QEMU outlived the node process that started it.

        `network` is its namespace as the network pool re-adopted it, if the pool made it.
        """
        if state.paused or not is_our_vm(self.layers, state.pid, state.disk_layers):
            raise EngineError(f"sandbox {state.sandbox_id} has no running VM left to adopt")
        assert state.pid is not None
        manifest = self.repository.leased(state.snapshot_id, state.sandbox_id)
        workdir = self.host.workdir(state.sandbox_id)
        vm = await VirtualMachine.adopt(
            self.clones.config(manifest, state.disk_layers[-1]), workdir, state.pid
        )
        network = network or SandboxNetwork(state.network_name)
        guest = GuestVM(vm=vm, network=network, envd=EnvdLink(network, access_token), workdir=workdir)
        # After a snapshot the top of the root chain has the sealed layer's successor's node name.
        nodes = await vm.command("query-named-block-nodes", flat=True)
        top = f"n{state.disk_layers[-1]}"
        root_node = top if any(n.get("node-name") == top for n in nodes) else "root"
        return SandboxVM(state=state, guest=guest, manifest=manifest, root_node=root_node)

    async def settle_paused(self, state: SandboxState) -> None:
        """A sandbox paused by a node process that ended while it was parked.

        Its QEMU process may have outlived that node; if the pause's device state or pages were
        not written yet, they are captured from it now (it is stopped). Either way the process
        is ended.
        """
        if not state.paused or state.pid is None:
            return
        workdir = self.host.workdir(state.sandbox_id)
        if state.devices is None or state.delta is None:
            if not is_our_vm(self.layers, state.pid, state.disk_layers):
                raise EngineError(f"paused sandbox {state.sandbox_id} lost its memory with its QEMU process")
            manifest = self.repository.leased(state.snapshot_id, state.sandbox_id)
            stem = workdir / f"pause-{time.time_ns()}"
            if state.devices is None:
                await self._capture_devices(state, manifest, stem.with_suffix(".devices"))
            if state.delta is None:
                delta = stem.with_suffix(".delta")
                await self.clones.capture_memory(state.pid, manifest, delta)
                state.delta = str(delta)
        kill_stray(self.layers, state.pid, state.disk_layers)
        state.pid = None
        state.save(workdir)

    async def _capture_devices(self, state: SandboxState, manifest: SnapshotManifest, devices: Path) -> None:
        """Save the device state of a paused sandbox's stopped QEMU, through its recovery monitor."""
        assert state.pid is not None
        workdir = self.host.workdir(state.sandbox_id)
        config = self.clones.config(manifest, state.disk_layers[-1])
        vm = await VirtualMachine.adopt(config, workdir, state.pid)
        try:
            await migration.capture_devices(vm, devices)
        finally:
            with contextlib.suppress(Exception):
                await vm.qmp.disconnect()
        state.devices = str(devices)

    def cleanup_warm_leftovers(self) -> int:
        """End the warm VMs of a node process that did not stop cleanly; returns how many."""
        leftovers = 0
        for record_file in WarmRecord.found(self.warm_dir):
            with contextlib.suppress(OSError, ValueError, TypeError):
                warm = WarmRecord.load(record_file)
                kill_stray(self.layers, warm.pid, [warm.top_layer])
                SandboxNetwork(warm.network).destroy()
                self.layers.remove(warm.top_layer)
                self.repository.release(warm.snapshot_id, record_file.parent.name)
                leftovers += 1
            shutil.rmtree(record_file.parent, ignore_errors=True)
        return leftovers

    def collect_garbage(
        self, *, grace_seconds: float | None = None, keep: set[str] | None = None
    ) -> GarbageReport:
        """Remove disk layers, runtime files and blobs nothing refers to any more (see `repository.gc`).

        A layer stays while a manifest, a sandbox's saved state, a warm VM's record, a live QEMU
        process or `keep` (the layers of snapshots not committed yet) names it, and for the grace
        period after its last write (`LAYER_GRACE_SECONDS` unless `grace_seconds` says
        otherwise), so collection can run while sandboxes are created, snapshotted and taken
        from the warm pool.
        """
        used = self._layers_in_use(keep or set())
        cutoff = time.time() - (LAYER_GRACE_SECONDS if grace_seconds is None else grace_seconds)
        orphans = sorted(i for i in self.layers.all_ids() - used if self.layers.modified(i) < cutoff)
        for layer in orphans:
            self.layers.remove(layer)
        self.runtime.prune(self.repository.is_live)
        blobs = self.repository.gc(grace_seconds=grace_seconds)
        return GarbageReport(removed_layers=tuple(orphans), blobs=blobs)

    def _layers_in_use(self, keep: set[str]) -> set[str]:
        used = {layer for m in self.repository.list() for layer in m.disk_layers}
        used |= {layer for s in self.host.sandbox_states() for layer in (*s.disk_layers, *s.kept_layers)}
        return used | self._warm_layers() | layers_of_running_vms(self.layers) | keep

    def remove_sealed_layers(self, ended: SandboxState, keep: set[str]) -> tuple[str, ...]:
        """Remove the disk layers an ended sandbox sealed (its pauses', snapshots' and
        checkpoints') that nothing else names, at once rather than after the collector's grace:
        a rollout that checkpoints and is killed would otherwise leave a layer for an hour, and
        a trainer runs thousands of them. Its snapshot's layers are not its own and stay; a
        snapshot made of it, a fork's chain or a snapshot still being committed (`keep`) keeps
        the layers it names. Called in a thread: it reads the repository's manifests."""
        sealed = {*ended.disk_layers[:-1], *ended.kept_layers}
        if not sealed:
            return ()
        try:
            sealed -= set(self.repository.get(ended.snapshot_id).disk_layers)
        except RepositoryError:  # its snapshot's layers unknown: the collector decides later
            return ()
        if not sealed:
            return ()
        removed = tuple(sorted(sealed - self._layers_in_use(keep)))
        for layer in removed:
            self.layers.remove(layer)
        return removed

    def _warm_layers(self) -> set[str]:
        layers = set()
        for record_file in WarmRecord.found(self.warm_dir):
            with contextlib.suppress(OSError, ValueError, TypeError):
                layers.add(WarmRecord.load(record_file).top_layer)
        return layers
