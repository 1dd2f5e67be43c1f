"""A warm pool of sandbox networks: namespace, tap, uplink and rules made ahead of time.

Making one costs tens of milliseconds (netlink round trips, an `nft` process); a sandbox
start should not wait for that. Idle networks carry `idle_policy` (the E2B default, internet
allowed), so handing one out with that policy is a deque pop; any other policy costs one
`nft` transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Iterable

from pyroute2 import AsyncIPRoute, netns

from ..tasks import cancel
from .builder import build
from .egress import EgressPolicy, ensure_host_rules
from .netns import SandboxNetwork, delete_link
from .slots import HOST_VETH_PREFIX, Slot, SlotAllocator

log = logging.getLogger(__name__)

POOL_PREFIX = "aenv-slot-"


async def cleanup_stale(prefix: str = POOL_PREFIX, keep: Iterable[str] = ()) -> list[str]:
    """Remove namespaces named `<prefix>…` (but those in `keep`) and uplinks left without one.

    For a node starting after a crash: nothing else may use the prefix on this host, and
    `keep` names the networks of sandboxes that survived it. An uplink's alias names its
    namespace; uplinks of namespaces that no longer exist are orphans whoever made them
    (e.g. uplinks `attach`ed to a namespace named by the engine).
    Returns the names of the namespaces whose remains were removed.
    """
    existing = set(netns.listnetns())
    removed = {name for name in existing if name.startswith(prefix)} - set(keep)
    for name in removed:
        with contextlib.suppress(FileNotFoundError):
            netns.remove(name)
    live = existing - removed
    async with AsyncIPRoute() as ipr:
        links = [
            (link.get("IFLA_IFNAME"), link.get("IFLA_IFALIAS") or "") async for link in await ipr.link("dump")
        ]
    for ifname, alias in links:
        if ifname.startswith(HOST_VETH_PREFIX) and alias not in live:
            delete_link(ifname)
            removed.add(alias)
    return sorted(removed)


class NetworkPool:
    """Pre-creates up to `size` networks in the background and hands them out.

    Networks are named `<prefix><slot index>`; the pool owns the slot range it is given, so
    two live networks never share a slot. A network goes back by `release` or by its own
    `destroy()` (which the engine already calls): either way its slot is freed.
    """

    def __init__(
        self,
        size: int = 4,
        *,
        prefix: str = POOL_PREFIX,
        slots: SlotAllocator | None = None,
        idle_policy: EgressPolicy | None = None,
    ):
        self.size = size
        self.prefix = prefix
        self.idle_policy = idle_policy or EgressPolicy()
        self._slots = slots or SlotAllocator()
        self._idle: deque[SandboxNetwork] = deque()
        self._leased: dict[int, SandboxNetwork] = {}  # by slot index
        self._wanted = asyncio.Event()
        self._filler: asyncio.Task[None] | None = None
        self._closed = False

    async def start(self, keep: Iterable[str] = ()) -> dict[str, SandboxNetwork]:
        """Clear what a crashed predecessor left, install the host rules, begin filling.

        `keep` names networks of this pool that sandboxes which outlived the previous node
        process still use: they are adopted (returned by name, slot reserved, leased) with
        an unknown policy, which the caller should apply again.
        """
        keep = set(keep)
        stale = await cleanup_stale(self.prefix, keep)
        if stale:
            log.warning("removed %d stale sandbox networks: %s", len(stale), ", ".join(stale))
        adopted = {}
        for name in sorted(keep & set(netns.listnetns())):
            suffix = name.removeprefix(self.prefix)
            if name == suffix or not suffix.isdigit():
                continue
            network = SandboxNetwork(name, self._slots.reserve(int(suffix)), None, self._returned)
            self._leased[int(suffix)] = network
            adopted[name] = network
        await ensure_host_rules()
        self._filler = asyncio.create_task(self._fill(), name="network-pool-fill")
        self._wanted.set()
        return adopted

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def available(self) -> int:
        """How many more sandboxes could get a network: idle ones plus slots never taken."""
        return len(self._idle) + self._slots.free

    @property
    def leased(self) -> list[SandboxNetwork]:
        return list(self._leased.values())

    async def wait_filled(self, timeout: float = 10.0) -> None:
        """Until `size` networks are idle; for tests and warm-up at start."""
        async with asyncio.timeout(timeout):
            while len(self._idle) < self.size:
                await asyncio.sleep(0.005)

    async def _make(self) -> SandboxNetwork:
        slot = self._slots.take()
        try:
            name = f"{self.prefix}{slot.index}"
            return await build(name, slot, self.idle_policy, self._returned)  # off the loop
        except BaseException:
            self._slots.give_back(slot)
            raise

    def _returned(self, slot: Slot) -> None:
        self._leased.pop(slot.index, None)
        self._slots.give_back(slot)
        if not self._closed:
            self._wanted.set()

    async def _fill(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            while len(self._idle) < self.size:
                try:
                    network = await self._make()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("preparing a sandbox network failed")
                    await asyncio.sleep(1.0)
                    continue
                if self._closed:
                    network.destroy()
                    return
                self._idle.append(network)

    async def acquire(self, policy: EgressPolicy | None = None) -> SandboxNetwork:
        """A ready network with `policy` (default: the idle policy); made on the spot if none is idle."""
        if self._closed:
            raise RuntimeError("network pool is closed")
        network = self._idle.popleft() if self._idle else await self._make()
        self._wanted.set()
        assert network.slot is not None
        self._leased[network.slot.index] = network
        if policy is not None and policy != network.policy:
            try:
                await network.apply_policy(policy)
            except BaseException:
                network.destroy()
                raise
        return network

    async def attach(self, network: SandboxNetwork, policy: EgressPolicy | None = None) -> SandboxNetwork:
        """Give a network made elsewhere (`SandboxNetwork.create(name)`) a slot of this pool."""
        slot = self._slots.take()
        try:
            await network.attach(slot, self._returned)
        except BaseException:
            self._slots.give_back(slot)
            raise
        self._leased[slot.index] = network
        await network.apply_policy(policy or self.idle_policy)
        return network

    def release(self, network: SandboxNetwork) -> None:
        """Destroy a network from `acquire`; its slot becomes free."""
        network.destroy()

    async def close(self) -> None:
        """Stop filling and destroy every network the pool made, idle or leased."""
        self._closed = True
        await cancel(self._filler)
        while self._idle:
            self._idle.popleft().destroy()
        for network in list(self._leased.values()):
            network.destroy()
