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

from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.devnode import DevNode
from aenv.storage import lazyfs
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
