"""Runtime resolvers: committed snapshots as local files QEMU maps and opens.

`LocalRuntime` serves a repository on this host's filesystem: its blobs are immutable files
already, so QEMU maps the memory image and opens boot files straight from the repository (one
page-cache copy per node, no download), and disk layers are the node's qcow2 layer store
(`aenv.storage.layers`), recorded in manifests by layer id.

`CachedRuntime` serves a remote repository (`aenv.storage.s3`) through the node's bounded
`BlobCache`: blobs are downloaded (verified) on first use, and disk layers travel as blobs. A
manifest then names its disk chain by digests, bottom first; the qcow2 header of each layer
still records the path its backing file had on the node that sealed it, so each layer is
materialized as its own cache entry, keyed by its whole chain below, and pointed at the
materialized layer under it with ``qemu-img rebase -u`` (a header-only change). A snapshot taken
on one node thus starts on any node sharing the repository.

With a `LazyMount` (`aenv.storage.lazyfs`), a memory image that has a chunk index in the
repository and is not in the cache is not downloaded before the start: it becomes a partial
cache entry that QEMU maps through the node's FUSE server, which fetches what the guest
touches. Before QEMU starts, the chunks a restore from the image read (its profile, recorded in
the repository by the first node that restored from it, after that guest answered) are fetched
in a few parallel ranged reads, so a cold start costs a small, bounded number of round trips.
Once an image is partial on a node it stays served through the mount until it is evicted, so
every sandbox from it maps the same file (one page-cache copy) and finds its mapping by that
path. If the server is gone, the image is fetched whole instead.

Both make one file per snapshot here: its restorable stream, spliced once from its vmstate
prefix and device state and kept under the node's `runtime/` directory until the snapshot is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..snapshot import devstate
from ..snapshot.manifest import DIGEST_RE, MachineShape, SnapshotManifest
from ..snapshot.repository import SnapshotRepository
from ..vmm.launcher import BootFiles
from .cache import BlobCache, CacheStats
from .chunks import ChunkFile, ChunkIndex, held_chunks
from .layers import LayerError, LayerStore
from .protocols import Repository

if TYPE_CHECKING:
    from .lazyfs import LazyMount

log = logging.getLogger(__name__)

STREAM_SUFFIX = ".vmstate"


class LocalRuntime:
    """Resolves committed snapshots of a POSIX repository to local files (`RuntimeResolver`)."""

    def __init__(self, repository: SnapshotRepository, layers: LayerStore, runtime_dir: Path):
        self._repository = repository
        self._layers = layers
        self._dir = runtime_dir
        runtime_dir.mkdir(parents=True, exist_ok=True)

    def _blob(self, digest: str, owner: str | None = None) -> Path:
        """Where a blob of the snapshot `owner` is readable on this node."""
        return self._repository.blob_path(digest)

    def memory_image(self, manifest: SnapshotManifest) -> Path:
        return self._blob(manifest.memory_image, manifest.id)

    def memory_deltas(self, manifest: SnapshotManifest) -> list[Path]:
        return [self._blob(d, manifest.id) for d in manifest.memory_deltas]

    def vmstate_prefix(self, manifest: SnapshotManifest) -> bytes:
        return self._blob(manifest.vmstate_prefix, manifest.id).read_bytes()

    def template_stream(self, manifest: SnapshotManifest) -> Path:
        """Spliced on first use; written to a temporary and renamed, so readers never see half."""
        path = self._dir / f"{manifest.id}{STREAM_SUFFIX}"
        if not path.exists():
            devices = self._blob(manifest.device_state, manifest.id).read_bytes()
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(devstate.splice(self.vmstate_prefix(manifest), devices))
            os.replace(tmp, path)
        return path

    def boot_files(self, machine: MachineShape, owner: str | None = None) -> BootFiles:
        return BootFiles(
            kernel=self._blob(machine.kernel_digest, owner),
            initramfs=self._blob(machine.initramfs_digest, owner),
            tools_image=self._blob(machine.tools_digest, owner),
            cmdline=machine.cmdline,
        )

    def layer_path(self, layer_id: str) -> Path:
        return self._layers.path(layer_id)

    def prepare(self, manifest: SnapshotManifest) -> None:
        """Nothing to fetch: the repository's files are used in place."""

    def restored(self, manifest: SnapshotManifest) -> None:
        """Nothing to learn: the repository's files are all here."""

    def top_layer(self, manifest: SnapshotManifest) -> Path:
        return self._layers.path(manifest.disk_layers[-1])

    def keep_local(self, path: Path, digest: str) -> None:
        """Nothing to keep: the stored blob is the file itself."""

    def publish_layers(self, layers: list[str]) -> tuple[str, ...]:
        """Layer ids, as they are: sealed layers stay in this node's layer store."""
        return tuple(layers)

    def cache_stats(self) -> CacheStats | None:
        """None: nothing is cached, the repository's files are used in place."""
        return None

    def prune(self, is_live: Callable[[str], bool]) -> int:
        removed = 0
        for stream in self._dir.glob(f"*{STREAM_SUFFIX}"):
            if not is_live(stream.stem):
                stream.unlink(missing_ok=True)
                removed += 1
        return removed


class CachedRuntime(LocalRuntime):
    """Resolves snapshots of a remote repository through the node's runtime cache."""

    def __init__(
        self, repository: Repository, layers: LayerStore, runtime_dir: Path, cache: BlobCache,
        lazy: LazyMount | None = None,
    ) -> None:  # fmt: skip
        super().__init__(repository, layers, runtime_dir)  # type: ignore[arg-type]
        self._remote = repository
        self.cache = cache
        self.lazy = lazy
        self._unprofiled: dict[str, ChunkIndex] = {}  # images started on demand with no profile yet
        self._profiles_lock = threading.Lock()
        if lazy is not None:
            cache.on_evict = lazy.withdraw

    def memory_image(self, manifest: SnapshotManifest) -> Path:
        return self._memory(manifest.memory_image, manifest.id)

    def _memory(self, digest: str, owner: str) -> Path:
        """The image in the cache if it is whole there, else loaded on demand if it can be."""
        key = digest.removeprefix("sha256:")
        lazy = self.lazy
        if lazy is None or not (self.cache.is_partial(key) or self._start_partial(digest, owner)):
            return self._blob(digest, owner)
        if not lazy.alive():  # its server is gone: new VMs map a whole copy instead
            return self._blob(digest, owner)
        self.cache.get_partial(key, 0, owner)  # a hit: touch it and record the owner
        return lazy.path(key)

    def _start_partial(self, digest: str, owner: str) -> bool:
        """Make a missing image a partial entry served on demand, its restore profile prefetched.

        False if it cannot be (no chunk index, or the FUSE server cannot run): fetch it whole.
        """
        assert self.lazy is not None
        key = digest.removeprefix("sha256:")
        if self.cache.path(key).exists() and not self.cache.is_partial(key):
            return False  # whole in the cache already
        reader = self.lazy.reader
        index = reader.chunk_index(digest)
        if index is None:
            return False
        try:
            self.lazy.ensure()
        except OSError:
            log.warning("lazy loading is unavailable, fetching memory images whole", exc_info=True)
            return False
        path, existed = self.cache.get_partial(key, index.size, owner)
        if existed and not self.cache.is_partial(key):
            return False  # filled whole by another thread meanwhile
        self.lazy.publish(key, index)
        profile = reader.profile(digest)
        if profile is None:
            with self._profiles_lock:
                self._unprofiled.setdefault(key, index)
        else:
            chunks = ChunkFile(path, index, lambda offset, length: reader.read_range(digest, offset, length))
            chunks.prefetch(i for i in profile if 0 <= i < len(index.digests))
        return True

    def restored(self, manifest: SnapshotManifest) -> None:
        """A guest restored from the snapshot answers: what its image's copy holds now is what a
        restore reads. Recorded in the background for the nodes that start from it later."""
        key = manifest.memory_image.removeprefix("sha256:")
        with self._profiles_lock:
            index = self._unprofiled.pop(key, None)
        if index is None or self.lazy is None:
            return
        reader = self.lazy.reader

        def record() -> None:
            chunks = held_chunks(self.cache.path(key), index)
            try:
                reader.record_profile(manifest.memory_image, chunks)
            except Exception:  # a later cold start records it
                log.warning("could not record the restore profile of %s", key, exc_info=True)
                with self._profiles_lock:
                    self._unprofiled.setdefault(key, index)

        threading.Thread(target=record, name="aenv-restore-profile", daemon=True).start()

    def _blob(self, digest: str, owner: str | None = None) -> Path:
        def fetch(dest: Path) -> None:
            self._remote.fetch_blob(digest, dest)

        return self.cache.get(digest.removeprefix("sha256:"), fetch, owner)

    def cache_stats(self) -> CacheStats | None:
        return self.cache.stats()

    def prepare(self, manifest: SnapshotManifest) -> None:
        """Fetch every blob the snapshot needs and materialize its disk chain, all pinned by it."""
        self.boot_files(manifest.machine, manifest.id)
        self._memory(manifest.memory_image, manifest.id)
        for digest in (*manifest.memory_deltas, manifest.device_state):
            self._blob(digest, manifest.id)
        self.template_stream(manifest)
        self.top_layer(manifest)

    def top_layer(self, manifest: SnapshotManifest) -> Path:
        below: Path | None = None
        chain = hashlib.sha256()
        for layer in manifest.disk_layers:
            if not DIGEST_RE.fullmatch(layer):  # a layer id: a manifest written by a POSIX node
                below = self._layers.path(layer)
                chain.update(layer.encode() + b"\n")
                continue
            chain.update(layer.encode() + b"\n")
            below = self.cache.get(
                f"layer-{chain.hexdigest()[:40]}.qcow2", self._layer_filler(layer, below), manifest.id
            )
        if below is None:
            raise LayerError(f"snapshot {manifest.id} has no disk layers")
        return below

    def _layer_filler(self, digest: str, below: Path | None) -> Callable[[Path], None]:
        def fill(dest: Path) -> None:
            self._remote.fetch_blob(digest, dest)
            backing = ["-b", str(below), "-F", "qcow2"] if below is not None else ["-b", ""]
            done = subprocess.run(
                ["qemu-img", "rebase", "-u", "-f", "qcow2", *backing, str(dest)], capture_output=True
            )
            if done.returncode != 0:
                raise LayerError(f"qemu-img rebase failed: {done.stderr.decode(errors='replace').strip()}")

        return fill

    def keep_local(self, path: Path, digest: str) -> None:
        """A new memory image is already here: the node that built it does not download it back.

        Only on the cache's filesystem (a hardlink); elsewhere the first use fetches it.
        """
        with contextlib.suppress(OSError):
            self.cache.adopt(digest.removeprefix("sha256:"), path)

    def publish_layers(self, layers: list[str]) -> tuple[str, ...]:
        """Upload each sealed layer of this node (digests already in the repository stay)."""
        return tuple(
            layer if DIGEST_RE.fullmatch(layer) else self._remote.put_blob(self._layers.path(layer))
            for layer in layers
        )
