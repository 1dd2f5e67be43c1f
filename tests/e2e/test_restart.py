"""A node killed with SIGKILL while sandboxes are paused and running loses none of them.

Runs on the session's node: crash it, start it again on the same home and port (a second
node would cost a second template build).
"""

from __future__ import annotations

import os

import pytest
from e2b import Sandbox, SandboxQuery, SandboxState

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
    assert paused.pause()

    running = sandboxes.create(metadata={"restart": "running"}, timeout=600)
    running.files.write("/tmp/state", "running at the crash")
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


ADOPTION_BUG = (
    "a sandbox running at the crash was lost: engine.adopt() checks that QEMU's cmdline names "
    "sandboxes/<id>, but a sandbox taken from the warm pool runs a QEMU spawned under "
    "runtime/warm/<entry> (the directory is only renamed), so the restarted node forgets it"
)
LEAK_BUG = (
    "QEMU processes of the crashed node outlive it unowned: nothing kills its warm-pool guests, nor "
    "the VM of a sandbox whose adoption failed (Orchestrator._recover -> engine.kill(state) only "
    "frees files and network)"
)


def test_sigkill_restart_keeps_every_sandbox(sandboxes: Sandboxes, crashable_node: NodeServer) -> None:
    """Hard checks for what works; the known bugs end the test as an xfail naming them, so any
    other failure (or a regression of what works) still fails it."""
    crash = crash_with(sandboxes, crashable_node)
    paused_id, paused_pid = crash["paused"]
    running_id, counter_pid = crash["running"]
    known_bugs = []

    mine = SandboxQuery(metadata={"e2e": sandboxes.tag})
    listed = {s.sandbox_id: s for s in Sandbox.list(query=mine).next_items()}
    assert paused_id in listed, "the paused sandbox was lost in the crash"
    assert listed[paused_id].state == SandboxState.PAUSED
    resumed = Sandbox.connect(paused_id)
    assert resumed.files.read("/tmp/state") == "paused before the crash"
    assert paused_pid in [p.pid for p in resumed.commands.list()]

    if running_id not in listed:
        known_bugs.append(ADOPTION_BUG)
    else:
        # adopted: paused (or still running), never dropped
        assert listed[running_id].state in (SandboxState.PAUSED, SandboxState.RUNNING)
        adopted = Sandbox.connect(running_id)
        assert adopted.files.read("/tmp/state") == "running at the crash"
        assert counter_pid in [p.pid for p in adopted.commands.list()]
        before = int(adopted.files.read("/tmp/count"))
        wait_until(lambda: int(adopted.files.read("/tmp/count")) > before, 20, what="the counter to go on")
        assert adopted.kill()
    assert resumed.kill()

    # Every QEMU of the crashed process was adopted (and killed just above) or cleaned up.
    try:
        wait_until(lambda: not [pid for pid in crash["old_qemus"] if alive(pid)], 20, what="old QEMUs")
    except AssertionError:
        known_bugs.append(LEAK_BUG)

    if known_bugs:
        pytest.xfail(" | ".join(known_bugs))
    fresh = sandboxes.create()
    assert fresh.commands.run("echo after restart").stdout == "after restart\n"
