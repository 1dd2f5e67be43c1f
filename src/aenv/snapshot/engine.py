"""The snapshot engine: templates as committed snapshots, restore, pause/resume, snapshot and fork.

Mechanism (design.md §3): a template boots with its RAM in a shared file, which becomes the
immutable memory image; every sandbox maps that image privately, so the pages it changes are
its own anonymous pages. Pause and snapshot save device state without RAM plus those pages (a
delta layer); restore spawns QEMU on the image, writes the delta back, and loads the template's
stream prefix spliced with the sandbox's device sections. Disks are qcow2 chains
(`aenv.storage.layers`): a snapshot seals the sandbox's writable layer with
`blockdev-snapshot-sync`, so it costs no copy.

Each capture holds every page the sandbox changed since the memory image (resume writes the
earlier pages back as private pages, so they are captured again): a sandbox's delta never
depends on an older one, and a snapshot has exactly one delta over its image.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..guest.artifacts import GuestArtifacts
from ..network.egress import EgressPolicy
from ..network.netns import SandboxNetwork
from ..network.pool import NetworkPool
from ..storage.layers import LayerStore, new_layer_id
from ..vmm.accel import Accelerator, default_vcpus
from ..vmm.envd_link import EnvdLink, utc_timestamp
from ..vmm.launcher import BootFiles, GuestVM, boot_guest, guest_machine
from ..vmm.machine import MACHINE_TYPE, SERIAL_LOG, MachineConfig, MemoryMode, VirtualMachine, VMError
from . import devstate, memory
from .manifest import MachineShape, RuntimeContext, SnapshotManifest, new_snapshot_id, utc_now
from .parking import ParkedVM, ParkingLot, ParkingPolicy
from .repository import GcReport, SnapshotRepository
from .warm_pool import WarmPool, WarmVM

log = logging.getLogger(__name__)

QEMU_BINARY_NAME = b"qemu-system"
STATE_FILE = "state.json"
WARM_FILE = "warm.json"


@dataclass(frozen=True)
class GuestInit:
    """What envd is told after every start or resume (E2B's `POST /init`)."""

    env_vars: dict[str, str] = field(default_factory=dict)
    access_token: str | None = None
    default_user: str | None = None
    default_workdir: str | None = None

    def payload(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "envVars": self.env_vars,
            "timestamp": utc_timestamp(),
            # Restored guests share the template's RNG state: give each one fresh entropy.
            "entropy": base64.b64encode(os.urandom(64)).decode(),
        }
        if self.access_token:
            body["accessToken"] = self.access_token
        if self.default_user:
            body["defaultUser"] = self.default_user
        if self.default_workdir:
            body["defaultWorkdir"] = self.default_workdir
        return body


@dataclass
class SandboxState:
    """What survives the QEMU process of a sandbox: enough to resume it, also after a node restart."""

    sandbox_id: str
    snapshot_id: str
    disk_layers: list[str]  # bottom to top; the top one is the sandbox's writable layer
    network_name: str
    delta: str | None = None  # path of the delta layer from the last pause
    devices: str | None = None  # path of the device state from the last pause
    paused: bool = False
    pid: int | None = None  # QEMU's, while running: a restarted node adopts it from here
    policy: dict[str, Any] = field(default_factory=dict)  # the egress policy, as EgressPolicy fields

    @property
    def egress(self) -> EgressPolicy:
        return EgressPolicy(**self.policy)

    def save(self, workdir: Path) -> None:
        tmp = workdir / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, workdir / STATE_FILE)

    @classmethod
    def load(cls, workdir: Path) -> SandboxState:
        return cls(**json.loads((workdir / STATE_FILE).read_text()))


@dataclass
class SandboxVM:
    """A running sandbox VM and where it came from."""

    state: SandboxState
    guest: GuestVM
    manifest: SnapshotManifest
    root_node: str = "root"  # QEMU's node name for the top of the root disk chain

    @property
    def sandbox_id(self) -> str:
        return self.state.sandbox_id

    @property
    def envd(self) -> EnvdLink:
        return self.guest.envd

    @property
    def vm(self) -> VirtualMachine:
        return self.guest.vm


@dataclass(frozen=True)
class GarbageReport:
    removed_layers: tuple[str, ...]
    blobs: GcReport


class EngineError(RuntimeError):
    """A snapshot operation failed; the message says which and why."""


class SnapshotEngine:
    """Builds templates and runs sandboxes from committed snapshots on this node."""

    def __init__(
        self,
        home: Path,
        repository: SnapshotRepository,
        artifacts: GuestArtifacts,
        accel: Accelerator,
        *,
        networks: NetworkPool | None = None,
        incoming_timeout: float = 60.0,
        parking: ParkingPolicy | None = None,
    ):
        self.repository = repository
        self.artifacts = artifacts
        self.accel = accel
        self.layers = LayerStore(home / "layers")
        self.sandboxes_dir = home / "sandboxes"
        self.runtime_dir = home / "runtime"
        self.incoming_timeout = incoming_timeout
        self.networks = networks
        self.pool = WarmPool(self._spawn_warm, self._discard_warm)
        # Off unless asked for: without it, every pause ends the QEMU process at once.
        self.parked = ParkingLot(parking or ParkingPolicy(max_seconds=0), self._release_parked)
        self._qemu_version: str | None = None
        for directory in (self.sandboxes_dir, self.runtime_dir):
            directory.mkdir(parents=True, exist_ok=True)

    async def close(self) -> None:
        """End the warm VMs and parked processes; running sandboxes are left to the caller.

        Pauses after this end the QEMU process at once.
        """
        await self.parked.close()
        await self.pool.close()

    # -- machine identity ------------------------------------------------------------------

    async def qemu_version(self) -> str:
        if self._qemu_version is None:
            process = await asyncio.create_subprocess_exec(
                "qemu-system-x86_64", "--version", stdout=asyncio.subprocess.PIPE
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

    async def _check_runnable(self, manifest: SnapshotManifest) -> None:
        if (problem := await self.incompatibility(manifest)) is not None:
            raise EngineError(f"snapshot {manifest.id} cannot run on this node: {problem}")

    async def _network(self, name: str, policy: EgressPolicy | None) -> SandboxNetwork:
        """A network from the node's pool (with egress), or a private one without any way out."""
        if self.networks is not None:
            return await self.networks.acquire(policy)
        return await SandboxNetwork.create(name)

    def _boot_files(self, manifest: SnapshotManifest) -> BootFiles:
        shape = manifest.machine
        return BootFiles(
            kernel=self.repository.blob_path(shape.kernel_digest),
            initramfs=self.repository.blob_path(shape.initramfs_digest),
            tools_image=self.repository.blob_path(shape.tools_digest),
            cmdline=shape.cmdline,
        )

    # -- templates -------------------------------------------------------------------------

    async def build_template(
        self,
        alias: str | None,
        *,
        vcpus: int | None = None,
        memory_mib: int = 512,
        runtime: RuntimeContext | None = None,
        metadata: dict[str, str] | None = None,
        ready_timeout: float = 300.0,
    ) -> SnapshotManifest:
        """Boot a fresh guest, run the start command until the ready check passes, commit it."""
        runtime = runtime or RuntimeContext()
        vcpus = vcpus or default_vcpus(self.accel)
        started = time.monotonic()
        staging = self.repository.staging_dir()
        guest: GuestVM | None = None
        upper: str | None = None
        try:
            boot = BootFiles.from_artifacts(self.artifacts, self.accel)
            digests = await asyncio.to_thread(
                lambda: [self.repository.put_blob(p) for p in (boot.kernel, boot.initramfs, boot.tools_image)]
            )
            kernel_digest, initramfs_digest, tools_digest = digests
            boot = BootFiles(*(self.repository.blob_path(d) for d in digests), cmdline=boot.cmdline)
            base = self.layers.import_base(self.artifacts.base_image, self.artifacts.base_image_digest)
            upper = await self.layers.create_upper(base)
            config = guest_machine(
                boot, self.layers.path(upper), accel=self.accel, vcpus=vcpus, memory_mib=memory_mib,
                memory_mode=MemoryMode.SHARED_FILE, memory_path=staging / "memory.img",
            )  # fmt: skip
            guest = await boot_guest(config, staging / "vm", network_name=f"aenv-b{upper[-10:]}")
            await self._prepare_template(guest, runtime, ready_timeout)
            guest.envd.close()  # clones should not inherit an open connection to this host
            await guest.vm.command("stop")
            await self._save_full_state(guest.vm, staging)
            await guest.vm.command("quit")
            await guest.vm.wait(30)
            await guest.destroy(keep_files=True)
            guest = None
            self.layers.seal(upper)
            manifest = await asyncio.to_thread(
                self._commit_template, staging, alias, base, upper, runtime, metadata or {},
                MachineShape(
                    qemu_version=await self.qemu_version(), machine_type=MACHINE_TYPE, vcpus=vcpus,
                    memory_mib=memory_mib, accel=self.accel, kernel_digest=kernel_digest,
                    initramfs_digest=initramfs_digest, tools_digest=tools_digest, cmdline=boot.cmdline,
                ),
            )  # fmt: skip
        except BaseException:
            if guest is not None:
                await guest.destroy()
            if upper is not None:
                self.layers.remove(upper)
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.info("template %s (%s) built in %.1f s", manifest.id, alias, time.monotonic() - started)
        return manifest

    async def _prepare_template(self, guest: GuestVM, runtime: RuntimeContext, timeout: float) -> None:
        init = GuestInit(runtime.env_vars, default_user=runtime.user, default_workdir=runtime.workdir)
        await guest.envd.init(init.payload())
        user = runtime.user or "root"
        if runtime.start_cmd:
            await guest.envd.run(runtime.start_cmd, user=user, cwd=runtime.workdir, background=True)
        if runtime.ready_cmd:
            deadline = time.monotonic() + timeout
            while await guest.envd.run(runtime.ready_cmd, user=user, cwd=runtime.workdir, timeout=30) != 0:
                if time.monotonic() > deadline:
                    raise EngineError(
                        f"ready check {runtime.ready_cmd!r} did not pass within {timeout:.0f} s"
                    )
                await asyncio.sleep(0.5)

    async def _save_full_state(self, vm: VirtualMachine, staging: Path) -> None:
        """Migration stream without RAM (it is in the shared file) plus the device sections alone."""
        await vm.command(
            "migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": True}]
        )
        await vm.command("migrate", uri=f"file:{staging / 'vmstate'}")
        while True:
            status = (await vm.command("query-migrate")).get("status")
            if status == "completed":
                break
            if status in ("failed", "cancelled"):
                raise EngineError(f"saving the template's state failed ({status})")
            await asyncio.sleep(0.002)
        await vm.command("xen-save-devices-state", filename=str(staging / "devices"), live=False)

    def _commit_template(
        self,
        staging: Path,
        alias: str | None,
        base: str,
        upper: str,
        runtime: RuntimeContext,
        metadata: dict[str, str],
        shape: MachineShape,
    ) -> SnapshotManifest:
        devices = (staging / "devices").read_bytes()
        prefix = devstate.split_prefix((staging / "vmstate").read_bytes(), devices)
        memory_image = self.repository.put_blob(staging / "memory.img", move=True)
        manifest = SnapshotManifest(
            id=new_snapshot_id(),
            kind="template",
            alias=alias,
            created_at=utc_now(),
            source={},
            machine=shape,
            memory_image=memory_image,
            memory_deltas=(),
            device_state=self.repository.put_bytes(devices),
            vmstate_prefix=self.repository.put_bytes(prefix),
            disk_layers=(base, upper),
            runtime=runtime,
            metadata=metadata,
            sizes={memory_image: self.repository.blob_path(memory_image).stat().st_size},
        )
        self.repository.commit(manifest)
        return manifest

    # -- start, pause, resume ---------------------------------------------------------------

    def workdir(self, sandbox_id: str) -> Path:
        return self.sandboxes_dir / sandbox_id

    async def start(
        self, snapshot: str, sandbox_id: str, init: GuestInit, policy: EgressPolicy | None = None
    ) -> SandboxVM:
        """Create a sandbox from a template or snapshot (id or alias), from the warm pool if it can."""
        manifest = self.repository.acquire(snapshot, sandbox_id)
        try:
            return await self._start(manifest, sandbox_id, init, policy or EgressPolicy())
        finally:
            self.pool.refill(manifest.id)

    async def _start(
        self, manifest: SnapshotManifest, sandbox_id: str, init: GuestInit, policy: EgressPolicy
    ) -> SandboxVM:
        warm = self.pool.take(manifest.id)
        try:
            await self._check_runnable(manifest)
            top = warm.top_layer if warm else await self.layers.create_upper(manifest.disk_layers[-1])
        except BaseException:
            if warm is not None:
                await self._discard_warm(warm)
            self.repository.release(manifest.id, sandbox_id)
            raise
        state = SandboxState(
            sandbox_id=sandbox_id,
            snapshot_id=manifest.id,
            disk_layers=[*manifest.disk_layers, top],
            network_name=warm.network.name if warm else f"aenv-{sandbox_id}",
            policy=asdict(policy),
        )
        try:
            if warm is None:
                deltas = [self.repository.blob_path(d) for d in manifest.memory_deltas]
                return await self._launch(state, manifest, deltas, self._template_stream(manifest), init)
            workdir = self.workdir(sandbox_id)
            (warm.workdir / WARM_FILE).unlink(missing_ok=True)
            warm.workdir.rename(workdir)
            warm.vm.workdir = workdir
            self.repository.release(manifest.id, warm.entry_id)
            if warm.network.policy != policy and self.networks is not None:
                await warm.network.apply_policy(policy)
            return await self._identify(state, manifest, warm.vm, warm.network, init, warm.envd)
        except BaseException:
            self.layers.remove(top)
            self.repository.release(manifest.id, sandbox_id)
            shutil.rmtree(self.workdir(sandbox_id), ignore_errors=True)
            raise

    async def _spawn_warm(self, snapshot_id: str) -> WarmVM:
        """A restored, running guest for the pool that has no identity yet.

        It holds a lease on its snapshot like a sandbox would. Its envd has answered once, so the
        code paths of the first request are already warm (under TCG: translated); taking it
        costs one `/init` that gives it the sandbox's token, variables, clock and entropy.
        """
        entry_id = "w" + secrets.token_hex(6)
        manifest = self.repository.acquire(snapshot_id, entry_id)
        workdir = self.runtime_dir / "warm" / entry_id
        top: str | None = None
        network: SandboxNetwork | None = None
        vm: VirtualMachine | None = None
        try:
            await self._check_runnable(manifest)
            top = await self.layers.create_upper(manifest.disk_layers[-1])
            network = await self._network(f"aenv-{entry_id}", None)
            vm = await self._spawn_clone(manifest, top, workdir, network)
            deltas = [self.repository.blob_path(d) for d in manifest.memory_deltas]
            await self._load(vm, manifest, deltas, self._template_stream(manifest))
            envd = EnvdLink(network)
            await envd.init(GuestInit().payload(), timeout=60)
            record = {"pid": vm.pid, "snapshot_id": manifest.id, "top_layer": top, "network": network.name}
            (workdir / WARM_FILE).write_text(json.dumps(record))
        except BaseException:
            if vm is not None:
                await vm.kill()
            if network is not None:
                network.destroy()
            if top is not None:
                self.layers.remove(top)
            shutil.rmtree(workdir, ignore_errors=True)
            self.repository.release(snapshot_id, entry_id)
            raise
        return WarmVM(entry_id, manifest.id, vm, network, envd, top, workdir)

    async def _discard_warm(self, warm: WarmVM) -> None:
        warm.envd.close()
        await warm.vm.kill()
        warm.network.destroy()
        self.layers.remove(warm.top_layer)
        shutil.rmtree(warm.workdir, ignore_errors=True)
        self.repository.release(warm.snapshot_id, warm.entry_id)

    def _template_stream(self, manifest: SnapshotManifest) -> Path:
        """The restorable stream of a snapshot, spliced once and kept in the runtime cache."""
        path = self.runtime_dir / f"{manifest.id}.vmstate"
        if not path.exists():
            prefix = self.repository.blob_path(manifest.vmstate_prefix).read_bytes()
            devices = self.repository.blob_path(manifest.device_state).read_bytes()
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(devstate.splice(prefix, devices))
            os.replace(tmp, path)
        return path

    def _clone_config(self, manifest: SnapshotManifest, top_layer: str) -> MachineConfig:
        """The machine of a sandbox restored from `manifest` whose disk chain ends in `top_layer`."""
        image = self.repository.blob_path(manifest.memory_image)
        return guest_machine(
            self._boot_files(manifest), self.layers.path(top_layer), accel=self.accel,
            vcpus=manifest.machine.vcpus, memory_mib=manifest.machine.memory_mib,
            memory_mode=MemoryMode.PRIVATE_IMAGE, memory_path=image,
        )  # fmt: skip

    async def _spawn_clone(
        self, manifest: SnapshotManifest, top_layer: str, workdir: Path, network: SandboxNetwork
    ) -> VirtualMachine:
        """QEMU on the snapshot's memory image and this disk layer, waiting for incoming state."""
        config = self._clone_config(manifest, top_layer)
        tap_fd = network.open_tap()
        try:
            vm = await VirtualMachine.spawn(config, workdir, tap_fd=tap_fd, incoming=True)
        finally:
            os.close(tap_fd)
        try:
            await vm.command(
                "migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": True}]
            )
        except BaseException:
            await vm.kill()
            raise
        return vm

    async def _launch(
        self,
        state: SandboxState,
        manifest: SnapshotManifest,
        deltas: list[Path],
        stream: Path,
        init: GuestInit,
    ) -> SandboxVM:
        """Spawn QEMU for the sandbox and restore it (the path without a warm VM)."""
        workdir = self.workdir(state.sandbox_id)
        network = await self._network(state.network_name, state.egress)
        state.network_name = network.name
        try:
            vm = await self._spawn_clone(manifest, state.disk_layers[-1], workdir, network)
        except BaseException:
            network.destroy()
            raise
        return await self._restore(state, manifest, vm, network, deltas, stream, init)

    async def _restore(
        self,
        state: SandboxState,
        manifest: SnapshotManifest,
        vm: VirtualMachine,
        network: SandboxNetwork,
        deltas: list[Path],
        stream: Path,
        init: GuestInit,
    ) -> SandboxVM:
        """Load a waiting QEMU with the sandbox's state, then give envd its identity."""
        try:
            await self._load(vm, manifest, deltas, stream)
        except BaseException:
            await vm.kill()
            network.destroy()
            raise
        return await self._identify(state, manifest, vm, network, init)

    async def _load(
        self, vm: VirtualMachine, manifest: SnapshotManifest, deltas: list[Path], stream: Path
    ) -> None:
        """Write the changed pages into the waiting QEMU, load the device state, let the guest run."""
        if deltas:
            image = self.repository.blob_path(manifest.memory_image)
            start, end = memory.find_mapping(vm.pid, image)
            await asyncio.to_thread(memory.apply_deltas, vm.pid, start, end, deltas)
        await self._incoming(vm, stream)

    async def _identify(
        self,
        state: SandboxState,
        manifest: SnapshotManifest,
        vm: VirtualMachine,
        network: SandboxNetwork,
        init: GuestInit,
        envd: EnvdLink | None = None,
    ) -> SandboxVM:
        """`/init` a running guest as this sandbox (token, variables, clock, entropy) and record it.

        `envd` is the guest's existing link, whose kept-alive connection makes `/init` cheaper.
        """
        envd = envd or EnvdLink(network)
        envd.access_token = init.access_token
        try:
            await envd.init(init.payload(), timeout=30)
        except BaseException:
            await vm.kill()
            network.destroy()
            raise
        state.paused, state.pid = False, vm.pid
        state.save(vm.workdir)
        guest = GuestVM(vm=vm, network=network, envd=envd, workdir=vm.workdir)
        return SandboxVM(state=state, guest=guest, manifest=manifest)

    async def _incoming(self, vm: VirtualMachine, stream: Path) -> None:
        """Load the device state and let the guest run."""
        await vm.command("migrate-incoming", uri=f"file:{stream}")
        deadline = time.monotonic() + self.incoming_timeout
        while (status := (await vm.command("query-status"))["status"]) == "inmigrate":
            if time.monotonic() > deadline:
                raise EngineError("loading the device state timed out")
            await asyncio.sleep(0.001)
        if status == "paused":
            await vm.command("cont")
        elif status != "running":  # QEMU starts the guest by itself once the state is loaded
            raise EngineError(f"loading the device state failed: QEMU is {status}")

    async def _capture(self, sandbox: SandboxVM, directory: Path, stem: str) -> tuple[Path, memory.DeltaInfo]:
        """With the guest stopped: its device state and changed pages, written under `directory`."""
        devices = directory / f"{stem}.devices"
        await sandbox.vm.command("xen-save-devices-state", filename=str(devices), live=False)
        delta = await self._capture_memory(sandbox.vm.pid, sandbox.manifest, directory / f"{stem}.delta")
        return devices, delta

    async def _capture_memory(self, pid: int, manifest: SnapshotManifest, delta: Path) -> memory.DeltaInfo:
        """With the guest stopped: the pages it changed since `manifest`'s image, as a delta layer."""
        start, end = memory.find_mapping(pid, self.repository.blob_path(manifest.memory_image))
        return await asyncio.to_thread(memory.capture_delta, pid, start, end, delta)

    async def pause(self, sandbox: SandboxVM) -> SandboxState:
        """Stop the sandbox and save it to disk; `resume` continues it exactly.

        With parking on, the stopped QEMU process is kept (see `aenv.snapshot.parking`): the call
        returns once the device state is saved, and the changed pages are written right after,
        in the background. Otherwise both are written before the process ends.
        """
        workdir = self.workdir(sandbox.sandbox_id)
        state = sandbox.state
        stem = f"pause-{time.time_ns()}"
        park = self.parked.accepts()
        await sandbox.vm.command("stop")
        try:
            if park:
                devices = workdir / f"{stem}.devices"
                await sandbox.vm.command("xen-save-devices-state", filename=str(devices), live=False)
            else:
                devices, delta = await self._capture(sandbox, workdir, stem)
        except BaseException:
            with contextlib.suppress(VMError):
                await sandbox.vm.command("cont")
            raise
        previous = [state.delta, state.devices]
        state.paused, state.devices = True, str(devices)
        if park:
            # Until the capture is done the state names no delta, and the live process holds
            # the memory: a restarted node finds it through `pid` and captures it (`settle_paused`).
            state.delta = None
            state.save(workdir)
            capture = asyncio.create_task(self._capture_parked(sandbox, workdir / f"{stem}.delta", previous))
            self.parked.park(sandbox.sandbox_id, sandbox, capture)
            return state
        state.delta, state.pid = str(delta.path), None
        state.save(workdir)
        await sandbox.guest.destroy(keep_files=True)
        _unlink(previous)
        return state

    async def _capture_parked(self, sandbox: SandboxVM, delta: Path, previous: list[str | None]) -> None:
        """The changed pages of a parked sandbox, after its pause returned; never raises."""
        try:
            await self._capture_memory(sandbox.vm.pid, sandbox.manifest, delta)
        except Exception as exc:
            delta.unlink(missing_ok=True)
            log.error("saving the memory of paused sandbox %s failed, its process is kept: %s",
                      sandbox.sandbox_id, exc)  # fmt: skip
            return
        sandbox.state.delta = str(delta)
        sandbox.state.save(self.workdir(sandbox.sandbox_id))
        _unlink(previous)

    async def _release_parked(self, parked: ParkedVM) -> None:
        """End a parked sandbox's QEMU process once its pause is on disk."""
        sandbox = parked.sandbox
        await parked.capture
        if sandbox.state.delta is None:  # the capture failed: try again, and keep the process if it fails
            delta = self.workdir(sandbox.sandbox_id) / f"pause-{time.time_ns()}.delta"
            retry = asyncio.create_task(self._capture_parked(sandbox, delta, []))
            await retry
            if sandbox.state.delta is None:
                if not self.parked.closed:
                    self.parked.park(sandbox.sandbox_id, sandbox, retry)
                # else: left running; the next node start captures it (`settle_paused`)
                return
        await self._end_parked_process(sandbox)

    async def _end_parked_process(self, sandbox: SandboxVM) -> None:
        await sandbox.guest.destroy(keep_files=True)
        sandbox.state.pid = None
        sandbox.state.save(self.workdir(sandbox.sandbox_id))

    async def resume(self, state: SandboxState, init: GuestInit) -> SandboxVM:
        """Continue a paused sandbox from its saved state (or its parked process)."""
        parked = self.parked.take(state.sandbox_id)
        if parked is not None:
            return await self._resume_parked(parked, init)
        if not state.paused or state.delta is None or state.devices is None:
            raise EngineError(f"sandbox {state.sandbox_id} is not paused")
        manifest = self.repository.leased(state.snapshot_id, state.sandbox_id)
        await self._check_runnable(manifest)
        workdir = self.workdir(state.sandbox_id)
        stream = workdir / "resume.vmstate"
        prefix = self.repository.blob_path(manifest.vmstate_prefix).read_bytes()
        stream.write_bytes(devstate.splice(prefix, Path(state.devices).read_bytes()))
        return await self._launch(state, manifest, [Path(state.delta)], stream, init)

    async def _resume_parked(self, parked: ParkedVM, init: GuestInit) -> SandboxVM:
        """`cont` the kept process and `/init` the guest; the pause stays on disk for a retry."""
        sandbox = parked.sandbox
        await parked.capture  # the guest must not run while its pages are being read
        try:
            await sandbox.vm.command("cont")
            sandbox.envd.access_token = init.access_token
            await sandbox.envd.init(init.payload(), timeout=30)
        except BaseException:
            if sandbox.state.delta is not None or not sandbox.vm.alive():
                await self._end_parked_process(sandbox)  # a later resume starts from the pause on disk
            else:  # the pause never reached the disk: pause again where the guest is now
                try:
                    await self.pause(sandbox)
                except Exception:
                    log.exception("pausing %s again after a failed resume failed", sandbox.sandbox_id)
            raise
        sandbox.state.paused = False
        sandbox.state.save(self.workdir(sandbox.sandbox_id))
        return sandbox

    async def settle_paused(self, state: SandboxState) -> None:
        """At start-up: a sandbox paused by a node process that ended while it was parked.

        Its QEMU process may have outlived that node; if the pause's pages were not written yet,
        they are captured from it now. Either way the process is ended.
        """
        if not state.paused or state.pid is None:
            return
        workdir = self.workdir(state.sandbox_id)
        if state.delta is None:
            if not self._is_our_vm(state.pid, state.disk_layers):
                raise EngineError(f"paused sandbox {state.sandbox_id} lost its memory with its QEMU process")
            manifest = self.repository.leased(state.snapshot_id, state.sandbox_id)
            delta = workdir / f"pause-{time.time_ns()}.delta"
            await self._capture_memory(state.pid, manifest, delta)
            state.delta = str(delta)
        self._kill_stray(state.pid, state.disk_layers)
        state.pid = None
        state.save(workdir)

    def sandbox_states(self) -> list[SandboxState]:
        """Every sandbox this node has (running or paused), as last saved."""
        states = []
        for state_file in self.sandboxes_dir.glob(f"*/{STATE_FILE}"):
            with contextlib.suppress(OSError, ValueError, TypeError):
                states.append(SandboxState.load(state_file.parent))
        return states

    def collect_garbage(self, *, grace_seconds: float | None = None) -> GarbageReport:
        """Remove disk layers and blobs nothing refers to any more (blobs: see `repository.gc`)."""
        used = {layer for m in self.repository.list() for layer in m.disk_layers}
        used |= {layer for state in self.sandbox_states() for layer in state.disk_layers}
        orphans = sorted(self.layers.all_ids() - used)
        for layer in orphans:
            self.layers.remove(layer)
        for stream in self.runtime_dir.glob("*.vmstate"):
            if not self.repository.is_live(stream.stem):
                stream.unlink(missing_ok=True)
        blobs = self.repository.gc(grace_seconds=grace_seconds)
        return GarbageReport(removed_layers=tuple(orphans), blobs=blobs)

    async def set_policy(self, sandbox: SandboxVM, policy: EgressPolicy) -> None:
        """Replace a running sandbox's egress rules (one nft transaction) and remember them."""
        await sandbox.guest.network.apply_policy(policy)
        sandbox.state.policy = asdict(policy)
        sandbox.state.save(sandbox.guest.workdir)

    async def adopt(
        self, state: SandboxState, access_token: str | None, network: SandboxNetwork | None = None
    ) -> SandboxVM:
        """Take over a sandbox whose QEMU outlived the node process that started it.

        `network` is its namespace as the network pool re-adopted it, if the pool made it.
        """
        if state.paused or not self._is_our_vm(state.pid, state.disk_layers):
            raise EngineError(f"sandbox {state.sandbox_id} has no running VM left to adopt")
        manifest = self.repository.leased(state.snapshot_id, state.sandbox_id)
        workdir = self.workdir(state.sandbox_id)
        vm = await VirtualMachine.adopt(
            self._clone_config(manifest, state.disk_layers[-1]), workdir, state.pid
        )
        network = network or SandboxNetwork(state.network_name)
        guest = GuestVM(vm=vm, network=network, envd=EnvdLink(network, access_token), workdir=workdir)
        # After a snapshot the top of the root chain has the sealed layer's successor's node name.
        nodes = await vm.command("query-named-block-nodes", flat=True)
        top = f"n{state.disk_layers[-1]}"
        root_node = top if any(n.get("node-name") == top for n in nodes) else "root"
        return SandboxVM(state=state, guest=guest, manifest=manifest, root_node=root_node)

    def serial_lines(self, sandbox_id: str) -> list[str]:
        """The sandbox's serial console so far, across its pauses and resumes."""
        try:
            text = (self.workdir(sandbox_id) / SERIAL_LOG).read_text(errors="replace")
        except FileNotFoundError:
            return []
        return [line.rstrip("\r") for line in text.splitlines() if line.strip()]

    def load_state(self, sandbox_id: str) -> SandboxState:
        return SandboxState.load(self.workdir(sandbox_id))

    def _is_our_vm(self, pid: int | None, layers: list[str]) -> bool:
        """Whether `pid` is a QEMU started on one of these disk layers: a VM's identity after a crash.

        Layer ids are random, and QEMU's command line names the top layer it was started on.
        """
        if pid is None:
            return False
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        return QEMU_BINARY_NAME in cmdline and any(
            str(self.layers.path(i)).encode() in cmdline for i in layers
        )

    def _kill_stray(self, pid: int | None, layers: list[str]) -> None:
        """Kill a VM a previous node process left behind (identified, not guessed by name)."""
        if self._is_our_vm(pid, layers):
            assert pid is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def cleanup_warm_leftovers(self) -> int:
        """At start-up: end the warm VMs of a node process that did not stop cleanly."""
        leftovers = 0
        for record in self.runtime_dir.glob(f"warm/*/{WARM_FILE}"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                warm = json.loads(record.read_text())
                self._kill_stray(warm["pid"], [warm["top_layer"]])
                SandboxNetwork(warm["network"]).destroy()
                self.layers.remove(warm["top_layer"])
                self.repository.release(warm["snapshot_id"], record.parent.name)
                leftovers += 1
            shutil.rmtree(record.parent, ignore_errors=True)
        return leftovers

    async def kill(self, sandbox: SandboxVM | SandboxState) -> None:
        """End a running or paused sandbox and free everything it owns."""
        state = sandbox.state if isinstance(sandbox, SandboxVM) else sandbox
        parked = self.parked.take(state.sandbox_id)
        if parked is not None:
            await parked.capture
            sandbox, state = parked.sandbox, parked.sandbox.state
        if isinstance(sandbox, SandboxVM):
            await sandbox.guest.destroy(keep_files=True)
        elif not state.paused:  # left running by a crashed node: its VM and namespace are strays
            self._kill_stray(state.pid, state.disk_layers)
            SandboxNetwork(state.network_name).destroy()
        # A paused sandbox has no network: the name it had may belong to another sandbox by now.
        self.layers.remove(state.disk_layers[-1])
        shutil.rmtree(self.workdir(state.sandbox_id), ignore_errors=True)
        self.repository.release(state.snapshot_id, state.sandbox_id)

    # -- snapshots and forks ---------------------------------------------------------------

    async def snapshot(
        self,
        sandbox: SandboxVM,
        *,
        alias: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> SnapshotManifest:
        """Commit a snapshot of a running sandbox; it is stopped only for the capture."""
        staging = self.repository.staging_dir()
        state = sandbox.state
        sealed = state.disk_layers[-1]
        new_top = None
        try:
            await sandbox.vm.command("stop")
            try:
                devices, delta = await self._capture(sandbox, staging, "snapshot")
                new_top = new_layer_id()
                seal = {
                    "node-name": sandbox.root_node,
                    "snapshot-file": str(self.layers.path(new_top)),
                    "snapshot-node-name": f"n{new_top}",
                    "format": "qcow2",
                    "mode": "absolute-paths",
                }
                await sandbox.vm.command("blockdev-snapshot-sync", **seal)
            finally:
                with contextlib.suppress(VMError):
                    await sandbox.vm.command("cont")
            self.layers.seal(sealed)
            sandbox.root_node = seal["snapshot-node-name"]
            state.disk_layers.append(new_top)
            state.save(self.workdir(state.sandbox_id))
            manifest = await asyncio.to_thread(
                self._commit_snapshot,
                sandbox,
                staging,
                devices,
                delta,
                state.disk_layers[:-1],
                alias,
                metadata or {},
            )
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return manifest

    def _commit_snapshot(
        self,
        sandbox: SandboxVM,
        staging: Path,
        devices: Path,
        delta: memory.DeltaInfo,
        layers: list[str],
        alias: str | None,
        metadata: dict[str, str],
    ) -> SnapshotManifest:
        origin = sandbox.manifest
        delta_digest = self.repository.put_blob(delta.path, digest=delta.digest, move=True, verify=False)
        manifest = SnapshotManifest(
            id=new_snapshot_id(),
            kind="snapshot",
            alias=alias,
            created_at=utc_now(),
            source={"sandbox_id": sandbox.sandbox_id, "snapshot_id": origin.id},
            machine=origin.machine,
            memory_image=origin.memory_image,
            memory_deltas=(delta_digest,),
            device_state=self.repository.put_blob(devices, move=True),
            vmstate_prefix=origin.vmstate_prefix,
            disk_layers=tuple(layers),
            runtime=origin.runtime,
            metadata=metadata,
            sizes={delta_digest: self.repository.blob_path(delta_digest).stat().st_size},
        )
        self.repository.commit(manifest)
        return manifest

    async def fork(self, sandbox: SandboxVM, children: list[tuple[str, GuestInit]]) -> list[SandboxVM]:
        """Start children from the sandbox's current state; the source keeps running.

        The children share one hidden snapshot, deleted as soon as the last of them is gone.
        """
        manifest = await self.snapshot(sandbox, metadata={"aenv.fork-of": sandbox.sandbox_id})
        policy = sandbox.state.egress
        results = await asyncio.gather(
            *(self.start(manifest.id, child_id, init, policy) for child_id, init in children),
            return_exceptions=True,
        )
        self.repository.delete(manifest.id, defer=True)
        started = [r for r in results if isinstance(r, SandboxVM)]
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            for child in started:
                await self.kill(child)
            raise EngineError(f"fork failed: {failures[0]}") from failures[0]
        return started


def _unlink(paths: list[str | None]) -> None:
    for path in paths:
        if path:
            Path(path).unlink(missing_ok=True)
