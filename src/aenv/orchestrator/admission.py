"""Admission control: refuse up front what the node could not honour, rather than fail midway.

A VM started on a host without the memory for it is one the kernel's OOM killer ends later (with
a neighbour, maybe); a pause or snapshot started on a full disk fails after the guest stopped.
So a create or resume is refused (429 with Retry-After: E2B's answer for "no room now", which its
SDKs retry) when the guest RAM of the running sandboxes would exceed
the configured multiple of the host's RAM (guests share their template's memory image, so the
multiple is well above 1), when the host could not give the new guest what running guests
measurably hold per MiB of their RAM (`held_mib`: their VMMs' private memory, which
`aenv.orchestrator.reclaim` keeps to what guests use) plus a reserve, or when no network slot
is left; and anything that writes
state (create, resume, pause, snapshot, fork) is refused (507) while the node's filesystem has
less than its reserve free.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import InsufficientStorage, Overloaded


def meminfo_mib(field: str = "MemTotal") -> int:
    """One `/proc/meminfo` figure (MemTotal: the host's RAM; MemAvailable: what it can still give), in MiB."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) // 1024
    raise OSError(f"no {field} in /proc/meminfo")


def free_disk_mib(path: Path) -> int:
    """Space an unprivileged writer could still use on `path`'s filesystem, in MiB."""
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize // 2**20


@dataclass
class Admission:
    """The node's limits, and the live figures (committed guest RAM, free slots) they apply to."""

    home: Path
    disk_reserve_mib: int
    memory_budget_mib: int  # host RAM times the overcommit ratio
    committed_mib: Callable[[], int]  # guest RAM of the sandboxes running now
    free_slots: Callable[[], int | None]  # None: the node does not allocate networks itself
    available_mib: Callable[[], int] = lambda: meminfo_mib("MemAvailable")
    held_mib: Callable[[], int] | None = None  # private memory running VMs hold; None: their full RAM
    memory_reserve_mib: int = 0  # host memory left free besides what new VMs are expected to hold

    def check_disk(self, operation: str) -> None:
        """507 when the home's filesystem is below the reserve."""
        free = free_disk_mib(self.home)
        if free < self.disk_reserve_mib:
            raise InsufficientStorage(
                f"cannot {operation}: the node has {free} MiB of disk free, "
                f"below its reserve of {self.disk_reserve_mib} MiB"
            )

    def check_start(self, operation: str, memory_mib: int, networks: int = 1) -> None:
        """429 (`Overloaded`) or 507 when VMs of `memory_mib` in all, needing `networks` new network
        slots, would exceed what the node can give."""
        self.check_disk(operation)
        committed = self.committed_mib()
        if committed + memory_mib > self.memory_budget_mib:
            raise Overloaded(
                f"cannot {operation}: running sandboxes hold {committed} MiB of guest RAM and this one "
                f"needs {memory_mib} MiB more, beyond the node's budget of {self.memory_budget_mib} MiB"
            )
        available = self.available_mib()
        needed = self.expected_mib(memory_mib, committed) + self.memory_reserve_mib
        if available < needed:
            raise Overloaded(
                f"cannot {operation}: the host has {available} MiB of memory available, less than the "
                f"{needed} MiB needed ({memory_mib} MiB of guest RAM as running guests use theirs, "
                f"and a reserve of {self.memory_reserve_mib} MiB)"
            )
        free = self.free_slots()
        if free is not None and free < networks:
            raise Overloaded(f"cannot {operation}: {free} free network slots, {networks} needed")

    def expected_mib(self, memory_mib: int, committed: int) -> int:
        """What VMs of `memory_mib` of guest RAM will hold: as much per MiB as the running ones hold
        now (all of it with none running, or when not measured)."""
        if self.held_mib is None or committed <= 0:
            return memory_mib
        return math.ceil(memory_mib * min(1.0, self.held_mib() / committed))
