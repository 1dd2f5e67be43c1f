"""A throwaway node in a temporary home, for tests, benchmarks and demos.

`DevNode` runs `python -m aenv.cli server` (the code of this very `aenv` package) as a
subprocess on a home of its own, a free loopback port, an API key and a network slot range of
its caller's choosing. It can be stopped, crashed (SIGKILL) and started again on the same home.
`cleanup` leaves nothing behind, also after a crash or a failed start: QEMU processes whose
command line names its home, and the network namespaces it created (its slot range's and its
template builds'), are removed by force and reported.

The first start of a fresh home boots a guest to build the `base` template (tens of seconds
under TCG, minutes on a busy host). Given a `seed` home that already holds `base` (a test
session's, for instance), the new home is seeded from it before the node starts, and the node
reuses that template (see `seed_home`): a test run builds `base` once, however many nodes it
starts.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from . import paths
from .node import BASE_TEMPLATE
from .repository.errors import SnapshotNotFound
from .repository.posix import SnapshotRepository
from .runtime import lazyfs
from .runtime.layers import LayerStore

START_TIMEOUT = 600.0  # seconds; a fresh, unseeded home builds `base` first
STOP_TIMEOUT = 180.0  # seconds for SIGTERM (the node pauses or kills its sandboxes) before SIGKILL
NETNS_DIR = Path("/run/netns")
# Settings of this host that a node shares with whoever starts it (the build cache, the
# accelerator, the QEMU binary); every other AENV_* and E2B_* variable is the launcher's to set.
PASSED_THROUGH = ("AENV_CACHE_DIR", "AENV_ACCEL", "AENV_KERNEL", "AENV_INITRAMFS", "AENV_QEMU")
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # where `import aenv` found this package
# The node gets SIGTERM when the thread that started it ends, even by SIGKILL, so it still ends
# its sandboxes (it runs in a session of its own, which Ctrl-C does not reach). util-linux's
# setpriv sets that before exec: a preexec_fn could deadlock in a process with threads.
_SERVER = ["setpriv", "--pdeathsig", "TERM", "--", sys.executable, "-m", "aenv.cli", "server"]


class DevNodeError(RuntimeError):
    """The node did not start, exited while starting, or its seed has nothing to seed it with."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def netns_names() -> set[str]:
    try:
        return set(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return set()


def qemu_pids_under(home: Path) -> list[int]:
    """QEMU processes whose command line names a file under `home` (identified, never guessed by name)."""
    marker = str(home).encode() + b"/"
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            if b"qemu-system" in argv[0] and any(marker in arg for arg in argv):
                pids.append(int(entry))
    return pids


def seed_home(home: Path, seed: Path, template: str = BASE_TEMPLATE) -> str:
    """Give `home` the template `template` of the node home `seed`; returns its id.

    Cheap and self-contained: the repository's blobs are immutable and become hardlinks, the
    template's disk layers are adopted by the layer store (the bottom one hardlinked, the small
    ones above copied and rebased onto this home), and the manifest is committed last, so a node
    sees the template whole or not at all. Nothing else of the seed is taken: no leases,
    sandboxes, warm VMs, runtime files, database, key or node id. A home that has the template
    already is left as it is.
    """
    target = SnapshotRepository(paths.repository_dir(home))
    with contextlib.suppress(SnapshotNotFound):
        return target.get(template).id
    if not paths.repository_dir(seed).is_dir():
        raise DevNodeError(f"{seed} is not a node home: it has no {paths.repository_dir(seed).name}")
    source = SnapshotRepository(paths.repository_dir(seed))
    try:
        manifest = source.get(template)
    except SnapshotNotFound as exc:
        raise DevNodeError(f"the node home {seed} has no {template} template to seed from") from exc
    for digest in manifest.blobs():
        target.put_blob(source.blob_path(digest), digest=digest, verify=False)
    LayerStore(paths.layers_dir(home)).adopt(LayerStore(paths.layers_dir(seed)), manifest.disk_layers)
    target.commit(manifest)
    return manifest.id


class DevNode:
    """`aenv server` on `home`, a free loopback port and its own network slots; a context manager.

    `settings` become the node's `AENV_<NAME>` variables (`warm_pool_size=1`). Nodes that run
    at the same time need disjoint slot ranges. The log of every start is appended to
    `log_path`. Namespaces present before this object was made are never touched. The node
    stops when the thread that started it ends: start it from one that outlives it.
    """

    def __init__(
        self, home: Path, *, slot_first: int, slot_count: int = 256, seed: Path | None = None,
        api_key: str | None = None, port: int | None = None, log_path: Path | None = None,
        **settings: object,
    ) -> None:  # fmt: skip
        self.home = home
        self.slot_first = slot_first
        self.slot_count = slot_count
        self.seed = seed
        self.key = api_key or "e2b_" + secrets.token_hex(20)
        self.port = port or free_port()
        self.log_path = log_path or home.parent / f"{home.name}-server.log"
        self.settings = settings
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._netns_before = netns_names()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.addr}"

    @property
    def domain(self) -> str:
        return f"localhost:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
        env.update({name: os.environ[name] for name in PASSED_THROUGH if name in os.environ})
        env.update(
            PYTHONPATH=str(_PACKAGE_ROOT),
            AENV_HOME_PATH=str(self.home),
            AENV_API_ADDR=self.addr,
            AENV_API_KEY=self.key,
            AENV_SLOT_FIRST=str(self.slot_first),
            AENV_SLOT_COUNT=str(self.slot_count),
            AENV_LOG_LEVEL="INFO",
        )
        env.update({f"AENV_{name.upper()}": str(value) for name, value in self.settings.items()})
        return env

    def __enter__(self) -> DevNode:
        try:
            self.start()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start the node (seeding a fresh home first) and wait until it answers `/health`."""
        if self.alive():
            raise DevNodeError("the node is already running")
        self.home.mkdir(parents=True, exist_ok=True)
        if self.seed is not None:
            seed_home(self.home, self.seed)
        self.starts += 1
        with self.log_path.open("ab") as log:
            log.write(f"\n==== start #{self.starts} ====\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                _SERVER, cwd=_PACKAGE_ROOT, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not self.healthy(timeout=2):
            if self.proc.poll() is not None:
                raise DevNodeError(f"aenv server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise DevNodeError(f"aenv server not healthy after {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def healthy(self, timeout: float = 5) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=timeout).status_code == 204
        except httpx.HTTPError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def sigkill(self) -> None:
        """Crash the node: SIGKILL, no chance to pause or clean up anything."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout: float = STOP_TIMEOUT) -> bool:
        """SIGTERM (the node pauses or kills its sandboxes), then SIGKILL; whether it stopped by itself."""
        if not self.alive():
            return True
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            return False

    def qemu_pids(self) -> list[int]:
        """QEMU processes of this node: their command line names a file under its home."""
        return qemu_pids_under(self.home)

    def owned_netns(self) -> list[str]:
        """Namespaces that appeared since this object was made and that only this node names so:
        its slot range's and those of template builds of a layer in its home."""
        slot = re.compile(rf"aenv-s{self.slot_first}-\d+")
        layers = paths.layers_dir(self.home)
        builds = {f"aenv-b{p.stem[-10:]}" for p in layers.glob("*.qcow2")} if layers.exists() else set()
        return sorted(n for n in netns_names() - self._netns_before if slot.fullmatch(n) or n in builds)

    def cleanup(self, *, keep_home: bool = False) -> list[str]:
        """Stop the node and remove what it left running; returns what had to be removed by force.

        With `keep_home` (the node starts again on this home) the namespaces a cleanly stopped
        node keeps for its paused sandboxes stay; they go only when something was forced.
        """
        forced = [] if self.stop() else ["node needed SIGKILL"]
        for pid in self.qemu_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                forced.append(f"qemu pid {pid}")
        deadline = time.monotonic() + 20
        while self.qemu_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        lazyfs.stop_at(self.home)  # ends with its node; this also removes one a test left
        if forced or not keep_home:
            for name in self.owned_netns():
                subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True)
                forced.append(f"netns {name}")
        return forced
