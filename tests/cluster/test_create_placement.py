"""A create's placement with its binding, against a real Redis: the binding is recorded with the
reservation, the node's own bind spends that reservation, a failed create's unbind frees it, and
the node's reconciliation sees the binding only once the create has ended or its reservation
expired (a gateway that died mid-create)."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from aenv.cluster.clusternode import ClusterNode
from aenv.cluster.model import Binding, NodeInfo, Placement
from aenv.cluster.scheduler import ClusterScheduler
from aenv.cluster.state import ClusterState
from aenv.orchestrator.errors import Conflict, InvalidRequest, NotFound
from aenv.orchestrator.ids import SANDBOX_ID, chosen_id
from aenv.orchestrator.interface import CreateRequest
from aenv.orchestrator.store import SandboxRecord
from tests.orchestrator.conftest import record

from .fakes import FakeScheduler, node_info
from .test_placement import GIB, node

# On the session's loop, as the Redis fixtures.
on_session_loop = pytest.mark.asyncio(loop_scope="session")


async def room(state: ClusterState) -> tuple[int, int]:
    (only,) = await state.rooms()
    return only.memory_mib, only.starting


@on_session_loop
async def test_a_create_placement_binds_and_the_node_bind_spends_its_own_reservation(redis_url: str) -> None:
    state = ClusterState.from_url(redis_url, down_after=10.0)
    scheduler = ClusterScheduler(state)
    try:
        await scheduler.register(node("a", memory_mib=4 * GIB))
        placed = await scheduler.place(Placement(template="base", sandbox_id="s1", memory_mib=1024))
        assert placed.node_id == "a"
        binding, where = await scheduler.locate("s1")
        assert (binding.node_id, binding.state, where.node_id) == ("a", "running", "a")
        with pytest.raises(Conflict, match="s1 is bound already"):
            await scheduler.place(Placement(sandbox_id="s1"))
        await scheduler.place(Placement(memory_mib=512))  # an unnamed create, placed after s1's
        assert await room(state) == (4 * GIB - 1536, 2)
        # Under way: not the node's to reconcile yet.
        assert [b.sandbox_id for b in await scheduler.bindings()] == ["s1"]
        assert await scheduler.bindings("a") == []
        await scheduler.bind(Binding(sandbox_id="s1", node_id="a", template_id="base1"))
        assert await room(state) == (4 * GIB - 1536, 2)  # s1's 1 GiB is pending, the other still reserved
        pending = await state.redis.hgetall("aenv:pending:a")
        assert pending == {"s1": "1024:1"}
        assert [b.template_id for b in await scheduler.bindings("a")] == ["base1"]
    finally:
        await state.close()


@on_session_loop
async def test_a_retried_create_placement_answers_its_first_node_and_reserves_once(redis_url: str) -> None:
    """A gateway resends a placement whose answer it lost (its scheduler died after Redis ran the
    script) to another scheduler: the same node, one reservation, until the node binds it."""
    state = ClusterState.from_url(redis_url, down_after=10.0)
    scheduler = ClusterScheduler(state)
    try:
        for name in ("a", "b"):
            await scheduler.register(node(name, memory_mib=4 * GIB))
        first = await scheduler.place(Placement(sandbox_id="s1", memory_mib=1024))
        again = await scheduler.place(Placement(sandbox_id="s1", memory_mib=1024))
        assert again.node_id == first.node_id
        rooms = {r.node.node_id: (r.memory_mib, r.starting) for r in await state.rooms()}
        assert rooms[first.node_id] == (3 * GIB, 1)
        await scheduler.bind(Binding(sandbox_id="s1", node_id=first.node_id))
        with pytest.raises(Conflict, match="s1 is bound already"):  # bound now: no retry of a placement
            await scheduler.place(Placement(sandbox_id="s1", memory_mib=1024))
    finally:
        await state.close()


@on_session_loop
async def test_unbinding_a_failed_create_frees_its_room(redis_url: str) -> None:
    state = ClusterState.from_url(redis_url, down_after=10.0)
    scheduler = ClusterScheduler(state)
    try:
        await scheduler.register(node("a", memory_mib=4 * GIB))
        await scheduler.place(Placement(sandbox_id="s1", memory_mib=1024))
        await scheduler.unbind("s1", "a")
        assert await room(state) == (4 * GIB, 0)
        with pytest.raises(NotFound):
            await scheduler.locate("s1")
        assert await state.redis.hlen("aenv:placing") == 0
    finally:
        await state.close()


@on_session_loop
async def test_a_create_whose_reservation_expired_is_the_nodes_to_reconcile(redis_url: str) -> None:
    state = ClusterState(
        Redis.from_url(redis_url, decode_responses=True), down_after=10.0, reservation_ttl=0.3
    )
    scheduler = ClusterScheduler(state)
    try:
        await scheduler.register(node("a"))
        await scheduler.place(Placement(sandbox_id="s1"))
        assert await scheduler.bindings("a") == []
        await asyncio.sleep(0.4)  # the gateway died mid-create: nobody will bind or unbind s1
        assert [b.sandbox_id for b in await scheduler.bindings("a")] == ["s1"]
        await scheduler.unbind("s1", "a")  # the node holds no such sandbox
        assert await scheduler.bindings() == []
    finally:
        await state.close()


@on_session_loop
async def test_a_resume_placement_binds_nothing(redis_url: str) -> None:
    state = ClusterState.from_url(redis_url, down_after=10.0)
    scheduler = ClusterScheduler(state)
    try:
        await scheduler.register(node("a"))
        await scheduler.bind(Binding(sandbox_id="s1", node_id="a", state="paused"))
        await scheduler.place(Placement(kind="resume", sandbox_id="s1"))
        assert (await scheduler.locate("s1"))[0].state == "paused"
    finally:
        await state.close()


def test_a_node_takes_the_id_a_gateway_chose_and_nothing_else() -> None:
    assert SANDBOX_ID.fullmatch(chosen_id(None))
    chosen = "i" + "7" * 20
    assert chosen_id(chosen) == chosen
    for bad in ("../etc", "I" + "a" * 20, "i" + "a" * 21, ""):
        with pytest.raises(InvalidRequest):
            chosen_id(bad)


@on_session_loop
async def test_a_node_that_names_its_own_sandbox_gets_that_one_bound() -> None:
    """A node of an older version ignores the id the gateway chose: its own is what is bound."""

    class OlderNode:
        async def create(self, request: CreateRequest) -> SandboxRecord:
            return record(sandbox_id="i" + "b" * 20, template_id=request.template)

    class Cluster(ClusterNode):
        def remote(self, info: NodeInfo) -> OlderNode:  # type: ignore[override]
            return OlderNode()

    scheduler = FakeScheduler()
    await scheduler.register(node_info("na", "http://na"))
    created = await Cluster(scheduler, None).create(CreateRequest(template="base"))  # type: ignore[arg-type]
    assert (
        set(scheduler.bound) == {created.sandbox_id} and scheduler.bound[created.sandbox_id].node_id == "na"
    )
