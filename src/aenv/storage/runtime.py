"""The runtime resolver for a repository on this host's filesystem: files are used in place.

Blobs of a POSIX repository are immutable files already, so QEMU maps the memory image and opens
boot files straight from the repository (one page-cache copy per node, no download). The one
file made here is each snapshot's restorable stream, spliced once from its vmstate prefix and
device state and kept under the node's `runtime/` directory until the snapshot is gone. Disk
layers are the node's qcow2 layer store (`aenv.storage.layers`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..snapshot import devstate
from ..snapshot.manifest import MachineShape, SnapshotManifest
from ..snapshot.repository import SnapshotRepository
from ..vmm.launcher import BootFiles
from .layers import LayerStore

STREAM_SUFFIX = ".vmstate"


class LocalRuntime:
    """Resolves committed snapshots of a POSIX repository to local files (`RuntimeResolver`)."""

    def __init__(self, repository: SnapshotRepository, layers: LayerStore, runtime_dir: Path):
        self._repository = repository
        self._layers = layers
        self._dir = runtime_dir
        runtime_dir.mkdir(parents=True, exist_ok=True)

    def memory_image(self, manifest: SnapshotManifest) -> Path:
        return self._repository.blob_path(manifest.memory_image)

    def memory_deltas(self, manifest: SnapshotManifest) -> list[Path]:
        return [self._repository.blob_path(d) for d in manifest.memory_deltas]

    def vmstate_prefix(self, manifest: SnapshotManifest) -> bytes:
        return self._repository.blob_path(manifest.vmstate_prefix).read_bytes()

    def template_stream(self, manifest: SnapshotManifest) -> Path:
        """Spliced on first use; written to a temporary and renamed, so readers never see half."""
        path = self._dir / f"{manifest.id}{STREAM_SUFFIX}"
        if not path.exists():
            devices = self._repository.blob_path(manifest.device_state).read_bytes()
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(devstate.splice(self.vmstate_prefix(manifest), devices))
            os.replace(tmp, path)
        return path

    def boot_files(self, machine: MachineShape) -> BootFiles:
        return BootFiles(
            kernel=self._repository.blob_path(machine.kernel_digest),
            initramfs=self._repository.blob_path(machine.initramfs_digest),
            tools_image=self._repository.blob_path(machine.tools_digest),
            cmdline=machine.cmdline,
        )

    def layer_path(self, layer_id: str) -> Path:
        return self._layers.path(layer_id)

    def prune(self, is_live: Callable[[str], bool]) -> int:
        removed = 0
        for stream in self._dir.glob(f"*{STREAM_SUFFIX}"):
            if not is_live(stream.stem):
                stream.unlink(missing_ok=True)
                removed += 1
        return removed
