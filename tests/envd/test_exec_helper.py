"""aenv-exec, envd's command starter, run directly: its arguments, its report pipe, its exec."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from aenv.guest.tools import build_exec_helper


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("exec") / "aenv-exec"
    build_exec_helper(path)
    return path


def _run(helper: Path, user: str, *command: str) -> tuple[int, str, bytes]:
    """Exit status, stdout and what the helper reported on its pipe."""
    report, report_w = os.pipe()
    try:
        done = subprocess.run(
            [str(helper), str(report_w), "100", user, "0", *command],
            pass_fds=(report_w,), capture_output=True, text=True, check=False,
        )  # fmt: skip
    finally:
        os.close(report_w)
    with os.fdopen(report, "rb") as pipe:
        return done.returncode, done.stdout, pipe.read()


@pytest.mark.skipif(os.geteuid() != 0, reason="changing ids takes root")
def test_the_command_runs_with_the_ids_and_oom_score_given(helper: Path) -> None:
    probe = "id -u; id -g; id -G; cat /proc/self/oom_score_adj"
    code, out, report = _run(helper, "65534:65534:65534,100", "sh", "-c", probe)
    assert (code, report) == (0, b"")  # the exec closed the report pipe unwritten
    assert out.split("\n")[:4] == ["65534", "65534", "65534 100", "100"]


def test_keeping_the_callers_user(helper: Path) -> None:
    code, out, report = _run(helper, "-", "id", "-u")  # found on PATH
    assert (code, out, report) == (0, f"{os.getuid()}\n", b"")


@pytest.mark.parametrize("user", ["-1:0", "0:-1", "0:0:1,-2", "0", "0:0:1,,2", "x:0", "0:0x"])
def test_malformed_ids_are_refused_before_anything_runs(helper: Path, user: str) -> None:
    assert _run(helper, user, "true") == (127, "", b"arguments 22")


def test_a_failed_exec_is_reported_with_its_errno(helper: Path, tmp_path: Path) -> None:
    assert _run(helper, "-", "/no/such/program") == (127, "", b"exec 2")
    plain = tmp_path / "plain"
    plain.write_text("not a program")
    assert _run(helper, "-", str(plain)) == (127, "", b"exec 13")
