"""The guest init's pure parts, run on the host (nothing here needs PID 1)."""

import time

from aenv.agent import init


def test_parse_cmdline() -> None:
    cmdline = (
        "console=ttyS0 quiet panic=-1 aenv.hostname=sbx-1 aenv.dns=1.1.1.1 aenv.flag aenv.hostname=sbx-2\n"
    )
    assert init.parse_cmdline(cmdline) == {"hostname": "sbx-2", "dns": "1.1.1.1"}
    assert init.parse_cmdline("console=ttyS0") == {}


def test_envd_environment() -> None:
    env = init.envd_env()
    assert env["PYTHONPATH"] == "/opt/aenv/lib"
    assert env["PYTHONHOME"] == "/opt/aenv/runtime/python"
    assert not any(name.startswith("LD_") for name in env), "the loader is told on its command line"

    assert "/usr/bin" in env["PATH"].split(":")


def test_shipped_programs_run_on_the_drive_s_loader() -> None:
    argv = init.shipped("ip", "-batch", "-")
    assert argv == [
        "/opt/aenv/runtime/lib/ld-linux-x86-64.so.2", "--library-path", "/opt/aenv/runtime/lib",
        "/opt/aenv/runtime/bin/ip", "-batch", "-",
    ]  # fmt: skip


def test_envd_backoff_grows_and_caps() -> None:
    envd = init.Envd()
    delays = []
    for _ in range(10):
        envd.started = time.monotonic()  # exits at once, so the backoff never resets
        envd.exited(None)
        delays.append(envd.timeout())
    assert delays[0] is not None and delays[0] <= init.BACKOFF_FIRST
    assert all(d is not None and d <= init.BACKOFF_MAX for d in delays)
    assert delays[-1] is not None and delays[-1] > init.BACKOFF_MAX / 2
