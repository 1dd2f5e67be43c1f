"""Runtime resolvers: committed snapshots as local files QEMU maps and opens.

`LocalRuntime` serves a repository on this host's filesystem: its blobs are immutable files
already, so QEMU maps the memory image and opens boot files straight from the repository (one
page-cache copy per node, no download), and disk layers are the node's qcow2 layer store
(`aenv.runtime.layers`), recorded in manifests by layer id.

`CachedRuntime` serves a remote repository (`aenv.repository.s3`) through the node's bounded
`BlobCache`: blobs are downloaded (verified) on first use, and disk layers travel as blobs. A
manifest then names its disk chain by digests, bottom first; the qcow2 header of each layer
still records the path its backing file had on the node that sealed it, so each layer is
materialized as its own cache entry, keyed by its whole chain below, and pointed at the
materialized layer under it with ``qemu-img rebase -u`` (a header-only change). A snapshot taken
on one node thus starts on any node sharing the repository.

With a `LazyMount` (`aenv.runtime.lazyfs`), what QEMU reads of a snapshot as stored (its memory
image, kernel, initramfs and tools image, and the bottom layer of its disk chain, which names no
backing file) is not downloaded before the start when it has a chunk index in the repository
and is not in the cache: it becomes a partial cache entry that QEMU opens through the node's
FUSE server, which fetches what the guest touches. Before QEMU starts, the chunks a restore read
(the blob's profile, recorded in the repository by the first node that restored from it, once
that guest answered) are fetched in a few parallel ranged reads, so a cold start costs a small,
bounded number of round trips. Deltas, device state and the upper disk layers (small, and
rewritten or read whole) are fetched whole. Once a blob is partial on a node it stays served
through the mount until it is evicted, so every sandbox from it maps the same file (one
page-cache copy) and finds its mapping by that path. If the server is gone, blobs are fetched
whole instead. With peer-to-peer transport on (`aenv.runtime.peers`), blobs fetched whole are
asked of the node's peers first, and so are the chunks prefetched before an on-demand start.

Both make one file per snapshot here: its restorable stream, spliced once from its vmstate
prefix and device state and kept under the node's `runtime/` directory until the snapshot is gone.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..repository.chunks import ChunkFile, ChunkIndex, Fetch, held_chunks
from ..repository.contract import Repository
from ..repository.manifest import MachineShape, SnapshotManifest
from ..repository.names import DIGEST_RE
from ..repository.posix import SnapshotRepository
from ..vmm import devstate
from ..vmm.launcher import BootFiles
from .cache import BlobCache, CacheStats
from .layers import LayerError, LayerStore

if TYPE_CHECKING:
    from .lazyfs import LazyMount
    from .peers import BlobSource, PeerSource

log = logging.getLogger(__name__)

STREAM_SUFFIX = ".vmstate"
HeaderCheck = Callable[[bytes], bool]  # whether a blob, by its first 16 bytes, may be served as stored


class LocalRuntime:
    """Resolves committed snapshots of a POSIX repository to local files (`RuntimeResolver`)."""

    def __init__(self, repository: SnapshotRepository, layers: LayerStore, runtime_dir: Path):
        self._repository = repository
        self._layers = layers
        self._dir = runtime_dir
        runtime_dir.mkdir(parents=True, exist_ok=True)

    def _blob(self, digest: str, owner: str | None = None) -> Path:
        """Where a blob of the snapshot `owner` is readable on this node, whole."""
        return self._repository.blob_path(digest)

    def _mapped(self, digest: str, owner: str | None = None) -> Path:
        """Where QEMU reads a blob of the snapshot `owner` (a memory image, a boot file)."""
        return self._blob(digest, owner)

    def memory_image(self, manifest: SnapshotManifest) -> Path:
        return self._mapped(manifest.memory_image, manifest.id)

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
            kernel=self._mapped(machine.kernel_digest, owner),
            initramfs=self._mapped(machine.initramfs_digest, owner),
            tools_image=self._mapped(machine.tools_digest, owner),
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
        lazy: LazyMount | None = None, peers: PeerSource | None = None,
    ) -> None:  # fmt: skip
        super().__init__(repository, layers, runtime_dir)  # type: ignore[arg-type]
        self._remote = repository
        # Where blobs come from: the repository, or peers first (aenv.runtime.peers).
        self._peers = peers
        self._source: BlobSource = peers if peers is not None else repository
        self.cache = cache
        self.lazy = lazy
        # Blobs started on demand whose restore profile is not recorded yet, by the snapshot
        # whose restore will record it: (digest, index).
        self._unprofiled: dict[str, list[tuple[str, ChunkIndex]]] = {}
        self._profiles_lock = threading.Lock()
        if lazy is not None:
            cache.on_evict = lazy.withdraw

    def _blob(self, digest: str, owner: str | None = None) -> Path:
        def fetch(dest: Path) -> None:
            self._source.fetch_blob(digest, dest)

        return self.cache.get(digest.removeprefix("sha256:"), fetch, owner)

    def _mapped(self, digest: str, owner: str | None = None) -> Path:
        return self._on_demand(digest, owner) or self._blob(digest, owner)

    def _on_demand(self, digest: str, owner: str | None, check: HeaderCheck | None = None) -> Path | None:
        """The blob's file on the FUSE mount if it is a partial entry, or can become one (only
        for a snapshot's start: `owner`)."""
        lazy = self.lazy
        key = digest.removeprefix("sha256:")
        if lazy is None:
            return None
        partial = self.cache.is_partial(key)
        if not partial and owner is not None:
            partial = self._start_partial(digest, owner, check)
        if not partial or not lazy.alive():  # a server gone: new VMs read a whole copy instead
            return None
        self.cache.get_partial(key, 0, owner)  # a hit: touch it and record the owner
        return lazy.path(key)

    def _start_partial(self, digest: str, owner: str, check: HeaderCheck | None = None) -> bool:
        """Make a missing blob a partial entry served on demand, its restore profile prefetched.

        False if it cannot be (no chunk index, the FUSE server cannot run, or `check` refuses the
        blob's first bytes): it is then fetched whole.
        """
        assert self.lazy is not None
        key = digest.removeprefix("sha256:")
        if self.cache.path(key).exists() and not self.cache.is_partial(key):
            return False  # whole in the cache already
        reader = self.lazy.reader
        index = reader.chunk_index(digest)
        if index is None or (check is not None and not check(reader.read_range(digest, 0, 16))):
            return False
        try:
            self.lazy.ensure()
        except OSError:
            log.warning("on-demand loading is unavailable: fetching blobs whole", exc_info=True)
            return False
        path, existed = self.cache.get_partial(key, index.size, owner)
        if existed and not self.cache.is_partial(key):
            return False  # filled whole by another thread meanwhile
        self.lazy.publish(key, index)  # first: a concurrent start may hand the file to QEMU now
        fetch: Fetch = functools.partial(reader.read_range, digest)
        if self._peers is not None:
            fetch = self._peers.ranges(digest, index, fetch)
        chunks = ChunkFile(path, index, fetch)
        profile = reader.profile(digest)
        chunks.prefetch({0, *(i for i in profile or () if 0 <= i < len(index.digests))})
        if profile is None:
            with self._profiles_lock:
                self._unprofiled.setdefault(owner, []).append((digest, index))
        return True

    def restored(self, manifest: SnapshotManifest) -> None:
        """A guest restored from the snapshot answers: what the partial copies of its blobs hold
        now is what a restore reads. Recorded in the background for nodes that start later."""
        with self._profiles_lock:
            blobs = self._unprofiled.pop(manifest.id, [])
        if not blobs or self.lazy is None:
            return
        reader = self.lazy.reader

        def record() -> None:
            for digest, index in blobs:
                chunks = held_chunks(self.cache.path(digest.removeprefix("sha256:")), index)
                try:
                    reader.record_profile(digest, chunks)
                except Exception:  # a later cold start records it
                    log.warning("could not record the restore profile of %s", digest, exc_info=True)

        threading.Thread(target=record, name="aenv-restore-profile", daemon=True).start()

    def cache_stats(self) -> CacheStats | None:
        return self.cache.stats()

    def prepare(self, manifest: SnapshotManifest) -> None:
        """Make the snapshot's files local (or served on demand), its disk chain materialized,
        all pinned by it."""
        self.boot_files(manifest.machine, manifest.id)
        self.memory_image(manifest)
        for digest in (*manifest.memory_deltas, manifest.device_state):
            self._blob(digest, manifest.id)
        self.template_stream(manifest)
        self.top_layer(manifest)

    def top_layer(self, manifest: SnapshotManifest) -> Path:
        below: Path | None = None
        chain = hashlib.sha256()
        for layer in manifest.disk_layers:
            chain.update(layer.encode() + b"\n")
            if not DIGEST_RE.fullmatch(layer):  # a layer id: a manifest written by a POSIX node
                below = self._layers.path(layer)
            elif below is None and (bottom := self._on_demand(layer, manifest.id, _no_backing)) is not None:
                below = bottom  # a bottom layer names no backing file: its blob is the file
                chain.update(b"on demand\n")  # the layers above name this path as their backing
            else:
                below = self.cache.get(
                    f"layer-{chain.hexdigest()[:40]}.qcow2", self._layer_filler(layer, below), manifest.id
                )
        if below is None:
            raise LayerError(f"snapshot {manifest.id} has no disk layers")
        return below

    def _layer_filler(self, digest: str, below: Path | None) -> Callable[[Path], None]:
        def fill(dest: Path) -> None:
            self._source.fetch_blob(digest, dest)
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


def _no_backing(header: bytes) -> bool:
    """Whether a qcow2 header names no backing file (its backing_file_offset, bytes 8-15, is 0)."""
    return header[:4] == b"QFI\xfb" and int.from_bytes(header[8:16], "big") == 0
