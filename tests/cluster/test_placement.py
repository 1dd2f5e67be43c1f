"""Placement and the shared state against a real Redis (no VMs): spread, room, draining and
down nodes, concurrent schedulers, reservations turned into bindings, restarts."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator

import pytest

from aenv.cluster.model import Binding, NodeCapacity, NodeInfo, NodeState, NodeUsage, Placement
from aenv.cluster.protocols import SandboxKilled
from aenv.cluster.scheduler import ClusterScheduler
from aenv.cluster.state import PLACE_SAMPLE, ClusterState
from aenv.orchestrator.errors import Conflict, InvalidRequest, NotFound, Unavailable

# The state fixture lives on the session's loop (the project's default fixture loop scope).
pytestmark = pytest.mark.asyncio(loop_scope="session")
GIB = 1024


def node(
    node_id: str, memory_mib: int = 16 * GIB, *, used_mib: int = 0, cached: list[str] | None = None
) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        address=f"http://{node_id}:8000",
        version="test",
        capacity=NodeCapacity(memory_mib=memory_mib, vcpus=8, disk_free_mib=10 * GIB),
        usage=NodeUsage(memory_mib=used_mib, running=used_mib // 512),
        cached=cached or [],
    )


@pytest.fixture
async def state(redis_url: str) -> AsyncIterator[ClusterState]:
    cluster = ClusterState.from_url(redis_url, down_after=10.0)
    yield cluster
    await cluster.close()


@pytest.fixture
def scheduler(state: ClusterState) -> ClusterScheduler:
    return ClusterScheduler(state)


async def place_many(scheduler: ClusterScheduler, count: int, **request: object) -> collections.Counter[str]:
    placed = collections.Counter[str]()
    for _ in range(count):
        placed[(await scheduler.place(Placement(**request))).node_id] += 1  # type: ignore[arg-type]
    return placed


async def test_twelve_placements_spread_over_three_nodes(scheduler: ClusterScheduler) -> None:
    for name in ("a", "b", "c"):
        await scheduler.register(node(name))
    assert await place_many(scheduler, 12, template="base") == {"a": 4, "b": 4, "c": 4}


async def test_many_nodes_placement_samples_them_and_still_finds_the_one_with_room(
    scheduler: ClusterScheduler,
) -> None:
    """Beyond `PLACE_SAMPLE` nodes a placement weighs a sample, and every node only when none of
    the sample has room: the one node of 60 with room is found each time, until it is full."""
    assert PLACE_SAMPLE < 60
    for i in range(59):
        await scheduler.register(node(f"full{i:02d}", memory_mib=GIB, used_mib=GIB))
    await scheduler.register(node("roomy", memory_mib=2 * GIB))
    assert await place_many(scheduler, 4, template="base") == {"roomy": 4}
    with pytest.raises(Unavailable, match="no node has room"):
        await scheduler.place(Placement())
    await scheduler.register(node("empty", memory_mib=GIB))
    assert await place_many(scheduler, 2) == {"empty": 2}


async def test_a_node_full_of_memory_gets_none(scheduler: ClusterScheduler) -> None:
    await scheduler.register(node("a"))
    await scheduler.register(node("b"))
    await scheduler.register(node("full", memory_mib=4 * GIB, used_mib=4 * GIB))
    placed = await place_many(scheduler, 12)
    assert placed == {"a": 6, "b": 6}


async def test_reservations_fill_a_node_then_unavailable(scheduler: ClusterScheduler) -> None:
    await scheduler.register(node("small", memory_mib=2 * GIB))
    assert await place_many(scheduler, 4, memory_mib=512) == {"small": 4}
    with pytest.raises(Unavailable, match="no node has room for 512 MiB"):
        await scheduler.place(Placement(memory_mib=512))


async def test_nodes_caching_the_template_come_first(
    scheduler: ClusterScheduler, state: ClusterState
) -> None:
    await scheduler.register(node("a"))
    await scheduler.register(node("b", cached=["snap1", "base"]))
    await scheduler.register(node("c"))
    assert await place_many(scheduler, 3, template="team/snap1:latest") == {"b": 3}
    assert await state.caching("snap1") == {"b"}
    await scheduler.heartbeat("b", NodeUsage(), node("b").capacity, ["base"])
    assert await state.caching("snap1") == set()


async def test_draining_down_and_excluded_nodes_get_none(redis_url: str) -> None:
    state = ClusterState.from_url(redis_url, down_after=0.5)
    scheduler = ClusterScheduler(state)
    try:
        for name in ("a", "b", "c", "d"):
            await scheduler.register(node(name))
        await asyncio.sleep(0.7)  # c stops heartbeating: it is down
        for name in ("a", "b", "d"):
            await scheduler.heartbeat(name, NodeUsage(), node(name).capacity, [])
        drained = await scheduler.drain("b")
        assert drained.status == NodeState.DRAINING
        statuses = {n.node_id: n.status for n in await scheduler.nodes()}
        assert statuses == {"a": "up", "b": "draining", "c": "down", "d": "up"}
        assert await place_many(scheduler, 4, exclude=["d"]) == {"a": 4}
        # A heartbeat does not undo a drain; a new registration (a restarted node) does.
        assert (await scheduler.heartbeat("b", NodeUsage(), node("b").capacity, [])).status == "draining"
        assert (await scheduler.register(node("b"))).status == "up"
    finally:
        await state.close()


async def test_two_schedulers_placing_concurrently_never_exceed_capacity(redis_url: str) -> None:
    states = [ClusterState.from_url(redis_url, down_after=10.0) for _ in range(2)]
    schedulers = [ClusterScheduler(s) for s in states]
    try:
        for name in ("a", "b", "c"):  # room for 10 sandboxes of 512 MiB each
            await schedulers[0].register(node(name, memory_mib=5 * GIB))

        async def attempt(index: int) -> str | None:
            try:
                return (await schedulers[index % 2].place(Placement(memory_mib=512))).node_id
            except Unavailable:
                return None

        results = await asyncio.gather(*(attempt(i) for i in range(45)))
        placed = collections.Counter(r for r in results if r is not None)
        assert sum(placed.values()) == 30
        assert placed == {"a": 10, "b": 10, "c": 10}
        assert all(room.memory_mib == 0 for room in await states[1].rooms())
    finally:
        for state in states:
            await state.close()


async def test_a_bind_turns_the_reservation_into_pending_room_until_the_heartbeat(
    scheduler: ClusterScheduler, state: ClusterState
) -> None:
    small = node("a", memory_mib=4 * GIB)
    await scheduler.register(small)
    await scheduler.place(Placement(memory_mib=1024))
    await scheduler.bind(Binding(sandbox_id="s1", node_id="a", template_id="base"))
    await scheduler.bind(Binding(sandbox_id="s1", node_id="a", template_id="base"))  # a repeat: no change
    (room,) = await state.rooms()
    assert (room.memory_mib, room.starting) == (3 * GIB, 1)
    await scheduler.heartbeat("a", NodeUsage(running=1, memory_mib=1024, vcpus=1), small.capacity, [])
    (room,) = await state.rooms()
    assert (room.memory_mib, room.starting) == (3 * GIB, 0)


async def test_an_observed_bind_changes_only_the_state(scheduler: ClusterScheduler) -> None:
    """A gateway's bind after an operation never overrides what the node reported of that state,
    and never says a pause is durable: only the node knows when its upload committed."""
    await scheduler.register(node("a"))
    durable = Binding(sandbox_id="s1", node_id="a", state="paused", durable=True)
    await scheduler.bind(durable)  # the node's report once its pause committed
    await scheduler.bind(durable.model_copy(update={"durable": False}), observed=True)  # the pause's, late
    assert (await scheduler.locate("s1"))[0] == durable
    await scheduler.bind(Binding(sandbox_id="s1", node_id="a"))  # resumed: the node's report, first
    await scheduler.bind(durable.model_copy(update={"state": "running"}), observed=True)  # stale copy
    await scheduler.bind(durable, observed=True)  # paused again, its upload under way
    assert (await scheduler.locate("s1"))[0] == Binding(sandbox_id="s1", node_id="a", state="paused")


async def test_a_late_bind_never_undoes_a_newer_one(scheduler: ClusterScheduler) -> None:
    """A node's report read before a pause, arriving after the gateway bound the pause (and the
    gateway's bind of a resume, arriving after the node reported a later pause) change nothing."""
    await scheduler.register(node("a"))
    await scheduler.register(node("b"))
    running = Binding(sandbox_id="s1", node_id="a", generation=1)
    await scheduler.bind(running)
    paused = Binding(sandbox_id="s1", node_id="a", state="paused", generation=2)
    await scheduler.bind(paused, observed=True)  # the gateway's, as the pause answered
    await scheduler.bind(running)  # the node's report, read before the pause
    assert (await scheduler.locate("s1"))[0] == paused
    durable = paused.model_copy(update={"durable": True, "generation": 3})
    await scheduler.bind(durable)  # the node's report once the pause committed
    await scheduler.bind(running.model_copy(update={"generation": 2}), observed=True)  # a stale resume's
    assert (await scheduler.locate("s1"))[0] == durable
    await scheduler.bind(Binding(sandbox_id="s1", node_id="a", generation=3))  # read while it resumes
    assert (await scheduler.locate("s1"))[0].state == "running"
    taken = Binding(sandbox_id="s1", node_id="b", generation=1)  # generations count per node
    await scheduler.bind(taken)
    assert (await scheduler.locate("s1"))[0] == taken


async def test_bindings_locate_and_guarded_unbind(scheduler: ClusterScheduler) -> None:
    await scheduler.register(node("a"))
    await scheduler.register(node("b"))
    await scheduler.bind(Binding(sandbox_id="s1", node_id="a"))
    await scheduler.bind(Binding(sandbox_id="s2", node_id="b", state="paused"))
    binding, where = await scheduler.locate("s1")
    assert (binding.node_id, where.node_id, where.address) == ("a", "a", "http://a:8000")
    assert [b.sandbox_id for b in await scheduler.bindings("b")] == ["s2"]
    assert [b.sandbox_id for b in await scheduler.bindings()] == ["s1", "s2"]
    # s1 moves to b; a late unbind from a must not remove it, nor a late "paused" from a.
    await scheduler.bind(Binding(sandbox_id="s1", node_id="b"))
    await scheduler.unbind("s1", "a")
    with pytest.raises(Conflict, match="is on node b"):
        await scheduler.bind(Binding(sandbox_id="s1", node_id="a", state="paused"))
    # Nor once it is paused over there: a (restarted) node's stale pause never takes it back.
    await scheduler.bind(Binding(sandbox_id="s1", node_id="b", state="paused", durable=True))
    with pytest.raises(Conflict, match="is on node b"):
        await scheduler.bind(Binding(sandbox_id="s1", node_id="a", state="paused", durable=True))
    assert (await scheduler.locate("s1"))[0].node_id == "b"
    assert await scheduler.bindings("a") == []
    await scheduler.unbind("s1", "b")
    with pytest.raises(NotFound):
        await scheduler.locate("s1")
    with pytest.raises(NotFound, match="node ghost is not registered"):
        await scheduler.bind(Binding(sandbox_id="s3", node_id="ghost"))


async def test_resume_placement(scheduler: ClusterScheduler) -> None:
    for name in ("a", "b"):
        await scheduler.register(node(name))
    await scheduler.bind(Binding(sandbox_id="local", node_id="a", state="paused"))
    await scheduler.bind(Binding(sandbox_id="durable", node_id="b", state="paused", durable=True))
    for _ in range(3):  # the holding node, although it is the busier one
        assert (await scheduler.place(Placement(kind="resume", sandbox_id="local"))).node_id == "a"
    assert (await scheduler.place(Placement(kind="resume", sandbox_id="durable"))).node_id == "b"
    moved = await scheduler.place(Placement(kind="resume", sandbox_id="durable", exclude=["b"]))
    assert moved.node_id == "a"
    await scheduler.drain("a")
    assert (await scheduler.place(Placement(kind="resume", sandbox_id="local"))).node_id == "a"
    with pytest.raises(Unavailable, match="can only resume on node a"):
        await scheduler.place(Placement(kind="resume", sandbox_id="local", exclude=["a"]))
    with pytest.raises(NotFound):
        await scheduler.place(Placement(kind="resume", sandbox_id="nobody"))
    with pytest.raises(InvalidRequest):
        await scheduler.place(Placement(kind="resume"))


async def test_a_resume_placement_released_frees_its_room(scheduler: ClusterScheduler) -> None:
    """A take-over that failed gives back the room its placement reserved (a create's goes with
    its unbind): else each failed attempt would hold it for a minute."""
    await scheduler.register(node("small", memory_mib=1024))
    await scheduler.register(node("home"))
    await scheduler.bind(Binding(sandbox_id="s1", node_id="home", state="paused", durable=True))
    resume = Placement(kind="resume", sandbox_id="s1", exclude=["home"])
    assert (await scheduler.place(resume)).node_id == "small"
    assert (await scheduler.place(resume)).node_id == "small"  # the same sandbox: room held once
    await scheduler.place(Placement(memory_mib=512, exclude=["home"]))
    with pytest.raises(Unavailable):
        await scheduler.place(Placement(memory_mib=512, exclude=["home"]))
    await scheduler.release(resume, "small")
    assert (await scheduler.place(Placement(memory_mib=512, exclude=["home"]))).node_id == "small"
    with pytest.raises(InvalidRequest):
        await scheduler.release(Placement(sandbox_id="s1"), "small")


async def test_state_survives_a_scheduler_restart_and_heartbeats_after_a_flush_say_register(
    redis_url: str,
) -> None:
    first = ClusterState.from_url(redis_url, down_after=10.0)
    await ClusterScheduler(first).register(node("a"))
    await ClusterScheduler(first).bind(Binding(sandbox_id="s1", node_id="a"))
    await first.close()
    second = ClusterState.from_url(redis_url, down_after=10.0)
    scheduler = ClusterScheduler(second)
    try:
        assert [n.node_id for n in await scheduler.nodes()] == ["a"]
        assert (await scheduler.locate("s1"))[1].node_id == "a"
        await second.redis.flushall()
        with pytest.raises(NotFound):
            await scheduler.heartbeat("a", NodeUsage(), node("a").capacity, [])
    finally:
        await second.close()


async def test_a_sandbox_killed_while_its_node_is_away_is_never_bound_again(
    scheduler: ClusterScheduler, state: ClusterState
) -> None:
    for name in ("a", "b"):
        await scheduler.register(node(name))
    await scheduler.bind(Binding(sandbox_id="lost", node_id="a"))
    await scheduler.bind(Binding(sandbox_id="paused", node_id="a", state="paused", durable=True))
    with pytest.raises(Conflict, match="is on node a"):  # the kill goes where it is bound
        await scheduler.tombstone("lost", "b")
    assert (await scheduler.tombstone("lost", "a")).node_id == "a"
    assert (await scheduler.tombstone("paused", "a")).durable
    assert await scheduler.bindings() == [] and await scheduler.bindings("a") == []
    with pytest.raises(NotFound):
        await scheduler.locate("lost")
    with pytest.raises(NotFound):  # no take-over of a killed durable pause
        await scheduler.place(Placement(kind="resume", sandbox_id="paused", exclude=["a"]))
    with pytest.raises(NotFound):  # killed twice: the second finds nothing
        await scheduler.tombstone("lost", "a")
    # Neither its node's report when it is back nor a take-over's late bind brings it back.
    for binding in [Binding(sandbox_id="lost", node_id="a"), Binding(sandbox_id="paused", node_id="a",
                    state="paused", durable=True), Binding(sandbox_id="paused", node_id="b")]:  # fmt: skip
        with pytest.raises(SandboxKilled, match="was killed"):
            await scheduler.bind(binding)
    with pytest.raises(Conflict):  # nor does a create reuse its id
        await scheduler.place(Placement(sandbox_id="lost"))
    assert await scheduler.bindings() == []
    ttl = await state.redis.pttl("aenv:tombstone:lost")  # kept a long time, not forever
    assert 0 < ttl <= state.tombstone_ttl * 1000


async def test_a_tombstone_takes_the_reservation_of_a_create_under_way(
    scheduler: ClusterScheduler, state: ClusterState
) -> None:
    await scheduler.register(node("a", memory_mib=4 * GIB))
    await scheduler.place(Placement(sandbox_id="s1", memory_mib=1024))
    await scheduler.tombstone("s1", "a")
    (room,) = await state.rooms()
    assert (room.memory_mib, room.starting) == (4 * GIB, 0)
