"""Nodes on one S3 store (a real SeaweedFS) started from fresh, unseeded homes (issue 32).

Every other test's node home is seeded with a `base` built earlier in the run; these nodes are
not, and that is what they test. Node A builds `base` itself into the bucket (minutes under
TCG): its memory image becomes a runtime cache entry by hardlink, which its unprivileged QEMUs
must be able to open (a warm VM, a create, a pause and a resume through the official SDK).
Node B, also fresh, finds that `base` in the bucket. A snapshot made on A is usable on B at
once, its background commit still running: B waits for it, told by the pending marker A
wrote before it answered; a marker whose node does not commit in time makes B answer 503
`snapshot_pending` naming that node, and a stale one is removed (404). Last, A stops while its
store is down: it exits within its stop bound, its QEMUs and its FUSE helper gone, the pause
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
from aenv.storage import lazyfs
from tests.conftest import wait_for
from tests.storage.seaweed import S3Server, SeaweedFS

SLOTS = (16128, 16256)  # the nodes' network slots, apart from every other node the suite starts


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
def node_a(weed: SeaweedFS, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevNode]:
    """A fresh home (no seed): the node builds `base` into the bucket at its first start."""
    bucket = weed.server.new_bucket()
    node = DevNode(tmp_path_factory.mktemp("fresh") / "a", slot_first=SLOTS[0], slot_count=64,
                   warm_pool_size=1, stop_timeout=10, **node_settings(weed.server, bucket))  # fmt: skip
    node.bucket = bucket  # type: ignore[attr-defined]
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


def test_a_stop_with_the_store_down_is_bounded_and_keeps_the_pause(weed: SeaweedFS, node_a: DevNode):
    from e2b import Sandbox

    sandbox = Sandbox.create("base", timeout=600, **sdk(node_a))
    sandbox.files.write("/root/before-stop.txt", "written before the store went away", user="root")
    qemus, helper = node_a.qemu_pids(), fuse_server(node_a.home)
    assert qemus and helper is not None and fuse_mounted(node_a.home)
    weed.stop()
    started = time.monotonic()
    try:
        assert node_a.stop(timeout=60), node_a.log_tail()  # by itself: no SIGKILL needed
        stopped = time.monotonic() - started
    finally:
        weed.start()
    assert "not committed by the stop deadline" in node_a.log_tail(200)
    assert not [pid for pid in qemus if Path(f"/proc/{pid}").exists()]
    assert fuse_server(node_a.home) is None and not fuse_mounted(node_a.home)
    print(f"\nstop with the store down (stop_timeout 10 s): {stopped:.1f} s")

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
