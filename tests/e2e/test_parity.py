"""E2B behaviours the SDK relies on, through the official SDK on a real node: list filters, order
and start-time bounds; network rule changes that reach the running sandbox at once."""

from __future__ import annotations

import httpx
import pytest
from e2b import Sandbox, SandboxQuery

from tests.network.conftest import INET_ADDRESS, Listener, fake_internet  # noqa: F401 (a fixture)

from .conftest import NodeServer, Sandboxes

pytestmark = pytest.mark.vm


def _ids(query: SandboxQuery, **kwargs) -> list[str]:
    return [s.sandbox_id for s in Sandbox.list(query=query, **kwargs).next_items()]


def test_list_order_template_and_start_bounds(node: NodeServer, sandboxes: Sandboxes) -> None:
    first = sandboxes.create()
    second = sandboxes.create()
    mine = {"e2e": sandboxes.tag}
    both = [first.sandbox_id, second.sandbox_id]

    assert _ids(SandboxQuery(metadata=mine), order="asc") == both
    assert _ids(SandboxQuery(metadata=mine), order="desc") == both[::-1]
    assert _ids(SandboxQuery(metadata=mine)) == both[::-1]  # newest first by default

    paginator = Sandbox.list(query=SandboxQuery(metadata=mine), limit=1, order="asc")
    assert [s.sandbox_id for s in paginator.next_items()] == both[:1] and paginator.has_next
    assert [s.sandbox_id for s in paginator.next_items()] == both[1:] and not paginator.has_next

    template_id = first.get_info().template_id
    for template in ("base", template_id, "team/base:latest"):
        assert _ids(SandboxQuery(metadata=mine, template=template), order="asc") == both, template
    assert _ids(SandboxQuery(metadata=mine, template="no-such-template")) == []

    second_started = second.get_info().started_at
    assert _ids(SandboxQuery(metadata=mine, started_after=second_started)) == both[1:]
    first_started = first.get_info().started_at
    # `startedBefore` is not sent by SDK 2.63 but is part of the list contract: raw HTTP.
    answer = httpx.get(
        f"{node.url}/v2/sandboxes",
        params={"startedBefore": first_started.isoformat(), "template": "base"},
        headers={"X-API-Key": node.key},
    )
    assert answer.status_code == 200
    listed = [s["sandboxID"] for s in answer.json()]
    assert first.sandbox_id in listed and second.sandbox_id not in listed

    for bad in (
        {"order": "sideways"},
        {"startedAfter": "yesterday"},
        {"startedBefore": "2026-01-01T00:00:00"},
    ):
        answer = httpx.get(f"{node.url}/v2/sandboxes", params=bad, headers={"X-API-Key": node.key})
        assert answer.status_code == 400 and answer.json()["code"] == 400, bad


def _reads(sandbox, port: int) -> str:
    """What the guest reads from the fake internet host; empty if it cannot connect within 3 s."""
    command = (
        f"timeout 3 bash -c 'exec 3<>/dev/tcp/{INET_ADDRESS}/{port}; head -c 64 <&3' 2>/dev/null || true"
    )
    return sandbox.commands.run(command, timeout=15).stdout


def test_network_update_applies_at_once_and_is_kept_by_pause_and_fork(
    sandboxes: Sandboxes,
    fake_internet,  # noqa: F811 (the imported fixture)
) -> None:
    internet = Listener(fake_internet.namespace)
    try:
        sandbox = sandboxes.create()
        assert _reads(sandbox, internet.port) == internet.token

        sandbox.update_network({"deny_out": [INET_ADDRESS]})
        assert _reads(sandbox, internet.port) == ""
        assert (sandbox.get_info().network or {}).get("deny_out") == [INET_ADDRESS]

        assert sandbox.pause()
        sandbox = Sandbox.connect(sandbox.sandbox_id)
        assert _reads(sandbox, internet.port) == "", "a resumed sandbox lost its network rules"
        child = sandbox.fork(count=1)[0]
        sandboxes.track(child.sandbox_id)
        assert _reads(child, internet.port) == "", "a fork's child lost its source's network rules"

        sandbox.update_network({"allow_internet_access": False, "allow_out": [INET_ADDRESS]})
        assert _reads(sandbox, internet.port) == internet.token  # allowOut wins over the closed internet
        sandbox.update_network({})  # every rule cleared: the internet is open again
        assert _reads(sandbox, internet.port) == internet.token
        sandbox.update_network({"allow_internet_access": False})
        assert _reads(sandbox, internet.port) == ""
        assert _reads(child, internet.port) == ""  # the child's rules are its own
    finally:
        internet.close()
