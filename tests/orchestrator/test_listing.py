"""List filters and their query parsing (E2B's `GET /v2/sandboxes`), without a node."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from aiohttp.test_utils import make_mocked_request

from aenv.api.server import list_query
from aenv.orchestrator.errors import InvalidRequest
from aenv.orchestrator.interface import ListQuery
from aenv.orchestrator.local import matches

from .conftest import record


def test_filters_combine() -> None:
    noon = record(started_at="2026-11-30T12:00:00.000Z", metadata={"k": "v"})
    at = datetime(2026, 11, 30, 12, tzinfo=UTC)
    assert matches(noon, ListQuery())
    assert matches(noon, ListQuery(template="base")) and matches(noon, ListQuery(template="tmpl1"))
    assert matches(noon, ListQuery(template="ns/base:v1"))
    assert not matches(noon, ListQuery(template="other"))
    assert matches(noon, ListQuery(started_after=at, started_before=at))  # bounds are inclusive
    assert not matches(noon, ListQuery(started_after=at.replace(minute=1)))
    assert not matches(noon, ListQuery(started_before=at.replace(hour=11)))
    assert not matches(noon, ListQuery(states=frozenset({"paused"})))
    assert matches(noon, ListQuery(states=frozenset({"running"}), metadata={"k": "v"}, template="base"))
    assert not matches(noon, ListQuery(metadata={"k": "w"}))


def test_query_parsing() -> None:
    query = list_query(
        make_mocked_request(
            "GET", "/v2/sandboxes?order=asc&template=base&startedAfter=2026-11-30T13:00:00%2B01:00"
        )
    )
    assert query.order == "asc" and query.template == "base"
    assert query.started_after == datetime(2026, 11, 30, 12, tzinfo=UTC)
    assert list_query(make_mocked_request("GET", "/v2/sandboxes")).order == "desc"
    for bad in ("order=up", "startedAfter=soon", "startedBefore=2026-11-30T12:00:00", "state=lost"):
        with pytest.raises(InvalidRequest):
            list_query(make_mocked_request("GET", f"/v2/sandboxes?{bad}"))
