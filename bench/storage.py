"""Storage figures (issue 11): creates from a snapshot absent from the node's runtime cache, loaded
on demand and fetched whole, against the same create with the cache warm; the repository's upload
throughput; the runtime cache's hit rate under a workload larger than its capacity.

The node under test keeps a posix repository, so these figures bring their own: the SeaweedFS the
tests start (`aenv.devs3`), into which the `base` template of the harness node's home
is uploaded (that upload is the throughput figure), and one `aenv server` (`DevNode`, its own
network slots) per cold sample, on a fresh home with an s3 repository, so its runtime cache starts
empty. A cold sample is that node's first create: wall clock from ``POST /sandboxes`` to the
answer, which comes after the guest's envd took ``/init``; what its cache holds at that moment is
what it fetched before the sandbox was ready (the memory image's part is shown against the
image's non-zero bytes). The first node that loads on demand finds no restore profile and
records one; the later ones prefetch it (the `storage` row; its target: no slower than the same
cold create on a node that fetches every blob whole). Warm creates follow on the same node.

The hit rate is the node's real `BlobCache` under a synthetic trace (no VMs): snapshots sharing
one base entry, each with an entry of its own, asked for with a Zipf-like popularity by a
workload whose working set is several times the capacity, nothing pinned.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from aenv.devnode import DevNode
from aenv.devs3 import S3Server, seaweedfs
from aenv.paths import layers_dir, repository_dir
from aenv.repository.chunks import ChunkIndex
from aenv.repository.location import S3Location
from aenv.repository.posix import SnapshotRepository
from aenv.repository.s3 import S3Repository
from aenv.runtime.cache import BlobCache
from aenv.runtime.layers import LayerStore

from .client import NodeClient
from .context import Context
from .node import SLOT_COUNT, SLOT_FIRST, BenchError, Node
from .report import Row
from .stats import ms_since, summarize

MIB = 1 << 20
STORAGE_SLOTS = SLOT_FIRST + SLOT_COUNT  # after the harness node's range
NODE_SLOTS = 16


@dataclasses.dataclass
class ColdSample:
    cold_ms: float
    fetched: int  # bytes in the node's cache when the create answered
    image_fetched: int  # of which the memory image (its partial copy), 0 if fetched whole
    image_data: int  # the memory image's non-zero bytes
    warm_ms: list[float]


def upload_base(seed: Path, repository: S3Repository) -> tuple[str, int, float]:
    """Store the seed home's `base` template in the repository as an s3 node would (its disk layers
    as blobs); returns its memory image digest, the bytes sent and the seconds it took."""
    source = SnapshotRepository(repository_dir(seed))
    manifest = source.get("base")
    layers = LayerStore(layers_dir(seed))
    started = time.perf_counter()
    sent = 0
    for digest in manifest.blobs():
        path = source.blob_path(digest)
        repository.put_blob(path, digest=digest, verify=False)
        sent += path.stat().st_size
    stored = []
    for layer in manifest.disk_layers:
        stored.append(repository.put_blob(layers.path(layer)))
        sent += layers.path(layer).stat().st_size
    elapsed = time.perf_counter() - started
    repository.commit(dataclasses.replace(manifest, disk_layers=tuple(stored)))
    if manifest.alias != "base":  # committed with its alias otherwise
        repository.set_alias("base", manifest.id)
    return manifest.memory_image, sent, elapsed


def cache_bytes(home: Path) -> int:
    cache = home / "cache"
    return sum(p.stat().st_blocks * 512 for p in cache.iterdir() if p.is_file() and p.name != "index.json")


def image_share(home: Path, image: str) -> tuple[int, int]:
    """What the node holds of a memory image loaded on demand, and the image's non-zero bytes."""
    key = image.removeprefix("sha256:")
    index_file = home / "lazy" / "index" / f"{key}.json"
    if not index_file.exists():
        return 0, 0
    index = ChunkIndex.from_json(index_file.read_bytes())
    return (home / "cache" / key).stat().st_blocks * 512, len(index.data_chunks()) * index.chunk_size


async def cold_sample(home: Path, settings: dict[str, Any], image: str, warm: int) -> ColdSample:
    """A fresh node's first create, then `warm` more creates on it (its cache warm)."""
    node = DevNode(home, slot_first=STORAGE_SLOTS, slot_count=NODE_SLOTS, **settings)
    try:
        node.start()  # in this thread: a node stops when the thread that started it ends
        if cache_bytes(home):
            raise BenchError(f"the node's cache is not empty before its first create: {home / 'cache'}")
        client = NodeClient(Node(node.url, node.key, home))
        try:
            started = time.perf_counter()
            sandbox = await client.create()
            cold = ms_since(started)
            fetched = cache_bytes(home)
            image_fetched, image_data = image_share(home, image)
            await client.kill(sandbox["sandboxID"])
            warm_ms = []
            for _ in range(warm):
                started = time.perf_counter()
                sandbox = await client.create()
                warm_ms.append(ms_since(started))
                await client.kill(sandbox["sandboxID"])
        finally:
            await client.aclose()
    finally:
        await asyncio.to_thread(node.cleanup)
    return ColdSample(cold, fetched, image_fetched, image_data, warm_ms)


def hit_rate(workdir: Path, *, snapshots: int = 12, requests: int = 600) -> tuple[float, dict[str, Any]]:
    """The cache's hit rate when its capacity holds the base entry and a quarter of the snapshots."""
    base, own = 8 * MIB, 2 * MIB
    capacity = base + own * snapshots // 4
    cache = BlobCache(workdir / "cache", capacity, set, recent_seconds=0)
    rng = random.Random(11)
    weights = [1 / (rank + 1) ** 1.1 for rank in range(snapshots)]
    for snapshot in rng.choices(range(snapshots), weights, k=requests):
        owner = f"snap-{snapshot}"
        cache.get("base", lambda dest: dest.write_bytes(b"b" * base), owner)
        cache.get(f"own-{snapshot}", lambda dest: dest.write_bytes(b"o" * own), owner)
    stats = cache.stats()
    details = {
        "capacity_mib": capacity / MIB, "working_set_mib": (base + own * snapshots) / MIB,
        "snapshots": snapshots, "requests": requests, "hits": stats.hits, "misses": stats.misses,
        "evictions": stats.evictions, "used_mib": stats.used_bytes / MIB,
    }  # fmt: skip
    return 100 * stats.hits / (stats.hits + stats.misses), details


async def storage(ctx: Context) -> list[Row]:
    seed = ctx.node.home
    if seed is None:
        raise BenchError("the storage figures start nodes of their own: they need the node's host")
    rounds = max(1, ctx.plan.create // 5)
    workdir = Path(tempfile.mkdtemp(prefix="aenv-bench-storage-"))
    try:
        with seaweedfs(workdir / "seaweedfs") as server:
            return await _measure(ctx, server, seed, workdir, rounds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def _measure(ctx: Context, server: S3Server, seed: Path, workdir: Path, rounds: int) -> list[Row]:
    bucket = server.new_bucket()
    location = S3Location(
        bucket=bucket, prefix="bench", endpoint=server.endpoint, region=server.region,
        access_key=server.access_key, secret_key=server.secret_key,
    )  # fmt: skip
    repository = S3Repository(location, workdir / "staging", node="bench-seed")
    image, sent, seconds = await asyncio.to_thread(upload_base, seed, repository)
    settings = {
        "repository": f"s3://{bucket}/bench", "s3_endpoint": server.endpoint, "s3_region": server.region,
        "s3_access_key": server.access_key, "s3_secret_key": server.secret_key, "warm_pool_size": 0,
        "park_seconds": 0,
    }  # fmt: skip
    lazy: list[ColdSample] = []
    whole: list[ColdSample] = []
    for index in range(rounds + 1):  # the first on-demand node records the restore profile
        lazy.append(await cold_sample(workdir / f"lazy-{index}", settings, image, ctx.plan.create))
    for index in range(rounds):
        whole.append(
            await cold_sample(workdir / f"whole-{index}", {**settings, "lazy_loading": False}, image, 0)
        )
    rate, rate_details = hit_rate(workdir)
    first, profiled = lazy[0], lazy[1:]

    def fetched(samples: list[ColdSample]) -> dict[str, Any]:
        return {
            "fetched_mib": [round(s.fetched / MIB, 1) for s in samples],
            "image_fetched_mib": [round(s.image_fetched / MIB, 1) for s in samples],
            "image_data_mib": round(first.image_data / MIB, 1),
        }

    note = (f"fresh node per sample, s3 repository on SeaweedFS; fetched before ready: "
            f"{_mib(profiled, 'fetched')} MiB, of the memory image {_mib(profiled, 'image_fetched')} "
            f"of its {first.image_data / MIB:.0f} MiB of data")  # fmt: skip
    upload = summarize("repository upload (base template)", [sent / MIB / seconds], unit="MiB/s")
    warm = summarize("create, warm cache (same nodes)", [ms for s in lazy for ms in s.warm_ms])
    return [
        Row("storage", summarize("create, cold cache, on demand", [s.cold_ms for s in profiled]),
            statistics.median(s.cold_ms for s in whole), "cold, fetched whole", note=note,
            details=fetched(profiled)),
        Row("storage-cold-create-first", summarize("create, cold cache, on demand, no profile",
            [first.cold_ms]), note=f"records the restore profile; fetched {first.fetched / MIB:.0f} MiB",
            details=fetched([first])),
        Row("storage-cold-create-whole", summarize("create, cold cache, blobs fetched whole",
            [s.cold_ms for s in whole]), note=f"fetched {_mib(whole, 'fetched')} MiB before ready",
            details=fetched(whole)),
        Row("storage-warm-create", warm, note="no warm pool: each create restores from the cached files"),
        Row("storage-upload", upload, note=f"{sent / MIB:.0f} MiB in {seconds:.1f} s, SeaweedFS on loopback"),
        Row("storage-cache-hit-rate", summarize("runtime cache hit rate, over capacity", [rate], unit="%"),
            note="the real BlobCache, a synthetic Zipf trace over a working set larger than its capacity",
            details=rate_details),
    ]  # fmt: skip


def _mib(samples: list[ColdSample], field: str) -> str:
    values = sorted(getattr(s, field) / MIB for s in samples)
    return f"{values[len(values) // 2]:.0f}" if values else "n/a"
