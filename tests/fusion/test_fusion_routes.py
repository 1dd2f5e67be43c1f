"""The SandboxFusion routes without a VM: who gets in, bad requests, and the scripts phases run."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp.test_utils import TestClient, TestServer

from aenv.api import schemas
from aenv.api.fusion import Fusion, local_url, phase_script
from aenv.api.server import NodeAPI
from aenv.config import Settings

KEY = "e2b_" + "0" * 40
TOKEN = "s3cret-token"


class NoNode:
    """A node service that must not be asked for anything: these requests end before a create."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the node was asked for {name}")


@contextlib.asynccontextmanager
async def serving(token: str | None = TOKEN) -> AsyncIterator[TestClient]:
    api = NodeAPI(NoNode(), domain="", limits=schemas.limits(Settings()))  # type: ignore[arg-type]
    async with TestClient(
        TestServer(api.app(KEY, fusion=Fusion(token, "base", "http://127.0.0.1:1")))
    ) as client:
        yield client


async def test_off_or_a_wrong_token_answers_the_routers_own_404() -> None:
    async with serving() as client:
        unknown = await client.post("/no/such/route", json={}, headers={"X-API-Key": KEY})
        expected = (unknown.status, await unknown.json())
        assert expected[0] == 404
        for path in (f"/fusion/{TOKEN}x/run_code", f"/fusion/{TOKEN[:-1]}/run_code", "/fusion/base/run_code"):
            answer = await client.post(path, json={"code": "1", "language": "python"})
            assert (answer.status, await answer.json()) == expected, path
    async with serving(None) as off:
        answer = await off.post(f"/fusion/{TOKEN}/run_code", json={"code": "1", "language": "python"})
        assert (answer.status, await answer.json()) == expected


async def test_bad_requests_are_400_and_other_languages_a_sandbox_error() -> None:
    async with serving() as client:
        await bad_requests(client)


async def bad_requests(client: TestClient) -> None:
    endpoint = f"/fusion/{TOKEN}/run_code"
    for body in (
        {"language": "python"},
        {"code": "1", "language": "cobol"},
        {"code": "1", "language": "python", "run_timeout": 0},
        {"code": "1", "language": "python", "files": {"a": "not base64!"}},
    ):
        answer = await client.post(endpoint, json=body)
        assert answer.status == 400, body
        assert set(await answer.json()) == {"code", "message"}
    verilog = await client.post(endpoint, json={"code": "module m; endmodule", "language": "verilog"})
    assert verilog.status == 200
    assert (await verilog.json())["status"] == "SandboxError"


def test_phase_scripts_check_the_tool_limit_memory_and_feed_stdin() -> None:
    script = phase_script("python3 main.py", ".stdin", 256)
    assert script.startswith("command -v python3 ")
    assert "ulimit -v 262144; exec python3 main.py < .stdin" in script
    assert phase_script("./main", "/dev/null", -1) == "exec ./main < /dev/null"


def test_the_servers_own_url() -> None:
    assert local_url("0.0.0.0:8000") == "http://127.0.0.1:8000"
    assert local_url("[::]:8080") == "http://[::1]:8080"
    assert local_url("10.0.0.5:9000") == "http://10.0.0.5:9000"
