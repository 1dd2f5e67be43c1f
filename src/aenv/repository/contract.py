"""The repository contract: what the engine asks of committed snapshots, and what it reports.

Snapshots live in three tiers (AgentENV's split, issue 11): the builder's staging area
(captures in progress, read by nobody else), the committed repository (the durable truth, which
may be shared by several nodes) and the node's runtime files (what QEMU maps and opens). The
engine talks to the second through `Repository` and never builds a path into it itself: the
backends (`aenv.repository.posix`, a directory; `aenv.repository.s3`, an object store) are
implementations of this protocol, and a new one only adds another. The third tier's contract
is `aenv.runtime.contract.RuntimeResolver`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .manifest import SnapshotManifest

DEFAULT_LEASE_TTL = 600.0  # seconds a node may go without a heartbeat before its leases expire


@dataclass(frozen=True)
class GcReport:
    """What one garbage collection pass removed."""

    removed_blobs: tuple[str, ...] = ()
    freed_bytes: int = 0
    removed_aliases: tuple[str, ...] = ()
    removed_staging: int = 0


@dataclass(frozen=True)
class PendingMark:
    """A snapshot a node answered and commits in the background (`aenv.snapshot.pending`), as
    the other nodes sharing the repository see it until the commit ends."""

    snapshot_id: str
    node: str  # the node committing it
    failure: str | None  # why its commit failed (the mark then stays until it is stale)
    stale: bool  # its node is gone, or it is older than the grace period: no commit will come

    def to_json(self) -> bytes:
        return json.dumps({"id": self.snapshot_id, "node": self.node, "failure": self.failure}).encode()

    @classmethod
    def parse(cls, data: bytes, *, age: float, node_live: Callable[[str], bool], grace: float) -> PendingMark:
        fields = json.loads(data)
        node = str(fields["node"])
        stale = age > grace or not node_live(node)
        return cls(str(fields["id"]), node, fields.get("failure"), stale)


class Repository(Protocol):
    """Committed snapshots: content-addressed blobs, manifests, aliases, leases and gc.

    A snapshot exists exactly when its manifest is committed, and its manifest is committed
    last, after every blob it names is stored. A lease (holder = a sandbox or warm VM id) pins a
    snapshot: deleting it is deferred until the last lease is released, and the holder can
    still read its manifest meanwhile.
    """

    node: str  # this node's id, as its leases, claims and pending marks name it
    grace_seconds: float

    @property
    def shared(self) -> bool:
        """Whether other nodes use this repository and its blobs are copies, never this node's
        files (s3): pauses are then committed to it for them (`aenv.snapshot.handover`), and
        this node keeps only what it holds leases on."""
        ...

    @property
    def local_root(self) -> Path:
        """The local directory this node's VMs read and write the repository's files in: a posix
        repository's root (its blobs are used in place), an s3 one's staging (captures before
        their upload)."""
        ...

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
