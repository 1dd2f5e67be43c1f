"""End-to-end fixtures: a real `aenv server` subprocess, driven by the official E2B SDKs.

One node per test session (the `base` template is built once, at its first start). The
node's process, every QEMU process whose command line names its home and every `aenv-*`
network namespace that appeared while it ran are tracked, so teardown leaves nothing behind,
also when a test fails or the node has to be killed.

The node gets a network slot range of its own, so other nodes on the host are left alone;
the restart test crashes and restarts this session node rather than starting a second one
(no second template build).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
# This node's network slots: apart from the defaults (0) and the CLI tests' nodes (4096).
SLOT_FIRST = 8192
# Namespaces this node creates: its pool's slots, template builds, sandboxes and warm guests
# started without the pool.
NODE_NETNS = re.compile(rf"aenv-(s{SLOT_FIRST}-\d+|b[0-9a-z]{{10}}|i[0-9a-z]{{20}}|w[0-9a-f]{{12}})")
API_KEY = "e2b_" + "5a" * 20
START_TIMEOUT = 540.0  # the first start builds the base template (~15 s alone, minutes on a busy host)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def netns_names() -> set[str]:
    try:
        return {name for name in os.listdir("/run/netns") if name.startswith("aenv-")}
    except FileNotFoundError:
        return set()


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.25, what: str = "") -> Any:
    """Poll `predicate` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what or predicate}")
        time.sleep(interval)


class NodeServer:
    """`python -m aenv.cli server` on a temporary home and a free loopback port."""

    def __init__(self, home: Path, port: int | None = None, **settings: str):
        self.home = home
        self.port = port or free_port()
        self.key = API_KEY
        self.settings = settings
        self.log_path = home.parent / f"{home.name}-server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.namespaces_before = netns_names()
        self.starts = 0

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.addr}"

    @property
    def domain(self) -> str:
        return f"localhost:{self.port}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
        env.update(
            PYTHONPATH=str(REPO / "src"),
            AENV_HOME_PATH=str(self.home),
            AENV_API_KEY=self.key,
            AENV_API_ADDR=self.addr,
            AENV_WARM_POOL_SIZE="1",
            AENV_EVICT_INTERVAL="1",
            AENV_SLOT_FIRST=str(SLOT_FIRST),
            AENV_SLOT_COUNT="256",
            AENV_LOG_LEVEL="INFO",
        )
        env.update({f"AENV_{k.upper()}": v for k, v in self.settings.items()})
        return env

    def start(self, timeout: float = START_TIMEOUT) -> None:
        assert self.proc is None or self.proc.poll() is not None, "node already running"
        self.starts += 1
        with self.log_path.open("ab") as log:
            log.write(f"\n==== start #{self.starts} ====\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "aenv.cli", "server"],
                cwd=REPO, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"aenv server exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 204:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"aenv server not healthy after {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 204
        except httpx.HTTPError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def sigkill(self) -> None:
        """Crash the node: SIGKILL, no chance to pause or clean up anything."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, timeout: float = 180.0) -> bool:
        """SIGTERM (the node pauses its sandboxes), then SIGKILL; returns whether it stopped by itself."""
        if self.proc is None or self.proc.poll() is not None:
            return True
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
            return False

    def qemu_pids(self) -> list[int]:
        """QEMU processes of this node: their command line names a file under its home."""
        marker = str(self.home).encode() + b"/"
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if b"qemu-system" in cmdline.split(b"\0", 1)[0] and marker in cmdline:
                pids.append(int(entry))
        return pids

    def cleanup(self) -> list[str]:
        """Stop the node and remove what it leaves behind; returns what had to be cleaned up by force."""
        forced = []
        if not self.stop():
            forced.append("node needed SIGKILL")
        for pid in self.qemu_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                forced.append(f"qemu pid {pid}")
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not self.qemu_pids(), 20, what="QEMU processes to exit")
        if forced:
            # Only after an unclean stop, and only names this node gives its namespaces (pool
            # slots, template builds, sandboxes): other aenv processes on this host use other
            # names (`aenv-boot…`, …) and must not lose theirs.
            for name in sorted(netns_names() - self.namespaces_before):
                if NODE_NETNS.fullmatch(name):
                    subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True)
                    forced.append(f"netns {name}")
        return forced


@pytest.fixture
def crashable_node(node: NodeServer) -> Iterator[NodeServer]:
    """The session node, for a test that crashes it: afterwards it is stopped cleanly, whatever
    the crash left behind (QEMU processes under its home) is killed, and it is started again, so
    the tests after this one get a node in a known state."""
    try:
        yield node
    finally:
        forced = node.cleanup()
        if forced:
            print(f"\nafter the crash test, cleaned up by force: {', '.join(forced)}", file=sys.stderr)
        node.start()


@pytest.fixture(scope="session")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeServer]:
    """The session's node, with the E2B SDK's environment variables pointing at it."""
    if os.geteuid() != 0:
        pytest.fail("the end-to-end tests start a node, which needs root (network namespaces)")
    server = NodeServer(tmp_path_factory.mktemp("aenv-e2e-home"))
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("E2B_")]:
            mp.delenv(name)
        mp.setenv("E2B_API_URL", server.url)
        mp.setenv("E2B_SANDBOX_URL", server.url)
        mp.setenv("E2B_API_KEY", server.key)
        try:
            server.start()
            yield server
        finally:
            forced = server.cleanup()
            if forced:
                print(f"\naenv e2e teardown cleaned up by force: {', '.join(forced)}", file=sys.stderr)
            print(f"\naenv e2e node log: {server.log_path}", file=sys.stderr)


@pytest.fixture(autouse=True)
def _node_alive(node: NodeServer) -> Iterator[None]:
    """Every test starts and ends with a healthy node (a crash is reported, not hidden)."""
    assert node.healthy(), f"node unhealthy before the test:\n{node.log_tail()}"
    yield
    assert node.alive(), f"node process died during the test:\n{node.log_tail()}"


class Sandboxes:
    """Creates sandboxes with the sync SDK, tagged with a per-test id, and kills them all at teardown."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:12]
        self.ids: list[str] = []

    def create(self, *args: Any, **kwargs: Any):
        from e2b import Sandbox

        kwargs["metadata"] = {"e2e": self.tag, **(kwargs.get("metadata") or {})}
        kwargs.setdefault("timeout", 300)
        sandbox = Sandbox.create(*args, **kwargs)
        self.ids.append(sandbox.sandbox_id)
        return sandbox

    def track(self, sandbox_id: str) -> None:
        self.ids.append(sandbox_id)

    def close(self) -> None:
        from e2b import Sandbox

        for sandbox_id in self.ids:
            with contextlib.suppress(Exception):
                Sandbox.kill(sandbox_id)


@pytest.fixture
def sandboxes(node: NodeServer) -> Iterator[Sandboxes]:
    manager = Sandboxes()
    yield manager
    manager.close()


def run_in(sandbox: Any, command: str, timeout: float = 60) -> str:
    """stdout of a command that must succeed."""
    return sandbox.commands.run(command, timeout=timeout).stdout
