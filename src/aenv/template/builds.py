"""User-built templates: E2B's build records, tags and build queue over the snapshot engine.

A template is named like a repository alias and its ``templateID`` is that name, so every
spelling the SDK uses (``name``, ``name:tag``, the ID) resolves. Each build gets a UUID (the
SDK parses build IDs as UUIDs) and, once ready, a committed snapshot; tags point at builds
(``default`` when the name has no tag), and the repository alias ``name`` follows the newest
ready build so ``Sandbox.create(name)`` and ``Template.exists`` work. A build's snapshot goes
when no tag points at it any more.

Records are JSON files under ``<home>/templates``; builds run as tasks of this process, at
most ``max_concurrent`` at a time, each in its own VM. A build that was waiting or running
when the node stopped is marked ``error`` at the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aenv.clock import rfc3339
from aenv.events import EventBus, TemplateBuilt
from aenv.repository.contract import Repository
from aenv.repository.errors import RepositoryError, SnapshotNotFound
from aenv.repository.manifest import RuntimeContext, SnapshotManifest
from aenv.runtime.layers import LayerStore
from aenv.snapshot.templates import Stage, StageFailed, StepBuild, TemplateBuilder
from aenv.telemetry import Observe
from aenv.template.disk import base_layer, base_layer_key
from aenv.template.image import ImageError
from aenv.template.reference import parse_reference
from aenv.template.registry import Credentials
from aenv.template.runner import StepRunner
from aenv.template.stepcache import StepCache
from aenv.template.steps import (
    DEFAULT_TAG,
    DEFAULT_USER,
    BuildRequest,
    BuildStart,
    BuildState,
    Step,
    StepError,
    first_forced,
    split_name,
    step_name,
)
from aenv.template.store import ImageStore
from aenv.template.uploads import UploadStore

log = logging.getLogger(__name__)

BUILT_MARK = "aenv.template-build"  # manifest metadata: the build that made this template
MAX_LOG_ENTRIES = 100  # per status call, as E2B's API
REASON_LINES = 20
# `Template()` without a `from_*` builds on E2B's own base image: here that is the `base` template.
E2B_BASE_IMAGE = "docker.io/e2bdev/base:latest"
BASE_TEMPLATE = "base"
PROVISION = Step(type="RUN", args=["aenv: create the default user and its home"])


class BuildRefused(ImageError):
    status = 409


class BuildNotFound(ImageError):
    status = 404


@dataclass
class BuildRecord:
    build_id: str
    status: str = "waiting"  # waiting | building | ready | error
    created_at: str = field(default_factory=rfc3339)
    finished_at: str | None = None
    cpu_count: int | None = None
    memory_mb: int | None = None
    min_free_disk_mb: int | None = None
    snapshot_id: str | None = None
    tags: list[str] = field(default_factory=list)  # what the build is tagged with once ready
    started: bool = False  # its steps arrived (a build runs once)
    reason: dict[str, Any] | None = None
    logs: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class TemplateRecord:
    template_id: str
    created_at: str = field(default_factory=rfc3339)
    builds: dict[str, BuildRecord] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)  # tag -> build id
    tagged_at: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TemplateRecord:
        builds = {k: BuildRecord(**v) for k, v in data.pop("builds").items()}
        return cls(builds=builds, **data)


@dataclass(frozen=True)
class TagInfo:
    tag: str
    build_id: str
    created_at: str


class TemplateBuilds:
    """Build records, tags and the build queue of this node."""

    def __init__(
        self,
        root: Path,
        repository: Repository,
        builder: TemplateBuilder,
        layers: LayerStore,
        *,
        max_concurrent: int = 2,
        events: EventBus | None = None,
        observe: Observe | None = None,
    ):
        self.root = root
        self.repository, self.builder, self.layers = repository, builder, layers
        self.events = events or EventBus()  # told `TemplateBuilt` (the warm pools follow)
        self._observe = observe  # each build's time, queue included (`aenv.telemetry`)
        self.records_dir = root / "records"
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.uploads = UploadStore(root / "files")
        self.cache = StepCache(root / "cache")
        self.images = ImageStore(root / "images")
        self._slots = asyncio.Semaphore(max_concurrent)
        self._tasks: set[asyncio.Task[None]] = set()
        self.templates: dict[str, TemplateRecord] = {}
        for path in self.records_dir.glob("*.json"):
            record = TemplateRecord.from_dict(json.loads(path.read_text()))
            self.templates[record.template_id] = record
            for build in record.builds.values():
                if build.status in ("waiting", "building"):
                    build.status, build.reason = "error", {"message": "the node restarted during the build"}
            self._save(record)

    # -- records ---------------------------------------------------------------------------

    def _save(self, record: TemplateRecord) -> None:
        path = self.records_dir / f"{record.template_id}.json"
        temp = path.with_suffix(".tmp")
        temp.write_text(json.dumps(asdict(record)))
        os.replace(temp, path)

    def template(self, reference: str) -> TemplateRecord:
        """A built template's records; a name no template can have is not found either."""
        try:
            name, _ = split_name(reference)
        except StepError:
            name = ""
        if name not in self.templates:
            raise BuildNotFound(f"template '{reference}' not found")
        return self.templates[name]

    def build(self, template_id: str, build_id: str) -> BuildRecord:
        record = self.template(template_id)
        if build_id not in record.builds:
            raise BuildNotFound(f"build '{build_id}' of template '{template_id}' not found")
        return record.builds[build_id]

    def resolve(self, reference: str) -> str | None:
        """The snapshot a template reference (``name``, ``name:tag``, ``name:<build id>``) starts
        from; None if not ours.

        As in E2B, the part after ``:`` is a tag or the ID of a ready build: Harbor starts its
        sandboxes from ``name:<build id>`` so that a rebuild cannot change a running job. A
        reference to neither answers E2B's wording, which Harbor reads ("does not exist": the
        build may still be running in another process, so it waits for it).
        """
        try:
            name, tag = split_name(reference)
        except StepError:
            return None
        record = self.templates.get(name)
        if record is None:
            return None
        build_id = record.tags.get(tag or DEFAULT_TAG)
        if build_id is None and tag is None:
            return None  # the alias (newest ready build) decides
        if build_id is None and tag in record.builds:
            build_id = tag
        snapshot_id = record.builds[build_id].snapshot_id if build_id is not None else None
        if snapshot_id is None:
            raise BuildNotFound(f"tag '{tag or DEFAULT_TAG}' does not exist for template '{name}'")
        return snapshot_id

    # -- requests --------------------------------------------------------------------------

    def request(self, request: BuildRequest) -> tuple[TemplateRecord, BuildRecord, list[str]]:
        """Register a build of ``name[:tag]``; it waits for its steps (``start``)."""
        name, tag = split_name(request.name)
        if name not in self.templates:
            self._check_free(name)
        tags = sorted({tag or DEFAULT_TAG, *(request.tags or [])})
        record = self.templates.setdefault(name, TemplateRecord(name))
        build = BuildRecord(
            str(uuid.uuid4()), cpu_count=request.cpu_count, memory_mb=request.memory_mb,
            min_free_disk_mb=request.min_free_disk_mb, tags=tags,
        )  # fmt: skip
        record.builds[build.build_id] = build
        self._save(record)
        return record, build, tags

    def _check_free(self, name: str) -> None:
        """A new template may not take the name of a template or snapshot aenv did not build."""
        with contextlib.suppress(SnapshotNotFound):
            manifest = self.repository.get(name)
            if BUILT_MARK not in manifest.metadata:
                raise BuildRefused(f"'{name}' is already the name of another template or snapshot")

    def start(self, template_id: str, build_id: str, start: BuildStart) -> None:
        build = self.build(template_id, build_id)
        if build.started or build.status != "waiting":
            raise BuildRefused(f"build '{build_id}' was already started")
        build.started = True
        build.logs.append(_entry("info", "build queued", "base"))
        task = asyncio.create_task(self._run(self.templates[template_id], build, start))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- the build -------------------------------------------------------------------------

    async def _run(self, record: TemplateRecord, build: BuildRecord, start: BuildStart) -> None:
        started = time.monotonic()
        try:
            async with self._slots:
                build.status = "building"
                self._save(record)
                manifest = await self._build(record, build, start)
            build.snapshot_id = manifest.id
            replaced = self._publish(record, build, build.tags)
            await self.events.deliver(TemplateBuilt(manifest.id, tuple(replaced)))
            build.status = "ready"
            build.logs.append(_entry("info", f"template {record.template_id} is ready", "finalize"))
            log.info("template %s build %s ready (%s)", record.template_id, build.build_id, manifest.id)
        except asyncio.CancelledError:
            self._fail(build, "base", "the build was cancelled (the node is stopping)")
            raise
        except StageFailed as exc:
            log.info(
                "template %s build %s failed at %s: %s", record.template_id, build.build_id, exc.stage, exc
            )
            self._fail(build, exc.stage, str(exc))
        except (ImageError, RepositoryError, OSError) as exc:
            self._fail(build, "base", str(exc))
        except Exception as exc:  # the build's boundary: reported as its error, logged in full
            log.exception("build %s of %s failed", build.build_id, record.template_id)
            self._fail(build, "base", f"internal error: {exc}")
        finally:
            build.finished_at = rfc3339()
            self._save(record)
            if self._observe is not None:
                ok = build.status == "ready"
                self._observe("template_build", "build", time.monotonic() - started, ok=ok)

    def _fail(self, build: BuildRecord, stage: str, message: str) -> None:
        build.logs.append(_entry("error", message, stage))
        build.status = "error"
        tail = [e for e in build.logs if e.get("step") == stage][-REASON_LINES:]
        where = "finalize" if stage == "finalize" else ("base" if stage == "base" else f"step {stage}")
        build.reason = {"message": f"build failed at {where}: {message}", "step": stage, "logEntries": tail}

    async def _build(self, record: TemplateRecord, build: BuildRecord, start: BuildStart) -> SnapshotManifest:
        def say(stage: str, message: str) -> None:
            build.logs.append(_entry("info", message, stage))

        base, state, provision, parent = await self._base(start, say)
        start_cmd, ready_cmd = start.start_cmd, start.ready_cmd
        if start_cmd is None and ready_cmd is None and parent is not None:
            start_cmd, ready_cmd = parent.start_cmd, parent.ready_cmd  # inherited, as in E2B
        forced_from = first_forced(start)
        stages = [Stage("base", PROVISION, StepRunner.provision, start.force)] if provision else []
        for index, step in enumerate(start.steps):
            stages.append(Stage(step_name(index), step, _runs(step), index >= forced_from))
        plan = StepBuild(
            base=base, state=state, stages=stages, start_cmd=start_cmd, ready_cmd=ready_cmd,
            vcpus=build.cpu_count, memory_mib=build.memory_mb or 512,
            min_free_disk_mib=build.min_free_disk_mb,
            metadata={BUILT_MARK: build.build_id},
        )  # fmt: skip
        return await self.builder.build_steps(
            plan,
            self.cache,
            lambda guest: StepRunner(guest.envd, self.uploads, lambda line: say(_current(build), line)),
            say,
        )

    async def _base(
        self, start: BuildStart, say: Any
    ) -> tuple[tuple[str, ...], BuildState, bool, RuntimeContext | None]:
        """The layers a build starts on, the state they carry, whether to provision them, and the
        runtime of the template it builds on (if it does)."""
        if start.from_image is not None and _is_e2b_base(start.from_image):
            start = start.model_copy(update={"from_image": None, "from_template": BASE_TEMPLATE})
        if start.from_template is not None:
            snapshot = self.resolve(start.from_template) or start.from_template
            try:
                manifest = self.repository.get(split_name(snapshot)[0])
            except (SnapshotNotFound, RepositoryError):
                raise StageFailed("base", f"template '{start.from_template}' not found") from None
            say("base", f"FROM template {start.from_template} ({manifest.id})")
            runtime = manifest.runtime
            state = BuildState(
                env=dict(runtime.env_vars),
                user=runtime.user or DEFAULT_USER,
                workdir=runtime.workdir or f"/home/{DEFAULT_USER}",
            )
            return tuple(manifest.disk_layers), state, False, runtime
        assert start.from_image is not None  # the model requires one of the two
        registry = start.from_image_registry
        credentials = (
            Credentials(registry.username, registry.password) if registry and registry.username else None
        )
        say("base", f"FROM {start.from_image}: pulling")
        try:
            image = await asyncio.to_thread(self.images.pull, start.from_image, credentials)
            say("base", f"pulled {image.reference} ({image.digest}); preparing its root filesystem")
            disk = await asyncio.to_thread(base_layer, image)
        except ImageError as exc:
            raise StageFailed("base", str(exc)) from exc
        layer = self.layers.import_base(disk, base_layer_key(image))
        return (layer,), BuildState(env=image.config.env_vars), True, None

    def _publish(self, record: TemplateRecord, build: BuildRecord, tags: list[str]) -> list[str]:
        """Point the tags and the name at the new build; drop builds nothing points at any more
        (their snapshots are returned)."""
        now = rfc3339()
        for tag in tags:
            record.tags[tag] = build.build_id
            record.tagged_at[tag] = now
        repository = self.repository
        with contextlib.suppress(SnapshotNotFound):
            repository.remove_alias(record.template_id)
        assert build.snapshot_id is not None
        repository.set_alias(record.template_id, build.snapshot_id)
        return self._prune(record)

    def _prune(self, record: TemplateRecord) -> list[str]:
        kept = set(record.tags.values())
        pruned = []
        for build in record.builds.values():
            if build.snapshot_id and build.build_id not in kept and build.status == "ready":
                with contextlib.suppress(RepositoryError):
                    self.repository.delete(build.snapshot_id, defer=True)
                pruned.append(build.snapshot_id)
                build.snapshot_id = None
        return pruned

    # -- status and tags -------------------------------------------------------------------

    def status(self, template_id: str, build_id: str, offset: int, limit: int) -> dict[str, Any]:
        build = self.build(template_id, build_id)
        entries = build.logs[offset : offset + min(limit, MAX_LOG_ENTRIES)]
        body: dict[str, Any] = {
            "templateID": template_id, "buildID": build_id, "status": build.status,
            "logEntries": entries, "logs": [],
        }  # fmt: skip
        if build.status == "error" and build.reason:
            body["reason"] = build.reason
        return body

    def assign_tags(self, target: str, tags: list[str]) -> tuple[str, list[str]]:
        name, tag = split_name(target)
        record = self.template(name)
        build_id = record.tags.get(tag or DEFAULT_TAG)
        if build_id is None:
            raise BuildNotFound(f"template '{target}' has no build tagged '{tag or DEFAULT_TAG}'")
        for new in tags:
            split_name(f"{name}:{new}")
            record.tags[new] = build_id
            record.tagged_at[new] = rfc3339()
        self._save(record)
        return build_id, tags

    def remove_tags(self, name: str, tags: list[str]) -> list[str]:
        """Remove tags; the snapshots of builds no tag points at any more are returned (deleted)."""
        record = self.template(name)
        missing = [t for t in tags if t not in record.tags]
        if missing:
            raise BuildNotFound(f"template '{name}' has no tag {', '.join(missing)}")
        for tag in tags:
            del record.tags[tag]
            record.tagged_at.pop(tag, None)
        pruned = self._prune(record)
        self._save(record)
        return pruned

    def tags(self, reference: str) -> list[TagInfo]:
        record = self.template(reference)
        return [
            TagInfo(t, b, record.tagged_at.get(t, record.created_at)) for t, b in sorted(record.tags.items())
        ]

    def forget(self, name: str) -> list[str]:
        """Drop a template's records; returns the snapshots of its builds (for the caller to delete)."""
        record = self.templates.pop(name, None)
        if record is None:
            return []
        (self.records_dir / f"{name}.json").unlink(missing_ok=True)
        return [b.snapshot_id for b in record.builds.values() if b.snapshot_id]

    def building(self, name: str) -> bool:
        record = self.templates.get(name)
        return record is not None and any(b.status in ("waiting", "building") for b in record.builds.values())


def _is_e2b_base(reference: str) -> bool:
    try:
        return str(parse_reference(reference)) == E2B_BASE_IMAGE
    except ImageError:
        return False


def _entry(level: str, message: str, step: str) -> dict[str, Any]:
    return {"timestamp": rfc3339(), "level": level, "message": message, "step": step}


def _current(build: BuildRecord) -> str:
    """The stage a command's output belongs to: the one whose start was logged last."""
    return build.logs[-1].get("step", "base") if build.logs else "base"


def _runs(step: Step) -> Any:
    async def run(runner: StepRunner, state: BuildState) -> BuildState:
        return await runner.run(step, state)

    return run
