"""A real node under misuse: refused proxy requests do not wake a paused sandbox, QEMU processes
carry no secret in their environment, and a second node on the same network slots refuses to start
instead of destroying the first one's namespaces."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aenv.agent.envd import ENVD_PORT
from aenv.network.slots import SlotRangeBusy, SlotRangeLock
from aenv.vmm.machine import QEMU_ENVIRONMENT

from .conftest import NodeServer, Sandboxes, free_port, netns_names

pytestmark = pytest.mark.vm

RPC = {"Content-Type": "application/json", "Connect-Protocol-Version": "1"}


@pytest.fixture
def api(node: NodeServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=node.url, headers={"X-API-Key": node.key}, timeout=120) as client:
        yield client


def state(api: httpx.Client, sandbox_id: str) -> str:
    return api.get(f"/sandboxes/{sandbox_id}").json()["state"]


def test_refused_proxy_requests_leave_a_paused_sandbox_paused(
    node: NodeServer, api: httpx.Client, sandboxes: Sandboxes
) -> None:
    body = {"templateID": "base", "autoResume": {"enabled": True}, "network": {"allowPublicTraffic": False}}
    created = api.post("/v2/sandboxes", json=body)
    assert created.status_code == 201, created.text
    sandbox = created.json()
    sandboxes.track(sandbox["sandboxID"])
    sandbox_id, token = sandbox["sandboxID"], sandbox["envdAccessToken"]
    assert token and sandbox["trafficAccessToken"]
    assert api.post(f"/sandboxes/{sandbox_id}/pause").status_code == 204

    envd = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT), **RPC}
    other_port = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "8080"}
    refused = [
        (envd, 401),
        ({**envd, "X-Access-Token": "wrong"}, 401),
        (other_port, 403),
        ({**other_port, "E2B-Traffic-Access-Token": "wrong"}, 403),
    ]
    with httpx.Client(base_url=node.url, timeout=120) as client:
        for headers, status in refused:
            response = client.post("/process.Process/List", headers=headers, content=b"{}")
            assert response.status_code == status, response.text
            assert state(api, sandbox_id) == "paused", f"a refused request ({status}) woke the sandbox"
        authorized = {**envd, "X-Access-Token": token}
        response = client.post("/process.Process/List", headers=authorized, content=b"{}")
        assert response.status_code == 200, response.text
    assert state(api, sandbox_id) == "running"


def test_qemu_processes_get_no_secrets(node: NodeServer, sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create()
    assert sandbox.commands.run("true").exit_code == 0
    pids = node.qemu_pids()
    assert pids, "the node runs no QEMU process"
    for pid in pids:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        names = {entry.split(b"=", 1)[0].decode() for entry in environ.split(b"\0") if entry}
        assert names <= set(QEMU_ENVIRONMENT), f"QEMU {pid} has {sorted(names)}"
        assert node.key.encode() not in environ


def test_slot_range_lock(tmp_path: Path) -> None:
    held = SlotRangeLock(100, 50, tmp_path)
    held.acquire()
    try:
        for first, count in ((100, 50), (149, 10), (90, 11), (0, 1000)):
            with pytest.raises(SlotRangeBusy, match=f"pid {os.getpid()}"):
                SlotRangeLock(first, count, tmp_path).acquire()
        neighbours = [SlotRangeLock(150, 10, tmp_path), SlotRangeLock(90, 10, tmp_path)]
        for lock in neighbours:
            lock.acquire()
            lock.release()
    finally:
        held.release()
    again = SlotRangeLock(120, 5, tmp_path)  # released: an overlapping range is free again
    again.acquire()
    again.release()


def test_slot_range_of_a_killed_holder_is_free(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from aenv.network.slots import SlotRangeLock\n"
         f"SlotRangeLock(0, 64, __import__('pathlib').Path({str(tmp_path)!r})).acquire()\n"
         "print('held', flush=True)\ntime.sleep(600)"],
        stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")},
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        with pytest.raises(SlotRangeBusy, match=f"pid {holder.pid}"):
            SlotRangeLock(32, 64, tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    lock = SlotRangeLock(32, 64, tmp_path)
    lock.acquire()
    lock.release()


def test_second_node_on_the_same_slots_refuses_to_start(
    node: NodeServer, sandboxes: Sandboxes, tmp_path: Path
) -> None:
    sandbox = sandboxes.create()
    before = netns_names()
    settings = node.env()
    first, count = int(settings["AENV_SLOT_FIRST"]), int(settings["AENV_SLOT_COUNT"])
    with pytest.raises(SlotRangeBusy):  # the session node holds its range
        SlotRangeLock(first, count).acquire()
    env = settings | {
        "AENV_HOME_PATH": str(tmp_path / "home"),
        "AENV_API_ADDR": f"127.0.0.1:{free_port()}",
        "AENV_SLOT_FIRST": str(first + count // 2),  # overlapping, not equal
    }
    second = subprocess.run(
        [sys.executable, "-m", "aenv.cli", "server"], env=env, capture_output=True, text=True, timeout=300
    )
    assert second.returncode != 0
    assert "not starting" in second.stderr and "slot_first" in second.stderr, second.stderr[-2000:]
    assert "Traceback" not in second.stderr
    assert netns_names() >= before, "the refused node removed namespaces"
    assert node.healthy()
    assert sandbox.commands.run("echo still here").stdout.strip() == "still here"
