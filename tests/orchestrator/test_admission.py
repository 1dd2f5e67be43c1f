"""Admission control's decisions, on fixed figures (the node-level refusals are in tests/e2e)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.api.status import STATUS
from aenv.orchestrator.admission import Admission, free_disk_mib, meminfo_mib
from aenv.orchestrator.errors import InsufficientStorage, Overloaded


def admission(
    tmp_path: Path, *, reserve: int = 0, committed: int = 0, slots: int | None = 8, available: int = 8192
) -> Admission:
    return Admission(
        home=tmp_path, disk_reserve_mib=reserve, memory_budget_mib=4096,
        committed_mib=lambda: committed, free_slots=lambda: slots, available_mib=lambda: available,
    )  # fmt: skip


def test_within_every_limit_nothing_is_refused(tmp_path: Path) -> None:
    admission(tmp_path, committed=3584).check_start("create a sandbox", 512)


def test_memory_beyond_the_budget_is_refused_with_429(tmp_path: Path) -> None:
    with pytest.raises(Overloaded, match=r"3700 MiB of guest RAM.*512 MiB more.*4096 MiB") as refused:
        admission(tmp_path, committed=3700).check_start("create a sandbox", 512)
    assert STATUS[type(refused.value)] == 429


def test_memory_the_host_cannot_give_now_is_refused_with_429(tmp_path: Path) -> None:
    with pytest.raises(Overloaded, match="300 MiB of memory available, less than the 512 MiB"):
        admission(tmp_path, available=300).check_start("resume sandbox x", 512)


def test_no_network_slot_is_refused_with_429(tmp_path: Path) -> None:
    with pytest.raises(Overloaded, match="0 free network slots, 1 needed"):
        admission(tmp_path, slots=0).check_start("create a sandbox", 512)
    admission(tmp_path, slots=0).check_start("create a sandbox", 512, networks=0)  # a warm VM's network
    admission(tmp_path, slots=None).check_start("create a sandbox", 512)  # no pool: not counted


def test_disk_below_the_reserve_is_refused_with_507(tmp_path: Path) -> None:
    reserve = free_disk_mib(tmp_path) + 1024
    with pytest.raises(InsufficientStorage, match=f"below its reserve of {reserve} MiB") as refused:
        admission(tmp_path, reserve=reserve).check_disk("pause sandbox x")
    assert STATUS[type(refused.value)] == 507
    with pytest.raises(InsufficientStorage):
        admission(tmp_path, reserve=reserve).check_start("resume sandbox x", 512)


def test_host_memory_is_read() -> None:
    assert meminfo_mib() >= meminfo_mib("MemAvailable") > 0
