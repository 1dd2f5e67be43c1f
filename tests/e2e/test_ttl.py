"""TTL expiry: the node's evictor pauses (`on_timeout: pause`) or kills (the default) expired sandboxes."""

from __future__ import annotations

import pytest
from e2b import NotFoundException, Sandbox, SandboxState

from .conftest import Sandboxes, wait_until

pytestmark = pytest.mark.vm


def state_of(sandbox_id: str) -> SandboxState | None:
    try:
        return Sandbox.get_info(sandbox_id).state
    except NotFoundException:
        return None


def test_expiry_pauses_with_auto_pause(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create(timeout=3, lifecycle={"on_timeout": "pause"})
    assert sandbox.get_info().lifecycle["on_timeout"] == "pause"
    sandbox.files.write("/tmp/survives", "ttl")
    sandbox.commands.run("sleep 600", background=True).disconnect()
    wait_until(lambda: state_of(sandbox.sandbox_id) == SandboxState.PAUSED, 30, what="auto-pause")
    assert not sandbox.is_running()
    resumed = Sandbox.connect(sandbox.sandbox_id, timeout=120)
    assert resumed.get_info().state == SandboxState.RUNNING
    assert resumed.files.read("/tmp/survives") == "ttl"
    commands = [" ".join([p.cmd, *p.args]) for p in resumed.commands.list()]
    assert any("sleep 600" in c for c in commands), commands


def test_expiry_kills_by_default(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create(timeout=3)
    assert sandbox.get_info().lifecycle["on_timeout"] == "kill"
    wait_until(lambda: state_of(sandbox.sandbox_id) is None, 30, what="the sandbox to be killed")
    assert not Sandbox.kill(sandbox.sandbox_id)
    assert not sandbox.is_running()
    with pytest.raises(NotFoundException):
        Sandbox.connect(sandbox.sandbox_id)


def test_explicit_kill_lifecycle(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create(timeout=3, lifecycle={"on_timeout": "kill"})
    wait_until(lambda: state_of(sandbox.sandbox_id) is None, 30, what="the sandbox to be killed")
    assert not Sandbox.kill(sandbox.sandbox_id)
