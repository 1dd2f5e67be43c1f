"""A list query's page: what a node sends for one page of `GET /v2/sandboxes` (after the cursor,
at most the limit), so a gateway merges pages, not every node's every sandbox."""

from __future__ import annotations

from aenv.orchestrator.interface import ListQuery

from .conftest import record


def test_a_page_starts_after_the_cursor_in_the_lists_order() -> None:
    times = ["2026-01-01T00:00:03Z", "2026-01-01T00:00:02Z", "2026-01-01T00:00:02Z", "2026-01-01T00:00:01Z"]
    ordered = [record(sandbox_id=i, started_at=t) for i, t in zip("abcd", times, strict=True)]  # newest first
    assert ListQuery().page(ordered) == ordered
    assert [r.sandbox_id for r in ListQuery(limit=2).page(ordered)] == ["a", "b"]
    after_b = ListQuery(after=(times[1], "b"), limit=5)
    assert [r.sandbox_id for r in after_b.page(ordered)] == ["c", "d"]
    ascending = [ordered[3], ordered[1], ordered[2], ordered[0]]  # oldest first, then by id
    after_c = ListQuery(order="asc", after=(times[2], "c"), limit=1)
    assert [r.sandbox_id for r in after_c.page(ascending)] == ["a"]
