"""The ``code-interpreter`` template through the official ``e2b-code-interpreter`` SDK.

The module builds the template from ``templates/code-interpreter`` with the E2B SDK, lean (no
matplotlib: pip under TCG takes minutes; ``scripts/code-interpreter-charts.py`` checks charts),
and then runs code as a user would: ``Sandbox.create()`` on the SDK's default template name.
"""

from __future__ import annotations

import base64
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest
from e2b import SandboxException, Template
from e2b_code_interpreter import Sandbox

from tests.e2e.conftest import NodeServer

pytestmark = pytest.mark.vm

DEFINITION = Path(__file__).resolve().parents[2] / "templates" / "code-interpreter" / "template.py"
PNG = b"\x89PNG\r\n\x1a\n-not-really"


def definition() -> ModuleType:
    spec = importlib.util.spec_from_file_location("code_interpreter_template", DEFINITION)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def interpreter(node: NodeServer) -> Iterator[str]:
    """The lean template, built under the SDK's default name; removed afterwards."""
    template = definition()
    Template.build(template.template(charts=False), template.NAME)
    yield template.NAME
    answer = httpx.delete(f"{node.url}/templates/{template.NAME}", headers={"X-API-Key": node.key})
    assert answer.status_code == 204, answer.text


@pytest.fixture
def sandbox(interpreter: str) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(timeout=300, envs={"FROM_CREATE": "yes"})
    try:
        yield sandbox
    finally:
        sandbox.kill()


def test_run_code_results_streams_errors_and_display_data(sandbox: Sandbox) -> None:
    assert sandbox.run_code("x = 1; x + 1").text == "2"

    out: list[str] = []
    err: list[str] = []
    execution = sandbox.run_code(
        "import os, subprocess, sys\nprint('out')\nprint('err', file=sys.stderr)\n"
        "subprocess.run(['echo', 'from-a-child'])\nx",
        on_stdout=lambda m: out.append(m.line),
        on_stderr=lambda m: err.append(m.line),
    )
    assert "".join(out) == "out\nfrom-a-child\n" == "".join(execution.logs.stdout)
    assert "".join(err) == "err\n"
    assert execution.text == "1" and execution.execution_count == 2

    failed = sandbox.run_code("def f():\n    raise ValueError('boom')\n\nf()")
    assert failed.error is not None and (failed.error.name, failed.error.value) == ("ValueError", "boom")
    assert "raise ValueError('boom')" in failed.error.traceback and "line 4" in failed.error.traceback

    shown = sandbox.run_code(
        "class Picture:\n"
        f"    def _repr_png_(self): return {PNG!r}\n"
        "    def _repr_html_(self): return '<b>picture</b>'\n"
        "display('shown first')\nPicture()"
    )
    first, main = shown.results
    assert (first.text, first.is_main_result) == ("'shown first'", False)
    assert main.is_main_result and main.html == "<b>picture</b>"
    assert base64.b64decode(main.png or "") == PNG

    envs = sandbox.run_code("os.environ['GREETING'], os.environ['FROM_CREATE']", envs={"GREETING": "hi"})
    assert envs.text == "('hi', 'yes')"  # per run, and the sandbox's own
    assert sandbox.run_code("import asyncio\nawait asyncio.sleep(0)\nx").text == "1"
    with pytest.raises(SandboxException, match="not available"):
        sandbox.run_code("1", language="r")


def test_contexts(sandbox: Sandbox) -> None:
    context = sandbox.create_code_context(cwd="/tmp")
    assert context.language == "python" and context.cwd == "/tmp"
    assert sandbox.run_code("import os; mine = os.getcwd(); mine", context=context).text == "'/tmp'"
    assert sandbox.run_code("mine").error.name == "NameError"  # the default context is another kernel
    assert context.id in {c.id for c in sandbox.list_code_contexts()}
    sandbox.restart_code_context(context)
    assert sandbox.run_code("mine", context=context).error.name == "NameError"
    sandbox.remove_code_context(context)
    assert context.id not in {c.id for c in sandbox.list_code_contexts()}


def test_pause_and_fork_keep_kernel_state(sandbox: Sandbox) -> None:
    sandbox.run_code("counter = 41")
    sandbox.pause()
    resumed = Sandbox.connect(sandbox.sandbox_id)
    assert resumed.run_code("counter += 1; counter").text == "42"
    children = resumed.fork(count=2)
    try:
        for child in children:
            assert not isinstance(child, Exception), child
            connected = Sandbox.connect(child.sandbox_id)
            assert connected.run_code("counter += 1; counter").text == "43"
        assert resumed.run_code("counter").text == "42"
    finally:
        for child in children:
            if not isinstance(child, Exception):
                child.kill()
