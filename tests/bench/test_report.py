"""The harness's arithmetic and presentation: summaries, targets, rows, the table, the JSON, parsing."""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

import pytest

from bench.client import _command_output
from bench.context import host_busy_ticks
from bench.node import BenchError
from bench.plan import MODES
from bench.report import Row, table, write_json
from bench.run import Options, _wanted
from bench.soak import second_half_growth
from bench.stats import percentile, summarize
from bench.targets import FIGURES, TARGETS, Target


def test_summary_statistics_are_actual_samples():
    samples = [float(v) for v in range(1, 101)]
    figure = summarize("x", samples)
    assert (figure.count, figure.median, figure.min, figure.max) == (100, 50.5, 1.0, 100.0)
    assert (figure.p95, figure.p99) == (95.0, 99.0)
    assert percentile([3.0, 1.0, 2.0], 0.99) == 3.0
    assert percentile([7.0], 0.5) == 7.0
    with pytest.raises(ValueError):
        summarize("empty", [])


def test_targets_cover_every_figure_and_read_as_written():
    # a figure's target, or its rows' (`loaded-create` of `loaded`, `cluster-create` of `cluster`)
    assert all(f in TARGETS or any(key.startswith(f"{f}-") for key in TARGETS) for f in FIGURES)
    assert str(TARGETS["create"]) == "<= 0.2x floor"
    assert TARGETS["create"].previous == "median <= 20 ms"
    assert str(TARGETS["concurrent-resume"]) == "p99 <= 0.5x floor"
    assert str(TARGETS["snapshot"]) == "<= 3x floor, median <= 100 ms"
    assert str(TARGETS["proxy-rtt"]) == "<= 1.1x floor"
    assert str(TARGETS["density"]) == ">= 500 sandboxes"
    assert Target("median", "<=", 20).holds(20) and not Target("median", "<=", 20).holds(20.1)
    assert Target("median", ">=", 0.8, ratio=True).holds(0.8)


def test_row_judges_its_target_statistic_over_the_floor():
    fast = summarize("create", [10.0, 12.0, 50.0])
    assert Row("create", fast, 60.0, "bare restore").met is True  # the median counts, not the max
    assert Row("create", summarize("create", [25.0, 30.0]), 60.0, "bare restore").met is False
    spiky = summarize("resumes", [10.0] * 99 + [400.0])
    row = Row("concurrent-resume", spiky, 40.0, "p99 of bare restores")  # p99: the 99th of 100
    assert row.ratio == 0.25 and row.met is True
    assert Row("concurrent-resume", summarize("r", [10.0] * 98 + [400.0] * 2), 40.0, "p99").met is False


def test_a_cap_must_hold_as_well_as_the_ratio():
    slow = summarize("snapshot", [150.0, 150.0])
    assert Row("snapshot", slow, 100.0, "nothing written").met is False  # 1.5x, but over 100 ms
    assert Row("snapshot", summarize("snapshot", [90.0]), 40.0, "nothing written").met is True
    assert Row("snapshot", summarize("snapshot", [90.0]), 20.0, "nothing written").met is False


def test_ratio_to_floor_and_missing_inputs():
    proxied = summarize("rtt", [3.0, 3.0, 3.0])
    row = Row("proxy-rtt", proxied, floor=2.0, floor_name="direct")
    assert row.ratio == 1.5 and row.met is False
    assert Row("proxy-rtt", proxied, floor=2.8, floor_name="direct").met is True
    assert Row("proxy-rtt", proxied, floor=None, floor_name="direct").met is None  # remote node: n/a
    megabytes = summarize("tp", [70.0], unit="MB/s")
    throughput = Row("proxy-throughput", megabytes, floor=100.0, floor_name="direct")
    assert throughput.ratio == pytest.approx(0.7) and throughput.met is False
    assert Row("density", summarize("alive", [24.0]), evaluate=False).met is None
    assert Row("density", summarize("alive", [500.0])).met is True
    assert Row("density", summarize("alive", [200.0])).met is False
    assert Row("floor-restore", summarize("floor", [1.0])).met is None  # no target


def test_table_has_one_line_per_row_and_the_notes():
    rows = [
        Row("create", summarize("create (warm pool)", [30.0, 40.0]), 60.0, "bare restore", note="waited"),
        Row("proxy-rtt", summarize("proxy round trip", [2.0]), None, "direct"),
        Row("floor-save", summarize("floor: save", [3.0, 4.0])),
    ]
    text = table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["figure", "unit", "median"]
    create = next(line for line in lines if line.startswith("create (warm pool)"))
    assert "<= 0.2x floor" in create and "0.58x" in create and "NO" in create.split()
    assert create.rstrip().endswith("median <= 20 ms")  # the old absolute target, for reference
    rtt = next(line for line in lines if line.startswith("proxy round trip"))
    assert " n/a " in rtt and " - " in rtt  # no floor from a remote node, so not judged
    assert "notes:" in lines and any("waited" in line for line in lines)
    assert len({len(line) for line in lines[:5]}) == 1  # fixed width


def test_json_document(tmp_path: Path):
    rows = [Row("pause", summarize("pause", [9.0, 11.0]), 3.0, "bare stop+save", details={"kept": [True]})]
    path = tmp_path / "out" / "quick.json"
    write_json(path, rows, {"mode": "quick", "errors": []})
    document = json.loads(path.read_text())
    assert document["mode"] == "quick"
    (figure,) = document["figures"]
    assert figure["key"] == "pause" and figure["median"] == 10.0 and figure["count"] == 2
    assert figure["target"] == "<= 2x floor" and figure["met"] is False
    assert figure["previous_target"] == "median <= 15 ms"
    assert figure["floor"] == 3.0 and figure["ratio"] == pytest.approx(10 / 3)
    assert figure["details"] == {"kept": [True]}
    assert figure["samples"] == [9.0, 11.0]  # as measured, for any later analysis


def test_selection_and_companion_rows():
    options = Options(mode="smoke", only=(), json_path=Path("x.json"))
    assert options.selected == MODES["smoke"].figures
    assert Options(mode="quick", only=("fork",), json_path=Path("x.json")).selected == ("fork",)
    assert Options(mode="quick", only=(), json_path=Path("x.json"), soak_cycles=300).plan.soak == 300
    assert _wanted("density-overcommit", ("density",))
    assert _wanted("loaded-resume", ("loaded",)) and _wanted("fork-usable", ("fork",))
    assert _wanted("floor-restore", ("proxy-rtt",))
    assert not _wanted("resume", ("pause",))
    assert not _wanted("concurrent-resume", ("resume",))


def test_soak_judges_the_rss_of_its_second_half():
    plateau = {0: 100.0, 2: 108.0, 4: 111.0, 6: 111.5, 8: 111.2, 10: 111.4}
    assert second_half_growth(plateau) == 0.4  # from cycle 4 (the last at or before 5) to 10
    leak = {0: 100.0, 250: 103.0, 500: 106.0, 750: 109.0, 1000: 112.0}
    assert second_half_growth(leak) == 6.0
    assert second_half_growth({0: 50.0, 3: 52.5}) == 2.5  # one checkpoint: the whole run


def _frame(message: dict, flags: int = 0) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">BI", flags, len(data)) + data


def test_command_output_from_a_connect_stream():
    out = base64.b64encode(b"hello\n").decode()
    stream = (
        _frame({"event": {"start": {"pid": 7}}})
        + _frame({"event": {"data": {"stdout": out}}})
        + _frame({"event": {"end": {"exited": True, "status": "exit status 0"}}})
        + _frame({}, flags=0x02)
    )
    assert _command_output("echo hello", stream) == "hello\n"
    failed = _frame({"event": {"end": {"exitCode": 1, "exited": True}}}) + _frame({}, flags=0x02)
    with pytest.raises(BenchError, match="failed in the guest"):
        _command_output("false", failed)
    with pytest.raises(BenchError, match="without an end event"):
        _command_output("true", _frame({}, flags=0x02)[:-1])


def test_host_cpu_ticks_count_busy_within_total():
    busy, total = host_busy_ticks()
    later_busy, later_total = host_busy_ticks()
    assert 0 <= busy <= total and later_total >= total and later_busy >= busy


async def test_the_cluster_figures_over_light_nodes(tmp_path: Path) -> None:
    """The list and placement figures end to end on the smallest plan: Redis, a scheduler, a
    gateway and four light nodes (no VMs); every sandbox is listed through the gateway's pages."""
    from types import SimpleNamespace

    from aenv.devcluster import redis_server
    from bench import cluster

    ctx = SimpleNamespace(plan=MODES["smoke"])
    with redis_server(tmp_path / "redis") as redis:
        rows = await cluster._light_rows(ctx, redis, tmp_path)  # type: ignore[arg-type]
    assert [r.key for r in rows] == ["cluster-placement", "cluster-list"]
    assert all(r.floor and r.ratio for r in rows)
    assert "bound on 3" in rows[0].note  # the placements spread over the three nodes


async def test_the_cluster_scale_figures_at_a_tiny_size() -> None:
    """Every cluster-scale figure on two processes of light nodes (one of them killed for the
    down and take-over figures), two gateways and two schedulers (no VMs)."""
    from bench import scale

    rows = await scale._run(scale.Size(nodes=scale.PER_PROCESS + 2, sandboxes=300, gateways=2))
    assert [r.key for r in rows] == [
        "cluster-scale-placement", "cluster-scale-create", "cluster-scale-connect", "cluster-scale-kill",
        "cluster-scale-list", "cluster-scale-heartbeat", "cluster-scale-redis-node",
        "cluster-scale-redis-sandbox", "cluster-scale-down", "cluster-scale-takeover",
    ]  # fmt: skip
    assert rows[1].figure.count == 300 and rows[4].note.startswith("3 pages of 100")
    assert rows[8].figure.count == 2  # the killed process's nodes, each down
    assert rows[7].figure.median > 0 and rows[9].figure.median > 0
