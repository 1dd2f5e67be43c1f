"""The console's terminal relay against a fake server that is both the API and the sandbox's envd
(the relay reaches both at the address the WebSocket came in on): a shell whose PTY echoes input,
a sandbox whose state the test flips to paused and back."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from aenv import console
from aenv.agent.envd.connect import encode_message, end_stream
from aenv.console import terminal

KEY = "console-test-key"
PID = 42


class FakeNode:
    """`GET /sandboxes/{id}` and envd's Start, Connect, SendInput and Update; a PTY that echoes."""

    def __init__(self) -> None:
        self.state = "running"
        self.output: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.calls: list[str] = []
        self.sizes: list[tuple[int, int]] = []
        self.inputs: list[bytes] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/sandboxes/{id}", self.sandbox)
        app.router.add_post("/process.Process/Start", self.stream)
        app.router.add_post("/process.Process/Connect", self.stream)
        app.router.add_post("/process.Process/SendInput", self.send_input)
        app.router.add_post("/process.Process/Update", self.update)
        for method, path, handler in console.routes():
            app.router.add_route(method, path, handler)
        return app

    async def sandbox(self, request: web.Request) -> web.Response:
        if request.headers.get("X-API-Key") != KEY:
            return web.json_response({"code": 401, "message": "invalid or missing API key"}, status=401)
        if request.match_info["id"] != "sbx1":
            return web.json_response({"code": 404, "message": "not found"}, status=404)
        body = {"sandboxID": "sbx1", "state": self.state, "envdAccessToken": "tok"}
        return web.json_response(body)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        self.calls.append(request.path.rsplit("/", 1)[1])
        assert request.headers["X-Access-Token"] == "tok"
        assert request.headers["E2b-Sandbox-Id"] == "sbx1"
        body = json.loads((await request.read())[5:])
        if request.path.endswith("Start"):
            size = body["pty"]["size"]
            self.sizes.append((size["cols"], size["rows"]))
        else:
            assert body == {"process": {"pid": PID}}
        response = web.StreamResponse(headers={"Content-Type": "application/connect+json"})
        await response.prepare(request)
        await response.write(encode_message({"event": {"start": {"pid": PID}}}))
        while (chunk := await self.output.get()) is not None:
            pty = base64.b64encode(chunk).decode()
            await response.write(encode_message({"event": {"data": {"pty": pty}}}))
        await response.write(encode_message({"event": {"end": {"exitCode": 3, "exited": True}}}))
        await response.write(end_stream())
        return response

    async def send_input(self, request: web.Request) -> web.Response:
        body = await request.json()
        data = base64.b64decode(body["input"]["pty"])
        self.inputs.append(data)
        await self.output.put(b"echo:" + data)
        return web.json_response({})

    async def update(self, request: web.Request) -> web.Response:
        size = (await request.json())["pty"]["size"]
        self.sizes.append((size["cols"], size["rows"]))
        return web.json_response({})


@pytest_asyncio.fixture(loop_scope="function")  # the test's own loop serves it
async def served() -> AsyncIterator[tuple[FakeNode, str]]:
    fake = FakeNode()
    server = TestServer(fake.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield fake, str(server.make_url("/console/terminal/"))
    finally:
        for _ in range(4):  # end the fake's streams still open: it does not see clients leave
            fake.output.put_nowait(None)
        await server.close()


async def next_text(ws: aiohttp.ClientWebSocketResponse) -> dict[str, Any]:
    while True:
        message = await asyncio.wait_for(ws.receive(), 10)
        if message.type == aiohttp.WSMsgType.TEXT:
            return json.loads(message.data)
        assert message.type == aiohttp.WSMsgType.BINARY, message


async def next_bytes(ws: aiohttp.ClientWebSocketResponse) -> bytes:
    message = await asyncio.wait_for(ws.receive(), 10)
    assert message.type == aiohttp.WSMsgType.BINARY, message
    return message.data


@pytest.fixture(autouse=True)
def fast_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(terminal, "STATE_POLL_S", 0.05)


async def send(ws: aiohttp.ClientWebSocketResponse, kind: str, **fields: Any) -> None:
    await ws.send_str(json.dumps({"type": kind, **fields}))


async def test_input_output_resize_and_exit(served: tuple[FakeNode, str]) -> None:
    fake, url = served
    async with aiohttp.ClientSession() as session, session.ws_connect(url + "sbx1") as ws:
        await ws.send_str(json.dumps({"apiKey": KEY, "cols": 100, "rows": 30}))
        await send(ws, "input", data="echo hi\r")
        assert await next_bytes(ws) == b"echo:echo hi\r"
        await send(ws, "resize", cols=120, rows=40)
        await send(ws, "input", data="\x1b[200~pasted\x1b[201~")  # a paste, as xterm.js sends it
        assert await next_bytes(ws) == b"echo:\x1b[200~pasted\x1b[201~"
        assert fake.sizes == [(100, 30), (120, 40)]
        await fake.output.put(None)  # the shell exits
        assert await next_text(ws) == {"type": "exit", "code": 3}
    assert fake.calls == ["Start"]


async def test_reattaches_to_the_same_shell_after_a_pause(served: tuple[FakeNode, str]) -> None:
    fake, url = served
    async with aiohttp.ClientSession() as session, session.ws_connect(url + "sbx1") as ws:
        await ws.send_str(json.dumps({"apiKey": KEY, "cols": 80, "rows": 24}))
        await send(ws, "input", data="a")
        assert await next_bytes(ws) == b"echo:a"  # attached
        fake.state = "paused"
        assert "paused" in (await next_text(ws))["text"]
        await send(ws, "input", data="lost")  # dropped, not sent
        fake.state = "running"
        assert (await next_text(ws))["text"] == "resumed"
        await send(ws, "input", data="b")
        assert await next_bytes(ws) == b"echo:b"
    assert fake.calls == ["Start", "Connect"]
    assert b"lost" not in fake.inputs


@pytest.mark.parametrize(
    ("hello", "sandbox", "expected"),
    [
        ({"apiKey": "wrong", "cols": 80, "rows": 24}, "sbx1", "invalid or missing API key"),
        ({"apiKey": KEY, "cols": 80, "rows": 24}, "nosuch", "sandbox nosuch is gone"),
        ({"apiKey": KEY, "cols": 0, "rows": 24}, "sbx1", "cols and rows must be integers"),
        ({"cols": 80, "rows": 24}, "sbx1", "the first message must be"),
    ],
)
async def test_refusals_say_why(
    served: tuple[FakeNode, str], hello: dict[str, Any], sandbox: str, expected: str
) -> None:
    fake, url = served
    async with aiohttp.ClientSession() as session, session.ws_connect(url + sandbox) as ws:
        await ws.send_str(json.dumps(hello))
        reply = await next_text(ws)
        assert reply["type"] == "error" and expected in reply["message"]
    assert fake.calls == []


async def test_shell_page_and_vendor_files_served_without_data(served: tuple[FakeNode, str]) -> None:
    _, url = served
    base = url.removesuffix("/console/terminal/")
    async with aiohttp.ClientSession() as session:
        async with session.get(base + "/console") as page:
            assert page.status == 200 and "aenv console" in await page.text()
        async with session.get(base + "/console/xterm.js") as vendor:
            assert vendor.status == 200
        async with session.get(base + "/console/secret.txt") as unknown:
            assert unknown.status == 404


async def test_missing_npm_install_is_a_clear_503(
    served: tuple[FakeNode, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setattr(console, "NODE_MODULES", tmp_path)
    _, url = served
    page_url = url.removesuffix("/console/terminal/") + "/console"
    async with aiohttp.ClientSession() as session, session.get(page_url) as page:
        assert page.status == 503
        assert "make setup-console" in (await page.json())["message"]
