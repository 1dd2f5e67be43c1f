"""Reverse proxy from the node's HTTP server to TCP ports inside sandboxes: the E2B data plane.

A request reaches a sandbox port in one of three ways: the `E2b-Sandbox-Id`/`E2b-Sandbox-Port`
headers of the SDK's single-URL mode (they win when present), a host `{port}-{sandboxID}.{domain}`
(the SDK's host mode, `Sandbox.get_host`, presigned file URLs), or AgentENV's `/proxy/...` prefix.

This module is the policy: which sandbox and port a request addresses, whether its credentials
let it through (checked before a paused sandbox is woken), which head the guest receives, and
the E2B error bodies. The bytes move below it, in a `Transport` (`aenv.api.upstream`, HTTP/1.1
to the guest over sockets made inside the sandbox's network namespace, kept alive per sandbox
and port, so a small RPC through the proxy costs about what a direct call does). Either side can
be replaced by a fake to test the other.
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import posixpath
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol
from urllib.parse import unquote

from aiohttp import web
from multidict import CIMultiDictProxy

from .. import logs
from ..agent.envd import ENVD_PORT
from ..cluster.auth import CLUSTER_SECRET_HEADER
from ..network.forward import open_guest_connection
from ..network.netns import GUEST_ADDRESS, SandboxNetwork
from ..telemetry import PROXIED
from .upstream import ClientGone, Upstream, UpstreamFailed, UpstreamRequest, UpstreamTransport, end_to_end

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]

TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"
ACCESS_TOKEN_HEADER = "x-access-token"
# (E2B name, AgentENV alias) for the sandbox ID and the guest port.
_ID_HEADERS = ("e2b-sandbox-id", "x-agentenv-sandbox-id")
_PORT_HEADERS = ("e2b-sandbox-port", "x-agentenv-target-port")

_SANDBOX_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,127}")
_HOST_LABEL = re.compile(r"([0-9]{1,5})-([a-z0-9][a-z0-9-]{0,127})")

# Request headers the proxy consumes or sets itself (the cluster secret never reaches a guest).
_NOT_FORWARDED = frozenset(
    {"x-forwarded-for", TRAFFIC_TOKEN_HEADER, *_ID_HEADERS, *_PORT_HEADERS, CLUSTER_SECRET_HEADER.lower()}
)

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


class Transport(Protocol):
    """What moves a request's bytes (`aenv.api.upstream.UpstreamTransport`, or a test's fake)."""

    async def relay(
        self, request: web.Request, upstream: Upstream, outgoing: UpstreamRequest
    ) -> web.StreamResponse:
        """Send `outgoing` with the request's body to `upstream` and relay the answer to the client.

        Raises `UpstreamFailed` or `ClientGone` while nothing has been answered yet.
        """
        ...

    def release(self, key: str) -> None:
        """Close every connection to the upstream pooled under `key`, in-flight ones too."""
        ...

    def close(self) -> None: ...


# --- the proxy ------------------------------------------------------------------------------------


class SandboxProxy:
    """Routes data-plane requests to sandbox ports; see the module docstring for the three forms.

    Mount: `web.Application(middlewares=[proxy.middleware(), <API-key auth>, ...])`, then
    `proxy.setup(app)` for the `/proxy` routes and connection cleanup. Call `release(sandbox_id)`
    when a sandbox is paused or killed, so its connections (in-flight streams included) end at once.
    """

    upstream_failed = PORT_NOT_OPEN  # what a client is told when the upstream fails to answer

    def __init__(
        self, resolver: SandboxResolver, domain: str | None = None, transport: Transport | None = None
    ):
        self._resolver = resolver
        self.domain = domain.strip(".").lower() if domain else None
        self.transport: Transport = transport or UpstreamTransport()

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

    def release(self, sandbox_id: str) -> None:
        """Close every connection to the sandbox, ending in-flight responses and tunnels."""
        self.transport.release(sandbox_id)

    def close(self) -> None:
        self.transport.close()

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
        return await self.relay(request, route, _guest(target))

    async def relay(self, request: web.Request, route: ProxyRoute, upstream: Upstream) -> web.StreamResponse:
        """Send the request on to `upstream` through the transport; its failures as E2B errors."""
        try:
            return await self.transport.relay(request, upstream, self.outgoing(request, route))
        except UpstreamFailed as exc:
            log.debug("sandbox %s port %d: %s", route.sandbox_id, route.port, exc)
            return sandbox_error(502, route.sandbox_id, self.upstream_failed, port=route.port)
        except ClientGone:
            return web.Response(status=400, text="incomplete request body")

    def outgoing(self, request: web.Request, route: ProxyRoute) -> UpstreamRequest:
        """The request head the upstream receives: the client's end-to-end fields but the proxy's
        own, the Host the route asks for, `X-Forwarded-*`, and this hop's `hop_headers`."""
        dropped = (_NOT_FORWARDED | {"host"}) if route.host is not None else _NOT_FORWARDED
        headers = [(k, v) for k, v in end_to_end(request.headers) if k.lower() not in dropped]
        if route.host is not None:
            headers.append(("Host", route.host))
        elif "Host" not in request.headers:
            headers.append(("Host", f"{GUEST_ADDRESS}:{route.port}"))
        forwarded_for = [*request.headers.getall("X-Forwarded-For", ()), request.remote or ""]
        headers.append(("X-Forwarded-For", ", ".join(v for v in forwarded_for if v)))
        if "X-Forwarded-Host" not in request.headers and request.host:
            headers.append(("X-Forwarded-Host", request.host))
        if "X-Forwarded-Proto" not in request.headers:
            headers.append(("X-Forwarded-Proto", request.scheme))
        return UpstreamRequest(route.port, route.target, headers + self.hop_headers(request, route))

    def hop_headers(self, request: web.Request, route: ProxyRoute) -> list[tuple[str, str]]:
        """Header fields only this hop adds (none to a guest; a gateway adds its routing to the node)."""
        return []


def _guest(target: ProxyTarget) -> Upstream:
    """The sandbox's guest as an upstream, pooled per sandbox.

    Its address is the identity of the live namespace object: a resumed sandbox has a new one
    under the same name, whose connections must not be mixed with the old VM's. The pool keeps
    the opener, which holds the namespace, so the id is not reused while the pool lives.
    """
    opener = functools.partial(open_guest_connection, target.network)
    return Upstream(target.sandbox_id, id(target.network), opener)
