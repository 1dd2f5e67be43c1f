"""Egress policy of a sandbox and the nftables rules that enforce it.

Two tables, both named `aenv` (family inet):

* inside each sandbox namespace: what the guest may reach. Every packet the guest sends
  is checked (not only new connections), so a policy change cuts connections it no longer
  allows at once. Order, as in the reference: always-denied → allowOut → denyOut → base.
  The namespace itself accepts from the guest only replies to connections the node opened
  (the node talks to the guest through sockets it creates inside the namespace) and
  connections to the sandbox's volume server (`VOLUME_PORT`, served only where it has volumes).
* in the root namespace, once per host: masquerade of the slot block towards the outside,
  and a wall between slots and the host (no new connections from a slot to any host
  address, no forwarding from one slot to another), whatever the host's addresses are.

Rules are replaced by one nft transaction (`policy_update`, loaded through `nftables`), so there
is never a moment without them.
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from pyroute2 import AsyncIPRoute

from . import nftables
from .nftables import NftError
from .slots import HOST_VETH_PREFIX, NAMESPACE_VETH, SLOT_BLOCK

VOLUME_PORT = 564  # the sandbox's volume server (aenv.volumes.server), at the namespace's tap address

TABLE = "aenv"
HOST_ADDRESSES_TTL = 5.0  # seconds a dump of the host's addresses serves new networks
REJECT = "reject with icmpx type admin-prohibited"
TAP_NAME = "tap0"

# Never reachable from a guest, whatever its policy says (the slot block keeps sandboxes
# apart; the host's own addresses are added when rules are generated).
ALWAYS_DENIED: tuple[ipaddress.IPv4Network, ...] = tuple(
    ipaddress.IPv4Network(cidr)
    for cidr in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, and the limited broadcast address
        str(SLOT_BLOCK),
    )
)
# (when, addresses) of the last `denied_host_addresses` dump
_recent: tuple[float, list[str]] = (float("-inf"), [])

DOMAINS_UNSUPPORTED = "domain entries in allowOut are not supported until TCP egress proxy is enabled"
_DOMAIN = re.compile(r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.?$")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class NetworkError(RuntimeError):
    """Setting up a sandbox network or its rules failed."""


def _parse(entry: str) -> Network | None:
    """An IP address (as a single-address network) or CIDR, normalized; None if neither."""
    try:
        return ipaddress.ip_network(entry.strip(), strict=False)
    except ValueError:
        return None


def _is_domain(entry: str) -> bool:
    """`example.com`, `*.example.com` or `*`; a numeric last label is a broken IP, not a name."""
    name = entry.strip().lower()
    if name == "*":
        return True
    return bool(_DOMAIN.match(name)) and not name.rstrip(".").rsplit(".", 1)[-1].isdigit()


def _normalize(entries: Iterable[str], kind: str) -> tuple[str, ...]:
    result: list[str] = []
    for entry in entries:
        network = _parse(entry)
        if network is None:
            if kind == "allowOut" and _is_domain(entry):
                raise ValueError(DOMAINS_UNSUPPORTED)
            raise ValueError(f'{kind} entry "{entry}" must be an IP address or CIDR block')
        if str(network) not in result:
            result.append(str(network))
    return tuple(result)


@dataclass(frozen=True)
class EgressPolicy:
    """E2B egress semantics: allowOut beats denyOut beats the base policy.

    `allow_internet=False` is the same as `deny_out=["0.0.0.0/0"]`; `allow_out` alone does
    not make an allowlist. Entries are normalized (bare IP → /32, host bits cleared,
    duplicates dropped), so equal policies compare equal. IPv6 entries are accepted and
    vacuous: guests have no IPv6 connectivity at all.
    """

    allow_internet: bool = True
    allow_out: tuple[str, ...] = field(default=())
    deny_out: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "allow_out", _normalize(self.allow_out, "allowOut"))
        object.__setattr__(self, "deny_out", _normalize(self.deny_out, "denyOut"))


def _ipv4(entries: Iterable[str]) -> list[str]:
    return [e for e in entries if isinstance(ipaddress.ip_network(e), ipaddress.IPv4Network)]


def _set(name: str, elements: Iterable[str]) -> str:
    body = "type ipv4_addr; flags interval; auto-merge;"
    listed = ", ".join(elements)
    if listed:
        body += f" elements = {{ {listed} }};"
    return f"    set {name} {{ {body} }}"


def _replace_table(body: list[str]) -> str:
    """A script that swaps the whole table in one transaction (the empty declaration makes
    the delete valid when the table does not exist yet)."""
    head = [f"table inet {TABLE}", f"delete table inet {TABLE}", f"table inet {TABLE} {{"]
    return "\n".join([*head, *body, "}", ""])


def _sets(policy: EgressPolicy, host_addresses: Iterable[str]) -> list[tuple[str, list[str]]]:
    denied = [str(n) for n in ALWAYS_DENIED] + _ipv4(str(ipaddress.ip_network(a)) for a in host_addresses)
    return [
        ("always_denied", denied),
        ("allow_out", _ipv4(policy.allow_out)),
        ("deny_out", _ipv4(policy.deny_out)),
    ]


def _egress_rules(policy: EgressPolicy) -> list[str]:
    return [
        f"ip daddr @always_denied {REJECT}",
        "ip daddr @allow_out accept",
        f"ip daddr @deny_out {REJECT}",
        "accept" if policy.allow_internet else REJECT,
    ]


def namespace_ruleset(
    policy: EgressPolicy, host_addresses: Iterable[str] = (), *, fresh: bool = False
) -> str:
    """The nft script for a sandbox namespace under `policy`.

    `fresh`: the namespace has no table yet, so the script only declares it. Otherwise it
    swaps the whole table, for a namespace whose table is unknown; the kernel then waits for
    an RCU grace period (~15 ms) as the old table's hooked chains go (`policy_update` does not).
    """
    body = [
        *(_set(name, elements) for name, elements in _sets(policy, host_addresses)),
        "    chain input {",
        "        type filter hook input priority filter; policy accept;",
        f'        iifname "{TAP_NAME}" ct state established,related accept',
        f'        iifname "{TAP_NAME}" tcp dport {VOLUME_PORT} accept',
        f'        iifname "{TAP_NAME}" drop',
        "    }",
        "    chain forward {",
        "        type filter hook forward priority filter; policy drop;",
        f'        iifname "{TAP_NAME}" oifname "{NAMESPACE_VETH}" meta nfproto ipv4 goto egress',
        f'        iifname "{NAMESPACE_VETH}" oifname "{TAP_NAME}" ct state established,related accept',
        "    }",
        "    chain egress {",
        *(f"        {rule}" for rule in _egress_rules(policy)),
        "    }",
        "    chain postrouting {",
        "        type nat hook postrouting priority srcnat; policy accept;",
        f'        oifname "{NAMESPACE_VETH}" masquerade',
        "    }",
    ]
    if fresh:
        return "\n".join([f"table inet {TABLE} {{", *body, "}", ""])
    return _replace_table(body)


def policy_update(policy: EgressPolicy, host_addresses: Iterable[str] = ()) -> str:
    """The script that gives a namespace holding `namespace_ruleset`'s table `policy` in place:
    the sets' elements and the egress chain's rules swapped in one transaction, the chains with
    hooks untouched (so there is never a moment without rules, and no grace period to wait for)."""
    lines = []
    for name, elements in _sets(policy, host_addresses):
        lines.append(f"flush set inet {TABLE} {name}")
        if elements:
            lines.append(f"add element inet {TABLE} {name} {{ {', '.join(elements)} }}")
    lines.append(f"flush chain inet {TABLE} egress")
    lines += [f"add rule inet {TABLE} egress {rule}" for rule in _egress_rules(policy)]
    return "\n".join([*lines, ""])


def host_ruleset() -> str:
    """The nft script for the root namespace: NAT for the slot block, slots walled off."""
    slots = f'"{HOST_VETH_PREFIX}*"'
    return _replace_table(
        [
            "    chain input {",
            "        type filter hook input priority filter; policy accept;",
            f"        iifname {slots} ct state established,related accept",
            f"        iifname {slots} drop",
            "    }",
            "    chain forward {",
            "        type filter hook forward priority filter; policy accept;",
            f"        iifname {slots} oifname {slots} drop",
            f"        iifname {slots} ip saddr != {SLOT_BLOCK} drop",
            f"        iifname {slots} meta nfproto ipv6 drop",
            "    }",
            "    chain postrouting {",
            "        type nat hook postrouting priority srcnat; policy accept;",
            f"        ip saddr {SLOT_BLOCK} oifname != {slots} masquerade",
            "    }",
        ]
    )


async def run_nft(script: str, netns: str | None = None) -> None:
    """Load an nft script as one transaction, inside namespace `netns` when given."""
    try:
        await nftables.load(script, netns)
    except (NftError, OSError) as exc:
        where = f"namespace {netns}" if netns else "root namespace"
        raise NetworkError(f"nft failed in {where}: {exc}") from exc


async def host_addresses() -> list[str]:
    """The root namespace's IPv4 addresses, which no guest may reach."""
    async with AsyncIPRoute() as ipr:
        return [msg.get("IFA_ADDRESS") async for msg in await ipr.addr("dump", family=2)]


async def denied_host_addresses() -> list[str]:
    """The host's addresses a new network's rules must name: those no always-denied range covers
    already, from a dump at most `HOST_ADDRESSES_TTL` seconds old.

    The dump lists every sandbox uplink's address too (all in `SLOT_BLOCK`, denied as a block), so
    it grew with the sandboxes: at 256 concurrent rollouts, parsing it took 6.9 % of the node's
    event loop (py-spy, bench `rollout`), once per new network, and made every network's rule set
    as long as the host had sandboxes. The host's own addresses change rarely, and a network keeps
    the ones it was made with anyway.
    """
    global _recent
    taken, addresses = _recent
    if time.monotonic() - taken > HOST_ADDRESSES_TTL:
        found = [ipaddress.ip_address(a) for a in await host_addresses() if a]
        addresses = [str(a) for a in found if not any(a in network for network in ALWAYS_DENIED)]
        _recent = time.monotonic(), addresses
    return addresses


def _write_sysctl(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def enable_forwarding() -> None:
    """IPv4 forwarding in the calling thread's current namespace."""
    _write_sysctl("/proc/sys/net/ipv4/ip_forward", "1")


async def ensure_host_rules() -> None:
    """Install (or refresh) the root namespace's table and turn on forwarding. Idempotent."""
    await run_nft(host_ruleset())
    enable_forwarding()


async def remove_host_rules() -> None:
    """Drop the root namespace's table (forwarding stays on: other software may rely on it)."""
    await run_nft(f"table inet {TABLE}\ndelete table inet {TABLE}\n")
