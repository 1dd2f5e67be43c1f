"""The node's storage from its settings: the repository, the runtime resolver, the heartbeat.

`AENV_REPOSITORY` picks the backend: a directory (posix_fs, `<home>/repository` by default,
usable on a shared filesystem too) or `s3://BUCKET/PREFIX` (any S3-compatible store, reached at
`AENV_S3_ENDPOINT` in `AENV_S3_REGION`). An s3 repository is read through a runtime cache in
`<home>/cache` of `AENV_CACHE_CAPACITY_MIB`, its memory images loaded on demand through the
node's FUSE server (`aenv.runtime.lazyfs`) unless `AENV_LAZY_LOADING=false` or the host has no
FUSE; a posix one is used in place. With `AENV_P2P=true` an s3 node's cache asks its peers
for blobs before the store (`aenv.runtime.peers`). This is the one place that tells the
backends apart by the repository's URL; everything after asks the repository
(`Repository.shared`, `Repository.local_root`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import Settings
from ..paths import layers_dir, repository_dir
from ..repository.contract import Repository
from ..repository.location import S3Location, is_s3_url
from ..repository.posix import SnapshotRepository
from .cache import BlobCache
from .contract import RuntimeResolver
from .layers import LayerStore
from .resolvers import CachedRuntime

if TYPE_CHECKING:
    from .lazyfs import LazyMount
    from .peers import Peers, PeerSource

log = logging.getLogger(__name__)

STOP_WAIT = 2.0  # seconds a stopping node waits for a heartbeat in flight


class Heartbeat:
    """Tells the repository every `interval` seconds that this node lives, so its leases hold."""

    def __init__(self, repository: Repository, interval: float):
        self._repository = repository
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aenv-heartbeat", daemon=True)

    def start(self) -> None:
        self._repository.heartbeat()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._repository.heartbeat()
            except Exception:  # the store is unreachable for now: try again next time
                log.warning("repository heartbeat failed", exc_info=True)

    def stop(self) -> None:
        """Stop beating; a heartbeat in flight (retrying an unreachable store) is not waited for
        beyond `STOP_WAIT`: the thread is a daemon."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(min(self._interval, STOP_WAIT))


@dataclass
class Storage:
    """What `open_storage` made; `runtime` is None for a posix repository (the engine's default)."""

    repository: Repository
    runtime: RuntimeResolver | None
    heartbeat: Heartbeat
    cache: BlobCache | None = None
    lazy: LazyMount | None = None  # ends with the node process, or with `LazyMount.stop`
    peers: PeerSource | None = None  # blobs from peers first (`aenv.runtime.peers`), if P2P is on

    def close(self) -> None:
        """Stop the heartbeat and the on-demand loading server (else it ends with this process):
        for a home whose VMs are all gone."""
        self.heartbeat.stop()
        if self.peers is not None:
            self.peers.close()
        if self.lazy is not None:
            self.lazy.stop()


def open_storage(settings: Settings, node: str, peers: Peers | None = None) -> Storage:
    """The repository named by the settings, its resolver and a started heartbeat.

    `peers`: whom an s3 node with P2P on asks for blobs (in a cluster, the scheduler's nodes:
    `aenv.cluster.peers`); by default the `p2p_peers` list.
    """
    home = settings.home_path
    if is_s3_url(settings.repository):
        from ..repository.s3 import S3Repository  # boto3 is only needed for this backend

        location = S3Location.from_url(
            settings.repository, endpoint=settings.s3_endpoint or None, region=settings.s3_region,
            access_key=settings.s3_access_key, secret_key=settings.s3_secret_key,
        )  # fmt: skip
        repository: Repository = S3Repository(
            location, home / "staging", node=node, lease_ttl=settings.lease_ttl, create_bucket=True
        )
        cache = BlobCache(home / "cache", settings.cache_capacity_mib << 20, repository.local_leases)
        lazy = _lazy_mount(settings, cache, location)
        source = _peer_source(settings, repository, peers) if settings.p2p else None
        runtime: RuntimeResolver | None = CachedRuntime(
            repository, LayerStore(layers_dir(home)), home / "runtime", cache, lazy, source
        )
        log.info("repository %s at %s, runtime cache %d MiB", settings.repository, location.endpoint,
                 settings.cache_capacity_mib)  # fmt: skip
    else:
        root = Path(settings.repository) if settings.repository else repository_dir(home)
        repository = SnapshotRepository(root, node=node, lease_ttl=settings.lease_ttl)
        runtime, cache, lazy, source = None, None, None, None
    heartbeat = Heartbeat(repository, settings.lease_ttl / 4)
    heartbeat.start()
    return Storage(repository, runtime, heartbeat, cache, lazy, source)


def _peer_source(settings: Settings, repository: Repository, peers: Peers | None) -> PeerSource:
    """Blobs from peers first: the given ones (a cluster's), else the `p2p_peers` list."""
    from .peers import PeerSource, StaticPeers

    if peers is None:
        own = (settings.node_addr or f"http://{settings.api_addr}").rstrip("/")
        peers = StaticPeers(tuple(settings.peer_urls), own)
    log.info("peer-to-peer blob transport on: peers from %s", settings.scheduler_url or settings.p2p_peers)
    return PeerSource(repository, peers, settings.cluster_secret, settings.api_key)


def _lazy_mount(settings: Settings, cache: BlobCache, location: S3Location) -> LazyMount | None:
    """The node's on-demand loading, mounted now: before the VMMs' root is built (it must be in
    it), and so that a missing FUSE shows at start, not at the first cold start."""
    from .lazyfs import LazyMount

    if not settings.lazy_loading:
        return None
    lazy = LazyMount.for_home(settings.home_path, cache.root, location)
    try:
        lazy.ensure()
    except OSError:
        log.warning("on-demand loading is off: memory images are fetched whole", exc_info=True)
        return None
    return lazy
