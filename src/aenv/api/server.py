"""The node's HTTP API: the E2B control plane, aenv's extensions, and the sandbox proxy.

Middlewares, outermost first: errors become E2B's JSON error body (never a bare 500 or an
HTML page); the sandbox proxy serves data-plane traffic (routing headers, sandbox hosts,
`/proxy`) which carries no API key; then API-key authentication for everything else.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import logging
import platform
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import unquote

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from pydantic import BaseModel, ValidationError

from .. import __version__
from ..guest.envd import ENVD_VERSION
from ..orchestrator.service import CreateRequest, Orchestrator, Sandbox, SandboxError, catalog_name
from ..orchestrator.store import api_state
from ..snapshot.manifest import SnapshotManifest
from ..snapshot.repository import InvalidName, RepositoryError, SnapshotNotFound
from . import openapi, schemas, views
from .proxy import ProxyTarget, SandboxAccess, SandboxProxy

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
B = TypeVar("B", bound=BaseModel)
MAX_BODY = 1 << 20
PUBLIC_PATHS = {"/health", "/metrics", "/openapi.json"}
# The node's limits that request bodies are validated against (schemas.limits).
LIMITS_KEY = web.AppKey("limits", dict)


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
        return error_response(exc.status, exc.message, exc.error_code)
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
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, "internal error: see the node's log")


def auth_middleware(api_key: str) -> Callable[..., Any]:
    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in PUBLIC_PATHS:
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
            raise SandboxError(400, "request body is required")
        return model()
    try:
        data = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, integers over 4300 digits
        raise SandboxError(400, f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise SandboxError(400, "request body is not valid JSON: nested too deeply") from exc
    try:
        return model.model_validate(data, context=request.app[LIMITS_KEY])
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
            for e in exc.errors(include_url=False)
        )
        raise SandboxError(400, f"invalid request body: {problems}") from exc


def _int_query(request: web.Request, name: str, *, low: int, high: int) -> int | None:
    value = request.query.get(name)
    if value is None:
        return None
    if not value.isdigit() or not low <= int(value) <= high:
        raise SandboxError(400, f"{name} must be an integer between {low} and {high}")
    return int(value)


def _paginate(request: web.Request, items: list[Any], key: Callable[[Any], tuple[str, str]]) -> web.Response:
    """E2B paging: `limit` and an opaque `nextToken`; `X-Next-Token` only when more items exist."""
    limit = _int_query(request, "limit", low=1, high=100)
    token = request.query.get("nextToken")
    if token:
        try:
            after = tuple(base64.urlsafe_b64decode(token.encode()).decode().split("__", 1))
        except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
            raise SandboxError(400, f"invalid next token: {exc}") from exc
        if len(after) != 2:
            raise SandboxError(400, "invalid next token")
        items = [item for item in items if _after(key(item), after)]
    page = items if limit is None else items[:limit]
    headers = {}
    if limit is not None and len(items) > limit:
        last = key(page[-1])
        headers["X-Next-Token"] = base64.urlsafe_b64encode(f"{last[0]}__{last[1]}".encode()).decode()
    return web.json_response(page, headers=headers)


def _after(position: tuple[str, str], cursor: tuple[str, ...]) -> bool:
    """Items are ordered by time descending, then id ascending."""
    return position[0] < cursor[0] or (position[0] == cursor[0] and position[1] > cursor[1])


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


class NodeAPI:
    """Request handlers; the orchestrator does the work, this maps it to the wire."""

    def __init__(self, orchestrator: Orchestrator, *, domain: str, node_id: str):
        self.orchestrator = orchestrator
        self.domain = domain
        self.node_id = node_id
        self.proxy = SandboxProxy(self, domain.split(":", 1)[0] or None)
        self.registry = CollectorRegistry()
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
        orchestrator.on_stopped = self.proxy.release

    # -- wiring ----------------------------------------------------------------------------

    def app(self, api_key: str) -> web.Application:
        app = web.Application(
            middlewares=[errors, self.proxy.middleware(), auth_middleware(api_key)], client_max_size=MAX_BODY
        )
        app[LIMITS_KEY] = schemas.limits(self.orchestrator.settings)
        self.proxy.setup(app)
        for method, path, handler in self.routes():
            app.router.add_route(method, path, handler)
        return app

    def routes(self) -> list[tuple[str, str, Handler]]:
        return [
            ("GET", "/health", self.health),
            ("GET", "/metrics", self.prometheus),
            ("GET", "/openapi.json", self.openapi_document),
            ("POST", "/sandboxes", self.create_v1),
            ("POST", "/v2/sandboxes", self.create_v2),
            ("GET", "/sandboxes", self.list_running),
            ("GET", "/v2/sandboxes", self.list_v2),
            ("GET", "/sandboxes/{sandboxID}", self.get_sandbox),
            ("DELETE", "/sandboxes/{sandboxID}", self.kill),
            ("POST", "/sandboxes/{sandboxID}/timeout", self.set_timeout),
            ("POST", "/sandboxes/{sandboxID}/refreshes", self.refresh),
            ("POST", "/sandboxes/{sandboxID}/pause", self.pause),
            ("POST", "/sandboxes/{sandboxID}/resume", self.resume),
            ("POST", "/sandboxes/{sandboxID}/connect", self.connect),
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
        ]

    # -- proxy resolver --------------------------------------------------------------------

    def proxy_access(self, sandbox_id: str) -> SandboxAccess | None:
        """From the record alone: the proxy checks credentials before it wakes a paused sandbox."""
        sandbox = self.orchestrator.sandboxes.get(sandbox_id)
        if sandbox is None:
            return None
        record = sandbox.record
        return SandboxAccess(
            envd_access_token=record.envd_token,
            traffic_access_token=record.traffic_token,
            secure=record.secure,
            public_traffic=record.network.get("allowPublicTraffic") is not False,
        )

    async def proxy_target(self, sandbox_id: str, *, resume: bool) -> ProxyTarget | None:
        sandbox = await self.orchestrator.running_vm(sandbox_id, resume=resume)
        if sandbox is None or sandbox.vm is None:
            return None
        return ProxyTarget(sandbox_id=sandbox.id, network=sandbox.vm.guest.network)

    # -- helpers ---------------------------------------------------------------------------

    def _sandbox(self, request: web.Request) -> Sandbox:
        return self.orchestrator.get(request.match_info["sandboxID"])

    def _created(self, sandbox: Sandbox, status: int = 201) -> web.Response:
        headers = {"X-Agentenv-Sandbox-Id": sandbox.id}
        return web.json_response(views.sandbox(sandbox.record, self.domain), status=status, headers=headers)

    # -- meta ------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def prometheus(self, request: web.Request) -> web.Response:
        counts: dict[str, int] = {}
        for sandbox in self.orchestrator.sandboxes.values():
            counts[sandbox.record.state] = counts.get(sandbox.record.state, 0) + 1
        self._sandboxes_gauge.clear()
        for state, count in counts.items():
            self._sandboxes_gauge.labels(state).set(count)
        self._creates_gauge.labels("success").set(self.orchestrator.counters["create_successes"])
        self._creates_gauge.labels("failure").set(self.orchestrator.counters["create_failures"])
        self._parked_gauge.set(len(self.orchestrator.engine.parked))
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi_document(self, request: web.Request) -> web.Response:
        return web.json_response(openapi.document(self.routes(), request.app[LIMITS_KEY]))

    # -- sandboxes -------------------------------------------------------------------------

    async def _create(self, body: schemas.NewSandbox, *, secure: bool) -> web.Response:
        network = body.network.wire() if body.network else {}
        if body.allow_internet_access is False and "denyOut" not in network:
            network["denyOut"] = ["0.0.0.0/0"]
        request = CreateRequest(
            template=body.template_id,
            timeout=self.orchestrator.settings.default_timeout if body.timeout is None else body.timeout,
            auto_pause=bool(body.auto_pause),
            auto_resume=bool(body.auto_resume and body.auto_resume.enabled),
            secure=secure,
            allow_internet=body.allow_internet_access,
            network=network,
            metadata=dict(body.metadata or {}),
            env_vars=dict(body.env_vars or {}),
        )
        return self._created(await self.orchestrator.create(request))

    async def create_v1(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.NewSandboxV1)
        return await self._create(body, secure=bool(body.secure))

    async def create_v2(self, request: web.Request) -> web.Response:
        return await self._create(await parse(request, schemas.NewSandbox), secure=True)

    def _filtered(self, request: web.Request) -> list[Sandbox]:
        wanted = metadata_filter(request.query.get("metadata"))
        states = {s for s in request.query.get("state", "").split(",") if s}
        unknown = states - {"running", "paused"}
        if unknown:
            raise SandboxError(400, f"unknown state filter: {', '.join(sorted(unknown))}")
        found = []
        for sandbox in self.orchestrator.sandboxes.values():
            record = sandbox.record
            if states and api_state(record.state) not in states:
                continue
            if any(record.metadata.get(k) != v for k, v in wanted.items()):
                continue
            found.append(sandbox)
        found.sort(key=lambda s: (s.record.created_at, s.id))
        found.sort(key=lambda s: s.record.created_at, reverse=True)
        return found

    async def list_running(self, request: web.Request) -> web.Response:
        sandboxes = [s for s in self._filtered(request) if api_state(s.record.state) == "running"]
        return web.json_response([views.listed(s.record) for s in sandboxes])

    async def list_v2(self, request: web.Request) -> web.Response:
        listed = [views.listed(s.record) for s in self._filtered(request)]
        return _paginate(request, listed, lambda item: (item["startedAt"], item["sandboxID"]))

    async def get_sandbox(self, request: web.Request) -> web.Response:
        return web.json_response(views.detail(self._sandbox(request).record, self.domain))

    async def kill(self, request: web.Request) -> web.Response:
        await self.orchestrator.kill(self._sandbox(request))
        return web.Response(status=204)

    async def set_timeout(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.TimeoutRequest)
        await self.orchestrator.set_timeout(self._sandbox(request), body.timeout)
        return web.Response(status=204)

    async def refresh(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.RefreshRequest, required=False)
        await self.orchestrator.refresh(self._sandbox(request), body.duration)
        return web.Response(status=204)

    async def pause(self, request: web.Request) -> web.Response:
        await parse(request, schemas.PauseRequest, required=False)
        await self.orchestrator.pause(self._sandbox(request))
        return web.Response(status=204)

    async def connect(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.ConnectSandbox, required=False)
        sandbox = self._sandbox(request)
        resumed = await self.orchestrator.connect(sandbox, body.timeout)
        return self._created(sandbox, 201 if resumed else 200)

    async def resume(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.ResumeSandbox, required=False)
        sandbox = self._sandbox(request)
        if api_state(sandbox.record.state) == "running":
            raise SandboxError(409, f"sandbox {sandbox.id} is already running")
        await self.orchestrator.connect(sandbox, body.timeout)
        return self._created(sandbox)

    async def sandbox_metrics(self, request: web.Request) -> web.Response:
        return web.json_response(await self.orchestrator.metrics(self._sandbox(request)))

    async def sandbox_logs(self, request: web.Request) -> web.Response:
        """The guest's serial console (kernel, init and envd messages), oldest first."""
        sandbox = self._sandbox(request)
        start = _int_query(request, "start", low=0, high=1 << 62) or 0
        limit = _int_query(request, "limit", low=1, high=100_000) or 1000
        lines = await asyncio.to_thread(self.orchestrator.engine.serial_lines, sandbox.id)
        logs = [
            {"timestamp": sandbox.record.started_at, "line": line} for line in lines[start : start + limit]
        ]
        entries = [
            {"timestamp": e["timestamp"], "message": e["line"], "level": "info", "fields": {}} for e in logs
        ]
        return web.json_response({"logs": logs, "logEntries": entries})

    async def create_snapshot(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.SnapshotRequest, required=False)
        name = catalog_name(body.name) if body.name else None
        manifest = await self.orchestrator.snapshot(self._sandbox(request), name)
        return web.json_response(views.snapshot_info(manifest), status=201)

    async def fork(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.ForkRequest, required=False)
        children = await self.orchestrator.fork(self._sandbox(request), body.count, body.timeout)
        return web.json_response(
            [{"sandbox": views.sandbox(child.record, self.domain)} for child in children], status=201
        )

    async def update_network(self, request: web.Request) -> web.Response:
        body = await parse(request, schemas.NetworkUpdate)
        network = body.wire()
        network.pop("allow_internet_access", None)
        if body.allow_internet_access is False and "denyOut" not in network:
            network["denyOut"] = ["0.0.0.0/0"]
        await self.orchestrator.update_network(self._sandbox(request), body.allow_internet_access, network)
        return web.Response(status=204)

    # -- catalog ---------------------------------------------------------------------------

    def _catalog(self, kind: str | None = None) -> list[SnapshotManifest]:
        return [m for m in self.orchestrator.engine.repository.list(kind) if "aenv.fork-of" not in m.metadata]

    async def list_snapshots(self, request: web.Request) -> web.Response:
        snapshots = self._catalog("snapshot")
        if sandbox_id := request.query.get("sandboxID"):
            snapshots = [m for m in snapshots if m.source.get("sandbox_id") == sandbox_id]
        if name := request.query.get("name"):
            name = catalog_name(name)
            snapshots = [m for m in snapshots if name in (m.id, m.alias)]
        infos = [views.snapshot_info(m) for m in snapshots]
        return _paginate(request, infos, lambda item: (item["createdAt"], item["snapshotID"]))

    def _manifest(self, reference: str, kind: str | None = None) -> SnapshotManifest:
        try:
            manifest = self.orchestrator.engine.repository.get(catalog_name(reference))
        except (SnapshotNotFound, InvalidName):
            raise SandboxError(404, f"'{reference}' not found") from None
        if kind is not None and manifest.kind != kind:
            raise SandboxError(404, f"{kind} '{reference}' not found")
        return manifest

    async def get_snapshot(self, request: web.Request) -> web.Response:
        return web.json_response(
            views.snapshot_info(self._manifest(request.match_info["snapshotID"], "snapshot"))
        )

    async def list_templates_v1(self, request: web.Request) -> web.Response:
        return web.json_response([views.template(m, ENVD_VERSION) for m in self._catalog("template")])

    async def list_templates_v2(self, request: web.Request) -> web.Response:
        templates = [views.template(m, ENVD_VERSION) for m in self._catalog("template")]
        return _paginate(request, templates, lambda item: (item["createdAt"], item["templateID"]))

    async def get_template(self, request: web.Request) -> web.Response:
        manifest = self._manifest(request.match_info["templateID"])
        return web.json_response(views.template_with_builds(manifest, ENVD_VERSION))

    async def delete_template(self, request: web.Request) -> web.Response:
        """Deletes a snapshot; one still used by sandboxes goes when the last one does.

        Templates are the node's own (it builds them, `base` at its first start, and keeps warm
        guests of each): deleting one would break creates until a restart, so it is refused.
        """
        manifest = self._manifest(request.match_info["templateID"])
        pool = self.orchestrator.engine.pool
        if manifest.kind == "template" or pool.target(manifest.id) > 0:
            name = manifest.alias or manifest.id
            problem = "is built into this node: creates and a warm pool use it, so it cannot be deleted"
            raise SandboxError(409, f"'{name}' {problem}")
        await pool.drain(manifest.id)
        try:
            self.orchestrator.engine.repository.delete(manifest.id, defer=True)
        except RepositoryError as exc:
            raise SandboxError(409, str(exc)) from exc
        log.info("deleted %s %s (alias %s) at the API's request", manifest.kind, manifest.id, manifest.alias)
        return web.Response(status=204)

    async def template_alias(self, request: web.Request) -> web.Response:
        alias = request.match_info["alias"]
        manifest = self._manifest(alias)
        if manifest.alias != alias:
            raise SandboxError(404, f"template alias not found: {alias}")
        return web.json_response({"templateID": manifest.id, "public": False})

    # -- nodes -----------------------------------------------------------------------------

    def _node(self) -> dict[str, Any]:
        records = [s.record for s in self.orchestrator.sandboxes.values()]
        running = [r for r in records if api_state(r.state) == "running"]
        paused = [r for r in records if api_state(r.state) == "paused"]
        return {
            "version": __version__,
            "commit": "",
            "id": self.node_id,
            "serviceInstanceID": self.node_id,
            "clusterID": "",
            "machineInfo": {
                "cpuFamily": "",
                "cpuModel": "",
                "cpuModelName": platform.processor() or platform.machine(),
                "cpuArchitecture": platform.machine(),
            },
            "status": "ready",
            "sandboxCount": len(running),
            "metrics": {
                "allocatedCPU": sum(r.cpu_count for r in running),
                "allocatedMemoryBytes": sum(r.memory_mb for r in running) << 20,
                "pausedAllocatedCPU": sum(r.cpu_count for r in paused),
                "pausedAllocatedMemoryBytes": sum(r.memory_mb for r in paused) << 20,
            },
            "createSuccesses": self.orchestrator.counters["create_successes"],
            "createFails": self.orchestrator.counters["create_failures"],
            "sandboxStartingCount": sum(1 for r in records if r.state == "creating"),
            "sandboxPausedCount": len(paused),
        }

    async def list_nodes(self, request: web.Request) -> web.Response:
        return web.json_response([self._node()])

    async def get_node(self, request: web.Request) -> web.Response:
        if request.match_info["nodeID"] != self.node_id:
            raise SandboxError(404, f"node {request.match_info['nodeID']} not found")
        return web.json_response(self._node() | {"cachedBuilds": []})
