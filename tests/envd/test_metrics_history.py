"""envd's metrics ring, without a server: bounded, ranged, CPU use per interval."""

from __future__ import annotations

import os

from aenv.agent.envd.metrics import MetricsHistory, Sample, render, take

CPUS = os.cpu_count() or 1


def _sample(ts: int, uptime: float, idle: float) -> Sample:
    return Sample(ts, uptime, idle * CPUS, 1000, 400, 100, 50, 20)


def test_render_averages_cpu_over_the_interval() -> None:
    first, second = _sample(10, 100.0, 50.0), _sample(15, 105.0, 54.0)
    metric = render(second, first)
    assert metric["cpu_used_pct"] == 20.0  # idle 4 of the 5 seconds
    assert metric["mem_used"] == 600 and metric["mem_total"] == 1000 and metric["disk_used"] == 20
    assert render(first, None)["cpu_used_pct"] == 50.0  # since boot
    assert render(first, first)["cpu_used_pct"] == 0.0  # no time passed


def test_ring_is_bounded_and_keeps_each_interval_average() -> None:
    history = MetricsHistory(kept=3)
    for n in range(5):
        history.add(_sample(10 + n, 100.0 + n, 50.0 + n / 2))
    kept = history.between(None, None)
    assert [m["ts"] for m in kept] == [12, 13, 14]
    assert all(m["cpu_used_pct"] == 50.0 for m in kept)  # the oldest against its evicted predecessor
    assert [m["ts"] for m in history.between(13, 13)] == [13]
    assert history.between(15, None) == []


def test_take_reads_this_machine() -> None:
    sample = take()
    assert sample.mem_total > sample.mem_available > 0 and sample.uptime > 0 and sample.disk_total > 0
