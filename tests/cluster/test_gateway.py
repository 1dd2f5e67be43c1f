"""The gateway without VMs: its API and proxy over real HTTP to node APIs serving fake nodes,
a fake scheduler, and an echo server standing in for a node's data plane."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import httpx
import pytest
from aiohttp import WSMsgType, web
from aiohttp.test_utils import TestServer

from aenv.api import schemas
from aenv.api.server import NodeAPI
from aenv.cluster import clusternode
from aenv.cluster.auth import CLUSTER_SECRET_HEADER
from aenv.cluster.gateway import gateway_app
from aenv.cluster.model import Binding, NodeState
from aenv.cluster.protocols import SandboxKilled
from aenv.cluster.remote import RemoteNode, cluster_client
from aenv.config import Settings
from aenv.devnode import free_port
from aenv.orchestrator.errors import Conflict, NotFound, OperationFailed, Unavailable
from aenv.orchestrator.interface import ListQuery
from aenv.orchestrator.states import State
from aenv.orchestrator.store import SandboxRecord
from tests.cluster.fakes import FakeNode, FakeScheduler, manifest, node_info

# Fixtures run on the session's loop (asyncio_default_fixture_loop_scope): so do these tests.
pytestmark = pytest.mark.asyncio(loop_scope="session")

SECRET = "cluster-secret-for-tests"
KEY = "e2b_gateway_key"
NODE_KEY = "e2b_node_key"
BASE = manifest("base1", "2026-01-01T00:00:00+00:00", alias="base")
SETTINGS = Settings(cluster_secret=SECRET, gateway_addr="127.0.0.1:8080")


@dataclass
class Cluster:
    scheduler: FakeScheduler
    nodes: dict[str, FakeNode]
    gateway: httpx.AsyncClient
    servers: dict[str, TestServer]

    async def kill(self, node_id: str) -> None:
        """The node dies: its API stops answering, and the scheduler has it down."""
        await self.servers.pop(node_id).close()
        self.scheduler.set_status(node_id, NodeState.DOWN)

    async def create(self, **body: object) -> dict:
        response = await self.gateway.post("/sandboxes", json={"templateID": "base1", **body})
        assert response.status_code == 201, response.text
        return response.json()

    async def join(self, node: FakeNode) -> FakeNode:
        """The node serves its API (taking the cluster secret) and registers."""
        api = NodeAPI(node, domain="localhost:1", limits=schemas.limits(SETTINGS))  # type: ignore[arg-type]
        self.servers[node.node_id] = server = await serve(api.app(NODE_KEY, SECRET))
        self.nodes[node.node_id] = node
        await self.scheduler.register(node_info(node.node_id, str(server.make_url("")).rstrip("/")))
        return node

    async def pause_durably(self, sandbox_id: str) -> None:
        """Paused through the gateway, then committed to its node's repository, as the node reports."""
        assert (await self.gateway.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
        binding = self.scheduler.bound[sandbox_id]
        node = self.nodes[binding.node_id]
        node.repository[sandbox_id] = node.sandboxes[sandbox_id]
        await self.scheduler.bind(binding.model_copy(update={"durable": True}))


async def serve(app: web.Application) -> TestServer:
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    scheduler = FakeScheduler()
    gateway = await serve(gateway_app(scheduler, SETTINGS, KEY))
    async with httpx.AsyncClient(base_url=str(gateway.make_url("")), headers={"X-API-Key": KEY}) as client:
        cluster = Cluster(scheduler, {}, client, {})
        for name in ("na", "nb"):
            await cluster.join(FakeNode(name, [BASE]))
        yield cluster
    for server in [gateway, *cluster.servers.values()]:
        await server.close()


async def test_creates_spread_over_nodes_and_each_call_reaches_the_holder(cluster: Cluster) -> None:
    created = [await cluster.create(metadata={"n": str(i)}) for i in range(4)]
    holders = {c["sandboxID"]: cluster.scheduler.bound[c["sandboxID"]].node_id for c in created}
    assert sorted(holders.values()) == ["na", "na", "nb", "nb"]
    for sandbox_id, node_id in holders.items():
        assert sandbox_id in cluster.nodes[node_id].sandboxes
        detail = (await cluster.gateway.get(f"/sandboxes/{sandbox_id}")).json()
        assert detail["clientID"] == node_id and detail["envdAccessToken"] == "envd-token"
        assert detail["domain"] == "localhost:8080"  # the gateway's, not the node's
    first = created[0]["sandboxID"]
    assert (await cluster.gateway.post(f"/sandboxes/{first}/pause")).status_code == 204
    assert cluster.scheduler.bound[first].state == "paused"
    assert (await cluster.gateway.post(f"/sandboxes/{first}/pause")).status_code == 409  # the node's Conflict
    assert (
        await cluster.gateway.post(f"/sandboxes/{first}/connect", json={"timeout": 60})
    ).status_code == 201
    assert cluster.scheduler.bound[first].state == "running"
    assert (await cluster.gateway.delete(f"/sandboxes/{first}")).status_code == 204
    assert first not in cluster.scheduler.bound
    missing = await cluster.gateway.get(f"/sandboxes/{first}")
    assert missing.status_code == 404 and missing.json()["code"] == 404


async def test_a_durable_pause_on_a_down_node_resumes_on_another(cluster: Cluster) -> None:
    cluster.nodes["nb"].repository = cluster.nodes["na"].repository  # one shared repository
    cluster.nodes["nb"].full = True
    sandbox_id = (await cluster.create())["sandboxID"]
    assert cluster.scheduler.bound[sandbox_id].node_id == "na"
    cluster.nodes["nb"].full = False
    assert (await cluster.gateway.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
    await cluster.kill("na")
    local = await cluster.gateway.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 60})
    assert local.status_code == 503  # not durable: only its own node can resume it
    record = cluster.nodes["na"].sandboxes[sandbox_id]
    cluster.nodes["na"].repository[sandbox_id] = record  # the pause was committed
    await cluster.scheduler.bind(cluster.scheduler.bound[sandbox_id].model_copy(update={"durable": True}))
    moved = await cluster.gateway.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 60})
    assert moved.status_code == 201, moved.text
    assert cluster.scheduler.bound[sandbox_id].node_id == "nb"
    assert cluster.scheduler.bound[sandbox_id].state == "running"
    assert (await cluster.gateway.get(f"/sandboxes/{sandbox_id}")).json()["clientID"] == "nb"


async def test_a_pause_after_a_durable_one_is_not_durable_until_its_node_says_so(cluster: Cluster) -> None:
    """The gateway's binds after a resume and a pause carry only the state: copied from the
    binding it located, they said the second pause was durable before its upload, and a node
    lost then was taken over from a pause the repository did not have (CI of stop 20)."""
    cluster.nodes["nb"].repository = cluster.nodes["na"].repository
    cluster.nodes["nb"].full = True
    sandbox_id = (await cluster.create())["sandboxID"]
    cluster.nodes["nb"].full = False
    assert (await cluster.gateway.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
    await cluster.scheduler.bind(cluster.scheduler.bound[sandbox_id].model_copy(update={"durable": True}))
    resumed = await cluster.gateway.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 60})
    assert resumed.status_code == 201 and not cluster.scheduler.bound[sandbox_id].durable
    assert (await cluster.gateway.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
    assert not cluster.scheduler.bound[sandbox_id].durable  # its upload has not committed
    await cluster.kill("na")
    waiting = await cluster.gateway.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 60})
    assert waiting.status_code == 503 and "not in a shared repository" in waiting.json()["message"]


async def test_a_report_read_before_a_pause_does_not_undo_it(cluster: Cluster) -> None:
    """A node sends its changed bindings one by one, as read when its report began: one read
    before a pause through the gateway can arrive after the gateway's bind of the pause. That
    bind carries the node's generation of the sandbox, so the late report changes nothing."""
    sandbox_id = (await cluster.create())["sandboxID"]
    running = cluster.scheduler.bound[sandbox_id].model_copy(update={"generation": 1})  # the node's report
    await cluster.scheduler.bind(running)
    assert (await cluster.gateway.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
    await cluster.scheduler.bind(running)  # the node's late report
    paused = cluster.scheduler.bound[sandbox_id]
    assert (paused.state, paused.generation) == ("paused", 2)
    resumed = await cluster.gateway.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 60})
    assert resumed.status_code == 201
    await cluster.scheduler.bind(paused)  # and its report of the pause, late as well
    assert (cluster.scheduler.bound[sandbox_id].state, cluster.scheduler.bound[sandbox_id].generation) == (
        "running",
        3,
    )


async def test_a_durable_pause_its_node_took_back_is_lost_with_the_node(cluster: Cluster) -> None:
    """The node resumed a durable pause (which left the repository) and went down before the
    scheduler heard of it: the binding still says paused and durable. The take-over finds no
    pause, so the sandbox was lost with its node, and says so (CI of stop 27, in a rerun)."""
    cluster.nodes["nb"].repository = cluster.nodes["na"].repository
    cluster.nodes["nb"].full = True
    sandbox_id = (await cluster.create())["sandboxID"]
    cluster.nodes["nb"].full = False
    await cluster.pause_durably(sandbox_id)
    na = cluster.nodes["na"]
    na.repository.pop(sandbox_id)  # resumed on its node, which claims and then deletes the pause
    na.sandboxes[sandbox_id].state = State.RUNNING
    await cluster.kill("na")
    lost = await cluster.gateway.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 60})
    message = lost.json()["message"]
    assert lost.status_code == 404 and "was lost" in message and "node na is down" in message, lost.text
    assert cluster.scheduler.released == [(sandbox_id, "nb")]  # the room nb kept for it is free again


async def test_list_merges_nodes_and_pages_across_them(cluster: Cluster) -> None:
    ids = {(await cluster.create(metadata={"job": "a"}))["sandboxID"] for _ in range(5)}
    await cluster.create(metadata={"job": "b"})
    everything = (await cluster.gateway.get("/v2/sandboxes", params={"metadata": "job=a"})).json()
    assert {s["sandboxID"] for s in everything} == ids
    holders = {i: (await cluster.gateway.get(f"/sandboxes/{i}")).json()["clientID"] for i in ids}
    assert {s["sandboxID"]: s["clientID"] for s in everything} == holders  # each names its node
    assert set(holders.values()) == {"na", "nb"}
    running = (await cluster.gateway.get("/sandboxes", params={"metadata": "job=a"})).json()
    assert {s["sandboxID"]: s["clientID"] for s in running} == holders
    paged, token = [], None
    while True:
        params = {"metadata": "job=a", "limit": "2"} | ({"nextToken": token} if token else {})
        response = await cluster.gateway.get("/v2/sandboxes", params=params)
        paged += response.json()
        if not (token := response.headers.get("X-Next-Token")):
            break
    assert paged == everything
    assert [s["startedAt"] for s in everything] == sorted((s["startedAt"] for s in everything), reverse=True)


async def test_a_page_mostly_from_one_node_is_whole_also_from_a_node_that_ignores_paging(
    cluster: Cluster,
) -> None:
    """Each node is first asked for its share of a page only: one holding more of it is asked again."""
    cluster.nodes["na"].full = True
    on_nb = {(await cluster.create())["sandboxID"] for _ in range(10)}
    cluster.nodes["na"].full = False
    on_na = (await cluster.create())["sandboxID"]
    unpaged = cluster.nodes["nb"].list

    async def ignoring_paging(query: ListQuery) -> list[SandboxRecord]:
        return await unpaged(replace(query, after=None, limit=None))

    for order in ("desc", "asc"):
        everything = (await cluster.gateway.get("/v2/sandboxes", params={"order": order})).json()
        assert {s["sandboxID"] for s in everything} == on_nb | {on_na}
        for nb_list in (unpaged, ignoring_paging):
            cluster.nodes["nb"].list = nb_list  # type: ignore[method-assign]
            paged, token = [], None
            while True:
                params = {"limit": "8", "order": order} | ({"nextToken": token} if token else {})
                response = await cluster.gateway.get("/v2/sandboxes", params=params)
                paged += response.json()
                if not (token := response.headers.get("X-Next-Token")):
                    break
            assert paged == everything


async def test_a_full_node_or_one_without_the_template_passes_the_create_on(cluster: Cluster) -> None:
    cluster.nodes["na"].full = True
    created = [(await cluster.create())["sandboxID"] for _ in range(2)]
    assert [cluster.scheduler.bound[i].node_id for i in created] == ["nb", "nb"]
    cluster.nodes["nb"].templates.clear()
    refused = await cluster.gateway.post("/sandboxes", json={"templateID": "base1"})
    assert refused.status_code == 404  # nb lacks the template, na is full: the last refusal is the answer
    cluster.nodes["nb"].templates["base1"] = BASE
    cluster.nodes["nb"].full = True
    full = await cluster.gateway.post("/sandboxes", json={"templateID": "base1"})
    assert full.status_code == 429 and "full" in full.json()["message"]  # E2B's "no room now"
    assert full.headers["Retry-After"] == "1"
    assert set(cluster.scheduler.bound) == set(created)  # every failed attempt let go of its binding


async def test_a_down_node_loses_its_running_sandboxes_and_nothing_else(cluster: Cluster) -> None:
    created = {
        cluster.scheduler.bound[(c := await cluster.create())["sandboxID"]].node_id: c for _ in range(4)
    }
    lost, kept = created["na"]["sandboxID"], created["nb"]["sandboxID"]
    paused = next(i for i, b in cluster.scheduler.bound.items() if b.node_id == "na" and i != lost)
    await cluster.gateway.post(f"/sandboxes/{paused}/pause")
    await cluster.kill("na")
    answer = await cluster.gateway.get(f"/sandboxes/{lost}")
    assert (
        answer.status_code == 404 and "lost" in answer.json()["message"] and "na" in answer.json()["message"]
    )
    assert (await cluster.gateway.post(f"/sandboxes/{paused}/connect")).status_code == 503
    listed = {s["sandboxID"] for s in (await cluster.gateway.get("/v2/sandboxes")).json()}
    assert kept in listed and lost not in listed
    assert (await cluster.gateway.get(f"/sandboxes/{kept}")).status_code == 200
    nodes = {n["id"]: n for n in (await cluster.gateway.get("/nodes")).json()}
    assert nodes["na"]["status"] == "down" and nodes["nb"]["status"] == "up"
    assert (await cluster.gateway.get("/nodes/nb")).json()["address"] == nodes["nb"]["address"]


async def test_sandboxes_of_a_down_node_are_killed_for_good(cluster: Cluster) -> None:
    """A lost sandbox and durable pauses on a dead node: killed (204), gone for the cluster at
    once, never taken over (not even by a take-over under way), and refused when their node is
    back and reports them (its membership kills them then). A killed pause is deleted from the
    shared repository by a live node at once: its node may never be back to do it."""
    cluster.nodes["nb"].repository = cluster.nodes["na"].repository
    cluster.nodes["nb"].full = True
    lost, paused, raced = [(await cluster.create())["sandboxID"] for _ in range(3)]
    cluster.nodes["nb"].full = False
    for sandbox_id in (paused, raced):
        await cluster.pause_durably(sandbox_id)
    await cluster.kill("na")
    for sandbox_id in (lost, paused):
        assert (await cluster.gateway.delete(f"/sandboxes/{sandbox_id}")).status_code == 204
        for answer in [await cluster.gateway.get(f"/sandboxes/{sandbox_id}"),
                       await cluster.gateway.delete(f"/sandboxes/{sandbox_id}")]:  # fmt: skip
            assert answer.status_code == 404 and "lost" not in answer.json()["message"], answer.text
    resumed = await cluster.gateway.post(f"/sandboxes/{paused}/connect", json={"timeout": 60})
    assert resumed.status_code == 404 and paused not in cluster.nodes["nb"].sandboxes
    assert paused not in cluster.nodes["na"].repository and raced in cluster.nodes["na"].repository
    assert (await cluster.gateway.delete(f"/sandboxes/{paused}/pause")).status_code == 404  # gone already

    take_over = cluster.nodes["nb"].take_over

    async def killed_meanwhile(sandbox_id: str, timeout: int | None) -> SandboxRecord:
        await cluster.scheduler.tombstone(sandbox_id, "na")  # another gateway's kill
        return await take_over(sandbox_id, timeout)

    cluster.nodes["nb"].take_over = killed_meanwhile  # type: ignore[method-assign]
    late = await cluster.gateway.post(f"/sandboxes/{raced}/connect", json={"timeout": 60})
    assert late.status_code == 404, late.text
    for sandbox_id, state in ((lost, "running"), (paused, "paused"), (raced, "running")):
        with pytest.raises(SandboxKilled):
            await cluster.scheduler.bind(Binding(sandbox_id=sandbox_id, node_id="na", state=state))
    assert not {lost, paused, raced} & set(cluster.scheduler.bound)


async def test_a_killed_pause_is_discarded_by_a_node_that_can(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Passed over: a node without a shared repository, and one that is unavailable. With no node
    left that can, the kill still answers 204 (its tombstone is the truth) and the pause stays,
    for its node's own kill when it is back, or a later `DELETE /sandboxes/{id}/pause`."""
    shared = cluster.nodes["na"].repository
    nc = await cluster.join(FakeNode("nc", [BASE]))
    nc.repository, cluster.nodes["nb"].shared = shared, False
    cluster.nodes["nb"].full = nc.full = True
    first, second = [(await cluster.create())["sandboxID"] for _ in range(2)]
    for sandbox_id in (first, second):
        await cluster.pause_durably(sandbox_id)
    bound = await cluster.gateway.delete(f"/sandboxes/{first}/pause")
    assert bound.status_code == 409 and "kill it" in bound.json()["message"]
    await cluster.kill("na")
    assert (await cluster.gateway.delete(f"/sandboxes/{first}")).status_code == 204
    assert first not in shared  # nc discarded it, whichever of nb and nc was asked first

    async def shutting_down(sandbox_id: str) -> None:
        raise Unavailable("node nc is shutting down")

    monkeypatch.setattr(nc, "discard_pause", shutting_down)
    assert (await cluster.gateway.delete(f"/sandboxes/{second}")).status_code == 204
    assert second in shared and (await cluster.gateway.get(f"/sandboxes/{second}")).status_code == 404
    refused = await cluster.gateway.delete(f"/sandboxes/{second}/pause")
    assert refused.status_code == 503
    assert (
        "node nb: " in refused.json()["message"] and "node nc is shutting down" in refused.json()["message"]
    )
    monkeypatch.undo()
    assert (await cluster.gateway.delete(f"/sandboxes/{second}/pause")).status_code == 204
    assert second not in shared


async def test_a_kill_does_not_wait_for_a_node_that_hangs_in_the_discard(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(clusternode, "DISCARD_TIMEOUT", 0.2)
    nb = cluster.nodes["nb"]
    nb.repository, nb.full = cluster.nodes["na"].repository, True
    sandbox_id = (await cluster.create())["sandboxID"]
    await cluster.pause_durably(sandbox_id)
    await cluster.kill("na")
    release = asyncio.Event()

    async def hangs(sandbox_id: str) -> None:
        await release.wait()

    monkeypatch.setattr(nb, "discard_pause", hangs)
    try:
        assert (await cluster.gateway.delete(f"/sandboxes/{sandbox_id}")).status_code == 204
        assert sandbox_id in nb.repository
    finally:
        release.set()


async def test_a_node_down_for_the_scheduler_but_answering_keeps_its_sandboxes(cluster: Cluster) -> None:
    """Its heartbeats did not reach the scheduler (one restarting, say): nothing is lost or moved."""
    cluster.nodes["nb"].repository = cluster.nodes["na"].repository
    cluster.nodes["nb"].full = True  # both sandboxes on na
    running, paused = [(await cluster.create())["sandboxID"] for _ in range(2)]
    assert (await cluster.gateway.post(f"/sandboxes/{paused}/pause")).status_code == 204
    cluster.nodes["na"].repository[paused] = cluster.nodes["na"].sandboxes[paused]  # durable
    await cluster.scheduler.bind(cluster.scheduler.bound[paused].model_copy(update={"durable": True}))
    cluster.scheduler.set_status("na", NodeState.DOWN)
    assert (await cluster.gateway.get(f"/sandboxes/{running}")).json()["clientID"] == "na"
    resumed = await cluster.gateway.post(f"/sandboxes/{paused}/connect", json={"timeout": 60})
    assert resumed.status_code == 201, resumed.text
    assert cluster.scheduler.bound[paused].node_id == "na"  # resumed where it was, not taken over
    assert paused in cluster.nodes["na"].repository


async def test_a_sandbox_its_node_no_longer_has_loses_its_binding(cluster: Cluster) -> None:
    sandbox_id = (await cluster.create())["sandboxID"]
    node = cluster.nodes[cluster.scheduler.bound[sandbox_id].node_id]
    del node.sandboxes[sandbox_id]  # ended on the node (its timeout, say)
    assert (await cluster.gateway.get(f"/sandboxes/{sandbox_id}")).status_code == 404
    assert sandbox_id not in cluster.scheduler.bound


async def test_what_a_node_did_is_answered_done_when_the_scheduler_cannot_record_it(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler restarting after the node paused or killed: the client hears it was done
    (a retried kill would find nothing); the node's own report records it later."""
    sandbox_id = (await cluster.create())["sandboxID"]
    node = cluster.nodes[cluster.scheduler.bound[sandbox_id].node_id]

    async def away(*args: object, **options: object) -> None:
        raise Unavailable("the scheduler is unreachable")

    monkeypatch.setattr(cluster.scheduler, "bind", away)
    monkeypatch.setattr(cluster.scheduler, "unbind", away)
    assert (await cluster.gateway.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
    assert node.sandboxes[sandbox_id].state == State.PAUSED
    resumed = await cluster.gateway.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 60})
    assert resumed.status_code == 201, resumed.text
    assert (await cluster.gateway.delete(f"/sandboxes/{sandbox_id}")).status_code == 204
    assert sandbox_id not in node.sandboxes


async def test_fork_stays_on_the_source_node_and_binds_the_children(cluster: Cluster) -> None:
    source = (await cluster.create())["sandboxID"]
    home = cluster.scheduler.bound[source].node_id
    forked = await cluster.gateway.post(f"/sandboxes/{source}/fork", json={"count": 2})
    assert forked.status_code == 201
    children = [c["sandbox"]["sandboxID"] for c in forked.json()]
    assert [cluster.scheduler.bound[c].node_id for c in children] == [home, home]


async def test_templates_are_cluster_wide(cluster: Cluster) -> None:
    cluster.nodes["nb"].templates["tmpl2"] = manifest("tmpl2", "2026-02-01T00:00:00+00:00")
    listed = (await cluster.gateway.get("/templates")).json()
    assert [t["templateID"] for t in listed] == ["tmpl2", "base1"]
    assert (await cluster.gateway.get("/templates/tmpl2")).status_code == 200
    assert (await cluster.gateway.get("/templates/aliases/base")).json()["templateID"] == "base1"
    assert (await cluster.gateway.get("/templates/nothing")).status_code == 404


async def test_metrics_add_up_the_nodes(cluster: Cluster) -> None:
    for _ in range(3):
        await cluster.create()
    metrics = (await cluster.gateway.get("/metrics")).text
    assert 'aenv_sandboxes{state="running"} 3.0' in metrics
    assert "aenv_gc_runs 2.0" in metrics  # one run on each of the two nodes


async def test_a_template_build_stays_on_one_node_whichever_call(cluster: Cluster) -> None:
    ticket = (await cluster.gateway.post("/v3/templates", json={"name": "mine"})).json()
    builder = next(n for n in cluster.nodes.values() if "mine" in n.builds)
    assert ticket["buildID"] == f"build-{builder.node_id}"
    link = (await cluster.gateway.get("/templates/mine/files/" + "a" * 64)).json()
    assert link["url"].startswith(str(cluster.gateway.base_url))  # uploads come through the gateway too
    uploaded = await cluster.gateway.put(link["url"], content=b"files", headers={"X-API-Key": ""})
    assert uploaded.status_code == 200 and builder.uploads["mine"] == [b"files"]
    status = await cluster.gateway.get(f"/templates/mine/builds/{ticket['buildID']}/status")
    assert status.status_code == 200 and status.json()["buildID"] == ticket["buildID"]
    assert (await cluster.gateway.get("/templates/mine/builds/other/status")).status_code == 404


async def test_the_gateway_takes_the_cluster_api_key_only(cluster: Cluster) -> None:
    wrong = await cluster.gateway.get("/v2/sandboxes", headers={"X-API-Key": NODE_KEY})
    assert wrong.status_code == 401
    secret_only = await cluster.gateway.get(
        "/v2/sandboxes", headers={"X-API-Key": "", CLUSTER_SECRET_HEADER: SECRET}
    )
    assert secret_only.status_code == 401


async def test_a_node_with_a_cluster_secret_takes_nothing_without_it(cluster: Cluster) -> None:
    address = (await cluster.scheduler.node("na")).address
    async with httpx.AsyncClient(base_url=address) as node:
        assert (await node.get("/health")).status_code == 204
        assert (await node.get("/v2/sandboxes", headers={"X-API-Key": NODE_KEY})).status_code == 401
        proxied = await node.get("/", headers={"E2b-Sandbox-Id": "abc", "E2b-Sandbox-Port": "49983"})
        assert proxied.status_code == 401
        assert (await node.get("/v2/sandboxes", headers={CLUSTER_SECRET_HEADER: SECRET})).status_code == 200
        internal = await node.post("/cluster/node/status", json={}, headers={CLUSTER_SECRET_HEADER: "wrong"})
        assert internal.status_code == 401


async def test_a_node_without_a_cluster_secret_has_no_internal_route() -> None:
    api = NodeAPI(FakeNode("solo", [BASE]), domain="localhost:1", limits=schemas.limits(SETTINGS))  # type: ignore[arg-type]
    server = await serve(api.app(NODE_KEY))
    try:
        async with httpx.AsyncClient(base_url=str(server.make_url("")), headers={"X-API-Key": NODE_KEY}) as c:
            assert (await c.post("/cluster/node/status", json={})).status_code == 404
    finally:
        await server.close()


async def test_remote_node_errors_come_back_typed() -> None:
    async def answer(request: web.Request) -> web.Response:
        if request.path.startswith("/stranger/"):
            return web.json_response({"code": 401, "message": "wrong secret"}, status=401)
        return web.json_response({"code": 409, "message": "busy", "error_code": "sandbox_busy"}, status=409)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    server = await serve(app)
    url = str(server.make_url("")).rstrip("/")
    client = cluster_client(SECRET)
    try:
        down = f"http://127.0.0.1:{free_port()}"
        with pytest.raises(Unavailable, match=f"node n1 at {down} is unreachable"):
            await RemoteNode("n1", down, client).get("abc")
        with pytest.raises(OperationFailed, match="refused the gateway's credentials"):
            await RemoteNode("n2", f"{url}/stranger", client).get("abc")
        with pytest.raises(Conflict) as conflict:
            await RemoteNode("n3", url, client).pause("abc")
        assert conflict.value.error_code == "sandbox_busy"
        with pytest.raises(NotFound):
            await RemoteNode("n3", url, client)._call("no_such_call")
    finally:
        await client.close()
        await server.close()


# -- the data plane ----------------------------------------------------------------------------


async def echo(request: web.Request) -> web.StreamResponse:
    """A node's data plane as the gateway sees it: says what arrived, streams, or echoes a WebSocket."""
    if request.headers.get("Upgrade", "").lower() == "websocket":
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:
            if message.type == WSMsgType.TEXT:
                await ws.send_str("echo " + message.data)
        return ws
    if request.path == "/proxy/stream":
        response = web.StreamResponse()
        await response.prepare(request)
        for i in range(3):
            await response.write(f"chunk {i}\n".encode())
        await response.write_eof()
        return response
    headers = {k.lower(): request.headers.getall(k) for k in request.headers}
    body = base64.b64encode(await request.read()).decode()
    return web.json_response({"target": request.raw_path, "headers": headers, "body": body})


@pytest.fixture
async def data_plane(cluster: Cluster) -> AsyncIterator[tuple[Cluster, str]]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    server = await serve(app)
    sandbox_id = (await cluster.create())["sandboxID"]
    node_id = cluster.scheduler.bound[sandbox_id].node_id
    address = str(server.make_url("")).rstrip("/")
    cluster.scheduler.infos[node_id] = cluster.scheduler.infos[node_id].model_copy(
        update={"address": address}
    )
    yield cluster, sandbox_id
    await server.close()


async def test_proxied_requests_reach_the_node_in_its_proxy_form(data_plane: tuple[Cluster, str]) -> None:
    cluster, sandbox_id = data_plane
    routing = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "8080"}
    headers = routing | {"e2b-traffic-access-token": "tt", CLUSTER_SECRET_HEADER: "forged", "X-API-Key": ""}
    response = await cluster.gateway.post("/proxy/a/b?x=1", headers=headers, content=b"payload")
    seen = response.json()
    assert seen["target"] == "/proxy/a/b?x=1" and base64.b64decode(seen["body"]) == b"payload"
    assert seen["headers"]["e2b-sandbox-id"] == [sandbox_id] and seen["headers"]["e2b-sandbox-port"] == [
        "8080"
    ]
    assert seen["headers"][CLUSTER_SECRET_HEADER.lower()] == [SECRET]  # the client's copy is dropped
    assert seen["headers"]["e2b-traffic-access-token"] == ["tt"]
    assert seen["headers"]["x-forwarded-host"] == [cluster.gateway.base_url.netloc.decode()]
    by_host = await cluster.gateway.get("/files", headers={"Host": f"49983-{sandbox_id}.localhost:8080"})
    assert by_host.json()["target"] == "/proxy/files"
    assert by_host.json()["headers"]["e2b-sandbox-port"] == ["49983"]
    streamed = await cluster.gateway.get("/stream", headers=routing)
    assert streamed.text == "chunk 0\nchunk 1\nchunk 2\n"
    unknown = await cluster.gateway.get("/", headers=routing | {"E2b-Sandbox-Id": "unknown1"})
    assert unknown.status_code == 502 and unknown.json()["sandboxId"] == "unknown1"
    node_id = cluster.scheduler.bound[sandbox_id].node_id
    cluster.scheduler.infos[node_id] = cluster.scheduler.infos[node_id].model_copy(
        update={"address": f"http://127.0.0.1:{free_port()}"}
    )
    gone = await cluster.gateway.get("/", headers=routing)
    assert gone.status_code == 502 and "node" in gone.json()["message"]


async def test_websockets_are_tunnelled_through_the_gateway(data_plane: tuple[Cluster, str]) -> None:
    import aiohttp

    cluster, sandbox_id = data_plane
    headers = {"Host": f"8080-{sandbox_id}.localhost"}
    url = str(cluster.gateway.base_url.join("/ws"))
    async with aiohttp.ClientSession() as session, session.ws_connect(url, headers=headers) as ws:
        await ws.send_str("hello")
        assert (await ws.receive()).data == "echo hello"


async def test_the_gateway_over_the_real_scheduler(redis_url: str) -> None:
    """The same calls through `SchedulerClient`, the scheduler's routes and Redis."""
    from aenv.cluster.client import SchedulerClient
    from tests.cluster.test_scheduler_http import SECRET as SCHEDULER_SECRET
    from tests.cluster.test_scheduler_http import serve as serve_scheduler

    scheduler_server = await serve_scheduler(redis_url)
    scheduler = SchedulerClient(str(scheduler_server.make_url("")), SCHEDULER_SECRET)
    nodes = {name: FakeNode(name, [BASE]) for name in ("na", "nb")}
    servers = [scheduler_server]
    for name, node in nodes.items():
        api = NodeAPI(node, domain="localhost:1", limits=schemas.limits(SETTINGS))  # type: ignore[arg-type]
        servers.append(await serve(api.app(NODE_KEY, SECRET)))
        await scheduler.register(node_info(name, str(servers[-1].make_url("")).rstrip("/")))
    servers.append(gateway := await serve(gateway_app(scheduler, SETTINGS, KEY)))
    try:
        async with httpx.AsyncClient(base_url=str(gateway.make_url("")), headers={"X-API-Key": KEY}) as api:
            created = [
                (await api.post("/sandboxes", json={"templateID": "base1"})).json()["sandboxID"]
                for _ in range(4)
            ]
            holders = {i: (await api.get(f"/sandboxes/{i}")).json()["clientID"] for i in created}
            assert sorted(holders.values()) == ["na", "na", "nb", "nb"]
            assert all(i in nodes[n].sandboxes for i, n in holders.items())
            assert len((await api.get("/v2/sandboxes")).json()) == 4
            assert (await api.delete(f"/sandboxes/{created[0]}")).status_code == 204
            assert {b.sandbox_id for b in await scheduler.bindings()} == set(created[1:])
            placed, _ = await scheduler.locate(created[1])
            running = placed.model_copy(update={"generation": 1})
            await scheduler.bind(running)  # its node's report of the create
            assert (await api.post(f"/sandboxes/{created[1]}/pause")).status_code == 204
            await scheduler.bind(running)  # and that report again, read before the pause, arriving late
            paused, _ = await scheduler.locate(created[1])
            assert (paused.state, paused.generation) == ("paused", 2)
            assert {n["id"] for n in (await api.get("/nodes")).json()} == {"na", "nb"}
    finally:
        await scheduler.close()
        for server in servers:
            await server.close()
