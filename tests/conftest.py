"""Session-wide fixtures for tests that run real VMs.

One node home and one `base` template per test session: tests restore sandboxes from the
template's snapshot instead of booting, and node subprocesses (tests/e2e, tests/cli) start on
homes seeded with it. The engine is asynchronous while the E2B SDK used by
the tests is synchronous, so the node's event loop runs in a thread of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


class NodeLoop:
    """An asyncio loop in a background thread, for driving async node code from sync tests."""

    @staticmethod
    async def _cancel_everything() -> None:
        """End what is still running on the loop (forwarded connections) before it closes."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="node-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 600) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self._cancel_everything(), timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture(scope="session")
def node_loop() -> Iterator[NodeLoop]:
    runner = NodeLoop()
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def guest_artifacts():
    from aenv.guest.artifacts import ensure_guest_artifacts

    return ensure_guest_artifacts()


@pytest.fixture(scope="session")
def node_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("aenv-home")


@pytest.fixture(scope="session")
def engine(node_home: Path, guest_artifacts, node_loop: NodeLoop):
    from aenv.paths import repository_dir
    from aenv.repository.posix import SnapshotRepository
    from aenv.snapshot.engine import SnapshotEngine
    from aenv.vmm.accel import accelerator_from_env

    repository = SnapshotRepository(repository_dir(node_home))
    return SnapshotEngine(node_home, repository, guest_artifacts, accelerator_from_env().accel)


@pytest.fixture(scope="session")
def base_template(engine, node_loop: NodeLoop):
    """The `base` template, built once per session by a real boot."""
    return node_loop.run(engine.build_template("base"))


@pytest.fixture(scope="session")
def template_seed(node_home: Path, base_template) -> Path:
    """A node home holding the session's `base` template: the nodes that tests start are seeded
    from it (`aenv.devnode.seed_home`), so a test run builds `base` once."""
    return node_home


@dataclass
class RunningSandbox:
    """A sandbox VM plus a loopback port forwarded to its envd."""

    vm: Any  # aenv.snapshot.engine.SandboxVM
    envd_url: str
    access_token: str | None

    @property
    def sandbox_id(self) -> str:
        return self.vm.sandbox_id

    def sdk(self):
        """The official SDK's `Sandbox`, bound straight to this sandbox's envd."""
        from e2b import Sandbox
        from e2b.connection_config import ConnectionConfig
        from packaging.version import Version

        from aenv.agent.envd import ENVD_VERSION

        headers = {"E2b-Sandbox-Id": self.sandbox_id, "E2b-Sandbox-Port": "49983"}
        if self.access_token:
            headers["X-Access-Token"] = self.access_token
        config = ConnectionConfig(debug=True, sandbox_url=self.envd_url, extra_sandbox_headers=headers)
        return Sandbox(
            sandbox_id=self.sandbox_id, sandbox_domain=None, envd_version=Version(ENVD_VERSION),
            envd_access_token=self.access_token, traffic_access_token=None, connection_config=config,
        )  # fmt: skip


class SandboxManager:
    """Starts, pauses, resumes and forks sandboxes for a test, and cleans up all of them."""

    def __init__(self, engine, node_loop: NodeLoop):
        self.engine = engine
        self.node = node_loop
        self._running: dict[str, RunningSandbox] = {}
        self._forwarders: dict[str, asyncio.Server] = {}
        self._paused: dict[str, Any] = {}

    def _init(self, token: str | None):
        from aenv.snapshot.engine import GuestInit

        return GuestInit(access_token=token)

    async def _expose(self, vm) -> RunningSandbox:
        """The sandbox, with the token its guest holds: `init`'s, or a warm VM's own (`WarmVMs.claim`)."""
        from aenv.agent.envd import ENVD_PORT
        from aenv.network.forward import forward_port

        server = await forward_port(vm.guest.network, ENVD_PORT)
        port = server.sockets[0].getsockname()[1]
        self._forwarders[vm.sandbox_id] = server
        token = vm.guest.envd.access_token
        sandbox = RunningSandbox(vm=vm, envd_url=f"http://127.0.0.1:{port}", access_token=token)
        self._running[vm.sandbox_id] = sandbox
        return sandbox

    def _unexpose(self, sandbox_id: str) -> None:
        self._running.pop(sandbox_id, None)
        server = self._forwarders.pop(sandbox_id, None)
        if server is not None:
            self.node.loop.call_soon_threadsafe(server.close)

    def start(self, snapshot: str, init: Any = None) -> RunningSandbox:
        """A sandbox from `snapshot`, with `init` (default: a new token and nothing else)."""
        sandbox_id = "t" + secrets.token_hex(6)
        init = init or self._init(secrets.token_hex(16))

        async def start() -> RunningSandbox:
            return await self._expose(await self.engine.start(snapshot, sandbox_id, init))

        return self.node.run(start())

    def pause(self, sandbox: RunningSandbox):
        state = self.node.run(self.engine.pause(sandbox.vm))
        self._unexpose(sandbox.sandbox_id)
        self._paused[sandbox.sandbox_id] = (state, sandbox.access_token)
        return state

    def resume(self, sandbox_id: str) -> RunningSandbox:
        state, token = self._paused.pop(sandbox_id)

        async def resume() -> RunningSandbox:
            return await self._expose(await self.engine.resume(state, self._init(token)))

        return self.node.run(resume())

    def snapshot(self, sandbox: RunningSandbox, **kwargs: Any):
        return self.node.run(self.engine.snapshot(sandbox.vm, **kwargs))

    def fork(self, sandbox: RunningSandbox, count: int) -> list[RunningSandbox]:
        children = [("t" + secrets.token_hex(6), secrets.token_hex(16)) for _ in range(count)]

        async def fork() -> list[RunningSandbox]:
            vms = await self.engine.fork(sandbox.vm, [(cid, self._init(token)) for cid, token in children])
            return [await self._expose(vm) for vm in vms]

        return self.node.run(fork())

    def kill(self, sandbox_id: str) -> None:
        running = self._running.get(sandbox_id)
        self._unexpose(sandbox_id)
        if running is not None:
            self.node.run(self.engine.kill(running.vm))
        elif sandbox_id in self._paused:
            self.node.run(self.engine.kill(self._paused.pop(sandbox_id)[0]))

    def close(self) -> None:
        for sandbox_id in [*self._running, *self._paused]:
            with contextlib.suppress(Exception):
                self.kill(sandbox_id)


@pytest.fixture
def sandboxes(engine, node_loop: NodeLoop) -> Iterator[SandboxManager]:
    """Per-test sandbox manager; everything it started is killed at teardown, also on failure."""
    manager = SandboxManager(engine, node_loop)
    yield manager
    manager.close()


@pytest.fixture(scope="session")
def session_sandboxes(engine, node_loop: NodeLoop) -> Iterator[SandboxManager]:
    manager = SandboxManager(engine, node_loop)
    yield manager
    manager.close()


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.1) -> None:
    """Poll until `predicate` holds; for guest state that settles asynchronously."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)
