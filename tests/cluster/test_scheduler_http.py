"""The scheduler's HTTP routes through `SchedulerClient`, against a real Redis: a round trip of
every call, the cluster secret, and errors as statuses and back as the typed errors."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from aiohttp.test_utils import TestServer

from aenv.cluster.auth import CLUSTER_SECRET_HEADER
from aenv.cluster.client import SchedulerClient
from aenv.cluster.model import Binding, NodeUsage, Placement
from aenv.cluster.protocols import SandboxKilled
from aenv.cluster.scheduler import ClusterScheduler, scheduler_app
from aenv.cluster.state import ClusterState
from aenv.devnode import free_port
from aenv.orchestrator.errors import InvalidRequest, NotFound, Unavailable

from .test_placement import node

pytestmark = pytest.mark.asyncio(loop_scope="session")
SECRET = "s3cret"


async def serve(redis_url: str) -> TestServer:
    state = ClusterState.from_url(redis_url, down_after=10.0)
    app = scheduler_app(ClusterScheduler(state), SECRET)
    app.on_cleanup.append(lambda _: state.close())
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    return server


@pytest.fixture
async def server(redis_url: str) -> AsyncIterator[TestServer]:
    server = await serve(redis_url)
    yield server
    await server.close()


@pytest.fixture
async def client(server: TestServer) -> AsyncIterator[SchedulerClient]:
    client = SchedulerClient(str(server.make_url("")), SECRET)
    yield client
    await client.close()


async def test_round_trip(client: SchedulerClient) -> None:
    registered = await client.register(node("a", cached=["base"]))
    assert (registered.node_id, registered.status, registered.cached) == ("a", "up", ["base"])
    assert registered.registered_at > 0
    await client.register(node("b"))
    beat = await client.heartbeat("a", NodeUsage(running=1, memory_mib=512), node("a").capacity, ["base"])
    assert beat.usage.running == 1 and beat.heartbeat_at >= registered.heartbeat_at
    assert [n.node_id for n in await client.nodes()] == ["a", "b"]
    assert (await client.place(Placement(template="base"))).node_id == "a"
    await client.bind(Binding(sandbox_id="s1", node_id="a", template_id="base"))
    binding, where = await client.locate("s1")
    assert (binding.template_id, where.address) == ("base", "http://a:8000")
    assert [b.sandbox_id for b in await client.bindings("a")] == ["s1"]
    await client.bind(Binding(sandbox_id="s1", node_id="a", state="paused", durable=True), observed=True)
    assert (await client.locate("s1"))[0].durable is False  # a gateway's word is never "durable"
    await client.unbind("s1", "b")  # not b's: stays
    assert [b.sandbox_id for b in await client.bindings()] == ["s1"]
    await client.unbind("s1", "a")
    assert await client.bindings() == []
    await client.bind(Binding(sandbox_id="s2", node_id="a", state="paused"))
    assert (await client.tombstone("s2", "a")).state == "paused"
    with pytest.raises(SandboxKilled, match="was killed"):  # a 409 told apart by its error_code
        await client.bind(Binding(sandbox_id="s2", node_id="a", state="paused"))
    with pytest.raises(NotFound):
        await client.tombstone("s2", "a")
    await client.bind(Binding(sandbox_id="s3", node_id="a", state="paused", durable=True))
    resume = Placement(kind="resume", sandbox_id="s3", exclude=["a"])
    assert (await client.place(resume)).node_id == "b"
    await client.release(resume, "b")  # its take-over failed there
    assert (await client.drain("b")).status == "draining"
    assert (await client.node("b")).status == "draining"


async def test_errors_come_back_typed(client: SchedulerClient, server: TestServer) -> None:
    with pytest.raises(NotFound, match="node ghost is not registered"):
        await client.heartbeat("ghost", NodeUsage(), node("ghost").capacity, [])
    with pytest.raises(NotFound, match="not bound"):
        await client.locate("nobody")
    with pytest.raises(Unavailable, match="no node has registered"):
        await client.place(Placement())
    with pytest.raises(InvalidRequest, match="sandbox_id"):
        await client.place(Placement(kind="resume"))
    with pytest.raises(InvalidRequest, match="only a resume's placement"):
        await client.release(Placement(sandbox_id="s1"), "a")
    raw = httpx.AsyncClient(base_url=str(server.make_url("")), headers={CLUSTER_SECRET_HEADER: SECRET})
    async with raw:
        bad = await raw.post("/placements", json={"memory_mib": 0})
        assert bad.status_code == 400 and "memory_mib" in bad.json()["message"]
        mismatch = await raw.put("/bindings/s9", json={"sandbox_id": "s8", "node_id": "a"})
        assert mismatch.status_code == 400
        assert (await raw.delete("/bindings/s9")).status_code == 400
        assert (await raw.post("/nodes/a%20b/drain")).status_code == 400
        missing = await raw.get("/no/such/route")
        assert missing.status_code == 404 and missing.json()["code"] == 404


async def test_the_cluster_secret_is_required(server: TestServer) -> None:
    async with httpx.AsyncClient(base_url=str(server.make_url(""))) as raw:
        assert (await raw.get("/health")).json() == {"status": "ok"}
        refused = await raw.get("/nodes")
        assert refused.status_code == 401 and CLUSTER_SECRET_HEADER in refused.json()["message"]
        wrong = await raw.get("/nodes", headers={CLUSTER_SECRET_HEADER: "nope"})
        assert wrong.status_code == 401
    stranger = SchedulerClient(str(server.make_url("")), "nope")
    try:
        with pytest.raises(Unavailable, match="AENV_CLUSTER_SECRET"):
            await stranger.nodes()
    finally:
        await stranger.close()


async def test_unreachable_scheduler_or_redis_is_unavailable() -> None:
    gone = SchedulerClient(f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(Unavailable, match="unreachable"):
            await gone.nodes()
    finally:
        await gone.close()
    server = await serve(f"redis://127.0.0.1:{free_port()}/0")  # no Redis there
    client = SchedulerClient(str(server.make_url("")), SECRET)
    try:
        with pytest.raises(Unavailable, match="Redis"):
            await client.nodes()
        async with httpx.AsyncClient() as raw:
            assert (await raw.get(str(server.make_url("/health")))).status_code == 503
    finally:
        await client.close()
        await server.close()


async def test_a_client_of_several_schedulers_goes_on_with_one_that_answers(server: TestServer) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    live = str(server.make_url("")).rstrip("/")
    client = SchedulerClient(f"{dead}, {live}/", SECRET)
    try:
        assert client.urls == [dead, live]
        await client.register(node("a"))
        assert client.url == live  # later calls start with the one that answered
        assert [n.node_id for n in await client.nodes()] == ["a"]
    finally:
        await client.close()
    nobody = SchedulerClient(f"{dead},http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(Unavailable, match=r"unreachable.*; .*unreachable"):
            await nobody.nodes()
    finally:
        await nobody.close()


async def test_metrics_count_placements_binds_and_nodes(client: SchedulerClient, server: TestServer) -> None:
    """`/metrics` (public, as a node's) has placements by kind and result with their latency,
    refused binds, nodes by state and every request by route template."""
    from prometheus_client.parser import text_string_to_metric_families

    await client.register(node("a"))
    await client.register(node("b"))
    await client.drain("b")
    await client.place(Placement(template="base", sandbox_id="m1"))
    with pytest.raises(Unavailable):
        await client.place(Placement(template="base", memory_mib=1 << 30))
    await client.bind(Binding(sandbox_id="m2", node_id="a", state="paused"))
    await client.tombstone("m2", "a")
    with pytest.raises(SandboxKilled):
        await client.bind(Binding(sandbox_id="m2", node_id="a", state="paused"))
    async with httpx.AsyncClient() as http:  # no secret: the route is public
        text = (await http.get(str(server.make_url("/metrics")))).text
    seen = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return seen.get((name, frozenset(labels.items())), 0.0)

    assert value("aenv_scheduler_placements_total", kind="create", result="placed") == 1
    assert value("aenv_scheduler_placements_total", kind="create", result="no_room") == 1
    assert value("aenv_scheduler_placement_duration_seconds_count", kind="create") == 2
    assert value("aenv_scheduler_bind_conflicts_total") == 1
    assert value("aenv_scheduler_nodes", state="up") == 1
    assert value("aenv_scheduler_nodes", state="draining") == 1
    assert value("aenv_http_requests_total", route="/placements", method="POST", status="429") == 1
    assert value("aenv_http_requests_total", route="/bindings/{sandbox_id}", method="PUT", status="409") == 1
