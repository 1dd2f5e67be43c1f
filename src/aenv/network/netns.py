"""Network namespaces with one tap device each: the sandbox's private network.

Every guest sees the same addresses (guest 169.254.0.21/30, gateway 169.254.0.22 on the
tap), so a VM restored or forked from a snapshot needs no network reconfiguration: the
namespace, not the address, tells sandboxes apart. The host reaches a guest by creating a
socket inside the namespace (sockets keep the namespace they were created in), which needs
no routes or addresses in the host's own namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from pyroute2 import AsyncIPRoute, netns

log = logging.getLogger(__name__)

GUEST_ADDRESS = "169.254.0.21"
GATEWAY_ADDRESS = "169.254.0.22"
PREFIX_LEN = 30
TAP_NAME = "tap0"
# Every tap has the same MAC: a restored guest keeps the gateway's MAC in its ARP cache.
GATEWAY_MAC = "02:00:a9:fe:00:16"

_CLONE_NEWNET = 0x40000000
_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_IFF_VNET_HDR = 0x4000

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def inside(name: str) -> Iterator[None]:
    """Run the body with this thread in namespace `name`, then return to the original one.

    setns(2) changes only the calling thread, so other threads are unaffected.
    """
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(original)
    finally:
        os.close(target)
        os.close(original)


@dataclass
class SandboxNetwork:
    """A namespace holding the tap that one VM's virtio-net device is attached to."""

    name: str

    @classmethod
    async def create(cls, name: str) -> SandboxNetwork:
        """Create the namespace, bring up loopback and the tap with the gateway address."""
        netns.create(name)
        network = cls(name)
        try:
            async with AsyncIPRoute(netns=name) as ipr:
                await ipr.link("add", ifname=TAP_NAME, kind="tuntap", mode="tap")
                (tap,) = await ipr.link_lookup(ifname=TAP_NAME)
                await ipr.link("set", index=tap, address=GATEWAY_MAC)
                await ipr.addr("add", index=tap, address=GATEWAY_ADDRESS, prefixlen=PREFIX_LEN)
                await ipr.link("set", index=tap, state="up")
                (lo,) = await ipr.link_lookup(ifname="lo")
                await ipr.link("set", index=lo, state="up")
        except BaseException:
            network.destroy()
            raise
        log.debug("network namespace %s ready", name)
        return network

    def open_tap(self) -> int:
        """Open the tap for QEMU (`-netdev tap,fd=N`), so QEMU itself needs no namespace."""
        with inside(self.name):
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
        try:
            request = struct.pack("16sH", TAP_NAME.encode(), _IFF_TAP | _IFF_NO_PI | _IFF_VNET_HDR)
            fcntl.ioctl(fd, _TUNSETIFF, request)
        except OSError:
            os.close(fd)
            raise
        return fd

    def socket(self) -> socket.socket:
        """A non-blocking TCP socket that lives in the sandbox's namespace."""
        with inside(self.name):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def destroy(self) -> None:
        """Remove the namespace; its tap goes with it. Idempotent."""
        with contextlib.suppress(FileNotFoundError):
            netns.remove(self.name)
