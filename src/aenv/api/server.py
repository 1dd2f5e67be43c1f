"""The node's HTTP API: the E2B control plane, aenv's extensions, and the sandbox proxy.

Middlewares, outermost first: errors become E2B's JSON error body (never a bare 500 or an
HTML page); the sandbox proxy serves data-plane traffic (routing headers, sandbox hosts,
`/proxy`) which carries no API key; then API-key authentication for everything else.

Handlers talk to the node only through `NodeService` (`aenv.orchestrator.interface`): this module
maps the wire to its calls and its typed errors to statuses (`status.STATUS`), and nothing else.
It stays one module over 600 lines because it is the route table: each handler is a few lines
from a route to one call, and the resources with more than that have their own modules
(`templates`, `volumes`, `rollouts`, `fusion`, `views`).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from datetime import datetime
from typing import Any, Literal, TypeVar, cast
from urllib.parse import unquote

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from pydantic import BaseModel, ValidationError

from .. import __version__, console, logs
from ..agent.envd import ENVD_VERSION
from ..cluster.auth import cluster_gate
from ..cluster.wire import node_route
from ..orchestrator.errors import (
    InvalidRequest,
    NotFound,
    Overloaded,
    SandboxError,
)
from ..orchestrator.ids import catalog_name
from ..orchestrator.interface import CreateRequest, ListQuery, NodeService, RouteService, follows
from ..orchestrator.store import SandboxRecord
from ..telemetry import CREATED_HEADER, Telemetry
from ..vmm.serial import NEXT_START_HEADER
from ..volumes.store import VolumeStore
from . import openapi, rollouts, schemas, templates, views, volumes
from .fusion import Fusion
from .proxy import ProxyTarget, SandboxAccess, SandboxProxy
from .status import status_of

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Route = tuple[str, str, Handler]
B = TypeVar("B", bound=BaseModel)
MAX_BODY = 1 << 20
MAX_UNIX_SECONDS = 1 << 40
MAX_METRICS_SANDBOXES = 100  # as E2B's API
PUBLIC_PATHS = {"/health", "/metrics", "/openapi.json"}
# The node's limits that request bodies are validated against (schemas.limits).
LIMITS_KEY = web.AppKey("limits", dict)
SANDBOX_ID = re.compile(r"[a-z0-9]{1,64}")  # E2B's sandbox IDs (also in the OpenAPI document)


GC_METRICS = {
    "runs": "Garbage collection passes since the node started",
    "failures": "Garbage collection passes that failed since the node started",
    "removed_layers": "Disk layers removed by garbage collection since the node started",
    "removed_blobs": "Repository blobs removed by garbage collection since the node started",
    "freed_bytes": "Bytes of repository blobs freed by garbage collection since the node started",
    "last_run_seconds": "Duration of the last garbage collection pass",
}

# The runtime cache of an s3 repository (`aenv.runtime.cache.CacheStats`); 0 with a posix one,
# whose files QEMU uses in place.
CACHE_METRICS = {
    "capacity_bytes": "Configured capacity of the node's runtime cache",
    "used_bytes": "Bytes the runtime cache holds",
    "entries": "Files the runtime cache holds",
    "pinned_entries": "Runtime cache files in use by a snapshot leased on this node (never evicted)",
    "hits": "Runtime cache lookups served locally since the node started",
    "misses": "Runtime cache lookups that fetched from the repository since the node started",
    "evictions": "Runtime cache files evicted (least recently used first) since the node started",
    "fetched_bytes": "Bytes the runtime cache fetched from the repository since the node started",
}


def error_response(status: int, message: str, error_code: str | None = None) -> web.Response:
    body: dict[str, Any] = {"code": status, "message": message}
    if error_code:
        body["error_code"] = error_code
    return web.json_response(body, status=status)


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except SandboxError as exc:
        response = error_response(status_of(exc), exc.message, exc.error_code)
        if isinstance(exc, Overloaded):  # the E2B SDKs wait this long before they retry
            response.headers["Retry-After"] = str(exc.retry_after)
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        if exc.status == 404 and not exc.text:
            message = f"route not found: {request.method} {request.path}"
        response = error_response(exc.status, message or exc.reason)
        if "Allow" in exc.headers:  # a 405 says which methods the route has
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except Exception:  # the process boundary: a bug is logged with its traceback, not shown
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, "internal error: see the node's log")


def auth_middleware(api_key: str) -> Callable[..., Any]:
    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        handler_ = request.match_info.handler
        if request.path in PUBLIC_PATHS or any(getattr(handler_, a, False) for a in ("presigned", "public")):
            return await handler(request)
        presented = request.headers.getall("X-API-Key", [])
        if len(presented) != 1 or not hmac.compare_digest(presented[0].encode(), api_key.encode()):
            return error_response(401, "invalid or missing API key (send it in the X-API-Key header)")
        return await handler(request)

    return authenticate


async def parse(request: web.Request, model: type[B], *, required: bool = True) -> B:
    """The JSON body as `model`, within the node's limits; 400 with the reason for malformed JSON
    (also nested too deeply, or numbers too long to convert), unknown fields, wrong types."""
    raw = await request.read()
    if not raw.strip():
        if required:
            raise InvalidRequest("request body is required")
        return model()
    try:
        data = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, integers over 4300 digits
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidRequest("request body is not valid JSON: nested too deeply") from exc
    try:
        return model.model_validate(data, context=request.app[LIMITS_KEY])
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
            for e in exc.errors(include_url=False)
        )
        raise InvalidRequest(f"invalid request body: {problems}") from exc


def _int_query(request: web.Request, name: str, *, low: int, high: int) -> int | None:
    value = request.query.get(name)
    if value is None:
        return None
    if not value.isdigit() or not low <= int(value) <= high:
        raise InvalidRequest(f"{name} must be an integer between {low} and {high}")
    return int(value)


def _cursor(request: web.Request) -> tuple[str, str] | None:
    """The position a `nextToken` names (a time and an id), or None without one."""
    token = request.query.get("nextToken")
    if not token:
        return None
    try:
        after = tuple(base64.urlsafe_b64decode(token.encode()).decode().split("__", 1))
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequest(f"invalid next token: {exc}") from exc
    if len(after) != 2:
        raise InvalidRequest("invalid next token")
    return after[0], after[1]


def _paginate(
    request: web.Request, items: list[Any], key: Callable[[Any], tuple[str, str]], *, ascending: bool = False
) -> web.Response:
    """E2B paging: `limit` and an opaque `nextToken`; `X-Next-Token` only when more items exist.

    `items` come sorted by time (newest first unless `ascending`), then by id.
    """
    limit = _int_query(request, "limit", low=1, high=100)
    if (after := _cursor(request)) is not None:
        items = [item for item in items if follows(key(item), after, ascending)]
    page = items if limit is None else items[:limit]
    headers = {}
    if limit is not None and len(items) > limit:
        last = key(page[-1])
        headers["X-Next-Token"] = base64.urlsafe_b64encode(f"{last[0]}__{last[1]}".encode()).decode()
    return web.json_response(page, headers=headers)


def _by_start(item: dict[str, Any]) -> tuple[str, str]:
    return item["startedAt"], item["sandboxID"]


def metadata_filter(raw: str | None) -> dict[str, str]:
    """Decode the SDK's doubly encoded `metadata` query value into a dict."""
    if not raw:
        return {}
    pairs = {}
    for item in unquote(raw).split("&"):
        if not item:
            continue
        key, _, value = item.partition("=")
        pairs[unquote(key)] = unquote(value)
    return pairs


def _time_query(request: web.Request, name: str) -> datetime | None:
    """An RFC 3339 time bound (the SDK sends `datetime.isoformat()` with an offset)."""
    value = request.query.get(name)
    if not value:
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(f"{name} must be an RFC 3339 time, got {value!r}") from None
    if moment.tzinfo is None:
        raise InvalidRequest(f"{name} must carry a UTC offset, got {value!r}")
    return moment


def list_query(request: web.Request) -> ListQuery:
    """`GET /v2/sandboxes` filters: state, metadata, template, start-time bounds and order."""
    states = {s for s in request.query.get("state", "").split(",") if s}
    unknown = states - {"running", "paused"}
    if unknown:
        raise InvalidRequest(f"unknown state filter: {', '.join(sorted(unknown))}")
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order must be asc or desc, got {order!r}")
    return ListQuery(
        states=frozenset(states),
        metadata=metadata_filter(request.query.get("metadata")),
        template=request.query.get("template") or None,
        started_after=_time_query(request, "startedAfter"),
        started_before=_time_query(request, "startedBefore"),
        order=cast(Literal["asc", "desc"], order),
    )


def create_request(body: schemas.NewSandbox, *, secure: bool) -> CreateRequest:
    """A create's options from its body (also a fan-out's, `aenv.api.rollouts`)."""
    network = body.network.wire() if body.network else {}
    auto_resume = bool(body.auto_resume and body.auto_resume.enabled)
    if body.allow_internet_access is False and "denyOut" not in network:
        network["denyOut"] = ["0.0.0.0/0"]
    if body.auto_pause_memory is False and (not body.auto_pause or auto_resume):
        raise InvalidRequest(
            "autoPauseMemory false (a filesystem-only pause) needs autoPause and cannot be combined "
            "with autoResume: a sandbox paused without memory is resumed explicitly, by connect"
        )
    return CreateRequest(
        template=body.template_id,
        timeout=body.timeout,
        auto_pause=bool(body.auto_pause),
        auto_pause_memory=body.auto_pause_memory is not False,
        auto_resume=auto_resume,
        secure=secure,
        allow_internet=body.allow_internet_access,
        network=network,
        metadata=dict(body.metadata or {}),
        env_vars=dict(body.env_vars or {}),
        # One volume per path (the SDK's mapping has no duplicates): the last one named wins.
        volume_mounts=list({m.path: m.model_dump() for m in body.volume_mounts or ()}.values()),
    )


class NodeAPI:
    """Request handlers; the node service does the work, this maps it to the wire."""

    def __init__(
        self,
        node: NodeService,
        *,
        domain: str,
        limits: dict[str, int],
        volumes: VolumeStore | None = None,
        telemetry: Telemetry | None = None,
    ):
        self.node = node
        self.volumes = volumes  # the node's volumes; None: no volume routes
        self.domain = domain
        self.limits = limits  # schemas.limits(settings): what request bodies are checked against
        self.proxy = SandboxProxy(self, domain.split(":", 1)[0] or None)
        # The node's own (it observes template builds into it too), or one for this API alone.
        self.telemetry = telemetry or Telemetry(CollectorRegistry())
        self.registry = self.telemetry.registry
        self._sandboxes_gauge = Gauge(
            "aenv_sandboxes", "Sandboxes on this node by state", ["state"], registry=self.registry
        )
        self._creates_gauge = Gauge(
            "aenv_sandbox_creates", "Sandbox creations since start", ["result"], registry=self.registry
        )
        self._parked_gauge = Gauge(
            "aenv_parked_sandboxes",
            "Paused sandboxes whose stopped QEMU process is kept for an instant resume",
            registry=self.registry,
        )
        self._lost_gauge = Gauge(
            "aenv_sandboxes_lost", "Sandboxes whose VM process exited unexpectedly", registry=self.registry
        )
        self._merged_gauge = Gauge(
            "aenv_memory_merge_saved_bytes",
            "Host RAM that memory merging (KSM, AENV_MEMORY_MERGE) saves in the sandboxes' QEMU processes",
            registry=self.registry,
        )
        self._gc_gauges = {
            name: Gauge(f"aenv_gc_{name}", help_text, registry=self.registry)
            for name, help_text in GC_METRICS.items()
        }
        self._cache_gauges = {
            name: Gauge(f"aenv_runtime_cache_{name}", help_text, registry=self.registry)
            for name, help_text in CACHE_METRICS.items()
        }

    # -- wiring ----------------------------------------------------------------------------

    def app(
        self,
        api_key: str,
        cluster_secret: str | None = None,
        internal: Iterable[Route] = (),
        fusion: Fusion | None = None,
    ) -> web.Application:
        """The API and proxy; with a `cluster_secret` (a node in a cluster) every request but the
        public ones must carry the secret instead of the API key (`aenv.cluster.auth`), and the
        internal route gateways call the node through is mounted (`aenv.cluster.wire`): never
        without the secret, as it takes calls without the public API's validation. `internal`:
        node-to-node routes mounted outside the OpenAPI document (`aenv.runtime.peers`); `fusion`:
        SandboxFusion's API (`aenv.api.fusion`), also outside it."""
        measured = [self.telemetry.middleware(), logs.request_context, errors]
        if cluster_secret:
            access = cluster_gate(cluster_secret, PUBLIC_PATHS, error_response)
            middlewares = [*measured, access, self.proxy.middleware()]
        else:
            middlewares = [*measured, self.proxy.middleware(), auth_middleware(api_key)]
        app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY)
        app[LIMITS_KEY] = self.limits
        self.proxy.setup(app)
        gateway = [node_route(self.node)] if cluster_secret else []
        # The console's page and terminal are outside the OpenAPI document, as `internal` is:
        # they take no API key header (`aenv.console`).
        for method, path, handler in [*self.routes(), *gateway, *internal, *console.routes()]:
            app.router.add_route(method, path, handler)
        if fusion is not None:
            fusion.mount(app, self.node, parse)
        return app

    def routes(self) -> list[Route]:
        return [
            ("GET", "/health", self.health),
            ("GET", "/metrics", self.prometheus),
            ("GET", "/openapi.json", self.openapi_document),
            ("POST", "/sandboxes", self.create_v1),
            ("POST", "/v2/sandboxes", self.create_v2),
            ("GET", "/sandboxes", self.list_running),
            ("GET", "/v2/sandboxes", self.list_v2),
            ("GET", "/sandboxes/metrics", self.sandboxes_metrics),  # before /sandboxes/{sandboxID}
            ("GET", "/sandboxes/{sandboxID}", self.get_sandbox),
            ("DELETE", "/sandboxes/{sandboxID}", self.kill),
            ("POST", "/sandboxes/{sandboxID}/timeout", self.set_timeout),
            ("POST", "/sandboxes/{sandboxID}/refreshes", self.refresh),
            ("POST", "/sandboxes/{sandboxID}/pause", self.pause),
            ("POST", "/sandboxes/{sandboxID}/resume", self.resume),
            ("POST", "/sandboxes/{sandboxID}/connect", self.connect),
            ("POST", "/sandboxes/{sandboxID}/takeover", self.take_over),
            ("DELETE", "/sandboxes/{sandboxID}/pause", self.discard_pause),
            ("POST", "/v2/sandboxes/{sandboxID}/connect", self.connect),
            ("GET", "/sandboxes/{sandboxID}/metrics", self.sandbox_metrics),
            ("GET", "/sandboxes/{sandboxID}/logs", self.sandbox_logs),
            ("POST", "/sandboxes/{sandboxID}/snapshots", self.create_snapshot),
            ("POST", "/sandboxes/{sandboxID}/fork", self.fork),
            ("PUT", "/sandboxes/{sandboxID}/network", self.update_network),
            ("GET", "/snapshots", self.list_snapshots),
            ("GET", "/snapshots/{snapshotID}", self.get_snapshot),
            ("GET", "/templates", self.list_templates_v1),
            ("GET", "/v2/templates", self.list_templates_v2),
            ("GET", "/templates/aliases/{alias}", self.template_alias),
            ("GET", "/templates/{templateID}", self.get_template),
            ("DELETE", "/templates/{templateID}", self.delete_template),
            ("GET", "/nodes", self.list_nodes),
            ("GET", "/nodes/{nodeID}", self.get_node),
            *templates.routes(self.node, parse),
            *rollouts.routes(self.node, parse, create_request, self.domain),
            *(volumes.routes(self.volumes, parse) if self.volumes is not None else ()),
        ]

    # -- proxy resolver --------------------------------------------------------------------

    async def proxy_access(self, sandbox_id: str) -> SandboxAccess | None:
        """From the record alone: the proxy checks credentials before it wakes a paused sandbox."""
        try:
            record = await self.node.get(sandbox_id)
        except NotFound:
            return None
        return SandboxAccess(
            envd_access_token=record.envd_token,
            traffic_access_token=record.traffic_token,
            secure=record.secure,
            public_traffic=record.network.get("allowPublicTraffic") is not False,
            mask_request_host=record.network.get("maskRequestHost") or None,
        )

    async def proxy_target(self, sandbox_id: str, *, resume: bool) -> ProxyTarget | None:
        if not isinstance(self.node, RouteService):  # a gateway's: its proxy forwards to nodes instead
            return None
        route = await self.node.route(sandbox_id, resume=resume)
        if route is None:
            return None
        return ProxyTarget(sandbox_id=route.record.sandbox_id, network=route.network)

    # -- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _id(request: web.Request) -> str:
        return request.match_info["sandboxID"]

    def _created(self, record: SandboxRecord, status: int = 201) -> web.Response:
        headers = {CREATED_HEADER: record.sandbox_id}
        return web.json_response(views.sandbox(record, self.domain), status=status, headers=headers)

    # -- meta ------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def prometheus(self, request: web.Request) -> web.Response:
        status = await self.node.status()
        counts: dict[str, int] = {}
        for record in status.records:
            counts[record.state] = counts.get(record.state, 0) + 1
        self._sandboxes_gauge.clear()
        for state, count in counts.items():
            self._sandboxes_gauge.labels(state).set(count)
        self._creates_gauge.labels("success").set(status.create_successes)
        self._creates_gauge.labels("failure").set(status.create_failures)
        self._parked_gauge.set(status.parked)
        self._lost_gauge.set(status.lost)
        self._merged_gauge.set(status.merged_bytes)
        for name, gauge in self._gc_gauges.items():
            gauge.set(getattr(status.gc, name))
        for name, gauge in self._cache_gauges.items():
            gauge.set(getattr(status.cache, name) if status.cache is not None else 0)
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi_document(self, request: web.Request) -> web.Response:
        return web.json_response(openapi.document(self.routes(), self.limits))

    # -- sandboxes -------------------------------------------------------------------------

    async def _create(self, body: schemas.NewSandbox, *, secure: bool) -> web.Response:
        return self._created(await self.node.create(create_request(body, secure=secure)))

    async def create_v1(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.NewSandboxV1)
        return await self._create(body, secure=bool(body.secure))

    async def create_v2(self, request: web.Request) -> web.Response:
        return await self._create(await parse(request, schemas.NewSandbox), secure=True)

    async def list_running(self, request: web.Request) -> web.Response:
        query = ListQuery(
            states=frozenset({"running"}), metadata=metadata_filter(request.query.get("metadata"))
        )
        return web.json_response(await self.listed(query))

    async def listed(self, query: ListQuery) -> list[dict[str, Any]]:
        """The list's entries (a gateway names each one's node: `GatewayAPI.listed`)."""
        return [views.listed(r) for r in await self.node.list(query)]

    async def list_v2(self, request: web.Request) -> web.Response:
        # The node pages too (one more than the page, so the token is known to be needed).
        limit = _int_query(request, "limit", low=1, high=100)
        query = replace(list_query(request), after=_cursor(request), limit=limit and limit + 1)
        listed = await self.listed(query)
        return _paginate(
            request,
            listed,
            lambda item: (item["startedAt"], item["sandboxID"]),
            ascending=query.order == "asc",
        )

    async def get_sandbox(self, request: web.Request) -> web.Response:
        return web.json_response(views.detail(await self.node.get(self._id(request)), self.domain))

    async def kill(self, request: web.Request) -> web.Response:
        await self.node.kill(self._id(request))
        return web.Response(status=204)

    async def set_timeout(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.TimeoutRequest)
        await self.node.set_timeout(self._id(request), body.timeout)
        return web.Response(status=204)

    async def refresh(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.RefreshRequest, required=False)
        await self.node.refresh(self._id(request), body.duration)
        return web.Response(status=204)

    async def pause(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.PauseRequest, required=False)
        await self.node.pause(self._id(request), memory=body.memory is not False)
        return web.Response(status=204)

    async def connect(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.ConnectSandbox, required=False)
        record, resumed = await self.node.connect(
            self._id(request), body.timeout, memory=body.memory is not False
        )
        return self._created(record, 201 if resumed else 200)

    async def resume(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.ResumeSandbox, required=False)
        memory = body.memory is not False
        return self._created(await self.node.resume(self._id(request), body.timeout, memory=memory))

    def _paused_id(self, request: web.Request) -> str:
        """The id of a sandbox whose durable pause the request is about (it may be on any node)."""
        sandbox_id = self._id(request)
        if not SANDBOX_ID.fullmatch(sandbox_id):  # no sandbox has such an id, so neither has a pause
            raise NotFound(f"sandbox {sandbox_id!r} has no durable pause: not a sandbox ID")
        return sandbox_id

    async def take_over(self, request: web.Request) -> web.Response:
        """Resume here a sandbox durably paused on another node (`HandoverService.take_over`).

        `POST /sandboxes/{sandboxID}/takeover` with an optional `{"timeout": seconds}`, on the node
        that is to run it: 201 with the sandbox (as create's); 404 with `error_code` `pause_gone`
        when the pause is not durable or its node claimed it back; 409 when another node took it
        over first or the sandbox is on this node already.
        """
        sandbox_id = self._paused_id(request)
        body = await parse(request, schemas.TakeOver, required=False)
        return self._created(await self.node.take_over(sandbox_id, body.timeout))

    async def discard_pause(self, request: web.Request) -> web.Response:
        """Delete from the shared repository a killed sandbox's pause (`HandoverService.discard_pause`).

        `DELETE /sandboxes/{sandboxID}/pause`: 204; 404 if there is no such pause; 409 if another
        node claimed it, if the sandbox is on this node (kill it), or, with `error_code`
        `repository_not_shared`, on a node whose repository is its own.
        """
        sandbox_id = self._paused_id(request)
        await self.node.discard_pause(sandbox_id)
        return web.Response(status=204)

    async def sandbox_metrics(self, request: web.Request) -> web.Response:
        """Samples between `start` and `end` (Unix seconds, both optional), oldest first."""
        start = _int_query(request, "start", low=0, high=MAX_UNIX_SECONDS)
        end = _int_query(request, "end", low=0, high=MAX_UNIX_SECONDS)
        if start is not None and end is not None and start > end:
            raise InvalidRequest("start must not be after end")
        return web.json_response(await self.node.metrics(self._id(request), start, end))

    async def sandboxes_metrics(self, request: web.Request) -> web.Response:
        """The newest sample of each of `sandbox_ids` (comma-separated, or the parameter repeated)."""
        if unknown := sorted(set(request.query) - {"sandbox_ids"}):
            raise InvalidRequest(f"unknown query parameters: {', '.join(map(repr, unknown))[:200]}")
        ids = [i for value in request.query.getall("sandbox_ids", []) for i in value.split(",") if i]
        if not 1 <= len(ids) <= MAX_METRICS_SANDBOXES:
            raise InvalidRequest(f"sandbox_ids must name 1 to {MAX_METRICS_SANDBOXES} sandboxes")
        if not all(SANDBOX_ID.fullmatch(i) for i in ids):
            raise InvalidRequest("sandbox_ids must be sandbox IDs: lowercase letters and digits")
        return web.json_response({"sandboxes": await self.node.latest_metrics(ids)})

    async def sandbox_logs(self, request: web.Request) -> web.Response:
        """A page of the guest's serial console (kernel, init and envd messages), oldest first:
        `limit` lines from line `start`, counted from the sandbox's first. The node keeps the
        newest lines only (`aenv.vmm.serial`); `X-Next-Start` is where the next page starts."""
        start = _int_query(request, "start", low=0, high=1 << 62) or 0
        limit = _int_query(request, "limit", low=1, high=100_000) or 1000
        record = await self.node.get(self._id(request))
        first, lines = await self.node.logs(record.sandbox_id, start, limit)
        logs = [{"timestamp": record.started_at, "line": line} for line in lines]
        entries = [
            {"timestamp": e["timestamp"], "message": e["line"], "level": "info", "fields": {}} for e in logs
        ]
        headers = {NEXT_START_HEADER: str(first + len(lines))}
        return web.json_response({"logs": logs, "logEntries": entries}, headers=headers)

    async def create_snapshot(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.SnapshotRequest, required=False)
        name = catalog_name(body.name) if body.name else None
        manifest = await self.node.snapshot(self._id(request), name, memory=body.memory is not False)
        return web.json_response(views.snapshot_info(manifest), status=201)

    async def fork(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.ForkRequest, required=False)
        children = await self.node.fork(self._id(request), body.count, body.timeout)
        return web.json_response(
            [{"sandbox": views.sandbox(child, self.domain)} for child in children], status=201
        )

    async def update_network(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.NetworkUpdate)
        network = body.wire()
        network.pop("allow_internet_access", None)
        if body.allow_internet_access is False and "denyOut" not in network:
            network["denyOut"] = ["0.0.0.0/0"]
        await self.node.update_network(self._id(request), body.allow_internet_access, network)
        return web.Response(status=204)

    # -- catalog ---------------------------------------------------------------------------

    async def list_snapshots(self, request: web.Request) -> web.Response:
        snapshots = await self.node.catalog("snapshot")
        if sandbox_id := request.query.get("sandboxID"):
            snapshots = [m for m in snapshots if m.source.get("sandbox_id") == sandbox_id]
        if name := request.query.get("name"):
            name = catalog_name(name)
            snapshots = [m for m in snapshots if name in (m.id, m.alias)]
        infos = [views.snapshot_info(m) for m in snapshots]
        return _paginate(request, infos, lambda item: (item["createdAt"], item["snapshotID"]))

    async def get_snapshot(self, request: web.Request) -> web.Response:
        manifest = await self.node.find(request.match_info["snapshotID"], "snapshot")
        return web.json_response(views.snapshot_info(manifest))

    async def list_templates_v1(self, request: web.Request) -> web.Response:
        templates = await self.node.catalog("template")
        return web.json_response([views.template(m, ENVD_VERSION) for m in templates])

    async def list_templates_v2(self, request: web.Request) -> web.Response:
        templates = [views.template(m, ENVD_VERSION) for m in await self.node.catalog("template")]
        return _paginate(request, templates, lambda item: (item["createdAt"], item["templateID"]))

    async def get_template(self, request: web.Request) -> web.Response:
        manifest = await self.node.find(request.match_info["templateID"])
        return web.json_response(views.template_with_builds(manifest, ENVD_VERSION))

    async def delete_template(self, request: web.Request) -> web.Response:
        """Deletes a template or snapshot; one still used by sandboxes goes when the last one does."""
        await self.node.delete_template(request.match_info["templateID"])
        return web.Response(status=204)

    async def template_alias(self, request: web.Request) -> web.Response:
        alias = request.match_info["alias"]
        manifest = await self.node.find(alias)
        if manifest.alias != alias:
            raise NotFound(f"template alias not found: {alias}")
        return web.json_response({"templateID": manifest.id, "public": False})

    # -- nodes -----------------------------------------------------------------------------

    async def list_nodes(self, request: web.Request) -> web.Response:
        return web.json_response([views.node(await self.node.status(), __version__)])

    async def get_node(self, request: web.Request) -> web.Response:
        status = await self.node.status()
        if request.match_info["nodeID"] != status.node_id:
            raise NotFound(f"node {request.match_info['nodeID']} not found")
        return web.json_response(views.node(status, __version__) | {"cachedBuilds": []})
