"""Fan-out's bookkeeping with a fake service: per-sandbox outcomes, order, and idempotent retries."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from aenv.cluster import wire
from aenv.orchestrator import fanout
from aenv.orchestrator.errors import Conflict, InvalidRequest, NotFound, Unavailable
from aenv.orchestrator.ids import SANDBOX_ID
from aenv.orchestrator.interface import CreateRequest, FanOutRequest, FanOutResult
from aenv.orchestrator.store import SandboxRecord

from .conftest import record as make_record


class FakeNode:
    """Creates records; refuses every third create as a full node would."""

    def __init__(self) -> None:
        self.records: dict[str, SandboxRecord] = {}
        self.creates = 0

    async def create(self, request: CreateRequest) -> SandboxRecord:
        self.creates += 1
        assert request.sandbox_id is not None
        if request.sandbox_id in self.records:
            raise Conflict("exists already")
        if self.creates % 3 == 0:
            raise Unavailable("the node is full")
        record = make_record(sandbox_id=request.sandbox_id)
        self.records[request.sandbox_id] = record
        return record

    async def get(self, sandbox_id: str) -> SandboxRecord:
        if sandbox_id not in self.records:
            raise NotFound(sandbox_id)
        return self.records[sandbox_id]


def run(node: FakeNode, count: int, key: str | None = None) -> list[FanOutResult]:
    request = FanOutRequest(
        create=CreateRequest(template="base", metadata={"a": "b"}), count=count, idempotency_key=key
    )
    return asyncio.run(fanout.fan_out(request, node.create, node.get))


def test_each_sandbox_succeeds_or_fails_alone() -> None:
    results = run(FakeNode(), 9)
    failed = [r for r in results if r.error is not None]
    assert len(failed) == 3 and all(r.error.kind == "Unavailable" for r in failed)
    assert all(SANDBOX_ID.fullmatch(r.sandbox.sandbox_id) for r in results if r.sandbox is not None)


def test_a_retry_with_the_key_makes_only_what_is_missing() -> None:
    node = FakeNode()
    first = run(node, 6, key="step-1")
    made = {r.sandbox.sandbox_id for r in first if r.sandbox is not None}
    again = run(node, 6, key="step-1")
    assert {r.sandbox.sandbox_id for r in again if r.sandbox is not None} >= made
    assert [fanout.member_id("step-1", i) for i in range(6)] == [
        (r.sandbox.sandbox_id if r.sandbox else fanout.member_id("step-1", i)) for i, r in enumerate(again)
    ]
    assert len(node.records) == sum(r.sandbox is not None for r in again)
    assert fanout.member_id("step-1", 0) != fanout.member_id("step-2", 0)


def test_count_is_bounded() -> None:
    with pytest.raises(InvalidRequest):
        run(FakeNode(), fanout.MAX_FAN_OUT + 1)


def test_the_call_travels_to_a_node_whole() -> None:
    request = FanOutRequest(
        create=CreateRequest(template="base", env_vars={"K": "V"}), count=3, idempotency_key="k"
    )
    arguments = wire.decode_arguments("fan_out", wire.encode_arguments("fan_out", {"request": request}))
    assert arguments["request"] == request
    result = [FanOutResult(error=fanout.failure(Unavailable("full")).error)]
    assert wire.decode_answer("fan_out", wire.encode_answer("fan_out", result)) == result
    assert replace(request, count=1).count == 1
