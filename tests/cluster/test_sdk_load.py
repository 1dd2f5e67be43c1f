"""The E2B SDK at load, as an RL backend drives it: 256 sandboxes at once through a gateway over two
real nodes, each created, given commands, a file written and read back, and killed, all with the
official `e2b` SDK's `AsyncSandbox` on one asyncio loop.

Every call must answer correctly; an overloaded node or gateway may only answer E2B's 429 (with
Retry-After), which the SDK's own retry absorbs; never a 5xx. Afterwards neither node holds any
QEMU, network namespace, nftables rule, cgroup or sandbox directory of those sandboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from e2b import AsyncSandbox

from aenv import devcluster
from aenv.devcluster import ClusterProcess, RedisServer
from aenv.devnode import DevNode
from bench.soak import footprint
from tests.e2e.conftest import wait_until

pytestmark = pytest.mark.vm

SANDBOXES = 256
NODES = 2
SLOT_FIRST = 1024  # this module's range: 1024..2047, 512 slots a node
SLOT_COUNT = 512
# No warm pool: it would serve 8 of 256 creates, and the VMs it refills at its own pace would
# make what the nodes hold afterwards differ from before without any leak.
WARM_POOL = 0
LEAKS = ("qemu", "namespaces", "nft_rules", "cgroups")
REQUEST_TIMEOUT = 240.0  # seconds an SDK call may take: the last of 256 creates waits for the rest
WAIT = {"request_timeout": REQUEST_TIMEOUT, "timeout": REQUEST_TIMEOUT}  # a command's own bound too


@dataclass
class LoadCluster:
    gateway: ClusterProcess
    nodes: list[DevNode]
    key: str


@pytest.fixture(scope="module")
def load_cluster(
    tmp_path_factory: pytest.TempPathFactory, template_seed: Path, redis_session: RedisServer
) -> Iterator[LoadCluster]:
    """Redis, a scheduler, a gateway and two nodes seeded with `base`, each with room for half."""
    redis_session.flush()
    root = tmp_path_factory.mktemp("aenv-sdk-load")
    secret, key = secrets.token_hex(16), "e2b_" + secrets.token_hex(20)
    scheduler = devcluster.scheduler(redis_session.url, root / "scheduler.log", secret)
    entrance = devcluster.gateway(scheduler.url, root / "gateway.log", secret, key)
    nodes = [
        _node(root / f"node{i}", SLOT_FIRST + i * SLOT_COUNT, template_seed, scheduler.url, secret)
        for i in range(NODES)
    ]
    forced: dict[str, list[str]] = {}
    try:
        scheduler.start()
        for node in nodes:
            node.start()
        entrance.start()
        wait_until(lambda: len(_nodes(entrance, key)) == NODES, 60, what="the nodes to join")
        yield LoadCluster(entrance, nodes, key)
    finally:
        entrance.stop()
        forced = {node.home.name: node.cleanup() for node in nodes}
        scheduler.stop()
        print(f"\nload cluster logs in {root}; cleaned up by force: {forced}", file=sys.stderr)
    assert not [f for found in forced.values() for f in found], forced


def _node(home: Path, slot_first: int, seed: Path, scheduler_url: str, secret: str) -> DevNode:
    return DevNode(
        home, slot_first=slot_first, slot_count=SLOT_COUNT, seed=seed, warm_pool_size=WARM_POOL,
        shutdown_action="kill", evict_interval=1, scheduler_url=scheduler_url, cluster_secret=secret,
        heartbeat_interval=0.5,
    )  # fmt: skip


def _nodes(entrance: ClusterProcess, key: str) -> list[dict]:
    nodes = httpx.get(f"{entrance.url}/nodes", headers={"X-API-Key": key}).raise_for_status().json()
    return [n for n in nodes if n.get("status", "up") == "up"]


def held(cluster: LoadCluster) -> dict[str, int]:
    """What the nodes hold on the host that a leaked sandbox would grow."""
    counts = [footprint(node.home, node.pid) for node in cluster.nodes if node.pid is not None]
    sandbox_dirs = sum(len(list((node.home / "sandboxes").glob("*"))) for node in cluster.nodes)
    return {"qemu": sum(int(c["qemu"]) for c in counts), "sandbox_dirs": sandbox_dirs} | {
        name: int(counts[0][name]) for name in LEAKS[1:]
    }


def answered(cluster: LoadCluster) -> Counter[str]:
    """Statuses the gateway and nodes answered so far, by `<process> <status>`."""
    seen: Counter[str] = Counter()
    pattern = re.compile(r'^aenv_http_requests_total\{[^}]*status="(\d+)"[^}]*\} ([0-9.e+]+)$', re.M)
    targets = {"gateway": cluster.gateway.url} | {n.home.name: n.url for n in cluster.nodes}
    for name, url in targets.items():
        text = httpx.get(f"{url}/metrics", headers={"X-API-Key": cluster.key}).raise_for_status().text
        for status, count in pattern.findall(text):
            seen[f"{name} {status}"] += int(float(count))
    return seen


def host_used_mib() -> int:
    """Host RAM in use (MemTotal less MemAvailable), in MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(fields["MemTotal"].split()[0]) - int(fields["MemAvailable"].split()[0])) // 1024


async def work(sandbox: AsyncSandbox, index: int) -> None:
    """What one RL episode does in its sandbox: run, write, read back."""
    result = await sandbox.commands.run(f"echo $(({index} * 7)) && whoami", **WAIT)
    assert result.stdout == f"{index * 7}\nuser\n", result
    body = f"rollout {index} " * 64
    await sandbox.files.write(f"/home/user/r{index}.txt", body, request_timeout=REQUEST_TIMEOUT)
    assert await sandbox.files.read(f"/home/user/r{index}.txt", request_timeout=REQUEST_TIMEOUT) == body


@dataclass
class Run:
    seconds: dict[str, float]
    used_mib: dict[str, int]  # host RAM in use with every sandbox running: created, and worked in
    failures: list[tuple[str, int, str]]


async def drive(count: int, tag: str) -> Run:
    """All `count` created at once, then all worked in at once (so that all run together), then all
    killed at once, as a rollout step of an RL trainer would."""
    seconds: dict[str, float] = {}
    started = time.monotonic()
    created = await asyncio.gather(
        *(
            AsyncSandbox.create("base", timeout=600, metadata={"load": tag}, request_timeout=REQUEST_TIMEOUT)
            for _ in range(count)
        ),
        return_exceptions=True,
    )
    seconds["create"] = time.monotonic() - started
    used = {"created": host_used_mib()}
    live = [(i, s) for i, s in enumerate(created) if isinstance(s, AsyncSandbox)]
    failures = [("create", i, repr(s)) for i, s in enumerate(created) if not isinstance(s, AsyncSandbox)]
    phase = time.monotonic()
    worked = await asyncio.gather(*(work(s, i) for i, s in live), return_exceptions=True)
    seconds["work"] = time.monotonic() - phase
    used["worked"] = host_used_mib()
    failures += [("work", i, repr(r)) for (i, _), r in zip(live, worked, strict=True) if r is not None]
    phase = time.monotonic()
    killed = await asyncio.gather(
        *(s.kill(request_timeout=REQUEST_TIMEOUT) for _, s in live), return_exceptions=True
    )
    seconds["kill"] = time.monotonic() - phase
    seconds["total"] = time.monotonic() - started
    failures += [("kill", i, repr(r)) for (i, _), r in zip(live, killed, strict=True) if r is not True]
    return Run(seconds, used, failures)


def test_256_sandboxes_through_a_gateway(load_cluster: LoadCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("E2B_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("E2B_API_URL", load_cluster.gateway.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", load_cluster.gateway.url)
    monkeypatch.setenv("E2B_API_KEY", load_cluster.key)
    before, used_before = held(load_cluster), host_used_mib()
    statuses_before = answered(load_cluster)
    tag = secrets.token_hex(6)
    run = asyncio.run(drive(SANDBOXES, tag))
    statuses = answered(load_cluster) - statuses_before
    per_sandbox = {phase: round((mib - used_before) / SANDBOXES, 1) for phase, mib in run.used_mib.items()}
    print(
        f"\n{SANDBOXES} sandboxes: {run.seconds} s; host RAM per sandbox (MiB) {per_sandbox}; "
        f"answers: {dict(statuses)}",
        file=sys.stderr,
    )
    kinds = Counter(f"{phase}: {why[:160]}" for phase, _, why in run.failures)
    assert not run.failures, kinds
    assert not [s for s in statuses if int(s.split()[1]) >= 500], statuses
    with httpx.Client(base_url=load_cluster.gateway.url, headers={"X-API-Key": load_cluster.key}) as api:
        left = api.get("/v2/sandboxes", params={"metadata": f"load={tag}"}).raise_for_status().json()
    assert left == []
    with contextlib.suppress(AssertionError):
        wait_until(lambda: held(load_cluster) == before, 60, 1, what="nothing left behind")
    assert held(load_cluster) == before
