"""`aenv scheduler`: the cluster's node registry, placement and sandbox bindings, over HTTP.

`ClusterScheduler` implements the `Scheduler` protocol on the shared state in Redis
(`aenv.cluster.state`), so any number of schedulers can serve one cluster. `scheduler_app` serves
it as JSON on `AENV_SCHEDULER_ADDR`; bodies are the pydantic records of `aenv.cluster.model`,
errors the API's `{"code", "message"}` with its statuses (`aenv.api.status.STATUS`), and with a
cluster secret set every route but `/health` needs it (`aenv.cluster.auth`):

    GET    /health                      200 {"status": "ok"}; 503 while Redis does not answer
    GET    /metrics                     Prometheus text: requests, placements, binds, nodes by state
    POST   /nodes                       register: NodeInfo -> NodeInfo
    GET    /nodes                       [NodeInfo]
    GET    /nodes/{node_id}             NodeInfo
    POST   /nodes/{node_id}/heartbeat   Heartbeat -> NodeInfo (404: register again)
    POST   /nodes/{node_id}/drain       NodeInfo
    POST   /placements                  Placement -> NodeInfo (503 when no node has room; 409
                                        when a create's sandbox_id is bound already)
    POST   /placements/release?node_id=N  Placement -> 204: a resume's room on N freed
                                        (`Scheduler.release`)
    GET    /bindings[?node_id=N]        [Binding]
    GET    /bindings/{sandbox_id}       Location {"binding", "node"}
    PUT    /bindings/{sandbox_id}[?observed=true]  Binding -> 204 (`Scheduler.bind`)
    DELETE /bindings/{sandbox_id}?node_id=N   204 (a no-op unless bound to N)
    POST   /tombstones/{sandbox_id}?node_id=N Binding: killed while N is away (`Scheduler.tombstone`);
                                        404 unless bound, 409 if bound to another node

A bind of a sandbox with a tombstone is a 409 whose `error_code` is `sandbox_killed`.

Ids in paths and queries are node or sandbox ids (`model.ID_PATTERN`), else 400.

Placement: a create goes to an up node with room for the request's memory (its capacity less
its usage, reservations and sandboxes started since its last heartbeat; memory is the hard limit,
as in the node's own admission), preferring nodes that cache the template, then the fewest
running sandboxes, then the most free memory and vCPUs. A resume prefers the node holding the
sandbox while that node is up; a durable pause (in the shared repository) may resume on any
node with room, a node-local one only on its node (draining included). The nodes weighed are a
sample (`state.PLACE_SAMPLE`): the home, some caching the template, some at random; all of
them only when none of those has room, so a placement costs the same at 1,000 nodes as at 50.
The choice and the reservation of the room are one Redis script (`state._PLACE`): one round trip, and no other
scheduler can spend the room in between. A create that names its sandbox
(`Placement.sandbox_id`: the gateway chose the id) is bound to the chosen node in that same
step, so it needs no second call; a create that fails is unbound, which frees its room. A fork
is no placement: it stays on its source's node, which the gateway locates.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..api.server import LIMITS_KEY, Handler, error_response, errors, parse
from ..config import Settings
from ..orchestrator.errors import Conflict, InvalidRequest, NotFound, Overloaded, SandboxError, Unavailable
from ..orchestrator.ids import catalog_name
from ..telemetry import LATENCY_BUCKETS, Telemetry
from .auth import CLUSTER_SECRET_HEADER, presents_secret
from .model import (
    ID_PATTERN,
    Binding,
    Heartbeat,
    Location,
    NodeCapacity,
    NodeInfo,
    NodeState,
    NodeUsage,
    Placement,
)
from .serving import listen_until_stopped, run
from .state import ClusterState, NodeRoom

log = logging.getLogger(__name__)

PUBLIC_PATHS = {"/health", "/metrics"}
SCHEDULER_KEY = web.AppKey("scheduler", "ClusterScheduler")
METRICS_KEY = web.AppKey("metrics", "SchedulerMetrics")


class SchedulerMetrics:
    """The scheduler's figures on `/metrics`, beside its requests' (`aenv.telemetry`): placements by
    kind and result with their latency (the Redis script included), binds refused (a sandbox bound
    to another node, or killed), and the registered nodes by state, read from Redis at each scrape
    (so every scheduler of a cluster reports the same nodes)."""

    def __init__(self) -> None:
        self.telemetry = Telemetry(CollectorRegistry())
        registry = self.telemetry.registry
        self.placements = Counter(
            "aenv_scheduler_placements",
            "Placements answered, by kind (create, resume) and result (placed, no_room, conflict, invalid)",
            ["kind", "result"],
            registry=registry,
        )
        self.placement_seconds = Histogram(
            "aenv_scheduler_placement_duration_seconds",
            "Time to place a create or resume, by kind",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.bind_conflicts = Counter(
            "aenv_scheduler_bind_conflicts",
            "Binds refused: the sandbox is bound to another node, or was killed",
            registry=registry,
        )
        self.nodes = Gauge("aenv_scheduler_nodes", "Registered nodes by state", ["state"], registry=registry)

    @contextlib.contextmanager
    def placing(self, kind: str) -> Iterator[None]:
        """Counts and times one placement by how it ended."""
        started, result = time.monotonic(), "placed"
        try:
            yield
        except Unavailable:
            result = "no_room"
            raise
        except Conflict:
            result = "conflict"
            raise
        except SandboxError:
            result = "invalid"
            raise
        finally:
            self.placements.labels(kind, result).inc()
            self.placement_seconds.labels(kind).observe(time.monotonic() - started)

    def render(self, nodes: list[NodeInfo]) -> bytes:
        for state in NodeState:
            self.nodes.labels(state.value).set(sum(node.status == state for node in nodes))
        return generate_latest(self.telemetry.registry)


class ClusterScheduler:
    """The `Scheduler` protocol on the cluster's shared state."""

    def __init__(self, state: ClusterState):
        self.state = state

    async def register(self, node: NodeInfo) -> NodeInfo:
        info = await self.state.register(node)
        log.info("node %s registered at %s (version %s)", node.node_id, node.address, node.version)
        return info

    async def heartbeat(
        self, node_id: str, usage: NodeUsage, capacity: NodeCapacity, cached: list[str]
    ) -> NodeInfo:
        return await self.state.heartbeat(node_id, usage, capacity, cached)

    async def nodes(self) -> list[NodeInfo]:
        return await self.state.nodes()

    async def node(self, node_id: str) -> NodeInfo:
        return await self.state.node(node_id)

    async def drain(self, node_id: str) -> NodeInfo:
        info = await self.state.set_status(node_id, NodeState.DRAINING)
        log.info("node %s is draining: no new placements", node_id)
        return info

    async def place(self, request: Placement) -> NodeInfo:
        if request.kind == "resume" and not request.sandbox_id:
            raise InvalidRequest("a resume placement needs the sandbox_id")
        template = catalog_name(request.template) if request.template else ""
        placed = await self.state.place(request, template)
        if placed is not None:
            return placed
        if (
            request.kind == "resume"
            and not (binding := await self.state.binding(request.sandbox_id or "")).durable
        ):
            raise Unavailable(
                f"sandbox {binding.sandbox_id} can only resume on node {binding.node_id}, where its "
                "pause is (not in the shared repository), and that node is down, excluded or full"
            )
        raise Overloaded(_no_room(await self.state.rooms(), request))

    async def bind(self, binding: Binding, *, observed: bool = False) -> None:
        await self.state.bind(binding, observed=observed)

    async def release(self, request: Placement, node_id: str) -> None:
        if request.kind != "resume" or not request.sandbox_id:
            raise InvalidRequest("only a resume's placement is released (a create's is unbound)")
        await self.state.release(request, node_id)

    async def unbind(self, sandbox_id: str, node_id: str) -> None:
        await self.state.unbind(sandbox_id, node_id)

    async def tombstone(self, sandbox_id: str, node_id: str) -> Binding:
        binding = await self.state.tombstone(sandbox_id, node_id)
        log.info("sandbox %s was killed while its node %s is away: tombstoned", sandbox_id, node_id)
        return binding

    async def locate(self, sandbox_id: str) -> tuple[Binding, NodeInfo]:
        binding, node = await self.state.locate(sandbox_id)
        if node is None:
            raise NotFound(f"sandbox {sandbox_id} is bound to node {binding.node_id}, which left")
        return binding, node

    async def bindings(self, node_id: str | None = None) -> list[Binding]:
        return await self.state.bindings(node_id)


def _no_room(rooms: list[NodeRoom], request: Placement) -> str:
    """Why a placement found no node, in one sentence."""
    counts = {state: sum(r.node.status == state for r in rooms) for state in NodeState}
    if not rooms:
        return "no node has registered with the scheduler"
    summary = ", ".join(f"{n} {state.value}" for state, n in counts.items() if n)
    excluded = f", {len(request.exclude)} excluded" if request.exclude else ""
    return f"no node has room for {request.memory_mib} MiB of guest memory ({summary}{excluded})"


# -- HTTP --------------------------------------------------------------------------------------


def _scheduler(request: web.Request) -> ClusterScheduler:
    return request.app[SCHEDULER_KEY]


def _id(request: web.Request, name: str) -> str:
    """A node or sandbox id from the path or query; 400 unless it is one (`model.ID_PATTERN`)."""
    value = request.match_info.get(name) or request.query.get(name)
    if not value:
        raise InvalidRequest(f"{name} is required")
    if not re.fullmatch(ID_PATTERN, value):
        raise InvalidRequest(f"{name} must match {ID_PATTERN}, got {value[:200]!r}")
    return value


def _json(model: object) -> web.Response:
    if isinstance(model, list):
        return web.json_response(text="[" + ",".join(item.model_dump_json() for item in model) + "]")
    return web.json_response(text=model.model_dump_json())  # type: ignore[attr-defined]


async def health(request: web.Request) -> web.Response:
    try:
        await _scheduler(request).state.redis.ping()
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        return error_response(503, f"the cluster state (Redis) does not answer: {exc}")
    return web.json_response({"status": "ok"})


async def register(request: web.Request) -> web.Response:
    return _json(await _scheduler(request).register(await parse(request, NodeInfo)))


async def list_nodes(request: web.Request) -> web.Response:
    return _json(await _scheduler(request).nodes())


async def get_node(request: web.Request) -> web.Response:
    return _json(await _scheduler(request).node(_id(request, "node_id")))


async def heartbeat(request: web.Request) -> web.Response:
    beat = await parse(request, Heartbeat)
    node_id = _id(request, "node_id")
    return _json(await _scheduler(request).heartbeat(node_id, beat.usage, beat.capacity, beat.cached))


async def drain(request: web.Request) -> web.Response:
    return _json(await _scheduler(request).drain(_id(request, "node_id")))


async def place(request: web.Request) -> web.Response:
    placement = await parse(request, Placement)
    with request.app[METRICS_KEY].placing(placement.kind):
        return _json(await _scheduler(request).place(placement))


async def release(request: web.Request) -> web.Response:
    await _scheduler(request).release(await parse(request, Placement), _id(request, "node_id"))
    return web.Response(status=204)


async def list_bindings(request: web.Request) -> web.Response:
    node_id = _id(request, "node_id") if "node_id" in request.query else None
    return _json(await _scheduler(request).bindings(node_id))


async def locate(request: web.Request) -> web.Response:
    binding, node = await _scheduler(request).locate(_id(request, "sandbox_id"))
    return _json(Location(binding=binding, node=node))


async def bind(request: web.Request) -> web.Response:
    binding = await parse(request, Binding)
    if binding.sandbox_id != _id(request, "sandbox_id"):
        raise InvalidRequest("the binding's sandbox_id differs from the one in the path")
    observed = request.query.get("observed", "false")
    if observed not in ("true", "false"):
        raise InvalidRequest("observed must be true or false")
    try:
        await _scheduler(request).bind(binding, observed=observed == "true")
    except Conflict:
        request.app[METRICS_KEY].bind_conflicts.inc()
        raise
    return web.Response(status=204)


async def prometheus(request: web.Request) -> web.Response:
    body = request.app[METRICS_KEY].render(await _scheduler(request).nodes())
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def unbind(request: web.Request) -> web.Response:
    await _scheduler(request).unbind(_id(request, "sandbox_id"), _id(request, "node_id"))
    return web.Response(status=204)


async def tombstone(request: web.Request) -> web.Response:
    return _json(await _scheduler(request).tombstone(_id(request, "sandbox_id"), _id(request, "node_id")))


@web.middleware
async def state_unreachable(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Redis down is the scheduler being unavailable (503, retry later), not its bug."""
    try:
        return await handler(request)
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise Unavailable(f"the cluster state (Redis) does not answer: {exc}") from exc


def secret_gate(secret: str) -> Handler:
    @web.middleware
    async def gate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in PUBLIC_PATHS or presents_secret(request.headers, secret):
            return await handler(request)
        return error_response(401, f"invalid or missing cluster secret (send it in {CLUSTER_SECRET_HEADER})")

    return gate


def scheduler_app(scheduler: ClusterScheduler, secret: str | None) -> web.Application:
    metrics = SchedulerMetrics()
    gate = [secret_gate(secret)] if secret else []
    middlewares = [metrics.telemetry.middleware(), errors, *gate, state_unreachable]
    app = web.Application(middlewares=middlewares, client_max_size=1 << 20)
    app[SCHEDULER_KEY] = scheduler
    app[METRICS_KEY] = metrics
    app[LIMITS_KEY] = {}
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", prometheus)
    app.router.add_post("/nodes", register)
    app.router.add_get("/nodes", list_nodes)
    app.router.add_get("/nodes/{node_id}", get_node)
    app.router.add_post("/nodes/{node_id}/heartbeat", heartbeat)
    app.router.add_post("/nodes/{node_id}/drain", drain)
    app.router.add_post("/placements", place)
    app.router.add_post("/placements/release", release)
    app.router.add_get("/bindings", list_bindings)
    app.router.add_get("/bindings/{sandbox_id}", locate)
    app.router.add_put("/bindings/{sandbox_id}", bind)
    app.router.add_delete("/bindings/{sandbox_id}", unbind)
    app.router.add_post("/tombstones/{sandbox_id}", tombstone)
    return app


async def serve(settings: Settings) -> None:
    """Serve the scheduler until SIGINT or SIGTERM."""
    state = ClusterState.from_url(
        settings.redis_url, down_after=settings.node_down_after, tombstone_ttl=settings.tombstone_ttl
    )
    try:
        app = scheduler_app(ClusterScheduler(state), settings.cluster_secret)
        await listen_until_stopped(app, settings.scheduler_addr, "scheduler")
    finally:
        await state.close()


def main() -> None:
    run(serve)
