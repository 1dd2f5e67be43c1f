"""Faults on a real node: a sandbox whose QEMU process is killed under it is reported and freed."""

from __future__ import annotations

import json
import os
import re
import signal

import httpx
import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException

from .conftest import NodeServer, Sandboxes, run_in, wait_until

pytestmark = pytest.mark.vm


def test_a_killed_vm_process_is_reported_and_freed(node: NodeServer, sandboxes: Sandboxes) -> None:
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
    assert re.search(r"^aenv_sandboxes_lost [1-9]", httpx.get(f"{node.url}/metrics").text, re.M)
    assert run_in(sandboxes.create(), "echo alive") == "alive\n"  # the node carries on
