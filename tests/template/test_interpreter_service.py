"""The code-interpreter template's service, run on the host (no VM): the wire protocol the
``e2b-code-interpreter`` SDK parses, interrupts of cells whose client left, and bad requests.
The template itself, in real sandboxes, is tested in ``tests/e2e/test_code_interpreter.py``."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b_code_interpreter.models import Execution, parse_output

from aenv.devnode import free_port

SERVICE = Path(__file__).resolve().parents[2] / "templates" / "code-interpreter"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    home = tmp_path_factory.mktemp("interpreter-home")
    process = subprocess.Popen(
        [sys.executable, str(SERVICE / "serve.py"), "--host", "127.0.0.1", "--port", str(port)],
        env={"PATH": "/usr/bin:/bin", "HOME": str(home), "PYTHONDONTWRITEBYTECODE": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def run(url: str, code: str, timeout: float = 30, **body: object) -> Execution:
    execution = Execution()
    request = {"code": code, **body}
    with httpx.stream("POST", f"{url}/execute", json=request, timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            parse_output(execution, line)
    return execution


def test_cells_share_a_namespace_and_report_like_jupyter(service: str) -> None:
    assert run(service, "x = 1; x + 1").text == "2"
    assert run(service, "x;").results == []  # a trailing `;` hides the value
    printed = run(service, "import os\nprint('a' * 100000)\nos.system('echo child')")
    assert "".join(printed.logs.stdout) == "a" * 100000 + "\nchild\n"
    assert printed.text == "0"
    escaped = run(service, "if True:\n    !echo from-the-shell\n%pip --version")  # IPython's escapes
    assert "".join(escaped.logs.stdout).startswith("from-the-shell\npip ")
    broken = run(service, "1 +")
    assert broken.error is not None and broken.error.name == "SyntaxError"
    assert run(service, "x").text == "1"


def test_a_cell_whose_client_left_is_interrupted(service: str) -> None:
    with pytest.raises(httpx.ReadTimeout):
        run(service, "import time\nstarted = True\ntime.sleep(600)", timeout=2)
    # the next cell runs at once on the same kernel, which kept what the cell did before
    assert run(service, "started", timeout=20).text == "True"


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/execute", {"code": 1}, 400),
        ("POST", "/execute", {"code": "1", "env_vars": {"A": 1}}, 400),
        ("POST", "/execute", {"code": "1", "context_id": "nope"}, 404),
        ("POST", "/execute", {"code": "1", "language": "r"}, 400),
        ("POST", "/contexts", {"cwd": "/no/such/dir"}, 400),
        ("POST", "/contexts/nope/restart", None, 404),
        ("DELETE", "/contexts/nope", None, 404),
        ("GET", "/nowhere", None, 404),
    ],
)
def test_bad_requests_are_json_errors(
    service: str, method: str, path: str, body: object, status: int
) -> None:
    answer = httpx.request(method, f"{service}{path}", json=body)
    assert answer.status_code == status
    assert set(answer.json()) == {"code", "message"}
