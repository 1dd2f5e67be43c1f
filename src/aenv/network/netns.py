"""Network namespaces with one tap device each: the sandbox's private network.

Every guest sees the same addresses (guest 169.254.0.21/30, gateway 169.254.0.22 on the
tap), so a VM restored or forked from a snapshot needs no network reconfiguration: the
namespace, not the address, tells sandboxes apart. The host reaches a guest by creating a
socket inside the namespace (sockets keep the namespace they were created in), which needs
no routes or addresses in the host's own namespace.

A namespace may also get an uplink (a slot, see `slots`): a veth pair to the root namespace
through which the guest's allowed traffic leaves, NATed twice (guest → slot address inside
the namespace, slot block → host address in the root namespace). Its egress policy is an
nft table inside the namespace (see `egress`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pyroute2 import AsyncIPRoute, netns

from .egress import (
    TAP_NAME,
    EgressPolicy,
    denied_host_addresses,
    enable_forwarding,
    namespace_ruleset,
    policy_update,
    run_nft,
)
from .nsthread import CLONE_NEWNET, inside, libc
from .slots import NAMESPACE_VETH, SLOT_PREFIX_LEN, Slot

log = logging.getLogger(__name__)

GUEST_ADDRESS = "169.254.0.21"
GATEWAY_ADDRESS = "169.254.0.22"
PREFIX_LEN = 30
# Every tap has the same MAC: a restored guest keeps the gateway's MAC in its ARP cache.
GATEWAY_MAC = "02:00:a9:fe:00:16"

_TUNSETIFF = 0x400454CA
_TUNSETPERSIST = 0x400454CB
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_IFF_VNET_HDR = 0x4000

_RTM_DELLINK = 17
_NLM_F_REQUEST_ACK = 0x1 | 0x4
_NLMSG_ERROR = 2


def _open_tap() -> int:
    """The tap of this thread's namespace, opened (and made if it is missing)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        request = struct.pack("16sH", TAP_NAME.encode(), _IFF_TAP | _IFF_NO_PI | _IFF_VNET_HDR)
        fcntl.ioctl(fd, _TUNSETIFF, request)
    except OSError:
        os.close(fd)
        raise
    return fd


def make_tap(name: str) -> None:
    """Make namespace `name`'s tap, which outlives this call (persistent) until the namespace goes."""
    with inside(name):
        fd = _open_tap()
    try:
        fcntl.ioctl(fd, _TUNSETPERSIST, 1)
    finally:
        os.close(fd)


def route_socket(name: str) -> AsyncIPRoute:
    """A netlink route session in namespace `name`, for `async with`.

    Its socket is made here, by this thread entering the namespace for the one call: pyroute2's
    own `netns=` forks a helper process per session, and a node refills its network pool with
    two such sessions per sandbox.
    """
    with inside(name):
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, socket.NETLINK_ROUTE)
    return AsyncIPRoute(use_socket=sock)


_MS_BIND = 4096
_MS_REC = 16384
_MS_SHARED = 1 << 20
NETNS_DIR = "/run/netns"


def _mount(source: str, target: str, flags: int) -> None:
    if libc.mount(source.encode(), target.encode(), b"none", flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _make_namespace(name: str, errors: list[BaseException]) -> None:
    """In a thread of its own: a new network namespace, pinned at /run/netns/<name> as `ip netns` does."""
    try:
        os.makedirs(NETNS_DIR, exist_ok=True)
        # As iproute2 does: make the directory a shared mount point, binding it onto itself
        # only if it is not a mount point yet (the first attempt fails with EINVAL then).
        if libc.mount(b"", NETNS_DIR.encode(), b"none", _MS_SHARED | _MS_REC, None) != 0:
            _mount(NETNS_DIR, NETNS_DIR, _MS_BIND | _MS_REC)
            _mount("", NETNS_DIR, _MS_SHARED | _MS_REC)
        path = f"{NETNS_DIR}/{name}"
        os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0))
        if libc.unshare(CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            os.unlink(path)
            raise OSError(err, f"unshare: {os.strerror(err)}")
        try:
            _mount("/proc/thread-self/ns/net", path, _MS_BIND)
        except OSError:
            os.unlink(path)
            raise
    except BaseException as exc:
        errors.append(exc)


def create_namespace(name: str) -> None:
    """Create a named network namespace without forking.

    unshare(2) moves only the calling thread into the new namespace, so a short-lived thread
    does it, which costs far less than forking a process as pyroute2's `netns.create` does.
    """
    errors: list[BaseException] = []
    worker = threading.Thread(target=_make_namespace, args=(name, errors), name=f"netns-{name}")
    worker.start()
    worker.join()
    if errors:
        raise errors[0]


def delete_link(ifname: str) -> bool:
    """Delete a root-namespace link by name with one netlink request; False if it is gone.

    Synchronous on purpose (`SandboxNetwork.destroy` is), and pyroute2's synchronous API
    cannot run inside an event loop.
    """
    try:
        index = socket.if_nametoindex(ifname)
    except OSError:
        return False
    header_len, ifinfo_len = 16, 16
    request = struct.pack("=LHHLL", header_len + ifinfo_len, _RTM_DELLINK, _NLM_F_REQUEST_ACK, 1, 0)
    request += struct.pack("=BxHiII", socket.AF_UNSPEC, 0, index, 0, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        sock.sendto(request, (0, 0))
        reply = sock.recv(4096)
    _, kind, _, _, _ = struct.unpack_from("=LHHLL", reply)
    (error,) = struct.unpack_from("=i", reply, header_len) if kind == _NLMSG_ERROR else (0,)
    if error == -19:  # ENODEV: it went away meanwhile
        return False
    if error:
        raise OSError(-error, f"deleting link {ifname}: {os.strerror(-error)}")
    return True


@dataclass
class SandboxNetwork:
    """A namespace holding the tap that one VM's virtio-net device is attached to.

    With a slot it also has an uplink and egress rules; `on_destroy` lets the owner of the
    slot (a `NetworkPool`) take it back whoever destroys the network.
    """

    name: str
    slot: Slot | None = None
    policy: EgressPolicy | None = None
    on_destroy: Callable[[Slot], None] | None = field(default=None, repr=False, compare=False)
    fresh: bool = field(default=False, repr=False, compare=False)  # made here: no rules loaded yet

    @classmethod
    async def create(
        cls, name: str, slot: Slot | None = None, policy: EgressPolicy | None = None
    ) -> SandboxNetwork:
        """Create the namespace, bring up loopback and the tap with the gateway address.

        Without a slot and a policy the namespace has no way out at all (the guest reaches
        nothing but the node's own connections to it). With a slot and no policy the E2B
        default applies: internet allowed.
        """
        create_namespace(name)
        network = cls(name, fresh=True)
        try:
            make_tap(name)
            async with route_socket(name) as ipr:
                (tap,) = await ipr.link_lookup(ifname=TAP_NAME)
                await ipr.link("set", index=tap, address=GATEWAY_MAC)
                await ipr.addr("add", index=tap, address=GATEWAY_ADDRESS, prefixlen=PREFIX_LEN)
                await ipr.link("set", index=tap, state="up")
                (lo,) = await ipr.link_lookup(ifname="lo")
                await ipr.link("set", index=lo, state="up")
            if slot is not None:
                await network.attach(slot)
            if slot is not None or policy is not None:
                await network.apply_policy(policy or EgressPolicy())
        except BaseException:
            network.destroy()
            raise
        log.debug("network namespace %s ready", name)
        return network

    async def attach(self, slot: Slot) -> None:
        """Give the namespace its uplink: a veth pair on `slot`, default route to the host.

        The host end carries the namespace's name as its alias, which is how
        `cleanup_stale` finds the uplinks of namespaces a crashed node left behind.
        """
        if self.slot is not None:
            raise ValueError(f"network {self.name} already has slot {self.slot.index}")
        try:
            async with AsyncIPRoute() as ipr:
                await ipr.link(
                    "add",
                    ifname=slot.host_ifname,
                    kind="veth",
                    peer={"ifname": NAMESPACE_VETH, "net_ns_fd": self.name},
                )
                (host,) = await ipr.link_lookup(ifname=slot.host_ifname)
                await ipr.link("set", index=host, ifalias=self.name)
                await ipr.addr("add", index=host, address=slot.host_address, prefixlen=SLOT_PREFIX_LEN)
                await ipr.link("set", index=host, state="up")
            async with route_socket(self.name) as ipr:
                (veth,) = await ipr.link_lookup(ifname=NAMESPACE_VETH)
                await ipr.addr("add", index=veth, address=slot.namespace_address, prefixlen=SLOT_PREFIX_LEN)
                await ipr.link("set", index=veth, state="up")
                await ipr.route("add", dst="0.0.0.0/0", gateway=slot.host_address)
            with inside(self.name):
                enable_forwarding()
        except BaseException:
            delete_link(slot.host_ifname)
            raise
        self.slot = slot

    async def apply_policy(self, policy: EgressPolicy) -> None:
        """Replace the namespace's egress rules by `policy` in one transaction.

        The rules this object loaded are changed in place (`policy_update`); a namespace `create`
        made gets its table declared; only one whose table is unknown (adopted after a restart)
        has the table swapped whole, for which the kernel waits out an RCU grace period.
        """
        hosts = await denied_host_addresses()
        if self.policy is not None:
            script = policy_update(policy, hosts)
        else:
            script = namespace_ruleset(policy, hosts, fresh=self.fresh)
        await run_nft(script, netns=self.name)
        self.policy, self.fresh = policy, False

    def open_tap(self) -> int:
        """Open the tap for QEMU (`-netdev tap,fd=N`), so QEMU itself needs no namespace."""
        with inside(self.name):
            return _open_tap()

    def socket(self) -> socket.socket:
        """A non-blocking TCP socket that lives in the sandbox's namespace."""
        with inside(self.name):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def destroy(self) -> None:
        """Remove the uplink and the namespace (its tap goes with it), free the slot. Idempotent.

        The uplink is deleted explicitly: a socket still open inside the namespace keeps
        the namespace, and with it the veth pair, alive after its name is removed.
        """
        slot, self.slot = self.slot, None
        _remove(self.name, slot)
        self._returned(slot)

    async def aclose(self) -> None:
        """`destroy`, with the kernel's part in a thread: deleting a veth pair waits for an RCU
        grace period (~40 ms here), which would stall every other request of the event loop."""
        slot, self.slot = self.slot, None
        await asyncio.to_thread(_remove, self.name, slot)
        self._returned(slot)

    def _returned(self, slot: Slot | None) -> None:
        if slot is not None and self.on_destroy is not None:
            self.on_destroy(slot)


def _remove(name: str, slot: Slot | None) -> None:
    """Delete a namespace's uplink, then its name (which ends the namespace once nothing holds it)."""
    if slot is not None:
        delete_link(slot.host_ifname)
    with contextlib.suppress(FileNotFoundError):
        netns.remove(name)
