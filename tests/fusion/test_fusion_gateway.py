"""SandboxFusion's API through a gateway: a one-node cluster (Redis, `aenv scheduler`, `aenv gateway`
with `AENV_FUSION_TOKEN`, a real node), driven by the `sandbox-fusion` client at the gateway's URL."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sandbox_fusion import RunCodeRequest, RunStatus, run_code

from aenv.devcluster import ClusterProcess, gateway, redis_server, scheduler_process
from aenv.devnode import DevNode

pytestmark = pytest.mark.vm

SLOT_FIRST = 10304  # after tests/fusion/test_fusion.py's node, apart from every other node the suite starts
TOKEN = secrets.token_urlsafe(24)
JOIN_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory, template_seed: Path) -> Iterator[ClusterProcess]:
    """The gateway of a one-node cluster, its node joined."""
    workdir = tmp_path_factory.mktemp("aenv-fusion-cluster")
    secret = secrets.token_hex(16)
    with (
        redis_server(workdir / "redis") as redis,
        scheduler_process(redis.url, workdir / "scheduler.log", secret) as scheduler_url,
    ):
        node = DevNode(
            workdir / "home", slot_first=SLOT_FIRST, slot_count=64, seed=template_seed, warm_pool_size=1,
            scheduler_url=scheduler_url, cluster_secret=secret, heartbeat_interval=0.5,
        )  # fmt: skip
        entrance = gateway(scheduler_url, workdir / "gateway.log", secret, "e2b_" + secrets.token_hex(20))
        entrance.env["AENV_FUSION_TOKEN"] = TOKEN
        with node, entrance:
            deadline = time.monotonic() + JOIN_TIMEOUT
            while not httpx.get(f"{entrance.url}/nodes", headers={"X-API-Key": entrance.key}).json():
                assert time.monotonic() < deadline, "the node did not join"
                time.sleep(0.5)
            yield entrance


def test_run_code_through_a_gateway(front: ClusterProcess) -> None:
    answer = run_code(
        RunCodeRequest(code="print(input()[::-1])", language="python", stdin="lewer\n"),
        endpoint=f"{front.url}/fusion/{TOKEN}",
        max_attempts=1,
    )
    assert answer.status == RunStatus.Success, answer
    assert answer.run_result.stdout == "rewel\n"
    wrong = httpx.post(f"{front.url}/fusion/{TOKEN[:-1]}/run_code", json={"code": "1", "language": "python"})
    assert wrong.status_code == 404
    assert TOKEN not in front.log_path.read_text()
