"""The two storage seams: the durable repository and the node's runtime resolver.

Snapshots live in three tiers (AgentENV's split, issue 11): the builder's staging area
(captures in progress, read by nobody else), the committed repository (the durable truth, which
may be shared by several nodes) and the node's runtime files (what QEMU maps and opens). The
engine talks to the second through `Repository` and to the third through `RuntimeResolver`, and
never builds a path into either itself: a remote repository or a bounded node cache only adds an
implementation of these protocols. Today's implementations are the POSIX directory
(`aenv.snapshot.repository.SnapshotRepository`) and the in-place resolver
(`aenv.storage.runtime.LocalRuntime`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..snapshot.manifest import MachineShape, SnapshotManifest
    from ..snapshot.repository import GcReport, PendingMark
    from ..vmm.launcher import BootFiles
    from .cache import CacheStats


class Repository(Protocol):
    """Committed snapshots: content-addressed blobs, manifests, aliases, leases and gc.

    A snapshot exists exactly when its manifest is committed, and its manifest is committed
    last, after every blob it names is stored. A lease (holder = a sandbox or warm VM id) pins a
    snapshot: deleting it is deferred until the last lease is released, and the holder can
    still read its manifest meanwhile.
    """

    # -- blobs (immutable, named by the sha256 of their bytes)
    def put_blob(
        self, path: Path | str, *, digest: str | None = None, move: bool = False, verify: bool = True
    ) -> str: ...
    def put_bytes(self, data: bytes) -> str: ...
    def has_blob(self, digest: str) -> bool: ...
    def verify_blob(self, digest: str) -> None: ...
    def fetch_blob(self, digest: str, dest: Path) -> None:
        """Write the blob to the new file `dest`, verified against its digest (else removed)."""
        ...

    # -- staging (the builder tier: scratch space from which storing is cheap)
    def staging_dir(self) -> Path: ...
    def discard_staging(self, path: Path) -> None: ...
    def cleanup_staging(self, older_than: float | None = None) -> int: ...
    def pending_dir(self) -> Path:
        """Where captures wait for their commit (`aenv.snapshot.pending`): on the staging
        tier's filesystem, so storing from it is as cheap, and kept across restarts."""
        ...

    # -- manifests and aliases
    def commit(self, manifest: SnapshotManifest) -> None: ...
    def resolve(self, id_or_alias: str) -> str: ...
    def get(self, id_or_alias: str) -> SnapshotManifest: ...
    def list(self, kind: str | None = None) -> list[SnapshotManifest]: ...
    def is_live(self, snapshot_id: str) -> bool: ...
    def set_alias(self, alias: str, id_or_alias: str) -> None: ...
    def remove_alias(self, alias: str) -> None: ...

    # -- leases, deletion and garbage collection
    def acquire(self, id_or_alias: str, holder: str) -> SnapshotManifest: ...
    def transfer(self, snapshot_id: str, holder: str, to: str) -> None:
        """Hand ``holder``'s lease on the snapshot to ``to``; the snapshot stays pinned throughout."""
        ...

    def release(self, snapshot_id: str, holder: str) -> None: ...
    def leased(self, snapshot_id: str, holder: str) -> SnapshotManifest: ...
    def holders(self, id_or_alias: str) -> list[str]: ...
    def delete(self, id_or_alias: str, *, defer: bool = True) -> bool: ...
    def heartbeat(self) -> None:
        """Keep this node's leases alive: they expire `lease_ttl` after its last heartbeat."""
        ...

    def local_leases(self) -> set[str]:
        """Ids of the snapshots this node holds leases on."""
        ...

    # -- pending marks: snapshots answered before their commit (aenv.snapshot.pending)
    def mark_pending(
        self, snapshot_id: str, alias: str | None = None, failure: str | None = None
    ) -> None: ...
    def unmark_pending(self, snapshot_id: str, alias: str | None = None) -> None: ...
    def pending_mark(self, id_or_alias: str) -> PendingMark | None: ...

    def gc(self, *, grace_seconds: float | None = None) -> GcReport: ...

    # -- claims: a snapshot taken over by one node, once (a paused sandbox moving between nodes)
    def claim(self, snapshot_id: str) -> str:
        """Claim the snapshot for this node unless another did first; returns the claiming node."""
        ...

    def claimant(self, snapshot_id: str) -> str | None: ...
    def unclaim(self, snapshot_id: str) -> None: ...


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
