"""Abuse from one sandbox on a real node: the node answers, a neighbour runs, the abuser stays manageable.

One abusing sandbox goes through 500 MiB of command output, 1,000 files written through the
files API, a fork bomb, a full disk and exhausted memory, in that order (one abuser and
one neighbour shared by the tests keep them bounded under TCG). During or right after each
abuse the node's API answers and the neighbour runs commands; afterwards the abuser can still
be paused, resumed and killed, and its disk use on the host stays within its disk's size. Its
QEMU runs confined: an unprivileged uid of its own without capabilities (which cannot open the
neighbour's disk layer nor signal its QEMU), seccomp, a root of its own, and a cgroup whose
limits the guest filling all its RAM does not reach.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from e2b import CommandExitException, Sandbox
from e2b.sandbox.filesystem.filesystem import WriteEntry

from aenv.devnode import DevNode
from aenv.orchestrator.launch import DISK_SIZE_MB

from .conftest import NodeServer, Sandboxes, run_in

pytestmark = pytest.mark.vm

ADMISSION_SLOTS = 15360  # apart from every other node the suite starts
GUEST_USER_PROCESSES = 100  # the fork bomb's ceiling, so that the guest can be cleaned up after it
OUTPUT_MIB = 500
FILES, FILES_PER_REQUEST = 1000, 100
T = TypeVar("T")


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
    real_gid, effective_gid = map(int, fields["Gid"].split()[:2])
    assert uid != 0 and effective_gid != 0 and real_gid != effective_gid  # the VMM user, its group apart
    assert os.stat(f"/proc/{pid}/mem").st_uid == 0  # hence not dumpable: no other VMM traces it
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
    snapshot = sandbox.create_snapshot()  # seals the top: the node takes it back, QEMU gets a new one
    state = json.loads((node.home / "sandboxes" / sandbox.sandbox_id / "state.json").read_text())
    assert top.stat().st_uid == 0
    assert (node.home / "layers" / f"{state['disk_layers'][-1]}.qcow2").stat().st_uid == uid
    Sandbox.delete_snapshot(snapshot.snapshot_id)
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


@dataclass
class Pair:
    """The abusing sandbox and its neighbour, shared by the abuse tests (in file order)."""

    abuser: Any
    neighbour: Any
    pid: int  # the abuser's QEMU


@pytest.fixture(scope="module")
def pair(node: NodeServer) -> Iterator[Pair]:
    manager = Sandboxes()
    abuser, neighbour = manager.create(timeout=1800), manager.create(timeout=1800)
    yield Pair(abuser, neighbour, qemu_pid(node, abuser.sandbox_id))
    manager.close()


def test_each_vmm_has_a_uid_of_its_own(node: NodeServer, pair: Pair) -> None:
    """Two sandboxes' QEMUs run as different uids; one cannot open the other's top layer nor signal it."""
    pids = [pair.pid, qemu_pid(node, pair.neighbour.sandbox_id)]
    uids = [int(status_fields(pid)["Uid"].split()[0]) for pid in pids]
    assert uids[0] != uids[1] and 0 not in uids
    tops = []
    for sandbox in (pair.abuser, pair.neighbour):
        state = json.loads((node.home / "sandboxes" / sandbox.sandbox_id / "state.json").read_text())
        tops.append(node.home / "layers" / f"{state['disk_layers'][-1]}.qcow2")
    assert [top.stat().st_uid for top in tops] == uids
    assert all(top.stat().st_mode & 0o077 == 0 for top in tops)  # no other uid reads them either

    def as_abuser(script: str) -> subprocess.CompletedProcess[str]:
        """`script` as the abuser's QEMU runs: its uid, its root."""
        identity = [f"--reuid={uids[0]}", f"--regid={uids[0]}", "--clear-groups"]
        argv = ["nsenter", f"--mount=/proc/{pids[0]}/ns/mnt", "setpriv", *identity, "sh", "-c", script]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30)

    assert as_abuser(f"head -c 3 {tops[0]}").stdout == "QFI"  # its own layer (a qcow2)
    assert "Permission denied" in as_abuser(f"head -c 3 {tops[1]}").stderr
    signal = as_abuser(f"kill -0 {pids[1]}")
    assert signal.returncode != 0 and "not permitted" in signal.stderr


def while_running(work: Callable[[], T], node: NodeServer, neighbour: Any) -> T:
    """`work` in a thread; meanwhile the node's API and the neighbour must answer."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(work)
        node_and_neighbour_answer(node, neighbour)
        return future.result()


def disk_use(node: NodeServer, sandbox_id: str) -> int:
    """Bytes the sandbox's disk layers and directory take on the host."""
    state = json.loads((node.home / "sandboxes" / sandbox_id / "state.json").read_text())
    files = [node.home / "layers" / f"{layer}.qcow2" for layer in state["disk_layers"]]
    files += (node.home / "sandboxes" / sandbox_id).iterdir()
    return sum(path.stat().st_blocks * 512 for path in files if path.is_file())


def test_500_mib_of_output(node: NodeServer, pair: Pair) -> None:
    received = 0

    def count(chunk: str) -> None:
        nonlocal received
        received += len(chunk)

    def stream() -> Any:
        return pair.abuser.commands.run(
            f"yes | head -c {OUTPUT_MIB}M", retain_output=False, on_stdout=count, timeout=900
        )

    assert while_running(stream, node, pair.neighbour).exit_code == 0
    assert received == OUTPUT_MIB << 20


def test_1000_files_through_the_files_api(node: NodeServer, pair: Pair) -> None:
    def write() -> None:
        for batch in range(FILES // FILES_PER_REQUEST):
            entries = [
                WriteEntry(path=f"/home/user/many/{batch}-{i}.txt", data=f"file {batch}-{i}\n" * 64)
                for i in range(FILES_PER_REQUEST)
            ]
            pair.abuser.files.write_files(entries, request_timeout=300)

    while_running(write, node, pair.neighbour)
    assert len(pair.abuser.files.list("/home/user/many")) == FILES
    assert run_in(pair.abuser, "cat /home/user/many/7-77.txt | head -1") == "file 7-77\n"
    assert disk_use(node, pair.abuser.sandbox_id) < 1.1 * DISK_SIZE_MB * 2**20


def test_fork_bomb(node: NodeServer, pair: Pair) -> None:
    # Bounded by a per-user process limit so that the guest can be cleaned up.
    bomb = f"ulimit -u {GUEST_USER_PROCESSES}; b() {{ b | b & }}; b"
    pair.abuser.commands.run(f"bash -c '{bomb}'", background=True)
    node_and_neighbour_answer(node, pair.neighbour)
    # Every process of the guest's user at once: kill(-1) as that user, which a process in the
    # middle of a fork does not escape (as it escapes a listing, pkill's).
    for _ in range(3):
        with contextlib.suppress(CommandExitException):  # the command is one of them
            pair.abuser.commands.run("kill -9 -1", user="user", timeout=300)
    left = pair.abuser.commands.run("sleep 5; pgrep -cu user || true", user="root", timeout=300)
    assert left.stdout.strip() == "0"


def test_full_disk(node: NodeServer, pair: Pair) -> None:
    """The guest gets ENOSPC; the host's layers stay within the disk's virtual size."""
    free = "$(df --output=avail -B1 / | tail -1)"
    fill = f"fallocate -l $(({free} - (32 << 20))) ~/fill && head -c 64M /dev/zero > ~/more"
    with pytest.raises(CommandExitException) as full:
        pair.abuser.commands.run(fill, timeout=300)
    assert "No space left" in full.value.stderr
    assert disk_use(node, pair.abuser.sandbox_id) < 1.1 * DISK_SIZE_MB * 2**20
    node_and_neighbour_answer(node, pair.neighbour)
    run_in(pair.abuser, "rm -f ~/fill* ~/more && echo freed", timeout=120)


def test_exhausted_memory(node: NodeServer, pair: Pair) -> None:
    """The guest's OOM killer ends the hog; QEMU stays inside its cgroup's limit."""
    hog = "x = []\nwhile True: x.append(bytearray(b'x' * (8 << 20)))"
    with pytest.raises(CommandExitException):  # ended by the guest's OOM killer (or, thrashing, at 120 s)
        pair.abuser.commands.run(f"timeout -s KILL 120 python3 -c {shlex.quote(hog)}", timeout=600)
    node_and_neighbour_answer(node, pair.neighbour)
    group = memory_group(pair.pid)
    assert "oom_kill 0" in (group / "memory.oom_control").read_text()  # the host never OOM-killed QEMU
    anonymous = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())["rss"]
    print(f"\nQEMU {pair.pid}: {int(anonymous) >> 20} MiB anonymous memory after exhausting guest RAM")


def test_the_abuser_is_still_an_ordinary_sandbox(node: NodeServer, pair: Pair) -> None:
    assert pair.abuser.pause()
    assert disk_use(node, pair.abuser.sandbox_id) < 1.1 * DISK_SIZE_MB * 2**20
    resumed = Sandbox.connect(pair.abuser.sandbox_id)
    assert run_in(resumed, "ls /home/user/many | wc -l", timeout=300) == f"{FILES}\n"
    resumed.kill()
    assert pair.abuser.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]
    assert (
        pair.pid not in node.qemu_pids() and not (node.home / "sandboxes" / pair.abuser.sandbox_id).exists()
    )
    node_and_neighbour_answer(node, pair.neighbour)


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
