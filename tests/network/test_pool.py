"""The warm pool on real namespaces, veths and nft tables (no VM)."""

from __future__ import annotations

import os
import resource
import secrets
import socket
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from aenv.network import nftables
from aenv.network.egress import TAP_NAME, EgressPolicy, NetworkError, policy_update, run_nft
from aenv.network.netns import GATEWAY_ADDRESS, GATEWAY_MAC, SandboxNetwork, inside
from aenv.network.pool import NetworkPool, cleanup_stale
from aenv.network.slots import Slot, SlotAllocator

from .conftest import TEST_SLOTS, namespaces, root_links, sh, table_exists

pytestmark = pytest.mark.asyncio(loop_scope="session")


def leftovers(prefix: str) -> set[str]:
    """Namespaces with the prefix, and root-namespace slot links of any namespace that has it."""
    found = {name for name in namespaces() if name.startswith(prefix)}
    for link in root_links():
        if link.startswith("aenv-v"):
            alias = sh(f"cat /sys/class/net/{link}/ifalias").strip()
            if alias.startswith(prefix):
                found.add(link)
    return found


def egress_rules(name: str) -> list[str]:
    listed = sh(f"ip netns exec {name} nft list chain inet aenv egress")
    lines = [line.strip() for line in listed.splitlines()]
    start = lines.index("chain egress {")
    return lines[start + 1 : lines.index("}", start)]


@pytest_asyncio.fixture(loop_scope="session")
async def pool() -> AsyncIterator[NetworkPool]:
    prefix = f"aenvtest-{secrets.token_hex(3)}-"
    pool = NetworkPool(2, prefix=prefix, slots=SlotAllocator(*TEST_SLOTS))
    try:
        await pool.start()
        yield pool
    finally:
        await pool.close()
        await cleanup_stale(prefix)
    assert not leftovers(prefix)


async def test_pool_prepares_networks_and_hands_them_out(pool: NetworkPool):
    await pool.wait_filled()
    assert len(leftovers(pool.prefix)) == 4  # two namespaces, two uplinks

    started = time.perf_counter()
    network = await pool.acquire()
    assert time.perf_counter() - started < 0.05  # no netlink, no nft: taken off the shelf
    assert network.slot is not None and network.policy == EgressPolicy()
    assert network.name in namespaces() and table_exists(network.name)
    addresses = sh(f"ip -n {network.name} -br addr show dev veth0")
    assert network.slot.namespace_address in addresses
    assert network.slot.host_address in sh(f"ip -br addr show dev {network.slot.host_ifname}")
    tap = sh(f"ip -n {network.name} -br link show dev {TAP_NAME}")  # made inside, never in the root
    assert GATEWAY_MAC in tap and "UP" in tap and TAP_NAME not in root_links()
    assert GATEWAY_ADDRESS in sh(f"ip -n {network.name} -br addr show dev {TAP_NAME}")

    strict = EgressPolicy(allow_internet=False, allow_out=["203.0.113.7"])
    other = await pool.acquire(strict)
    assert other.policy == strict
    rules = sh(f"ip netns exec {other.name} nft list chain inet aenv egress")
    assert "@allow_out accept" in rules and rules.strip().splitlines()[-3].strip().startswith("reject")
    assert "203.0.113.7" in sh(f"ip netns exec {other.name} nft list set inet aenv allow_out")

    await pool.wait_filled()
    live = [*pool.leased, *pool._idle]
    slots = [n.slot.index for n in live if n.slot is not None]
    assert len(slots) == len(set(slots)) == 4

    pool.release(network)
    await other.aclose()  # what a VM's end does; the pool still gets the slot back
    assert network.name not in namespaces() and other.name not in namespaces()
    assert network.slot is None and not pool.leased
    assert not {f"aenv-v{index}" for index in slots[:2]} & root_links()


async def test_policy_is_replaced_atomically_on_a_live_network(pool: NetworkPool):
    network = await pool.acquire()
    await network.apply_policy(EgressPolicy(allow_internet=False, deny_out=["203.0.113.0/24"]))
    assert "203.0.113.0/24" in sh(f"ip netns exec {network.name} nft list set inet aenv deny_out")
    assert egress_rules(network.name)[-1].startswith("reject")
    await network.apply_policy(EgressPolicy())
    assert "elements" not in sh(f"ip netns exec {network.name} nft list set inet aenv deny_out")
    assert egress_rules(network.name) == [  # swapped, not appended
        "ip daddr @always_denied reject with icmpx admin-prohibited",
        "ip daddr @allow_out accept",
        "ip daddr @deny_out reject with icmpx admin-prohibited",
        "accept",
    ]
    assert sh(f"ip netns exec {network.name} nft list tables").split().count("aenv") == 1


async def test_a_refused_script_raises_with_nft_s_message_and_changes_nothing(pool: NetworkPool):
    network = await pool.acquire()
    refused = policy_update(EgressPolicy(allow_internet=False)) + "add rule inet aenv egress bogus\n"
    with pytest.raises(NetworkError, match="syntax error"):
        await run_nft(refused, network.name)  # all of it or nothing: its reject is not applied either
    assert egress_rules(network.name)[-1] == "accept"


async def test_rules_load_in_a_process_holding_over_a_thousand_descriptors(pool: NetworkPool):
    """libnftables waits with select(2), which aborts a process on a descriptor numbered 1024 or
    more; a node with hundreds of sandboxes holds that many, so the library runs in a helper."""
    network = await pool.acquire()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), max(hard, 4096)))
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    try:
        await run_nft(policy_update(EgressPolicy(allow_internet=False)), network.name)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert egress_rules(network.name)[-1].startswith("reject")


async def test_a_helper_that_exited_is_started_again(pool: NetworkPool):
    network = await pool.acquire()
    await run_nft(policy_update(EgressPolicy(allow_internet=False)), network.name)
    helper = nftables._HELPER._process
    assert helper is not None
    helper.kill()  # the helper this test's loads started
    helper.wait()
    await run_nft(policy_update(EgressPolicy()), network.name)
    assert egress_rules(network.name)[-1] == "accept"


async def test_a_network_made_elsewhere_gets_a_slot(pool: NetworkPool):
    network = await SandboxNetwork.create(f"{pool.prefix}adopted")
    try:
        await pool.attach(network, EgressPolicy(allow_internet=False))
        assert network.slot is not None and network.policy == EgressPolicy(allow_internet=False)
        assert sh(f"cat /sys/class/net/{network.slot.host_ifname}/ifalias").strip() == network.name
    finally:
        network.destroy()
    assert not pool.leased


async def test_cleanup_stale_removes_what_a_crashed_node_left(pool: NetworkPool):
    await pool.wait_filled()
    orphan = await pool.acquire()
    await pool.wait_filled()
    # A socket inside keeps the namespace, and its uplink, alive after the name is gone.
    with inside(orphan.name):
        holder = socket.socket()
    try:
        sh(f"ip netns del {orphan.name}")
        assert orphan.slot is not None and orphan.slot.host_ifname in root_links()
        removed = await cleanup_stale(pool.prefix)
        assert orphan.name in removed and len(removed) == 3
        assert not leftovers(pool.prefix)
        assert orphan.slot.host_ifname not in root_links()
    finally:
        holder.close()


async def test_a_restarted_node_keeps_the_networks_of_surviving_sandboxes():
    prefix = f"aenvtest-{secrets.token_hex(3)}-"
    first = TEST_SLOTS[0]
    survivor = await SandboxNetwork.create(f"{prefix}{first}", Slot(first))
    dead = await SandboxNetwork.create(f"{prefix}{first + 1}", Slot(first + 1))
    pool = NetworkPool(1, prefix=prefix, slots=SlotAllocator(*TEST_SLOTS))
    try:
        adopted = await pool.start(keep=[survivor.name])
        assert list(adopted) == [survivor.name] and adopted[survivor.name].slot == Slot(first)
        assert dead.name not in namespaces() and Slot(first + 1).host_ifname not in root_links()
        await pool.wait_filled()
        assert pool._idle[0].slot not in (Slot(first), None)  # the survivor's slot stays taken
        adopted[survivor.name].destroy()
        assert survivor.name not in namespaces() and not pool.leased
    finally:
        await pool.close()
        for network in (survivor, dead):
            network.destroy()
        await cleanup_stale(prefix)
    assert not leftovers(prefix)
