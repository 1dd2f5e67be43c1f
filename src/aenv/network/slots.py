"""The address plan of sandbox uplinks: one /30 per slot out of a dedicated block.

A slot is what lets a sandbox's namespace reach beyond itself: a veth pair whose root-side
end is `aenv-v<index>` with the slot's first host address, and whose namespace-side end is
`veth0` with the second one (the slot's host-reachable address, the source that the
guest's traffic is masqueraded to). The guest itself keeps 169.254.0.21 everywhere.

The block is 198.19.0.0/16, the upper half of 198.18.0.0/15 that RFC 2544 reserves for
benchmarking: it is never routed on the internet, home and office LANs do not use it (they
use RFC 1918 space, which sandboxes must not reach anyway), and it stays clear of the
198.18.0.0/16 that proxy tools commonly take for fake-IP DNS. 16384 slots of 4 addresses.
"""

from __future__ import annotations

import ipaddress
from collections import deque
from dataclasses import dataclass

SLOT_BLOCK = ipaddress.IPv4Network("198.19.0.0/16")
SLOT_PREFIX_LEN = 30
SLOT_COUNT = SLOT_BLOCK.num_addresses // 4
# Root-namespace interfaces of slots; the host's nft rules match on this prefix.
HOST_VETH_PREFIX = "aenv-v"
NAMESPACE_VETH = "veth0"


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
    def in_use(self) -> frozenset[int]:
        return frozenset(self._used)
