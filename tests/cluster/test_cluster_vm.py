"""A real cluster on this machine: Redis, `aenv scheduler`, two `aenv gateway`s and two nodes
(`aenv.devnode.DevNode`, seeded with the session's `base`), driven through a gateway by the
official SDKs (Python sync and async, npm), then broken: a gateway killed mid-stream, a node
killed with sandboxes on it.

Module-scoped: the processes start once; the tests run in order and the last ones break things.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from aenv.cluster.auth import CLUSTER_SECRET_HEADER
from aenv.devcluster import ClusterProcess, RedisServer, gateway, scheduler_process
from aenv.devnode import DevNode
from tests.e2e.conftest import wait_until
from tests.e2e.test_js_sdk import SCRIPT, installed_sdk, run_script

pytestmark = pytest.mark.vm

# Network slots of this module's nodes: apart from every other node the suite starts.
SLOT_FIRST = 14848
SLOT_COUNT = 128
HEARTBEAT = 0.5  # seconds between a node's heartbeats
DOWN_AFTER = 4.0  # seconds of silence before the scheduler has a node down


@dataclass
class Cluster:
    gateways: list[ClusterProcess]
    nodes: dict[str, DevNode]  # by node id
    key: str
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    crashed: list[DevNode] = field(default_factory=list)  # killed by a test: their VMs outlive them

    def api(self, gateway: int = 0) -> httpx.Client:
        return httpx.Client(base_url=self.gateways[gateway].url, headers={"X-API-Key": self.key}, timeout=120)

    def node_of(self, sandbox_id: str, gateway: int = 0) -> str:
        with self.api(gateway) as api:
            return api.get(f"/sandboxes/{sandbox_id}").raise_for_status().json()["clientID"]

    @contextlib.contextmanager
    def sdk(self, gateway: int = 0) -> Iterator[None]:
        """The E2B SDKs' environment pointing at one gateway."""
        with pytest.MonkeyPatch.context() as mp:
            for name in [n for n in os.environ if n.startswith("E2B_")]:
                mp.delenv(name)
            mp.setenv("E2B_API_URL", self.gateways[gateway].url)
            mp.setenv("E2B_SANDBOX_URL", self.gateways[gateway].url)
            mp.setenv("E2B_API_KEY", self.key)
            yield


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, template_seed: Path, redis_session: RedisServer
) -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.fail("the cluster tests start nodes, which need root (network namespaces)")
    redis_session.flush()
    root = tmp_path_factory.mktemp("aenv-cluster")
    secret, key = secrets.token_hex(16), "e2b_" + secrets.token_hex(20)
    with contextlib.ExitStack() as stack:
        scheduler = stack.enter_context(
            scheduler_process(redis_session.url, root / "scheduler.log", secret, node_down_after=DOWN_AFTER)
        )
        gateways = [gateway(scheduler, root / f"gateway{i}.log", secret, key) for i in range(2)]
        nodes = [
            DevNode(
                root / f"node{i}",
                slot_first=SLOT_FIRST + i * SLOT_COUNT,
                slot_count=SLOT_COUNT,
                seed=template_seed,
                warm_pool_size=1,
                evict_interval=1,
                shutdown_action="kill",  # what a test leaves running is not paused at teardown
                max_fork_count=4,  # fewer idle networks to make (and to clean up after the crash)
                scheduler_url=scheduler,
                cluster_secret=secret,
                heartbeat_interval=HEARTBEAT,
            )
            for i in range(2)
        ]
        try:
            for node in nodes:
                node.start()
            for front in gateways:
                front.start()
            with httpx.Client(base_url=scheduler, headers={CLUSTER_SECRET_HEADER: secret}) as client:
                ids = wait_until(lambda: _up_nodes(client, len(nodes)), 60, what="the nodes to join")
            by_address = {node.url: node for node in nodes}
            cluster = Cluster(gateways, {i: by_address[a] for i, a in ids.items()}, key)
            yield cluster
        finally:
            for front in gateways:
                front.stop()
            forced = {node.home.name: node.cleanup() for node in nodes}
            print(f"\ncluster logs in {root}; cleaned up by force: {forced}", file=sys.stderr)
    # Nothing leaked: only a node a test crashed left anything to clean up by force.
    assert not [f for node in nodes if node not in cluster.crashed for f in forced[node.home.name]], forced


def _up_nodes(client: httpx.Client, count: int) -> dict[str, str] | None:
    nodes = client.get("/nodes").json()
    up = {n["node_id"]: n["address"] for n in nodes if n["status"] == "up"}
    return up if len(up) == count else None


def test_the_python_sdk_through_a_gateway_uses_every_node(cluster: Cluster) -> None:
    from e2b import Sandbox, SandboxQuery, SandboxState

    with cluster.sdk():
        mine = SandboxQuery(metadata={"tag": cluster.tag})
        created = [Sandbox.create("base", metadata={"tag": cluster.tag}, timeout=300) for _ in range(4)]
        homes = {s.sandbox_id: cluster.node_of(s.sandbox_id) for s in created}
        assert set(homes.values()) == set(cluster.nodes), homes  # placement spreads over both nodes
        first = created[0]
        assert first.commands.run("echo $((40+2))").stdout == "42\n"
        chunks: list[str] = []
        first.commands.run("for i in 1 2 3; do echo $i; sleep 0.2; done", on_stdout=chunks.append)
        assert "".join(chunks) == "1\n2\n3\n"
        first.files.write("/home/user/kept.txt", "through the gateway")
        assert first.pause()
        assert Sandbox.get_info(first.sandbox_id).state == SandboxState.PAUSED
        resumed = Sandbox.connect(first.sandbox_id)
        assert resumed.files.read("/home/user/kept.txt") == "through the gateway"
        assert cluster.node_of(first.sandbox_id) == homes[first.sandbox_id]
        paginator = Sandbox.list(query=mine, limit=3)
        seen = paginator.next_items()
        seen += paginator.next_items()
        assert not paginator.has_next and sorted(s.sandbox_id for s in seen) == sorted(homes)
        with cluster.api() as api:
            forked = api.post(f"/sandboxes/{first.sandbox_id}/fork", json={"count": 1}).raise_for_status()
        child = forked.json()[0]["sandbox"]["sandboxID"]
        assert cluster.node_of(child) == homes[first.sandbox_id]
        assert Sandbox.connect(child).files.read("/home/user/kept.txt") == "through the gateway"
        for sandbox_id in [*homes, child]:
            Sandbox.kill(sandbox_id)
        assert Sandbox.list(query=mine).next_items() == []


async def test_the_async_sdk_through_the_other_gateway(cluster: Cluster) -> None:
    from e2b import AsyncSandbox

    with cluster.sdk(gateway=1):
        sandbox = await AsyncSandbox.create("base", metadata={"tag": cluster.tag}, timeout=300)
        try:
            lines: list[str] = []
            result = await sandbox.commands.run("seq 1 3", on_stdout=lines.append)
            assert result.exit_code == 0 and "".join(lines) == "1\n2\n3\n"
            await sandbox.files.write("/tmp/a.txt", "async")
            assert await sandbox.files.read("/tmp/a.txt") == "async"
            info = await AsyncSandbox.get_info(sandbox.sandbox_id)
            assert info.state.value == "running"
        finally:
            await AsyncSandbox.kill(sandbox.sandbox_id)


def test_the_npm_sdk_through_a_gateway(cluster: Cluster, tmp_path: Path) -> None:
    outcome = run_script(cluster.gateways[0], installed_sdk(tmp_path), "cluster.mjs", SCRIPT)
    assert outcome["ok"] and "gone" in outcome["steps"], outcome


def test_gateway_nodes_list_the_cluster(cluster: Cluster) -> None:
    with cluster.api(1) as api:
        nodes = api.get("/nodes").raise_for_status().json()
    assert {n["id"] for n in nodes} == set(cluster.nodes)
    assert all(n["status"] == "up" and n["capacity"]["memoryMB"] > 0 and n["version"] for n in nodes)


def test_a_node_port_is_no_open_door(cluster: Cluster) -> None:
    node = next(iter(cluster.nodes.values()))
    refused = httpx.get(node.url + "/v2/sandboxes", headers={"X-API-Key": node.key})
    assert refused.status_code == 401


def test_a_gateway_killed_mid_stream_loses_nothing(cluster: Cluster) -> None:
    from e2b import Sandbox

    with cluster.sdk(gateway=0):
        sandbox = Sandbox.create("base", metadata={"tag": cluster.tag}, timeout=300)
    chunks: list[str] = []

    def on_stdout(chunk: str) -> None:
        chunks.append(chunk)
        if len(chunks) == 2:
            cluster.gateways[0].sigkill()

    with pytest.raises(Exception):  # noqa: B017  # whatever the SDK makes of the cut stream
        sandbox.commands.run("for i in $(seq 1 50); do echo $i; sleep 0.2; done", on_stdout=on_stdout)
    with cluster.sdk(gateway=1):  # the client retries against the other gateway
        again = Sandbox.connect(sandbox.sandbox_id)
        assert again.commands.run("echo still here").stdout == "still here\n"
        Sandbox.kill(sandbox.sandbox_id)


def test_a_node_killed_reports_its_sandboxes_lost_and_nothing_else(cluster: Cluster) -> None:
    from e2b import Sandbox, SandboxQuery

    with cluster.sdk(gateway=1):
        homes: dict[str, str] = {}  # a sandbox on each node (placement is the scheduler's choice)
        while len(set(homes.values())) < 2:
            assert len(homes) < 6, f"placement put every sandbox on one node: {homes}"
            sandbox_id = Sandbox.create("base", metadata={"tag": cluster.tag}, timeout=300).sandbox_id
            homes[sandbox_id] = cluster.node_of(sandbox_id, gateway=1)
        victim_id, survivor_id = (next(i for i, n in homes.items() if n == node) for node in cluster.nodes)
        victim_node = cluster.nodes[homes[victim_id]]
        cluster.crashed.append(victim_node)
        victim_node.sigkill()
        with cluster.api(1) as api:
            lost = wait_until(
                lambda: (r := api.get(f"/sandboxes/{victim_id}")).status_code == 404 and r,
                DOWN_AFTER * 5,
                what="the killed node's sandbox to be reported lost",
            )
            assert "lost" in lost.json()["message"] and homes[victim_id] in lost.json()["message"]
            nodes = {n["id"]: n["status"] for n in api.get("/nodes").json()}
        assert nodes[homes[victim_id]] == "down" and nodes[homes[survivor_id]] == "up"
        survivor = Sandbox.connect(survivor_id)
        assert survivor.commands.run("echo fine").stdout == "fine\n"
        listed = Sandbox.list(query=SandboxQuery(metadata={"tag": cluster.tag})).next_items()
        survivors = [i for i, n in homes.items() if n == homes[survivor_id]]
        assert sorted(s.sandbox_id for s in listed) == sorted(survivors)
        with cluster.sdk(gateway=1):
            new = Sandbox.create("base", timeout=120)  # placed on the node that is left
            assert cluster.node_of(new.sandbox_id, gateway=1) == homes[survivor_id]
            Sandbox.kill(new.sandbox_id)
        for sandbox_id in survivors:
            Sandbox.kill(sandbox_id)
