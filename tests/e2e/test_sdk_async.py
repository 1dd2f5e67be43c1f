"""The official `e2b` Python SDK (async API), unchanged, against a real node."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    FileType,
    NotFoundException,
    PtySize,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)

from .conftest import NodeServer

pytestmark = [pytest.mark.vm, pytest.mark.asyncio(loop_scope="function")]


class AsyncSandboxes:
    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.ids: list[str] = []

    async def create(self, *args, **kwargs) -> AsyncSandbox:
        kwargs["metadata"] = {"e2e": self.tag, **(kwargs.get("metadata") or {})}
        kwargs.setdefault("timeout", 300)
        sandbox = await AsyncSandbox.create(*args, **kwargs)
        self.ids.append(sandbox.sandbox_id)
        return sandbox


@pytest.fixture
async def asandboxes(node: NodeServer) -> AsyncIterator[AsyncSandboxes]:
    manager = AsyncSandboxes(f"async-{time.monotonic_ns()}")
    yield manager
    for sandbox_id in manager.ids:
        with contextlib.suppress(Exception):
            await AsyncSandbox.kill(sandbox_id)


async def eventually(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := await predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.25)
    return value


async def test_async_create_commands_pty(asandboxes: AsyncSandboxes) -> None:
    by_alias, by_id_source = await asyncio.gather(
        asandboxes.create("base", envs={"FOO": "bar"}, metadata={"k": "v"}, timeout=120),
        asandboxes.create(secure=True),
    )
    template_id = (await by_id_source.get_info()).template_id
    by_id = await asandboxes.create(template_id)
    assert (await by_id.commands.run("echo ok")).stdout == "ok\n"
    sandbox = by_alias
    assert await sandbox.is_running()
    info = await sandbox.get_info()
    assert info.state == SandboxState.RUNNING and info.metadata["k"] == "v"

    command = 'echo "$FOO $X"; pwd; whoami'
    result = await sandbox.commands.run(command, envs={"X": "1"}, cwd="/tmp", user="root")
    assert result.stdout == "bar 1\n/tmp\nroot\n"
    with pytest.raises(CommandExitException) as failed:
        await sandbox.commands.run("exit 4")
    assert failed.value.exit_code == 4
    with pytest.raises(TimeoutException):
        await sandbox.commands.run("sleep 30", timeout=2)

    cat = await sandbox.commands.run("cat", background=True, stdin=True)
    await sandbox.commands.send_stdin(cat.pid, "from async\n")
    await sandbox.commands.close_stdin(cat.pid)
    assert (await cat.wait()).stdout == "from async\n"
    sleeper = await sandbox.commands.run("sleep 100", background=True)
    assert sleeper.pid in [p.pid for p in await sandbox.commands.list()]
    assert await sandbox.commands.kill(sleeper.pid)

    output = bytearray()
    terminal = await sandbox.pty.create(PtySize(rows=24, cols=80), on_data=output.extend)
    await sandbox.pty.resize(terminal.pid, PtySize(rows=40, cols=120))
    await sandbox.pty.send_stdin(terminal.pid, b"stty size; echo async-$((6*7)); exit\n")
    await terminal.wait()
    assert "async-42" in output.decode(errors="replace")
    assert "40 120" in output.decode(errors="replace")


async def test_async_files(asandboxes: AsyncSandboxes) -> None:
    sandbox = await asandboxes.create()
    files = sandbox.files
    assert (await files.write("a.txt", "hello")).path == "/home/user/a.txt"
    assert await files.read("a.txt") == "hello"
    assert bytes(await files.read("a.txt", format="bytes")) == b"hello"
    await files.write("/tmp/gz", "g" * 5000, gzip=True)
    assert await files.read("/tmp/gz", gzip=True) == "g" * 5000
    written = await files.write_files([{"path": "/tmp/m/1", "data": "1"}, {"path": "r/2", "data": "2"}])
    assert len(written) == 2
    assert await files.exists("/tmp/m/1")
    assert not await files.exists("/tmp/nope")
    with pytest.raises(NotFoundException):
        await files.read("/tmp/nope")
    assert await files.make_dir("/tmp/dir")
    assert not await files.make_dir("/tmp/dir")
    assert (await files.get_info("/tmp/dir")).type == FileType.DIR
    assert [e.name for e in await files.list("/tmp/m")] == ["1"]
    assert (await files.rename("/tmp/m/1", "/tmp/m/one")).name == "one"
    await files.remove("/tmp/m")
    assert not await files.exists("/tmp/m")

    events = []
    handle = await files.watch_dir("/tmp/dir", on_event=events.append)
    try:
        await files.write("/tmp/dir/new.txt", "x")

        async def seen() -> bool:
            return any(e.name == "new.txt" for e in events)

        await eventually(seen, 20, "watch events")
    finally:
        await handle.stop()


async def test_async_host_list_lifecycle(asandboxes: AsyncSandboxes, node: NodeServer) -> None:
    sandbox = await asandboxes.create(metadata={"which": "one"})
    other = await asandboxes.create(metadata={"which": "two"})

    await sandbox.commands.run("cd /tmp && python3 -m http.server 8003", background=True)
    host = sandbox.get_host(8003)
    assert host == f"8003-{sandbox.sandbox_id}.{node.domain}"
    async with httpx.AsyncClient(timeout=10) as client:

        async def served():
            response = await client.get(node.url + "/", headers={"Host": host})
            return response.status_code == 200

        await eventually(served, 60, "the sandbox's HTTP server")

    query = SandboxQuery(metadata={"e2e": asandboxes.tag})
    listed = await AsyncSandbox.list(query=query).next_items()
    assert {s.sandbox_id for s in listed} == {sandbox.sandbox_id, other.sandbox_id}
    two = SandboxQuery(metadata={"e2e": asandboxes.tag, "which": "two"})
    only = await AsyncSandbox.list(query=two).next_items()
    assert [s.sandbox_id for s in only] == [other.sandbox_id]

    await sandbox.set_timeout(900)
    assert (await sandbox.get_info()).end_at.timestamp() - time.time() > 800

    await sandbox.files.write("/tmp/kept", "kept")
    assert await sandbox.pause()
    assert not await sandbox.is_running()
    paused_query = SandboxQuery(metadata={"e2e": asandboxes.tag}, state=[SandboxState.PAUSED])
    paused = await AsyncSandbox.list(query=paused_query).next_items()
    assert [s.sandbox_id for s in paused] == [sandbox.sandbox_id]
    resumed = await AsyncSandbox.connect(sandbox.sandbox_id)
    assert await resumed.files.read("/tmp/kept") == "kept"

    snapshot = await resumed.create_snapshot()
    assert snapshot.snapshot_id in [s.snapshot_id for s in await AsyncSandbox.list_snapshots().next_items()]
    clone = await asandboxes.create(snapshot.snapshot_id)
    assert await clone.files.read("/tmp/kept") == "kept"
    assert await AsyncSandbox.delete_snapshot(snapshot.snapshot_id)
    assert not await AsyncSandbox.delete_snapshot(snapshot.snapshot_id)

    forks = await resumed.fork(count=1)
    assert not isinstance(forks[0], Exception), forks[0]
    asandboxes.ids.append(forks[0].sandbox_id)
    assert await forks[0].files.read("/tmp/kept") == "kept"

    assert await other.kill()
    assert not await AsyncSandbox.kill(other.sandbox_id)
    with pytest.raises(NotFoundException):
        await AsyncSandbox.get_info(other.sandbox_id)
