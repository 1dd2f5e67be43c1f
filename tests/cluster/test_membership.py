"""A node's membership against a real scheduler and Redis, with a fake node (no VMs): joining,
heartbeats, bindings that follow the node's sandboxes, rejoining after Redis lost everything,
healing a missed event, a scheduler that is unreachable for a while, and sandboxes killed while
the node was away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp.test_utils import TestServer

from aenv.cluster.client import SchedulerClient
from aenv.cluster.membership import RECONCILE_EVERY, Membership, NodeReport
from aenv.cluster.model import Binding, NodeState, NodeUsage
from aenv.cluster.scheduler import ClusterScheduler, scheduler_app
from aenv.cluster.state import ClusterState
from aenv.devnode import free_port

from .test_placement import node

pytestmark = pytest.mark.asyncio(loop_scope="session")
INTERVAL = 0.05


class FakeNode:
    """A `NodeSource` whose sandboxes the test sets: id -> running or paused."""

    def __init__(self) -> None:
        self.sandboxes: dict[str, str] = {}
        self.taken_over: set[str] = set()  # paused here, taken over by another node meanwhile
        self.killed: list[str] = []

    def report(self) -> NodeReport:
        running = sum(state == "running" for state in self.sandboxes.values())
        return NodeReport(
            usage=NodeUsage(running=running, paused=len(self.sandboxes) - running, memory_mib=512 * running),
            capacity=node("n1").capacity,
            bindings={
                sandbox_id: Binding(sandbox_id=sandbox_id, node_id="n1", state=state)  # type: ignore[arg-type]
                for sandbox_id, state in self.sandboxes.items()
            },
        )

    def cached(self) -> list[str]:
        return ["base"]

    async def forget_moved(self) -> None:
        for sandbox_id in self.taken_over:
            self.sandboxes.pop(sandbox_id, None)

    async def kill(self, sandbox_id: str) -> None:
        del self.sandboxes[sandbox_id]
        self.killed.append(sandbox_id)


async def eventually(check: Callable[[], Awaitable[bool]]) -> None:
    """Wait until `check()` holds (the membership works in the background)."""
    for _ in range(400):
        if await check():
            return
        await asyncio.sleep(INTERVAL)
    raise AssertionError("the condition never held")


@pytest.fixture
async def scheduler(redis_url: str) -> AsyncIterator[ClusterScheduler]:
    state = ClusterState.from_url(redis_url, down_after=10.0)
    yield ClusterScheduler(state)
    await state.close()


async def bound(scheduler: ClusterScheduler) -> dict[str, str]:
    return {b.sandbox_id: b.state for b in await scheduler.bindings("n1")}


async def test_the_node_joins_heartbeats_and_keeps_its_bindings_true(
    scheduler: ClusterScheduler, redis_url: str
) -> None:
    fake = FakeNode()
    fake.sandboxes = {"s1": "running", "s2": "paused"}
    membership = Membership(scheduler, fake, "n1", "http://n1:8000", interval=INTERVAL)
    await membership.start()
    try:
        await eventually(lambda: _equals(bound(scheduler), {"s1": "running", "s2": "paused"}))
        listed = await scheduler.node("n1")
        assert (listed.address, listed.cached, listed.usage.running) == ("http://n1:8000", ["base"], 1)
        fake.sandboxes = {"s1": "paused", "s3": "running"}
        membership.changed("s1")
        await eventually(lambda: _equals(bound(scheduler), {"s1": "paused", "s3": "running"}))

        await scheduler.unbind("s3", "n1")  # an event the scheduler missed: the reconcile heals it
        await eventually(lambda: _equals(bound(scheduler), {"s1": "paused", "s3": "running"}))
        assert membership._beats >= RECONCILE_EVERY

        await scheduler.state.redis.flushall()  # Redis lost everything: the node joins again
        await eventually(lambda: _equals(bound(scheduler), {"s1": "paused", "s3": "running"}))
        assert [n.node_id for n in await scheduler.nodes()] == ["n1"]

        await scheduler.drain("n1")
        await eventually(lambda: _true(membership.status == NodeState.DRAINING))
    finally:
        await membership.close()


async def test_a_restarted_node_does_not_bind_what_was_taken_over_meanwhile(
    scheduler: ClusterScheduler,
) -> None:
    """s2 was taken over by another node while this one was down, and has ended there since
    (no binding left): this node's stale pause of it must not bring it back."""
    fake = FakeNode()
    fake.sandboxes = {"s1": "paused", "s2": "paused"}
    fake.taken_over = {"s2"}
    membership = Membership(scheduler, fake, "n1", "http://n1:8000", interval=INTERVAL)
    await membership.start()
    try:
        await eventually(lambda: _equals(bound(scheduler), {"s1": "paused"}))
        assert "s2" not in {b.sandbox_id for b in await scheduler.bindings()}
    finally:
        await membership.close()


async def test_sandboxes_killed_while_the_node_was_away_are_killed_when_it_is_back(
    scheduler: ClusterScheduler,
) -> None:
    """Killed through a gateway while the node was down (a restart), or cut off from the
    scheduler (its bindings sent before): the node kills them, and never binds them again."""
    fake = FakeNode()
    fake.sandboxes = {"lost": "running", "paused": "paused", "kept": "paused", "cut": "running"}
    first = Membership(scheduler, fake, "n1", "http://n1:8000", interval=INTERVAL)
    await first.start()
    await eventually(lambda: _equals(bound(scheduler), dict(fake.sandboxes)))
    await first.close()
    for sandbox_id in ("lost", "paused"):
        await scheduler.tombstone(sandbox_id, "n1")
    again = Membership(scheduler, fake, "n1", "http://n1:8000", interval=INTERVAL)
    await again.start()
    try:
        await eventually(lambda: _true(sorted(fake.killed) == ["lost", "paused"]))
        await scheduler.tombstone("cut", "n1")
        await eventually(lambda: _true("cut" in fake.killed))
        assert await bound(scheduler) == {"kept": "paused"} and fake.sandboxes == {"kept": "paused"}
    finally:
        await again.close()


async def test_close_ends_the_loop_when_a_change_wakes_it_at_the_same_moment(
    scheduler: ClusterScheduler,
) -> None:
    """A shutdown kills the node's sandboxes (each wakes the loop) just before it closes the
    membership: the wake-up must not swallow the cancellation (as 3.11's `wait_for` does)."""
    fake = FakeNode()
    fake.sandboxes = {"s1": "running"}
    membership = Membership(scheduler, fake, "n1", "http://n1:8000", interval=60.0)
    await membership.start()
    await eventually(lambda: _equals(bound(scheduler), {"s1": "running"}))
    await asyncio.sleep(INTERVAL)  # the loop waits for a change or its next heartbeat
    fake.sandboxes = {}
    membership.changed("s1")
    closing = asyncio.ensure_future(membership.close())
    done, _ = await asyncio.wait({closing}, timeout=10)
    if not done:  # the loop went on: end it for good, then fail
        assert membership._task is not None
        membership._task.print_stack()
        print(membership._task, membership._task.cancelling())
        membership._task.cancel()
        await closing
    assert done, "close() waited for a loop that ignored its cancellation"
    assert await bound(scheduler) == {}  # the last report went out all the same


async def test_an_unreachable_scheduler_is_retried(redis_url: str) -> None:
    port = free_port()
    fake = FakeNode()
    fake.sandboxes = {"s1": "running"}
    client = SchedulerClient(f"http://127.0.0.1:{port}")
    membership = Membership(client, fake, "n1", "http://n1:8000", interval=INTERVAL)
    await membership.start()
    state = ClusterState.from_url(redis_url, down_after=10.0)
    server = TestServer(scheduler_app(ClusterScheduler(state), None), host="127.0.0.1", port=port)
    try:
        await asyncio.sleep(3 * INTERVAL)
        assert membership.status is None  # it kept trying, nothing else
        await server.start_server()
        await eventually(lambda: _equals(bound(ClusterScheduler(state)), {"s1": "running"}))
    finally:
        await membership.close()
        await server.close()
        await state.close()


async def _equals(value: Awaitable[object], expected: object) -> bool:
    return await value == expected


async def _true(value: bool) -> bool:
    return value
