"""The node's side of the metrics history: merging envd's samples, ranges, the pause archive."""

from __future__ import annotations

from pathlib import Path

from aenv.agent.envd.metrics import INTERVAL_SECONDS
from aenv.orchestrator.metrics import (
    CLOCK_MARGIN,
    KEPT_SAMPLES,
    MetricsArchive,
    between,
    merge,
    sample_due,
    sandbox_metric,
)


def _sample(ts: int, cpu: float = 1.0) -> dict:
    return {"ts": ts, "cpu_used_pct": cpu, "mem_used": 1, "mem_total": 2, "mem_cache": 0,
            "disk_used": 3, "disk_total": 4, "cpu_count": 2}  # fmt: skip


def test_merge_keeps_one_sample_per_time_oldest_first_and_bounded() -> None:
    merged = merge([_sample(3), _sample(1)], [_sample(2), _sample(3, cpu=9.0)])
    assert [s["ts"] for s in merged] == [1, 2, 3] and merged[-1]["cpu_used_pct"] == 9.0
    many = merge([_sample(ts) for ts in range(KEPT_SAMPLES + 10)])
    assert len(many) == KEPT_SAMPLES and many[0]["ts"] == 10


def test_between_is_inclusive_and_open_ended() -> None:
    samples = [_sample(ts) for ts in (10, 15, 20)]
    assert [s["ts"] for s in between(samples, 15, 15)] == [15]
    assert [s["ts"] for s in between(samples, None, 15)] == [10, 15]
    assert [s["ts"] for s in between(samples, 16, None)] == [20]


def test_sandbox_metric_has_every_key_the_sdk_requires() -> None:
    metric = sandbox_metric(_sample(1735689600), cpu_count=2)
    assert metric["timestamp"] == "2025-01-01T00:00:00Z" and metric["timestampUnix"] == 1735689600
    required = {"cpuCount", "cpuUsedPct", "memUsed", "memTotal", "memCache", "diskUsed", "diskTotal"}
    assert required <= metric.keys()


def test_archive_adds_and_survives_damage(tmp_path: Path) -> None:
    archive = MetricsArchive(tmp_path)
    assert archive.load() == [] and archive.newest() is None
    archive.add([_sample(1), _sample(2)])
    archive.add([_sample(2), _sample(3)])
    assert [s["ts"] for s in archive.load()] == [1, 2, 3] and archive.newest() == 3
    archive.path.write_text("{not json")
    assert archive.load() == []


def test_a_sample_is_due_once_the_guest_may_have_run_an_interval_since_the_newest() -> None:
    assert sample_due(None, 0.0)  # nothing saved yet: whatever the guest holds is new
    newest = 1_000
    assert not sample_due(newest, newest + 0.5)
    assert not sample_due(newest, newest + INTERVAL_SECONDS - CLOCK_MARGIN - 0.5)
    # The guest's clock may be a little ahead of the host's: due that much before the interval ends.
    assert sample_due(newest, newest + INTERVAL_SECONDS - CLOCK_MARGIN)
    assert sample_due(newest, newest + 3600)
