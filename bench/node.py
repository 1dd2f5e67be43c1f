"""The node under test: one the harness starts on a throwaway home, or a running one named by AENV_URL.

A node the harness starts is a real `aenv server` subprocess in a session of its own (so Ctrl-C
reaches only the harness, which then stops it in order). It gets network slots of its own
(12288…, apart from the test suites' 4096 and 8192), `shutdown_action=kill` so SIGTERM ends its
sandboxes, and a long default timeout so no sandbox expires mid-run. Stopping it removes what it
may have left behind: QEMU processes whose command line names its home, the namespaces of its slot
range and of its template builds, and the temporary directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from aenv.config import Settings

REPO = Path(__file__).resolve().parents[1]
API_KEY = "e2b_" + "be" * 20
SLOT_FIRST = 12288
SLOT_COUNT = 1024
DEFAULT_TIMEOUT = 6 * 3600  # seconds: longer than any run, so the TTL never ends a sandbox early
START_TIMEOUT = 600.0  # the first start of a fresh home boots the guest once to build `base`
STOP_TIMEOUT = 180.0
NETNS_DIR = Path("/run/netns")
_PR_SET_PDEATHSIG = 1
# Settings of this host the node should share with the harness (which reads them too): artifacts,
# accelerator, QEMU binary. Every other AENV_* variable is the harness's to choose.
PASSED_THROUGH = ("AENV_CACHE_DIR", "AENV_ACCEL", "AENV_KERNEL", "AENV_INITRAMFS", "AENV_QEMU")


class BenchError(RuntimeError):
    """The node or a guest did not do what a measurement needs."""


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


@dataclass(frozen=True)
class Node:
    """How to reach the node; `home` and `pid` only when it runs on this host under the harness."""

    url: str
    api_key: str
    home: Path | None = None
    pid: int | None = None
    warm_pool: int | None = None  # warm VMs per template the node keeps, when known

    @property
    def local(self) -> bool:
        return self.home is not None

    def sandbox_pids(self) -> dict[str, int]:
        """QEMU pid of each running sandbox, from the node's saved sandbox states."""
        pids = {}
        if self.home is None:
            return pids
        for state_file in (self.home / "sandboxes").glob("*/state.json"):
            with contextlib.suppress(OSError, ValueError):
                state = json.loads(state_file.read_text())
                if state.get("pid"):
                    pids[state["sandbox_id"]] = int(state["pid"])
        return pids

    def state(self, sandbox_id: str) -> dict[str, Any]:
        """The engine's saved state of a sandbox (namespace, QEMU pid, last pause's files)."""
        if self.home is None:
            raise BenchError("a sandbox's saved state is only readable for a node on this host")
        return json.loads((self.home / "sandboxes" / sandbox_id / "state.json").read_text())

    def pause_delta_bytes(self, sandbox_id: str) -> int | None:
        """Size of the memory delta the last pause of a sandbox wrote."""
        if self.home is None:
            return None
        with contextlib.suppress(OSError, ValueError, TypeError):
            return Path(self.state(sandbox_id)["delta"]).stat().st_size
        return None

    def process_kept(self, sandbox_id: str) -> bool | None:
        """Whether a paused sandbox still has its (stopped) QEMU process: a node may keep it for a
        quick resume. None when this cannot be seen from here."""
        if self.home is None:
            return None
        pid = self.state(sandbox_id).get("pid")
        return pid is not None and Path(f"/proc/{pid}").exists()

    def snapshot_delta_bytes(self, snapshot_id: str) -> int | None:
        """Size of a committed snapshot's memory delta, from its manifest."""
        if self.home is None:
            return None
        with contextlib.suppress(OSError, ValueError, KeyError):
            manifest = json.loads(
                (self.home / "repository" / "manifests" / f"{snapshot_id}.json").read_text()
            )
            return sum(manifest["sizes"].get(d, 0) for d in manifest["memory_deltas"])
        return None

    def warm_ready(self, snapshot_id: str) -> int:
        """Warm VMs of a snapshot that are ready (their record is written after their envd answered)."""
        ready = 0
        if self.home is None:
            return ready
        for record in (self.home / "runtime" / "warm").glob("*/warm.json"):
            with contextlib.suppress(OSError, ValueError):
                ready += json.loads(record.read_text()).get("snapshot_id") == snapshot_id
        return ready


def _stop_with_parent() -> None:
    """In the node's process before exec: SIGTERM when the harness dies, even by SIGKILL, so the
    node still ends its sandboxes (it runs in a session of its own, which Ctrl-C does not reach)."""
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def remote_node() -> Node | None:
    """The node named by AENV_URL (with AENV_API_KEY), if any."""
    url = os.environ.get("AENV_URL")
    if not url:
        return None
    return Node(url=url.rstrip("/"), api_key=os.environ.get("AENV_API_KEY", ""))


class LocalNode:
    """`python -m aenv.cli server` on a temporary home and a free loopback port; a context manager."""

    def __init__(self) -> None:
        self.port = free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix="aenv-bench-"))
        self.home = self.workdir / "home"
        self.log_path = self.workdir / "node.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._netns_before = netns_names()

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
        env.update(
            PYTHONPATH=str(REPO / "src"),
            AENV_HOME_PATH=str(self.home),
            AENV_API_ADDR=f"127.0.0.1:{self.port}",
            AENV_API_KEY=API_KEY,
            AENV_SLOT_FIRST=str(SLOT_FIRST),
            AENV_SLOT_COUNT=str(SLOT_COUNT),
            AENV_SHUTDOWN_ACTION="kill",
            AENV_DEFAULT_TIMEOUT=str(DEFAULT_TIMEOUT),
            AENV_LOG_LEVEL="INFO",
        )
        env.update({name: os.environ[name] for name in PASSED_THROUGH if name in os.environ})
        return env

    def __enter__(self) -> Node:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Node:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "aenv.cli", "server"],
                cwd=REPO, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_stop_with_parent,
            )  # fmt: skip
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"aenv server exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 204:
                    pool = Settings.warm_pool_size  # the node's default: the harness sets none
                    return Node(url=url, api_key=API_KEY, home=self.home, pid=self.proc.pid, warm_pool=pool)
            if time.monotonic() > deadline:
                raise BenchError(f"aenv server not healthy after {START_TIMEOUT:.0f} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _owned_netns(self) -> list[str]:
        """Namespaces that appeared while this node ran and that only it names this way."""
        slot = re.compile(rf"aenv-s{SLOT_FIRST}-\d+")
        layers = self.home / "layers"
        builds = {f"aenv-b{p.stem[-10:]}" for p in layers.glob("*.qcow2")} if layers.exists() else set()
        return sorted(n for n in netns_names() - self._netns_before if slot.fullmatch(n) or n in builds)

    def stop(self) -> list[str]:
        """Stop the node and remove all it leaves; returns what had to be removed by force."""
        forced = []
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
                forced.append("node needed SIGKILL")
        for pid in qemu_pids_under(self.home):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                forced.append(f"qemu {pid}")
        deadline = time.monotonic() + 20
        while qemu_pids_under(self.home) and time.monotonic() < deadline:
            time.sleep(0.1)
        for name in self._owned_netns():
            subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True)
            forced.append(f"netns {name}")
        if forced:
            print(f"bench: cleaned up after the node by force: {', '.join(forced)}", file=sys.stderr)
            print(f"bench: the node's log ends with:\n{self.log_tail(20)}", file=sys.stderr)
        shutil.rmtree(self.workdir, ignore_errors=True)
        return forced
