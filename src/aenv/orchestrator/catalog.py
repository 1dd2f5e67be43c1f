"""The templates and snapshots of this node as callers name them, over the engine's parts.

A name resolves to a snapshot being committed here (`PendingSnapshots`), one committed in the
repository, or one another node answered and is committing (it is waited for, up to
`pending_wait`); one whose commit failed answers 404 with why. Deleting one drains its warm pool
first and cancels it if it is still being committed.
"""

from __future__ import annotations

from ..repository.contract import Repository
from ..repository.errors import InvalidName, RepositoryError, SnapshotNotFound
from ..repository.manifest import SnapshotManifest
from ..runtime.cache import CacheStats
from ..runtime.contract import RuntimeResolver
from ..snapshot.pending import PendingSnapshots, SnapshotPending
from ..snapshot.warm_pool import WarmPool
from .errors import SNAPSHOT_PENDING, NotFound, Unavailable
from .ids import catalog_name


class Catalog:
    """Lookups, listings and deletes over the repository, pending snapshots and warm pools."""

    def __init__(
        self,
        repository: Repository,
        pending: PendingSnapshots,
        pool: WarmPool,
        runtime: RuntimeResolver,
        pending_wait: float,
    ):
        self.repository = repository
        self.pending = pending
        self.pool = pool
        self.runtime = runtime
        self.pending_wait = pending_wait

    async def resolve(self, reference: str) -> SnapshotManifest:
        """A template or snapshot by id or alias; `namespace/` prefixes and `:tag` suffixes are ignored."""
        name = catalog_name(reference)
        if (pending := self.pending.get(name)) is not None:
            return pending  # this node's, being committed: a start waits for the commit
        try:
            return self.repository.get(name)
        except (SnapshotNotFound, RepositoryError):
            if (found := await self.committed_elsewhere(name)) is not None:
                return found
            raise NotFound(self.pending.failure(name) or f"template '{reference}' not found") from None

    async def find(self, reference: str) -> SnapshotManifest | None:
        """As `resolve`, without the error: None if no node has it (`failure` says why, if known)."""
        name = catalog_name(reference)
        manifest = self.pending.get(name)
        try:
            return manifest or self.repository.get(name)
        except (SnapshotNotFound, InvalidName):
            return await self.committed_elsewhere(name)

    def failure(self, reference: str) -> str | None:
        """Why a snapshot this node answered failed later (answered, then rolled back)."""
        return self.pending.failure(catalog_name(reference))

    async def committed_elsewhere(self, name: str) -> SnapshotManifest | None:
        """A snapshot another node answered, once committed (`PendingSnapshots.elsewhere`); None
        if no node is committing it."""
        try:
            return await self.pending.elsewhere(name, self.pending_wait)
        except SnapshotPending as exc:
            raise Unavailable(str(exc), SNAPSHOT_PENDING) from None
        except SnapshotNotFound as exc:  # its commit failed: why
            raise NotFound(str(exc)) from None

    def listing(self, kind: str | None) -> tuple[list[SnapshotManifest], list[SnapshotManifest]]:
        """The committed ones of `kind` (all kinds: None), and the ones being committed here."""
        return self.repository.list(kind), self.pending.list()

    def warm(self, snapshot_id: str) -> tuple[int, int]:
        """How many warm VMs the snapshot's pool keeps (its target) and has ready now."""
        return self.pool.target(snapshot_id), self.pool.ready(snapshot_id)

    async def delete(self, snapshot_id: str, *, pending: bool = False) -> None:
        """End the snapshot's warm VMs and delete it (deferred while sandboxes use it); one still
        being committed (`pending`) is cancelled instead, and never becomes visible."""
        await self.pool.drain(snapshot_id)
        if not (pending and await self.pending.cancel(snapshot_id)):
            self.repository.delete(snapshot_id, defer=True)

    async def drain(self, snapshot_id: str) -> None:
        """No warm VMs for the snapshot any more (no tag names its build)."""
        await self.pool.drain(snapshot_id)

    def cache_stats(self) -> CacheStats | None:
        return self.runtime.cache_stats()
