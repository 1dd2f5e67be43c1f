"""envd inside a real guest (512 MiB, as the product runs it), driven by the official SDK.

A flood of output must stream through envd without growing it, a memory hog must be what the
guest's OOM killer takes (never envd), and an envd that dies anyway must come back by itself,
still guarding the sandbox with its token. Plus the base template's `python` command.
"""

from __future__ import annotations

import contextlib

import pytest
from e2b import AuthenticationException, CommandExitException, SandboxException

from tests.conftest import RunningSandbox, wait_for

FLOOD = 500 << 20
# What envd may grow by while it streams: its bounded queues and buffers, far below the flood.
ENVD_GROWTH_BOUND_KIB = 64 << 10


def _envd_pid(sbx) -> int:
    """envd starts every command, so it is the parent of the command's shell."""
    return int(sbx.commands.run("echo $PPID", user="root").stdout)


def _status_kib(sbx, pid: int, key: str) -> int:
    line = sbx.commands.run(f"grep '^{key}:' /proc/{pid}/status", user="root").stdout
    return int(line.split()[1])


def _oom_score_adj(sbx, pid: int | str) -> int:
    return int(sbx.commands.run(f"cat /proc/{pid}/oom_score_adj", user="root").stdout)


def _answers(sbx) -> bool:
    try:
        return sbx.commands.run("echo up", timeout=30).stdout == "up\n"
    except SandboxException:
        return False


def test_python_command(sandbox):
    r = sandbox.commands.run("python --version")
    assert r.stdout.startswith("Python 3.")
    assert sandbox.commands.run("python -c 'print(6 * 7)'").stdout == "42\n"


def test_flood_of_output_streams_through_bounded_envd(sandboxes, base_template):
    sbx = sandboxes.start(base_template.id).sdk()
    envd = _envd_pid(sbx)
    peak_before = _status_kib(sbx, envd, "VmHWM")
    received = 0

    def count(chunk: str) -> None:
        nonlocal received
        received += len(chunk)

    r = sbx.commands.run("yes | head -c 500M", retain_output=False, on_stdout=count, timeout=0)
    assert r.exit_code == 0 and received == FLOOD
    assert _envd_pid(sbx) == envd, "envd must have served the whole stream, not been restarted"
    assert _status_kib(sbx, envd, "VmHWM") - peak_before < ENVD_GROWTH_BOUND_KIB

    # A client that stops reading leaves the output in the pipe: envd does not grow either.
    chatty = sbx.commands.run("yes", background=True, timeout=0)
    try:
        for _ in range(5):
            assert sbx.commands.run("echo alive").stdout == "alive\n"
        assert _status_kib(sbx, envd, "VmHWM") - peak_before < ENVD_GROWTH_BOUND_KIB
    finally:
        chatty.kill()


def test_oom_killer_takes_the_hog_not_envd(sandboxes, base_template):
    sbx = sandboxes.start(base_template.id).sdk()
    envd = _envd_pid(sbx)
    assert _oom_score_adj(sbx, envd) == -1000
    assert _oom_score_adj(sbx, "self") == 100
    hog = "python3 -c 'import itertools; [b\"x\" * (1 << 20) for _ in itertools.count()]'"
    with pytest.raises(CommandExitException) as exc:
        sbx.commands.run(hog, timeout=0)
    assert exc.value.exit_code in (-1, 137)  # SIGKILL, seen directly or through the shell
    assert _envd_pid(sbx) == envd
    assert sbx.commands.run("echo alive").stdout == "alive\n"


def test_killed_envd_comes_back_with_its_token(sandboxes, base_template):
    running = sandboxes.start(base_template.id)
    sbx = running.sdk()
    envd = _envd_pid(sbx)
    with contextlib.suppress(SandboxException):  # the stream of this very command dies with envd
        sbx.commands.run(f"kill -9 {envd}", user="root", timeout=30)
    wait_for(lambda: _answers(sbx), timeout=120, interval=1)
    restarted = _envd_pid(sbx)
    assert restarted != envd
    assert _oom_score_adj(sbx, restarted) == -1000
    stranger = RunningSandbox(vm=running.vm, envd_url=running.envd_url, access_token="not-the-token").sdk()
    with pytest.raises(AuthenticationException):
        stranger.commands.run("true")


def test_idle_guest_kernel_has_no_needless_timers(sandbox):
    """Each wakeup of an idle guest costs its host CPU: proactive compaction, the soft-lockup
    watchdog and pressure-stall tracking are off, the vmstat shepherd and the managed neighbour
    probes are rare (the guest kernel's command line)."""
    settings = (
        "/proc/sys/vm/compaction_proactiveness /proc/sys/kernel/watchdog /proc/sys/vm/stat_interval"
        " /proc/sys/net/ipv4/neigh/default/interval_probe_time_ms"
        " /proc/sys/net/ipv6/neigh/default/interval_probe_time_ms"
    )
    values = sandbox.commands.run(f"cat {settings}", user="root").stdout.split()
    assert values == ["0", "0", "10", "3600000", "3600000"]
    assert not sandbox.files.exists("/proc/pressure")


def test_idle_guest_stops_its_tick(sandbox):
    """The guest keeps a high-resolution clocksource, so its idle CPU stops the timer tick: on
    the jiffies, which a guest under TCG fell back to when its boot's clocksource watchdog
    judged the TSC unstable, it takes 250 timer interrupts a second (`tsc=reliable`)."""
    cmdline = sandbox.files.read("/proc/cmdline")
    if "tsc_early_khz=" in cmdline and "tsc=reliable" not in cmdline:
        pytest.skip("under TCG on this host the guest's clocksource watchdog stays (`tcg_clock_options`)")
    clocksource = "/sys/devices/system/clocksource/clocksource0/current_clocksource"
    assert sandbox.files.read(clocksource).strip() in ("tsc", "kvm-clock")
    timers = sandbox.commands.run("cat /proc/timer_list", user="root").stdout
    assert "tick_handle_periodic" not in timers
    assert "hrtimer_interrupt" in timers
