"""Reverse proxy from the node's HTTP server to TCP ports inside sandboxes: the E2B data plane.

A request reaches a sandbox port in one of three ways: the `E2b-Sandbox-Id`/`E2b-Sandbox-Port`
headers of the SDK's single-URL mode (they win when present), a host `{port}-{sandboxID}.{domain}`
(the SDK's host mode, `Sandbox.get_host`, presigned file URLs), or AgentENV's `/proxy/...` prefix.

The proxy speaks HTTP/1.1 to the guest itself, on asyncio streams over sockets created inside the
sandbox's network namespace, rather than through an HTTP client library: it needs byte-exact request
targets, pass-through headers, streaming both ways with backpressure, and raw tunnels after a
`101 Switching Protocols`. A keep-alive pool per sandbox and port keeps a small RPC almost as cheap
through the proxy as a direct call.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import posixpath
import re
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol
from urllib.parse import unquote

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from .. import logs
from ..agent.envd import ENVD_PORT
from ..cluster.auth import CLUSTER_SECRET_HEADER
from ..network.forward import open_guest_connection
from ..network.netns import GUEST_ADDRESS, SandboxNetwork
from ..telemetry import PROXIED

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]

# A TCG guest under load can take seconds to answer a SYN; a closed port answers at once (RST).
CONNECT_TIMEOUT = 10.0
# Idle pooled connections are dropped well before envd's 75 s keep-alive would close them under us.
IDLE_TIMEOUT = 30.0
MAX_IDLE_PER_PORT = 16
_CHUNK = 256 * 1024
# Bodies up to this size are read whole: one write upstream, and a replay on a stale connection.
_SMALL_BODY = 64 * 1024

TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"
ACCESS_TOKEN_HEADER = "x-access-token"
# (E2B name, AgentENV alias) for the sandbox ID and the guest port.
_ID_HEADERS = ("e2b-sandbox-id", "x-agentenv-sandbox-id")
_PORT_HEADERS = ("e2b-sandbox-port", "x-agentenv-target-port")

_SANDBOX_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,127}")
_HOST_LABEL = re.compile(r"([0-9]{1,5})-([a-z0-9][a-z0-9-]{0,127})")

_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
    "proxy-authenticate", "proxy-authorization",
})  # fmt: skip
# Request headers the proxy consumes or sets itself (the cluster secret never reaches a guest).
_NOT_FORWARDED = _HOP_BY_HOP | {
    "content-length", "expect", "x-forwarded-for", TRAFFIC_TOKEN_HEADER, *_ID_HEADERS, *_PORT_HEADERS,
    CLUSTER_SECRET_HEADER.lower(),
}  # fmt: skip

# envd routes only the node may call (`x-internal` in envd.yaml), refused whatever the method: /init
# sets the access token and the clock, the others freeze the guest.
ENVD_INTERNAL_PATHS = frozenset(
    {"/init", "/freeze", "/unfreeze", "/collapse", "/fsfreeze", "/fsthaw", "/upgrade"}
)
# envd requests that need no X-Access-Token (as in envd itself): /files checks signatures instead.
_ENVD_TOKEN_EXEMPT = frozenset({("GET", "/health"), ("GET", "/files"), ("POST", "/files")})

SANDBOX_NOT_FOUND = "The sandbox was not found"
PORT_NOT_OPEN = "The sandbox is running but port is not open"
INTERNAL_ROUTE = (
    "This endpoint is reserved for the E2B control plane and is not reachable through the sandbox URL"
)
ENVD_UNAUTHORIZED = "unauthorized access, please provide a valid access token or method signing if supported"


@dataclass(frozen=True)
class SandboxAccess:
    """Who may reach a sandbox's ports: known whether it runs or not, so checked before waking it."""

    envd_access_token: str | None
    traffic_access_token: str | None
    secure: bool
    public_traffic: bool
    # E2B's `maskRequestHost`: the Host header the guest's servers see on other ports than envd's,
    # with `${PORT}` standing for the port (for servers that answer only their public name).
    mask_request_host: str | None = None


@dataclass
class ProxyTarget:
    """Where a running sandbox's traffic goes.

    `network` must be the live namespace object of the sandbox's current VM: pooled connections are
    kept per object, so a resumed sandbox (new namespace, same name) never gets a stale connection.
    """

    sandbox_id: str
    network: SandboxNetwork


class SandboxResolver(Protocol):
    """Implemented by the node server: maps a sandbox ID to its credentials and where its traffic goes."""

    async def proxy_access(self, sandbox_id: str) -> SandboxAccess | None:
        """The credentials of a known sandbox, running or paused, without waking it; None if unknown."""
        ...

    async def proxy_target(self, sandbox_id: str, *, resume: bool) -> ProxyTarget | None:
        """The running sandbox, or None if unknown, killed, or paused and not auto-resumed.

        With `resume`, a paused sandbox with auto-resume on is resumed first. Raising TimeoutError
        answers 504, any other exception 502.
        """
        ...


class RoutingError(Exception):
    """The request addresses a sandbox, but malformed (answered with 400)."""


@dataclass(frozen=True)
class ProxyRoute:
    """A classified data-plane request: sandbox, guest port and the raw target sent upstream."""

    sandbox_id: str
    port: int
    target: str
    host: str | None = None  # the Host header sent upstream instead of the client's

    @property
    def path(self) -> str:
        """The decoded, cleaned path: a superset of what a guest router could match it to."""
        path = unquote(self.target.partition("?")[0])
        return posixpath.normpath(re.sub(r"/+", "/", "/" + path))


def _json_response(status: int, body: dict[str, Any]) -> web.Response:
    return web.Response(
        status=status, text=json.dumps(body), content_type="application/json", charset="utf-8",
        headers={"Access-Control-Allow-Origin": "*"},
    )  # fmt: skip


def sandbox_error(status: int, sandbox_id: str, message: str, **extra: Any) -> web.Response:
    return _json_response(status, {"sandboxId": sandbox_id, "message": message, **extra, "code": status})


def _port(value: str, what: str) -> int:
    if not value.isascii() or not value.isdigit() or not 0 < int(value) < 65536:
        raise RoutingError(f"invalid {what}: {value!r} is not a TCP port")
    return int(value)


def _sandbox_id(value: str, what: str) -> str:
    if not _SANDBOX_ID.fullmatch(value):
        raise RoutingError(f"invalid {what}: {value!r} is not a sandbox ID")
    return value


def _header(headers: CIMultiDictProxy[str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        if (value := headers.get(name)) is not None:
            return name, value.strip()
    return None


def _route_from_headers(headers: CIMultiDictProxy[str]) -> tuple[str, int] | None:
    sandbox, port = _header(headers, _ID_HEADERS), _header(headers, _PORT_HEADERS)
    if sandbox is None and port is None:
        return None
    if sandbox is None:
        raise RoutingError("Missing header: E2b-Sandbox-Id")
    if port is None:
        raise RoutingError("Missing header: E2b-Sandbox-Port")
    return _sandbox_id(sandbox[1], f"header {sandbox[0]}"), _port(port[1], f"header {port[0]}")


def _connection_tokens(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> set[str]:
    return {t.strip().lower() for value in headers.getall("Connection", ()) for t in value.split(",")}


def _is_upgrade(request: web.Request) -> bool:
    return "upgrade" in _connection_tokens(request.headers) and "Upgrade" in request.headers


# --- the guest side -------------------------------------------------------------------------------


@dataclass(eq=False)
class _Connection:
    port: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0
    aborted: bool = False

    def reusable(self, now: float) -> bool:
        fresh = now - self.idle_since < IDLE_TIMEOUT
        return fresh and not self.writer.is_closing() and not self.reader.at_eof()

    def abort(self) -> None:
        self.aborted = True
        self.writer.transport.abort()


Opener = Callable[[int], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


@dataclass(eq=False)
class UpstreamPool:
    """Keep-alive connections to one upstream, per guest port; closing it cuts in-flight ones too.

    `upstream` identifies where `open(port)` connects: a sandbox VM's live network namespace on a
    node, or the node that holds the sandbox on a gateway.
    """

    upstream: object
    open: Opener
    idle: dict[int, list[_Connection]] = field(default_factory=dict)
    busy: set[_Connection] = field(default_factory=set)
    closed: bool = False

    async def connect(self, port: int) -> _Connection:
        reader, writer = await asyncio.wait_for(self.open(port), CONNECT_TIMEOUT)
        conn = _Connection(port, reader, writer)
        if self.closed:
            conn.abort()
            raise ConnectionAbortedError("sandbox released")
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


class _UpstreamFailed(Exception):
    """The guest refused, reset or closed the connection before answering."""


# How a connection to the guest breaks: reset, closed early, garbage, or an oversized head.
_BROKEN = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, _UpstreamFailed)


class _ClientGone(Exception):
    """The client disconnected before its request body was complete."""


@dataclass
class _ResponseHead:
    status: int
    reason: str
    headers: CIMultiDict[str]
    keep_alive: bool
    length: int | None
    chunked: bool


async def _read_response_head(reader: asyncio.StreamReader, method: str) -> _ResponseHead:
    raw = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = raw[:-4].decode("utf-8", "replace").split("\r\n")
    version, _, rest = status_line.partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise _UpstreamFailed(f"malformed status line {status_line[:80]!r}")
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines:
        name, sep, value = line.partition(":")
        if sep and name and name == name.strip():
            headers.add(name, value.strip())
    status = int(code)
    keep_alive = version == "HTTP/1.1" and "close" not in _connection_tokens(headers)
    length: int | None = None
    chunked = False
    if method == "HEAD" or 100 <= status < 200 or status in (204, 304):
        length = 0
    elif "chunked" in headers.get("Transfer-Encoding", "").lower():
        chunked = True
    elif (value := headers.get("Content-Length")) is not None:
        if not value.isdigit():
            raise _UpstreamFailed(f"malformed Content-Length {value!r}")
        length = int(value)
    else:
        keep_alive = False  # the body ends when the guest closes the connection
    return _ResponseHead(status, reason or "", headers, keep_alive, length, chunked)


async def _read_final_head(reader: asyncio.StreamReader, method: str) -> _ResponseHead:
    """The response head after any interim 1xx (100 Continue, 103 Early Hints), or a 101."""
    while (head := await _read_response_head(reader, method)).status < 200 and head.status != 101:
        pass
    return head


def _reset(transport: asyncio.BaseTransport | None) -> None:
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


async def _relay_body(reader: asyncio.StreamReader, resp: web.StreamResponse, head: _ResponseHead) -> None:
    """Copy the response body as it arrives; raises IncompleteReadError if the guest stops short."""

    async def copy(remaining: int) -> None:
        while remaining:
            data = await reader.read(min(remaining, _CHUNK))
            if not data:
                raise asyncio.IncompleteReadError(b"", remaining)
            remaining -= len(data)
            await resp.write(data)

    if head.chunked:
        while size := int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16):
            await copy(size)
            if await reader.readexactly(2) != b"\r\n":
                raise _UpstreamFailed("malformed chunk")
        while await reader.readuntil(b"\r\n") != b"\r\n":
            pass  # trailers: dropped, aiohttp's chunked writer cannot send them
    elif head.length is not None:
        await copy(head.length)
    else:
        while data := await reader.read(_CHUNK):
            await resp.write(data)


class _UpgradedStream:
    """Client bytes after a 101, fed by aiohttp's protocol in place of its WebSocket frame parser.

    The StreamReader pauses the client transport when its buffer fills, which is the backpressure.
    """

    def __init__(self, transport: asyncio.Transport | None):
        self.reader = asyncio.StreamReader(limit=_CHUNK)
        if transport is not None:
            self.reader.set_transport(transport)

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        self.reader.feed_data(data)
        return False, b""

    def feed_eof(self) -> None:
        self.reader.feed_eof()


# --- the proxy ------------------------------------------------------------------------------------


class SandboxProxy:
    """Routes data-plane requests to sandbox ports; see the module docstring for the three forms.

    Mount: `web.Application(middlewares=[proxy.middleware(), <API-key auth>, ...])`, then
    `proxy.setup(app)` for the `/proxy` routes and pool cleanup. Call `release(sandbox_id)` when a
    sandbox is paused or killed, so its connections (in-flight streams included) end at once.
    """

    upstream_failed = PORT_NOT_OPEN  # what a client is told when the upstream fails to answer

    def __init__(self, resolver: SandboxResolver, domain: str | None = None):
        self._resolver = resolver
        self.domain = domain.strip(".").lower() if domain else None
        self._pools: dict[str, UpstreamPool] = {}

    # classification

    def _route_from_host(self, host: str | None) -> tuple[str, int] | None:
        if not host or host.startswith("["):
            return None
        name = host.strip().lower().rsplit(":", 1)[0].rstrip(".")
        label, _, rest = name.partition(".")
        if self.domain is not None:
            if rest != self.domain:
                return None
            if not (match := _HOST_LABEL.fullmatch(label)):
                expected = f"<port>-<sandboxID>.{self.domain}"
                raise RoutingError(f"invalid sandbox host {label!r}: expected {expected}")
        elif not rest or not (match := _HOST_LABEL.fullmatch(label)):
            return None
        return match[2], _port(match[1], "host port")

    def classify(self, request: web.Request) -> ProxyRoute | None:
        """The sandbox route of a data-plane request, None for anything else; RoutingError if malformed."""
        headers = _route_from_headers(request.headers)
        host = self._route_from_host(request.headers.get("Host"))
        raw = request.raw_path
        if host is None and (raw == "/proxy" or raw.startswith(("/proxy/", "/proxy?"))):
            if headers is None:
                raise RoutingError("missing sandbox routing headers: E2b-Sandbox-Id and E2b-Sandbox-Port")
            target = raw[len("/proxy") :]
            return ProxyRoute(*headers, target if target.startswith("/") else "/" + target)
        route = headers or host
        return None if route is None else ProxyRoute(*route, raw)

    def middleware(self) -> Middleware:
        """Serves data-plane requests itself; put it before API-key auth, as they carry no API key."""

        @web.middleware
        async def sandbox_proxy(request: web.Request, handler: Handler) -> web.StreamResponse:
            try:
                route = self.classify(request)
            except RoutingError as exc:
                return _json_response(400, {"code": 400, "message": str(exc)})
            if route is None:
                return await handler(request)
            return await self._relayed(request, route)

        return sandbox_proxy

    async def _relayed(self, request: web.Request, route: ProxyRoute) -> web.StreamResponse:
        """`serve`, counted as the data plane's (`aenv.telemetry`) and logged as its sandbox's."""
        request[PROXIED] = True
        with logs.sandbox_context(route.sandbox_id):
            return await self.serve(request, route)

    async def handle_proxy_path(self, request: web.Request) -> web.StreamResponse:
        """Route handler for `/proxy` and `/proxy/{tail}` (also works without the middleware)."""
        try:
            route = self.classify(request)
        except RoutingError as exc:
            return _json_response(400, {"code": 400, "message": str(exc)})
        if route is None:
            return _json_response(400, {"code": 400, "message": "missing sandbox routing headers"})
        return await self._relayed(request, route)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.route("*", "/proxy", self.handle_proxy_path),
            web.route("*", "/proxy/{tail:.*}", self.handle_proxy_path),
        ]

    def setup(self, app: web.Application) -> None:
        """Add the `/proxy` routes and close the guest connections when the app shuts down."""
        app.add_routes(self.routes())

        async def cleanup(app: web.Application) -> None:
            self.close()

        app.on_cleanup.append(cleanup)

    # pools

    def _pool(self, target: ProxyTarget) -> UpstreamPool:
        pool = self._pools.get(target.sandbox_id)
        if pool is None or pool.upstream is not target.network:
            if pool is not None:
                pool.close()
            opener = functools.partial(open_guest_connection, target.network)
            pool = self._pools[target.sandbox_id] = UpstreamPool(target.network, opener)
        return pool

    def release(self, sandbox_id: str) -> None:
        """Close every connection to the sandbox, ending in-flight responses and tunnels."""
        if (pool := self._pools.pop(sandbox_id, None)) is not None:
            pool.close()

    def close(self) -> None:
        for sandbox_id in list(self._pools):
            self.release(sandbox_id)

    # serving

    def _denied(self, request: web.Request, route: ProxyRoute, access: SandboxAccess) -> web.Response | None:
        if route.port == ENVD_PORT:
            token = access.envd_access_token
            if not access.secure or not token or request.method == "OPTIONS":
                return None
            if (request.method, route.path) in _ENVD_TOKEN_EXEMPT:
                return None
            sent = request.headers.get(ACCESS_TOKEN_HEADER, "")
            if hmac.compare_digest(sent.encode(), token.encode()):
                return None
            return _json_response(401, {"code": 401, "message": ENVD_UNAUTHORIZED})
        if access.public_traffic:
            return None
        sent = request.headers.get(TRAFFIC_TOKEN_HEADER)
        if sent is None:
            problem = f"Token header '{TRAFFIC_TOKEN_HEADER}' is missing"
        elif access.traffic_access_token and hmac.compare_digest(
            sent.encode(), access.traffic_access_token.encode()
        ):
            return None
        else:
            problem = f"Provided token in header '{TRAFFIC_TOKEN_HEADER}' is invalid"
        message = f"Sandbox is secured with traffic access token. {problem}"
        return sandbox_error(403, route.sandbox_id, message)

    async def serve(self, request: web.Request, route: ProxyRoute) -> web.StreamResponse:
        """Forward one classified request to its sandbox port and relay the answer.

        Credentials are checked before the sandbox is resolved: a request that is refused must not
        wake a paused sandbox with auto-resume.
        """
        if route.port == ENVD_PORT and route.path in ENVD_INTERNAL_PATHS:
            return _json_response(404, {"message": INTERNAL_ROUTE, "path": route.path, "code": 404})
        access = await self._resolver.proxy_access(route.sandbox_id)
        if access is None:
            self.release(route.sandbox_id)
            return sandbox_error(502, route.sandbox_id, SANDBOX_NOT_FOUND)
        if (denied := self._denied(request, route, access)) is not None:
            return denied
        if access.mask_request_host and route.port != ENVD_PORT:
            route = replace(route, host=access.mask_request_host.replace("${PORT}", str(route.port)))
        try:
            target = await self._resolver.proxy_target(route.sandbox_id, resume=True)
        except TimeoutError:
            return sandbox_error(504, route.sandbox_id, "The sandbox did not resume in time")
        except Exception:
            log.exception("resolving sandbox %s for the proxy failed", route.sandbox_id)
            return sandbox_error(502, route.sandbox_id, "The sandbox could not be resumed")
        if target is None:
            self.release(route.sandbox_id)
            return sandbox_error(502, route.sandbox_id, SANDBOX_NOT_FOUND)
        return await self.relay(request, route, self._pool(target))

    async def relay(self, request: web.Request, route: ProxyRoute, pool: UpstreamPool) -> web.StreamResponse:
        """Send the request to `pool`'s upstream and relay the answer, or tunnel after a 101."""
        try:
            if _is_upgrade(request):
                return await self._upgrade(request, route, pool)
            return await self._forward(request, route, pool)
        except _UpstreamFailed as exc:
            log.debug("sandbox %s port %d: %s", route.sandbox_id, route.port, exc)
            return sandbox_error(502, route.sandbox_id, self.upstream_failed, port=route.port)
        except _ClientGone:
            return web.Response(status=400, text="incomplete request body")

    def _request_head(self, request: web.Request, route: ProxyRoute, extra: list[str]) -> bytes:
        dropped = _NOT_FORWARDED | _connection_tokens(request.headers)
        if route.host is not None:
            dropped |= {"host"}
        lines = [f"{request.method} {route.target} HTTP/1.1"]
        lines += [f"{k}: {v}" for k, v in request.headers.items() if k.lower() not in dropped]
        if route.host is not None:
            lines.append(f"Host: {route.host}")
        elif "Host" not in request.headers:
            lines.append(f"Host: {GUEST_ADDRESS}:{route.port}")
        forwarded_for = [*request.headers.getall("X-Forwarded-For", ()), request.remote or ""]
        lines.append("X-Forwarded-For: " + ", ".join(v for v in forwarded_for if v))
        if "X-Forwarded-Host" not in request.headers and request.host:
            lines.append(f"X-Forwarded-Host: {request.host}")
        if "X-Forwarded-Proto" not in request.headers:
            lines.append(f"X-Forwarded-Proto: {request.scheme}")
        lines += extra
        lines += self.hop_headers(request, route)
        return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")

    def hop_headers(self, request: web.Request, route: ProxyRoute) -> list[str]:
        """Header lines only this hop adds (none to a guest; a gateway adds its routing to the node)."""
        return []

    async def _exchange(
        self, request: web.Request, route: ProxyRoute, pool: UpstreamPool
    ) -> tuple[_Connection, _ResponseHead, asyncio.Task[None] | None]:
        """Send the request (body streamed in a task if large) and read the response head.

        A pooled connection the guest closed meanwhile fails before any answer; the request is then
        replayed once on a fresh connection, if its body is still at hand.
        """
        chunked = "chunked" in request.headers.get("Transfer-Encoding", "").lower()
        length = request.content_length
        body: bytes | None = b""
        if chunked:
            extra, body = ["Transfer-Encoding: chunked"], None
        elif length is not None:
            extra = [f"Content-Length: {length}"]
            if length > _SMALL_BODY:
                body = None
            elif length:
                try:
                    body = await request.content.readexactly(length)
                except asyncio.IncompleteReadError as exc:
                    raise _ClientGone from exc
        else:
            extra = []
        head = self._request_head(request, route, extra)
        for attempt in range(2):
            conn = pool.take(route.port) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                try:
                    conn = await pool.connect(route.port)
                except (OSError, TimeoutError) as exc:
                    raise _UpstreamFailed(f"connect: {exc!r}") from exc
            sender = None
            if body is None:
                conn.writer.write(head)
                sender = asyncio.create_task(self._send_body(request, conn, chunked))
            else:
                conn.writer.write(head + body)
            try:
                return conn, await _read_final_head(conn.reader, request.method), sender
            except _BROKEN as exc:
                pool.discard(conn)
                if sender is not None:
                    sender.cancel()
                nothing_read = not isinstance(exc, asyncio.IncompleteReadError) or not exc.partial
                if not (reused and body is not None and nothing_read):
                    raise _UpstreamFailed(f"no response: {exc!r}") from exc
        raise AssertionError("unreachable")

    async def _send_body(self, request: web.Request, conn: _Connection, chunked: bool) -> None:
        """Stream the client's body upstream as it arrives; on failure cut the guest connection."""
        try:
            while data := await request.content.readany():
                if chunked:
                    conn.writer.writelines((b"%x\r\n" % len(data), data, b"\r\n"))
                else:
                    conn.writer.write(data)
                await conn.writer.drain()
            if chunked:
                conn.writer.write(b"0\r\n\r\n")
                await conn.writer.drain()
        except Exception as exc:
            log.debug("request body to guest port %d ended early: %r", conn.port, exc)
            conn.abort()

    async def _forward(
        self, request: web.Request, route: ProxyRoute, pool: UpstreamPool
    ) -> web.StreamResponse:
        conn, head, sender = await self._exchange(request, route, pool)
        return await self._respond(request, pool, conn, head, sender, reusable=head.keep_alive)

    async def _respond(
        self,
        request: web.Request,
        pool: UpstreamPool,
        conn: _Connection,
        head: _ResponseHead,
        sender: asyncio.Task[None] | None,
        *,
        reusable: bool,
    ) -> web.StreamResponse:
        dropped = _HOP_BY_HOP | {"content-length"} | _connection_tokens(head.headers)
        resp = web.StreamResponse(status=head.status, reason=head.reason)
        resp.headers.extend((k, v) for k, v in head.headers.items() if k.lower() not in dropped)
        if request.method == "HEAD":
            with contextlib.suppress(KeyError, ValueError):
                resp.content_length = int(head.headers["Content-Length"])
        elif head.length is not None:
            resp.content_length = head.length
        complete = False
        try:
            await resp.prepare(request)
            await _relay_body(conn.reader, resp, head)
            if conn.aborted:  # released mid-body: an end-at-close body would otherwise look whole
                raise ConnectionAbortedError("sandbox released")
            complete = True
            await resp.write_eof()
        except (*_BROKEN, ValueError) as exc:
            # The guest or the client went away mid-body: reset the client connection without
            # completing the message, so a truncated body is never mistaken for a whole one.
            log.debug("proxied response ended early: %r", exc)
            _reset(request.transport)
        finally:
            if sender is not None and not sender.done():
                sender.cancel()
                reusable = False
            if complete and reusable:
                pool.give_back(conn)
            else:
                pool.discard(conn)
        return resp

    async def _upgrade(
        self, request: web.Request, route: ProxyRoute, pool: UpstreamPool
    ) -> web.StreamResponse:
        """Pass an Upgrade (WebSocket) request on; after the guest's 101, tunnel bytes both ways."""
        try:
            conn = await pool.connect(route.port)
        except (OSError, TimeoutError) as exc:
            raise _UpstreamFailed(f"connect: {exc!r}") from exc
        upgrade = ["Connection: Upgrade", f"Upgrade: {request.headers['Upgrade']}"]
        conn.writer.write(self._request_head(request, route, upgrade))
        try:
            head = await _read_final_head(conn.reader, request.method)
        except _BROKEN as exc:
            pool.discard(conn)
            raise _UpstreamFailed(f"no response: {exc!r}") from exc
        if head.status != 101:
            return await self._respond(request, pool, conn, head, None, reusable=False)
        resp = web.StreamResponse(status=101, reason=head.reason)
        resp.headers.extend(head.headers)
        resp.force_close()
        try:
            await resp.prepare(request)
            incoming = _UpgradedStream(request.transport)
            request.protocol.set_parser(incoming)
            await self._splice(request, incoming.reader, conn, resp)
        except OSError as exc:
            log.debug("tunnel to guest port %d ended: %r", conn.port, exc)
        finally:
            pool.discard(conn)
        return resp

    @staticmethod
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
            if half_closed:  # the client only shut down its sending side: keep relaying the guest's answer
                await downward
        finally:
            for task in (upward, downward):
                task.cancel()
            await asyncio.gather(upward, downward, return_exceptions=True)
