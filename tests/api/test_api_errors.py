"""The API's validation and error paths without VMs: request schemas, the OpenAPI document, the HTTP
server's answers to requests its parser refuses, and the proxy's credential check before a wake-up.

The node's real routes and middlewares run here on a loopback port; no request reaches the
node service, which is a stand-in that fails any call. The same paths are exercised on a real node
in tests/e2e/test_bad_input.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import pytest_asyncio
from aiohttp import web
from pydantic import ValidationError

from aenv.agent.envd import ENVD_PORT
from aenv.api import openapi, schemas
from aenv.api.proxy import ProxyTarget, SandboxAccess, SandboxProxy
from aenv.api.runner import APIRunner
from aenv.api.server import NodeAPI
from aenv.config import Settings

KEY = "e2b_" + "0f" * 20
SETTINGS = Settings(max_timeout=3600, max_fork_count=4)
LIMITS = schemas.limits(SETTINGS)


class RefusingNode:
    """Stands in for the node service: these requests must be refused before they reach it."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the node service was called ({name}) for a request that must be refused")


@dataclass
class Server:
    url: str
    port: int


@pytest_asyncio.fixture(loop_scope="function")  # the test's own loop serves it
async def server() -> AsyncIterator[Server]:
    api = NodeAPI(RefusingNode(), domain="localhost:1", limits=LIMITS)  # type: ignore[arg-type]
    runner = APIRunner(api.app(KEY), access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    yield Server(f"http://127.0.0.1:{port}", port)
    await runner.cleanup()


def assert_json_error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text[:300]
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["code"] == status and body["message"]
    return body["message"]


# --- schemas ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model", [schemas.ConnectSandbox, schemas.ForkRequest, schemas.ResumeSandbox, schemas.TakeOver]
)
@pytest.mark.parametrize("timeout", [3601, 2147483648, 10**30])
def test_timeouts_capped_by_the_node_setting(model: type, timeout: int) -> None:
    with pytest.raises(ValidationError, match="at most 3600 seconds"):
        model.model_validate({"timeout": timeout}, context=LIMITS)
    assert model.model_validate({"timeout": 3600}, context=LIMITS).timeout == 3600


def test_limits_default_to_the_settings_defaults() -> None:
    with pytest.raises(ValidationError, match=f"at most {Settings.max_timeout} seconds"):
        schemas.NewSandbox.model_validate({"templateID": "base", "timeout": Settings.max_timeout + 1})
    with pytest.raises(ValidationError, match="at most 4 "):
        schemas.ForkRequest.model_validate({"count": 5}, context=LIMITS)


@pytest.mark.parametrize(
    "model", [schemas.ConnectSandbox, schemas.PauseRequest, schemas.ResumeSandbox, schemas.SnapshotRequest]
)
def test_memory_false_accepted(model: type) -> None:
    """Filesystem-only pauses and snapshots, and resumes that boot from the disk."""
    assert model.model_validate({"memory": False}).memory is False
    assert model.model_validate({"memory": True}).memory is True
    with pytest.raises(ValidationError):
        model.model_validate({"memory": "no"})


BAD_NAMES = ["Upper/Case:1.0", "UPPER", "a b", "-lead", "x" * 64, "a/b/c", "n:", "ns/:t"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_snapshot_names_refused(name: str) -> None:
    with pytest.raises(ValidationError, match="invalid snapshot name"):
        schemas.SnapshotRequest.model_validate({"name": name})


@pytest.mark.parametrize("name", ["snap", "my-snap_1.0", "team/snap", "snap:v1", "team-slug/snap:default"])
def test_e2b_snapshot_names_accepted(name: str) -> None:
    assert schemas.SnapshotRequest.model_validate({"name": name}).name == name


def test_openapi_document_declares_the_constraints() -> None:
    api = NodeAPI(RefusingNode(), domain="localhost:1", limits=LIMITS)  # type: ignore[arg-type]
    document = openapi.document(api.routes(), LIMITS)
    ids = [op["operationId"] for ops in document["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    text = json.dumps(document)
    assert schemas.LIMIT_KEY not in text
    components = document["components"]["schemas"]

    def branch(model: str, field: str) -> dict:
        prop = components[model]["properties"][field]
        return next(b for b in prop.get("anyOf", [prop]) if b.get("type") != "null")

    for model in ("NewSandbox", "ConnectSandbox", "ResumeSandbox", "ForkRequest", "TimeoutRequest"):
        assert branch(model, "timeout")["maximum"] == 3600, model
    assert branch("ForkRequest", "count")["maximum"] == 4
    for model in ("ConnectSandbox", "PauseRequest", "ResumeSandbox", "SnapshotRequest"):
        memory = branch(model, "memory")
        assert memory["type"] == "boolean" and "enum" not in memory, model
    cidr = branch("NetworkConfig", "allowOut")["items"]
    assert re.match(cidr["pattern"], "10.0.0.0/8") and not re.match(cidr["pattern"], "example.com")
    assert "pattern" in branch("SnapshotRequest", "name")


# --- the HTTP server ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/sandboxes/isbx/connect",
        "/v2/sandboxes/isbx/connect",
        "/sandboxes/isbx/fork",
        "/sandboxes/isbx/takeover",
        "/v2/sandboxes",
    ],
)
@pytest.mark.parametrize(
    "body",
    [
        b'{"templateID": "base", "timeout": 1000000000000000000000000000000}',
        b'{"templateID": "base", "timeout": 2147483648}',
        b'{"templateID": "base", "timeout": ' + b"9" * 5000 + b"}",
        b"[" * 100_000,
        b'{"templateID": ' + b"[" * 100_000,
    ],
)
async def test_bad_bodies_are_400_not_500(server: Server, path: str, body: bytes) -> None:
    if "templateID" not in path and b"templateID" in body:
        body = body.replace(b'"templateID": "base", ', b"")
    async with httpx.AsyncClient(base_url=server.url, headers={"X-API-Key": KEY}) as client:
        response = await client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert_json_error(response, 400)


@pytest.mark.parametrize("method, action", [("POST", "takeover"), ("DELETE", "pause")])
async def test_a_durable_pause_of_no_sandbox_id_is_404_before_the_node(
    server: Server, method: str, action: str
) -> None:
    """A take-over or discard may name a sandbox of another node, so only its id is checked here."""
    async with httpx.AsyncClient(base_url=server.url, headers={"X-API-Key": KEY}) as client:
        response = await client.request(method, f"/sandboxes/Not-An-Id/{action}")
    assert "not a sandbox ID" in assert_json_error(response, 404)


async def test_405_says_which_methods(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, headers={"X-API-Key": KEY}) as client:
        response = await client.request("PATCH", "/v2/sandboxes")
    assert_json_error(response, 405)
    assert set(response.headers["Allow"].split(",")) >= {"GET", "POST"}


async def raw_exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}
        body = await reader.readexactly(int(headers["content-length"]))
        return int(status_line.split()[1]), headers, body
    finally:
        writer.close()


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /v2/sandboxes HTTP/1.1\r\nHost: x\r\nX-Long: " + b"b" * 100_000 + b"\r\n\r\n",
        b"GET /\x00\x01 HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/9.9\r\nHost: x\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64 + b"\r\n\r\n",
        b"GET /v2/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n",
    ],
)
async def test_unparseable_requests_get_json_errors(
    server: Server, request_bytes: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        status, headers, body = await raw_exchange(server.port, request_bytes)
    assert 400 <= status < 500
    assert headers["content-type"].startswith("application/json")
    error = json.loads(body)
    assert error["code"] == status and error["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_server_still_serves_after_bad_requests(server: Server) -> None:
    await raw_exchange(server.port, b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\n\r\n")
    async with httpx.AsyncClient(base_url=server.url) as client:
        assert (await client.get("/health")).status_code == 204


# --- the proxy: credentials before a wake-up ---------------------------------------------------


SECURED = SandboxAccess("envd-token", "traffic-token", secure=True, public_traffic=False)


class PausedSandboxes:
    """A resolver whose one sandbox is paused with auto-resume: every proxy_target call wakes it."""

    def __init__(self, access: SandboxAccess):
        self.access = access
        self.wakeups = 0

    async def proxy_access(self, sandbox_id: str) -> SandboxAccess | None:
        return self.access if sandbox_id == "isbx" else None

    async def proxy_target(self, sandbox_id: str, *, resume: bool) -> ProxyTarget | None:
        self.wakeups += resume
        return None  # the wake-up "failed": the proxy answers 502, no guest is needed


async def proxy_call(resolver: PausedSandboxes, port: int, headers: dict[str, str], path: str) -> int:
    proxy = SandboxProxy(resolver, "test.local")
    app = web.Application(middlewares=[proxy.middleware()])
    proxy.setup(app)
    async with Served(app) as client:
        routing = {"E2b-Sandbox-Id": "isbx", "E2b-Sandbox-Port": str(port)}
        return (await client.post(path, headers={**routing, **headers}, content=b"{}")).status_code


class Served:
    """An httpx client to `app` served on a loopback port for the duration of the block."""

    def __init__(self, app: web.Application):
        self.runner = web.AppRunner(app, handle_signals=False)

    async def __aenter__(self) -> httpx.AsyncClient:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.runner.addresses[0][1]}")
        return self.client

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()
        await self.runner.cleanup()


@pytest.mark.parametrize(
    ("port", "headers", "status"),
    [
        (ENVD_PORT, {}, 401),
        (ENVD_PORT, {"X-Access-Token": "wrong"}, 401),
        (8080, {}, 403),
        (8080, {"E2B-Traffic-Access-Token": "wrong"}, 403),
    ],
)
async def test_refused_proxy_requests_do_not_wake_a_paused_sandbox(
    port: int, headers: dict[str, str], status: int
) -> None:
    resolver = PausedSandboxes(SECURED)
    assert await proxy_call(resolver, port, headers, "/process.Process/List") == status
    assert resolver.wakeups == 0


@pytest.mark.parametrize(
    ("port", "headers"),
    [(ENVD_PORT, {"X-Access-Token": "envd-token"}), (8080, {"E2B-Traffic-Access-Token": "traffic-token"})],
)
async def test_authorized_proxy_requests_wake_it(port: int, headers: dict[str, str]) -> None:
    resolver = PausedSandboxes(SECURED)
    assert await proxy_call(resolver, port, headers, "/process.Process/List") == 502
    assert resolver.wakeups == 1
