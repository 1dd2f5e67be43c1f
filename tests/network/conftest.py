"""Fixtures for network tests: host rules restored afterwards, a fake internet host, listeners.

No test sends traffic anywhere but loopback and namespaces the tests create: the "internet"
is a namespace of its own behind a veth in the root namespace, on TEST-NET-3 addresses.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from aenv.network.netns import inside
from aenv.network.slots import SLOT_COUNT

INET_HOST_SIDE = "203.0.113.1"
INET_ADDRESS = "203.0.113.2"
# Slots for tests, at the top of the block: clear of a node that may run on this host.
TEST_SLOTS = (SLOT_COUNT - 64, 64)


def sh(command: str) -> str:
    return subprocess.run(command, shell=True, check=True, capture_output=True, text=True).stdout


def table_exists(netns: str | None = None) -> bool:
    prefix = f"ip netns exec {netns} " if netns else ""
    return (
        subprocess.run(f"{prefix}nft list table inet aenv", shell=True, capture_output=True).returncode == 0
    )


def namespaces() -> set[str]:
    return {line.split()[0] for line in sh("ip netns list").splitlines() if line.strip()}


def root_links() -> set[str]:
    return {name for name in sh("ls /sys/class/net").split()}


@pytest.fixture(scope="session", autouse=True)
def host_state() -> Iterator[None]:
    """Put the root namespace's aenv table and IPv4 forwarding back as they were."""
    had_table = table_exists()
    forwarding = Path("/proc/sys/net/ipv4/ip_forward").read_text()
    yield
    if not had_table and table_exists():
        sh("nft delete table inet aenv")
    Path("/proc/sys/net/ipv4/ip_forward").write_text(forwarding)


class Listener:
    """A TCP server in a thread that greets every client with its token and hangs up.

    Its socket is created inside `netns` when given (a socket keeps its namespace).
    """

    def __init__(self, netns: str | None = None, port: int = 0):
        self.token = secrets.token_hex(4)
        with inside(netns) if netns else contextlib.nullcontext():
            self.sock = socket.create_server(("0.0.0.0", port))
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.sendall(self.token.encode())

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)


def reach_from_host(address: str, port: int, netns: str | None = None) -> str:
    """What a client in the root namespace (or `netns`) reads from address:port."""
    with inside(netns) if netns else contextlib.nullcontext():
        sock = socket.socket()
    with sock:
        sock.settimeout(2)
        sock.connect((address, port))
        return sock.recv(64).decode()


@dataclass
class FakeInternet:
    namespace: str
    address: str


@pytest.fixture
def fake_internet() -> Iterator[FakeInternet]:
    """A namespace routed via the host like an internet host would be; removed afterwards."""
    tag = secrets.token_hex(3)
    name, veth = f"aenvtest-inet-{tag}", f"atinet{tag}"
    try:
        sh(f"ip netns add {name}")
        sh(f"ip link add {veth} type veth peer name eth0 netns {name}")
        sh(f"ip addr add {INET_HOST_SIDE}/30 dev {veth} && ip link set {veth} up")
        sh(
            f"ip -n {name} addr add {INET_ADDRESS}/30 dev eth0 && ip -n {name} link set eth0 up"
            f" && ip -n {name} link set lo up && ip -n {name} route add default via {INET_HOST_SIDE}"
        )
        yield FakeInternet(name, INET_ADDRESS)
    finally:
        subprocess.run(f"ip link del {veth}", shell=True, capture_output=True)
        subprocess.run(f"ip netns del {name}", shell=True, capture_output=True)
