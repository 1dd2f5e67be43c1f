"""`name:<tag or build id>` references as E2B resolves them, on the build records alone."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from aenv.template.builds import BuildNotFound, BuildRecord, TemplateBuilds, TemplateRecord


@pytest.fixture
def builds(tmp_path: Path) -> TemplateBuilds:
    store = TemplateBuilds(tmp_path, SimpleNamespace(), None, None)  # type: ignore[arg-type]  # no build runs here
    record = TemplateRecord("harbor-abc")
    record.builds = {
        "b-ready": BuildRecord("b-ready", status="ready", snapshot_id="s-ready", tags=["v1"]),
        "b-running": BuildRecord("b-running", status="building"),
        "b-failed": BuildRecord("b-failed", status="error"),
    }
    record.tags = {"v1": "b-ready", "default": "b-ready"}
    store.templates[record.template_id] = record
    return store


def test_the_part_after_the_colon_is_a_tag_or_the_id_of_a_ready_build(builds: TemplateBuilds) -> None:
    assert builds.resolve("harbor-abc:v1") == "s-ready"
    assert builds.resolve("harbor-abc:b-ready") == "s-ready"
    assert builds.resolve("harbor-abc") == "s-ready"
    assert builds.resolve("someone-else:v1") is None  # not a built template: the repository decides


@pytest.mark.parametrize("missing", ["v2", "b-running", "b-failed"])
def test_a_missing_tag_or_unready_build_answers_e2bs_wording(builds: TemplateBuilds, missing: str) -> None:
    with pytest.raises(BuildNotFound) as answer:
        builds.resolve(f"harbor-abc:{missing}")
    assert str(answer.value) == f"tag '{missing}' does not exist for template 'harbor-abc'"
    assert answer.value.status == 404
