"""Two nodes sharing one S3 bucket (a real SeaweedFS): a snapshot taken on A starts on B, and a
sandbox paused on A resumes on B.

In the first test each node is a snapshot engine with its own home, layer store and runtime
cache, opened from settings the way `aenv server` opens its storage. Node A builds a template
and runs a sandbox from it, writes a file and a running process's state, and snapshots it; node
B starts a sandbox from that snapshot through the repository alone (its cache starts empty) and
finds both. Then two real `aenv server`s (DevNodes) share the bucket: a snapshot made on A
creates on B with its memory image loaded on demand (B's QEMU maps the file of B's FUSE server,
and only part of what B loads on demand was fetched when the sandbox answered), and a sandbox paused on A
(through the E2B SDK) is taken over by B, and A no longer has it. The DevNodes are each other's
peer-to-peer blob source (`AENV_P2P`): B's fetches go through its peer-first source.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aenv.config import Settings
from aenv.devnode import DevNode, free_port
from aenv.devs3 import S3Server, seaweedfs
from aenv.repository.chunks import ChunkIndex
from aenv.runtime.open import open_storage
from aenv.snapshot.engine import SnapshotEngine
from aenv.vmm.accel import accelerator_from_env
from tests.conftest import NodeLoop, SandboxManager, wait_for


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


SLOTS = (15360, 15616)  # the DevNodes' network slots, apart from every other node the suite starts


@pytest.fixture(scope="module")
def bucket(s3_server: S3Server) -> str:
    return s3_server.new_bucket()


def s3_settings(s3_server: S3Server, bucket: str) -> dict[str, str]:
    return {
        "repository": f"s3://{bucket}/cluster", "s3_endpoint": s3_server.endpoint,
        "s3_region": s3_server.region, "s3_access_key": s3_server.access_key,
        "s3_secret_key": s3_server.secret_key,
    }  # fmt: skip


@pytest.fixture(scope="module")
def two_nodes(s3_server: S3Server, bucket: str, guest_artifacts, node_loop: NodeLoop, tmp_path_factory):
    made = []
    for name in ("node-a", "node-b"):
        settings = Settings(
            home_path=tmp_path_factory.mktemp(name), **s3_settings(s3_server, bucket)
        ).validate()  # type: ignore[arg-type]
        storage = open_storage(settings, name)
        engine = SnapshotEngine(
            settings.home_path, storage.repository, guest_artifacts, accelerator_from_env().accel,
            runtime=storage.runtime,
        )  # fmt: skip
        made.append((engine, storage, SandboxManager(engine, node_loop)))
    yield made
    for engine, storage, manager in made:
        manager.close()
        with contextlib.suppress(Exception):
            node_loop.run(engine.close())
        storage.close()


@pytest.fixture(scope="module")
def shared_template(two_nodes, node_loop: NodeLoop):
    """A template in the bucket, built once by node A; bound as `base` too, for the DevNodes."""
    engine_a = two_nodes[0][0]
    template = node_loop.run(engine_a.build_template("shared-base", memory_mib=256))
    engine_a.repository.set_alias("base", template.id)
    return template


def test_snapshot_on_node_a_starts_on_node_b(two_nodes, shared_template, node_loop: NodeLoop):
    (engine_a, _, node_a), (engine_b, storage_b, node_b) = two_nodes
    assert [m.id for m in engine_b.repository.list("template")] == [shared_template.id]

    source = node_a.start("shared-base")
    sdk = source.sdk()
    sdk.files.write("/root/made-on-a.txt", "written on node A before the snapshot", user="root")
    sdk.commands.run("sleep 100000 & echo $! > /root/sleeper.pid", user="root")
    snapshot = node_a.snapshot(source, alias="from-a")
    assert all(layer.startswith("sha256:") for layer in snapshot.disk_layers)  # no node-local ids
    node_a.kill(source.sandbox_id)

    assert storage_b.cache is not None and storage_b.cache.stats().entries == 0
    started = time.monotonic()
    copy = node_b.start("from-a")
    cold = time.monotonic() - started
    sdk_b = copy.sdk()
    assert sdk_b.files.read("/root/made-on-a.txt", user="root") == "written on node A before the snapshot"
    pid = sdk_b.files.read("/root/sleeper.pid", user="root").strip()
    assert sdk_b.commands.run(f"kill -0 {pid}", user="root").exit_code == 0  # the process lives on
    stats = storage_b.cache.stats()
    assert stats.misses > 0 and stats.fetched_bytes > 0
    started = time.monotonic()
    again = node_b.start("from-a")  # everything is in B's cache now
    warm = time.monotonic() - started
    assert storage_b.cache.stats().misses == stats.misses
    assert again.sdk().files.read("/root/made-on-a.txt", user="root").startswith("written on node A")
    print(
        f"\ncreate on B from A's snapshot: cold cache {cold:.1f} s ({stats.fetched_bytes >> 20} MiB fetched,"
        f" {stats.used_bytes >> 20} MiB on disk), warm cache {warm:.1f} s"
    )
    # Both nodes collect garbage with no grace while B runs the copy: nothing B needs goes.
    engine_a.collect_garbage(grace_seconds=0)
    engine_b.collect_garbage(grace_seconds=0)
    assert again.sdk().commands.run("cat /root/made-on-a.txt", user="root").stdout.startswith("written")
    third = node_b.start("from-a")
    assert third.sdk().files.read("/root/made-on-a.txt", user="root").startswith("written on node A")
    layers_dir = Path(engine_b.layers.root)
    chain_owner = engine_b.runtime.top_layer(engine_b.repository.get("from-a"))
    assert str(chain_owner).startswith(str(layers_dir.parent))  # materialized in B's own home
    node_b.kill(copy.sandbox_id)


@pytest.fixture(scope="module")
def dev_nodes(s3_server: S3Server, bucket: str, shared_template, tmp_path_factory) -> Iterator[list[DevNode]]:
    """Two `aenv server`s on the bucket (no warm VMs, no parked processes: less to wait for), each
    the other's peer-to-peer blob source (one API key, which each presents to the other)."""
    settings = {**s3_settings(s3_server, bucket), "warm_pool_size": 0, "park_seconds": 0, "p2p": "true"}
    home = tmp_path_factory.mktemp("dev-nodes")
    key, ports = "e2b_" + secrets.token_hex(20), (free_port(), free_port())
    pairs = zip(("a", "b"), SLOTS, ports, ports[::-1], strict=True)
    nodes = [DevNode(home / name, slot_first=first, slot_count=64, api_key=key, port=port,
                     p2p_peers=f"http://127.0.0.1:{other}", **settings)
             for name, first, port, other in pairs]  # fmt: skip
    try:
        for node in nodes:
            node.start()
        yield nodes
    finally:
        for node in nodes:
            node.cleanup()


def partial_entries(node: DevNode) -> set[str]:
    """The keys of what the node's runtime cache holds in part (blobs loaded on demand)."""
    entries = json.loads((node.home / "cache" / "index.json").read_text())
    return {key for key, entry in entries.items() if entry.get("lazy")}


def held_and_stored(node: DevNode, key: str) -> tuple[int, int]:
    """Bytes the node holds of a blob loaded on demand, and the blob's bytes that are not zeros."""
    index = ChunkIndex.from_json((node.home / "lazy" / "index" / f"{key}.json").read_bytes())
    held = (node.home / "cache" / key).stat().st_blocks * 512
    return held, len(index.data_chunks()) * index.chunk_size


def test_snapshot_on_node_a_creates_on_node_b_loading_on_demand(dev_nodes: list[DevNode], two_nodes):
    from e2b import Sandbox

    a, b = dev_nodes
    repository = two_nodes[0][0].repository  # the bucket, read as the engines' node A
    source = Sandbox.create("base", timeout=300, api_key=a.key, api_url=a.url, sandbox_url=a.url)
    source.files.write("/root/made-on-a.txt", "written on node A before the snapshot", user="root")
    source.commands.run("sleep 100000 & echo $! > /root/sleeper.pid", user="root")
    made = httpx.post(
        f"{a.url}/sandboxes/{source.sandbox_id}/snapshots", headers={"X-API-Key": a.key}, json={}, timeout=120
    )
    assert made.status_code == 201, made.text
    snapshot_id = made.json()["snapshotID"]
    source.kill()
    detail = f"{b.url}/snapshots/{snapshot_id}"
    wait_for(lambda: httpx.get(detail, headers={"X-API-Key": b.key}).status_code == 200, timeout=120)

    copy = Sandbox.create(snapshot_id, timeout=300, api_key=b.key, api_url=b.url, sandbox_url=b.url)
    # What B holds of each blob it loads on demand (the memory image, boot files, the bottom disk
    # layer) when the guest answered, against the blob's bytes that are not zeros.
    held = {key: held_and_stored(b, key) for key in partial_entries(b)}
    key = repository.get(snapshot_id).memory_image.removeprefix("sha256:")
    assert key in held and held[key][0] > 0
    assert sum(h for h, _ in held.values()) < sum(s for _, s in held.values())  # only part of them
    [qemu] = b.qemu_pids()
    assert str(b.home / "runtime" / "lazy" / key) in Path(f"/proc/{qemu}/maps").read_text()
    assert copy.files.read("/root/made-on-a.txt", user="root") == "written on node A before the snapshot"
    pid = copy.files.read("/root/sleeper.pid", user="root").strip()
    assert copy.commands.run(f"kill -0 {pid}", user="root").exit_code == 0  # the process lives on
    print(f"\ncreate on B, fetched before ready (MiB held / stored): memory image {held[key][0] >> 20} /"
          f" {held[key][1] >> 20}; all on demand {sum(h for h, _ in held.values()) >> 20} /"
          f" {sum(s for _, s in held.values()) >> 20}")  # fmt: skip
    copy.kill()


def test_sandbox_paused_on_node_a_resumes_on_node_b(dev_nodes: list[DevNode]):
    from e2b import NotFoundException, Sandbox

    from aenv import rollouts

    a, b = dev_nodes
    sandbox = Sandbox.create("base", timeout=300, api_key=a.key, api_url=a.url, sandbox_url=a.url)
    sandbox.files.write("/root/paused-on-a.txt", "written on node A before the pause", user="root")
    sandbox.commands.run("sleep 100000 & echo $! > /root/sleeper.pid", user="root")
    rollouts.checkpoint(sandbox, "on-a")  # checkpoints stay on node A (`aenv.snapshot.checkpoints`)
    assert sandbox.pause()
    headers_a, headers_b = {"X-API-Key": a.key}, {"X-API-Key": b.key}
    detail = f"/sandboxes/{sandbox.sandbox_id}"
    wait_for(lambda: httpx.get(a.url + detail, headers=headers_a).json().get("durable"), timeout=120)

    taken = httpx.post(b.url + detail + "/takeover", headers=headers_b, json={"timeout": 300}, timeout=300)
    assert taken.status_code == 201, taken.text
    moved = Sandbox.connect(sandbox.sandbox_id, api_key=b.key, api_url=b.url, sandbox_url=b.url)
    assert moved.files.read("/root/paused-on-a.txt", user="root") == "written on node A before the pause"
    pid = moved.files.read("/root/sleeper.pid", user="root").strip()
    assert moved.commands.run(f"kill -0 {pid}", user="root").exit_code == 0  # the process lives on
    assert rollouts.checkpoints(moved) == []
    with pytest.raises(NotFoundException, match="stayed on node"):
        rollouts.reset(moved, "on-a")
    metrics = httpx.get(b.url + "/metrics").text  # B fetched the pause into its runtime cache
    assert re.search(r"^aenv_runtime_cache_misses [1-9]", metrics, re.M)
    assert re.search(r"^aenv_runtime_cache_capacity_bytes [1-9]", metrics, re.M)
    # ... through its peer-first source (AENV_P2P): the pause's files node A holds whole (its
    # memory delta and device state, say) came from A, the rest from the store.
    sources = dict(re.findall(r'^aenv_p2p_fetched_blobs_total\{source="(peer|store)"\} (\S+)', metrics, re.M))
    assert float(sources["peer"]) >= 1, sources
    assert re.search(r"^aenv_p2p_served_total ", httpx.get(a.url + "/metrics").text, re.M)
    print(f"\ntake-over on B, blobs by source: {sources}")

    # One hand-over only: a second take-over is refused, and node A no longer has the sandbox.
    again = httpx.post(b.url + detail + "/takeover", headers=headers_b, timeout=60)
    assert again.status_code == 409, again.text
    resumed_on_a = httpx.post(a.url + detail + "/resume", headers=headers_a, json={}, timeout=60)
    assert resumed_on_a.status_code == 404 and "taken over" in resumed_on_a.json()["message"]
    assert httpx.get(a.url + detail, headers=headers_a).status_code == 404

    # A pause that its node committed and then took back (resumed) is nobody else's: 404 with
    # `pause_gone`, which tells a gateway that finds that node down the sandbox was lost with it.
    assert moved.pause()
    wait_for(lambda: httpx.get(b.url + detail, headers=headers_b).json().get("durable"), timeout=120)
    assert httpx.post(b.url + detail + "/resume", headers=headers_b, json={}, timeout=60).status_code == 201
    gone = httpx.post(a.url + detail + "/takeover", headers=headers_a, timeout=60)
    assert gone.status_code == 404 and gone.json()["error_code"] == "pause_gone", gone.text
    moved.kill()
