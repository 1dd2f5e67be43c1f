"""From inside a sandbox: the node's API and other sandboxes are out of reach.

Only addresses of this machine are probed: the host's own addresses (`ip -4 -o addr`, which
include the root-namespace ends of the sandbox uplinks) and the namespace ends of the slots
(`src/aenv/network/slots.py`). The guest address is the same in every sandbox, so another
sandbox is only addressable through its slot.
"""

from __future__ import annotations

import ipaddress
import shlex
import subprocess

import httpx
import pytest

from aenv.network.slots import HOST_VETH_PREFIX, SLOT_BLOCK

from .conftest import NodeServer, Sandboxes, wait_until

pytestmark = pytest.mark.vm

OTHER_PORT = 8004
ENVD_PORT = 49983


def host_addresses() -> dict[str, str]:
    """Interface name → IPv4 address, for every address of the host's root namespace."""
    out = subprocess.run(["ip", "-4", "-o", "addr"], check=True, capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        fields = line.split()
        found[f"{fields[1]}:{fields[3]}"] = fields[3].split("/")[0]
    return found


def slot_namespace_addresses() -> list[str]:
    """The namespace end (`.2` of the /30) of every slot uplink on the host."""
    addresses = []
    for key, address in host_addresses().items():
        if key.startswith(HOST_VETH_PREFIX) and ipaddress.ip_address(address) in SLOT_BLOCK:
            addresses.append(str(ipaddress.ip_address(address) + 1))
    return addresses


def probe(sandbox, targets: list[tuple[str, int]]) -> dict[tuple[str, int], bool]:
    """Try a TCP connection to each target from inside the sandbox, in parallel; True where one opened."""
    script = " ".join(
        f"( timeout 3 bash -c '</dev/tcp/{host}/{port}' 2>/dev/null && echo OPEN {host} {port}"
        f" || echo closed {host} {port} ) &"
        for host, port in targets
    )
    out = sandbox.commands.run(f"bash -c {shlex.quote(script + ' wait')}", timeout=60).stdout
    results = {}
    for line in out.splitlines():
        verdict, host, port = line.split()
        results[(host, int(port))] = verdict == "OPEN"
    assert set(results) == set(targets), out
    return results


def test_sandbox_cannot_reach_node_or_other_sandboxes(sandboxes: Sandboxes, node: NodeServer) -> None:
    mine = sandboxes.create()
    other = sandboxes.create()
    other.commands.run(f"python3 -m http.server {OTHER_PORT}", background=True)
    host = other.get_host(OTHER_PORT)
    wait_until(
        lambda: httpx.get(node.url, headers={"Host": host}, timeout=5).status_code == 200,
        60,
        what="the other sandbox's HTTP server (through the proxy, from the host)",
    )
    # Positive control: the probe itself works (inside the other sandbox its server answers).
    assert probe(other, [("127.0.0.1", OTHER_PORT)]) == {("127.0.0.1", OTHER_PORT): True}

    addresses = host_addresses()
    assert any(key.startswith(HOST_VETH_PREFIX) for key in addresses), addresses
    targets = [(address, node.port) for address in addresses.values()]
    targets += [(address, port) for address in slot_namespace_addresses() for port in (OTHER_PORT, ENVD_PORT)]
    # (inside the guest, loopback is the guest itself, whose envd does listen)
    outside = [a for a in addresses.values() if not ipaddress.ip_address(a).is_loopback]
    targets += [(address, port) for address in outside for port in (OTHER_PORT, ENVD_PORT)]
    targets = sorted(set(targets))
    reached = [target for target, opened in probe(mine, targets).items() if opened]
    assert reached == [], f"reachable from inside a sandbox: {reached}"
    # and the other way round
    mine.commands.run(f"python3 -m http.server {OTHER_PORT}", background=True)
    back = [(address, OTHER_PORT) for address in slot_namespace_addresses()]
    back += [(address, node.port) for address in addresses.values()]
    reached = [target for target, opened in probe(other, sorted(set(back))).items() if opened]
    assert reached == [], f"reachable from inside a sandbox: {reached}"
