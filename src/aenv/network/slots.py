"""The address plan of sandbox uplinks: one /30 per slot out of a dedicated block.

A slot is what lets a sandbox's namespace reach beyond itself: a veth pair whose root-side
end is `aenv-v<index>` with the slot's first host address, and whose namespace-side end is
`veth0` with the second one (the slot's host-reachable address, the source that the
guest's traffic is masqueraded to). The guest itself keeps 169.254.0.21 everywhere.

The block is 198.19.0.0/16, the upper half of 198.18.0.0/15 that RFC 2544 reserves for
benchmarking: it is never routed on the internet, home and office LANs do not use it (they
use RFC 1918 space, which sandboxes must not reach anyway), and it stays clear of the
198.18.0.0/16 that proxy tools commonly take for fake-IP DNS. 16384 slots of 4 addresses.

Nodes sharing a host take disjoint slot ranges, and each holds a `SlotRangeLock` on its range.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SLOT_BLOCK = ipaddress.IPv4Network("198.19.0.0/16")
SLOT_PREFIX_LEN = 30
SLOT_COUNT = SLOT_BLOCK.num_addresses // 4
# Root-namespace interfaces of slots; the host's nft rules match on this prefix.
HOST_VETH_PREFIX = "aenv-v"
NAMESPACE_VETH = "veth0"
# Where the nodes of a host lock their slot ranges: tmpfs, emptied at boot like the namespaces.
LOCK_DIR = Path("/run/aenv")


@dataclass(frozen=True)
class Slot:
    """One /30 of the slot block, derived from its index alone."""

    index: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < SLOT_COUNT:
            raise ValueError(f"slot index {self.index} is outside 0..{SLOT_COUNT - 1}")

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network((int(SLOT_BLOCK.network_address) + 4 * self.index, SLOT_PREFIX_LEN))

    @property
    def host_address(self) -> str:
        """The root namespace's end: the namespace's default gateway."""
        return str(self.network.network_address + 1)

    @property
    def namespace_address(self) -> str:
        """The namespace's end: the host reaches the slot here, guest traffic leaves from here."""
        return str(self.network.network_address + 2)

    @property
    def host_ifname(self) -> str:
        return f"{HOST_VETH_PREFIX}{self.index}"


class SlotAllocator:
    """Hands out slot indices from a range so that no two live networks share one.

    Freed indices go to the back of the queue: a slot is reused as late as possible, which
    keeps stale connection-tracking entries of its last user out of the way.
    """

    def __init__(self, first: int = 0, count: int = SLOT_COUNT):
        if first < 0 or count < 1 or first + count > SLOT_COUNT:
            raise ValueError(f"slot range {first}+{count} does not fit 0..{SLOT_COUNT - 1}")
        self._free: deque[int] = deque(range(first, first + count))
        self._used: set[int] = set()

    def take(self) -> Slot:
        if not self._free:
            raise RuntimeError("no free network slot")
        index = self._free.popleft()
        self._used.add(index)
        return Slot(index)

    def reserve(self, index: int) -> Slot:
        """Take a particular slot: one a surviving sandbox still uses after a node restart."""
        if index in self._used or index not in self._free:
            raise ValueError(f"slot {index} is in use or outside this allocator's range")
        self._free.remove(index)
        self._used.add(index)
        return Slot(index)

    def give_back(self, slot: Slot) -> None:
        if slot.index in self._used:
            self._used.remove(slot.index)
            self._free.append(slot.index)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> frozenset[int]:
        return frozenset(self._used)


class SlotRangeBusy(RuntimeError):
    """Another live process on this host holds slots of the range."""


class SlotRangeLock:
    """Exclusive use of a slot range by one process on this host, until `release` or its exit.

    Each holder keeps an flock on `slots-<first>-<count>.lock` in `directory`; the kernel drops it
    when the process dies, whatever way, so a crashed node never blocks the next. Acquiring checks,
    under a directory-wide lock, every other range file that overlaps: one whose lock can be taken
    is a dead holder's (removed), one whose lock cannot is a live overlap (`SlotRangeBusy`). Nodes
    that shared slots would delete each other's namespaces and uplinks at start.
    """

    def __init__(self, first: int, count: int, directory: Path = LOCK_DIR):
        self.first, self.count, self.directory = first, count, directory
        self.path = directory / f"slots-{first}-{count}.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with _flocked(self.directory / "slots.lock", blocking=True):
            for other in sorted(self.directory.glob("slots-*-*.lock")):
                if other != self.path and self._overlaps(other):
                    self._check_dead(other)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise SlotRangeBusy(self._busy_message(self.path)) from None
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self._fd = fd

    def release(self) -> None:
        """Give the range up (the file stays: removing it could race with a new holder's open)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _overlaps(self, other: Path) -> bool:
        match = re.fullmatch(r"slots-(\d+)-(\d+)\.lock", other.name)
        if match is None:
            return False
        first, count = int(match[1]), int(match[2])
        return first < self.first + self.count and self.first < first + count

    def _check_dead(self, other: Path) -> None:
        try:
            with _flocked(other, blocking=False):
                other.unlink()  # its holder is gone: nothing else may open it while we hold the directory
        except BlockingIOError:
            raise SlotRangeBusy(self._busy_message(other)) from None

    def _busy_message(self, held: Path) -> str:
        try:
            holder = f"pid {held.read_text().strip() or '?'}"
        except OSError:
            holder = "a process"
        last = self.first + self.count - 1
        return (
            f"network slots {self.first}..{last} overlap the range {held.name} that {holder} holds "
            f"on this host (lock {held}): give each node on a host its own range "
            "(settings slot_first and slot_count)"
        )


@contextlib.contextmanager
def _flocked(path: Path, *, blocking: bool) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield fd
    finally:
        os.close(fd)
