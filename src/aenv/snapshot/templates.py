"""Template builds: one cold boot whose RAM becomes the immutable memory image of every clone.

The guest boots with its RAM in a shared file in the repository's staging area, runs the
template's start command until its ready check passes, and is stopped and saved without RAM
(`aenv.vmm.migration.save`). The file then becomes the memory image blob, the stream's prefix
and the device sections become blobs too, the boot disk's writable layer is sealed, and the
manifest is committed last: an interrupted build leaves no template behind.

User builds (`build_steps`, the E2B template build API) boot the same way on a given layer
chain (an image's root filesystem, or another template's disk), on a network with the node's
egress (so that steps can install packages), and first run their steps in the guest. After
each step the disk's top layer is frozen under a new one while the guest runs
(`migration.seal_disk`) and recorded in the step cache, so a rebuild boots on the last layer
whose steps are unchanged and runs only the rest.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..guest.artifacts import GuestArtifacts
from ..network.egress import EgressPolicy
from ..repository.files import file_digest
from ..repository.manifest import MachineShape, RuntimeContext, SnapshotManifest, new_snapshot_id, utc_now
from ..runtime.layers import new_layer_id
from ..template.runner import LOGIN_SHELL, LineLog, Log, StepRunner, sync
from ..template.stepcache import CachedStep, StepCache
from ..template.steps import BuildState, Step, step_key
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
# $1: MiB that must be free on /; grows the filesystem to its device when they are not.
FREE_DISK_SCRIPT = """
free() { df -Pk / | awk 'NR==2 {print int($4 / 1024)}'; }
[ "$(free)" -ge "$1" ] && { echo "$(free) MiB free on /"; exit 0; }
command -v resize2fs >/dev/null || { echo "growing / needs resize2fs (e2fsprogs) in the image"; exit 1; }
device=$(awk '$2 == "/" {print $1}' /proc/mounts | tail -n 1)
resize2fs "$device" 2>&1 | tail -n 1
[ "$(free)" -ge "$1" ] && { echo "$(free) MiB free on / after growing it"; exit 0; }
echo "only $(free) MiB free on / after growing it"; exit 1
"""
StageRun = Callable[[StepRunner, BuildState], Awaitable[BuildState]]


@dataclass(frozen=True)
class Stage:
    """One cached unit of a user build: the base step's provisioning or a user step."""

    name: str  # as the SDK names steps: "base", "1", "2", ...
    key: Step  # what the cache key is made of
    run: StageRun
    forced: bool = False


@dataclass(frozen=True)
class StepBuild:
    """A user build as the VM side sees it: where it starts and what it runs."""

    base: tuple[str, ...]  # sealed disk layers, bottom to top
    state: BuildState  # ENV, USER and WORKDIR before the first stage
    stages: list[Stage]
    start_cmd: str | None = None
    ready_cmd: str | None = None
    vcpus: int | None = None
    memory_mib: int = 512
    min_free_disk_mib: int | None = None  # free space the template's root filesystem must have
    metadata: dict[str, str] = field(default_factory=dict)


class StageFailed(EngineError):
    """A stage of a user build failed; `stage` names it as the SDK reports failed steps."""

    def __init__(self, stage: str, message: str):
        super().__init__(message)
        self.stage = stage


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
            await self._save(guest, staging)
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

    async def build_steps(
        self,
        plan: StepBuild,
        cache: StepCache,
        runner: Callable[[GuestVM], StepRunner],
        say: Callable[[str, str], None],
    ) -> SnapshotManifest:
        """Run a user build's stages (cached ones skipped), finalize it and commit the template.

        `say(stage, message)` logs progress; a failed stage raises `StageFailed`. On failure
        nothing is committed and no VM is left; layers of stages that passed stay cached.
        """
        host, layers = self.host, self.host.layers
        chain, state, first = self._cached_prefix(plan, cache, say)
        staging = host.repository.staging_dir()
        guest: GuestVM | None = None
        upper = await layers.create_upper(chain[-1])
        try:
            if plan.min_free_disk_mib:  # room to grow into at finalize (sparse: costs nothing yet)
                await _enlarge(layers.path(upper), plan.min_free_disk_mib)
            shape = await self._machine(plan.vcpus or default_vcpus(host.accel), plan.memory_mib)
            config = guest_machine(
                host.runtime.boot_files(shape), layers.path(upper), accel=host.accel, vcpus=shape.vcpus,
                memory_mib=shape.memory_mib, memory_mode=MemoryMode.SHARED_FILE,
                memory_path=staging / "memory.img",
            )  # fmt: skip
            try:
                # the node's egress (E2B's default policy), so steps can fetch packages
                network = await host.network(f"aenv-b{upper[-10:]}", EgressPolicy())
                guest = await boot_guest(config, staging / "vm", network=network)
                await guest.envd.init(GuestInit(default_user="root").payload())
            except Exception as exc:
                raise StageFailed("base", f"the build VM did not start: {exc}") from exc
            node = "root"
            for stage in plan.stages[first:]:
                say(stage.name, describe(stage, plan))
                try:
                    state = await stage.run(runner(guest), state)
                    await sync(guest.envd)
                except Exception as exc:
                    raise StageFailed(stage.name, str(exc)) from exc
                top = new_layer_id()
                try:
                    await migration.seal_disk(guest.vm, node, layers.path(top), f"n{top}")
                except BaseException:
                    layers.remove(top)
                    raise
                layers.seal(upper)
                chain = (*chain, upper)
                cache.put(stage_key(chain[-2], stage), CachedStep(chain, state))
                upper, node = top, f"n{top}"
            runtime = RuntimeContext(
                env_vars=state.env, workdir=state.workdir, user=state.user,
                start_cmd=plan.start_cmd, ready_cmd=plan.ready_cmd,
            )  # fmt: skip
            say("finalize", "starting the template" if plan.start_cmd else "saving the template")
            try:
                if plan.min_free_disk_mib:
                    await ensure_free_disk(
                        guest.envd, plan.min_free_disk_mib, lambda line: say("finalize", line)
                    )
                await self._prepare(guest, runtime, READY_TIMEOUT, lambda line: say("finalize", line))
            except Exception as exc:
                raise StageFailed("finalize", str(exc)) from exc
            await self._save(guest, staging)
            guest = None
            layers.seal(upper)
            return await asyncio.to_thread(
                self._commit, staging, None, (*chain, upper), runtime, plan.metadata, shape
            )
        except BaseException:
            if guest is not None:
                await guest.destroy()
            layers.remove(upper)
            raise
        finally:
            host.repository.discard_staging(staging)

    def _cached_prefix(
        self, plan: StepBuild, cache: StepCache, say: Callable[[str, str], None]
    ) -> tuple[tuple[str, ...], BuildState, int]:
        """The layer chain and state after the longest run of cached, unforced first stages."""
        chain, state = plan.base, plan.state
        for index, stage in enumerate(plan.stages):
            hit = None if stage.forced else cache.get(stage_key(chain[-1], stage), self.host.layers.exists)
            if hit is None:
                return chain, state, index
            say(stage.name, f"CACHED {describe(stage, plan)}")
            chain, state = hit.chain, hit.state
        return chain, state, len(plan.stages)

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


async def ensure_free_disk(envd: EnvdLink, mib: int, log: Log) -> None:
    """Grow the root filesystem onto its (enlarged) disk when it has less than `mib` MiB free.

    As E2B's ``minFreeDiskMb``: best effort (an image without ``resize2fs`` keeps its size, and
    the log says so), never shrinking.
    """
    captured: list[bytes] = []
    argv = ["/bin/sh", "-c", FREE_DISK_SCRIPT, "sh", str(mib)]
    code = await envd.execute(argv, timeout=300, on_output=captured.append)
    output = b"".join(captured).decode(errors="replace").strip()
    log(output if code == 0 else f"minFreeDiskMb {mib} not met: {output[-300:]}")


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


def stage_key(parent: str, stage: Stage) -> str:
    return step_key(parent, stage.key)


def describe(stage: Stage, plan: StepBuild) -> str:
    """A stage as build logs show it: ``[step 3/7] RUN make`` (the progress the CLI shows)."""
    steps = sum(1 for s in plan.stages if s.name != "base")
    where = "[base]" if stage.name == "base" else f"[step {stage.name}/{steps}]"
    return f"{where} {stage.key.type} {' '.join(stage.key.args)[:200]}"
