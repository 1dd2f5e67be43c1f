"""What an operator reads on a real node's `/metrics`: every lifecycle operation the official SDK
made, timed in `aenv_operation_duration_seconds`, data-plane requests as one `proxy` series, and
requests counted by route template (never by sandbox id)."""

from __future__ import annotations

import httpx
import pytest
from e2b import Sandbox
from prometheus_client.parser import text_string_to_metric_families

from .conftest import NodeServer, Sandboxes

pytestmark = pytest.mark.vm


def scrape(node: NodeServer) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{node.url}/metrics", timeout=30).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def count(seen: dict, name: str, **labels: str) -> float:
    return seen.get((name, frozenset(labels.items())), 0.0)


def test_sdk_operations_are_timed_by_operation_and_stage(node: NodeServer, sandboxes: Sandboxes) -> None:
    before = scrape(node)
    sandbox = sandboxes.create()
    assert sandbox.commands.run("echo hi").stdout == "hi\n"
    sandbox.pause()
    sandbox = Sandbox.connect(sandbox.sandbox_id)
    sandbox.kill()
    after = scrape(node)

    def grew(operation: str, stage: str = "api") -> float:
        labels = {"operation": operation, "stage": stage, "outcome": "ok"}
        name = "aenv_operation_duration_seconds_count"
        return count(after, name, **labels) - count(before, name, **labels)

    assert grew("create") == 1 and grew("pause") == 1 and grew("connect") == 1 and grew("kill") == 1
    assert grew("proxy", "proxy") >= 1  # the command went through the data plane

    def creates(seen: dict) -> float:
        routes = ("/sandboxes", "/v2/sandboxes")
        name = "aenv_http_requests_total"
        return sum(count(seen, name, route=r, method="POST", status="201") for r in routes)

    assert creates(after) == creates(before) + 1
    labels = {value for _, labelset in after for _, value in labelset}
    assert sandbox.sandbox_id not in labels  # no series per sandbox
