"""Disk space on a real node: what the guest frees is returned by the sandbox's layer file."""

from __future__ import annotations

import json
import os

import pytest

from .conftest import NodeServer, Sandboxes, run_in

pytestmark = pytest.mark.vm


def _allocated_mib(path) -> float:
    return os.stat(path).st_blocks * 512 / (1 << 20)


def test_space_freed_in_the_guest_is_freed_on_the_host(node: NodeServer, sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.create()
    state = json.loads((node.home / "sandboxes" / sandbox.sandbox_id / "state.json").read_text())
    layer = node.home / "layers" / f"{state['disk_layers'][-1]}.qcow2"
    run_in(sandbox, "head -c 64M /dev/urandom > /home/user/big && sync", timeout=120)
    grown = _allocated_mib(layer)
    assert grown > 60, f"the layer holds only {grown:.0f} MiB after a 64 MiB write"
    run_in(sandbox, "rm /home/user/big && sync && sudo fstrim /", timeout=120)
    freed = grown - _allocated_mib(layer)
    assert freed > 48, f"fstrim in the guest freed only {freed:.0f} MiB of the layer file"
