"""A user build's stages run in the engine's template VM, each one's disk layer cached.

The build (`aenv.template.builds`) hands `StepBuilder` a plan: the layers it starts on, the
state they carry and its stages (the base step's provisioning, then the user's steps). The
longest run of unchanged first stages is found in the step cache (`aenv.template.stepcache`),
so a rebuild boots on the last cached layer and runs only the rest. The VM itself, its disk's
layers and the template's commit are the snapshot engine's (`aenv.snapshot.templates.BuildVM`):
after each stage this module syncs the guest's writes, seals the layer and records it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aenv.repository.manifest import RuntimeContext, SnapshotManifest
from aenv.runtime.layers import LayerStore
from aenv.snapshot.model import EngineError, GuestInit
from aenv.snapshot.templates import READY_TIMEOUT, Log, TemplateBuilder, sync
from aenv.template.runner import StepRunner
from aenv.template.stepcache import CachedStep, StepCache
from aenv.template.steps import BuildState, Step, step_key
from aenv.vmm.envd_link import EnvdLink

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
Say = Callable[[str, str], None]  # (stage, message): the build's log


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


class StepBuilder:
    """Runs user builds' stages in the engine's template VMs; a cached entry is a hit while its
    disk layers are still in `layers` (the node's collection may have removed them)."""

    def __init__(self, builder: TemplateBuilder, layers: LayerStore):
        self.builder = builder
        self.layers = layers

    async def build_steps(
        self, plan: StepBuild, cache: StepCache, runner: Callable[[EnvdLink], StepRunner], say: Say
    ) -> SnapshotManifest:
        """Run a user build's stages (cached ones skipped), finalize it and commit the template.

        `say(stage, message)` logs progress; a failed stage raises `StageFailed`. On failure
        nothing is committed and no VM is left; layers of stages that passed stay cached.
        """
        chain, state, first = self._cached_prefix(plan, cache, say)
        async with contextlib.AsyncExitStack() as stack:
            try:
                build = await stack.enter_async_context(
                    self.builder.vm(
                        chain, vcpus=plan.vcpus, memory_mib=plan.memory_mib, grow_mib=plan.min_free_disk_mib
                    )
                )
                await build.envd.init(GuestInit(default_user="root").payload())
            except Exception as exc:
                raise StageFailed("base", f"the build VM did not start: {exc}") from exc
            for stage in plan.stages[first:]:
                say(stage.name, describe(stage, plan))
                try:
                    state = await stage.run(runner(build.envd), state)
                    await sync(build.envd)
                except Exception as exc:
                    raise StageFailed(stage.name, str(exc)) from exc
                parent = build.chain[-1]
                cache.put(stage_key(parent, stage), CachedStep(await build.seal(), state))
            runtime = RuntimeContext(
                env_vars=state.env, workdir=state.workdir, user=state.user,
                start_cmd=plan.start_cmd, ready_cmd=plan.ready_cmd,
            )  # fmt: skip
            say("finalize", "starting the template" if plan.start_cmd else "saving the template")
            try:
                if plan.min_free_disk_mib:
                    await ensure_free_disk(
                        build.envd, plan.min_free_disk_mib, lambda line: say("finalize", line)
                    )
                await build.prepare(runtime, READY_TIMEOUT, lambda line: say("finalize", line))
            except Exception as exc:
                raise StageFailed("finalize", str(exc)) from exc
            return await build.commit(runtime, plan.metadata)

    def _cached_prefix(
        self, plan: StepBuild, cache: StepCache, say: Say
    ) -> tuple[tuple[str, ...], BuildState, int]:
        """The layer chain and state after the longest run of cached, unforced first stages."""
        chain, state = plan.base, plan.state
        for index, stage in enumerate(plan.stages):
            hit = None if stage.forced else cache.get(stage_key(chain[-1], stage), self.layers.exists)
            if hit is None:
                return chain, state, index
            say(stage.name, f"CACHED {describe(stage, plan)}")
            chain, state = hit.chain, hit.state
        return chain, state, len(plan.stages)


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


def stage_key(parent: str, stage: Stage) -> str:
    return step_key(parent, stage.key)


def describe(stage: Stage, plan: StepBuild) -> str:
    """A stage as build logs show it: ``[step 3/7] RUN make`` (the progress the CLI shows)."""
    steps = sum(1 for s in plan.stages if s.name != "base")
    where = "[base]" if stage.name == "base" else f"[step {stage.name}/{steps}]"
    return f"{where} {stage.key.type} {' '.join(stage.key.args)[:200]}"
