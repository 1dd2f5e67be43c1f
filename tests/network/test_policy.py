"""Egress policy validation, slot addresses and generated rules; no VM, nothing applied."""

from __future__ import annotations

import subprocess

import pytest

from aenv.network.egress import DOMAINS_UNSUPPORTED, EgressPolicy, host_ruleset, namespace_ruleset
from aenv.network.slots import SLOT_COUNT, Slot, SlotAllocator


def test_entries_are_normalized_and_deduplicated():
    policy = EgressPolicy(allow_out=["1.1.1.1", "8.8.8.8/24", " 1.1.1.1/32"], deny_out=["0.0.0.0/0"])
    assert policy.allow_out == ("1.1.1.1/32", "8.8.8.0/24")
    assert policy.deny_out == ("0.0.0.0/0",)
    assert policy == EgressPolicy(True, ("1.1.1.1/32", "8.8.8.0/24"), ("0.0.0.0/0",))


@pytest.mark.parametrize("entry", ["example.com", "*.example.com", "api.example.com.", "*"])
def test_domains_in_allow_out_are_rejected(entry):
    with pytest.raises(ValueError, match=DOMAINS_UNSUPPORTED):
        EgressPolicy(allow_out=[entry])


@pytest.mark.parametrize("entry", ["1.2.3.4/33", "300.1.1.1", "not an address", ""])
def test_invalid_allow_out_entries_are_rejected(entry):
    with pytest.raises(ValueError, match=r'allowOut entry ".*" must be an IP address or CIDR block'):
        EgressPolicy(allow_out=[entry])


@pytest.mark.parametrize("entry", ["example.com", "10.0.0.0/40", "*"])
def test_deny_out_takes_only_addresses(entry):
    with pytest.raises(ValueError, match=r'denyOut entry ".*" must be an IP address or CIDR block'):
        EgressPolicy(deny_out=[entry])


def _egress_chain(script: str) -> list[str]:
    lines = [line.strip() for line in script.splitlines()]
    start = lines.index("chain egress {")
    return lines[start + 1 : lines.index("}", start)]


def test_evaluation_order_always_denied_then_allow_then_deny_then_base():
    reject = "reject with icmpx type admin-prohibited"
    assert _egress_chain(namespace_ruleset(EgressPolicy())) == [
        f"ip daddr @always_denied {reject}",
        "ip daddr @allow_out accept",
        f"ip daddr @deny_out {reject}",
        "accept",
    ]
    assert _egress_chain(namespace_ruleset(EgressPolicy(allow_internet=False)))[-1] == reject


def test_guardrails_and_host_addresses_are_in_the_always_denied_set():
    script = namespace_ruleset(EgressPolicy(allow_out=["10.1.2.3"]), ["192.0.2.2", "fd00::2"])
    always = next(line for line in script.splitlines() if "set always_denied" in line)
    for cidr in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "127.0.0.0/8"):
        assert cidr in always
    for cidr in ("169.254.0.0/16", "224.0.0.0/4", "0.0.0.0/8", "198.19.0.0/16", "192.0.2.2/32"):
        assert cidr in always
    assert "fd00" not in script


def test_ipv6_entries_are_accepted_but_not_in_ipv4_sets():
    policy = EgressPolicy(allow_out=["2001:db8::1"], deny_out=["::/0", "0.0.0.0/0"])
    script = namespace_ruleset(policy)
    assert "2001:db8" not in script and "::/0" not in script
    assert "elements = { 0.0.0.0/0 }" in script


@pytest.mark.parametrize(
    "script",
    [
        namespace_ruleset(EgressPolicy()),
        namespace_ruleset(
            EgressPolicy(False, ["8.8.8.8", "1.0.0.0/8", "1.2.0.0/16"], ["0.0.0.0/0"]), ["192.0.2.2"]
        ),
        host_ruleset(),
    ],
)
def test_generated_rules_pass_nft_check(script):
    """`nft -c` parses and validates the script against the kernel without committing it."""
    result = subprocess.run(["nft", "-c", "-f", "-"], input=script, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_slot_addresses_follow_the_index():
    assert (Slot(0).host_address, Slot(0).namespace_address) == ("198.19.0.1", "198.19.0.2")
    last = Slot(SLOT_COUNT - 1)
    assert (str(last.network), last.host_ifname) == ("198.19.255.252/30", "aenv-v16383")
    with pytest.raises(ValueError):
        Slot(SLOT_COUNT)


def test_allocator_never_hands_out_a_slot_twice_and_reuses_late():
    allocator = SlotAllocator(10, 3)
    a, b, c = allocator.take(), allocator.take(), allocator.take()
    assert {a.index, b.index, c.index} == {10, 11, 12}
    with pytest.raises(RuntimeError):
        allocator.take()
    allocator.give_back(b)
    allocator.give_back(b)  # twice is harmless
    assert allocator.take() == b
    assert allocator.in_use == {10, 11, 12}
