"""Abuse from one sandbox on a real node: the node answers, a neighbour runs, the abuser stays manageable.

One abusing sandbox goes through a fork bomb, a full disk and exhausted memory, in that order
(one VM keeps the test bounded under TCG). Between
abuses the node's API answers and a neighbour sandbox runs commands; afterwards the abuser can
still be paused, resumed and killed. Its QEMU runs confined: no capabilities, seccomp, and a
cgroup of its own whose limits the guest filling all its RAM does not reach.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import CommandExitException, Sandbox

from aenv.devnode import DevNode
from aenv.orchestrator.service import DISK_SIZE_MB

from .conftest import NodeServer, Sandboxes, run_in

pytestmark = pytest.mark.vm

ADMISSION_SLOTS = 15360  # apart from every other node the suite starts
GUEST_USER_PROCESSES = 100  # the fork bomb's ceiling, so that the guest can be cleaned up after it


def qemu_pid(node: NodeServer, sandbox_id: str) -> int:
    return json.loads((node.home / "sandboxes" / sandbox_id / "state.json").read_text())["pid"]


def status_fields(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {name: value.strip() for name, _, value in (line.partition(":") for line in lines)}


def memory_group(pid: int) -> Path:
    """The v1 memory cgroup directory of a process (the host runs cgroup v1)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    raise AssertionError(f"process {pid} has no memory cgroup")


def node_and_neighbour_answer(node: NodeServer, neighbour: Any) -> None:
    assert node.healthy(timeout=30)
    assert run_in(neighbour, "echo ok", timeout=120) == "ok\n"


def test_qemu_runs_confined(node: NodeServer, sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create()
    pid = qemu_pid(node, sandbox.sandbox_id)
    fields = status_fields(pid)
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0
    assert fields["NoNewPrivs"] == "1" and fields["Seccomp"] == "2"
    assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    root = next(
        line.split()
        for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        if line.split()[4] == "/"
    )
    assert root[5].startswith("ro")  # a root of its own, read-only
    uid = int(fields["Uid"].split()[0])
    assert uid != 0 and int(fields["Gid"].split()[0]) != 0  # the VMM user
    view = Path(f"/proc/{pid}/root")
    assert not (view / str(node.home / "node.db").lstrip("/")).exists()  # only what VMs use is there
    assert not (view / "home").exists() and (view / str(node.home / "layers").lstrip("/")).is_dir()
    state = json.loads((node.home / "sandboxes" / sandbox.sandbox_id / "state.json").read_text())
    *sealed, top = [node.home / "layers" / f"{layer}.qcow2" for layer in state["disk_layers"]]
    assert top.stat().st_uid == uid  # the one file it writes by name
    assert all(layer.stat().st_uid == 0 for layer in sealed if layer.exists())
    image = next(line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                 if "/blobs/" in line)  # fmt: skip
    assert os.stat(image).st_uid == 0 and not os.stat(image).st_mode & 0o022  # immutable to QEMU
    group = memory_group(pid)
    assert group.name == f"vm-{pid}" and group.parent.name == "aenv"
    info = Sandbox.get_info(sandbox.sandbox_id)
    limit = int((group / "memory.limit_in_bytes").read_text())
    assert limit > info.memory_mb * 2**20
    cpu = Path("/sys/fs/cgroup/cpu/aenv") / f"vm-{pid}"
    assert int((cpu / "cpu.cfs_quota_us").read_text()) == info.cpu_count * 100_000
    assert int((Path("/sys/fs/cgroup/pids/aenv") / f"vm-{pid}" / "pids.max").read_text()) > 0
    sandbox.kill()
    assert not group.exists() and not cpu.exists()


def test_abuse_hurts_neither_the_node_nor_a_neighbour(node: NodeServer, sandboxes: Sandboxes) -> None:
    abuser, neighbour = sandboxes.create(timeout=1800), sandboxes.create(timeout=1800)
    pid = qemu_pid(node, abuser.sandbox_id)
    info = Sandbox.get_info(abuser.sandbox_id)

    # A fork bomb, bounded by a per-user process limit so that the guest can be cleaned up.
    bomb = f"ulimit -u {GUEST_USER_PROCESSES}; b() {{ b | b & }}; b"
    abuser.commands.run(f"bash -c '{bomb}'", background=True)
    node_and_neighbour_answer(node, neighbour)
    # Stopped first, so that none forks while the others are killed.
    stop = (
        "for i in 1 2 3; do pkill -STOP -u user; done; pkill -KILL -u user; sleep 1; pgrep -cu user || true"
    )
    assert abuser.commands.run(stop, user="root", timeout=300).stdout.strip() in ("", "0")

    # A full disk: the guest gets ENOSPC, the host's layer stays within the disk's virtual size.
    free = "$(df --output=avail -B1 / | tail -1)"
    fill = f"fallocate -l $(({free} - (32 << 20))) ~/fill && head -c 64M /dev/zero > ~/more"
    with pytest.raises(CommandExitException) as full:
        abuser.commands.run(fill, timeout=300)
    assert "No space left" in full.value.stderr
    state = json.loads((node.home / "sandboxes" / abuser.sandbox_id / "state.json").read_text())
    layers = [node.home / "layers" / f"{layer}.qcow2" for layer in state["disk_layers"]]
    assert (
        sum(layer.stat().st_blocks * 512 for layer in layers if layer.exists()) < 1.1 * DISK_SIZE_MB * 2**20
    )
    node_and_neighbour_answer(node, neighbour)
    run_in(abuser, "rm -f ~/fill* ~/more && echo freed", timeout=120)

    # All guest RAM: the guest's OOM killer ends the hog; QEMU stays inside its cgroup's limit.
    hog = "x = []\nwhile True: x.append(bytearray(b'x' * (8 << 20)))"
    with pytest.raises(CommandExitException):  # ended by the guest's OOM killer (or, thrashing, at 120 s)
        abuser.commands.run(f"timeout -s KILL 120 python3 -c {shlex.quote(hog)}", timeout=600)
    node_and_neighbour_answer(node, neighbour)
    group = memory_group(pid)
    assert "oom_kill 0" in (group / "memory.oom_control").read_text()  # the host never OOM-killed QEMU
    anonymous = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())["rss"]
    print(f"\nQEMU {pid}: {int(anonymous) >> 20} MiB anonymous memory for a {info.memory_mb} MiB guest")

    # The abuser is still an ordinary sandbox.
    assert abuser.pause()
    resumed = Sandbox.connect(abuser.sandbox_id)
    assert run_in(resumed, "echo back", timeout=300) == "back\n"
    resumed.kill()
    assert abuser.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]


def test_a_node_below_its_disk_reserve_refuses_creates_with_507(tmp_path: Path, template_seed: Path) -> None:
    node = DevNode(
        tmp_path / "home", slot_first=ADMISSION_SLOTS, slot_count=64, seed=template_seed,
        warm_pool_size=0, disk_reserve_mib=2**40,
    )  # fmt: skip
    with node:
        refused = httpx.post(
            f"{node.url}/sandboxes", json={"templateID": "base"}, headers={"X-API-Key": node.key}, timeout=60
        )
        assert refused.status_code == 507
        assert refused.json()["code"] == 507 and "below its reserve" in refused.json()["message"]
        assert node.qemu_pids() == []  # refused before any VM was started
