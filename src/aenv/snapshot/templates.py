"""Template builds: one cold boot whose RAM becomes the immutable memory image of every clone.

The guest boots with its RAM in a shared file in the repository's staging area, runs the
template's start command until its ready check passes, and is stopped and saved without RAM
(`aenv.vmm.migration.save`). The file then becomes the memory image blob, the stream's prefix
and the device sections become blobs too, the boot disk's writable layer is sealed, and the
manifest is committed last: an interrupted build leaves no template behind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from ..guest.artifacts import GuestArtifacts
from ..vmm import migration
from ..vmm.accel import default_vcpus
from ..vmm.envd_link import EnvdLink
from ..vmm.launcher import BootFiles, GuestVM, boot_guest, guest_machine
from ..vmm.machine import MACHINE_TYPE, MemoryMode
from . import devstate
from .host import Host
from .manifest import MachineShape, RuntimeContext, SnapshotManifest, new_snapshot_id, utc_now
from .model import EngineError, GuestInit
from .repository import file_digest

log = logging.getLogger(__name__)


class TemplateBuilder:
    """Boots, prepares and commits templates from this node's guest artifacts."""

    def __init__(self, host: Host, artifacts: GuestArtifacts):
        self.host = host
        self.artifacts = artifacts

    async def build(
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
        host, layers = self.host, self.host.layers
        runtime = runtime or RuntimeContext()
        started = time.monotonic()
        staging = host.repository.staging_dir()
        guest: GuestVM | None = None
        upper: str | None = None
        try:
            shape = await self._machine(vcpus or default_vcpus(host.accel), memory_mib)
            base = layers.import_base(self.artifacts.base_image, self.artifacts.base_image_digest)
            upper = await layers.create_upper(base)
            boot = await asyncio.to_thread(host.runtime.boot_files, shape)
            config = guest_machine(
                boot, layers.path(upper), accel=host.accel, vcpus=shape.vcpus,
                memory_mib=memory_mib, memory_mode=MemoryMode.SHARED_FILE, memory_path=staging / "memory.img",
            )  # fmt: skip
            guest = await boot_guest(config, staging / "vm", network_name=f"aenv-b{upper[-10:]}")
            await self._prepare(guest, runtime, ready_timeout)
            guest.envd.close()  # clones should not inherit an open connection to this host
            await migration.stop(guest.vm)
            await migration.save(guest.vm, staging / "vmstate", staging / "devices")
            await guest.vm.command("quit")
            await guest.vm.wait(30)
            await guest.destroy(keep_files=True)
            guest = None
            layers.seal(upper)
            manifest = await asyncio.to_thread(
                self._commit, staging, alias, (base, upper), runtime, metadata or {}, shape
            )
        except BaseException:
            if guest is not None:
                await guest.destroy()
            if upper is not None:
                layers.remove(upper)
            raise
        finally:
            host.repository.discard_staging(staging)
        log.info("template %s (%s) built in %.1f s", manifest.id, alias, time.monotonic() - started)
        return manifest

    async def _machine(self, vcpus: int, memory_mib: int) -> MachineShape:
        """The template's machine, its boot files stored in the repository first."""
        repository = self.host.repository
        boot = BootFiles.from_artifacts(self.artifacts, self.host.accel)
        kernel, initramfs, tools = await asyncio.to_thread(
            lambda: [repository.put_blob(p) for p in (boot.kernel, boot.initramfs, boot.tools_image)]
        )
        return MachineShape(
            qemu_version=await self.host.qemu_version(), machine_type=MACHINE_TYPE, vcpus=vcpus,
            memory_mib=memory_mib, accel=self.host.accel, kernel_digest=kernel,
            initramfs_digest=initramfs, tools_digest=tools, cmdline=boot.cmdline,
        )  # fmt: skip

    async def _prepare(self, guest: GuestVM, runtime: RuntimeContext, timeout: float) -> None:
        init = GuestInit(runtime.env_vars, default_user=runtime.user, default_workdir=runtime.workdir)
        await guest.envd.init(init.payload())
        await start_runtime(guest.envd, runtime, timeout)

    def _commit(
        self,
        staging: Path,
        alias: str | None,
        layers: tuple[str, str],
        runtime: RuntimeContext,
        metadata: dict[str, str],
        shape: MachineShape,
    ) -> SnapshotManifest:
        repository = self.host.repository
        devices = (staging / "devices").read_bytes()
        prefix = devstate.split_prefix((staging / "vmstate").read_bytes(), devices)
        image = staging / "memory.img"
        image_size = image.stat().st_size
        memory_image = file_digest(image)
        self.host.runtime.keep_local(image, memory_image)
        repository.put_blob(image, digest=memory_image, move=True, verify=False)
        manifest = SnapshotManifest(
            id=new_snapshot_id(),
            kind="template",
            alias=alias,
            created_at=utc_now(),
            source={},
            machine=shape,
            memory_image=memory_image,
            memory_deltas=(),
            device_state=repository.put_bytes(devices),
            vmstate_prefix=repository.put_bytes(prefix),
            disk_layers=self.host.runtime.publish_layers(list(layers)),
            runtime=runtime,
            metadata=metadata,
            sizes={memory_image: image_size},
        )
        repository.commit(manifest)
        return manifest


async def start_runtime(envd: EnvdLink, runtime: RuntimeContext, timeout: float) -> None:
    """Start the template's start command in the background and wait until its ready check passes
    (after a template's boot, and after a sandbox's boot from its disk)."""
    user = runtime.user or "root"
    if runtime.start_cmd:
        await envd.run(runtime.start_cmd, user=user, cwd=runtime.workdir, background=True)
    if runtime.ready_cmd:
        deadline = time.monotonic() + timeout
        while await envd.run(runtime.ready_cmd, user=user, cwd=runtime.workdir, timeout=30) != 0:
            if time.monotonic() > deadline:
                raise EngineError(f"ready check {runtime.ready_cmd!r} did not pass within {timeout:.0f} s")
            await asyncio.sleep(0.5)
