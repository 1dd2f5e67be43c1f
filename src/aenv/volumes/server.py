"""The volume server of each sandbox: diod (9P2000.L over TCP) in the sandbox's namespace.

Why 9P over TCP from a process per sandbox: clones map their RAM privately from the template's
image, so no vhost-user device (virtiofs) can attach, and a virtio-9p device would block QEMU's
migration, which pause and snapshot use. A network filesystem served into the sandbox's own
namespace has neither problem: the guest sees `GATEWAY_ADDRESS:PORT`, exactly as every other
sandbox does, and only the volumes its create request named are there.

diod runs confined by `aenv.volumes.jail` (a user namespace mapping the guest's uids onto an
unprivileged host range, a root holding only diod, its libraries and the sandbox's volumes bound
`nodev,nosuid,noexec`, seccomp, a deny-all devices cgroup): the uid a guest claims over 9P is
trusted, so files keep the guest's owners, but it is only ever one of that range's host uids.
It dies with the node (`--pdeathsig`), and the node starts it again for every resume and fork
child.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path

from ..network.egress import VOLUME_PORT
from ..network.netns import GATEWAY_ADDRESS, SandboxNetwork
from . import jail
from .store import IdRange

log = logging.getLogger(__name__)

PORT = VOLUME_PORT
EXPORTS = "/v"  # where a sandbox's volumes are in its server's root: /v/<name>
DIOD = "/usr/sbin/diod"
READY_TIMEOUT = 10.0
STOP_TIMEOUT = 3.0


def export_path(name: str) -> str:
    """The 9P export (attach name) of a volume, as the guest mounts it."""
    return f"{EXPORTS}/{name}"


class VolumeServers:
    """One diod per sandbox with volumes; `root` is an empty directory each one mounts its root on,
    `ids` the host uids and gids guests' ids become."""

    def __init__(self, root: Path, ids: IdRange):
        self.root = root
        self.ids = ids
        self._files: dict[str, str] | None = None  # diod and its libraries (found at the first start)
        jail.remove_unused_groups()
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._servers: dict[str, asyncio.subprocess.Process] = {}
        self._loggers: set[asyncio.Task[None]] = set()

    async def start(self, sandbox_id: str, network: SandboxNetwork, exports: dict[str, Path]) -> None:
        """Serve `exports` (volume name → data directory) in the sandbox's namespace, replacing
        any server it had; returns once the server accepts connections."""
        await self.stop(sandbox_id)
        if self._files is None:
            self._files = await asyncio.to_thread(jail.server_files, DIOD)
        spec = jail.Spec(
            root=str(self.root), exports={export_path(name): str(data) for name, data in exports.items()},
            files=self._files,
            listen=f"{GATEWAY_ADDRESS}:{PORT}", uid_base=self.ids.base, uid_count=self.ids.count,
            cgroup=sandbox_id,
        )  # fmt: skip
        argv = [
            "setpriv", "--pdeathsig", "KILL", "--",
            "nsenter", f"--net=/run/netns/{network.name}", "--",
            sys.executable, "-m", jail.__name__, json.dumps(asdict(spec)),
        ]  # fmt: skip
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        self._servers[sandbox_id] = process
        try:
            await self._ready(process, network)
        except BaseException:
            await self.stop(sandbox_id)
            raise
        logger = asyncio.create_task(self._log(sandbox_id, process))
        self._loggers.add(logger)
        logger.add_done_callback(self._loggers.discard)

    async def _ready(self, process: asyncio.subprocess.Process, network: SandboxNetwork) -> None:
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            if process.returncode is not None:
                assert process.stderr is not None
                said = (await process.stderr.read()).decode(errors="replace").strip()
                raise RuntimeError(f"the volume server exited with {process.returncode}: {said[-500:]}")
            sock = network.socket()
            try:
                await asyncio.wait_for(loop.sock_connect(sock, (GATEWAY_ADDRESS, PORT)), 1.0)
                return
            except (OSError, TimeoutError):
                if time.monotonic() > deadline:
                    raise RuntimeError("the volume server did not start listening in time") from None
                await asyncio.sleep(0.02)
            finally:
                sock.close()

    async def _log(self, sandbox_id: str, process: asyncio.subprocess.Process) -> None:
        """Pass the server's messages to the node's log until it exits."""
        assert process.stderr is not None
        async for line in process.stderr:
            log.info("volume server of %s: %s", sandbox_id, line.decode(errors="replace").rstrip())
        code = await process.wait()
        if self._servers.get(sandbox_id) is process:
            log.error("the volume server of sandbox %s exited with %s", sandbox_id, code)

    async def stop(self, sandbox_id: str) -> None:
        """End the sandbox's server, if it has one."""
        process = self._servers.pop(sandbox_id, None)
        if process is None:
            return
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), STOP_TIMEOUT)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        for group in jail.cgroup_dirs(sandbox_id).values():
            with contextlib.suppress(OSError):
                group.rmdir()

    async def close(self) -> None:
        for sandbox_id in list(self._servers):
            await self.stop(sandbox_id)
