"""The console's terminal: a WebSocket relayed to a PTY process in the sandbox's envd.

The browser cannot put the API key in a WebSocket's headers, so the socket opens without one and its
first message carries it (`{"apiKey", "cols", "rows"}`); nothing reaches the sandbox before the key
checks out. The relay is a client of the server it runs in, over the address the browser's connection
arrived on: the API for the sandbox's state and envd access token, the sandbox proxy for envd. So the
same code serves a node and a gateway (whose proxy forwards to the sandbox's node).

A pause freezes the guest with the shell in it, but the host side of the output stream neither ends
nor errors (the parked VM's TCP peer just goes quiet), so the relay watches the sandbox's state
instead: when it leaves `running` the stream is dropped, and once it runs again the relay reattaches
to the same shell with envd's `process.Connect` by PID. Input typed meanwhile is dropped rather than
sent: a request through the proxy would wake a sandbox with auto-resume on.

Browser -> relay after the first message: `{"type": "input", "data": str}`, `{"type": "resize",
"cols", "rows"}`. Relay -> browser: binary frames (PTY output) and `{"type": "status" | "exit" |
"error", ...}` text frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from aiohttp import WSMsgType, web

from ..cli.config import CLIError
from ..cli.envd import Envd, EnvdError, exit_status, unb64
from ..cli.terminal import start_shell

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
STATE_POLL_S = 1.0
MAX_COLS, MAX_ROWS = 1000, 500
SHELL_ENV = {"TERM": "xterm-256color", "COLORTERM": "truecolor", "LANG": "C.UTF-8"}
Events = AsyncIterator[dict[str, Any]]


class Refused(Exception):
    """The session cannot start or go on; the message is shown in the browser."""


def self_url(request: web.Request) -> str:
    """The server's own address: the local end of the browser's connection (behind any proxy)."""
    assert request.transport is not None
    host, port = request.transport.get_extra_info("sockname")[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def size(message: dict[str, Any]) -> tuple[int, int]:
    cols, rows = message.get("cols"), message.get("rows")
    if not (
        isinstance(cols, int) and isinstance(rows, int) and 0 < cols <= MAX_COLS and 0 < rows <= MAX_ROWS
    ):
        raise Refused(f"cols and rows must be integers up to {MAX_COLS}x{MAX_ROWS}")
    return cols, rows


class Relay:
    """One browser terminal: one shell in one sandbox, for as long as the socket is open."""

    def __init__(self, ws: web.WebSocketResponse, api: httpx.AsyncClient, sandbox_id: str) -> None:
        self.ws = ws
        self.api = api
        self.sandbox_id = sandbox_id
        self.envd: Envd | None = None
        self.pid: int | None = None
        self.attached = asyncio.Event()

    async def state(self) -> dict[str, Any]:
        try:
            response = await self.api.get(f"/sandboxes/{self.sandbox_id}")
        except httpx.HTTPError as exc:
            raise Refused(f"the server did not answer: {exc}") from exc
        if response.status_code == 404:
            raise Refused(f"sandbox {self.sandbox_id} is gone")
        if response.status_code != 200:
            raise Refused(response.json().get("message", f"HTTP {response.status_code}"))
        return response.json()

    async def running(self) -> None:
        """Until the sandbox runs (it may be paused for a long time: the socket stays open)."""
        notified = False
        while (await self.state()).get("state") != "running":
            if not notified:
                await self.status("paused: the terminal reattaches when the sandbox resumes")
                notified = True
            await asyncio.sleep(STATE_POLL_S)

    async def left_running(self) -> None:
        while (await self.state()).get("state") == "running":
            await asyncio.sleep(STATE_POLL_S)

    async def status(self, text: str) -> None:
        await self.ws.send_str(json.dumps({"type": "status", "text": text}))

    async def attach(self, cols: int, rows: int) -> Events:
        """The shell's output stream: a new shell the first time, the same one after a pause."""
        assert self.envd is not None
        if self.pid is None:
            self.pid, events = await start_shell(self.envd, cols, rows, SHELL_ENV)
            return events
        events = self.envd.stream("process.Process/Connect", {"process": {"pid": self.pid}})
        await anext(events)  # the start event, with the same PID
        await self.status("resumed")
        return events

    async def pump(self, events: Events) -> int | None:
        """PTY output to the browser; the exit status when the shell ends, None when the stream is cut."""
        with contextlib.suppress(EnvdError, httpx.HTTPError, CLIError):
            async for message in events:
                event = message.get("event", {})
                if chunk := event.get("data", {}).get("pty"):
                    await self.ws.send_bytes(unb64(chunk))
                elif "end" in event:
                    return exit_status(event["end"])
        return None

    async def session(self, cols: int, rows: int) -> int:
        """Attach, relay until the shell ends, reattach after each pause."""
        detail = await self.state()
        self.envd = Envd(str(self.api.base_url), detail)
        try:
            while True:
                await self.running()
                events = await self.attach(cols, rows)
                self.attached.set()
                pump = asyncio.create_task(self.pump(events))
                watch = asyncio.create_task(self.left_running())
                try:
                    await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    self.attached.clear()
                    watch.cancel()
                    pump.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await watch
                with contextlib.suppress(asyncio.CancelledError):
                    if (code := await pump) is not None:
                        return code
                await events.aclose()  # type: ignore[attr-defined]
        finally:
            await self.envd.aclose()

    async def forward(self, data: dict[str, Any]) -> None:
        """One browser message to the shell: held while the shell starts, dropped while paused."""
        if self.pid is None:
            await self.attached.wait()
        if not self.attached.is_set() or self.envd is None or self.pid is None:
            return
        with contextlib.suppress(EnvdError, httpx.HTTPError, CLIError):
            if data.get("type") == "input" and isinstance(data.get("data"), str):
                await self.envd.send_input(self.pid, data["data"].encode(), pty=True)
            elif data.get("type") == "resize":
                await self.envd.resize(self.pid, *size(data))

    async def inputs(self) -> None:
        async for message in self.ws:
            if message.type != WSMsgType.TEXT:
                continue
            with contextlib.suppress(ValueError, Refused):
                data = json.loads(message.data)
                if isinstance(data, dict):
                    await self.forward(data)


async def relay_until_closed(relay: Relay, cols: int, rows: int) -> int | None:
    """The shell's exit status, or None when the browser closed the socket first."""
    session = asyncio.create_task(relay.session(cols, rows))
    inputs = asyncio.create_task(relay.inputs())
    try:
        done, _ = await asyncio.wait({session, inputs}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (session, inputs):
            task.cancel()
    if session in done:
        return session.result()
    with contextlib.suppress(asyncio.CancelledError):
        await session
    return None


async def hello(ws: web.WebSocketResponse) -> dict[str, Any]:
    try:
        message = await ws.receive(timeout=HELLO_TIMEOUT_S)
    except TimeoutError:
        raise Refused("no API key within 10 s") from None
    try:
        data = json.loads(message.data) if message.type == WSMsgType.TEXT else None
    except ValueError:
        data = None
    if not isinstance(data, dict) or not isinstance(data.get("apiKey"), str):
        raise Refused('the first message must be {"apiKey": ..., "cols": ..., "rows": ...}')
    return data


async def terminal_socket(request: web.Request) -> web.StreamResponse:
    """GET /console/terminal/{sandboxID}: the WebSocket (authenticated by its first message)."""
    ws = web.WebSocketResponse(heartbeat=30)
    await ws.prepare(request)
    sandbox_id = request.match_info["sandboxID"]
    try:
        first = await hello(ws)
        cols, rows = size(first)
        headers = {"X-API-Key": first["apiKey"]}
        async with httpx.AsyncClient(base_url=self_url(request), headers=headers, timeout=30) as api:
            code = await relay_until_closed(Relay(ws, api, sandbox_id), cols, rows)
        if code is None:  # the browser left
            return ws
        await ws.send_str(json.dumps({"type": "exit", "code": code}))
    except (Refused, EnvdError, CLIError) as exc:
        with contextlib.suppress(ConnectionError):
            await ws.send_str(json.dumps({"type": "error", "message": str(exc)}))
    await ws.close()
    return ws
