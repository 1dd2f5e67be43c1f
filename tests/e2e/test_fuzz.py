"""Schemathesis against a real node's `/openapi.json`: generated requests, valid and invalid, for every
operation the document describes; no answer may be a 5xx or contradict the document, and the node
must be healthy afterwards.

Bounded: a few examples per operation (the suite runs on a busy 2-core TCG host). Generated
sandbox IDs name no sandbox, so the only VMs this can start are creates from a generated template
name that happens to exist; any sandbox it leaves is killed at the end.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, assume, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from .conftest import NodeServer

pytestmark = pytest.mark.vm

EXAMPLES_PER_OPERATION = 15


@pytest.fixture(scope="module")
def node_sandboxes(node: NodeServer) -> Iterator[None]:
    """Kill every sandbox the run created: the fuzzer cannot know the IDs it got."""
    with httpx.Client(base_url=node.url, headers={"X-API-Key": node.key}, timeout=120) as api:
        before = {s["sandboxID"] for s in api.get("/v2/sandboxes").json()}
        yield
        for sandbox in api.get("/v2/sandboxes").json():
            if sandbox["sandboxID"] not in before:
                api.delete(f"/sandboxes/{sandbox['sandboxID']}")


@pytest.fixture(scope="module")
def log_start(node: NodeServer) -> int:
    """Where the node's log stood before the fuzzing: tests that ran earlier on the same node
    may have logged failures they caused on purpose (an unwritable repository, say)."""
    return node.log_path.stat().st_size


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_generated_requests(
    node: NodeServer, node_sandboxes: None, log_start: int, mode: GenerationMode
) -> None:
    """Every operation, with data that fits its schema (positive) and data that does not (negative).

    Driven with Hypothesis here rather than by `schema.parametrize()`, whose lazy loading from a
    fixture does not run under pytest 9.
    """
    schema = schemathesis.openapi.from_url(f"{node.url}/openapi.json")
    failures = {}
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: schemathesis.Case) -> None:
            # A query parameter whose value is an empty list is not sent at all, so a request
            # made invalid only by such an extra parameter arrives valid: nothing to reject.
            assume(not any(value == [] for value in (case.query or {}).values()))
            case.call_and_validate(headers={"X-API-Key": node.key}, timeout=120)

        try:
            check()
        except Unsatisfiable:  # nothing to generate in this mode: no parameters, no body
            continue
        except Exception as exc:  # every operation's failure, not only the first one's
            failures[operation.label] = exc
    assert not failures, "\n\n".join(f"{label}: {exc}" for label, exc in failures.items())


def test_node_healthy_after_fuzzing(node: NodeServer, log_start: int) -> None:
    assert node.healthy() and node.alive()
    with open(node.log_path, "rb") as log:
        log.seek(log_start)
        logged = log.read().decode(errors="replace")
    assert "Traceback" not in logged, logged[-4000:]
