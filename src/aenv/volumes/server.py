"""The volume server of each sandbox: diod (9P2000.L over TCP) in the sandbox's namespace.

Why 9P over TCP from a process per sandbox: clones map their RAM privately from the template's
image, so no vhost-user device (virtiofs) can attach, and a virtio-9p device would block QEMU's
migration, which pause and snapshot use. A network filesystem served into the sandbox's own
namespace has neither problem: the guest sees `GATEWAY_ADDRESS:PORT`, exactly as every other
sandbox does, and only the volumes its create request named are there.

diod runs as root (so files keep the guest's owners), chrooted into a tmpfs of its own mount
namespace that holds the host's `/usr` read-only and the sandbox's volumes under `/v/<name>`:
a guest speaking raw 9P through a symlink still reaches nothing else of the host. It dies with
the node (`--pdeathsig`), and the node starts it again for every resume and fork child.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import time
from pathlib import Path

from ..network.egress import VOLUME_PORT
from ..network.netns import GATEWAY_ADDRESS, SandboxNetwork

log = logging.getLogger(__name__)

PORT = VOLUME_PORT
EXPORTS = "/v"  # where a sandbox's volumes are in its server's root: /v/<name>
DIOD = "/usr/sbin/diod"
READY_TIMEOUT = 10.0
STOP_TIMEOUT = 3.0


def export_path(name: str) -> str:
    """The 9P export (attach name) of a volume, as the guest mounts it."""
    return f"{EXPORTS}/{name}"


def _script(root: Path, exports: dict[str, Path]) -> str:
    """The shell steps, in the server's private mount namespace, that build its root and exec diod."""
    q = shlex.quote
    steps = [
        "set -e",
        f"mount -t tmpfs -o mode=0755,size=1m aenv-volumes {q(str(root))}",
        f"mkdir {q(f'{root}/usr')} {q(f'{root}{EXPORTS}')}",
        f"mount --bind -o ro /usr {q(f'{root}/usr')}",
        # diod names each client (getnameinfo): from files only, never a DNS query that fails.
        f"mkdir {q(f'{root}/etc')}",
        f"echo 'hosts: files' > {q(f'{root}/etc/nsswitch.conf')}",
        f"echo '127.0.0.1 localhost' > {q(f'{root}/etc/hosts')}",
    ]
    for top in ("lib", "lib64", "bin", "sbin"):  # merged /usr: symlinks; else read-only binds
        host = Path("/") / top
        if host.is_symlink():
            steps.append(f"ln -s {q(str(host.readlink()).lstrip('/'))} {q(f'{root}/{top}')}")
        elif host.is_dir():
            steps += [f"mkdir {q(f'{root}/{top}')}", f"mount --bind -o ro /{top} {q(f'{root}/{top}')}"]
    argv = [DIOD, "-f", "-n", "-N", "-L", "stderr", "-l", f"{GATEWAY_ADDRESS}:{PORT}"]
    for name, data in exports.items():
        inner = f"{root}{export_path(name)}"
        steps += [f"mkdir {q(inner)}", f"mount --bind {q(str(data))} {q(inner)}"]
        argv += ["-e", export_path(name)]
    steps.append(f"exec chroot {q(str(root))} {shlex.join(argv)}")
    return "\n".join(steps)


class VolumeServers:
    """One diod per sandbox with volumes; `root` is an empty directory each one mounts its root on."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._servers: dict[str, asyncio.subprocess.Process] = {}
        self._loggers: set[asyncio.Task[None]] = set()

    async def start(self, sandbox_id: str, network: SandboxNetwork, exports: dict[str, Path]) -> None:
        """Serve `exports` (volume name → data directory) in the sandbox's namespace, replacing
        any server it had; returns once the server accepts connections."""
        await self.stop(sandbox_id)
        argv = [
            "setpriv", "--pdeathsig", "KILL", "--",
            "nsenter", f"--net=/run/netns/{network.name}", "--",
            "unshare", "--mount", "--propagation", "private", "--",
            "sh", "-c", _script(self.root, exports),
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
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), STOP_TIMEOUT)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()

    async def close(self) -> None:
        for sandbox_id in list(self._servers):
            await self.stop(sandbox_id)
