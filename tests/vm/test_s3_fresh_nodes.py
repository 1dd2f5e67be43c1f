"""Nodes on one S3 store (a real SeaweedFS) started from fresh, unseeded homes (issue 32).

Every other test's node home is seeded with a `base` built earlier in the run; these nodes are
not, and that is what they test. Node A builds `base` itself into the bucket (about 20 s under
TCG here): its memory image becomes a runtime cache entry by hardlink, which its unprivileged QEMUs
must be able to open (a warm VM, a create, a pause and a resume through the official SDK).
Node B, also fresh, finds that `base` in the bucket. A snapshot made on A is usable on B at
once, its background commit still running: B waits for it, told by the pending mark A wrote
before it answered; a mark whose node does not commit in time makes B answer 503
`snapshot_pending` naming that node, and a stale one is removed (404). Last, A stops while its
store does not answer: it exits within its stop bound, its QEMUs and its FUSE helper gone, the pause
kept on its disk and committed once A starts again with the store back; a SIGKILL of a node
takes its FUSE helper and mount along.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aenv.devnode import DevNode
from aenv.devs3 import S3Server, SeaweedFS
from aenv.repository.contract import PendingMark
from aenv.repository.manifest import new_snapshot_id
from aenv.runtime import lazyfs
from tests.conftest import wait_for

SLOTS = (16128, 16256)  # the nodes' network slots, apart from every other node the suite starts
PENDING_WAIT = 15  # seconds node B waits for a snapshot another node is committing


@pytest.fixture(scope="module")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def node_settings(server: S3Server, bucket: str) -> dict[str, str]:
    return {
        "repository": f"s3://{bucket}/fresh", "s3_endpoint": server.endpoint, "s3_region": server.region,
        "s3_access_key": server.access_key, "s3_secret_key": server.secret_key, "park_seconds": "0",
    }  # fmt: skip


@pytest.fixture(scope="module")
def bucket(weed: SeaweedFS) -> str:
    return weed.server.new_bucket()


@pytest.fixture(scope="module")
def node_a(weed: SeaweedFS, bucket: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevNode]:
    """A fresh home (no seed): the node builds `base` into the bucket at its first start."""
    node = DevNode(tmp_path_factory.mktemp("fresh") / "a", slot_first=SLOTS[0], slot_count=64,
                   warm_pool_size=1, stop_timeout=10, **node_settings(weed.server, bucket))  # fmt: skip
    try:
        node.start()
        yield node
    finally:
        node.cleanup()


def sdk(node: DevNode) -> dict[str, object]:
    return {"api_key": node.key, "api_url": node.url, "sandbox_url": node.url}


def test_a_fresh_s3_node_builds_base_and_runs_sandboxes(node_a: DevNode):
    from e2b import Sandbox

    sandbox = Sandbox.create("base", timeout=300, **sdk(node_a))
    assert sandbox.commands.run("echo made on a fresh node", user="root").stdout == "made on a fresh node\n"
    sandbox.files.write("/root/note.txt", "kept across the pause", user="root")
    assert sandbox.pause()
    resumed = Sandbox.connect(sandbox.sandbox_id, timeout=300, **sdk(node_a))
    assert resumed.files.read("/root/note.txt", user="root") == "kept across the pause"
    assert resumed.commands.run("uname -s", user="root").stdout.strip() == "Linux"
    resumed.kill()


def fuse_mounted(home: Path) -> bool:
    return lazyfs._mounted(home / lazyfs.MOUNT_DIR)


@pytest.fixture(scope="module")
def node_b(weed: SeaweedFS, bucket: str, node_a: DevNode) -> Iterator[DevNode]:
    """Another fresh home on A's bucket: it finds `base` there (no build, no seed)."""
    node = DevNode(node_a.home.parent / "b", slot_first=SLOTS[1], slot_count=64, warm_pool_size=0,
                   pending_wait=PENDING_WAIT, **node_settings(weed.server, bucket))  # fmt: skip
    try:
        node.start()
        yield node
    finally:
        node.cleanup()


def test_a_snapshot_made_on_a_is_usable_on_b_at_once(
    weed: SeaweedFS, bucket: str, node_a: DevNode, node_b: DevNode
):
    """B learns from A's pending mark that the snapshot is coming and waits for its commit (a
    100 MiB delta to hash and upload), where it answered 404 before (issue 32)."""
    from e2b import Sandbox

    source = Sandbox.create("base", timeout=600, **sdk(node_a))
    source.files.write("/root/made-on-a.txt", "written on A before the snapshot", user="root")
    source.commands.run("head -c 100M /dev/urandom > /dev/shm/noise", user="root", timeout=300)
    made = httpx.post(f"{node_a.url}/sandboxes/{source.sandbox_id}/snapshots", json={},
                      headers={"X-API-Key": node_a.key}, timeout=120)  # fmt: skip
    assert made.status_code == 201, made.text
    snapshot_id = made.json()["snapshotID"]
    marked = mark(weed, bucket, snapshot_id) is not None  # gone already if the commit was quick
    copy = Sandbox.create(snapshot_id, timeout=600, **sdk(node_b))
    assert copy.files.read("/root/made-on-a.txt", user="root") == "written on A before the snapshot"
    assert mark(weed, bucket, snapshot_id) is None  # the commit ended: its mark went
    print(f"\nsnapshot answered on A (durable {made.json().get('durable')}), still marked pending when"
          f" B was asked: {marked}")  # fmt: skip
    copy.kill()
    source.kill()


def test_a_pending_mark_is_waited_for_then_answered_503_and_a_stale_one_removed(
    weed: SeaweedFS, bucket: str, node_a: DevNode, node_b: DevNode
):
    """Marks written as a node writes them: A's (alive: B waits, then 503 naming A), one of a
    node that never beat (stale: removed, 404) and one of a failed commit (404 saying why)."""
    headers = {"X-API-Key": node_b.key}
    node = (node_a.home / "node-id").read_text().strip()
    pending, ghost, failed = new_snapshot_id(), new_snapshot_id(), new_snapshot_id()
    put_mark(weed, bucket, pending, node)
    put_mark(weed, bucket, ghost, "a-node-that-never-beat")
    put_mark(weed, bucket, failed, node, failure="snapshot x failed and was rolled back: disk full")

    waited = httpx.get(f"{node_b.url}/snapshots/{pending}", headers=headers, timeout=PENDING_WAIT + 60)
    assert waited.status_code == 503 and waited.json()["error_code"] == "snapshot_pending", waited.text
    assert node in waited.json()["message"]
    created = httpx.post(f"{node_b.url}/sandboxes", json={"templateID": pending}, headers=headers,
                         timeout=PENDING_WAIT + 60)  # fmt: skip
    assert created.status_code == 503 and created.json()["error_code"] == "snapshot_pending", created.text

    stale = httpx.get(f"{node_b.url}/snapshots/{ghost}", headers=headers, timeout=60)
    assert stale.status_code == 404 and mark(weed, bucket, ghost) is None
    gone = httpx.get(f"{node_b.url}/snapshots/{failed}", headers=headers, timeout=60)
    assert gone.status_code == 404 and "disk full" in gone.json()["message"]


def mark(weed: SeaweedFS, bucket: str, name: str) -> bytes | None:
    """The pending mark of a snapshot in the bucket, as the nodes write it (None: none)."""
    client = weed.server.client()
    try:
        return client.get_object(Bucket=bucket, Key=f"fresh/pending/{name}")["Body"].read()
    except client.exceptions.NoSuchKey:
        return None


def put_mark(weed: SeaweedFS, bucket: str, snapshot_id: str, node: str, failure: str | None = None) -> None:
    body = PendingMark(snapshot_id, node, failure, stale=False).to_json()
    weed.server.client().put_object(Bucket=bucket, Key=f"fresh/pending/{snapshot_id}", Body=body)


def test_a_stop_with_the_store_unanswering_is_bounded_and_keeps_the_pause(weed: SeaweedFS, node_a: DevNode):
    from e2b import Sandbox

    sandbox = Sandbox.create("base", timeout=600, **sdk(node_a))
    sandbox.files.write("/root/before-stop.txt", "written before the store went away", user="root")
    qemus, helper = node_a.qemu_pids(), fuse_server(node_a.home)
    assert qemus and helper is not None and fuse_mounted(node_a.home)
    weed.freeze()  # the store stops answering: every call to it waits out its timeouts and retries
    started = time.monotonic()
    try:
        assert node_a.stop(timeout=60), node_a.log_tail()  # by itself: no SIGKILL needed
        stopped = time.monotonic() - started
    finally:
        weed.freeze(False)
    assert "pauses not committed by the stop deadline" in node_a.log_tail(200)
    assert not [pid for pid in qemus if Path(f"/proc/{pid}").exists()]
    # the FUSE server sees its node end (a pidfd) and unmounts by itself, a moment later
    wait_for(lambda: fuse_server(node_a.home) is None and not fuse_mounted(node_a.home), timeout=30)
    print(f"\nstop with the store not answering (stop_timeout 10 s): {stopped:.1f} s")

    node_a.start()  # the store is back: the pause kept on disk is committed, and resumes
    detail = f"{node_a.url}/sandboxes/{sandbox.sandbox_id}"
    headers = {"X-API-Key": node_a.key}
    wait_for(lambda: httpx.get(detail, headers=headers).json().get("durable"), timeout=120)
    resumed = Sandbox.connect(sandbox.sandbox_id, timeout=300, **sdk(node_a))
    assert resumed.files.read("/root/before-stop.txt", user="root") == "written before the store went away"
    resumed.kill()


def test_a_killed_node_takes_its_fuse_server_and_mount_along(node_a: DevNode):
    helper = fuse_server(node_a.home)
    assert helper is not None and fuse_mounted(node_a.home)
    node_a.sigkill()
    wait_for(lambda: fuse_server(node_a.home) is None and not fuse_mounted(node_a.home), timeout=30)
    node_a.start()  # mounts again, with a server of its own
    assert fuse_mounted(node_a.home) and fuse_server(node_a.home) not in (None, helper)


def fuse_server(home: Path) -> int | None:
    return lazyfs.server_pid(home / lazyfs.STATE_DIR)
