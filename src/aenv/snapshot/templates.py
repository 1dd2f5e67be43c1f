"""Template VMs: one cold boot whose RAM becomes the immutable memory image of every clone.

The guest boots with its RAM in a shared file in the repository's staging area, runs the
template's start command until its ready check passes, and is stopped and saved without RAM
(`aenv.vmm.migration.save`). The file then becomes the memory image blob, the stream's prefix
and the device sections become blobs too, the boot disk's writable layer is sealed, and the
manifest is committed last: an interrupted build leaves no template behind.

`TemplateBuilder.build` is the node's own template (`base`, from the guest artifacts).
`TemplateBuilder.vm` is the same VM for a user build (`aenv.template.stages` runs its steps in
it, the E2B template build API above that): it boots on a given layer chain (an image's root
filesystem, or another template's disk), on a network with the node's egress, so that steps
can install packages; after each step the disk's top layer is frozen under a new one while the
guest runs (`BuildVM.seal`, `migration.seal_disk`), so the build's cache can boot a rebuild on
the last layer whose steps are unchanged. This package imports nothing of `aenv.template`.

Start and ready commands run here too (`start_runtime`): after a template's boot, and after a
sandbox's boot from its disk (`aenv.snapshot.lifecycle`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from ..guest.artifacts import GuestArtifacts
from ..network.egress import EgressPolicy
from ..repository.contract import Repository
from ..repository.files import file_digest
from ..repository.manifest import MachineShape, RuntimeContext, SnapshotManifest, new_snapshot_id, utc_now
from ..runtime.contract import RuntimeResolver
from ..runtime.layers import LayerStore, new_layer_id
from ..vmm import devstate, migration
from ..vmm.accel import default_vcpus
from ..vmm.envd_link import EnvdLink
from ..vmm.launcher import BootFiles, GuestVM, boot_guest, guest_machine
from ..vmm.machine import MACHINE_TYPE, MemoryMode
from .host import Host
from .model import EngineError, GuestInit

log = logging.getLogger(__name__)

DEFAULT_READY_CMD = "sleep 20"  # E2B's ready command for a start command given without one
READY_RETRY_INTERVAL = 2.0  # seconds between ready command attempts, as E2B
READY_TIMEOUT = 300.0  # seconds the ready command has to succeed, as E2B
START_SCRIPT = 'if [ -x /bin/bash ]; then /bin/bash -l -c "$1"; else /bin/sh -l -c "$1"; fi; echo $? > "$2"'
# Start and ready commands run in a login shell, as E2B runs them (`bash -l -c`).
LOGIN_SHELL = [
    "/bin/sh", "-c", 'if [ -x /bin/bash ]; then exec /bin/bash -l -c "$1"; fi; exec /bin/sh -l -c "$1"', "sh",
]  # fmt: skip
Log = Callable[[str], None]


class LineLog:
    """Turns a command's output chunks into log lines (called from envd's reader thread)."""

    def __init__(self, log: Log):
        self.log = log
        self.partial = b""

    def feed(self, chunk: bytes) -> None:
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        for line in lines:
            self.log(line.decode(errors="replace").rstrip("\r"))

    def flush(self) -> None:
        if self.partial:
            self.log(self.partial.decode(errors="replace"))
            self.partial = b""


class SyncFailed(EngineError):
    """The build VM could not write its files out before a layer was sealed."""


async def sync(envd: EnvdLink) -> None:
    """The build VM's writes on its disk, before a layer is sealed (envd's own route: no shell needed)."""
    status, answer = await envd.post_json("/aenv/build/sync", {}, timeout=300)
    if status >= 300:
        raise SyncFailed(f"sync failed: {answer[:200]!r}")


class BuildVM:
    """A template's VM (`TemplateBuilder.vm`): its guest, and the disk's layer chain as it grows."""

    def __init__(
        self, builder: TemplateBuilder, guest: GuestVM, staging: Path, chain: tuple[str, ...],
        upper: str, shape: MachineShape,
    ):  # fmt: skip
        self._builder, self._layers = builder, builder.layers
        self.guest: GuestVM | None = guest  # None once saved
        self.chain = chain  # sealed layers, bottom to top
        self.upper = upper  # the writable layer on top of them
        self._staging, self._shape = staging, shape
        self._node = "root"  # the writable layer's block node

    @property
    def envd(self) -> EnvdLink:
        assert self.guest is not None, "the build VM was saved"
        return self.guest.envd

    async def seal(self) -> tuple[str, ...]:
        """Freeze the writable layer under a new one while the guest runs (the caller has synced
        the guest's writes: `sync`); the chain with it on top, which a later build can boot on."""
        assert self.guest is not None, "the build VM was saved"
        top = new_layer_id()
        try:
            await migration.seal_disk(self.guest.vm, self._node, self._layers.path(top), f"n{top}")
        except BaseException:
            self._layers.remove(top)
            raise
        self._layers.seal(self.upper)
        self.chain = (*self.chain, self.upper)
        self.upper, self._node = top, f"n{top}"
        return self.chain

    async def prepare(self, runtime: RuntimeContext, timeout: float, log: Log | None = None) -> None:
        """The template's environment, and its start command run until the ready check passes."""
        assert self.guest is not None, "the build VM was saved"
        await self._builder._prepare(self.guest, runtime, timeout, log)

    async def commit(
        self, runtime: RuntimeContext, metadata: dict[str, str], alias: str | None = None
    ) -> SnapshotManifest:
        """Save the guest (the VM is gone afterwards) and commit the template."""
        assert self.guest is not None, "the build VM was saved"
        await self._builder._save(self.guest, self._staging)
        self.guest = None
        self._layers.seal(self.upper)
        return await asyncio.to_thread(
            self._builder._commit, self._staging, alias, (*self.chain, self.upper), runtime, metadata,
            self._shape,
        )  # fmt: skip


class TemplateBuilder:
    """Boots, prepares and commits template VMs from this node's guest artifacts."""

    def __init__(
        self,
        host: Host,
        repository: Repository,
        runtime: RuntimeResolver,
        layers: LayerStore,
        artifacts: GuestArtifacts,
    ):
        self.host = host
        self.repository, self.runtime, self.layers = repository, runtime, layers
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
        """Boot a fresh guest on the base image, run the start command until the ready check
        passes, commit it."""
        runtime = runtime or RuntimeContext()
        started = time.monotonic()
        base = self.layers.import_base(self.artifacts.base_image, self.artifacts.base_image_digest)
        async with self.vm((base,), vcpus=vcpus, memory_mib=memory_mib, egress=False) as build:
            await build.prepare(runtime, ready_timeout)
            manifest = await build.commit(runtime, metadata or {}, alias)
        log.info("template %s (%s) built in %.1f s", manifest.id, alias, time.monotonic() - started)
        return manifest

    @contextlib.asynccontextmanager
    async def vm(
        self,
        chain: tuple[str, ...],
        *,
        vcpus: int | None = None,
        memory_mib: int = 512,
        grow_mib: int | None = None,
        egress: bool = True,
    ) -> AsyncIterator[BuildVM]:
        """A template VM booted on a new writable layer over `chain` (sealed layers, bottom to top),
        the disk `grow_mib` MiB larger (room for its filesystem to grow into: sparse, it costs
        nothing yet). With `egress`, on a network with the node's egress (E2B's default policy),
        else on one without any way out.

        Nothing is committed unless the caller does (`BuildVM.commit`); on failure no VM is left
        and the writable layer goes, while the layers sealed on the way (`BuildVM.seal`) stay.
        """
        host, layers = self.host, self.layers
        staging = self.repository.staging_dir()
        upper = await layers.create_upper(chain[-1])
        build: BuildVM | None = None
        try:
            if grow_mib:
                await _enlarge(layers.path(upper), grow_mib)
            shape = await self._machine(vcpus or default_vcpus(host.accel), memory_mib)
            boot = await asyncio.to_thread(self.runtime.boot_files, shape)
            config = guest_machine(
                boot, layers.path(upper), accel=host.accel, vcpus=shape.vcpus, memory_mib=memory_mib,
                memory_mode=MemoryMode.SHARED_FILE, memory_path=staging / "memory.img",
            )  # fmt: skip
            name = f"aenv-b{upper[-10:]}"
            if egress:
                guest = await boot_guest(
                    config, staging / "vm", network=await host.network(name, EgressPolicy())
                )
            else:
                guest = await boot_guest(config, staging / "vm", network_name=name)
            build = BuildVM(self, guest, staging, chain, upper, shape)
            yield build
        except BaseException:
            if build is not None and build.guest is not None:
                await build.guest.destroy()
            layers.remove(build.upper if build is not None else upper)
            raise
        finally:
            self.repository.discard_staging(staging)

    async def _save(self, guest: GuestVM, staging: Path) -> None:
        """Stop the guest once it is quiet and save its state without RAM; the VM is gone afterwards.

        Dirty files are written out and the host's connections closed first, and the guest is
        given the moment it needs to finish with them: otherwise every clone would do that work
        after its restore (under TCG, ~0.2 s of CPU per clone before it answers anything).
        """
        await sync(guest.envd)
        guest.envd.close()  # clones should not inherit an open connection to this host
        waited = await guest.vm.settle()
        log.debug("template guest quiet after %.1f s", waited)
        await migration.stop(guest.vm)
        await migration.save(guest.vm, staging / "vmstate", staging / "devices")
        await guest.vm.command("quit")
        await guest.vm.wait(30)
        await guest.destroy(keep_files=True)

    async def _machine(self, vcpus: int, memory_mib: int) -> MachineShape:
        """The template's machine, its boot files stored in the repository first."""
        repository = self.repository
        boot = BootFiles.from_artifacts(self.artifacts, self.host.accel)
        kernel, initramfs, tools = await asyncio.to_thread(
            lambda: [repository.put_blob(p) for p in (boot.kernel, boot.initramfs, boot.tools_image)]
        )
        return MachineShape(
            qemu_version=await self.host.qemu_version(), machine_type=MACHINE_TYPE, vcpus=vcpus,
            memory_mib=memory_mib, accel=self.host.accel, kernel_digest=kernel,
            initramfs_digest=initramfs, tools_digest=tools, cmdline=boot.cmdline,
        )  # fmt: skip

    async def _prepare(
        self, guest: GuestVM, runtime: RuntimeContext, timeout: float, log: Log | None = None
    ) -> None:
        init = GuestInit(runtime.env_vars, default_user=runtime.user, default_workdir=runtime.workdir)
        await guest.envd.init(init.payload())
        await start_runtime(guest.envd, runtime, timeout, log, build=True)

    def _commit(
        self,
        staging: Path,
        alias: str | None,
        layers: tuple[str, ...],
        runtime: RuntimeContext,
        metadata: dict[str, str],
        shape: MachineShape,
    ) -> SnapshotManifest:
        repository = self.repository
        devices = (staging / "devices").read_bytes()
        prefix = devstate.split_prefix((staging / "vmstate").read_bytes(), devices)
        image = staging / "memory.img"
        image_size = image.stat().st_size
        memory_image = file_digest(image)
        self.runtime.keep_local(image, memory_image)
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
            disk_layers=self.runtime.publish_layers(list(layers)),
            runtime=runtime,
            metadata=metadata,
            sizes={memory_image: image_size},
        )
        repository.commit(manifest)
        return manifest


async def start_runtime(
    envd: EnvdLink, runtime: RuntimeContext, timeout: float, log: Log | None = None, *, build: bool = False
) -> None:
    """Start the template's start command in the background and poll its ready command until it
    succeeds (after a template's boot, and after a sandbox's boot from its disk).

    Both run as E2B runs them: with ``bash -l -c`` (``sh -l -c`` in images without bash) as the
    template's user in its workdir. The ready command is retried every 2 s for up to `timeout`
    seconds; a start command that fails before then fails at once, naming its exit code. In a
    `build`, a start command without a ready command waits 20 s (E2B's default ready command).
    `log` gets the ready command's output and each attempt's outcome.
    """
    user = runtime.user or "root"
    say = log or (lambda line: None)
    ready_cmd = runtime.ready_cmd or (DEFAULT_READY_CMD if build and runtime.start_cmd else None)
    status = f"/tmp/.aenv-start-{secrets.token_hex(6)}.status"
    if runtime.start_cmd:
        say(f"[start cmd]: {runtime.start_cmd}")
        await envd.execute(
            start_command(runtime.start_cmd, status), user=user, cwd=runtime.workdir, background=True
        )
    if not ready_cmd:
        return
    say(f"[ready cmd]: {ready_cmd}")
    deadline = time.monotonic() + timeout
    while True:
        lines = LineLog(say)
        left = max(deadline - time.monotonic(), 1.0)
        code = await envd.execute(
            [*LOGIN_SHELL, ready_cmd], user=user, cwd=runtime.workdir, timeout=left, on_output=lines.feed
        )
        lines.flush()
        if code == 0:
            say("template is ready")
            return
        say(f"template is not ready: the ready command exited with code {code}")
        if runtime.start_cmd:
            await _check_started(envd, runtime.start_cmd, status)
        if time.monotonic() + READY_RETRY_INTERVAL > deadline:
            raise EngineError(
                f"ready command {ready_cmd!r} did not succeed within {timeout:.0f} s (last exit code {code})"
            )
        await asyncio.sleep(READY_RETRY_INTERVAL)


async def _enlarge(disk: Path, mib: int) -> None:
    """Make the disk `mib` MiB larger (its filesystem is grown later, in the guest, if need be)."""
    command = ["qemu-img", "resize", "-q", "-f", "qcow2", str(disk), f"+{mib}M"]
    await asyncio.to_thread(subprocess.run, command, check=True, capture_output=True)


def start_command(command: str, status: str) -> list[str]:
    """The start command through a login shell, its exit code written to `status` when it ends."""
    return ["/bin/sh", "-c", START_SCRIPT, "sh", command, status]


async def _check_started(envd: EnvdLink, command: str, status: str) -> None:
    """Fail if the start command has ended with an error (E2B fails the build then)."""
    captured: list[bytes] = []
    await envd.execute(["/bin/sh", "-c", f"cat {status} 2>/dev/null"], timeout=30, on_output=captured.append)
    text = b"".join(captured).decode(errors="replace").strip()
    if text.isdigit() and text != "0":
        raise EngineError(f"start command {command!r} exited with code {text} before the template was ready")
