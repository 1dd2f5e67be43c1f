"""A hostile guest against the node's reads from it, on a real node: every read is bounded.

The guest's root replaces envd with a server of its own on envd's port that answers the node
with an endless chunked body, or with one that trickles a byte at a time. The node's calls into
that guest (metrics, the samples saved at a pause, `/init` at a resume) fail with a typed 502
for that sandbox only, in bounded time; the node's memory stays near its baseline and a
neighbour keeps running commands. A guest flooding its serial console keeps a bounded ring on
the host, which `GET /logs` reads a page at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from aenv.vmm import serial

from .conftest import NodeServer, Sandboxes, run_in, wait_until

pytestmark = pytest.mark.vm

RSS_HEADROOM_MIB = 256
SERIAL_CAP = 8 * 1024 * 1024  # the node's default serial_log_mib
# Served as root in the guest: envd killed (and its restarts kept off the port), then every GET
# whose `start` is odd trickles a byte every 0.2 s; any other request gets an endless chunked body.
ROGUE = r"""
import os, signal, socket, threading, time

def kill_envd():
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"aenv_envd" in open(f"/proc/{pid}/cmdline", "rb").read():
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass

time.sleep(2)  # the command that started this ends first
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
while True:
    kill_envd()
    try:
        server.bind(("0.0.0.0", 49983))
        break
    except OSError:
        time.sleep(0.01)
server.listen(64)
CHUNK = b"x" * 65536

def serve(conn):
    request = b""
    while b"\r\n\r\n" not in request:
        data = conn.recv(65536)
        if not data:
            return
        request += data
    line = request.split(b"\r\n", 1)[0]
    start = line.partition(b"start=")[2].split(b" ")[0].split(b"&")[0]
    trickle = line.startswith(b"GET") and start.isdigit() and int(start) % 2 == 1
    try:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:
            if trickle:
                conn.sendall(b"1\r\n \r\n")
                time.sleep(0.2)
            else:
                conn.sendall(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
    except OSError:
        conn.close()

while True:
    conn, _ = server.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""


@pytest.fixture
def api(node: NodeServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=node.url, headers={"X-API-Key": node.key}, timeout=120) as client:
        yield client


class RssPeak:
    """The node process's peak resident memory while it is watched (sampled every 20 ms)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.baseline = self.peak = self.rss()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def rss(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def _watch(self) -> None:
        while not self._done.wait(0.02):
            self.peak = max(self.peak, self.rss())

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def assert_guest_error(response: httpx.Response, code: str) -> None:
    assert response.status_code == 502, response.text[:300]
    body = response.json()
    assert body["code"] == 502 and body["error_code"] == code, body


def test_a_rogue_envd_fails_its_own_calls_only(
    node: NodeServer, sandboxes: Sandboxes, api: httpx.Client
) -> None:
    neighbour, rogue = sandboxes.create(), sandboxes.create()
    rogue.files.write("/tmp/rogue.py", ROGUE)
    rogue.commands.run("setsid nohup python3 /tmp/rogue.py >/tmp/rogue.log 2>&1 &", user="root")
    metrics = f"/sandboxes/{rogue.sandbox_id}/metrics"
    even = int(time.time()) // 2 * 2 + 1_000_000  # after the sandbox's birth: envd is asked this `start`
    wait_until(
        lambda: api.get(metrics, params={"start": even}).status_code == 502, 120, what="the rogue envd"
    )

    assert node.pid is not None
    with RssPeak(node.pid) as memory, ThreadPoolExecutor(2) as pool:
        neighbour_runs = pool.submit(lambda: [run_in(neighbour, "echo ok", timeout=120) for _ in range(5)])
        assert_guest_error(api.get(metrics, params={"start": even}), "guest_answer_too_large")
        assert_guest_error(api.get(metrics, params={"start": even + 1}), "guest_answer_too_slow")
        views = api.get(
            "/sandboxes/metrics", params={"sandbox_ids": f"{rogue.sandbox_id},{neighbour.sandbox_id}"}
        )
        assert views.status_code == 200 and rogue.sandbox_id not in views.json()["sandboxes"]
        # The samples saved before a pause are the guest's loss, not its pause's.
        assert api.post(f"/sandboxes/{rogue.sandbox_id}/pause").status_code == 204
        resumed = api.post(f"/sandboxes/{rogue.sandbox_id}/resume", json={"timeout": 300})
        assert_guest_error(resumed, "guest_answer_too_large")
        assert neighbour_runs.result() == ["ok\n"] * 5
    assert api.get(f"/sandboxes/{rogue.sandbox_id}").json()["state"] == "paused"
    grew = (memory.peak - memory.baseline) / 2**20
    print(f"\nnode RSS {memory.baseline / 2**20:.0f} MiB, peak {memory.peak / 2**20:.0f} MiB (+{grew:.0f})")
    assert grew < RSS_HEADROOM_MIB
    assert run_in(neighbour, "echo still") == "still\n"


def test_a_console_flood_keeps_a_bounded_ring_that_logs_pages(
    node: NodeServer, sandboxes: Sandboxes, api: httpx.Client
) -> None:
    sandbox = sandboxes.create()
    workdir = node.home / "sandboxes" / sandbox.sandbox_id
    flood = "yes 'flooding the serial console with a line of some length, again and again' > /dev/ttyS0"
    sandbox.commands.run(f"setsid nohup sh -c {flood!r} >/dev/null 2>&1 &", user="root")
    try:
        wait_until(lambda: (workdir / serial.OLDER_LOG).exists(), 300, interval=1, what="a rotation")
        first = (workdir / serial.OLDER_LOG).stat().st_ino
        wait_until(
            lambda: (workdir / serial.OLDER_LOG).stat().st_ino != first, 300, interval=1, what="another"
        )
    finally:
        sandbox.commands.run("pkill -x yes", user="root")
    kept = sum((workdir / name).stat().st_size for name in (serial.SERIAL_LOG, serial.OLDER_LOG))
    assert kept <= SERIAL_CAP + 2 * serial.MAX_LINE

    logs = f"/sandboxes/{sandbox.sandbox_id}/logs"
    first_kept = int((workdir / serial.FIRST_LINE_FILE).read_text())
    assert first_kept > 0  # the boot's lines were dropped: a page from 0 starts at the oldest kept
    oldest = api.get(logs, params={"start": 0, "limit": 1})
    assert oldest.headers[serial.NEXT_START_HEADER] == str(first_kept + 1)
    assert oldest.json()["logs"] == api.get(logs, params={"start": first_kept, "limit": 1}).json()["logs"]
    page = api.get(logs, params={"start": first_kept + 10, "limit": 100}).json()["logs"]
    half = api.get(logs, params={"start": first_kept + 10, "limit": 50})
    rest = api.get(logs, params={"start": half.headers[serial.NEXT_START_HEADER], "limit": 50})
    assert len(page) == 100 and half.json()["logs"] + rest.json()["logs"] == page
    assert api.get(logs, params={"start": 1 << 40, "limit": 10}).json()["logs"] == []
