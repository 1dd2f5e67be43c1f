"""Faults on a real node, after each of which every acknowledged sandbox is accounted for and
nothing is left on the host: a QEMU process killed under its sandbox, the node killed with
SIGKILL in the middle of a pause, and the repository becoming unwritable during a snapshot.

"Nothing left" compares what the node holds on the host (QEMU processes, network namespaces,
nftables rules, files under its home, VM cgroups: `bench.soak.footprint`) with what it held
before the test, once the test's sandboxes are gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import SandboxException

from bench.soak import footprint

from .conftest import NodeServer, Sandboxes, run_in, wait_until

pytestmark = pytest.mark.vm

DIRTY_MIB = 192  # guest memory a sandbox changes before its pause, so that the capture takes a while
# What a node process holds by itself (a restarted node is a new process), not what it leaks.
PER_PROCESS = ("node_fds", "node_rss_mib")


def held(node: NodeServer) -> dict[str, float]:
    """What the node holds on the host, as the soak counts it (see the module docstring)."""
    assert node.pid is not None
    counts = footprint(node.home, node.pid)
    # This node's namespaces only: the session's other node may still be refilling its pools.
    counts["namespaces"] = len(node.owned_netns())
    # A failed commit's pending mark stays, saying why, until the collector's grace has passed
    # (`SnapshotRepository.gc`): a record other nodes read, with a bounded life, not a leak.
    marks = node.home / "repository" / "marks"
    counts["home_files"] -= len(list(marks.iterdir())) if marks.is_dir() else 0
    return {name: value for name, value in counts.items() if name not in PER_PROCESS}


def steady(node: NodeServer) -> dict[str, float]:
    """What the node holds once nothing changes any more (its network pool and warm VMs filled)."""
    last: list[dict[str, float]] = []

    def unchanged() -> dict[str, float] | None:
        last.append(held(node))
        return last[-1] if len(last) >= 3 and last[-1] == last[-2] == last[-3] else None

    return wait_until(unchanged, 90, interval=1, what="the node to settle")


def settled(node: NodeServer, before: dict[str, float]) -> None:
    """Wait until the node holds no more than it held `before` (warm pools refill, networks are
    returned); less is no leak (a restarted node may have collected a file the old one kept)."""

    def within() -> bool:
        now = held(node)
        return all(now[name] <= value for name, value in before.items())

    try:
        wait_until(within, 90, interval=1, what="the node to hold no more than it held before")
    except AssertionError:
        raise AssertionError(
            f"left behind: before {before}, now {held(node)}; newest files: {newest_files(node.home)}"
        ) from None


def newest_files(home: Path, count: int = 8) -> list[str]:
    """The files under `home` changed last: where a leaked file is found when a count is off."""
    changed = []
    for top, _, names in os.walk(home):
        for name in names:
            with contextlib.suppress(FileNotFoundError):  # removed while we walk
                changed.append((os.lstat(os.path.join(top, name)).st_mtime, os.path.join(top, name)))
    return [os.path.relpath(path, home) for _, path in sorted(changed, reverse=True)[:count]]


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """`directory` read-only for everyone, root (the node) included: a read-only bind mount over it."""
    subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_a_killed_vm_process_is_reported_and_freed(node: NodeServer, sandboxes: Sandboxes) -> None:
    before = steady(node)
    sandbox = sandboxes.create()
    workdir = node.home / "sandboxes" / sandbox.sandbox_id
    pid = json.loads((workdir / "state.json").read_text())["pid"]
    assert pid in node.qemu_pids()
    os.kill(pid, signal.SIGKILL)

    def lost_message() -> str | None:
        try:
            Sandbox.get_info(sandbox.sandbox_id)
        except SandboxException as exc:  # SandboxNotFoundException: the API answered 404
            return str(exc)
        return None

    wait_until(lost_message, 30, what="the sandbox to be reported lost")
    detail = httpx.get(f"{node.url}/sandboxes/{sandbox.sandbox_id}", headers={"X-API-Key": node.key})
    assert detail.status_code == 404
    assert "was lost" in detail.json()["message"] and "signal 9" in detail.json()["message"]
    assert sandbox.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]
    assert not workdir.exists() and pid not in node.qemu_pids()
    assert Sandbox.kill(sandbox.sandbox_id) is False  # already gone: 404
    settled(node, before)
    assert re.search(r"^aenv_sandboxes_lost [1-9]", httpx.get(f"{node.url}/metrics").text, re.M)
    assert run_in(sandboxes.create(), "echo alive") == "alive\n"  # the node carries on


def test_sigkill_of_the_node_mid_pause_loses_nothing(
    sandboxes: Sandboxes, crashable_node: NodeServer
) -> None:
    node = crashable_node
    before = steady(node)
    sandbox = sandboxes.create(timeout=600)
    sandbox.files.write("/tmp/state", "before the pause")
    sleeper = sandbox.commands.run("sleep 3600", background=True).pid
    dirty = f"head -c {DIRTY_MIB}M /dev/urandom > /dev/shm/dirty"
    run_in(sandbox, f"{dirty} && echo dirty", timeout=300)
    workdir = node.home / "sandboxes" / sandbox.sandbox_id
    with ThreadPoolExecutor(1) as pool:
        pausing = pool.submit(sandbox.pause)  # answered or not: the node dies under it
        wait_until(lambda: list(workdir.glob("pause-*.devices")), 120, interval=0.002, what="the pause")
        node.sigkill()
        with contextlib.suppress(Exception):
            pausing.result(timeout=120)
    node.start()

    listed = {
        s.sandbox_id: s
        for s in Sandbox.list(query=SandboxQuery(metadata={"e2e": sandboxes.tag})).next_items()
    }
    assert sandbox.sandbox_id in listed, "the sandbox being paused at the crash was lost"
    assert listed[sandbox.sandbox_id].state in (SandboxState.PAUSED, SandboxState.RUNNING)
    resumed = Sandbox.connect(sandbox.sandbox_id)
    assert resumed.files.read("/tmp/state") == "before the pause"
    assert sleeper in [p.pid for p in resumed.commands.list()]
    assert run_in(resumed, "wc -c < /dev/shm/dirty") == f"{DIRTY_MIB << 20}\n"
    assert resumed.kill()
    settled(node, before)


def test_an_unwritable_repository_fails_a_snapshot_cleanly(node: NodeServer, sandboxes: Sandboxes) -> None:
    """A snapshot is answered once captured, then its commit fails: it is rolled back whole (no
    blob, no layer sealed for it: the chain is as it was), the API says why, and the sandbox runs
    on. A fork, which waits for its snapshot's commit, fails with a JSON error, as cleanly."""
    sandbox = sandboxes.create()
    sandbox.files.write("/tmp/state", "running")
    api, headers = f"{node.url}", {"X-API-Key": node.key}
    state_file = node.home / "sandboxes" / sandbox.sandbox_id / "state.json"
    chain = json.loads(state_file.read_text())["disk_layers"]
    repository = node.home / "repository"
    blobs = {path.name for path in (repository / "blobs" / "sha256").iterdir()}
    before = steady(node)

    def chain_restored() -> bool:
        return json.loads(state_file.read_text())["disk_layers"] == chain

    with read_only(repository / "blobs" / "sha256"):
        answer = httpx.post(
            f"{api}/sandboxes/{sandbox.sandbox_id}/snapshots", json={}, headers=headers, timeout=300
        )
        assert answer.status_code == 201 and answer.json()["durable"] is False, answer.text
        snapshot_id = answer.json()["snapshotID"]

        def failure() -> httpx.Response | None:
            found = httpx.get(f"{api}/snapshots/{snapshot_id}", headers=headers)
            return None if found.status_code == 200 else found  # 200: still being committed

        failed = wait_until(failure, 120, what="the snapshot's commit to fail")
        assert failed.status_code == 404 and failed.json()["code"] == 404, failed.text
        assert f"snapshot {snapshot_id} failed and was rolled back" in failed.json()["message"]
        assert snapshot_id not in httpx.get(f"{api}/snapshots", headers=headers).text
        wait_until(chain_restored, 60, what="the snapshot's disk layer to be unsealed")
        assert run_in(sandbox, "cat /tmp/state") == "running"
        fork = httpx.post(f"{api}/sandboxes/{sandbox.sandbox_id}/fork", json={}, headers=headers, timeout=300)
        assert fork.status_code >= 500 and "fork of sandbox" in fork.json()["message"], fork.text
        wait_until(chain_restored, 60, what="the fork's disk layer to be unsealed")
    assert {path.name for path in (repository / "blobs" / "sha256").iterdir()} == blobs
    settled(node, before)
    assert run_in(sandbox, "echo still running") == "still running\n"
    top = node.home / "layers" / f"{chain[-1]}.qcow2"
    assert top.stat().st_uid == int(status_uid(json.loads(state_file.read_text())["pid"]))  # its VMM's again
    snapshot = sandbox.create_snapshot()  # writable again: the same sandbox snapshots fine
    assert Sandbox.delete_snapshot(snapshot.snapshot_id)
    assert sandbox.kill()


def status_uid(pid: int) -> str:
    """The real uid of process `pid`."""
    return next(
        line.split()[1]
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("Uid:")
    )
