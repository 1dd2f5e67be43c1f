"""What an operator reads of a node, gateway or scheduler: request counts and latency histograms.

Each server process keeps its own `CollectorRegistry` (tests run several nodes in one process),
so `Telemetry` is made once per served application and handed to what observes into it:

- every HTTP request the API answers, by route template (never the raw path: ids would make a
  series per sandbox), method and status: `aenv_http_requests_total` and
  `aenv_http_request_duration_seconds`;
- the operations a user waits for, named as E2B names them (create, connect, resume, pause,
  fork, snapshot, kill, template build, proxy round trip): `aenv_operation_duration_seconds`
  with the stage the time was spent in (`api`: the whole call as the API answered it; `build`:
  a template build from its start to ready or error; `proxy`: a data-plane request relayed to a
  guest, until its last byte).

Each lifecycle operation is also one log line (`aenv.operations`), with its sandbox (`aenv.logs`).

Buckets span 1 ms (a warm create is ~6 ms, a parked resume ~8 ms) to 10 minutes (a template
build under TCG takes minutes), so the same histogram reads right on KVM and TCG hosts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram

from . import logs

log = logging.getLogger("aenv.operations")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Observe(Protocol):
    """`Telemetry.observe`, as the parts that time an operation of their own receive it."""

    def __call__(self, operation: str, stage: str, seconds: float, *, ok: bool = True) -> None: ...


LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0, 600.0,
)  # fmt: skip

# The API calls that are the operations of E2B's lifecycle, by (method, route template).
OPERATIONS: dict[tuple[str, str], str] = {
    ("POST", "/sandboxes"): "create",
    ("POST", "/v2/sandboxes"): "create",
    ("DELETE", "/sandboxes/{sandboxID}"): "kill",
    ("POST", "/sandboxes/{sandboxID}/pause"): "pause",
    ("POST", "/sandboxes/{sandboxID}/resume"): "resume",
    ("POST", "/sandboxes/{sandboxID}/connect"): "connect",
    ("POST", "/v2/sandboxes/{sandboxID}/connect"): "connect",
    ("POST", "/sandboxes/{sandboxID}/takeover"): "takeover",
    ("POST", "/sandboxes/{sandboxID}/snapshots"): "snapshot",
    ("POST", "/sandboxes/{sandboxID}/fork"): "fork",
    ("GET", "/v2/sandboxes"): "list",
    ("GET", "/sandboxes"): "list",
}
CREATED_HEADER = "X-Agentenv-Sandbox-Id"  # the id of the sandbox a create made, on its answer
UNMATCHED = "unmatched"  # requests no route took (404s of unknown paths): one series, not one per path
# Set on a request the proxy relays to a guest (`aenv.api.proxy`), whatever its path: one series.
PROXIED = web.RequestKey("aenv_proxied", bool)
PROXY_ROUTE = "proxy"


def route_of(request: web.Request) -> str:
    """The template of the route that took the request (`/sandboxes/{sandboxID}`), PROXY_ROUTE for
    the data plane, or UNMATCHED."""
    if request.get(PROXIED):
        return PROXY_ROUTE
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else UNMATCHED


class Telemetry:
    """The request and operation metrics of one served application, in its registry."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self._requests = Counter(
            "aenv_http_requests",
            "HTTP requests answered, by route template, method and status",
            ["route", "method", "status"],
            registry=registry,
        )
        self._latency = Histogram(
            "aenv_http_request_duration_seconds",
            "Time to answer an HTTP request, by route template and method",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._operations = Histogram(
            "aenv_operation_duration_seconds",
            "Time of the operations users wait for (create, pause, resume, fork, snapshot, kill, "
            "template build, proxy round trip), by operation, stage and outcome (ok, error)",
            ["operation", "stage", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def observe(self, operation: str, stage: str, seconds: float, *, ok: bool = True) -> None:
        """One finished operation (or stage of one) that took `seconds`."""
        self._operations.labels(operation, stage, "ok" if ok else "error").observe(seconds)

    def observe_request(self, request: web.Request, status: int, seconds: float) -> str | None:
        """Counts one answered request; the lifecycle operation it was, if any."""
        route = route_of(request)
        self._requests.labels(route, request.method, str(status)).inc()
        self._latency.labels(route, request.method).observe(seconds)
        if route == PROXY_ROUTE:
            self.observe("proxy", "proxy", seconds, ok=status < 500)
            return None
        if (operation := OPERATIONS.get((request.method, route))) is not None:
            self.observe(operation, "api", seconds, ok=status < 400)
        return operation

    def middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        """Counts and times every request the application answers, and logs each lifecycle
        operation (one line, with its sandbox: a create's from its answer). Put it outermost, so
        that errors turned into JSON answers by inner middlewares are counted with their status."""

        @web.middleware
        async def measure(request: web.Request, handler: Handler) -> web.StreamResponse:
            started = time.monotonic()
            status, sandbox_id = 500, request.match_info.get("sandboxID")
            try:
                response = await handler(request)
                status = response.status
                sandbox_id = response.headers.get(CREATED_HEADER, sandbox_id)
                return response
            except web.HTTPException as exc:
                status = exc.status
                raise
            finally:
                seconds = time.monotonic() - started
                if (operation := self.observe_request(request, status, seconds)) is not None:
                    _log_operation(operation, status, seconds, sandbox_id)

        return measure


def _log_operation(operation: str, status: int, seconds: float, sandbox_id: str | None) -> None:
    level = logging.INFO if status < 500 else logging.WARNING
    if sandbox_id is None:
        log.log(level, "%s answered %d in %.1f ms", operation, status, 1000 * seconds)
        return
    with logs.sandbox_context(sandbox_id):
        log.log(
            level, "%s of sandbox %s answered %d in %.1f ms", operation, sandbox_id, status, 1000 * seconds
        )
