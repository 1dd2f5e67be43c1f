"""The runtime tier's contract: a committed snapshot's parts as files a QEMU process opens.

The engine asks a `RuntimeResolver` for the files of a snapshot it holds a lease on, and never
builds a path into the repository itself (the repository's own contract is
`aenv.repository.contract.Repository`). A posix repository's blobs are used in place
(`aenv.runtime.resolvers.LocalRuntime`); an s3 one's are copied into a bounded node cache and
memory images loaded on demand (`CachedRuntime`). The contract lives here, not beside the
repository's, because it speaks of what QEMU boots from (`aenv.vmm.launcher.BootFiles`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..repository.manifest import MachineShape, SnapshotManifest
    from ..vmm.launcher import BootFiles
    from .cache import CacheStats


class RuntimeResolver(Protocol):
    """A committed snapshot's parts as local files a QEMU process can map and open.

    Callers hold a repository lease on the snapshot for as long as they use the files; that
    lease is what keeps a bounded cache from evicting them. Every path returned is read-only
    for the caller: the memory image in particular is mapped copy-on-write by every clone.
    """

    def memory_image(self, manifest: SnapshotManifest) -> Path: ...
    def memory_deltas(self, manifest: SnapshotManifest) -> list[Path]: ...
    def template_stream(self, manifest: SnapshotManifest) -> Path:
        """The snapshot's own restorable stream: its vmstate prefix and its device state."""
        ...

    def vmstate_prefix(self, manifest: SnapshotManifest) -> bytes:
        """The stream prefix later device states of a sandbox from this snapshot are spliced onto."""
        ...

    def boot_files(self, machine: MachineShape) -> BootFiles: ...
    def layer_path(self, layer_id: str) -> Path: ...
    def prepare(self, manifest: SnapshotManifest) -> None:
        """Make every file of the snapshot local now (blocking: call it in a worker thread)."""
        ...

    def restored(self, manifest: SnapshotManifest) -> None:
        """A guest restored from the snapshot answers (its envd took `/init`): what it read of the
        memory image until now is what a restore reads (the prefetch list of on-demand loading)."""
        ...

    def top_layer(self, manifest: SnapshotManifest) -> Path:
        """The snapshot's topmost sealed disk layer, its backing chain in place: new layers go on it."""
        ...

    def keep_local(self, path: Path, digest: str) -> None:
        """`path` (immutable, about to be stored as blob `digest`) may serve reads of that blob."""
        ...

    def publish_layers(self, layers: list[str]) -> tuple[str, ...]:
        """What a manifest records for this disk chain (node layer ids, or repository digests).

        Blocking: a remote repository uploads the sealed layers it does not hold yet.
        """
        ...

    def cache_stats(self) -> CacheStats | None:
        """The node's runtime cache, if files are cached (None: used in place)."""
        ...

    def prune(self, is_live: Callable[[str], bool]) -> int:
        """Remove the runtime files of snapshots that are no longer live; returns how many."""
        ...
