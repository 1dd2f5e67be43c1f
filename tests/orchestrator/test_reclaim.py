"""The memory policy's choices and admission on measured use, with fake VMs (the real ones are
in tests/vm/test_reclaim.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from aenv.orchestrator import reclaim as policy_module
from aenv.orchestrator.admission import Admission
from aenv.orchestrator.errors import Unavailable
from aenv.orchestrator.reclaim import MemoryReclaimer
from aenv.orchestrator.states import State
from aenv.vmm.envd_link import EnvdUnavailable
from aenv.vmm.reclaim import Scan


class FakeVM:
    """A QEMU as the policy sees it: its private MiB, its CPU seconds; a reclaim frees `freed` MiB."""

    every: dict[int, FakeVM] = {}
    reclaimed: list[int] = []  # pids, in the order reclaimed
    caches_dropped: list[int] = []  # pids, in the order their guests were asked to drop their cache
    on_reclaim: list[Callable[[], None]] = []

    def __init__(self, pid: int, private: float, cpu: float, freed: float = 0.0, envd_down: bool = False):
        self.pid, self.private, self.cpu, self.freed, self.envd_down = pid, private, cpu, freed, envd_down
        FakeVM.every[pid] = self

    def cpu_seconds(self) -> float:
        return self.cpu

    async def execute(self, argv: list[str], *, timeout: float) -> int:
        """The guest's envd: dropping its page cache costs it a little CPU."""
        assert argv == policy_module.DROP_CACHE
        if self.envd_down:
            raise EnvdUnavailable("envd does not answer")
        FakeVM.caches_dropped.append(self.pid)
        self.cpu += 0.1
        return 0


async def fake_find(vm: FakeVM) -> Scan:
    """Each page of what the guest freed is a candidate."""
    freed = np.arange(int(vm.freed * 256), dtype=np.uint64)
    return Scan(0, 0, int(vm.private * 256), freed, np.empty(0, np.uint64))


async def fake_release(vm: FakeVM, found: Scan) -> tuple[int, float]:
    FakeVM.reclaimed.append(vm.pid)
    vm.private -= found.candidates / 256
    vm.freed = 0.0
    for hook in FakeVM.on_reclaim:
        hook()
    return found.candidates, 0.01


def sandbox(name: str, vm: FakeVM, state: State = State.RUNNING) -> SimpleNamespace:
    return SimpleNamespace(id=name, vm=SimpleNamespace(vm=vm, envd=vm), lock=asyncio.Lock(),
                           record=SimpleNamespace(state=state))  # fmt: skip


@pytest.fixture(autouse=True)
def fake_vms(monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy works on FakeVMs."""
    monkeypatch.setattr(FakeVM, "every", {})
    monkeypatch.setattr(FakeVM, "reclaimed", [])
    monkeypatch.setattr(FakeVM, "caches_dropped", [])
    monkeypatch.setattr(FakeVM, "on_reclaim", [])
    monkeypatch.setattr(policy_module.reclaim, "find", fake_find)
    monkeypatch.setattr(policy_module.reclaim, "release", fake_release)
    monkeypatch.setattr(policy_module, "private_mib", lambda pid: FakeVM.every[pid].private)


def test_only_sandboxes_whose_memory_grew_are_scanned() -> None:
    grown, steady = FakeVM(1, 50, 0, freed=200), FakeVM(2, 50, 0)
    sandboxes = [sandbox("a", grown), sandbox("b", steady), sandbox("p", FakeVM(3, 500, 0), State.PAUSING)]
    policy = MemoryReclaimer(lambda: sandboxes, interval=0, growth_mib=16, pressure_mib=0)
    assert asyncio.run(policy.sweep()) == 0  # first sight: where each stands
    grown.private += 200
    assert asyncio.run(policy.sweep()) == 200 * 2**20
    assert FakeVM.reclaimed == [1]
    assert asyncio.run(policy.sweep()) == 0  # nothing grew since
    registry = CollectorRegistry()
    registry.register(policy)  # as the node registers it
    assert registry.get_sample_value("aenv_node_memory_returned_bytes_total") == 200 * 2**20
    families = {family.name: family for family in policy.collect()}
    by_sandbox = {s.labels["sandbox_id"]: s.value for s in families["aenv_memory_returned_bytes"].samples}
    assert by_sandbox == {"a": 200 * 2**20, "b": 0}
    assert families["aenv_node_memory_returned_bytes"].samples[0].value == 200 * 2**20


def test_under_pressure_the_idlest_that_grew_go_first_until_the_host_has_enough() -> None:
    busy, idle, idler = FakeVM(1, 300, 0, 100), FakeVM(2, 300, 0, 100), FakeVM(3, 300, 0, 100)
    steady = FakeVM(4, 300, 0)  # the idlest, but not grown since it was last seen: nothing to give
    available = [4000]
    policy = MemoryReclaimer(
        lambda: [sandbox("busy", busy), sandbox("idle", idle), sandbox("idler", idler), sandbox("s", steady)],
        interval=0, growth_mib=1 << 20, pressure_mib=1150, available_mib=lambda: available[0],
    )  # fmt: skip
    asyncio.run(policy.sweep())
    busy.cpu, idle.cpu, idler.cpu = 5.0, 1.0, 0.1
    for vm in (busy, idle, idler):
        vm.freed, vm.private = 100, 400
    available[0] = 1000
    FakeVM.on_reclaim.append(lambda: available.__setitem__(0, available[0] + 100))
    asyncio.run(policy.sweep())
    assert FakeVM.reclaimed == [3, 2]  # idlest first; the busy one left once the host has enough
    assert FakeVM.caches_dropped == []  # none grew by growth_mib: their page cache stays


def test_under_pressure_a_guest_at_rest_that_ran_drops_its_page_cache() -> None:
    vm, fresh = FakeVM(1, 300, 0), FakeVM(2, 300, 0)
    mute = FakeVM(3, 300, 0, freed=10, envd_down=True)
    policy = MemoryReclaimer(lambda: [sandbox("a", vm), sandbox("f", fresh), sandbox("m", mute)], interval=0,
                             growth_mib=16, pressure_mib=1 << 30)  # fmt: skip
    asyncio.run(policy.sweep())  # first sight

    def run(seconds: float) -> list[int]:
        """The guests run; a pass sees them at work, the next at rest. Returns the drops at work."""
        vm.cpu, mute.cpu = vm.cpu + seconds, mute.cpu + seconds
        asyncio.run(policy.sweep())
        at_work = list(FakeVM.caches_dropped)
        asyncio.run(policy.sweep())
        return at_work

    assert run(1.0) == [] and FakeVM.caches_dropped == [1]  # the fresh one did not run
    assert 3 in FakeVM.reclaimed  # mute's envd did not answer: scanned all the same
    assert run(0.2) == [1] and FakeVM.caches_dropped == [1]  # it barely ran since it dropped its cache
    assert run(1.0) == [1] and FakeVM.caches_dropped == [1, 1]


def test_a_guest_at_work_is_scanned_once_it_rests_also_when_it_freed_without_growing() -> None:
    vm = FakeVM(1, 300, 0)
    policy = MemoryReclaimer(lambda: [sandbox("a", vm)], interval=0, growth_mib=16, pressure_mib=0)
    asyncio.run(policy.sweep())
    vm.cpu, vm.freed = 1000.0, 200  # at work: freed 200 MiB, its private memory the same
    assert asyncio.run(policy.sweep()) == 0
    assert asyncio.run(policy.sweep()) == 200 * 2**20  # rests now
    assert FakeVM.reclaimed == [1]
    assert asyncio.run(policy.sweep()) == 0  # neither grew nor ran since
    assert FakeVM.reclaimed == [1]


def test_a_sandbox_whose_lock_is_held_is_left_for_the_next_pass() -> None:
    vm = FakeVM(1, 50, 0, freed=100)
    held = sandbox("a", vm)
    policy = MemoryReclaimer(lambda: [held], interval=0, growth_mib=16, pressure_mib=0)

    async def locked() -> int:
        await policy.sweep()
        vm.private += 100
        async with held.lock:
            return await policy.sweep()

    assert asyncio.run(locked()) == 0
    assert asyncio.run(policy.sweep()) == 100 * 2**20


def test_a_pause_started_during_the_scan_finds_its_guest_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    vm = FakeVM(1, 50, 0, freed=100)
    held = sandbox("a", vm)
    policy = MemoryReclaimer(lambda: [held], interval=0, growth_mib=16, pressure_mib=0)

    async def find_while_a_pause_starts(scanned: FakeVM) -> Scan:
        found = await fake_find(scanned)
        await held.lock.acquire()  # the scan holds no lock: a pause may take it meanwhile
        return found

    async def sweeps() -> int:
        await policy.sweep()
        vm.private += 100
        monkeypatch.setattr(policy_module.reclaim, "find", find_while_a_pause_starts)
        return await policy.sweep()

    assert asyncio.run(sweeps()) == 0
    assert FakeVM.reclaimed == []  # nothing stopped or dropped under the pause


def admission(tmp_path: Path, held: int | None, committed: int, available: int) -> Admission:
    return Admission(
        home=tmp_path, disk_reserve_mib=0, memory_budget_mib=1 << 30, committed_mib=lambda: committed,
        free_slots=lambda: None, available_mib=lambda: available,
        held_mib=None if held is None else (lambda: held), memory_reserve_mib=1024,
    )  # fmt: skip


def test_admission_expects_what_running_guests_hold_per_mib_plus_the_reserve(tmp_path: Path) -> None:
    # 100 sandboxes of 512 MiB holding 64 MiB each: a new one is expected to hold 64 MiB.
    diverged_idle = admission(tmp_path, held=6400, committed=51200, available=1100)
    diverged_idle.check_start("create a sandbox", 512)
    with pytest.raises(Unavailable, match=r"1000 MiB of memory available, less than the 1088 MiB needed"):
        admission(tmp_path, held=6400, committed=51200, available=1000).check_start("create a sandbox", 512)
    # Nothing running, or nothing measured: the whole guest RAM.
    with pytest.raises(Unavailable, match="less than the 1536 MiB needed"):
        admission(tmp_path, held=0, committed=0, available=1500).check_start("create a sandbox", 512)
    with pytest.raises(Unavailable, match="less than the 1536 MiB needed"):
        admission(tmp_path, held=None, committed=51200, available=1500).check_start("create a sandbox", 512)
