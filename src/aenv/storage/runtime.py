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

Both make one file per snapshot here: its restorable stream, spliced once from its vmstate
prefix and device state and kept under the node's `runtime/` directory until the snapshot is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from ..snapshot import devstate
from ..snapshot.manifest import DIGEST_RE, MachineShape, SnapshotManifest
from ..snapshot.repository import SnapshotRepository
from ..vmm.launcher import BootFiles
from .cache import BlobCache, CacheStats
from .layers import LayerError, LayerStore
from .protocols import Repository

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

    def __init__(self, repository: Repository, layers: LayerStore, runtime_dir: Path, cache: BlobCache):
        super().__init__(repository, layers, runtime_dir)  # type: ignore[arg-type]
        self._remote = repository
        self.cache = cache

    def _blob(self, digest: str, owner: str | None = None) -> Path:
        def fetch(dest: Path) -> None:
            self._remote.fetch_blob(digest, dest)

        return self.cache.get(digest.removeprefix("sha256:"), fetch, owner)

    def cache_stats(self) -> CacheStats | None:
        return self.cache.stats()

    def prepare(self, manifest: SnapshotManifest) -> None:
        """Fetch every blob the snapshot needs and materialize its disk chain, all pinned by it."""
        self.boot_files(manifest.machine, manifest.id)
        for digest in (manifest.memory_image, *manifest.memory_deltas, manifest.device_state):
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
