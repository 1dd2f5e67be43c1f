"""Peer-to-peer blob transport (`aenv.runtime.peers`) between nodes sharing a real SeaweedFS bucket.

Each node is its storage as `aenv server` opens it (`open_storage`) and, for the serving side,
the node API's app with the blob route on a loopback port. Fetches run in a worker thread, as
the engine's do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry, generate_latest

from aenv.api import schemas
from aenv.api.server import NodeAPI
from aenv.cluster.auth import CLUSTER_SECRET_HEADER
from aenv.config import Settings
from aenv.devs3 import S3Server
from aenv.repository.chunks import CHUNK_SIZE, ChunkIndex
from aenv.runtime.open import Storage, open_storage
from aenv.runtime.peers import BlobServer
from aenv.runtime.resolvers import CachedRuntime

from .test_cached_runtime import snapshot_manifest

KEY = "e2b_" + "2e" * 20
MIB = 1 << 20


class NoNode:
    def __getattr__(self, name: str):
        raise AssertionError(f"the blob route called the node service ({name})")


@pytest.fixture
def make_node(s3_server: S3Server, tmp_path: Path):
    """A node's storage on one shared bucket; P2P on (unless `p2p` is false) if `peers` are given."""
    bucket = s3_server.new_bucket()
    opened: list[Storage] = []

    def make(
        name: str,
        peers: list[str] | None = None,
        secret: str | None = None,
        p2p: bool = True,
        lazy: bool = False,
        key: str = KEY,
    ) -> Storage:
        settings = Settings(
            home_path=tmp_path / name, repository=f"s3://{bucket}/aenv", s3_endpoint=s3_server.endpoint,
            s3_region=s3_server.region, s3_access_key=s3_server.access_key,
            s3_secret_key=s3_server.secret_key, lazy_loading=lazy, p2p=p2p and peers is not None,
            p2p_peers=",".join(peers or ()), cluster_secret=secret, api_key=key,
        ).validate()  # fmt: skip
        storage = open_storage(settings, name)
        opened.append(storage)
        return storage

    make.bucket = bucket  # type: ignore[attr-defined]
    yield make
    for storage in opened:
        storage.close()


@contextlib.asynccontextmanager
async def serving(blobs: BlobServer, secret: str | None = None) -> AsyncIterator[str]:
    """The node API's app with the blob route, as `aenv server` mounts it; yields its base URL."""
    api = NodeAPI(NoNode(), domain="localhost:1", limits=schemas.limits(Settings()))  # type: ignore[arg-type]
    server = TestServer(api.app(KEY, secret, [blobs.route()]), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def runtime(storage: Storage) -> CachedRuntime:
    assert isinstance(storage.runtime, CachedRuntime)
    return storage.runtime


def memory() -> bytes:
    """An image with a hole in it (holes must stay holes whatever the source)."""
    return os.urandom(MIB) + bytes(2 * MIB) + os.urandom(MIB)


def held_by(storage: Storage, content: bytes):
    """A snapshot committed through `storage` whose memory image this node now caches whole."""
    manifest = snapshot_manifest(storage.repository, ("sha256:" + "0" * 64,), content)
    assert runtime(storage).memory_image(manifest).read_bytes() == content
    return manifest


async def test_a_node_takes_a_blob_from_a_peer_not_the_store(make_node, s3_server: S3Server):
    a = make_node("node-a")
    content = memory()
    manifest = held_by(a, content)
    # Gone from the store: only node A can still give it.
    key = "aenv/blobs/sha256/" + manifest.memory_image.removeprefix("sha256:")
    s3_server.client().delete_object(Bucket=make_node.bucket, Key=key)
    served = BlobServer(a.cache)
    async with serving(served) as url_a:
        b = make_node("node-b", peers=[url_a])
        path = await asyncio.to_thread(runtime(b).memory_image, manifest)
    assert path.read_bytes() == content
    assert path.stat().st_blocks * 512 < len(content)  # the hole stayed a hole
    assert b.peers is not None and b.peers.blobs == {"peer": 1, "store": 0}
    assert b.peers.bytes["peer"] == len(content)
    registry = CollectorRegistry()  # as `aenv server` shows them on /metrics
    registry.register(b.peers)
    registry.register(served)
    metrics = generate_latest(registry).decode()
    assert (
        'aenv_p2p_fetched_blobs_total{source="peer"} 1.0' in metrics
        and "aenv_p2p_served_total 1.0" in metrics
    )


async def test_corrupt_and_absent_peers_are_skipped_for_the_store(make_node, tmp_path: Path):
    a = make_node("node-a")
    content = memory()
    manifest = held_by(a, content)
    cached = a.cache.path(manifest.memory_image.removeprefix("sha256:"))
    cached.chmod(0o644)
    with open(cached, "r+b") as f:  # a peer whose copy rotted
        f.write(b"rot")
    other = make_node("node-other")  # holds nothing: answers 404
    async with (
        serving(BlobServer(other.cache)) as url_other,
        serving(BlobServer(None)) as url_off,  # P2P off there: 404 to every blob
        serving(BlobServer(a.cache)) as url_a,
    ):
        b = make_node("node-b", peers=[url_other, url_off, url_a, "http://127.0.0.1:9"])
        path = await asyncio.to_thread(runtime(b).memory_image, manifest)
        async with httpx.AsyncClient(headers={"X-API-Key": KEY}) as client:
            absent = await client.get(f"{url_other}/p2p/blobs/{manifest.memory_image[7:]}")
            disabled = await client.get(f"{url_off}/p2p/blobs/{manifest.memory_image[7:]}")
            bad = await client.get(f"{url_other}/p2p/blobs/not-a-digest")
    assert path.read_bytes() == content
    assert b.peers is not None and b.peers.blobs == {"peer": 0, "store": 1}
    assert b.peers.rejected == 2  # the rotten copy and the peer that is not there; 404s are no fault
    assert (absent.status_code, disabled.status_code, bad.status_code) == (404, 404, 400)
    assert "off" in disabled.json()["message"]


async def test_p2p_off_asks_no_peer(make_node):
    a = make_node("node-a")
    content = memory()
    manifest = held_by(a, content)
    blobs = BlobServer(a.cache)
    async with serving(blobs) as url_a:
        b = make_node("node-b", peers=[url_a], p2p=False)  # peers named, but P2P off
        path = await asyncio.to_thread(runtime(b).memory_image, manifest)
    assert path.read_bytes() == content
    assert b.peers is None and blobs.served == 0


async def test_without_a_cluster_secret_only_nodes_with_the_api_key_get_blobs(make_node):
    a = make_node("node-a")
    content = memory()
    manifest = held_by(a, content)
    async with serving(BlobServer(a.cache)) as url_a:
        stranger = make_node("node-stranger", peers=[url_a], key="e2b_" + "5a" * 20)
        assert (await asyncio.to_thread(runtime(stranger).memory_image, manifest)).read_bytes() == content
        async with httpx.AsyncClient() as client:
            refused = await client.get(f"{url_a}/p2p/blobs/{manifest.memory_image[7:]}")
    assert refused.status_code == 401
    assert stranger.peers is not None and stranger.peers.blobs == {"peer": 0, "store": 1}


async def test_with_a_cluster_secret_only_its_holders_get_blobs(make_node):
    secret = secrets.token_hex(16)
    a = make_node("node-a", secret=secret)
    content = memory()
    manifest = held_by(a, content)
    async with serving(BlobServer(a.cache), secret) as url_a:
        outsider = make_node("node-outsider", peers=[url_a])  # no secret
        member = make_node("node-member", peers=[url_a], secret=secret)
        assert (await asyncio.to_thread(runtime(outsider).memory_image, manifest)).read_bytes() == content
        assert (await asyncio.to_thread(runtime(member).memory_image, manifest)).read_bytes() == content
        url = f"{url_a}/p2p/blobs/{manifest.memory_image[7:]}"
        async with httpx.AsyncClient() as client:
            refused = await client.get(url)
            ranged = await client.get(url, headers={CLUSTER_SECRET_HEADER: secret, "Range": "bytes=10-19"})
    assert refused.status_code == 401
    assert (ranged.status_code, ranged.content) == (206, content[10:20])
    assert outsider.peers is not None and outsider.peers.blobs == {"peer": 0, "store": 1}
    assert outsider.peers.rejected == 1
    assert member.peers is not None and member.peers.blobs == {"peer": 1, "store": 0}


async def test_on_demand_prefetch_takes_verified_chunks_from_a_peer(make_node, tmp_path: Path):
    """A cold on-demand start prefetches the restore profile's chunks: runs a peer holds intact
    come from it, a run in which its copy rotted comes from the store."""
    a = make_node("node-a")
    image = tmp_path / "memory"
    image.write_bytes(os.urandom(40 * CHUNK_SIZE))  # large enough for a chunk index
    base = snapshot_manifest(a.repository, ("sha256:" + "0" * 64,), b"unused")
    manifest = dataclasses.replace(base, memory_image=a.repository.put_blob(image))
    content = image.read_bytes()
    assert runtime(a).memory_image(manifest).read_bytes() == content
    profile = [1, 2, 3, 20, 21, 22, 23]  # with chunk 0: two runs, chunks 0-3 and 20-23
    a.repository.reader.record_profile(manifest.memory_image, profile)
    cached = a.cache.path(manifest.memory_image.removeprefix("sha256:"))
    cached.chmod(0o644)
    with open(cached, "r+b") as f:
        f.seek(21 * CHUNK_SIZE)
        f.write(b"rot")
    async with serving(BlobServer(a.cache)) as url_a:
        b = make_node("node-b", peers=[url_a], lazy=True)
        if b.lazy is None:
            pytest.skip("no FUSE on this host: on-demand loading is off")
        await asyncio.to_thread(runtime(b).memory_image, manifest)
    assert b.peers is not None and b.peers.blobs == {"peer": 0, "store": 0}  # nothing fetched whole
    assert b.peers.range_bytes == {"peer": 4 * CHUNK_SIZE, "store": 4 * CHUNK_SIZE}
    assert b.peers.rejected == 1
    partial = b.cache.path(manifest.memory_image.removeprefix("sha256:"))
    with open(partial, "rb") as f:
        for i in (0, *profile):
            f.seek(i * CHUNK_SIZE)
            expected = content[i * CHUNK_SIZE : (i + 1) * CHUNK_SIZE]
            assert hashlib.sha256(f.read(CHUNK_SIZE)).digest() == hashlib.sha256(expected).digest()


def test_a_range_is_kept_only_if_its_chunks_match():
    data = os.urandom(2 * CHUNK_SIZE + 100)
    index = ChunkIndex(
        len(data),
        CHUNK_SIZE,
        tuple(hashlib.sha256(data[i : i + CHUNK_SIZE]).hexdigest() for i in range(0, len(data), CHUNK_SIZE)),
    )
    assert index.verified(0, data) and index.verified(CHUNK_SIZE, data[CHUNK_SIZE:])
    assert not index.verified(0, data[:-1])  # short of the end
    assert not index.verified(1, data[1 : CHUNK_SIZE + 1])  # not whole chunks
    assert not index.verified(0, b"x" + data[1:])
    assert not index.verified(0, b"")


async def test_in_a_cluster_the_peers_are_the_schedulers_other_live_nodes():
    """`SchedulerPeers` against the scheduler's `GET /nodes` (a fake scheduler: only that route)."""
    from aiohttp import web

    from aenv.cluster.model import NodeCapacity, NodeInfo, NodeState
    from aenv.cluster.peers import SchedulerPeers

    secret, asked = secrets.token_hex(8), []
    capacity = NodeCapacity(memory_mib=1, vcpus=1, disk_free_mib=1)
    nodes = [
        NodeInfo(node_id=name, address=f"http://{name}:8000/", version="x", status=status, capacity=capacity)
        for name, status in (("me", NodeState.UP), ("up", NodeState.UP), ("draining", NodeState.DRAINING),
                             ("down", NodeState.DOWN))
    ]  # fmt: skip

    async def list_nodes(request: web.Request) -> web.Response:
        asked.append(request.headers.get(CLUSTER_SECRET_HEADER))
        return web.Response(text="[" + ",".join(n.model_dump_json() for n in nodes) + "]")

    app = web.Application()
    app.router.add_get("/nodes", list_nodes)
    async with TestServer(app, host="127.0.0.1") as server:
        url = str(server.make_url("/"))
        peers = SchedulerPeers(url, "me", secret)
        assert await asyncio.to_thread(peers.urls) == ["http://up:8000", "http://draining:8000"]
        await asyncio.to_thread(peers.urls)  # within the ttl: not asked again
    assert asked == [secret]
    gone = SchedulerPeers(url, "me", secret, ttl=0)
    assert await asyncio.to_thread(gone.urls) == []  # an unreachable scheduler: no peers for now
