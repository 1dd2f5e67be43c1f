"""Volumes of sandboxes: checked at create, served and mounted after every start, resume and fork.

A sandbox's `volumeMounts` (E2B: `[{"name", "path"}]`, by volume name) are kept in its record.
Each time its guest starts running (create, resume, fork child) the node starts the sandbox's
volume server in its namespace and asks envd to mount them; when its VM stops (pause, kill) the
server goes. A fork's source keeps its server and its mounts: its guest never stopped talking
to them.
"""

from __future__ import annotations

import asyncio
import json

from ..orchestrator.errors import InvalidRequest
from ..snapshot.model import SandboxVM
from .server import PORT, VolumeServers, export_path
from .store import Volume, VolumeStore

Mounts = list[dict[str, str]]


class SandboxVolumes:
    """The node's volumes as sandboxes use them."""

    def __init__(self, store: VolumeStore, servers: VolumeServers):
        self.store = store
        self.servers = servers

    def resolve(self, mounts: Mounts) -> dict[str, Volume]:
        """The volumes `mounts` name, by name; 400 for a name no volume has (never dropped)."""
        found = {}
        for mount in mounts:
            volume = self.store.by_name(mount["name"])
            if volume is None:
                raise InvalidRequest(f"volume '{mount['name']}' (mounted at {mount['path']}) does not exist")
            found[volume.name] = volume
        return found

    async def attach(self, vm: SandboxVM, mounts: Mounts) -> None:
        """Serve the volumes into the sandbox's namespace and have its guest mount them (and let go
        of any other mounts of a volume server it holds: none of those servers exists any more)."""
        volumes = self.resolve(mounts)
        if volumes:
            exports = {name: self.store.data(volume) for name, volume in volumes.items()}
            await self.servers.start(vm.sandbox_id, vm.guest.network, exports)
        wanted = [{"path": m["path"], "export": export_path(m["name"]), "port": PORT} for m in mounts]
        answer = await vm.envd.init({"volumeMounts": wanted}, timeout=30)
        try:
            mounted = json.loads(answer)["volumeMounts"]
        except (ValueError, KeyError, TypeError):
            mounted = None
        if mounted != [m["path"] for m in mounts]:
            raise RuntimeError(
                f"the guest agent of template {vm.manifest.id} does not mount volumes (it predates "
                "them): build the template again"
            )

    async def detach(self, sandbox_id: str) -> None:
        await self.servers.stop(sandbox_id)

    async def close(self) -> None:
        await self.servers.close()
        await asyncio.to_thread(self.store.close)
