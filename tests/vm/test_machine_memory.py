"""QEMU's processes get no transparent huge pages, and the node keeps its own setting (no VM needed).

A real sandbox's QEMU is checked in tests/vm/test_snapshot_engine.py (memory image test).
"""

from __future__ import annotations

import os
from pathlib import Path

from aenv.vmm import machine


def thp_enabled(pid: int | str) -> str:
    fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return fields["THP_enabled"].strip()


def test_spawned_processes_get_no_huge_pages_and_the_node_keeps_its_own(tmp_path: Path) -> None:
    before = thp_enabled("self")
    out = tmp_path / "status"
    with machine._without_huge_pages():
        # through execve, as QEMU is started (behind setpriv and nsenter, which exec in place)
        pid = os.posix_spawnp("sh", ["sh", "-c", f"exec grep THP_enabled /proc/self/status > {out}"], {})
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert out.read_text().split() == ["THP_enabled:", "0"]
    assert thp_enabled("self") == before
