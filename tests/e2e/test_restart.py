"""A node killed with SIGKILL while sandboxes are paused and running loses none of them, nor
their checkpoints.

Runs on the session's node: crash it, start it again on the same home and port (a second
node would cost a second template build).
"""

from __future__ import annotations

import os

import pytest
from e2b import Sandbox, SandboxQuery, SandboxState

from aenv import rollouts

from .conftest import NodeServer, Sandboxes, wait_until

pytestmark = pytest.mark.vm

COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def crash_with(sandboxes: Sandboxes, node: NodeServer) -> dict:
    """A paused and a running sandbox with state in memory and on disk; then SIGKILL and restart."""
    paused = sandboxes.create(metadata={"restart": "paused"})
    paused.files.write("/tmp/state", "paused before the crash")
    paused_pid = paused.commands.run("sleep 3600", background=True).pid
    rollouts.checkpoint(paused, "kept")
    assert paused.pause()

    running = sandboxes.create(metadata={"restart": "running"}, timeout=600)
    running.files.write("/tmp/state", "running at the crash")
    rollouts.checkpoint(running, "before-counter")
    counter = running.commands.run(COUNTER, background=True)
    counter.disconnect()
    wait_until(lambda: running.files.exists("/tmp/count"), 20, what="the counter")

    old_qemus = node.qemu_pids()
    assert old_qemus, "the running sandbox has a QEMU process"
    node.sigkill()
    assert any(alive(pid) for pid in old_qemus), "QEMU outlives a crashed node (its own session)"
    node.start()
    return {
        "paused": (paused.sandbox_id, paused_pid),
        "running": (running.sandbox_id, counter.pid),
        "old_qemus": old_qemus,
    }


def test_sigkill_restart_keeps_every_sandbox(sandboxes: Sandboxes, crashable_node: NodeServer) -> None:
    """After a SIGKILL of the node, the paused sandbox resumes and the running one was adopted:
    none is lost, and no QEMU of the crashed process is left behind."""
    crash = crash_with(sandboxes, crashable_node)
    paused_id, paused_pid = crash["paused"]
    running_id, counter_pid = crash["running"]

    mine = SandboxQuery(metadata={"e2e": sandboxes.tag})
    listed = {s.sandbox_id: s for s in Sandbox.list(query=mine).next_items()}
    assert paused_id in listed, "the paused sandbox was lost in the crash"
    assert listed[paused_id].state == SandboxState.PAUSED
    resumed = Sandbox.connect(paused_id)
    assert resumed.files.read("/tmp/state") == "paused before the crash"
    assert paused_pid in [p.pid for p in resumed.commands.list()]
    assert [c["name"] for c in rollouts.checkpoints(resumed)] == ["kept"]  # checkpoints outlive the crash

    assert running_id in listed, "the sandbox running at the crash was lost"
    assert listed[running_id].state in (SandboxState.PAUSED, SandboxState.RUNNING)
    adopted = Sandbox.connect(running_id)
    assert adopted.files.read("/tmp/state") == "running at the crash"
    assert counter_pid in [p.pid for p in adopted.commands.list()]
    before = int(adopted.files.read("/tmp/count"))
    wait_until(lambda: int(adopted.files.read("/tmp/count")) > before, 20, what="the counter to go on")
    rollouts.reset(adopted, "before-counter")  # a checkpoint taken before the crash still resets
    assert adopted.files.read("/tmp/state") == "running at the crash"
    assert not adopted.files.exists("/tmp/count")
    assert adopted.kill()
    assert resumed.kill()

    # Every QEMU of the crashed process was adopted (and killed just above) or cleaned up.
    wait_until(lambda: not [pid for pid in crash["old_qemus"] if alive(pid)], 20, what="old QEMUs")
    fresh = sandboxes.create()
    assert fresh.commands.run("echo after restart").stdout == "after restart\n"
