"""End-to-end fixtures: a real `aenv server` subprocess, driven by the official E2B SDKs.

One node per test session (`aenv.devnode`), on a home seeded with the session's `base`
template, so it builds none. Its process, every QEMU process whose command line names its home
and the network namespaces it created are tracked, so teardown leaves nothing behind, also when
a test fails or the node has to be killed.

The node gets a network slot range of its own, so other nodes on the host are left alone;
the restart test crashes and restarts this session node rather than starting a second one.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aenv.devnode import DevNode, free_port, netns_names

# The tests' name for the node they drive.
NodeServer = DevNode
# What the tests import from here.
__all__ = ["NodeServer", "Sandboxes", "free_port", "netns_names", "run_in", "wait_until"]
# This node's network slots: apart from the defaults (0), the CLI tests' nodes (4096) and bench (12288).
SLOT_FIRST = 8192


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


@pytest.fixture
def crashable_node(node: NodeServer) -> Iterator[NodeServer]:
    """The session node, for a test that crashes it: afterwards it is stopped cleanly, whatever
    the crash left behind (QEMU processes under its home) is killed, and it is started again, so
    the tests after this one get a node in a known state."""
    try:
        yield node
    finally:
        forced = node.cleanup(keep_home=True)
        if forced:
            print(f"\nafter the crash test, cleaned up by force: {', '.join(forced)}", file=sys.stderr)
        node.start()


@pytest.fixture(scope="session")
def node(tmp_path_factory: pytest.TempPathFactory, template_seed: Path) -> Iterator[NodeServer]:
    """The session's node, with the E2B SDK's environment variables pointing at it."""
    if os.geteuid() != 0:
        pytest.fail("the end-to-end tests start a node, which needs root (network namespaces)")
    server = NodeServer(
        tmp_path_factory.mktemp("aenv-e2e-home"), slot_first=SLOT_FIRST, seed=template_seed,
        warm_pool_size=1, evict_interval=1,
    )  # fmt: skip
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
