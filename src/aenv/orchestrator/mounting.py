"""Volumes in sandboxes: which sandboxes mount a volume, and serving them into a sandbox's guest.

The orchestrator's only door to `aenv.volumes`: a create is refused (400) a volume that does not
exist, a started or resumed guest gets its mounts, a stopped one's volume server goes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from .errors import InvalidRequest
from .sandboxes import Sandbox
from .store import SandboxRecord, SandboxStore

if TYPE_CHECKING:
    from ..volumes.mounts import SandboxVolumes

# Metadata of a snapshot taken while its sandbox had volumes mounted (its guest holds the mounts).
VOLUMES_MARK = "aenv.volumes"


def stored_users(store: SandboxStore) -> Callable[[str], list[str]]:
    """Who mounts a volume, from the sandboxes' stored records: the store holds every sandbox the
    node has from its start to its end, so a volume store built before the orchestrator asks it."""
    return lambda name: VolumeMounts.users(store.all(), name)


class VolumeMounts:
    """The sandboxes' volumes over `volumes` (None: the node has none, and mounts get 400)."""

    def __init__(self, volumes: SandboxVolumes | None):
        self.volumes = volumes

    def check(self, mounts: list[dict[str, str]]) -> None:
        """400 for a mount of a volume that does not exist: never started without it."""
        if not mounts:
            return
        if self.volumes is None:
            raise InvalidRequest("this node has no volumes")
        self.volumes.resolve(mounts)

    async def mount(self, sandbox: Sandbox, *, stale: bool = False) -> None:
        """Serve the sandbox's volumes into its namespace and mount them in its running guest.

        `stale`: its guest comes from a snapshot of a sandbox with volumes, whose mounts it holds
        and must let go of even if it mounts none itself.
        """
        wanted = sandbox.record.volume_mounts
        if (wanted or stale) and self.volumes is not None and sandbox.vm is not None:
            await self.volumes.attach(sandbox.vm, wanted)

    async def unmount(self, sandbox: Sandbox) -> None:
        """The sandbox's VM stopped (pause, kill): its volume server goes too."""
        if self.volumes is not None:
            await self.volumes.detach(sandbox.id)

    @staticmethod
    def users(records: Iterable[SandboxRecord], name: str) -> list[str]:
        """The sandboxes (running or paused) that mount the volume named `name`."""
        return [r.sandbox_id for r in records if any(m["name"] == name for m in r.volume_mounts)]

    @staticmethod
    def snapshot_metadata(sandbox: Sandbox) -> dict[str, str]:
        """A snapshot's metadata: its sandbox, and whether the guest held volume mounts."""
        metadata = {"sandbox_id": sandbox.id}
        if sandbox.record.volume_mounts:
            metadata[VOLUMES_MARK] = "mounted"
        return metadata

    async def close(self) -> None:
        if self.volumes is not None:
            await self.volumes.close()
