"""Start and ready commands as E2B runs them (`aenv.snapshot.templates.start_runtime`), against a
scripted envd; the real thing runs in `tests/e2e/test_template_build.py`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from aenv.repository.manifest import RuntimeContext
from aenv.snapshot import templates
from aenv.snapshot.model import EngineError


class ScriptedEnvd:
    """Answers the ready command with `ready_codes` in turn; `cat` of the start status with `status`."""

    def __init__(self, ready_codes: list[int], status: str = ""):
        self.ready_codes = ready_codes
        self.status = status
        self.calls: list[list[str]] = []

    async def execute(
        self, argv: list[str], *, on_output: Callable[[bytes], None] | None = None, **kwargs: Any
    ) -> int | None:
        self.calls.append(argv)
        if kwargs.get("background"):
            return None
        if argv[2].startswith("cat "):
            if on_output is not None:
                on_output(self.status.encode())
            return 0
        if on_output is not None:
            on_output(b"probing\n")
        return self.ready_codes.pop(0) if self.ready_codes else 1


@pytest.fixture(autouse=True)
def _no_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(templates, "READY_RETRY_INTERVAL", 0.0)


async def test_the_ready_command_is_retried_until_it_succeeds_and_logged() -> None:
    envd = ScriptedEnvd([1, 1, 0])
    lines: list[str] = []
    runtime = RuntimeContext(start_cmd="serve", ready_cmd="check", user="user", workdir="/home/user")
    await templates.start_runtime(envd, runtime, 60, lines.append, build=True)  # type: ignore[arg-type]
    start = envd.calls[0]
    assert start[:2] == ["/bin/sh", "-c"] and start[4] == "serve"  # through the login-shell wrapper
    assert [c[-1] for c in envd.calls if c[-1] == "check"] == ["check"] * 3
    assert lines[0] == "[start cmd]: serve" and "[ready cmd]: check" in lines
    assert lines.count("probing") == 3 and lines[-1] == "template is ready"


async def test_a_start_command_that_failed_fails_at_once() -> None:
    envd = ScriptedEnvd([1] * 100, status="7")
    runtime = RuntimeContext(start_cmd="serve --broken", ready_cmd="check")
    with pytest.raises(EngineError, match="'serve --broken' exited with code 7"):
        await templates.start_runtime(envd, runtime, 60, build=True)  # type: ignore[arg-type]
    assert len([c for c in envd.calls if c[-1] == "check"]) == 1


async def test_a_ready_command_that_never_succeeds_times_out() -> None:
    envd = ScriptedEnvd([])
    runtime = RuntimeContext(ready_cmd="false")
    with pytest.raises(EngineError, match="'false' did not succeed within 0 s"):
        await templates.start_runtime(envd, runtime, 0.01, build=True)  # type: ignore[arg-type]


@pytest.mark.parametrize(("build", "ready"), [(True, ["sleep 20"]), (False, [])])
async def test_a_start_command_alone_waits_20_s_in_builds(build: bool, ready: list[str]) -> None:
    envd = ScriptedEnvd([0])
    await templates.start_runtime(envd, RuntimeContext(start_cmd="serve"), 60, build=build)  # type: ignore[arg-type]
    assert [c[-1] for c in envd.calls[1:]] == ready
