"""A real cluster on this machine, as issue 12 checks it: Redis, SeaweedFS (the S3 repository the
nodes share), `aenv scheduler`, two `aenv gateway`s and three nodes (`aenv.devnode.DevNode`, each
with its own home, port and network slots), started once for the module.

First the end-to-end SDK tests that run against a single node (tests/e2e: the Python SDK sync
and async, and the npm SDK) run unchanged against a gateway: they are imported here, and the
`node` they talk to is a gateway. Then the cluster's own checks, and last the fault test, which
breaks things: kill -9 of a gateway, of the scheduler and of a node during a stream of creates,
pauses and resumes, after which every acknowledged sandbox is accounted for and nothing leaked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import secrets
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv import devcluster, paths
from aenv.cluster.auth import CLUSTER_SECRET_HEADER
from aenv.devcluster import ClusterProcess, RedisServer
from aenv.devnode import DevNode
from aenv.devs3 import seaweedfs
from aenv.repository.contract import Repository
from aenv.repository.location import S3Location
from aenv.repository.posix import SnapshotRepository
from aenv.repository.s3 import S3Repository
from aenv.runtime.layers import LayerStore
from bench.soak import footprint
from tests.e2e.conftest import Sandboxes, sandboxes, wait_until
from tests.e2e.test_console import (
    ROWS_JS,
    SLOW_MS,
    browser,
    log_in,
    test_console_terminal_across_pause_and_resume,
    wait_for_line,
)
from tests.e2e.test_js_sdk import test_js_sdk_smoke
from tests.e2e.test_sdk_async import asandboxes, test_async_files, test_async_host_list_lifecycle
from tests.e2e.test_sdk_sync import (
    test_commands_foreground,
    test_create_default,
    test_files_watch_and_presigned_urls,
    test_list_filters_and_paging,
    test_pause_connect_keeps_processes_and_files,
)
from tests.vm.test_s3_two_nodes import s3_settings

pytestmark = pytest.mark.vm

# The end-to-end tests that run here too, through a gateway (and the fixtures they take).
E2E_THROUGH_A_GATEWAY = (
    sandboxes, asandboxes, test_create_default, test_commands_foreground, test_files_watch_and_presigned_urls,
    test_list_filters_and_paging, test_pause_connect_keeps_processes_and_files, test_async_files,
    test_async_host_list_lifecycle, test_js_sdk_smoke, browser, test_console_terminal_across_pause_and_resume,
)  # fmt: skip

# Network slots of this module's three nodes: apart from every other node the suite starts.
SLOT_FIRST = 14848
SLOT_COUNT = 128
NODES = 3
HEARTBEAT = 0.5  # seconds between a node's heartbeats
DOWN_AFTER = 4.0  # seconds of silence before the scheduler has a node down
# What a leaked VM or network leaves on the host (`bench.soak.footprint`); the nodes' files are
# not counted, as their runtime caches keep what they fetched from the repository.
LEAKS = ("qemu", "namespaces", "nft_rules", "cgroups")


@dataclass
class Cluster:
    scheduler: ClusterProcess
    gateways: list[ClusterProcess]
    nodes: dict[str, DevNode]  # by node id
    key: str
    secret: str
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    crashed: list[DevNode] = field(default_factory=list)  # killed by a test, not started again

    def api(self, gateway: int = 0) -> httpx.Client:
        return httpx.Client(base_url=self.gateways[gateway].url, headers={"X-API-Key": self.key}, timeout=300)

    def state(self) -> httpx.Client:
        """The scheduler's own API, with the cluster secret."""
        return httpx.Client(base_url=self.scheduler.url, headers={CLUSTER_SECRET_HEADER: self.secret})

    def node_of(self, sandbox_id: str, gateway: int = 0) -> str:
        with self.api(gateway) as api:
            return api.get(f"/sandboxes/{sandbox_id}").raise_for_status().json()["clientID"]

    def statuses(self) -> dict[str, str]:
        with self.state() as state:
            return {n["node_id"]: n["status"] for n in state.get("/nodes").raise_for_status().json()}

    def all_up(self) -> bool:
        statuses = self.statuses()
        return len(statuses) == NODES and set(statuses.values()) == {"up"}

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


def publish_template(seed: Path, repository: Repository, name: str = "base") -> None:
    """Commit the seed home's template to the shared repository as a node on it would have
    built it: its blobs, and its disk layers as blobs too (named by digest, not by one node's
    layer id), so that every node starts it from the repository alone."""
    local = SnapshotRepository(paths.repository_dir(seed))
    manifest = local.get(name)
    for digest in manifest.blobs():
        repository.put_blob(local.blob_path(digest), digest=digest, verify=False)
    layers = LayerStore(paths.layers_dir(seed))
    disk = tuple(repository.put_blob(layers.path(layer)) for layer in manifest.disk_layers)
    repository.commit(dataclasses.replace(manifest, disk_layers=disk))


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, template_seed: Path, redis_session: RedisServer
) -> Iterator[Cluster]:
    """The cluster, with the E2B SDKs' environment pointing at the first gateway."""
    if os.geteuid() != 0:
        pytest.fail("the cluster tests start nodes, which need root (network namespaces)")
    redis_session.flush()
    root = tmp_path_factory.mktemp("aenv-cluster")
    secret, key = secrets.token_hex(16), "e2b_" + secrets.token_hex(20)
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(seaweedfs(root / "seaweedfs"))
        storage = s3_settings(s3, s3.new_bucket())
        location = S3Location.from_url(
            storage["repository"], endpoint=s3.endpoint, region=s3.region, access_key=s3.access_key,
            secret_key=s3.secret_key,
        )  # fmt: skip
        publish_template(template_seed, S3Repository(location, root / "publisher", node="publisher"))
        scheduler = devcluster.scheduler(
            redis_session.url, root / "scheduler.log", secret, node_down_after=str(DOWN_AFTER)
        )
        gateways = [
            devcluster.gateway(scheduler.url, root / f"gateway{i}.log", secret, key) for i in range(2)
        ]
        nodes = [
            DevNode(
                root / f"node{i}",
                slot_first=SLOT_FIRST + i * SLOT_COUNT,
                slot_count=SLOT_COUNT,
                warm_pool_size=1,
                evict_interval=1,
                shutdown_action="kill",  # what a test leaves running is not paused at teardown
                max_fork_count=4,  # fewer idle networks to make (and to clean up after the crash)
                scheduler_url=scheduler.url,
                cluster_secret=secret,
                heartbeat_interval=HEARTBEAT,
                **storage,
            )
            for i in range(NODES)
        ]
        forced: dict[str, list[str]] = {}
        try:
            scheduler.start()
            for node in nodes:
                node.start()
            for gateway in gateways:
                gateway.start()
            wait_until(lambda: _registered(scheduler.url, secret), 60, what="the nodes to join")
            by_address = {node.url: node for node in nodes}
            ids = _registered(scheduler.url, secret)
            assert ids is not None
            cluster = Cluster(scheduler, gateways, {i: by_address[a] for i, a in ids.items()}, key, secret)
            with cluster.sdk():
                yield cluster
        finally:
            for front in gateways:
                front.stop()
            forced = {node.home.name: node.cleanup() for node in nodes}
            scheduler.stop()
            print(f"\ncluster logs in {root}; cleaned up by force: {forced}", file=sys.stderr)
    # Nothing leaked: only a node a test crashed (and did not start again) left anything behind.
    assert not [f for node in nodes if node not in cluster.crashed for f in forced[node.home.name]], forced


def _registered(url: str, secret: str) -> dict[str, str] | None:
    """Node id -> address once every node is up."""
    nodes = httpx.get(url + "/nodes", headers={CLUSTER_SECRET_HEADER: secret}).json()
    up = {n["node_id"]: n["address"] for n in nodes if n["status"] == "up"}
    return up if len(up) == NODES else None


@pytest.fixture(scope="module")
def node(cluster: Cluster) -> ClusterProcess:
    """What the end-to-end tests imported above call the node: the gateway their SDK talks to."""
    return cluster.gateways[0]


def test_the_python_sdk_through_a_gateway_uses_every_node(cluster: Cluster) -> None:
    from e2b import Sandbox, SandboxQuery, SandboxState

    mine = SandboxQuery(metadata={"tag": cluster.tag})
    created = [Sandbox.create("base", metadata={"tag": cluster.tag}, timeout=300) for _ in range(NODES + 1)]
    homes = {s.sandbox_id: cluster.node_of(s.sandbox_id) for s in created}
    with cluster.state() as state:  # what placement went by, should it not spread
        nodes = {n["node_id"]: (n["usage"], n["cached"]) for n in state.get("/nodes").json()}
    assert set(homes.values()) == set(cluster.nodes), (homes, nodes)  # placement spreads over every node
    first = created[0]
    first.files.write("/home/user/kept.txt", "through the gateway")
    assert first.pause()
    assert Sandbox.get_info(first.sandbox_id).state == SandboxState.PAUSED
    resumed = Sandbox.connect(first.sandbox_id)
    with cluster.state() as state:  # the node's count of settled changes: created, paused, resumed
        binding = state.get(f"/bindings/{first.sandbox_id}").raise_for_status().json()["binding"]
    assert binding["state"] == "running" and binding["generation"] >= 3, binding
    assert resumed.files.read("/home/user/kept.txt") == "through the gateway"
    assert cluster.node_of(first.sandbox_id) == homes[first.sandbox_id]  # resumed where it was paused
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


def test_fan_out_spreads_over_nodes_and_checkpoints_reset_through_a_gateway(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from e2b import Sandbox

    from aenv import rollouts
    from aenv.cli import main

    key = uuid.uuid4().hex
    group = rollouts.fan_out(
        "base", 2 * NODES, timeout=300, metadata={"tag": cluster.tag}, idempotency_key=key
    )
    try:
        assert all(isinstance(s, Sandbox) for s in group), group
        homes = {s.sandbox_id: cluster.node_of(s.sandbox_id) for s in group}
        assert len(set(homes.values())) >= 2, homes  # spread by room over the nodes
        again = rollouts.fan_out(
            "base", 2 * NODES, timeout=300, idempotency_key=key, api_url=cluster.gateways[1].url
        )
        assert [s.sandbox_id for s in again] == [s.sandbox_id for s in group]  # any gateway finds them
        sandbox = group[0]
        sandbox.files.write("/home/user/kept.txt", "at the checkpoint")
        rollouts.checkpoint(sandbox, "start")
        sandbox.files.write("/home/user/kept.txt", "changed")
        rollouts.reset(sandbox, "start")
        assert sandbox.files.read("/home/user/kept.txt") == "at the checkpoint"
        assert [c["name"] for c in rollouts.checkpoints(sandbox)] == ["start"]
        assert cluster.node_of(sandbox.sandbox_id) == homes[sandbox.sandbox_id]

        # The CLI through the other gateway: its fan-out with the key finds the same sandboxes.
        monkeypatch.setenv("AENV_URL", cluster.gateways[1].url)
        monkeypatch.setenv("AENV_API_KEY", cluster.key)
        capsys.readouterr()
        assert main(["fanout", "base", "-n", str(2 * NODES), "--key", key, "-o", "json"]) == 0
        listed = [r["sandbox"]["sandboxID"] for r in json.loads(capsys.readouterr().out)]
        assert listed == [s.sandbox_id for s in group]
        other = group[-1]
        other.files.write("/home/user/cli.txt", "at the checkpoint")
        assert main(["checkpoint", "create", other.sandbox_id, "--name", "cli", "-o", "json"]) == 0
        assert json.loads(capsys.readouterr().out)["name"] == "cli"
        other.files.write("/home/user/cli.txt", "changed")
        assert main(["reset", other.sandbox_id, "cli", "-o", "json"]) == 0
        assert json.loads(capsys.readouterr().out)["sandboxID"] == other.sandbox_id
        assert other.files.read("/home/user/cli.txt") == "at the checkpoint"
        assert main(["checkpoint", "rm", other.sandbox_id, "cli", "-o", "json"]) == 0
        capsys.readouterr()
        assert main(["checkpoint", "ls", other.sandbox_id, "-o", "json"]) == 0
        assert json.loads(capsys.readouterr().out) == []
    finally:
        for sandbox in group:
            if isinstance(sandbox, Sandbox):
                Sandbox.kill(sandbox.sandbox_id)


def test_gateway_nodes_list_the_cluster(cluster: Cluster) -> None:
    with cluster.api(1) as api:
        nodes = api.get("/nodes").raise_for_status().json()
    assert {n["id"] for n in nodes} == set(cluster.nodes)
    assert all(n["status"] == "up" and n["capacity"]["memoryMB"] > 0 and n["version"] for n in nodes)


def test_the_console_through_a_gateway_names_each_sandbox_s_node(
    cluster: Cluster, sandboxes: Sandboxes, browser: Any, tmp_path: Path
) -> None:
    """Sandboxes of two nodes, each with its node; the nodes view lists the cluster; a terminal
    into a sandbox on another node than the first one's."""
    from playwright.sync_api import expect

    homes: dict[str, str] = {}  # placement spreads: NODES + 1 creates reach every node
    while len(set(homes.values())) < 2 and len(homes) <= NODES:
        sandbox_id = sandboxes.create(metadata={"view": "gateway"}).sandbox_id
        homes[sandbox_id] = cluster.node_of(sandbox_id)
    assert len(set(homes.values())) == 2, homes
    page, shot = log_in(browser, cluster.gateways[0], tmp_path)
    for sandbox_id, node_id in homes.items():
        expect(page.locator(f'tr[data-id="{sandbox_id}"] td.node')).to_have_text(node_id, timeout=30_000)
    shot("gateway-sandboxes")
    page.click("nav button[data-view=nodes]")
    expect(page.locator("main tbody tr")).to_have_count(NODES, timeout=30_000)
    shot("gateway-nodes")
    first = next(iter(homes.values()))
    page.click("nav button[data-view=sandboxes]")
    page.click(f"text={next(i for i, node_id in homes.items() if node_id != first)}")
    page.wait_for_function(f"{ROWS_JS}.some(row => row.endsWith('$'))", timeout=SLOW_MS)  # the prompt
    page.click("#terminal")
    page.keyboard.type("echo across-$((40+2))\n")
    wait_for_line(page, "across-42")
    shot("gateway-terminal")


def test_a_node_port_is_no_open_door(cluster: Cluster) -> None:
    node = next(iter(cluster.nodes.values()))
    refused = httpx.get(node.url + "/v2/sandboxes", headers={"X-API-Key": node.key})
    assert refused.status_code == 401


def test_a_gateway_killed_mid_stream_loses_nothing(cluster: Cluster) -> None:
    from e2b import Sandbox

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
    cluster.gateways[0].start()  # as its supervisor would


# -- the fault test ---------------------------------------------------------------------------

RETRY_FOR = 60.0  # seconds a call is tried again while no gateway or no scheduler answers it
Body = dict[str, Any] | None


class Stream:
    """Creates, pauses, resumes and kills sandboxes through the gateways from a thread of its
    own, as a client would: a call that finds no gateway (refused, cut) is tried on the other one,
    one answered 503 by a gateway without a scheduler is tried again a little later. It keeps
    about `size` sandboxes and records what was acknowledged."""

    def __init__(self, cluster: Cluster, size: int = 4) -> None:
        self.cluster = cluster
        self.size = size
        self.acked: dict[str, str] = {}  # sandbox id -> its last acknowledged state
        self.killed: set[str] = set()  # acknowledged kills
        self.unsure: set[str] = set()  # an operation on it went unanswered: it may be in either state
        self.retired: dict[str, str] = {}  # out of the rotation (lost, waits for its node): why
        self.unexpected: list[str] = []  # answers no fault explains
        self.counts: Counter[str] = Counter()
        self._gateway = 0
        self._failed_over = False  # the last call was cut off once: its first try may have been done
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream", daemon=True)
        self._failure: BaseException | None = None

    def __enter__(self) -> Stream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(600)
        if self._failure is not None:
            raise AssertionError("the stream failed") from self._failure

    def wait(self, count: int, kind: str = "ops") -> None:
        """Until `count` more operations of `kind` were acknowledged."""
        target = self.counts[kind] + count

        def done() -> bool:
            if self._failure is not None:
                raise AssertionError("the stream failed") from self._failure
            return self.counts[kind] >= target

        try:
            wait_until(done, 300, what=f"{count} more acknowledged {kind}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the stream so far: {dict(self.counts)}") from None

    def _run(self) -> None:
        rng = random.Random(12)
        try:
            while not self._stop.is_set():
                rotation = [i for i in self.acked if i not in self.retired]
                sandbox_id = rng.choice(rotation) if rotation else ""
                if len(rotation) < self.size:
                    self._create()
                elif rng.random() < 0.2:
                    self._kill(sandbox_id)
                elif self.acked[sandbox_id] == "running":
                    self._operate("pause", sandbox_id, "paused")
                else:
                    self._operate("connect", sandbox_id, "running", {"timeout": 600})
        except BaseException as exc:
            self._failure = exc

    def _create(self) -> None:
        body = {"templateID": "base", "timeout": 600, "metadata": {"stream": self.cluster.tag}}
        answer = self._call("/sandboxes", body)
        if answer is not None and answer.status_code == 201:
            self.acked[answer.json()["sandboxID"]] = "running"
            self.counts.update(["create", "ops"])
        else:
            self._refused("create", "", answer)

    def _kill(self, sandbox_id: str) -> None:
        answer = self._call(f"/sandboxes/{sandbox_id}", None, "DELETE")
        # A kill tried again on the other gateway finds the sandbox gone when the first try (cut
        # off with its gateway) did kill it: a 404 that names no lost sandbox is then the kill's.
        gone = answer is not None and answer.status_code == 404 and "lost" not in answer.text
        if answer is not None and (answer.status_code == 204 or (gone and self._failed_over)):
            del self.acked[sandbox_id]
            self.killed.add(sandbox_id)
            self.counts.update(["kill", "ops"])
        else:
            self._refused("kill", sandbox_id, answer)

    def _operate(self, operation: str, sandbox_id: str, state: str, body: Body = None) -> None:
        answer = self._call(f"/sandboxes/{sandbox_id}/{operation}", body)
        if answer is not None and answer.is_success:
            self.acked[sandbox_id] = state
            self.counts.update([operation, "ops"])
        else:
            self._refused(operation, sandbox_id, answer)

    def _call(self, path: str, body: Body, method: str = "POST") -> httpx.Response | None:
        """The answer of whichever gateway gives one; None when none did in `RETRY_FOR`."""
        deadline = time.monotonic() + RETRY_FOR
        self._failed_over = False
        while True:
            gateway = self.cluster.gateways[self._gateway]
            try:
                answer = httpx.request(method, gateway.url + path, json=body, timeout=300,
                                       headers={"X-API-Key": self.cluster.key})  # fmt: skip
            except httpx.TransportError:
                self._gateway = 1 - self._gateway
                self._failed_over = True
                self.counts["failover to the other gateway"] += 1
                answer = None
            else:
                # A 503 naming a node that is down is the answer for now; other 503s are the
                # scheduler's absence, which passes.
                if answer.status_code != 503 or "is down" in answer.text:
                    return answer
                self.counts["503 retried"] += 1
            if time.monotonic() > deadline:
                return answer
            time.sleep(0.5)

    def _refused(self, operation: str, sandbox_id: str, answer: httpx.Response | None) -> None:
        if answer is None:
            self.counts[f"{operation} unanswered"] += 1
            self.unsure.add(sandbox_id)
        elif answer.status_code in (404, 503) and sandbox_id:  # lost, or paused on a node that is down
            self.retired[sandbox_id] = answer.json()["message"]
            self.counts[f"{operation} {answer.status_code}"] += 1
        elif answer.status_code == 409 and sandbox_id:  # e.g. a retried pause the first try made
            self.unsure.add(sandbox_id)
            self.counts[f"{operation} 409"] += 1
        else:
            self.unexpected.append(f"{operation} {sandbox_id}: {answer.status_code} {answer.text[:300]}")


def held(cluster: Cluster) -> dict[str, float]:
    """What the cluster's nodes hold on the host that a leak would grow (see `LEAKS`)."""
    counts = [footprint(node.home, node.pid) for node in cluster.nodes.values() if node.pid is not None]
    return {"qemu": sum(c["qemu"] for c in counts)} | {name: counts[0][name] for name in LEAKS[1:]}


def steady(cluster: Cluster) -> dict[str, float]:
    """`held` once it no longer changes (warm pools and idle networks filled)."""
    readings: list[dict[str, float]] = []

    def unchanged() -> dict[str, float] | None:
        readings.append(held(cluster))
        return readings[-1] if readings[-3:] == [readings[-1]] * 3 else None

    return wait_until(unchanged, 120, interval=1, what="the nodes to settle")


def durably_paused_and_running_on_one_node(cluster: Cluster) -> tuple[str, str, str]:
    """A sandbox paused durably (with a file written before) and one running, on one node."""
    from e2b import Sandbox

    paused = Sandbox.create("base", metadata={"stream": cluster.tag}, timeout=600)
    home = cluster.node_of(paused.sandbox_id)
    others = []
    for _ in range(2 * NODES):
        running = Sandbox.create("base", metadata={"stream": cluster.tag}, timeout=600)
        if cluster.node_of(running.sandbox_id) == home:
            break
        others.append(running)
    else:
        raise AssertionError("placement never chose the same node twice")
    for other in others:
        other.kill()
    paused.files.write("/home/user/kept.txt", "paused before the crash")
    assert paused.pause()
    with cluster.state() as state:
        wait_until(
            lambda: state.get(f"/bindings/{paused.sandbox_id}").json()["binding"]["durable"],
            180,
            what="the pause to be committed to the repository",
        )
    return home, paused.sandbox_id, running.sandbox_id


def account(cluster: Cluster, ids: list[str], victim: str) -> dict[str, set[str]]:
    """Each sandbox, resumed through the gateway: running on a live node (a durable pause on the
    dead node taken over by another), reported lost with its node down, or paused on the dead
    node and waiting for it (its pause not in the repository)."""
    outcome: dict[str, set[str]] = {"running": set(), "lost": set(), "waiting": set()}
    with cluster.api(1) as api:
        for sandbox_id in ids:
            answer = api.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 600})
            if answer.is_success:
                assert cluster.node_of(sandbox_id, gateway=1) != victim
                outcome["running"].add(sandbox_id)
                continue
            message = answer.json()["message"]
            assert victim in message and "is down" in message, (sandbox_id, answer.text)
            if answer.status_code == 404:
                assert "was lost" in message
                outcome["lost"].add(sandbox_id)
            else:
                assert answer.status_code == 503 and "paused" in message, answer.text
                outcome["waiting"].add(sandbox_id)
    return outcome


def test_kill_9_of_a_gateway_the_scheduler_and_a_node_loses_no_acknowledged_sandbox(cluster: Cluster) -> None:
    before = steady(cluster)
    with cluster.sdk(gateway=1):
        victim, durable, running = durably_paused_and_running_on_one_node(cluster)
    with Stream(cluster) as stream:
        stream.wait(3)
        cluster.gateways[0].sigkill()  # clients move to the other gateway
        stream.wait(3)
        assert stream.counts["failover to the other gateway"] >= 1
        cluster.gateways[0].start()

        cluster.scheduler.sigkill()  # placements and bindings wait for it; nothing is lost
        time.sleep(1)
        cluster.scheduler.start()
        stream.wait(2, "create")  # placements go on after the restart

        node = cluster.nodes[victim]
        cluster.crashed.append(node)
        node.sigkill()
        wait_until(lambda: cluster.statuses()[victim] == "down", DOWN_AFTER * 10, what="the node to be down")
        stream.wait(2)
    summary = f"stream: {dict(stream.counts)}, retired: {stream.retired}, unsure: {stream.unsure}"
    print(f"\n{summary}", file=sys.stderr)
    assert not stream.unexpected, (stream.unexpected, summary)

    ids = [durable, running, *stream.acked]
    outcome = account(cluster, ids, victim)
    print(f"accounted for after the crash of {victim}: {outcome}", file=sys.stderr)
    assert durable in outcome["running"] and running in outcome["lost"]
    check_acknowledged(cluster, stream, outcome)
    kill_while_down(cluster, running)  # lost, and killed: it must not come back with its node
    outcome["lost"].remove(running)

    node.start()  # the node rejoins: its sandboxes are back, what was taken over stays where it went
    cluster.crashed.remove(node)
    wait_until(cluster.all_up, 60, what="the node to rejoin")
    check_rejoined(cluster, outcome, victim, durable)
    check_killed_while_down(cluster, victim, running)
    check_bindings_and_kill_everything(cluster, [i for i in ids if i != running], stream.killed | {running})
    try:
        wait_until(lambda: all(held(cluster)[n] <= before[n] for n in LEAKS), 120, 1, what="no leaks")
    except AssertionError:
        raise AssertionError(f"left behind: before {before}, now {held(cluster)}: {vms(cluster)}") from None


def vms(cluster: Cluster) -> dict[str, list[str]]:
    """The files each node's QEMU processes run from (which sandbox or warm VM each is)."""
    found = {}
    for node in cluster.nodes.values():
        argvs = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in node.qemu_pids()]
        marker = str(node.home).encode()
        found[node.home.name] = [next((a.decode() for a in argv if marker in a), "?") for argv in argvs]
    return found


def check_acknowledged(cluster: Cluster, stream: Stream, outcome: dict[str, set[str]]) -> None:
    """What runs, runs (the durable pause taken over with its disk); only sandboxes last known
    running were lost, only ones last known paused wait for their node."""
    from e2b import Sandbox

    with cluster.sdk(gateway=1):
        for sandbox_id in outcome["running"]:
            assert Sandbox.connect(sandbox_id).commands.run("echo alive").stdout == "alive\n"
    for sandbox_id in outcome["lost"]:
        assert stream.acked.get(sandbox_id, "running") == "running" or sandbox_id in stream.unsure
    for sandbox_id in outcome["waiting"]:
        assert stream.acked.get(sandbox_id) == "paused" or sandbox_id in stream.unsure


def kill_while_down(cluster: Cluster, sandbox_id: str) -> None:
    """A sandbox reported lost is killed through a gateway: done, and gone for the cluster."""
    with cluster.api(1) as api:
        assert api.delete(f"/sandboxes/{sandbox_id}").status_code == 204
        gone = api.get(f"/sandboxes/{sandbox_id}")
        assert gone.status_code == 404 and "lost" not in gone.json()["message"], gone.text


def check_killed_while_down(cluster: Cluster, victim: str, sandbox_id: str) -> None:
    """The node that came back killed the sandbox killed while it was down: no record, VM or
    files of it left, and the gateway still does not know it."""
    node = cluster.nodes[victim]
    on_victim, secret = f"{node.url}/sandboxes/{sandbox_id}", {CLUSTER_SECRET_HEADER: cluster.secret}
    wait_until(lambda: httpx.get(on_victim, headers=secret).status_code == 404, 30, what="its kill there")
    assert not [path for path in vms(cluster)[node.home.name] if sandbox_id in path]
    assert not (node.home / "sandboxes" / sandbox_id).exists()
    with cluster.api(1) as api:
        gone = api.get(f"/sandboxes/{sandbox_id}")
        assert gone.status_code == 404 and "lost" not in gone.json()["message"], gone.text


def check_rejoined(cluster: Cluster, outcome: dict[str, set[str]], victim: str, durable: str) -> None:
    """The node that came back has its lost and waiting sandboxes again; the one another node
    took over stays there, and the node forgets it."""
    from e2b import Sandbox

    with cluster.api(1) as api:
        for sandbox_id in outcome["waiting"] | outcome["lost"]:
            resumed = api.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 600})
            assert resumed.is_success, resumed.text
            assert cluster.node_of(sandbox_id, gateway=1) == victim
    assert cluster.node_of(durable, gateway=1) != victim
    with cluster.sdk(gateway=1):
        assert Sandbox.connect(durable).files.read("/home/user/kept.txt") == "paused before the crash"
    on_victim = f"{cluster.nodes[victim].url}/sandboxes/{durable}"
    secret = {CLUSTER_SECRET_HEADER: cluster.secret}
    wait_until(lambda: httpx.get(on_victim, headers=secret).status_code == 404, 30, what="the node to forget")


def check_bindings_and_kill_everything(cluster: Cluster, acknowledged: list[str], killed: set[str]) -> None:
    """Every binding points at a sandbox its node holds, every sandbox is bound, not one
    acknowledged sandbox is gone nor a killed one back; then all are killed and every binding goes."""
    with cluster.api(1) as api, cluster.state() as state:
        seen: dict[str, object] = {}

        def consistent() -> bool:
            seen["bound"] = bound = {b["sandbox_id"]: b["node_id"] for b in state.get("/bindings").json()}
            seen["listed"] = listed = {s["sandboxID"] for s in api.get("/v2/sandboxes").json()}
            seen["holders"] = holders = {i: api.get(f"/sandboxes/{i}").json().get("clientID") for i in bound}
            return bound.keys() == listed and holders == bound

        try:
            wait_until(consistent, 30, what="the bindings to match the nodes' sandboxes")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {seen}") from None
        listed = {s["sandboxID"] for s in api.get("/v2/sandboxes").json()}
        assert set(acknowledged) <= listed and not killed & listed
        for sandbox_id in listed:
            assert api.delete(f"/sandboxes/{sandbox_id}").status_code == 204
        wait_until(lambda: state.get("/bindings").json() == [], 30, what="every binding to go")
