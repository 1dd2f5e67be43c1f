"""The sandbox proxy's transport: one request relayed over HTTP/1.1 to an upstream and back.

`aenv.api.proxy` decides where a request goes, whether it may, and which head it carries; this
module moves the bytes, as httpx's transports sit below its client. Given the client's aiohttp
request, an `Upstream` (how to connect) and the composed `UpstreamRequest`, it frames the body
(`Content-Length`, chunked, or an `Upgrade`), speaks HTTP/1.1 with h11 over asyncio streams,
streams bodies both ways with backpressure, tunnels raw bytes after a `101 Switching Protocols`,
and keeps connections alive per upstream and port. An upstream is a port of a sandbox's guest (on
a node) or the node that holds the sandbox (on a gateway).

It uses no HTTP client library: the target must reach the upstream byte for byte, and a tunnel
needs the raw connection. h11 parses the answers, so what is buffered is bounded: a response head,
a chunk header or a trailer block still incomplete after `HEAD_LIMIT` bytes ends the exchange
(`UpstreamFailed`), and bodies are passed on as they arrive, at most one read at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field

import h11
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

log = logging.getLogger(__name__)

# A TCG guest under load can take seconds to answer a SYN; a closed port answers at once (RST).
CONNECT_TIMEOUT = 10.0
# Idle pooled connections are dropped well before envd's 75 s keep-alive would close them under us.
IDLE_TIMEOUT = 30.0
MAX_IDLE_PER_PORT = 16
# How much of a response head (or chunk header, or trailer block) is buffered before it must be whole.
HEAD_LIMIT = 64 * 1024
_CHUNK = 256 * 1024
# Bodies up to this size are read whole: one write upstream, and a replay on a stale connection.
_SMALL_BODY = 64 * 1024

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
    "proxy-authenticate", "proxy-authorization",
})  # fmt: skip
# Besides the hop-by-hop headers, each hop frames the body itself and answers `Expect` itself
# (aiohttp sends the client its 100 Continue).
_REFRAMED = HOP_BY_HOP | {"content-length", "expect"}


Fields = CIMultiDict[str] | CIMultiDictProxy[str]


def connection_tokens(headers: Fields) -> set[str]:
    """The header names a message's `Connection` header lists (hop-by-hop by declaration)."""
    return {t.strip().lower() for value in headers.getall("Connection", ()) for t in value.split(",")}


def end_to_end(headers: Fields) -> Iterator[tuple[str, str]]:
    """The headers a proxy passes on: neither hop-by-hop nor about this hop's framing."""
    dropped = _REFRAMED | connection_tokens(headers)
    return ((k, v) for k, v in headers.items() if k.lower() not in dropped)


def is_upgrade(request: web.Request) -> bool:
    return "upgrade" in connection_tokens(request.headers) and "Upgrade" in request.headers


class UpstreamFailed(Exception):
    """The upstream refused, reset or closed the connection before answering, or answered garbage."""


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


# How a connection to the upstream breaks: reset, closed early, or an answer h11 refuses.
_BROKEN = (OSError, h11.RemoteProtocolError, UpstreamFailed)

Opener = Callable[[int], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


@dataclass(frozen=True)
class Upstream:
    """Where requests go: `open(port)` connects; connections are pooled under `key`.

    `address` identifies the endpoint behind the key: when it changes (a resumed sandbox's new
    namespace, a node's new address) the old pool is closed and a new one made.
    """

    key: str
    address: object
    open: Opener = field(compare=False)


@dataclass(frozen=True)
class UpstreamRequest:
    """What the policy sends: the guest port, the raw target and the end-to-end header fields.

    The transport sends `headers` as they are, adding only the framing of the body it relays.
    """

    port: int
    target: str
    headers: list[tuple[str, str]]


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def _fields(response: h11.Response | h11.InformationalResponse) -> CIMultiDict[str]:
    """The response's header fields as received (names in their case, in their order)."""
    return CIMultiDict((_decode(k), _decode(v)) for k, v in response.headers.raw_items())


@dataclass(eq=False)
class _Connection:
    port: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    http: h11.Connection = field(
        default_factory=lambda: h11.Connection(h11.CLIENT, max_incomplete_event_size=HEAD_LIMIT)
    )
    idle_since: float = 0.0
    aborted: bool = False
    received: int = 0  # bytes of the current answer so far (none: a stale kept-alive connection)

    def reusable(self, now: float) -> bool:
        fresh = now - self.idle_since < IDLE_TIMEOUT
        return fresh and not self.writer.is_closing() and not self.reader.at_eof()

    def send(self, *events: h11.Event) -> None:
        self.writer.writelines(
            [data for e in events for data in self.http.send_with_data_passthrough(e) or ()]
        )

    async def next_event(self) -> h11.Event | type[h11.PAUSED]:
        while (event := self.http.next_event()) is h11.NEED_DATA:
            data = await self.reader.read(_CHUNK)  # b"": closed, which h11 turns into an event or an error
            self.received += len(data)
            self.http.receive_data(data)
        return event

    async def final_response(self) -> h11.Response | h11.InformationalResponse:
        """The answer after any interim 1xx (100 Continue, 103 Early Hints): a response or a 101."""
        while True:
            event = await self.next_event()
            if isinstance(event, h11.Response) or (
                isinstance(event, h11.InformationalResponse) and event.status_code == 101
            ):
                return event
            if not isinstance(event, h11.InformationalResponse):
                raise UpstreamFailed(f"expected a response, got {event!r}")

    def finished(self) -> bool:
        """Whether the exchange ended with the connection kept alive; then it is ready for the next."""
        if self.http.our_state is h11.DONE and self.http.their_state is h11.DONE:
            self.http.start_next_cycle()
            self.received = 0
            return True
        return False

    def abort(self) -> None:
        self.aborted = True
        self.writer.transport.abort()


@dataclass(eq=False)
class UpstreamPool:
    """Keep-alive connections to one upstream, per port; closing it cuts in-flight ones too."""

    upstream: Upstream
    idle: dict[int, list[_Connection]] = field(default_factory=dict)
    busy: set[_Connection] = field(default_factory=set)
    closed: bool = False

    async def connect(self, port: int) -> _Connection:
        try:
            reader, writer = await asyncio.wait_for(self.upstream.open(port), CONNECT_TIMEOUT)
        except (OSError, TimeoutError) as exc:
            raise UpstreamFailed(f"connect: {exc!r}") from exc
        conn = _Connection(port, reader, writer)
        if self.closed:
            conn.abort()
            raise UpstreamFailed("connect: the upstream was released meanwhile")
        self.busy.add(conn)
        return conn

    def take(self, port: int) -> _Connection | None:
        idle, now = self.idle.get(port), time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.reusable(now):
                self.busy.add(conn)
                return conn
            conn.abort()
        return None

    def give_back(self, conn: _Connection) -> None:
        self.busy.discard(conn)
        idle = self.idle.setdefault(conn.port, [])
        if self.closed or len(idle) >= MAX_IDLE_PER_PORT:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def discard(self, conn: _Connection) -> None:
        self.busy.discard(conn)
        conn.abort()

    def close(self) -> None:
        self.closed = True
        for conn in [*self.busy, *(c for idle in self.idle.values() for c in idle)]:
            conn.abort()
        self.busy.clear()
        self.idle.clear()


def reset(transport: asyncio.BaseTransport | None) -> None:
    """Close a client connection with a TCP reset rather than a FIN.

    The SDKs tell "sandbox killed" from a network failure by probing envd's `/health` after a
    dropped stream, and only for transport failures: the Python SDK's HTTP client (pyqwest) reports
    a reset as a `ReadError` (probed), but a FIN inside a chunked body as a `RemoteProtocolError`,
    which SDK 2.4x maps to the generic "sandbox timeout" message without probing.
    """
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _ClientStream:
    """The client's bytes after a 101, fed by aiohttp's protocol in place of its WebSocket reader.

    aiohttp has no public way to read a connection's raw bytes after a 101: `WebSocketResponse`
    parses frames (relaying messages instead of bytes would re-negotiate extensions and cost a
    parse per frame), and asyncio's `set_protocol` would lose the bytes aiohttp has already read
    past the request and its own connection bookkeeping. `RequestHandler.set_parser` is the hook
    `WebSocketResponse` itself uses; `tests/api/test_upstream.py` tunnels through it. The
    StreamReader pauses the client transport when its buffer fills, which is the backpressure.
    """

    def __init__(self, request: web.Request):
        self.reader = asyncio.StreamReader(limit=_CHUNK)
        if request.transport is not None:
            self.reader.set_transport(request.transport)
        request.protocol.set_parser(self)

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        self.reader.feed_data(data)
        return False, b""

    def feed_eof(self) -> None:
        self.reader.feed_eof()


def _content_length(response: h11.Response, method: str) -> int | None:
    """The body length the client is told; None for a body streamed chunked or until close."""
    fields = dict(response.headers)  # names lower-cased; h11 has refused malformed lengths
    if method == "HEAD":
        value = fields.get(b"content-length", b"")
        return int(value) if value.isdigit() else None
    if response.status_code in (204, 304):
        return 0
    if b"transfer-encoding" in fields or b"content-length" not in fields:
        return None
    return int(fields[b"content-length"])


class UpstreamTransport:
    """Relays requests to upstreams over pooled HTTP/1.1 connections; the proxy's wire.

    `release(key)` closes every connection of an upstream, ending in-flight responses and tunnels.
    """

    def __init__(self) -> None:
        self._pools: dict[str, UpstreamPool] = {}

    def _pool(self, upstream: Upstream) -> UpstreamPool:
        pool = self._pools.get(upstream.key)
        if pool is None or pool.upstream.address != upstream.address:
            if pool is not None:
                pool.close()
            pool = self._pools[upstream.key] = UpstreamPool(upstream)
        return pool

    def release(self, key: str) -> None:
        if (pool := self._pools.pop(key, None)) is not None:
            pool.close()

    def close(self) -> None:
        for key in list(self._pools):
            self.release(key)

    async def relay(
        self, request: web.Request, upstream: Upstream, outgoing: UpstreamRequest
    ) -> web.StreamResponse:
        """Send the request upstream and relay the answer, or tunnel after a 101.

        Raises `UpstreamFailed` or `ClientGone` before any answer reached the client; after that
        a failure resets the client connection.
        """
        pool = self._pool(upstream)
        if is_upgrade(request):
            return await self._upgrade(request, outgoing, pool)
        conn, response, sender = await self._exchange(request, outgoing, pool)
        return await self._respond(request, pool, conn, response, sender, reusable=True)

    @staticmethod
    def _h11_request(
        request: web.Request, outgoing: UpstreamRequest, framing: Iterable[tuple[str, str]]
    ) -> h11.Request:
        fields = [(_encode(k), _encode(v)) for k, v in (*outgoing.headers, *framing)]
        try:
            return h11.Request(method=request.method, target=_encode(outgoing.target), headers=fields)
        except h11.LocalProtocolError as exc:  # a target or field the client's parser let through
            raise UpstreamFailed(f"not an HTTP/1.1 request head: {exc}") from exc

    async def _exchange(
        self, request: web.Request, outgoing: UpstreamRequest, pool: UpstreamPool
    ) -> tuple[_Connection, h11.Response, asyncio.Task[None] | None]:
        """Send the request (body streamed in a task if large) and read the response head.

        A pooled connection the upstream closed meanwhile fails before any answer; the request is
        then replayed once on a fresh connection, if its body is still at hand.
        """
        chunked = "chunked" in request.headers.get("Transfer-Encoding", "").lower()
        length = request.content_length
        body: bytes | None = b""
        if chunked:
            framing, body = [("Transfer-Encoding", "chunked")], None
        elif length is not None:
            framing = [("Content-Length", str(length))]
            if length > _SMALL_BODY:
                body = None
            elif length:
                try:
                    body = await request.content.readexactly(length)
                except asyncio.IncompleteReadError as exc:
                    raise ClientGone from exc
        else:
            framing = []
        head = self._h11_request(request, outgoing, framing)
        for attempt in range(2):
            conn = pool.take(outgoing.port) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await pool.connect(outgoing.port)
            sender = None
            if body is None:
                conn.send(head)
                sender = asyncio.create_task(self._send_body(request, conn))
            else:
                conn.send(head, h11.Data(data=body), h11.EndOfMessage())
            try:
                response = await conn.final_response()
                assert isinstance(response, h11.Response)  # h11 refuses a 101 to a request without Upgrade
                return conn, response, sender
            except _BROKEN as exc:
                pool.discard(conn)
                if sender is not None:
                    sender.cancel()
                if not (reused and body is not None and conn.received == 0):
                    raise UpstreamFailed(f"no response: {exc!r}") from exc
        raise AssertionError("unreachable")

    @staticmethod
    async def _send_body(request: web.Request, conn: _Connection) -> None:
        """Stream the client's body upstream as it arrives; on failure cut the upstream connection."""
        try:
            while data := await request.content.readany():
                conn.send(h11.Data(data=data))
                await conn.writer.drain()
            conn.send(h11.EndOfMessage())
            await conn.writer.drain()
        except Exception as exc:
            log.debug("request body to upstream port %d ended early: %r", conn.port, exc)
            conn.abort()

    @staticmethod
    async def _relay_body(conn: _Connection, resp: web.StreamResponse) -> None:
        """Copy the response body as it arrives; trailers are dropped (aiohttp cannot send them)."""
        while not isinstance(event := await conn.next_event(), h11.EndOfMessage):
            if not isinstance(event, h11.Data):
                raise UpstreamFailed(f"expected a response body, got {event!r}")
            await resp.write(event.data)

    async def _respond(
        self,
        request: web.Request,
        pool: UpstreamPool,
        conn: _Connection,
        response: h11.Response,
        sender: asyncio.Task[None] | None,
        *,
        reusable: bool,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(status=response.status_code, reason=_decode(response.reason))
        resp.headers.extend(end_to_end(_fields(response)))
        resp.content_length = _content_length(response, request.method)
        complete = False
        try:
            await resp.prepare(request)
            await self._relay_body(conn, resp)
            if conn.aborted:  # released mid-body: an end-at-close body would otherwise look whole
                raise ConnectionAbortedError("upstream released")
            complete = True
            await resp.write_eof()
        except (*_BROKEN, ValueError) as exc:
            # The upstream or the client went away mid-body: reset the client connection without
            # completing the message, so a truncated body is never mistaken for a whole one.
            log.debug("proxied response ended early: %r", exc)
            reset(request.transport)
        finally:
            if sender is not None and not sender.done():
                sender.cancel()
                reusable = False
            if complete and reusable and conn.finished():
                pool.give_back(conn)
            else:
                pool.discard(conn)
        return resp

    async def _upgrade(
        self, request: web.Request, outgoing: UpstreamRequest, pool: UpstreamPool
    ) -> web.StreamResponse:
        """Pass an Upgrade (WebSocket) request on; after the upstream's 101, tunnel bytes both ways."""
        framing = [("Connection", "Upgrade"), ("Upgrade", request.headers["Upgrade"])]
        head = self._h11_request(request, outgoing, framing)
        conn = await pool.connect(outgoing.port)
        conn.send(head, h11.EndOfMessage())
        try:
            response = await conn.final_response()
        except _BROKEN as exc:
            pool.discard(conn)
            raise UpstreamFailed(f"no response: {exc!r}") from exc
        if isinstance(response, h11.Response):
            return await self._respond(request, pool, conn, response, None, reusable=False)
        resp = web.StreamResponse(status=101, reason=_decode(response.reason))
        resp.headers.extend(_fields(response))
        resp.force_close()
        try:
            await resp.prepare(request)
            incoming = _ClientStream(request)
            if early := conn.http.trailing_data[0]:  # tunnel bytes that came with the 101
                await resp.write(early)
            await _splice(request, incoming.reader, conn, resp)
        except OSError as exc:
            log.debug("tunnel to upstream port %d ended: %r", conn.port, exc)
        finally:
            pool.discard(conn)
        return resp


async def _splice(
    request: web.Request, incoming: asyncio.StreamReader, conn: _Connection, resp: web.StreamResponse
) -> None:
    async def up() -> None:
        while data := await incoming.read(_CHUNK):
            conn.writer.write(data)
            await conn.writer.drain()
        if conn.writer.can_write_eof():
            conn.writer.write_eof()

    async def down() -> None:
        while data := await conn.reader.read(_CHUNK):
            await resp.write(data)

    upward, downward = asyncio.create_task(up()), asyncio.create_task(down())
    try:
        await asyncio.wait((upward, downward), return_when=asyncio.FIRST_COMPLETED)
        client = request.transport
        half_closed = upward.done() and upward.exception() is None and client and not client.is_closing()
        if half_closed:  # the client only shut down its sending side: keep relaying the upstream's answer
            await downward
    finally:
        for task in (upward, downward):
            task.cancel()
        await asyncio.gather(upward, downward, return_exceptions=True)
