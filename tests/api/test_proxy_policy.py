"""The proxy's policy alone (`aenv.api.proxy`) over a fake transport: routing, credentials, the head
the upstream receives, and transport failures as E2B errors. No sockets below the proxy."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
import pytest_asyncio
from aiohttp import web

from aenv.agent.envd import ENVD_PORT
from aenv.api.proxy import PORT_NOT_OPEN, ProxyTarget, SandboxAccess, SandboxProxy
from aenv.api.upstream import ClientGone, Upstream, UpstreamFailed, UpstreamRequest

SANDBOX = "isbx"
OPEN = SandboxAccess("envd-token", None, secure=True, public_traffic=True)


@dataclass
class FakeTransport:
    """Records what the policy hands down and answers 200, or raises `fail`."""

    sent: list[tuple[Upstream, UpstreamRequest]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    fail: Exception | None = None

    async def relay(
        self, request: web.Request, upstream: Upstream, outgoing: UpstreamRequest
    ) -> web.StreamResponse:
        self.sent.append((upstream, outgoing))
        if self.fail is not None:
            raise self.fail
        return web.Response(text="relayed")

    def release(self, key: str) -> None:
        self.released.append(key)

    def close(self) -> None:
        self.released.append("*")


@dataclass
class Resolver:
    access: SandboxAccess | None = OPEN
    network: object = field(default_factory=object)  # stands in for the sandbox's namespace
    wakeups: int = 0

    async def proxy_access(self, sandbox_id: str) -> SandboxAccess | None:
        return self.access if sandbox_id == SANDBOX else None

    async def proxy_target(self, sandbox_id: str, *, resume: bool) -> ProxyTarget | None:
        self.wakeups += 1
        return ProxyTarget(sandbox_id, self.network)  # type: ignore[arg-type]


@dataclass
class Proxied:
    client: httpx.AsyncClient
    transport: FakeTransport
    resolver: Resolver

    def fields(self) -> dict[str, list[str]]:
        """The last outgoing head's fields, by lower-cased name."""
        found: dict[str, list[str]] = {}
        for name, value in self.transport.sent[-1][1].headers:
            found.setdefault(name.lower(), []).append(value)
        return found


@pytest_asyncio.fixture(loop_scope="function")  # the test's own loop serves it
async def proxied() -> AsyncIterator[Proxied]:
    transport, resolver = FakeTransport(), Resolver()
    proxy = SandboxProxy(resolver, "test.local", transport)

    async def api(request: web.Request) -> web.Response:
        return web.Response(text="api")

    app = web.Application(middlewares=[proxy.middleware()])
    app.router.add_get("/health", api)
    proxy.setup(app)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{runner.addresses[0][1]}") as client:
        yield Proxied(client, transport, resolver)
    await runner.cleanup()
    assert transport.released[-1] == "*"  # the app's cleanup closed the transport


def routing(port: int) -> dict[str, str]:
    return {"E2b-Sandbox-Id": SANDBOX, "E2b-Sandbox-Port": str(port)}


async def test_the_three_routing_forms(proxied: Proxied) -> None:
    client = proxied.client
    assert (await client.get("/files?path=/a%20b", headers=routing(ENVD_PORT))).text == "relayed"
    assert (await client.get("/x?y=1", headers={"Host": f"8000-{SANDBOX}.test.local"})).text == "relayed"
    assert (await client.post("/proxy/rpc?z", headers=routing(3000), content=b"{}")).text == "relayed"
    assert (await client.get("/health")).text == "api"  # not a data-plane request: the API's
    sent = [(up.key, out.port, out.target) for up, out in proxied.transport.sent]
    assert sent == [
        (SANDBOX, ENVD_PORT, "/files?path=/a%20b"),
        (SANDBOX, 8000, "/x?y=1"),
        (SANDBOX, 3000, "/rpc?z"),
    ]
    bad = await client.get("/", headers={"E2b-Sandbox-Id": SANDBOX, "E2b-Sandbox-Port": "70000"})
    assert bad.status_code == 400 and bad.json()["code"] == 400


async def test_the_head_the_upstream_receives(proxied: Proxied) -> None:
    headers = {
        **routing(8000),
        "X-Access-Token": "envd-token",
        "E2b-Traffic-Access-Token": "t",
        "X-Aenv-Cluster-Secret": "s",
        "X-Forwarded-For": "10.0.0.1",
        "Connection": "keep-alive, X-Hop",
        "X-Hop": "1",
        "X-Kept": "yes",
    }
    await proxied.client.get("/", headers=headers)
    fields = proxied.fields()
    assert fields["x-kept"] == ["yes"] and fields["x-access-token"] == ["envd-token"]
    consumed = ("e2b-sandbox-id", "e2b-sandbox-port", "e2b-traffic-access-token", "x-aenv-cluster-secret")
    for name in (*consumed, "x-hop", "connection"):
        assert name not in fields
    assert fields["x-forwarded-for"] == ["10.0.0.1, 127.0.0.1"]
    assert fields["x-forwarded-proto"] == ["http"]
    assert fields["host"] == [proxied.client.base_url.netloc.decode()]


async def test_mask_request_host_applies_to_ports_but_envd(proxied: Proxied) -> None:
    proxied.resolver.access = SandboxAccess(None, None, False, True, mask_request_host="app-${PORT}.example")
    await proxied.client.get("/", headers=routing(8000))
    assert proxied.fields()["host"] == ["app-8000.example"]
    await proxied.client.get("/health", headers=routing(ENVD_PORT))
    assert proxied.fields()["host"] != ["app-49983.example"]


@pytest.mark.parametrize(
    ("port", "path", "headers", "status"),
    [
        (ENVD_PORT, "/init", {"X-Access-Token": "envd-token"}, 404),  # the node's alone
        (ENVD_PORT, "/process.Process/List", {}, 401),
        (8000, "/", {}, 403),
        (8000, "/", {"E2b-Traffic-Access-Token": "wrong"}, 403),
    ],
)
async def test_refusals_reach_neither_the_sandbox_nor_the_transport(
    proxied: Proxied, port: int, path: str, headers: dict[str, str], status: int
) -> None:
    proxied.resolver.access = SandboxAccess("envd-token", "traffic", secure=True, public_traffic=False)
    response = await proxied.client.post(path, headers={**routing(port), **headers})
    assert response.status_code == status
    assert proxied.resolver.wakeups == 0 and proxied.transport.sent == []


async def test_transport_failures_and_unknown_sandboxes(proxied: Proxied) -> None:
    proxied.transport.fail = UpstreamFailed("connect: refused")
    failed = await proxied.client.get("/", headers=routing(8000))
    assert failed.status_code == 502
    assert failed.json() == {"sandboxId": SANDBOX, "message": PORT_NOT_OPEN, "port": 8000, "code": 502}
    proxied.transport.fail = ClientGone()
    assert (await proxied.client.get("/", headers=routing(8000))).status_code == 400
    unknown = await proxied.client.get("/", headers={**routing(8000), "E2b-Sandbox-Id": "nobody"})
    assert unknown.status_code == 502 and proxied.transport.released == ["nobody"]


async def test_a_new_namespace_is_a_new_upstream(proxied: Proxied) -> None:
    await proxied.client.get("/", headers=routing(8000))
    proxied.resolver.network = object()  # the sandbox was resumed into a new namespace
    await proxied.client.get("/", headers=routing(8000))
    first, second = (upstream for upstream, _ in proxied.transport.sent)
    assert first.key == second.key and first.address != second.address
