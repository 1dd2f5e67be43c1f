"""Egress policy and isolation seen from inside real sandbox VMs.

The engine makes each sandbox's namespace (`SandboxNetwork.create`); the test pool gives it
an uplink and a policy, as `NetworkPool.attach` would for any namespace made elsewhere.
Every "is it reachable" question is asked from the guest with bash's /dev/tcp against
listeners that greet with a token: on the host (all addresses), in another sandbox's
namespace, in the sandbox's own namespace, and on a fake internet host.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator

import pytest

from aenv.network.egress import EgressPolicy, host_addresses
from aenv.network.pool import NetworkPool, cleanup_stale
from aenv.network.slots import SlotAllocator

from .conftest import INET_ADDRESS, TEST_SLOTS, FakeInternet, Listener, reach_from_host, root_links

pytestmark = pytest.mark.vm


@pytest.fixture
def vm_pool(node_loop) -> Iterator[NetworkPool]:
    prefix = f"aenvtest-{secrets.token_hex(3)}-"
    pool = NetworkPool(0, prefix=prefix, slots=SlotAllocator(*TEST_SLOTS))
    node_loop.run(pool.start())
    try:
        yield pool
    finally:
        node_loop.run(pool.close())
        node_loop.run(cleanup_stale(prefix))
    assert not {f"aenv-v{i}" for i in range(TEST_SLOTS[0], sum(TEST_SLOTS))} & root_links()


@pytest.fixture
def listen() -> Iterator[Callable[..., Listener]]:
    made: list[Listener] = []

    def make(netns: str | None = None) -> Listener:
        made.append(Listener(netns))
        return made[-1]

    yield make
    for listener in made:
        listener.close()


def guest_reads(sdk, address: str, port: int) -> str:
    """What the guest reads from address:port; empty if it cannot connect within 3 s."""
    command = f"timeout 3 bash -c 'exec 3<>/dev/tcp/{address}/{port}; head -c 64 <&3' 2>/dev/null || true"
    return sdk.commands.run(command, timeout=10).stdout


def test_guest_reaches_the_internet_but_never_the_host_or_other_sandboxes(
    base_template, sandboxes, node_loop, vm_pool: NetworkPool, fake_internet: FakeInternet, listen
):
    internet, on_host = listen(fake_internet.namespace), listen()
    host_ips = [ip for ip in node_loop.run(host_addresses()) if not ip.startswith("127.")]
    a, b = sandboxes.start(base_template.id), sandboxes.start(base_template.id)
    net_b = node_loop.run(vm_pool.attach(b.vm.guest.network))
    # Everything listed here is always denied: allowOut must not open any of it.
    allowed = [*host_ips, "198.19.0.0/16", "10.0.0.0/8", "169.254.0.0/16", "127.0.0.1", "0.0.0.0/0"]
    net_a = node_loop.run(vm_pool.attach(a.vm.guest.network, EgressPolicy(allow_out=allowed)))
    assert net_a.slot is not None and net_b.slot is not None
    in_b, in_a = listen(net_b.name), listen(net_a.name)

    # The listeners answer whoever may reach them: the host reaches every slot address.
    assert reach_from_host(host_ips[0], on_host.port) == on_host.token
    assert reach_from_host(net_b.slot.namespace_address, in_b.port) == in_b.token
    assert reach_from_host(net_a.slot.namespace_address, in_a.port) == in_a.token

    sdk = a.sdk()
    assert guest_reads(sdk, INET_ADDRESS, internet.port) == internet.token
    forbidden = [
        *[(ip, on_host.port) for ip in host_ips],  # the node's API would listen here
        (net_a.slot.host_address, on_host.port),  # the host's end of its own uplink
        (net_b.slot.host_address, on_host.port),
        (net_b.slot.namespace_address, in_b.port),  # another sandbox
        ("169.254.0.22", in_a.port),  # its own namespace, through the gateway
        (net_a.slot.namespace_address, in_a.port),
    ]
    for address, port in forbidden:
        assert guest_reads(sdk, address, port) == "", f"guest reached {address}:{port}"
    assert b.sdk().commands.run("echo alive").stdout == "alive\n"  # the node still reaches guests


def test_policy_changes_on_a_running_sandbox(
    base_template, sandboxes, node_loop, vm_pool: NetworkPool, fake_internet: FakeInternet, listen
):
    internet = listen(fake_internet.namespace)
    sandbox = sandboxes.start(base_template.id)
    network = node_loop.run(vm_pool.attach(sandbox.vm.guest.network))
    sdk = sandbox.sdk()
    cases = [
        (EgressPolicy(), True),
        (EgressPolicy(deny_out=[INET_ADDRESS]), False),
        (EgressPolicy(allow_internet=False), False),
        (EgressPolicy(allow_internet=False, allow_out=["203.0.113.0/30"]), True),
        (EgressPolicy(allow_out=[INET_ADDRESS], deny_out=["0.0.0.0/0"]), True),  # allowOut wins
        (EgressPolicy(deny_out=["0.0.0.0/0"]), False),
        (EgressPolicy(allow_internet=True), True),
    ]
    for policy, reachable in cases:
        node_loop.run(network.apply_policy(policy))
        expected = internet.token if reachable else ""
        assert guest_reads(sdk, INET_ADDRESS, internet.port) == expected, policy
