"""The template build API on the wire, driven by the official SDK, with the build VM faked.

The node service, records, uploads and HTTP layer are the real ones; only the engine's
`build_steps` (which needs a VM; the end-to-end tests run it for real) is replaced by one that
logs like a build and fails a step. This checks that every answer parses in the SDK and that
a failure reaches `Template.build` as the SDK reports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from aiohttp import web
from e2b import AsyncTemplate
from e2b.exceptions import BuildException, TemplateException

from aenv.api import schemas
from aenv.api.server import NodeAPI
from aenv.config import Settings
from aenv.events import EventBus
from aenv.orchestrator.local import LocalNode
from aenv.repository.manifest import RuntimeContext
from aenv.repository.posix import SnapshotRepository
from aenv.runtime.layers import LayerStore
from aenv.snapshot.templates import Stage, StageFailed, StepBuild, TemplateBuilder
from aenv.template.builds import TemplateBuilds
from aenv.template.stepcache import CachedStep, StepCache
from aenv.template.steps import BuildRequest, BuildState, Step, step_key
from tests.envd.conftest import free_port

KEY = "e2b_" + "0" * 40


class FakeRepository(SnapshotRepository):
    """The repository with a `base` template that is only a manifest (no VM builds from it here)."""

    def get(self, id_or_alias: str) -> Any:
        if id_or_alias == "base":
            return SimpleNamespace(id="sbase", disk_layers=("lbase",), runtime=RuntimeContext(), metadata={})
        return super().get(id_or_alias)


class FakeBuilder:
    """`build_steps` without a VM: logs each stage, then fails the last one."""

    def __init__(self) -> None:
        self.plans: list[StepBuild] = []

    async def build_steps(self, plan: StepBuild, cache: Any, runner: Any, say: Any) -> Any:
        self.plans.append(plan)
        for stage in plan.stages:
            say(stage.name, f"running {stage.key.type}")
        raise StageFailed(plan.stages[-1].name, "command exited with code 7: false")


@contextlib.asynccontextmanager
async def serving(tmp_path: Path) -> AsyncIterator[tuple[str, FakeBuilder]]:
    """A node API on a free port, in the test's own event loop."""
    builder = FakeBuilder()
    engine = SimpleNamespace(
        repository=FakeRepository(tmp_path / "repository"),
        layers=LayerStore(tmp_path / "layers"),
        templates=builder,
    )
    settings = Settings(home_path=tmp_path)
    node = LocalNode(
        SimpleNamespace(engine=engine, settings=settings, events=EventBus(), catalog=None), None, "node-1"
    )  # type: ignore[arg-type]
    api = NodeAPI(node, domain="", limits=schemas.limits(settings))
    runner = web.AppRunner(api.app(KEY))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", builder
    finally:
        await node.builds.close()
        await runner.cleanup()


def sdk(url: str) -> dict[str, Any]:
    return {"api_url": url, "api_key": KEY, "domain": url.split("://")[1]}


async def test_sdk_build_uploads_files_and_reports_the_failed_step(tmp_path: Path) -> None:
    async with serving(tmp_path) as (url, builder):
        await sdk_build_fails(url, builder, tmp_path)


async def sdk_build_fails(url: str, builder: FakeBuilder, tmp_path: Path) -> None:
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "app.py").write_text("print(1)\n")
    template = (
        AsyncTemplate(file_context_path=str(tmp_path / "ctx"))
        .from_template("base")
        .copy("app.py", "/app/")
        .set_envs({"A": "1"})
        .run_cmd("false")
    )
    logs: list[str] = []
    with pytest.raises(BuildException, match="step 3"):
        await AsyncTemplate.build(
            template, "wire-test:v1", on_build_logs=lambda e: logs.append(e.message), **sdk(url)
        )
    assert "running RUN" in logs and any("code 7" in line for line in logs)
    (plan,) = builder.plans
    assert [s.key.type for s in plan.stages] == ["COPY", "ENV", "RUN"]
    uploaded = list((tmp_path / "templates" / "files" / "pending").iterdir())
    assert len(uploaded) == 1 and uploaded[0].name == plan.stages[0].key.files_hash
    # the template has no ready build: its tags say so, and so does a create by tag
    assert await AsyncTemplate.get_tags("wire-test", **sdk(url)) == []
    with pytest.raises(TemplateException):
        await AsyncTemplate.assign_tags("wire-test:v1", ["stable"], **sdk(url))


async def test_bad_requests_get_json_errors(tmp_path: Path) -> None:
    async with serving(tmp_path) as (url, _):
        await bad_requests(url)


async def bad_requests(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": KEY}) as api:
        for method, path, body, status in [
            ("POST", "/v3/templates", {"name": "Not Valid"}, 400),
            ("POST", "/v3/templates", {"name": "base"}, 409),  # a template aenv did not build
            ("POST", "/v3/templates", {"name": "x", "cpuCount": 0}, 400),
            ("GET", "/templates/nope/files/" + "a" * 64, None, 404),
            ("POST", "/v2/templates/nope/builds/b", {"fromTemplate": "base", "steps": []}, 404),
            ("GET", "/templates/nope/builds/b/status", None, 404),
            ("DELETE", "/templates/tags", {"name": "nope", "tags": ["x"]}, 404),
        ]:
            answer = await api.request(method, path, json=body)
            assert answer.status_code == status, (path, answer.text)
            assert set(answer.json()) >= {"code", "message"}
        created = (await api.post("/v3/templates", json={"name": "twice"})).json()
        start = {"fromTemplate": "base", "steps": [{"type": "RUN", "args": ["true"]}]}
        path = f"/v2/templates/twice/builds/{created['buildID']}"
        assert (await api.post(path, json=start)).status_code == 202
        assert (await api.post(path, json=start)).status_code == 409
        bad_steps = {"fromTemplate": "base", "fromImage": "debian", "steps": []}
        assert (await api.post(path, json=bad_steps)).status_code == 400
        status = await api.get(
            f"/templates/twice/builds/{created['buildID']}/status", params={"logsOffset": "x"}
        )
        assert status.status_code == 400


def test_a_restart_marks_unfinished_builds_failed(tmp_path: Path) -> None:
    engine = SimpleNamespace(repository=FakeRepository(tmp_path / "repository"), templates=FakeBuilder())
    builds = TemplateBuilds(tmp_path / "templates", engine.repository, engine.templates, None)  # type: ignore[arg-type]
    _, build, tags = builds.request(BuildRequest(name="restarted:v1"))
    assert tags == ["v1"] and build.status == "waiting"
    again = TemplateBuilds(tmp_path / "templates", engine.repository, engine.templates, None)  # type: ignore[arg-type]
    status = again.status("restarted", build.build_id, 0, 100)
    assert status["status"] == "error" and "restarted" in status["reason"]["message"]


def test_cached_prefix_stops_at_the_first_forced_or_missing_step(tmp_path: Path) -> None:
    layers = {"b", "l1", "l2"}
    builder = TemplateBuilder(SimpleNamespace(layers=SimpleNamespace(exists=layers.__contains__)), None)  # type: ignore[arg-type]
    cache = StepCache(tmp_path)
    steps = [Step(type="RUN", args=[f"echo {n}"]) for n in range(3)]
    stages = [Stage(str(n + 1), step, None) for n, step in enumerate(steps)]  # type: ignore[arg-type]
    cache.put(step_key("b", steps[0]), CachedStep(("b", "l1"), BuildState(user="one")))
    cache.put(step_key("l1", steps[1]), CachedStep(("b", "l1", "l2"), BuildState(user="two")))
    said: list[str] = []
    plan = StepBuild(base=("b",), state=BuildState(), stages=stages)
    chain, state, first = builder._cached_prefix(plan, cache, lambda stage, message: said.append(message))
    assert (chain, state.user, first) == (("b", "l1", "l2"), "two", 2)
    assert said == ["CACHED [step 1/3] RUN echo 0", "CACHED [step 2/3] RUN echo 1"]
    forced = StepBuild(base=("b",), state=BuildState(), stages=[stages[0], replace(stages[1], forced=True)])
    assert builder._cached_prefix(forced, cache, lambda *_: None)[2] == 1
    layers.discard("l1")  # collected: every entry whose chain needs it is a miss
    assert builder._cached_prefix(plan, cache, lambda *_: None)[2] == 0


async def test_the_sdk_default_image_is_the_base_template(tmp_path: Path) -> None:
    async with serving(tmp_path) as (url, builder):
        template = AsyncTemplate().from_base_image().run_cmd("false")
        with pytest.raises(BuildException, match="step 1"):
            await AsyncTemplate.build(template, "on-default", **sdk(url))
    (plan,) = builder.plans
    assert plan.base == ("lbase",) and [s.name for s in plan.stages] == ["1"]  # no image, no provisioning
