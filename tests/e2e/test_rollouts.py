"""Fan-out, checkpoints and reset on a real node, through the official SDK, `aenv.rollouts` and the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from e2b import AsyncSandbox, NotFoundException, Sandbox
from e2b.exceptions import SandboxException

from aenv import paths, rollouts

from .conftest import NodeServer, Sandboxes, run_in, wait_until

pytestmark = pytest.mark.vm

# A process whose memory holds a value: it answers /tmp/ask with it and takes a new one from /tmp/change.
KEEPER = """
import os, time
value = open('/tmp/seed').read()
while True:
    if os.path.exists('/tmp/change'):
        new = open('/tmp/change').read()
        if new:  # envd writes a file in place: an empty one may still be filling
            value = new; os.remove('/tmp/change')
    if os.path.exists('/tmp/ask'):
        os.remove('/tmp/ask'); open('/tmp/answer.tmp', 'w').write(value)
        os.rename('/tmp/answer.tmp', '/tmp/answer')
    time.sleep(0.05)
"""


def ask(sandbox: Sandbox) -> str:
    """The value in the keeper process's memory."""
    wait = "for i in $(seq 200); do [ -f /tmp/answer ] && break; sleep 0.05; done"
    return run_in(sandbox, f"rm -f /tmp/answer; touch /tmp/ask; {wait}; cat /tmp/answer")


def start_keeper(sandbox: Sandbox, value: str) -> str:
    sandbox.files.write("/tmp/keeper.py", KEEPER)
    sandbox.files.write("/tmp/seed", value)
    sandbox.commands.run("python3 /tmp/keeper.py", background=True)
    assert ask(sandbox) == value
    return run_in(sandbox, "pgrep -f keeper.py").split()[0]


def aenv(node: NodeServer, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AENV_URL": node.url, "AENV_API_KEY": node.key}
    command = [sys.executable, "-m", "aenv.cli", "-o", "json", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_reset_restores_processes_files_and_memory_exactly(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create("base")
    token = sandbox._envd_access_token
    pid = start_keeper(sandbox, "alpha")
    sandbox.files.write("/home/user/state.txt", "one")
    first = rollouts.checkpoint(sandbox, "start")
    assert first["name"] == "start" and first["parent"].startswith("snapshot:") and first["pages"] > 0

    sandbox.files.write("/tmp/change", "beta")
    sandbox.files.write("/home/user/state.txt", "two")
    sandbox.files.write("/home/user/new.txt", "made after the checkpoint")
    sandbox.commands.run("sleep 1000", background=True)
    assert ask(sandbox) == "beta"
    time.sleep(3)  # the guest's clock must be set forward by the reset, not left at the checkpoint's

    for _ in range(2):  # twice: a checkpoint stays usable after a reset to it
        rollouts.reset(sandbox, "start")
        assert sandbox.files.read("/home/user/state.txt") == "one"
        assert not sandbox.files.exists("/home/user/new.txt")
        assert run_in(sandbox, "pgrep -f keeper.py").split()[0] == pid
        assert run_in(sandbox, "pgrep -x sleep || true") == ""
        assert ask(sandbox) == "alpha"
        assert abs(int(run_in(sandbox, "date +%s")) - time.time()) < 3
        sandbox.files.write("/home/user/state.txt", "three")
    info = Sandbox.get_info(sandbox.sandbox_id)
    assert info.state.value == "running" and sandbox._envd_access_token == token

    second = rollouts.checkpoint(sandbox)  # no name: its id only; its parent is the one it came from
    assert second["name"] is None and second["parent"] == first["checkpointID"]
    assert [c["checkpointID"] for c in rollouts.checkpoints(sandbox)] == [
        first["checkpointID"],
        second["checkpointID"],
    ]
    rollouts.reset(sandbox, second["checkpointID"])
    assert sandbox.files.read("/home/user/state.txt") == "three"
    rollouts.delete_checkpoint(sandbox, "start")
    assert [c["checkpointID"] for c in rollouts.checkpoints(sandbox)] == [second["checkpointID"]]
    with pytest.raises(NotFoundException):
        rollouts.reset(sandbox, "start")


def standby_vm(workdir: Path) -> tuple[int, str] | None:
    """The pid and disk layer of the QEMU kept as the sandbox's standby (`aenv.snapshot.standby`):
    the one whose log is in a `standby-*` directory of the sandbox's (removed once a reset took it)."""
    for fd in Path("/proc").glob("[0-9]*/fd/1"):
        try:
            log = os.readlink(fd)
            if not log.startswith(f"{workdir}/standby-") or log.endswith(" (deleted)"):
                continue
            cmdline = (fd.parent.parent / "cmdline").read_bytes().decode()
        except OSError:
            continue
        layer = re.search(r"node-name=root,[^\0]*?/layers/([^/,\0]+)\.qcow2", cmdline)
        assert layer, cmdline
        return int(fd.parent.parent.name), layer.group(1)
    return None


def test_resets_continue_the_checkpoints_standby(node: NodeServer, sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create("base")
    workdir = node.home / "sandboxes" / sandbox.sandbox_id
    pid = start_keeper(sandbox, "alpha")
    sandbox.files.write("/home/user/state.txt", "one")
    rollouts.checkpoint(sandbox, "start")
    vms: list[tuple[int, str]] = []
    for episode in range(2):  # the checkpoint's standby, then the one made after that reset
        sandbox.files.write("/home/user/state.txt", f"episode {episode}")
        sandbox.files.write("/tmp/change", "beta")
        assert ask(sandbox) == "beta"
        vms.append(wait_until(lambda: standby_vm(workdir), 60, what="a standby of the checkpoint"))
        rollouts.reset(sandbox, "start")
        state = json.loads((workdir / "state.json").read_text())
        assert (state["pid"], state["disk_layers"][-1]) == vms[-1], "the reset did not continue the standby"
        assert sandbox.files.read("/home/user/state.txt") == "one"
        assert run_in(sandbox, "pgrep -f keeper.py").split()[0] == pid
        assert ask(sandbox) == "alpha"
        assert abs(int(run_in(sandbox, "date +%s")) - time.time()) < 3
    vms.append(wait_until(lambda: standby_vm(workdir), 60, what="the next standby"))
    Sandbox.kill(sandbox.sandbox_id)
    layers = paths.layers_dir(node.home)

    def gone() -> bool:
        return not any(Path(f"/proc/{p}").exists() or (layers / f"{l_}.qcow2").exists() for p, l_ in vms)

    wait_until(gone, 30, what="the standbys' QEMU processes and disk layers to go")
    assert not workdir.exists()


def test_a_checkpoint_becomes_a_snapshot_to_fan_out_from(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create("base")
    sandbox.files.write("/home/user/prepared.txt", "at the checkpoint")
    rollouts.checkpoint(sandbox, "prepared")
    sandbox.files.write("/home/user/prepared.txt", "later")
    snapshot_id = rollouts.promote(sandbox, "prepared", name=f"cp-{sandboxes.tag}")
    (child,) = rollouts.fan_out(f"cp-{sandboxes.tag}", 1, metadata={"e2e": sandboxes.tag})
    assert isinstance(child, Sandbox), child
    sandboxes.track(child.sandbox_id)
    assert child.files.read("/home/user/prepared.txt") == "at the checkpoint"
    assert sandbox.files.read("/home/user/prepared.txt") == "later"  # the source runs on, unchanged
    child.kill()
    Sandbox.delete_snapshot(snapshot_id)


def test_checkpoint_refusals(node: NodeServer, sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create("base")
    rollouts.checkpoint(sandbox, "taken")
    headers = {"X-API-Key": node.key}
    base = f"{node.url}/sandboxes/{sandbox.sandbox_id}"
    taken = httpx.post(f"{base}/checkpoints", json={"name": "taken"}, headers=headers, timeout=60)
    assert taken.status_code == 409, taken.text
    bad = httpx.post(f"{base}/checkpoints", json={"name": "../x"}, headers=headers, timeout=60)
    assert bad.status_code == 400 and bad.json()["message"], bad.text
    missing = httpx.post(f"{base}/reset", json={}, headers=headers, timeout=60)
    assert missing.status_code == 400, missing.text
    unknown = httpx.delete(f"{base}/checkpoints/nope", headers=headers, timeout=60)
    assert unknown.status_code == 404, unknown.text
    assert sandbox.pause()
    paused = httpx.post(f"{base}/checkpoints", json={}, headers=headers, timeout=60)
    assert paused.status_code == 409 and "paused" in paused.json()["message"], paused.text
    reset = httpx.post(f"{base}/reset", json={"checkpoint": "taken"}, headers=headers, timeout=60)
    assert reset.status_code == 409, reset.text
    resumed = Sandbox.connect(sandbox.sandbox_id)  # a paused sandbox keeps its checkpoints
    rollouts.reset(resumed, "taken")
    assert run_in(resumed, "echo ok") == "ok\n"


def test_checkpoint_and_reset_with_the_cli(node: NodeServer, sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create("base")
    sandbox.files.write("/home/user/cli.txt", "before")
    created = aenv(node, "checkpoint", "create", sandbox.sandbox_id, "--name", "cli")
    assert created.returncode == 0, created.stderr
    checkpoint_id = json.loads(created.stdout)["checkpointID"]
    listed = aenv(node, "checkpoint", "ls", sandbox.sandbox_id)
    assert [c["checkpointID"] for c in json.loads(listed.stdout)] == [checkpoint_id]
    sandbox.files.write("/home/user/cli.txt", "after")
    reset = aenv(node, "reset", sandbox.sandbox_id, "cli")
    assert reset.returncode == 0, reset.stderr
    assert json.loads(reset.stdout)["sandboxID"] == sandbox.sandbox_id
    assert sandbox.files.read("/home/user/cli.txt") == "before"
    removed = aenv(node, "checkpoint", "rm", sandbox.sandbox_id, checkpoint_id)
    assert removed.returncode == 0, removed.stderr
    assert json.loads(aenv(node, "checkpoint", "ls", sandbox.sandbox_id).stdout) == []


def test_fan_out_returns_sdk_sandboxes_once_per_key(node: NodeServer, sandboxes: Sandboxes) -> None:
    key = uuid.uuid4().hex
    group = rollouts.fan_out("base", 3, timeout=300, metadata={"e2e": sandboxes.tag}, idempotency_key=key)
    for sandbox in group:
        assert isinstance(sandbox, Sandbox), sandbox
        sandboxes.track(sandbox.sandbox_id)
    assert [run_in(s, "echo $((6*7))") for s in group] == ["42\n"] * 3
    again = rollouts.fan_out("base", 3, timeout=300, idempotency_key=key)
    assert [s.sandbox_id for s in again] == [s.sandbox_id for s in group]  # a retry makes none
    assert len({s.sandbox_id for s in group}) == 3
    assert all(Sandbox.get_info(s.sandbox_id).metadata["e2e"] == sandboxes.tag for s in group)

    missing = rollouts.fan_out("no-such-template", 2)
    assert all(isinstance(r, NotFoundException) for r in missing), missing
    with pytest.raises(SandboxException, match="400"):
        rollouts.fan_out("base", 1001)


def test_fan_out_checkpoint_and_reset_from_asyncio(sandboxes: Sandboxes) -> None:
    async def rollout() -> tuple[str, str]:
        (sandbox,) = await rollouts.fan_out_async("base", 1, metadata={"e2e": sandboxes.tag})
        assert isinstance(sandbox, AsyncSandbox), sandbox
        sandboxes.track(sandbox.sandbox_id)
        await sandbox.files.write("/home/user/a.txt", "first")
        await rollouts.checkpoint_async(sandbox, "a")
        await sandbox.files.write("/home/user/a.txt", "second")
        await rollouts.reset_async(sandbox, "a")
        return sandbox.sandbox_id, await sandbox.files.read("/home/user/a.txt")

    sandbox_id, content = asyncio.run(rollout())
    assert content == "first" and Sandbox.get_info(sandbox_id).state.value == "running"


def test_fan_out_with_the_cli(node: NodeServer, sandboxes: Sandboxes) -> None:
    done = aenv(node, "fanout", "base", "-n", "2", "-m", f"e2e={sandboxes.tag}")
    assert done.returncode == 0, done.stderr
    ids = [r["sandbox"]["sandboxID"] for r in json.loads(done.stdout)]
    for sandbox_id in ids:
        sandboxes.track(sandbox_id)
    assert len(ids) == 2 and all(Sandbox.get_info(i).metadata["e2e"] == sandboxes.tag for i in ids)


def _readme_blocks(language: str) -> list[str]:
    """The README's code blocks of the "Fan-out, checkpoints and reset" section."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = re.split(r"\n##+ ", text.split("### Fan-out, checkpoints and reset", 1)[1], maxsplit=1)[0]
    return [block.split("```", 1)[0] for block in section.split(f"```{language}\n")[1:]]


def test_the_readme_examples_work_pasted(node: NodeServer, tmp_path: Path) -> None:
    (python,) = _readme_blocks("python")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    ran = subprocess.run([sys.executable, "-c", python], env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr
    assert "solve me" in ran.stdout
    (shell,) = _readme_blocks("sh")
    env |= {
        "AENV_URL": node.url,
        "AENV_API_KEY": node.key,
        "PATH": f"{Path(sys.executable).parent}:{env['PATH']}",
    }
    ran = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", shell], env=env, capture_output=True, text=True, timeout=600
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.count('"checkpointID"') == 3  # created, listed, removed (JSON when piped)
