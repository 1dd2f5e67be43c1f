"""One real run of the harness (`--mode smoke`) against a node of its own, seeded with the session's
`base` template: it measures, reports and cleans up. Timing targets are not asserted here: they
are what the harness is for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aenv.devnode import netns_names
from bench.node import SLOT_FIRST

pytestmark = pytest.mark.vm

REPO = Path(__file__).resolve().parents[2]
SMOKE_FIGURES = {"floor-restore", "floor-save", "create", "create-usable", "pause", "resume", "proxy-rtt"}


def _scratch_dirs() -> set[str]:
    return {p.name for p in Path("/tmp").glob("aenv-bench-*")}


def test_smoke_run_reports_every_figure_and_leaves_nothing(tmp_path: Path, template_seed: Path):
    if os.geteuid() != 0:
        pytest.skip("the harness starts a node, which needs root (network namespaces)")
    result_path = tmp_path / "smoke.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    dirs_before, netns_before = _scratch_dirs(), netns_names()
    command = ["--mode", "smoke", "--json", str(result_path), "--seed", str(template_seed)]
    run = subprocess.run(
        [sys.executable, "-m", "bench", *command],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=420,
    )  # fmt: skip
    assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr[-4000:]}"
    assert "median" in run.stdout and "proxy round trip" in run.stdout

    document = json.loads(result_path.read_text())
    assert document["mode"] == "smoke" and document["errors"] == []
    figures = {f["key"]: f for f in document["figures"]}
    assert set(figures) == SMOKE_FIGURES
    for key, figure in figures.items():
        assert figure["count"] >= 1, key
        assert 0 < figure["min"] <= figure["median"] <= figure["max"], key
    for key in ("create", "resume", "pause", "proxy-rtt"):
        assert figures[key]["floor"] > 0 and figures[key]["ratio"] > 0, key
        assert figures[key]["met"] in (True, False), key

    assert _scratch_dirs() <= dirs_before, "the harness left a temporary directory"
    # Only names the harness and its node use: other nodes on the host may come and go meanwhile.
    left = {n for n in netns_names() - netns_before if n.startswith(("aenv-floor-", f"aenv-s{SLOT_FIRST}-"))}
    assert left == set(), f"the harness left network namespaces: {left}"
    pids = subprocess.run(["pgrep", "-f", "aenv-bench-"], capture_output=True, text=True).stdout.split()
    assert pids == [], f"processes still running from the harness's directories: {pids}"
