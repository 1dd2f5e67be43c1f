"""The proxy's transport alone (`aenv.api.upstream`), between an aiohttp front and a local fake upstream.

The upstream is a loopback server whose answers are written byte for byte, so framing the SDKs
never produce (trailers, interim responses, bodies ending at close, truncation, an oversized head,
bytes arriving with a 101) is exercised in milliseconds, without a VM.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
from collections.abc import AsyncIterator

import h11
import httpx
import pytest
import pytest_asyncio
from aiohttp import web

from aenv.api.upstream import (
    HEAD_LIMIT,
    ClientGone,
    Upstream,
    UpstreamFailed,
    UpstreamRequest,
    UpstreamTransport,
    end_to_end,
)

KEY = "isbx"
PORT = 8000


class FakeUpstream:
    """Answers each path with fixed bytes; counts connections; `/echo` reports what it received."""

    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def open(self, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        assert self.server is not None
        return await asyncio.open_connection(*self.server.sockets[0].getsockname()[:2])

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while (received := await self._request(reader)) is not None:
                request, body = received
                if not await self.answer(request, body, reader, writer):
                    break
        except (ConnectionError, h11.RemoteProtocolError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _request(reader: asyncio.StreamReader) -> tuple[h11.Request, bytes] | None:
        http = h11.Connection(h11.SERVER)
        request, body = None, bytearray()
        while True:
            event = http.next_event()
            if event is h11.NEED_DATA:
                http.receive_data(await reader.read(65536))
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                return request, bytes(body)
            else:
                return None

    async def answer(
        self, request: h11.Request, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        path = request.target.decode()
        if path.startswith("/echo"):
            fields = "".join(f"{k.decode()}: {v.decode()}\n" for k, v in request.headers.raw_items())
            text = f"{request.method.decode()} {path}\n{fields}sha={hashlib.sha256(body).hexdigest()}\n"
            data = text.encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        elif path == "/chunked":
            writer.write(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Sum\r\n\r\n"
                b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Sum: 1\r\n\r\n"
            )
        elif path == "/until-close":
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
            return False
        elif path == "/interim":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n")
            writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 4\r\nConnection: x-private\r\n")
            writer.write(b"X-Private: 1\r\n\r\ndone")
        elif path == "/truncated":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b")
            return False
        elif path == "/unasked-101":
            writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n")
            return False
        elif path == "/huge-head":
            writer.write(b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (16 * HEAD_LIMIT) + b"\r\n\r\n")
            return False
        elif path == "/then-close":  # answers, then drops the kept-alive connection
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            return False
        elif path == "/stream":  # a body that never ends
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            while True:
                writer.write(b"4\r\ntick\r\n")
                await writer.drain()
                await asyncio.sleep(0.01)
        elif path == "/ws":
            writer.write(
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
            )
            writer.write(b"early ")  # tunnel bytes in the same segment as the 101
            while data := await reader.read(65536):
                writer.write(data.upper())
            return False
        return True


@pytest_asyncio.fixture(loop_scope="function")  # the test's own loop serves it
async def upstream() -> AsyncIterator[FakeUpstream]:
    fake = FakeUpstream()
    fake.server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    yield fake
    fake.server.close()
    for writer in fake.writers:
        writer.transport.abort()


@pytest_asyncio.fixture(loop_scope="function")
async def front(upstream: FakeUpstream) -> AsyncIterator[tuple[str, UpstreamTransport]]:
    """An aiohttp server relaying every request through the transport, as the proxy does."""
    transport = UpstreamTransport()

    async def relay(request: web.Request) -> web.StreamResponse:
        outgoing = UpstreamRequest(PORT, request.raw_path, list(end_to_end(request.headers)))
        try:
            return await transport.relay(request, Upstream(KEY, "fake", upstream.open), outgoing)
        except UpstreamFailed as exc:
            return web.Response(status=502, text=str(exc))
        except ClientGone:
            return web.Response(status=400)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", relay)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", transport
    transport.close()
    await runner.cleanup()


async def test_kept_alive_request_heads_and_bodies_both_ways(front, upstream: FakeUpstream) -> None:
    url, _ = front
    big = bytes(range(256)) * 1024  # over the size read whole: streamed upstream
    async with httpx.AsyncClient(base_url=url) as client:
        small = await client.post("/echo/a%20b?x=1", content=b"tiny", headers={"X-Case": "Kept"})
        streamed = await client.put("/echo", content=big)

        async def chunks() -> AsyncIterator[bytes]:
            yield b"one"
            yield b"two"

        chunked = await client.post("/echo", content=chunks())
    assert small.status_code == 200
    assert small.text.startswith("POST /echo/a%20b?x=1\n")  # the target byte for byte
    assert "X-Case: Kept\n" in small.text and "Content-Length: 4\n" in small.text
    assert f"sha={hashlib.sha256(big).hexdigest()}" in streamed.text
    assert "Transfer-Encoding: chunked\n" in chunked.text
    assert f"sha={hashlib.sha256(b'onetwo').hexdigest()}" in chunked.text
    assert upstream.connections == 1  # one kept-alive connection served all three


async def test_response_framings(front, upstream: FakeUpstream) -> None:
    url, _ = front
    async with httpx.AsyncClient(base_url=url) as client:
        chunked = await client.get("/chunked")
        interim = await client.get("/interim")
        until_close = await client.get("/until-close")
        head = await client.head("/echo")
    assert chunked.content == b"hello world"
    assert (interim.status_code, interim.content) == (201, b"done")
    assert "x-private" not in interim.headers  # named by the upstream's Connection header: hop-by-hop
    assert until_close.content == b"all of it"
    assert head.status_code == 200 and head.content == b""


async def test_a_stale_kept_alive_connection_is_replaced(front, upstream: FakeUpstream) -> None:
    url, _ = front
    async with httpx.AsyncClient(base_url=url) as client:
        assert (await client.get("/then-close")).content == b"ok"
        await asyncio.sleep(0.05)  # the upstream has closed the pooled connection by now
        assert (await client.post("/echo", content=b"again")).status_code == 200
    assert upstream.connections == 2


async def test_broken_answers(front) -> None:
    url, _ = front
    async with httpx.AsyncClient(base_url=url) as client:
        huge = await client.get("/huge-head")
        assert huge.status_code == 502  # a head far over HEAD_LIMIT is refused, not buffered
        assert (await client.get("/unasked-101")).status_code == 502  # no tunnel nobody asked for
        with pytest.raises(httpx.ReadError):  # a truncated body ends in a reset, never looks whole
            await client.get("/truncated")


async def test_release_cuts_an_in_flight_stream(front) -> None:
    url, transport = front
    async with httpx.AsyncClient(base_url=url) as client, client.stream("GET", "/stream") as response:
        chunks = response.aiter_raw()
        assert await anext(chunks)
        transport.release(KEY)
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
            async for _ in chunks:
                pass


async def test_upgrade_tunnels_raw_bytes(front) -> None:
    url, _ = front
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101")
        writer.write(b"ping")
        assert await reader.readexactly(len(b"early PING")) == b"early PING"
        writer.write_eof()  # half-closed: the upstream's answer still comes back
        assert await reader.read() == b""
    finally:
        writer.transport.abort()


async def test_a_refused_connection_fails_before_any_answer() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]

    async def refused(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", closed_port)

    transport = UpstreamTransport()
    app = web.Application()

    async def relay(request: web.Request) -> web.StreamResponse:
        with pytest.raises(UpstreamFailed):
            await transport.relay(request, Upstream(KEY, "gone", refused), UpstreamRequest(PORT, "/", []))
        return web.Response(status=204)

    app.router.add_get("/", relay)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://127.0.0.1:{runner.addresses[0][1]}/")).status_code == 204
    finally:
        await runner.cleanup()
