"""The node's start gate (`aenv.orchestrator.starts`): bounded starts at once, waits in order, and
E2B's 429 with a Retry-After once the wait would be too long."""

from __future__ import annotations

import asyncio

import pytest

from aenv.api.status import STATUS
from aenv.orchestrator.errors import Overloaded
from aenv.orchestrator.starts import MAX_RETRY_AFTER, MAX_WAIT, StartGate


async def test_at_most_concurrency_starts_run_and_the_rest_wait_in_order() -> None:
    gate, peak, order = StartGate(concurrency=2), 0, []

    async def start(i: int) -> None:
        nonlocal peak
        gate.check("create a sandbox")
        async with gate.turn():
            peak = max(peak, gate.running)
            order.append(i)
            await asyncio.sleep(0.01)

    await asyncio.gather(*(start(i) for i in range(6)))
    assert peak == 2 and order == list(range(6))
    assert gate.running == gate.waiting == 0 and 0 < gate.estimate < 1


async def test_a_wait_beyond_the_bound_is_refused_with_429_and_retry_after() -> None:
    gate = StartGate(concurrency=1)
    gate.estimate = 10.0  # seconds a start takes, as measured
    held = asyncio.Event()

    async def slow() -> None:
        async with gate.turn():
            await held.wait()

    tasks = [asyncio.create_task(slow()) for _ in range(int(MAX_WAIT // 10))]
    await asyncio.sleep(0)
    gate.check("create a sandbox")  # the last that still fits: 40 s of waiting ahead
    tasks.append(asyncio.create_task(slow()))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="waiting") as refused:
        gate.check("create a sandbox")
    assert STATUS[type(refused.value)] == 429
    assert 1 <= refused.value.retry_after <= MAX_RETRY_AFTER
    held.set()
    await asyncio.gather(*tasks)
    gate.check("create a sandbox")
