"""No room right now answers E2B's 429 with Retry-After, and the official `e2b` SDK's own retry
absorbs it: a gateway over in-memory nodes (tests/cluster/test_gateway.py's), no VM. The same
answer from a real node's admission is in tests/orchestrator/test_admission.py; under real load
in tests/cluster/test_sdk_load.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from e2b import AsyncSandbox, RateLimitException

from tests.cluster.test_gateway import KEY, Cluster, cluster

pytestmark = pytest.mark.asyncio(loop_scope="session")
__all__ = ["cluster"]  # the fixture these tests take


async def test_full_nodes_answer_429_with_retry_after(cluster: Cluster) -> None:
    for node in cluster.nodes.values():
        node.full = True
    refused = await cluster.gateway.post("/sandboxes", json={"templateID": "base1"})
    assert refused.status_code == 429, refused.text
    assert refused.headers["Retry-After"] == "1"
    assert refused.json()["code"] == 429 and "is full" in refused.json()["message"]
    cluster.scheduler.infos.clear()  # no node at all has room: the scheduler's own refusal
    refused = await cluster.gateway.post("/sandboxes", json={"templateID": "base1"})
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1", refused.text


async def test_the_e2b_sdk_retries_a_429_on_its_own(cluster: Cluster) -> None:
    url = str(cluster.gateway.base_url).rstrip("/")
    for node in cluster.nodes.values():
        node.full = True
    started = time.monotonic()
    with pytest.raises(RateLimitException):
        await AsyncSandbox.create("base1", api_key=KEY, api_url=url, retries=2)
    assert time.monotonic() - started >= 2  # it waited Retry-After twice before giving up

    async def room_frees() -> None:
        await asyncio.sleep(0.5)
        cluster.nodes["na"].full = False

    freed = asyncio.create_task(room_frees())
    sandbox = await AsyncSandbox.create("base1", api_key=KEY, api_url=url)  # its default: 3 retries
    await freed
    assert sandbox.sandbox_id in cluster.nodes["na"].sandboxes
