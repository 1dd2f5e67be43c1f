"""The node's side of the metrics history: merging envd's samples, ranges, the pause archive."""

from __future__ import annotations

from pathlib import Path

from aenv.agent.envd.metrics import INTERVAL_SECONDS
from aenv.orchestrator.metrics import (
    CLOCK_MARGIN,
    KEPT_SAMPLES,
    NEXT_SAMPLE_MARGIN,
    MetricsArchive,
    SampleWatch,
    between,
    merge,
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


def test_a_pause_asks_the_guest_only_once_it_may_have_run_an_interval_since_its_newest_sample() -> None:
    watch = SampleWatch()
    watch.running(0.0)
    assert watch.due(1.0)  # nothing saved yet
    watch.saved(newest=1_000, previous=None, wall=1_001.0)  # first request: the host's clock bounds
    quiet = INTERVAL_SECONDS - CLOCK_MARGIN - 1.0
    watch.stopped(1.0)
    watch.running(10.0)  # paused meanwhile: that does not count
    watch.running(10.5)  # a later start (a resume's end) changes nothing
    assert not watch.due(10.0 + quiet - 0.1)
    assert watch.due(10.0 + quiet + 0.1)

    # A sample newer than the last request came after it: the running time since bounds it
    # (3.1 s here, where the host's clock says 11 s).
    watch.saved(newest=1_020, previous=1_000, wall=1_030.0)
    watch.stopped(13.2)
    watch.running(100.0)
    assert not watch.due(100.0 + INTERVAL_SECONDS - 3.1 - 0.1 - 0.1)
    assert watch.due(100.0 + INTERVAL_SECONDS - 3.1 - 0.1 + 0.1)
    watch.saved(newest=1_020, previous=1_020, wall=1_200.0)  # nothing new: due until something is
    assert watch.due(100.0 + INTERVAL_SECONDS)

    watch.saved(newest=1_300, previous=1_020, wall=1_300.5)
    watch.reset()  # a guest booted afresh from its disk samples from its start
    assert watch.due(200.0)


def test_envd_s_next_in_bounds_the_quiet_time_also_after_an_answer_with_nothing_new() -> None:
    watch = SampleWatch()
    watch.running(0.0)
    assert watch.due(0.5)
    watch.saved(newest=1_000, previous=1_000, wall=1_000.5, next_in=2.0)  # nothing new, but envd said when
    watch.stopped(1.0)  # counted from the request's start (0.5), not from its answer
    watch.running(50.0)
    assert not watch.due(50.0 + 1.5 - NEXT_SAMPLE_MARGIN - 0.01)
    assert watch.due(50.0 + 1.5 - NEXT_SAMPLE_MARGIN + 0.01)
    watch.saved(newest=1_060, previous=1_000, wall=1_060.0, next_in=0.0)  # a sample is due any moment
    assert watch.due(51.6)
