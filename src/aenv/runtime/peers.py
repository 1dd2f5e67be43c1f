"""Peer-to-peer blob transport (optional, off by default): nodes sharing an s3 repository fetch
blobs from each other before the object store.

With `AENV_P2P=true` a node serves the committed blobs it holds whole in its runtime cache
(`GET /p2p/blobs/<hex>` on its API port, byte ranges included) and its runtime cache asks its
peers for a missing blob, in turn, before the repository (`PeerSource.fetch_blob`, and
`PeerSource.ranges` for on-demand loading's prefetch). The object
store stays the source of truth, and P2P only reads: committing and uploading are unchanged.

Decisions, and why:

- Verified whatever the source: a blob from a peer is rehashed against its digest (its name)
  before the cache takes it, as one from the store is; a mismatch, an error answer or a timeout
  is logged and the next peer, then the store, is asked. A bad peer costs time, never data.
- A node serves only what it holds whole (complete cache entries, which are verified copies):
  never a partial on-demand copy, and it never fetches on a peer's behalf, so a request is one
  hop (no loops, no amplification) and a node that lacks the blob answers 404 at once.
- Peers: in a cluster, the nodes the scheduler lists that are not down (draining nodes still
  hold their blobs), asked at most every few seconds (`aenv.cluster.peers`, given to
  `open_storage` by the node); otherwise `AENV_P2P_PEERS`. The node itself is left out (by id
  and by address).
- Plain HTTP on the API port, not a second listener or transport (the reference system uses
  iroh): nodes already reach each other there, and the route is guarded as every other one: by
  the cluster secret in a cluster (a node there takes no call without it, `aenv.cluster.auth`),
  else by the API key, which nodes listed in `AENV_P2P_PEERS` then share (`AENV_API_KEY`). A
  peer that refuses (401) is skipped like any other failing one.
- Whole blobs, and the prefetch of on-demand loading (the chunks a restore reads, fetched by the
  node before QEMU starts: `PeerSource.ranges`, each chunk checked against the blob's chunk
  index). What the FUSE server fetches later, as the guest touches it (`aenv.runtime.lazyfs`,
  its own process), still comes from the store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx
from aiohttp import web
from prometheus_client.core import CounterMetricFamily

from .. import __version__
from ..headers import CLUSTER_SECRET_HEADER
from ..repository.chunks import ChunkIndex, Fetch
from ..repository.errors import RepositoryError
from ..repository.files import CHUNK, write_fetched
from ..repository.names import DIGEST_RE, check_digest
from .cache import BlobCache

log = logging.getLogger(__name__)

BLOB_PATH = "/p2p/blobs/{hex}"
# A peer answers from its local disk: one that cannot connect in a second, or stalls for ten
# seconds between reads, is skipped for the next source.
PEER_TIMEOUT = httpx.Timeout(10.0, connect=1.0)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Peers(Protocol):
    def urls(self) -> list[str]:
        """Base URLs of the peers to ask, this node excluded."""
        ...


class BlobSource(Protocol):
    def fetch_blob(self, digest: str, dest: Path) -> None: ...


def peer_headers(secret: str | None, api_key: str | None = None) -> dict[str, str]:
    """What a node presents to another: the cluster secret in a cluster, else the API key."""
    headers = {"User-Agent": f"aenv/{__version__}"}
    if secret:
        headers[CLUSTER_SECRET_HEADER] = secret
    elif api_key:
        headers["X-API-Key"] = api_key
    return headers


@dataclass(frozen=True)
class StaticPeers:
    """A fixed list (`AENV_P2P_PEERS`), without this node's own address."""

    peers: tuple[str, ...]
    own: str = ""

    def urls(self) -> list[str]:
        return [url for url in self.peers if url != self.own]


class PeerSource:
    """Blobs from peers first, then from the repository (`BlobSource`), each verified.

    Counts what came from where (`collect`: Prometheus counters).
    """

    def __init__(
        self, store: BlobSource, peers: Peers, secret: str | None = None, api_key: str | None = None
    ):
        self.store = store
        self.peers = peers
        self._client = httpx.Client(headers=peer_headers(secret, api_key), timeout=PEER_TIMEOUT)
        self._lock = threading.Lock()
        self.blobs = {"peer": 0, "store": 0}
        self.bytes = {"peer": 0, "store": 0}
        self.range_bytes = {"peer": 0, "store": 0}  # on-demand loading's ranged reads
        self.rejected = 0  # peer answers that failed: errors, timeouts, bad digests

    def fetch_blob(self, digest: str, dest: Path) -> None:
        """Write the blob to the new file `dest`: from the first peer holding it, else the store."""
        check_digest(digest)
        for url in self.peers.urls():
            try:
                self._from_peer(url, digest, dest)
            except (httpx.HTTPError, RepositoryError, OSError) as exc:
                with self._lock:
                    self.rejected += 1
                log.warning("peer %s did not give blob %s: %s", url, digest, exc)
                continue
            except _Absent:
                continue
            self._count("peer", dest)
            return
        self.store.fetch_blob(digest, dest)
        self._count("store", dest)

    def _from_peer(self, url: str, digest: str, dest: Path) -> None:
        hex_digest = digest.removeprefix("sha256:")
        with self._client.stream("GET", url + BLOB_PATH.format(hex=hex_digest)) as response:
            if response.status_code == 404:
                raise _Absent
            response.raise_for_status()
            write_fetched(dest, response.iter_bytes(CHUNK), digest)

    def ranges(self, digest: str, index: ChunkIndex, store: Fetch) -> Fetch:
        """Ranged reads of blob `digest` for on-demand loading: whole chunks from peers first,
        each checked against `index`; other reads, and any a peer fails, from `store`.

        A peer that does not hold the blob (404) is not asked again for it by this reader.
        """
        hex_digest = check_digest(digest).removeprefix("sha256:")
        lacking: set[str] = set()

        def fetch(offset: int, length: int) -> bytes:
            urls = (
                [u for u in self.peers.urls() if u not in lacking] if offset % index.chunk_size == 0 else []
            )
            for url in urls:
                try:
                    data = self._range_from_peer(url + BLOB_PATH.format(hex=hex_digest), offset, length)
                except _Absent:
                    lacking.add(url)
                    continue
                except httpx.HTTPError as exc:
                    problem = str(exc)
                else:
                    if index.verified(offset, data):
                        self._count_range("peer", len(data))
                        return data
                    problem = "its bytes do not match the blob's chunk index"
                with self._lock:
                    self.rejected += 1
                log.warning(
                    "peer %s did not give bytes %d+%d of %s: %s", url, offset, length, digest, problem
                )
            data = store(offset, length)
            self._count_range("store", len(data))
            return data

        return fetch

    def _range_from_peer(self, url: str, offset: int, length: int) -> bytes:
        response = self._client.get(url, headers={"Range": f"bytes={offset}-{offset + length - 1}"})
        if response.status_code == 404:
            raise _Absent
        response.raise_for_status()
        return response.content

    def _count_range(self, source: str, size: int) -> None:
        with self._lock:
            self.range_bytes[source] += size

    def _count(self, source: str, dest: Path) -> None:
        size = dest.stat().st_size
        with self._lock:
            self.blobs[source] += 1
            self.bytes[source] += size

    def collect(self) -> Iterator[CounterMetricFamily]:
        """Prometheus counters (a collector for the node's registry)."""
        with self._lock:
            blobs, sizes, ranges = dict(self.blobs), dict(self.bytes), dict(self.range_bytes)
            rejected = self.rejected
        for name, values, text in (
            (
                "aenv_p2p_fetched_blobs",
                blobs,
                "Whole blobs the runtime cache fetched, by source (peer or store)",
            ),
            ("aenv_p2p_fetched_bytes", sizes, "Bytes of whole blobs the runtime cache fetched, by source"),
            ("aenv_p2p_range_bytes", ranges, "Bytes prefetched for on-demand loading, by source"),
        ):
            family = CounterMetricFamily(name, text, labels=["source"])
            for source, value in values.items():
                family.add_metric([source], value)
            yield family
        yield CounterMetricFamily("aenv_p2p_rejected", "Peer answers refused (errors, bad digests)", rejected)

    def close(self) -> None:
        self._client.close()


class _Absent(Exception):
    """The peer does not hold the blob whole (its 404): the next source is asked, nothing logged."""


class BlobServer:
    """The route peers fetch blobs from; `cache` None: P2P is off here, every blob is 404."""

    def __init__(self, cache: BlobCache | None):
        self.cache = cache
        self.served = 0

    def route(self) -> tuple[str, str, Handler]:
        return ("GET", BLOB_PATH, self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.cache is None:
            raise web.HTTPNotFound(text="peer-to-peer blob transport is off on this node")
        hex_digest = request.match_info["hex"]
        if not DIGEST_RE.fullmatch("sha256:" + hex_digest):
            raise web.HTTPBadRequest(text="a blob is named by the 64 lowercase hex digits of its sha256")
        path = self.cache.whole(hex_digest)
        if path is None:
            raise web.HTTPNotFound(text=f"this node holds no whole copy of blob sha256:{hex_digest}")
        self.served += 1
        return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})

    def collect(self) -> Iterator[CounterMetricFamily]:
        """A Prometheus counter (a collector for the node's registry)."""
        yield CounterMetricFamily(
            "aenv_p2p_served", "Blob requests this node answered for peers", self.served
        )
