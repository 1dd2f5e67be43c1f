"""Every killed rollout leaves nothing behind on the host (issue 34).

Rollouts as a trainer runs them, on the session node: a fan-out, tool calls (commands, file
writes and reads), checkpoints, resets that reuse the sandbox (each reset starts a new QEMU),
a pause, then kills. Each sandbox's own traces are followed through every step (its QEMU pids,
their cgroups, the disk layers it made, its checkpoints' included, its directory with the checkpoint
files) and must all be gone after the kill; what the node holds in all (QEMU processes, network
namespaces, their uplinks, nftables rules, files under its home, VM cgroups) must come back to
what it held before.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from e2b import Sandbox

from aenv import paths, rollouts

from .conftest import NodeServer, Sandboxes, run_in, wait_until
from .test_faults import settled, steady

CGROUPS = Path("/sys/fs/cgroup")
NET = Path("/sys/class/net")


@dataclass
class Traces:
    """What one sandbox made on the host, as its saved state named it over its life."""

    workdir: Path
    pids: set[int] = field(default_factory=set)
    layers: set[str] = field(default_factory=set)

    def note(self) -> None:
        state = json.loads((self.workdir / "state.json").read_text())
        if state.get("pid"):
            self.pids.add(int(state["pid"]))
        self.layers.update(state["disk_layers"], state.get("kept_layers", ()))


def uplinks(node: NodeServer) -> set[str]:
    """The host ends of the veth pairs in the node's slot range (`aenv.network.slots`)."""
    names = {f"aenv-v{index}" for index in range(node.slot_first, node.slot_first + node.slot_count)}
    return names & set(os.listdir(NET))


def tool_calls(sandbox: Sandbox, step: str) -> None:
    assert run_in(sandbox, f"echo {step} >> /tmp/trace; wc -l < /tmp/trace").strip()
    sandbox.files.write(f"/home/user/{step}.txt", step)
    assert sandbox.files.read(f"/home/user/{step}.txt") == step


def cgroups_of(pid: int) -> list[Path]:
    return list(CGROUPS.rglob(f"vm-{pid}"))


def test_killed_rollouts_leave_nothing_behind(node: NodeServer, sandboxes: Sandboxes) -> None:
    before = steady(node)
    links_before = uplinks(node)
    layers = paths.layers_dir(node.home)
    shared = {p.stem for p in layers.glob("*.qcow2")}  # the template's, which the sandboxes stand on
    group = rollouts.fan_out("base", 2, timeout=300, metadata={"e2e": sandboxes.tag})
    assert all(isinstance(s, Sandbox) for s in group), group
    for sandbox in group:
        sandboxes.track(sandbox.sandbox_id)
    traces = {s.sandbox_id: Traces(node.home / "sandboxes" / s.sandbox_id) for s in group}
    for sandbox in group:
        trace = traces[sandbox.sandbox_id]
        trace.note()
        assert trace.pids and all(cgroups_of(pid) for pid in trace.pids), "no VM cgroup to follow"
        tool_calls(sandbox, "prepare")
        rollouts.checkpoint(sandbox, "start")
        for episode in range(2):  # reset and reuse: a new QEMU each time
            tool_calls(sandbox, f"episode{episode}")
            trace.note()
            rollouts.reset(sandbox, "start")
            trace.note()
        assert len(trace.pids) == 3 and list((trace.workdir / "checkpoints").iterdir())
    second = group[1]
    rollouts.checkpoint(second, "late")
    traces[second.sandbox_id].note()
    assert second.pause()  # killed while paused: its pause's files and checkpoints go too
    for sandbox in group:
        Sandbox.kill(sandbox.sandbox_id)

    for sandbox_id, trace in traces.items():
        wait_until(lambda t=trace: not any(Path(f"/proc/{pid}").exists() for pid in t.pids), 30,
                   what=f"the QEMU processes of {sandbox_id} to end")  # fmt: skip
        assert not trace.workdir.exists(), sorted(p.name for p in trace.workdir.rglob("*"))
        assert not [pid for pid in trace.pids if cgroups_of(pid)], "VM cgroups left"
        own = trace.layers - shared
        left = [layer for layer in own if (layers / f"{layer}.qcow2").exists()]
        assert own and not left, f"disk layers left: {left}"
    settled(node, before)
    # As many as before, not the same ones: the network pool refills on whichever slots are free.
    wait_until(lambda: len(uplinks(node)) <= len(links_before), 30, what="the node's uplinks to be as many")
