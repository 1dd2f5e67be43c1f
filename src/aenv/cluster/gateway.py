"""`aenv gateway`: the cluster's front door, the E2B API and data plane of a node, for many.

The API is the node's own (`NodeAPI`), served over `ClusterNode`, so the official SDKs see no
difference; `GET /nodes` lists the scheduler's nodes and `GET /sandboxes/{id}` names the node
that holds the sandbox in E2B's `clientID`. Data-plane traffic (the E2B routing headers, sandbox
hosts, `/proxy`, WebSockets, streams) is forwarded by `GatewayProxy` to the node that holds the
sandbox, which checks its tokens and relays it to the guest as for a client of its own.

A gateway keeps no state: bindings and nodes are the scheduler's. Run several behind one name;
when one dies its clients retry another and find everything where it was.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from ..api import schemas, views
from ..api.fusion import Fusion
from ..api.proxy import SANDBOX_NOT_FOUND, TRAFFIC_TOKEN_HEADER, ProxyRoute, SandboxProxy, sandbox_error
from ..api.server import NodeAPI, Route
from ..api.upstream import Upstream
from ..config import ConfigError, Settings
from ..orchestrator.errors import NotFound, SandboxError
from ..orchestrator.interface import ListQuery
from .auth import CLUSTER_SECRET_HEADER
from .client import SchedulerClient
from .clusternode import ClusterNode
from .model import NodeInfo
from .protocols import Scheduler
from .remote import cluster_client
from .serving import listen_until_stopped, run
from .volumes import VolumeRouting

log = logging.getLogger("aenv.gateway")


class GatewayProxy(SandboxProxy):
    """Forwards each data-plane request to the node that holds its sandbox.

    The request goes on as the node's `/proxy` form (routing headers, the target unchanged
    after the prefix), with the cluster secret and the client's traffic token; the client's Host
    travels as `X-Forwarded-Host`. Connections to each node are kept alive and shared by all of
    its sandboxes.
    """

    upstream_failed = "The node that holds the sandbox did not answer"

    def __init__(self, api: NodeAPI, cluster: ClusterNode, domain: str | None, secret: str):
        super().__init__(api, domain)
        self.cluster = cluster
        self.secret = secret

    async def serve(self, request: web.Request, route: ProxyRoute) -> web.StreamResponse:
        try:
            _, info = await self.cluster.locate(route.sandbox_id)
        except NotFound as exc:
            return sandbox_error(502, route.sandbox_id, SANDBOX_NOT_FOUND, reason=exc.message)
        except SandboxError as exc:
            return sandbox_error(503, route.sandbox_id, exc.message)
        target = "/proxy" + route.target if route.target.startswith("/") else route.target
        hop = replace(route, target=target, host=urlsplit(info.address).netloc)
        return await self.relay(request, hop, _node(info))

    def hop_headers(self, request: web.Request, route: ProxyRoute) -> list[tuple[str, str]]:
        fields = [
            ("E2b-Sandbox-Id", route.sandbox_id),
            ("E2b-Sandbox-Port", str(route.port)),
            (CLUSTER_SECRET_HEADER, self.secret),
        ]
        if (token := request.headers.get(TRAFFIC_TOKEN_HEADER)) is not None:
            fields.append((TRAFFIC_TOKEN_HEADER, token))
        return fields


def _node(info: NodeInfo) -> Upstream:
    """The node as an upstream: its connections are shared by all of its sandboxes."""
    address = urlsplit(info.address)
    host, port = address.hostname or "127.0.0.1", address.port or 80

    async def open_node(_port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(host, port)

    return Upstream(info.node_id, info.address, open_node)


def node_view(info: NodeInfo) -> dict[str, Any]:
    """A node as the gateway's `/nodes` shows it: identity, status, capacity and use."""
    return {
        "id": info.node_id,
        "nodeID": info.node_id,
        "address": info.address,
        "status": info.status.value,
        "version": info.version,
        "sandboxCount": info.usage.running,
        "sandboxPausedCount": info.usage.paused,
        "capacity": {
            "memoryMB": info.capacity.memory_mib,
            "cpuCount": info.capacity.vcpus,
            "diskFreeMB": info.capacity.disk_free_mib,
        },
        "usage": {"memoryMB": info.usage.memory_mib, "cpuCount": info.usage.vcpus},
        "cachedBuilds": info.cached,
        "heartbeatAt": info.heartbeat_at,
    }


class GatewayAPI(NodeAPI):
    """The node's API over the cluster, with the cluster's view of nodes and sandboxes."""

    node: ClusterNode

    def __init__(self, cluster: ClusterNode, *, domain: str, limits: dict[str, int], secret: str):
        super().__init__(cluster, domain=domain, limits=limits)
        self.proxy = GatewayProxy(self, cluster, domain.split(":", 1)[0] or None, secret)
        self.volume_routing = VolumeRouting(cluster)
        cluster.excluded = self.volume_routing.excluded  # a create goes where the volumes it mounts are

    def routes(self) -> list[Route]:
        return [*super().routes(), *self.volume_routing.routes()]

    async def get_sandbox(self, request: web.Request) -> web.Response:
        """The node's answer, with the id of the node that holds the sandbox as `clientID`."""
        sandbox_id = self._id(request)
        record = await self.node.get(sandbox_id)
        detail = views.detail(record, self.domain)
        return web.json_response(detail | {"clientID": await self.node.node_of(sandbox_id)})

    async def listed(self, query: ListQuery) -> list[dict[str, Any]]:
        """Each entry names the node that holds the sandbox as `clientID`, as `get_sandbox` does."""
        return [views.listed(r) | {"clientID": node_id} for r, node_id in await self.node.list_placed(query)]

    async def list_nodes(self, request: web.Request) -> web.Response:
        return web.json_response([node_view(n) for n in await self.node.scheduler.nodes()])

    async def get_node(self, request: web.Request) -> web.Response:
        return web.json_response(node_view(await self.node.scheduler.node(request.match_info["nodeID"])))


def gateway_app(scheduler: Scheduler, settings: Settings, api_key: str) -> web.Application:
    """The gateway's application: the API (checked against `api_key`) and the proxy. Made on the
    event loop that serves it (its client to the nodes belongs to that loop)."""
    if not settings.cluster_secret:
        raise ConfigError("aenv gateway needs the cluster secret its nodes take (AENV_CLUSTER_SECRET)")
    client = cluster_client(settings.cluster_secret)
    cluster = ClusterNode(scheduler, client)
    port = settings.gateway_addr.rsplit(":", 1)[1]
    domain = settings.domain or f"localhost:{port}"
    api = GatewayAPI(cluster, domain=domain, limits=schemas.limits(settings), secret=settings.cluster_secret)
    app = api.app(api_key, fusion=Fusion.of(settings, settings.gateway_addr))

    async def close_client(app: web.Application) -> None:
        await client.close()

    app.on_cleanup.append(close_client)
    return app


async def serve(settings: Settings) -> None:
    """Serve the gateway until SIGINT or SIGTERM."""
    from ..node import api_key

    if not settings.scheduler_url:
        raise ConfigError("aenv gateway needs the scheduler's URL (AENV_SCHEDULER_URL)")
    scheduler = SchedulerClient(settings.scheduler_url, settings.cluster_secret)
    try:
        app = gateway_app(scheduler, settings, api_key(settings))
        # auto_decompress off: the proxy forwards bodies as sent, as a node's does.
        await listen_until_stopped(app, settings.gateway_addr, "gateway", auto_decompress=False)
    finally:
        await scheduler.close()


def main() -> None:
    run(serve)
