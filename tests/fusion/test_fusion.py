"""SandboxFusion's API on a real node, driven by the `sandbox-fusion` client (what verl calls).

The node runs with `AENV_FUSION_TOKEN`; the client gets only the endpoint URL
`<node>/fusion/<token>`, as verl's `sandbox_fusion_url` would be set.
"""

from __future__ import annotations

import base64
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sandbox_fusion import RunCodeRequest, RunStatus, run_code
from sandbox_fusion.models import CommandRunStatus

from aenv.devnode import DevNode

pytestmark = pytest.mark.vm

SLOT_FIRST = 10240  # apart from every other node the suite starts
TOKEN = secrets.token_urlsafe(24)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, template_seed: Path) -> Iterator[DevNode]:
    home = tmp_path_factory.mktemp("aenv-fusion") / "home"
    with DevNode(
        home, slot_first=SLOT_FIRST, slot_count=64, seed=template_seed, warm_pool_size=2, fusion_token=TOKEN
    ) as server:
        yield server
    print(f"\nfusion node log: {server.log_path}", file=sys.stderr)


def endpoint(node: DevNode, token: str = TOKEN) -> str:
    return f"{node.url}/fusion/{token}"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_python_with_stdin_and_files_in_and_out(node: DevNode) -> None:
    code = (
        "import sys\n"
        "name = sys.stdin.read().strip()\n"
        "data = open('input.txt').read()\n"
        "open('out/answer.txt', 'w').write(data.upper())\n"
        "print('hello', name)\n"
        "print('to stderr', file=sys.stderr)\n"
    )
    files = {"input.txt": b64(b"some data"), "out/keep": b64(b"")}
    request = RunCodeRequest(
        code=code, language="python", stdin="verl\n", files=files, fetch_files=["out/answer.txt", "missing"]
    )
    answer = run_code(request, endpoint=endpoint(node), max_attempts=1)
    assert answer.status == RunStatus.Success, answer
    assert answer.run_result.status == CommandRunStatus.Finished
    assert answer.run_result.return_code == 0
    assert answer.run_result.stdout == "hello verl\n"
    assert answer.run_result.stderr == "to stderr\n"
    assert answer.run_result.execution_time > 0
    assert answer.files == {
        "out/answer.txt": b64(b"SOME DATA")
    }  # a file the program did not make is left out


def test_bash_failure_and_a_fresh_sandbox_each_time(node: DevNode) -> None:
    first = run_code(
        RunCodeRequest(code="echo $$ > /tmp/mark; echo out; exit 3", language="bash"),
        endpoint=endpoint(node),
        max_attempts=1,
    )
    assert first.status == RunStatus.Failed
    assert (first.run_result.return_code, first.run_result.stdout) == (3, "out\n")
    second = run_code(
        RunCodeRequest(code="cat /tmp/mark 2>/dev/null || echo clean", language="bash"),
        endpoint=endpoint(node),
        max_attempts=1,
    )
    assert second.run_result.stdout == "clean\n"
    assert second.executor_pod_name != first.executor_pod_name


def test_timeout_and_memory_limit(node: DevNode) -> None:
    slow = run_code(
        RunCodeRequest(code="import time\nprint('started', flush=True)\ntime.sleep(60)", language="python",
                       run_timeout=2),
        endpoint=endpoint(node),
        max_attempts=1,
    )  # fmt: skip
    assert slow.status == RunStatus.Failed
    assert slow.run_result.status == CommandRunStatus.TimeLimitExceeded
    assert slow.run_result.stdout == "started\n"
    # verl sends memory_limit_MB (the client's model has no such field): the program's ulimit -v
    hungry = httpx.post(
        f"{endpoint(node)}/run_code",
        json={
            "code": "x = bytearray(400 << 20)\nprint('allocated')",
            "language": "python",
            "memory_limit_MB": 128,
        },
        timeout=120,
    ).json()
    assert hungry["status"] == "Failed" and "MemoryError" in hungry["run_result"]["stderr"], hungry


def test_languages_the_template_lacks_and_bad_requests(node: DevNode) -> None:
    missing = httpx.post(
        f"{endpoint(node)}/run_code", json={"code": "int main(){}", "language": "cpp"}, timeout=120
    )
    assert missing.status_code == 200
    assert missing.json()["status"] == "SandboxError" and "g++" in missing.json()["message"]
    unknown = httpx.post(f"{endpoint(node)}/run_code", json={"code": "x", "language": "cobol"}, timeout=30)
    assert unknown.status_code == 400 and set(unknown.json()) == {"code", "message"}


def test_a_wrong_token_is_an_unknown_route_and_no_token_is_logged(node: DevNode) -> None:
    wrong = httpx.post(f"{endpoint(node, 'x' + TOKEN)}/run_code", json={"code": "1", "language": "python"})
    unknown = httpx.post(
        f"{node.url}/fusion/{'x' + TOKEN}/nothing-here", json={}, headers={"X-API-Key": node.key}
    )
    assert wrong.status_code == unknown.status_code == 404
    assert wrong.json() == unknown.json()
    assert TOKEN not in node.log_path.read_text()
